"""fastrl.PPOTrainer on tiny Qwen2 models on CPU: metrics, rollout numbers against materialised logits, the loss
wiring against the reference, no vocabulary-sized logits, k3 KL, checkpoint resume, PEFT, the example script.
"""

from __future__ import annotations

import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import EOS_ID, PAD_ID, tiny_qwen2, tiny_tokenizer, toy_prompt_dataset

pytest.importorskip("trl")

from fastrl import PPOConfig, PPOTrainer  # noqa: E402
from fastrl.losses.config import PolicyLossConfig  # noqa: E402
from fastrl.reference import policy_loss_from_logprobs, value_loss_reference  # noqa: E402
from fastrl.trainers.ppo_math import INVALID_LOGPROB  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
V, H = 128, 32
DOCUMENTED_METRICS = (
    "eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
    "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
    "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr", "episode",
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: one thread (tests/conftest.py)


def seq_cls(seed: int):
    """A tiny Qwen2ForSequenceClassification (one label): reward or value model."""
    from transformers import Qwen2ForSequenceClassification

    config = tiny_qwen2(V, H, 1, seed=seed).config
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
    return model


def prompt_dataset(tok, n: int = 16, seed: int = 0):
    ds = toy_prompt_dataset(tok, n=n, vocab_size=V, seed=seed)
    return ds.map(lambda e: {"input_ids": tok(e["prompt"])["input_ids"]}, remove_columns=["prompt"])


def make_trainer(tmp_path, *, ref_model=None, peft_config=None, callbacks=None, policy=None, **overrides):
    options = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_mini_batches=1, total_episodes=16, response_length=8, num_ppo_epochs=2, stop_token="eos",
        missing_eos_penalty=1.0, report_to="none", num_sample_generations=0, save_strategy="no", disable_tqdm=True,
        local_rollout_forward_batch_size=4, learning_rate=3e-3, seed=0,
    )
    options.update(overrides)
    args = PPOConfig(**options)
    tok = tiny_tokenizer(V)
    return PPOTrainer(
        args=args, processing_class=tok, model=policy if policy is not None else tiny_qwen2(V, H, 1, seed=0),
        ref_model=ref_model, reward_model=seq_cls(1), train_dataset=prompt_dataset(tok), value_model=seq_cls(2),
        eval_dataset=prompt_dataset(tok, n=6, seed=1), callbacks=callbacks, peft_config=peft_config,
    )


def updates(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "objective/kl" in h]


def materialised_logprobs(causal_lm, query_responses, context_length, temperature):  # [B, R]
    """TRL's way: full logits of the sequence, divided by temperature + 1e-7, log-softmax, gather."""
    attn = query_responses != PAD_ID
    pos = attn.cumsum(1) - attn.long()
    ids = query_responses.masked_fill(~attn, 0)
    logits = causal_lm(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, context_length - 1 : -1]
    logits = logits.float() / (temperature + 1e-7)
    return torch.log_softmax(logits, -1).gather(-1, query_responses[:, context_length:, None]).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------------


