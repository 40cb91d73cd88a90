"""The per-token policy-loss math of ``fastrl.reference`` against TRL 1.16's own ``GRPOTrainer._compute_loss``.

Every case runs TRL's real method (through ``tests/trl_harness.py``) and ``policy_loss_from_logprobs`` on the same
float64 per-token tensors, and compares the loss, the gradients w.r.t. log-probs and entropies, and the metrics.
"""

from __future__ import annotations

import math

import pytest
import torch

from fastrl.losses.config import CLIPPED_LOSS_TYPES, LOSS_TYPES, PolicyLossConfig
from fastrl.reference import kl_estimate, policy_loss_from_logprobs, value_loss_reference
from trl_harness import make_grpo_trainer, trl_compute_loss, trl_kwargs_from_config

DTYPE = torch.float64
B, T = 6, 7
# Loss and gradients: TRL and fastrl do the same float64 arithmetic, so only reassociation-level differences.
TOL = dict(rtol=1e-12, atol=1e-13)
# TRL computes the clip-ratio metrics from `indicator.float()`, i.e. as float32 fractions.
FLOAT32_METRICS = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                   "clip_ratio/high_max", "cispo_clip_ratio"}
# Keys fastrl adds for PPO-style logging; TRL's GRPOTrainer does not log them.
FASTRL_ONLY_METRICS = {"policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "val/ratio",
                       "val/ratio_var"}


