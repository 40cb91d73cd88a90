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

A head sharded over the vocabulary by transformers' tensor-parallel plan (a ``Shard(0)`` DTensor on the "tp" mesh) is
never gathered: fastrl's ops take it as it is (``fastrl.ops.sharded``), and its ``colwise_gather_output`` module, which
would gather ``[N, V]`` logits, is never called. Any other head is gathered as TRL gathers it: an FSDP2 ``DTensor`` weight with ``full_tensor()`` (differentiable:
its gradient is reduce-scattered back), a DeepSpeed ZeRO-3 partitioned weight with ``GatheredParameters`` for
the forward and again for the backward (``Zero3Recompute``: fastrl's autograd state keeps a reference to the
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
    "Zero3Recompute",
    "add_fastrl_lm_head",
    "call_with_head",
    "head_precision",
    "head_settings_from_config",
    "is_tensor_parallel_head",
    "is_zero3_param",
    "lm_head_logprobs",
    "support_stats",
    "unwrap_causal_lm",
    "zero3_gather_ctx",
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


def is_zero3_param(p: torch.Tensor | None) -> bool:
    return p is not None and hasattr(p, "ds_id")


def zero3_gather_ctx(weight, bias):
    # TRL's helper: a null context unless ZeRO-3 is on and the parameters are partitioned right now
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    return maybe_gather_lm_head_ctx(weight, bias)


class Zero3Recompute(torch.autograd.Function):
    """``fn(hidden, weight, bias)`` with a ZeRO-3 partitioned head: gather for the forward, gather again and
    recompute for the backward (the partitioned weight's storage is empty in between)."""

    @staticmethod
    def forward(ctx, fn, hidden, weight, bias):
        with zero3_gather_ctx(weight, bias), torch.no_grad():
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
        with zero3_gather_ctx(weight, bias), torch.enable_grad():
            h = hidden.detach().requires_grad_(need_h)
            outs = ctx.fn(h, weight, bias)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and isinstance(o, torch.Tensor)
                     and o.requires_grad]
            wrt = [x for x, need in ((h, need_h), (weight, need_w), (bias, need_b)) if need]
            got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
                if pairs and wrt else [None] * len(wrt)
        it = iter(got)
        return (None, next(it) if need_h else None, next(it) if need_w else None, next(it) if need_b else None)


def is_tensor_parallel_head(weight) -> bool:
    """A head sharded over the vocabulary by tensor parallelism (transformers' TP plan, ``colwise_gather_output``):
    a DTensor placed ``Shard(0)`` on a 1-D mesh whose dimension is named "tp". fastrl's ops read it shard by shard
    and never gather it (an FSDP2 shard, also ``Shard(0)``, lives on a mesh of another name and is gathered)."""
    from fastrl.ops.sharded import is_vocab_sharded

    if not is_vocab_sharded(weight):
        return False
    return tuple(weight.device_mesh.mesh_dim_names or ()) == ("tp",)