def test_updates_log_every_documented_metric_finite(tmp_path, capsys):
    from fastrl.trainers.health import TrainingHealthCallback

    trainer = make_trainer(tmp_path, num_sample_generations=1)
    assert any(isinstance(cb, TrainingHealthCallback) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    logs = updates(trainer)
    assert len(logs) == 2 and trainer.state.global_step == 2
    for log in logs:
        missing = [k for k in DOCUMENTED_METRICS if k not in log]
        assert not missing, f"metrics missing from the log: {missing}"
        bad = {k: log[k] for k in DOCUMENTED_METRICS if not math.isfinite(log[k])}
        assert not bad, f"non-finite metrics: {bad}"
        assert abs(log["val/ratio"] - 1) < 0.2 and log["val/ratio_var"] >= 0
        assert 0 <= log["policy/clipfrac_avg"] <= 1 and 0 <= log["val/clipfrac_avg"] <= 1
        assert log["loss/value_avg"] >= 0 and log["policy/entropy_avg"] > 0 and log["objective/entropy"] > 0
        assert log["objective/rlhf_reward"] == pytest.approx(log["objective/scores"] + log["objective/non_score_reward"], abs=1e-5)
    assert [log["episode"] for log in logs] == [8, 16]
    assert logs[0]["lr"] > logs[1]["lr"] > 0  # linear decay, one scheduler step per update
    assert logs[0]["objective/kl"] == 0.0  # first rollout: policy == reference
    # the sample-completions table (num_sample_generations=1: after the first update)
    table = trainer.last_completions
    assert list(table.columns) == ["query", "model response", "score"] and len(table) == 6  # one eval batch
    assert "model response" in capsys.readouterr().out


def test_rollout_matches_materialised_reference(tmp_path):
    ref = tiny_qwen2(V, H, 1, seed=7)  # a reference that differs from the policy
    trainer = make_trainer(tmp_path, ref_model=tiny_qwen2(V, H, 1, seed=7), temperature=0.9)
    torch.manual_seed(123)
    batch = trainer._rollout(trainer._queries(0))
    qr, ctx = batch["query_responses"], int(batch["context_length"])
    real, real_p1 = ~batch["padding_mask"], ~batch["padding_mask_p1"]
    assert real.any(1).sum() >= 3, "degenerate rollout: most responses start with a pad"
    policy = trainer.accelerator.unwrap_model(trainer.model_wrapped).policy
    with torch.no_grad():
        for name, model in (("logprobs", policy), ("ref_logprobs", ref)):
            expected = materialised_logprobs(model, qr, ctx, 0.9)
            err = (batch[name] - expected).abs()[real].max().item()
            assert err < 2e-5, f"{name}: max |fused - materialised| = {err}"
            assert bool((batch[name][~real] == INVALID_LOGPROB).all())
        # values: the value model's score head on its backbone, read where TRL reads them
        attn = qr != PAD_ID
        pos = attn.cumsum(1) - attn.long()
        vm = trainer.value_model
        hidden = vm.base_model(input_ids=qr.masked_fill(~attn, 0), attention_mask=attn, position_ids=pos).last_hidden_state
        values = vm.score(hidden).squeeze(-1)[:, ctx - 1 : -1]
        assert (batch["values"] - values).abs()[real_p1].max().item() < 1e-5
        assert bool((batch["values"][~real_p1] == 0).all())
        # scores: the reward model's score head at the last real token of the truncated response, EOS trick
        post = batch["postprocessed_responses"]
        full = torch.cat([qr[:, :ctx], post], 1)
        attn = full != PAD_ID
        pos = attn.cumsum(1) - attn.long()
        rm = trainer.reward_model
        head = rm.score(rm.base_model(input_ids=full.masked_fill(~attn, 0), attention_mask=attn, position_ids=pos).last_hidden_state)
        for i in range(full.shape[0]):
            row = post[i].tolist()
            last = (row.index(PAD_ID) if PAD_ID in row else len(row)) - 1 + ctx
            expected = head[i, last, 0].item() - (0.0 if EOS_ID in row else 1.0)
            assert batch["scores"][i].item() == pytest.approx(expected, abs=1e-5)
    # whitened advantages: zero on padding, mean 0 / variance 1 over the real tokens
    adv = batch["advantages"]
    assert bool((adv[~real] == 0).all())
    assert adv[real].mean().item() == pytest.approx(0.0, abs=1e-5)
    assert adv[real].var().item() == pytest.approx(1.0, abs=1e-3)


def test_training_loss_and_gradients_match_reference(tmp_path):
    """One micro-batch through the trainer (fused, inside the wrapper's forward) against the reference loss on
    materialised logits: same loss, same gradients for every policy and value parameter."""
    trainer = make_trainer(tmp_path, cliprange=0.1, cliprange_value=0.05, vf_coef=0.3)
    torch.manual_seed(5)
    batch = trainer._rollout(trainer._queries(0))
    real = ~batch["padding_mask"]
    g = torch.Generator().manual_seed(0)
    # old log-probs off by up to +-0.3 and old values by +-0.2: both clippings are active on some tokens
    batch["logprobs"] = torch.where(real, batch["logprobs"] + (torch.rand(real.shape, generator=g) - 0.5) * 0.6, batch["logprobs"])
    batch["values"] = torch.where(~batch["padding_mask_p1"], batch["values"] + (torch.rand(real.shape, generator=g) - 0.5) * 0.4, batch["values"])
    inds = torch.arange(4)
    wrapper = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    params = {n: p for n, p in wrapper.named_parameters() if p.requires_grad}

    trainer.optimizer.step = lambda *a, **k: None  # keep the gradients of this one micro-batch
    trainer.optimizer.zero_grad = lambda *a, **k: None
    for p in params.values():
        p.grad = None
    with trainer.accelerator.accumulate(trainer.model_wrapped):
        metrics = trainer._train_micro_batch(batch, inds)
    got = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}

    for p in params.values():
        p.grad = None
    args, ctx = trainer.args, int(batch["context_length"])
    qr = batch["query_responses"][inds]
    new_logprobs = materialised_logprobs(wrapper.policy, qr, ctx, args.temperature)
    mask = real[inds]
    pg, pg_m = policy_loss_from_logprobs(
        new_logprobs, None, batch["advantages"][inds], mask, config=PolicyLossConfig.ppo(args.cliprange),
        old_logprobs=batch["logprobs"][inds],
    )
    attn = qr != PAD_ID
    pos = attn.cumsum(1) - attn.long()
    hidden = wrapper.value_model.base_model(input_ids=qr.masked_fill(~attn, 0), attention_mask=attn, position_ids=pos).last_hidden_state
    vpred = wrapper.value_model.score(hidden).squeeze(-1)[:, ctx - 1 : -1]
    vf, vf_m = value_loss_reference(vpred, batch["values"][inds], batch["returns"][inds], ~batch["padding_mask_p1"][inds],
                                    args.cliprange_value)
    (pg + args.vf_coef * vf).div(args.gradient_accumulation_steps).backward()  # accelerate divides by the GA steps
    assert pg_m["policy/clipfrac_avg"] > 0 and vf_m["val/clipfrac_avg"] > 0, "test case does not clip"
    assert metrics["loss/policy_avg"].item() == pytest.approx(pg.item(), abs=1e-5)
    assert metrics["loss/value_avg"].item() == pytest.approx(vf.item(), abs=1e-5)
    for key in ("policy/clipfrac_avg", "val/ratio", "policy/approxkl_avg"):
        assert metrics[key].item() == pytest.approx(pg_m[key].item(), abs=1e-5), key
    assert metrics["val/clipfrac_avg"].item() == pytest.approx(vf_m["val/clipfrac_avg"].item(), abs=1e-6)
    assert set(got) == {n for n, p in params.items() if p.grad is not None}
    for n, p in params.items():
        if p.grad is None:
            continue
        scale = p.grad.abs().max().item()
        err = (got[n] - p.grad).abs().max().item()
        assert err <= 1e-4 * max(scale, 1e-3), f"{n}: max |grad - reference| = {err} (reference max {scale})"


