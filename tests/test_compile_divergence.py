"""``fastrl.fused_divergence`` inside ``torch.compile``: the ``fastrl::divergence`` / ``fastrl::divergence_backward`` ops.

* compiled == eager (outputs and the student's gradients, float32, <= 1e-6 relative), ``fullgraph=True``, for
  beta in {0, 0.5, 1} with biases, softcaps, logit scales, a temperature, a mask and NaN in masked rows: all three
  in one aot_eager graph, beta=0.5 under inductor with ``dynamic=True`` over three token counts (at most one
  recompile), with a ``KeptSet`` support, and on the Triton hybrid backend (interpreted). Eager drops masked rows before the op (host sync); compiled, the op
  computes every row with the mask inside it: so this also checks the two paths against each other.
* zero graph breaks (``torch._dynamo.explain``), with and without a support.
* ``torch.library.opcheck`` on both ops, with and without a support (host plan and fixed plan) and a mask.
* the op's no-sync path reads nothing on the host, with and without a support (every aten op recorded, inside the
  op too).
* double backward raises ``DoubleBackwardError``.
"""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl import KeptSet
from fastrl.ops import divergence as D
from fastrl.ops import kept, live
from fastrl.ops.custom_ops import DoubleBackwardError

B, T, H, HT, V = 3, 6, 16, 12, 67
TF = dict(temperature=0.7, logit_scale=1.2, softcap=4.0, teacher_logit_scale=0.9, teacher_softcap=5.0)
BETAS = (0.0, 0.5, 1.0)
REL = 1e-6
OPCHECKED = ("divergence", "divergence_backward")  # read by test_compile.test_every_fastrl_op_is_opchecked


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def inputs(b=B, t=T, seed=0, k=None, empty_masked=True):
    g = torch.Generator().manual_seed(seed)
    x = dict(
        h=torch.randn(b, t, H, generator=g).requires_grad_(),
        w=(0.5 * torch.randn(V, H, generator=g)).requires_grad_(),
        bias=(0.1 * torch.randn(V, generator=g)).requires_grad_(),
        th=torch.randn(b, t, HT, generator=g),
        tw=0.5 * torch.randn(V, HT, generator=g),
        tb=0.1 * torch.randn(V, generator=g),
    )
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, t // 2:] = False  # a completion that ended early
    mask[-1, 1:] = False
    with torch.no_grad():  # what a masked row holds must reach neither an output nor a gradient
        x["h"][0, -1] = float("nan")
        x["th"][-1, -1] = float("nan")
    x["mask"] = mask
    if k is not None:  # k kept ids per token (masked tokens keep none: allowed)
        ids = torch.rand(b * t, V, generator=g).argsort(1)[:, :k]
        if empty_masked:
            ids[~mask.reshape(-1)] = -1
        x["support"] = KeptSet.from_padded(ids.reshape(b, t, k), V)
    return x


def divergence_fn(betas, with_support=False):
    def fn(h, w, bias, th, tw, tb, mask, support=None):
        out = []
        for beta in betas:
            div, ent = fastrl.fused_divergence(h, w, th, tw, beta=beta, bias=bias, teacher_bias=tb, mask=mask,
                                               with_entropy=True, backend="torch", support=support, **TF)
            out += [div, ent]
        return tuple(out)
    return fn


def args_of(x):
    return (x["h"], x["w"], x["bias"], x["th"], x["tw"], x["tb"], x["mask"]) + (
        (x["support"],) if "support" in x else ())


def check_outputs_and_grads(compiled, eager, x):
    args = args_of(x)
    leaves = (x["h"], x["w"], x["bias"])
    got, want = compiled(*args), eager(*args)
    assert len(got) == len(want)
    for i, (g, e) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all() and (g[~x["mask"]] == 0).all(), f"output {i}"
        assert rel(g, e) <= REL, f"output {i}: differs by {rel(g, e):.2e}"
    for i in range(len(got)):
        # a fresh forward per output (a compiled backward runs once per graph), weighted per token
        r = torch.rand(x["mask"].shape, generator=torch.Generator().manual_seed(i)) + 0.5
        gg = torch.autograd.grad((compiled(*args)[i] * r).sum(), leaves)
        ge = torch.autograd.grad((eager(*args)[i] * r).sum(), leaves)
        for name, a, b in zip(("hidden", "weight", "bias"), gg, ge):
            assert torch.isfinite(a).all(), f"output {i}: non-finite compiled grad of {name}"
            assert rel(a, b) <= REL, f"output {i}: grad of {name} differs by {rel(a, b):.2e}"
        assert (gg[0][~x["mask"]] == 0).all(), f"output {i}: gradient at a masked row"


