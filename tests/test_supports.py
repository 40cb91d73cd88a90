"""Supports (issue 20, op side): kept sets and sampler rules against float64 ground truth.

* ``fused_logprobs(support=...)`` and ``policy_loss(support=...)`` against ``fastrl.reference``'s materialised
  masked log-softmax with autograd gradients (float64), on the torch backend and Triton's interpreter;
* ``apply_rule`` against transformers' own warpers and against a plain float64 rewrite of vLLM's rule (below);
* ``replay_rule`` (chunked, never [N, V]) against the rule on materialised float64 logits;
* named errors for bad input, and ``support=None`` unchanged.
"""

import itertools
import math

import pytest
import torch

import fastrl
from fastrl.losses.arithmetic import policy_loss_from_logprobs
from fastrl.losses.config import LOSS_TYPES, PolicyLossConfig
from fastrl.ops import budget
from fastrl.ops import kept as kept_mod
from fastrl.ops.rules import apply_rule
from fastrl.reference import logits_reference, masked_logprobs_reference, rule_mask_reference

from conftest import CPU_BACKENDS
from test_logprobs import grads, loss_weights, make_inputs, max_err, rel_err

SR = fastrl.SamplerRule
F64 = torch.float64


def random_keptset(targets, V, k_max, seed=0, ignore_index=-100, empty_ignored=True):
    """Random kept sets of 1..k_max ids holding each counted target; ignored tokens keep nothing (or a few)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for t in targets.reshape(-1).tolist():
        if t == ignore_index and empty_ignored:
            rows.append([])
            continue
        k = int(torch.randint(1, k_max + 1, (1,), generator=g))
        ids = set(torch.randperm(V, generator=g)[:k].tolist())
        if t != ignore_index:
            ids.add(t)
        rows.append(sorted(ids))
    return fastrl.KeptSet.from_lists(rows, V)


@pytest.fixture
def small_tiles(monkeypatch):
    """Force many token chunks in the kept path and in replay_rule (the chunk seams are where bugs hide)."""
    monkeypatch.setitem(budget.BUDGETS, "kept", {"cpu": budget.TileBudget(elems=64, live=2, cap=12)})
    # replay_rule: 3-token chunks, and 48-column vocabulary blocks where the rule is a bounded selection
    monkeypatch.setitem(budget.BUDGETS, "rule", {"cpu": budget.TileBudget(elems=3 * 48, live=4, rows=3)})


# ------------------------------------------------------------------------------------- op vs float64


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["keptset", "rule", "keptset-nosync"])
def test_support_logprobs_against_float64(backend, kind, small_tiles):
    """Both plans of the kept-set engine (eager: the host plan; ``host_sync=False``: the fixed plan, every row
    computed) against float64, with tiles small enough that chunks split into many units."""
    B, T, H, V = 3, 7, 31, 123
    tf = dict(temperature=0.7, logit_scale=1.3, softcap=6.0)
    hidden, weight, b, targets = make_inputs(B * T, H, V, torch.float32, lead=(B, T))
    targets[1, 5:] = -100
    with torch.no_grad():
        hidden[1, 6] = float("nan")  # an ignored row: must not reach anything
    params = [hidden, weight, b]
    if kind.startswith("keptset"):
        support = random_keptset(targets, V, 9)
        kept = support.to_mask()
    else:
        support = SR(top_k=12, top_p=0.9, min_p=0.02)
        kept, _ = rule_mask_reference(hidden.detach(), weight.detach(), targets, support, bias=b.detach(), dtype=F64,
                                      **tf)
    a, c = loss_weights(targets.shape)
    sync = dict(host_sync=False) if kind.endswith("nosync") else {}
    logp, ent = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend, support=support, **tf, **sync)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    g_fast = grads(logp, ent, a, c, params)
    assert torch.isfinite(torch.cat([g.reshape(-1) for g in g_fast])).all()
    assert logp[1, 5:].eq(0).all() and ent[1, 5:].eq(0).all()

    with torch.no_grad():
        hidden[1, 6] = 0.0  # the reference would propagate NaN from the ignored row through its [N, V] GEMM
    lp64, en64 = masked_logprobs_reference(hidden, weight, targets, kept, bias=b, dtype=F64, **tf)
    g64 = grads(lp64, en64, a, c, params)
    lpt, ent_t = masked_logprobs_reference(hidden, weight, targets, kept, bias=b, **tf)  # PyTorch in float32
    gt = grads(lpt, ent_t, a, c, params)
    assert max_err(logp, lp64) <= max_err(lpt, lp64) + 1e-6
    assert max_err(ent, en64) <= max_err(ent_t, en64) + 1e-6
    for name, gf, g_ref, g_t in zip(("hidden", "weight", "bias"), g_fast, g64, gt):
        assert rel_err(gf, g_ref) <= rel_err(g_t, g_ref) + 1e-6, name


@pytest.mark.parametrize("with_bias", [False, True])
def test_support_float64_inputs_exact(with_bias):
    """float64 inputs: the kept path agrees with the float64 reference to rounding, weight gradient zero
    exactly on rows no token kept."""
    N, H, V = 40, 16, 97
    hidden, weight, b, targets = make_inputs(N, H, V, F64, bias=with_bias)
    targets[::7] = -100
    ks = random_keptset(targets, V, 5, seed=3)
    params = [p for p in (hidden, weight, b) if p is not None]
    a, c = loss_weights(targets.shape)
    logp, ent = fastrl.fused_logprobs(hidden, weight, targets, bias=b, support=ks, backend="torch")
    lp, en = masked_logprobs_reference(hidden, weight, targets, ks.to_mask(), bias=b)
    assert max_err(logp, lp) < 1e-12 and max_err(ent, en) < 1e-12
    g_fast, g_ref = grads(logp, ent, a, c, params), grads(lp, en, a, c, params)
    for gf, gr in zip(g_fast, g_ref):
        assert rel_err(gf, gr) < 1e-12
    counted = ks[(targets != -100).nonzero().squeeze(1)]
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[counted.ids] = False
    assert untouched.any() and g_fast[1][untouched].eq(0).all()


def test_support_bf16_inputs():
    N, H, V = 24, 32, 200
    hidden, weight, b, targets = make_inputs(N, H, V, torch.bfloat16)
    ks = random_keptset(targets, V, 20)
    params = [hidden, weight, b]
    a, c = loss_weights(targets.shape)
    logp, ent = fastrl.fused_logprobs(hidden, weight, targets, bias=b, support=ks)
    lp64, en64 = masked_logprobs_reference(hidden, weight, targets, ks.to_mask(), bias=b, dtype=F64)
    lpt, _ = masked_logprobs_reference(hidden, weight, targets, ks.to_mask(), bias=b)  # PyTorch in bf16
    assert max_err(logp, lp64) <= 1e-5 < max_err(lpt, lp64)  # no logit rounded to bf16
    assert max_err(ent, en64) <= 1e-5
    for gf, gr in zip(grads(logp, ent, a, c, params), grads(lp64, en64, a, c, params)):
        assert rel_err(gf, gr) <= 2**-8


def test_forward_only_and_frozen_head():
    N, H, V = 20, 8, 60
    hidden, weight, b, targets = make_inputs(N, H, V, torch.float32)
    ks = random_keptset(targets, V, 6)
    with torch.no_grad():
        lp0, en0 = fastrl.fused_logprobs(hidden, weight, targets, bias=b, support=ks)
    assert not lp0.requires_grad
    weight.requires_grad_(False)
    lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, support=ks)
    assert torch.equal(lp.detach(), lp0) and torch.equal(en.detach(), en0)
    (g,) = torch.autograd.grad(lp.sum(), [hidden])
    ref, _ = masked_logprobs_reference(hidden, weight, targets, ks.to_mask(), bias=b, dtype=F64)
    (g64,) = torch.autograd.grad(ref.sum(), [hidden])
    assert rel_err(g, g64) < 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_return_kept_mass(backend):
    B, T, H, V = 2, 5, 16, 77
    tf = dict(temperature=0.8, softcap=5.0)
    hidden, weight, b, targets = make_inputs(B * T, H, V, torch.float32, lead=(B, T))
    targets[0, 4] = -100
    ks = random_keptset(targets, V, 10)
    logp, ent, mass = fastrl.fused_logprobs(hidden, weight, targets, bias=b, support=ks, return_kept_mass=True,
                                            backend=backend, **tf)
    z = logits_reference(hidden.reshape(-1, H), weight, b, dtype=F64, **tf).detach()
    kept = ks.to_mask()
    ref = torch.logsumexp(z.masked_fill(~kept, -math.inf), -1) - torch.logsumexp(z, -1)
    ref = torch.where(targets.reshape(-1) != -100, ref, 0).reshape(B, T)
    assert max_err(mass, ref) < 1e-5 and not mass.requires_grad
    assert (mass <= 1e-6).all() and mass[0, 4] == 0
    lp2, en2 = fastrl.fused_logprobs(hidden, weight, targets, bias=b, support=ks, backend=backend, **tf)
    assert torch.equal(lp2, logp) and torch.equal(en2, ent)
    # a rule that keeps every id is the full softmax, bit for bit
    full = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend, **tf)
    ident = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend, support=SR(), **tf)
    assert all(torch.equal(x, y) for x, y in zip(full, ident))
    # no support: the kept mass is the whole distribution, log 1 = 0
    _, _, zero = fastrl.fused_logprobs(hidden, weight, targets, bias=b, return_kept_mass=True, backend=backend)
    assert zero.eq(0).all()


def test_chunk_plan_bounds():
    """Chunks cover every row once, hold at most ``cap`` ids in their union (or one row) and one bounded tile;
    overlapping sets give longer chunks than disjoint ones."""
    V, N = 5000, 300
    disjoint = fastrl.KeptSet.from_lists([list(range(16 * n, 16 * n + 16)) for n in range(N)], V)
    shared = fastrl.KeptSet.from_lists([list(range(n % 5, n % 5 + 16)) for n in range(N)], V)
    for ks, most in ((disjoint, 4), (shared, N)):
        plan = kept_mod.chunk_plan(ks, V, tile_elems=4096, cap=64)
        assert [c0 for c0, _ in plan] == [0] + [c1 for _, c1 in plan[:-1]] and plan[-1][1] == N
        for c0, c1 in plan:
            u = torch.unique(ks[c0:c1].ids).numel()
            assert (u <= 64 or c1 - c0 == 1) and (c1 - c0) * u <= 4096
        assert max(c1 - c0 for c0, c1 in plan) <= most
    assert len(kept_mod.chunk_plan(shared, V, 4096, 64)) < len(kept_mod.chunk_plan(disjoint, V, 4096, 64)) / 3


# ------------------------------------------------------------------------------------ policy_loss


def _loss_cases():
    for loss_type, level in itertools.product(LOSS_TYPES, ("token", "sequence")):
        yield PolicyLossConfig(
            loss_type=loss_type, importance_sampling_level=level, beta=0.04, kl_estimator="k3", entropy_coef=0.01,
            temperature=0.9, max_completion_length=9 if loss_type == "dr_grpo" else None,
            epsilon_high=5.0 if loss_type == "cispo" else None,
        )
    yield PolicyLossConfig(loss_type="bnpo", top_entropy_quantile=0.4)


@pytest.mark.parametrize("config", list(_loss_cases()),
                         ids=lambda c: f"{c.loss_type}-{c.importance_sampling_level}-q{c.top_entropy_quantile}")
def test_policy_loss_keptset_every_loss_type(config):
    B, T, H, V = 3, 6, 12, 70
    hidden, weight, b, targets = make_inputs(B * T, H, V, F64, lead=(B, T))
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 2:] = False
    ks = random_keptset(torch.where(mask, targets, -100), V, 8, empty_ignored=True)
    adv = torch.randn(B, generator=g, dtype=F64)
    old = torch.randn(B, T, generator=g, dtype=F64) * 0.3 - 2.0
    ref = old + 0.1 * torch.randn(B, T, generator=g, dtype=F64)
    kw = dict(config=config, old_logprobs=old, ref_logprobs=ref)
    loss, metrics = fastrl.policy_loss(hidden, weight, targets, adv, mask, bias=b, support=ks, backend="torch", **kw)
    params = [hidden, weight, b]
    g_fast = torch.autograd.grad(loss, params)

    lp, en = masked_logprobs_reference(hidden, weight, torch.where(mask, targets, -100), ks.to_mask(), bias=b,
                                       temperature=config.temperature, dtype=F64)
    loss_ref, m_ref = policy_loss_from_logprobs(lp, en, adv, mask, **kw)
    g_ref = torch.autograd.grad(loss_ref, params)
    assert abs(float(loss.detach()) - float(loss_ref.detach())) < 1e-12
    for gf, gr in zip(g_fast, g_ref):
        assert rel_err(gf, gr) < 1e-10
    for k, v in m_ref.items():
        assert abs(float(metrics[k]) - float(v)) < 1e-12, k
    sizes = ks.sizes().double().reshape(B, T)
    assert float(metrics["sampling/kept_size_mean"]) == pytest.approx(float(sizes[mask].mean()), abs=1e-12)
    assert "sampling/label_outside_frac" not in metrics


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_policy_loss_rule(backend, level):
    B, T, H, V = 2, 8, 16, 90
    config = PolicyLossConfig(loss_type="grpo", importance_sampling_level=level, beta=0.04, entropy_coef=0.01,
                              temperature=0.8)
    rule = SR(top_k=6, top_p=0.8, min_tokens=3, stop_token_ids=(1, 2))
    hidden, weight, b, targets = make_inputs(B * T, H, V, torch.float32, lead=(B, T))
    targets[0, 0] = 1  # a stop id before min_tokens: outside the rule's set, extended by the target
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:] = False
    adv = torch.tensor([0.5, -1.0])
    old = torch.full((B, T), -3.0)
    loss, metrics = fastrl.policy_loss(hidden, weight, targets, adv, mask, config=config, bias=b, support=rule,
                                       old_logprobs=old, ref_logprobs=old - 0.1, backend=backend)
    params = [hidden, weight, b]
    g_fast = torch.autograd.grad(loss, params)
    eff = torch.where(mask, targets, -100)
    kept, outside = rule_mask_reference(hidden.detach(), weight.detach(), eff, rule, bias=b.detach(),
                                        temperature=0.8, dtype=F64)
    assert outside[0, 0]
    lp, en = masked_logprobs_reference(hidden, weight, eff, kept, bias=b, temperature=0.8, dtype=F64)
    loss_ref, _ = policy_loss_from_logprobs(lp, en, adv.double(), mask, config=config, old_logprobs=old.double(),
                                            ref_logprobs=old.double() - 0.1)
    g_ref = torch.autograd.grad(loss_ref, params)
    assert abs(float(loss.detach()) - float(loss_ref.detach())) < 1e-5
    for gf, gr in zip(g_fast, g_ref):
        assert rel_err(gf, gr) < 1e-5
    assert float(metrics["sampling/label_outside_frac"]) == pytest.approx(float(outside[mask].double().mean()))
    assert float(metrics["sampling/kept_size_mean"]) == pytest.approx(float(kept.sum(1).reshape(B, T)[mask].double().mean()))


def test_policy_loss_support_none_unchanged():
    B, T, H, V = 2, 5, 8, 40
    config = PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)
    hidden, weight, b, targets = make_inputs(B * T, H, V, torch.float32, lead=(B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5])
    ref = torch.full((B, T), -3.0)
    out = []
    for extra in ({}, {"support": None}):
        loss, m = fastrl.policy_loss(hidden, weight, targets, adv, mask, config=config, bias=b, ref_logprobs=ref,
                                     **extra)
        out.append((loss, m, torch.autograd.grad(loss, [hidden, weight, b])))
    (l0, m0, g0), (l1, m1, g1) = out
    assert torch.equal(l0, l1) and m0.keys() == m1.keys() and "sampling/kept_size_mean" not in m1
    assert all(torch.equal(x, y) for x, y in zip(g0, g1))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fused_logprobs_support_none_is_main_path(backend):
    """support=None runs the unchanged full-softmax path: bit-identical to the custom op main calls."""
    from fastrl.ops.linear_logprob import LinearOptions

    N, H, V = 16, 8, 50
    hidden, weight, b, targets = make_inputs(N, H, V, torch.float32)
    lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend, support=None, temperature=0.7)
    name = "triton-hybrid" if backend == "triton" else backend
    opts = LinearOptions(temperature=0.7, backend=name, with_entropy=True)
    lp0, en0, _ = torch.ops.fastrl.linear_logprob(hidden, weight, b, targets, *opts.pack())
    assert torch.equal(lp, lp0) and torch.equal(en, en0)
    g = torch.autograd.grad((lp + en).sum(), [hidden, weight, b])
    g0 = torch.autograd.grad((lp0 + en0).sum(), [hidden, weight, b])
    assert all(torch.equal(x, y) for x, y in zip(g, g0))


# ------------------------------------------------------------------------------ rules: transformers


def _transformers_mask(z, rule, positions=None):
    tr = pytest.importorskip("transformers.generation.logits_process")
    s = z.clone()
    if rule.min_tokens:
        rows = []
        for i in range(s.shape[0]):
            proc = tr.MinNewTokensLengthLogitsProcessor(0, rule.min_tokens, list(rule.stop_token_ids))
            ids = torch.zeros((1, int(positions[i])), dtype=torch.long)
            rows.append(proc(ids, s[i : i + 1]))
        s = torch.cat(rows)
    if rule.top_k:
        s = tr.TopKLogitsWarper(rule.top_k)(None, s)
    if rule.top_p < 1.0:
        s = tr.TopPLogitsWarper(rule.top_p)(None, s)
    if rule.min_p:
        s = tr.MinPLogitsWarper(rule.min_p)(None, s)
    return s > -math.inf


def _logit_tiles():
    g = torch.Generator().manual_seed(11)
    smooth = torch.randn(40, 64, generator=g, dtype=F64) * 2.5
    ties = (torch.randn(40, 64, generator=g, dtype=F64) * 2).round()  # many exact ties
    return smooth, ties


@pytest.mark.parametrize("top_k,top_p,min_p", [
    (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1), (10, 0.8, 0.05), (0, 0.5, 0.2), (64, 0.95, 0.0), (100, 1.0, 0.0),
    (3, 0.3, 0.0), (0, 1.0, 1.0), (7, 1.0, 1.0),
])
def test_rules_match_transformers_warpers(top_k, top_p, min_p):
    smooth, ties = _logit_tiles()
    rule = SR(top_k=top_k, top_p=top_p, min_p=min_p, order="transformers")
    assert torch.equal(apply_rule(smooth, rule), _transformers_mask(smooth, rule))
    # without ties the two tie rules agree
    assert torch.equal(apply_rule(smooth, SR(top_k=top_k, top_p=top_p, min_p=min_p, order="transformers",
                                             ties="index")), _transformers_mask(smooth, rule))
    if top_p == 1.0:  # top_k and min_p keep ties as transformers does; top_p's tie order is torch.sort's there
        assert torch.equal(apply_rule(ties, rule), _transformers_mask(ties, rule))


def test_rules_transformers_min_tokens():
    smooth, _ = _logit_tiles()
    rule = SR(top_k=8, top_p=0.9, min_tokens=4, stop_token_ids=(0, 3, 17), order="transformers")
    pos = torch.arange(smooth.shape[0]) % 7
    assert torch.equal(apply_rule(smooth, rule, pos), _transformers_mask(smooth, rule, pos))
    m = apply_rule(smooth, rule, pos)
    assert not m[pos < 4][:, [0, 3, 17]].any()


def test_rules_transformers_top_p_boundary():
    # probabilities 1/2, 1/4, 1/8, 1/8 exactly: top_p = 0.75 lands on a cumulative boundary
    z = torch.tensor([[math.log(4), math.log(2), 0.0, 0.0]], dtype=F64)
    for p in (0.75, 0.5, 0.25):
        rule = SR(top_p=p, order="transformers")
        assert torch.equal(apply_rule(z, rule), _transformers_mask(z, rule))
    # the tie at the cut: "index" drops the higher id, "keep" keeps both
    assert apply_rule(z, SR(top_p=0.875, order="transformers", ties="index")).tolist() == [[True, True, True, False]]
    assert apply_rule(z, SR(top_p=0.875, order="transformers", ties="keep")).tolist() == [[True, True, True, True]]


# ------------------------------------------------------------------------------------- rules: vLLM


def vllm_rule_rewrite(z, rule, positions=None):
    """A plain float64, row-by-row rewrite of the vLLM-order rule (SamplerRule's docstring), for the test."""
    out = torch.zeros(z.shape, dtype=torch.bool)
    V = z.shape[1]
    for i in range(z.shape[0]):
        row = z[i].double().tolist()
        alive = [j for j in range(V) if row[j] > -math.inf]
        if rule.min_tokens and positions[i] < rule.min_tokens:
            alive = [j for j in alive if j not in rule.stop_token_ids]
        if rule.min_p > 0:
            zmax = max(row[j] for j in alive)
            alive = [j for j in alive if row[j] >= zmax + math.log(rule.min_p)]
        order = sorted(alive, key=lambda j: (-row[j], j))
        if rule.top_k > 0 and len(order) > rule.top_k:
            if rule.ties == "keep":
                kth = row[order[rule.top_k - 1]]
                order = [j for j in order if row[j] >= kth]
            else:
                order = order[: rule.top_k]
        if rule.top_p < 1.0:
            zs = torch.tensor([row[j] for j in order], dtype=F64)
            p = torch.softmax(zs, 0).tolist()
            keep = []
            for r, j in enumerate(order):
                if rule.ties == "keep":
                    above = sum(p[q] for q in range(len(order)) if row[order[q]] > row[j])
                else:
                    above = sum(p[:r])
                if r == 0 or above < rule.top_p:
                    keep.append(j)
            order = keep
        out[i, order] = True
    return out


@pytest.mark.parametrize("ties", ["keep", "index"])
@pytest.mark.parametrize("top_k,top_p,min_p", [
    (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1), (10, 0.8, 0.05), (0, 0.6, 0.2), (64, 0.95, 0.0), (100, 0.7, 0.0),
    (0, 1.0, 1.0), (4, 0.5, 1.0),
])
def test_rules_match_vllm_rewrite(ties, top_k, top_p, min_p):
    smooth, tied = _logit_tiles()
    rule = SR(top_k=top_k, top_p=top_p, min_p=min_p, ties=ties)
    for z in (smooth[:12], tied[:12]):
        assert torch.equal(apply_rule(z, rule), vllm_rule_rewrite(z, rule))


@pytest.mark.parametrize("ties", ["keep", "index"])
def test_rules_vllm_edges(ties):
    equal = torch.zeros(3, 8, dtype=F64)  # all-equal logits: p = 1/8 each
    boundary = torch.tensor([[math.log(4), math.log(2), 0.0, 0.0]], dtype=F64)
    cases = [(equal, SR(top_k=3, ties=ties)), (equal, SR(top_p=0.25, ties=ties)), (equal, SR(min_p=1.0, ties=ties)),
             (boundary, SR(top_p=0.75, ties=ties)), (boundary, SR(top_p=0.875, ties=ties)),
             (boundary, SR(top_k=3, ties=ties)), (boundary, SR(top_k=50, top_p=0.5, ties=ties))]
    for z, rule in cases:
        assert torch.equal(apply_rule(z, rule), vllm_rule_rewrite(z, rule)), rule

    def n_kept(z, r):
        return apply_rule(z, r).sum(1).tolist()

    assert n_kept(equal, SR(top_k=3, ties=ties)) == ([8] * 3 if ties == "keep" else [3] * 3)
    assert n_kept(equal, SR(top_p=0.25, ties=ties)) == ([8] * 3 if ties == "keep" else [2] * 3)  # 0, 1/8 < 1/4
    assert n_kept(boundary, SR(top_p=0.75, ties=ties)) == [2]  # 3/4 above the third id is not < 3/4
    assert n_kept(boundary, SR(top_p=0.875, ties=ties)) == ([4] if ties == "keep" else [3])
    pos = torch.tensor([0, 1, 5])
    rule = SR(top_k=4, min_tokens=2, stop_token_ids=(0, 2), ties=ties)
    z = torch.arange(8, dtype=F64).flip(0).expand(3, 8).contiguous()  # id 0 is the most likely
    assert torch.equal(apply_rule(z, rule, pos), vllm_rule_rewrite(z, rule, pos))
    assert apply_rule(z, rule, pos)[:, 0].tolist() == [False, False, True]


# ------------------------------------------------------------------------------------- replay_rule


@pytest.mark.parametrize("order", ["vllm", "transformers"])
def test_replay_rule_matches_materialised(order, small_tiles):
    B, T, H, V = 2, 9, 16, 150
    hidden, weight, b, targets = make_inputs(B * T, H, V, torch.float32, lead=(B, T))
    targets[1, 7:] = -100
    rule = SR(top_k=20, top_p=0.85, min_p=0.01, min_tokens=3, stop_token_ids=(4,), order=order)
    tf = dict(temperature=0.6, logit_scale=0.9)
    ks, outside = fastrl.replay_rule(hidden, weight, targets, rule, bias=b, **tf)
    # float32 tiles on both sides: the masks agree exactly (float64 may move a boundary by one id)
    kept, out_ref = rule_mask_reference(hidden.detach(), weight.detach(), targets, rule, bias=b.detach(), **tf)
    assert torch.equal(ks.to_mask(), kept) and torch.equal(outside, out_ref)
    assert ks.lead_shape == (B, T) and ks.sizes().reshape(B, T)[1, 7:].eq(0).all()
    assert outside.any()  # random targets mostly fall outside a top-20 set
    assert ks.contains(torch.where(targets == -100, 0, targets)).reshape(B, T)[targets != -100].all()


_HANDED = {"top_k": SR(top_k=20, min_tokens=3, stop_token_ids=(4,)), "top_k+top_p": SR(top_k=20, top_p=0.85),
           "top_p": SR(top_p=0.8, min_tokens=3, stop_token_ids=(4,))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
@pytest.mark.parametrize("name", list(_HANDED))
def test_replay_hands_its_logits_to_the_kept_engine(dtype, name, small_tiles, monkeypatch):
    """A rule's replay returns the logits it read at the kept entries (a target it added too, a stop id before
    min_tokens included), in the compute dtype, each equal to the float64 logit; the kept-set engine takes them and
    computes no logit of that head, and fused_logprobs and policy_loss over the rule still equal float64 over the
    rule's sets (the bounded selection and the whole-row path both)."""
    from fastrl.ops import kept_rows, rules
    from fastrl.ops.config import LogitTransform

    rule = _HANDED[name]
    B, T, H, V = 2, 9, 16, 150
    hidden, weight, b, targets = make_inputs(B * T, H, V, dtype, lead=(B, T))
    targets[1, 7:] = -100
    targets[0, 0] = 4  # a stop id before min_tokens (top_k, top_p) or outside the set: the replay adds the target
    tf = dict(temperature=0.6, logit_scale=0.9, softcap=5.0)
    ks, outside, z = rules.replay_checked(hidden.detach(), weight.detach(), b.detach(), targets, rule,
                                          LogitTransform(**tf), -100, None)
    assert bool(outside[0, 0]) and z.dtype == (F64 if dtype == F64 else torch.float32) and z.shape == ks.ids.shape
    z64 = logits_reference(hidden.detach().reshape(-1, H), weight.detach(), b.detach(), dtype=F64, **tf)
    row = torch.repeat_interleave(torch.arange(B * T), ks.sizes())
    assert max_err(z, z64[row, ks.ids]) <= (1e-12 if dtype == F64 else 2e-5)

    def computed(*a, **k):
        raise AssertionError("the kept-set engine computed logits the replay had handed it")

    monkeypatch.setattr(kept_rows, "rows_logits", computed)
    monkeypatch.setattr(kept_mod, "unit_logits", computed)
    logp, ent = fastrl.fused_logprobs(hidden, weight, targets, bias=b, support=rule, **tf)
    config = PolicyLossConfig(loss_type="dapo", entropy_coef=0.01, temperature=tf["temperature"])
    mask = targets != -100
    adv = torch.tensor([0.5, -1.0])
    loss, _ = fastrl.policy_loss(hidden, weight, targets, adv, mask, config=config, bias=b, support=rule,
                                 logit_scale=tf["logit_scale"], softcap=tf["softcap"])
    lp64, en64 = masked_logprobs_reference(hidden, weight, targets, ks.to_mask(), bias=b, dtype=F64, **tf)
    loss64, _ = policy_loss_from_logprobs(lp64, en64, adv.double(), mask, config=config)
    tol = 1e-10 if dtype == F64 else 2e-5
    assert max_err(logp, lp64) <= tol and max_err(ent, en64) <= tol
    assert abs(float(loss.detach()) - float(loss64.detach())) <= tol
    params = [hidden, weight, b]
    for gf, gr in zip(torch.autograd.grad(logp.sum() + ent.sum() + loss, params),
                      torch.autograd.grad(lp64.sum() + en64.sum() + loss64, params)):
        assert rel_err(gf, gr) <= {F64: 1e-10, torch.float32: 1e-4}.get(dtype, 2**-7)  # bf16 gradients: 2 ulps


# ----------------------------------------------------------------------------------------- bad input


def test_bad_keptsets_named():
    V = 10
    with pytest.raises(ValueError, match=r"token 1 keeps id 12"):
        fastrl.KeptSet.from_lists([[1, 2], [12]], V)
    with pytest.raises(ValueError, match=r"token 0 keeps id 3 twice"):
        fastrl.KeptSet.from_lists([[3, 3]], V)
    with pytest.raises(ValueError, match=r"token \(1, 0\) holds id -5"):
        fastrl.KeptSet.from_padded(torch.tensor([[[1, -1]], [[-5, 2]]]), V)

    hidden, weight, _, targets = make_inputs(4, 8, V, torch.float32, lead=(2, 2))
    targets = torch.tensor([[1, 2], [3, -100]])
    good = [[1], [2, 5], [3], []]
    fastrl.fused_logprobs(hidden, weight, targets, support=fastrl.KeptSet.from_lists(good, V))  # fine
    cases = [
        ([[1], [2], [], []], r"empty at counted token \(1, 0\)"),
        ([[1], [5], [3], []], r"does not contain the target at token \(0, 1\) \(id 2\)"),
        ([[1], [2], [3]], r"support has 3 tokens, expected one per target.*hold 4"),
    ]
    for rows, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fastrl.fused_logprobs(hidden, weight, targets, support=fastrl.KeptSet.from_lists(rows, V))
    with pytest.raises(ValueError, match=r"vocab_size=11, but weight has V=10"):
        fastrl.fused_logprobs(hidden, weight, targets, support=fastrl.KeptSet.from_lists(good, 11))
    with pytest.raises(TypeError, match="support must be None, a fastrl.KeptSet or a fastrl.SamplerRule"):
        fastrl.fused_logprobs(hidden, weight, targets, support=[[1]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"does not contain the target at token \(0, 1\)"):
        fastrl.policy_loss(hidden, weight, targets.clamp(min=0), torch.ones(2), mask, config=PolicyLossConfig(),
                           support=fastrl.KeptSet.from_lists([[1], [5], [3], [0]], V))


def test_bad_rule_inputs_named():
    hidden, weight, _, targets = make_inputs(6, 8, 20, torch.float32)
    rule = SR(top_k=3, min_tokens=2, stop_token_ids=(0,))
    with pytest.raises(ValueError, match=r"min_tokens=2\) needs each token's completion position.*flat targets"):
        fastrl.fused_logprobs(hidden, weight, targets, support=rule)
    with pytest.raises(ValueError, match=r"min_tokens=2\) needs"):
        fastrl.replay_rule(hidden, weight, targets, rule)
    with pytest.raises(ValueError, match=r"positions must have targets' shape \(6,\), got \(5,\)"):
        fastrl.replay_rule(hidden, weight, targets, rule, positions=torch.arange(5))
    ks, _ = fastrl.replay_rule(hidden, weight, targets, rule, positions=torch.arange(6))
    assert len(ks) == 6
    with pytest.raises(TypeError, match="rule must be a fastrl.SamplerRule"):
        fastrl.replay_rule(hidden, weight, targets, {"top_k": 3})
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SR(top_p=0.0)


def test_support_paths_import_no_dynamo():
    """The kept-set ops are torch.library ops like the others: their first eager calls (both plans, a rule, the loss
    with the exact KL, the divergence) import no torch._dynamo (~170 MB and 1-2 s in a process that never compiles)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys, torch, fastrl
        B, T, H, V = 2, 8, 16, 64
        h = torch.randn(B, T, H, requires_grad=True); w = torch.randn(V, H, requires_grad=True)
        t = torch.randint(0, V, (B, T)); mask = torch.ones(B, T, dtype=torch.bool)
        keep = torch.rand(B, T, V) < 0.3; keep.view(-1, V)[torch.arange(B * T), t.view(-1)] = True
        ks = fastrl.KeptSet.from_mask(keep)
        cfg = fastrl.PolicyLossConfig(loss_type="dapo", beta=0.1, kl_estimator="exact")
        ref = dict(ref_hidden=torch.randn(B, T, H), ref_weight=torch.randn(V, H))
        for support, sync in ((ks, None), (ks, False), (fastrl.SamplerRule(top_k=5), None)):
            lp, ent = fastrl.fused_logprobs(h, w, t, support=support, host_sync=sync)
            (lp.sum() + ent.sum()).backward()
        for support in (None, ks):
            fastrl.policy_loss(h, w, t, torch.randn(B), mask, config=cfg, old_logprobs=lp.detach(), support=support,
                               **ref)[0].backward()
        fastrl.fused_divergence(h, w, torch.randn(B, T, 24), torch.randn(V, 24), beta=0.5, support=ks).sum().backward()
        assert "torch._dynamo" not in sys.modules
    """)
    env = {**os.environ, "FASTRL_BACKEND": "torch"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
