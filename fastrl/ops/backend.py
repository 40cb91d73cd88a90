"""One dispatcher for every op: which backend computes on these tensors.

* ``triton``: the Triton kernels in ``fastrl.kernels``; on CUDA tensors, or on CPU tensors when Triton's
  interpreter is on (``TRITON_INTERPRET=1`` set before fastrl's kernels are imported), which is how the
  test-suite checks the kernels without a GPU.
* ``torch``: a chunked pure-PyTorch path that also never materialises ``[N, V]``; the default on CPU.

``FASTRL_BACKEND=triton|torch`` overrides the choice for the whole process; a ``backend=`` argument
overrides both.
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("triton", "torch")

__all__ = ["BACKENDS", "resolve_backend"]


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(device: torch.device, requested: str | None = None) -> str:
    name = requested if requested is not None else os.environ.get("FASTRL_BACKEND", "auto")
    name = (name or "auto").lower()
    if name not in BACKENDS + ("auto",):
        raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {name!r} (from FASTRL_BACKEND or backend=)")
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "triton":
        if not _triton_available():
            raise RuntimeError("backend 'triton' was requested but Triton is not installed")
        if device.type == "cpu":
            from fastrl.kernels import linear_logprob

            if not linear_logprob.INTERPRET:
                raise RuntimeError(
                    "backend 'triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                    "before fastrl's kernels are first imported, or use backend 'torch'"
                )
        elif device.type != "cuda":
            raise RuntimeError(f"backend 'triton' runs on CUDA (or CPU under TRITON_INTERPRET=1), got {device}")
    return name
