"""Fused LM head -> per-token log-prob and entropy: the fully fused Triton kernels and their launchers.

Nothing here knows about autograd (that lives in ``fastrl/ops``). Two kernels, each computing tiles of
``h W^T`` with ``tl.dot`` (float32 accumulation) and consuming them in registers, so no logit is ever stored:

* ``stats_fwd_kernel``: folds each tile into online row statistics. Grid: (token blocks, vocabulary splits);
  each split writes partial statistics that ``linear_stats`` merges (O(N * splits) floats). Splitting the
  vocabulary keeps every SM busy when there are few tokens. The target's logit is a separate dot product of
  the row with its target's weight row, after the vocabulary loop, so the hot loop carries no per-element
  target compare (it cost the 128x256 tile ~30 spilled registers on sm_90).
* ``grad_block_kernel``: recomputes the tile for a slice of the vocabulary and writes ``G = dL/dy`` from the
  saved row statistics and the upstream gradients of log-prob and entropy. The caller turns ``G`` into
  weight / hidden gradients with two cuBLAS GEMMs.

On Hopper (and in the interpreter) the tiles are loaded through TMA tensor descriptors when the tensors are
16-byte aligned: the hardware computes the addresses (no per-element 64-bit pointers in registers) and the H
loop is software-pipelined over ``num_stages`` shared-memory buffers. Otherwise the same kernel loads with
pointers. Launch configurations are a fixed table per GPU family (``CONFIGS``); ``FASTRL_AUTOTUNE=1`` times the
candidates once per (kernel, H, V, dtype) instead (``fastrl.kernels.tuning``).

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

from fastrl.kernels.tuning import KernelConfig, config_for

try:  # host-side TMA descriptors (Triton >= 3.4); without them every launch uses pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    TensorDescriptor = None

# Triton decides at decoration time whether a kernel is interpreted; record what was decided so the
# dispatcher can refuse CPU tensors with a clear message instead of a driver error.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# A finite stand-in for -inf in the online statistics: padded columns and the initial running max. With it,
# exp(m_old - m_new) and exp(pad - m_new) underflow to exactly 0 and no inf - inf (NaN) can arise, without
# the extra where()s that cost registers in the epilogue. Real logits are far inside (-1e30, 1e30).
NEG_LARGE: tl.constexpr = tl.constexpr(-1.0e30)


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
def round_to(x, dtype: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """``x.to(dtype)``: round to nearest even, as a GPU's conversion does.

    Triton's interpreter truncates float32 -> bf16 (whatever rounding is asked for); the CPU tests must see
    the GPU's arithmetic, so there (``EMULATE_RNE``) the rounding is done on the bits first, after which the
    truncation is exact: add 0x7FFF plus the lowest kept bit, then clear the 16 dropped bits.
    """
    if dtype == tl.float32:
        return x
    elif EMULATE_RNE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def dot_tile(
    h_src, w_src,  # TMA descriptors (USE_TMA) or base pointers
    n0, v0,  # first row of the token block and of the vocabulary block
    N, V, H,
    stride_hn, stride_wv,
    # Meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    """Raw logits ``h[n0:n0+BN] @ W[v0:v0+BV]^T`` as a float32 [BLOCK_N, BLOCK_V] tile (zeros outside)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if not USE_TMA:
        # 64-bit only in the scalar base (N * H and V * H exceed 2^31); tile offsets stay 32-bit
        rn = tl.arange(0, BLOCK_N)
        rv = tl.arange(0, BLOCK_V)
        rh = tl.arange(0, BLOCK_H)
        h_base = h_src + tl.cast(n0, tl.int64) * stride_hn
        w_base = w_src + tl.cast(v0, tl.int64) * stride_wv
        n_ok = (n0 + rn) < N
        v_ok = (v0 + rv) < V
    for h0 in range(0, H, BLOCK_H):
        if USE_TMA:
            a = h_src.load([n0, h0])  # [BLOCK_N, BLOCK_H], zero-filled out of bounds
            b = w_src.load([v0, h0]).T  # [BLOCK_H, BLOCK_V]
        else:
            h_ok = (h0 + rh) < H
            a = tl.load(h_base + rn[:, None] * stride_hn + (h0 + rh)[None, :],
                        mask=n_ok[:, None] & h_ok[None, :], other=0.0)
            b = tl.load(w_base + rv[None, :] * stride_wv + (h0 + rh)[:, None],
                        mask=v_ok[None, :] & h_ok[:, None], other=0.0)
        if INTERP_BF16:
            # Triton's interpreter multiplies bf16 tiles as raw integers (numpy has no bf16). bf16 x bf16
            # products are exact in float32, so upcasting is the same arithmetic the tensor cores do.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # float32 inputs use IEEE products: TF32 would be less accurate than PyTorch's fp32 matmul
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def transform_tile(y, logit_scale, softcap, inv_temp, HAS_SOFTCAP: tl.constexpr):
    """z = softcap(logit_scale * y) / T, softcap c tanh(x / c) only when set."""
    x = y * logit_scale
    if HAS_SOFTCAP:
        x = softcap * _tanh(x / softcap)
    return x * inv_temp


