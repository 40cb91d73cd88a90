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
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedTokenizerBase, Trainer, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import TrainOutput, get_last_checkpoint, set_seed
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.utils import logging

import fastrl
from fastrl.losses.config import PolicyLossConfig
from fastrl.trainers._distributed import check_launch
from fastrl.trainers._lm_head import (
    HeadSettings,
    call_with_head,
    head_precision,
    head_settings_from_config,
    lm_head_logprobs,
    unwrap_causal_lm,
)
from fastrl.trainers.memory import MemoryOptions, during_training
from fastrl.trainers.ppo_config import PPOConfig
from fastrl.trainers.sampling import (
    record_kept_sets,
    rule_from_generation_config,
    sequence_rows,
    stack_sequences,
    warn_if_untruncated,
)
from fastrl.trainers.ppo_math import (
    INVALID_LOGPROB,
    apply_eos_penalty,
    compute_gae,
    first_true_indices,
    kl_rewards,
    masked_whiten,
    padding_masks,
    response_lengths,
    truncate_response,
)

__all__ = ["PPOTrainer", "PolicyAndValueWrapper", "OnlineTrainerState", "get_reward"]

logger = logging.get_logger(__name__)

_IGNORE = -100
VALUE_MODEL_DIR = "value_model"  # checkpoint sub-folder holding the value model (plain / DDP runs)


@dataclass
class OnlineTrainerState(TrainerState):
    """``TrainerState`` plus the number of prompts used so far (TRL's ``OnlineTrainerState``)."""

    episode: int = 0


# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------


def _lm_inputs(query_responses: torch.Tensor, pad_token_id: int):  # [B, L] -> (ids, mask, positions), each [B, L]
    """TRL's forward inputs: pad tokens masked out, positions counted over real tokens (left padding)."""
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    return input_ids, attention_mask, position_ids


# transformers 5.23 renamed gradient_checkpointing* to activation_checkpointing* (the old names stay as deprecated
# aliases until v6); earlier versions have only the old names.
def _args_checkpointing(args) -> tuple[bool, dict | None]:  # (on, kwargs) of TrainingArguments
    if hasattr(args, "activation_checkpointing"):
        return bool(args.activation_checkpointing), args.activation_checkpointing_kwargs
    return bool(args.gradient_checkpointing), args.gradient_checkpointing_kwargs


def _checkpointing_on(model) -> bool:
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)


def _unwrap_engine(model):
    """The module inside a DeepSpeed inference engine (reference / reward model under DeepSpeed)."""
    return model.module if type(model).__name__ == "DeepSpeedEngine" else model


def get_reward(
    model: nn.Module,  # a sequence-classification model with a `score` head
    query_responses: torch.Tensor,  # [B, L]
    pad_token_id: int,
    context_length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # (score head on every position [B, L, 1], scores [B], index [B])
    """TRL's ``get_reward``: the ``score`` head on the backbone's last hidden state, read at the last non-pad token.

    The last token is found in the response part only (``context_length`` on): the last token before the
    response's first pad token.
    """
    model = _unwrap_engine(model)
    input_ids, attention_mask, position_ids = _lm_inputs(query_responses, pad_token_id)
    output = model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
    )
    reward_logits = model.score(output.last_hidden_state)
    sequence_lengths = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    scores = reward_logits[torch.arange(reward_logits.size(0), device=reward_logits.device), sequence_lengths]
    return reward_logits, scores.squeeze(-1), sequence_lengths


def _fused_head_outputs(causal_lm, input_ids, attention_mask, position_ids, context_length, head_fn):
    """Run ``causal_lm``'s body, then ``head_fn(hidden [B, R, H], weight, bias)`` with the LM head gathered.

    ``hidden`` are the states that predict the response tokens (positions ``context_length - 1 .. L - 2``);
    the head's ``[B, R, V]`` logits are never formed.
    """
    lm = unwrap_causal_lm(causal_lm)
    out = lm.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
    )
    head = lm.get_output_embeddings()
    hidden = out.last_hidden_state[:, context_length - 1 : -1].to(head.weight.device)
    return call_with_head(head_fn, hidden, head.weight, head.bias)


