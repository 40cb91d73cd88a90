"""The exact reference KL (``kl_estimator="exact"``): ``policy_loss`` against float64, the GRPO and PPO trainers.

Ground truth is float64 on materialised logits: ``fastrl.reference.logprobs_reference`` and
``divergence_reference`` (the spec of ``fused_divergence``) feeding ``policy_loss_from_logprobs(per_token_kl=)``,
differentiated by autograd. The fused loss (float32 inputs) must give the same loss, the same gradients w.r.t.
hidden, weight and bias, and a ``kl`` metric equal to the float64 masked mean of the exact KL, for every loss type,
through the one-pass path (policy gradients formed in the forward, the KL's through its own graph) and the
two-pass path. An independent check of the placement: ``loss(beta) - loss(0)`` is ``beta`` times the loss type's
normalised KL sum, whatever ``use_bias_correction_kl`` says (the ratio never multiplies the exact KL).
Trainers: a tiny GRPO run whose logged ``kl`` equals, at every step, the float64 exact KL of the step's batch
(gradient accumulation and num_iterations splits included); a PPO rollout whose KL reward is the float64 exact KL.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import fastrl
from fastrl.ops import one_pass as OP
from fastrl.losses import policy as P
from fastrl.ops import policy_run
from fastrl.losses.config import LOSS_TYPES, PolicyLossConfig
from fastrl.reference import divergence_reference, logprobs_reference, policy_loss_from_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls (tests/conftest.py)

B, T, H, H_REF, V = 3, 7, 16, 24, 37  # the reference is wider than the policy; awkward vocabulary
TEMPERATURE = 0.9
REL = {torch.float32: 2e-5, torch.float64: 1e-10}  # float32 inputs against float64 ground truth; float64 vs float64


def make_inputs(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False  # a completion that ended early
    mask[2, :] = False  # a fully masked row
    mask[2, 0] = True
    x = dict(
        hidden=randn(B, T, H), weight=randn(V, H, scale=0.5), bias=randn(V, scale=0.3),
        ref_hidden=randn(B, T, H_REF), ref_weight=randn(V, H_REF, scale=0.5), ref_bias=randn(V, scale=0.3),
        targets=torch.randint(0, V, (B, T), generator=g), mask=mask, advantages=randn(B),
    )
    with torch.no_grad():
        logp, _ = logprobs_reference(x["hidden"], x["weight"], x["targets"], bias=x["bias"], temperature=TEMPERATURE,
                                     dtype=torch.float64)
    # old log-probs off by up to +-0.4: ratios fall on both sides of every clip range
    x["old_logprobs"] = (logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.8).to(dtype)
    return x


def config_for(loss_type: str, **kw) -> PolicyLossConfig:
    level = "sequence" if loss_type in ("grpo", "sapo", "cispo") else "token"
    options = dict(loss_type=loss_type, beta=0.3, kl_estimator="exact", temperature=TEMPERATURE, entropy_coef=0.01,
                   importance_sampling_level=level, max_completion_length=T)
    if loss_type == "cispo":
        options["epsilon_high"] = 1.1
    options.update(kw)
    return PolicyLossConfig(**options)


def reference(x: dict, config: PolicyLossConfig, logit_scale: float = 1.0, softcap: float | None = None):
    """(loss, (grad_h, grad_w, grad_b), metrics, per-token KL) in float64 on materialised logits."""
    h, w, b = (x[k].detach().double().requires_grad_() for k in ("hidden", "weight", "bias"))
    tf = dict(temperature=config.temperature, logit_scale=logit_scale, softcap=softcap)
    logp, ent = logprobs_reference(h, w, x["targets"], bias=b, **tf)
    kl, _ = divergence_reference(
        h, w, x["ref_hidden"].double(), x["ref_weight"].double(), beta=1.0, bias=b, teacher_bias=x["ref_bias"].double(),
        temperature=config.temperature, logit_scale=logit_scale, teacher_logit_scale=logit_scale, softcap=softcap,
        teacher_softcap=softcap, mask=x["mask"],
    )
    loss, metrics = policy_loss_from_logprobs(logp, ent, x["advantages"].double(), x["mask"], config=config,
                                              old_logprobs=x["old_logprobs"].double(), per_token_kl=kl)
    return loss.detach(), torch.autograd.grad(loss, [h, w, b]), metrics, kl.detach()


def fused(x: dict, config: PolicyLossConfig, *, backend="torch", **kw):
    h, w, b = (x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    loss, metrics = fastrl.policy_loss(
        h, w, x["targets"], x["advantages"], x["mask"], config=config, old_logprobs=x["old_logprobs"], bias=b,
        ref_hidden=x["ref_hidden"], ref_weight=x["ref_weight"], ref_bias=x["ref_bias"], backend=backend, **kw,
    )
    loss.backward()
    return loss.detach(), (h.grad, w.grad, b.grad), metrics


def force_path(monkeypatch, path: str) -> list:
    """Make ``policy_loss`` take ``path`` ("one_pass" / "two_pass"); the returned list records one-pass calls."""
    calls = []
    if path == "two_pass":
        monkeypatch.setattr(OP, "live_chunks", lambda *a, **k: None)
    real = OP.run

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(OP, "run", spy)
    return calls


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def assert_matches(got, ref, rel: float, label: str) -> None:
    (loss, grads, metrics), (loss64, grads64, metrics64, _) = got, ref
    assert abs(loss.double().item() - loss64.item()) <= rel * max(1.0, abs(loss64.item())), (
        f"{label}: loss {loss.item()!r}, float64 {loss64.item()!r}")
    for name, g, g64 in zip(("hidden", "weight", "bias"), grads, grads64):
        err = rel_err(g, g64)
        assert err <= rel, f"{label}: gradient w.r.t. {name} differs from float64 by {err:.2e} (relative norm)"
    assert metrics["kl"].item() == pytest.approx(metrics64["kl"].item(), rel=rel, abs=1e-12), label
    for key in metrics64:
        assert key in metrics, f"{label}: metric {key} missing"


# ---------------------------------------------------------------------------------------------------------------
# policy_loss against float64
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ("one_pass", "two_pass"))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_exact_kl_matches_float64(monkeypatch, loss_type, path):
    x = make_inputs(seed=LOSS_TYPES.index(loss_type))
    config = config_for(loss_type)
    calls = force_path(monkeypatch, path)
    got = fused(x, config, chunk_tokens=T)  # several chunks, whole sequences each
    assert bool(calls) == (path == "one_pass")
    ref = reference(x, config)
    assert ref[3][x["mask"]].min() > 0 and bool((ref[3][~x["mask"]] == 0).all())
    assert_matches(got, ref, REL[torch.float32], f"{loss_type}/{path}")


@pytest.mark.parametrize("path", ("one_pass", "two_pass"))
def test_policy_loss_exact_kl_float64_inputs(monkeypatch, path):
    """float64 inputs on the torch backend: equal to the float64 reference to 1e-10 (a wrong gradient hides nowhere)."""
    x = make_inputs(seed=11, dtype=torch.float64)
    config = config_for("dapo", use_bias_correction_kl=True)
    calls = force_path(monkeypatch, path)
    got = fused(x, config, chunk_tokens=3, logit_scale=0.7, softcap=5.0)
    assert bool(calls) == (path == "one_pass")
    assert_matches(got, reference(x, config, logit_scale=0.7, softcap=5.0), REL[torch.float64], path)


def test_policy_loss_exact_kl_bf16_no_worse_than_pytorch(monkeypatch):
    """bf16 inputs (one pass): the error against float64 is no worse than PyTorch's own on materialised bf16 logits."""
    x = make_inputs(seed=8)
    x16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in x.items()}
    x64 = {k: v.double() if v.is_floating_point() else v for k, v in x16.items()}  # the same (rounded) inputs
    config = config_for("dapo")
    calls = force_path(monkeypatch, "one_pass")
    loss, grads, metrics = fused(x16, config, chunk_tokens=T)
    assert calls
    loss64, grads64, metrics64, _ = reference(x64, config)
    # PyTorch itself: the same reference computed in bf16 (logits rounded to bf16)
    h, w, b = (x16[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    logp, ent = logprobs_reference(h, w, x16["targets"], bias=b, temperature=TEMPERATURE)
    kl, _ = divergence_reference(h, w, x16["ref_hidden"], x16["ref_weight"], bias=b, teacher_bias=x16["ref_bias"],
                                 temperature=TEMPERATURE, mask=x16["mask"])
    loss16, _ = policy_loss_from_logprobs(logp, ent, x16["advantages"], x16["mask"], config=config,
                                          old_logprobs=x16["old_logprobs"], per_token_kl=kl)
    grads16 = torch.autograd.grad(loss16, [h, w, b])
    assert abs(loss.double().item() - loss64.item()) <= abs(loss16.double().item() - loss64.item())
    for name, g, g16, g64 in zip(("hidden", "weight", "bias"), grads, grads16, grads64):
        assert rel_err(g, g64) <= rel_err(g16, g64), (name, rel_err(g, g64), rel_err(g16, g64))


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ("one_pass", "two_pass"))
@pytest.mark.parametrize("backend", ("triton", "triton-fused"))
def test_policy_loss_exact_kl_triton(monkeypatch, backend, path):
    x = make_inputs(seed=5)
    config = config_for("grpo", importance_sampling_level="token")
    calls = force_path(monkeypatch, path)
    got = fused(x, config, backend=backend, chunk_tokens=4)
    assert bool(calls) == (path == "one_pass" and backend != "triton-fused")  # triton-fused: always two passes
    assert_matches(got, reference(x, config), REL[torch.float32], f"{backend}/{path}")


@pytest.mark.parametrize("support", (False, True))
def test_one_pass_exact_kl_is_computed_in_the_chunks(monkeypatch, support):
    """On the torch backend's one-pass path (and over a support) the exact KL comes from the loss's own chunks, the
    reference's tile next to the policy's: no separate fused_divergence pass (which would compute the policy's
    logits a second time), the same numbers as float64; a non-finite reference is still named."""
    from fastrl.ops import divergence

    def no_second_pass(*a, **k):
        raise AssertionError("the exact KL ran as its own fused_divergence pass")

    monkeypatch.setattr(divergence, "fused_divergence", no_second_pass)
    x = make_inputs(seed=3)
    config = config_for("dapo")
    kw = {}
    if support:
        keep = torch.ones(B * T, V, dtype=torch.bool)  # every id kept: the support's KL is the whole vocabulary's
        kw["support"] = fastrl.KeptSet.from_mask(keep.view(B, T, V))
    calls = force_path(monkeypatch, "one_pass")
    got = fused(x, config, chunk_tokens=T, **kw)
    assert bool(calls) != support  # the vocabulary chunks, or the kept-set engine
    assert_matches(got, reference(x, config), REL[torch.float32], f"support={support}")
    nan = x["ref_hidden"].clone()
    nan[0, 1, 2] = float("nan")
    with pytest.raises(FloatingPointError, match=r"exact KL at token \(0, 1\).*ref_hidden holds inf/nan"):
        fused(dict(x, ref_hidden=nan), config, chunk_tokens=T, **kw)


@pytest.mark.parametrize("bias_correction", (True, False))
def test_exact_kl_term_is_beta_times_normalised_kl_without_the_ratio(bias_correction):
    """bnpo: loss(beta) - loss(0) = beta * sum_mask(KL) / n_mask, and the same for the gradients, with the ratios far
    from 1 (old log-probs perturbed); independent of the loss arithmetic's own code for the KL."""
    x = make_inputs(seed=3, dtype=torch.float64)
    beta = 0.7
    on = config_for("bnpo", beta=beta, use_bias_correction_kl=bias_correction, entropy_coef=0.0)
    off = config_for("bnpo", beta=0.0, use_bias_correction_kl=bias_correction, entropy_coef=0.0)
    l_on, g_on, m_on = fused(x, on)
    l_off, g_off, _ = fused(x, off)
    h, w, b = (x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    kl, _ = divergence_reference(h, w, x["ref_hidden"], x["ref_weight"], beta=1.0, bias=b, teacher_bias=x["ref_bias"],
                                 temperature=TEMPERATURE, mask=x["mask"])
    term = beta * kl[x["mask"]].sum() / x["mask"].sum()
    grads = torch.autograd.grad(term, [h, w, b])
    assert (l_on - l_off).item() == pytest.approx(term.item(), rel=1e-10)
    for g1, g0, g in zip(g_on, g_off, grads):
        assert rel_err(g1 - g0, g) <= 1e-10
    assert m_on["kl"].item() == pytest.approx((kl[x["mask"]].sum() / x["mask"].sum()).item(), rel=1e-10)


def test_policy_loss_exact_kl_is_zero_against_itself():
    """The reference equal to the policy: KL exactly 0 and the same loss and gradients as beta=0."""
    x = make_inputs(seed=4, dtype=torch.float64)
    x.update(ref_hidden=x["hidden"].clone(), ref_weight=x["weight"].clone(), ref_bias=x["bias"].clone())
    l_on, g_on, m_on = fused(x, config_for("dapo"))
    l_off, g_off, _ = fused(x, config_for("dapo", beta=0.0))
    assert m_on["kl"].abs().item() < 1e-12
    assert l_on.item() == pytest.approx(l_off.item(), abs=1e-12)
    for a, b in zip(g_on, g_off):
        assert (a - b).abs().max().item() < 1e-12


# ---------------------------------------------------------------------------------------------------------------
# bad input: named errors before any kernel
# ---------------------------------------------------------------------------------------------------------------


def _bad(x: dict, config: PolicyLossConfig, **override):
    args = dict(old_logprobs=x["old_logprobs"], ref_hidden=x["ref_hidden"], ref_weight=x["ref_weight"],
                ref_bias=x["ref_bias"], bias=x["bias"])
    args.update(override)
    return fastrl.policy_loss(x["hidden"], x["weight"], x["targets"], x["advantages"], x["mask"], config=config, **args)


def test_bad_input_named_errors(monkeypatch):
    x = make_inputs()
    exact, k3 = config_for("dapo"), config_for("dapo", kl_estimator="k3")

    def no_kernel(*a, **k):
        raise AssertionError("a kernel ran before the input check")

    from fastrl.ops import divergence

    monkeypatch.setattr(divergence, "fused_divergence", no_kernel)
    monkeypatch.setattr(policy_run, "run_logprobs", no_kernel)
    monkeypatch.setattr(OP, "run", no_kernel)
    cases = [
        (exact, dict(ref_logprobs=x["old_logprobs"]), ValueError, "ref_logprobs must be None"),
        (exact, dict(ref_hidden=None), ValueError, "ref_hidden is None"),
        (exact, dict(ref_weight=None), ValueError, "ref_weight is None"),
        (exact, dict(ref_hidden=x["ref_hidden"][:, :-1]), ValueError, r"ref_hidden must be \[B, T, H_ref\]"),
        (exact, dict(ref_hidden=x["ref_hidden"][0]), ValueError, "ref_hidden must be"),
        (exact, dict(ref_weight=x["ref_weight"][:-1]), ValueError, "vocabulary must be the policy's"),
        (exact, dict(ref_weight=x["ref_weight"][:, :-1]), ValueError, "ref_weight must be"),
        (exact, dict(ref_bias=x["ref_bias"][:-1]), ValueError, "ref_bias must be"),
        (exact, dict(ref_hidden=x["ref_hidden"].long()), TypeError, "ref_hidden must be a floating"),
        (exact, dict(ref_weight=x["ref_weight"].numpy()), TypeError, "ref_weight must be a torch.Tensor"),
        (k3, dict(ref_logprobs=x["old_logprobs"]), ValueError, "read only with kl_estimator='exact'"),
    ]
    for config, override, error, match in cases:
        with pytest.raises(error, match=match):
            _bad(x, config, **override)
    with pytest.raises(ValueError, match="kl_estimator"):
        PolicyLossConfig(kl_estimator="k4")
    monkeypatch.undo()
    # a non-finite reference inside the mask: named as the caller knows it; outside the mask it is never read
    nan = x["ref_hidden"].clone()
    nan[0, 1, 2] = float("nan")
    with pytest.raises(FloatingPointError, match=r"exact KL at token \(0, 1\).*ref_hidden holds inf/nan"):
        _bad(x, exact, ref_hidden=nan)
    nan = x["ref_hidden"].clone()
    nan[1, 6] = float("nan")
    assert torch.isfinite(_bad(x, exact, ref_hidden=nan)[0])
    # the arithmetic on log-probs
    lp = x["old_logprobs"]
    with pytest.raises(ValueError, match="per_token_kl is None"):
        policy_loss_from_logprobs(lp, None, x["advantages"], x["mask"], config=config_for("dapo", entropy_coef=0.0))
    with pytest.raises(ValueError, match="per_token_kl is given"):
        policy_loss_from_logprobs(lp, None, x["advantages"], x["mask"], config=PolicyLossConfig(beta=0.1), ref_logprobs=lp,
                                  per_token_kl=lp)
    with pytest.raises(ValueError, match="per_token_kl has shape"):
        policy_loss_from_logprobs(lp, None, x["advantages"], x["mask"], config=config_for("dapo", entropy_coef=0.0),
                                  per_token_kl=lp[:, :-1])


def test_exact_with_beta_zero_needs_no_reference():
    """beta = 0: no KL term; the reference inputs are neither required nor read, the loss is k3's with beta = 0."""
    x = make_inputs(seed=6, dtype=torch.float64)
    got = fastrl.policy_loss(x["hidden"], x["weight"], x["targets"], x["advantages"], x["mask"],
                             config=config_for("dapo", beta=0.0), old_logprobs=x["old_logprobs"], bias=x["bias"])
    want = fastrl.policy_loss(x["hidden"], x["weight"], x["targets"], x["advantages"], x["mask"],
                              config=config_for("dapo", beta=0.0, kl_estimator="k3"), old_logprobs=x["old_logprobs"],
                              bias=x["bias"])
    assert torch.equal(got[0], want[0]) and "kl" not in got[1]


# ---------------------------------------------------------------------------------------------------------------
# Trainers
# ---------------------------------------------------------------------------------------------------------------


def _float64_body(model):
    """A float64 copy of a causal LM (PEFT: merged view not needed; the plain model here)."""
    return copy.deepcopy(model).double().eval()


def test_grpo_exact_kl_logged_equals_float64(tmp_path):
    """A tiny GRPO run (gradient accumulation 2, num_iterations 2): the logged kl is >= 0 at every step and equals
    the float64 exact KL of the step's micro-batches (policy as it was when each loss ran, the reference model)."""
    pytest.importorskip("trl")
    from test_grpo_trainer import TEMPERATURE as GT, V as GV, H as GH, _logs, make_trainer
    from tiny import save_for_reference, tiny_qwen2

    ref_dir = save_for_reference(tiny_qwen2(GV, GH, 1, seed=5), tmp_path / "reference")
    policy = tiny_qwen2(GV, GH, 1, seed=0)
    policy.config._name_or_path = ref_dir  # TRL builds the reference from here: a model other than the policy
    trainer = make_trainer(fastrl.GRPOTrainer, fastrl.GRPOConfig, tmp_path, model=policy, loss_type="grpo", beta=0.1,
                           kl_estimator="exact", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                           num_iterations=2, max_steps=2)
    expected = []
    real = trainer._compute_loss

    def spy(model, inputs):
        with torch.no_grad():
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            K = inputs["completion_ids"].size(1)
            states = []
            for m in (trainer.model, trainer.ref_model):
                m64 = _float64_body(m)
                hidden = m64.model(input_ids=ids, attention_mask=attn).last_hidden_state[:, -K - 1 : -1]
                states += [hidden, m64.lm_head.weight]
            mask = inputs["completion_mask"].bool()
            kl, _ = divergence_reference(*states, beta=1.0, temperature=GT, mask=mask)
            assert inputs["ref_hidden_states"].shape == (ids.size(0), K, GH)
            expected.append((kl.sum() / mask.sum()).item())
        return real(model, inputs)

    trainer._compute_loss = spy
    trainer.train()
    assert trainer._fastrl_last_path == "one_pass"
    logs = _logs(trainer)
    assert len(logs) == 2 and len(expected) == 4  # 2 steps x 2 micro-batches
    for step, log in enumerate(logs):
        want = sum(expected[2 * step : 2 * step + 2]) / 2
        assert log["kl"] >= 0 and want > 0
        assert log["kl"] == pytest.approx(want, rel=1e-4), f"step {step}: logged kl {log['kl']}, float64 {want}"


def test_grpo_reference_hidden_states(tmp_path):
    """What the trainer keeps for the exact KL: the reference body's own hidden states at the positions that predict
    the completion, and its head by reference, copied when it is a ZeRO-3 partitioned weight (no storage outside
    the gather; without DeepSpeed the gather is a no-op and a ``ds_id`` marks the weight)."""
    pytest.importorskip("trl")
    from test_grpo_trainer import C, make_batch, ours

    trainer = ours(tmp_path, beta=0.1, kl_estimator="exact")
    batch = make_batch(trainer)
    states = trainer._reference_hidden_states(batch)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        own = trainer.ref_model.model(input_ids=ids, attention_mask=attn).last_hidden_state[:, -C - 1 : -1]
    assert torch.equal(states, own) and states.is_contiguous()
    weight = trainer.ref_model.lm_head.weight
    assert trainer._fastrl_ref_head[0].data_ptr() == weight.data_ptr()
    weight.ds_id = 0
    try:
        again = trainer._reference_hidden_states(batch)
    finally:
        del weight.ds_id
    assert torch.equal(again, states)
    assert trainer._fastrl_ref_head[0].data_ptr() != weight.data_ptr()
    assert torch.equal(trainer._fastrl_ref_head[0], weight)


@pytest.mark.parametrize("estimator, options", [("k2", {}), ("exact", dict(top_entropy_quantile=0.5))])
def test_grpo_other_estimators_run_on_fastrls_loss(tmp_path, estimator, options):
    """k1/k2/exact reach fastrl's loss (TRL's loss math only knows k3), the entropy-quantile mask included."""
    pytest.importorskip("trl")
    from test_grpo_trainer import _logs, ours
    from fastrl.trainers.grpo_loss import one_pass_config

    trainer = ours(tmp_path, loss_type="bnpo", beta=0.1, kl_estimator=estimator, max_steps=1, **options)
    assert one_pass_config(trainer, 0.0).kl_estimator == estimator
    trainer.train()
    assert trainer._fastrl_last_path == "one_pass"
    assert all(math.isfinite(h["kl"]) for h in _logs(trainer))


def test_grpo_config_kl_estimator_options(tmp_path):
    pytest.importorskip("trl")
    base = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert fastrl.GRPOConfig(**base).kl_estimator == "k3"  # TRL's
    with pytest.raises(ValueError, match="GRPOConfig.kl_estimator"):
        fastrl.GRPOConfig(**base, kl_estimator="k4")
    with pytest.raises(ValueError, match="one_pass_loss"):
        fastrl.GRPOConfig(**base, kl_estimator="exact", beta=0.1, one_pass_loss=False)
    with pytest.raises(ValueError, match="fused_loss"):
        fastrl.GRPOConfig(**base, kl_estimator="k1", beta=0.1, fused_loss=False)
    fastrl.GRPOConfig(**base, kl_estimator="exact", beta=0.0, one_pass_loss=False)  # no KL term: nothing to refuse


def test_grpo_peft_exact_kl_uses_the_adapter_free_head(tmp_path):
    """PEFT without a reference model: the reference is the base model with adapters disabled, the same head."""
    pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    from test_grpo_trainer import V as GV, H as GH, _logs, make_trainer
    from tiny import tiny_qwen2

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = make_trainer(fastrl.GRPOTrainer, fastrl.GRPOConfig, tmp_path, model=tiny_qwen2(GV, GH, 1, seed=3),
                           peft_config=lora, beta=0.1, kl_estimator="exact", max_steps=2, learning_rate=5e-2)
    trainer.train()
    logs = _logs(trainer)
    assert trainer.ref_model is None
    head = trainer.model.get_base_model().lm_head.weight
    assert trainer._fastrl_ref_head[0].data_ptr() == head.data_ptr()  # the policy's own (frozen) head, not a copy
    assert logs[0]["kl"] == 0.0  # LoRA starts as the identity: the policy is the reference
    assert all(math.isfinite(h["kl"]) and h["kl"] >= 0 for h in logs) and logs[-1]["kl"] > 0


def test_ppo_exact_kl_rollout_reward_is_float64_kl(tmp_path):
    pytest.importorskip("trl")
    from test_ppo_trainer import V as PV, H as PH, make_trainer, updates
    from tiny import PAD_ID, tiny_qwen2

    ref = tiny_qwen2(PV, PH, 1, seed=7)
    trainer = make_trainer(tmp_path, ref_model=copy.deepcopy(ref), temperature=0.9, kl_estimator="exact", kl_coef=0.2)
    torch.manual_seed(123)
    batch = trainer._rollout(trainer._queries(0))
    assert "ref_logprobs" not in batch
    qr, ctx = batch["query_responses"], int(batch["context_length"])
    real = ~batch["padding_mask"]
    policy = trainer.accelerator.unwrap_model(trainer.model_wrapped).policy
    attn = qr != PAD_ID
    pos = attn.cumsum(1) - attn.long()
    with torch.no_grad():
        # the models' own (float32) bodies, the KL on their hidden states in float64: the error left is fastrl's
        states = []
        for m in (policy, ref):
            out = m.model(input_ids=qr.masked_fill(~attn, 0), attention_mask=attn, position_ids=pos)
            states += [out.last_hidden_state[:, ctx - 1 : -1].double(), m.lm_head.weight.double()]
        kl, _ = divergence_reference(*states, beta=1.0, temperature=0.9 + 1e-7, mask=real)
        # PyTorch's own error at the inputs' dtype (float32 logits): a small KL between nearby models is a difference
        # of O(1) log-probabilities, so both lose digits to the same cancellation
        kl32, _ = divergence_reference(*[t.float() for t in states], beta=1.0, temperature=0.9 + 1e-7, mask=real)
    assert kl[real].min() > 0

    def err_of(x):
        return ((x.double() - kl).abs().max() / kl.abs().max()).item()

    err, err32 = err_of(batch["kl"]), err_of(kl32)
    assert err <= 2 * err32 + 1e-6, f"rollout KL differs from the float64 exact KL by {err:.2e} (relative); float32 " \
        f"PyTorch {err32:.2e}"
    assert bool((batch["kl"][~real] == 0).all())
    assert torch.equal(batch["non_score_reward"], -0.2 * batch["kl"])
    # a short run: the logged KL (sum over the response, mean over the batch) is never negative
    trainer = make_trainer(tmp_path, kl_estimator="exact")
    trainer.train()
    logs = updates(trainer)
    assert len(logs) == 2 and all(log["objective/kl"] >= 0 and math.isfinite(log["objective/kl"]) for log in logs)
    assert logs[0]["objective/kl"] == 0.0 and logs[1]["objective/kl"] > 0  # the first rollout: policy == reference


def test_ppo_config_kl_estimator():
    pytest.importorskip("trl")
    from fastrl.trainers.ppo_math import kl_rewards

    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="per_token_kl must be"):
        kl_rewards(lp, None, torch.zeros(2), torch.tensor([1, 2]), 0.1, "exact")
    with pytest.raises(ValueError, match="per_token_kl is read only"):
        kl_rewards(lp, lp, torch.zeros(2), torch.tensor([1, 2]), 0.1, "k1", per_token_kl=lp)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_exact_kl_over_a_kept_set_matches_float64(loss_type):
    """Sampling replay and the exact KL together: the policy's log-probs and the KL are both over each token's kept
    set (both models renormalised there), against float64 masked log-softmax and divergence_reference(support=)."""
    from fastrl.reference import masked_logprobs_reference

    x = make_inputs(seed=7)
    g = torch.Generator().manual_seed(11)
    keep = torch.rand(B * T, V, generator=g) < 0.3
    keep[torch.arange(B * T), x["targets"].reshape(-1)] = True  # a sampled token is in its set
    ks = fastrl.KeptSet.from_mask(keep.view(B, T, V))
    config = config_for(loss_type)
    h, w, b = (x[k].detach().double().requires_grad_() for k in ("hidden", "weight", "bias"))
    logp, ent = masked_logprobs_reference(h, w, x["targets"], keep, bias=b, temperature=TEMPERATURE)
    kl, _ = divergence_reference(
        h, w, x["ref_hidden"].double(), x["ref_weight"].double(), beta=1.0, bias=b, teacher_bias=x["ref_bias"].double(),
        temperature=TEMPERATURE, mask=x["mask"], support=ks,
    )
    old = x["old_logprobs"].double()
    loss64, metrics64 = policy_loss_from_logprobs(logp, ent, x["advantages"].double(), x["mask"], config=config,
                                                  old_logprobs=old, per_token_kl=kl)
    grads64 = torch.autograd.grad(loss64, [h, w, b])
    got = fused(x, config, support=ks)
    assert_matches(got, (loss64.detach(), grads64, metrics64, kl.detach()), REL[torch.float32], f"{loss_type} kept set")
    # the support changes the KL: the full-vocabulary KL is a different number
    full = fused(x, config)
    assert abs(full[2]["kl"].item() - got[2]["kl"].item()) > 1e-4
