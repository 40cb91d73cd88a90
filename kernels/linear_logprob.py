"""Fused LM head -> per-token log-prob and entropy: Triton kernels and their launchers.

Nothing here knows about autograd (that lives in ``fastrl/ops``). Two kernels:

* ``_stats_fwd_kernel``: the logits tile ``h W^T (+ b)`` is computed with ``tl.dot`` (float32
  accumulation) and folded straight into online row statistics, so logits never exist in memory and
  are never rounded to bf16. Grid: (token blocks, vocabulary splits); each split writes partial
  statistics that ``linear_stats`` merges (O(N * splits) floats). Splitting the vocabulary keeps every
  SM busy when there are few tokens.
* ``_grad_block_kernel``: recomputes the logits tile for a slice of the vocabulary and writes
  ``G = dL/dy`` for it, from the saved row statistics and the upstream gradients of log-prob and
  entropy. The caller turns ``G`` into weight/hidden gradients with two cuBLAS GEMMs.

Statistics, per row, relative to a running max ``m`` so that ``exp`` never overflows:
``s = sum exp(z - m)``, ``u = sum exp(z - m) (z - m)``; then ``lse = m + log s`` and
``entropy = log s - u / s``. Keeping ``u`` relative to ``m`` (rather than ``sum p z``) avoids the
cancellation of two large numbers when logits are large.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton decides at decoration time whether a kernel is interpreted; record what was decided so the
# dispatcher can refuse CPU tensors with a clear message instead of a driver error.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Default launch configuration (Hopper/Ampere, bf16). Block sizes are real ones even under the
# interpreter: tests run these exact tiles on CPU tensors.
BLOCK_N = 64
BLOCK_V = 128
BLOCK_H = 64
NUM_WARPS = 8
NUM_STAGES = 3


@triton.jit
def _tanh(x):
    # tanh from exp of a non-positive argument: no overflow, and no 2*sigmoid(2x)-1 cancellation
    # near zero beyond what 1 - e costs; |x| < 2^-4 uses the odd Taylor series (error < 1e-9 rel).
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    x2 = a * a
    small = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(a < 0.0625, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def _logits_tile(
    h_ptr, w_ptr, b_ptr,
    offs_n, offs_v,
    N, V, H,
    stride_hn, stride_hh, stride_wv, stride_wh,
    logit_scale, softcap, inv_temp,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """Transformed logits z for rows offs_n and columns offs_v, float32 [BLOCK_N, BLOCK_V]."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    n_ok = offs_n[:, None] < N
    v_ok = offs_v[None, :] < V
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        h_tile = tl.load(
            h_ptr + offs_n[:, None] * stride_hn + offs_h[None, :] * stride_hh,
            mask=n_ok & h_ok[None, :], other=0.0,
        )
        w_tile = tl.load(
            w_ptr + offs_v[None, :] * stride_wv + offs_h[:, None] * stride_wh,
            mask=v_ok & h_ok[:, None], other=0.0,
        )
        if DOT_UPCAST:
            # Triton's interpreter multiplies bf16 tiles as raw integers (numpy has no bf16). bf16 x bf16
            # products are exact in float32, so upcasting is the same arithmetic the tensor cores do.
            h_tile = h_tile.to(tl.float32)
            w_tile = w_tile.to(tl.float32)
        # float32 inputs use IEEE products: TF32 would be less accurate than PyTorch's fp32 matmul
        acc = tl.dot(h_tile, w_tile, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_v, mask=offs_v < V, other=0.0).to(tl.float32)
        acc += b[None, :]
    x = acc * logit_scale
    if HAS_SOFTCAP:
        x = softcap * _tanh(x / softcap)
    return x * inv_temp


