"""The arithmetic of TRL's PPOv2 trainer between the rollout and the loss, as small pure functions.

Each function is the corresponding piece of TRL's ``trl/trainer/ppo_trainer.py`` / ``trl/trainer/utils.py``
(trl 0.11-0.19), with the same numbers; where TRL's code has a quirk worth knowing, the docstring says so.
Shapes: ``B`` responses, ``R`` response positions (``response_length`` or less when every response stopped early).

Rollout to advantages, in the order the trainer calls them:

1. ``truncate_response``: everything after the first stop token becomes padding.
2. ``response_lengths``: index of the last non-pad token of each truncated response.
3. ``apply_eos_penalty``: the "EOS trick" on the reward-model scores.
4. ``padding_masks``: which positions are padding for the log-probs (``> L``) and for the values (``> L + 1``).
5. ``kl_rewards``: per-token KL estimate, non-score reward ``-kl_coef * kl`` and the score added at the end.
6. ``masked_whiten`` (``whiten_rewards``), ``compute_gae``, ``masked_whiten`` of the advantages.
"""

from __future__ import annotations

import torch

from fastrl.losses.arithmetic import kl_estimate

__all__ = [
    "INVALID_LOGPROB",
    "KL_ESTIMATORS",
    "first_true_indices",
    "truncate_response",
    "response_lengths",
    "apply_eos_penalty",
    "padding_masks",
    "kl_rewards",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "compute_gae",
]

# TRL fills the log-probs of padding positions with 1.0, a value no log-probability can take, so that the
# KL there is exactly 0 (both sides hold the same number).
INVALID_LOGPROB = 1.0
# TRL's PPOv2 offers k1 (default) and k3; k2 is fastrl's addition (same placement); "exact" is the whole-vocabulary
# KL(pi || pi_ref) at each position, computed from both models' hidden states (fastrl.fused_divergence with beta=1)
KL_ESTIMATORS = ("k1", "k2", "k3", "exact")


def first_true_indices(bools: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:  # [...]
    """Index of the first True along the last dim; the row length when there is none (TRL's helper)."""
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def truncate_response(
    stop_token_id: int,
    pad_token_id: int,
    responses: torch.Tensor,  # [B, R]
) -> torch.Tensor:  # [B, R]
    """Replace every token after the first ``stop_token_id`` with ``pad_token_id`` (the stop token is kept)."""
    trunc_idxs = first_true_indices(responses == stop_token_id).unsqueeze(-1)
    new_size = [1] * (len(responses.size()) - 1) + [responses.shape[1]]
    idxs = torch.arange(responses.shape[1], device=responses.device).view(*new_size)
    return torch.masked_fill(responses, idxs > trunc_idxs, pad_token_id)


def response_lengths(
    postprocessed_responses: torch.Tensor,  # [B, R]
    pad_token_id: int,
) -> torch.Tensor:  # [B] long
    """Index of the last token before the first pad of each response (``-1`` when it starts with a pad).

    TRL's ``sequence_lengths``: despite the name an index, so a response has ``L + 1`` real tokens. A response
    with no pad at all gets ``R - 1``.
    """
    return first_true_indices(postprocessed_responses == pad_token_id) - 1


def apply_eos_penalty(
    scores: torch.Tensor,  # [B]
    contain_eos_token: torch.Tensor,  # [B] bool
    *,
    missing_eos_penalty: float | None = None,
    non_eos_penalty: bool = False,
    penalty_reward_value: float = -1.0,
) -> torch.Tensor:  # [B], a new tensor
    """The EOS trick: a response that never produced EOS gets a worse score.

    ``missing_eos_penalty`` (TRL >= 0.12): subtract it from the score. ``non_eos_penalty`` with
    ``penalty_reward_value`` (TRL <= 0.11): replace the score by that value. Both at once is refused by the
    config; here they would apply in that order.
    """
    scores = scores.clone()
    if missing_eos_penalty is not None:
        scores[~contain_eos_token] -= missing_eos_penalty
    if non_eos_penalty:
        scores = torch.where(contain_eos_token, scores, torch.full_like(scores, penalty_reward_value))
    return scores


def padding_masks(
    sequence_lengths: torch.Tensor,  # [B] from response_lengths
    response_length: int,  # R
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, R], [B, R]) bool, True = padding
    """``(padding_mask, padding_mask_p1)``: positions after the last real token, and after one more.

    The log-probs (and the policy loss) use positions ``0..L``; the values (and the value loss) ``0..L+1``:
    the value one past the end is where the score usually lands (see ``kl_rewards``).
    """
    response_idxs = torch.arange(response_length, device=sequence_lengths.device).repeat(sequence_lengths.shape[0], 1)
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    padding_mask_p1 = response_idxs > (sequence_lengths + 1).unsqueeze(1)
    return padding_mask, padding_mask_p1


