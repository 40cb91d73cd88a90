"""The loss arithmetic on per-token log-probs: one definition, shared by the fast path and the reference.

``fastrl.losses.policy`` (the fused loss) and ``fastrl.reference`` (the spec, which re-exports everything here)
both import these functions, so the fast path and the reference cannot drift apart: the GRPO-family policy loss
of TRL 1.16's ``GRPOTrainer._compute_loss`` (``policy_loss_from_logprobs``), the KL estimators (``kl_estimate``)
and PPO's clipped value loss (``value_loss_reference``). Nothing here touches logits.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fastrl.losses.config import CLIPPED_LOSS_TYPES, PolicyLossConfig

__all__ = ["kl_estimate", "policy_loss_from_logprobs", "value_loss_reference", "check_value_inputs"]


def kl_estimate(
    logprobs: torch.Tensor,  # [...] log pi(t)
    ref_logprobs: torch.Tensor,  # [...] log pi_ref(t)
    estimator: str = "k3",
) -> torch.Tensor:  # [...]
    """Per-token KL(pi || pi_ref) estimators, with ``r = ref_logp - logp``.

    ``k1 = -r`` (unbiased, can be negative), ``k2 = r^2 / 2``, ``k3 = exp(r) - r - 1`` (never negative).
    """
    r = ref_logprobs - logprobs
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r * r
    if estimator == "k3":
        return torch.exp(r) - r - 1
    raise ValueError(f"kl estimator must be one of 'k1', 'k2', 'k3', got {estimator!r}")


# ----------------------------------------------------------------------------------------------------------
# Policy loss on per-token log-probs: TRL 1.16's GRPOTrainer._compute_loss (gradient accumulation 1, one process)
# ----------------------------------------------------------------------------------------------------------


def _check_shape(name: str, t: object, shapes: tuple[tuple[int, ...], ...], expected: str, logprobs) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a {expected} tensor, got {type(t).__name__}")
    if tuple(t.shape) not in shapes:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, expected {expected} with logprobs of shape {tuple(logprobs.shape)}"
        )


def _check_policy_inputs(
    logprobs, entropy, advantages, mask, config, old_logprobs, ref_logprobs, importance_weights, sampling_logprobs,
    per_token_kl=None,
) -> None:
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    if not isinstance(logprobs, torch.Tensor):
        raise TypeError(f"logprobs must be a floating [B, T] tensor, got {type(logprobs).__name__}")
    if not logprobs.is_floating_point() or logprobs.dim() != 2 or logprobs.numel() == 0:
        raise ValueError(
            f"logprobs must be a non-empty floating [B, T] tensor, got {logprobs.dtype} of shape "
            f"{tuple(logprobs.shape)}"
        )
    B, T = logprobs.shape
    per_token, per_token_or_seq = ((B, T),), ((B,), (B, T))
    _check_shape("mask", mask, per_token, "[B, T]", logprobs)
    _check_shape("advantages", advantages, per_token_or_seq, "[B] or [B, T]", logprobs)
    for name, t in (("entropy", entropy), ("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                    ("sampling_logprobs", sampling_logprobs)):
        if t is not None:
            _check_shape(name, t, per_token, "[B, T]", logprobs)
    if importance_weights is not None:
        # TRL folds per-token log IS ratios into VESPO's sequence weight and refuses sequence-level vLLM IS modes.
        vespo = config.loss_type == "vespo"
        _check_shape("importance_weights", importance_weights, per_token if vespo else per_token_or_seq,
                     "[B, T] (vespo)" if vespo else "[B] or [B, T]", logprobs)
    if config.needs_entropy and entropy is None:
        raise ValueError(
            f"entropy is None but the loss needs it (entropy_coef={config.entropy_coef}, "
            f"top_entropy_quantile={config.top_entropy_quantile})"
        )
    if config.kl_estimator == "exact":
        if ref_logprobs is not None:
            raise ValueError(
                "ref_logprobs must be None with kl_estimator='exact' (the exact KL is not a function of the sampled "
                "token's log-probs): pass the per-token exact KL as per_token_kl"
            )
        if config.beta != 0.0 and per_token_kl is None:
            raise ValueError(
                f"per_token_kl is None but beta={config.beta} with kl_estimator='exact' needs the per-token exact KL "
                "([B, T], e.g. fastrl.fused_divergence(..., beta=1.0))"
            )
        if per_token_kl is not None:
            _check_shape("per_token_kl", per_token_kl, ((B, T),), "[B, T]", logprobs)
            if not per_token_kl.is_floating_point():
                raise TypeError(f"per_token_kl must be a floating tensor, got {per_token_kl.dtype}")
    elif per_token_kl is not None:
        raise ValueError(
            f"per_token_kl is given but kl_estimator={config.kl_estimator!r}: it is read only with "
            "kl_estimator='exact' (the other estimators are computed from ref_logprobs)"
        )
    if config.beta != 0.0 and config.kl_estimator != "exact" and ref_logprobs is None:
        raise ValueError(f"ref_logprobs is None but beta={config.beta} needs the reference log-probs")


def _vespo_gamma_weights(
    advantages: torch.Tensor,  # [B, 1] or [B, T]
    log_ratio: torch.Tensor,  # [B, T]  logp - old_logp
    mask: torch.Tensor,  # [B, T] in the compute dtype
    importance_weights: torch.Tensor | None,  # [B, T]
    config: PolicyLossConfig,
) -> torch.Tensor:  # [B, 1] (or [B, T] with per-token advantages), detached
    """TRL's ``GRPOTrainer.get_gamma_weights``: phi(w) = exp(lambda + k log w - lambda w), w the sequence ratio."""
    with torch.no_grad():
        lower_clamp = math.log(1e-8)
        seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
        if importance_weights is not None:
            # TRL sums log IS ratios over ALL T positions, masked or not (TRL's ratio is exp(0) = 1 there).
            log_is_ratio = torch.clamp(torch.log(importance_weights), lower_clamp, 20.0)
            seq_log_ratio = seq_log_ratio + torch.sum(log_is_ratio, dim=-1, keepdim=True)
        log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
        w_seq = torch.exp(log_w_seq)
        is_nonneg_adv = advantages >= 0
        # TRL builds k and lambda with torch.where on Python scalars, i.e. in the default dtype (float32): mirror
        # that rounding, then compute in the compute dtype.
        k_seq = torch.where(is_nonneg_adv, config.vespo_k_pos, config.vespo_k_neg).to(log_ratio.dtype)
        lambda_seq = torch.where(is_nonneg_adv, config.vespo_lambda_pos, config.vespo_lambda_neg)
        lambda_seq = lambda_seq.clamp(min=1e-4).to(log_ratio.dtype)
        log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
        return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:  # [B, T] bool
    """TRL's ``get_high_entropy_mask`` on one process: entropy >= the ``quantile`` of the masked entropies.

    TRL takes ``torch.quantile(entropies[mask].float(), q)``; ``nanquantile`` over the float32 entropies with
    the masked ones set to NaN gives the same number without the host sync of boolean indexing. An all-masked
    batch gives a NaN threshold, hence an all-False mask, as TRL's explicit empty case does.
    """
    with torch.no_grad():
        values = entropy.float().masked_fill(~mask, float("nan")).reshape(-1)
        threshold = torch.nanquantile(values, quantile)
        return ((entropy * mask) >= threshold) & mask


