"""CPU demo: train a tiny Qwen2-architecture policy with ``fastrl.GRPOTrainer``, then compare step memory with TRL.

    python -m fastrl.demo            # about 40 steps, a few minutes on two cores
    python -m fastrl.demo --quick    # a short smoke run
    python -m fastrl.demo --steps 80

Part 1, training. A toy task whose reward really rises within minutes: the prompt is a few random words of a
64-word vocabulary and the reward is the fraction of completion words equal to a target word (``w7``); a random
policy says it about once in 64 words. A 2-layer, hidden-64 Qwen2 model (random init, offline word-level tokenizer,
nothing downloaded) is trained with ``fastrl.GRPOTrainer`` (TRL's defaults: DAPO loss, no KL) and prints TRL's
metrics as it goes.

Part 2, memory. One training step (loss forward + backward on the same fixed batch of completions) of a model with
a real vocabulary (V=151936, H=256) through stock ``trl.GRPOTrainer`` and ``fastrl.GRPOTrainer``, each in a fresh
process; the peak resident memory of the step above what the process held before it (Linux ``VmHWM`` reset through
``/proc/self/clear_refs``, else ``ru_maxrss``), and its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

__all__ = ["main", "build_tokenizer", "build_model", "measure_step", "run_measurement"]

SPECIAL = ("<pad>", "<eos>", "<bos>")
TARGET = "w7"


# ---------------------------------------------------------------------------------------------------------------
# A tiny model and an offline tokenizer
# ---------------------------------------------------------------------------------------------------------------


def build_tokenizer(vocab_size: int):
    """Word-level tokenizer over ``<pad> <eos> <bos> w0 w1 ...`` (offline), left padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i + len(SPECIAL) for i in range(vocab_size - len(SPECIAL))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   padding_side="left", model_max_length=1 << 16)


def build_model(vocab_size: int, hidden_size: int, layers: int, seed: int = 0, attn: str = "sdpa"):
    """A randomly initialised ``Qwen2ForCausalLM`` in float32 (SDPA attention, transformers' default)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1 << 14, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                      bos_token_id=2)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model


def target_reward(completions, **kwargs):
    """Fraction of the completion's words that are the target word."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w == TARGET for w in words) / max(len(words), 1))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Part 1: training
# ---------------------------------------------------------------------------------------------------------------


