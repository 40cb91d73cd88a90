"""The kept-set engine's plans (issue 34): what each computes, held here, and the per-row plan's own semantics.

* Costs: for every plan (per-row, host union, fixed union) on disjoint, Zipf and ragged sampler-like sets, the
  logits the engine computed (``KeptPlan.computed``, counted where the products run) equal what the plan's
  description says (``PlanChoice.logits``), and stay within the bounds docs/kept-set-costs.md states: the per-row
  plan ``1.25 nnz + N`` (on the ragged sets, where ``N x K_max`` is several times nnz, too; more in
  tests/test_kept_ragged.py), the host union plan ``max(cap, K_max)``, the fixed union plan ``3.5 C + R C / N``
  (``C`` its ids per unit, at most ``min(cap, 4 K)``, ``R`` its rows per chunk). The plans give the same logits.
* The choice: measured on the host (per-row for sampled sets, union tiles where neighbouring rows share ids), per-row
  without host reads unless the set says it overlaps; printable.
* ``kept_rows``: the per-row torch implementation against float64 (ragged rows, ids repeated across rows, padding,
  bf16), its deterministic weight gradient bit-reproducible and equal to the default's to rounding, and the dispatch
  to ``fastrl.kernels.kept_rows`` on a Triton backend (a stand-in module records the calls).
"""

from __future__ import annotations


import pytest
import torch

import fastrl
from fastrl.ops import budget, kept, kept_plan, kept_rows
from fastrl.ops.config import LogitTransform

V, H = 4096, 16


