"""Ragged kept sets at O(nnz) (issue 44 point 3) and the per-row plan's deterministic weight gradient (issue 47).

Sets as a sampler keeps them (``bench.keptset.make_sets(kind="ragged")``: ~45% one id, median 2, mean ~8, p99 ~82,
at most 128), with Zipf ids (frequent ids recur across tokens) and with disjoint ids:

* cost: the logits the engine computed where the products ran (``KeptPlan.computed``) stay within
  ``1.25 nnz + N`` on the per-row plan, eager and without host reads, and equal what the plan's description says;
  the old ``N x K_max`` layout (what CUDA graph capture still runs) would break that bound on these sets;
* values: every entry's logit, and ``fused_logprobs`` with its gradients, against float64; a singleton set gives
  log-prob 0, entropy 0 and no gradient; ``torch.compile(fullgraph=True)`` runs the same buckets;
* determinism: two backward runs give bitwise-equal hidden and weight gradients under
  ``torch.use_deterministic_algorithms(True)``, on the torch backend and on Triton (interpreted here).
"""

from __future__ import annotations

import pytest
import torch

import fastrl
from bench.keptset import make_sets
from fastrl.ops import kept, kept_plan
from fastrl.ops.config import LogitTransform
from fastrl.reference import masked_logprobs_reference

V, H = 4096, 16
F64 = torch.float64


