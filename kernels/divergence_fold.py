"""Divergence statistics and student gradients from two stored float32 logits tiles (student and teacher).

The hybrid path (``fastrl.ops.divergence_hybrid``) lets cuBLAS write the raw logits of one vocabulary slice of
both heads as float32 tiles (bf16 operands, float32 accumulation and result); these kernels read both tiles of a
row in one pass, one program per row:

* ``stats_kernel``: folds the slice into each row's online statistics of both models: running maxima
  ``m_s, m_t``, ``s = sum e^(z - m)``, the student's ``u = sum e^(d_s) d_s`` (entropy) and the cross term of the
  KL direction, ``c = sum e^(d_t) (d_t - d_s)`` (forward KL) or ``sum e^(d_s) (d_s - d_t)`` (reverse), with
  ``d = z - m``; every sum is re-based when a max moves.
* ``jsd_kernel``: with both normalisers known, adds the slice's share of the generalized JSD and of
  ``KL(p_s || m)`` (what the backward needs).
* ``grad_kernel``: turns the student's tile into ``G = dL/dy_s`` for ``L = sum gd D + ge H_s``, written over the
  tile itself (a 2-byte G in the first half of each float32 row, as ``logits_fold.grad_tile``).

The math is in ``fastrl/ops/divergence_torch.py`` (and docs/design.md, "Divergences"); bias, scale, softcap and
temperature are applied here on the fly, so the GEMMs stay plain GEMMs. Nothing here knows about autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrl.kernels.linear_logprob import INTERPRET, NEG_LARGE, chain_transform, round_to
from fastrl.kernels.logits_fold import load_z, grad_out

BLOCK_C = 1024  # two models' blocks are live at once: half the single-model fold's width
NUM_WARPS = 8
FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2  # MODE: fastrl.ops.divergence_stats's constants (the kernels compare literals)
# float32's smallest normal: log(m) where both probabilities underflow (a constexpr: kernels read it)
TINY: tl.constexpr = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def stats_kernel(
    ys_ptr, yt_ptr,  # [R, C] float32 raw logits of the slice: student, teacher
    bs_ptr, bt_ptr,  # [C] biases of the slice (HAS_BS / HAS_BT)
    ms_ptr, ss_ptr, us_ptr, c_ptr, mt_ptr, st_ptr,  # [R] float32 running statistics, read and written in place
    C, stride_ys, stride_yt,
    s_scale, s_softcap, t_scale, t_softcap, inv_temp,
    # Meta-parameters
    HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
    MODE: tl.constexpr, HAS_ENTROPY: tl.constexpr, FIRST: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ys_row = ys_ptr + row * stride_ys
    yt_row = yt_ptr + row * stride_yt
    if FIRST:
        # a finite "minus infinity": exp(m_old - m_new) is exactly 0 and (m_old - m_new) * 0 stays 0
        m_s = tl.full((), NEG_LARGE, tl.float32)
        m_t = tl.full((), NEG_LARGE, tl.float32)
        s_s = tl.zeros((), tl.float32)
        s_t = tl.zeros((), tl.float32)
        u_s = tl.zeros((), tl.float32)
        c = tl.zeros((), tl.float32)
    else:
        m_s = tl.load(ms_ptr + row)
        m_t = tl.load(mt_ptr + row)
        s_s = tl.load(ss_ptr + row)
        s_t = tl.load(st_ptr + row)
        u_s = tl.load(us_ptr + row)
        c = tl.load(c_ptr + row)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        ok = cols < C
        zs = tl.where(ok, load_z(ys_row, bs_ptr, cols, ok, s_scale, s_softcap, inv_temp, HAS_BS, S_SOFTCAP), NEG_LARGE)
        zt = tl.where(ok, load_z(yt_row, bt_ptr, cols, ok, t_scale, t_softcap, inv_temp, HAS_BT, T_SOFTCAP), NEG_LARGE)
        ms_new = tl.maximum(m_s, tl.max(zs, axis=0))
        mt_new = tl.maximum(m_t, tl.max(zt, axis=0))
        sh_s = m_s - ms_new  # how far each reference point moves (<= 0)
        sh_t = m_t - mt_new
        a_s = tl.exp(sh_s)
        a_t = tl.exp(sh_t)
        ds = tl.where(ok, zs - ms_new, 0.0)  # 0 in padded columns, whose e = 0: no 0 * huge
        dt = tl.where(ok, zt - mt_new, 0.0)
        es = tl.where(ok, tl.exp(ds), 0.0)
        et = tl.where(ok, tl.exp(dt), 0.0)
        if HAS_ENTROPY:
            u_s = a_s * (u_s + sh_s * s_s) + tl.sum(es * ds, axis=0)
        if MODE == 0:
            c = a_t * (c + (sh_t - sh_s) * s_t) + tl.sum(et * (dt - ds), axis=0)
        if MODE == 1:
            c = a_s * (c + (sh_s - sh_t) * s_s) + tl.sum(es * (ds - dt), axis=0)
        s_s = a_s * s_s + tl.sum(es, axis=0)
        s_t = a_t * s_t + tl.sum(et, axis=0)
        m_s = ms_new
        m_t = mt_new
    tl.store(ms_ptr + row, m_s)
    tl.store(mt_ptr + row, m_t)
    tl.store(ss_ptr + row, s_s)
    tl.store(st_ptr + row, s_t)
    tl.store(us_ptr + row, u_s)
    tl.store(c_ptr + row, c)


def stats_tile(ys, yt, bs, bt, stats, *, first: bool, mode: int, with_entropy: bool, student, teacher) -> None:
    """Fold one slice of both heads ([R, C] float32 each) into ``stats`` [6, R] = (m_s, s_s, u_s, c, m_t, s_t).

    ``student`` / ``teacher``: the two ``LogitTransform``s (the temperature is shared)."""
    R, C = ys.shape
    if R == 0:
        return
    assert ys.dtype == yt.dtype == torch.float32 and ys.stride(1) == yt.stride(1) == 1 and stats.stride(1) == 1
    m_s, s_s, u_s, c, m_t, s_t = stats.unbind(0)
    stats_kernel[(R,)](
        ys, yt, bs if bs is not None else ys, bt if bt is not None else yt, m_s, s_s, u_s, c, m_t, s_t,
        C, ys.stride(0), yt.stride(0),
        float(student.logit_scale), float(student.softcap or 1.0), float(teacher.logit_scale),
        float(teacher.softcap or 1.0), student.inv_temp,
        HAS_BS=bs is not None, HAS_BT=bt is not None, S_SOFTCAP=student.softcap is not None,
        T_SOFTCAP=teacher.softcap is not None, MODE=mode, HAS_ENTROPY=with_entropy, FIRST=first,
        BLOCK_C=BLOCK_C, num_warps=NUM_WARPS,
    )


@triton.jit
def _log_probs(ys_row, yt_row, bs_ptr, bt_ptr, cols, ok, lse_s, lse_t, s_scale, s_softcap, t_scale, t_softcap,
               inv_temp, HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr):
    """(z_s, log p_s, log p_t) of one block of a row; the log-probs are 0 in padded columns."""
    zs = load_z(ys_row, bs_ptr, cols, ok, s_scale, s_softcap, inv_temp, HAS_BS, S_SOFTCAP)
    zt = load_z(yt_row, bt_ptr, cols, ok, t_scale, t_softcap, inv_temp, HAS_BT, T_SOFTCAP)
    return zs, tl.where(ok, zs - lse_s, 0.0), tl.where(ok, zt - lse_t, 0.0)


@triton.jit
def jit_log_mix(ps, pt, beta):
    """log((1 - beta) p_s + beta p_t), clamped where both underflow (their terms carry weight 0)."""
    return tl.log(tl.maximum((1.0 - beta) * ps + beta * pt, TINY))


@triton.jit
def jsd_kernel(
    ys_ptr, yt_ptr, bs_ptr, bt_ptr,
    lse_s_ptr, lse_t_ptr,  # [R] float32
    jsd_ptr, aux_ptr,  # [R] float32 accumulators: the JSD and KL(p_s || m), added to in place
    C, stride_ys, stride_yt,
    beta, s_scale, s_softcap, t_scale, t_softcap, inv_temp,
    # Meta-parameters
    HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ys_row = ys_ptr + row * stride_ys
    yt_row = yt_ptr + row * stride_yt
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    kl_sm = tl.zeros((), tl.float32)
    kl_tm = tl.zeros((), tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        ok = cols < C
        zs, ls, lt = _log_probs(ys_row, yt_row, bs_ptr, bt_ptr, cols, ok, lse_s, lse_t, s_scale, s_softcap, t_scale,
                                t_softcap, inv_temp, HAS_BS, HAS_BT, S_SOFTCAP, T_SOFTCAP)
        ps = tl.where(ok, tl.exp(ls), 0.0)
        pt = tl.where(ok, tl.exp(lt), 0.0)
        lm = jit_log_mix(ps, pt, beta)
        kl_sm += tl.sum(ps * (ls - lm), axis=0)
        kl_tm += tl.sum(pt * (lt - lm), axis=0)
    tl.store(jsd_ptr + row, tl.load(jsd_ptr + row) + beta * kl_tm + (1.0 - beta) * kl_sm)
    tl.store(aux_ptr + row, tl.load(aux_ptr + row) + kl_sm)


def jsd_tile(ys, yt, bs, bt, lse_s, lse_t, jsd, aux, *, beta: float, student, teacher) -> None:
    R, C = ys.shape
    if R == 0:
        return
    jsd_kernel[(R,)](
        ys, yt, bs if bs is not None else ys, bt if bt is not None else yt, lse_s, lse_t, jsd, aux,
        C, ys.stride(0), yt.stride(0),
        float(beta), float(student.logit_scale), float(student.softcap or 1.0), float(teacher.logit_scale),
        float(teacher.softcap or 1.0), student.inv_temp,
        HAS_BS=bs is not None, HAS_BT=bt is not None, S_SOFTCAP=student.softcap is not None,
        T_SOFTCAP=teacher.softcap is not None, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS,
    )


@triton.jit
def grad_kernel(
    ys_ptr, yt_ptr, g_ptr,  # g: [R, C] out, G = dL/dy_s (may share ys's storage, see IN_PLACE)
    bs_ptr, bt_ptr,
    lse_s_ptr, lse_t_ptr, aux_ptr, ent_ptr, gd_ptr, ge_ptr,  # [R] float32 each
    C, stride_ys, stride_yt, stride_g,
    beta, s_scale, s_softcap, t_scale, t_softcap, inv_temp,
    # Meta-parameters
    HAS_BS: tl.constexpr, HAS_BT: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
    MODE: tl.constexpr, HAS_GD: tl.constexpr, HAS_GE: tl.constexpr, IN_PLACE: tl.constexpr,
    EMULATE_RNE: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ys_row = ys_ptr + row * stride_ys
    yt_row = yt_ptr + row * stride_yt
    g_row = g_ptr + row * stride_g
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    aux = tl.load(aux_ptr + row)
    gd = tl.load(gd_ptr + row) if HAS_GD else 0.0
    ge = tl.load(ge_ptr + row) if HAS_GE else 0.0
    ent = tl.load(ent_ptr + row) if HAS_GE else 0.0
    live = (gd != 0.0) | (ge != 0.0)  # rows without upstream gradient write exact zeros
    w = (1.0 - beta) * gd
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        ok = cols < C
        zs, ls, lt = _log_probs(ys_row, yt_row, bs_ptr, bt_ptr, cols, ok, lse_s, lse_t, s_scale, s_softcap, t_scale,
                                t_softcap, inv_temp, HAS_BS, HAS_BT, S_SOFTCAP, T_SOFTCAP)
        ps = tl.exp(ls)
        # the student's entropy: d H / d z = -p_s (log p_s + H)
        g = -ge * ps * (ls + ent)
        if MODE == 0:  # forward KL: p_s - p_t
            g += gd * (ps - tl.exp(lt))
        if MODE == 1:  # reverse KL: p_s (log p_s - log p_t - KL)
            g += gd * ps * (ls - lt - aux)
        if MODE == 2:  # JSD: (1 - beta) p_s (log p_s - log m - KL(p_s || m))
            g += w * ps * (ls - jit_log_mix(ps, tl.exp(lt), beta) - aux)
        g = chain_transform(g, zs, s_scale, s_softcap, inv_temp, S_SOFTCAP)
        g = tl.where(live, g, 0.0)
        if IN_PLACE:
            # G (2-byte) is written over the first half of this row's float32 logits: every warp must have loaded
            # the block's bytes before any warp stores
            tl.debug_barrier()
        tl.store(g_row + cols, round_to(g, g_ptr.dtype.element_ty, EMULATE_RNE), mask=ok)


def grad_tile(ys, yt, bs, bt, lse_s, lse_t, aux, entropy, grad_div, grad_ent, out_dtype: torch.dtype, *, mode: int,
              beta: float, student, teacher) -> torch.Tensor:  # [R, C] G in ys's storage
    """G = dL/dy_s over the slice, written over the student's tile (float32 in place; 2-byte in the first half of
    each row, row stride ``2 * ys.stride(0)`` in its own units)."""
    R, C = ys.shape
    g = grad_out(ys, out_dtype)
    if R == 0:
        return g
    dummy = lse_s
    grad_kernel[(R,)](
        ys, yt, g, bs if bs is not None else ys, bt if bt is not None else yt,
        lse_s, lse_t, aux, entropy if entropy is not None else dummy,
        grad_div if grad_div is not None else dummy, grad_ent if grad_ent is not None else dummy,
        C, ys.stride(0), yt.stride(0), g.stride(0),
        float(beta), float(student.logit_scale), float(student.softcap or 1.0), float(teacher.logit_scale),
        float(teacher.softcap or 1.0), student.inv_temp,
        HAS_BS=bs is not None, HAS_BT=bt is not None, S_SOFTCAP=student.softcap is not None,
        T_SOFTCAP=teacher.softcap is not None, MODE=mode, HAS_GD=grad_div is not None, HAS_GE=grad_ent is not None,
        IN_PLACE=out_dtype != torch.float32, EMULATE_RNE=INTERPRET, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS,
    )
    return g
