"""``fused_divergence`` with the student's and/or the teacher's head sharded over the vocabulary (tensor parallelism).

Each head is a DTensor placed ``Shard(0)`` on a 1-D mesh (``fastrl.ops.sharded``) or replicated (a plain tensor or a
DTensor placed ``Replicate()``); both sharded ones must split the same V the same way (``torch.chunk``'s rows). A
replicated head is read at the sharded one's rows ``[v0, v1)``. Per token, with ``a = log p_s`` and ``b = log p_t``
over the vocabulary, the divergence is a sum over ids of one term ``phi(a_j, b_j)`` (TRL 1.16's three cases):

* ``beta = 0``: ``phi = e^b (b - a)`` (forward KL), ``d phi / d a = -e^b``;
* ``beta = 1``: ``phi = e^a (a - b)`` (reverse KL), ``d phi / d a = e^a (a - b + 1)``;
* otherwise, ``log m = logaddexp(log(1 - beta) + a, log(beta) + b)``: ``phi = beta e^b (b - log m) + (1 - beta) e^a
  (a - log m)``, ``d phi / d a = (1 - beta) e^a (a - log m)``.

Since ``a_j = z_j - lse_s``, the student-logit gradient is ``dD/dz_j = phi'_j - p_j c`` with ``c = sum_k phi'_k``.
Passes: (1) each head's shard statistics on its backend (``linear_stats``), merged across ranks
(``fastrl.ops.sharded.merge_stats``: O(N) numbers); (2) torch tiles of both heads over the shard, ``D`` and ``c`` as
per-token sums, one SUM all-reduce of ``[3, N]``; backward: the tiles again, ``G`` of the student's shard, its weight
(and bias) gradient locally, the hidden gradient all-reduced once. A replicated student weight's gradient is
all-reduced as a whole ``[V, H]`` (each rank fills its rows): prefer sharding the student. The second pass and the
backward run torch tiles of at most ``tile_columns`` columns on every backend (a first version: correctness first).
"""

from __future__ import annotations

import math

import torch

from fastrl.ops import torch_backend as TB
from fastrl.ops._checks import (
    autocast_inputs, check_divergence_finite, check_head, compact_rows, dense_bias, unit_stride,
)
from fastrl.ops.backend import resolve_backend
from fastrl.ops.config import LogitTransform
from fastrl.ops.custom_ops import host_sync_enabled
from fastrl.ops.sharded_base import all_reduce, local_replica, merge_stats, vocab_shard

__all__ = ["sharded_divergence"]


def _phi(a: torch.Tensor, b: torch.Tensor, dz: torch.Tensor, shift: torch.Tensor, beta: float
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi, d phi / d a) elementwise on a tile of log-probabilities ``a``, ``b``, with ``b - a = dz - shift``
    (``dz = z_t - z_s``, ``shift = lse_t - lse_s`` per row). For the two KLs ``phi`` leaves out the ``shift`` term,
    whose sum over the vocabulary is exactly ``-/+ shift`` (``_finish``): summing ``p * shift`` in float32 would
    add ``shift`` times the rounding of ``sum p``."""
    if beta == 0.0:
        eb = torch.exp(b)
        return torch.where(eb > 0, eb * dz, 0.0), -eb
    ea = torch.exp(a)
    d = dz - shift
    if beta == 1.0:
        return torch.where(ea > 0, -ea * dz, 0.0), ea * (1.0 - torch.where(ea > 0, d, 0.0))
    la = -torch.logaddexp(torch.full_like(d, math.log1p(-beta)), d + math.log(beta))  # a - log m
    eb = torch.exp(b)
    t_s = torch.where(ea > 0, ea * la, 0.0)
    t_t = torch.where(eb > 0, eb * (d + la), 0.0)  # b - log m = d + (a - log m)
    return beta * t_t + (1.0 - beta) * t_s, (1.0 - beta) * t_s


def _finish(acc: torch.Tensor, shift: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, c) [N] from the summed tiles ``acc`` = [sum phi, sum phi', sum p] (p the KL's weighting distribution).

    The KLs divide by the summed ``p`` (1 but for rounding: the float32 normaliser's error cancels, as the unsharded
    online statistics' ``u / s`` does) and add back ``-/+ shift``; their ``c`` is exact: -1 (forward), ``1 + D``
    (reverse)."""
    if beta == 0.0:
        D = acc[0] / acc[2] - shift
        return D, -torch.ones_like(D)
    if beta == 1.0:
        D = acc[0] / acc[2] + shift
        return D, 1.0 + D
    return acc[0], acc[1]