def train(steps: int, quick: bool) -> tuple[float, float]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    import fastrl

    vocab = 64
    tok = build_tokenizer(vocab)
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"w{int(i)}" for i in row) for row in torch.randint(0, vocab - 3, (256, 4), generator=g)]
    model = build_model(vocab, 64, 2)
    out_dir = tempfile.mkdtemp(prefix="fastrl-demo-")
    args = fastrl.GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        per_device_train_batch_size=32, num_generations=8, max_completion_length=8, max_steps=steps,
        learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1 if quick else 2, seed=0,
        temperature=1.0, disable_tqdm=True, log_completions=False,
    )
    rewards: list[float] = []

    class Printer(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])
                keys = ("loss", "reward", "reward_std", "entropy", "completions/mean_length",
                        "clip_ratio/region_mean", "step_time")
                line = "  ".join(f"{k.split('/')[-1]}={logs[k]:.4g}" for k in keys if k in logs)
                print(f"step {state.global_step:3d}  {line}", flush=True)

    trainer = fastrl.GRPOTrainer(model=model, reward_funcs=target_reward, args=args, processing_class=tok,
                                 train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[Printer()])
    print(f"Part 1: training a tiny Qwen2 (V={vocab}, H=64, 2 layers) with fastrl.GRPOTrainer to say '{TARGET}'. "
          f"Reward = fraction of completion words equal to '{TARGET}'; random policy ~{1 / (vocab - 3):.3f}. "
          "(Completions are capped at 8 words, so the health check's truncation warning is expected.)",
          flush=True)
    t0 = time.perf_counter()
    trainer.train()
    k = max(1, min(3, len(rewards) // 3))
    before, after = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"reward: first {k} logs {before:.3f} -> last {k} logs {after:.3f}  ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    return before, after


# ---------------------------------------------------------------------------------------------------------------
# Part 2: memory of one training step, fresh process per trainer
# ---------------------------------------------------------------------------------------------------------------


def _rss_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


def measure_step(which: str, vocab: int, hidden: int, layers: int, batch: int, prompt_len: int,
                 completion_len: int, loss_type: str = "dapo", seed: int = 0) -> dict:
    """One training step (compute_loss + backward) with ``which`` in ("trl", "fastrl"); run in a fresh process.

    Returns peak extra RSS over the step in MB, its wall time, and the loss.
    """
    import resource

    import torch
    import trl
    from datasets import Dataset

    import fastrl

    torch.manual_seed(seed)
    tok = build_tokenizer(vocab)
    model = build_model(vocab, hidden, layers, seed=seed)
    cls, cfg = (trl.GRPOTrainer, trl.GRPOConfig) if which == "trl" else (fastrl.GRPOTrainer, fastrl.GRPOConfig)
    kw = dict(output_dir=tempfile.mkdtemp(prefix="fastrl-mem-"), use_cpu=True, bf16=False, report_to="none",
              save_strategy="no", per_device_train_batch_size=batch, num_generations=batch,
              max_completion_length=completion_len, loss_type=loss_type, disable_tqdm=True)
    if which == "fastrl":
        kw["health_checks"] = False
    trainer = cls(model=model, reward_funcs=target_reward, args=cfg(**kw), processing_class=tok,
                  train_dataset=Dataset.from_dict({"prompt": ["w1"] * batch}))
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(batch, completion_len, dtype=torch.int64)
    inputs = dict(
        prompt_ids=torch.randint(3, vocab, (batch, prompt_len), generator=g),
        prompt_mask=torch.ones(batch, prompt_len, dtype=torch.int64),
        completion_ids=torch.randint(3, vocab, (batch, completion_len), generator=g),
        completion_mask=completion_mask,
        advantages=torch.randn(batch, generator=g),
        num_items_in_batch=completion_mask.sum(),
    )
    model = trainer.model
    model.train()
    import gc

    gc.collect()
    base = _rss_kb("VmRSS")
    exact = _reset_peak() and base is not None
    base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    seconds = time.perf_counter() - t0
    if exact:
        peak_mb = (_rss_kb("VmHWM") - base) / 1024
        how = "VmHWM reset"
    else:
        peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_maxrss) / 1024
        how = "ru_maxrss delta (a lower bound)"
    return dict(which=which, peak_extra_mb=peak_mb, seconds=seconds, loss=float(loss), how=how,
                path=getattr(trainer, "_fastrl_last_path", "trl"), tokens=batch * completion_len)


def run_measurement(which: str, timeout: float = 1800, **kw) -> dict:
    """``measure_step`` in a fresh Python process (so neither trainer sees the other's allocator state)."""
    cmd = [sys.executable, "-m", "fastrl.demo", "--_measure", json.dumps({"which": which, **kw})]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("MEASURE "):
            return json.loads(line[len("MEASURE "):])
    return dict(which=which, error=(proc.stderr or proc.stdout)[-2000:])


def memory_comparison(quick: bool) -> None:
    shape = dict(vocab=151936, hidden=256, layers=1, batch=2 if quick else 4, prompt_len=16,
                 completion_len=128 if quick else 256)
    print(f"\nPart 2: peak memory of one training step (loss forward + backward), V={shape['vocab']}, "
          f"H={shape['hidden']}, {shape['batch']} completions x {shape['completion_len']} tokens, float32, "
          "each trainer in a fresh process:", flush=True)
    rows = [run_measurement(w, **shape) for w in ("trl", "fastrl")]
    for r in rows:
        if "error" in r:
            print(f"  {r['which']:>7}: failed: {r['error']}")
        else:
            print(f"  {r['which']:>7}: peak extra {r['peak_extra_mb']:8.1f} MB   step {r['seconds']:6.2f} s   "
                  f"loss {r['loss']:+.6f}   ({r['how']})", flush=True)
    if all("error" not in r for r in rows) and rows[1]["peak_extra_mb"] > 0:
        print(f"  fastrl uses {rows[0]['peak_extra_mb'] / rows[1]['peak_extra_mb']:.1f}x less step memory than "
              "stock TRL on the same batch.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fastrl.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 40, --quick 8)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run and a smaller memory batch")
    parser.add_argument("--skip-memory", action="store_true", help="only the training part")
    parser.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a._measure is not None:
        print("MEASURE " + json.dumps(measure_step(**json.loads(a._measure))), flush=True)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    steps = a.steps if a.steps is not None else (8 if a.quick else 40)
    train(steps, a.quick)
    if not a.skip_memory:
        memory_comparison(a.quick)


if __name__ == "__main__":
    main()
