"""fastrl.policy_loss against the float64 reference (materialised logits + the loss arithmetic).

The loss arithmetic itself is checked against TRL 1.16's own ``_compute_loss`` in test_loss_math.py;
here the question is whether the fused paths (one pass and two pass, both CPU backends) give the
reference's loss, gradients and metrics.
"""

import itertools
import zlib

import pytest
import torch

import fastrl
from fastrl.ops import one_pass as one_pass_mod
from fastrl.losses.config import CLIPPED_LOSS_TYPES, LOSS_TYPES, PolicyLossConfig
from fastrl.reference import logprobs_reference, policy_loss_from_logprobs

from conftest import CPU_BACKENDS

B, T, H, V = 3, 7, 16, 150


def make_batch(dtype=torch.float32, seed=0, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / 3).to(dtype).requires_grad_()
    bias = (torch.randn(V, generator=g) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    mask[1, :] = False  # a fully masked row
    targets[~mask] = V + 5  # padding ids out of range must not matter under the mask
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=g)
    old = -torch.rand(B, T, generator=g) * 4 - 1
    ref = -torch.rand(B, T, generator=g) * 4 - 1
    return dict(hidden=hidden, weight=weight, bias=bias, targets=targets, mask=mask, adv=adv, old=old, ref=ref)


def reference(batch, config, dtype=torch.float64, **kw):
    """Materialised logits in ``dtype`` + the loss arithmetic; returns loss, metrics, grads."""
    t = torch.where(batch["mask"], batch["targets"], -100)
    params = [batch["hidden"], batch["weight"], batch["bias"]]
    lp, en = logprobs_reference(batch["hidden"], batch["weight"], t, bias=batch["bias"],
                                temperature=config.temperature, dtype=dtype)
    cast = (lambda x: x.to(dtype)) if dtype is not None else (lambda x: x.to(lp.dtype))
    loss, metrics = policy_loss_from_logprobs(
        lp, en, cast(batch["adv"]), batch["mask"], config=config, old_logprobs=cast(batch["old"]),
        ref_logprobs=cast(batch["ref"]), **kw)
    return loss, metrics, torch.autograd.grad(loss, params)


def fused(batch, config, backend, **kw):
    params = [batch["hidden"], batch["weight"], batch["bias"]]
    loss, metrics = fastrl.policy_loss(
        batch["hidden"], batch["weight"], batch["targets"], batch["adv"], batch["mask"], config=config,
        old_logprobs=batch["old"], ref_logprobs=batch["ref"], bias=batch["bias"], backend=backend, **kw)
    return loss, metrics, torch.autograd.grad(loss, params)


def rel(x, y):
    return ((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-12)).item()


def assert_matches(got, want, torch_same_dtype, label):
    loss, metrics, grads = got
    loss64, metrics64, grads64 = want
    loss_t, _, grads_t = torch_same_dtype
    e_fast, e_torch = abs(loss.item() - loss64.item()), abs(loss_t.item() - loss64.item())
    # float32 slack relative to the loss: a wrong term (or a wrong kernel) is off by far more
    assert e_fast <= e_torch + 4e-6 * (1 + abs(loss64.item())), (
        f"{label}: loss error {e_fast:.2e} vs PyTorch's own {e_torch:.2e}")
    for name, gf, g64, gt in zip(("hidden", "weight", "bias"), grads, grads64, grads_t):
        assert torch.isfinite(gf).all(), f"{label}: non-finite grad {name}"
        e_fast, e_torch = rel(gf, g64), rel(gt, g64)
        # 5e-6 is ~40 float32 ulps of the largest entry: the two sides sum in different orders (CPU GEMM blocking
        # varies with the machine's load, and 2e-6 was hit at 2.6e-6 once), while a wrong term is off by >1e-3
        assert e_fast <= e_torch + 5e-6, f"{label}: grad {name} rel error {e_fast:.2e} vs PyTorch's {e_torch:.2e}"
    assert set(metrics) == set(metrics64), f"{label}: metric names differ: {set(metrics) ^ set(metrics64)}"
    for k in metrics64:
        assert abs(metrics[k].item() - metrics64[k].item()) <= 1e-5 * (1 + abs(metrics64[k].item())), (
            f"{label}: metric {k} = {metrics[k].item()} vs reference {metrics64[k].item()}")


