"""pytest-benchmark: fused linear -> per-token log-prob (+ entropy), every provider, forward / backward / both.

    pytest bench/test_linear_logprob.py --benchmark-only          (shape: FASTRL_BENCH_SHAPE="N,H,V,dtype")

``logprob``: log-prob + entropy with gradients (fastrl path A), loss ``sum(logp) + 0.01 sum(entropy)``;
``forward``: log-probs without gradients (fastrl path C); and the floor, one plain [N, H] @ [H, V] GEMM.
"""

from __future__ import annotations

import pytest
import torch

from bench import _pytest as B

LOGPROB_PROVIDERS = ("fastrl", "torch", "torch-compile", "trl", "cce")


@pytest.mark.parametrize("phase", B.PHASES)
@pytest.mark.parametrize("provider", LOGPROB_PROVIDERS)
def test_logprob_entropy(benchmark, provider, phase):
    benchmark.group = f"logprob+entropy {phase}"
    B.run(benchmark, B.workload("logprob"), provider, phase)


@pytest.mark.parametrize("provider", LOGPROB_PROVIDERS)
def test_forward_only(benchmark, provider):
    benchmark.group = "forward-only logprob"
    B.run(benchmark, B.workload("forward"), provider, "fwd")


def test_matmul_floor(benchmark):
    """The floor for this file's shape: [N, H] @ [H, V] in the same dtype, 2NHV FLOPs."""
    n, h, v, dt = B.shape()
    a, b = (torch.randn(*s, device=B.DEVICE).to(getattr(torch, dt)) for s in ((n, h), (h, v)))

    def mm():
        a @ b
        B.sync()

    benchmark.group = "forward-only logprob"
    benchmark.pedantic(mm, rounds=5, warmup_rounds=1)
    B.record(benchmark, 2.0 * n * h * v)
