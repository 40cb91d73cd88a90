"""Supports (``KeptSet``, ``SamplerRule``) inside ``torch.compile`` and on the no-sync path: one kept-set engine,
as ops.

* compiled == eager (outputs and gradients, float32, <= 4e-6 relative), ``fullgraph=True`` under inductor with
  ``dynamic=True`` over three token counts (at most one recompile), for ``fused_logprobs(support=KeptSet)``,
  ``fused_logprobs(support=SamplerRule)``, ``policy_loss(support=KeptSet)`` (k3, and the exact KL over the support,
  with a sequence-level ratio) and ``fused_divergence(support=KeptSet)``. Eager runs the engine's host plan
  (ignored rows dropped first), compiled the fixed plan (every row, no host read): so this also checks the two plans
  against each other (to 4e-6: they sum in different orders).
* zero graph breaks (``torch._dynamo.explain``); a rule's replay is an op whose output size depends on the data, which
  dynamo captures under ``fullgraph=True`` (or ``capture_dynamic_output_shape_ops``).
* ``host_sync=False`` with a KeptSet on every function executes no host read (every aten op recorded, inside the
  ops too) and equals eager; a rule is refused by name there.
* ``create_graph=True`` raises ``DoubleBackwardError`` on every support path.
* ``torch.library.opcheck`` on ``fastrl::kept_logprob`` (host and fixed plans, live and masked rows), its backward and
  ``fastrl::replay_rule``.
"""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl import KeptSet, PolicyLossConfig, SamplerRule
from fastrl.ops import budget, kept, kept_plan
from fastrl.ops.config import LogitTransform
from fastrl.ops.custom_ops import DoubleBackwardError
from fastrl.ops.kept_rules import RuleOptions

from test_compile import SYNC_OPS, RecordOps, rel

# Eager runs the engine's host plan and the compiled graph (or host_sync=False) its fixed plan, whose units cut a
# token's ids differently, so float32 sums run in another order: both stay within 1.5e-6 (relative to the largest
# entry) of float64 here, and agree to 4e-6. A wrong kernel is off by orders of magnitude more; each plan's accuracy
# against float64 is checked in test_supports.py (no worse than PyTorch's own float32 + 1e-6).
REL = 4e-6

B, T, H, HT, V = 3, 6, 16, 12, 67
TF = dict(temperature=0.7, softcap=4.0)
OPCHECKED = ("kept_logprob", "kept_logprob_backward", "replay_rule")  # read by test_compile's opcheck inventory


@pytest.fixture(autouse=True)
def small_units(monkeypatch):
    """Units of at most 12 ids in 64-element tiles: many units per chunk and chunks split on both plans."""
    monkeypatch.setitem(budget.BUDGETS, "kept", {"cpu": budget.TileBudget(elems=64, live=2, cap=12)})


def inputs(b=B, t=T, seed=0, k=7):
    g = torch.Generator().manual_seed(seed)
    x = dict(
        h=torch.randn(b, t, H, generator=g).requires_grad_(),
        w=(0.5 * torch.randn(V, H, generator=g)).requires_grad_(),
        bias=(0.1 * torch.randn(V, generator=g)).requires_grad_(),
        th=torch.randn(b, t, HT, generator=g),
        tw=0.5 * torch.randn(V, HT, generator=g),
        targets=torch.randint(0, V, (b, t), generator=g),
        adv=torch.randn(b, generator=g),
    )
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, t // 2:] = False  # a completion that ended early
    mask[-1, 1:] = False
    x["mask"] = mask
    with torch.no_grad():  # what a masked row holds must reach nothing
        x["h"][0, -1] = float("nan")
    x["old"] = -3.0 + 0.3 * torch.randn(b, t, generator=g)
    # up to k ids per token, the target among them; masked tokens keep nothing (allowed)
    scores = torch.rand(b * t, V, generator=g)
    scores[torch.arange(b * t), x["targets"].reshape(-1)] = -1.0  # the target first
    ids = scores.argsort(1)[:, :k]
    sizes = torch.randint(1, k + 1, (b * t,), generator=g)
    ids[torch.arange(k)[None, :] >= sizes[:, None]] = -1
    ids[~mask.reshape(-1)] = -1
    x["support"] = KeptSet.from_padded(ids.reshape(b, t, k), V)
    return x


