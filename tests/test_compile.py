"""fastrl inside ``torch.compile``: the ``torch.library`` ops, fullgraph tracing, dynamic token counts, no host sync.

* compiled == eager (outputs and gradients, float32, <= 1e-6 relative), ``fullgraph=True``: ``fused_logprobs``
  with bias, softcap, temperature and ignored rows under inductor; ``policy_loss`` for every loss type (one-pass
  and two-pass paths, sequence-level ratios) in one aot_eager graph for the breadth, and one loss under inductor;
  ``value_loss`` under inductor; both Triton implementations (interpreted) under aot_eager. Eager takes the host-sync path (compaction, checks); compiled the no-sync path,
  so this also checks the two paths against each other.
* three batch lengths under ``dynamic=True``: at most one recompile (dynamo's ``unique_graphs`` counter).
* zero graph breaks (``torch._dynamo.explain``).
* ``torch.library.opcheck`` on every fastrl op (schema, fake implementation, autograd registration, AOT dispatch).
* the no-sync path executes no ``aten._local_scalar_dense`` / ``aten.nonzero`` / ``aten.item`` (a dispatch mode
  that records every aten op, inside the fastrl ops too), and the eager default does (so the recorder works).
* bad input on the no-sync path gives NaN, never a finite wrong number; double backward raises a clear error.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastrl
from fastrl import PolicyLossConfig
from fastrl.losses import one_pass, value  # noqa: F401  (importing a module registers its ops)
from fastrl.ops import custom_ops, linear_logprob, live
from fastrl.reference import value_loss_reference

B, T, H, V = 3, 6, 16, 67
TF = dict(temperature=0.7, softcap=4.0)  # every compiled case runs a non-unit temperature and a softcap
REL = 1e-6
ALL_LOSSES = (
    PolicyLossConfig(loss_type="grpo", temperature=0.7),
    PolicyLossConfig(loss_type="bnpo", temperature=0.7, beta=0.04, kl_estimator="k1"),
    PolicyLossConfig(loss_type="dr_grpo", temperature=0.7, max_completion_length=T),
    PolicyLossConfig(loss_type="dapo", temperature=0.7, beta=0.04, entropy_coef=0.01, delta=2.0),
    PolicyLossConfig(loss_type="cispo", temperature=0.7, epsilon_high=1.2),
    PolicyLossConfig(loss_type="sapo", temperature=0.7),
    PolicyLossConfig(loss_type="luspo", temperature=0.7),
    PolicyLossConfig(loss_type="vespo", temperature=0.7),  # sequence-coupled: whole-sequence chunks
    PolicyLossConfig(loss_type="grpo", temperature=0.7, importance_sampling_level="sequence"),  # GSPO
    PolicyLossConfig(loss_type="dapo", temperature=0.7, top_entropy_quantile=0.5),  # two-pass path
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def inputs(b=B, t=T, seed=0, nan_padding=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, H, generator=g).requires_grad_()
    w = (0.5 * torch.randn(V, H, generator=g)).requires_grad_()
    bias = (0.1 * torch.randn(V, generator=g)).requires_grad_()
    targets = torch.randint(0, V, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, t // 2:] = False  # a completion that ended early: ignored rows
    mask[-1, 1:] = False
    if nan_padding:
        with torch.no_grad():
            h[0, -1] = float("nan")  # what an ignored row holds must not reach a gradient
    old = -3.0 + 0.3 * torch.randn(b, t, generator=g)
    ref = old + 0.2 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g)
    return dict(h=h, w=w, bias=bias, targets=targets, mask=mask, old=old, ref=ref, adv=adv)


def logprob_fn(h, w, bias, targets, mask):
    lp, ent = fastrl.fused_logprobs(h, w, torch.where(mask, targets, -100), bias=bias, backend="torch", **TF)
    return lp.sum() + 0.3 * ent.sum(), lp, ent


def losses_fn(configs):
    def fn(h, w, bias, targets, mask, old, ref, adv, num_items=None):
        return tuple(fastrl.policy_loss(h, w, targets, adv, mask, config=c, old_logprobs=old, ref_logprobs=ref,
                                        bias=bias, softcap=TF["softcap"], backend="torch", chunk_tokens=8,
                                        num_items_in_batch=num_items)[0]
                     for c in configs)
    return fn


def check_outputs_and_grads(compiled, eager, x, args):
    leaves = (x["h"], x["w"], x["bias"])
    got, want = compiled(*args), eager(*args)
    assert len(got) == len(want)
    for i, (g, e) in enumerate(zip(got, want)):
        assert rel(g, e) <= REL, f"output {i}: compiled {g} vs eager {e}"
    for i, g in enumerate(got):
        if not g.requires_grad:
            continue
        # a fresh forward per output: a compiled backward runs once per graph (donated buffers)
        gg = torch.autograd.grad(compiled(*args)[i].sum(), leaves)
        ge = torch.autograd.grad(eager(*args)[i].sum(), leaves)
        for name, a, b in zip(("hidden", "weight", "bias"), gg, ge):
            assert torch.isfinite(a).all(), f"output {i}: non-finite compiled grad of {name}"
            assert rel(a, b) <= REL, f"output {i}: grad of {name} differs by {rel(a, b):.2e}"


def test_fused_logprobs_inductor_fullgraph_dynamic():
    """compiled == eager, and three token counts under dynamic=True with at most one recompile."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(logprob_fn, fullgraph=True, dynamic=True)
    for b, t in ((B, T), (B + 1, T + 3), (B + 2, T - 2)):
        x = inputs(b, t, seed=b)
        check_outputs_and_grads(compiled, logprob_fn, x, (x["h"], x["w"], x["bias"], x["targets"], x["mask"]))
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # the first graph + one recompile