def policy_loss_from_logprobs(
    logprobs: torch.Tensor,  # [B, T] log pi(t), differentiable
    entropy: torch.Tensor | None,  # [B, T], differentiable; needed iff config.needs_entropy
    advantages: torch.Tensor,  # [B] or [B, T]
    mask: torch.Tensor,  # [B, T] bool or 0/1
    *,
    config: PolicyLossConfig,
    old_logprobs: torch.Tensor | None = None,  # [B, T]; None: on-policy, old = logprobs.detach()
    ref_logprobs: torch.Tensor | None = None,  # [B, T]; needed iff config.beta != 0
    importance_weights: torch.Tensor | None = None,  # [B] or [B, T] vLLM truncated/masked IS ratio
    num_items_in_batch: torch.Tensor | int | float | None = None,  # dapo/cispo/vespo normaliser
    sampling_logprobs: torch.Tensor | None = None,  # [B, T] inference-engine log-probs (off-policy mask)
    per_token_kl: torch.Tensor | None = None,  # [B, T] exact KL(pi || pi_ref), differentiable; kl_estimator="exact"
    with_metrics: bool = True,  # False: the loss alone (the one-pass path's per-chunk gradient evaluations)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # (0-dim loss, {name: detached 0-dim metric})
    """The GRPO-family policy loss of TRL 1.16's ``GRPOTrainer._compute_loss``, from per-token log-probs.

    Same arithmetic, in the same order, as TRL with gradient accumulation 1 on one process: ratio (token or
    sequence level), per-loss-type term, off-policy mask, entropy mask, IS weights, ``+ beta * KL`` (times the
    ratio with ``use_bias_correction_kl``), the loss type's normaliser, then ``- entropy_coef * masked_mean(H)``.
    ``num_items_in_batch`` defaults to the number of masked tokens (TRL's value with one process and
    ``steps_per_generation == 1``). ``sampling_logprobs`` feeds only the off-policy mask and defaults to
    ``old_logprobs``, as in TRL. Advantages, old/ref/sampling log-probs and IS weights are treated as constants.

    ``config.kl_estimator == "exact"``: ``per_token_kl`` (``[B, T]``, the whole-vocabulary KL(pi || pi_ref) at each
    position, differentiable: its gradient flows to whatever produced it) takes the place of the k1/k2/k3 estimate
    and ``ref_logprobs`` must be None. It enters as ``+ beta * per_token_kl``, normalised like every other term,
    and is not multiplied by the ratio (``use_bias_correction_kl`` corrects a sampled-token estimate for the
    off-policy sample; the exact KL is already the expectation over the next token, see ``PolicyLossConfig``).
    The loss is additive in it: ``d loss / d per_token_kl`` is ``beta`` times the loss type's constant weight of
    each token.

    Computed in ``logprobs.dtype``, with no host synchronisation. Masked tokens are read through
    ``torch.where``, so whatever they hold (even inf/NaN, where TRL's ``x * mask`` would give NaN) contributes
    exactly 0 to the loss, the gradients and the metrics; fully masked rows and batches give loss 0, gradient 0.

    Metrics (TRL's keys without the "train/" prefix; with one process TRL's means of per-process values are the
    values themselves): ``kl`` (beta != 0), ``entropy`` (entropy given), ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_max`` (clipped
    loss types), ``cispo_clip_ratio`` (cispo), ``vespo/phi_seq_mean`` (vespo), ``policy_loss`` and
    ``entropy_coef`` (entropy_coef != 0, as TRL logs them only then); and for PPO-style logging
    ``policy/approxkl_avg`` = 0.5 masked mean (logp - old)^2, ``policy/clipfrac_avg`` = masked mean of "the
    clipped term won" (clipped loss types; cispo: the cap is active; absent for sapo/vespo, which do not clip),
    ``policy/entropy_avg`` (entropy given), ``val/ratio`` and ``val/ratio_var`` (masked token mean and unbiased
    variance of the ratio, sequence ratios broadcast to their tokens).
    """
    _check_policy_inputs(
        logprobs, entropy, advantages, mask, config, old_logprobs, ref_logprobs, importance_weights, sampling_logprobs,
        per_token_kl,
    )
    mk = _Masking(mask, logprobs)
    logp = mk.masked(logprobs)
    ent = None if entropy is None else mk.masked(entropy)
    old = logp.detach() if old_logprobs is None else mk.masked(old_logprobs.detach())
    adv = advantages.detach().to(mk.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else mk.masked(adv)
    is_w = None
    if importance_weights is not None:
        is_w = importance_weights.detach().to(mk.dtype)
        is_w = is_w.unsqueeze(1) if is_w.dim() == 1 else is_w

    entropy_mask = None
    if config.top_entropy_quantile < 1.0:
        entropy_mask = _high_entropy_mask(ent.detach(), mk.mask, 1 - config.top_entropy_quantile)
    log_ratio = logp - old
    coef_1 = torch.exp(_log_importance_weights(log_ratio, mk, config))  # [B, T] or [B, 1]
    per_token_kl = _kl_term(logp, ref_logprobs, per_token_kl, coef_1, mk, config)
    term = _policy_term(logp, adv, coef_1, log_ratio, is_w, mk, config)
    per_token_loss = _weighted(term.loss, logp, old, adv, is_w, entropy_mask, per_token_kl, sampling_logprobs, mk,
                               config)
    loss = _normalised(mk.masked(per_token_loss), mk, num_items_in_batch, config)
    policy_loss = loss.detach()
    if config.entropy_coef != 0.0:
        # TRL: mean entropy over the tokens the policy term acts on, whatever the loss type's normaliser.
        effective_mask = mk.m if entropy_mask is None else mk.m * entropy_mask
        entropy_loss = (ent * effective_mask).sum() / effective_mask.sum().clamp(min=1.0)
        loss = loss - config.entropy_coef * entropy_loss
    if not with_metrics:
        return loss, {}
    with torch.no_grad():
        return loss, _metrics(policy_loss, per_token_kl, ent, coef_1.detach(), log_ratio, adv, term, mk, config)


class _Masking:
    """The completion mask of one loss call, and the masked reductions every term and metric uses."""

    def __init__(self, mask: torch.Tensor, logprobs: torch.Tensor):
        self.dtype, self.device = logprobs.dtype, logprobs.device
        self.B, self.T = logprobs.shape
        self.mask = mask if mask.dtype == torch.bool else mask != 0  # [B, T] bool
        self.m = self.mask.to(self.dtype)  # [B, T] in the compute dtype
        self.zero = torch.zeros((), dtype=self.dtype, device=self.device)

    def masked(self, x: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
        # Masked entries never reach the loss; replacing them (not multiplying by 0) keeps inf/NaN there out
        # of every sum and every gradient.
        return torch.where(self.mask, x.to(self.dtype), self.zero if fill is None else fill)

    def mean(self, x: torch.Tensor) -> torch.Tensor:  # over masked tokens, 0 when there are none
        return self.masked(x).sum() / self.m.sum().clamp(min=1.0)

    def global_mean(self, x: torch.Tensor) -> torch.Tensor:
        # TRL: a [B, 1] value (sequence-level ratio) is averaged over ALL B rows, fully masked ones included.
        # (TRL decides by x.shape[1] == 1, which for T == 1 would also drop the mask of per-token values;
        # here T == 1 keeps the mask.)
        if x.shape[1] == 1 and self.T > 1:
            return x.sum() / self.B
        return self.mean(x)


@dataclasses.dataclass
class _PolicyTerm:
    """The loss type's per-token policy term and what its metrics read."""

    loss: torch.Tensor  # [B, T] (or [B, 1] broadcast)
    capped: torch.Tensor | None = None  # clipped types: the (delta-capped) ratio
    clipped: torch.Tensor | None = None  # clipped types: the clipped term is the one the loss takes
    phi_seq: torch.Tensor | None = None  # vespo


def _log_importance_weights(log_ratio: torch.Tensor, mk: _Masking, config: PolicyLossConfig) -> torch.Tensor:
    if config.importance_sampling_level == "token":
        return log_ratio
    return ((log_ratio * mk.m).sum(-1) / mk.m.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def _kl_term(logp, ref_logprobs, per_token_kl, coef_1, mk: _Masking, config: PolicyLossConfig):
    """The per-token KL term ([B, T]) or None (beta 0)."""
    if config.beta == 0.0:
        return None
    if config.kl_estimator == "exact":
        return mk.masked(per_token_kl)  # no ratio: already the expectation over the next token
    kl = kl_estimate(logp, mk.masked(ref_logprobs.detach()), config.kl_estimator)
    return kl * coef_1 if config.use_bias_correction_kl else kl


def _policy_term(logp, adv, coef_1, log_ratio, is_w, mk: _Masking, config: PolicyLossConfig) -> _PolicyTerm:
    loss_type = config.loss_type
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=config.epsilon_high).detach()
        return _PolicyTerm(-clamped_ratios * adv * logp)
    if loss_type in CLIPPED_LOSS_TYPES:
        coef_2 = torch.clamp(coef_1, 1 - config.epsilon_low, 1 + config.epsilon_high)
        # TRL rebinds coef_1 to the delta-capped ratio; its clip metrics below read the capped one too.
        capped = coef_1 if config.delta is None else torch.clamp(coef_1, max=config.delta)
        per_token_loss1 = capped * adv
        per_token_loss2 = coef_2 * adv
        # the clipped term is the one the loss takes
        return _PolicyTerm(-torch.min(per_token_loss1, per_token_loss2), capped, per_token_loss2 < per_token_loss1)
    if loss_type == "sapo":
        # torch.where on Python scalars gives TRL's temperatures in the default dtype (float32): 1.05 is rounded
        # there, so mirror it, then compute in the compute dtype.
        temperatures = torch.where(adv > 0, config.sapo_temperature_pos, config.sapo_temperature_neg).to(mk.dtype)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        return _PolicyTerm(-soft_coef_1 * adv)
    phi_seq = _vespo_gamma_weights(adv, log_ratio, mk.m, is_w, config)  # vespo
    return _PolicyTerm(-phi_seq * adv * logp, phi_seq=phi_seq)


def _weighted(per_token_loss, logp, old, adv, is_w, entropy_mask, per_token_kl, sampling_logprobs, mk: _Masking,
              config: PolicyLossConfig) -> torch.Tensor:
    """The policy term times the off-policy mask, the entropy mask and the IS weights, plus ``beta * KL``."""
    if config.off_policy_mask_threshold is not None:
        sampling = old if sampling_logprobs is None else mk.masked(sampling_logprobs.detach())
        kl_div = torch.nan_to_num(sampling - logp.detach(), nan=0.0)
        avg_seq_kl = (kl_div * mk.m).sum(dim=1, keepdim=True) / mk.m.sum(dim=1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((adv >= 0) | (avg_seq_kl <= config.off_policy_mask_threshold)).to(mk.dtype)
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if is_w is not None and config.loss_type != "vespo":  # vespo folded the IS ratio into phi
        if is_w.shape[1] == mk.T:
            is_w = mk.masked(is_w, torch.ones((), dtype=mk.dtype, device=mk.device))
        per_token_loss = per_token_loss * is_w
    if per_token_kl is not None:
        per_token_loss = per_token_loss + config.beta * per_token_kl
    return per_token_loss


def _normalised(token_sum, mk: _Masking, num_items_in_batch, config: PolicyLossConfig) -> torch.Tensor:
    """The loss type's normaliser over ``token_sum`` ([B, T], TRL's ``per_token_loss * mask``)."""
    loss_type, m = config.loss_type, mk.m
    if loss_type in ("grpo", "sapo"):
        return (token_sum.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return token_sum.sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return token_sum.sum() / (mk.B * config.max_completion_length)
    if loss_type in ("cispo", "dapo", "vespo"):
        if num_items_in_batch is None:
            normalizer = m.sum()
        elif isinstance(num_items_in_batch, torch.Tensor):
            normalizer = num_items_in_batch.detach().to(device=mk.device, dtype=mk.dtype).reshape(())
        else:
            # torch.full, not torch.tensor: a host-to-device copy would wait for every queued kernel
            normalizer = torch.full((), float(num_items_in_batch), dtype=mk.dtype, device=mk.device)
        return token_sum.sum() / normalizer.clamp(min=1.0)
    return token_sum.sum(-1).mean()  # luspo


def _metrics(policy_loss, per_token_kl, ent, ratio, log_ratio, adv, term: _PolicyTerm, mk: _Masking,
             config: PolicyLossConfig) -> dict[str, torch.Tensor]:
    """The metrics, named where they are computed (their order is the dict's)."""
    metrics: dict[str, torch.Tensor] = {}
    if config.entropy_coef != 0.0:
        metrics["policy_loss"] = policy_loss
        metrics["entropy_coef"] = torch.full((), config.entropy_coef, dtype=mk.dtype, device=mk.device)
    if per_token_kl is not None:
        metrics["kl"] = mk.global_mean(per_token_kl.detach())
    if ent is not None:
        metrics["entropy"] = mk.global_mean(ent.detach())
    if config.loss_type in CLIPPED_LOSS_TYPES:
        metrics.update(_clip_metrics(term, adv, mk, config))
    elif config.loss_type == "cispo":
        is_cispo_clipped = ((ratio > config.epsilon_high) & (adv > 0)).to(mk.dtype)
        metrics["cispo_clip_ratio"] = mk.global_mean(is_cispo_clipped)
        metrics["policy/clipfrac_avg"] = mk.mean((ratio > config.epsilon_high).to(mk.dtype))
    elif config.loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = mk.global_mean(term.phi_seq)
    metrics["policy/approxkl_avg"] = 0.5 * mk.mean(log_ratio.detach() ** 2)
    if ent is not None:
        metrics["policy/entropy_avg"] = mk.mean(ent.detach())
    ratio_mean = mk.mean(ratio)
    metrics["val/ratio"] = ratio_mean
    metrics["val/ratio_var"] = mk.masked((ratio - ratio_mean) ** 2).sum() / (mk.m.sum() - 1).clamp(min=1.0)
    return metrics


def _clip_metrics(term: _PolicyTerm, adv, mk: _Masking, config: PolicyLossConfig) -> dict[str, torch.Tensor]:
    capped, dtype, zero = term.capped.detach(), mk.dtype, mk.zero
    is_low = ((capped < 1 - config.epsilon_low) & (adv < 0)).to(dtype)
    is_high = ((capped > 1 + config.epsilon_high) & (adv > 0)).to(dtype)
    is_region = torch.maximum(is_low, is_high)
    out = {"clip_ratio/low_mean": mk.global_mean(is_low), "clip_ratio/high_mean": mk.global_mean(is_high),
           "clip_ratio/region_mean": mk.global_mean(is_region)}
    # TRL: nanmin / nanmax over per-sequence means (x * mask).sum(-1) / mask.sum(-1), where a fully masked
    # row is 0/0 = NaN and skipped; an all-NaN batch would log NaN, here 0.
    if is_low.shape[1] == 1 and mk.T > 1:
        row_low, row_high = is_low.squeeze(1), is_high.squeeze(1)
        row_ok = torch.ones(mk.B, dtype=torch.bool, device=mk.device)
    else:
        counts = mk.m.sum(-1)
        row_low = mk.masked(is_low).sum(-1) / counts.clamp(min=1.0)
        row_high = mk.masked(is_high).sum(-1) / counts.clamp(min=1.0)
        row_ok = counts > 0
    inf = torch.full((), float("inf"), dtype=dtype, device=mk.device)
    low_min = torch.where(row_ok, row_low, inf).min()
    high_max = torch.where(row_ok, row_high, -inf).max()
    out["clip_ratio/low_min"] = torch.where(row_ok.any(), low_min, zero)
    out["clip_ratio/high_max"] = torch.where(row_ok.any(), high_max, zero)
    out["policy/clipfrac_avg"] = mk.mean(term.clipped.to(dtype))
    return out


def value_loss_reference(
    values: torch.Tensor,  # [B, T] value head output, differentiable
    old_values: torch.Tensor,  # [B, T] values at rollout time
    returns: torch.Tensor,  # [B, T] GAE returns
    mask: torch.Tensor,  # [B, T] bool or 0/1
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # (0-dim loss, metrics)
    """PPO's clipped value loss, as TRL's PPOv2 trainer computed it.

    ``0.5 * masked_mean(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))``; metrics ``loss/value_avg``
    (the loss) and ``val/clipfrac_avg`` (masked mean of "the clipped term is larger", PPOv2's ``vf_clipfrac``).
    A fully masked batch gives 0 (PPOv2's masked_mean would divide by 0).
    """
    check_value_inputs(values, old_values, returns, mask, cliprange_value)
    dtype = values.dtype
    mask_b = mask if mask.dtype == torch.bool else mask != 0
    m = mask_b.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    v = torch.where(mask_b, values, zero)
    v_old = torch.where(mask_b, old_values.detach().to(dtype), zero)
    ret = torch.where(mask_b, returns.detach().to(dtype), zero)
    v_clipped = torch.clamp(v, v_old - cliprange_value, v_old + cliprange_value)
    vf_losses1 = torch.square(v - ret)
    vf_losses2 = torch.square(v_clipped - ret)
    count = m.sum().clamp(min=1.0)
    loss = 0.5 * torch.where(mask_b, torch.max(vf_losses1, vf_losses2), zero).sum() / count
    with torch.no_grad():
        clipfrac = torch.where(mask_b, (vf_losses2 > vf_losses1).to(dtype), zero).sum() / count
        metrics = {"loss/value_avg": loss.detach(), "val/clipfrac_avg": clipfrac}
    return loss, metrics


def check_value_inputs(values, old_values, returns, mask, cliprange_value) -> None:
    """The input checks of ``value_loss_reference`` (shapes and types only: no host read)."""
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise ValueError(f"values must be a floating tensor, got {type(values).__name__}")
    for name, t in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if not isinstance(t, torch.Tensor) or t.shape != values.shape:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} has shape {shape}, expected the shape of values {tuple(values.shape)}")
    if not isinstance(cliprange_value, (int, float)) or not -math.inf < cliprange_value < math.inf or cliprange_value < 0:
        raise ValueError(f"cliprange_value must be a finite number >= 0, got {cliprange_value!r}")