def test_no_vocabulary_sized_logits_during_training(tmp_path):
    trainer = make_trainer(tmp_path, total_episodes=8)
    shapes = []
    heads = [trainer.accelerator.unwrap_model(trainer.model_wrapped).policy.lm_head, trainer.ref_model.lm_head]
    hooks = [h.register_forward_hook(lambda m, inp, out: shapes.append(tuple(out.shape))) for h in heads]
    try:
        trainer.train()
    finally:
        for h in hooks:
            h.remove()
    # the only LM-head calls are generate()'s, one position per sequence and step
    assert shapes, "generation should call the LM head"
    big = [s for s in shapes if len(s) != 3 or s[1] != 1]
    assert not big, f"LM head materialised logits of shape {big[0]} outside generation"


def test_k3_kl_never_negative(tmp_path):
    trainer = make_trainer(tmp_path, kl_estimator="k3", learning_rate=2e-2, total_episodes=24, num_ppo_epochs=3)
    trainer.train()
    kls = [log["objective/kl"] for log in updates(trainer)]
    assert kls[0] == 0.0 and kls[-1] > 0, f"the policy should have moved away from the reference: {kls}"
    assert min(kls) >= 0, kls
    torch.manual_seed(0)
    batch = trainer._rollout(trainer._queries(0))
    assert bool((batch["kl"] >= 0).all()), batch["kl"].min()
    assert bool((batch["non_score_reward"] <= 0).all())


