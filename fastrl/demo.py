"""The main job: train a tiny policy with ``fastrl.GRPOTrainer``, then weigh one training step against stock TRL.

    python -m fastrl.demo                  # on the GPU when there is one (bf16 where supported), else the CPU
    python -m fastrl.demo --device cpu     # choose: auto (default), cpu or cuda
    python -m fastrl.demo --quick          # a short run with a smaller comparison batch
    python -m fastrl.demo --steps 80

Needs the ``trl`` extra (``pip install "fastrl-kernels[trl]"``). Nothing is downloaded: the models are randomly
initialised from a config and the tokenizer is built offline.

Part 1, training. A toy task whose reward really rises within a minute: the prompt is a few random words of a
64-word vocabulary and the reward is the share of completion words equal to a target word (``w7``); a random
policy says it about once in 61 words. A 2-layer, hidden-64 Qwen2 model is trained with ``fastrl.GRPOTrainer``
(TRL's defaults: DAPO loss, no KL), one progress line per step.

Part 2, one training step (loss forward + backward on the same fixed batch of completions; generation excluded)
of a model with a real vocabulary (V=151936) through stock ``trl.GRPOTrainer`` and ``fastrl.GRPOTrainer``, each in
a fresh process: the step's peak memory above what the process held just before it, and its time. On a GPU the
memory is ``torch.cuda.max_memory_allocated()`` (bf16 model, an untimed warm-up step first, then the median of
three steps); on a CPU it is the peak resident memory of the process (float32, one step after a short warm-up).

The run ends with a short verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = [
    "main", "build_model", "target_reward", "pick_device", "use_bf16", "train_config_kwargs",
    "measurement_shape", "measure_step", "run_measurement", "step_line", "verdict",
]

TARGET = "w7"
TRAIN_VOCAB = 64
DEVICES = ("auto", "cpu", "cuda")
# the `trl` extra: what the demo imports beyond torch
NEEDS = ("trl", "transformers", "accelerate", "datasets", "tokenizers")


# ---------------------------------------------------------------------------------------------------------------
# The models and the task (the models and tokenizer: fastrl.testing)
# ---------------------------------------------------------------------------------------------------------------


def build_model(vocab_size: int, hidden_size: int, layers: int, seed: int = 0, dtype: str = "float32"):
    """The demo's random Qwen2 (``fastrl.testing.tiny_model``): heads of 64 or less, 2 KV heads, SDPA attention."""
    from fastrl.testing import tiny_model

    # 4 heads up to H=256 (the sizes used so far), 14 at H=896 (Qwen2.5-0.5B)
    return tiny_model(vocab_size, hidden_size, layers, seed=seed, heads=max(4, hidden_size // 64), kv_heads=2,
                      dtype=dtype, max_position_embeddings=1 << 14)


def target_reward(completions, **kwargs):
    """Share of the completion's words that are the target word."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w == TARGET for w in words) / max(len(words), 1))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Device and precision
# ---------------------------------------------------------------------------------------------------------------


def pick_device(requested: str = "auto") -> str:
    """``"cuda"`` or ``"cpu"``: ``auto`` takes the GPU when torch sees one; ``cuda`` without one is an error."""
    import torch

    if requested not in DEVICES:
        raise ValueError(f"--device must be one of {DEVICES}, got {requested!r}")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (a CPU build of torch, or no GPU); "
                         "use --device cpu or --device auto")
    return requested


def use_bf16(device: str) -> bool:
    """Train in bf16 mixed precision on a GPU that supports it; float32 elsewhere."""
    import torch

    return device == "cuda" and torch.cuda.is_bf16_supported()


def device_label(device: str, bf16: bool) -> str:
    import torch

    if device == "cuda":
        return f"GPU ({torch.cuda.get_device_name(0)}), {'bf16' if bf16 else 'float32'}"
    return f"CPU ({torch.get_num_threads()} threads), float32"


# ---------------------------------------------------------------------------------------------------------------
# Part 1: training
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    steps: int
    rewards: list  # the mean reward logged at each step
    seconds: float

    def before_after(self) -> tuple[float, float]:
        """Mean reward over the first and the last few steps."""
        k = max(1, min(3, len(self.rewards) // 3))
        return sum(self.rewards[:k]) / k, sum(self.rewards[-k:]) / k


def _no_checkpointing() -> dict:
    """Activation checkpointing off, under the name this transformers uses (renamed in transformers 5)."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": False}


