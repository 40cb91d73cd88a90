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
  ``fastrl.policy_loss`` on the hidden states, inside the model's forward (``grpo_loss.compute_loss_one_pass``). Otherwise
  (or with ``one_pass_loss=False``, or multimodal inputs) TRL's own ``_compute_loss`` runs on fastrl's log-probs
  and entropies. Both give TRL's numbers and TRL's metric names. (A build without ``fastrl.policy_loss`` uses
  its two-pass equivalent, ``fused_logprobs`` + ``policy_loss_from_logprobs``, on the same route.)
* ``TrainingHealthCallback`` is attached (``health_checks=False`` turns it off).
* ``sampling_replay`` (off by default): log-probs, entropies and the loss over the sampler's support, recorded at
  generation (``"kept_set"``) or replayed from the sampling settings (``"rule"``); see ``fastrl.trainers.sampling``.
* vLLM (``use_vllm=True``, ``fastrl.trainers.grpo_vllm``): the colocated engine samples at the policy's precision,
  with weights TRL's sync reaches on vLLM's CPU build, and with ``vllm_fp32_lm_head`` a float32 LM head; TRL's
  ``sampling/sampling_logp_difference/*`` and ``sampling/importance_sampling_ratio/*`` are logged whenever vLLM's
  log-probs exist (TRL: only with its IS correction on).
* ``kl_estimator`` (fastrl only; TRL hard-codes k3): ``"k1"``, ``"k2"`` or ``"exact"``. With ``"exact"`` (and
  ``beta != 0``) the KL term is the exact per-token ``KL(pi_theta || pi_ref)`` over the whole vocabulary
  (``fastrl.policy_loss(..., ref_hidden=, ref_weight=)``, i.e. ``fastrl.fused_divergence``); the trainer then keeps
  the reference model's last hidden states at the completion positions in the batch (``ref_hidden_states``,
  ``[B, K, H]``) instead of its log-probs (see ``GRPOTrainer._reference_hidden_states`` for why and what it costs).

Where each part lives: ``grpo_config`` (``GRPOConfig``, the loss-option checks), ``grpo_loss`` (the head install and
the one-pass loss, shared with ``fastrl.patch_trainer``), ``grpo_replay`` (sampling replay), ``grpo_vllm`` (the
colocated vLLM engine, what replay needs from TRL's vLLM generation, the sampler-gap metrics) and ``grpo_reference`` (the exact KL's reference capture).
"""

from __future__ import annotations

import trl

from fastrl.trainers._common import opt
from fastrl.trainers._distributed import check_launch
from fastrl.trainers._guards import (check_entropy_controller, check_fused_head_protocol, check_overrides,
                                     check_reference_pass_skip)
from fastrl.trainers.grpo_config import GRPOConfig, check_loss_options
from fastrl.trainers.grpo_loss import compute_loss_one_pass, exact_kl, fastrl_kl, install_fastrl_head, one_pass_reason
from fastrl.trainers.grpo_reference import ReferenceCaptureMixin, reference_from_instance, skip_trl_reference_pass
from fastrl.trainers.grpo_replay import SamplingReplayMixin
from fastrl.trainers.grpo_vllm import check_vllm_installed, check_vllm_replay_launch, log_sampling_gap, vllm_engine
from fastrl.trainers.memory import MemoryOptions, MemoryStepsMixin, trl_alias_warnings_silenced
from fastrl.trainers.sampling import check_replay_options

__all__ = ["GRPOConfig", "GRPOTrainer"]

# the trl.GRPOTrainer methods fastrl.GRPOTrainer overrides, with the leading parameters it takes and passes on
TRL_OVERRIDES = (
    ("_compute_loss", ("model", "inputs")),
    ("_generate_and_score_completions", ("inputs",)),
    ("_get_per_token_logps_and_entropies", ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                                            "compute_entropy", "compute_aux_loss")),
    ("_generate_single_turn", ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images")),
)


class GRPOTrainer(MemoryStepsMixin, SamplingReplayMixin, ReferenceCaptureMixin, trl.GRPOTrainer):
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
        check_launch(args, self)
        replay = opt(args, "sampling_replay", "off")
        check_replay_options(type(args).__name__, replay, opt(args, "log_kept_mass", False))
        check_vllm_replay_launch(args, replay)
        # what fastrl overrides and patches in TRL must be there (a clear error now, not stock TRL's numbers later)
        check_overrides(trl.GRPOTrainer, TRL_OVERRIDES, "fastrl.GRPOTrainer's overrides")
        if opt(args, "fused_loss", True):
            check_fused_head_protocol(trl.GRPOTrainer)
        if args.beta != 0.0 and opt(args, "kl_estimator", "k3") == "exact":
            check_reference_pass_skip(trl.GRPOTrainer)
        check_vllm_installed(args, replay)
        with vllm_engine(args, replay), reference_from_instance(model, args.beta):
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self._setup_sampling_replay(replay)
        if opt(self.args, "fused_loss", True):
            check_entropy_controller(self, trl.GRPOTrainer)  # the one-pass loss runs TRL's controller on TRL's state
            install_fastrl_head(
                self, backend=opt(self.args, "fastrl_backend", None),
                vocab_chunk=opt(self.args, "fastrl_vocab_chunk", None),
                chunk_tokens=opt(self.args, "fastrl_chunk_tokens", None),
            )
        if opt(self.args, "health_checks", True):
            from fastrl.trainers.health import TrainingHealthCallback

            self.add_callback(TrainingHealthCallback())
        # long completions: tiled MLPs from here until train() returns; offloading inside each training step
        self._fastrl_memory = MemoryOptions(
            self.model, {"policy": self.model, "reference model": getattr(self, "ref_model", None)},
            activation_offloading=opt(self.args, "activation_offloading", False),
            tiled_mlp=opt(self.args, "tiled_mlp", 0),
        )

    def _generate_and_score_completions(self, inputs):
        with trl_alias_warnings_silenced():
            if not exact_kl(self):
                output = self._generate_and_score_completions_replayed(inputs)
            else:
                # The exact KL needs the reference's hidden states, not its log-probs: TRL's reference pass (the only
                # place its generation reads beta) is skipped, and the hidden states are taken once per generation.
                with skip_trl_reference_pass(self):
                    output = self._generate_and_score_completions_replayed(inputs)
                output["ref_hidden_states"] = self._reference_hidden_states(output)
            # TRL's sampler-gap metrics, also with its IS correction off (from the loss pass's log-probs where it
            # takes fastrl's one-pass route)
            log_sampling_gap(self, output, loss_covers=one_pass_reason(self, output) is None)
            return output

    def _compute_loss(self, model, inputs):
        # which path the last loss took ("one_pass" or "trl"), for tests and debugging
        with self._loss_support(inputs):
            reason = one_pass_reason(self, inputs)
            if reason is None:
                self._fastrl_last_path = "one_pass"
                return compute_loss_one_pass(self, model, inputs)
            if fastrl_kl(self):
                raise ValueError(
                    f"GRPOConfig.kl_estimator={self.args.kl_estimator!r} needs fastrl's policy loss, which this batch "
                    f"cannot take ({reason}); TRL's loss math only computes the k3 estimate"
                )
            self._fastrl_last_path = "trl"
            return self._trl_loss_with_stats(model, inputs)
