"""Log-probabilities and entropies over a ``KeptSet`` from a head sharded over the vocabulary (tensor parallelism).

The kept set (the same CSR on every rank) is split by the shard that holds each id: rank r computes the logits of
the kept ids in its rows ``[v0, v1)`` only (one dot product per kept entry, ``E_r`` of them, in bounded chunks), its
per-token statistics over them (max, sum of exps, ``sum p z``, the target's logit where it holds it: a token whose
ids all live on other ranks contributes nothing), and ``fastrl.ops.sharded.merge_stats`` combines them with the
same two O(N) all-reduces as the full softmax. Backward: each kept entry's ``G`` from the global statistics, the
weight (and bias) gradient scattered into the local rows, the hidden gradient all-reduced once. Cost per rank:
``2 E_r H`` FLOPs forward, ``4 E_r H`` backward, ``E_r`` logits kept between them (as the kept-set engine keeps
them); nothing of size V.
"""

from __future__ import annotations

import torch

from fastrl.ops.sharded_base import VocabShard, all_reduce, merge_stats
from fastrl.ops.torch_backend import acc_dtype, upcast

__all__ = ["ShardedKept", "local_entries"]

_CHUNK_BYTES = 32 << 20  # per chunk of kept entries: [chunk, H] gathered rows of hidden and weight


def local_entries(ids: torch.Tensor, offsets: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [E_r], local column [E_r]) of the kept entries whose id lies in ``[v0, v1)``."""
    n = offsets.numel() - 1
    rows = torch.repeat_interleave(torch.arange(n, device=ids.device), offsets[1:] - offsets[:-1])
    mine = (ids >= v0) & (ids < v1)
    return rows[mine], ids[mine] - v0


def _chunks(E: int, H: int):
    step = max(1, _CHUNK_BYTES // (8 * max(H, 1)))
    for e0 in range(0, E, step):
        yield e0, min(e0 + step, E)


def _segment_stats(z, rows, is_t, N, with_entropy):
    """Per-row (lse_l, entropy_l, target logit) over the local kept entries (-inf / 0 where a row has none)."""
    m = torch.full((N,), float("-inf"), dtype=z.dtype, device=z.device).scatter_reduce(0, rows, z, "amax")
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    d = z - m_safe[rows]
    p = torch.exp(d)
    s = torch.zeros_like(m).index_add_(0, rows, p)
    lse = torch.where(s > 0, m_safe + torch.log(s), torch.full_like(s, float("-inf")))
    ent = None
    if with_entropy:
        u = torch.zeros_like(m).index_add_(0, rows, p * d)
        ent = torch.where(s > 0, torch.log(s) - u / s, torch.zeros_like(s))
    zt = torch.zeros_like(m).index_add_(0, rows, torch.where(is_t, z, torch.zeros_like(z)))
    return lse, ent, zt


class ShardedKept(torch.autograd.Function):
    """(logp [A], entropy [A] | None, lse over the kept set [A]) of live rows, from this rank's vocabulary shard."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, cols, shard: VocabShard, tf, with_entropy: bool):
        N, H = hidden.shape
        cdt = acc_dtype(hidden.dtype)
        E = rows.numel()
        z = torch.empty(E, dtype=cdt, device=hidden.device)
        for e0, e1 in _chunks(E, H):  # one dot product per kept entry: [chunk, H] rows gathered, never [N, V]
            r, c = rows[e0:e1], cols[e0:e1]
            y = (upcast(hidden.index_select(0, r)) * upcast(weight.index_select(0, c))).sum(1)
            if bias is not None:
                y += upcast(bias.index_select(0, c))
            z[e0:e1] = y
        tf.apply_(z)
        is_t = (cols + shard.v0) == targets[rows]
        lse_l, ent_l, zt_l = _segment_stats(z, rows, is_t, N, with_entropy)
        lse, ent, zt = merge_stats(lse_l, ent_l, zt_l, shard.group)
        ctx.save_for_backward(hidden, weight, bias, rows, cols, is_t, z, lse, ent)
        ctx.shard, ctx.tf = shard, tf
        ctx.mark_non_differentiable(lse)
        return zt - lse, ent, lse

    @staticmethod
    def backward(ctx, grad_logp, grad_ent, _grad_lse):
        hidden, weight, bias, rows, cols, is_t, z, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        p = torch.exp(z - lse[rows])
        G = torch.zeros_like(z)
        if grad_logp is not None:  # d logp / d z_j = 1[j = t] - p_j over the kept set
            G += grad_logp.to(z.dtype)[rows] * (is_t.to(z.dtype) - p)
        if grad_ent is not None and ent is not None:  # d H / d z_j = -p_j (z_j - lse + H)
            G -= grad_ent.to(z.dtype)[rows] * p * (z - lse[rows] + ent[rows])
        G *= ctx.tf.dz_dy(z)
        H = hidden.shape[1]
        gh = torch.zeros(hidden.shape, dtype=z.dtype, device=z.device) if need_h else None
        gw = torch.zeros(weight.shape, dtype=z.dtype, device=z.device) if need_w else None
        for e0, e1 in _chunks(z.numel(), H):
            r, c, g = rows[e0:e1], cols[e0:e1], G[e0:e1, None]
            if need_h:
                gh.index_add_(0, r, g * upcast(weight.index_select(0, c)))
            if need_w:
                gw.index_add_(0, c, g * upcast(hidden.index_select(0, r)))
        gb = torch.zeros((weight.shape[0],), dtype=z.dtype, device=z.device).index_add_(0, cols, G) if need_b else None
        if need_h:
            gh = all_reduce(gh, "sum", ctx.shard.group).to(hidden.dtype)
        return (gh, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype),
                None, None, None, None, None, None)
