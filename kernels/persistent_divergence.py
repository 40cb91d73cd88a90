"""Student-teacher divergences in persistent TMA kernels: both heads' logits tiles in registers, none stored.

The ``triton-sm90`` backend of ``fused_divergence``: the same online statistics as ``divergence_fold`` (which reads
cuBLAS's stored float32 tiles), but each program computes the student's and the teacher's tile of one
(token block, vocabulary block) with ``tl.dot`` from TMA descriptors (each head with its own hidden width) and folds
them in registers. Three kernels, each a persistent grid:

* ``div_stats_kernel``: per (token block, vocabulary split), the running maxima ``m_s, m_t``, ``s = sum e^(z - m)``,
  the student's ``u = sum e^(d_s) d_s`` (entropy) and the cross term of the KL direction (``c = sum e^(d_t)
  (d_t - d_s)`` forward, ``sum e^(d_s) (d_s - d_t)`` reverse), ``d = z - m``; ``merge_div_partials`` combines the
  splits (every sum re-based to the common maxima, the cross term with both shifts).
* ``div_jsd_kernel``: with both normalisers known, per split the shares of ``KL(p_s || m)`` and ``KL(p_t || m)``
  (the generalized JSD and what its backward needs); the splits are summed.
* ``div_grad_kernel``: ``G = dL/dy_s`` of one vocabulary slice from recomputed tiles of both heads, stored once
  through TMA for the cuBLAS gradient GEMMs (as ``persistent_grad``; the teacher gets no gradient).

Two float32 accumulators are live at once, so the tiles are 128x64 on sm_90 (``tuning``: ``sm90_div``). The math is in
``fastrl/ops/divergence_torch.py`` and docs/design.md ("Divergences"); nothing here knows about autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrl.kernels.divergence_fold import jit_log_mix
from fastrl.kernels.linear_logprob import (
    NEG_LARGE, TensorDescriptor, chain_transform, dot_precision, dot_tile, interp_bf16, round_to, transform_tile,
)
from fastrl.kernels.persistent_stats import choose_splits, num_programs
from fastrl.kernels.tuning import KernelConfig

__all__ = ["div_stats", "div_jsd", "div_grad_block", "merge_div_partials"]


@triton.jit
def _both_tiles(hs_desc, ws_desc, ht_desc, wt_desc, bs_ptr, bt_ptr, n0, v0, v_end, N, V, Hs, Ht,
                s_scale, s_softcap, t_scale, t_softcap, inv_temp,
                HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr):
    """(z_s, z_t, ok): both heads' transformed logits of one tile, NEG_LARGE in columns at or past ``v_end``."""
    offs_v = v0 + tl.arange(0, BLOCK_V)
    ok = offs_v[None, :] < v_end
    ys = dot_tile(hs_desc, ws_desc, n0, v0, N, V, Hs, 0, 0, BLOCK_N, BLOCK_V, BLOCK_H, True, DOT_PRECISION,
                   INTERP_BF16)
    if HAS_BS:
        ys += tl.load(bs_ptr + offs_v, mask=offs_v < V, other=0.0).to(tl.float32)[None, :]
    zs = tl.where(ok, transform_tile(ys, s_scale, s_softcap, inv_temp, S_SOFTCAP), NEG_LARGE)
    yt = dot_tile(ht_desc, wt_desc, n0, v0, N, V, Ht, 0, 0, BLOCK_N, BLOCK_V, BLOCK_H, True, DOT_PRECISION,
                   INTERP_BF16)
    if HAS_BT:
        yt += tl.load(bt_ptr + offs_v, mask=offs_v < V, other=0.0).to(tl.float32)[None, :]
    zt = tl.where(ok, transform_tile(yt, t_scale, t_softcap, inv_temp, T_SOFTCAP), NEG_LARGE)
    return zs, zt, ok


