"""What the pytest-benchmark files share: the shape under test and one in-process measurement.

``pytest bench/ --benchmark-only`` times in this process (pytest-benchmark's way); ``python -m bench`` isolates every
provider in a fresh process and measures CPU memory. Shapes: CPU-sized on CPU, W1's on CUDA; override with
``FASTRL_BENCH_SHAPE="N,H,V,dtype"``. FLOPs: forward 2NHV, backward 4NHV, both 6NHV (``bench.workloads.flops``);
TFLOP/s is in each benchmark's extra_info.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from bench import providers as P
from bench.measure import MB
from bench.workloads import Workload, flops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_DEFAULT = {"cuda": (16384, 4096, 151936, "bfloat16"), "cpu": (1024, 256, 16384, "float32")}
PHASES = ("fwd", "bwd", "fwd+bwd")


def shape() -> tuple[int, int, int, str]:
    env = os.environ.get("FASTRL_BENCH_SHAPE")
    if not env:
        return _DEFAULT[DEVICE]
    try:
        n, h, v, dt = env.split(",")
        return int(n), int(h), int(v), dt.strip()
    except ValueError:
        raise pytest.UsageError(f"FASTRL_BENCH_SHAPE must be 'N,H,V,dtype', got {env!r}") from None


def workload(kind: str, batch: int = 1) -> Workload:
    n, h, v, dt = shape()
    return Workload(f"pytest-{kind}", kind, n, h, v, dt, batch=batch if kind == "loss" else 1)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def record(benchmark, flop_count: float, **info) -> bool:
    """FLOPs, TFLOP/s and ``info`` into the benchmark's extra_info; False under --benchmark-disable (each function
    ran once as a smoke test, nothing was timed)."""
    if benchmark.stats is None:
        return False
    median_s = benchmark.stats.stats.median
    benchmark.extra_info.update(flops=flop_count, tflops=flop_count / median_s / 1e12 if median_s > 0 else None, **info)
    return True


def run(benchmark, wl: Workload, provider: str, phase: str) -> None:
    """Benchmark one phase ('fwd', 'bwd', 'fwd+bwd'; forward workloads: 'fwd') of one provider, or skip saying why."""
    prov, dev = P.get(provider), torch.device(DEVICE)
    why = prov.unavailable(wl, DEVICE)
    if why:
        pytest.skip(f"{provider}: {why[0]}: {why[1]}")
    try:
        op = prov.build(wl, dev, {})
    except P.ProviderUnavailable as e:
        pytest.skip(f"{provider}: {e}")
    cycle = itertools.cycle([op.prepare(P.make_inputs(wl, dev, seed)) for seed in range(2 if DEVICE == "cpu" else 3)])

    def forward(backward: bool = False):  # also the untimed forward before each timed backward (its setup)
        st = next(cycle)
        with torch.set_grad_enabled(op.needs_grad):
            out = op.forward(st)
            if backward:
                torch.autograd.grad(out["loss"], st["wrt"])
        sync()
        return (out, st), {}

    def backward(out, st):
        torch.autograd.grad(out["loss"], st["wrt"])
        sync()

    try:
        forward(op.needs_grad)  # warm-up: compiles, autotunes
    except Exception as e:  # noqa: BLE001
        if prov.compile_fails_skip:
            pytest.skip(f"torch.compile failed on {DEVICE}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        raise
    rounds = 3 if DEVICE == "cpu" else 10
    if phase == "bwd":
        benchmark.pedantic(backward, setup=forward, rounds=rounds, warmup_rounds=0)
    else:
        benchmark.pedantic(forward, args=(phase == "fwd+bwd",), rounds=rounds, warmup_rounds=1)
    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    timed = record(benchmark, flops(wl, {"fwd+bwd": "total"}.get(phase, phase)), provider=provider, phase=phase,
                   N=wl.N, H=wl.H, V=wl.V, dtype=wl.dtype, device=device, torch=torch.__version__,
                   notes="; ".join(op.notes))
    if timed and DEVICE == "cuda":  # peak extra memory of one fwd+bwd: max allocated minus what was held before
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward(op.needs_grad)
        benchmark.extra_info["peak_extra_mb_incl_outputs"] = (torch.cuda.max_memory_allocated() - base) / MB