def _configs():
    kls = [(0.0, "k3", True), (0.04, "k1", True), (0.04, "k2", True), (0.04, "k3", True), (0.04, "k3", False)]
    for loss_type, level, delta, (beta, est, bias_corr), ent in itertools.product(
            LOSS_TYPES, ("token", "sequence"), (None, 1.5), kls, (0.0, 0.01)):
        if delta is not None and loss_type not in CLIPPED_LOSS_TYPES:
            continue
        yield PolicyLossConfig(
            loss_type=loss_type, importance_sampling_level=level, delta=delta, beta=beta, kl_estimator=est,
            use_bias_correction_kl=bias_corr, entropy_coef=ent,
            max_completion_length=T + 3 if loss_type == "dr_grpo" else None,
            epsilon_high=5.0 if loss_type == "cispo" else None,
        )


CONFIGS = list(_configs())


def _id(c):
    return (f"{c.loss_type}-{c.importance_sampling_level}-d{c.delta}-b{c.beta}{c.kl_estimator}"
            f"{'' if c.use_bias_correction_kl else 'nobc'}-e{c.entropy_coef}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_matches_float64_reference(config, backend):
    batch = make_batch(seed=zlib.crc32(_id(config).encode()) % 1000)  # not hash(): it changes per process
    assert_matches(fused(batch, config, backend), reference(batch, config), reference(batch, config, dtype=None),
                   _id(config))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_per_token_advantages_and_temperature(loss_type, backend):
    config = PolicyLossConfig(loss_type=loss_type, temperature=0.7, beta=0.04, entropy_coef=0.01,
                              max_completion_length=12 if loss_type == "dr_grpo" else None)
    batch = make_batch(per_token_adv=True, seed=3)
    assert_matches(fused(batch, config, backend), reference(batch, config), reference(batch, config, dtype=None),
                   loss_type)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bf16_inputs_are_more_accurate_than_pytorch(backend):
    config = PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)
    batch = make_batch(dtype=torch.bfloat16, seed=5)
    got, want, same = fused(batch, config, backend), reference(batch, config), reference(batch, config, dtype=None)
    assert abs(got[0].item() - want[0].item()) <= abs(same[0].item() - want[0].item()) + 1e-5
    for gf, g64, gt in zip(got[2], want[2], same[2]):
        assert rel(gf, g64) <= rel(gt, g64) + 2**-8


def _spy_paths(monkeypatch):
    calls = []
    real = one_pass_mod.run

    def spy(*args, **kwargs):
        calls.append(args[6])  # the chunks: ranges of live (in-mask) rows
        return real(*args, **kwargs)

    monkeypatch.setattr(one_pass_mod, "run", spy)
    return calls


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "config, chunk, one_pass",
    [(PolicyLossConfig(loss_type="grpo"), 5, True),  # token level: any token range
     (PolicyLossConfig(loss_type="grpo", importance_sampling_level="sequence"), 2 * T, True),
     (PolicyLossConfig(loss_type="grpo", importance_sampling_level="sequence"), T - 1, False),  # sequence > chunk
     (PolicyLossConfig(loss_type="vespo"), T, True),
     (PolicyLossConfig(loss_type="bnpo", top_entropy_quantile=0.35), None, False)],  # batch-wide quantile
    ids=["token", "seq-fits", "seq-too-long", "vespo", "entropy-quantile"],
)
def test_path_choice_and_equal_numbers(config, chunk, one_pass, backend, monkeypatch):
    """The configuration picks one pass or two; both give the reference's numbers."""
    calls = _spy_paths(monkeypatch)
    batch = make_batch(seed=11)
    got = fused(batch, config, backend, chunk_tokens=chunk)
    assert bool(calls) == one_pass, f"expected one_pass={one_pass}, ran one-pass chunks {calls}"
    if one_pass and config.importance_sampling_level == "sequence" or config.loss_type == "vespo":
        # every chunk boundary (in live-row space) is a boundary between sequences
        seq_ends = set(batch["mask"].bool().sum(1).cumsum(0).tolist()) | {0}
        bounds = {b for chunks in calls for c in chunks for b in c}
        assert bounds <= seq_ends, f"sequence-coupled losses must chunk whole sequences: {calls} vs {seq_ends}"
    if one_pass and chunk is not None:
        assert all(c1 - c0 <= chunk for chunks in calls for c0, c1 in chunks), calls
    assert_matches(got, reference(batch, config), reference(batch, config, dtype=None), str(config.loss_type))


