"""Sampling replay in the trainers (``sampling_replay="kept_set" | "rule"``), on tiny models, float32 on CPU.

Proof: GRPO with top_k=5, top_p=0.9 (transformers generate): every sampled token lies in its recorded kept set, the
recorded sets are the ones transformers' own warpers give on the model's logits at sampling time, and the loss and
every gradient equal a float64 computation (materialised masked log-softmax, ``fastrl.reference``) over those sets,
with the old and reference log-probs over the same sets; the same with ``"rule"`` (sets from ``apply_rule`` on the
float64 logits). PPO with top_k: rollout, reference and update log-probs over the recorded sets against a float64
recomputation of one minibatch. Bad values raise named errors; a misaligned kept set raises before any step.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

import fastrl
from tiny import EOS_ID, PAD_ID, reward_even, run_step, save_for_reference, tiny_qwen2, tiny_tokenizer, toy_prompt_dataset

trl = pytest.importorskip("trl")

from fastrl.losses.config import PolicyLossConfig  # noqa: E402
from fastrl.ops.support import KeptSet, SamplerRule  # noqa: E402
from fastrl.reference import masked_logprobs_reference, policy_loss_from_logprobs, rule_mask_reference  # noqa: E402
from fastrl.trainers.sampling import (  # noqa: E402
    KEPT_KEY,
    kept_sets_from_vllm,
    rule_from_generation_config,
    rule_from_vllm_settings,
    sequence_rows,
    stack_sequences,
)

pytestmark = pytest.mark.usefixtures("one_thread")

V, H, C = 96, 32, 10
TEMPERATURE = 0.9
TOP_K, TOP_P = 5, 0.9
REL = 2e-4  # float32 trainer against float64 ground truth (loss and gradient norms, relative)


def grpo_trainer(tmp_path, peft_config=None, **overrides):
    tok = tiny_tokenizer(V)
    model = tiny_qwen2(V, H, 1, seed=0)
    if peft_config is None:
        save_for_reference(model, tmp_path / "ref")
    kw = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, max_completion_length=C,
        report_to="none", use_cpu=True, save_strategy="no", logging_steps=1, seed=0, temperature=TEMPERATURE,
        learning_rate=1e-3, max_steps=1, disable_tqdm=True, bf16=False, top_k=TOP_K, top_p=TOP_P, beta=0.04,
        loss_type="dapo", num_iterations=2, generation_kwargs={"min_new_tokens": 2},
    )
    kw.update(overrides)
    trainer = fastrl.GRPOTrainer(model=model, reward_funcs=reward_even, args=fastrl.GRPOConfig(**kw),
                                 processing_class=tok, train_dataset=toy_prompt_dataset(tok, n=8, vocab_size=V),
                                 peft_config=peft_config)
    if peft_config is not None:  # the reference is the policy without its adapter
        return trainer
    with torch.no_grad():  # a reference that differs from the policy, so the reference log-probs are checked
        g = torch.Generator().manual_seed(1)
        for p in trainer.ref_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return trainer


def generation_batch(trainer):
    ds = trainer.train_dataset
    return [ds[0], ds[0], ds[1], ds[1]]  # two prompts, two generations each (TRL's sampler repeats prompts)


def completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask):  # [B, C, H]
    """The decoder's last hidden states at the positions that predict the completion tokens."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    am = torch.cat([prompt_mask, completion_mask], 1)
    out = model.model(input_ids=ids, attention_mask=am)
    K = completion_ids.size(1)
    return out.last_hidden_state[:, -K - 1 : -1]