def test_minibatches_reward_whitening_and_non_eos_penalty(tmp_path):
    trainer = make_trainer(
        tmp_path, num_mini_batches=2, whiten_rewards=True, stop_token=None, missing_eos_penalty=None,
        non_eos_penalty=True, penalty_reward_value=-2.0,
    )
    args = trainer.args
    # TRL's sizes: 4 per device x 2 accumulation x 2 minibatches; one optimizer step per minibatch
    assert (args.local_batch_size, args.local_mini_batch_size, args.batch_size, args.num_total_batches) == (16, 8, 16, 1)
    steps = []
    step = trainer.optimizer.optimizer.step
    trainer.optimizer.optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]
    trainer.train()
    assert len(steps) == args.num_ppo_epochs * args.num_mini_batches
    log = updates(trainer)[0]
    assert all(math.isfinite(log[k]) for k in DOCUMENTED_METRICS)
    torch.manual_seed(3)
    batch = trainer._rollout(trainer._queries(0))
    # no stop token: nothing is truncated; responses without EOS get exactly penalty_reward_value
    assert torch.equal(batch["postprocessed_responses"], batch["responses"])
    no_eos = ~(batch["responses"] == EOS_ID).any(1)
    assert no_eos.any() and bool((batch["scores"][no_eos] == -2.0).all())


def test_bf16_autocast_policy_and_reference_agree(tmp_path):
    trainer = make_trainer(tmp_path, bf16=True, use_cpu=True, total_episodes=8)
    trainer.train()
    log = updates(trainer)[0]
    # the reference is computed under the same autocast as the policy: identical models, KL exactly 0
    assert log["objective/kl"] == 0.0
    assert all(math.isfinite(log[k]) for k in DOCUMENTED_METRICS)


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model_wrapped).named_parameters()}


def test_resume_from_checkpoint_continues_the_same_run(tmp_path):
    kw = dict(total_episodes=24, save_strategy="steps", save_steps=1)
    full = make_trainer(tmp_path / "a", **kw)
    full.train()
    ckpt = tmp_path / "a" / "out" / "checkpoint-1"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "value_model" / "model.safetensors").is_file()
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "rng_state.pth").is_file()

    resumed = make_trainer(tmp_path / "b", **kw)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 3 and resumed.state.episode == full.state.episode == 24
    a, b = updates(full), updates(resumed)
    assert len(b) == 3  # the checkpoint's log history plus the two updates run after resuming
    for la, lb in zip(a[1:], b[1:]):
        for k in DOCUMENTED_METRICS:
            if k != "eps":
                assert la[k] == pytest.approx(lb[k], rel=1e-6, abs=1e-7), f"step {la['step']}: {k} {la[k]} vs {lb[k]}"
    wa, wb = _weights(full), _weights(resumed)
    for n in wa:
        assert torch.equal(wa[n], wb[n]), f"{n} differs after resuming"
    sa, sb = full.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)