def train_config_kwargs(out_dir: str, device: str, bf16: bool, steps: int) -> dict:
    """Arguments of the ``fastrl.GRPOConfig`` the training part uses."""
    return dict(
        output_dir=out_dir, use_cpu=device == "cpu", bf16=bf16, report_to="none", save_strategy="no",
        per_device_train_batch_size=32, num_generations=8, max_completion_length=8, max_steps=steps,
        learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, seed=0, temperature=1.0,
        disable_tqdm=True, log_completions=False,
        **_no_checkpointing(),  # a 2-layer model has nothing to gain from recomputing activations
        # attached below without the truncation check (completions always run to 8 words here, by design)
        health_checks=False,
    )


def step_line(step: int, steps: int, logs: dict) -> str | None:
    """The one progress line of a training step, from the trainer's logged metrics (None: not a training log)."""
    if "reward" not in logs:
        return None
    parts = [f"step {step:>{len(str(steps))}}/{steps}", f"reward {logs['reward']:.3f}"]
    if "reward_std" in logs:
        parts[-1] += f" (std {logs['reward_std']:.3f})"
    for key, label, fmt in (("entropy", "entropy", ".2f"), ("loss", "loss", "+.3g"),
                            ("completions/mean_length", "length", ".1f"), ("step_time", "s/step", ".2f")):
        if key in logs:
            parts.append(f"{label} {logs[key]:{fmt}}" if label != "s/step" else f"{logs[key]:{fmt}} s")
    return "  ".join(parts)


