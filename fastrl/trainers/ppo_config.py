"""``PPOConfig``: the options of TRL's PPOv2 trainer (trl 0.11-0.19), as ``transformers.TrainingArguments``.

Names, defaults and command-line flags are TRL's (its ``OnPolicyConfig`` + ``PPOConfig``), so the command lines of
TRL's PPO documentation parse unchanged. Differences, each on purpose:

- ``kl_estimator`` also accepts ``"k2"`` (fastrl computes all three; TRL offered k1 and k3) and ``"exact"``: the
  per-token KL in the non-score reward is then ``KL(pi || pi_ref)`` over the whole vocabulary at each response
  position (never negative, no sampling noise), from both models' last hidden states during the rollout, without
  materialising logits (``fastrl.fused_divergence`` with beta=1; one pass over both LM heads per rollout chunk
  instead of the reference's log-prob pass).
- The older (trl <= 0.11) ``non_eos_penalty`` / ``penalty_reward_value`` pair is accepted next to
  ``missing_eos_penalty``; setting both styles at once is an error instead of a silent double penalty.
- ``generation_kwargs`` (as in TRL's GRPOConfig) overrides the rollout sampling settings; settings known to make
  the KL estimate negative are warned about.
- ``health_checks`` attaches fastrl's ``TrainingHealthCallback`` (on by default).
- ``activation_offloading`` and ``tiled_mlp``: long completions on limited memory (``fastrl.trainers.memory``), as
  in fastrl's ``GRPOConfig``.
- ``sampling_replay`` / ``log_kept_mass``: log-probs (rollout, reference, updates) over the sampler's support, as in
  fastrl's ``GRPOConfig`` (``fastrl.trainers.sampling``); ``"off"`` keeps TRL's numbers.
- ``logging_dir``: TensorBoard's log directory. transformers 5 dropped this TrainingArguments field (it reads
  ``TENSORBOARD_LOGGING_DIR``); PPO's documented ``--logging_dir`` flag is kept and handed to the TensorBoard
  callback by the trainer.
- ``bf16`` keeps TrainingArguments' default (False); TRL's later OnPolicyConfig turned it on unless fp16 was set,
  which on a CPU-only machine gives slow bf16 autocast. Pass ``--bf16`` on GPUs.

The batch sizes TRL computed into the config (``local_batch_size``, ``micro_batch_size``, ``batch_size``,
``mini_batch_size``, ``local_mini_batch_size``, ``num_total_batches``) are filled in by ``PPOTrainer``:

    local_batch_size      = per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches
    batch_size            = local_batch_size * world_size            (prompts per update, all processes)
    local_mini_batch_size = local_batch_size / num_mini_batches      (one optimizer step)
    num_total_batches     = ceil(total_episodes / batch_size)        (updates; may overshoot total_episodes)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Literal

from transformers import TrainingArguments

from fastrl.trainers.memory import check_memory_options
from fastrl.trainers.sampling import check_replay_options

__all__ = ["PPOConfig"]

_KL_ESTIMATORS = ("k1", "k2", "k3", "exact")


@dataclass
class PPOConfig(TrainingArguments):
    r"""Configuration of ``fastrl.PPOTrainer`` (TRL PPOv2's options; see the module docstring for differences).

    Rollout: ``response_length`` new tokens sampled at ``temperature`` (top-k off, top-p 1, no minimum length),
    ``local_rollout_forward_batch_size`` sequences per generation / scoring forward; ``stop_token="eos"`` (or
    ``stop_token_id``) truncates each response after its first stop token. Rewards: the reward model's score,
    lowered for responses without EOS (``missing_eos_penalty``, or ``non_eos_penalty`` + ``penalty_reward_value``),
    plus ``-kl_coef * kl`` per token (``kl_estimator``); optionally whitened (``whiten_rewards``). Advantages: GAE
    (``gamma``, ``lam``), whitened. Updates: ``num_ppo_epochs`` passes over the rollout in ``num_mini_batches``
    minibatches; loss ``pg + vf_coef * vf`` with ratio clipping ``cliprange`` and value clipping
    ``cliprange_value``. ``total_episodes`` prompts in all (default ``num_train_epochs * len(train_dataset)``).
    """

    # --- TRL OnPolicyConfig -------------------------------------------------------------------------------------
    run_name: str | None = field(default=None, metadata={"help": "Name of the run (default: exp_name__seed__time)."})
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Number of processes to use for processing the dataset."})
    num_mini_batches: int = field(default=1, metadata={"help": "Number of minibatches to split a batch into."})
    total_episodes: int | None = field(
        default=None, metadata={"help": "Total number of episodes (prompts) in the run; default num_train_epochs * len(train_dataset)."}
    )
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Per rank no grad forward pass in the rollout phase."}
    )
    num_sample_generations: int = field(
        default=10,
        metadata={"help": "Number of debugging samples generations (i.e., `generate_completions` calls) throughout training; 0 = none."},
    )
    response_length: int = field(default=53, metadata={"help": "Length of the response."})
    stop_token: Literal["eos"] | None = field(
        default=None,
        metadata={"help": "Specifies the stop token to use for text generation ('eos' or None). Mutually exclusive with stop_token_id."},
    )
    stop_token_id: int | None = field(
        default=None, metadata={"help": "Specifies the ID of the stop token to use for text generation."}
    )
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature."})
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Penalty subtracted from the score of completions that do not contain an EOS token."},
    )
    non_eos_penalty: bool = field(
        default=False,
        metadata={"help": "(trl <= 0.11) Replace the score of completions without EOS by penalty_reward_value."},
    )
    penalty_reward_value: float = field(
        default=-1.0, metadata={"help": "(trl <= 0.11) Score given to completions without EOS when non_eos_penalty is set."}
    )
    sft_model_path: str = field(default="EleutherAI/pythia-160m", metadata={"help": "Path to the SFT model."})
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={"help": "Gather the policy weights for generation under DeepSpeed ZeRO-3 (faster, more memory)."},
    )
    # sizes computed by the trainer (TRL kept them in the config too)
    num_total_batches: int | None = field(default=None, metadata={"help": "Number of updates (computed)."})
    micro_batch_size: int | None = field(default=None, metadata={"help": "per_device_train_batch_size * world_size (computed)."})
    local_batch_size: int | None = field(default=None, metadata={"help": "Prompts per update per process (computed)."})
    batch_size: int | None = field(default=None, metadata={"help": "Prompts per update, all processes (computed)."})
    local_mini_batch_size: int | None = field(default=None, metadata={"help": "Minibatch size per process (computed)."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "Minibatch size across processes (computed)."})

    # --- TRL PPOConfig ------------------------------------------------------------------------------------------
    exp_name: str = field(default="ppo", metadata={"help": "Name of this experiment."})
    reward_model_path: str = field(default="EleutherAI/pythia-160m", metadata={"help": "Path to the reward model."})
    model_adapter_name: str | None = field(
        default=None, metadata={"help": "Name of the train target PEFT adapter, when using LoRA with multiple adapters."}
    )
    ref_adapter_name: str | None = field(
        default=None, metadata={"help": "Name of the reference PEFT adapter, when using LoRA with multiple adapters."}
    )
    num_ppo_epochs: int = field(default=4, metadata={"help": "Number of epochs to train."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whether to whiten the rewards."})
    kl_coef: float = field(default=0.05, metadata={"help": "KL coefficient."})
    kl_estimator: Literal["k1", "k2", "k3", "exact"] = field(
        default="k1",
        metadata={"help": "KL estimator: 'k1' (unbiased, can be negative), 'k3' (unbiased, never negative, lower variance), 'k2', "
                          "'exact' (the whole-vocabulary KL at each position)."},
    )
    cliprange: float = field(default=0.2, metadata={"help": "Clip range."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value function coefficient."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range for the value function."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "Lambda value for GAE."})

    # --- fastrl ---------------------------------------------------------------------------------------------------
    generation_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Extra transformers GenerationConfig settings for the rollout (JSON on the command line); "
                          "anything but full-distribution sampling makes the KL estimate biased."},
    )
    health_checks: bool = field(
        default=True, metadata={"help": "Attach fastrl's TrainingHealthCallback (PPO cookbook checks)."}
    )
    logging_dir: str | None = field(
        default=None, metadata={"help": "TensorBoard log directory (default: output_dir/runs/...)."}
    )
    activation_offloading: bool = field(
        default=False,
        metadata={"help": "Offload the activations saved for backward to CPU memory in each training micro-batch "
                          "(TRL's OffloadActivations; no effect on CPU)."},
    )
    tiled_mlp: int = field(
        default=0,
        metadata={"help": "Run every decoder MLP (policy, value, reference, reward) over this many token chunks, "
                          "recomputed in backward (0: off)."},
    )
    sampling_replay: str = field(
        default="off",
        metadata={"help": "Log-probs over the sampler's support: 'off' (full softmax, TRL's numbers), 'kept_set' "
                          "(recorded in generate after every warper) or 'rule' (top_k / top_p / min_p / "
                          "min_new_tokens replayed on each model's logits)."},
    )
    log_kept_mass: bool = field(
        default=False,
        metadata={"help": "Log sampling/kept_mass_mean, the policy's full-softmax mass of the support at the rollout "
                          "(one extra forward pass over the vocabulary)."},
    )

    def __post_init__(self):
        if isinstance(self.generation_kwargs, str):
            try:
                self.generation_kwargs = json.loads(self.generation_kwargs)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"generation_kwargs must be a JSON object (e.g. '{{\"top_k\": 0}}'), got {self.generation_kwargs!r}: {e}"
                ) from None
        super().__post_init__()
        if self.kl_estimator not in _KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {_KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.stop_token is not None and self.stop_token != "eos":
            raise ValueError(f"stop_token must be 'eos' or None (use stop_token_id for other tokens), got {self.stop_token!r}")
        if self.stop_token is not None and self.stop_token_id is not None:
            raise ValueError("You cannot set both `stop_token` and `stop_token_id`.")
        if self.missing_eos_penalty is not None and self.non_eos_penalty:
            raise ValueError(
                "set either missing_eos_penalty (subtract a penalty) or non_eos_penalty + penalty_reward_value "
                "(replace the score), not both"
            )
        for name in ("num_ppo_epochs", "num_mini_batches", "response_length", "local_rollout_forward_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_sample_generations < 0:
            raise ValueError(f"num_sample_generations must be >= 0, got {self.num_sample_generations!r}")
        if self.total_episodes is not None and self.total_episodes < 1:
            raise ValueError(f"total_episodes must be None or >= 1, got {self.total_episodes!r}")
        for name in ("cliprange", "cliprange_value", "kl_coef", "vf_coef", "temperature", "gamma", "lam"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("gamma", "lam"):  # a discount or GAE lambda above 1 makes the returns grow without bound
            if getattr(self, name) > 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.generation_kwargs is not None and not isinstance(self.generation_kwargs, dict):
            raise ValueError(f"generation_kwargs must be a dict (or a JSON object string), got {self.generation_kwargs!r}")
        check_memory_options(self.activation_offloading, self.tiled_mlp)
        check_replay_options("PPOConfig", self.sampling_replay, self.log_kept_mass)