def logprob_fn(h, w, bias, targets, mask, support):
    lp, ent = fastrl.fused_logprobs(h, w, torch.where(mask, targets, -100), bias=bias, support=support, **TF)
    return lp.sum() + 0.3 * ent.sum(), lp, ent


def divergence_fn(h, w, bias, th, tw, mask, support):
    out = []
    for beta in (0.0, 0.5, 1.0):
        div, ent = fastrl.fused_divergence(h, w, th, tw, beta=beta, bias=bias, mask=mask, with_entropy=True,
                                           support=support, **TF)
        out += [div, ent]
    return tuple(out)


CONFIGS = (
    PolicyLossConfig(loss_type="dapo", temperature=0.7, beta=0.04, entropy_coef=0.01),
    PolicyLossConfig(loss_type="grpo", temperature=0.7, beta=0.1, kl_estimator="exact",
                     importance_sampling_level="sequence"),
)


def policy_fn(h, w, bias, targets, mask, old, adv, th, tw, support):
    out = []
    for config in CONFIGS:
        ref = dict(ref_hidden=th, ref_weight=tw) if config.kl_estimator == "exact" else dict(ref_logprobs=old - 0.1)
        loss, metrics = fastrl.policy_loss(h, w, targets, adv, mask, config=config, old_logprobs=old, bias=bias,
                                           softcap=TF["softcap"], support=support, **ref)
        out += [loss, metrics["kl"], metrics["sampling/kept_size_mean"]]
    return tuple(out)


def policy_args(x, support=None):
    return (x["h"], x["w"], x["bias"], x["targets"], x["mask"], x["old"], x["adv"], x["th"], x["tw"],
            x["support"] if support is None else support)


def check(compiled, eager, leaves, args):
    got, want = compiled(*args), eager(*args)
    for i, (g, e) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all() and rel(g, e) <= REL, f"output {i}: differs by {rel(g, e):.2e}"
    for i in range(len(got)):
        if not got[i].requires_grad:
            continue
        r = torch.rand(got[i].shape, generator=torch.Generator().manual_seed(i)) + 0.5
        gg = torch.autograd.grad((compiled(*args)[i] * r).sum(), leaves)
        ge = torch.autograd.grad((eager(*args)[i] * r).sum(), leaves)
        for j, (a, b) in enumerate(zip(gg, ge)):
            assert torch.isfinite(a).all(), f"output {i}: non-finite compiled gradient {j}"
            assert rel(a, b) <= REL, f"output {i}: gradient {j} differs by {rel(a, b):.2e}"


def _dynamic(fn, make_args, leaves_of):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for b, t in ((B, T), (B + 1, T + 3), (B + 2, T - 2)):
        x = inputs(b, t, seed=b)
        check(compiled, fn, leaves_of(x), make_args(x))
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # the first graph + one recompile


def test_keptset_logprobs_inductor_fullgraph_dynamic():
    _dynamic(logprob_fn, lambda x: (x["h"], x["w"], x["bias"], x["targets"], x["mask"], x["support"]),
             lambda x: (x["h"], x["w"], x["bias"]))


def test_rule_logprobs_inductor_fullgraph_dynamic(monkeypatch):
    """The compiled rule path; the replay op hands its kept logits to the kept-set op, which computes none."""
    from fastrl.ops import kept_rows

    def computed(*a, **k):
        raise AssertionError("the kept-set engine computed logits the replay had handed it")

    monkeypatch.setattr(kept_rows, "rows_logits", computed)
    monkeypatch.setattr(kept, "unit_logits", computed)
    rule = SamplerRule(top_k=9, top_p=0.9, min_p=0.01, min_tokens=2, stop_token_ids=(1, 3))
    _dynamic(logprob_fn, lambda x: (x["h"], x["w"], x["bias"], x["targets"], x["mask"], rule),
             lambda x: (x["h"], x["w"], x["bias"]))


def test_keptset_policy_loss_inductor_fullgraph_dynamic():
    """The one-pass op on the kept-set engine (k3 and the exact KL over the support) under inductor."""
    _dynamic(policy_fn, policy_args, lambda x: (x["h"], x["w"], x["bias"]))


def test_keptset_divergence_inductor_fullgraph_dynamic():
    _dynamic(divergence_fn, lambda x: (x["h"], x["w"], x["bias"], x["th"], x["tw"], x["mask"], x["support"]),
             lambda x: (x["h"], x["w"], x["bias"]))


