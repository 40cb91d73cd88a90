"""Plain-PyTorch reference for every number fastrl computes: the spec.

Everything here materialises the full ``[N, V]`` logits, in whatever dtype it is asked for (float64 for
ground truth, the input dtype for "what PyTorch itself would do"). Tests and benchmarks import these
functions; nothing here is fast and nothing here should be.

The math (docs/design.md, "The math"): logits ``y = h W^T + b``; transformed ``z = softcap(scale * y) / T``;
``logp_n = z[n, t_n] - logsumexp(z[n])``; entropy ``H_n = -sum_j p_nj log p_nj``.
"""

from __future__ import annotations

import math

import torch

from fastrl.losses.arithmetic import kl_estimate, policy_loss_from_logprobs, value_loss_reference

__all__ = [
    "transform_logits",
    "logits_reference",
    "logprobs_reference",
    "masked_logprobs_reference",
    "rule_mask_reference",
    "divergence_reference",
    "kl_estimate",
    "policy_loss_from_logprobs",
    "value_loss_reference",
]


def transform_logits(
    logits: torch.Tensor,  # [..., V]
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """``softcap(logit_scale * logits) / temperature``; softcap is ``c * tanh(x / c)`` when set."""
    z = logits * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def logits_reference(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None = None,  # [V]
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [N, V]
    """Transformed logits, materialised. ``dtype`` casts the inputs first (None: keep the input dtype)."""
    if dtype is not None:
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    y = hidden @ weight.T
    if bias is not None:
        y = y + bias
    return transform_logits(y, temperature=temperature, logit_scale=logit_scale, softcap=softcap)


def logprobs_reference(
    hidden: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [...] int64
    *,
    bias: torch.Tensor | None = None,  # [V]
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([...], [...]) in the compute dtype
    """Log-probabilities of ``targets`` and entropies, from materialised logits.

    ``dtype=None`` computes in the input dtype, exactly as a plain PyTorch trainer would (logits rounded
    to bf16 when the inputs are bf16); ``dtype=torch.float64`` gives ground truth. Ignored targets give
    log-prob 0 and entropy 0 (and no gradient).
    """
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    z = logits_reference(
        h, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap, dtype=dtype
    )
    logp_all = torch.log_softmax(z, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return _at_targets(logp_all, entropy, t, t != ignore_index, lead)


def _at_targets(
    logp_all: torch.Tensor,  # [N, V]
    entropy: torch.Tensor,  # [N]
    t: torch.Tensor,  # [N] int64
    active: torch.Tensor,  # [N] bool: the target is not ignore_index
    lead: torch.Size,
) -> tuple[torch.Tensor, torch.Tensor]:  # (logp, entropy) of shape lead
    """Each token's log-prob of its target, and its entropy; ignored tokens give 0 for both (and no gradient)."""
    safe_t = torch.where(active, t, torch.zeros_like(t))
    logp = logp_all.gather(-1, safe_t[:, None]).squeeze(-1)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(active, logp, zero)
    entropy = torch.where(active, entropy, zero)
    return logp.reshape(lead), entropy.reshape(lead)


def masked_logprobs_reference(
    hidden: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [...] int64
    kept_mask: torch.Tensor,  # [..., V] bool (or [N, V] for the flattened tokens): True where the id is kept
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([...], [...]) in the compute dtype
    """Log-probabilities and entropies under ``pi^S``: the softmax restricted to each token's kept ids and
    renormalised (the spec of ``support=``). Materialised; ``dtype=torch.float64`` gives ground truth.

    ``logp = z_t - logsumexp_S(z)``, ``H = -sum_S p log p``; ignored tokens give 0 and no gradient (their mask
    is not read). The target of a counted token must be kept (a sampled token lies in its set)."""
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    kept = kept_mask.reshape(t.numel(), -1)
    z = logits_reference(h, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                         dtype=dtype)
    active = t != ignore_index
    kept = kept | ~active[:, None]  # ignored rows: any finite row, masked out below
    logp_all = torch.log_softmax(z.masked_fill(~kept, float("-inf")), dim=-1)
    zero = torch.zeros((), dtype=logp_all.dtype, device=logp_all.device)
    # dropped ids: logp -inf; select before multiplying so their gradient is 0, not 0 * inf
    logp_kept = torch.where(kept, logp_all, zero)
    entropy = -(torch.where(kept, logp_kept.exp(), zero) * logp_kept).sum(-1)
    return _at_targets(logp_all, entropy, t, active, lead)


def rule_mask_reference(
    hidden: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [...] int64
    rule,  # fastrl.SamplerRule
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    positions: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # kept [N, V] bool, outside [...] bool
    """The kept mask ``fastrl.replay_rule`` computes, from materialised logits (``fastrl.ops.rules.apply_rule``,
    the one definition of a rule): each counted token's set extended by its target where the rule dropped it
    (``outside``); ignored tokens keep nothing."""
    from fastrl.ops.rules import apply_rule, rule_positions

    pos = rule_positions(targets, rule, positions)
    t = targets.reshape(-1)
    z = logits_reference(hidden.reshape(-1, hidden.shape[-1]), weight, bias, temperature=temperature,
                         logit_scale=logit_scale, softcap=softcap, dtype=dtype)
    kept = apply_rule(z, rule, pos)
    active = t != ignore_index
    rows = active.nonzero().squeeze(1)
    outside = torch.zeros_like(active)
    outside[rows] = ~kept[rows, t[rows]]
    kept[rows, t[rows]] = True
    kept[~active] = False
    return kept, outside.reshape(targets.shape)
def divergence_reference(
    hidden: torch.Tensor,  # [..., H] student
    weight: torch.Tensor,  # [V, H]
    teacher_hidden: torch.Tensor,  # [..., H_t]
    teacher_weight: torch.Tensor,  # [V, H_t]
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    mask: torch.Tensor | None = None,  # [...]: 0 where a token does not count
    support=None,  # fastrl.KeptSet, rows = the flattened tokens, or None (the whole vocabulary)
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # divergence [...], student entropy [...]
    """Per-token divergence between student ``p_s`` and teacher ``p_t`` and the student's entropy, materialised.

    ``beta=0``: KL(p_t || p_s); ``beta=1``: KL(p_s || p_t); ``0 < beta < 1``: the generalized JSD of TRL 1.16's
    ``DistillationTrainer``, ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with ``m = (1 - beta) p_s + beta p_t``
    (no temperature**2 factor, as TRL). Each model's logits are transformed by its own scale and softcap, then
    both by ``temperature``. ``support``: both distributions renormalised over each token's kept set.
    ``dtype`` as in ``logprobs_reference`` (None: the input dtype; float64: ground truth). Masked tokens give 0.
    """
    lead = hidden.shape[:-1]
    zs = logits_reference(hidden.reshape(-1, hidden.shape[-1]), weight, bias, temperature=temperature,
                          logit_scale=logit_scale, softcap=softcap, dtype=dtype)
    zt = logits_reference(teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), teacher_weight, teacher_bias,
                          temperature=temperature, logit_scale=teacher_logit_scale, softcap=teacher_softcap,
                          dtype=dtype if dtype is not None else zs.dtype).to(zs.dtype)
    if support is not None:
        keep = support.to_mask().to(zs.device)
        zs, zt = zs.masked_fill(~keep, float("-inf")), zt.masked_fill(~keep, float("-inf"))
        # log-probs of ids outside the set: 0 (their probabilities are 0), so no 0 * inf anywhere, gradients included
        ls = torch.where(keep, torch.log_softmax(zs, -1), 0.0)
        lt = torch.where(keep, torch.log_softmax(zt, -1), 0.0)
        ps, pt = ls.exp() * keep, lt.exp() * keep
    else:
        ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
        ps, pt = ls.exp(), lt.exp()
    if beta == 0.0:
        div = (pt * (lt - ls)).sum(-1)
    elif beta == 1.0:
        div = (ps * (ls - lt)).sum(-1)
    else:
        log_m = torch.logaddexp(ls + math.log(1 - beta), lt + math.log(beta))
        div = (beta * pt * (lt - log_m) + (1 - beta) * ps * (ls - log_m)).sum(-1)
    entropy = -(ps * ls).sum(-1)
    if mask is not None:
        on = mask.reshape(-1).to(div.device) != 0
        zero = torch.zeros((), dtype=div.dtype, device=div.device)
        div, entropy = torch.where(on, div, zero), torch.where(on, entropy, zero)
        lead = mask.shape
    return div.reshape(lead), entropy.reshape(lead)