def disjoint_sets(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(V, generator=g)[: N * K].view(N, K)
    return fastrl.KeptSet.from_padded(ids, V)


def zipf_sets(N, K, seed=0):
    """K distinct ids per token from a Zipf(1.1) law (frequent ids recur from token to token)."""
    g = torch.Generator().manual_seed(seed)
    logp = -1.1 * torch.arange(1, V + 1, dtype=torch.float32).log()
    u = torch.rand(N, V, generator=g).clamp_(min=1e-20)
    ids = (logp - u.log().neg().log()).topk(K, dim=1).indices
    return fastrl.KeptSet.from_padded(ids, V)


def shared_sets(N, K):
    """Neighbouring tokens keep nearly the same ids (a few hundred ids in all)."""
    return fastrl.KeptSet.from_lists([list(range(n % 3, n % 3 + K)) for n in range(N)], V)


def ragged_sets(N, K, seed=0):
    """Sampler-like sizes (``bench.keptset.make_sets(kind="ragged")``: ~45% one id, median 2, mean ~8, at most 8 K),
    Zipf ids: the sets on which a padded ``[N, K_max]`` plan computes ~8x the entries."""
    from bench.keptset import make_sets

    return make_sets(N, V, 8 * K, "ragged", torch.device("cpu"), seed=seed)[0]


SETS = {"disjoint": disjoint_sets, "zipf": zipf_sets, "ragged": ragged_sets}
PLANS = {  # (overlap hint, host reads allowed) -> the plan kind it must give on sampled sets
    "rows-host": (None, True, "rows"),
    "rows-nosync": (None, False, "rows"),
    "union-host": (True, True, "union-host"),
    "union-fixed": (True, False, "union-fixed"),
}


def _run(ks, choice, heads=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(len(ks), H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    plan = kept.op_plan(ks.ids, ks.offsets, V, choice.arg(), choice.tile_elems, choice.cap, "torch")
    z = kept.entry_logits(plan, [kept.Head(hidden, weight, None, LogitTransform())] * heads, torch.float64)
    return plan, z[0][: plan.nnz], hidden, weight


@pytest.mark.parametrize("sets", list(SETS))
@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("K", [8, 20])
def test_logits_computed_within_the_stated_bound(sets, name, K, monkeypatch):
    cap = 512  # (a CPU's unit cap is 2048: sampled sets then fill a union with ~cap / K rows)
    monkeypatch.setitem(budget.BUDGETS, "kept", {"cpu": budget.TileBudget(elems=4096, live=2, cap=cap)})
    N = 96 if sets != "ragged" else 400
    ks = SETS[sets](N, K)
    overlap, sync, kind = PLANS[name]
    choice = ks.with_overlap(overlap).describe_plan(host_sync=sync)
    assert choice.kind == kind, str(choice)
    plan, z, hidden, weight = _run(ks, choice, heads=2)
    assert plan.computed == 2 * choice.logits  # what the engine computed (two heads) is what the plan says
    per_token = choice.logits / N
    k_max, nnz = int(ks.sizes().max()), ks.ids.numel()
    if kind == "rows":  # buckets by set size: at most 1.25 nnz (padding included) whatever the sizes
        assert plan.computed <= 2 * (1.25 * nnz + N), (plan.computed, nnz)
        assert sets != "ragged" or N * k_max > 1.25 * nnz + N  # where the padded [N, K_max] plan would fail
    elif kind == "union-host":
        assert per_token <= max(cap, k_max)
    else:
        R, C, _, _ = kept_plan.fixed_shape(N, ks.ids.numel(), V, choice.tile_elems, cap)
        assert per_token <= 3.5 * C + R * C / N and C <= kept_plan.FIXED_WIDTH * -(-ks.ids.numel() // N)
    row = torch.repeat_interleave(torch.arange(N), ks.sizes())
    want = (hidden[row] * weight[ks.ids]).sum(1)
    assert torch.allclose(z, want, rtol=0, atol=1e-12)  # every plan computes every entry, each once
    assert str(choice).startswith({"rows": "per-row plan", "union-host": "union tiles, host plan",
                                   "union-fixed": "union tiles, fixed plan"}[kind])


def test_choice_follows_the_overlap():
    """Sampled sets take the per-row plan on either path; sets whose neighbouring rows share their ids take union
    tiles where the host can measure it; a stated hint wins; with no known width and no host read, the fixed union."""
    N, K = 64, 16
    shared = shared_sets(N, K)
    assert shared.describe_plan().kind == "union-host"
    assert shared.describe_plan(host_sync=False).kind == "rows"
    assert shared.with_overlap(True).describe_plan(host_sync=False).kind == "union-fixed"
    assert disjoint_sets(N, K).with_overlap(False).describe_plan().kind == "rows"
    blind = fastrl.KeptSet(shared.ids, shared.offsets, V, validate=False)
    assert blind.width is None and blind.describe_plan(host_sync=False).kind == "union-fixed"
    assert blind.describe_plan().width == K  # measured on the host
    text = str(shared.describe_plan())
    assert "measured" in text and "per token" in text


def test_keptset_width_is_known_and_checked():
    assert disjoint_sets(5, 3).width == 3
    assert fastrl.KeptSet.from_lists([[1], [2, 3, 4], []], V).width == 3
    mask = torch.zeros(3, V, dtype=torch.bool)
    mask[1, :5] = True
    assert fastrl.KeptSet.from_mask(mask).width == 5
    ks = fastrl.KeptSet.from_lists([[1], [2, 3, 4], []], V)
    assert ks[1:].width == 3 and ks[torch.tensor([0, 2])].width == 3 and ks.to("cpu").width == 3
    with pytest.raises(ValueError, match=r"KeptSet width=2, but a token keeps 3 ids"):
        fastrl.KeptSet(ks.ids, ks.offsets, V, width=2)


def test_a_set_wider_than_its_width_gives_nan_not_a_short_sum():
    """A hand-built CSR that understates its width (validate=False) cannot drop ids silently on the per-row plan."""
    ks = fastrl.KeptSet.from_lists([[1, 2], [3, 4, 5, 6]], V)
    lying = fastrl.KeptSet(ks.ids, ks.offsets, V, validate=False, width=2)
    h = torch.randn(2, H)
    w = torch.randn(V, H)
    lp, _ = fastrl.fused_logprobs(h, w, torch.tensor([1, 3]), support=lying, host_sync=False)
    assert torch.isfinite(lp[0]) and torch.isnan(lp[1])


# ------------------------------------------------------------------------------------------- kept_rows


def _ragged_ids(N, K, seed=0):
    """[N, K] ids: ragged rows (-1 padding), ids repeated across rows, one row empty."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(40, generator=g)[:K] for _ in range(N)])  # 40 ids: rows share ids
    sizes = torch.randint(0, K + 1, (N,), generator=g)
    ids[torch.arange(K)[None, :] >= sizes[:, None]] = -1
    ids[3] = -1
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_against_float64(dtype):
    N, K, Hs, Vs = 37, 9, 33, 40
    g = torch.Generator().manual_seed(3)
    h = torch.randn(N, Hs, generator=g).to(dtype)
    w = torch.randn(Vs, Hs, generator=g).to(dtype)
    b = torch.randn(Vs, generator=g).to(dtype)
    ids = _ragged_ids(N, K)
    pad = ids < 0
    y = kept_rows.rows_logits(h, w, ids, b, tile_elems=5 * K * Hs)  # 5-row chunks
    h64, w64, b64 = h.double(), w.double(), b.double()
    want = torch.einsum("nh,nkh->nk", h64, w64[ids.clamp(min=0)]) + b64[ids.clamp(min=0)]
    assert y.dtype == torch.float32 and torch.isneginf(y[pad]).all()
    assert (y[~pad].double() - want[~pad]).abs().max() < 2e-5  # products of bf16 inputs exact, sums in float32
    G = torch.randn(N, K, generator=g).masked_fill(pad, 1e9)  # ignored at padding, whatever it holds
    gw = torch.zeros(Vs, Hs)
    gb = torch.zeros(Vs)
    gh = kept_rows.rows_backward(G, h, w, ids, gw, gb, tile_elems=5 * K * Hs)
    G64 = G.double().masked_fill(pad, 0.0)
    want_h = torch.einsum("nk,nkh->nh", G64, w64[ids.clamp(min=0)])
    want_w = torch.zeros(Vs, Hs, dtype=torch.float64).index_add_(
        0, ids.clamp(min=0).reshape(-1), (G64[:, :, None] * h64[:, None, :]).reshape(-1, Hs))
    want_b = torch.zeros(Vs, dtype=torch.float64).index_add_(0, ids.clamp(min=0).reshape(-1), G64.reshape(-1))
    for got, ref in ((gh, want_h), (gw, want_w), (gb, want_b)):
        assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_rows_deterministic_weight_gradient():
    N, K, Hs, Vs = 50, 8, 12, 30
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(N, Hs, generator=g), torch.randn(Vs, Hs, generator=g)
    ids = torch.stack([torch.randperm(Vs, generator=g)[:K] for _ in range(N)])
    ids[::4, -2:] = -1
    G = torch.randn(N, K, generator=g)
    runs = []
    for det in (True, True, False):
        gw = torch.full((Vs, Hs), 0.5)  # scatter-ADDED into what is there
        kept_rows.rows_backward(G, h, w, ids, gw, None, deterministic=det, tile_elems=7 * K * Hs)
        runs.append(gw)
    assert torch.equal(runs[0], runs[1])
    assert torch.allclose(runs[0], runs[2], rtol=1e-6, atol=1e-6)
    assert not torch.equal(runs[0], torch.full_like(runs[0], 0.5))


@pytest.mark.parametrize("dtype,bias,host_sync", [(torch.float32, False, True), (torch.float32, True, False),
                                                  (torch.bfloat16, True, True)])
def test_triton_backend_runs_the_kept_row_kernels(monkeypatch, dtype, bias, host_sync):
    """On a Triton backend the per-row plan runs ``fastrl.kernels.kept_rows`` (the real kernels, interpreted here;
    calls recorded) and equals the torch implementation; a bf16 head's weight gradient goes through the float32
    buffer over the kept ids (``weight_rows``), never a float32 [V, H]; float64 heads stay on torch."""
    from fastrl.kernels import kept_rows as kern

    calls = []
    real_logits, real_backward = kern.kept_rows_logits, kern.kept_rows_backward

    def logits(*a, **kw):
        calls.append("logits")
        return real_logits(*a, **kw)

    def backward(*a, **kw):
        grad_weight = a[4] if len(a) > 4 else kw.get("grad_weight")
        calls.append(("backward", tuple(grad_weight.shape) if grad_weight is not None else None,
                      kw.get("weight_rows") is not None))
        return real_backward(*a, **kw)

    monkeypatch.setattr(kern, "kept_rows_logits", logits)
    monkeypatch.setattr(kern, "kept_rows_backward", backward)
    assert kept_rows.kernels_for("triton-hybrid", torch.float32) is kern
    assert kept_rows.kernels_for("torch", torch.float32) is None
    assert kept_rows.kernels_for("triton-hybrid", torch.float64) is None
    N, K = 12, 5
    ks = disjoint_sets(N, K)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    t = ks.padded()[:, 0]
    params = [h, w] + ([b] if bias else [])
    want = fastrl.fused_logprobs(h, w, t, bias=b, support=ks, backend="torch", host_sync=host_sync)
    want_g = torch.autograd.grad(want[0].sum() + 0.1 * want[1].sum(), params)
    assert not calls
    got = fastrl.fused_logprobs(h, w, t, bias=b, support=ks, backend="triton", host_sync=host_sync)
    got_g = torch.autograd.grad(got[0].sum() + 0.1 * got[1].sum(), params)
    assert calls[0] == "logits" and calls[-1][0] == "backward", calls
    if dtype == torch.bfloat16:  # the kept ids' float32 buffer, not [V, H]
        assert calls[-1][1][0] < V and calls[-1][2], calls
    for a, c in zip(got, want):  # float32 log-probs and entropies, whatever the head's dtype
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-5), (a - c).abs().max()
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the gradients are rounded to bf16 (one ulp) at the end
    for a, c in zip(got_g, want_g):
        assert torch.allclose(a.float(), c.float(), rtol=tol, atol=tol), (a - c).abs().max()


def test_opcheck_per_row_plan():
    """``fastrl::kept_logprob`` and its backward with the per-row plan's argument (``[-K_max]``), live and masked
    rows (the union plans' cases are in test_compile_supports.py)."""
    N, K, Vs = 10, 4, 48
    g = torch.Generator().manual_seed(6)
    ks = fastrl.KeptSet.from_padded(torch.stack([torch.randperm(Vs, generator=g)[:K] for _ in range(N)]), Vs)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(Vs, H, generator=g, requires_grad=True)
    b = torch.randn(Vs, generator=g, requires_grad=True)
    t = ks.padded()[:, 1].clone()
    t[3] = -100
    choice = ks.describe_plan(host_sync=False)
    assert choice.arg() == [-K]
    for all_live in (True, False):
        tt = t.clamp(min=0) if all_live else t
        o = kept.KeptOptions(temperature=0.7, softcap=4.0, all_live=all_live, tile_elems=2 * K * H, cap=12)
        fwd = (h, w, b, tt, ks.ids, ks.offsets, choice.arg(), *o.pack())
        torch.library.opcheck(torch.ops.fastrl.kept_logprob, fwd)
        with torch.no_grad():
            _, ent, lse, z = torch.ops.fastrl.kept_logprob(*fwd)
        bwd = (torch.randn(N, generator=g), torch.randn(N, generator=g), h.detach(), w.detach(), b.detach(), tt,
               ks.ids, ks.offsets, z, lse, ent, choice.arg(), *o.pack(), True, True, True)
        torch.library.opcheck(torch.ops.fastrl.kept_logprob_backward, bwd)


def test_benchmark_sets_logits_per_plan():
    """The counts docs/kept-set-costs.md quotes, on ``bench keptset``'s own sets (N=1024, K=64, V=151936, a CPU's
    budget): the union plans compute 18.6x (Zipf) and 31.8x (disjoint) the per-row plan's logits on the host plan,
    14x on the fixed plan."""
    from bench.keptset import make_sets

    for kind, host in (("zipf", 18.6), ("uniform", 31.8)):
        ks, _ = make_sets(1024, 151936, 64, kind, torch.device("cpu"))
        rows = ks.describe_plan()
        assert rows.kind == "rows" and rows.per_token() == 64
        assert round(rows.other / rows.logits, 1) == host
        assert ks.with_overlap(True).describe_plan(host_sync=False).per_token() == 14 * 64