def _graph_cases(x):
    rule = SamplerRule(top_k=9, top_p=0.9)
    return {
        "logprobs/keptset": (logprob_fn, (x["h"], x["w"], x["bias"], x["targets"], x["mask"], x["support"])),
        "logprobs/rule": (logprob_fn, (x["h"], x["w"], x["bias"], x["targets"], x["mask"], rule)),
        "divergence/keptset": (divergence_fn, (x["h"], x["w"], x["bias"], x["th"], x["tw"], x["mask"], x["support"])),
        "policy_loss/keptset": (policy_fn, policy_args(x)),
        "policy_loss/rule": (policy_fn, policy_args(x, rule)),
    }


@pytest.mark.parametrize("case", list(_graph_cases(inputs())))
def test_no_graph_breaks(case):
    fn, args = _graph_cases(inputs())[case]
    torch._dynamo.reset()
    # a rule's replay has a data-dependent output size: dynamo captures it under fullgraph=True, or with this flag
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1


# ------------------------------------------------------------------------------------------------- no host sync


def _no_sync_runs(x, host_sync):
    """Every function with a KeptSet, forward + backward; returns the outputs and the gradients of hidden."""
    outs = []
    t = torch.where(x["mask"], x["targets"], -100)
    lp, ent = fastrl.fused_logprobs(x["h"], x["w"], t, bias=x["bias"], support=x["support"], host_sync=host_sync,
                                    check_finite=False, **TF)
    (gh,) = torch.autograd.grad(lp.sum() + ent.sum(), x["h"])
    outs += [lp, ent, gh]
    div = fastrl.fused_divergence(x["h"], x["w"], x["th"], x["tw"], beta=0.5, mask=x["mask"], support=x["support"],
                                  host_sync=host_sync, check_finite=False, **TF)
    (gh,) = torch.autograd.grad(div.sum(), x["h"])
    outs += [div, gh]
    for config in CONFIGS:
        ref = dict(ref_hidden=x["th"], ref_weight=x["tw"]) if config.kl_estimator == "exact" else {}
        loss, _ = fastrl.policy_loss(x["h"], x["w"], x["targets"], x["adv"], x["mask"], config=config,
                                     old_logprobs=x["old"], ref_logprobs=None if ref else x["old"] - 0.1,
                                     support=x["support"], host_sync=host_sync, check_finite=False, **ref)
        (gh,) = torch.autograd.grad(loss, x["h"])
        outs += [loss, gh]
    return outs


def test_keptset_no_sync_reads_nothing_and_equals_eager(monkeypatch):
    x = inputs()  # (building a KeptSet validates it on the host)
    # as under CUDA graph capture: the per-row plan then reads nothing, not even the bucket counts it reads otherwise
    # as the op runs (tests/test_kept_ragged.py)
    monkeypatch.setattr(kept_plan, "_capturing", lambda device: True)
    with RecordOps() as rec:
        got = _no_sync_runs(x, host_sync=False)
    finite = all(bool(torch.isfinite(o).all()) for o in got)  # (read after the recording: a host read itself)
    # the products ran inside the ops: the per-row plan's batched products (issue 34; the union plans' are aten.mm)
    assert {"fastrl.kept_logprob", "fastrl.kept_logprob_backward", "fastrl.divergence", "fastrl.policy_loss_one_pass",
            "aten.bmm"} <= rec.ops
    assert not set(SYNC_OPS) & rec.ops, f"host reads on the no-sync path: {set(SYNC_OPS) & rec.ops}"
    assert finite
    with RecordOps() as rec:
        want = _no_sync_runs(x, host_sync=None)  # eager: compaction, checks and the host plan read the host
    assert {"aten._local_scalar_dense", "aten._unique2"} & rec.ops
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel(a, b) <= REL, f"output {i}: the no-sync path differs from eager by {rel(a, b):.2e}"


def test_no_sync_bad_support_is_nan_not_wrong():
    """Eager names the token; the no-sync path cannot raise, so the bad tokens' log-prob and entropy are NaN."""
    x = inputs()
    t = torch.where(x["mask"], x["targets"], -100).reshape(-1)
    ids = x["support"].padded()
    ids[2] = -1  # counted token 2 keeps nothing
    ids[6] = -1
    ids[6, 0] = (t[6] + 1) % V  # counted token 6's set lacks its target
    ks = KeptSet.from_padded(ids, V)
    h = x["h"].reshape(-1, H)
    with pytest.raises(ValueError, match=r"support is empty at counted token 2"):
        fastrl.fused_logprobs(h, x["w"], t, support=ks)
    lp, ent = fastrl.fused_logprobs(h, x["w"], t, support=ks, host_sync=False)
    bad = torch.zeros_like(t, dtype=torch.bool)
    bad[[2, 6]] = True
    assert torch.isnan(lp[bad]).all() and torch.isnan(ent[bad]).all()
    live = t != -100
    assert torch.isfinite(lp[live & ~bad]).all() and (lp[~live] == 0).all() and (ent[~live] == 0).all()


