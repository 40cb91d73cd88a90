"""Row statistics and logit gradients from a stored float32 logits tile: the elementwise half of the hybrid path.

The hybrid path lets cuBLAS compute a tile of raw logits ``y = h W^T`` with a float32 output (bf16 inputs,
float32 accumulation, float32 result: no logit is ever rounded to bf16) and does everything else in two
memory-bound Triton kernels, one program per row, each reading the tile once:

* ``fold_kernel``: folds a ``[rows, cols]`` tile into each row's running online statistics (max ``m``,
  ``s = sum exp(z - m)``, ``u = sum exp(z - m) (z - m)``) and picks the target's transformed logit when the
  target falls in the tile. Several tiles of one row (vocabulary slices) fold one after the other.
* ``grad_kernel``: turns a tile of raw logits into ``G = dL/dy`` from the rows' final log-sum-exp and
  entropy and the upstream gradients of log-prob and entropy; ``G`` may be written over the tile itself.

Bias, logit scale, softcap and temperature are applied here, on the fly, so the GEMM stays a plain GEMM.
Nothing here knows about autograd (``fastrl/ops`` orchestrates); the math is in ``docs/design.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrl.kernels.linear_logprob import INTERPRET, NEG_LARGE, chain_transform, round_to, transform_tile

# Elementwise over a row: wide column blocks keep the loads coalesced and the row loop short.
BLOCK_C = 2048
NUM_WARPS = 8


@triton.jit
def load_z(y_row, b_ptr, cols, ok, logit_scale, softcap, inv_temp, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Transformed logits of one block of a row: ``z = softcap(scale * (y + b)) / T`` (0 -> z(0) where not ``ok``)."""
    y = tl.load(y_row + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return transform_tile(y, logit_scale, softcap, inv_temp, HAS_SOFTCAP)


@triton.jit
def fold_kernel(
    y_ptr,  # [R, C] float32 raw logits of a vocabulary slice
    b_ptr,  # [C] bias of the slice (HAS_BIAS)
    t_ptr,  # [R] int64 global target ids
    m_ptr, s_ptr, u_ptr, zt_ptr,  # [R] float32 running statistics, read and written in place
    C, v_offset,
    stride_yr,
    logit_scale, softcap, inv_temp,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr, FIRST: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_yr
    if FIRST:
        # a finite "minus infinity": exp(m_old - m_new) is then exactly 0 with no inf - inf anywhere
        m = tl.full((), NEG_LARGE, tl.float32)
        s = tl.zeros((), tl.float32)
        u = tl.zeros((), tl.float32)
        zt = tl.zeros((), tl.float32)
    else:
        m = tl.load(m_ptr + row)
        s = tl.load(s_ptr + row)
        u = tl.load(u_ptr + row)
        zt = tl.load(zt_ptr + row)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        ok = cols < C
        z = tl.where(ok, load_z(y_row, b_ptr, cols, ok, logit_scale, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP),
                     NEG_LARGE)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        d = z - m_new
        p = tl.exp(d)  # exactly 0 in padded columns: NEG_LARGE - m_new underflows
        if HAS_ENTROPY:
            # re-base u from the old max to the new one: u' = alpha (u + (m - m_new) s)
            u = alpha * (u + (m - m_new) * s) + tl.sum(p * d, axis=0)
        s = alpha * s + tl.sum(p, axis=0)
        m = m_new
    local = tl.load(t_ptr + row) - v_offset
    if (local >= 0) & (local < C):
        yt = tl.load(y_row + local)
        if HAS_BIAS:
            yt += tl.load(b_ptr + local).to(tl.float32)
        zt = transform_tile(yt, logit_scale, softcap, inv_temp, HAS_SOFTCAP)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(zt_ptr + row, zt)
    if HAS_ENTROPY:
        tl.store(u_ptr + row, u)


def fold_tile(
    y: torch.Tensor,  # [R, C] float32 raw logits (row stride free, unit column stride)
    bias: torch.Tensor | None,  # [C] contiguous bias of the slice
    targets: torch.Tensor,  # [R] int64 global ids
    v_offset: int,  # global id of the tile's first column
    stats: torch.Tensor,  # [4, R] float32 (m, s, u, zt), updated in place
    *,
    first: bool,  # the tile is the row's first vocabulary slice: start the statistics afresh
    logit_scale: float,
    softcap: float | None,
    temperature: float,
    with_entropy: bool,
) -> None:
    R, C = y.shape
    if R == 0:
        return
    assert y.dtype == torch.float32 and y.stride(1) == 1 and stats.stride(1) == 1
    m, s, u, zt = stats.unbind(0)
    fold_kernel[(R,)](
        y, bias if bias is not None else y, targets, m, s, u, zt,
        C, v_offset, y.stride(0),
        float(logit_scale), float(softcap or 1.0), 1.0 / float(temperature),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_ENTROPY=with_entropy, FIRST=first,
        BLOCK_C=BLOCK_C, num_warps=NUM_WARPS,
    )


def finish_stats(stats: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(m, s, u, zt) -> (lse, target logit, entropy): ``lse = m + log s``, ``H = log s - u / s``."""
    m, s, u, zt = stats.unbind(0)
    log_s = torch.log(s)
    return m + log_s, zt, (log_s - u / s) if with_entropy else None


@triton.jit
def grad_kernel(
    y_ptr,  # [R, C] float32 raw logits of a vocabulary slice
    g_ptr,  # [R, C] out: G = dL/dy (may share y's storage, see IN_PLACE)
    b_ptr, t_ptr,
    lse_ptr, ent_ptr, glogp_ptr, gent_ptr,  # [R] float32 each
    C, v_offset,
    stride_yr, stride_gr,
    logit_scale, softcap, inv_temp,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr,
    IN_PLACE: tl.constexpr, EMULATE_RNE: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_yr
    g_row = g_ptr + row * stride_gr
    lse = tl.load(lse_ptr + row)
    glogp = tl.load(glogp_ptr + row) if HAS_GLOGP else 0.0
    gent = tl.load(gent_ptr + row) if HAS_GENT else 0.0
    ent = tl.load(ent_ptr + row) if HAS_GENT else 0.0
    # rows without upstream gradient (ignored targets) write exact zeros, even where their logits are not finite
    live = (glogp != 0.0) | (gent != 0.0)
    local = tl.load(t_ptr + row) - v_offset
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        ok = cols < C
        z = load_z(y_row, b_ptr, cols, ok, logit_scale, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP)
        p = tl.exp(z - lse)
        # d logp / d z_j = 1[j = t] - p_j ;  d H / d z_j = -p_j (z_j - lse + H)
        g = -glogp * p - gent * p * (z - lse + ent)
        g = tl.where(cols == local, g + glogp, g)
        g = chain_transform(g, z, logit_scale, softcap, inv_temp, HAS_SOFTCAP)
        g = tl.where(live, g, 0.0)
        if IN_PLACE:
            # G (2-byte) is written over the first half of this row's float32 logits: the bytes of columns
            # [c0/2, (c0 + BLOCK_C)/2), which every warp must have loaded before any warp stores
            tl.debug_barrier()
        tl.store(g_row + cols, round_to(g, g_ptr.dtype.element_ty, EMULATE_RNE), mask=ok)


def grad_out(y: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:  # [R, C] in y's storage
    """Where a grad kernel writes ``G`` of the float32 tile ``y`` [R, C]: over ``y`` itself (float32), or, 2-byte,
    the first half of each float32 row (row stride ``2 * y.stride(0)`` in its own units). One program walks each
    row left to right, so it only overwrites bytes it has already read."""
    assert y.dtype == torch.float32 and y.stride(1) == 1
    if out_dtype == torch.float32:
        return y
    assert torch.empty((), dtype=out_dtype).element_size() == 2
    return y.view(out_dtype)[:, : y.shape[1]]


def grad_tile(
    y: torch.Tensor,  # [R, C] float32 raw logits
    bias: torch.Tensor | None,  # [C]
    targets: torch.Tensor,  # [R] int64 global ids
    v_offset: int,
    lse: torch.Tensor,  # [R] float32
    entropy: torch.Tensor | None,  # [R] float32 (needed with grad_entropy)
    grad_logp: torch.Tensor | None,  # [R] float32, zero on rows without gradient
    grad_entropy: torch.Tensor | None,  # [R] float32
    out_dtype: torch.dtype,  # the dtype of the GEMMs that consume G (the input dtype)
    *,
    logit_scale: float,
    softcap: float | None,
    temperature: float,
) -> torch.Tensor:  # [R, C] G, in y's storage (float32 in place; 2-byte in the first half of each row)
    """G = dL/dy over the tile, written over the tile itself (``grad_out``): no second [R, C] buffer."""
    R, C = y.shape
    g = grad_out(y, out_dtype)
    if R == 0:
        return g
    dummy = lse
    grad_kernel[(R,)](
        y, g, bias if bias is not None else y, targets,
        lse, entropy if entropy is not None else dummy,
        grad_logp if grad_logp is not None else dummy,
        grad_entropy if grad_entropy is not None else dummy,
        C, v_offset, y.stride(0), g.stride(0),
        float(logit_scale), float(softcap or 1.0), 1.0 / float(temperature),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
        HAS_GLOGP=grad_logp is not None, HAS_GENT=grad_entropy is not None,
        IN_PLACE=out_dtype != torch.float32, EMULATE_RNE=INTERPRET, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS,
    )
    return g
