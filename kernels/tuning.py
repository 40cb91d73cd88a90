"""Launch configurations of the fused kernels: a fixed table per GPU family, autotuning only on request.

A configuration is (BLOCK_N, BLOCK_V, BLOCK_H, num_warps, num_stages). The defaults are a table keyed on the
GPU family and on whether the tiles come through TMA descriptors; ``FASTRL_AUTOTUNE=1`` instead times every
candidate once per (kernel, family, H, V, dtype, variant) in this process and keeps the fastest (keyed on the
model's H and V only, never on the token count, so an RL batch of a new length does not re-tune).

Where the table's numbers come from (docs/gpu-map.md): on an H100 (torch 2.11, triton 3.6, bf16) the fused
forward ran fastest at 128x256x64 with 8 warps and 3 stages (2.2x the 64x128 tile at H=4096) and the gradient
kernel at 128x256x64, 8 warps, 4 stages. Those timings were taken with the older pointer-load kernels; the
TMA kernels use the same tiles, and compiled offline for sm_90 (``python -m bench sass``) they hold them in
registers without spills. Ampere and other families keep the 64x128x64 tile, which fits their shared memory
and was never measured to lose. The interpreter runs real block sizes too (the CPU tests check these tiles).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["KernelConfig", "CONFIGS", "CANDIDATES", "gpu_family", "variant_of", "config_for", "autotune_enabled"]


@dataclass(frozen=True)
class KernelConfig:
    block_n: int
    block_v: int
    block_h: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_n}x{self.block_v}x{self.block_h} w{self.num_warps} s{self.num_stages}"


_SMALL = KernelConfig(64, 128, 64, 8, 3)
_MID = KernelConfig(128, 128, 64, 8, 3)
_FP32 = KernelConfig(64, 64, 32, 8, 2)  # IEEE float32 dots run on the FMA units: small tiles, few stages

# (kernel, family, tma, variant) -> config. "kernel": "stats" (fused forward) or "grad" (fused recompute + G);
# "variant": "fp32" (float32 inputs), "softcap" (the tanh epilogue needs more registers), "bias", else "default".
CONFIGS: dict[tuple[str, str, bool, str], KernelConfig] = {}
for _k in ("stats", "grad"):
    for _fam in ("sm90", "other", "interpreter"):
        for _tma in (True, False):
            CONFIGS[(_k, _fam, _tma, "default")] = _SMALL
            CONFIGS[(_k, _fam, _tma, "softcap")] = _SMALL
            CONFIGS[(_k, _fam, _tma, "bias")] = _SMALL
            CONFIGS[(_k, _fam, _tma, "fp32")] = _SMALL if _fam == "interpreter" else _FP32
# Hopper with TMA: the measured tiles; the tanh epilogue of a softcap does not fit 128x256 in registers
CONFIGS[("stats", "sm90", True, "default")] = KernelConfig(128, 256, 64, 8, 3)
CONFIGS[("grad", "sm90", True, "default")] = KernelConfig(128, 256, 64, 8, 4)
CONFIGS[("stats", "sm90", True, "softcap")] = _MID
CONFIGS[("grad", "sm90", True, "softcap")] = _MID
# a bias adds a [BLOCK_V] row to the epilogue: the forward keeps 128x256; the gradient kernel spilled 7 registers
# there under Triton 3.6 (torch 2.11's), so it takes 128x128
CONFIGS[("stats", "sm90", True, "bias")] = KernelConfig(128, 256, 64, 8, 3)
CONFIGS[("grad", "sm90", True, "bias")] = _MID


def variant_of(dtype: torch.dtype, has_softcap: bool, has_bias: bool = False) -> str:
    if dtype == torch.float32:
        return "fp32"
    if has_softcap:
        return "softcap"
    return "bias" if has_bias else "default"



# What FASTRL_AUTOTUNE=1 tries (kept short: every candidate compiles once per key).
CANDIDATES: tuple[KernelConfig, ...] = (
    KernelConfig(128, 256, 64, 8, 3),
    KernelConfig(128, 256, 64, 8, 4),
    KernelConfig(128, 128, 64, 8, 3),
    KernelConfig(128, 128, 64, 4, 4),
    KernelConfig(64, 256, 64, 8, 3),
    KernelConfig(64, 128, 64, 8, 3),
)


# Hopper and Blackwell data-centre parts (H100/H200, B200/GB200, B300): TMA and ~227 KB of shared memory per
# block, which the 128x256 tiles need (144 KB / 192 KB). Consumer Blackwell (sm_120/121) has TMA but ~99 KB.
_BIG_SMEM_CAPS = {(9, 0), (10, 0), (10, 3)}


def gpu_family(device: torch.device) -> str:
    """'sm90' for the big-shared-memory data-centre parts above, 'other' for every other GPU, 'interpreter' for
    CPU tensors."""
    if device.type != "cuda":
        return "interpreter"
    return "sm90" if torch.cuda.get_device_capability(device) in _BIG_SMEM_CAPS else "other"


def autotune_enabled() -> bool:
    return os.environ.get("FASTRL_AUTOTUNE", "0") == "1"


_TUNED: dict[tuple, KernelConfig] = {}


def config_for(kernel: str, device: torch.device, *, H: int, V: int, dtype: torch.dtype, use_tma: bool,
               has_bias: bool = False, has_softcap: bool = False, with_entropy: bool = True,
               launch=None) -> KernelConfig:
    """The launch configuration for ``kernel`` on ``device`` at this H, V and dtype.

    With ``FASTRL_AUTOTUNE=1`` on a GPU and a ``launch(config)`` callable (one idempotent launch), every
    candidate is timed once per key and the fastest is kept for the rest of the process.
    """
    family = gpu_family(device)
    default = CONFIGS[(kernel, family, use_tma, variant_of(dtype, has_softcap, has_bias))]
    if launch is None or family == "interpreter" or not autotune_enabled():
        return default
    key = (kernel, family, use_tma, H, V, dtype, has_bias, has_softcap, with_entropy)
    if key not in _TUNED:
        _TUNED[key] = _time_candidates(launch, default)
    return _TUNED[key]


def _time_candidates(launch, default: KernelConfig) -> KernelConfig:
    import triton.testing

    best, best_ms = default, float("inf")
    for cfg in dict.fromkeys((default,) + CANDIDATES):
        try:
            ms = triton.testing.do_bench(lambda: launch(cfg), warmup=5, rep=20)
        except Exception:  # noqa: BLE001 - a config this GPU cannot run (shared memory, registers) is skipped
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best
