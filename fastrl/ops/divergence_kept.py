"""``fused_divergence`` over a support: both distributions renormalised over each token's kept ids.

Both heads' logits at the kept entries come from the kept-set engine (``fastrl.ops.kept``, on the plan
``fastrl.ops.kept.build_plan`` chose: the per-row plan computes ``K_max`` logits per token and head, the union plans
their units' tiles; the bounds in docs/kept-set-costs.md, held by tests/test_kept_costs.py); everything after is
O(nnz) arithmetic on the entries, segment reductions per token (``ls = log p_s``, ``lt = log p_t`` over the support):

* forward KL (beta = 0): ``sum p_t (lt - ls)``; reverse KL (beta = 1): ``sum p_s (ls - lt)``;
* JSD: ``beta sum p_t (lt - lm) + (1 - beta) sum p_s (ls - lm)``, ``lm = log((1 - beta) p_s + beta p_t)``: the
  normalisers come first from the entries themselves, so no statistics pass;
* the student's entropy ``-sum p_s ls``.

The backward forms the student's ``G = dL/dy`` per entry from the saved entry logits (nothing recomputed) and runs
the engine's gradient products (per unit of a union plan, one batched product on the per-row plan):

* forward KL: ``gd (p_s - p_t)``; reverse KL: ``gd p_s (ls - lt - KL)``; JSD: ``(1 - beta) gd p_s (ls - lm -
  KL(p_s || m))``; the entropy: ``-ge p_s (ls + H)``; times the transform's derivative.
"""

from __future__ import annotations

import torch

from fastrl.ops import kept as K
from fastrl.ops.divergence_stats import FORWARD_KL, REVERSE_KL, log_mix
from fastrl.ops.kept import Head, KeptPlan, entry_backward, entry_logits, segment_lse, segment_sum

__all__ = ["forward", "backward"]


def _logs(plan: KeptPlan, z: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p [nnz], p [nnz]) over the support from entry logits [nnz (+ 1)] and the per-token lse [N]."""
    ls = z[: plan.nnz] - lse[plan.row]
    return ls, torch.exp(ls)


def forward(
    plan: KeptPlan, student: Head, teacher: Head, mode: int, beta: float, with_entropy: bool, cdt: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(divergence [N], entropy [N] | None, lse_s [N], lse_t [N], aux [N], entry logits [2, nnz]): aux is the KL
    for the KL modes and KL(p_s || m) for the JSD (what the backward needs)."""
    zs, zt = entry_logits(plan, [student, teacher], cdt)
    lse_s, lse_t = segment_lse(plan, zs)[0], segment_lse(plan, zt)[0]
    ls, ps = _logs(plan, zs, lse_s)
    lt, pt = _logs(plan, zt, lse_t)
    if mode == FORWARD_KL:
        div = aux = segment_sum(plan, pt * (lt - ls))
    elif mode == REVERSE_KL:
        div = aux = segment_sum(plan, ps * (ls - lt))
    else:
        lm = log_mix(ps, pt, beta)
        aux = segment_sum(plan, ps * (ls - lm))
        div = beta * segment_sum(plan, pt * (lt - lm)) + (1.0 - beta) * aux
    ent = -segment_sum(plan, ps * ls) if with_entropy else None
    return div, ent, lse_s, lse_t, aux, torch.stack([zs[: plan.nnz], zt[: plan.nnz]])


def backward(
    plan: KeptPlan, student: Head, entries: torch.Tensor,  # [2, nnz] the forward's entry logits
    lse_s: torch.Tensor, lse_t: torch.Tensor, aux: torch.Tensor, entropy: torch.Tensor | None,
    grad_div: torch.Tensor | None, grad_ent: torch.Tensor | None,  # [N] compute dtype, 0 where nothing flows
    mode: int, beta: float, need: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The student's gradients (hidden, weight, bias) of ``sum grad_div * D + grad_ent * H``."""
    zs, zt = entries[0], entries[1]
    row = plan.row
    ls, ps = _logs(plan, zs, lse_s)
    G = torch.zeros_like(ls)
    if grad_div is not None:
        gd = grad_div[row]
        if mode == FORWARD_KL:
            G += gd * (ps - torch.exp(zt - lse_t[row]))
        elif mode == REVERSE_KL:
            G += gd * ps * (ls - (zt - lse_t[row]) - aux[row])
        else:
            lm = log_mix(ps, torch.exp(zt - lse_t[row]), beta)
            G += (1.0 - beta) * gd * ps * (ls - lm - aux[row])
    if grad_ent is not None:
        G -= grad_ent[row] * ps * (ls + entropy[row])
    dzdy = student.tf.dz_dy(zs)
    if not isinstance(dzdy, float) or dzdy != 1.0:
        G *= dzdy
    return entry_backward(plan, student, K.entries(G), need)