def transformers_kept_mask(logits64, min_new_tokens: int):  # [B, C, V] float64 logits / T -> bool [B, C, V]
    """The support transformers' own processors give (min_new_tokens, then TopK, TopP warpers), float64."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    B, T, _ = logits64.shape
    z = logits64.clone()
    z[:, :min_new_tokens, EOS_ID] = float("-inf")
    flat = z.reshape(B * T, -1)
    flat = TopKLogitsWarper(TOP_K)(None, flat)
    flat = TopPLogitsWarper(TOP_P)(None, flat)
    return torch.isfinite(flat).reshape(B, T, -1)


def float64_step(trainer, out, kept_mask):
    """Loss and gradients of the GRPO step in float64, over ``kept_mask`` [B, C, V], and the float64 reference
    log-probs over the same sets (materialised: fastrl.reference)."""
    policy = copy.deepcopy(trainer.model).double()
    ref = copy.deepcopy(trainer.ref_model).double()
    ids, mask = out["completion_ids"], out["completion_mask"].bool()
    targets = ids.masked_fill(~mask, -100)
    with torch.no_grad():
        h_ref = completion_hidden(ref, out["prompt_ids"], out["prompt_mask"], ids, out["completion_mask"])
        ref_lp, _ = masked_logprobs_reference(h_ref, ref.lm_head.weight, targets, kept_mask, temperature=TEMPERATURE)
    h = completion_hidden(policy, out["prompt_ids"], out["prompt_mask"], ids, out["completion_mask"])
    logp, ent = masked_logprobs_reference(h, policy.lm_head.weight, targets, kept_mask, temperature=TEMPERATURE)
    config = PolicyLossConfig(loss_type="dapo", beta=0.04, temperature=TEMPERATURE, epsilon_low=0.2, epsilon_high=0.2,
                              max_completion_length=C)
    old = out.get("old_per_token_logps")
    loss, _ = policy_loss_from_logprobs(
        logp, ent, out["advantages"].double(), mask, config=config,
        old_logprobs=None if old is None else old.double(), ref_logprobs=out["ref_per_token_logps"].double(),
        num_items_in_batch=out["num_items_in_batch"],
    )
    loss.backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    return loss.item(), grads, ref_lp, logp.detach()


def trainer_step(trainer, out):
    trainer.current_gradient_accumulation_steps = 1  # set by train(); compute_loss outside train() reads it
    return run_step(trainer, out)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def assert_step_matches(got, ref, label):
    (loss, grads, _), (loss64, grads64) = got, ref
    assert abs(loss - loss64) <= REL * max(abs(loss64), 1e-3), f"{label}: loss {loss!r}, float64 {loss64!r}"
    assert set(grads) == set(grads64)
    worst = max(grads, key=lambda n: rel(grads[n], grads64[n]))
    assert rel(grads[worst], grads64[worst]) <= REL, \
        f"{label}: gradient of {worst} differs from float64 by {rel(grads[worst], grads64[worst]):.2e}"


# ---------------------------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["one_pass", "trl"])
def test_grpo_kept_set_matches_float64_over_recorded_sets(tmp_path, path):
    torch.manual_seed(0)
    trainer = grpo_trainer(tmp_path, sampling_replay="kept_set", one_pass_loss=(path == "one_pass"),
                           log_kept_mass=True)
    trainer.model.train()
    out = trainer._generate_and_score_completions(generation_batch(trainer))
    ids, mask = out["completion_ids"], out["completion_mask"].bool()
    B, K = ids.shape
    kept = stack_sequences(out[KEPT_KEY], K)
    assert kept.lead_shape == (B, K) and mask.sum() >= 8
    # every sampled token lies in its recorded set; the sets are transformers' warpers on the model's logits
    assert bool(kept.contains(ids)[mask.reshape(-1)].all())
    recorded = kept.to_mask().reshape(B, K, V)
    with torch.no_grad():
        h = completion_hidden(copy.deepcopy(trainer.model).double(), out["prompt_ids"], out["prompt_mask"], ids,
                              out["completion_mask"])
        z = h @ trainer.model.lm_head.weight.double().T / TEMPERATURE
    expected = transformers_kept_mask(z, 2)
    assert torch.equal(recorded[mask], expected[mask]), "recorded kept sets differ from the warpers' support"
    assert int(recorded[mask].sum(-1).max()) <= TOP_K
    assert not bool(recorded[:, :2, EOS_ID][mask[:, :2]].any()), "min_new_tokens: EOS must be out of the first sets"
    assert out.get("old_per_token_logps") is not None  # num_iterations=2: old log-probs over the support too

    got = trainer_step(trainer, out)
    assert trainer._fastrl_last_path == path
    loss64, grads64, ref64, logp64 = float64_step(trainer, out, recorded)
    err = (out["ref_per_token_logps"].double() - ref64).abs()[mask].max().item()
    assert err < 2e-5, f"reference log-probs over the kept sets: max error {err}"
    err = (out["old_per_token_logps"].double() - logp64).abs()[mask].max().item()
    assert err < 2e-5, f"old log-probs over the kept sets: max error {err}"
    assert_step_matches(got, (loss64, grads64), f"kept_set/{path}")
    metrics = got[2]
    sizes = recorded.sum(-1).double()[mask].mean().item()
    assert metrics["sampling/kept_size_mean"] == pytest.approx(sizes, rel=1e-6)
    assert 0.0 < metrics["sampling/kept_mass_mean"] <= 1.0
    assert "sampling/label_outside_frac" not in metrics


@pytest.mark.parametrize("path", ["one_pass", "trl"])
def test_grpo_rule_matches_float64_over_replayed_sets(tmp_path, path):
    torch.manual_seed(0)
    trainer = grpo_trainer(tmp_path, sampling_replay="rule", one_pass_loss=(path == "one_pass"), log_kept_mass=True)
    assert trainer._fastrl_rule == SamplerRule(top_k=TOP_K, top_p=TOP_P, min_tokens=2, stop_token_ids=(EOS_ID,),
                                               order="transformers")
    trainer.model.train()
    out = trainer._generate_and_score_completions(generation_batch(trainer))
    assert KEPT_KEY not in out
    ids, mask = out["completion_ids"], out["completion_mask"].bool()
    targets = ids.masked_fill(~mask, -100)
    with torch.no_grad():  # each model's rule on its own float64 logits, extended by the target
        sets = {}
        for name, model in (("policy", trainer.model), ("ref", trainer.ref_model)):
            m = copy.deepcopy(model).double()
            h = completion_hidden(m, out["prompt_ids"], out["prompt_mask"], ids, out["completion_mask"])
            kept, outside = rule_mask_reference(h, m.lm_head.weight, targets, trainer._fastrl_rule,
                                                temperature=TEMPERATURE)
            sets[name] = kept.reshape(*ids.shape, V)
            if name == "policy":
                assert not bool(outside.any()), "the policy sampled outside its own rule"
        # the policy moves before it is trained on these completions (a second iteration, an earlier micro-batch):
        # some sampled tokens fall outside its rule now, and their sets are extended by them
        g = torch.Generator().manual_seed(2)
        for p in trainer.model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        m = copy.deepcopy(trainer.model).double()
        h = completion_hidden(m, out["prompt_ids"], out["prompt_mask"], ids, out["completion_mask"])
        kept, outside = rule_mask_reference(h, m.lm_head.weight, targets, trainer._fastrl_rule,
                                            temperature=TEMPERATURE)
        sets["policy"] = kept.reshape(*ids.shape, V)
        outside_frac = outside[mask].double().mean().item()
        assert outside_frac > 0
    got = trainer_step(trainer, out)
    assert trainer._fastrl_last_path == path
    # reference log-probs: over the rule on the reference's own logits
    ref = copy.deepcopy(trainer.ref_model).double()
    with torch.no_grad():
        h = completion_hidden(ref, out["prompt_ids"], out["prompt_mask"], ids, out["completion_mask"])
        ref64, _ = masked_logprobs_reference(h, ref.lm_head.weight, targets, sets["ref"], temperature=TEMPERATURE)
    err = (out["ref_per_token_logps"].double() - ref64).abs()[mask].max().item()
    assert err < 2e-5, f"reference log-probs over the reference's rule: max error {err}"
    loss64, grads64, _, _ = float64_step(trainer, out, sets["policy"])
    assert_step_matches(got, (loss64, grads64), f"rule/{path}")
    assert got[2]["sampling/label_outside_frac"] == pytest.approx(outside_frac, rel=1e-6)
    assert 0.0 < got[2]["sampling/kept_mass_mean"] <= 1.0
    assert got[2]["sampling/kept_size_mean"] == pytest.approx(sets["policy"].sum(-1).double()[mask].mean().item())


def test_grpo_misaligned_kept_sets_raise_before_any_step(tmp_path):
    torch.manual_seed(0)
    trainer = grpo_trainer(tmp_path, sampling_replay="kept_set")
    trainer.model.train()
    out = trainer._generate_and_score_completions(generation_batch(trainer))
    seqs = out[KEPT_KEY]
    trainer.current_gradient_accumulation_steps = 1
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    shifted = dict(out, **{KEPT_KEY: seqs[1:] + seqs[:1]})  # each completion paired with another one's sets
    with pytest.raises(ValueError, match="misaligned|does not contain"):
        trainer.compute_loss(trainer.model, shifted)
    with pytest.raises(ValueError, match="kept sets for"):
        trainer.compute_loss(trainer.model, dict(out, **{KEPT_KEY: seqs[:2]}))
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("peft", [False, True])
def test_grpo_trains_with_replay_accumulation_and_iterations(tmp_path, peft):
    """A real run: generation, shuffle/split into 2 accumulation steps, 2 iterations per generation; with PEFT
    (LoRA; the reference is the policy without its adapter) too."""
    lora = None
    if peft:
        lora = pytest.importorskip("peft").LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0)
    trainer = grpo_trainer(tmp_path, sampling_replay="kept_set", gradient_accumulation_steps=2,
                           per_device_train_batch_size=2, max_steps=2, peft_config=lora)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for log in logs:
        assert 1.0 <= log["sampling/kept_size_mean"] <= TOP_K
    cb = next(c for c in trainer.callback_handler.callbacks if type(c).__name__ == "TrainingHealthCallback")
    assert not [e for e in cb.events if e[1] == "generation_settings"]  # replay on: no sampling warning


# ---------------------------------------------------------------------------------------------------------------
# PPO
# ---------------------------------------------------------------------------------------------------------------


def seq_cls(seed: int):
    from transformers import Qwen2ForSequenceClassification

    config = tiny_qwen2(V, H, 1, seed=seed).config
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForSequenceClassification(config)


def ppo_trainer(tmp_path, **overrides):
    tok = tiny_tokenizer(V)
    ds = toy_prompt_dataset(tok, n=16, vocab_size=V).map(lambda e: {"input_ids": tok(e["prompt"])["input_ids"]},
                                                         remove_columns=["prompt"])
    options = dict(
        output_dir=str(tmp_path / "ppo"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_mini_batches=1, total_episodes=16, response_length=8, num_ppo_epochs=1, stop_token="eos",
        missing_eos_penalty=1.0, report_to="none", num_sample_generations=0, save_strategy="no", disable_tqdm=True,
        local_rollout_forward_batch_size=4, learning_rate=3e-3, seed=0, temperature=TEMPERATURE,
        generation_kwargs={"top_k": TOP_K},
    )
    options.update(overrides)
    return fastrl.PPOTrainer(
        args=fastrl.PPOConfig(**options), processing_class=tok, model=tiny_qwen2(V, H, 1, seed=0),
        ref_model=tiny_qwen2(V, H, 1, seed=7), reward_model=seq_cls(1), train_dataset=ds, value_model=seq_cls(2),
    )


def ppo_float64_logprobs(model, query_responses, ctx, kept_mask):  # [B, R] over kept_mask [B, R, V]
    m = copy.deepcopy(model).double()
    attn = query_responses != PAD_ID
    pos = attn.cumsum(1) - attn.long()
    ids = query_responses.masked_fill(~attn, 0)
    h = m.model(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state[:, ctx - 1 : -1]
    targets = query_responses[:, ctx:]
    return m, h, targets


def test_ppo_kept_set_rollout_reference_and_update_over_recorded_sets(tmp_path):
    from fastrl.trainers.ppo_math import INVALID_LOGPROB

    trainer = ppo_trainer(tmp_path, sampling_replay="kept_set")
    torch.manual_seed(123)
    batch = trainer._rollout(trainer._queries(0))
    qr, ctx = batch["query_responses"], int(batch["context_length"])
    real = ~batch["padding_mask"]
    kept = batch["kept_sets"]
    B, R = real.shape
    assert kept.lead_shape == (B, R) and real.sum() >= 8
    resp = batch["responses"]
    assert bool(kept.contains(resp)[real.reshape(-1)].all()), "a sampled token outside its recorded set"
    mask3 = kept.to_mask().reshape(B, R, V)
    assert int(mask3[real].sum(-1).max()) <= TOP_K
    policy = trainer.accelerator.unwrap_model(trainer.model_wrapped).policy
    targets = resp.masked_fill(~real, -100)
    with torch.no_grad():
        for name, model in (("logprobs", policy), ("ref_logprobs", trainer.ref_model)):
            m, h, _ = ppo_float64_logprobs(model, qr, ctx, mask3)
            lp, _ = masked_logprobs_reference(h, m.lm_head.weight, targets, mask3, temperature=TEMPERATURE + 1e-7)
            err = (batch[name].double() - lp)[real].abs().max().item()
            assert err < 2e-5, f"{name}: max |fused - float64 over the kept sets| = {err}"
            assert bool((batch[name][~real] == INVALID_LOGPROB).all())
        # the recorded sets are top-k of the policy's logits at sampling time
        m, h, _ = ppo_float64_logprobs(policy, qr, ctx, mask3)
        z = h @ m.lm_head.weight.T
        top = torch.zeros_like(mask3).scatter_(-1, z.topk(TOP_K, -1).indices, True)
        assert torch.equal(top[real], mask3[real])
    # misaligned: each response paired with another one's kept sets raises before the optimizer step
    params = [p.detach().clone() for p in trainer.model.parameters()]
    rolled = dict(batch, kept_sets=sequence_rows(kept, torch.tensor([1, 2, 3, 0, 5, 6, 7, 4])))
    with pytest.raises(ValueError, match="misaligned|does not contain"):
        trainer._train_micro_batch(rolled, torch.tensor([0, 1, 2, 3]))
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), params))
    # one micro-batch of the update: the policy loss over the recorded sets against float64
    inds = torch.tensor([2, 0, 3, 1])
    m, h, _ = ppo_float64_logprobs(policy, qr[inds], ctx, mask3[inds])
    mb_real = real[inds]
    logp, ent = masked_logprobs_reference(h, m.lm_head.weight, resp[inds].masked_fill(~mb_real, -100), mask3[inds],
                                          temperature=TEMPERATURE + 1e-7)
    config = PolicyLossConfig.ppo(trainer.args.cliprange)
    pg64, _ = policy_loss_from_logprobs(logp, ent, batch["advantages"][inds].double(), mb_real,
                                        config=config, old_logprobs=batch["logprobs"][inds].double())
    stats = trainer._train_micro_batch(batch, inds)
    assert abs(stats["loss/policy_avg"].item() - pg64.item()) <= 1e-5 * max(abs(pg64.item()), 1e-3)
    assert stats["sampling/kept_size_mean"].item() == pytest.approx(mask3[inds][mb_real].sum(-1).double().mean().item())


def test_ppo_rule_trains_and_logs(tmp_path):
    trainer = ppo_trainer(tmp_path, sampling_replay="rule", log_kept_mass=True, total_episodes=8)
    assert trainer.sampling_rule == SamplerRule(top_k=TOP_K, order="transformers")
    rollouts = []  # (the policy as it sampled, the rollout batch)
    rollout = trainer._rollout

    def recording(queries):
        policy = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model_wrapped).policy)
        batch = rollout(queries)
        rollouts.append((policy, batch))
        return batch

    trainer._rollout = recording
    trainer.train()
    log = [h for h in trainer.state.log_history if "objective/kl" in h][0]
    # objective/kl against float64: the k1 KL summed over each response's real tokens, averaged over responses, with
    # each model's log-probs over the rule replayed on its own float64 logits (extended by the sampled token)
    (policy, batch), = rollouts
    qr, ctx, real = batch["query_responses"], int(batch["context_length"]), ~batch["padding_mask"]
    targets = batch["responses"].masked_fill(~real, -100)
    logps = []
    with torch.no_grad():
        for model in (policy, trainer.ref_model):
            m, h, _ = ppo_float64_logprobs(model, qr, ctx, None)
            kept, _ = rule_mask_reference(h, m.lm_head.weight, targets, trainer.sampling_rule,
                                          temperature=TEMPERATURE + 1e-7, dtype=torch.float64)
            lp, _ = masked_logprobs_reference(h, m.lm_head.weight, targets, kept.reshape(*targets.shape, V),
                                              temperature=TEMPERATURE + 1e-7)
            logps.append(torch.where(real, lp, 0.0))
    kl64 = (logps[0] - logps[1]).sum(1).mean().item()
    assert abs(kl64) > 1e-2  # the reference is another model: a KL that says something
    assert log["objective/kl"] == pytest.approx(kl64, rel=1e-5, abs=1e-6)
    assert 1.0 <= log["sampling/kept_size_mean"] <= TOP_K
    assert 0.0 <= log["sampling/label_outside_frac"] <= 1.0
    assert 0.0 < log["sampling/kept_mass_mean"] <= 1.0


# ---------------------------------------------------------------------------------------------------------------
# Configuration, errors, pieces
# ---------------------------------------------------------------------------------------------------------------


def test_bad_config_values_raise_named_errors(tmp_path):
    cpu = dict(use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match=r"GRPOConfig\.sampling_replay must be one of"):
        fastrl.GRPOConfig(output_dir=str(tmp_path), **cpu, sampling_replay="yes")
    with pytest.raises(ValueError, match=r"GRPOConfig\.log_kept_mass=True needs sampling_replay"):
        fastrl.GRPOConfig(output_dir=str(tmp_path), **cpu, log_kept_mass=True)
    with pytest.raises(ValueError, match=r"GRPOConfig\.sampling_replay='kept_set' needs fused_loss=True"):
        fastrl.GRPOConfig(output_dir=str(tmp_path), **cpu, sampling_replay="kept_set", fused_loss=False)
    with pytest.raises(ValueError, match=r"PPOConfig\.sampling_replay must be one of"):
        fastrl.PPOConfig(output_dir=str(tmp_path), **cpu, sampling_replay=True)
    with pytest.raises(ValueError, match=r"PPOConfig\.log_kept_mass must be a bool"):
        fastrl.PPOConfig(output_dir=str(tmp_path), **cpu, sampling_replay="rule", log_kept_mass="yes")
    from fastrl.trainers.grpo_vllm import check_vllm_replay_launch

    server = types.SimpleNamespace(use_vllm=True, vllm_mode="server")
    with pytest.raises(ValueError, match="vLLM server.*sampling_replay='rule'"):
        check_vllm_replay_launch(server, "kept_set")
    check_vllm_replay_launch(server, "rule")  # the rule needs nothing from the server
    # vLLM returns sampling masks only with top_k > 0 and temperature > 0 (TRL's default top_k is 0)
    colocate = dict(use_vllm=True, vllm_mode="colocate", top_k=0, temperature=1.0, generation_kwargs=None)
    with pytest.raises(ValueError, match=r"needs top_k > 0 and temperature > 0.*got top_k=0"):
        check_vllm_replay_launch(types.SimpleNamespace(**colocate), "kept_set")
    with pytest.raises(ValueError, match=r"got top_k=5, temperature=0\.0"):
        greedy = {"top_k": 5, "temperature": 0.0}
        check_vllm_replay_launch(types.SimpleNamespace(**{**colocate, "generation_kwargs": greedy}), "kept_set")
    check_vllm_replay_launch(types.SimpleNamespace(**{**colocate, "top_k": 5}), "kept_set")
    check_vllm_replay_launch(types.SimpleNamespace(**colocate), "rule")


def test_rule_from_settings():
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=True, top_k=20, top_p=0.8, min_p=0.05, min_new_tokens=3, eos_token_id=[1, 7])
    assert rule_from_generation_config(cfg) == SamplerRule(top_k=20, top_p=0.8, min_p=0.05, min_tokens=3,
                                                           stop_token_ids=(1, 7), order="transformers")
    with pytest.raises(ValueError, match="cannot replay.*bad_words_ids.*kept_set"):
        rule_from_generation_config(GenerationConfig(do_sample=True, bad_words_ids=[[5]]))
    with pytest.raises(ValueError, match="do_sample=False"):
        rule_from_generation_config(GenerationConfig(do_sample=False))
    assert rule_from_vllm_settings(-1, 0.95, None, {"min_tokens": 2}, [1]) == SamplerRule(
        top_p=0.95, min_tokens=2, stop_token_ids=(1,), order="vllm")
    from fastrl.trainers.sampling import truncating_settings, warn_if_untruncated

    assert truncating_settings(cfg) == ["top_k=20", "top_p=0.8", "min_p=0.05", "min_new_tokens=3"]
    full = GenerationConfig(do_sample=True, top_k=0, top_p=1.0)
    assert truncating_settings(full) == []
    with pytest.warns(UserWarning, match="whole vocabulary"):
        warn_if_untruncated(full)


def test_kept_sets_travel_with_their_rows():
    seqs = [KeptSet.from_lists([[1, 2], [3]], V), KeptSet.from_lists([[4], [5, 6], [7]], V), KeptSet.from_lists([], V)]
    k = stack_sequences(seqs, 3)
    assert k.lead_shape == (3, 3)
    assert [r.ids.tolist() for r in (k[i] for i in range(9))] == [[1, 2], [3], [], [4], [5, 6], [7], [], [], []]
    sub = sequence_rows(k, torch.tensor([1, 0]))
    assert sub.lead_shape == (2, 3) and sub.ids.tolist() == [4, 5, 6, 7, 1, 2, 3]
    # TRL's shuffle and split index the per-sequence list together with the tensors
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    torch.manual_seed(0)
    batch = {"x": torch.arange(3), KEPT_KEY: seqs}
    shuffled = shuffle_sequence_dict(batch)
    for x, s in zip(shuffled["x"].tolist(), shuffled[KEPT_KEY]):
        assert s is seqs[x]
    parts = split_tensor_dict({"x": torch.arange(4), KEPT_KEY: seqs + seqs[:1]}, 2)
    assert parts[1][KEPT_KEY] == [seqs[2], seqs[0]]


def test_kept_sets_from_vllm_lists():
    ns = types.SimpleNamespace
    outputs = [ns(outputs=[ns(token_ids=[5, 9], sampling_mask=ns(token_ids=[[5, 3], [9]]))]),
               ns(outputs=[ns(token_ids=[2], sampling_mask=ns(token_ids=[[4, 2, 8]]))])]
    kept = kept_sets_from_vllm(outputs, V)
    assert [k.ids.tolist() for k in kept] == [[3, 5, 9], [2, 4, 8]]
    assert [k.offsets.tolist() for k in kept] == [[0, 2, 3], [0, 3]]
    bad = [ns(outputs=[ns(token_ids=[5], sampling_mask=ns(token_ids=[[3]]))])]
    with pytest.raises(ValueError, match="not in its sampling mask"):
        kept_sets_from_vllm(bad, V)
    with pytest.raises(ValueError, match="return_sampling_mask=True"):
        kept_sets_from_vllm([ns(outputs=[ns(token_ids=[5], sampling_mask=None)])], V)


def test_health_warning_names_replay_and_is_silent_with_it():
    from fastrl.trainers.health import TrainingHealthCallback

    cb = TrainingHealthCallback()
    args = types.SimpleNamespace(top_k=50, top_p=0.9, min_p=None, repetition_penalty=1.0, sampling_replay="off")
    assert cb.check_generation_settings(args) == ["top_k=50", "top_p=0.9"]
    assert "sampling_replay" in cb.events[0][2]
    for mode in ("kept_set", "rule"):
        cb = TrainingHealthCallback()
        assert cb.check_generation_settings(types.SimpleNamespace(**{**vars(args), "sampling_replay": mode})) == []
        assert cb.events == []
