"""Tile budgets (fastrl.ops.budget) and the plain path's memory plan: regression guards without timing.

* every path reads its row of ``BUDGETS`` (shrinking the row shrinks that path's tiles);
* ``fused_logprobs`` on the torch backend (C1's path) allocates, at its peak, its outputs plus the ``live`` tiles
  of the ``logprob`` budget and O(N) vectors, counted from the CPU allocator's own events (the profiler's memory
  records), not from a clock;
* a fresh process's first eager call of every fastrl op imports no ``torch._dynamo`` (``torch.library.custom_op``
  did: ~170 MB of modules and 1-2 s on C1's first step, the C1 regression of 8f83654).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fastrl
from fastrl.ops import one_pass
from fastrl.ops import budget, divergence_hybrid, divergence_torch, hybrid, kept, rules, torch_backend
from fastrl.ops.budget import TileBudget, tile_budget

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tile_budget_rows_and_bad_path():
    assert tile_budget("logprob").elems == 1 << 22 and tile_budget("logprob").live == 2
    assert tile_budget("kept", "cpu").cap == 2048 and tile_budget("kept", torch.device("cuda")).cap == 8192
    assert tile_budget("one-pass", "cuda").elems == 1 << 28 and tile_budget("one-pass-frozen", "cuda").elems == 1 << 26
    assert tile_budget("rule", "meta") == tile_budget("rule", "cpu")  # every non-CUDA device takes the CPU row
    assert tile_budget("hybrid").nbytes == 256 << 20
    with pytest.raises(ValueError, match=r"path must be one of .*'logprob'.*got 'logprobs'"):
        tile_budget("logprobs")


def _shrink(monkeypatch, path, **kw):
    monkeypatch.setitem(budget.BUDGETS, path, TileBudget(**{"live": 1, **kw}))


def test_every_path_reads_its_budget(monkeypatch):
    cpu = torch.device("cpu")
    _shrink(monkeypatch, "logprob", elems=64 * 256)
    assert torch_backend.tile_columns(64, 10_000) == 256
    _shrink(monkeypatch, "hybrid", elems=64 * 512)
    assert hybrid.tile_columns(64, 10_000) == 512
    _shrink(monkeypatch, "rule", elems=7 * 1000)
    assert rules._rows_per_tile(1000, cpu) == 7
    _shrink(monkeypatch, "one-pass", elems=5 * 1000)
    _shrink(monkeypatch, "one-pass-frozen", elems=3 * 1000)
    assert one_pass.chunk_budget(1000, cpu, True, None) == 5 and one_pass.chunk_budget(1000, cpu, False, None) == 3
    _shrink(monkeypatch, "divergence-hybrid", elems=8 * 256)
    assert divergence_hybrid._cols(8, 10_000) == 256
    # the torch backend's divergence walks fixed [ROW_BLOCK, VOCAB_TILE] tiles (batch invariance), not a budget
    assert [(t.rows.start, t.v0, t.v1) for t in divergence_torch._invariant_tiles(256, 3000)] == [
        (0, 0, 2048), (0, 2048, 3000), (128, 0, 2048), (128, 2048, 3000)]
    # the kept-set engine (fused_logprobs / policy_loss / fused_divergence over a support): its unit cap and tile
    ks = fastrl.KeptSet.from_lists([[i] for i in range(10)], 100)
    _shrink(monkeypatch, "kept", elems=1 << 20, cap=3)
    assert kept.capacity(cpu) == (1 << 20, 3)
    assert kept.chunk_plan(ks, 100, *kept.capacity(cpu)) == [(0, 3), (3, 6), (6, 9), (9, 10)]


def _peak_allocated(fn) -> tuple[int, int]:
    """(peak, end) bytes the CPU allocator held during ``fn()`` above what it held before, from the profiler's
    memory records (each allocation and free with its size, in order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    assert events, "the profiler recorded no allocation: the memory plan cannot be checked"
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_plain_path_memory_plan(softcap):
    """C1's path (torch backend, log-prob + entropy, forward + backward) holds at most the ``logprob`` budget's tiles
    besides its outputs: a third float32 [N, V_blk] tile alive, a [N, V] buffer, or a float32 [V, H] copy of the
    weight fails this. Shape: several vocabulary slices of the real (16 MB) budget."""
    N, H, V = 1024, 64, 16384
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H**0.5).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    b = tile_budget("logprob")
    assert torch_backend.tile_columns(N, V) * N == b.elems and V // torch_backend.tile_columns(N, V) == 4

    def step():
        lp, ent = fastrl.fused_logprobs(h, w, t, backend="torch", softcap=softcap)
        step.grads = torch.autograd.grad(lp.sum() + 0.01 * ent.sum(), (h, w))

    step()  # warm: lazy initialisation is not the op's memory
    peak, end = _peak_allocated(step)
    outputs = sum(x.numel() * x.element_size() for x in step.grads)
    assert end == outputs, f"the step left {end - outputs} bytes allocated besides its gradients"
    tiles = b.nbytes + (b.elems * 4 if softcap is not None else 0)  # softcap's dz/dy is one more tile (it held 3)
    o_n = 64 * N * 4  # O(N) vectors: statistics, masks, per-row scalars
    assert peak - outputs <= tiles + o_n, (
        f"peak {peak / 2**20:.1f} MB = gradients {outputs / 2**20:.1f} MB + {(peak - outputs) / 2**20:.1f} MB; the "
        f"plan allows {tiles / 2**20:.1f} MB of tiles ({b.live} x {b.elems * 4 / 2**20:.0f} MB) + O(N)")