def test_every_loss_type_compiled_equals_eager():
    """All loss types (one-pass, sequence-coupled and two-pass paths) in one fullgraph aot_eager graph."""
    torch._dynamo.reset()
    fn = losses_fn(ALL_LOSSES)
    x = inputs()
    args = (x["h"], x["w"], x["bias"], x["targets"], x["mask"], x["old"], x["ref"], x["adv"])
    check_outputs_and_grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), fn, x, args)


def test_policy_loss_inductor_dynamic_batch_lengths():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    fn = losses_fn((ALL_LOSSES[3],))
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for t in (T, T + 4, T + 9):
        x = inputs(B, t, seed=t)
        # num_items_in_batch as a Python int that changes every step, as TRL passes it (dapo divides by it)
        args = (x["h"], x["w"], x["bias"], x["targets"], x["mask"], x["old"], x["ref"], x["adv"], t * B - 1)
        check_outputs_and_grads(compiled, fn, x, args)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ("triton-hybrid", "triton-fused"))
def test_triton_backends_compiled_equal_eager(backend):
    """The Triton kernels (interpreted on CPU) inside the compiled ops, no-sync path included (NaN padding rows)."""
    torch._dynamo.reset()

    def fn(h, w, bias, targets, mask, old, ref, adv):
        lp, ent = fastrl.fused_logprobs(h, w, torch.where(mask, targets, -100), bias=bias, backend=backend, **TF)
        loss, _ = fastrl.policy_loss(h, w, targets, adv, mask, config=ALL_LOSSES[3], old_logprobs=old,
                                     ref_logprobs=ref, bias=bias, softcap=TF["softcap"], backend=backend,
                                     chunk_tokens=8)
        return lp.sum() + 0.3 * ent.sum(), loss

    x = inputs()
    args = (x["h"], x["w"], x["bias"], x["targets"], x["mask"], x["old"], x["ref"], x["adv"])
    check_outputs_and_grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), fn, x, args)


def value_fn(v, old, ret, mask):
    loss, m = fastrl.value_loss(v, old, ret, mask, 0.2)
    return loss, m["val/clipfrac_avg"]


def test_value_loss_compiled_equals_reference():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    v = torch.randn(B, T, generator=g, requires_grad=True)
    old, ret = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    (loss, clipfrac) = torch.compile(value_fn, fullgraph=True)(v, old, ret, mask)
    want, wm = value_loss_reference(v, old, ret, mask, 0.2)
    assert rel(loss, want) <= REL and rel(clipfrac, wm["val/clipfrac_avg"]) <= REL
    assert rel(torch.autograd.grad(loss, v)[0], torch.autograd.grad(want, v)[0]) <= REL


def test_no_graph_breaks():
    x = inputs()
    cases = [
        (logprob_fn, (x["h"], x["w"], x["bias"], x["targets"], x["mask"])),
        (losses_fn((ALL_LOSSES[3], ALL_LOSSES[7], ALL_LOSSES[9])),
         (x["h"], x["w"], x["bias"], x["targets"], x["mask"], x["old"], x["ref"], x["adv"])),
        (value_fn, (x["old"].clone().requires_grad_(), x["old"], x["ref"], x["mask"])),
    ]
    for fn, args in cases:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(*args)
        assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
        assert explained.graph_count == 1


