"""PPO reward shaping, GAE, whitening and the loss terms on small cases whose numbers are worked out by hand.

Each expected value below is computed in the comment next to it from TRL PPOv2's formulas.
"""

from __future__ import annotations

import math

import pytest
import torch

import fastrl
from fastrl.losses.config import PolicyLossConfig
from fastrl.reference import kl_estimate, policy_loss_from_logprobs
from fastrl.trainers.ppo_config import PPOConfig
from fastrl.trainers.ppo_math import (
    INVALID_LOGPROB,
    apply_eos_penalty,
    compute_gae,
    first_true_indices,
    kl_rewards,
    masked_var,
    masked_whiten,
    padding_masks,
    response_lengths,
    truncate_response,
)

PAD, EOS = 0, 1
INV = INVALID_LOGPROB


def close(got: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=got.dtype)
    assert got.shape == expected.shape, f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    bad = ~torch.isclose(got, expected, atol=atol, rtol=0)
    if bad.any():
        i = tuple(int(x) for x in bad.nonzero()[0])
        raise AssertionError(f"at {i}: got {got[i].item()!r}, expected {expected[i].item()!r}\n{got}\nvs\n{expected}")


# ---------------------------------------------------------------------------------------------------------------
# response processing
# ---------------------------------------------------------------------------------------------------------------


def test_first_true_indices_row_length_when_none():
    bools = torch.tensor([[False, True, False, True], [False, False, False, False], [True, False, False, False]])
    assert first_true_indices(bools).tolist() == [1, 4, 0]


def test_truncate_response_keeps_stop_token_pads_after():
    responses = torch.tensor([[5, EOS, 7, 8], [5, 6, 7, 8], [EOS, 2, EOS, 4]])
    assert truncate_response(EOS, PAD, responses).tolist() == [[5, EOS, PAD, PAD], [5, 6, 7, 8], [EOS, PAD, PAD, PAD]]


def test_response_lengths_is_index_of_last_real_token():
    post = torch.tensor([[5, EOS, PAD, PAD], [5, 6, 7, 8], [PAD, PAD, PAD, PAD]])
    # [5, EOS] ends at index 1; no pad -> R - 1 = 3; a response starting with a pad -> -1
    assert response_lengths(post, PAD).tolist() == [1, 3, -1]


def test_padding_masks_values_reach_one_further():
    padding_mask, padding_mask_p1 = padding_masks(torch.tensor([1, 3]), 4)
    assert padding_mask.tolist() == [[False, False, True, True], [False, False, False, False]]
    assert padding_mask_p1.tolist() == [[False, False, False, True], [False, False, False, False]]


# ---------------------------------------------------------------------------------------------------------------
# EOS trick
# ---------------------------------------------------------------------------------------------------------------


def test_missing_eos_penalty_subtracts():
    scores = torch.tensor([1.0, 2.0, -0.5])
    eos = torch.tensor([True, False, False])
    close(apply_eos_penalty(scores, eos, missing_eos_penalty=1.5), [1.0, 0.5, -2.0])
    close(scores, [1.0, 2.0, -0.5])  # not modified in place


def test_non_eos_penalty_replaces_score():
    scores = torch.tensor([1.0, 2.0])
    eos = torch.tensor([True, False])
    close(apply_eos_penalty(scores, eos, non_eos_penalty=True, penalty_reward_value=-1.0), [1.0, -1.0])
    close(apply_eos_penalty(scores, eos), [1.0, 2.0])  # no penalty configured: unchanged


