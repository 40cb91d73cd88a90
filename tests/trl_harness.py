"""Drive TRL 1.16's real ``GRPOTrainer._compute_loss`` on given per-token tensors, without a model.

The trainer object is made with ``GRPOTrainer.__new__`` (no ``__init__``: no model, dataset or accelerate state) and
given exactly the attributes ``_compute_loss`` and the helpers it calls (``get_high_entropy_mask``,
``get_off_policy_mask``, ``get_gamma_weights``) read; anything else it touched would raise ``AttributeError``,
because ``args`` is a ``SimpleNamespace`` and the trainer has no ``__init__``-set state. Its
``_get_per_token_logps_and_entropies`` is replaced on the instance to return the caller's tensors unchanged, so
the autograd graph is kept and ``torch.autograd.grad`` works through TRL's own loss.

Settings are those of one process, gradient accumulation 1, ``steps_per_generation`` 1, train mode, no MoE aux
loss, static entropy coefficient: the setting in which ``fastrl.reference.policy_loss_from_logprobs`` is defined.

    trainer = make_grpo_trainer(loss_type="dapo", epsilon=0.2, beta=0.04)
    loss, metrics = trl_compute_loss(trainer, logps, entropies, advantages, mask, ref_logprobs=ref)
    # or, from a fastrl config:  make_grpo_trainer(**trl_kwargs_from_config(config))

``metrics`` are TRL's logged floats for this call (``trainer._metrics["train"][key][-1]``), keyed without the
"train/" prefix.
"""

from __future__ import annotations

import types
from collections import defaultdict

import torch
from trl import GRPOTrainer

__all__ = ["OneProcessAccelerator", "make_grpo_trainer", "trl_kwargs_from_config", "trl_compute_loss"]


