"""Drop-in ``DistillationTrainer`` / ``DistillationConfig`` for TRL 1.16: change one import, keep everything else.

    from fastrl import DistillationConfig, DistillationTrainer   # instead of: from trl import ...

TRL 1.16's ``DistillationTrainer`` trains a student on its own completions (on-policy, generated with transformers
or vLLM, tool calls included) to match a teacher's next-token distribution under the generalized JSD of ``beta``
(0: KL(teacher || student), 1: KL(student || teacher), between: the JSD with mixture ``(1 - beta) p_s + beta p_t``),
at the sampling ``temperature``. Its loss already runs each model's body for the last hidden states
(``_get_last_hidden_state``) and folds both LM heads chunk by chunk (``_chunked_divergence_loss``: float32 tiles of
4096 tokens x 32768 vocabulary per model, a float32 ``[V, H]`` weight-gradient buffer).

What fastrl changes, and nothing else: that loss (``distillation_loss`` here) is ``fastrl.fused_divergence`` on the
same hidden states and heads, under the same logit transform per model (TRL's rules: ``logit_scale`` /
``output_multiplier`` / ``lm_head_multiplier`` / ``1 / logits_scaling``, then ``final_logit_softcapping``, then the
temperature; read by ``fastrl.trainers._lm_head.head_settings_from_config``), the same compute dtype per model
(autocast's, else the hidden states'), the same reduction (``sum / num_items_in_batch``, or the mean over the
local valid tokens) and the same logged ``entropy``. Neither model's ``[B, T, V]`` logits exist at any point;
masked-off tokens (prompt, padding, tool results) are never computed. Generation, buffering, gradient
accumulation, PEFT (LoRA; TRL refuses adapters on the head and prompt learning), VLM inputs, ``_forward_redirection``
for DDP / FSDP / DeepSpeed and every metric are TRL's own code, inherited.

Falls back to TRL's own ``_chunked_divergence_loss`` (with one warning on the ``fastrl.distillation`` logger naming
why, and ``trainer._fastrl_last_path == "trl"``) when ``fused_loss=False``. A teacher served remotely (``trl.experimental.server_distillation.ServerDistillationTrainer``)
and cross-tokenizer distillation (``trl.experimental.gold``) are other TRL classes, which fastrl does not replace.

Plus the two memory options of fastrl's other trainers (``fastrl.trainers.memory``): ``tiled_mlp`` (student and
teacher) and ``activation_offloading`` (the student's training step).
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field

import torch
import trl

from fastrl.ops.backend import BACKENDS
from fastrl.trainers._common import MULTIMODAL_KEYS, default_activation_checkpointing, opt
from fastrl.trainers._distributed import check_launch
from fastrl.trainers._guards import check_forward_redirection, check_overrides
from fastrl.trainers._lm_head import (
    HeadSettings,
    is_tensor_parallel_head,
    is_zero3_param,
    zero3_gather_ctx,
    Zero3Recompute,
    call_with_head,
    head_settings_from_config,
)
from fastrl.trainers.memory import (
    MemoryOptions,
    MemoryStepsMixin,
    check_memory_options,
    trl_alias_warnings_silenced,
)

__all__ = ["DistillationConfig", "DistillationTrainer", "check_distillation_options", "distillation_loss"]

logger = logging.getLogger("fastrl.distillation")

# TRL 1.16's multimodal micro-batch fields that its `_compute_loss` passes to both models' bodies: those its
# `_get_last_hidden_state` takes
_BODY_KEYS = tuple(k for k in MULTIMODAL_KEYS
                   if k in inspect.signature(trl.DistillationTrainer._get_last_hidden_state).parameters)


@dataclass
class DistillationConfig(trl.DistillationConfig):
    """TRL 1.16's ``DistillationConfig`` plus fastrl's own options (every TRL option keeps its meaning).

    Args (fastrl only):
        fused_loss (`bool`, defaults to `True`): compute the divergence with `fastrl.fused_divergence`. `False`
            gives stock TRL's loss (`_chunked_divergence_loss`).
        fastrl_backend (`str` or `None`, defaults to `None`): the backend of `fastrl.fused_divergence`
            (`"triton"`, `"torch"`, ...); `None` lets fastrl pick (Triton on CUDA, chunked PyTorch on CPU; env
            `FASTRL_BACKEND` overrides).
        activation_offloading (`bool`, defaults to `False`): move the activations saved for backward to CPU memory
            during each training step (TRL's `OffloadActivations`). No effect on a CPU-only model.
        tiled_mlp (`int`, defaults to `0`): `n` > 0 runs every decoder MLP (student and teacher) over `n` chunks
            of the tokens, each recomputed in backward; undone when `train()` returns. Same loss and gradients.
    """

    fused_loss: bool = field(default=True, metadata={"help": "Compute the divergence with fastrl.fused_divergence."})
    fastrl_backend: str | None = field(
        default=None, metadata={"help": "fastrl backend: 'triton', 'torch' or None (automatic)."}
    )
    # TRL turns activation checkpointing on by default through the old name, which transformers 5 answers with a
    # FutureWarning on every config built: keep TRL's default under the current name instead (__post_init__)
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated alias of activation_checkpointing (default: on, as in TRL)."}
    )
    activation_offloading: bool = field(
        default=False, metadata={"help": "Offload the activations saved for backward to CPU memory (TRL's)."}
    )
    tiled_mlp: int = field(
        default=0,
        metadata={"help": "Run each decoder MLP over this many token chunks, recomputed in backward (0: off)."},
    )

    def __post_init__(self):
        default_activation_checkpointing(self, trl.DistillationConfig)
        check_distillation_options(self)  # before TRL's own checks: the same named errors for a stock config
        super().__post_init__()


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_distillation_options(args) -> None:
    """Validate a (fastrl or stock TRL) ``DistillationConfig`` when it is made or handed to the trainer, not at the
    first loss after a whole generation: ``ValueError`` naming the field, what it must be and what came."""
    beta = args.beta
    if not _is_number(beta) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"DistillationConfig.beta must be a number in [0, 1] (0: KL(teacher || student), 1: "
                         f"KL(student || teacher), between: the generalized JSD), got {beta!r}")
    t = args.temperature
    if not _is_number(t) or not (t > 0 and math.isfinite(t)):
        raise ValueError(f"DistillationConfig.temperature must be a finite number > 0 (it divides both models' "
                         f"logits), got {t!r}")
    fused = getattr(args, "fused_loss", True)
    if not isinstance(fused, bool):
        raise ValueError(f"DistillationConfig.fused_loss must be True or False, got {fused!r}")
    backend = getattr(args, "fastrl_backend", None)
    if backend not in (None, *BACKENDS):
        raise ValueError(f"DistillationConfig.fastrl_backend must be None or one of {BACKENDS}, got {backend!r}")
    check_memory_options(getattr(args, "activation_offloading", False), getattr(args, "tiled_mlp", 0))


# ---------------------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------------------


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    # TRL's rule (trl/kernels/chunked_divergence.py): the autocast dtype when autocast is on, else the hidden's
    dev = hidden.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """An FSDP2 ``DTensor`` gathered whole (a plain tensor, or a tensor-parallel head that fastrl reads shard by
    shard, as it is)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) and not is_tensor_parallel_head(t) else t


