"""Tiny offline models, a tokenizer and prompts, to try fastrl's trainers (and to test them) without a download.

    from fastrl.testing import tiny_model, tiny_prompt_dataset, tiny_tokenizer

    tok = tiny_tokenizer(256)                     # word-level: <pad> <eos> <bos> w0 w1 ... w252
    model = tiny_model(vocab_size=256, hidden_size=32, layers=1, seed=0)   # a random Qwen2ForCausalLM
    dataset = tiny_prompt_dataset(n=16, vocab_size=256)                     # a "prompt" column: "w17 w3 w250 w9"

Nothing touches the network: the model is built from a ``Qwen2Config`` with random weights (so its completions are
random words until it is trained), the tokenizer from the ``tokenizers`` library, wrapped in a
``transformers.PreTrainedTokenizerFast``. Needs the ``trl`` extra (transformers, tokenizers, datasets). The ids of
the special tokens match between the two: pad 0, eos 1, bos 2.

A policy built here and passed to ``fastrl.GRPOTrainer`` as an object works with ``beta != 0`` too: the reference
model is then a copy of it (TRL would try to load the policy's ``name_or_path``, which an in-memory model lacks).
"""

from __future__ import annotations

import torch

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "SPECIAL_TOKENS", "tiny_model", "tiny_prompt_dataset", "tiny_prompts",
           "tiny_tokenizer", "word"]

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2


def word(i: int) -> str:
    """The text of the i-th ordinary token (token id ``i + len(SPECIAL_TOKENS)``)."""
    return f"w{i}"


def tiny_tokenizer(vocab_size: int = 256, *, model_max_length: int = 4096):
    """A ``PreTrainedTokenizerFast`` over ``vocab_size`` tokens: ``<pad> <eos> <bos>`` then ``w0 w1 ...``, left
    padding (what generation-based trainers want). Text is split on whitespace; decoding joins tokens with single
    spaces (the specials skipped on request)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be an int > {len(SPECIAL_TOKENS)}, got {vocab_size!r}")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): i + len(SPECIAL_TOKENS) for i in range(vocab_size - len(SPECIAL_TOKENS))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins word-level tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   padding_side="left", model_max_length=model_max_length)


def tiny_model(
    vocab_size: int = 256,
    hidden_size: int = 32,
    layers: int = 1,
    *,
    seed: int = 0,
    heads: int = 2,
    kv_heads: int = 1,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = False,
    attn: str = "sdpa",
    dtype: torch.dtype | str = torch.float32,
    max_position_embeddings: int = 8192,
    **config_kwargs,
):
    """A randomly initialised ``Qwen2ForCausalLM``, its special ids those of ``tiny_tokenizer``.

    The weights depend on the arguments and ``seed`` only (the caller's random state is left as it was).
    ``attn``: the attention implementation (``"sdpa"``, transformers' default, or ``"eager"``); ``dtype`` a
    ``torch.dtype`` or its name; ``config_kwargs`` go to ``Qwen2Config``.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID, **config_kwargs,
    )
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model = model.to(dtype)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = PAD_ID, EOS_ID, BOS_ID
    return model


def tiny_prompts(n: int = 16, prompt_len: int = 4, vocab_size: int = 256, seed: int = 0) -> list[str]:
    """``n`` prompts of ``prompt_len`` random ordinary words (deterministic in ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size - len(SPECIAL_TOKENS), (n, prompt_len), generator=g)
    return [" ".join(word(int(i)) for i in row) for row in ids]


def tiny_prompt_dataset(n: int = 16, prompt_len: int = 4, vocab_size: int = 256, seed: int = 0):
    """A ``datasets.Dataset`` with a standard-format ``prompt`` column of ``tiny_prompts``."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": tiny_prompts(n, prompt_len, vocab_size, seed)})