def kl_rewards(
    logprobs: torch.Tensor,  # [B, R], INVALID_LOGPROB at padding
    ref_logprobs: torch.Tensor,  # [B, R], INVALID_LOGPROB at padding
    scores: torch.Tensor,  # [B]
    sequence_lengths: torch.Tensor,  # [B]
    kl_coef: float,
    kl_estimator: str = "k1",
    per_token_kl: torch.Tensor | None = None,  # [B, R] exact KL, 0 at padding; kl_estimator="exact" only
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # (rewards, non_score_reward, kl), each [B, R]
    """Per-token rewards: ``-kl_coef * kl`` everywhere, plus the score at the end of the response.

    ``kl``: TRL's ``logr = ref_logprobs - logprobs``; k1 ``-logr``, k3 ``exp(logr) - 1 - logr`` (never negative),
    k2 ``logr^2 / 2`` (``fastrl.reference.kl_estimate``). Padding positions, filled with ``INVALID_LOGPROB`` on
    both sides, get exactly 0. ``kl_estimator="exact"``: ``kl`` is ``per_token_kl``, the exact KL(pi || pi_ref) over
    the whole vocabulary at each position (never negative; 0 at padding), and the log-prob arguments are not read
    (``ref_logprobs`` may be None).

    Where the score goes (TRL's ``actual_end``): at ``L + 1``, one past the last real token, when the response
    has room for it, else at ``L``. So a response that stopped early is scored at the first padding position,
    where the value head also has a target (``padding_mask_p1``); a full-length one on its last token.
    """
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if kl_estimator == "exact":
        if not isinstance(per_token_kl, torch.Tensor) or per_token_kl.shape != logprobs.shape:
            got = tuple(per_token_kl.shape) if isinstance(per_token_kl, torch.Tensor) else per_token_kl
            raise ValueError(
                f"per_token_kl must be a [B, R] = {list(logprobs.shape)} tensor with kl_estimator='exact', got {got}"
            )
        kl = per_token_kl.to(logprobs.dtype)
    else:
        if per_token_kl is not None:
            raise ValueError(f"per_token_kl is read only with kl_estimator='exact', got kl_estimator={kl_estimator!r}")
        kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0), device=rewards.device)
    sequence_lengths_p1 = sequence_lengths + 1
    actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)
    rewards[actual_start, actual_end] += scores.to(rewards.dtype)
    return rewards, non_score_reward, kl


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is true (TRL's helper; 0/0 gives NaN)."""
    if axis is not None:
        return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
    return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked positions, Bessel-corrected by default (TRL's helper, same errors)."""
    mean = masked_mean(values, mask)
    centered_values = values - mean
    variance = masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError(
                "The sum of the mask is zero, which can happen when `mini_batch_size=1`; "
                "try increase the `mini_batch_size` or `gradient_accumulation_steps`"
            )
        if mask_sum == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with masked statistics; ``shift_mean=False`` adds the mean back.

    Every position is transformed (padding too); callers zero the padding afterwards, as TRL does.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def compute_gae(
    rewards: torch.Tensor,  # [B, R]
    values: torch.Tensor,  # [B, R], 0 after the value padding
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (advantages [B, R], returns [B, R])
    """Generalised advantage estimation over the whole response, TRL's loop.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V_R = 0``), ``A_t = delta_t + gamma * lam * A_{t+1}``,
    ``returns = A + V``. The advantages are not whitened here.
    """
    lastgaelam = 0
    advantages_reversed = []
    gen_length = rewards.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return advantages, returns
