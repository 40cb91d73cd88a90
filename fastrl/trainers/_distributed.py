"""Launch checks shared by fastrl's trainers (run in their constructors, before any model is prepared).

Two things go wrong when ``accelerate launch`` runs a DeepSpeed config on a machine without GPUs (the CPU test
launches; on GPUs accelerate does both itself):

* Without ``use_cpu=True`` in the ``TrainingArguments``, accelerate's state counts one process although DeepSpeed
  has joined all of them: each would train alone, and DeepSpeed stops later at its batch-size check
  (``train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size``). Said plainly here.
* With ``use_cpu=True`` accelerate joins the processes through ``torch.distributed`` but leaves DeepSpeed's own
  communication uninitialised, so a model built under ZeRO-3's ``zero.Init`` after the trainer exists (TRL's GRPO
  reference model, ``beta != 0``) sees one process and fails the same batch-size check. Initialised here, over
  the process group accelerate created.

And one that is only noise: where DeepSpeed is installed, accelerate imports it while any trainer is built, and on a
machine without a CUDA device DeepSpeed's accelerator auto-detection warns "Setting accelerator to CPU. If you have
GPU or other accelerator, we were unable to detect it." on every run. There the CPU is its only choice; naming it
(``DS_ACCELERATOR=cpu``, DeepSpeed's own setting) makes the same choice without the warning.
"""

from __future__ import annotations

import os

__all__ = ["check_launch"]


def _uses_deepspeed(args) -> bool:
    return bool(getattr(args, "deepspeed", None)) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"


def name_deepspeed_cpu() -> None:
    """Set ``DS_ACCELERATOR=cpu`` where torch sees no CUDA device and nobody set it (the choice DeepSpeed's
    auto-detection would make, without its warning); a set value and a machine with CUDA are left alone."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def check_launch(args) -> None:
    """Raise ``ValueError`` if ``torch.distributed`` runs more processes than ``args`` (TrainingArguments) counts;
    under DeepSpeed, initialise DeepSpeed's communication over the existing process group if nothing did. On a
    machine without CUDA, name DeepSpeed's accelerator first (:func:`name_deepspeed_cpu`)."""
    import torch.distributed as dist

    name_deepspeed_cpu()

    if not (dist.is_available() and dist.is_initialized()):
        return
    launched, counted = dist.get_world_size(), args.world_size
    if launched != counted:
        raise ValueError(
            f"torch.distributed runs {launched} processes, but the TrainingArguments set up {counted}: "
            "on a machine without GPUs accelerate joins the processes only with use_cpu=True (--use_cpu true); "
            "without it each process would train alone (under DeepSpeed it stops at DeepSpeed's batch-size check)."
        )
    if _uses_deepspeed(args):
        import deepspeed.comm

        if not deepspeed.comm.is_initialized():
            deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
