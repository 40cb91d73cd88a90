"""The one-pass policy loss over a support (``policy_loss(support=...)``): the kept-set engine inside
``fastrl::policy_loss_one_pass``.

Over a support every token's log-prob and entropy (and, with ``kl_estimator="exact"``, its KL to the reference over
the same support) come from the kept entries' logits (``fastrl.ops.kept``: no vocabulary walk), all of
them before any gradient is needed. So, unlike the vocabulary chunks of ``fastrl.ops.one_pass``, the loss gradient
is taken once, by the caller's loss on the whole ``[B, T]`` batch with every value known: exact for every loss type,
sequence-coupled ones and ``top_entropy_quantile`` included (no placeholders). Then ``G = dL/dy`` per entry

    G = g_lp (1[j = t] - p_j) - g_en p_j (log p_j + H) + g_kl p_j (log p_j - log p_ref,j - KL)      (times dz/dy)

and the engine's gradient products. Cost: ``L`` logits per token and head, 2 L (H + H_ref) FLOPs forward and 4 L H
backward (the entry logits are kept, nothing is recomputed), ``L`` what the plan computes per token
(``fastrl.ops.kept.build_plan``: ``K_max`` on the per-row plan; docs/kept-set-costs.md).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from fastrl.ops import kept as K
from fastrl.ops import torch_backend as TB
from fastrl.ops._checks import compact_rows
from fastrl.ops.config import LogitTransform
from fastrl.ops.kept_plan import host_bounds
from fastrl.ops.one_pass import IGNORE
from fastrl.ops.support import KeptSet

__all__ = ["run"]


def run(
    hidden: torch.Tensor,  # [N, H], N = B * T
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    targets: torch.Tensor,  # [N], IGNORE where masked out
    B: int,
    T: int,
    loss: Callable,  # (logp [B, T], entropy [B, T], KL [B, T] | None, leaves) -> (loss, metrics, grads | None)
    tf: LogitTransform,
    ids: torch.Tensor,  # [nnz] the support's CSR
    offsets: torch.Tensor,  # [N + 1]
    need: tuple[bool, bool, bool],
    compact: bool,  # True: host reads (drop masked rows); False: every row
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,  # the exact KL's (hidden [N, H_r], W, b)
    bounds: tuple[int, int],  # the engine's (tile_elems, cap); 0: the device's (fastrl.ops.kept.capacity)
    plan_arg: list[int] = (),  # fastrl.ops.kept.build_plan(live rows).arg(); empty: union tiles (host plan if compact)
    backend: str = "torch",
    given: torch.Tensor | None = None,  # [nnz] the policy's entry logits, computed already (a rule's replay)
) -> tuple[torch.Tensor, dict, tuple, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss, metrics, (grad_h, grad_w, grad_b), logp [N], entropy [N], the exact KL [N] | None).

    ``loss`` is the caller's (the engine knows no loss): given every row's log-prob, entropy and KL as ``[B, T]``
    leaves, it returns the loss, its metrics and, when ``leaves`` is true, d loss / d (logp, entropy, KL)."""
    rows = _KeptRows(hidden, targets, ids, offsets, weight.shape[0], compact)
    if given is not None and given.shape != rows.ids.shape:  # dropped rows held entries: not a replay's set
        given = None
    v = _values(rows, hidden, weight, bias, targets, tf, ref, bounds, plan_arg, backend, given)
    full = rows.full  # [live rows] -> [N]
    logp_all, ent_all = full(v.logp).view(B, T), full(v.ent).view(B, T)
    kl_all = None if v.kl is None else full(v.kl).view(B, T)
    total, metrics, grads = loss(logp_all, ent_all, kl_all, any(need))
    kl_out = None if kl_all is None else kl_all.reshape(-1)
    if grads is None:
        return total, metrics, (None, None, None), logp_all.reshape(-1), ent_all.reshape(-1), kl_out
    gh, gw, gb = _backward(rows, v, grads, need, tf)
    return total, metrics, (gh, gw, gb), logp_all.reshape(-1), ent_all.reshape(-1), kl_out


