"""pytest-benchmark over the core ops in this process, built by the same op builders ``python -m bench`` measures in
fresh processes (docs/benchmarks.md, "pytest-benchmark"): ``pip install -e ".[bench]"``, then

    pytest bench/ --benchmark-only [--benchmark-autosave] [--benchmark-compare]

CPU: small float32 shapes (N=512, H=128, V=8192); CUDA: W1's head in bf16. ``python -m pytest`` never runs these
(its testpaths is tests/).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from bench import divergence, keptset, measure
from bench import providers as P
from bench.workloads import Workload

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
N, H, V, DTYPE = (16384, 4096, 151936, "bfloat16") if CUDA else (512, 128, 8192, "float32")
# op -> who is timed on it: fastrl and its peers (bench/providers.py, bench/divergence.py, bench/keptset.py)
CASES = {
    "logprob": ("fastrl", "torch", "trl"),  # log-probs + entropy, forward + backward (path A)
    "loss": ("fastrl-fused", "fastrl", "torch", "trl", "liger-fused"),  # W1's GRPO loss; fastrl-fused: one pass
    "divergence": ("fastrl", "torch", "trl", "liger"),  # the generalized JSD at beta 0.5, student and teacher heads
    "kept": ("kept", "full"),  # K=64 Zipf sets against the full vocabulary
}


def _op(op: str, who: str) -> tuple:
    """(``who``'s op on ``op``, its inputs by seed), or a skip saying why it cannot run here."""
    if op == "divergence":
        wl = replace(divergence.workloads(DEVICE.type, betas=(0.5,))[0], N=N, H=H, Ht=H + H // 2, V=V)
        why = divergence.provider_unavailable(who, DEVICE.type)
        if why:
            pytest.skip(f"{who}: {why}")
        return divergence.build_op(wl, who, {}), lambda seed: divergence.make_inputs(wl, DEVICE, seed)
    wl, prov = Workload(f"bench-{op}", op, N, H, V, DTYPE, batch=8 if op == "loss" else 1), P.get(who)
    why = prov.unavailable(wl, DEVICE.type)
    if why:
        pytest.skip(f"{who}: {why[0]}: {why[1]}")
    try:
        return prov.build(wl, DEVICE, {"liger_compiled": CUDA}), lambda seed: P.make_inputs(wl, DEVICE, seed)
    except P.ProviderUnavailable as e:
        pytest.skip(f"{who}: {e}")


def _step(op: str, who: str):
    """One forward + backward of ``who`` on ``op``, the inputs rotated over two seeds."""
    if op == "kept":
        return keptset.build(dict(mode=who, K=64, sets="zipf", N=N, H=H, V=V, dtype=DTYPE, device=DEVICE.type))[0]
    fn, inputs = _op(op, who)
    states = itertools.cycle([fn.prepare(inputs(seed)) for seed in range(2)])

    def step():
        st = next(states)
        torch.autograd.grad(fn.forward(st)["loss"], st["wrt"])
    return step


@pytest.mark.parametrize("op,who", [(op, who) for op, whos in CASES.items() for who in whos])
def test_op(benchmark, op, who):
    step = _step(op, who)
    benchmark.group = f"{op} N={N} H={H} V={V} {DTYPE} on {DEVICE.type}"
    benchmark.extra_info.update(op=op, who=who, N=N, H=H, V=V, dtype=DTYPE,
                                device=torch.cuda.get_device_name() if CUDA else "cpu")
    # time and memory together: one step's extra peak (CUDA: allocated; CPU: RSS), warm-up included (compiling)
    benchmark.extra_info["peak_extra_mb"] = measure.time_steps(step, 1, 1, CUDA)["extra_mb"]
    benchmark.pedantic(lambda: measure.wall_ms(step, CUDA), rounds=20 if CUDA else 5, warmup_rounds=1)
