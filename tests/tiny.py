"""Tiny Qwen2-architecture models, an offline tokenizer, a toy prompt dataset and its reward, for trainer tests and
demos; and the one-step harness the trainer tests compare trainers with (``run_step``, ``rel_err``).

Nothing here touches the network: the model is built from a ``Qwen2Config`` with random weights and the
tokenizer from the ``tokenizers`` library (a word-level vocabulary ``<pad> <eos> <bos> w0 w1 ...``), wrapped in
a ``transformers.PreTrainedTokenizerFast``. Shared by the GRPO and PPO trainer tests; keep the API stable.

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

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")


def word(i: int) -> str:
    """The text of the i-th ordinary token (token id ``i + len(SPECIAL_TOKENS)``)."""
    return f"w{i}"


def tiny_tokenizer(vocab_size: int = 256):
    """A ``PreTrainedTokenizerFast`` over ``vocab_size`` tokens: 3 specials then ``w0 w1 ...``; left padding.

    Text is split on whitespace; decoding joins tokens with single spaces (specials skipped on request).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be > {len(SPECIAL_TOKENS)}, got {vocab_size}")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for i in range(vocab_size - len(SPECIAL_TOKENS)):
        vocab[word(i)] = i + len(SPECIAL_TOKENS)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins word-level tokens with spaces
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        padding_side="left",
        model_max_length=4096,
    )
    return out


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
    """A randomly initialised ``Qwen2ForCausalLM`` (eager attention), special ids matching ``tiny_tokenizer``.

    ``config_kwargs`` go to ``Qwen2Config`` (e.g. ``max_position_embeddings``).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=config_kwargs.pop("max_position_embeddings", 8192),
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        **config_kwargs,
    )
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model = model.to(dtype)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = BOS_ID
    return model


def toy_prompts(n: int = 16, prompt_len: int = 4, vocab_size: int = 256, seed: int = 0) -> list[str]:
    """``n`` prompts of ``prompt_len`` random ordinary words (deterministic in ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    n_words = vocab_size - len(SPECIAL_TOKENS)
    ids = torch.randint(0, n_words, (n, prompt_len), generator=g)
    return [" ".join(word(int(i)) for i in row) for row in ids]


def toy_prompt_dataset(tokenizer=None, n: int = 16, prompt_len: int = 4, vocab_size: int | None = None, seed: int = 0):
    """A ``datasets.Dataset`` with a standard-format ``prompt`` column of ``n`` toy prompts."""
    from datasets import Dataset

    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else 256
    return Dataset.from_dict({"prompt": toy_prompts(n, prompt_len, vocab_size, seed)})


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


def param_diff_vs_rank0(model) -> tuple[torch.Tensor, float]:
    """(this rank's flattened parameters, their largest difference from rank 0's): 0.0 when DDP kept ranks in sync."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    other = flat.clone()
    dist.broadcast(other, src=0)
    return flat, (flat - other).abs().max().item()