def test_rule_with_host_sync_false_is_refused_by_name():
    x = inputs()
    with pytest.raises(ValueError, match=r"support=SamplerRule cannot run with host_sync=False.*fastrl.replay_rule"):
        fastrl.fused_logprobs(x["h"], x["w"], x["targets"], support=SamplerRule(top_k=5), host_sync=False)


# ------------------------------------------------------------------------------------------------- double backward


def test_double_backward_raises_with_supports():
    x = inputs()
    t = torch.where(x["mask"], x["targets"], -100)
    for support in (x["support"], SamplerRule(top_k=9)):
        lp, _ = fastrl.fused_logprobs(x["h"], x["w"], t, support=support, **TF)
        with pytest.raises(DoubleBackwardError, match=r"fastrl.fused_logprobs \(support=\) does not support double"):
            torch.autograd.grad(lp.sum(), x["h"], create_graph=True)
    div = fastrl.fused_divergence(x["h"], x["w"], x["th"], x["tw"], mask=x["mask"], support=x["support"])
    with pytest.raises(DoubleBackwardError, match=r"fastrl.fused_divergence does not support double backward"):
        torch.autograd.grad(div.sum(), x["h"], create_graph=True)
    for support in (x["support"], SamplerRule(top_k=9)):
        for loss in policy_fn(*policy_args(x, support))[::3]:
            with pytest.raises(DoubleBackwardError, match=r"fastrl.policy_loss does not support double backward"):
                torch.autograd.grad(loss, x["h"], create_graph=True)


# ------------------------------------------------------------------------------------------------- the ops


def _opcheck_cases():
    x = inputs(2, 4)
    with torch.no_grad():
        x["h"].nan_to_num_(0.0)  # opcheck compares runs: no NaN
    h = x["h"].detach().reshape(-1, H).clone().requires_grad_()
    w, bias = x["w"].detach().clone().requires_grad_(), x["bias"].detach().clone().requires_grad_()
    t = torch.where(x["mask"].reshape(-1), x["targets"].reshape(-1), -100)
    ks = x["support"]
    live = (t != -100).nonzero().squeeze(1)
    cases = {}
    for name, rows, all_live, fixed in (("host", live, True, False), ("fixed", None, False, True),
                                        ("fixed_live", live, True, True)):
        hh = h if rows is None else h.detach()[rows].clone().requires_grad_()
        tt, kk = (t, ks) if rows is None else (t[rows], ks[rows])
        o = kept.KeptOptions(temperature=0.7, softcap=4.0, all_live=all_live, tile_elems=64, cap=12)
        plan = [] if fixed else kept.plan_for(kk, True, hh.device)
        fwd = (hh, w, bias, tt, kk.ids, kk.offsets, plan, *o.pack())
        cases[f"kept_logprob[{name}]"] = (torch.ops.fastrl.kept_logprob, fwd)
        with torch.no_grad():
            _, ent, lse, z = torch.ops.fastrl.kept_logprob(*fwd)
        cases[f"kept_logprob_given[{name}]"] = (torch.ops.fastrl.kept_logprob, (*fwd, z))
        n = hh.shape[0]
        cases[f"kept_logprob_backward[{name}]"] = (
            torch.ops.fastrl.kept_logprob_backward,
            (torch.randn(n), torch.randn(n), hh.detach(), w.detach(), bias.detach(), tt, kk.ids, kk.offsets, z, lse,
             ent, plan, *o.pack(), True, True, True))
    rule = SamplerRule(top_k=5, top_p=0.9, min_tokens=2, stop_token_ids=(1, 4))
    o = RuleOptions.of(rule, LogitTransform(temperature=0.7), -100)
    pos = torch.arange(t.numel()) % 4
    cases["replay_rule"] = (torch.ops.fastrl.replay_rule, (h.detach(), w.detach(), None, t, pos, [1, 4], *o.pack()))
    return cases


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args)
