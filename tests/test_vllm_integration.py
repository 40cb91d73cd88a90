"""``kept_sets_from_vllm`` against a real vLLM: a tiny random Qwen2 served by ``vllm.LLM(return_sampling_mask=True,
logprobs_mode="processed_logprobs")`` on CPU, its per-token sampling masks converted to ``KeptSet``s and compared
with the top-k/top-p rule replayed (``apply_rule(order="vllm")``) on the same model's float64 logits.

Runs in the vLLM environment (``bash .ci/vllm-env.sh``; ``.ci/run`` runs it there, where a missing vLLM fails);
skipped, saying so, anywhere else (tests/vllm_harness.py). vLLM returns sampling masks only from its Model Runner
V2, which needs Triton with a backend for the device: without a GPU or triton-cpu, ``fastrl.testing_vllm.prepare`` runs
vLLM's Triton kernels in Triton's interpreter and routes top-k/top-p to vLLM's own PyTorch implementation. All the
code that computes, gathers and returns the masks is vLLM's.
"""

from __future__ import annotations

import pytest
import torch

from vllm_harness import require_vllm

vllm = require_vllm()

from tiny import tiny_qwen2, tiny_tokenizer  # noqa: E402

from fastrl.ops.rules import apply_rule  # noqa: E402
from fastrl.ops.support import SamplerRule  # noqa: E402
from fastrl.trainers.sampling import kept_sets_from_vllm  # noqa: E402

V, TOP_K, TOP_P, MIN_P, N_TOKENS = 256, 5, 0.9, 0.1, 8
PROMPTS = [[5, 6, 7, 8], [40, 41, 9], [100, 3, 77, 12, 200]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(HF float64 model, vLLM RequestOutputs) for PROMPTS, n=2 samples each: top_k=5, top_p=0.9 at temperature 1;
    and top_k=5, top_p=0.97, min_p=0.1 at temperature 0.7."""
    from vllm import LLM, SamplingParams

    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    model = tiny_qwen2(vocab_size=V, hidden_size=128, layers=1, heads=2, kv_heads=1, max_position_embeddings=256)
    with torch.no_grad():  # peaked logits, so top_p cuts inside the top 5 at some tokens
        model.lm_head.weight.mul_(12.0)
    model.save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    llm = LLM(model=path, tokenizer=path, dtype="float32", return_sampling_mask=True,
              logprobs_mode="processed_logprobs", enforce_eager=True, max_model_len=64, seed=0, max_num_seqs=8,
              max_num_batched_tokens=256)
    params = SamplingParams(n=2, temperature=1.0, top_k=TOP_K, top_p=TOP_P, max_tokens=N_TOKENS, ignore_eos=True,
                            seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    params_min_p = SamplingParams(n=2, temperature=0.7, top_k=TOP_K, top_p=0.97, min_p=MIN_P, max_tokens=N_TOKENS,
                                  ignore_eos=True, seed=1)
    outs_min_p = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params_min_p, use_tqdm=False)
    return model.double().eval(), outs, outs_min_p


def test_vllm_masks_become_kept_sets(served):
    _, outs, _ = served
    kept = kept_sets_from_vllm(outs, V)
    completions = [c for o in outs for c in o.outputs]
    assert len(kept) == len(completions) == 2 * len(PROMPTS)
    sizes = []
    for ks, c in zip(kept, completions):
        assert len(ks) == len(c.token_ids) == N_TOKENS
        assert bool(ks.contains(torch.tensor(list(c.token_ids))).all())
        mask = ks.to_mask()
        for t, ids in enumerate(c.sampling_mask.token_ids):
            assert mask[t].nonzero().flatten().tolist() == sorted(ids)
            sizes.append(len(ids))
    assert max(sizes) <= TOP_K
    assert min(sizes) < TOP_K, "top_p never cut: the test would not tell top-k from top-k+top-p"


@pytest.mark.parametrize("with_min_p", [False, True])
def test_vllm_masks_equal_the_rule_on_float64_logits(served, with_min_p):
    model, outs, outs_min_p = served
    if with_min_p:  # vLLM's order: min_p, then top_k, then top_p, all on the logits after temperature
        outs, temperature = outs_min_p, 0.7
        rule = SamplerRule(top_k=TOP_K, top_p=0.97, min_p=MIN_P, order="vllm")
    else:
        temperature, rule = 1.0, SamplerRule(top_k=TOP_K, top_p=TOP_P, order="vllm")
    kept = kept_sets_from_vllm(outs, V)
    i = 0
    for prompt, o in zip(PROMPTS, outs):
        for c in o.outputs:
            seq = torch.tensor([prompt + list(c.token_ids)])
            with torch.no_grad():
                z = model(seq).logits[0, len(prompt) - 1: -1].double() / temperature  # each completion token's logits
            want = apply_rule(z, rule)  # [T, V] bool
            got = kept[i].to_mask()
            bad = (got != want).any(-1).nonzero().flatten().tolist()
            assert not bad, f"completion {i}: vLLM's masks differ from the replayed rule at tokens {bad}"
            i += 1