def make_inputs(seed: int = 0, per_token_advantages: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -3.0 * torch.rand(B, T, generator=g, dtype=DTYPE) - 0.01
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    mask[2] = False  # a fully masked row
    mask[4, 3:] = False  # a short row
    shape = (B, T) if per_token_advantages else (B,)
    advantages = torch.randn(shape, generator=g, dtype=DTYPE)
    advantages.view(-1)[1] = 0.0  # the A > 0 / A >= 0 boundaries of sapo, vespo and the clip metrics
    return dict(
        logp=logp,
        entropy=4.0 * torch.rand(B, T, generator=g, dtype=DTYPE),
        advantages=advantages,
        mask=mask,
        # Ratios spread over roughly [0.5, 2] so that both clip sides, delta and cispo's cap are reached.
        old=logp + 0.35 * torch.randn(B, T, generator=g, dtype=DTYPE),
        ref=logp + 0.4 * torch.randn(B, T, generator=g, dtype=DTYPE),
        sampling=logp + 0.3 * torch.randn(B, T, generator=g, dtype=DTYPE),
        is_token=torch.rand(B, T, generator=g, dtype=DTYPE) * 1.5 + 0.25,
        is_seq=torch.rand(B, generator=g, dtype=DTYPE) * 1.5 + 0.25,
    )


def grads(loss: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor) -> list[torch.Tensor]:
    out = torch.autograd.grad(loss, [logp, entropy], allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(out, (logp, entropy))]


def run_both(config: PolicyLossConfig, data: dict, *, old: bool, ref: bool, is_weights: str | None = None,
             sampling: bool = False, num_items_in_batch=None):
    """(fastrl loss, grads, metrics), (TRL loss, grads, metrics) on fresh leaves holding the same numbers."""
    kwargs = dict(
        old_logprobs=data["old"] if old else None,
        ref_logprobs=data["ref"] if ref else None,
        importance_weights={None: None, "token": data["is_token"], "sequence": data["is_seq"]}[is_weights],
        num_items_in_batch=num_items_in_batch,
        sampling_logprobs=data["sampling"] if sampling else None,
    )
    logp = data["logp"].clone().requires_grad_()
    ent = data["entropy"].clone().requires_grad_()
    loss, metrics = policy_loss_from_logprobs(logp, ent, data["advantages"], data["mask"], config=config, **kwargs)
    ours = (loss, grads(loss, logp, ent), metrics)

    trainer = make_grpo_trainer(**trl_kwargs_from_config(config), use_vllm_importance_sampling=is_weights is not None)
    logp = data["logp"].clone().requires_grad_()
    ent = data["entropy"].clone().requires_grad_()
    loss, metrics = trl_compute_loss(trainer, logp, ent, data["advantages"], data["mask"], **kwargs)
    theirs = (loss, grads(loss, logp, ent), metrics)
    return ours, theirs


def assert_matches_trl(ours, theirs, label: str) -> None:
    (loss, (g_logp, g_ent), metrics), (t_loss, (t_g_logp, t_g_ent), t_metrics) = ours, theirs
    assert loss.dtype == DTYPE and loss.dim() == 0, label
    torch.testing.assert_close(loss, t_loss, **TOL, msg=lambda m: f"{label}: loss\n{m}")
    torch.testing.assert_close(g_logp, t_g_logp, **TOL, msg=lambda m: f"{label}: d loss / d logprobs\n{m}")
    torch.testing.assert_close(g_ent, t_g_ent, **TOL, msg=lambda m: f"{label}: d loss / d entropy\n{m}")
    assert set(metrics) - FASTRL_ONLY_METRICS == set(t_metrics), f"{label}: metric keys"
    for key, expected in t_metrics.items():
        value = metrics[key]
        assert value.dim() == 0 and not value.requires_grad, f"{label}: metric {key} not a detached 0-dim tensor"
        tol = 1e-7 if key in FLOAT32_METRICS else 1e-12
        assert math.isclose(value.item(), expected, rel_tol=tol, abs_tol=tol), \
            f"{label}: metric {key}: fastrl {value.item()!r}, TRL {expected!r}"
    for key, value in metrics.items():
        assert torch.isfinite(value), f"{label}: metric {key} = {value}"


# (beta, use_bias_correction_kl): the KL settings TRL has (its estimator is always k3)
KL_SETTINGS = [(0.0, True), (0.04, True), (0.04, False)]
GRID = [
    (loss_type, level, delta, beta, bias)
    for loss_type in LOSS_TYPES
    for level in ("token", "sequence")
    for delta in ((None, 1.5) if loss_type in CLIPPED_LOSS_TYPES else (None,))
    for beta, bias in KL_SETTINGS
]


@pytest.mark.parametrize("loss_type,level,delta,beta,bias", GRID)
def test_matches_trl(loss_type, level, delta, beta, bias):
    data = make_inputs(seed=2 * LOSS_TYPES.index(loss_type) + (level == "sequence"))
    for entropy_coef in (0.0, 0.01):
        config = PolicyLossConfig(
            loss_type=loss_type, importance_sampling_level=level, delta=delta, beta=beta,
            use_bias_correction_kl=bias, entropy_coef=entropy_coef, max_completion_length=9,
            # cispo caps the ratio itself at epsilon_high: 1.2 leaves some ratios under the cap
            epsilon_high=1.2 if loss_type == "cispo" else 0.28,
        )
        for old in (False, True):
            label = f"{config} old={old}"
            assert_matches_trl(*run_both(config, data, old=old, ref=beta != 0.0), label)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_matches_trl_per_token_advantages_and_default_epsilons(loss_type, level):
    data = make_inputs(seed=7, per_token_advantages=True)
    config = PolicyLossConfig(loss_type=loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01,
                              max_completion_length=T)
    assert_matches_trl(*run_both(config, data, old=True, ref=True), f"{config}")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("is_weights", ["token", "sequence"])
def test_matches_trl_with_importance_weights(loss_type, is_weights):
    if loss_type == "vespo" and is_weights == "sequence":
        pytest.skip("TRL refuses sequence-level vLLM IS with vespo (and so does fastrl, see test_bad_inputs)")
    # Not 1 on masked tokens (TRL's own ratios are exp(0) = 1 there): pins TRL's VESPO quirk of summing the log
    # IS ratios over all T positions, masked or not.
    data = make_inputs(seed=3)
    config = PolicyLossConfig(loss_type=loss_type, beta=0.04, max_completion_length=T)
    assert_matches_trl(*run_both(config, data, old=True, ref=True, is_weights=is_weights), f"{config} {is_weights}")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize("quantile", [0.0, 0.3, 0.8])
def test_matches_trl_top_entropy_quantile(loss_type, quantile):
    data = make_inputs(seed=11)
    config = PolicyLossConfig(loss_type=loss_type, top_entropy_quantile=quantile, entropy_coef=0.01)
    assert config.one_pass_granularity is None
    assert_matches_trl(*run_both(config, data, old=True, ref=False), f"{config}")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("sampling", [False, True])
def test_matches_trl_off_policy_mask(loss_type, sampling):
    data = make_inputs(seed=5)
    config = PolicyLossConfig(loss_type=loss_type, off_policy_mask_threshold=0.02, beta=0.04,
                              max_completion_length=T)
    assert_matches_trl(*run_both(config, data, old=True, ref=True, sampling=sampling), f"{config}")


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
@pytest.mark.parametrize("num_items", [1, 100, torch.tensor(57)])
def test_matches_trl_num_items_in_batch(loss_type, num_items):
    data = make_inputs(seed=2)
    config = PolicyLossConfig(loss_type=loss_type, beta=0.04)
    assert_matches_trl(*run_both(config, data, old=True, ref=True, num_items_in_batch=num_items), f"{config}")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("estimator", ["k1", "k2"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_other_kl_estimators(loss_type, estimator, level):
    """TRL 1.16 has only k3. k1/k2 go where k3 goes: ``+ beta * kl * coef_1`` before the loss type's normaliser.

    The normaliser is read off TRL itself: on-policy, with A = -1 on every token and cispo's cap >= 1, every
    loss type's per-token term has d/d logp = 1, so d TRL-loss / d logp is the weight w_t each token's term gets.
    Then loss(k) - loss(beta=0) must be beta * sum_t w_t * kl_k(t) * coef_1(t), with its gradient.
    """
    data = make_inputs(seed=13)
    ones = -torch.ones(B, T, dtype=DTYPE)
    trainer = make_grpo_trainer(loss_type=loss_type, epsilon_high=1.0, max_completion_length=T)
    logp = data["logp"].clone().requires_grad_()
    weight = torch.autograd.grad(trl_compute_loss(trainer, logp, data["entropy"], ones, data["mask"])[0], logp)[0]

    for est in (estimator, "k3"):  # k3 checks the method itself against TRL's k3
        base = dict(loss_type=loss_type, importance_sampling_level=level, max_completion_length=T)
        config = PolicyLossConfig(**base, beta=0.04, kl_estimator=est)
        logp = data["logp"].clone().requires_grad_()
        loss, _ = policy_loss_from_logprobs(logp, None, data["advantages"], data["mask"], config=config,
                                            old_logprobs=data["old"], ref_logprobs=data["ref"])
        loss0, _ = policy_loss_from_logprobs(logp, None, data["advantages"], data["mask"],
                                             config=PolicyLossConfig(**base), old_logprobs=data["old"])
        log_ratio = (logp - data["old"]) * data["mask"]
        if level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True) / data["mask"].sum(-1, keepdim=True).clamp(min=1)
        kl = kl_estimate(logp, data["ref"], est) * torch.exp(log_ratio)
        expected = 0.04 * (weight * torch.where(data["mask"], kl, 0.0)).sum()
        torch.testing.assert_close(loss - loss0, expected, **TOL)
        torch.testing.assert_close(torch.autograd.grad(loss - loss0, logp)[0], torch.autograd.grad(expected, logp)[0],
                                   **TOL)


def test_k3_kl_never_negative():
    g = torch.Generator().manual_seed(0)
    logp = -10 * torch.rand(64, 50, generator=g, dtype=DTYPE)
    ref = logp + 5 * torch.randn(64, 50, generator=g, dtype=DTYPE)
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    mask = torch.rand(64, 50, generator=g) > 0.3
    for bias in (False, True):
        config = PolicyLossConfig(loss_type="bnpo", beta=1.0, use_bias_correction_kl=bias)
        _, metrics = policy_loss_from_logprobs(logp, None, torch.zeros(64, dtype=DTYPE), mask, config=config,
                                               old_logprobs=logp + 0.3, ref_logprobs=ref)
        assert metrics["kl"] >= 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_fully_masked_batch_gives_zero(loss_type, level):
    data = make_inputs(seed=1)
    mask = torch.zeros(B, T, dtype=torch.bool)
    # garbage where masked: TRL's `x * mask` would turn it into NaN; fastrl never reads it
    logp = data["logp"].clone()
    logp[0, 0], logp[1, 1] = float("inf"), float("nan")
    config = PolicyLossConfig(loss_type=loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.01,
                              max_completion_length=T, off_policy_mask_threshold=0.1, top_entropy_quantile=0.5)
    logp.requires_grad_()
    ent = data["entropy"].clone().requires_grad_()
    loss, metrics = policy_loss_from_logprobs(logp, ent, data["advantages"], mask, config=config,
                                              old_logprobs=data["old"], ref_logprobs=data["ref"] - 1e3,
                                              importance_weights=data["is_token"])
    g_logp, g_ent = grads(loss, logp, ent)
    assert loss.item() == 0.0
    assert (g_logp == 0).all() and (g_ent == 0).all()
    for key, value in metrics.items():
        assert torch.isfinite(value), f"metric {key} = {value}"


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clip_metrics_match_trl_when_every_row_clips(level):
    """All non-empty rows clipped low: at token level TRL's nanmin skips the fully masked row (0/0); with
    delta below 1 + epsilon_high: TRL's clip metrics read the delta-capped ratio."""
    data = make_inputs(seed=8)
    data["old"] = data["logp"] + 0.5  # ratio exp(-0.5) ~ 0.61 < 1 - 0.2 everywhere
    data["advantages"] = -data["advantages"].abs() - 0.1
    config = PolicyLossConfig(loss_type="dapo", importance_sampling_level=level)
    ours, theirs = run_both(config, data, old=True, ref=False)
    assert_matches_trl(ours, theirs, str(config))
    # Sequence level: the fully masked row's ratio is exp(0 / 1) = 1, unclipped, and TRL keeps it in the minimum.
    assert theirs[2]["clip_ratio/low_min"] == (1.0 if level == "token" else 0.0)
    data["old"] = data["logp"] - 0.4  # ratio ~ 1.49: above 1 + 0.28, capped by delta = 1.1 below it
    data["advantages"] = -data["advantages"]
    config = PolicyLossConfig(loss_type="dapo", importance_sampling_level=level, epsilon_high=0.28, delta=1.1)
    ours, theirs = run_both(config, data, old=True, ref=False)
    assert_matches_trl(ours, theirs, str(config))
    assert theirs[2]["clip_ratio/high_mean"] == 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
def test_fully_masked_rows_match_trl_and_get_zero_gradient(loss_type):
    data = make_inputs(seed=4)
    config = PolicyLossConfig(loss_type=loss_type, importance_sampling_level="sequence", beta=0.04,
                              entropy_coef=0.01)
    ours, theirs = run_both(config, data, old=True, ref=True)
    assert_matches_trl(ours, theirs, str(config))
    g_logp, g_ent = ours[1]
    assert (g_logp[2] == 0).all() and (g_ent[2] == 0).all()
    assert (g_logp[~data["mask"]] == 0).all() and (g_ent[~data["mask"]] == 0).all()


# --------------------------------------------------------------------------- one-pass granularity


GRANULARITY_CASES = [
    (dict(loss_type=lt, beta=0.04, entropy_coef=0.01, max_completion_length=T, delta=d), "token")
    for lt, d in [("grpo", 1.5), ("bnpo", None), ("dr_grpo", None), ("dapo", 1.5), ("cispo", None), ("sapo", None),
                  ("luspo", None)]
] + [
    (dict(loss_type=lt, importance_sampling_level="sequence", beta=0.04, max_completion_length=T), "sequence")
    for lt in LOSS_TYPES
] + [
    (dict(loss_type="vespo", beta=0.04, entropy_coef=0.01), "sequence"),
    (dict(loss_type="dapo", off_policy_mask_threshold=0.02), "sequence"),
    (dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.01), None),
]


@pytest.mark.parametrize("kwargs,granularity", GRANULARITY_CASES)
def test_one_pass_granularity_claims_hold(kwargs, granularity):
    """Changing the inputs outside a token's claimed reach must leave that token's gradients unchanged."""
    config = PolicyLossConfig(**kwargs)
    assert config.one_pass_granularity == granularity
    data = make_inputs(seed=21)
    g = torch.Generator().manual_seed(99)

    def gradients(logp, ent):
        logp, ent = logp.clone().requires_grad_(), ent.clone().requires_grad_()
        loss, _ = policy_loss_from_logprobs(logp, ent, data["advantages"], data["mask"], config=config,
                                            old_logprobs=data["old"], ref_logprobs=data["ref"],
                                            sampling_logprobs=data["sampling"])
        return grads(loss, logp, ent)

    base = gradients(data["logp"], data["entropy"])
    moved = False
    for b, t in [(0, 0), (3, 2), (5, 6)]:
        keep = torch.zeros(B, T, dtype=torch.bool)
        if granularity == "token":
            keep[b, t] = True
        else:
            keep[b] = True
        noise = 0.5 * torch.randn(2, B, T, generator=g, dtype=DTYPE)
        other = gradients(torch.where(keep, data["logp"], data["logp"] + noise[0]),
                          torch.where(keep, data["entropy"], (data["entropy"] + noise[1]).abs()))
        for name, x, y in zip(("logprobs", "entropy"), base, other):
            if granularity is None:  # the claim is tight: other sequences do move this one's gradients
                moved |= not torch.equal(x[keep], y[keep])
            else:
                assert torch.equal(x[keep], y[keep]), f"{config}: d loss / d {name} at {keep.nonzero().tolist()} moved"
    assert moved or granularity is not None, f"{config}: no cross-sequence dependence found"


# --------------------------------------------------------------------------- PPO and the value loss


def test_ppo_config_is_ppov2_policy_loss():
    config = PolicyLossConfig.ppo(cliprange=0.2)
    assert (config.loss_type, config.epsilon_low, config.epsilon_high, config.beta) == ("bnpo", 0.2, 0.2, 0.0)
    assert config.importance_sampling_level == "token" and config.one_pass_granularity == "token"
    # ratios 1.5 (A=1: clipped to 1.2), 0.5 (A=-1: clipped to 0.8), 1.1 (A=-2: inside), one masked garbage token
    ratio = torch.tensor([[1.5, 0.5, 1.1, 7.0]], dtype=DTYPE)
    advantages = torch.tensor([[1.0, -1.0, -2.0, 5.0]], dtype=DTYPE)
    mask = torch.tensor([[True, True, True, False]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=DTYPE)
    logp = (old + ratio.log()).requires_grad_()
    loss, metrics = policy_loss_from_logprobs(logp, None, advantages, mask, config=config, old_logprobs=old)
    # by hand: max(-1.5, -1.2) = -1.2, max(0.5, 0.8) = 0.8, max(2.2, 2.2) = 2.2 -> mean 0.6
    torch.testing.assert_close(loss, torch.tensor(0.6, dtype=DTYPE), **TOL)
    # the PPOv2 formula, written out
    rho = torch.exp(logp - old)
    pg_losses, pg_losses2 = -advantages * rho, -advantages * torch.clamp(rho, 0.8, 1.2)
    ppov2 = (torch.max(pg_losses, pg_losses2) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, ppov2, **TOL)
    (g,) = torch.autograd.grad(loss, logp)
    # only the unclipped third token moves: d/dlogp (-A rho) / 3 = 2 * 1.1 / 3
    torch.testing.assert_close(g, torch.tensor([[0.0, 0.0, 2.2 / 3, 0.0]], dtype=DTYPE), **TOL)
    torch.testing.assert_close(metrics["policy/clipfrac_avg"], torch.tensor(2 / 3, dtype=DTYPE), **TOL)
    torch.testing.assert_close(metrics["val/ratio"], torch.tensor(3.1 / 3, dtype=DTYPE), **TOL)
    var = ((torch.tensor([1.5, 0.5, 1.1], dtype=DTYPE) - 3.1 / 3) ** 2).sum() / 2
    torch.testing.assert_close(metrics["val/ratio_var"], var, **TOL)
    torch.testing.assert_close(metrics["policy/approxkl_avg"], 0.5 * (ratio[0, :3].log() ** 2).mean(), **TOL)


def test_value_loss_hand_checked():
    values = torch.tensor([[0.9, 2.0, 0.5, 100.0]], dtype=DTYPE, requires_grad=True)
    old_values = torch.tensor([[0.8, 1.0, 1.0, 0.0]], dtype=DTYPE)
    returns = torch.tensor([[1.5, 1.0, 0.0, 0.0]], dtype=DTYPE)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss_reference(values, old_values, returns, mask, cliprange_value=0.2)
    # token 1: inside the clip range, 0.36 both ways; token 2: clipped to 1.2, max(1, 0.04) = 1;
    # token 3: clipped to 0.8, max(0.25, 0.64) = 0.64 (the clipped term is larger). 0.5 * 2.0 / 3
    torch.testing.assert_close(loss, torch.tensor(1 / 3, dtype=DTYPE), **TOL)
    assert metrics["loss/value_avg"] == loss.detach() and not metrics["loss/value_avg"].requires_grad
    torch.testing.assert_close(metrics["val/clipfrac_avg"], torch.tensor(1 / 3, dtype=DTYPE), **TOL)
    (g,) = torch.autograd.grad(loss, values)
    torch.testing.assert_close(g, torch.tensor([[-0.2, 1 / 3, 0.0, 0.0]], dtype=DTYPE), **TOL)
    empty, metrics = value_loss_reference(values, old_values, returns, torch.zeros_like(mask), 0.2)
    assert empty.item() == 0.0 and metrics["val/clipfrac_avg"].item() == 0.0


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,field,value", [
    (dict(loss_type="ppo"), "loss_type", "'ppo'"),
    (dict(epsilon_low=-0.1), "epsilon_low", "-0.1"),
    (dict(epsilon_high=-0.2), "epsilon_high", "-0.2"),
    (dict(epsilon_low=float("nan")), "epsilon_low", "nan"),
    (dict(delta=0.0), "delta", "0.0"),
    (dict(loss_type="sapo", delta=2.0), "delta", "2.0"),
    (dict(beta=-0.01), "beta", "-0.01"),
    (dict(kl_estimator="k4"), "kl_estimator", "'k4'"),
    (dict(use_bias_correction_kl=1), "use_bias_correction_kl", "1"),
    (dict(entropy_coef=float("inf")), "entropy_coef", "inf"),
    (dict(importance_sampling_level="batch"), "importance_sampling_level", "'batch'"),
    (dict(temperature=0.0), "temperature", "0.0"),
    (dict(temperature=-1.0), "temperature", "-1.0"),
    (dict(loss_type="dr_grpo"), "max_completion_length", "None"),
    (dict(max_completion_length=0), "max_completion_length", "0"),
    (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg", "0.0"),
    (dict(vespo_lambda_pos=-1.0), "vespo_lambda_pos", "-1.0"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile", "1.5"),
    (dict(off_policy_mask_threshold=float("nan")), "off_policy_mask_threshold", "nan"),
])
def test_bad_config_raises_naming_field(kwargs, field, value):
    with pytest.raises(ValueError) as err:
        PolicyLossConfig(**kwargs)
    assert f"PolicyLossConfig.{field}" in str(err.value) and value in str(err.value), str(err.value)


def test_config_defaults_mirror_trl():
    config = PolicyLossConfig()
    assert config.loss_type == "dapo" and config.epsilon_low == 0.2 and config.epsilon_high == 0.2
    assert PolicyLossConfig(epsilon_low=0.1).epsilon_high == 0.1
    assert PolicyLossConfig(epsilon_low=0.1, epsilon_high=0.28).epsilon_high == 0.28
    assert config.kl_estimator == "k3" and config.use_bias_correction_kl and config.beta == 0.0
    assert (config.sapo_temperature_neg, config.sapo_temperature_pos) == (1.05, 1.0)
    assert (config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_k_neg, config.vespo_lambda_neg) == (2, 3, 3, 2)
    with pytest.raises(AttributeError):
        config.beta = 1.0  # frozen


@pytest.mark.parametrize("name,bad_shape", [
    ("mask", (B, T + 1)), ("entropy", (B + 1, T)), ("advantages", (B + 1,)), ("advantages", (B, T, 1)),
    ("old_logprobs", (B, T - 1)), ("ref_logprobs", (T, B)), ("importance_weights", (B - 1,)),
    ("sampling_logprobs", (B, 1)),
])
def test_shape_mismatch_names_both_shapes(name, bad_shape):
    data = make_inputs()
    args = dict(logprobs=data["logp"], entropy=data["entropy"], advantages=data["advantages"], mask=data["mask"],
                config=PolicyLossConfig(beta=0.04, off_policy_mask_threshold=0.1), ref_logprobs=data["ref"])
    args[name] = torch.zeros(bad_shape, dtype=torch.bool if name == "mask" else DTYPE)
    with pytest.raises(ValueError) as err:
        policy_loss_from_logprobs(**args)
    message = str(err.value)
    assert name in message and str(tuple(bad_shape)) in message and str((B, T)) in message, message


def test_bad_inputs():
    data = make_inputs()
    common = dict(advantages=data["advantages"], mask=data["mask"])
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss_from_logprobs(data["logp"], None, **common, config=PolicyLossConfig(beta=0.1))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss_from_logprobs(data["logp"], None, **common, config=PolicyLossConfig(entropy_coef=0.01))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss_from_logprobs(data["logp"], None, **common, config=PolicyLossConfig(top_entropy_quantile=0.2))
    with pytest.raises(ValueError, match="importance_weights"):
        policy_loss_from_logprobs(data["logp"], None, **common, config=PolicyLossConfig(loss_type="vespo"),
                                  importance_weights=data["is_seq"])
    with pytest.raises(ValueError, match="logprobs"):
        policy_loss_from_logprobs(data["logp"][0], None, **common, config=PolicyLossConfig())
    with pytest.raises(TypeError, match="PolicyLossConfig"):
        policy_loss_from_logprobs(data["logp"], None, **common, config=dict(loss_type="dapo"))
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss_reference(data["logp"], data["logp"], data["logp"], data["mask"], -0.1)
    with pytest.raises(ValueError, match=r"returns.*\(6, 6\).*\(6, 7\)"):
        value_loss_reference(data["logp"], data["logp"], data["logp"][:, :6], data["mask"], 0.2)