class OneProcessAccelerator:
    """The collective operations ``_compute_loss`` calls, as accelerate performs them with one process."""

    num_processes = 1
    sync_gradients = True  # every micro-batch ends an optimizer step with gradient accumulation 1

    @staticmethod
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(1) if tensor.dim() == 0 else tensor  # accelerate gathers 0-dim tensors to [1]

    gather_for_metrics = gather

    @staticmethod
    def reduce(tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        assert reduction == "sum", reduction
        return tensor

    @staticmethod
    def pad_across_processes(tensor: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor:
        return tensor


def make_grpo_trainer(
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = True,
    entropy_coef: float = 0.0,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = 512,
    sapo_temperature_neg: float = 1.05,
    sapo_temperature_pos: float = 1.0,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    top_entropy_quantile: float = 1.0,
    off_policy_mask_threshold: float | None = None,
    use_vllm_importance_sampling: bool = False,
) -> GRPOTrainer:
    """A ``GRPOTrainer`` holding only what ``_compute_loss`` reads; arguments are ``GRPOConfig``'s (TRL names).

    The derived attributes follow ``GRPOTrainer.__init__``: ``epsilon_low = epsilon``, ``epsilon_high`` defaulting
    to ``epsilon``, ``_entropy_bonus_enabled = entropy_coef != 0``. ``use_vllm_importance_sampling`` sets
    ``use_vllm`` and ``vllm_importance_sampling_correction``, which make ``_compute_loss`` multiply in the
    ``importance_sampling_ratio`` input (and VESPO read it).
    """
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.args = types.SimpleNamespace(
        delta=delta,
        use_bias_correction_kl=use_bias_correction_kl,
        sapo_temperature_neg=sapo_temperature_neg,
        sapo_temperature_pos=sapo_temperature_pos,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
        steps_per_generation=1,
    )
    trainer.loss_type = loss_type
    trainer.epsilon_low = epsilon
    trainer.epsilon_high = epsilon_high if epsilon_high is not None else epsilon
    trainer.beta = beta
    trainer.importance_sampling_level = importance_sampling_level
    trainer.max_completion_length = max_completion_length
    trainer.top_entropy_quantile = top_entropy_quantile
    trainer.off_policy_mask_threshold = off_policy_mask_threshold
    trainer.use_vllm = use_vllm_importance_sampling
    trainer.vllm_importance_sampling_correction = use_vllm_importance_sampling
    trainer.entropy_coef = entropy_coef
    trainer.use_adaptive_entropy = False
    trainer._entropy_bonus_enabled = entropy_coef != 0.0
    trainer.aux_loss_enabled = False
    trainer.current_gradient_accumulation_steps = 1
    trainer.model = types.SimpleNamespace(training=True)
    trainer.accelerator = OneProcessAccelerator()
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return trainer


def trl_kwargs_from_config(config) -> dict:
    """``make_grpo_trainer`` keyword arguments for a ``fastrl.losses.config.PolicyLossConfig``.

    ``kl_estimator`` has no TRL counterpart (TRL hard-codes k3) and ``temperature`` is not read by the loss.
    """
    if config.kl_estimator != "k3" and config.beta != 0.0:
        raise ValueError(f"TRL 1.16 only has the k3 KL estimator, got kl_estimator={config.kl_estimator!r}")
    return dict(
        loss_type=config.loss_type,
        epsilon=config.epsilon_low,
        epsilon_high=config.epsilon_high,
        delta=config.delta,
        beta=config.beta,
        use_bias_correction_kl=config.use_bias_correction_kl,
        entropy_coef=config.entropy_coef,
        importance_sampling_level=config.importance_sampling_level,
        max_completion_length=config.max_completion_length,
        sapo_temperature_neg=config.sapo_temperature_neg,
        sapo_temperature_pos=config.sapo_temperature_pos,
        vespo_k_pos=config.vespo_k_pos,
        vespo_lambda_pos=config.vespo_lambda_pos,
        vespo_k_neg=config.vespo_k_neg,
        vespo_lambda_neg=config.vespo_lambda_neg,
        top_entropy_quantile=config.top_entropy_quantile,
        off_policy_mask_threshold=config.off_policy_mask_threshold,
    )


def trl_compute_loss(
    trainer: GRPOTrainer,
    logprobs: torch.Tensor,  # [B, T], may require grad
    entropy: torch.Tensor,  # [B, T], may require grad (TRL always computes entropies)
    advantages: torch.Tensor,  # [B] or [B, T]
    mask: torch.Tensor,  # [B, T] bool or 0/1; handed to TRL as int64, as its completion_mask is
    *,
    old_logprobs: torch.Tensor | None = None,  # [B, T]
    ref_logprobs: torch.Tensor | None = None,  # [B, T]
    importance_weights: torch.Tensor | None = None,  # [B] or [B, T]
    num_items_in_batch: torch.Tensor | int | None = None,  # default: mask.sum(), TRL's value on one process
    sampling_logprobs: torch.Tensor | None = None,  # [B, T]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run TRL's ``_compute_loss`` on these per-token tensors; return its loss and the metrics it logged."""
    B, T = logprobs.shape
    completion_mask = mask.to(torch.int64)
    if num_items_in_batch is None:
        num_items_in_batch = completion_mask.sum()
    inputs = {
        "prompt_ids": torch.zeros(B, 0, dtype=torch.int64),
        "prompt_mask": torch.zeros(B, 0, dtype=torch.int64),
        "completion_ids": torch.zeros(B, T, dtype=torch.int64),
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": torch.as_tensor(num_items_in_batch),
    }
    if old_logprobs is not None:
        inputs["old_per_token_logps"] = old_logprobs
    if ref_logprobs is not None:
        inputs["ref_per_token_logps"] = ref_logprobs
    if sampling_logprobs is not None:
        inputs["sampling_per_token_logps"] = sampling_logprobs
    if importance_weights is not None:
        if not trainer.use_vllm:
            raise ValueError("importance_weights need make_grpo_trainer(use_vllm_importance_sampling=True)")
        # TRL's sequence-level vLLM IS ratio is [B, 1]
        inputs["importance_sampling_ratio"] = importance_weights[:, None] if importance_weights.dim() == 1 \
            else importance_weights

    def per_token_logps_and_entropies(*args, **kwargs):
        return logprobs, entropy, None

    trainer._get_per_token_logps_and_entropies = per_token_logps_and_entropies
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    loss = trainer._compute_loss(None, inputs)
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
    return loss, metrics
