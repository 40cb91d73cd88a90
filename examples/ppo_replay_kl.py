"""The negative-KL FAQ, measured: PPO with top-k sampling and the k1 KL, with and without sampling replay.

TRL's Training FAQ ("What Is the Concern with Negative KL Divergence?") blames top-k sampling and minimum lengths for
a negative KL: the tokens are drawn from the truncated distribution pi^S, but the k1 estimate
``log pi(y) - log pi_ref(y)`` uses the full softmax, and the KL penalty teaches the policy to move probability out of
the kept ids (where no sample ever lands) so that the estimate falls below zero. With ``sampling_replay`` the
policy, reference and update log-probs are computed over the sampler's support, and the estimate is that of
KL(pi^S || pi_ref^S) >= 0.

Runs offline on a CPU in about a minute (tiny random-init Qwen2 models; nothing downloaded):

    python examples/ppo_replay_kl.py

and prints, per setting, the mean ``objective/kl`` over the updates, the most negative one, and how many were < 0.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch

V, H = 128, 32
PAD, EOS, BOS = 0, 1, 2


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, **{f"w{i}": i + 3 for i in range(V - 3)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   padding_side="left")


def qwen2(seed: int, classifier: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    config = Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=PAD, eos_token_id=EOS,
                         bos_token_id=BOS, num_labels=1)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return (Qwen2ForSequenceClassification if classifier else Qwen2ForCausalLM)(config)


def run(replay: str, top_k: int, updates: int, seed: int) -> list[float]:
    from datasets import Dataset
    from transformers import PrinterCallback

    from fastrl import PPOConfig, PPOTrainer

    tok = tokenizer()
    g = torch.Generator().manual_seed(seed)
    prompts = [" ".join(f"w{int(i)}" for i in row) for row in torch.randint(0, V - 3, (64, 4), generator=g)]
    ds = Dataset.from_dict({"input_ids": [tok(p)["input_ids"] for p in prompts]})
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the negative-KL settings warning is the point here
        args = PPOConfig(
            output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=1, num_mini_batches=1,
            total_episodes=8 * updates, response_length=12, num_ppo_epochs=4, kl_coef=0.5, kl_estimator="k1",
            learning_rate=1e-2, temperature=1.0, generation_kwargs={"top_k": top_k} if top_k else None,
            sampling_replay=replay, report_to="none", num_sample_generations=0, save_strategy="no",
            disable_tqdm=True, seed=seed, use_cpu=True, bf16=False, health_checks=False, logging_steps=1,  # float32
            local_rollout_forward_batch_size=8,
        )
        trainer = PPOTrainer(args=args, processing_class=tok, model=qwen2(0), ref_model=qwen2(0),
                             reward_model=qwen2(1, True), train_dataset=ds, value_model=qwen2(2, True))
        trainer.remove_callback(PrinterCallback)  # one summary line per setting, not every log
        trainer.train()
    return [h["objective/kl"] for h in trainer.state.log_history if "objective/kl" in h]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--updates", type=int, default=12)
    p.add_argument("--top_k", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [("full softmax sampling (top_k=0), replay off", "off", 0),
            (f"top_k={a.top_k}, sampling_replay='off'", "off", a.top_k),
            (f"top_k={a.top_k}, sampling_replay='kept_set'", "kept_set", a.top_k),
            (f"top_k={a.top_k}, sampling_replay='rule'", "rule", a.top_k)]
    print(f"PPO, k1 KL (kl_coef 0.5), {a.updates} updates of 8 prompts x 12 tokens, tiny Qwen2 (V={V}), seed {a.seed}")
    print(f"{'setting':48s} {'mean objective/kl':>18s} {'min':>9s} {'updates < 0':>12s}")
    for label, replay, k in rows:
        kl = run(replay, k, a.updates, a.seed)
        later = kl[1:]  # update 1: policy == reference, KL 0 by construction
        neg = sum(x < 0 for x in later)
        print(f"{label:48s} {sum(later) / len(later):18.4f} {min(later):9.4f} {neg:>6d} / {len(later)}")


if __name__ == "__main__":
    main()
