"""A bf16 sum kept as two bf16 halves: ``hi + lo``, where ``hi`` is the sum rounded to bf16 and ``lo`` what rounding
left over, rounded to bf16 too.

The one-pass loss adds one product ``P = G^T h`` (float32, from cuBLAS) per token chunk into the weight gradient.
A float32 ``[V, H]`` accumulator costs ``4 V H`` bytes besides the bf16 gradient it is cast to (2.4 GB at
V=151936, H=4096). Keeping the running sum as ``hi + lo`` instead costs ``2 V H`` bytes besides ``hi``, which *is*
the gradient at the end: ``hi + lo`` is exact in float32 (``|lo| <= ulp(hi) / 2``, 16 significant bits in all),
each step ``s = (hi + lo) + P`` rounds once in float32 and then splits, losing about ``2^-17 |s|`` (lo's rounding),
where the final bf16 gradient rounds by ``2^-9 |s|``. The traffic per chunk is the float32 accumulator's (read and
write 4 bytes an element) plus the product slice, which the caller keeps small enough to stay in cache.

Only bf16: fp16's exponent range would push ``lo`` (2^-11 of a gradient of 1e-4) into subnormals, losing the
compensation; fp16 keeps the float32 accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrl.kernels.linear_logprob import INTERPRET, round_to

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def compensated_add_kernel(
    hi_ptr, lo_ptr,  # [n] bf16: the running sum's halves, read and written in place
    p_ptr,  # [n] float32: the product to add
    n,
    # Meta-parameters
    BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    hi = tl.load(hi_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    lo = tl.load(lo_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=ok, other=0.0)
    # hi + lo is exact in float32 (lo is below half of hi's last bit): the only float32 rounding is the one of + p
    s = (hi + lo) + p
    h16 = round_to(s, tl.bfloat16, EMULATE_RNE)  # to nearest even, as torch does (the interpreter truncates)
    tl.store(hi_ptr + offs, h16, mask=ok)
    tl.store(lo_ptr + offs, round_to(s - h16.to(tl.float32), tl.bfloat16, EMULATE_RNE), mask=ok)


def compensated_add_(hi: torch.Tensor, lo: torch.Tensor, p: torch.Tensor) -> None:
    """``(hi, lo) <- split(hi + lo + p)``: contiguous bf16 ``hi``, ``lo`` and float32 ``p`` of one shape."""
    n = hi.numel()
    if n == 0:
        return
    compensated_add_kernel[(triton.cdiv(n, BLOCK),)](hi, lo, p, n, BLOCK=BLOCK, EMULATE_RNE=INTERPRET,
                                                         num_warps=NUM_WARPS)
