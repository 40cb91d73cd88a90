"""``PPOTrainer``: TRL's PPOv2 trainer (trl 0.11-0.19; TRL 1.16 no longer ships it), on fastrl's fused losses.

Same constructor, options (``PPOConfig``), rollout, reward shaping, GAE, minibatch loop and metric names as TRL's
``trl/trainer/ppo_trainer.py``. What is different is where the log-probabilities come from: TRL stacked
``generate``'s scores and materialised ``[batch, response, vocab]`` logits for the rollout, the reference policy
and every training micro-batch. Here every log-probability comes from the policy's (or reference's) last hidden
states and LM-head weight through fastrl's fused ops, and no ``[batch, response, vocab]`` tensor exists:

- rollout: ``generate`` samples the tokens (its scores are not kept); a forward-only fused pass over the sampled
  sequence's hidden states gives the log-probs, in the same forward as the values;
- reference: the same forward-only pass on the reference model (or, with PEFT, the policy without its adapter);
- training: ``fastrl.policy_loss`` (one pass, gradients formed in the forward) with
  ``PolicyLossConfig.ppo(cliprange)``, and ``fastrl.value_loss``.

Temperature: TRL samples at ``temperature + 1e-7`` and divides the logits by ``temperature + 1e-7`` for every
log-prob (rollout, reference, training); so does this trainer (the 1e-7 only keeps ``temperature=0`` from
dividing by zero). The reference policy's log-probs are therefore those of the reference at the same temperature.

One PPO update (``global_step``) = one rollout of ``batch_size`` prompts, then ``num_ppo_epochs`` passes over it in
``num_mini_batches`` minibatches of ``gradient_accumulation_steps`` micro-batches (one optimizer step per minibatch).
Metrics are logged once per update (TRL did the same, whatever ``logging_steps`` says).

Known TRL quirks kept on purpose (documented in ``ppo_math``): the score lands one position past the last response
token when there is room; values are trained one position further than the log-probs. Quirks not kept:
``objective/entropy`` sums ``-logp`` over real response tokens only (TRL also added +1 for every padding position,
its INVALID_LOGPROB fill), and ``policy/approxkl_avg``, ``policy/entropy_avg``, ``val/ratio`` are means over the
real response tokens (TRL averaged over padding too); ``val/ratio_var`` is the token variance of the ratio (TRL:
the variance of the per-micro-batch mean ratios); ``val/num_eos_tokens`` counts EOS in the truncated responses
of all processes (TRL: untruncated, main process only, which counts generate's EOS padding); ``eps`` is episodes
per second of this session (TRL divided the run's episodes by this session's time after a resume).

Where each part lives: ``ppo_models`` (the policy + value wrapper, the reward score, the fused head on a body),
``ppo_rollout`` (generation, log-probs, rewards and advantages), ``ppo_update`` (the PPO epochs and their metrics),
``ppo_checkpoints`` (save, resume) and ``ppo_tables`` (sample-completion tables); the math is ``ppo_math``, the
options ``ppo_config``. This module holds the constructor and the training loop.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
import warnings

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase, Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import TrainOutput, get_last_checkpoint, set_seed

from fastrl.losses.config import PolicyLossConfig
from fastrl.trainers._common import args_checkpointing
from fastrl.trainers._distributed import check_launch, release_at_exit
from fastrl.trainers._guards import check_logits_processor_hook, check_overrides
from fastrl.trainers._lm_head import head_settings_from_config, unwrap_causal_lm
from fastrl.trainers.memory import MemoryOptions, during_training
from fastrl.trainers.ppo_checkpoints import CheckpointMixin, OnlineTrainerState
from fastrl.trainers.ppo_config import PPOConfig
from fastrl.trainers.ppo_models import PolicyAndValueWrapper, get_reward
from fastrl.trainers.ppo_rollout import REPLAYED, RolloutMixin, negative_kl_settings
from fastrl.trainers.ppo_tables import TablesMixin
from fastrl.trainers.ppo_update import UpdateMixin
from fastrl.trainers.sampling import rule_from_generation_config, warn_if_untruncated

__all__ = ["PPOTrainer", "PolicyAndValueWrapper", "OnlineTrainerState", "get_reward"]

# the transformers.Trainer methods PPOTrainer overrides or calls, with the leading parameters it passes
TRAINER_INTERNALS = (
    ("_prepare_for_training", ("max_steps", "train_dataloader", "resume_from_checkpoint")),
    ("_load_from_checkpoint", ("resume_from_checkpoint", "model")),
    ("save_model", ("output_dir", "_internal_call")),
    ("_save_checkpoint", ("model", "trial")),
    ("_load_optimizer_and_scheduler", ("checkpoint",)),
    ("_load_scaler", ("checkpoint",)),
    ("_load_rng_state", ("checkpoint",)),
    ("_load_callback_state", ()),
)


class PPOTrainer(RolloutMixin, UpdateMixin, CheckpointMixin, TablesMixin, Trainer):
    """PPO (TRL's PPOv2 trainer) with fastrl's fused log-prob, policy-loss and value-loss ops.

    Args (TRL's): ``args`` a ``PPOConfig``; ``processing_class`` the tokenizer (needs a pad and an EOS token);
    ``model`` the policy (causal LM); ``ref_model`` the frozen reference (None: a copy of the policy, or with
    PEFT the policy without its adapter; passing ``model`` itself is an error); ``reward_model`` a
    sequence-classification model with a ``score`` head (one label); ``train_dataset`` pre-tokenized, an
    ``input_ids`` column; ``value_model`` a sequence-classification model whose ``score`` head becomes the
    value head; ``data_collator`` (default: left padding of ``input_ids``); ``eval_dataset`` (prompts for the
    sample-completion tables; default: the training prompts); ``optimizers``; ``callbacks``; ``peft_config``.

    ``train(resume_from_checkpoint=None)`` runs ``num_total_batches`` updates; with a checkpoint folder (or
    True: the last one in ``output_dir``) it continues the same run: model and value weights, optimizer,
    scheduler, RNG states, step and episode counters, and the position in the prompt order.
    """

    _tag_names = ["trl", "ppo", "fastrl"]

    def __init__(
        self,
        args: PPOConfig,
        processing_class: PreTrainedTokenizerBase,
        model: nn.Module,
        ref_model: nn.Module | None,
        reward_model: nn.Module,
        train_dataset,
        value_model: nn.Module,
        data_collator=None,
        eval_dataset=None,
        optimizers=(None, None),
        callbacks=None,
        peft_config=None,
    ) -> None:
        _check_arguments(args, processing_class, model, ref_model, train_dataset)
        # stop token: the policy stops generating there and responses are truncated after it (None: generate
        # response_length tokens, no truncation)
        self.stop_token_id = processing_class.eos_token_id if args.stop_token == "eos" else args.stop_token_id
        model, ref_model = self._set_models(args, model, ref_model, reward_model, value_model, peft_config)
        wrapper = PolicyAndValueWrapper(model, value_model)
        self._input_ids_only = data_collator is None
        if data_collator is None:
            data_collator = _LeftPadCollator(processing_class.pad_token_id)
        super().__init__(
            model=wrapper,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=_with_health_callback(args, callbacks),
            optimizers=optimizers,
        )
        release_at_exit(self)  # a clean exit from a distributed run (fastrl.trainers._distributed)
        self.model.config = unwrap_causal_lm(model).config  # model cards / hub pushes describe the policy
        self._set_tensorboard_dir()
        self._set_batch_sizes(args, train_dataset)
        self._set_head_and_sampling(args, model, ref_model)
        # these warn at the caller of PPOTrainer(...) (stacklevel 3): called from __init__ itself
        if self.sampling_replay == "kept_set":
            warn_if_untruncated(self.generation_config)
            check_logits_processor_hook(unwrap_causal_lm(model))
        self._warn_if_biased_sampling()
        self._check_fused_head(unwrap_causal_lm(model), self.head_settings)
        # long completions: tiled MLPs in every model the rollout and the updates run, until train() returns
        # (rollout: no gradients, so chunks only bound the forward's transients; offloading acts on updates only)
        self._fastrl_memory = MemoryOptions(
            wrapper, {"policy": model, "value model": value_model, "reference model": ref_model,
                      "reward model": reward_model},
            activation_offloading=args.activation_offloading, tiled_mlp=args.tiled_mlp,
        )
        self._prepare_distributed(args, wrapper, model)
        self.last_completions = None  # the latest sample-completions table (a pandas DataFrame)
        self._printed_completions = None  # (global_step, rows) of the table printed last

    # ------------------------------------------------------------------------------------------------------------
    # the constructor's steps
    # ------------------------------------------------------------------------------------------------------------

    def _set_models(self, args, model, ref_model, reward_model, value_model, peft_config):
        """The policy (a PEFT adapter on it with ``peft_config``) and the reference (None: a copy of the policy, or
        with PEFT the policy without its adapter); the reference and reward models frozen, dropout off in all.
        Returns ``(policy, reference)``."""
        self.is_peft_model = False
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        try:
            from peft import PeftModel

            self.is_peft_model = isinstance(model, PeftModel)
        except ImportError:
            pass
        self.model_adapter_name = args.model_adapter_name
        self.ref_adapter_name = args.ref_adapter_name
        if ref_model is None and not self.is_peft_model:
            ref_model = copy.deepcopy(model)
        if ref_model is not None:
            ref_model.eval()
            ref_model.requires_grad_(False)
        reward_model.eval()
        reward_model.requires_grad_(False)
        for m in (model, ref_model, value_model, reward_model):
            if m is not None:
                _disable_dropout(m)
        self.policy_model = model
        self.ref_model = ref_model
        self.reward_model = reward_model
        self.value_model = value_model
        return model, ref_model

    def _set_batch_sizes(self, args: PPOConfig, train_dataset) -> None:
        """TRL's batch-size arithmetic, written into ``args``; the number of updates, the seeds, the run name."""
        accelerator = self.accelerator
        self.train_dataset_len = len(train_dataset)
        if args.total_episodes is None:  # episodes in terms of epochs
            args.total_episodes = int(args.num_train_epochs * self.train_dataset_len)
        world = accelerator.num_processes
        args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
        args.micro_batch_size = int(args.per_device_train_batch_size * world)
        args.batch_size = int(args.local_batch_size * world)
        args.mini_batch_size = _exact_div(args.batch_size, args.num_mini_batches, "`batch_size` must be a multiple of `num_mini_batches`")
        args.local_mini_batch_size = _exact_div(
            args.local_batch_size, args.num_mini_batches, "`local_batch_size` must be a multiple of `num_mini_batches`"
        )
        if args.whiten_rewards and args.local_mini_batch_size < 8:
            raise ValueError(f"Per-rank minibatch size {args.local_mini_batch_size} is insufficient for whitening")
        if args.batch_size > self.train_dataset_len:
            raise ValueError(
                f"one update needs batch_size={args.batch_size} prompts (per_device_train_batch_size * "
                f"gradient_accumulation_steps * num_mini_batches * processes) but train_dataset has {self.train_dataset_len}"
            )
        args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)  # may train past total_episodes
        if args.run_name is None or args.run_name == args.output_dir:
            args.run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
        self.local_seed = args.seed + accelerator.process_index * 100003  # prime
        self.sample_generations_freq = max(1, args.num_total_batches // max(1, args.num_sample_generations))

    def _set_head_and_sampling(self, args: PPOConfig, model: nn.Module, ref_model: nn.Module | None) -> None:
        """The fused-head settings (the models' logit transform, TRL's temperature), the loss config, the rollout's
        generation config and, with ``sampling_replay="rule"``, the sampler rule it replays."""
        temperature = args.temperature + 1e-7
        self.head_settings = head_settings_from_config(unwrap_causal_lm(model), temperature=temperature)
        self.ref_head_settings = (
            head_settings_from_config(unwrap_causal_lm(ref_model), temperature=temperature)
            if ref_model is not None else self.head_settings
        )
        self.loss_config = dataclasses.replace(PolicyLossConfig.ppo(args.cliprange), temperature=temperature)
        self.generation_config = self._rollout_generation_config(args.temperature + 1e-7)
        self.sampling_replay = args.sampling_replay
        self.sampling_rule = None
        if self.sampling_replay == "rule":
            self.sampling_rule = rule_from_generation_config(self.generation_config, self.stop_token_id)

    def _warn_if_biased_sampling(self) -> None:
        """Warn (at the caller of ``PPOTrainer(...)``) about the generation settings that sample from another
        distribution than the policy's softmax and that ``sampling_replay`` does not replay."""
        temperature = self.args.temperature + 1e-7
        bad = [b for b in negative_kl_settings(self.generation_config, temperature)
               if b.split("=")[0] not in REPLAYED.get(self.sampling_replay, ())]
        if bad:
            warnings.warn(
                "PPO rollout generation settings " + ", ".join(bad) + " sample tokens from a distribution other "
                "than the policy's softmax(logits / temperature), whose log-probs the KL penalty and the PPO ratio "
                "use: the KL estimate becomes biased and can go negative (TRL Training FAQ). Sample with top_k=0, "
                "top_p=1.0, no minimum length and no penalties unless you mean to"
                + (", or set sampling_replay='kept_set' (truncation and minimum length; penalties still reweight)."
                   if self.sampling_replay == "off" else "; sampling_replay replays the support only."),
                stacklevel=3,
            )

    def _prepare_distributed(self, args: PPOConfig, wrapper: PolicyAndValueWrapper, model: nn.Module) -> None:
        """Distributed setup: prepare the policy + value wrapper, the optimizer and the scheduler (the Trainer's
        ``_prepare_for_training``); the reference and reward models to the device (DeepSpeed: prepared for it)."""
        accelerator = self.accelerator
        if args_checkpointing(args)[0]:
            kw = args_checkpointing(args)[1] or {"use_reentrant": False}
            wrapper.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        self._prepare_for_training(args.num_total_batches, None, None)
        # one optimizer step per minibatch = gradient_accumulation_steps micro-batches (the Trainer's own
        # accelerator counts micro-batches itself; PPO's loop uses accelerator.accumulate, as TRL did)
        accelerator.gradient_accumulation_steps = args.gradient_accumulation_steps
        from trl.distributed import DistributedBackend

        self._dist = DistributedBackend(accelerator)
        if self.is_deepspeed_enabled:
            from trl.models import prepare_deepspeed

            self.reward_model = prepare_deepspeed(self.reward_model, accelerator)
            if self.ref_model is not None:
                self.ref_model = prepare_deepspeed(self.ref_model, accelerator)
        else:
            self.reward_model = self.reward_model.to(accelerator.device)
            if self.ref_model is not None:
                self.ref_model = self.ref_model.to(accelerator.device)
        if hasattr(unwrap_causal_lm(model), "add_model_tags"):
            unwrap_causal_lm(model).add_model_tags(self._tag_names)

    def _set_tensorboard_dir(self) -> None:
        if self.args.logging_dir is None:
            return
        from transformers.integrations import TensorBoardCallback

        for cb in self.callback_handler.callbacks:
            if isinstance(cb, TensorBoardCallback) and cb.tb_writer is None:
                cb.logging_dir = os.path.expanduser(self.args.logging_dir)

    # ------------------------------------------------------------------------------------------------------------
    # prompts
    # ------------------------------------------------------------------------------------------------------------

    def _collate(self, dataset, indices) -> torch.Tensor:  # [b, Lq] left-padded
        rows = [dataset[int(i)] for i in indices]
        if self._input_ids_only:
            rows = [{"input_ids": r["input_ids"]} for r in rows]
        return self.data_collator(rows)["input_ids"].to(self.accelerator.device)

    def _queries(self, update_index: int) -> torch.Tensor:
        """This process's prompts for update ``update_index`` (0-based): a function of the index alone.

        Each pass over the dataset is a fresh permutation seeded by ``(data_seed or seed) + pass``, cut into
        ``batch_size`` prompts per update (the incomplete tail is dropped, as TRL's ``drop_last``); process ``r``
        takes the ``r``-th ``local_batch_size`` slice. A resumed run therefore continues with the same prompts.
        """
        args = self.args
        per_pass = self.train_dataset_len // args.batch_size
        data_pass, k = divmod(update_index, per_pass)
        seed = (args.data_seed if args.data_seed is not None else args.seed) + data_pass
        perm = torch.randperm(self.train_dataset_len, generator=torch.Generator().manual_seed(seed))
        start = k * args.batch_size + self.accelerator.process_index * args.local_batch_size
        return self._collate(self.train_dataset, perm[start : start + args.local_batch_size].tolist())

    # ------------------------------------------------------------------------------------------------------------
    # training loop
    # ------------------------------------------------------------------------------------------------------------

    @during_training
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs) -> TrainOutput:
        """Run the PPO updates (all of them, or the rest of them when resuming from a checkpoint)."""
        if kwargs:
            raise TypeError(f"PPOTrainer.train() got unexpected arguments {sorted(kwargs)}")
        args = self.args
        accelerator = self.accelerator
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({args.output_dir})")
        elif resume_from_checkpoint is False:
            resume_from_checkpoint = None

        max_steps = args.num_total_batches
        stateful = [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]
        self.state = OnlineTrainerState(stateful_callbacks=stateful)
        if resume_from_checkpoint is not None:
            self._resume(resume_from_checkpoint)
        else:
            set_seed(self.local_seed)
        self.state.compute_steps(args, max_steps)  # this run's logging / save intervals, also when resuming
        self.state.init_training_references(self, max_steps, args.total_episodes / self.train_dataset_len, None)
        self.state.num_train_epochs = args.total_episodes / self.train_dataset_len
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))

        self.model_wrapped.train()
        accelerator.print("===training policy===")  # before on_train_begin draws the progress bar
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start_time, start_episode = time.time(), self.state.episode
        metrics, loss_value = {}, float("nan")
        for update in range(self.state.global_step + 1, max_steps + 1):
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            self.state.episode += args.batch_size
            batch = self._rollout(self._queries(update - 1))
            self._check_rollout(batch, update)
            stats = self._ppo_epochs(batch)
            metrics = self._update_metrics(batch, stats, start_time, start_episode)
            loss_value = metrics["loss/policy_avg"] + args.vf_coef * metrics["loss/value_avg"]
            self.state.epoch = self.state.episode / self.train_dataset_len  # read by self.log
            self.state.global_step += 1
            self.log(metrics)
            self.lr_scheduler.step()
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.control.should_save:
                self._save_checkpoint(self.model_wrapped, trial=None)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            del batch
            if args.num_sample_generations > 0 and (update - 1) % self.sample_generations_freq == 0:
                self.generate_completions(sampling=True)
            if self.control.should_training_stop:
                break

        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if self.control.should_save:
            self._save_checkpoint(self.model_wrapped, trial=None)
            self.control = self.callback_handler.on_save(args, self.state, self.control)
        return TrainOutput(self.state.global_step, loss_value, metrics)


