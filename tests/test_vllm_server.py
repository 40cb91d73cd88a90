"""``fastrl.GRPOTrainer(use_vllm=True, vllm_mode="server")`` with ``sampling_replay="rule"``, against a real
``trl vllm-serve`` (vLLM's CPU build) started by the test on 127.0.0.1 at a free port and always stopped by its PID.

Where these run: the vLLM environment (tests/vllm_harness.py). What a CPU cannot do: TRL pushes weights to the server
over NCCL (``VLLMClient.init_communicator`` / ``update_named_params``), which needs CUDA; here both are replaced by
no-ops that record what would have been sent, so the server keeps its initial weights. At step 1 these are the
trainer's weights, so the replay is still exact; the real weight sync runs on the GPU window.

Checked: one training step runs; the rule replayed on the trainer's logits holds every token the server sampled
(``sampling/label_outside_frac`` 0); the logged loss, kl and kept-set size equal a float64 recomputation over the
rule's sets (``fastrl.reference.rule_mask_reference`` on float64 logits); the server's log-probs equal the trainer's
over those sets (the gap metric, ~1e-7 nats in float32); and on a few tokens the sets the trainer replays equal the
masks vLLM itself returns for the same logits (a colocated engine with ``return_sampling_mask=True``).
"""

from __future__ import annotations

import pytest
import torch

from vllm_harness import PROMPTS, completion_hidden, grpo_kwargs, require_vllm, reward_len, vllm_serve

vllm = require_vllm()

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import fastrl  # noqa: E402
from fastrl import testing_vllm as vllm_cpu  # noqa: E402
from fastrl.losses.config import PolicyLossConfig  # noqa: E402
from fastrl.ops.support import SamplerRule  # noqa: E402
from fastrl.reference import masked_logprobs_reference, policy_loss_from_logprobs, rule_mask_reference  # noqa: E402

V, TOP_K, TOP_P = 512, 20, 0.9
REL = 2e-4


@pytest.fixture
def no_nccl(monkeypatch):
    """TRL's NCCL weight transfer (CUDA only) as no-ops; returns the names each sync would have sent."""
    from trl.generation.vllm_client import VLLMClient

    sent: list[list[str]] = []

    def update_named_params(self, metadata, named_params):
        sent.append([name for name, _ in named_params])  # consume the iterator: TRL gathers as it goes

    monkeypatch.setattr(VLLMClient, "init_communicator", lambda self, device=0: None)
    monkeypatch.setattr(VLLMClient, "update_named_params", update_named_params)
    return sent


