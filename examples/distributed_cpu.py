"""A two-process training run on the CPU: GRPO, then on-policy distillation, with tiny models built offline.

    accelerate launch --multi_gpu --num_processes 2 examples/distributed_cpu.py

``--multi_gpu`` names accelerate's multi-process launcher; ``use_cpu=True`` below joins the processes over gloo on a
machine without GPUs (``--cpu`` instead would start one process, whatever ``--num_processes`` says). Each process
trains on its share of the batch and the gradients are averaged over both (DistributedDataParallel). The script
ends like any other: fastrl's trainers take down the process group when the interpreter exits (docs/scaling-out.md),
so the launch exits 0 once both processes are done. About 15 s on 2 cores, mostly imports.
"""

from __future__ import annotations

import tempfile

from fastrl import DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer
from fastrl.testing import tiny_model, tiny_prompt_dataset, tiny_tokenizer


def reward(completions, **kwargs):  # the share of even-numbered words ("w2", "w4", ...) in each completion
    words = [[w for w in c.split() if w[1:].isdigit()] for c in completions]
    return [sum(int(w[1:]) % 2 == 0 for w in ws) / max(len(ws), 1) for ws in words]


def main() -> None:
    common = dict(use_cpu=True, bf16=False, max_steps=2, per_device_train_batch_size=4, max_completion_length=8,
                  logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True)
    with tempfile.TemporaryDirectory() as out:
        grpo = GRPOTrainer(model=tiny_model(), reward_funcs=reward, processing_class=tiny_tokenizer(),
                           args=GRPOConfig(output_dir=out, num_generations=4, **common),
                           train_dataset=tiny_prompt_dataset())
        grpo.train()
        distill = DistillationTrainer(model=tiny_model(seed=0), teacher_model=tiny_model(hidden_size=48, seed=1),
                                      processing_class=tiny_tokenizer(), train_dataset=tiny_prompt_dataset(),
                                      args=DistillationConfig(output_dir=out, beta=0.5, **common))
        distill.train()
        if grpo.accelerator.is_main_process:
            print(f"done: {grpo.state.global_step} GRPO steps and {distill.state.global_step} distillation steps "
                  f"on {grpo.accelerator.num_processes} processes")


if __name__ == "__main__":
    main()