@triton.jit
def div_stats_kernel(
    hs_desc, ws_desc, ht_desc, wt_desc,  # student [N, Hs] / [V, Hs], teacher [N, Ht] / [V, Ht] TMA descriptors
    bs_ptr, bt_ptr,  # [V] biases (HAS_BS / HAS_BT)
    part_ptr,  # [6, SPLITS, N] float32 out: m_s, s_s, u_s, c, m_t, s_t per split
    N, V, Hs, Ht, n_splits, v_per_split,
    s_scale, s_softcap, t_scale, t_softcap, inv_temp,
    # Meta-parameters
    HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
    MODE: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, NUM_PROGS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    n_items = tl.cdiv(N, BLOCK_N) * n_splits
    for item in tl.range(pid, n_items, NUM_PROGS):
        sp = item % n_splits
        n0 = (item // n_splits) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        v_start = sp * v_per_split
        v_end = tl.minimum(v_start + v_per_split, V)
        m_s = tl.full((BLOCK_N,), NEG_LARGE, dtype=tl.float32)
        m_t = tl.full((BLOCK_N,), NEG_LARGE, dtype=tl.float32)
        s_s = tl.zeros((BLOCK_N,), dtype=tl.float32)
        s_t = tl.zeros((BLOCK_N,), dtype=tl.float32)
        u_s = tl.zeros((BLOCK_N,), dtype=tl.float32)
        c = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for v0 in range(v_start, v_end, BLOCK_V):
            zs, zt, ok = _both_tiles(hs_desc, ws_desc, ht_desc, wt_desc, bs_ptr, bt_ptr, n0, v0, v_end, N, V, Hs, Ht,
                                     s_scale, s_softcap, t_scale, t_softcap, inv_temp, HAS_BS, HAS_BT, S_SOFTCAP,
                                     T_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, INTERP_BF16)
            ms_new = tl.maximum(m_s, tl.max(zs, axis=1))
            mt_new = tl.maximum(m_t, tl.max(zt, axis=1))
            sh_s = m_s - ms_new  # how far each reference point moves (<= 0)
            sh_t = m_t - mt_new
            a_s = tl.exp(sh_s)
            a_t = tl.exp(sh_t)
            ds = tl.where(ok, zs - ms_new[:, None], 0.0)  # 0 in padded columns, whose e = 0: no 0 * huge
            dt = tl.where(ok, zt - mt_new[:, None], 0.0)
            es = tl.where(ok, tl.exp(ds), 0.0)
            et = tl.where(ok, tl.exp(dt), 0.0)
            if HAS_ENTROPY:
                u_s = a_s * (u_s + sh_s * s_s) + tl.sum(es * ds, axis=1)
            if MODE == 0:
                c = a_t * (c + (sh_t - sh_s) * s_t) + tl.sum(et * (dt - ds), axis=1)
            if MODE == 1:
                c = a_s * (c + (sh_s - sh_t) * s_s) + tl.sum(es * (ds - dt), axis=1)
            s_s = a_s * s_s + tl.sum(es, axis=1)
            s_t = a_t * s_t + tl.sum(et, axis=1)
            m_s = ms_new
            m_t = mt_new
        out = part_ptr + sp * N + offs_n
        n_ok = offs_n < N
        plane = n_splits * N
        tl.store(out, m_s, mask=n_ok)
        tl.store(out + plane, s_s, mask=n_ok)
        tl.store(out + 2 * plane, u_s, mask=n_ok)
        tl.store(out + 3 * plane, c, mask=n_ok)
        tl.store(out + 4 * plane, m_t, mask=n_ok)
        tl.store(out + 5 * plane, s_t, mask=n_ok)


def _ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.sum(dim)``, the slices added one at a time in order: a reduction's order may follow the other dimension's
    length and a row's position in it (its vector lane, the CUDA kernel's block), which would make a token's value
    depend on its batch."""
    parts = x.unbind(dim)
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def merge_div_partials(part: torch.Tensor, mode: int) -> torch.Tensor:  # [6, S, N] -> [6, N]
    """Combine per-split statistics: each split's sums re-based to the common maxima (the cross term of the forward
    KL scales with the teacher's factor and shifts by both, as one more tile would in the kernel), added in split
    order."""
    m_s, s_s, u_s, c, m_t, s_t = part.unbind(0)
    M_s, M_t = m_s.max(0).values, m_t.max(0).values
    sh_s, sh_t = m_s - M_s, m_t - M_t
    a_s, a_t = torch.exp(sh_s), torch.exp(sh_t)
    U = _ordered_sum(a_s * (u_s + sh_s * s_s), 0)
    if mode == 0:
        C = _ordered_sum(a_t * (c + (sh_t - sh_s) * s_t), 0)
    elif mode == 1:
        C = _ordered_sum(a_s * (c + (sh_s - sh_t) * s_s), 0)
    else:
        C = torch.zeros_like(M_s)
    return torch.stack([M_s, _ordered_sum(a_s * s_s, 0), U, C, M_t, _ordered_sum(a_t * s_t, 0)])


@triton.jit
def div_jsd_kernel(
    hs_desc, ws_desc, ht_desc, wt_desc, bs_ptr, bt_ptr,
    lse_s_ptr, lse_t_ptr,  # [N] float32
    part_ptr,  # [2, SPLITS, N] float32 out: KL(p_s || m), KL(p_t || m) per split
    N, V, Hs, Ht, n_splits, v_per_split,
    beta, s_scale, s_softcap, t_scale, t_softcap, inv_temp,
    # Meta-parameters
    HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, NUM_PROGS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    n_items = tl.cdiv(N, BLOCK_N) * n_splits
    for item in tl.range(pid, n_items, NUM_PROGS):
        sp = item % n_splits
        n0 = (item // n_splits) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        lse_s = tl.load(lse_s_ptr + offs_n, mask=n_ok, other=0.0)
        lse_t = tl.load(lse_t_ptr + offs_n, mask=n_ok, other=0.0)
        v_start = sp * v_per_split
        v_end = tl.minimum(v_start + v_per_split, V)
        kl_sm = tl.zeros((BLOCK_N,), dtype=tl.float32)
        kl_tm = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for v0 in range(v_start, v_end, BLOCK_V):
            zs, zt, ok = _both_tiles(hs_desc, ws_desc, ht_desc, wt_desc, bs_ptr, bt_ptr, n0, v0, v_end, N, V, Hs, Ht,
                                     s_scale, s_softcap, t_scale, t_softcap, inv_temp, HAS_BS, HAS_BT, S_SOFTCAP,
                                     T_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, INTERP_BF16)
            ls = tl.where(ok, zs - lse_s[:, None], 0.0)
            lt = tl.where(ok, zt - lse_t[:, None], 0.0)
            ps = tl.where(ok, tl.exp(ls), 0.0)
            pt = tl.where(ok, tl.exp(lt), 0.0)
            lm = jit_log_mix(ps, pt, beta)
            kl_sm += tl.sum(ps * (ls - lm), axis=1)
            kl_tm += tl.sum(pt * (lt - lm), axis=1)
        tl.store(part_ptr + sp * N + offs_n, kl_sm, mask=n_ok)
        tl.store(part_ptr + (n_splits + sp) * N + offs_n, kl_tm, mask=n_ok)


@triton.jit
def div_grad_kernel(
    hs_desc, ws_desc, ht_desc, wt_desc,  # the weight descriptors cover one vocabulary slice [V_blk, H]
    bs_ptr, bt_ptr,  # [V_blk] bias slices
    lse_s_ptr, lse_t_ptr, aux_ptr, ent_ptr, gd_ptr, ge_ptr,  # [N] float32 each
    g_desc,  # [N, V_blk] out: G = dL/dy_s in the student's dtype, blocks [BLOCK_N, BLOCK_V]
    N, V_blk, Hs, Ht,
    beta, s_scale, s_softcap, t_scale, t_softcap, inv_temp,
    # Meta-parameters
    HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
    MODE: tl.constexpr, HAS_GD: tl.constexpr, HAS_GE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, NUM_PROGS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    v_blocks = tl.cdiv(V_blk, BLOCK_V)
    n_items = tl.cdiv(N, BLOCK_N) * v_blocks
    for item in tl.range(pid, n_items, NUM_PROGS, flatten=True):
        n0 = (item // v_blocks) * BLOCK_N
        v0 = (item % v_blocks) * BLOCK_V
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        zs, zt, ok = _both_tiles(hs_desc, ws_desc, ht_desc, wt_desc, bs_ptr, bt_ptr, n0, v0, V_blk, N, V_blk, Hs, Ht,
                                 s_scale, s_softcap, t_scale, t_softcap, inv_temp, HAS_BS, HAS_BT, S_SOFTCAP,
                                 T_SOFTCAP, BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, INTERP_BF16)
        lse_s = tl.load(lse_s_ptr + offs_n, mask=n_ok, other=0.0)
        lse_t = tl.load(lse_t_ptr + offs_n, mask=n_ok, other=0.0)
        aux = tl.load(aux_ptr + offs_n, mask=n_ok, other=0.0)
        gd = tl.zeros((BLOCK_N,), dtype=tl.float32)
        ge = tl.zeros((BLOCK_N,), dtype=tl.float32)
        ent = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if HAS_GD:
            gd = tl.load(gd_ptr + offs_n, mask=n_ok, other=0.0)
        if HAS_GE:
            ge = tl.load(ge_ptr + offs_n, mask=n_ok, other=0.0)
            ent = tl.load(ent_ptr + offs_n, mask=n_ok, other=0.0)
        live = ((gd != 0.0) | (ge != 0.0)) & n_ok  # rows without upstream gradient write exact zeros
        ls = tl.where(ok, zs - lse_s[:, None], 0.0)
        lt = tl.where(ok, zt - lse_t[:, None], 0.0)
        ps = tl.where(ok, tl.exp(ls), 0.0)
        # the student's entropy: d H / d z = -p_s (log p_s + H)
        g = -ge[:, None] * ps * (ls + ent[:, None])
        if MODE == 0:  # forward KL: p_s - p_t
            g += gd[:, None] * (ps - tl.where(ok, tl.exp(lt), 0.0))
        if MODE == 1:  # reverse KL: p_s (log p_s - log p_t - KL)
            g += gd[:, None] * ps * (ls - lt - aux[:, None])
        if MODE == 2:  # JSD: (1 - beta) p_s (log p_s - log m - KL(p_s || m))
            pt = tl.where(ok, tl.exp(lt), 0.0)
            g += ((1.0 - beta) * gd)[:, None] * ps * (ls - jit_log_mix(ps, pt, beta) - aux[:, None])
        # past V_blk z is NEG_LARGE: the softcap's derivative would square it (overflow); those columns are clipped
        g = chain_transform(g, tl.where(ok, zs, 0.0), s_scale, s_softcap, inv_temp, S_SOFTCAP)
        g = tl.where(live[:, None], g, 0.0)
        g_desc.store([n0, v0], round_to(g, g_desc.dtype, INTERP_BF16))  # clipped outside [N, V_blk]


def _descs(student, teacher, w_s, w_t, cfg: KernelConfig):
    return (TensorDescriptor.from_tensor(student.h, [cfg.block_n, cfg.block_h]),
            TensorDescriptor.from_tensor(w_s, [cfg.block_v, cfg.block_h]),
            TensorDescriptor.from_tensor(teacher.h, [cfg.block_n, cfg.block_h]),
            TensorDescriptor.from_tensor(w_t, [cfg.block_v, cfg.block_h]))


def _tf_args(student, teacher) -> tuple:
    return (float(student.tf.logit_scale), float(student.tf.softcap or 1.0), float(teacher.tf.logit_scale),
            float(teacher.tf.softcap or 1.0), student.tf.inv_temp)


def _flags(student, teacher, cfg: KernelConfig) -> dict:
    return dict(HAS_BS=student.bias is not None, HAS_BT=teacher.bias is not None,
                S_SOFTCAP=student.tf.softcap is not None, T_SOFTCAP=teacher.tf.softcap is not None,
                BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
                DOT_PRECISION=dot_precision(student.h.dtype), INTERP_BF16=interp_bf16(student.h.dtype),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _grid(N: int, V: int, cfg: KernelConfig, device, splits: int | None = None) -> tuple[int, int, int]:
    """(programs, splits, v_per_split) of a split-vocabulary persistent launch (``splits``: that many, whatever N)."""
    n_blocks, v_blocks = triton.cdiv(N, cfg.block_n), triton.cdiv(V, cfg.block_v)
    progs = num_programs(device, n_blocks * v_blocks)
    n_splits = max(1, min(splits, v_blocks)) if splits else choose_splits(n_blocks, v_blocks, progs)
    v_per_split = triton.cdiv(v_blocks, n_splits) * cfg.block_v
    n_splits = triton.cdiv(V, v_per_split)
    return min(progs, n_blocks * n_splits), n_splits, v_per_split


def div_stats(student, teacher, mode: int, with_entropy: bool, cfg: KernelConfig,
              splits: int | None = None) -> torch.Tensor:  # [6, N]
    """(m_s, s_s, u_s, c, m_t, s_t) of every row over the whole vocabulary (``divergence._Head``s, inputs'
    dtype); ``splits``: the vocabulary split count (None: chosen for N)."""
    N, V = student.h.shape[0], student.weight.shape[0]
    progs, n_splits, v_per_split = _grid(N, V, cfg, student.h.device, splits)
    part = torch.empty((6, n_splits, N), dtype=torch.float32, device=student.h.device)
    bs = student.bias if student.bias is not None else part
    bt = teacher.bias if teacher.bias is not None else part
    div_stats_kernel[(progs,)](
        *_descs(student, teacher, student.weight, teacher.weight, cfg), bs, bt, part,
        N, V, student.h.shape[1], teacher.h.shape[1], n_splits, v_per_split, *_tf_args(student, teacher),
        MODE=mode, HAS_ENTROPY=with_entropy, NUM_PROGS=progs, **_flags(student, teacher, cfg))
    return merge_div_partials(part, mode)


def div_jsd(student, teacher, lse_s, lse_t, beta: float, cfg: KernelConfig,
            splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(p_s || m), KL(p_t || m)) [N] each, ``m = (1 - beta) p_s + beta p_t``."""
    N, V = student.h.shape[0], student.weight.shape[0]
    progs, n_splits, v_per_split = _grid(N, V, cfg, student.h.device, splits)
    part = torch.empty((2, n_splits, N), dtype=torch.float32, device=student.h.device)
    bs = student.bias if student.bias is not None else part
    bt = teacher.bias if teacher.bias is not None else part
    div_jsd_kernel[(progs,)](
        *_descs(student, teacher, student.weight, teacher.weight, cfg), bs, bt, lse_s, lse_t, part,
        N, V, student.h.shape[1], teacher.h.shape[1], n_splits, v_per_split, float(beta),
        *_tf_args(student, teacher), NUM_PROGS=progs, **_flags(student, teacher, cfg))
    kl_sm, kl_tm = _ordered_sum(part, 1).unbind(0)
    return kl_sm, kl_tm


def div_grad_block(student, teacher, v0: int, v1: int, lse_s, lse_t, aux, entropy, grad_div, grad_ent,
                   mode: int, beta: float, out: torch.Tensor, cfg: KernelConfig) -> torch.Tensor:
    """G = dL/dy_s [N, v1 - v0] of one vocabulary slice into ``out`` (student's dtype, 16-byte aligned rows)."""
    N = student.h.shape[0]
    V_blk = v1 - v0
    n_items = triton.cdiv(N, cfg.block_n) * triton.cdiv(V_blk, cfg.block_v)
    progs = num_programs(student.h.device, n_items)
    dummy = lse_s

    def sl(b):
        return b[v0:v1] if b is not None else lse_s

    div_grad_kernel[(progs,)](
        *_descs(student, teacher, student.weight[v0:v1], teacher.weight[v0:v1], cfg),
        sl(student.bias), sl(teacher.bias), lse_s, lse_t, aux,
        entropy if entropy is not None else dummy, grad_div if grad_div is not None else dummy,
        grad_ent if grad_ent is not None else dummy,
        TensorDescriptor.from_tensor(out, [cfg.block_n, cfg.block_v]),
        N, V_blk, student.h.shape[1], teacher.h.shape[1], float(beta), *_tf_args(student, teacher),
        MODE=mode, HAS_GD=grad_div is not None, HAS_GE=grad_ent is not None, NUM_PROGS=progs,
        **_flags(student, teacher, cfg))
    return out