class _KeptRows:
    """The rows the engine computes: the live ones (one host sync: masked tokens cost nothing), or every row with
    the hidden states of masked ones zeroed (no-sync)."""

    def __init__(self, hidden, targets, ids, offsets, V: int, compact: bool):
        self.N, self.compact = hidden.shape[0], compact
        self.live = targets != IGNORE
        self.idx = compact_rows(self.live) if compact else None
        if self.idx is not None:
            ks = KeptSet(ids, offsets, V, validate=False)[self.idx]
            ids, offsets = ks.ids, ks.offsets
        self.ids, self.offsets = ids, offsets

    def take(self, x: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [rows, ...]
        return x if self.idx is None else x.index_select(0, self.idx)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [rows, H], masked rows zeroed when computed
        x = self.take(x)
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return x if self.compact else torch.where(self.live[:, None], x, zero)

    def full(self, x: torch.Tensor) -> torch.Tensor:  # [rows] -> [N], 0 at rows not computed
        return x if self.idx is None else x.new_zeros((self.N,)).index_copy(0, self.idx, x)


@dataclasses.dataclass
class _Values:
    """Every computed row's values over its kept set, and what the backward reads."""

    plan: object  # fastrl.ops.kept_plan.KeptPlan
    head: K.Head  # the policy's
    t: torch.Tensor  # [rows] targets
    zs: torch.Tensor  # [entries] the policy's logits
    lse: torch.Tensor
    logp: torch.Tensor
    ent: torch.Tensor
    kl: torch.Tensor | None = None  # [rows] KL(pi^S || pi_ref^S)
    ls: torch.Tensor | None = None  # [entries] log p
    lkl: torch.Tensor | None = None  # [entries] log p - log p_ref


def _values(rows: _KeptRows, hidden, weight, bias, targets, tf, ref, bounds, plan_arg, backend, given) -> _Values:
    """Every row's log-prob, entropy (and KL to the reference) over its kept set: no vocabulary walk."""
    tile, cap = K.capacity(hidden.device, *bounds)
    if not plan_arg and rows.compact:  # the op called without a plan: the host union plan, as before
        plan_arg = host_bounds(rows.ids, rows.offsets, tile, cap)
    plan = K.op_plan(rows.ids, rows.offsets, weight.shape[0], list(plan_arg), tile, cap, backend)
    heads = [K.Head(rows.hidden(hidden), weight, bias, tf)]
    if ref is not None:
        heads.append(K.Head(rows.hidden(ref[0]), ref[1], ref[2], tf))
    t = rows.take(targets)
    zs, *zr = K.entry_logits(plan, heads, TB.acc_dtype(hidden.dtype), given)
    logp, ent, lse, found = K.logprob_stats(plan, zs, t, True)
    v = _Values(plan, heads[0], t, zs, lse, logp, ent)
    if ref is not None:  # KL(pi^S || pi_ref^S): both renormalised over the support
        v.ls = zs[: plan.nnz] - lse[plan.row]
        v.lkl = v.ls - (zr[0][: plan.nnz] - K.segment_lse(plan, zr[0])[0][plan.row])  # log p - log p_ref per entry
        v.kl = K.segment_sum(plan, torch.exp(v.ls) * v.lkl)
    if not rows.compact:  # masked rows give 0; a counted row whose set lacks its target gives NaN (no exception here)
        v.logp, v.ent = K.dead_rows(rows.live, found, v.logp, v.ent)
        v.kl, = K.dead_rows(rows.live, None, v.kl)
    return v


def _backward(rows: _KeptRows, v: _Values, grads, need, tf: LogitTransform):
    """(grad_h [N, H], grad_w, grad_b) from d loss / d (logp, entropy, KL): ``G`` per entry, the engine's products."""
    cdt = v.zs.dtype

    def per_row(g):
        return None if g is None else rows.take(g.reshape(-1).to(cdt))

    g_lp, g_en = per_row(grads[0]), per_row(grads[1])
    extra = None
    if v.kl is not None and grads[2] is not None:  # d KL / d z_j = p_j (log p_j - log p_ref,j - KL)
        extra = per_row(grads[2])[v.plan.row] * torch.exp(v.ls) * (v.lkl - v.kl[v.plan.row])
    G = K.logprob_grad(v.plan, v.zs, v.t, v.lse, v.ent, g_lp, g_en, tf, extra=extra)
    gh, gw, gb = K.entry_backward(v.plan, v.head, G, need)
    if gh is not None and rows.idx is not None:
        gh = gh.new_zeros((rows.N, gh.shape[1])).index_copy_(0, rows.idx, gh)
    return gh, gw, gb