class _LeftPadCollator:
    """``{"input_ids": [B, L]}`` left-padded with the tokenizer's pad id (queries must end where responses start)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows):
        seqs = [torch.as_tensor(r["input_ids"], dtype=torch.long) for r in rows]
        L = max(s.numel() for s in seqs)
        out = torch.full((len(seqs), L), self.pad_token_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            if s.numel():
                out[i, L - s.numel():] = s
        return {"input_ids": out}


def _check_arguments(args, processing_class, model, ref_model, train_dataset) -> None:
    """PPOTrainer's arguments, before anything is built (a warning names the caller of ``PPOTrainer(...)``)."""
    if not isinstance(args, PPOConfig):
        raise TypeError(f"args must be a fastrl.PPOConfig, got {type(args).__name__}")
    check_launch(args)
    check_overrides(Trainer, TRAINER_INTERNALS, "fastrl.PPOTrainer's training loop and checkpoints")
    if ref_model is model:
        raise ValueError(
            "`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the "
            "same as `model`, you must make a copy of it, or `None` if you use peft."
        )
    if processing_class is None or processing_class.pad_token_id is None:
        raise ValueError("processing_class must be a tokenizer with a pad token (PPO pads queries and responses)")
    if processing_class.eos_token_id is None:
        raise ValueError("processing_class must have an EOS token (stop token, EOS penalty, num_eos_tokens)")
    if processing_class.pad_token_id == processing_class.eos_token_id:
        warnings.warn(
            "the tokenizer's pad token is its EOS token: the EOS closing a response is then read as padding "
            "(scored one token early, its log-prob masked). Add a separate pad token, as TRL's PPO example does.",
            stacklevel=3,
        )
    if train_dataset is None or len(train_dataset) == 0:
        raise ValueError("train_dataset must be a non-empty dataset of pre-tokenized `input_ids`")


def _with_health_callback(args: PPOConfig, callbacks) -> list:
    """The callbacks, with a ``TrainingHealthCallback`` added when ``args.health_checks`` and none is there."""
    callbacks = list(callbacks or [])
    if args.health_checks:
        from fastrl.trainers.health import TrainingHealthCallback

        if not any(isinstance(cb, TrainingHealthCallback) or cb is TrainingHealthCallback for cb in callbacks):
            callbacks.append(TrainingHealthCallback())
    return callbacks


def _exact_div(a: int, b: int, message: str) -> int:
    q = a // b
    if a != q * b:
        raise ValueError(f"{message}, inexact division: {a} / {b} = {a / b}")
    return q


def _disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0