@triton.jit
def _stats_fwd_kernel(
    h_ptr, w_ptr, b_ptr, t_ptr,
    m_ptr, s_ptr, u_ptr, zt_ptr,  # partial statistics, each [SPLITS, N] float32
    z_ptr,  # [N, V] float32 transformed logits, written only when STORE_Z (one-pass loss chunks)
    N, V, H, v_per_split,
    stride_hn, stride_hh, stride_wv, stride_wh, stride_zn,
    logit_scale, softcap, inv_temp,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr, STORE_Z: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    # 64-bit offsets: N * V and V * H exceed 2^31 at real sizes (16k tokens x 152k vocab)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    tgt = tl.load(t_ptr + offs_n, mask=n_ok, other=-1)

    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zt = tl.zeros((BLOCK_N,), dtype=tl.float32)

    v_start = pid_s.to(tl.int64) * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        z = _logits_tile(
            h_ptr, w_ptr, b_ptr, offs_n, offs_v, N, V, H,
            stride_hn, stride_hh, stride_wv, stride_wh,
            logit_scale, softcap, inv_temp,
            HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, DOT_UPCAST,
        )
        v_ok = offs_v[None, :] < v_end
        if STORE_Z:
            tl.store(z_ptr + offs_n[:, None] * stride_zn + offs_v[None, :], z, mask=n_ok[:, None] & v_ok)
        z = tl.where(v_ok, z, float("-inf"))
        zt += tl.sum(tl.where(offs_v[None, :] == tgt[:, None], z, 0.0), axis=1)

        m_new = tl.maximum(m, tl.max(z, axis=1))
        # Rows whose logits are all -inf so far keep m = -inf; shift by 0 there to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        d = z - m_safe[:, None]
        p = tl.exp(d)
        if HAS_ENTROPY:
            # re-base u from the old max to the new one: u' = alpha (u + (m - m_new) s);
            # padded columns have p = 0 and d = -inf, so zero d there before the product
            # (rows with s = 0 still have m = -inf: shift by 0 there rather than multiply -inf by 0)
            shift = (tl.where(s > 0, m, m_safe) - m_safe) * s
            u = alpha * (u + shift) + tl.sum(p * tl.where(p > 0, d, 0.0), axis=1)
        s = alpha * s + tl.sum(p, axis=1)
        m = m_new

    out = pid_s.to(tl.int64) * N + offs_n
    tl.store(m_ptr + out, m, mask=n_ok)
    tl.store(s_ptr + out, s, mask=n_ok)
    tl.store(zt_ptr + out, zt, mask=n_ok)
    if HAS_ENTROPY:
        tl.store(u_ptr + out, u, mask=n_ok)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_upcast(dtype: torch.dtype) -> bool:
    return INTERPRET and dtype == torch.bfloat16


def _num_splits(n_blocks: int, v_blocks: int, device: torch.device) -> int:
    """Enough vocabulary splits to give every SM about two programs."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(v_blocks, triton.cdiv(2 * sms, n_blocks)))


def linear_stats(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [N] int64 (anything outside [0, V) contributes no target logit)
    *,
    logit_scale: float,
    softcap: float | None,
    temperature: float,
    with_entropy: bool,
    splits: int | None = None,
    z_out: torch.Tensor | None = None,  # [N, V] float32: also store the transformed logits here
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # lse [N], target z [N], entropy [N] or None
    """Row statistics of the transformed logits in one fused pass: log-sum-exp, target logit, entropy.

    With ``z_out`` the logits are also written (float32), for the one-pass loss, whose gradient needs
    each row's statistics before it can be formed.
    """
    N, H = hidden.shape
    V = weight.shape[0]
    n_blocks = triton.cdiv(N, BLOCK_N)
    v_blocks = triton.cdiv(V, BLOCK_V)
    if splits is None:
        splits = _num_splits(n_blocks, v_blocks, hidden.device)
    splits = max(1, min(splits, v_blocks))
    # each split covers a whole number of vocabulary blocks
    v_per_split = triton.cdiv(v_blocks, splits) * BLOCK_V
    splits = triton.cdiv(V, v_per_split)
    part = torch.empty((4, splits, N), dtype=torch.float32, device=hidden.device)
    m, s, u, zt = part.unbind(0)
    _stats_fwd_kernel[(n_blocks, splits)](
        hidden, weight, bias if bias is not None else hidden, targets,
        m, s, u, zt, z_out if z_out is not None else m,
        N, V, H, v_per_split,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        z_out.stride(0) if z_out is not None else 0,
        float(logit_scale), float(softcap or 1.0), 1.0 / float(temperature),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_ENTROPY=with_entropy,
        STORE_Z=z_out is not None,
        BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H,
        DOT_PRECISION=_dot_precision(hidden.dtype), DOT_UPCAST=_dot_upcast(hidden.dtype),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return merge_partial_stats(m, s, u if with_entropy else None, zt)


def merge_partial_stats(
    m: torch.Tensor,  # [S, N] running max per split
    s: torch.Tensor,  # [S, N] sum exp(z - m)
    u: torch.Tensor | None,  # [S, N] sum exp(z - m) (z - m)
    zt: torch.Tensor,  # [S, N] target logit (0 in splits that do not hold the target)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Merge per-split online statistics into lse [N], target logit [N] and entropy [N]."""
    M = m.max(dim=0).values
    M_safe = torch.where(torch.isneginf(M), torch.zeros_like(M), M)
    alpha = torch.exp(m - M_safe)
    S = (alpha * s).sum(0)
    lse = M_safe + torch.log(S)
    entropy = None
    if u is not None:
        shift = torch.where(s > 0, (m - M_safe) * s, torch.zeros_like(s))
        U = (alpha * (u + shift)).sum(0)
        entropy = torch.log(S) - U / S
    return lse, zt.sum(0), entropy


@triton.jit
def _grad_epilogue(
    z, offs_n, offs_v, n_ok,
    t_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, v_offset,
    logit_scale, softcap, inv_temp,
    HAS_SOFTCAP: tl.constexpr, HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dL/dy for a tile of transformed logits z, from the rows' lse/entropy and upstream gradients."""
    lse = tl.load(lse_ptr + offs_n, mask=n_ok, other=0.0)
    # unused gradients point at lse (a valid buffer); their terms are compiled out below
    glogp = tl.load(glogp_ptr + offs_n, mask=n_ok, other=0.0)
    gent = tl.load(gent_ptr + offs_n, mask=n_ok, other=0.0)
    p = tl.exp(z - lse[:, None])
    g = tl.zeros_like(z)
    if HAS_GLOGP:
        # d logp / d z_j = 1[j = t] - p_j
        tgt = tl.load(t_ptr + offs_n, mask=n_ok, other=-1) - v_offset
        onehot = tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0)
        g += glogp[:, None] * (onehot - p)
    if HAS_GENT:
        # d H / d z_j = -p_j (z_j - lse + H)
        ent = tl.load(ent_ptr + offs_n, mask=n_ok, other=0.0)
        g -= gent[:, None] * p * (z - lse[:, None] + ent[:, None])
    # chain through z = softcap(scale * y) / T: dz/dy = scale / T * (1 - tanh^2)
    dzdy = logit_scale * inv_temp
    if HAS_SOFTCAP:
        th = z / (softcap * inv_temp)
        g = g * (dzdy * (1.0 - th * th))
    else:
        g = g * dzdy
    # rows with no upstream gradient (ignored targets) are exactly zero, even where their logits
    # are not finite (padding), so nothing leaks into the weight gradient
    has_grad = tl.zeros((BLOCK_N,), dtype=tl.int1)
    if HAS_GLOGP:
        has_grad = has_grad | (glogp != 0)
    if HAS_GENT:
        has_grad = has_grad | (gent != 0)
    g = tl.where((has_grad & n_ok)[:, None], g, 0.0)
    return g


@triton.jit
def _grad_block_kernel(
    h_ptr, w_ptr, b_ptr, t_ptr,
    lse_ptr, ent_ptr, glogp_ptr, gent_ptr,  # [N] float32 each
    g_ptr,  # [N, V_blk] out, the dtype of the GEMM that consumes it
    N, V_blk, H, v_offset,
    stride_hn, stride_hh, stride_wv, stride_wh, stride_gn,
    logit_scale, softcap, inv_temp,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """G[n, j] = dL/dy[n, v_offset + j] for one vocabulary slice (w_ptr/b_ptr already point at it)."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    n_ok = offs_n < N
    z = _logits_tile(
        h_ptr, w_ptr, b_ptr, offs_n, offs_v, N, V_blk, H,
        stride_hn, stride_hh, stride_wv, stride_wh,
        logit_scale, softcap, inv_temp,
        HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, DOT_UPCAST,
    )
    g = _grad_epilogue(
        z, offs_n, offs_v, n_ok, t_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, v_offset,
        logit_scale, softcap, inv_temp, HAS_SOFTCAP, HAS_GLOGP, HAS_GENT, BLOCK_N,
    )
    g_mask = n_ok[:, None] & (offs_v[None, :] < V_blk)
    tl.store(g_ptr + offs_n[:, None] * stride_gn + offs_v[None, :], g.to(g_ptr.dtype.element_ty), mask=g_mask)


def linear_grad_block(
    hidden: torch.Tensor,  # [N, H]
    weight_blk: torch.Tensor,  # [V_blk, H] a contiguous-row slice of the weight
    bias_blk: torch.Tensor | None,  # [V_blk]
    targets: torch.Tensor,  # [N] int64, global vocabulary ids
    v_offset: int,  # global id of weight_blk's first row
    lse: torch.Tensor,  # [N] float32
    entropy: torch.Tensor | None,  # [N] float32
    grad_logp: torch.Tensor | None,  # [N] float32, zero on ignored rows
    grad_entropy: torch.Tensor | None,  # [N] float32, zero on ignored rows
    out: torch.Tensor,  # [N, V_blk] written: dL/dy for this slice
    *,
    logit_scale: float,
    softcap: float | None,
    temperature: float,
) -> torch.Tensor:
    N, H = hidden.shape
    V_blk = weight_blk.shape[0]
    assert out.shape == (N, V_blk) and out.stride(1) == 1
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(V_blk, BLOCK_V))
    dummy = lse
    _grad_block_kernel[grid](
        hidden, weight_blk, bias_blk if bias_blk is not None else hidden, targets,
        lse, entropy if entropy is not None else dummy,
        grad_logp if grad_logp is not None else dummy,
        grad_entropy if grad_entropy is not None else dummy,
        out,
        N, V_blk, H, v_offset,
        hidden.stride(0), hidden.stride(1), weight_blk.stride(0), weight_blk.stride(1), out.stride(0),
        float(logit_scale), float(softcap or 1.0), 1.0 / float(temperature),
        HAS_BIAS=bias_blk is not None, HAS_SOFTCAP=softcap is not None,
        HAS_GLOGP=grad_logp is not None, HAS_GENT=grad_entropy is not None,
        BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H,
        DOT_PRECISION=_dot_precision(hidden.dtype), DOT_UPCAST=_dot_upcast(hidden.dtype),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out


@triton.jit
def _grad_from_z_kernel(
    z_ptr,  # [N, V] float32 stored transformed logits
    t_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr,  # [N]
    g_ptr,  # [N, V] out (may alias z_ptr when both are float32)
    N, V,
    stride_zn, stride_gn,
    logit_scale, softcap, inv_temp,
    # Meta-parameters
    HAS_SOFTCAP: tl.constexpr, HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One-pass loss: G = dL/dy from logits stored by the stats kernel; one read, one write per element."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    n_ok = offs_n < N
    mask = n_ok[:, None] & (offs_v[None, :] < V)
    z = tl.load(z_ptr + offs_n[:, None] * stride_zn + offs_v[None, :], mask=mask, other=0.0)
    g = _grad_epilogue(
        z, offs_n, offs_v, n_ok, t_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, 0,
        logit_scale, softcap, inv_temp, HAS_SOFTCAP, HAS_GLOGP, HAS_GENT, BLOCK_N,
    )
    tl.store(g_ptr + offs_n[:, None] * stride_gn + offs_v[None, :], g.to(g_ptr.dtype.element_ty), mask=mask)


def grad_from_logits(
    z: torch.Tensor,  # [N, V] float32 transformed logits (from linear_stats(..., z_out=z))
    targets: torch.Tensor,  # [N] int64
    lse: torch.Tensor,  # [N] float32
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,  # [N] float32, zero on rows without gradient
    grad_entropy: torch.Tensor | None,
    out: torch.Tensor,  # [N, V], may be z itself
    *,
    logit_scale: float,
    softcap: float | None,
    temperature: float,
) -> torch.Tensor:
    N, V = z.shape
    assert z.stride(1) == 1 and out.stride(1) == 1 and out.shape == z.shape
    if N == 0:
        return out
    # elementwise over the tile: a wide V block keeps the loads coalesced
    block_n, block_v = 16, 256
    grid = (triton.cdiv(N, block_n), triton.cdiv(V, block_v))
    _grad_from_z_kernel[grid](
        z, targets, lse, entropy if entropy is not None else lse,
        grad_logp if grad_logp is not None else lse,
        grad_entropy if grad_entropy is not None else lse,
        out, N, V, z.stride(0), out.stride(0),
        float(logit_scale), float(softcap or 1.0), 1.0 / float(temperature),
        HAS_SOFTCAP=softcap is not None, HAS_GLOGP=grad_logp is not None, HAS_GENT=grad_entropy is not None,
        BLOCK_N=block_n, BLOCK_V=block_v, num_warps=4,
    )
    return out