@pytest.mark.interpreter
def test_triton_fused_takes_two_passes_on_its_kernels(monkeypatch):
    """backend="triton-fused" promises no stored logit: the loss takes path A on the fused kernels (never the
    one-pass float32 tile), with the reference's numbers."""
    from fastrl.ops import linear_logprob

    calls = _spy_paths(monkeypatch)
    ran = []
    real_stats = linear_logprob.linear_stats

    def spy_stats(hidden, weight, bias, targets, tf, backend, *args, **kwargs):
        ran.append(backend)
        return real_stats(hidden, weight, bias, targets, tf, backend, *args, **kwargs)

    monkeypatch.setattr(linear_logprob, "linear_stats", spy_stats)
    config = PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)
    batch = make_batch(seed=5)
    got = fused(batch, config, "triton-fused")
    assert not calls, f"triton-fused ran the one-pass path: {calls}"
    assert ran == ["triton-fused"], f"the two-pass path's statistics ran on {ran}"
    assert_matches(got, reference(batch, config), reference(batch, config, dtype=None), "triton-fused")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_one_pass_equals_two_pass(backend, monkeypatch):
    config = PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01, delta=2.0)
    batch = make_batch(seed=2)
    one = fused(batch, config, backend, chunk_tokens=4)
    monkeypatch.setattr(PolicyLossConfig, "one_pass_granularity", property(lambda self: None))
    two = fused(batch, config, backend)
    assert abs(one[0].item() - two[0].item()) < 1e-6
    for a, b in zip(one[2], two[2]):
        assert rel(a, b) < 1e-5
    for k in one[1]:
        assert abs(one[1][k].item() - two[1][k].item()) < 1e-6, k


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_forward_only_gives_same_loss_and_metrics(backend):
    config = PolicyLossConfig(loss_type="grpo", beta=0.04)
    batch = make_batch(seed=4)
    loss, metrics, _ = fused(batch, config, backend)
    with torch.no_grad():
        loss2, metrics2 = fastrl.policy_loss(
            batch["hidden"], batch["weight"], batch["targets"], batch["adv"], batch["mask"], config=config,
            old_logprobs=batch["old"], ref_logprobs=batch["ref"], bias=batch["bias"], backend=backend)
    assert loss2.grad_fn is None and abs(loss.item() - loss2.item()) < 1e-6
    assert all(abs(metrics[k].item() - metrics2[k].item()) < 1e-6 for k in metrics)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fully_masked_batch_gives_zero(loss_type, backend):
    config = PolicyLossConfig(loss_type=loss_type, beta=0.04, entropy_coef=0.01,
                              max_completion_length=10 if loss_type == "dr_grpo" else None)
    batch = make_batch(seed=6)
    batch["mask"][:] = False
    loss, metrics, grads = fused(batch, config, backend)
    assert loss.item() == 0.0
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))
    assert all(torch.isfinite(v) for v in metrics.values()), metrics


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_on_policy_without_old_logprobs(backend):
    config = PolicyLossConfig(loss_type="grpo")
    batch = make_batch(seed=8)
    batch["old"] = None
    t = torch.where(batch["mask"], batch["targets"], -100)
    lp, en = logprobs_reference(batch["hidden"], batch["weight"], t, bias=batch["bias"], dtype=torch.float64)
    loss64, _ = policy_loss_from_logprobs(lp, en, batch["adv"].double(), batch["mask"], config=config)
    g64 = torch.autograd.grad(loss64, [batch["hidden"], batch["weight"], batch["bias"]])
    loss, _, grads = fused(batch, config, backend)
    assert abs(loss.item() - loss64.item()) < 1e-6
    assert all(rel(a, b) < 1e-5 for a, b in zip(grads, g64))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_frozen_head_gets_no_weight_gradient(backend):
    config = PolicyLossConfig(loss_type="dapo")
    batch = make_batch(seed=9)
    w = batch["weight"].detach()
    loss, _ = fastrl.policy_loss(batch["hidden"], w, batch["targets"], batch["adv"], batch["mask"], config=config,
                                 old_logprobs=batch["old"], backend=backend)
    loss.backward()
    assert batch["hidden"].grad is not None and w.grad is None