def train(steps: int, device: str, bf16: bool) -> TrainResult:
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback

    import fastrl
    from fastrl.testing import tiny_prompt_dataset, tiny_tokenizer
    from fastrl.trainers.health import CHECKS, TrainingHealthCallback

    tok = tiny_tokenizer(TRAIN_VOCAB, model_max_length=1 << 16)
    model = build_model(TRAIN_VOCAB, 64, 2)
    rewards: list[float] = []

    class StepPrinter(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            line = step_line(state.global_step, steps, logs or {})
            if line is not None:
                rewards.append(float(logs["reward"]))
                print("  " + line, flush=True)

    health = TrainingHealthCallback(checks=tuple(c for c in CHECKS if c.name != "truncated"))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fastrl-demo-") as out_dir:
        args = fastrl.GRPOConfig(**train_config_kwargs(out_dir, device, bf16, steps))
        trainer = fastrl.GRPOTrainer(model=model, reward_funcs=target_reward, args=args, processing_class=tok,
                                     train_dataset=tiny_prompt_dataset(256, 4, TRAIN_VOCAB, seed=0),
                                     callbacks=[StepPrinter(), health])
        # our line per step replaces the trainer's own printing of every logged dict
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.train()
    return TrainResult(steps=steps, rewards=rewards, seconds=time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------------------------
# Part 2: one training step, stock TRL vs fastrl, each in a fresh process
# ---------------------------------------------------------------------------------------------------------------


def measurement_shape(device: str, quick: bool) -> dict:
    """The batch and model of the comparison step (keyword arguments of :func:`measure_step`)."""
    if device == "cuda":
        # Qwen2.5-0.5B's width and vocabulary, 2 layers, bf16: the LM head is most of the step, as it is at
        # long completions
        return dict(vocab=151936, hidden=896, layers=2, batch=8, prompt_len=64,
                    completion_len=1024 if quick else 4096, dtype="bfloat16", device="cuda")
    return dict(vocab=151936, hidden=256, layers=1, batch=2 if quick else 4, prompt_len=16,
                completion_len=128 if quick else 256, dtype="float32", device="cpu")


def _rss_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset Linux's peak-RSS mark (VmHWM) to the current RSS; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    """Give freed heap back to the OS, so the RSS before a step counts only memory in use."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_step(which: str, vocab: int, hidden: int, layers: int, batch: int, prompt_len: int,
                 completion_len: int, loss_type: str = "dapo", seed: int = 0, device: str = "cpu",
                 dtype: str = "float32", reps: int | None = None, progress=None) -> dict:
    """One training step (compute_loss + backward) with ``which`` in ("trl", "fastrl"); run in a fresh process.

    Returns the step's peak memory above what the process held before it (``peak_extra_mb``), its time
    (``seconds``, the median over ``reps`` timed steps), the loss, and how the memory was measured.
    ``progress(message)``, when given, is called as each phase ends (trainer built, warm-up, each timed step).
    """
    with contextlib.ExitStack() as stack:  # holds the trainer's (unused) output folder until the end
        return _measure_step(stack, which, vocab, hidden, layers, batch, prompt_len, completion_len, loss_type,
                             seed, device, dtype, reps, progress or (lambda message: None))


def _measure_step(stack, which, vocab, hidden, layers, batch, prompt_len, completion_len, loss_type, seed, device,
                  dtype, reps, progress) -> dict:
    import torch

    cuda = device == "cuda"
    reps = reps if reps is not None else (3 if cuda else 1)
    torch.manual_seed(seed)
    trainer = _step_trainer(stack, which, vocab, hidden, layers, batch, completion_len, loss_type, seed, cuda, dtype)
    model = trainer.model
    model.train()

    def step(inputs) -> float:
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, inputs)
        trainer.accelerator.backward(loss)
        return float(loss.detach())

    # untimed warm-up: on a GPU at the measured shape (Triton compiles its kernels at the first call), on a CPU
    # at a short length (lazy initialisation, without doubling the run time)
    warm_len = completion_len if cuda else min(completion_len, 16)
    what = "compiling the kernels" if cuda else "first-call set-up"
    progress(f"trainer built; warm-up: one untimed step on {batch} x {warm_len} tokens ({what})")
    t_warm = time.perf_counter()
    step(_step_inputs(batch, vocab, prompt_len, warm_len, seed + 1, device))
    progress(f"warm-up done ({time.perf_counter() - t_warm:.1f} s); timing {reps} step{'s' if reps > 1 else ''} "
             f"on {batch} x {completion_len} tokens")
    model.zero_grad(set_to_none=True)
    inputs = _step_inputs(batch, vocab, prompt_len, completion_len, seed, device)
    times, peaks, losses = [], [], []
    exact = True
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        meter = _StepMemory(cuda)
        exact = meter.exact
        t0 = time.perf_counter()
        losses.append(step(inputs))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        progress(f"step {len(times)}/{reps}: {times[-1]:.2f} s")
        peaks.append(meter.peak_extra_mb())
    memory = ("torch.cuda.max_memory_allocated() during the step minus memory allocated before it" if cuda else
              "peak resident memory during the step minus resident memory before it" if exact else
              "growth of the process's peak resident memory during the step (a lower bound)")
    return dict(which=which, device=device, peak_extra_mb=max(peaks), seconds=sorted(times)[len(times) // 2],
                reps=reps, loss=losses[0], memory=memory, lower_bound=not cuda and not exact,
                path=getattr(trainer, "_fastrl_last_path", "trl"), tokens=batch * completion_len)


def _step_trainer(stack, which, vocab, hidden, layers, batch, completion_len, loss_type, seed, cuda, dtype):
    """``trl.GRPOTrainer`` or ``fastrl.GRPOTrainer`` on the demo's random model, the same options for both, its
    output folder held by ``stack``; ready for ``compute_loss`` outside ``train()``."""
    import trl
    from datasets import Dataset

    import fastrl
    from fastrl.testing import tiny_tokenizer

    tok = tiny_tokenizer(vocab, model_max_length=1 << 16)
    model = build_model(vocab, hidden, layers, seed=seed, dtype=dtype)
    cls, cfg = (trl.GRPOTrainer, trl.GRPOConfig) if which == "trl" else (fastrl.GRPOTrainer, fastrl.GRPOConfig)
    kw = dict(use_cpu=not cuda, bf16=dtype == "bfloat16", report_to="none", save_strategy="no",
              logging_strategy="no", per_device_train_batch_size=batch, num_generations=batch,
              max_completion_length=completion_len, loss_type=loss_type, disable_tqdm=True,
              **_no_checkpointing())  # the same for both; compute_loss alone would not turn it on
    if which == "fastrl":
        kw["health_checks"] = False
    out_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastrl-mem-"))
    trainer = cls(model=model, reward_funcs=target_reward, args=cfg(output_dir=out_dir, **kw),
                  processing_class=tok, train_dataset=Dataset.from_dict({"prompt": ["w1"] * batch}))
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _step_inputs(batch: int, vocab: int, prompt_len: int, length: int, gen_seed: int, device: str) -> dict:
    """A fixed batch of random prompts and ``length``-token completions, as ``compute_loss`` takes them."""
    import torch

    g = torch.Generator().manual_seed(gen_seed)
    mask = torch.ones(batch, length, dtype=torch.int64)
    inp = dict(prompt_ids=torch.randint(3, vocab, (batch, prompt_len), generator=g),
               prompt_mask=torch.ones(batch, prompt_len, dtype=torch.int64),
               completion_ids=torch.randint(3, vocab, (batch, length), generator=g),
               completion_mask=mask, advantages=torch.randn(batch, generator=g), num_items_in_batch=mask.sum())
    return {k: v.to(device) for k, v in inp.items()}


class _StepMemory:
    """The memory one step adds, read from just before it (made then) to ``peak_extra_mb()`` after it: on CUDA the
    allocator's peak; on a CPU the peak resident memory (VmHWM after resetting it; where it cannot be reset,
    ``exact`` is False and the growth of ru_maxrss, a lower bound, is read instead)."""

    def __init__(self, cuda: bool):
        import resource

        import torch

        self.cuda, self.exact = cuda, True
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            _trim_heap()
            self.base_kb = _rss_kb("VmRSS")
            self.exact = _reset_peak_rss() and self.base_kb is not None
            self.base_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def peak_extra_mb(self) -> float:
        import resource

        import torch

        if self.cuda:
            return (torch.cuda.max_memory_allocated() - self.base) / 2**20
        if self.exact:
            return (_rss_kb("VmHWM") - self.base_kb) / 1024
        # ru_maxrss never goes down: only growth past the earlier peak shows
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.base_maxrss) / 1024