# ------------------------------------------------------------------------------------------------- opcheck


def _opcheck_cases():
    x = inputs(2, 4, nan_padding=False)
    h = x["h"].detach().reshape(-1, H).clone().requires_grad_()
    t = torch.where(x["mask"].reshape(-1), x["targets"].reshape(-1), -100)
    w, bias = x["w"].detach().clone().requires_grad_(), x["bias"].detach().clone().requires_grad_()
    lin = linear_logprob.LinearOptions(temperature=0.7, softcap=4.0, all_live=False).pack()
    lin_no_ent = linear_logprob.LinearOptions(with_entropy=False).pack()
    N = h.shape[0]
    lse = torch.randn(N)
    cfg = PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01, temperature=0.7)
    pol = one_pass.PolicyOptions(softcap=4.0, need_bias=True, compact=False, chunk_rows=3,
                                n_metrics=len(one_pass.metric_names(cfg))).pack(cfg)
    cfg_exact = PolicyLossConfig(loss_type="grpo", beta=0.04, kl_estimator="exact", temperature=0.7)
    pol_exact = one_pass.PolicyOptions(softcap=4.0, need_bias=True, compact=False, chunk_rows=3,
                                      n_metrics=len(one_pass.metric_names(cfg_exact))).pack(cfg_exact)
    kl = torch.rand(2, 4, requires_grad=True)  # the exact KL enters as an input with its own gradient
    eff = torch.where(x["mask"], x["targets"], -100)
    v = torch.randn(2, 4, requires_grad=True)
    return {
        "linear_logprob": (torch.ops.fastrl.linear_logprob, (h, w, bias, t, *lin)),
        "linear_logprob_no_entropy": (torch.ops.fastrl.linear_logprob, (h, w, None, t.clamp(min=0), *lin_no_ent)),
        "linear_logprob_backward": (torch.ops.fastrl.linear_logprob_backward,
                                    (torch.randn(N), torch.randn(N), h.detach(), w.detach(), bias.detach(), t,
                                     lse, torch.rand(N), *lin, True, True, True)),
        "policy_loss_one_pass": (torch.ops.fastrl.policy_loss_one_pass,
                                 (x["h"].detach().requires_grad_(), w, bias, eff, x["adv"], x["mask"], x["old"],
                                  x["ref"], None, None, None, None, None, None, None, None, None, [], *pol)),
        "policy_loss_one_pass_exact_kl": (torch.ops.fastrl.policy_loss_one_pass,
                                          (x["h"].detach().requires_grad_(), w, bias, eff, x["adv"], x["mask"],
                                           x["old"], None, None, None, None, kl, None, None, None, None, None, [],
                                           *pol_exact)),
        "value_loss": (torch.ops.fastrl.value_loss, (v, torch.randn(2, 4), torch.randn(2, 4), x["mask"], 0.2)),
        "value_loss_backward": (torch.ops.fastrl.value_loss_backward,
                                (torch.tensor(1.0), v.detach(), torch.randn(2, 4), torch.randn(2, 4), x["mask"], 0.2)),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)


def test_every_fastrl_op_is_opchecked():
    import fastrl.ops.divergence  # noqa: F401  (registers fastrl::divergence*, opchecked in its own file)
    import fastrl.ops.kept_rules  # noqa: F401  (registers fastrl::kept_logprob*, replay_rule: test_compile_supports.py)
    from test_compile_divergence import OPCHECKED
    from test_compile_supports import OPCHECKED as SUPPORT_OPS

    ops = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fastrl::")}
    checked = ({n.replace("_no_entropy", "").replace("_exact_kl", "") for n in _opcheck_cases()} | set(OPCHECKED)
               | set(SUPPORT_OPS))
    assert ops == checked, f"fastrl ops without an opcheck case: {ops - checked}"


# ------------------------------------------------------------------------------------------------- no host sync

# reads of device values on the host, and ops whose output shape depends on the data (a host sync on CUDA)
SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.is_nonzero", "aten._unique2", "aten._unique",
            "aten.unique_dim", "aten.unique_consecutive", "aten.masked_select")