def test_module_form_and_scaled_backward():
    config = PolicyLossConfig(loss_type="bnpo")
    batch = make_batch(seed=10)
    module = fastrl.FusedPolicyLoss(config)
    loss, _ = module(batch["hidden"], batch["weight"], batch["targets"], batch["adv"], batch["mask"],
                     old_logprobs=batch["old"], bias=batch["bias"])
    (g1,) = torch.autograd.grad(loss, [batch["weight"]], retain_graph=False)
    loss2, _ = module(batch["hidden"], batch["weight"], batch["targets"], batch["adv"], batch["mask"],
                      old_logprobs=batch["old"], bias=batch["bias"])
    (g3,) = torch.autograd.grad(3.0 * loss2, [batch["weight"]])
    assert rel(g3, 3.0 * g1) < 1e-6


def test_ppo_config_is_pp0v2_clipped_surrogate():
    """PPOv2: masked mean over tokens of max(-A rho, -A clip(rho, 1 -+ c)), no KL term."""
    config = PolicyLossConfig.ppo(cliprange=0.2)
    batch = make_batch(seed=12, per_token_adv=True)
    loss, _, _ = fused(batch, config, "torch")
    t = torch.where(batch["mask"], batch["targets"], -100)
    lp, _ = logprobs_reference(batch["hidden"], batch["weight"], t, bias=batch["bias"], dtype=torch.float64)
    rho = torch.exp(lp - batch["old"].double())
    a = batch["adv"].double()
    pg = torch.max(-a * rho, -a * rho.clamp(0.8, 1.2))
    m = batch["mask"].double()
    assert abs(loss.item() - ((pg * m).sum() / m.sum()).item()) < 1e-6


# ---------------------------------------------------------------- bad input