def run_measurement(which: str, timeout: float = 1800, **kw) -> dict:
    """``measure_step`` in a fresh Python process (so neither trainer sees the other's allocator state), its
    progress lines printed as they come."""
    import threading

    cmd = [sys.executable, "-m", "fastrl.demo", "--_measure", json.dumps({"which": which, **kw})]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    print(f"  {LABELS[which]:>9}: starting a fresh process", flush=True)
    with tempfile.TemporaryFile(mode="w+") as err:  # a file, not a pipe: a full stderr pipe would stall the child
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        result, lines = None, []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("PROGRESS "):
                print(f"  {LABELS[which]:>9}: {line[len('PROGRESS '):].rstrip()} "
                      f"[{time.perf_counter() - t0:.0f} s]", flush=True)
            elif line.startswith("MEASURE "):
                result = json.loads(line[len("MEASURE "):])
        killed = proc.wait() != 0 and not timer.is_alive()
        timer.cancel()
        err.seek(0)
        stderr = err.read()
    if result is not None:
        return result
    if killed:
        return dict(which=which, error=f"no result within {timeout:.0f} s")
    return dict(which=which, error=(stderr or "".join(lines))[-2000:])


LABELS = {"trl": "stock TRL", "fastrl": "fastrl"}


def compare(shape: dict) -> list[dict]:
    s = shape
    on = "GPU" if s["device"] == "cuda" else "CPU"
    print(f"\nPart 2: one training step (loss forward + backward, generation excluded) on the same batch, "
          f"stock trl.GRPOTrainer vs fastrl.GRPOTrainer, each in a fresh process on the {on}:\n"
          f"  Qwen2 with V={s['vocab']}, H={s['hidden']}, {s['layers']} layer{'s' if s['layers'] > 1 else ''}, "
          f"{s['dtype']}; {s['batch']} completions x {s['completion_len']} tokens", flush=True)
    rows = [run_measurement(w, **s) for w in ("trl", "fastrl")]
    ok = [r for r in rows if "error" not in r]
    if ok:
        print(f"  memory: {ok[0]['memory']}; time: "
              + (f"median of {ok[0]['reps']} steps" if ok[0]["reps"] > 1 else "one step") + " after a warm-up step")
    for r in rows:
        if "error" in r:
            lines = r["error"].strip().splitlines() or ["?"]
            print(f"  {LABELS[r['which']]:>9}: failed: {lines[-1]}")
        else:
            print(f"  {LABELS[r['which']]:>9}: {r['peak_extra_mb']:8.1f} MB   {r['seconds']:7.3f} s   "
                  f"loss {r['loss']:+.6g}", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Verdict
# ---------------------------------------------------------------------------------------------------------------


def verdict(result: TrainResult | None, rows: list[dict] | None) -> str:
    """A few plain sentences: did the reward rise, and how did fastrl's step compare with stock TRL's."""
    out = []
    if result is not None:
        if not result.rewards:
            out.append("no training step logged a reward.")
        else:
            before, after = result.before_after()
            trend = f"reward {before:.2f} -> {after:.2f} in {result.steps} steps, {result.seconds:.0f} s"
            if after >= 0.5 and after > before + 0.2:
                out.append(f"the policy learned the task ({trend}).")
            elif after > before + 0.05:
                out.append(f"the reward rose but the task is not learned yet ({trend}): try more --steps.")
            else:
                out.append(f"the reward did not rise ({trend}).")
    if rows is not None:
        by = {r["which"]: r for r in rows}
        bad = [r for r in rows if "error" in r]
        if bad:
            out.append("the step comparison did not complete (" + ", ".join(LABELS[r["which"]] for r in bad)
                       + " failed; the lines above say why).")
        elif "trl" in by and "fastrl" in by:
            t, f = by["trl"], by["fastrl"]
            tm, fm = t["peak_extra_mb"], f["peak_extra_mb"]
            if tm <= 0 or fm <= 0:
                mem = f"step memory fastrl {fm:.0f} MB, stock TRL {tm:.0f} MB (too small to compare)"
            elif tm / fm >= 1.1:
                mem = f"fastrl's step took {tm / fm:.1f}x less memory than stock TRL's ({fm:.0f} vs {tm:.0f} MB)"
            elif fm / tm >= 1.1:
                mem = f"fastrl's step took {fm / tm:.1f}x MORE memory than stock TRL's ({fm:.0f} vs {tm:.0f} MB)"
            else:
                mem = f"fastrl's step took about the same memory as stock TRL's ({fm:.0f} vs {tm:.0f} MB)"
            ratio = f["seconds"] / t["seconds"] if t["seconds"] > 0 else float("inf")
            if ratio <= 0.9:
                speed = f"and was {1 / ratio:.1f}x faster"
            elif ratio >= 1.1:
                speed = f"and {ratio:.1f}x slower"
            else:
                speed = "in about the same time"
            out.append(f"{mem}, {speed} ({f['seconds']:.2f} vs {t['seconds']:.2f} s), on the same batch.")
    return "Verdict: " + " ".join(s if s.startswith("fastrl") else s[0].upper() + s[1:] for s in out) if out else ""


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None, *, shape: dict | None = None) -> int:
    """The command line. ``shape`` overrides :func:`measurement_shape` (tests use a tiny one)."""
    parser = argparse.ArgumentParser(prog="python -m fastrl.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="where to train and measure: auto (the GPU when torch sees one), cpu or cuda")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 40, --quick 12)")
    parser.add_argument("--quick", action="store_true", help="a short run and a smaller comparison batch")
    parser.add_argument("--skip-memory", action="store_true", help="only the training part")
    parser.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    from fastrl._extras import missing_modules, extra_error

    missing = missing_modules(NEEDS)
    if missing:
        print(f"error: {extra_error('python -m fastrl.demo', missing)}", file=sys.stderr)
        return 1
    if a._measure is not None:
        row = measure_step(**json.loads(a._measure), progress=lambda m: print("PROGRESS " + m, flush=True))
        print("MEASURE " + json.dumps(row), flush=True)
        return 0
    if a.steps is not None and a.steps < 1:
        parser.error(f"--steps must be at least 1, got {a.steps}")
    if a.device != "cpu":
        # one GPU: with several visible, transformers' Trainer would wrap the model in DataParallel (set before
        # torch first queries CUDA; an explicit CUDA_VISIBLE_DEVICES is left alone)
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    try:
        device = pick_device(a.device)
    except ValueError as e:
        parser.error(str(e))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":
        # where DeepSpeed is installed (the test extra), transformers' Trainer imports it, and its accelerator
        # auto-detection warns that it "fell back" to the CPU: on the CPU path that is the plan, so say it up front
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import trl

    import fastrl
    from fastrl.testing import SPECIAL_TOKENS

    bf16 = use_bf16(device)
    steps = a.steps if a.steps is not None else (12 if a.quick else 40)
    print(f"fastrl {fastrl.__version__} demo on {device_label(device, bf16)} | torch {torch.__version__}, "
          f"trl {trl.__version__}", flush=True)
    print(f"\nPart 1: train a tiny Qwen2 policy (V={TRAIN_VOCAB}, H=64, 2 layers) with fastrl.GRPOTrainer to say "
          f"'{TARGET}'. Reward: the share of completion words that are '{TARGET}' (a random policy scores about "
          f"{1 / (TRAIN_VOCAB - len(SPECIAL_TOKENS)):.3f}).", flush=True)
    result = train(steps, device, bf16)
    rows = None
    if not a.skip_memory:
        rows = compare(shape if shape is not None else measurement_shape(device, a.quick))
    print("\n" + verdict(result, rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