def call_with_head(fn: Callable, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """``fn(hidden, weight, bias)`` (a tuple of tensors) with the LM head gathered however it is distributed."""
    from torch.distributed.tensor import DTensor

    if is_tensor_parallel_head(weight):  # TP: fastrl's ops take the vocabulary shard as it is (fastrl.ops.sharded)
        return tuple(fn(hidden, weight, bias))
    if isinstance(weight, DTensor):  # FSDP2 keeps a sharded DTensor outside its unshard window
        weight = weight.full_tensor()
        if bias is not None:
            bias = bias.full_tensor()
    if is_zero3_param(weight):
        return Zero3Recompute.apply(fn, hidden, weight, bias)
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
    support=None,  # None, a KeptSet (one row per target) or a SamplerRule: log-probs over the sampler's support
    positions: torch.Tensor | None = None,  # [N]: completion position of each target (a rule's min_tokens)
    return_kept_mass: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``fastrl.fused_logprobs`` under the model's logit transform and the trainer's precision settings.

    ``support``/``positions``/``return_kept_mass`` are passed on only when set (``fastrl.fused_logprobs``'s
    sampling-support arguments); the default call is the one from before supports existed."""
    from fastrl.ops.linear_logprob import fused_logprobs

    extra = {}
    if support is not None:
        extra["support"] = support
        if positions is not None:
            extra["positions"] = positions
    if return_kept_mass:
        extra["return_kept_mass"] = True
    with head_precision(hidden, weight, bias, settings) as (h, w, b):
        return fused_logprobs(
            h, w, targets, bias=b, temperature=settings.temperature, logit_scale=settings.logit_scale,
            softcap=settings.softcap, with_entropy=with_entropy, backend=settings.backend,
            vocab_chunk=settings.vocab_chunk, **extra,
        )


def support_stats(kept, outside: torch.Tensor | None = None, log_kept_mass: torch.Tensor | None = None) -> dict:
    """Sums for the ``sampling/*`` metrics over the tokens of ``kept`` (counted tokens only): token count, kept ids,
    targets outside the rule (``outside``, bool per token), full-softmax mass of the support (``log_kept_mass``)."""
    n = len(kept)
    out = {"tokens": float(n), "kept": float(kept.sizes().sum()) if n else 0.0}
    if outside is not None:
        out["outside"] = float(outside.reshape(-1).sum())
    if log_kept_mass is not None:
        out["mass"] = float(log_kept_mass.detach().double().exp().sum())
    return out


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
                        fastrl_head_fn=None, fastrl_support=None, fastrl_completion_length=None,
                        fastrl_kept_mass=False, **kwargs):
        if not fused_lm_head:
            # the forward from before (TRL's fused wrapper, or the model's own): generation, plain losses
            passed = (("labels", labels), ("shift_labels", shift_labels), ("num_items_in_batch", num_items_in_batch))
            for k, v in passed:
                if v is not None:
                    kwargs[k] = v
            if fastrl_head_fn is not None or fastrl_support is not None:
                raise ValueError("fastrl_head_fn / fastrl_support need fused_lm_head=True")
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

        if fastrl_support is None:
            def head(h_, w_, b_):
                return lm_head_logprobs(h_, w_, b_, t, st, with_entropy=True)
        else:
            head = _support_head(self, fastrl_support, fastrl_completion_length, mask, t, st, fastrl_kept_mass)

        logp, ent = call_with_head(head, h, weight, bias)[:2]
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


def _support_head(model, support, K, mask: torch.Tensor, targets: torch.Tensor, st: HeadSettings, kept_mass: bool):
    """The head function of a forward called with ``fastrl_support``: log-probs of the scored labels over the
    sampler's support. ``support``: a KeptSet laid out ``[B, K]`` over the last ``K`` label columns (the completion),
    or a SamplerRule (``K`` = ``fastrl_completion_length``), replayed on this model's own logits with
    ``fastrl.replay_rule`` and then scored over the replayed sets. Per-call sums for the ``sampling/*`` metrics
    are appended to ``model._fastrl_support_stats``."""
    from fastrl.ops.support import KeptSet, SamplerRule

    B, L1 = mask.shape
    if isinstance(support, KeptSet):
        if len(support.lead_shape) != 2 or support.lead_shape[0] != B:
            raise ValueError(f"fastrl_support must be a KeptSet laid out [B={B}, K], got {support.lead_shape}")
        K = support.lead_shape[1]
    elif isinstance(support, SamplerRule):
        if not isinstance(K, int) or K <= 0:
            raise ValueError(f"a SamplerRule fastrl_support needs fastrl_completion_length, a positive int, got {K!r}")
    else:
        raise TypeError(f"fastrl_support must be a KeptSet or a SamplerRule, got {type(support).__name__}")
    if K > L1:
        raise ValueError(f"the support covers {K} completion tokens but the sequence predicts only {L1}")
    start = L1 - K
    if bool(mask[:, :start].any()):
        b, c = (int(i) for i in mask[:, :start].nonzero()[0])
        raise ValueError(f"label ({b}, {c}) is scored but lies before the {K} completion tokens the support covers")
    b_idx, c_idx = mask.nonzero(as_tuple=True)  # row-major: the order of hidden[mask]
    pos = c_idx - start  # completion position of each scored token
    stats = getattr(model, "_fastrl_support_stats", None)

    def head(h_, w_, b_):
        outside = None
        if isinstance(support, SamplerRule) and support.is_identity:  # keeps every id: the full softmax
            out = lm_head_logprobs(h_, w_, b_, targets, st, with_entropy=True, support=None,
                                   return_kept_mass=kept_mass)
            if stats is not None:
                stats.append({"tokens": float(targets.numel()), "kept": float(targets.numel() * w_.shape[0]),
                              "outside": 0.0, **({"mass": float(targets.numel())} if kept_mass else {})})
            return out
        if isinstance(support, KeptSet):
            kept = support.to(h_.device)[b_idx.to(h_.device) * K + pos.to(h_.device)]
        elif is_tensor_parallel_head(w_):  # the rule replayed across the vocabulary shards (fastrl.ops.sharded_rules)
            from fastrl.ops.config import LogitTransform
            from fastrl.ops.sharded import resolve_sharded_support

            tf = LogitTransform(temperature=st.temperature, logit_scale=st.logit_scale, softcap=st.softcap)
            with head_precision(h_, w_, b_, st) as (hh, ww, bb):
                kept, outside = resolve_sharded_support(support, hh.detach(), ww, bb, targets, tf, -100, pos)
        else:
            from fastrl.ops.rules import replay_rule

            with head_precision(h_, w_, b_, st) as (hh, ww, bb):
                kept, outside = replay_rule(
                    hh.detach(), ww.detach(), targets, support, bias=None if bb is None else bb.detach(),
                    temperature=st.temperature, logit_scale=st.logit_scale, softcap=st.softcap, positions=pos,
                    backend=st.backend,
                )
        out = lm_head_logprobs(h_, w_, b_, targets, st, with_entropy=True, support=kept, return_kept_mass=kept_mass)
        if stats is not None:
            stats.append(support_stats(kept, outside, out[2] if kept_mass else None))
        return out

    return head