def test_bad_configurations_raise_naming_the_field():
    with pytest.raises(ValueError, match="loss_type"):
        PolicyLossConfig(loss_type="ppo2")
    with pytest.raises(ValueError, match="epsilon_low"):
        PolicyLossConfig(epsilon_low=-0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        PolicyLossConfig(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="kl_estimator"):
        PolicyLossConfig(kl_estimator="k4")
    with pytest.raises(TypeError, match="PolicyLossConfig"):
        batch = make_batch()
        fastrl.policy_loss(batch["hidden"], batch["weight"], batch["targets"], batch["adv"], batch["mask"],
                           config={"loss_type": "grpo"})


def test_bad_shapes_name_both_shapes():
    batch = make_batch()
    cfg = PolicyLossConfig(loss_type="grpo", beta=0.04)
    with pytest.raises(ValueError, match=r"mask must have targets' shape \(3, 7\), got \(3, 6\)"):
        fastrl.policy_loss(batch["hidden"], batch["weight"], batch["targets"], batch["adv"], batch["mask"][:, :6],
                           config=cfg, ref_logprobs=batch["ref"])
    with pytest.raises(ValueError, match=r"\(2,\).*\(3, 7\)"):
        fastrl.policy_loss(batch["hidden"], batch["weight"], batch["targets"], batch["adv"][:2], batch["mask"],
                           config=cfg, ref_logprobs=batch["ref"])
    with pytest.raises(ValueError, match="ref_logprobs"):
        fastrl.policy_loss(batch["hidden"], batch["weight"], batch["targets"], batch["adv"], batch["mask"],
                           config=cfg)
    with pytest.raises(ValueError, match=r"hidden must be \[B, T, H\]"):
        fastrl.policy_loss(batch["hidden"][0], batch["weight"], batch["targets"][0], batch["adv"],
                           batch["mask"][0], config=PolicyLossConfig())


@pytest.mark.parametrize("B_, T_", [(0, 7), (3, 0)])
def test_empty_batch_names_the_callers_arguments(B_, T_):
    """An empty batch is refused naming hidden and targets (what the caller passed), not an internal argument."""
    hidden = torch.randn(B_, T_, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    targets = torch.zeros(B_, T_, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"at least one completion token: hidden has shape \({B_}, {T_}, {H}\) "
                                         rf"and targets \({B_}, {T_}\)") as e:
        fastrl.policy_loss(hidden, weight, targets, torch.zeros(B_), torch.ones(B_, T_, dtype=torch.bool),
                           config=PolicyLossConfig())
    assert "logprobs" not in str(e.value)


def test_out_of_range_target_inside_the_mask_is_an_error():
    batch = make_batch()
    batch["targets"][0, 0] = V
    with pytest.raises(ValueError, match=r"position \(0, 0\): got 150"):
        fastrl.policy_loss(batch["hidden"], batch["weight"], batch["targets"], batch["adv"], batch["mask"],
                           config=PolicyLossConfig(), old_logprobs=batch["old"])


def test_value_loss_hand_checked():
    v = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    v_old = torch.tensor([[0.5, 2.5, 9.0]])
    ret = torch.tensor([[2.0, 2.0, 1.0]])
    mask = torch.tensor([[True, True, False]])
    loss, metrics = fastrl.value_loss(v, v_old, ret, mask, cliprange_value=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped clip(1, .3, .7) = .7 -> (.7-2)^2 = 1.69 -> 1.69 (clipped larger)
    # token 1: unclipped 0, clipped clip(2, 2.3, 2.7) = 2.3 -> .09 -> .09 (clipped larger)
    assert abs(loss.item() - 0.5 * (1.69 + 0.09) / 2) < 1e-6
    assert metrics["val/clipfrac_avg"].item() == 1.0


# ---------------------------------------------------------------- against TRL's own arithmetic


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fused_loss_equals_trl_compute_loss(loss_type, level, backend):
    """TRL 1.16's real _compute_loss, fed fastrl's per-token log-probs (autograd through the two-pass op),
    against the fused one-pass loss: same loss, same hidden/weight/bias gradients, same logged metrics."""
    from trl_harness import make_grpo_trainer, trl_compute_loss, trl_kwargs_from_config

    config = PolicyLossConfig(loss_type=loss_type, importance_sampling_level=level, beta=0.04, entropy_coef=0.0,
                              max_completion_length=T + 3 if loss_type == "dr_grpo" else None)
    batch = make_batch(seed=21)
    params = [batch["hidden"], batch["weight"], batch["bias"]]
    t = torch.where(batch["mask"], batch["targets"], -100)
    lp, en = fastrl.fused_logprobs(batch["hidden"], batch["weight"], t, bias=batch["bias"], backend=backend)
    trainer = make_grpo_trainer(**trl_kwargs_from_config(config))
    trl_loss, trl_metrics = trl_compute_loss(trainer, lp, en, batch["adv"], batch["mask"],
                                             old_logprobs=batch["old"], ref_logprobs=batch["ref"])
    trl_grads = torch.autograd.grad(trl_loss, params)
    loss, metrics, grads = fused(batch, config, backend)
    assert abs(loss.item() - trl_loss.item()) <= 2e-6 * (1 + abs(trl_loss.item()))
    for a, b in zip(grads, trl_grads):
        assert rel(a, b) < 1e-5
    for k, v in trl_metrics.items():
        assert k in metrics, f"TRL logs {k}, fastrl does not"
        assert abs(metrics[k].item() - v) <= 1e-5 * (1 + abs(v)), f"{k}: {metrics[k].item()} vs TRL {v}"
