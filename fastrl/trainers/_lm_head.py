"""Hidden states and the LM head of a Hugging Face causal LM, handed to fastrl instead of materialising logits.

``add_fastrl_lm_head(model, ...)`` patches ``model.forward`` the way TRL 1.16's ``add_fused_lm_head`` does, so
the call still goes through every wrapper (DDP, FSDP2, DeepSpeed, PEFT, accelerate's autocast) and the
distributed hooks stay armed:

* ``model(input_ids, attention_mask, labels=labels, fused_lm_head=True)`` returns TRL's
  ``FusedCausalLMOutput``: ``log_probs`` and ``entropy`` of every next-token label, ``[B, L-1]``, zero where the
  label is ``-100``, computed by ``fastrl.fused_logprobs`` on the valid positions only. This is the contract
  TRL's ``GRPOTrainer._get_per_token_logps_and_entropies`` calls, so TRL's own loss code runs unchanged on
  fastrl's numbers (and, under ``torch.no_grad``, reference / old log-probs take fastrl's forward-only path).
* ``model(input_ids, attention_mask, fused_lm_head=True, logits_to_keep=K, fastrl_head_fn=fn)`` runs the body,
  takes the hidden states that predict the last ``K`` tokens, ``[B, K, H]``, and returns
  ``FastrlHeadOutput(head_outputs=fn(hidden, weight, bias), aux_loss=...)``: the one-pass policy loss runs
  inside the model's forward, with the LM head gathered.
* Without ``fused_lm_head`` the previous forward runs (generation is unchanged).

The LM head is gathered as TRL gathers it: an FSDP2 ``DTensor`` weight with ``full_tensor()`` (differentiable:
its gradient is reduce-scattered back), a DeepSpeed ZeRO-3 partitioned weight with ``GatheredParameters`` for
the forward and again for the backward (``_Zero3Recompute``: fastrl's autograd state keeps a reference to the
weight, whose storage ZeRO-3 frees between the two).

Logit transform (TRL's rules): ``final_logit_softcapping`` -> softcap; ``logit_scale`` / ``output_multiplier`` /
``lm_head_multiplier`` / ``1 / logits_scaling`` -> logit scale; then division by the sampling temperature.
"""

from __future__ import annotations

import functools
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.utils import ModelOutput

__all__ = [
    "HeadSettings",
    "FastrlHeadOutput",
    "add_fastrl_lm_head",
    "call_with_head",
    "head_precision",
    "head_settings_from_config",
    "lm_head_logprobs",
    "unwrap_causal_lm",
]


@dataclass(frozen=True)
class HeadSettings:
    """How the LM head's logits become a distribution, and how fastrl computes it."""

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None
    cast_lm_head_to_fp32: bool = False
    backend: str | None = None  # None: fastrl's dispatcher (triton on CUDA, torch on CPU)
    vocab_chunk: int | None = None  # None: fastrl's bounded default
    chunk_tokens: int | None = None  # tokens per one-pass policy-loss chunk; None: fastrl's default


@dataclass
class FastrlHeadOutput(ModelOutput):
    """Output of a patched forward called with ``fastrl_head_fn``: what the function returned, and the MoE aux loss."""

    head_outputs: tuple | None = None
    aux_loss: torch.Tensor | None = None


def head_settings_from_config(model, **kwargs) -> HeadSettings:
    """``HeadSettings`` with the logit scale and softcap read from the model config the way TRL 1.16 reads them."""
    text_config = model.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        s = text_config.logits_scaling
        scale = s if text_config.model_type == "hyperclovax" else 1 / s
    scale = 1.0 if scale is None else float(scale)
    return HeadSettings(logit_scale=scale, softcap=None if softcap is None else float(softcap), **kwargs)


