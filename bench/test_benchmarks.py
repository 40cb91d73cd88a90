"""pytest-benchmark over the providers, timed in this process: ``pytest bench/ --benchmark-only``
(``--benchmark-disable``: each once, as a smoke test); what each one runs: bench/README.md. ``python -m bench`` is
the one that isolates every provider in a fresh process and measures memory.
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
LOGPROB_PROVIDERS = ("fastrl", "torch", "torch-compile", "trl", "cce")
LOSS_PROVIDERS = ("fastrl-fused", "fastrl", "torch", "torch-compile", "trl", "liger-fused", "liger-triton")


def shape() -> tuple[int, int, int, str]:
    env = os.environ.get("FASTRL_BENCH_SHAPE")
    if not env:
        return _DEFAULT[DEVICE]
    try:
        n, h, v, dt = env.split(",")
        return int(n), int(h), int(v), dt.strip()
    except ValueError:
        raise pytest.UsageError(f"FASTRL_BENCH_SHAPE must be 'N,H,V,dtype', got {env!r}") from None


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def record(benchmark, flop_count: float, **info) -> bool:
    """FLOPs, TFLOP/s and ``info`` into the benchmark's extra_info; False under --benchmark-disable (nothing timed)."""
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


# (kind, provider, phase) -> its pytest-benchmark group
CASES = {**{("logprob", p, ph): f"logprob+entropy {ph}" for p in LOGPROB_PROVIDERS for ph in PHASES},
         **{("forward", p, "fwd"): "forward-only logprob" for p in LOGPROB_PROVIDERS},
         **{("loss", p, ph): f"grpo loss {ph}" for p in LOSS_PROVIDERS for ph in PHASES}}


@pytest.mark.parametrize("kind,provider,phase", list(CASES))
def test_provider(benchmark, kind, provider, phase):
    n, h, v, dt = shape()
    benchmark.group = CASES[kind, provider, phase]
    batch = (16 if DEVICE == "cuda" else 8) if kind == "loss" else 1  # loss: N tokens in `batch` sequences
    run(benchmark, Workload(f"pytest-{kind}", kind, n, h, v, dt, batch=batch), provider, phase)


def test_matmul_floor(benchmark):
    """The floor for this shape: [N, H] @ [H, V] in the same dtype, 2NHV FLOPs."""
    n, h, v, dt = shape()
    a, b = (torch.randn(*s, device=DEVICE).to(getattr(torch, dt)) for s in ((n, h), (h, v)))

    def mm():
        a @ b
        sync()

    benchmark.group = "forward-only logprob"
    benchmark.pedantic(mm, rounds=5, warmup_rounds=1)
    record(benchmark, 2.0 * n * h * v)