class RecordOps(TorchDispatchMode):
    """Records every aten op executed, inside fastrl's custom ops too (their Python bodies run under the mode)."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops.add(name)
        if name.startswith("fastrl."):
            with self:  # run the op's implementation under this mode, so its aten ops are recorded as well
                return custom_ops.IMPLEMENTATIONS[func._schema.name](*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _run_everything(host_sync):
    x = inputs()
    dapo = PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01, temperature=0.7)
    for cfg in (dapo, ALL_LOSSES[7], ALL_LOSSES[9]):
        loss, metrics = fastrl.policy_loss(x["h"], x["w"], x["targets"], x["adv"], x["mask"], config=cfg,
                                           old_logprobs=x["old"], ref_logprobs=x["ref"], bias=x["bias"],
                                           backend="torch", chunk_tokens=8, host_sync=host_sync,
                                           check_finite=False)
        loss.backward()
    lp, ent = fastrl.fused_logprobs(x["h"], x["w"], torch.where(x["mask"], x["targets"], -100), bias=x["bias"],
                                    backend="torch", host_sync=host_sync, check_finite=False, **TF)
    (lp.sum() + ent.sum()).backward()
    v = x["old"].clone().requires_grad_()
    fastrl.value_loss(v, x["old"], x["ref"], x["mask"], 0.2)[0].backward()
    return torch.isfinite(x["w"].grad).all()


def test_no_sync_path_executes_no_host_read(monkeypatch):
    # as on a device: CPU rows' live count is read from host memory (no synchronisation) to skip the masked rows
    # (fastrl.ops.live, tests/test_masked_rows.py); a device's is never read
    monkeypatch.setattr(live, "count_readable", lambda device: False)
    with RecordOps() as rec:
        finite = _run_everything(host_sync=False)
    assert finite  # (read after the recording: bool() of a tensor is itself a host read)
    assert "fastrl.policy_loss_one_pass" in rec.ops and "aten.mm" in rec.ops  # the recorder sees inside the ops
    assert not set(SYNC_OPS) & rec.ops, f"host reads on the no-sync path: {set(SYNC_OPS) & rec.ops}"
    with RecordOps() as rec:
        _run_everything(host_sync=None)  # eager default: compaction and checks read the host
    assert {"aten._local_scalar_dense", "aten.nonzero"} <= rec.ops


def test_no_sync_bad_input_is_nan_not_wrong():
    x = inputs()
    targets = torch.where(x["mask"], x["targets"], -100)
    targets[1, 2] = V + 5  # out of range: eager raises, no-sync poisons that token
    lp, ent = fastrl.fused_logprobs(x["h"], x["w"], targets, bias=x["bias"], backend="torch", host_sync=False)
    assert torch.isnan(lp[1, 2]) and torch.isnan(ent[1, 2])
    assert torch.isfinite(lp[x["mask"]][:5]).all()
    with pytest.raises(ValueError, match="target id out of range"):
        fastrl.fused_logprobs(x["h"], x["w"], targets, bias=x["bias"], backend="torch")
    cfg = PolicyLossConfig(loss_type="dapo", temperature=0.7)
    for bad in ("mask", "targets"):
        m, t = x["mask"].float(), x["targets"].clone()
        if bad == "mask":
            m[1, 1] = 0.5  # a weight, not a selection
        else:
            t[1, 1] = -7
        loss, _ = fastrl.policy_loss(x["h"], x["w"], t, x["adv"], m, config=cfg, old_logprobs=x["old"],
                                     backend="torch", host_sync=False)
        assert torch.isnan(loss), bad
        loss.backward()
        assert torch.isnan(x["w"].grad).all(), bad
        x["w"].grad = None


# ------------------------------------------------------------------------------------------------- double backward


def test_double_backward_names_itself():
    x = inputs()
    lp, _ = fastrl.fused_logprobs(x["h"], x["w"], torch.where(x["mask"], x["targets"], -100), backend="torch")
    with pytest.raises(custom_ops.DoubleBackwardError, match=r"fastrl.fused_logprobs does not support double backward"):
        torch.autograd.grad(lp.sum(), x["h"], create_graph=True)
    for cfg in (ALL_LOSSES[3], ALL_LOSSES[9]):  # one-pass, two-pass
        loss, _ = fastrl.policy_loss(x["h"], x["w"], x["targets"], x["adv"], x["mask"], config=cfg,
                                     old_logprobs=x["old"], ref_logprobs=x["ref"], backend="torch")
        with pytest.raises(RuntimeError, match=r"does not support double backward \(create_graph=True\)"):
            torch.autograd.grad(loss, x["h"], create_graph=True)
    v = x["old"].clone().requires_grad_()
    with pytest.raises(custom_ops.DoubleBackwardError, match="fastrl.value_loss"):
        torch.autograd.grad(fastrl.value_loss(v, x["old"], x["ref"], x["mask"], 0.2)[0], v, create_graph=True)