def ragged(N, ids="zipf", seed=0):
    """(KeptSet, targets): sampler-like sizes; Zipf ids (the benchmark's sets) or disjoint ids."""
    ks, t = make_sets(N, V, 128, "ragged", torch.device("cpu"), seed=seed)
    if ids == "disjoint":
        sizes = ks.sizes()
        perm = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[: int(sizes.sum())]
        rows = perm.split(sizes.tolist())
        ks = fastrl.KeptSet.from_lists([r.tolist() for r in rows], V)
        t = torch.stack([r[len(r) // 2] for r in rows])
    return ks, t


def test_the_ragged_sets_are_sampler_like():
    ks, t = ragged(4000)
    s = ks.sizes().float()
    assert 0.40 <= (s == 1).float().mean() <= 0.50
    assert s.median() == 2 and 6.5 <= s.mean() <= 9.5 and 60 <= s.quantile(0.99) <= 110 and s.max() <= 128
    assert ks.contains(t).all()


@pytest.mark.parametrize("ids", ["zipf", "disjoint"])
@pytest.mark.parametrize("sync", [True, False])
def test_counted_logits_within_nnz_bound(ids, sync):
    N = 480 if ids == "disjoint" else 1024  # disjoint: nnz <= V
    ks, _ = ragged(N, ids)
    nnz = ks.ids.numel()
    choice = ks.with_overlap(False).describe_plan(host_sync=sync)
    assert choice.kind == "rows"
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(N, H, generator=g, dtype=F64), torch.randn(V, H, generator=g, dtype=F64)
    plan = kept.op_plan(ks.ids, ks.offsets, V, choice.arg(), choice.tile_elems, choice.cap, "torch")
    (z,) = kept.entry_logits(plan, [kept.Head(hidden, weight, None, LogitTransform())], F64)
    assert plan.computed == choice.logits <= 1.25 * nnz + N, (plan.computed, nnz, N)
    assert N * int(ks.sizes().max()) > 1.25 * nnz + N  # the padded [N, K_max] layout would fail this bound
    row = torch.repeat_interleave(torch.arange(N), ks.sizes())
    assert torch.allclose(z[:nnz], (hidden[row] * weight[ks.ids]).sum(1), rtol=0, atol=1e-12)
    G = kept.entries(torch.randn(nnz, generator=g, dtype=F64))
    kept.entry_backward(plan, kept.Head(hidden, weight, None, LogitTransform()), G, (True, True, False))
    assert plan.computed_backward == plan.computed - int((ks.sizes() == 1).sum())  # singletons: no product


def test_bucket_width_pads_at_most_a_quarter():
    s = torch.arange(0, 5000)
    w = kept_plan.bucket_width(s, 10**6)
    assert w[0] == 0 and torch.equal(w[1:8], s[1:8])
    assert (w >= s).all() and (w - s <= s // 4).all() and (w - s < s / 4 + 1e-9).all()
    assert kept_plan.bucket_width(s, 100).max() == 100  # never past the plan's width
    assert w.unique().numel() < 60  # a few buckets per octave


def test_graph_capture_falls_back_to_one_bucket(monkeypatch):
    """Where no host read is possible (CUDA graph capture) the plan is every row at the width: the same logits."""
    ks, _ = ragged(64)
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(64, H, generator=g, dtype=F64), torch.randn(V, H, generator=g, dtype=F64)
    head = [kept.Head(hidden, weight, None, LogitTransform())]
    arg = ks.describe_plan(host_sync=False).arg()
    bucketed = kept.op_plan(ks.ids, ks.offsets, V, arg, 0, 0, "torch")
    monkeypatch.setattr(kept_plan, "_capturing", lambda device: True)
    captured = kept.op_plan(ks.ids, ks.offsets, V, arg, 0, 0, "torch")
    assert len(captured.buckets) == 1 and captured.logits == 64 * ks.width > bucketed.logits
    a, c = kept.entry_logits(captured, head, F64)[0], kept.entry_logits(bucketed, head, F64)[0]
    assert torch.allclose(a, c, rtol=0, atol=1e-12)  # (a batched product's order may follow its batch size)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("sync", [True, False])
def test_ragged_logprobs_against_float64(backend, sync):
    N = 96 if backend == "torch" else 40
    ks, t = ragged(N, seed=3)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    b = torch.randn(V, generator=g, requires_grad=True)
    tf = dict(temperature=0.7, softcap=6.0)
    logp, ent = fastrl.fused_logprobs(hidden, weight, t, bias=b, support=ks, backend=backend, host_sync=sync, **tf)
    params = [hidden, weight, b]
    got = torch.autograd.grad(logp.sum() + 0.3 * ent.sum(), params)
    lp64, en64 = masked_logprobs_reference(hidden, weight, t, ks.to_mask(), bias=b, dtype=F64, **tf)
    want = torch.autograd.grad(lp64.sum() + 0.3 * en64.sum(), params)
    assert (logp.double() - lp64).abs().max() < 2e-5 and (ent.double() - en64).abs().max() < 2e-5
    for name, a, c in zip(("hidden", "weight", "bias"), got, want):
        assert (a.double() - c).abs().max() <= 2e-5 * max(1.0, c.abs().max()), name
    one = ks.sizes() == 1
    assert one.any() and logp[one].eq(0).all() and ent[one].eq(0).all() and got[0][one].eq(0).all()


def test_compiled_runs_the_same_buckets(monkeypatch):
    """Under ``torch.compile(fullgraph=True)`` the op runs eagerly: it reads the bucket sizes and computes within
    ``1.25 nnz + N`` logits, with the eager results."""
    N = 128
    ks, t = ragged(N, seed=5)
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    plans, real = [], kept.op_plan

    def record(*a, **kw):
        plans.append(real(*a, **kw))
        return plans[-1]

    monkeypatch.setattr(kept, "op_plan", record)

    def f(h, w):
        logp, ent = fastrl.fused_logprobs(h, w, t, support=ks, backend="torch", host_sync=False)
        return logp.sum() + 0.1 * ent.sum()

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(hidden, weight), [hidden, weight])
    fwd = [p for p in plans if p.computed]
    assert fwd and all(p.computed <= 1.25 * ks.ids.numel() + N for p in fwd)
    plans.clear()
    want = torch.autograd.grad(f(hidden, weight), [hidden, weight])
    for a, c in zip(got, want):
        assert torch.allclose(a, c, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend,overlap", [("torch", None), ("triton", None), ("torch", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_gradients_bitwise(backend, overlap, dtype):
    """Two backward runs: bitwise-equal gradients (ids recur within and across buckets; bf16: the float32 buffer
    over the kept ids), on the per-row plan and on union tiles (``overlap=True``)."""
    N = 160 if backend == "torch" else 48
    ks, t = ragged(N, seed=7)
    ks = ks.with_overlap(overlap)
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(N, 64, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(V, 64, generator=g).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_()
    runs = []
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            logp, ent = fastrl.fused_logprobs(hidden, weight, t, bias=b, support=ks, backend=backend)
            runs.append(torch.autograd.grad(logp.sum() + 0.1 * ent.sum(), [hidden, weight, b]))
    finally:
        torch.use_deterministic_algorithms(prev)
    for a, c in zip(*runs):
        assert torch.equal(a, c)
    assert runs[0][1].abs().sum() > 0


def test_opcheck_on_ragged_sets():
    """``fastrl::kept_logprob`` and its backward on the bucketed per-row plan (singletons, empty and masked rows)."""
    ks, t = ragged(24, seed=9)
    ids = ks.padded()
    ids[5] = -1  # an empty set, its token masked
    ks = fastrl.KeptSet.from_padded(ids, V)
    t = t.clone()
    t[5] = -100
    g = torch.Generator().manual_seed(10)
    h = torch.randn(24, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    choice = ks.describe_plan(host_sync=False)
    o = kept.KeptOptions(temperature=0.7, all_live=False)
    fwd = (h, w, None, t, ks.ids, ks.offsets, choice.arg(), *o.pack())
    torch.library.opcheck(torch.ops.fastrl.kept_logprob, fwd)
    with torch.no_grad():
        _, ent, lse, z = torch.ops.fastrl.kept_logprob(*fwd)
    bwd = (torch.randn(24, generator=g), torch.randn(24, generator=g), h.detach(), w.detach(), None, t, ks.ids,
           ks.offsets, z, lse, ent, choice.arg(), *o.pack(), True, True, False)
    torch.library.opcheck(torch.ops.fastrl.kept_logprob_backward, bwd)
