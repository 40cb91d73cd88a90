"""Reliability of the trainers on bad input (issue 11): config values checked when the config is made, PPO resume
of the README example's GPT-NeoX models with nothing loaded from a checkpoint that does not fit, and no optimizer
step on a NaN reward or loss.

Each test here failed before its fix: PPOConfig took lam=2 and gamma=1.5 and gave a bare JSONDecodeError; bad
GRPOConfig values passed until the first training step; resuming the README example died on ``embed_out.weight``
after overwriting part of the trainer; a NaN reward stepped the optimizer and was blamed on the hidden states.
"""

from __future__ import annotations

import math
import runpy
import shutil
from pathlib import Path

import pytest
import torch

from tiny import tiny_qwen2, tiny_tokenizer

pytest.importorskip("trl")

import fastrl  # noqa: E402
from fastrl import GRPOConfig, PPOConfig, PPOTrainer  # noqa: E402
from fastrl.trainers import ppo_update  # noqa: E402
from fastrl.trainers.health import TrainingHealthCallback  # noqa: E402
from test_ppo_trainer import V, make_trainer, prompt_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------- items 8 and 12: configs checked when made

@pytest.mark.parametrize("kw, match", [
    (dict(lam=2.0), r"lam must be in \[0, 1\], got 2.0"),
    (dict(gamma=1.5), r"gamma must be in \[0, 1\], got 1.5"),
    (dict(gamma=-0.1), "gamma must be a finite number >= 0"),
    (dict(generation_kwargs="not json"), "generation_kwargs must be a JSON object.*'not json'"),
])
def test_ppo_config_rejects_bad_values(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(output_dir=str(tmp_path), **kw)
    PPOConfig(output_dir=str(tmp_path), gamma=1.0, lam=0.0, generation_kwargs='{"top_k": 0}')  # the edges are fine


GRPO_BAD = [
    (dict(loss_type="ppo2"), "GRPOConfig.loss_type must be one of"),
    (dict(epsilon=-0.1), r"GRPOConfig.epsilon must be a number in \[0, 1\), got -0.1"),
    (dict(epsilon_high=-1.0), "GRPOConfig.epsilon_high must be"),
    (dict(beta=-1.0), "GRPOConfig.beta must be a finite number >= 0"),
    (dict(delta=0.0), "GRPOConfig.delta must be None or a finite number > 1"),
    (dict(loss_type="cispo", delta=-1.0), "GRPOConfig.delta must be None or a finite number > 1"),
    (dict(top_entropy_quantile=2.0), r"GRPOConfig.top_entropy_quantile must be a number in \[0, 1\]"),
    (dict(importance_sampling_level="batch"), "GRPOConfig.importance_sampling_level must be one of"),
    (dict(temperature=0.0), "GRPOConfig.temperature must be a finite number > 0"),
]


@pytest.mark.parametrize("kw, match", GRPO_BAD, ids=[next(iter(kw)) + "=" + str(next(iter(kw.values())))
                                                      for kw, _ in GRPO_BAD])
def test_grpo_config_rejects_bad_loss_options(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(output_dir=str(tmp_path), bf16=False, **kw)


def test_grpo_trainer_checks_a_stock_trl_config_before_generating(tmp_path):
    import trl

    args = trl.GRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none",
                          per_device_train_batch_size=4, num_generations=4, loss_type="ppo2")
    tok = tiny_tokenizer(V)
    with pytest.raises(ValueError, match="GRPOConfig.loss_type must be one of"):
        fastrl.GRPOTrainer(model=tiny_qwen2(V, 32, 1), reward_funcs=lambda completions, **k: [0.0] * len(completions),
                           args=args, processing_class=tok, train_dataset=prompt_dataset(tok, n=8))


# ---------------------------------------------------------------- item 10: resume of the README's PPO example

def _neox_trainer(tmp_path, **overrides):
    """A PPOTrainer on the architectures examples/make_tiny_ppo_models.py makes (GPT-NeoX policy, reward, value)."""
    from transformers import GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    build_config = runpy.run_path(str(ROOT / "examples" / "make_tiny_ppo_models.py"))["build_config"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = GPTNeoXForCausalLM(build_config(V, 32, 1))
        reward = GPTNeoXForSequenceClassification(build_config(V, 32, 1, num_labels=1))
        value = GPTNeoXForSequenceClassification(build_config(V, 32, 1, num_labels=1))
    options = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
        total_episodes=4, response_length=6, num_ppo_epochs=1, stop_token="eos", missing_eos_penalty=1.0,
        report_to="none", num_sample_generations=0, save_strategy="no", disable_tqdm=True,
        local_rollout_forward_batch_size=4, learning_rate=3e-3, seed=0,
    )
    options.update(overrides)
    tok = tiny_tokenizer(V)
    return PPOTrainer(args=PPOConfig(**options), processing_class=tok, model=policy, ref_model=None,
                      reward_model=reward, train_dataset=prompt_dataset(tok, n=8), value_model=value)


def _trainer_tensors(trainer) -> dict[str, torch.Tensor]:
    """Every weight of the policy and value model, and the optimizer's state tensors."""
    out = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model_wrapped).named_parameters()}
    for i, st in trainer.optimizer.state_dict()["state"].items():
        out.update({f"optimizer.{i}.{k}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def test_ppo_resume_of_the_readme_example_models(tmp_path):
    import safetensors.torch

    a = _neox_trainer(tmp_path / "a", save_strategy="steps", save_steps=1)
    a.train()
    ckpt = tmp_path / "a" / "out" / "checkpoint-1"
    # GPT-NeoX's head is saved as embed_out (transformers >= 5 calls it lm_head in the model, its original name on disk)
    saved = safetensors.torch.load_file(str(ckpt / "model.safetensors"))
    assert "embed_out.weight" in saved

    # a checkpoint that does not fit (the value model lost its score head): nothing is loaded
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    value_file = bad / "value_model" / "model.safetensors"
    value_sd = safetensors.torch.load_file(str(value_file))
    value_sd.pop("score.weight")
    safetensors.torch.save_file(value_sd, str(value_file), metadata={"format": "pt"})
    b = _neox_trainer(tmp_path / "b")
    for p in b.model.parameters():  # optimizer state that a half-loaded resume would overwrite
        p.grad = torch.full_like(p, 1e-3)
    b.optimizer.step()
    b.optimizer.zero_grad()
    before = _trainer_tensors(b)
    with pytest.raises(ValueError, match=r"does not match GPTNeoXForSequenceClassification.*score\.weight"):
        b.train(resume_from_checkpoint=str(bad))
    after = _trainer_tensors(b)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert not changed, f"a failed resume changed {len(changed)}/{len(before)} tensors, e.g. {changed[:3]}"
    assert b.state.global_step == 0

    # the good checkpoint loads every weight and the optimizer state
    b.train(resume_from_checkpoint=str(ckpt))
    assert b.state.global_step == 1
    wa, wb = _trainer_tensors(a), _trainer_tensors(b)
    assert set(wa) == set(wb)
    for n in wa:
        assert torch.equal(wa[n], wb[n]), f"{n} differs after resuming"


# ---------------------------------------------------------------- item 11: no optimizer step on non-finite values

def _count_steps(trainer) -> list:
    steps = []
    inner = trainer.optimizer.optimizer
    step = inner.step
    inner.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]
    return steps


def test_nan_reward_stops_before_any_optimizer_step(tmp_path):
    health = TrainingHealthCallback()
    trainer = make_trainer(tmp_path, num_ppo_epochs=2, total_episodes=8, callbacks=[health])
    with torch.no_grad():
        trainer.reward_model.score.weight.fill_(float("nan"))
    steps = _count_steps(trainer)
    before = _trainer_tensors(trainer)
    with pytest.raises(FloatingPointError, match=r"the reward .*\(scores\) is not finite in the rollout of update 1"
                                                 r".*No optimizer step"):
        trainer.train()
    assert not steps
    after = _trainer_tensors(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before), "weights changed after a NaN reward"
    fired = [(name, msg) for _, name, msg in health.events]
    assert any(name == "reward_nan" and "objective/scores" in msg and "reward" in msg for name, msg in fired), fired


def test_nan_reference_exact_kl_stops_before_any_optimizer_step(tmp_path):
    """kl_estimator="exact" with a reference whose head holds a NaN: the rollout's exact KL is not finite, and the
    rollout check names it (on every process at once) before any optimizer step."""
    trainer = make_trainer(tmp_path, total_episodes=8, kl_estimator="exact", ref_model=tiny_qwen2(V, 32, 1, seed=7))
    with torch.no_grad():
        trainer.ref_model.lm_head.weight[3, 1] = float("nan")
    steps = _count_steps(trainer)
    before = _trainer_tensors(trainer)
    with pytest.raises(FloatingPointError, match=r"the exact KL to the reference policy \(kl\) is not finite in the "
                                                 r"rollout of update 1: \d+ non-finite, the first nan at kl\[.*No optimizer"):
        trainer.train()
    assert not steps
    after = _trainer_tensors(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_non_finite_loss_never_reaches_the_optimizer(tmp_path, monkeypatch):
    """A loss that turns non-finite during the PPO epochs (here: the value loss) stops training before the step."""
    trainer = make_trainer(tmp_path, total_episodes=8)
    real = ppo_update.value_loss

    def nan_value_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * math.nan, metrics

    monkeypatch.setattr(ppo_update, "value_loss", nan_value_loss)
    steps = _count_steps(trainer)
    before = _trainer_tensors(trainer)
    with pytest.raises(FloatingPointError, match=r"PPO loss is non-finite \(policy .*, value nan"):
        trainer.train()
    assert not steps
    after = _trainer_tensors(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)