def unwrap_causal_lm(model):
    """The ``PreTrainedModel`` under PEFT (``get_base_model``); the model itself otherwise."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


# ---------------------------------------------------------------------------------------------------------------
# Gathering the head: FSDP2 DTensor, DeepSpeed ZeRO-3
# ---------------------------------------------------------------------------------------------------------------


def _is_zero3_param(p: torch.Tensor | None) -> bool:
    return p is not None and hasattr(p, "ds_id")


def _zero3_gather_ctx(weight, bias):
    # TRL's helper: a null context unless ZeRO-3 is on and the parameters are partitioned right now
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    return maybe_gather_lm_head_ctx(weight, bias)


class _Zero3Recompute(torch.autograd.Function):
    """``fn(hidden, weight, bias)`` with a ZeRO-3 partitioned head: gather for the forward, gather again and
    recompute for the backward (the partitioned weight's storage is empty in between)."""

    @staticmethod
    def forward(ctx, fn, hidden, weight, bias):
        with _zero3_gather_ctx(weight, bias), torch.no_grad():
            outs = fn(hidden, weight, bias)
        ctx.fn = fn
        ctx.save_for_backward(hidden)
        ctx.params = (weight, bias)
        ctx.n_out = len(outs)
        ctx.mark_non_differentiable(*[o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        (hidden,) = ctx.saved_tensors
        weight, bias = ctx.params
        need_h, need_w, need_b = ctx.needs_input_grad[1:4]
        with _zero3_gather_ctx(weight, bias), torch.enable_grad():
            h = hidden.detach().requires_grad_(need_h)
            outs = ctx.fn(h, weight, bias)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and isinstance(o, torch.Tensor)
                     and o.requires_grad]
            wrt = [x for x, need in ((h, need_h), (weight, need_w), (bias, need_b)) if need]
            got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
                if pairs and wrt else [None] * len(wrt)
        it = iter(got)
        return (None, next(it) if need_h else None, next(it) if need_w else None, next(it) if need_b else None)


def call_with_head(fn: Callable, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """``fn(hidden, weight, bias)`` (a tuple of tensors) with the LM head gathered however it is distributed."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):  # FSDP2 keeps a sharded DTensor outside its unshard window
        weight = weight.full_tensor()
        if bias is not None:
            bias = bias.full_tensor()
    if _is_zero3_param(weight):
        return _Zero3Recompute.apply(fn, hidden, weight, bias)
    return tuple(fn(hidden, weight, bias))


# ---------------------------------------------------------------------------------------------------------------
# The head itself
# ---------------------------------------------------------------------------------------------------------------


@contextmanager
def head_precision(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, settings: HeadSettings):
    """Yield ``(hidden, weight, bias)`` in one dtype, with autocast off (fastrl accumulates in float32 itself).

    ``cast_lm_head_to_fp32``: everything in float32 (TRL's option). Otherwise, under autocast, the autocast dtype
    (what ``nn.Linear`` would have used); else the weight's dtype.
    """
    dev = hidden.device.type
    if settings.cast_lm_head_to_fp32:
        dt = torch.float32
    elif torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
    else:
        dt = weight.dtype
    with torch.autocast(dev, enabled=False):
        yield hidden.to(dt), weight.to(dt), (None if bias is None else bias.to(dt))


def lm_head_logprobs(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [N] or [B, T], -100 = ignored
    settings: HeadSettings,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fastrl.fused_logprobs`` under the model's logit transform and the trainer's precision settings."""
    from fastrl import fused_logprobs

    with head_precision(hidden, weight, bias, settings) as (h, w, b):
        return fused_logprobs(
            h, w, targets, bias=b, temperature=settings.temperature, logit_scale=settings.logit_scale,
            softcap=settings.softcap, with_entropy=with_entropy, backend=settings.backend,
            vocab_chunk=settings.vocab_chunk,
        )


def _moe_aux_loss(model, text_config, backbone_outputs, attention_mask):
    # Mixtral's load-balancing loss, as TRL's fused forward computes it
    import transformers
    from packaging.version import Version
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    if Version(transformers.__version__) < Version("5.0.0"):
        num_experts, top_k = model.num_experts, model.num_experts_per_tok
    else:
        num_experts = getattr(text_config, "num_experts", None) or getattr(model, "num_experts", None)
        top_k = text_config.num_experts_per_tok
    return load_balancing_loss_func(backbone_outputs.router_logits, num_experts, top_k, attention_mask)


def add_fastrl_lm_head(model, settings: HeadSettings) -> None:
    """Patch ``model.forward`` (a ``PreTrainedModel``; PEFT: its base model) to score labels with fastrl.

    Idempotent: patching again only replaces the settings. See the module docstring for the call forms.
    """
    if getattr(model, "_fastrl_head_settings", None) is not None:
        model._fastrl_head_settings = settings
        return
    previous_forward = model.forward
    text_config = model.config.get_text_config()
    model._fastrl_head_settings = settings

    @functools.wraps(type(model).forward)  # generate() validates its kwargs against this signature
    def _fastrl_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                        fastrl_head_fn=None, **kwargs):
        if not fused_lm_head:
            # the forward from before (TRL's fused wrapper, or the model's own): generation, plain losses
            passed = (("labels", labels), ("shift_labels", shift_labels), ("num_items_in_batch", num_items_in_batch))
            for k, v in passed:
                if v is not None:
                    kwargs[k] = v
            if fastrl_head_fn is not None:
                raise ValueError("fastrl_head_fn needs fused_lm_head=True")
            return previous_forward(*args, **kwargs)

        st: HeadSettings = self._fastrl_head_settings
        logits_to_keep = kwargs.pop("logits_to_keep", None)
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        out = self.base_model(*args, **kwargs)  # the body, looked up per call (FSDP / PEFT replace modules)
        lm_head = self.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        hidden = out.last_hidden_state.to(weight.device)
        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = _moe_aux_loss(self, text_config, out, kwargs.get("attention_mask"))

        if fastrl_head_fn is not None:
            if not isinstance(logits_to_keep, int) or logits_to_keep <= 0:
                raise ValueError(f"fastrl_head_fn needs logits_to_keep, a positive int, got {logits_to_keep!r}")
            # position t predicts token t + 1: the last K tokens are predicted by positions [-K-1, -1)
            h = hidden[:, -logits_to_keep - 1 : -1]
            return FastrlHeadOutput(head_outputs=call_with_head(fastrl_head_fn, h, weight, bias), aux_loss=aux_loss)

        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        labels = labels.to(weight.device)
        mask = labels != -100
        h = hidden[mask]  # [n, H]: only the scored positions (prompt and padding cost nothing)
        t = labels[mask]

        def head(h_, w_, b_):
            return lm_head_logprobs(h_, w_, b_, t, st, with_entropy=True)

        logp, ent = call_with_head(head, h, weight, bias)
        # masked_scatter keeps an all-masked micro-batch connected to the graph (a differentiable zero), as TRL does
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        entropy = ent.new_zeros(mask.shape).masked_scatter(mask, ent)
        denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / denom
        if aux_loss is not None:
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        from trl.trainer.utils import FusedCausalLMOutput

        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask, aux_loss=aux_loss)

    model.forward = types.MethodType(_fastrl_forward, model)
