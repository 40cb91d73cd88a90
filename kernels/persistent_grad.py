"""Logit gradients ``G = dL/dy`` for the ``triton-sm90`` backward, from recomputed tiles or from stored scaled exps.

Two kernels, both writing ``G`` in the input dtype for the two cuBLAS gradient GEMMs (``grad_h = G W`` and
``grad_W = G^T h``, float32 accumulation inside each, ``grad_h`` accumulated across slices in float32):

* ``persistent_grad_kernel`` (path A, two passes): a persistent grid over the ``(token block, vocabulary block)``
  tiles of one vocabulary slice; each tile's logits are recomputed with ``tl.dot`` from TMA-loaded operands, turned
  into ``G`` in registers from the saved row statistics, and stored once through a TMA descriptor. No logit is
  stored. Why ``G`` goes through HBM instead of feeding both gradient GEMMs inside the kernel (Cut Cross-Entropy's
  design): the outputs of those GEMMs are ``[BLOCK_N, H]`` and ``[BLOCK_V, H]`` per tile, far past the registers at
  H = 4096, so a fused kernel must add them into float32 ``grad_h`` / ``grad_W`` with atomics: (BLOCK_N + BLOCK_V) *
  H * 4 bytes read and written per tile, ~480 GB at W1 with 128x256 tiles (over 100 ms at 4.3 TB/s) and not
  deterministic, against 15 GB for ``G`` written once in bf16 and read by the two GEMMs (``python -m bench
  roofline`` prints both). Liger's SM90 backward makes the same choice (``dZ`` through memory, one wave at a time).
* ``scaled_exp_grad_kernel`` (the one-pass loss): ``G`` from the scaled exps the forward stored
  (``persistent_stats(exp_out=...)``: ``e = 2^(z log2(e) - k)`` per (row, vocabulary block)), written over them in
  place: ``p = e 2^(k - lse log2(e))``; the entropy term and a softcap's derivative need ``z`` itself, recovered as
  ``(log2(e) + k) ln 2`` (bf16 ``e``: within 2^-9 relative of ``e``, so ``z`` within ~0.003 absolute, where ``p`` is
  large enough to matter; the log-probs and entropies themselves are the forward's float32 statistics).

The gradient math is ``docs/design.md``'s: ``d logp / dz_j = 1[j = t] - p_j``, ``d H / dz_j = -p_j (z_j - lse + H)``,
then the chain through ``z = softcap(scale * y) / T``. Rows with no upstream gradient write exact zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrl.kernels.linear_logprob import (
    INTERPRET, TensorDescriptor, chain_transform, dot_precision, dot_tile, interp_bf16, round_to, transform_tile,
    tma_ok,
)
from fastrl.kernels.persistent_stats import LN2, LOG2E, num_programs
from fastrl.kernels.tuning import KernelConfig, config_for

__all__ = ["persistent_grad_block", "scaled_exp_grad"]


@triton.jit
def _grad_from_p(p, z, is_t, lse, ent, glogp, gent, live, logit_scale, softcap, inv_temp,
                 HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """G = dL/dy of a [rows, cols] tile from p = softmax, z (transformed logits) and the row vectors."""
    # d logp / d z_j = 1[j = t] - p_j ;  d H / d z_j = -p_j (z_j - lse + H)
    if HAS_GLOGP:
        g = glogp[:, None] * (tl.where(is_t, 1.0, 0.0) - p)
    else:
        g = tl.zeros_like(p)
    if HAS_GENT:
        g -= gent[:, None] * p * (z - lse[:, None] + ent[:, None])
    g = chain_transform(g, z, logit_scale, softcap, inv_temp, HAS_SOFTCAP)
    return tl.where(live[:, None], g, 0.0)


@triton.jit
def _row_grads(glogp_ptr, gent_ptr, ent_ptr, lse_ptr, offs_n, n_ok,
               HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr):
    """(lse, entropy, grad logp, grad entropy, live) of a block of rows; live = some upstream gradient is not 0."""
    lse = tl.load(lse_ptr + offs_n, mask=n_ok, other=0.0)
    live = tl.zeros(offs_n.shape, dtype=tl.int1)
    glogp = tl.zeros(offs_n.shape, dtype=tl.float32)
    gent = tl.zeros(offs_n.shape, dtype=tl.float32)
    ent = tl.zeros(offs_n.shape, dtype=tl.float32)
    if HAS_GLOGP:
        glogp = tl.load(glogp_ptr + offs_n, mask=n_ok, other=0.0)
        live = live | (glogp != 0.0)
    if HAS_GENT:
        gent = tl.load(gent_ptr + offs_n, mask=n_ok, other=0.0)
        ent = tl.load(ent_ptr + offs_n, mask=n_ok, other=0.0)
        live = live | (gent != 0.0)
    return lse, ent, glogp, gent, live & n_ok


@triton.jit
def persistent_grad_kernel(
    h_desc, w_desc,  # [N, H], [V_blk, H] (the weight slice) TMA descriptors
    b_ptr, t_ptr,  # [V_blk] bias slice (HAS_BIAS), [N] int64 global target ids
    lse_ptr, ent_ptr, glogp_ptr, gent_ptr,  # [N] float32 each
    g_desc,  # [N, V_blk] out: G in the input dtype, a TMA descriptor with blocks [BLOCK_N, BLOCK_V // 2]
    count_ptr,  # [1] int32 (HAS_COUNT): rows [count, N) are dead (sorted last): G = 0 there, stored without a GEMM
    N, V_blk, H, v_offset,
    logit_scale, softcap, inv_temp,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, NUM_PROGS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    v_blocks = tl.cdiv(V_blk, BLOCK_V)
    n_items = tl.cdiv(N, BLOCK_N) * v_blocks
    if HAS_COUNT:
        # items are token-block major, so the live rows' items come first: the GEMM loop stops after them, and the
        # dead blocks' G (read by the cuBLAS gradient GEMMs) is stored as zeros by a second loop with no GEMM
        all_items = n_items
        n_items = tl.cdiv(tl.minimum(tl.load(count_ptr), N), BLOCK_N) * v_blocks
        zero = tl.zeros((BLOCK_N, BLOCK_V // 2), dtype=tl.float32)
        for item in tl.range(n_items + pid, all_items, NUM_PROGS):
            for half in tl.static_range(2):
                g_desc.store([(item // v_blocks) * BLOCK_N, (item % v_blocks) * BLOCK_V + half * (BLOCK_V // 2)],
                             round_to(zero, g_desc.dtype, INTERP_BF16))
    # consecutive items walk the vocabulary blocks of one token block: the programs of one moment share a few
    # token blocks and neighbouring weight panels (L2), as in persistent_stats
    for item in tl.range(pid, n_items, NUM_PROGS, flatten=True):
        n0 = (item // v_blocks) * BLOCK_N
        v0 = (item % v_blocks) * BLOCK_V
        offs_n = n0 + tl.arange(0, BLOCK_N)
        y = dot_tile(h_desc, w_desc, n0, v0, N, V_blk, H, 0, 0,
                      BLOCK_N, BLOCK_V, BLOCK_H, True, DOT_PRECISION, INTERP_BF16)
        lse, ent, glogp, gent, live = _row_grads(glogp_ptr, gent_ptr, ent_ptr, lse_ptr, offs_n, offs_n < N,
                                                 HAS_GLOGP, HAS_GENT)
        tgt = tl.load(t_ptr + offs_n, mask=offs_n < N, other=-1) - v_offset
        # The epilogue in two column halves (as Triton's persistent-matmul tutorial subtiles its epilogue): half the
        # float32 temporaries live at once and a half-width TMA store buffer, which keeps 128x256 tiles free of
        # register spills with the next tile's loads in flight (python -m bench sass)
        y0, y1 = tl.split(tl.permute(tl.reshape(y, (BLOCK_N, 2, BLOCK_V // 2)), (0, 2, 1)))
        for half in tl.static_range(2):
            yh = y0 if half == 0 else y1
            vh = v0 + half * (BLOCK_V // 2)
            offs_v = vh + tl.arange(0, BLOCK_V // 2)
            if HAS_BIAS:
                yh += tl.load(b_ptr + offs_v, mask=offs_v < V_blk, other=0.0).to(tl.float32)[None, :]
            z = transform_tile(yh, logit_scale, softcap, inv_temp, HAS_SOFTCAP)
            p = tl.exp(z - lse[:, None])
            g = _grad_from_p(p, z, offs_v[None, :] == tgt[:, None], lse, ent, glogp, gent, live,
                             logit_scale, softcap, inv_temp, HAS_GLOGP, HAS_GENT, HAS_SOFTCAP)
            # the TMA store clips rows and columns outside [N, V_blk]
            g_desc.store([n0, vh], round_to(g, g_desc.dtype, INTERP_BF16))


def persistent_grad_block(
    hidden: torch.Tensor,  # [N, H] 16-byte aligned rows
    weight_blk: torch.Tensor,  # [V_blk, H] a slice of the weight's rows
    bias_blk: torch.Tensor | None,  # [V_blk] contiguous
    targets: torch.Tensor,  # [N] int64 global ids
    v_offset: int,  # global id of weight_blk's first row
    lse: torch.Tensor,  # [N] float32
    entropy: torch.Tensor | None,  # [N] float32 (with grad_entropy)
    grad_logp: torch.Tensor | None,  # [N] float32, zero on rows without gradient
    grad_entropy: torch.Tensor | None,  # [N] float32
    out: torch.Tensor,  # [N, V_blk] hidden's dtype, 16-byte aligned rows: written with dL/dy of this slice
    *,
    logit_scale: float,
    softcap: float | None,
    temperature: float,
    config: KernelConfig | None = None,
    live_count: torch.Tensor | None = None,  # [1] int32 on the device: rows [count, N) are dead, their G 0, no GEMM
) -> torch.Tensor:
    N, H = hidden.shape
    V_blk = weight_blk.shape[0]
    assert out.shape == (N, V_blk) and tma_ok(hidden, weight_blk, out) and TensorDescriptor is not None
    variant = dict(has_bias=bias_blk is not None, has_softcap=softcap is not None,
                   with_entropy=grad_entropy is not None)
    dummy = lse

    def launch(cfg: KernelConfig) -> None:
        n_items = triton.cdiv(N, cfg.block_n) * triton.cdiv(V_blk, cfg.block_v)
        progs = num_programs(hidden.device, n_items)
        persistent_grad_kernel[(progs,)](
            TensorDescriptor.from_tensor(hidden, [cfg.block_n, cfg.block_h]),
            TensorDescriptor.from_tensor(weight_blk, [cfg.block_v, cfg.block_h]),
            bias_blk if bias_blk is not None else hidden, targets,
            lse, entropy if entropy is not None else dummy,
            grad_logp if grad_logp is not None else dummy,
            grad_entropy if grad_entropy is not None else dummy,
            TensorDescriptor.from_tensor(out, [cfg.block_n, cfg.block_v // 2]),
            live_count if live_count is not None else targets,
            N, V_blk, H, v_offset,
            float(logit_scale), float(softcap or 1.0), 1.0 / float(temperature),
            HAS_BIAS=bias_blk is not None, HAS_SOFTCAP=softcap is not None,
            HAS_GLOGP=grad_logp is not None, HAS_GENT=grad_entropy is not None, HAS_COUNT=live_count is not None,
            BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, NUM_PROGS=progs,
            DOT_PRECISION=dot_precision(hidden.dtype), INTERP_BF16=interp_bf16(hidden.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    launch(config or config_for("sm90_grad", hidden.device, H=H, V=V_blk, dtype=hidden.dtype, use_tma=True,
                                launch=launch, **variant))
    return out


# Elementwise over a row of the scaled-exp tile: wide column blocks keep the loads coalesced.
BLOCK_C = 2048
NUM_WARPS = 8


@triton.jit
def scaled_exp_grad_kernel(
    e_ptr,  # [R, C] scaled exps (input dtype); G is written over them
    k_ptr,  # [R, cdiv(C, BLOCK_V)] float32 power-of-two offsets
    t_ptr,  # [R] int64 global ids (the bias is inside e already)
    zt_ptr,  # [R] float32 exact target logits (from the forward's statistics)
    lse_ptr, ent_ptr, glogp_ptr, gent_ptr,  # [R] float32 each
    C, v_offset,
    stride_er, stride_k,
    logit_scale, softcap, inv_temp,
    # Meta-parameters
    HAS_SOFTCAP: tl.constexpr, HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    row = tl.program_id(0)
    rows = row + tl.arange(0, 1)  # a one-row block, so the row helpers see [1] vectors
    lse, ent, glogp, gent, live = _row_grads(glogp_ptr, gent_ptr, ent_ptr, lse_ptr, rows, rows >= 0,
                                             HAS_GLOGP, HAS_GENT)
    local = tl.load(t_ptr + rows) - v_offset
    zt = tl.load(zt_ptr + rows)
    e_row = e_ptr + row.to(tl.int64) * stride_er
    k_row = k_ptr + row.to(tl.int64) * stride_k
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        ok = cols < C
        e = tl.load(e_row + cols, mask=ok, other=0.0).to(tl.float32)[None, :]
        k = tl.load(k_row + cols // BLOCK_V, mask=ok, other=0.0)[None, :]
        # p = e 2^(k - lse log2 e): one exact power of two per block, one float32 rounding in exp2
        p = e * tl.exp2(k - lse[:, None] * LOG2E)
        # z from e where e > 0; where e underflowed to 0 (p = 0, no gradient) the finite stand-in k ln 2 keeps the
        # chain rule's products at 0 (never 0 * inf); the target's own logit is the forward's exact float32 value
        is_t = cols[None, :] == local[:, None]
        z = (tl.log2(tl.where(e > 0.0, e, 1.0)) + k) * LN2
        z = tl.where(is_t, zt[:, None], z)
        g = _grad_from_p(p, z, is_t, lse, ent, glogp, gent, live,
                         logit_scale, softcap, inv_temp, HAS_GLOGP, HAS_GENT, HAS_SOFTCAP)
        # every element is read before it is written, by the same thread (same offsets, same layout)
        tl.store(e_row + cols[None, :], round_to(g, e_ptr.dtype.element_ty, EMULATE_RNE), mask=ok[None, :])


def scaled_exp_grad(
    e: torch.Tensor,  # [R, C] scaled exps from persistent_stats(exp_out=...); overwritten with G
    k: torch.Tensor,  # [R, cdiv(C, block_v)] float32 offsets
    block_v: int,  # the vocabulary block of the forward that wrote e and k
    targets: torch.Tensor,  # [R] int64 global ids
    v_offset: int,  # global id of e's first column
    target_logit: torch.Tensor,  # [R] float32, the forward's exact transformed target logit
    lse: torch.Tensor,  # [R] float32
    entropy: torch.Tensor | None,  # [R] float32 (with grad_entropy)
    grad_logp: torch.Tensor | None,  # [R] float32, zero on rows without gradient
    grad_entropy: torch.Tensor | None,  # [R] float32
    *,
    logit_scale: float,
    softcap: float | None,
    temperature: float,
) -> torch.Tensor:  # e itself, now holding G = dL/dy
    R, C = e.shape
    if R == 0:
        return e
    assert e.stride(1) == 1 and k.dtype == torch.float32 and k.shape == (R, triton.cdiv(C, block_v))
    dummy = lse
    scaled_exp_grad_kernel[(R,)](
        e, k, targets, target_logit, lse, entropy if entropy is not None else dummy,
        grad_logp if grad_logp is not None else dummy, grad_entropy if grad_entropy is not None else dummy,
        C, v_offset, e.stride(0), k.stride(0),
        float(logit_scale), float(softcap or 1.0), 1.0 / float(temperature),
        HAS_SOFTCAP=softcap is not None, HAS_GLOGP=grad_logp is not None, HAS_GENT=grad_entropy is not None,
        BLOCK_V=block_v, BLOCK_C=BLOCK_C, EMULATE_RNE=INTERPRET, num_warps=NUM_WARPS,
    )
    return e
