"""How far a GRPO training step's gradients are from float64, in float32 and in bf16, stock TRL vs fastrl.

    python examples/bf16_fidelity.py            # CPU, about a minute; --vocab / --hidden / --tokens change the shape

One ``compute_loss`` + backward of ``trl.GRPOTrainer`` and ``fastrl.GRPOTrainer`` on the same tiny random Qwen2 and
the same batch of completions (TRL's default dapo loss, on-policy), under ``bf16=False`` (float32) and
``bf16=True`` (accelerate's bf16 autocast, TRL's default, which stays on with ``use_cpu=True``). The ground truth is
stock TRL's step with the model in float64. Printed per run: the loss and the relative error of all parameter
gradients together, ``|g - g64| / |g64|`` (on-policy the loss's value is the same in every run; its gradient is
not). Offline (``fastrl.testing``'s model and tokenizer); needs the ``trl``
extra.
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import torch


def step(which: str, model, tok, inputs: dict, bf16: bool) -> tuple[float, torch.Tensor]:
    """(loss, flattened float64 gradients) of one compute_loss + backward."""
    import trl
    from datasets import Dataset

    import fastrl

    cls, cfg = (trl.GRPOTrainer, trl.GRPOConfig) if which == "trl" else (fastrl.GRPOTrainer, fastrl.GRPOConfig)
    b = inputs["completion_ids"].shape[0]
    kw = dict(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=bf16, report_to="none", save_strategy="no",
              per_device_train_batch_size=b, num_generations=b, max_completion_length=inputs["completion_ids"].shape[1],
              disable_tqdm=True, activation_checkpointing=False)
    if which == "fastrl":
        kw["health_checks"] = False
    trainer = cls(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=cfg(**kw),
                  processing_class=tok, train_dataset=Dataset.from_dict({"prompt": ["w1"] * b}))
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(trainer.model, dict(inputs))
    trainer.accelerator.backward(loss)
    grads = torch.cat([p.grad.detach().double().reshape(-1) for p in trainer.model.parameters() if p.grad is not None])
    return float(loss.detach()), grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens per sequence (4 sequences)")
    a = ap.parse_args()
    from fastrl.testing import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer(a.vocab, model_max_length=1 << 16)
    base = tiny_model(a.vocab, a.hidden, 2, seed=0)
    g = torch.Generator().manual_seed(0)
    b, p, c = 4, 8, a.tokens
    inputs = dict(prompt_ids=torch.randint(3, a.vocab, (b, p), generator=g), prompt_mask=torch.ones(b, p, dtype=torch.long),
                  completion_ids=torch.randint(3, a.vocab, (b, c), generator=g),
                  completion_mask=torch.ones(b, c, dtype=torch.long), advantages=torch.randn(b, generator=g))
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    loss64, g64 = step("trl", copy.deepcopy(base).double(), tok, inputs, bf16=False)
    print(f"V={a.vocab} H={a.hidden} 2 layers, {b} x {c} completion tokens, dapo; ground truth: stock TRL in float64, "
          f"loss {loss64:+.8f}")
    for bf16 in (False, True):
        for which in ("trl", "fastrl"):
            loss, grads = step(which, copy.deepcopy(base), tok, inputs, bf16=bf16)
            err = ((grads - g64).norm() / g64.norm()).item()
            print(f"{'bf16 autocast' if bf16 else 'float32':>13}  {which:>6}: loss {loss:+.8f}, "
                  f"gradients {err:.2e} relative from float64")


if __name__ == "__main__":
    main()