def test_peft_policy_uses_the_adapter_free_reference(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(tmp_path, peft_config=config, total_episodes=8, learning_rate=5e-2)
    assert trainer.ref_model is None and trainer.is_peft_model
    policy = trainer.accelerator.unwrap_model(trainer.model_wrapped).policy
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trainer.train()
    log = updates(trainer)[0]
    assert log["objective/kl"] == 0.0  # LoRA starts as the identity: policy == adapter-free reference
    assert all(math.isfinite(log[k]) for k in DOCUMENTED_METRICS)
    changed = {n for n, p in policy.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed), sorted(changed)[:4]
    with torch.no_grad():  # after the update the reference context really turns the adapter off
        batch = trainer._rollout(trainer._queries(1))
    assert batch["kl"].abs().sum() > 0
    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_sampling_settings_that_bias_the_kl_warn(tmp_path):
    with pytest.warns(UserWarning, match=r"top_k=10.*min_new_tokens=2|min_new_tokens=2.*top_k=10") as record:
        make_trainer(tmp_path, generation_kwargs={"top_k": 10, "min_new_tokens": 2}, health_checks=False)
    biased = [w for w in record if "PPO rollout generation settings" in str(w.message)]
    assert [w.filename for w in biased] == [__file__]  # the warning points at the line that built the trainer


def test_health_callback_can_be_turned_off(tmp_path):
    from fastrl.trainers.health import TrainingHealthCallback

    trainer = make_trainer(tmp_path, health_checks=False)
    assert not any(isinstance(cb, TrainingHealthCallback) for cb in trainer.callback_handler.callbacks)


def test_model_as_its_own_reference_is_refused(tmp_path):
    policy = tiny_qwen2(V, H, 1, seed=0)
    with pytest.raises(ValueError, match="cannot be the same"):
        make_trainer(tmp_path, policy=policy, ref_model=policy)


def test_example_script_runs(tmp_path):
    """``examples/ppo.py`` with the documentation's flags, on models from ``examples/make_tiny_ppo_models.py``."""
    models = tmp_path / "tiny"
    argv = sys.argv
    try:
        sys.argv = ["make_tiny_ppo_models.py", "--output_dir", str(models), "--num_prompts", "24"]
        runpy.run_path(str(ROOT / "examples" / "make_tiny_ppo_models.py"), run_name="__main__")
    finally:
        sys.argv = argv
    out = tmp_path / "run"
    cmd = [
        sys.executable, str(ROOT / "examples" / "ppo.py"),
        "--dataset_name", str(models / "dataset"), "--dataset_train_split", "descriptiveness",
        "--learning_rate", "3e-6", "--output_dir", str(out), "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "1", "--total_episodes", "8",
        "--model_name_or_path", str(models / "policy"), "--sft_model_path", str(models / "policy"),
        "--reward_model_path", str(models / "reward"), "--missing_eos_penalty", "1.0",
        "--response_length", "8", "--num_ppo_epochs", "1", "--local_rollout_forward_batch_size", "4",
        "--stop_token", "eos", "--kl_estimator", "k3", "--report_to", "none", "--disable_tqdm", "true",
        "--num_sample_generations", "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert "objective/scores" in proc.stdout + proc.stderr
    assert "model response" in proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# DDP: two gloo processes on CPU
# ---------------------------------------------------------------------------------------------------------------


def _ddp_worker(out_dir: str) -> None:
    import json
    import tempfile

    import torch.distributed as dist

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    kw = dict(total_episodes=32, save_strategy="steps", save_steps=1, output_dir=str(Path(out_dir) / "run"))
    trainer = make_trainer(tmp, **kw)
    acc = trainer.accelerator
    assert acc.num_processes == 2, acc.num_processes
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel), type(trainer.model_wrapped)
    queries = trainer._queries(0)
    trainer.train()

    def flat(t):
        return torch.cat([p.detach().reshape(-1) for p in t.accelerator.unwrap_model(t.model_wrapped).parameters()])

    params = flat(trainer)
    rank0 = params.clone()
    dist.broadcast(rank0, src=0)
    acc.wait_for_everyone()
    # resume from the first checkpoint: both ranks reload their own RNG state and continue the same run
    resumed = make_trainer(tmp / "resumed", **{**kw, "output_dir": str(tmp / "resumed_out")})
    resumed.train(resume_from_checkpoint=str(Path(out_dir) / "run" / "checkpoint-1"))
    result = {
        "rank": acc.process_index,
        "queries": queries.tolist(),
        "param_max_diff_vs_rank0": (params - rank0).abs().max().item(),
        "resumed_max_diff": (flat(resumed) - params).abs().max().item(),
        "logs": updates(trainer),
        "resumed_logs": updates(resumed),
    }
    with open(os.path.join(out_dir, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(result, f)
    from tiny import end_worker

    end_worker()


@pytest.mark.distributed
def test_ddp_two_processes_shard_prompts_and_stay_in_sync(tmp_path):
    import json

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "ACCELERATE_USE_CPU": "true"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(29700 + os.getpid() % 1000), str(Path(__file__).resolve()), "--ppo-ddp-worker", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(ROOT / "tests"))
    assert proc.returncode == 0, f"DDP workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    q0, q1 = ({tuple(row) for row in r["queries"]} for r in (r0, r1))
    assert not q0 & q1, "both processes drew the same prompts"
    for r in (r0, r1):
        assert r["param_max_diff_vs_rank0"] == 0.0, "the processes' weights diverged"
        assert r["resumed_max_diff"] == 0.0, f"rank {r['rank']}: resuming under DDP did not reproduce the run"
        assert [log["episode"] for log in r["logs"]] == [16, 32]  # batch_size = 2 processes x 8 prompts
        for log in r["logs"]:
            assert all(math.isfinite(log[k]) for k in DOCUMENTED_METRICS)
    for k in DOCUMENTED_METRICS:  # metrics are gathered: every process logs the same numbers
        if k != "eps":
            assert r0["logs"][-1][k] == pytest.approx(r1["logs"][-1][k], rel=1e-6), k
            assert r0["logs"][-1][k] == pytest.approx(r0["resumed_logs"][-1][k], rel=1e-6, abs=1e-7), k


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--ppo-ddp-worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _ddp_worker(sys.argv[2])
