"""The one-pass policy loss over a support (``policy_loss(support=...)``): the kept-set engine inside
``fastrl::policy_loss_one_pass``.

Over a support every token's log-prob and entropy (and, with ``kl_estimator="exact"``, its KL to the reference over
the same support) come from the kept entries' logits (``fastrl.ops.kept``: no vocabulary walk), all of
them before any gradient is needed. So, unlike the vocabulary chunks of ``one_pass._one_pass``, the loss gradient is
taken once, on the whole ``[B, T]`` loss with every value known: exact for every loss type, sequence-coupled ones
and ``top_entropy_quantile`` included (no placeholders). Then ``G = dL/dy`` per entry

    G = g_lp (1[j = t] - p_j) - g_en p_j (log p_j + H) + g_kl p_j (log p_j - log p_ref,j - KL)      (times dz/dy)

and the engine's gradient products. Cost: ``L`` logits per token and head, 2 L (H + H_ref) FLOPs forward and 4 L H
backward (the entry logits are kept, nothing is recomputed), ``L`` what the plan computes per token
(``fastrl.ops.kept.build_plan``: ``K_max`` on the per-row plan; docs/kept-set-costs.md).
"""

from __future__ import annotations

import dataclasses

import torch

from fastrl.losses.config import PolicyLossConfig
from fastrl.ops import kept as K
from fastrl.ops import torch_backend as TB
from fastrl.ops.config import LogitTransform
from fastrl.ops.kept_plan import host_bounds
from fastrl.ops.linear_logprob import compact_rows
from fastrl.ops.support import KeptSet

__all__ = ["kept_one_pass"]


def kept_one_pass(
    hidden: torch.Tensor,  # [N, H], N = B * T
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    targets: torch.Tensor,  # [N], _IGNORE where masked out
    B: int,
    T: int,
    inputs,  # one_pass._LossInputs (per_token_kl None: the exact KL, if any, is computed here from ``ref``)
    config: PolicyLossConfig,
    tf: LogitTransform,
    ids: torch.Tensor,  # [nnz] the support's CSR
    offsets: torch.Tensor,  # [N + 1]
    need: tuple[bool, bool, bool],
    compact: bool,  # True: host reads (drop masked rows); False: every row
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,  # the exact KL's (hidden [N, H_r], W, b)
    bounds: tuple[int, int],  # the engine's (tile_elems, cap); 0: the device's (fastrl.ops.kept.capacity)
    ignore: int,
    plan_arg: list[int] = (),  # fastrl.ops.kept.build_plan(live rows).arg(); empty: union tiles (host plan if compact)
    backend: str = "torch",
) -> tuple[torch.Tensor, dict, tuple, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    # (loss, metrics, (grad_h, grad_w, grad_b), logp [N], entropy [N], the exact KL [N] | None)
    N = hidden.shape[0]
    V = weight.shape[0]
    cdt = TB.acc_dtype(hidden.dtype)
    live = targets != ignore
    tile, cap = K.capacity(hidden.device, *bounds)
    idx = compact_rows(live) if compact else None
    if idx is not None:  # live rows only (one host sync): masked tokens cost nothing
        ks = KeptSet(ids, offsets, V, validate=False)[idx]
        ids, offsets = ks.ids, ks.offsets
    rows = (lambda x: x) if idx is None else (lambda x: x.index_select(0, idx))
    zero_dead = (lambda x: x) if compact else (
        lambda x: torch.where(live[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device)))
    h, t = zero_dead(rows(hidden)), rows(targets)
    if not plan_arg and compact:  # the op called without a plan: the host union plan, as before
        plan_arg = host_bounds(ids, offsets, tile, cap)
    plan = K.op_plan(ids, offsets, V, list(plan_arg), tile, cap, backend)
    heads = [K.Head(h, weight, bias, tf)]
    if ref is not None:
        heads.append(K.Head(zero_dead(rows(ref[0])), ref[1], ref[2], tf))
    zs, *zr = K.entry_logits(plan, heads, cdt)
    logp, ent, lse, found = K.logprob_stats(plan, zs, t, True)
    kl = lkl = None
    if ref is not None:  # KL(pi^S || pi_ref^S): both renormalised over the support
        ls = zs[: plan.nnz] - lse[plan.row]
        lkl = ls - (zr[0][: plan.nnz] - K.segment_lse(plan, zr[0])[0][plan.row])  # log p - log p_ref per entry
        kl = K.segment_sum(plan, torch.exp(ls) * lkl)
    if not compact:  # masked rows give 0; a counted row whose set lacks its target gives NaN (no exception here)
        logp, ent = K.dead_rows(live, found, logp, ent)
        kl, = K.dead_rows(live, None, kl)

    def full(x):  # [live rows] -> [B, T]
        return (x if idx is None else x.new_zeros((N,)).index_copy(0, idx, x)).view(B, T)

    logp_all, ent_all = full(logp), full(ent)
    with torch.enable_grad():
        lp, en = logp_all.detach().requires_grad_(), ent_all.detach().requires_grad_()
        kl_all = None if kl is None else full(kl).detach().requires_grad_()
        run = inputs if kl_all is None else dataclasses.replace(inputs, per_token_kl=kl_all)
        loss, metrics = run.loss(lp, en, config)
        grads = None
        if any(need):
            leaves = [lp, en] + ([kl_all] if kl_all is not None else [])
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    loss, metrics = loss.detach(), {k: v.detach() for k, v in metrics.items()}
    kl_out = None if kl_all is None else kl_all.detach().reshape(-1)
    if grads is None:
        return loss, metrics, (None, None, None), logp_all.reshape(-1), ent_all.reshape(-1), kl_out

    def per_row(g):
        return None if g is None else rows(g.reshape(-1).to(cdt))

    g_lp, g_en = per_row(grads[0]), per_row(grads[1])
    extra = None
    if kl is not None and grads[2] is not None:  # d KL / d z_j = p_j (log p_j - log p_ref,j - KL)
        extra = per_row(grads[2])[plan.row] * torch.exp(ls) * (lkl - kl[plan.row])
    G = K.logprob_grad(plan, zs, t, lse, ent, g_lp, g_en, tf, extra=extra)
    gh, gw, gb = K.entry_backward(plan, heads[0], G, need)
    if gh is not None and idx is not None:
        gh = gh.new_zeros((N, gh.shape[1])).index_copy_(0, idx, gh)
    return loss, metrics, (gh, gw, gb), logp_all.reshape(-1), ent_all.reshape(-1), kl_out