def test_config_refuses_both_eos_penalties(tmp_path):
    with pytest.raises(ValueError, match="missing_eos_penalty"):
        PPOConfig(output_dir=str(tmp_path), missing_eos_penalty=1.0, non_eos_penalty=True, report_to="none")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(stop_token="eos", stop_token_id=3), "stop_token"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(cliprange=-0.1), "cliprange"),
        (dict(num_ppo_epochs=0), "num_ppo_epochs"),
    ],
)
def test_config_rejects_bad_values(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(output_dir=str(tmp_path), report_to="none", **kwargs)


def test_config_defaults_are_trls(tmp_path):
    c = PPOConfig(output_dir=str(tmp_path), report_to="none")
    expected = dict(
        num_ppo_epochs=4, num_mini_batches=1, response_length=53, temperature=0.7, kl_coef=0.05, kl_estimator="k1",
        cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95, whiten_rewards=False,
        num_sample_generations=10, local_rollout_forward_batch_size=64, stop_token=None, missing_eos_penalty=None,
        non_eos_penalty=False, penalty_reward_value=-1.0, total_episodes=None,
    )
    got = {k: getattr(c, k) for k in expected}
    assert got == expected


# ---------------------------------------------------------------------------------------------------------------
# KL estimators and the per-token rewards
# ---------------------------------------------------------------------------------------------------------------


def test_kl_rewards_k1_non_score_reward_and_score_placement():
    # row 0: 2 real tokens (L = 1), then padding (INVALID_LOGPROB on both sides); row 1: full length (L = 3)
    logprobs = torch.tensor([[-1.0, -2.0, INV, INV], [-1.0, -1.0, -1.0, -1.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, INV, INV], [-1.0, -2.0, -0.5, -1.0]])
    scores = torch.tensor([2.0, 3.0])
    rewards, non_score, kl = kl_rewards(logprobs, ref_logprobs, scores, torch.tensor([1, 3]), 0.1, "k1")
    # k1 = logp - ref: row 0 [0.5, -1.0, 0, 0]; row 1 [0, 1.0, -0.5, 0]
    close(kl, [[0.5, -1.0, 0.0, 0.0], [0.0, 1.0, -0.5, 0.0]])
    close(non_score, [[-0.05, 0.1, 0.0, 0.0], [0.0, -0.1, 0.05, 0.0]])
    # the score lands at L + 1 = 2 for row 0 (room left), at L = 3 for the full-length row 1
    close(rewards, [[-0.05, 0.1, 2.0, 0.0], [0.0, -0.1, 0.05, 3.0]])


def test_kl_rewards_k3_values():
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref_logprobs = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    _, non_score, kl = kl_rewards(logprobs, ref_logprobs, torch.zeros(1, dtype=torch.float64), torch.tensor([1]), 0.5, "k3")
    # r = ref - logp = [-0.5, 1.0]; k3 = exp(r) - r - 1
    k3 = [math.exp(-0.5) + 0.5 - 1, math.e - 1.0 - 1]
    close(kl, [k3], atol=1e-12)
    close(non_score, [[-0.5 * k3[0], -0.5 * k3[1]]], atol=1e-12)


def test_k3_is_never_negative_k1_can_be():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, 16, generator=g) * 8
    ref = -torch.rand(64, 16, generator=g) * 8
    # extremes on both sides
    logp[0, :4] = torch.tensor([-30.0, -1e-6, -15.0, 0.0])
    ref[0, :4] = torch.tensor([-1e-6, -30.0, -15.0, 0.0])
    k3 = kl_estimate(logp, ref, "k3")
    assert bool((k3 >= 0).all()), f"k3 has a negative entry: {k3.min().item()}"
    assert bool((kl_estimate(logp, ref, "k1") < 0).any())
    _, _, kl = kl_rewards(logp, ref, torch.zeros(64), torch.full((64,), 15), 0.05, "k3")
    assert bool((kl >= 0).all())


def test_kl_rewards_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_rewards(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.tensor([1]), 0.1, "k5")


# ---------------------------------------------------------------------------------------------------------------
# whitening and GAE
# ---------------------------------------------------------------------------------------------------------------


