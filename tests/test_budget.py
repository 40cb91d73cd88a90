"""Tile budgets (fastrl.ops.budget): every path reads its row of ``BUDGETS`` (shrinking the row shrinks that
path's tiles)."""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl.losses import one_pass
from fastrl.ops import budget, divergence, hybrid, kept, rules, torch_backend
from fastrl.ops.budget import TileBudget, tile_budget
from fastrl.ops.config import LogitTransform


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
    assert one_pass._chunk_budget(1000, cpu, True, None) == 5 and one_pass._chunk_budget(1000, cpu, False, None) == 3
    _shrink(monkeypatch, "divergence", elems=8 * 128, rows=4)
    assert [(t.rows.start, t.v0, t.v1) for t in divergence._tiles(8, 300, None)] == [(0, 0, 128), (0, 128, 256),
                                                                                      (0, 256, 300)]
    ks = fastrl.KeptSet.from_lists([[i] for i in range(10)], 100)
    assert [t.rows.start for t in divergence._tiles(10, 100, ks)] == [0, 4, 8]
    _shrink(monkeypatch, "kept", elems=1 << 20, cap=3)
    assert kept._plan(ks, 100, kept.KeptOptions(tf=LogitTransform(), with_entropy=True), cpu) == [
        (0, 3), (3, 6), (6, 9), (9, 10)]
