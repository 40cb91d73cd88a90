"""What the pytest-benchmark files share: the shape under test and one in-process measurement.

``pytest bench --benchmark-only`` times in this process (pytest-benchmark's way); the CLI
(``python -m bench``) is the one that isolates every provider in a fresh process and measures CPU memory.
Shapes: a CPU-sized default on CPU, W1's on CUDA; override with ``FASTRL_BENCH_SHAPE="N,H,V,dtype"``.
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


def run(benchmark, wl: Workload, provider: str, phase: str) -> None:
    """Benchmark one phase ('fwd', 'bwd', 'fwd+bwd'; forward workloads: 'fwd') of one provider, or skip saying why."""
    prov = P.get(provider)
    why = prov.unavailable(wl, DEVICE)
    if why:
        pytest.skip(f"{provider}: {why[0]}: {why[1]}")
    dev = torch.device(DEVICE)
    try:
        op = prov.build(wl, dev, {})
    except P.ProviderUnavailable as e:
        pytest.skip(f"{provider}: {e}")
    states = [op.prepare(P.make_inputs(wl, dev, seed)) for seed in range(2 if DEVICE == "cpu" else 3)]
    cycle = itertools.cycle(states)

    def fwd():
        with torch.set_grad_enabled(op.needs_grad):
            op.forward(next(cycle))
        sync()

    def both():
        with torch.set_grad_enabled(op.needs_grad):
            st = next(cycle)
            out = op.forward(st)
            torch.autograd.grad(out["loss"], st["wrt"])
        sync()

    def setup_bwd():  # an untimed forward before each timed backward
        st = next(cycle)
        with torch.set_grad_enabled(op.needs_grad):
            out = op.forward(st)
        sync()
        return (out, st), {}

    def bwd(out, st):
        torch.autograd.grad(out["loss"], st["wrt"])
        sync()

    try:
        both() if op.needs_grad else fwd()  # warm-up: compiles, autotunes
    except Exception as e:  # noqa: BLE001
        if prov.compile_fails_skip:
            pytest.skip(f"torch.compile failed on {DEVICE}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        raise

    rounds = 3 if DEVICE == "cpu" else 10
    if phase == "fwd":
        benchmark.pedantic(fwd, rounds=rounds, warmup_rounds=1)
    elif phase == "fwd+bwd":
        benchmark.pedantic(both, rounds=rounds, warmup_rounds=1)
    else:
        benchmark.pedantic(bwd, setup=setup_bwd, rounds=rounds, warmup_rounds=0)

    if benchmark.stats is None:  # --benchmark-disable: each op ran once as a smoke test, nothing was timed
        return
    # FLOPs: forward 2NHV, backward 4NHV, both 6NHV (bench/workloads.py)
    key = {"fwd": "fwd", "bwd": "bwd", "fwd+bwd": "total"}[phase]
    f = flops(wl, key)
    median_s = benchmark.stats.stats.median
    benchmark.extra_info.update({
        "provider": provider, "phase": phase, "N": wl.N, "H": wl.H, "V": wl.V, "dtype": wl.dtype,
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
        "flops": f, "tflops": f / median_s / 1e12 if median_s > 0 else None, "notes": "; ".join(op.notes),
    })
    if DEVICE == "cuda":  # peak extra memory of one fwd+bwd: max allocated minus what was held before
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        both() if op.needs_grad else fwd()
        benchmark.extra_info["peak_extra_mb_incl_outputs"] = (torch.cuda.max_memory_allocated() - base) / MB