def test_masked_whiten_uses_masked_unbiased_statistics():
    values = torch.tensor([[2.0, 4.0, 6.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    # masked mean 4; unbiased variance ((2^2 + 0 + 2^2) / 3) * 3 / 2 = 4, std 2 (+1e-8 under the root)
    s = 1 / math.sqrt(4 + 1e-8)
    close(masked_var(values, mask), 4.0, atol=1e-12)
    close(masked_whiten(values, mask), [[-2 * s, 0.0, 2 * s, 96 * s]], atol=1e-12)
    # shift_mean=False (rewards whitening) keeps the mean
    close(masked_whiten(values, mask, shift_mean=False), [[4 - 2 * s, 4.0, 4 + 2 * s, 4 + 96 * s]], atol=1e-12)


def test_masked_var_refuses_zero_or_one_token():
    v = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="zero"):
        masked_var(v, torch.tensor([False, False]))
    with pytest.raises(ValueError, match="one"):
        masked_var(v, torch.tensor([True, False]))


def test_gae_gamma_one():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    adv, ret = compute_gae(rewards, values, gamma=1.0, lam=0.95)
    # t=2: delta = 1 - 0.7 = 0.3               A2 = 0.3
    # t=1: delta = 0 + 0.7 - 0.6 = 0.1         A1 = 0.1 + 0.95 * 0.3 = 0.385
    # t=0: delta = 0 + 0.6 - 0.5 = 0.1         A0 = 0.1 + 0.95 * 0.385 = 0.46575
    close(adv, [[0.46575, 0.385, 0.3]], atol=1e-12)
    close(ret, [[0.96575, 0.985, 1.0]], atol=1e-12)


def test_gae_discounted():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    adv, _ = compute_gae(rewards, values, gamma=0.9, lam=0.5)
    # t=2: delta = 0.3, A2 = 0.3; t=1: delta = 0.9 * 0.7 - 0.6 = 0.03, A1 = 0.03 + 0.45 * 0.3 = 0.165
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04, A0 = 0.04 + 0.45 * 0.165 = 0.11425
    close(adv, [[0.11425, 0.165, 0.3]], atol=1e-12)


def test_gae_lambda_one_gives_monte_carlo_returns():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(3, 5, generator=g, dtype=torch.float64)
    values = torch.randn(3, 5, generator=g, dtype=torch.float64)
    _, ret = compute_gae(rewards, values, gamma=1.0, lam=1.0)
    close(ret, rewards.flip(1).cumsum(1).flip(1), atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# the loss terms (fastrl's ops with PPO's settings)
# ---------------------------------------------------------------------------------------------------------------


def test_value_loss_clipping_by_hand():
    v = torch.tensor([[1.0, 2.0, 9.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.0]])
    ret = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    loss, metrics = fastrl.value_loss(v, old, ret, mask, 0.2)
    # clip(v, old +- 0.2) = [0.7, 2.0]; (v - R)^2 = [1, 1]; (v_clip - R)^2 = [1.69, 1]; max = [1.69, 1]
    # loss = 0.5 * (1.69 + 1) / 2 = 0.6725; the clipped term is larger on token 0 only -> clipfrac 0.5
    close(loss.detach(), 0.6725)
    close(metrics["loss/value_avg"], 0.6725)
    close(metrics["val/clipfrac_avg"], 0.5)
    loss.backward()
    # token 0: the clipped (constant) term wins -> no gradient; token 1: d/dv 0.5 * (v - R)^2 / 2 = (v - R) / 2
    close(v.grad, [[0.0, 0.5, 0.0]])


def test_ppo_policy_loss_clipping_by_hand():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 3.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, metrics = policy_loss_from_logprobs(logp, None, adv, mask, config=PolicyLossConfig.ppo(0.2),
                                              old_logprobs=old)
    # ratio [1.5, 0.5, 1.0]; max(-A r, -A clip(r, 0.8, 1.2)): [max(-1.5, -1.2), max(0.5, 0.8), max(-2, -2)]
    # = [-1.2, 0.8, -2.0]; masked mean = -0.8; clipped on tokens 0 and 1 -> clipfrac 2/3
    close(loss.detach(), -0.8)
    close(metrics["policy/clipfrac_avg"], 2 / 3)
    close(metrics["val/ratio"], 1.0)
    # approxkl = 0.5 * mean(log r ^ 2)
    close(metrics["policy/approxkl_avg"], 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 3)
    loss.backward()
    # only the unclipped token 2 has a gradient: d/dlogp (-A r / 3) = -A r / 3 = -2/3
    close(logp.grad, [[0.0, 0.0, -2 / 3, 0.0]])
