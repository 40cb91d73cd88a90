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

At the end, a clean exit: a process group still alive when the interpreter exits is torn down with it, and that
teardown (Python finalisers and C++ static destructors in no set order while gloo's or NCCL's threads still run)
can abort a finished run ("terminate called without an active exception", exit code -6). ``destroy_process_group``
alone does not prevent it: it drops only ``torch.distributed``'s reference, and the trainers still hold the group
through their wrapped models (the DDP reducer, a DeepSpeed engine) and optimizers. So every fastrl trainer in a
process group is remembered (weakly); at interpreter exit, before that teardown, :func:`finish` drops what each
still holds of the group and destroys it, unless the script did (``fastrl.finish()`` at its end does the same,
after a barrier, for scripts that want it explicit).
"""

from __future__ import annotations

import atexit
import gc
import os
import weakref

__all__ = ["check_launch", "finish", "release_at_exit"]


def _uses_deepspeed(args) -> bool:
    return bool(getattr(args, "deepspeed", None)) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"


def name_deepspeed_cpu() -> None:
    """Set ``DS_ACCELERATOR=cpu`` where torch sees no CUDA device and nobody set it (the choice DeepSpeed's
    auto-detection would make, without its warning); a set value and a machine with CUDA are left alone."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def check_launch(args, trainer=None) -> None:
    """Raise ``ValueError`` if ``torch.distributed`` runs more processes than ``args`` (TrainingArguments) counts;
    under DeepSpeed, initialise DeepSpeed's communication over the existing process group if nothing did. On a
    machine without CUDA, name DeepSpeed's accelerator first (:func:`name_deepspeed_cpu`). ``trainer`` (the one
    being built) is remembered for a clean exit (:func:`release_at_exit`)."""
    import torch.distributed as dist

    name_deepspeed_cpu()
    if trainer is not None:
        release_at_exit(trainer)

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


# ------------------------------------------------------------------------------------------------------------------
# A clean exit
# ------------------------------------------------------------------------------------------------------------------

_TRAINERS: weakref.WeakSet = weakref.WeakSet()  # fastrl trainers built in this process (dead ones drop out)
_HOOKED = False
# objects that hold a process group in C++ (the DDP reducer, DeepSpeed's engine, FSDP's state, TRL's
# DistributedBackend): named, not imported, so that nothing here imports DeepSpeed or TRL
_GROUP_HOLDERS = ("DistributedDataParallel", "DeepSpeedEngine", "PipelineEngine", "FullyShardedDataParallel",
                  "DistributedBackend")


def release_at_exit(trainer) -> None:
    """Remember ``trainer`` so that :func:`finish` can release what it holds of the process group, and register
    :func:`finish` to run at interpreter exit (once per process). Called by fastrl's trainers when built."""
    global _HOOKED
    _TRAINERS.add(trainer)
    if not _HOOKED:
        atexit.register(_finish_at_exit)
        _HOOKED = True


def _release(trainer) -> None:
    """Drop the trainer's references to the process group: its wrapped models (replaced by the modules they
    wrap), optimizer and scheduler, and what its accelerator keeps of them."""
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        accelerator.free_memory()
    for name, value in list(vars(trainer).items()):
        if type(value).__name__ in _GROUP_HOLDERS:
            setattr(trainer, name, getattr(value, "module", None))
    for name in ("optimizer", "lr_scheduler"):
        if getattr(trainer, name, None) is not None:
            setattr(trainer, name, None)


def finish(barrier: bool = True) -> None:
    """End a distributed run cleanly: wait for every process (``barrier=True``), release what fastrl's trainers
    hold of the process group, and destroy it, so that nothing of gloo or NCCL is left for the interpreter's exit
    to tear down. Does nothing outside a process group. Call it last: the trainers cannot train or save through
    the group afterwards (save the models before); their unwrapped models stay.

    fastrl's trainers run this (without the barrier) at interpreter exit when the script has not: a script needs
    no call of its own. Call it yourself to end the group at a point of your choosing, e.g. before work that
    outlives the run in the same process.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if barrier:
        dist.barrier()
    for trainer in list(_TRAINERS):
        _release(trainer)
    gc.collect()  # the wrappers sit in reference cycles: free them (and the group with them) now
    if dist.is_initialized():
        dist.destroy_process_group()


def _finish_at_exit() -> None:
    # No barrier at exit: a process that exits on an error would wait at it for a peer still training (until the
    # backend's timeout) instead of exiting and letting the launcher stop the others.
    try:
        finish(barrier=False)
    except Exception as e:  # an exit hook must not turn a finished run into a failed one
        import sys

        print(f"fastrl: releasing the process group at exit failed ({type(e).__name__}: {e})", file=sys.stderr)
