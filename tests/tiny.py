"""Tiny Qwen2-architecture models, an offline tokenizer, a toy prompt dataset and its reward, for trainer tests; and
the one-step harness the trainer tests compare trainers with (``run_step``, ``rel_err``).

The models, tokenizer and prompts are ``fastrl.testing``'s (the public, documented copy), with the defaults the
tests were written against (eager attention). Nothing here touches the network. Shared by the GRPO and PPO trainer
tests; keep the API stable.

    tok = tiny_tokenizer(256)
    model = tiny_qwen2(vocab_size=256, hidden_size=32, layers=1, seed=0)
    ds = toy_prompt_dataset(tok, n=16)
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastrl.testing import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, tiny_prompts, tiny_tokenizer, word  # noqa: F401

__all__ = [
    "PAD_ID",
    "EOS_ID",
    "BOS_ID",
    "SPECIAL_TOKENS",
    "word",
    "tiny_tokenizer",
    "tiny_qwen2",
    "toy_prompts",
    "toy_prompt_dataset",
    "save_for_reference",
    "reward_even",
    "run_step",
    "rel_err",
]

def tiny_qwen2(
    vocab_size: int = 256,
    hidden_size: int = 32,
    layers: int = 1,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    *,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    **config_kwargs,
):
    """``fastrl.testing.tiny_model`` with eager attention (what the trainer tests were written against)."""
    from fastrl.testing import tiny_model

    return tiny_model(vocab_size, hidden_size, layers, seed=seed, heads=heads, kv_heads=kv_heads,
                      intermediate_size=intermediate_size, tie_word_embeddings=tie_word_embeddings, attn="eager",
                      dtype=dtype, **config_kwargs)


toy_prompts = tiny_prompts


def toy_prompt_dataset(tokenizer=None, n: int = 16, prompt_len: int = 4, vocab_size: int | None = None, seed: int = 0):
    """A ``datasets.Dataset`` with a standard-format ``prompt`` column of ``n`` toy prompts."""
    from fastrl.testing import tiny_prompt_dataset

    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else 256
    return tiny_prompt_dataset(n, prompt_len, vocab_size, seed)


def save_for_reference(model, path) -> str:
    """Save ``model`` to ``path`` and point its config there, so TRL (which builds the reference model for
    ``beta != 0`` from the policy's ``name_or_path``) loads the same weights offline. Returns the path."""
    path = str(path)
    model.save_pretrained(path)
    model.config._name_or_path = path
    return path


def reward_even(completions, **kwargs):
    """Fraction of even-numbered words: varies between completions from the start, so advantages are not 0."""
    out = []
    for c in completions:
        words = [w for w in c.split() if w[1:].isdigit()]
        out.append(sum(int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1))
    return out


def run_step(trainer, inputs) -> tuple[float, dict[str, torch.Tensor], dict[str, float]]:
    """One ``compute_loss`` + ``backward`` in train mode: (loss, gradients by parameter name, metrics logged)."""
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.item(), grads, metrics


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


class LargestAllocations(TorchDispatchMode):
    """Records ``(numel, op, shape)`` of every tensor an op allocates inside the block (views allocate nothing):
    ``max(rec.allocs)`` is the largest tensor a step held, e.g. to show no ``[tokens, vocab]`` logits exist."""

    def __init__(self):
        super().__init__()
        self.allocs: list[tuple[int, str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):
            return out  # a view allocates nothing
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.allocs.append((t.numel(), str(func), tuple(t.shape)))
        return out


def launch_two_gloo(script: Path, tmp_path, *worker_args: str, port_base: int) -> None:
    """Run ``script *worker_args tmp_path`` as two gloo processes on the CPU (``torch.distributed.run``); each
    test file picks its own ``port_base`` so that files run in parallel do not share a master port."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"), "ACCELERATE_USE_CPU": "true"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(port_base + os.getpid() % 1000), str(Path(script).resolve()), *worker_args, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def end_worker() -> None:
    """The last call of a two-gloo-process worker, after its results are written: wait for the other rank, destroy
    the process group, and leave with ``os._exit(0)``.

    Why not a normal exit: ``destroy_process_group`` drops only ``torch.distributed``'s own reference to the group.
    The trainers still hold it (the DDP reducer, accelerate's state), so gloo's C++ objects and threads live until
    the interpreter tears itself down, and that teardown (Python finalisers and C++ static destructors, in no set
    order, while gloo's threads still run) sometimes aborts: "terminate called without an active exception",
    SIGABRT, exit code -6, after every result was written, failing a finished launch. ``os._exit`` runs no
    finaliser and no static destructor: a rank that got here exits 0; one that failed earlier never gets here and
    exits with its error. ``tests/test_worker_exit.py`` checks that."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def param_diff_vs_rank0(model) -> tuple[torch.Tensor, float]:
    """(this rank's flattened parameters, their largest difference from rank 0's): 0.0 when DDP kept ranks in sync."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    other = flat.clone()
    dist.broadcast(other, src=0)
    return flat, (flat - other).abs().max().item()