def test_first_eager_call_of_every_op_imports_no_dynamo():
    """The ops are torch.library ops; torch.library.custom_op would import torch._dynamo on each op's first call."""
    script = textwrap.dedent("""
        import sys, torch, fastrl
        B, T, H, V = 2, 8, 16, 64
        h = torch.randn(B, T, H, requires_grad=True); w = torch.randn(V, H, requires_grad=True)
        t = torch.randint(0, V, (B, T)); mask = torch.ones(B, T, dtype=torch.bool)
        seen = []
        lp, ent = fastrl.fused_logprobs(h, w, t); (lp.sum() + ent.sum()).backward()
        seen.append(("fused_logprobs", "torch._dynamo" in sys.modules))
        loss, _ = fastrl.policy_loss(h, w, t, torch.randn(B), mask, config=fastrl.PolicyLossConfig(loss_type="dapo"),
                                     old_logprobs=lp.detach())
        loss.backward()
        seen.append(("policy_loss", "torch._dynamo" in sys.modules))
        v = torch.randn(B, T, requires_grad=True)
        fastrl.value_loss(v, v.detach(), v.detach() + 1, mask, 0.2)[0].backward()
        seen.append(("value_loss", "torch._dynamo" in sys.modules))
        d = fastrl.fused_divergence(h, w, torch.randn(B, T, 24), torch.randn(V, 24), beta=0.5)
        (d[0] if isinstance(d, tuple) else d).sum().backward()
        seen.append(("fused_divergence", "torch._dynamo" in sys.modules))
        print(seen)
        assert not any(s for _, s in seen), seen
    """)
    env = {**os.environ, "FASTRL_BACKEND": "torch"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_marks_device_family_constant_as_torch_would():
    """kernels.tuning marks device_family constant to torch.compile without torch.compiler.assume_constant_result,
    which imports torch._dynamo when fastrl is imported: the mark must be the one torch's decorator sets."""
    from fastrl.kernels import tuning

    def f():
        return 0

    before = set(vars(f))
    torch.compiler.assume_constant_result(f)
    marks = {k: v for k, v in vars(f).items() if k not in before}
    assert marks and all(getattr(tuning.device_family, k, None) == v for k, v in marks.items()), marks


GiB = 1 << 30
W_V = 151936  # W1 / W2 vocabulary


# (device memory GiB, tokens, H) -> (rows per chunk, chunks): the counts the sm90-one-pass row states
ONE_PASS = {
    (80, 16384, 4096): (16384, 1),  # W1: one chunk, no float32 [V, H] accumulator
    (80, 16384, 896): (16384, 1),  # W2
    (80, 24576, 4096): (8192, 3),  # past the 1/16 share: a tile as large as the accumulator (2 H rows)
    (141, 24576, 4096): (24576, 1),  # an H200 holds it in one
    (80, 65536, 4096): (8192, 8),
    (141, 65536, 4096): (8192, 8),
    (80, 131072, 896): (1792, 74),  # W4's 8 x 16384 tokens at H=896: about the memory-unknown rows
    (78, 16384, 4096): (16384, 1),  # what an H100 reports, about
    (139, 24576, 4096): (24576, 1),
    (None, 16384, 4096): (1664, 10),  # memory unknown: the one-pass row (the safe default)
    (None, 131072, 896): (1664, 79),
}


@pytest.mark.parametrize("memory_gib, tokens, H", list(ONE_PASS), ids=[f"{m}GiB-N{n}-H{h}" for m, n, h in ONE_PASS])
def test_sm90_one_pass_chunks_per_device_memory(memory_gib, tokens, H):
    """The sm90-one-pass row: every token in one chunk when its bf16 scaled exps fit 1/16 of the device's memory,
    else whole 128-row blocks of a tile as large as the float32 [V, H] accumulator, within [the one-pass row, the
    share]; the counts the docstring states for W1 / W2 shapes on 80 and 141 GiB devices."""
    total = None if memory_gib is None else memory_gib * GiB
    rows = budget.one_pass_rows(W_V, H, tokens, torch.bfloat16, total_memory=total)
    assert (rows, -(-tokens // rows)) == ONE_PASS[(memory_gib, tokens, H)]
    if total is not None:
        share, tile = total // 16, rows * W_V * 2
        assert tile <= share and (rows == tokens) == (tokens * W_V * 2 <= share)
        if rows != tokens:  # the accumulator's size, in whole blocks, where the share allows
            assert rows == max(1664, min(share // (W_V * 2), 4 * W_V * H // (W_V * 2)) // 128 * 128)


@pytest.mark.parametrize("memory_gib, cols, slices", [(80, 20480, 8), (78, 19968, 8), (141, 36096, 5),
                                                      (139, 35584, 5), (None, 4096, 38)])
def test_sm90_grad_slices_per_device_memory(memory_gib, cols, slices):
    """The sm90-grad row: path A's G slices of 16384 bf16 rows within 1/128 of the device's memory, in whole
    256-column blocks; memory unknown, the hybrid row's 4096 columns."""
    total = None if memory_gib is None else memory_gib * GiB
    c = budget.grad_columns(16384, W_V, torch.bfloat16, total_memory=total)
    assert c == cols and -(-W_V // c) == slices
    if total is not None:
        assert 16384 * c * 2 <= total // 128 < 16384 * (c + 256) * 2


def test_one_pass_chunk_budget_reads_device_memory(monkeypatch):
    """On CUDA the one-pass loss with a trained head takes its speed rows from the device's memory
    (budget.one_pass_rows), cut to the memory budget (tests/test_memory_ceiling.py: by default TRL's memory on the same
    work); 1/16 of the device gives the speed rows back. A frozen head, an explicit chunk_tokens and a CPU keep their
    rows."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(budget, "device_memory", lambda device: 80 * GiB)
    w1 = dict(dtype=torch.bfloat16, tokens=16384, H=4096)
    capped = one_pass.chunk_budget(W_V, cuda, True, None, "triton-sm90", **w1)
    assert 128 <= capped < 16384 and capped % 128 == 0
    previous = budget.set_memory_budget(1 / 16)
    try:
        assert one_pass.chunk_budget(W_V, cuda, True, None, "triton-sm90", **w1) == 16384
        assert one_pass.chunk_budget(W_V, cuda, True, None, "triton-hybrid", **w1) == 4096  # the accumulator's size
    finally:
        budget.set_memory_budget(previous)
    assert one_pass.chunk_budget(W_V, cuda, False, None, "triton-sm90", **w1) == (1 << 26) // W_V // 128 * 128
    assert one_pass.chunk_budget(W_V, cuda, True, 512, "triton-sm90", **w1) == 512
    assert one_pass.chunk_budget(W_V, torch.device("cpu"), True, None, "triton-sm90", **w1) == (8 << 20) // W_V
    monkeypatch.setattr(budget, "device_memory", lambda device: None)  # unknown: the one-pass row, within the ceiling
    assert one_pass.chunk_budget(W_V, cuda, True, None, "triton-sm90", **w1) == 1664
    assert budget.device_memory(torch.device("cpu")) is None