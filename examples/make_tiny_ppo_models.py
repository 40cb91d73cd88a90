"""Build tiny PPO models, a tokenizer and a prompt dataset offline, so ``examples/ppo.py`` runs on a CPU.

    python examples/make_tiny_ppo_models.py --output_dir tiny_ppo
    python examples/ppo.py \
        --dataset_name tiny_ppo/dataset --dataset_train_split descriptiveness \
        --model_name_or_path tiny_ppo/policy --sft_model_path tiny_ppo/policy --reward_model_path tiny_ppo/reward \
        --output_dir tiny_ppo/run --learning_rate 3e-6 --per_device_train_batch_size 4 \
        --gradient_accumulation_steps 1 --total_episodes 16 --response_length 8 --missing_eos_penalty 1.0

Writes (random weights, nothing downloaded):

- ``policy/``: a GPT-NeoX (pythia) architecture causal LM (the SFT model and the reference policy), with the tokenizer;
- ``reward/``: a GPT-NeoX sequence-classification model, one label (the reward model; TRL's example also loads the
  value model from here), with the tokenizer;
- ``dataset/``: a parquet prompt dataset with a ``prompt`` text column and two splits named like TRL's
  ``trl-lib/descriptiveness-sentiment``: ``descriptiveness`` and ``sentiment``.

The tokenizer is ``fastrl.testing.tiny_tokenizer``: word-level over ``<pad> <eos> <bos> w0 w1 ...`` (left padding).
"""

from __future__ import annotations

import argparse
import os

import torch


def build_config(vocab_size: int, hidden_size: int, layers: int, **extra):
    # GPT-NeoX: the pythia architecture of TRL's PPO documentation. (A Qwen2 config would also make
    # AutoTokenizer load Qwen2's own tokenizer class instead of the word-level tokenizer saved next to it.)
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, **extra,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", default="tiny_ppo")
    parser.add_argument("--vocab_size", type=int, default=256)
    parser.add_argument("--hidden_size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--num_prompts", type=int, default=64, help="prompts per split")
    parser.add_argument("--prompt_length", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()

    from datasets import Dataset

    from fastrl.testing import SPECIAL_TOKENS, tiny_tokenizer
    from transformers import GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    tok = tiny_tokenizer(a.vocab_size)
    torch.manual_seed(a.seed)
    policy = GPTNeoXForCausalLM(build_config(a.vocab_size, a.hidden_size, a.layers))
    policy.generation_config.pad_token_id = tok.pad_token_id
    policy.generation_config.eos_token_id = tok.eos_token_id
    policy.generation_config.bos_token_id = tok.bos_token_id
    reward = GPTNeoXForSequenceClassification(build_config(a.vocab_size, a.hidden_size, a.layers, num_labels=1))
    for name, model in (("policy", policy), ("reward", reward)):
        path = os.path.join(a.output_dir, name)
        model.save_pretrained(path)
        tok.save_pretrained(path)

    g = torch.Generator().manual_seed(a.seed)
    n_words = a.vocab_size - len(SPECIAL_TOKENS)
    for split in ("descriptiveness", "sentiment"):
        ids = torch.randint(0, n_words, (a.num_prompts, a.prompt_length), generator=g)
        prompts = [" ".join(f"w{int(i)}" for i in row) for row in ids]
        path = os.path.join(a.output_dir, "dataset", "data", f"{split}-00000-of-00001.parquet")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Dataset.from_dict({"prompt": prompts}).to_parquet(path)
    print(f"tiny PPO models, tokenizer and dataset written to {a.output_dir}")


if __name__ == "__main__":
    main()
