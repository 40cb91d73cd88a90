"""One dispatcher for every op: which backend computes on these tensors.

* ``triton-hybrid``: cuBLAS (``torch.mm`` with a float32 output) computes tiles of raw logits and two Triton
  kernels fold them into row statistics and turn them into ``G = dL/dy`` (``fastrl.kernels.logits_fold``).
* ``triton-fused``: Triton kernels that compute the logits tiles with ``tl.dot`` and consume them in
  registers, never storing a logit (``fastrl.kernels.linear_logprob``).
* ``triton``: either of the two, chosen here (``choose_triton``): hybrid where cuBLAS can write float32
  logits from bf16 operands (CUDA, torch >= 2.8), fused otherwise. On an H100 cuBLAS ran those GEMMs at
  701 TFLOP/s (H=4096) where the fused forward reached 486 (docs/gpu-map.md); the fused kernels stay
  selectable by name so both can be measured side by side (``python -m bench gpu``).
* ``torch``: a chunked pure-PyTorch path that also never materialises ``[N, V]``; the default on CPU.

The Triton backends run on CUDA tensors, or on CPU tensors when Triton's interpreter is on
(``TRITON_INTERPRET=1`` set before fastrl's kernels are imported), which is how the test-suite checks the
kernels without a GPU. ``FASTRL_BACKEND`` overrides the default for the whole process; a ``backend=``
argument overrides both.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from fastrl.ops._gemm import cuda_f32_out

BACKENDS = ("triton", "triton-hybrid", "triton-fused", "torch")
CONCRETE = ("triton-hybrid", "triton-fused", "torch")

__all__ = ["BACKENDS", "CONCRETE", "resolve_backend", "choose_triton", "is_triton"]


# looked up once (find_spec does not import triton): a module constant also lets torch.compile trace the dispatch
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def _triton_available() -> bool:
    return _TRITON_AVAILABLE


def is_triton(name: str) -> bool:
    return name.startswith("triton")


def choose_triton(device: torch.device) -> str:
    """The Triton implementation ``backend="triton"`` means on this device (see the module docstring)."""
    if device.type == "cuda":
        return "triton-hybrid" if cuda_f32_out(device) else "triton-fused"
    return "triton-hybrid"  # the interpreter mirrors what a current CUDA install runs


def resolve_backend(device: torch.device, requested: str | None = None) -> str:
    """The concrete backend ("triton-hybrid", "triton-fused" or "torch") that computes on ``device``."""
    name = requested if requested is not None else os.environ.get("FASTRL_BACKEND", "auto")
    name = (name or "auto").lower()
    if name not in BACKENDS + ("auto",):
        raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {name!r} (from FASTRL_BACKEND or backend=)")
    if name == "auto":
        if device.type == "cuda" and _triton_available():
            return choose_triton(device)
        return "torch"
    if is_triton(name):
        if not _triton_available():
            raise RuntimeError(f"backend {name!r} was requested but Triton is not installed")
        if device.type == "cpu":
            from fastrl.kernels import linear_logprob

            if not linear_logprob.INTERPRET:
                raise RuntimeError(
                    f"backend {name!r} on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                    "before fastrl's kernels are first imported, or use backend 'torch'"
                )
        elif device.type != "cuda":
            raise RuntimeError(f"backend {name!r} runs on CUDA (or CPU under TRITON_INTERPRET=1), got {device}")
        if name == "triton":
            return choose_triton(device)
    return name
