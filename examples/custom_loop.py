"""fastrl's fused GRPO loss in a hand-written training loop (no TRL trainer).

    python examples/custom_loop.py            # ~20 s on two CPU cores; needs the trl extra (transformers)

A tiny Qwen2-architecture policy (random init, offline tokenizer: ``fastrl.testing``) learns to say ``w7``:
sample a group of completions per prompt, score them, normalise rewards within each group, then take a few
gradient steps on ``fastrl.policy_loss``: hidden states from the model body, the LM head's weight, and the
completion tokens go in; the loss and TRL's metrics come out, and no ``[batch, completion, vocab]`` logits are ever
held. Old log-probs (for the importance ratio) come from ``fastrl.fused_logprobs`` under ``torch.no_grad`` (the
forward-only path).
"""

from __future__ import annotations

import torch

import fastrl
from fastrl.demo import target_reward
from fastrl.testing import tiny_model, tiny_tokenizer

VOCAB, GROUP, PROMPTS, MAX_NEW, ITERATIONS, STEPS = 64, 8, 4, 8, 2, 15


def hidden_for_completions(model, input_ids, attention_mask, n_completion):
    """Last hidden states of the positions that predict the completion tokens: [B, n_completion, H]."""
    out = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state[:, -n_completion - 1 : -1]


def main():
    torch.manual_seed(0)
    tok = tiny_tokenizer(VOCAB)
    model = tiny_model(VOCAB, 64, 2, heads=4, kv_heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = fastrl.PolicyLossConfig(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, temperature=1.0)
    for step in range(STEPS):
        prompts = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (4,))) for _ in range(PROMPTS)]
        enc = tok(prompts, return_tensors="pt", padding=True)
        model.eval()
        with torch.no_grad():
            seqs = model.generate(**enc, do_sample=True, max_new_tokens=MAX_NEW, num_return_sequences=GROUP,
                                  temperature=config.temperature, top_k=0, top_p=1.0)
        P = enc.input_ids.shape[1]
        completion = seqs[:, P:]
        # completion mask: up to and including the first EOS
        is_eos = completion == tok.eos_token_id
        first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(is_eos[:, 0], MAX_NEW,
                                                                                             dtype=torch.long))
        mask = torch.arange(completion.shape[1])[None] <= first_eos[:, None]
        attention = torch.cat([enc.attention_mask.repeat_interleave(GROUP, 0), mask.long()], 1)
        rewards = torch.tensor(target_reward(tok.batch_decode(completion, skip_special_tokens=True)))
        grouped = rewards.view(-1, GROUP)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)

        with torch.no_grad():  # old log-probs: fastrl's forward-only path
            h = hidden_for_completions(model, seqs, attention, completion.shape[1])
            old, _ = fastrl.fused_logprobs(h, model.lm_head.weight, completion.masked_fill(~mask, -100),
                                           temperature=config.temperature, with_entropy=False)
        model.train()
        for _ in range(ITERATIONS):
            h = hidden_for_completions(model, seqs, attention, completion.shape[1])
            # one pass: the gradients are formed in the forward, the logits never held
            loss, metrics = fastrl.policy_loss(h, model.lm_head.weight, completion, advantages, mask, config=config,
                                               old_logprobs=old)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"step {step:2d}  reward {rewards.mean():.3f}  loss {loss.item():+.4f}  "
              f"entropy {metrics['entropy']:.3f}  clip {metrics['clip_ratio/region_mean']:.3f}", flush=True)


if __name__ == "__main__":
    main()
