"""fastrl.patch_trainer on already constructed TRL trainers: the same numbers as stock TRL, fastrl underneath."""

from __future__ import annotations

import math

import pytest
import torch

import fastrl
from test_grpo_trainer import (
    DEFAULTS, C, V, H, assert_same_step, make_batch, run_step, set_loss_options, stock,
)
from tiny import save_for_reference, tiny_qwen2, tiny_tokenizer, toy_prompt_dataset

trl = pytest.importorskip("trl")


def test_patch_grpo_trainer_matches_stock(tmp_path):
    st, patched = stock(tmp_path, beta=0.04), stock(tmp_path, beta=0.04)
    assert fastrl.patch_trainer(patched) is patched
    fastrl.patch_trainer(patched)  # twice is harmless
    assert patched.model._fastrl_head_settings is not None and patched.ref_model._fastrl_head_settings is not None
    batch = make_batch(st, seed=5)
    for loss_type, level, path in (("dapo", "token", "one_pass"), ("grpo", "sequence", "one_pass"),
                                   ("bnpo", "token", "trl")):
        opts = {**DEFAULTS, "loss_type": loss_type, "importance_sampling_level": level, "beta": 0.04}
        if path == "trl":
            opts["top_entropy_quantile"] = 0.5
        for t in (st, patched):
            set_loss_options(t, **opts)
        assert_same_step(run_step(st, batch), run_step(patched, batch), label=f"patched {loss_type} {level}")
        assert patched._fastrl_last_path == path


def test_patched_grpo_trainer_trains(tmp_path):
    trainer = fastrl.patch_trainer(stock(tmp_path, loss_type="grpo", max_steps=2), health_checks=True)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert trainer._fastrl_last_path == "one_pass"
    assert any(type(cb).__name__ == "TrainingHealthCallback" for cb in trainer.callback_handler.callbacks)


def test_patch_rloo_trainer(tmp_path):
    from test_grpo_trainer import reward_even

    def make():
        tok = tiny_tokenizer(V)
        args = trl.RLOOConfig(output_dir=str(tmp_path / "rloo"), per_device_train_batch_size=4, num_generations=4,
                              max_completion_length=C, report_to="none", use_cpu=True, bf16=False,
                              save_strategy="no", logging_steps=1, seed=0, max_steps=2, disable_tqdm=True)
        model = tiny_qwen2(V, H, 1, seed=0)
        save_for_reference(model, tmp_path / "rloo-ref")  # RLOO's default beta builds a reference model
        return trl.RLOOTrainer(model=model, reward_funcs=reward_even, args=args,
                               processing_class=tok, train_dataset=toy_prompt_dataset(tok, n=8))

    st, patched = make(), fastrl.patch_trainer(make())
    batch = make_batch(st, seed=6)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    a = st._get_per_token_logps_and_entropies(st.model, ids, am, C, compute_entropy=True)
    b = patched._get_per_token_logps_and_entropies(patched.model, ids, am, C, compute_entropy=True)
    torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-6)
    patched.train()
    logs = [h for h in patched.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)


def test_patch_rejects_other_objects():
    with pytest.raises(TypeError, match="GRPOTrainer"):
        fastrl.patch_trainer(object())