def test_server_step_with_rule_replay(tmp_path, no_nccl):
    model_dir = vllm_cpu.save_tiny_qwen2(tmp_path / "qwen2", vocab_size=V, head_scale=8.0)
    tok = vllm_cpu.load_tokenizer(model_dir)
    seen = []
    # --hf-overrides: the server flag README gives for a float32 LM head (a no-op on this float32 model), forwarded
    # by trl vllm-serve to vllm serve
    with vllm_serve(model_dir, tmp_path, "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
                    "--hf-overrides", '{"head_dtype": "float32"}') as port:
        args = fastrl.GRPOConfig(**grpo_kwargs(tmp_path / "out", vllm_mode="server", vllm_server_host="127.0.0.1",
                                               vllm_server_port=port, vllm_server_timeout=60,
                                               sampling_replay="rule"))
        trainer = fastrl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                     reward_funcs=reward_len, args=args, processing_class=tok,
                                     train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
        score = trainer._generate_and_score_completions

        def generate_and_score(inputs):
            seen.append({n: p.detach().double().clone() for n, p in trainer.model.named_parameters()})
            out = score(inputs)
            seen.append({k: v.clone() if torch.is_tensor(v) else v for k, v in out.items()})
            return out

        trainer._generate_and_score_completions = generate_and_score
        trainer.train()
    assert trainer.state.global_step == 1
    assert no_nccl and set(no_nccl[0]) == {n for n, _ in trainer.model.named_parameters()}, \
        "TRL's sync should have streamed every parameter (to the no-op transfer)"
    weights, batch = seen
    logged = next(h for h in trainer.state.log_history if "loss" in h)

    # float64: the rule's sets on the policy's float64 logits, TRL's loss over them
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager").eval()
    policy.load_state_dict(weights)
    ids, mask = batch["completion_ids"], batch["completion_mask"].bool()
    targets = ids.masked_fill(~mask, -100)
    h = completion_hidden(policy, batch)
    with torch.no_grad():
        kept, outside = rule_mask_reference(h, policy.lm_head.weight, targets,
                                            SamplerRule(top_k=TOP_K, top_p=TOP_P, order="vllm"))
    kept = kept.reshape(*ids.shape, V)
    logp, ent = masked_logprobs_reference(h, policy.lm_head.weight, targets, kept)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager")
        h_ref = completion_hidden(ref, batch)
        ref_logp, _ = masked_logprobs_reference(h_ref, ref.lm_head.weight, targets, kept)
    assert not bool(outside[mask].any()), "the server sampled a token outside the rule's set on the same weights"
    sampled = batch["sampling_per_token_logps"].double()
    old = logp.detach()
    ratio = torch.exp(((old - sampled) * mask).sum(-1))
    ratio = torch.where(ratio > 3.0, torch.zeros_like(ratio), ratio)
    a = trainer.args
    config = PolicyLossConfig(loss_type=a.loss_type, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high,
                              beta=a.beta, temperature=a.temperature, max_completion_length=a.max_completion_length)
    loss, metrics = policy_loss_from_logprobs(logp, ent, batch["advantages"].double(), mask, config=config,
                                              old_logprobs=old, ref_logprobs=ref_logp, importance_weights=ratio,
                                              num_items_in_batch=batch["num_items_in_batch"])
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in policy.parameters() if p.grad is not None)).item()
    # step 1: the policy is the reference and every IS ratio ~1, so the loss is ~0 (a group's advantages sum to 0);
    # its gradient norm (logged before clipping) is what tells
    want = {"grad_norm": grad_norm, "kl": metrics["kl"].item(), "sampling/label_outside_frac": 0.0,
            "sampling/kept_size_mean": kept.sum(-1)[mask].double().mean().item()}
    for key, value in want.items():
        assert logged[key] == pytest.approx(value, rel=REL, abs=1e-7), f"logged {key} = {logged[key]}, float64 {value}"
    assert logged["loss"] == pytest.approx(loss.item(), abs=1e-5)  # IS ratios within ~1e-6 of 1: loss ~1e-6
    assert want["sampling/kept_size_mean"] < TOP_K, "top_p never cut inside top_k: the test could not tell"
    gap = (old - sampled).abs()[mask]
    assert logged["sampling/sampling_logp_difference/mean"] == pytest.approx(gap.mean().item(), abs=2e-6)
    assert logged["sampling/sampling_logp_difference/max"] < 1e-4, "the server's log-probs are not the replayed ones"

    # the trainer's replayed sets against the masks vLLM returns for the same logits (a colocated engine)
    check_rule_against_vllm_masks(model_dir, trainer, batch, weights)


def check_rule_against_vllm_masks(model_dir, trainer, batch, weights, tokens_per_row: int = 3):
    from vllm import LLM, SamplingParams

    rule = trainer._fastrl_rule
    assert (rule.top_k, rule.top_p, rule.order) == (TOP_K, TOP_P, "vllm")
    ids, mask = batch["completion_ids"], batch["completion_mask"].bool()
    T = ids.size(1)
    model = trainer.model.eval()
    model.load_state_dict({n: w.float() for n, w in weights.items()})
    with torch.no_grad():  # what the trainer replays: fastrl.replay_rule on its float32 hidden states
        seq = torch.cat([batch["prompt_ids"], ids], 1)
        am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        h = model.model(input_ids=seq, attention_mask=am).last_hidden_state[:, -T - 1 : -1]
        replayed, _ = fastrl.replay_rule(h, model.lm_head.weight, ids.masked_fill(~mask, -100), rule, temperature=1.0)
    replayed = replayed.to_mask().reshape(*ids.shape, V)
    llm = LLM(model=model_dir, dtype="float32", return_sampling_mask=True, logprobs_mode="processed_logprobs",
              enforce_eager=True, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512, seed=0)
    params = SamplingParams(temperature=1.0, top_k=TOP_K, top_p=TOP_P, max_tokens=1)
    requests, where = [], []
    for b in range(ids.size(0)):
        prompt = batch["prompt_ids"][b][batch["prompt_mask"][b].bool()].tolist()
        for t in range(min(tokens_per_row, int(mask[b].sum()))):
            requests.append({"prompt_token_ids": prompt + ids[b, :t].tolist()})
            where.append((b, t))
    outputs = llm.generate(requests, params, use_tqdm=False)
    for (b, t), out in zip(where, outputs):
        got = sorted(out.outputs[0].sampling_mask.token_ids[0])
        want = replayed[b, t].nonzero().flatten().tolist()
        assert got == want, f"completion {b}, token {t}: vLLM kept {got}, the trainer's replayed rule {want}"
