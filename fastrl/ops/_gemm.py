"""GEMMs whose products are never rounded to the input dtype: float32 results from bf16/fp16 operands.

On CUDA with a torch that has ``torch.mm(..., out_dtype=torch.float32)`` (2.8+), cuBLAS multiplies the 2-byte
operands on the tensor cores, accumulates in float32 and writes float32: the logits keep every bit the
accumulator had, at the speed of a bf16 GEMM. Elsewhere (CPU, older torch) the operands are upcast first,
which gives the same products (bf16 x bf16 is exact in float32) at float32 speed.
"""

from __future__ import annotations

import functools

import torch

from fastrl.ops.backend import cuda_f32_out
from fastrl.ops.budget import COMPENSATED_SLICE_BYTES

__all__ = ["cuda_f32_out", "mm_f32", "addmm_f32", "compensated_addmm_", "COMPENSATED_SLICE_BYTES"]


@functools.cache
def _addmm_mixed_ok() -> bool:
    """``addmm(fp32 acc, bf16, bf16, out_dtype=fp32)``: the overload exists from torch 2.8, but before 2.10 it
    refuses an accumulator whose dtype differs from the operands' ("self and mat2 must have the same dtype")."""
    try:
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    except ValueError:  # pragma: no cover - unusual version strings
        return False
    return (major, minor) >= (2, 10) and "dtype_out" in torch.ops.aten.addmm.overloads()


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` with ``out`` float32 (or float64 for float64 operands), never rounding the product."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    if cuda_f32_out(out.device) and out.dtype == torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(_f32(a), _f32(b), out=out)


def addmm_f32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` into a float32 (float64) accumulator, never rounding the product to the input dtype."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if cuda_f32_out(acc.device) and acc.dtype == torch.float32:
        if _addmm_mixed_ok():
            return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return acc.add_(torch.mm(a, b, out_dtype=torch.float32))  # torch 2.8 / 2.9: a temporary, then the sum
    return acc.addmm_(_f32(a), _f32(b))


def compensated_addmm_(hi: torch.Tensor, lo: torch.Tensor, a: torch.Tensor, b: torch.Tensor, triton: bool) -> None:
    """``hi + lo += a @ b`` for a bf16 sum kept as two bf16 halves (``fastrl.kernels.compensated``: half the bytes
    of a float32 accumulator beside the gradient, which ``hi`` is at the end): ``[V, H]`` halves, ``a`` [V, K],
    ``b`` [K, H]. The product goes through a float32 slice of at most ``COMPENSATED_SLICE_BYTES`` (cache-sized), one
    GEMM and one combine per slice; ``triton``: the combine as one Triton kernel, else torch (the CPU's path)."""
    V, H = hi.shape
    rows = max(1, min(V, COMPENSATED_SLICE_BYTES // (4 * max(H, 1))))
    buf = torch.empty((rows, H), dtype=torch.float32, device=hi.device)
    if triton:
        from fastrl.kernels.compensated import compensated_add_
    else:
        tmp = torch.empty_like(buf)  # the running sum of a slice in float32
    for v0 in range(0, V, rows):
        v1 = min(v0 + rows, V)
        p = mm_f32(a[v0:v1], b, out=buf[: v1 - v0])
        h, l = hi[v0:v1], lo[v0:v1]
        if triton:
            compensated_add_(h, l, p)
            continue
        s = tmp[: v1 - v0].copy_(h).add_(l).add_(p)  # hi + lo exact in float32; one rounding for + p
        h.copy_(s)
        l.copy_(s.sub_(h))