class _SumGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over the group (a replicated student head read at one shard's rows)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), "sum", ctx.group), None


class ShardedDivergence(torch.autograd.Function):
    """(divergence [A], student entropy [A] | None) of live rows from the local vocabulary rows of both heads."""

    @staticmethod
    def forward(ctx, h, w, b, ht, wt, bt, group, beta, tf_s, tf_t, with_entropy, backend):
        from fastrl.ops.linear_logprob import linear_stats

        A, cdt = h.shape[0], TB.acc_dtype(h.dtype)
        none = torch.full((A,), -1, dtype=torch.int64, device=h.device)  # no target: its logit is not read
        if w.shape[0] > 0:
            with torch.autocast(h.device.type, enabled=False):
                lse_sl, _, ent_sl = linear_stats(h, w, b, none, tf_s, backend, with_entropy)
                lse_tl, _, _ = linear_stats(ht, wt, bt, none, tf_t, backend, False)
        else:
            lse_sl = lse_tl = torch.full((A,), float("-inf"), dtype=cdt, device=h.device)
            ent_sl = torch.zeros_like(lse_sl) if with_entropy else None
        lse_s, ent, _ = merge_stats(lse_sl, ent_sl, None, group)
        lse_t, _, _ = merge_stats(lse_tl, None, None, group)
        acc = torch.zeros((3, A), dtype=cdt, device=h.device)
        shift = lse_t - lse_s
        for a, bb, dz, _, _ in _tiles(h, w, b, ht, wt, bt, lse_s, lse_t, tf_s, tf_t):
            phi, dphi = _phi(a, bb, dz, shift[:, None], beta)
            acc[0] += phi.sum(1)
            acc[1] += dphi.sum(1)
            acc[2] += torch.exp(bb if beta == 0.0 else a).sum(1)
        D, c = _finish(all_reduce(acc, "sum", group), shift, beta)
        ctx.save_for_backward(h, w, b, ht, wt, bt, lse_s, lse_t, c, ent)
        ctx.args = (group, beta, tf_s, tf_t)
        return D, ent

    @staticmethod
    def backward(ctx, g_div, g_ent):
        h, w, b, ht, wt, bt, lse_s, lse_t, c, ent = ctx.saved_tensors
        group, beta, tf_s, tf_t = ctx.args
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = b is not None and ctx.needs_input_grad[2]
        cdt = lse_s.dtype
        g_div = torch.zeros_like(lse_s) if g_div is None else g_div.to(cdt)
        g_ent = None if (g_ent is None or ent is None) else g_ent.to(cdt)
        h32 = TB.upcast(h)
        gh = torch.zeros_like(h32) if need_h else None
        gw = torch.empty_like(w) if need_w else None
        gb = torch.empty((w.shape[0],), dtype=cdt, device=h.device) if need_b else None
        shift = (lse_t - lse_s)[:, None]
        for a, bb, dz, zs, (v0, v1) in _tiles(h, w, b, ht, wt, bt, lse_s, lse_t, tf_s, tf_t):
            _, dphi = _phi(a, bb, dz, shift, beta)
            p = torch.exp(a)
            G = g_div[:, None] * (dphi - p * c[:, None])
            if g_ent is not None:  # d H / d z_j = -p_j (z_j - lse + H)
                G -= g_ent[:, None] * p * (a + ent[:, None])
            dzdy = tf_s.dz_dy(zs)
            G = G * dzdy
            if need_w:
                gw[v0:v1] = (G.T @ h32).to(w.dtype)
            if need_h:
                gh += G @ TB.upcast(w[v0:v1])
            if need_b:
                gb[v0:v1] = G.sum(0)
        if need_h:
            gh = all_reduce(gh, "sum", group).to(h.dtype)
        return (gh, gw, gb.to(b.dtype) if need_b else None) + (None,) * 9


def _tiles(h, w, b, ht, wt, bt, lse_s, lse_t, tf_s, tf_t):
    """(log p_s, log p_t, z_t - z_s, z_s, (v0, v1)) over bounded column tiles of the local rows (global
    normalisers)."""
    V = w.shape[0]
    step = TB.tile_columns(h.shape[0], V)
    h32, ht32 = TB.upcast(h), TB.upcast(ht)
    for v0 in range(0, V, step):
        v1 = min(v0 + step, V)
        zs = TB.logits_block(h32, w, b, v0, v1, tf_s)
        zt = TB.logits_block(ht32, wt, bt, v0, v1, tf_t)
        dz = zt - zs
        yield zs - lse_s[:, None], zt.sub_(lse_t[:, None]), dz, zs, (v0, v1)


def _head_rows(weight, bias, shard, v0: int, v1: int, group, name: str, detach: bool):
    """One head's rows [v0, v1): its own shard, or the replicated head sliced (its gradient summed over ranks)."""
    if shard is not None:
        return shard.weight, shard.bias
    w, b = local_replica(weight, name), local_replica(bias, f"{name} bias")
    if detach:
        return w.detach()[v0:v1], None if b is None else b.detach()[v0:v1]
    if w.requires_grad:
        w = _SumGrad.apply(w, group)
    if b is not None and b.requires_grad:
        b = _SumGrad.apply(b, group)
    return w[v0:v1], None if b is None else b[v0:v1]


def sharded_divergence(hidden, weight, teacher_hidden, teacher_weight, *, beta, temperature, bias, teacher_bias,
                       logit_scale, teacher_logit_scale, softcap, teacher_softcap, mask, with_entropy, check_finite,
                       backend, host_sync):
    """``fastrl.fused_divergence`` with at least one head placed Shard(0) (the same outputs on every rank)."""
    if not host_sync_enabled(host_sync):
        raise ValueError("a vocabulary-sharded head (DTensor Shard(0)) runs in eager only: host_sync must be None "
                         "or True outside torch.compile")
    s_sh = vocab_shard(weight, bias)
    t_sh = vocab_shard(teacher_weight, teacher_bias, weight_name="teacher_weight", bias_name="teacher_bias")
    ref = s_sh or t_sh
    V = weight.shape[0]
    if teacher_weight.shape[0] != V:
        raise ValueError(f"the vocabularies differ: weight has V = {V} rows, teacher_weight "
                         f"{teacher_weight.shape[0]}; the divergence compares distributions over one vocabulary")
    if s_sh is not None and t_sh is not None and (s_sh.v0, s_sh.weight.shape[0], s_sh.world) != \
            (t_sh.v0, t_sh.weight.shape[0], t_sh.world):
        raise ValueError("weight and teacher_weight are sharded differently: both must be Shard(0) on meshes of one "
                         f"size (got {s_sh.world} and {t_sh.world} ranks)")
    v0, v1 = ref.v0, ref.v0 + ref.weight.shape[0]
    w, b = _head_rows(weight, bias, s_sh, v0, v1, ref.group, "weight", detach=False)
    wt, bt = _head_rows(teacher_weight, teacher_bias, t_sh, v0, v1, ref.group, "teacher_weight", detach=True)
    hidden, w, b = autocast_inputs(local_replica(hidden, "hidden"), w, b)
    teacher_hidden, wt, bt = autocast_inputs(local_replica(teacher_hidden, "teacher_hidden").detach(), wt.detach(),
                                             None if bt is None else bt.detach())
    full = (lambda x: x if x.shape[0] else x.new_empty((1,) + tuple(x.shape[1:])))  # an empty shard: check shapes
    check_head(hidden, full(w), None if b is None or not b.shape[0] else b, hidden_name="hidden",
               weight_name="weight", bias_name="bias")
    check_head(teacher_hidden, full(wt), None if bt is None or not bt.shape[0] else bt,
               hidden_name="teacher_hidden", weight_name="teacher_weight", bias_name="teacher_bias")
    lead = tuple(hidden.shape[:-1])
    if tuple(teacher_hidden.shape[:-1]) != lead:
        raise ValueError(f"teacher_hidden must have hidden's leading shape {lead}, got "
                         f"{tuple(teacher_hidden.shape[:-1])}")
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be a finite number in [0.0, 1.0], got {beta!r}")
    tf_s = LogitTransform(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    tf_t = LogitTransform(temperature=temperature, logit_scale=teacher_logit_scale, softcap=teacher_softcap)
    name = resolve_backend(hidden.device, backend)
    if mask is not None and tuple(mask.shape) != lead:
        raise ValueError(f"mask must have hidden's leading shape {lead}, got {tuple(mask.shape)}")
    N = math.prod(lead)
    h = unit_stride(hidden.reshape(N, -1))
    ht = unit_stride(teacher_hidden.reshape(N, -1))
    active = (mask.reshape(-1) != 0) if mask is not None else torch.ones(N, dtype=torch.bool, device=h.device)
    idx = compact_rows(active)
    h_live, ht_live = (h, ht) if idx is None else (h.index_select(0, idx), ht.index_select(0, idx))
    div, ent = ShardedDivergence.apply(h_live, unit_stride(w), dense_bias(b), ht_live, unit_stride(wt),
                                       dense_bias(bt), ref.group, float(beta), tf_s, tf_t, with_entropy, name)
    if idx is not None:
        div = div.new_zeros((N,)).index_copy(0, idx, div)
        ent = None if ent is None else ent.new_zeros((N,)).index_copy(0, idx, ent)
    if check_finite:
        check_divergence_finite(div.detach(), None if ent is None else ent.detach(), active, h, ht, lead)
    if with_entropy:
        return div.reshape(lead), ent.reshape(lead)
    return div.reshape(lead)