@triton.jit
def chain_transform(g, z, logit_scale, softcap, inv_temp, HAS_SOFTCAP: tl.constexpr):
    """``g * dz/dy`` at transformed logits ``z`` (``transform_tile``'s derivative): ``scale / T * (1 - tanh^2)``."""
    dzdy = logit_scale * inv_temp
    if HAS_SOFTCAP:
        th = z / (softcap * inv_temp)
        dzdy = dzdy * (1.0 - th * th)
    return g * dzdy


@triton.jit
def load_target_logit(
    h_ptr, w_ptr, b_ptr, t_ptr,  # [N, H], [V, H], [V] (HAS_BIAS), [N] int64 targets
    offs_n, n_ok,  # [BLOCK_N] rows of the block and which of them exist
    V, H, stride_hn, stride_wv,
    logit_scale, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """z[n, t_n] = transform(h_n . W[t_n] + b[t_n]) for a block of rows (0 where t_n is outside [0, V)): a row-wise
    dot with the gathered target rows, after the vocabulary loop, so the hot loop carries no per-element target
    compare (it cost the 128x256 tile ~30 spilled registers on sm_90); float32 products and sums, as exact as the
    tiles' own."""
    tgt = tl.load(t_ptr + offs_n, mask=n_ok, other=-1)
    t_ok = n_ok & (tgt >= 0) & (tgt < V)
    t_safe = tl.where(t_ok, tgt, 0)
    yt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        ld = t_ok[:, None] & (offs_h[None, :] < H)
        hv = tl.load(h_ptr + offs_n.to(tl.int64)[:, None] * stride_hn + offs_h[None, :], mask=ld, other=0.0)
        wv = tl.load(w_ptr + t_safe.to(tl.int64)[:, None] * stride_wv + offs_h[None, :], mask=ld, other=0.0)
        yt += tl.sum(hv.to(tl.float32) * wv.to(tl.float32), axis=1)
    if HAS_BIAS:
        yt += tl.load(b_ptr + t_safe, mask=t_ok, other=0.0).to(tl.float32)
    return tl.where(t_ok, transform_tile(yt, logit_scale, softcap, inv_temp, HAS_SOFTCAP), 0.0)


@triton.jit
def stats_fwd_kernel(
    h_src, w_src,  # [N, H], [V, H]: TMA descriptors (USE_TMA) or pointers
    h_ptr, w_ptr,  # the same tensors as plain pointers (target-row gathers)
    b_ptr, t_ptr,  # [V] bias (HAS_BIAS), [N] int64 targets
    m_ptr, s_ptr, u_ptr, zt_ptr,  # partial statistics, each [SPLITS, N] float32
    count_ptr,  # [1] int32 (HAS_COUNT): rows [count, N) are dead (sorted last), their blocks skipped, not written
    N, V, H, v_per_split,
    stride_hn, stride_wv,
    logit_scale, softcap, inv_temp,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_COUNT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    if HAS_COUNT:  # the live count from the device (no host read): a block of dead rows costs no GEMM
        if n0 >= tl.load(count_ptr):
            return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N

    m = tl.full((BLOCK_N,), NEG_LARGE, dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u = tl.zeros((BLOCK_N,), dtype=tl.float32)

    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        y = dot_tile(h_src, w_src, n0, v0, N, V, H, stride_hn, stride_wv,
                      BLOCK_N, BLOCK_V, BLOCK_H, USE_TMA, DOT_PRECISION, INTERP_BF16)
        offs_v = v0 + tl.arange(0, BLOCK_V)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_v, mask=offs_v < V, other=0.0).to(tl.float32)[None, :]
        z = tl.where(offs_v[None, :] < v_end, transform_tile(y, logit_scale, softcap, inv_temp, HAS_SOFTCAP), NEG_LARGE)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        d = z - m_new[:, None]
        p = tl.exp(d)  # exactly 0 in padded columns
        if HAS_ENTROPY:
            # re-base u from the old max to the new one: u' = alpha (u + (m - m_new) s)
            u = alpha * (u + (m - m_new) * s) + tl.sum(p * d, axis=1)
        s = alpha * s + tl.sum(p, axis=1)
        m = m_new

    out = pid_s * N + offs_n
    tl.store(m_ptr + out, m, mask=n_ok)
    tl.store(s_ptr + out, s, mask=n_ok)
    if HAS_ENTROPY:
        tl.store(u_ptr + out, u, mask=n_ok)

    if pid_s == 0:  # the target logit once per token
        zt = load_target_logit(h_ptr, w_ptr, b_ptr, t_ptr, offs_n, n_ok, V, H, stride_hn, stride_wv,
                           logit_scale, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_H)
    else:
        zt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    tl.store(zt_ptr + out, zt, mask=n_ok)


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def interp_bf16(dtype: torch.dtype) -> bool:
    """bf16 under the interpreter: upcast the dot operands and emulate the GPU's rounding of bf16 results."""
    return INTERPRET and dtype == torch.bfloat16


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these 2-D tensors: Hopper or newer (or the interpreter), unit
    column stride, 16-byte aligned base and row stride."""
    if TensorDescriptor is None:
        return False
    t0 = tensors[0]
    if not INTERPRET:
        if t0.device.type != "cuda" or torch.cuda.get_device_capability(t0.device)[0] < 9:
            return False
    for t in tensors:
        if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16 or t.shape[0] == 0:
            return False
    return True


def _sources(hidden, weight, cfg: KernelConfig, use_tma: bool):
    if not use_tma:
        return hidden, weight
    return (TensorDescriptor.from_tensor(hidden, [cfg.block_n, cfg.block_h]),
            TensorDescriptor.from_tensor(weight, [cfg.block_v, cfg.block_h]))


def _num_splits(n_blocks: int, v_blocks: int, device: torch.device) -> int:
    """Enough vocabulary splits to give every SM about two programs."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(v_blocks, triton.cdiv(2 * sms, n_blocks)))


def linear_stats(
    hidden: torch.Tensor,  # [N, H], unit column stride
    weight: torch.Tensor,  # [V, H], unit column stride
    bias: torch.Tensor | None,  # [V] contiguous
    targets: torch.Tensor,  # [N] int64 contiguous (anything outside [0, V) contributes no target logit)
    *,
    logit_scale: float,
    softcap: float | None,
    temperature: float,
    with_entropy: bool,
    splits: int | None = None,
    use_tma: bool | None = None,  # None: whenever the tensors allow it
    config: KernelConfig | None = None,  # None: the table's (or the autotuner's) choice
    live_count: torch.Tensor | None = None,  # [1] int32 on the device: rows [count, N) are dead (dead_rows_zero)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # lse [N], target z [N], entropy [N] or None
    """Row statistics of the transformed logits in one fused pass: log-sum-exp, target logit, entropy."""
    N, H = hidden.shape
    V = weight.shape[0]
    assert hidden.stride(1) == 1 and weight.stride(1) == 1 and targets.is_contiguous()
    if use_tma is None:
        use_tma = tma_ok(hidden, weight)
    variant = dict(has_bias=bias is not None, has_softcap=softcap is not None, with_entropy=with_entropy)

    def launch(cfg: KernelConfig) -> torch.Tensor:  # [4, splits, N] partial statistics
        n_blocks = triton.cdiv(N, cfg.block_n)
        v_blocks = triton.cdiv(V, cfg.block_v)
        n_splits = _num_splits(n_blocks, v_blocks, hidden.device) if splits is None else splits
        n_splits = max(1, min(n_splits, v_blocks))
        # each split covers a whole number of vocabulary blocks
        v_per_split = triton.cdiv(v_blocks, n_splits) * cfg.block_v
        n_splits = triton.cdiv(V, v_per_split)
        part = torch.empty((4, n_splits, N), dtype=torch.float32, device=hidden.device)
        m, s, u, zt = part.unbind(0)
        h_src, w_src = _sources(hidden, weight, cfg, use_tma)
        stats_fwd_kernel[(n_blocks, n_splits)](
            h_src, w_src, hidden, weight, bias if bias is not None else hidden, targets,
            m, s, u, zt, live_count if live_count is not None else targets,
            N, V, H, v_per_split,
            hidden.stride(0), weight.stride(0),
            float(logit_scale), float(softcap or 1.0), 1.0 / float(temperature),
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_ENTROPY=with_entropy,
            HAS_COUNT=live_count is not None,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, USE_TMA=use_tma,
            DOT_PRECISION=dot_precision(hidden.dtype), INTERP_BF16=interp_bf16(hidden.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return part

    cfg = config or config_for("stats", hidden.device, H=H, V=V, dtype=hidden.dtype, use_tma=use_tma,
                               launch=launch, **variant)
    m, s, u, zt = launch(cfg).unbind(0)
    return dead_rows_zero(live_count, *merge_partial_stats(m, s, u if with_entropy else None, zt))


def dead_rows_zero(live_count: torch.Tensor | None, *xs: torch.Tensor | None) -> tuple:
    """Row outputs [N] with the dead rows ``[count, N)`` (which the kernels skipped: never written) set to 0, what
    an ignored row gives in eager; a device-side select, no host read."""
    if live_count is None:
        return xs
    n = next(x for x in xs if x is not None).shape[0]
    dead = torch.arange(n, device=live_count.device, dtype=torch.int32) >= live_count
    zero = torch.zeros((), dtype=torch.float32, device=live_count.device)
    return tuple(None if x is None else torch.where(dead, zero.to(x.dtype), x) for x in xs)


def merge_partial_stats(
    m: torch.Tensor,  # [S, N] running max per split
    s: torch.Tensor,  # [S, N] sum exp(z - m)
    u: torch.Tensor | None,  # [S, N] sum exp(z - m) (z - m)
    zt: torch.Tensor,  # [S, N] target logit (0 in splits that do not hold the target)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Merge per-split online statistics into lse [N], target logit [N] and entropy [N].

    The splits are added one at a time, in split order, with elementwise ops: a reduction over dim 0 of ``[S, N]``
    sums a row's splits in an order that can depend on N and on the row's position (its vector lane on a CPU, the
    CUDA reduction's block shape), which made a token's entropy change in its last bit with the batch."""
    M = m.max(dim=0).values
    alpha = torch.exp(m - M)
    a_s = alpha * s
    S = a_s[0].clone()
    for i in range(1, a_s.shape[0]):
        S += a_s[i]
    lse = M + torch.log(S)
    entropy = None
    if u is not None:
        terms = alpha * (u + (m - M) * s)
        U = terms[0].clone()
        for i in range(1, terms.shape[0]):
            U += terms[i]
        entropy = torch.log(S) - U / S
    return lse, zt.sum(0), entropy


@triton.jit
def grad_block_kernel(
    h_src, w_src,  # [N, H], [V_blk, H] (w already offset to the slice): descriptors or pointers
    b_ptr, t_ptr,
    lse_ptr, ent_ptr, glogp_ptr, gent_ptr,  # [N] float32 each
    g_dst,  # [N, V_blk] out, the dtype of the GEMM that consumes it: a descriptor (USE_TMA) or a pointer
    count_ptr,  # [1] int32 (HAS_COUNT): rows [count, N) are dead (sorted last): their blocks store zeros, no GEMM
    N, V_blk, H, v_offset,
    stride_hn, stride_wv, stride_gn,
    logit_scale, softcap, inv_temp,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    """G[n, j] = dL/dy[n, v_offset + j] for one vocabulary slice."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    v0 = pid_v * BLOCK_V
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_v = v0 + tl.arange(0, BLOCK_V)
    n_ok = offs_n < N
    if HAS_COUNT:  # a block of dead rows: G = 0 (the cuBLAS gradient GEMMs read every row), no GEMM
        if n0 >= tl.load(count_ptr):
            _store_g(g_dst, tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32), n0, v0, offs_v, n_ok, V_blk, stride_gn,
                     BLOCK_N, USE_TMA, INTERP_BF16)
            return
    y = dot_tile(h_src, w_src, n0, v0, N, V_blk, H, stride_hn, stride_wv,
                  BLOCK_N, BLOCK_V, BLOCK_H, USE_TMA, DOT_PRECISION, INTERP_BF16)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_v, mask=offs_v < V_blk, other=0.0).to(tl.float32)[None, :]
    z = transform_tile(y, logit_scale, softcap, inv_temp, HAS_SOFTCAP)
    lse = tl.load(lse_ptr + offs_n, mask=n_ok, other=0.0)
    p = tl.exp(z - lse[:, None])
    # d logp / d z_j = 1[j = t] - p_j ;  d H / d z_j = -p_j (z_j - lse + H)
    if HAS_GLOGP:
        glogp = tl.load(glogp_ptr + offs_n, mask=n_ok, other=0.0)
        tgt = tl.load(t_ptr + offs_n, mask=n_ok, other=-1) - v_offset
        g = glogp[:, None] * (tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0) - p)
        live = glogp != 0.0
    else:
        g = tl.zeros_like(z)
        live = tl.zeros((BLOCK_N,), dtype=tl.int1)
    if HAS_GENT:
        gent = tl.load(gent_ptr + offs_n, mask=n_ok, other=0.0)
        ent = tl.load(ent_ptr + offs_n, mask=n_ok, other=0.0)
        g -= gent[:, None] * p * (z - lse[:, None] + ent[:, None])
        live = live | (gent != 0.0)
    # chain through z = softcap(scale * y) / T
    g = chain_transform(g, z, logit_scale, softcap, inv_temp, HAS_SOFTCAP)
    # rows with no upstream gradient (ignored targets) are exactly zero, even where their logits are not finite
    g = tl.where((live & n_ok)[:, None], g, 0.0)
    _store_g(g_dst, g, n0, v0, offs_v, n_ok, V_blk, stride_gn, BLOCK_N, USE_TMA, INTERP_BF16)


@triton.jit
def _store_g(g_dst, g, n0, v0, offs_v, n_ok, V_blk, stride_gn,
             BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, INTERP_BF16: tl.constexpr):
    if USE_TMA:
        # the TMA store clips rows and columns outside [N, V_blk]; no [BLOCK_N, BLOCK_V] pointer tile in registers
        g_dst.store([n0, v0], round_to(g, g_dst.dtype, INTERP_BF16))
    else:
        g_ptrs = g_dst + tl.cast(n0, tl.int64) * stride_gn + tl.arange(0, BLOCK_N)[:, None] * stride_gn + offs_v[None, :]
        tl.store(g_ptrs, round_to(g, g_dst.dtype.element_ty, INTERP_BF16),
                 mask=n_ok[:, None] & (offs_v[None, :] < V_blk))


def linear_grad_block(
    hidden: torch.Tensor,  # [N, H]
    weight_blk: torch.Tensor,  # [V_blk, H] a slice of the weight's rows
    bias_blk: torch.Tensor | None,  # [V_blk] contiguous
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
    use_tma: bool | None = None,
    config: KernelConfig | None = None,
    live_count: torch.Tensor | None = None,  # [1] int32 on the device: rows [count, N) are dead, their G 0, no GEMM
) -> torch.Tensor:
    N, H = hidden.shape
    V_blk = weight_blk.shape[0]
    assert out.shape == (N, V_blk) and out.stride(1) == 1
    if use_tma is None:
        use_tma = tma_ok(hidden, weight_blk, out)
    variant = dict(has_bias=bias_blk is not None, has_softcap=softcap is not None, with_entropy=grad_entropy is not None)
    dummy = lse

    def launch(cfg: KernelConfig) -> None:
        grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(V_blk, cfg.block_v))
        h_src, w_src = _sources(hidden, weight_blk, cfg, use_tma)
        g_dst = TensorDescriptor.from_tensor(out, [cfg.block_n, cfg.block_v]) if use_tma else out
        grad_block_kernel[grid](
            h_src, w_src, bias_blk if bias_blk is not None else hidden, targets,
            lse, entropy if entropy is not None else dummy,
            grad_logp if grad_logp is not None else dummy,
            grad_entropy if grad_entropy is not None else dummy,
            g_dst, live_count if live_count is not None else targets,
            N, V_blk, H, v_offset,
            hidden.stride(0), weight_blk.stride(0), out.stride(0),
            float(logit_scale), float(softcap or 1.0), 1.0 / float(temperature),
            HAS_BIAS=bias_blk is not None, HAS_SOFTCAP=softcap is not None,
            HAS_GLOGP=grad_logp is not None, HAS_GENT=grad_entropy is not None, HAS_COUNT=live_count is not None,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, USE_TMA=use_tma,
            DOT_PRECISION=dot_precision(hidden.dtype), INTERP_BF16=interp_bf16(hidden.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    launch(config or config_for("grad", hidden.device, H=H, V=V_blk, dtype=hidden.dtype, use_tma=use_tma,
                                launch=launch, **variant))
    return out
