"""pytest-benchmark: fused linear -> per-token log-prob (+ entropy), every provider, forward / backward / both.

    pytest bench/test_linear_logprob.py --benchmark-only          (shape: FASTRL_BENCH_SHAPE="N,H,V,dtype")

``logprob``: log-prob + entropy with gradients (fastrl path A), loss ``sum(logp) + 0.01 sum(entropy)``;
``forward``: log-probs without gradients (fastrl path C). FLOPs per phase: forward 2NHV, backward 4NHV,
both 6NHV (``bench.workloads.flops``); TFLOP/s is in each benchmark's extra_info.
The matmul floor is measured alongside: one plain [N, H] @ [H, V] GEMM of the same shape.
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
    dev = torch.device(B.DEVICE)
    a = torch.randn(n, h, device=dev).to(getattr(torch, dt))
    b = torch.randn(h, v, device=dev).to(getattr(torch, dt))

    def mm():
        a @ b
        B.sync()

    benchmark.group = "forward-only logprob"
    benchmark.pedantic(mm, rounds=5, warmup_rounds=1)
    benchmark.extra_info.update({"flops": 2.0 * n * h * v, "tflops": 2.0 * n * h * v / benchmark.stats.stats.median / 1e12})