class PolicyAndValueWrapper(nn.Module):
    """The policy and the value model as one module (TRL's wrapper): one optimizer, one DDP / DeepSpeed / FSDP
    wrapper and one ``forward`` for both. The value head is the value model's ``score`` on its own backbone.

    ``forward(input_ids, attention_mask, position_ids, context_length=, head_fn=, with_values=)`` returns
    ``(head_fn(policy_hidden, lm_head.weight, lm_head.bias) or None, values [B, R] or None)``: the fused
    loss runs inside the forward, so distributed wrappers have the LM head materialised while it runs.
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        # FSDP's transformer-based auto wrap reads the layer classes from here
        no_split = []
        for m in (unwrap_causal_lm(policy), value_model):
            no_split += [c for c in (getattr(m, "_no_split_modules", None) or []) if c not in no_split]
        self._no_split_modules = no_split

    @property
    def critic_backbone(self) -> nn.Module:
        return _unwrap_engine(self.value_model).base_model

    def forward(self, input_ids, attention_mask, position_ids, *, context_length: int, head_fn=None,
                with_values: bool = True):
        head_out = None
        if head_fn is not None:
            head_out = _fused_head_outputs(self.policy, input_ids, attention_mask, position_ids, context_length, head_fn)
        values = None
        if with_values:
            out = self.critic_backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
            )
            values = self.value_model.score(out.last_hidden_state[:, context_length - 1 : -1])
            values = values.squeeze(-1).clone()  # not a view: FSDP2 warns about views returned by a forward
        return head_out, values

    # TRL's generation helpers toggle activation checkpointing on the unwrapped model around generate().
    def _models(self):
        return [unwrap_causal_lm(self.policy), self.value_model]

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(_checkpointing_on(m) for m in self._models())

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        for m in self._models():
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self):
        for m in self._models():
            m.gradient_checkpointing_disable()


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


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


def _pad_right(tensors: list[torch.Tensor], value: int) -> torch.Tensor:  # list of [b_i, L_i] -> [sum b_i, max L_i]
    L = max(t.shape[1] for t in tensors)
    return torch.cat([nn.functional.pad(t, (0, L - t.shape[1]), value=value) for t in tensors], 0)


# ---------------------------------------------------------------------------------------------------------------
# Generation settings
# ---------------------------------------------------------------------------------------------------------------

# generation settings whose effect on the support each sampling_replay mode reproduces (penalties, a logit bias and a
# different temperature reweight the kept ids too: no mode reproduces those)
_REPLAYED = {
    "kept_set": ("top_k", "top_p", "typical_p", "min_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size",
                 "min_length", "min_new_tokens", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
                 "forced_bos_token_id", "forced_eos_token_id"),
    "rule": ("top_k", "top_p", "min_p", "min_new_tokens"),
}


def negative_kl_settings(generation_config: GenerationConfig, temperature: float) -> list[str]:
    """Generation settings that sample from something other than ``softmax(logits / temperature)``.

    The KL estimate and the PPO ratio use the policy's full-distribution log-probs at ``temperature``; tokens
    drawn from a truncated / penalised / re-tempered distribution make the KL estimate biased and often
    negative (TRL's Training FAQ, "What Is the Concern with Negative KL Divergence?").
    """
    cfg = generation_config
    bad = []

    def flag(name):
        bad.append(f"{name}={getattr(cfg, name)!r}")

    if not cfg.do_sample:
        flag("do_sample")
    if (cfg.num_beams or 1) > 1:
        flag("num_beams")
    if cfg.top_k not in (None, 0):
        flag("top_k")
    for name in ("top_p", "typical_p"):
        if getattr(cfg, name, None) is not None and getattr(cfg, name) < 1.0:
            flag(name)
    for name in ("min_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size", "min_length", "min_new_tokens"):
        if getattr(cfg, name, None):
            flag(name)
    for name in ("repetition_penalty", "encoder_repetition_penalty"):
        if getattr(cfg, name, None) not in (None, 1.0):
            flag(name)
    for name in ("bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
                 "forced_bos_token_id", "forced_eos_token_id"):
        if getattr(cfg, name, None) is not None:
            flag(name)
    if cfg.temperature is not None and abs(cfg.temperature - temperature) > 1e-6:
        bad.append(f"temperature={cfg.temperature!r} (the log-probs use {temperature!r})")
    return bad


# ---------------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------------


class PPOTrainer(Trainer):
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
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a fastrl.PPOConfig, got {type(args).__name__}")
        check_launch(args)
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
                stacklevel=2,
            )
        if train_dataset is None or len(train_dataset) == 0:
            raise ValueError("train_dataset must be a non-empty dataset of pre-tokenized `input_ids`")

        # stop token: the policy stops generating there and responses are truncated after it
        if args.stop_token == "eos":
            self.stop_token_id = processing_class.eos_token_id
        else:
            self.stop_token_id = args.stop_token_id  # None: generate response_length tokens, no truncation

        # PEFT: the trained policy is an adapter; with no ref_model the reference is the policy without it
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

        wrapper = PolicyAndValueWrapper(model, value_model)
        if data_collator is None:
            data_collator = _LeftPadCollator(processing_class.pad_token_id)
            self._input_ids_only = True
        else:
            self._input_ids_only = False
        callbacks = list(callbacks or [])
        if args.health_checks:
            from fastrl.trainers.health import TrainingHealthCallback

            if not any(isinstance(cb, TrainingHealthCallback) or cb is TrainingHealthCallback for cb in callbacks):
                callbacks.append(TrainingHealthCallback())
        super().__init__(
            model=wrapper,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.model.config = unwrap_causal_lm(model).config  # model cards / hub pushes describe the policy
        self._set_tensorboard_dir()

        # ---- batch sizes (TRL's arithmetic) ----------------------------------------------------------------
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

        # ---- fused-head settings: the models' logit transform, TRL's temperature -----------------------------
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
        elif self.sampling_replay == "kept_set":
            warn_if_untruncated(self.generation_config)
        bad = [b for b in negative_kl_settings(self.generation_config, temperature)
               if b.split("=")[0] not in _REPLAYED.get(self.sampling_replay, ())]
        if bad:
            warnings.warn(
                "PPO rollout generation settings " + ", ".join(bad) + " sample tokens from a distribution other "
                "than the policy's softmax(logits / temperature), whose log-probs the KL penalty and the PPO ratio "
                "use: the KL estimate becomes biased and can go negative (TRL Training FAQ). Sample with top_k=0, "
                "top_p=1.0, no minimum length and no penalties unless you mean to"
                + (", or set sampling_replay='kept_set' (truncation and minimum length; penalties still reweight)."
                   if self.sampling_replay == "off" else "; sampling_replay replays the support only."),
                stacklevel=2,
            )
        self._check_fused_head(unwrap_causal_lm(model), self.head_settings)
        # long completions: tiled MLPs in every model the rollout and the updates run, until train() returns
        # (rollout: no gradients, so chunks only bound the forward's transients; offloading acts on updates only)
        self._fastrl_memory = MemoryOptions(
            wrapper, {"policy": model, "value model": value_model, "reference model": ref_model,
                      "reward model": reward_model},
            activation_offloading=args.activation_offloading, tiled_mlp=args.tiled_mlp,
        )

        # ---- distributed setup: prepare (policy + value), optimizer, scheduler ---------------------------------
        if _args_checkpointing(args)[0]:
            kw = _args_checkpointing(args)[1] or {"use_reentrant": False}
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
        self.last_completions = None  # the latest sample-completions table (a pandas DataFrame)
        self._printed_completions = None  # (global_step, rows) of the table printed last

    # ------------------------------------------------------------------------------------------------------------
    # setup helpers
    # ------------------------------------------------------------------------------------------------------------

    def _set_tensorboard_dir(self) -> None:
        if self.args.logging_dir is None:
            return
        from transformers.integrations import TensorBoardCallback

        for cb in self.callback_handler.callbacks:
            if isinstance(cb, TensorBoardCallback) and cb.tb_writer is None:
                cb.logging_dir = os.path.expanduser(self.args.logging_dir)

    def _rollout_generation_config(self, temperature: float) -> GenerationConfig:
        """TRL's rollout sampling (Training FAQ settings): sample from the full distribution, pad with EOS."""
        tok = self.processing_class
        kw = dict(
            max_new_tokens=self.args.response_length,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            do_sample=True,
            min_length=0,
            eos_token_id=self.stop_token_id,
            pad_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id,
            use_cache=True,
        )
        kw.update(self.args.generation_kwargs or {})
        return GenerationConfig(**kw)

    def _check_fused_head(self, causal_lm: nn.Module, settings: HeadSettings) -> None:
        """Warn if the fused log-probs disagree with the model's own logits on one training prompt.

        fastrl reads the LM head's weight and the config's logit transform; a model whose head does something
        else would silently get other log-probs. Skipped where the weights are not materialised (ZeRO-3).
        """
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            return
        row = self.train_dataset[0]
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)[None, :16]
        if ids.shape[1] < 2:
            return
        device = next(causal_lm.parameters()).device
        ids = ids.to(device)
        with torch.no_grad():
            logits = causal_lm(input_ids=ids).logits[:, :-1].float() / settings.temperature
            expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            got, _ = _fused_head_outputs(
                causal_lm, ids, torch.ones_like(ids, dtype=torch.bool),
                torch.arange(ids.shape[1], device=device)[None], 1,
                lambda h, w, b: lm_head_logprobs(h, w, b, ids[:, 1:], settings, with_entropy=False),
            )
        err = (got.float() - expected).abs().max().item()
        tol = 1e-3 if unwrap_causal_lm(causal_lm).dtype in (torch.float32, torch.float64) else 0.15  # bf16 logits
        if not err <= tol:
            warnings.warn(
                f"fastrl's fused log-probs differ from the model's own logits by up to {err:.3g} nats on a training "
                f"prompt ({type(causal_lm).__name__}): its LM head applies a transform fastrl does not know "
                "(settings read: " + f"logit_scale={settings.logit_scale}, softcap={settings.softcap}). "
                "PPO would optimise the wrong log-probs.",
                stacklevel=3,
            )

    @contextlib.contextmanager
    def null_ref_context(self):
        """The reference policy under PEFT: the policy with its adapter disabled (or the reference adapter)."""
        policy = self.accelerator.unwrap_model(self.model_wrapped).policy
        with (
            policy.disable_adapter() if self.is_peft_model and not self.ref_adapter_name else contextlib.nullcontext()
        ):
            if self.ref_adapter_name:
                policy.set_adapter(self.ref_adapter_name)
            yield
            if self.ref_adapter_name:
                policy.set_adapter(self.model_adapter_name or "default")

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
    # rollout
    # ------------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _unwrapped_for_generation(self):
        from trl.models import unwrap_model_for_generation

        with (
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=_args_checkpointing(self.args)[1],
            ) as unwrapped,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            yield unwrapped

    def _generate(self, policy: nn.Module, queries: torch.Tensor, batch: int, config: GenerationConfig,
                  kept: list | None = None) -> torch.Tensor:
        """``[B, Lq + R]`` query + sampled response, generated ``batch`` prompts at a time (TRL's batch_generation).

        The generation config replaces the policy's own for the call, so nothing model-specific (a hub
        ``generation_config.json`` with top_k / top_p / repetition_penalty) leaks into the sampling. ``kept``: a
        list that receives one ``KeptSet`` per sequence, the ids each response token could be drawn from
        (recorded after every warper of ``generate``; sampling_replay="kept_set").
        """
        pad = self.processing_class.pad_token_id
        lm = unwrap_causal_lm(policy)
        saved = lm.generation_config
        lm.generation_config = config
        recording = record_kept_sets(lm) if kept is not None else contextlib.nullcontext([])
        try:
            chunks = []
            with recording as recorders:
                for i in range(0, queries.shape[0], batch):
                    query = queries[i : i + batch]
                    context_length = query.shape[1]
                    attention_mask = query != pad
                    input_ids = torch.masked_fill(query, ~attention_mask, 0)
                    out = policy.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
                    chunks.append(torch.cat((query, out[:, context_length:]), dim=1))
                    if kept is not None:
                        r = out.shape[1] - context_length
                        kept.extend(recorders[-1].kept_sets([r] * out.shape[0], lm.config.get_text_config().vocab_size))
        finally:
            lm.generation_config = saved
        return _pad_right(chunks, pad)

    def _policy_logprobs_and_values(self, query_responses, targets, context_length, support=None, ref=None):
        """Forward-only fused log-probs of ``targets`` [b, R] (-100: skip) and values, in one forward.

        ``support`` (sampling replay): the log-probs are over it. ``ref``: the reference's ``(hidden [b, R, H_ref],
        weight, bias)`` (``kl_estimator="exact"``): the exact per-token KL(pi || pi_ref) [b, R] (0 where the target
        is skipped) is computed in the same forward, with the policy's head gathered, over the same support (a
        rule: the set replayed on the policy's logits). Returns ``(logprob, value, extras)``: ``extras["kl"]``
        (with ``ref``) and ``extras["kept_mass"]``, the log of the support's full-softmax mass (``log_kept_mass``),
        each None when not asked for.
        """
        ids, mask, pos = _lm_inputs(query_responses, self.processing_class.pad_token_id)
        settings = self.head_settings
        mass = support is not None and self.args.log_kept_mass

        def head(h, w, b):
            sup, kl = support, None
            if ref is not None:
                from fastrl.losses.policy import exact_reference_kl
                from fastrl.ops.config import LogitTransform
                from fastrl.ops.kept import resolve_support

                ref_h, ref_w, ref_b = ref
                ref_st = self.ref_head_settings
                tf = LogitTransform(temperature=settings.temperature, logit_scale=settings.logit_scale,
                                    softcap=settings.softcap)
                with head_precision(h, w, b, settings) as (h_, w_, b_):
                    if sup is not None:  # one kept set for the log-probs and the KL
                        sup, _ = resolve_support(sup, h_, w_, b_, targets, tf, _IGNORE, None, settings.backend)
                    kl = exact_reference_kl(
                        h_, w_, b_, ref_h.to(h_.dtype), ref_w.to(h_.dtype),
                        None if ref_b is None else ref_b.to(h_.dtype), targets != _IGNORE, tf, settings.backend, True,
                        support=sup,
                        ref_tf=LogitTransform(temperature=settings.temperature, logit_scale=ref_st.logit_scale,
                                              softcap=ref_st.softcap),
                    )
            outs = lm_head_logprobs(h, w, b, targets, settings, with_entropy=False, support=sup,
                                    return_kept_mass=mass and sup is not None)
            kept_mass = outs[2] if mass and sup is not None else (torch.zeros_like(outs[0]) if mass else None)
            return outs[0], kept_mass, kl

        (logprob, kept_mass, kl), value = self.model_wrapped(ids, mask, pos, context_length=context_length,
                                                             head_fn=head)
        return logprob, value, {"kl": kl, "kept_mass": kept_mass}

    def _ref_forward(self, query_responses, context_length, head):
        """``head(hidden, weight, bias)`` on the reference model's hidden states at the response positions."""
        ids, mask, pos = _lm_inputs(query_responses, self.processing_class.pad_token_id)
        if self.ref_model is None:
            with self.null_ref_context():
                out, _ = self.model_wrapped(ids, mask, pos, context_length=context_length, head_fn=head,
                                            with_values=False)
            return out
        # the policy's forward runs under the accelerator's autocast (mixed precision); the reference must
        # be computed the same way, or the KL between two identical models is not 0
        with self.accelerator.autocast():
            return _fused_head_outputs(_unwrap_engine(self.ref_model), ids, mask, pos, context_length, head)

    def _ref_logprobs(self, query_responses, targets, context_length, support=None):
        settings = self.ref_head_settings

        def head(h, w, b):
            return lm_head_logprobs(h, w, b, targets, settings, with_entropy=False, support=support)

        logprob, _ = self._ref_forward(query_responses, context_length, head)
        return logprob

    def _ref_hidden(self, query_responses, context_length):
        """The reference's ``(hidden [b, R, H_ref], weight, bias)`` for the exact KL of one rollout chunk.

        The hidden states are copied out of the forward (a slice would keep the whole body output alive); the head
        is held by reference (the reference is frozen), copied only under DeepSpeed ZeRO-3, whose partitioned
        weight has no storage outside the gather.
        """
        from fastrl.trainers._lm_head import _is_zero3_param

        def head(h, w, b):
            keep = _is_zero3_param(w)
            return (h.detach().clone(), w.detach().clone() if keep else w.detach(),
                    None if b is None else (b.detach().clone() if keep else b.detach()))

        return tuple(self._ref_forward(query_responses, context_length, head))

    @torch.no_grad()
    def _rollout(self, queries: torch.Tensor) -> dict[str, torch.Tensor]:
        """Generate, score, and turn scores and log-probs into advantages and returns (TRL's steps 1-6)."""
        args = self.args
        tok = self.processing_class
        pad = tok.pad_token_id
        context_length = queries.shape[1]
        kept_seqs = [] if self.sampling_replay == "kept_set" else None
        with self._unwrapped_for_generation() as unwrapped:
            query_responses = self._generate(
                unwrapped.policy, queries, args.local_rollout_forward_batch_size, self.generation_config, kept_seqs
            )
        responses = query_responses[:, context_length:]
        R = responses.shape[1]
        # the support of every response token (sampling replay): recorded kept sets [B, R], or the rule
        kept = stack_sequences(kept_seqs, R, device=responses.device) if kept_seqs is not None else None

        parts = defaultdict(list)
        for i in range(0, queries.shape[0], args.local_rollout_forward_batch_size):
            query = queries[i : i + args.local_rollout_forward_batch_size]
            query_response = query_responses[i : i + args.local_rollout_forward_batch_size]
            response = query_response[:, context_length:]
            # 1. truncate after the first stop token
            postprocessed_response = response
            if self.stop_token_id is not None:  # the stop token id may be 0
                postprocessed_response = truncate_response(self.stop_token_id, pad, response)
            sequence_length = response_lengths(postprocessed_response, pad)
            # log-probs only where they are used (positions 0..L); the rest are skipped by the fused op
            padding_mask, _ = padding_masks(sequence_length, R)
            targets = response.masked_fill(padding_mask, _IGNORE)
            fb = query.shape[0]
            support = kept.rows_of_sequences(i, i + fb) if kept is not None else self.sampling_rule
            # the exact KL needs the reference's hidden states, not its log-probs: one pass over both heads
            ref = self._ref_hidden(query_response, context_length) if args.kl_estimator == "exact" else None
            logprob, value, extras = self._policy_logprobs_and_values(query_response, targets, context_length,
                                                                      support, ref=ref)
            if extras["kept_mass"] is not None:
                parts["kept_mass"].append(extras["kept_mass"].double().exp().masked_fill(padding_mask, 0.0))
            if ref is not None:
                parts["kl"].append(extras["kl"])
                del ref
            else:
                parts["ref_logprobs"].append(self._ref_logprobs(query_response, targets, context_length, support))
            # 2. the reward model scores the truncated response
            postprocessed_query_response = torch.cat((query, postprocessed_response), 1)
            _, score, _ = get_reward(self.reward_model, postprocessed_query_response, pad, context_length)
            parts["postprocessed_responses"].append(postprocessed_response)
            parts["logprobs"].append(logprob)
            parts["sequence_lengths"].append(sequence_length)
            parts["scores"].append(score.float())
            parts["values"].append(value.float())
        out = {k: torch.cat(v, 0) for k, v in parts.items()}
        postprocessed_responses, sequence_lengths = out["postprocessed_responses"], out["sequence_lengths"]

        # 3. the EOS trick
        contain_eos_token = torch.any(postprocessed_responses == tok.eos_token_id, dim=-1)
        scores = apply_eos_penalty(
            out["scores"], contain_eos_token, missing_eos_penalty=args.missing_eos_penalty,
            non_eos_penalty=args.non_eos_penalty, penalty_reward_value=args.penalty_reward_value,
        )
        # padding: log-probs after the last real token, values one further
        padding_mask, padding_mask_p1 = padding_masks(sequence_lengths, R)
        logprobs = torch.masked_fill(out["logprobs"], padding_mask, INVALID_LOGPROB)
        ref_logprobs = None
        if "ref_logprobs" in out:
            ref_logprobs = torch.masked_fill(out["ref_logprobs"], padding_mask, INVALID_LOGPROB)
        values = torch.masked_fill(out["values"], padding_mask_p1, 0)
        # 4. rewards: -kl_coef * kl per token, the score at the end
        rewards, non_score_reward, kl = kl_rewards(
            logprobs, ref_logprobs, scores, sequence_lengths, args.kl_coef, args.kl_estimator,
            per_token_kl=out.get("kl"),
        )
        # 5. whiten rewards
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
            rewards = torch.masked_fill(rewards, padding_mask_p1, 0)
        # 6. advantages and returns
        advantages, returns = compute_gae(rewards, values, args.gamma, args.lam)
        advantages = masked_whiten(advantages, ~padding_mask)
        advantages = torch.masked_fill(advantages, padding_mask, 0)
        batch = dict(
            query_responses=query_responses, responses=responses, postprocessed_responses=postprocessed_responses,
            logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, scores=scores, kl=kl,
            non_score_reward=non_score_reward, advantages=advantages, returns=returns, padding_mask=padding_mask,
            padding_mask_p1=padding_mask_p1, context_length=torch.tensor(context_length),
        )
        if kept is not None:
            batch["kept_sets"] = kept  # [B, R] KeptSet: the updates index its rows with the micro-batch's
        if "kept_mass" in out:
            batch["kept_mass"] = out["kept_mass"]
        if ref_logprobs is None:  # kl_estimator="exact": the reference gave its hidden states, not log-probs
            del batch["ref_logprobs"]
        return batch

    # ------------------------------------------------------------------------------------------------------------
    # optimisation
    # ------------------------------------------------------------------------------------------------------------

    def _train_micro_batch(self, batch: dict[str, torch.Tensor], inds) -> dict[str, torch.Tensor]:
        """Loss ``pg + vf_coef * vf`` on one micro-batch, backward, (accumulated) optimizer step; its metrics."""
        args = self.args
        context_length = int(batch["context_length"])
        mb_query_responses = batch["query_responses"][inds]
        mb_responses = batch["responses"][inds]
        mb_mask = ~batch["padding_mask"][inds]
        ids, attn, pos = _lm_inputs(mb_query_responses, self.processing_class.pad_token_id)
        settings = self.head_settings
        config = self.loss_config
        mb_advantage = batch["advantages"][inds]
        mb_logprobs = batch["logprobs"][inds]
        extra = {}
        if "kept_sets" in batch:
            extra["support"] = sequence_rows(batch["kept_sets"], inds)
        elif self.sampling_rule is not None:
            extra["support"] = self.sampling_rule

        loss_fn = fastrl.policy_loss
        if extra:
            from fastrl.trainers.grpo import fastrl_loss_fn

            loss_fn = fastrl_loss_fn(support=True)

        def head(h, w, b):
            with head_precision(h, w, b, settings) as (h_, w_, b_):
                return loss_fn(
                    h_, w_, mb_responses, mb_advantage, mb_mask, config=config, old_logprobs=mb_logprobs, bias=b_,
                    logit_scale=settings.logit_scale, softcap=settings.softcap, backend=settings.backend, **extra,
                )

        (pg_loss, pg_metrics), vpred = self.model_wrapped(ids, attn, pos, context_length=context_length, head_fn=head)
        vf_loss, vf_metrics = fastrl.value_loss(
            vpred.float(), batch["values"][inds], batch["returns"][inds], ~batch["padding_mask_p1"][inds],
            args.cliprange_value,
        )
        loss = pg_loss + args.vf_coef * vf_loss
        # never let a non-finite loss reach the optimizer (gathered: every process raises together, none hangs)
        if bool(self.accelerator.gather((~torch.isfinite(loss.detach())).reshape(1)).any()):
            raise FloatingPointError(
                f"PPO loss is non-finite (policy {pg_loss.item()}, value {vf_loss.item()} on this process) at update "
                f"{self.state.global_step + 1}; stopped before the optimizer step. The rollout's rewards, values and "
                "advantages were finite: the policy or value model produced inf/nan (learning rate too high?)."
            )
        self.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        stats = {
            "policy/approxkl_avg": pg_metrics["policy/approxkl_avg"],
            "policy/clipfrac_avg": pg_metrics["policy/clipfrac_avg"],
            "loss/policy_avg": pg_loss.detach(),
            "loss/value_avg": vf_metrics["loss/value_avg"],
            "val/clipfrac_avg": vf_metrics["val/clipfrac_avg"],
            "policy/entropy_avg": pg_metrics["policy/entropy_avg"],
            "val/ratio": pg_metrics["val/ratio"],
            "val/ratio_var": pg_metrics["val/ratio_var"],
        }
        for name in ("sampling/kept_size_mean", "sampling/label_outside_frac"):  # the supports of this update
            if name in pg_metrics:
                stats[name] = pg_metrics[name]
        return stats

    def _check_rollout(self, batch: dict[str, torch.Tensor], update: int) -> None:
        """Raise before any optimizer step when the rollout holds non-finite rewards, values, log-probs or
        advantages, naming the first culprit; the bad rollout's scores are logged first, so the health callback
        reports the reward too. One host synchronisation; the flags are gathered, so every process raises."""
        real, real_p1 = ~batch["padding_mask"], ~batch["padding_mask_p1"]
        checks = (
            ("scores", "the reward (the reward model's score, after the EOS penalty)", batch["scores"], None),
            ("values", "the value model's values", batch["values"], real_p1),
            ("logprobs", "the policy's rollout log-probs", batch["logprobs"], real),
            ("ref_logprobs", "the reference policy's log-probs", batch["ref_logprobs"], real) if "ref_logprobs" in batch
            else ("kl", "the exact KL to the reference policy", batch["kl"], real),
            ("advantages", "the advantages", batch["advantages"], real),
            ("returns", "the returns", batch["returns"], real_p1),
        )
        bad = [~torch.isfinite(x) if where is None else ~torch.isfinite(x) & where for _, _, x, where in checks]
        flags = torch.stack([b.any() for b in bad])
        everywhere = self.accelerator.gather(flags[None]).reshape(-1, len(checks)).any(0)
        if not bool(everywhere.any()):
            return
        with torch.no_grad():
            self.log({"objective/scores": batch["scores"].float().mean().item(),
                      "objective/kl": batch["kl"].sum(1).mean().item()})
        i = int(everywhere.nonzero()[0, 0])
        name, what, x, _ = checks[i]
        if bool(flags[i]):
            pos = tuple(int(j) for j in bad[i].nonzero()[0])
            detail = f"{int(bad[i].sum())} non-finite, the first {x[pos].item()} at {name}[{', '.join(map(str, pos))}]"
        else:
            detail = "on another process"
        raise FloatingPointError(
            f"{what} ({name}) is not finite in the rollout of update {update}: {detail}. No optimizer step was "
            "taken on it."
        )

    def _ppo_epochs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``num_ppo_epochs`` shuffled passes over the rollout; each metric averaged over every micro-batch."""
        args = self.args
        model = self.model_wrapped
        stats: dict[str, torch.Tensor] = {}
        shape = (args.num_ppo_epochs, args.num_mini_batches, args.gradient_accumulation_steps)
        for ppo_epoch_idx in range(args.num_ppo_epochs):
            b_inds = np.random.permutation(args.local_batch_size)
            for minibatch_idx, mini_batch_start in enumerate(range(0, args.local_batch_size, args.local_mini_batch_size)):
                mini_batch_inds = b_inds[mini_batch_start : mini_batch_start + args.local_mini_batch_size]
                micro_starts = range(0, args.local_mini_batch_size, args.per_device_train_batch_size)
                for ga_idx, micro_batch_start in enumerate(micro_starts):
                    with self.accelerator.accumulate(model), self._fastrl_memory.step_context():
                        micro_inds = torch.as_tensor(
                            mini_batch_inds[micro_batch_start : micro_batch_start + args.per_device_train_batch_size],
                            device=self.accelerator.device,
                        )
                        for key, value in self._train_micro_batch(batch, micro_inds).items():
                            if key not in stats:
                                stats[key] = torch.zeros(shape, device=self.accelerator.device)
                            stats[key][ppo_epoch_idx, minibatch_idx, ga_idx] = value.float()
        return {k: v.mean() for k, v in stats.items()}

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

    def _update_metrics(self, batch, stats, start_time: float, start_episode: int) -> dict[str, float]:
        """TRL's metric dict for one update (every documented name; see the module docstring for meanings)."""
        acc = self.accelerator
        real = ~batch["padding_mask"]
        with torch.no_grad():
            local = {
                "objective/kl": batch["kl"].sum(1).mean(),
                "objective/entropy": torch.where(real, -batch["logprobs"], 0.0).sum(1).mean(),
                "objective/non_score_reward": batch["non_score_reward"].sum(1).mean(),
                "objective/scores": batch["scores"].mean(),
            }
            local["objective/rlhf_reward"] = local["objective/non_score_reward"] + local["objective/scores"]
            n_real = real.sum().clamp(min=1)
            if "kept_mass" in batch:
                local["sampling/kept_mass_mean"] = batch["kept_mass"].sum() / n_real
            local.update(stats)
            keys = list(local)
            gathered = acc.gather(torch.stack([local[k].float() for k in keys])[None]).reshape(-1, len(keys)).mean(0)
            num_eos = acc.gather((batch["postprocessed_responses"] == self.processing_class.eos_token_id).sum()[None])
        elapsed = max(time.time() - start_time, 1e-9)
        metrics = {"eps": int((self.state.episode - start_episode) / elapsed)}
        order = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                 "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg",
                 "loss/value_avg", "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var"]
        values = dict(zip(keys, gathered.tolist()))
        metrics.update({k: values[k] for k in order})
        metrics.update({k: values[k] for k in _SAMPLING_METRICS if k in values})
        metrics["val/num_eos_tokens"] = int(num_eos.sum().item())
        metrics["lr"] = self.lr_scheduler.get_last_lr()[0]
        metrics["episode"] = self.state.episode
        return metrics

    # ------------------------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------------------------

    def _resume(self, checkpoint: str) -> None:
        """Load everything a checkpoint holds, so the next update is the one the saved run would have done.

        Everything is read and checked before anything is loaded (the trainer state; both models' weights,
        names and shapes, against the models; the optimizer's parameter groups and state shapes; the scheduler
        file), so a checkpoint that does not fit raises and leaves this trainer as it was.
        """
        state_file = os.path.join(checkpoint, TRAINER_STATE_NAME)
        if not os.path.isfile(state_file):
            raise ValueError(f"{checkpoint} is not a PPOTrainer checkpoint (no {TRAINER_STATE_NAME})")
        state = OnlineTrainerState.load_from_json(state_file)
        weights = None
        if not (self.is_fsdp_enabled or self.is_deepspeed_enabled):
            weights = self._read_checkpoint_weights(checkpoint)
            self._check_optimizer_checkpoint(checkpoint)
        # nothing above changed the trainer; from here on the checkpoint is known to fit
        self.state = state
        self._load_callback_state()
        if self.is_deepspeed_enabled:
            from transformers.integrations.deepspeed import deepspeed_load_checkpoint

            deepspeed_load_checkpoint(self.model_wrapped, checkpoint, load_module_strict=not self.is_peft_model)
        elif weights is None:
            super()._load_from_checkpoint(checkpoint, self.model_wrapped)
        else:
            for module, state_dict in weights:
                _apply_weights(module, state_dict)
        self._load_optimizer_and_scheduler(checkpoint)
        self._load_scaler(checkpoint)
        self._load_rng_state(checkpoint)

    def _read_checkpoint_weights(self, checkpoint: str) -> list[tuple[nn.Module, dict]]:
        """The policy's weights from the checkpoint folder, the value model's from its ``value_model`` sub-folder,
        read and checked against the models (nothing is loaded)."""
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        return [
            (wrapper.policy, _read_weights(wrapper.policy, checkpoint)),
            (wrapper.value_model, _read_weights(wrapper.value_model, os.path.join(checkpoint, VALUE_MODEL_DIR))),
        ]

    def _check_optimizer_checkpoint(self, checkpoint: str) -> None:
        """The checkpoint's optimizer state must fit this optimizer (groups, parameter counts, state shapes)."""
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        for name in (OPTIMIZER_NAME, SCHEDULER_NAME):
            if not os.path.isfile(os.path.join(checkpoint, name)):
                raise ValueError(f"checkpoint {checkpoint} has no {name}: it cannot continue the run")
        saved = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True, mmap=True)
        groups = saved.get("param_groups", [])
        mine = self.optimizer.param_groups
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in mine]:
            raise ValueError(
                f"checkpoint {checkpoint}: the optimizer state has parameter groups of sizes "
                f"{[len(g['params']) for g in groups]}, this trainer's optimizer {[len(g['params']) for g in mine]}"
            )
        ids = [i for g in groups for i in g["params"]]
        params = [p for g in mine for p in g["params"]]
        for i, (key, p) in enumerate(zip(ids, params)):
            for k, v in saved.get("state", {}).get(key, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                    raise ValueError(
                        f"checkpoint {checkpoint}: optimizer state {k!r} of parameter {i} has shape {tuple(v.shape)}, "
                        f"the parameter {tuple(p.shape)}"
                    )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Policy from the checkpoint folder, value model from its ``value_model`` sub-folder (FSDP: the Trainer's)."""
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        for module, state_dict in self._read_checkpoint_weights(resume_from_checkpoint):
            _apply_weights(module, state_dict)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy (``from_pretrained``-loadable) and the tokenizer; checkpoints also get the value model."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        try:
            state_dict = self.accelerator.get_state_dict(self.model_wrapped)  # collective under ZeRO-3 / FSDP
        except ValueError:
            # ZeRO-3 without stage3_gather_16bit_weights_on_model_save: DeepSpeed's own checkpoint is the record
            logger.warning("ZeRO-3 weights not gathered on save (set zero3_save_16bit_model: true); policy not saved")
            return
        if not self.args.should_save:
            return
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        os.makedirs(output_dir, exist_ok=True)
        parts = [("policy.", wrapper.policy, output_dir)]
        if _internal_call:
            parts.append(("value_model.", wrapper.value_model, os.path.join(output_dir, VALUE_MODEL_DIR)))
        for prefix, module, folder in parts:
            sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
            module.save_pretrained(folder, state_dict=sub)
        self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # ------------------------------------------------------------------------------------------------------------
    # sample completions
    # ------------------------------------------------------------------------------------------------------------

    def generate_completions(self, sampling: bool = False):
        """A table of (query, model response, score) for the eval prompts, printed with rich and sent to trackers.

        TRL's: near-greedy sampling (temperature 0.01), responses truncated at the stop token, scored by the
        reward model; ``sampling=True`` (during training) uses one batch only. Runs on a forked RNG so that
        it does not change the training run's random stream.
        """
        import pandas as pd
        from accelerate.utils import gather_object

        args = self.args
        tok = self.processing_class
        pad = tok.pad_token_id
        dataset = self.eval_dataset if self.eval_dataset is not None else self.train_dataset
        acc = self.accelerator
        config = self._rollout_generation_config(0.01 + 1e-7)
        mine = list(range(acc.process_index, len(dataset), acc.num_processes))
        per_process = math.ceil(len(dataset) / acc.num_processes)  # same loop length on every process (gathers)
        bs = args.per_device_eval_batch_size
        table = defaultdict(list)
        devices = [acc.device] if acc.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self._unwrapped_for_generation() as unwrapped:
            for start in range(0, per_process, bs):
                idx = mine[start : start + bs]
                query = self._collate(dataset, idx) if idx else None
                queries_text, responses_text, scores = [], [], []
                if query is not None:
                    context_length = query.shape[1]
                    query_response = self._generate(unwrapped.policy, query, query.shape[0], config)
                    response = query_response[:, context_length:]
                    postprocessed_response = response
                    if self.stop_token_id is not None:
                        postprocessed_response = truncate_response(self.stop_token_id, pad, response)
                    _, score, _ = get_reward(
                        self.reward_model, torch.cat((query, postprocessed_response), 1), pad, context_length
                    )
                    queries_text = tok.batch_decode(query, skip_special_tokens=True)
                    responses_text = tok.batch_decode(postprocessed_response)
                    scores = score.float().cpu().tolist()
                table["query"].extend(gather_object(queries_text))
                table["model response"].extend(gather_object(responses_text))
                table["score"].extend(gather_object(scores))
                if sampling:
                    break
        df = pd.DataFrame(table)
        self.last_completions = df
        shown = df.iloc[0:5]
        # A script's final call often comes right after the last update's sample table (same step, same model,
        # near-greedy sampling, so the same rows): print those rows once.
        seen = self._printed_completions
        repeat = seen is not None and seen[0] == self.state.global_step and seen[1].equals(shown)
        self._printed_completions = (self.state.global_step, shown)
        if acc.is_main_process:
            if not repeat:
                _print_rich_table(shown)
            self._log_table(df)
        return df

    def _log_table(self, df) -> None:
        report_to = self.args.report_to or []
        if "wandb" in report_to:
            import wandb

            if wandb.run is not None:
                wandb.log({"completions": wandb.Table(dataframe=df)})
        if "comet_ml" in report_to:
            from trl.trainer.utils import log_table_to_comet_experiment

            log_table_to_comet_experiment(name="completions.csv", table=df)
        if "trackio" in report_to:
            import trackio

            trackio.log({"completions": trackio.Table(dataframe=df)})
        if "tensorboard" in report_to:
            from transformers.integrations import TensorBoardCallback

            for cb in self.callback_handler.callbacks:
                if isinstance(cb, TensorBoardCallback) and cb.tb_writer is not None:
                    cb.tb_writer.add_text("completions", _markdown_table(df), self.state.global_step)


# ---------------------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------------------


_SAMPLING_METRICS = ("sampling/kept_size_mean", "sampling/label_outside_frac", "sampling/kept_mass_mean")


def _exact_div(a: int, b: int, message: str) -> int:
    q = a // b
    if a != q * b:
        raise ValueError(f"{message}, inexact division: {a} / {b} = {a / b}")
    return q


def _disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0


def _shared_storage(module: nn.Module) -> dict[str, list[str]]:
    """For each state-dict key, the keys whose tensors share its storage (tied weights), itself included."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for k, v in module.state_dict(keep_vars=True).items():
        groups[(v.device, v.data_ptr()) if v.numel() else ("empty", k)].append(k)
    return {k: keys for keys in groups.values() for k in keys}


def _weights_mismatch(module: nn.Module, state_dict: dict) -> str | None:
    """What keeps ``state_dict`` from loading into ``module`` exactly (None: it fits). A tied weight may be
    saved under one of its names only (``save_pretrained`` drops the others)."""
    expected = module.state_dict()
    tied = _shared_storage(module)
    missing = sorted(k for k in expected if k not in state_dict and not any(t in state_dict for t in tied[k]))
    unexpected = sorted(k for k in state_dict if k not in expected)
    shapes = [f"{k} {tuple(v.shape)} (model {tuple(expected[k].shape)})" for k, v in state_dict.items()
              if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    if not (missing or unexpected or shapes):
        return None
    return f"missing {missing[:8]}, unexpected {unexpected[:8]}, shape mismatches {shapes[:8]}"


def _read_weights(module: nn.Module, folder: str):
    """A ``save_pretrained`` folder's weights for ``module``, checked against it (names and shapes); nothing is
    loaded. Single file or sharded; a PEFT model's adapter.

    transformers >= 5 saves some architectures in their original key format (GPT-NeoX's ``lm_head`` as
    ``embed_out``); when the file's names are not the module's, transformers' own loader maps them.
    """
    import json

    import safetensors.torch

    if hasattr(module, "peft_config"):
        from peft import get_peft_model_state_dict

        path = os.path.join(folder, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise ValueError(f"no adapter_model.safetensors in {folder}")
        state_dict = safetensors.torch.load_file(path)
        expected = get_peft_model_state_dict(module, adapter_name=module.active_adapter)
        if set(state_dict) != set(expected) or any(state_dict[k].shape != expected[k].shape for k in expected):
            raise ValueError(f"adapter checkpoint {folder} does not match the model's adapter: saved "
                             f"{sorted(state_dict)[:8]}, model {sorted(expected)[:8]}")
        return state_dict
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(folder, v) for v in json.load(f)["weight_map"].values()})
    else:
        raise ValueError(f"no model.safetensors (or index) in {folder}")
    state_dict = {}
    for path in files:
        state_dict.update(safetensors.torch.load_file(path, device="cpu"))
    problem = _weights_mismatch(module, state_dict)
    if problem is not None and hasattr(module, "config") and hasattr(type(module), "from_pretrained"):
        converted = _converted_weights(module, folder)
        if converted is not None:
            state_dict, problem = converted, None
    if problem is not None:
        raise ValueError(f"checkpoint {folder} does not match {type(module).__name__}: {problem}")
    return state_dict


def _converted_weights(module: nn.Module, folder: str) -> dict | None:
    """The folder's weights as transformers' ``from_pretrained`` names them for this architecture (None: they do
    not fit even then)."""
    try:
        loaded, info = type(module).from_pretrained(folder, config=module.config, output_loading_info=True)
    except (OSError, ValueError, RuntimeError):
        return None
    if info.get("missing_keys") or info.get("unexpected_keys") or info.get("mismatched_keys"):
        return None  # a weight the file does not hold would be left at its random initialisation
    state_dict = loaded.state_dict()
    return state_dict if _weights_mismatch(module, state_dict) is None else None


def _apply_weights(module: nn.Module, state_dict: dict) -> None:
    """Load weights checked by ``_read_weights`` into ``module`` in place."""
    if hasattr(module, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(module, state_dict, adapter_name=module.active_adapter)
        return
    module.load_state_dict(state_dict, strict=False)  # strict=False: tied weights are saved once


def _print_rich_table(df) -> None:
    """Print through ``tqdm.write``, which lifts a running progress bar out of the way and redraws it below."""
    from tqdm.auto import tqdm

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        tqdm.write(df.to_string())
        return
    table = Table(show_lines=True)
    for column in df.columns:
        table.add_column(str(column))
    for _, row in df.iterrows():
        table.add_row(*[str(x) for x in row.to_list()])
    console = Console()  # the terminal's width and colours
    with console.capture() as captured:
        console.print(table)
    tqdm.write(captured.get().rstrip("\n"))


def _markdown_table(df) -> str:
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in row.to_list()) + " |")
    return "\n".join(lines)
