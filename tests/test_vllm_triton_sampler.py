"""vLLM's Triton top-k/top-p kernel (``apply_top_k_top_p_triton``: what Model Runner V2 runs on a GPU, and whose
survivors become the sampling masks ``kept_set`` replay reads) against fastrl's rule replay (``apply_rule(order=
"vllm")``), run in Triton's interpreter on CPU tensors, one rule per row, for the rule grid the vLLM tests use.

Runs in the vLLM environment (``bash .ci/vllm-env.sh``; ``.ci/run`` runs it there, where a missing vLLM fails);
skipped, saying so, anywhere else (tests/vllm_harness.py).

What it holds (docs/vllm-support.md: vLLM's Triton sampler and replay):
* rows without ties at the cut (random logits, -inf entries, peaked logits): the same ids, every rule of the grid;
* a tie at the cut: the kernel keeps exactly k ids, every id above the k-th largest logit and then the tied ones in
  increasing id order, and top-p cuts inside a tie group the same way; fastrl's rule (vLLM's PyTorch sampler's tie
  rule) keeps every tied id, so its set holds the kernel's. ``kept_set`` replay reads vLLM's masks and so follows
  the kernel exactly; ``rule`` replay is a superset where logits tie at the cut (bf16 logits tie often);
* a tie group that fills most of the row at the cut (249 of 256 ids): the kernel drops it whole and keeps fewer
  than k ids (vLLM's behaviour; fastrl's rule keeps them all).
"""

from __future__ import annotations

import pytest
import torch

from vllm_harness import require_vllm

vllm = require_vllm()

from fastrl import testing_vllm as vllm_cpu  # noqa: E402
from fastrl.ops.rules import apply_rule  # noqa: E402
from fastrl.ops.support import SamplerRule  # noqa: E402

V = 256
# top_k (V: off) x top_p (1.0: off): the values tests/test_vllm_*.py sample with, and both ends
RULES = [(k, p) for k in (1, 5, 20, V) for p in (0.9, 0.97, 1.0)]


def vllm_triton_masks(logits: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:  # [R, V] bool
    """The ids vLLM's Triton top-k/top-p kernel leaves finite, one rule per row (vLLM's per-request k and p)."""
    from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton

    with vllm_cpu.interpreter_tensor_ranges():
        out = apply_top_k_top_p_triton(logits.float().clone(), torch.tensor(ks, dtype=torch.int32),
                                       torch.tensor(ps, dtype=torch.float32))
    return out > float("-inf")


def fastrl_masks(logits: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:  # [R, V] bool
    return torch.cat([apply_rule(row[None].double(), SamplerRule(top_k=k if k < V else 0, top_p=p, order="vllm"))
                      for row, k, p in zip(logits.float(), ks, ps)])


def grid(rows: list[torch.Tensor]):
    """Every rule of RULES on every row: (logits [R, V], ks, ps)."""
    logits = torch.stack([r for r in rows for _ in RULES])
    ks = [k for _ in rows for k, _ in RULES]
    ps = [p for _ in rows for _, p in RULES]
    return logits, ks, ps


@pytest.fixture(scope="module")
def untied_and_tied():
    """One kernel launch for every row of both tests (the interpreter's start-up is per launch)."""
    g = torch.Generator().manual_seed(0)
    untied = [torch.randn(V, generator=g) * 3, torch.randn(V, generator=g) * 8]
    masked = torch.randn(V, generator=g) * 2
    masked[::3] = float("-inf")  # ids an earlier stage (min_p, bad words) removed
    untied.append(masked)
    tied = [(torch.randn(V, generator=g) * 2).round()]  # many ids per value: ties at every cut
    logits, ks, ps = grid(untied + tied)
    got = vllm_triton_masks(logits, ks, ps)
    n = len(untied) * len(RULES)
    return (logits[:n], ks[:n], ps[:n], got[:n]), (logits[n:], ks[n:], ps[n:], got[n:])


def test_no_tie_at_the_cut_same_masks(untied_and_tied):
    (logits, ks, ps, got), _ = untied_and_tied
    assert len({tuple(x) for x in zip(logits[:, 0].tolist(), ks, ps)}) == len(ks)
    for row in logits:  # the premise: no two finite logits equal
        finite = row[row > float("-inf")]
        assert finite.unique().numel() == finite.numel()
    want = fastrl_masks(logits, ks, ps)
    bad = [(ks[i], ps[i], int(want[i].sum()), int(got[i].sum())) for i in range(len(ks))
           if not torch.equal(got[i], want[i])]
    assert not bad, f"(top_k, top_p, fastrl's count, vLLM Triton's count) where the masks differ: {bad}"
    assert {int(g.sum()) for g in got} > {1}, "every rule kept one id: the grid tells nothing"


def test_ties_at_the_cut_vllm_keeps_exactly_k_in_id_order(untied_and_tied):
    _, (logits, ks, ps, got) = untied_and_tied
    want = fastrl_masks(logits, ks, ps)
    strict_subsets = split = 0
    for i, (k, p) in enumerate(zip(ks, ps)):
        assert not (got[i] & ~want[i]).any(), f"top_k={k}, top_p={p}: vLLM kept ids fastrl's rule dropped"
        strict_subsets += int(got[i].sum() < want[i].sum())
        if p == 1.0 and k < V:  # top-k alone: exactly k, the k-th value's ties taken lowest id first
            row = logits[i]
            kth = row.sort(descending=True).values[k - 1]
            above = (row > kth).nonzero().flatten().tolist()
            tied = (row == kth).nonzero().flatten().tolist()
            expected = sorted(above + tied[: k - len(above)])
            assert got[i].nonzero().flatten().tolist() == expected, f"top_k={k}"
            split += len(tied) > k - len(above)
    assert split >= 2, "top-k never cut inside a tie group: the id-order check would tell nothing"
    assert strict_subsets >= len(ks) // 2, "the ties never mattered: the test would not see the tie rule"


def test_a_tie_group_filling_the_row_is_dropped_whole():
    row = torch.zeros(V)
    row[:7] = 1.0  # 7 ids above, 249 tied at the cut of top_k=20
    got = vllm_triton_masks(row[None], [20], [1.0])[0]
    assert got.nonzero().flatten().tolist() == list(range(7)), "vLLM's kernel changed its tie handling: update " \
        "docs/vllm-support.md"
    assert bool(fastrl_masks(row[None], [20], [1.0])[0].all())  # fastrl's rule keeps every tied id