def _vocab_rows(weight: torch.Tensor) -> int:
    shape = getattr(weight, "ds_shape", None)  # a ZeRO-3 partitioned weight keeps its full shape here
    return int(shape[0]) if shape is not None else int(weight.shape[0])


def distillation_loss(
    student_hidden: torch.Tensor,  # [B, K, H_s], aligned to the completion tokens
    teacher_hidden: torch.Tensor,  # [B, K, H_t]
    student_weight: torch.Tensor,  # [V, H_s]
    teacher_weight: torch.Tensor,  # [V, H_t]
    mask: torch.Tensor,  # [B, K], nonzero = the token counts
    *,
    beta: float,
    student: HeadSettings,  # logit_scale, softcap, temperature (and fastrl's backend)
    teacher: HeadSettings,
    num_items_in_batch: torch.Tensor | int | None = None,
    student_bias: torch.Tensor | None = None,  # [V]
    teacher_bias: torch.Tensor | None = None,  # [V]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL 1.16's ``_chunked_divergence_loss`` through ``fastrl.fused_divergence``: ``(loss, entropy_sum, n_valid)``.

    The loss is the sum of the per-token divergences over the valid tokens divided by ``num_items_in_batch`` (or,
    when None, by the number of valid tokens, at least 1); ``entropy_sum`` the sum of the student's per-token
    entropy (nats, no gradient); ``n_valid`` the number of valid tokens. Gradients reach the student's hidden
    states, weight and bias only. The heads may be FSDP2 ``DTensor`` s or DeepSpeed ZeRO-3 partitioned weights
    (gathered for the forward and again for the backward).
    """
    from fastrl.ops.divergence import fused_divergence

    if student_hidden.shape[:-1] != mask.shape or teacher_hidden.shape[:-1] != mask.shape:
        raise ValueError(f"distillation_loss: student_hidden {tuple(student_hidden.shape)} and teacher_hidden "
                         f"{tuple(teacher_hidden.shape)} must be [B, K, H] with [B, K] = the mask's shape "
                         f"{tuple(mask.shape)}")
    v_s, v_t = _vocab_rows(student_weight), _vocab_rows(teacher_weight)
    if v_s != v_t:
        raise ValueError(f"distillation_loss: the student's LM head has {v_s} vocabulary rows but the teacher's has "
                         f"{v_t}; the divergence compares full next-token distributions, which needs one vocabulary")
    if teacher.temperature != student.temperature:
        raise ValueError(f"distillation_loss: one temperature divides both models' logits, got student "
                         f"{student.temperature} and teacher {teacher.temperature}")
    valid = mask != 0
    s_dtype, t_dtype = _compute_dtype(student_hidden), _compute_dtype(teacher_hidden)
    dev = student_hidden.device.type
    t_hidden = teacher_hidden.detach()

    def head_fn(h, w, b):  # the student's head gathered (call_with_head / Zero3Recompute)
        tw, tb = teacher_weight, teacher_bias
        with zero3_gather_ctx(tw, tb):  # a ZeRO-3 teacher head: gathered here, in the forward and the recompute
            tw, tb = _full(tw).detach(), None if tb is None else _full(tb).detach()
            with torch.autocast(dev, enabled=False):  # fastrl accumulates in float32 itself
                div, ent = fused_divergence(
                    h.to(s_dtype), w.to(s_dtype), t_hidden.to(t_dtype), tw.to(t_dtype),
                    beta=float(beta), temperature=float(student.temperature),
                    bias=None if b is None else b.to(s_dtype), teacher_bias=None if tb is None else tb.to(t_dtype),
                    logit_scale=float(student.logit_scale), teacher_logit_scale=float(teacher.logit_scale),
                    softcap=student.softcap, teacher_softcap=teacher.softcap, mask=valid, with_entropy=True,
                    backend=student.backend,
                )
        return div, ent

    if is_zero3_param(teacher_weight) and not is_zero3_param(student_weight):
        div, ent = Zero3Recompute.apply(head_fn, student_hidden, student_weight, student_bias)
    else:
        div, ent = call_with_head(head_fn, student_hidden, student_weight, student_bias)
    n_valid = valid.sum()
    loss = div.sum()
    entropy_sum = torch.where(valid, ent.detach(), 0.0).sum()
    if num_items_in_batch is None:
        loss = loss / n_valid.clamp(min=1)  # a fully masked rank: a finite zero, not 0 / 0
    else:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss, entropy_sum, n_valid


# ---------------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------------


# the trl.DistillationTrainer methods fastrl.DistillationTrainer overrides or calls, with the leading parameters it
# passes
TRL_OVERRIDES = (
    ("_compute_loss", ("unwrapped_student", "inputs", "num_items_in_batch")),
    ("_generate_and_score_completions", ("inputs",)),
    ("_get_last_hidden_state", ("unwrapped_model", "input_ids", "attention_mask", "logits_to_keep")),
)


class DistillationTrainer(MemoryStepsMixin, trl.DistillationTrainer):
    """TRL 1.16's ``DistillationTrainer`` with the loss through ``fastrl.fused_divergence`` (module docstring).

    Same constructor, datasets, generation, tools, callbacks and logging as ``trl.DistillationTrainer``. ``args``
    may be a ``fastrl.DistillationConfig`` (for fastrl's options) or a stock ``trl.DistillationConfig``.
    """

    _tag_names = [*getattr(trl.DistillationTrainer, "_tag_names", []), "fastrl"]

    def __init__(self, model, teacher_model=None, args=None, *pargs, **kwargs):
        if args is None:
            from trl.trainer.utils import get_config_model_id

            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = DistillationConfig(f"{name.split('/')[-1]}-Distillation")
        if not isinstance(args, trl.DistillationConfig):
            raise TypeError(f"args must be a fastrl.DistillationConfig or trl.DistillationConfig, got "
                            f"{type(args).__name__}")
        check_distillation_options(args)  # a stock config too, and one changed after it was made
        if teacher_model is None and type(self)._compute_loss is DistillationTrainer._compute_loss:
            raise ValueError(
                "teacher_model is None: fastrl.DistillationTrainer needs the teacher as a model or a model id/path "
                "(a teacher served remotely is trl.experimental.server_distillation.ServerDistillationTrainer, "
                "which fastrl does not replace)"
            )
        check_launch(args, self)
        check_overrides(trl.DistillationTrainer, TRL_OVERRIDES, "fastrl.DistillationTrainer's loss")
        check_forward_redirection(trl.DistillationTrainer)  # the fused loss runs the teacher through it
        super().__init__(model, teacher_model, args, *pargs, **kwargs)
        if self.teacher_model is not None:
            unwrap = self.accelerator.unwrap_model
            v_s = _vocab_rows(unwrap(self.model).get_output_embeddings().weight)
            v_t = _vocab_rows(unwrap(self.teacher_model).get_output_embeddings().weight)
            if v_s != v_t:  # TRL compares config.vocab_size only; the heads' rows are what the loss reads
                raise ValueError(
                    f"The student's LM head has {v_s} vocabulary rows but the teacher's has {v_t}: distillation "
                    "compares full next-token distributions, which needs one vocabulary (the same tokenizer and "
                    "head size); cross-tokenizer distillation is trl.experimental.gold.GOLDTrainer"
                )
        self._fastrl_warned: set[str] = set()
        self._fastrl_last_path: str | None = None
        self._fastrl_memory = MemoryOptions(
            self.model, {"student": self.model, "teacher": self.teacher_model},
            activation_offloading=opt(self.args, "activation_offloading", False),
            tiled_mlp=opt(self.args, "tiled_mlp", 0),
        )

    def _generate_and_score_completions(self, inputs):
        with trl_alias_warnings_silenced():
            return super()._generate_and_score_completions(inputs)

    def fused_reason(self) -> str | None:
        """Why the loss cannot go through ``fastrl.fused_divergence`` here (None: it can)."""
        if not opt(self.args, "fused_loss", True):
            return "fused_loss=False in the config"
        return None

    def _head_settings(self, unwrapped) -> HeadSettings:
        return head_settings_from_config(unwrapped, temperature=float(self.temperature),
                                         backend=opt(self.args, "fastrl_backend", None))

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        reason = self.fused_reason()
        if reason is not None:
            if reason not in self._fastrl_warned:
                self._fastrl_warned.add(reason)
                logger.warning("fastrl.DistillationTrainer: TRL's own divergence loss runs (%s)", reason)
            self._fastrl_last_path = "trl"
            return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        self._fastrl_last_path = "fused"

        # TRL 1.16's `_compute_loss` up to the loss: both bodies' last hidden states over the completion tokens
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        completion_mask = inputs["completion_mask"]
        loss_mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        logits_to_keep = inputs["completion_ids"].size(1)
        multimodal_inputs = {k: inputs[k] for k in _BODY_KEYS if k in inputs}
        student_hidden = self._get_last_hidden_state(
            unwrapped_student, input_ids, attention_mask, logits_to_keep, **multimodal_inputs
        )
        self.teacher_model.eval()
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            teacher_hidden = self._forward_redirection(
                self.teacher_model, unwrapped_teacher, self._get_last_hidden_state, unwrapped_teacher, input_ids,
                attention_mask, logits_to_keep, **multimodal_inputs,
            )
        student_head = unwrapped_student.get_output_embeddings()
        teacher_head = unwrapped_teacher.get_output_embeddings()
        if student_head.weight.device != teacher_head.weight.device:
            raise ValueError(
                f"The student `lm_head` is on {student_head.weight.device} but the teacher `lm_head` is on "
                f"{teacher_head.weight.device}. Place both on the same device in their `device_map`."
            )
        device = student_head.weight.device
        loss, entropy_sum, n_valid = distillation_loss(
            student_hidden.to(device), teacher_hidden.to(device), student_head.weight, teacher_head.weight,
            loss_mask.to(device), beta=self.beta, student=self._head_settings(unwrapped_student),
            teacher=self._head_settings(unwrapped_teacher), num_items_in_batch=num_items_in_batch,
            student_bias=student_head.bias, teacher_bias=teacher_head.bias,
        )
        return loss, entropy_sum.detach(), n_valid