def test_every_beta_compiled_equals_eager():
    torch._dynamo.reset()
    fn = divergence_fn(BETAS)
    check_outputs_and_grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), fn, inputs())


def test_support_compiled_equals_eager():
    """A KeptSet crosses the op as (ids, offsets): fullgraph, forward and backward on the fixed plan (compiled) against
    the host plan (eager)."""
    torch._dynamo.reset()
    fn = divergence_fn((0.0, 0.5))
    check_outputs_and_grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), fn, inputs(k=9))


def test_inductor_dynamic_token_counts():
    """beta=0.5 under inductor, three token counts under dynamic=True, at most one recompile."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    fn = divergence_fn((0.5,))
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for b, t in ((B, T), (B + 1, T + 3), (B + 2, T - 2)):
        check_outputs_and_grads(compiled, fn, inputs(b, t, seed=b))
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # the first graph + one recompile


@pytest.mark.interpreter
def test_triton_backend_compiled_equals_eager(monkeypatch):
    """The hybrid Triton kernels (interpreted) inside the compiled op, masked rows (NaN) computed with the mask."""
    from fastrl.kernels import divergence_fold as K
    from fastrl.ops import divergence_hybrid, hybrid

    monkeypatch.setattr(divergence_hybrid, "COLUMNS", 256)
    monkeypatch.setattr(K, "BLOCK_C", 128)
    monkeypatch.setattr(hybrid, "ROWS", 16)
    monkeypatch.setattr(hybrid, "MAX_ROWS", 16)
    torch._dynamo.reset()

    def fn(h, w, bias, th, tw, tb, mask):
        div, ent = fastrl.fused_divergence(h, w, th, tw, beta=0.5, bias=bias, teacher_bias=tb, mask=mask,
                                           with_entropy=True, backend="triton-hybrid", **TF)
        return div, ent

    check_outputs_and_grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), fn, inputs())


@pytest.mark.parametrize("k", (None, 9))
def test_no_graph_breaks(k):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(divergence_fn(BETAS))(*args_of(inputs(k=k)))
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1


# ------------------------------------------------------------------------------------------------- the ops


def _op_args(k=None, masked=True, beta=0.5, fixed=False):
    x = inputs(2, 4, k=k, empty_masked=masked)
    with torch.no_grad():  # opcheck compares runs: no NaN
        x["h"].nan_to_num_(0.0)
        x["th"].nan_to_num_(0.0)
    h = x["h"].detach().reshape(-1, H).clone().requires_grad_()
    ht = x["th"].reshape(-1, HT)
    active = x["mask"].reshape(-1) if masked else None
    s = x.get("support")
    tf = {key: v for key, v in TF.items() if key != "temperature"}
    opts = D.DivergenceOptions(beta=beta, temperature=TF["temperature"], with_entropy=True, tile_elems=64, cap=12,
                               **tf).pack()
    plan = [] if s is None or fixed else kept.plan_for(s, True, h.device)
    fwd = (h, x["w"], x["bias"], ht, x["tw"], x["tb"], active, None if s is None else s.ids,
           None if s is None else s.offsets, plan, *opts)
    return fwd


def _opcheck_cases():
    cases = {}
    for k, fixed in ((None, False), (9, False), (9, True)):
        for masked in (True, False):
            fwd = _op_args(k, masked, fixed=fixed)
            name = f"support={k is not None},fixed={fixed},mask={masked}"
            cases[f"divergence[{name}]"] = (torch.ops.fastrl.divergence, fwd)
            with torch.no_grad():
                _, ent, lse_s, lse_t, aux, entries = torch.ops.fastrl.divergence(*fwd)
            N = fwd[0].shape[0]
            h, w, bias = (t.detach() for t in fwd[:3])
            cases[f"divergence_backward[{name}]"] = (
                torch.ops.fastrl.divergence_backward,
                (torch.randn(N), torch.randn(N), h, w, bias, *fwd[3:10], lse_s, lse_t, aux, ent, entries, *fwd[10:],
                 True, True, True))
    return cases


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("k", (None, 9))
def test_masked_op_reads_nothing_on_the_host(k, monkeypatch):
    from test_compile import SYNC_OPS, RecordOps

    # as on a device: CPU rows' live count is read from host memory (no synchronisation, fastrl.ops.live)
    monkeypatch.setattr(live, "count_readable", lambda device: False)
    fwd = _op_args(k=k, masked=True, fixed=True)
    with RecordOps() as rec:
        div, ent, *_ = torch.ops.fastrl.divergence(*fwd)
        (div.sum() + ent.sum()).backward()
    assert {"fastrl.divergence", "fastrl.divergence_backward", "aten.mm"} <= rec.ops
    assert not set(SYNC_OPS) & rec.ops, f"host reads on the compiled path: {set(SYNC_OPS) & rec.ops}"


def test_empty_support_at_counted_token():
    """Eager names the token; the no-sync path (no host read, so no exception) gives NaN there, finite elsewhere."""
    x = inputs(2, 4, k=5)
    ids = x["support"].padded()
    ids[0, 1:] = -1
    ids[1] = -1  # token 1 keeps nothing, and counts
    s = KeptSet.from_padded(ids, V)
    with pytest.raises(ValueError, match=r"support is empty at counted token \(0, 1\)"):
        fastrl.fused_divergence(x["h"], x["w"], x["th"], x["tw"], mask=x["mask"], support=s, check_finite=False)
    div = fastrl.fused_divergence(x["h"], x["w"], x["th"], x["tw"], mask=x["mask"], support=s, host_sync=False)
    assert torch.isnan(div[0, 1]) and torch.isfinite(div[0, 0]) and (div[~x["mask"]] == 0).all()


def test_double_backward_raises():
    x = inputs()
    for k in (None, 5):
        kw = {} if k is None else {"support": inputs(k=k)["support"]}
        div = fastrl.fused_divergence(x["h"], x["w"], x["th"], x["tw"], beta=0.5, mask=x["mask"], **kw)
        with pytest.raises(DoubleBackwardError, match=r"fastrl.fused_divergence does not support double backward"):
            torch.autograd.grad(div.sum(), x["h"], create_graph=True)


def test_policy_loss_exact_kl_traces_whole():
    """policy_loss(kl_estimator="exact") reaches fused_divergence: now one graph, compiled == eager."""
    torch._dynamo.reset()
    x = inputs()
    g = torch.Generator().manual_seed(3)
    targets = torch.randint(0, V, (B, T), generator=g)
    old, adv = -3.0 + 0.3 * torch.randn(B, T, generator=g), torch.randn(B, generator=g)
    ref_h = torch.randn(B, T, H, generator=g)
    cfg = fastrl.PolicyLossConfig(loss_type="grpo", beta=0.04, kl_estimator="exact", temperature=0.7)

    def fn(h, w, bias):
        return (fastrl.policy_loss(h, w, targets, adv, x["mask"], config=cfg, old_logprobs=old, bias=bias,
                                   ref_hidden=ref_h, ref_weight=x["w"].detach() + 0.1, ref_bias=x["tb"],
                                   backend="torch")[0],)

    args = (x["h"], x["w"], x["bias"])  # NaN in a masked row of hidden
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    (got,), (want,) = compiled(*args), fn(*args)
    assert rel(got, want) <= REL
    for a, b in zip(torch.autograd.grad(compiled(*args)[0], args), torch.autograd.grad(fn(*args)[0], args)):
        assert torch.isfinite(a).all() and rel(a, b) <= REL
