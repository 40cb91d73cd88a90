"""The shared machinery of fastrl's ``torch.library`` custom ops (``torch.ops.fastrl.*``): what ``torch.compile`` sees.

Each op lives in the module of its operation (``fastrl.ops.linear_logprob``: ``linear_logprob`` and its backward;
``fastrl.losses.one_pass``: ``policy_loss_one_pass``; ``fastrl.losses.value``: ``value_loss`` and its backward;
``fastrl.ops.divergence``), registered when that module is imported; this module holds what they share.

Each op is opaque to the compiler: a fake implementation gives its output shapes (so ``fullgraph=True`` and
``dynamic=True`` trace it without running it) and ``register_autograd`` gives its backward, itself an op. The
public functions (``fastrl.fused_logprobs``, ``fastrl.policy_loss``, ``fastrl.value_loss``) check their input
in Python, then call these ops, in eager and under compile alike: one code path.

The op boundary is "tensors + one options structure". Every scalar option (logit transform, backend, loss
config, ...) travels as one frozen dataclass, packed into three primitive arguments (``_pack``): its strings
joined into one ``str``, its floats as ``float[]`` (None as NaN), its ints and bools as ``int[]`` (None as a
sentinel), in the dataclass's field order. So:

* the schema stays short and stable: a new scalar option is a new dataclass field, not a new argument;
* ``torch.compile`` sees plain Python scalars, which it specialises on (a change of config is a recompile, as
  a change of any Python scalar would be, never a stale constant); tensors whose sizes change per step (token
  counts) stay dynamic. (A JSON string would not do: dynamo cannot trace ``json.dumps``, and under
  ``dynamic=True`` a float read from a config object is symbolic, which no string can hold.)

Threading a new option through (e.g. a sampling support, reference-model hidden states): a scalar is a new field
of ``LinearOptions`` / ``PolicyOptions`` (a new ``PolicyLossConfig`` field travels by itself: the layout is read
from the dataclass); a tensor is a new ``Optional[torch.Tensor]`` argument of the op, of its fake implementation,
saved in its ``setup_context`` if the backward needs it, with one more ``None`` in the backward's return tuple.

Ops that run autograd inside their implementation (the one-pass loss differentiates the loss arithmetic per
chunk, the value loss's backward differentiates its formula) re-enable autograd with ``_autograd_inside``:
a custom op's implementation runs below the autograd dispatch key, where nothing records a graph.

Double backward: every backward here is a forward-only computation (the one-pass loss even formed its
gradients in the forward); a backward run with ``create_graph=True`` raises ``DoubleBackwardError`` naming
the op, instead of PyTorch's generic "does not require grad" later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import types
import typing
from typing import Optional

import torch

from fastrl.losses.config import CLIPPED_LOSS_TYPES, PolicyLossConfig
from fastrl.ops.config import LogitTransform

__all__ = ["DoubleBackwardError", "IMPLEMENTATIONS"]


# op name -> its Python implementation (what the op runs; tests run it under a dispatch mode to see inside)
IMPLEMENTATIONS: dict = {}


def _op(name: str):
    """``torch.library.custom_op("fastrl::<name>")``, no argument mutated; records the implementation."""
    def register(fn):
        IMPLEMENTATIONS[f"fastrl::{name}"] = fn
        return torch.library.custom_op(f"fastrl::{name}", mutates_args=())(fn)
    return register


class DoubleBackwardError(RuntimeError):
    """A second derivative (``create_graph=True``) through a fastrl op, which has no differentiable backward."""


def _refuse_double_backward(op: str) -> None:
    # autograd runs a backward with grad mode on only for create_graph=True; AOTAutograd traces the compiled
    # backward with grad mode off, so this fires for a real double backward only
    if torch.is_grad_enabled():
        raise DoubleBackwardError(
            f"{op} does not support double backward (create_graph=True): its backward is computed by fastrl's "
            "kernels and carries no graph, so a second derivative through it would silently be zero. For "
            "higher-order gradients use fastrl.reference (materialised logits, plain PyTorch)."
        )


@contextlib.contextmanager
def _autograd_inside():
    """Record autograd graphs inside a custom op's implementation (which runs below the autograd key)."""
    K = torch._C.DispatchKey
    with torch._C._SetExcludeDispatchKeyGuard(K.AutogradFunctionality, False), \
            torch._C._SetExcludeDispatchKeyGuard(K.ADInplaceOrView, False):
        yield


_NONE_INT = -(1 << 62)  # an Optional[int] field that is None (no option takes this value)


def _layout(cls) -> tuple[tuple[str, str, bool], ...]:
    """(field name, kind "s" / "f" / "i" / "b", optional) of each field of a frozen dataclass, in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        args = typing.get_args(t) or (t,)
        optional = type(None) in args
        kind = "s" if str in args else "f" if float in args else "b" if bool in args else "i"
        out.append((f.name, kind, optional))
    return tuple(out)


def _pack(objs_and_layouts) -> tuple[str, list[float], list[int]]:
    """Pack frozen dataclasses into (str, float[], int[]) op arguments; traceable by dynamo."""
    strs, floats, ints = [], [], []
    for obj, layout in objs_and_layouts:
        for name, kind, _ in layout:
            v = getattr(obj, name)
            if kind == "s":
                strs.append("" if v is None else v)
            elif kind == "f":
                floats.append(math.nan if v is None else v)
            else:
                ints.append(_NONE_INT if v is None else int(v))
    return "|".join(strs), floats, ints


def _unpack(strs: str, floats, ints, layouts) -> list[dict]:
    s_it, f_it, i_it = iter(strs.split("|")), iter(floats), iter(ints)
    out = []
    for layout in layouts:
        d = {}
        for name, kind, optional in layout:
            if kind == "s":
                v = next(s_it)
                d[name] = None if optional and v == "" else v
            elif kind == "f":
                v = next(f_it)
                d[name] = None if optional and isinstance(v, float) and math.isnan(v) else v
            else:
                v = next(i_it)  # bools travel as ints
                d[name] = None if optional and v == _NONE_INT else bool(v) if kind == "b" else v
        out.append(d)
    return out


def _key(floats) -> tuple:  # a cache key (NaN != NaN would defeat the cache)
    return tuple(None if math.isnan(x) else x for x in floats)


def _empty(like: torch.Tensor) -> torch.Tensor:  # the "no tensor" output of an op (outputs cannot be None)
    return like.new_empty((0,))


def _or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or t.numel() == 0 and t.dim() == 1 else t


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------------
# policy_loss, one-pass path: fastrl::policy_loss_one_pass (the gradients are formed in the forward)
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyOptions:
    """Scalar options of ``fastrl::policy_loss_one_pass``: the loss config, the logit transform (its
    temperature is the config's), the backend, which inputs need a gradient, and how rows are chunked.

    ``compact``: the ``chunks`` argument holds ranges of live (in-mask) rows found on the host (eager). False:
    no host synchronisation: fixed chunks over all rows (``chunk_rows`` rows each, whole sequences when the loss
    couples a sequence's tokens), rows outside the mask computed with zeroed hidden states and no gradient.
    """

    logit_scale: float = 1.0
    softcap: Optional[float] = None
    backend: str = "torch"
    need_hidden: bool = True
    need_weight: bool = True
    need_bias: bool = False
    compact: bool = True
    chunk_rows: int = 1

    def pack(self, config: PolicyLossConfig) -> tuple[str, list[float], list[int]]:
        """These options and the loss config, as the op's three option arguments."""
        return _pack(((self, _POLICY_LAYOUT), (config, _CONFIG_LAYOUT)))

    @staticmethod
    def unpack(strs: str, floats, ints) -> tuple[PolicyOptions, PolicyLossConfig]:
        return _policy_options(strs, _key(floats), tuple(ints))

    @staticmethod
    def unpack_symbolic(strs: str, floats, ints) -> tuple[types.SimpleNamespace, types.SimpleNamespace]:
        """As ``LinearOptions.unpack_symbolic``: unvalidated attributes, for fake implementations."""
        d_opts, d_config = _unpack(strs, floats, ints, (_POLICY_LAYOUT, _CONFIG_LAYOUT))
        return types.SimpleNamespace(**d_opts), types.SimpleNamespace(**d_config)

    def tf(self, config: PolicyLossConfig) -> LogitTransform:
        return LogitTransform(temperature=config.temperature, logit_scale=self.logit_scale, softcap=self.softcap)


_POLICY_LAYOUT = _layout(PolicyOptions)
_CONFIG_LAYOUT = _layout(PolicyLossConfig)


@functools.lru_cache(maxsize=256)
def _policy_options(strs: str, floats: tuple, ints: tuple) -> tuple[PolicyOptions, PolicyLossConfig]:
    floats = tuple(math.nan if x is None else x for x in floats)
    d_opts, d_config = _unpack(strs, floats, ints, (_POLICY_LAYOUT, _CONFIG_LAYOUT))
    return PolicyOptions(**d_opts), PolicyLossConfig(**d_config)


def metric_keys(config: PolicyLossConfig) -> tuple[str, ...]:
    """The metric names ``policy_loss_from_logprobs`` returns for ``config`` when entropies are given (their
    order there). The one-pass op returns the metrics as one [M] tensor in this order; the op checks at run
    time that the arithmetic returned exactly these names, so the two cannot drift apart silently."""
    keys = []
    if config.entropy_coef != 0.0:
        keys += ["policy_loss", "entropy_coef"]
    if config.beta != 0.0:
        keys.append("kl")
    keys.append("entropy")
    if config.loss_type in CLIPPED_LOSS_TYPES:
        keys += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                 "clip_ratio/high_max", "policy/clipfrac_avg"]
    elif config.loss_type == "cispo":
        keys += ["cispo_clip_ratio", "policy/clipfrac_avg"]
    elif config.loss_type == "vespo":
        keys.append("vespo/phi_seq_mean")
    keys += ["policy/approxkl_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var"]
    return tuple(keys)


def fixed_chunks(B: int, T: int, granularity: str, chunk_rows: int) -> list[tuple[int, int]]:
    """Row ranges over all B*T rows, chosen from shapes only (the no-sync path): ``chunk_rows`` tokens, or as many
    whole sequences as fit (the caller has checked that one does)."""
    N = B * T
    step = chunk_rows if granularity == "token" else max(1, chunk_rows // T) * T
    return [(c0, min(c0 + step, N)) for c0 in range(0, N, step)]


@_op("policy_loss_one_pass")
def policy_loss_one_pass(
    hidden: torch.Tensor,  # [B, T, H]
    weight: torch.Tensor,  # [V, H]
    bias: Optional[torch.Tensor],  # [V]
    targets: torch.Tensor,  # [B, T] int64, -100 outside the mask
    advantages: torch.Tensor,  # [B] or [B, T]
    mask: torch.Tensor,  # [B, T]
    old_logprobs: Optional[torch.Tensor],
    ref_logprobs: Optional[torch.Tensor],
    importance_weights: Optional[torch.Tensor],
    num_items_in_batch: Optional[torch.Tensor],  # 0-dim
    sampling_logprobs: Optional[torch.Tensor],
    per_token_kl: Optional[torch.Tensor],  # [B, T] the exact KL (kl_estimator="exact"), differentiable outside
    chunks: list[int],  # flattened (c0, c1) ranges of live rows (compact), or [] (no-sync: fixed chunks)
    opt_str: str,  # PolicyOptions.pack(config)
    opt_float: list[float],
    opt_int: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    # (loss [], metrics [M] in metric_keys order, grad hidden [B, T, H], grad weight [V, H], grad bias [V]
    #  (each [0] when not needed), logprobs [B*T], entropy [B*T], d loss / d per_token_kl [B, T] (or [0]))
    from fastrl.losses import policy as P

    o, config = PolicyOptions.unpack(opt_str, opt_float, opt_int)
    B, T, H = hidden.shape
    h2 = hidden.reshape(B * T, H)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    t2 = targets.reshape(-1)
    if o.compact:
        pairs = list(zip(chunks[0::2], chunks[1::2]))
    else:
        pairs = fixed_chunks(B, T, config.one_pass_granularity, o.chunk_rows)
    inputs = P._LossInputs(advantages, mask, old_logprobs, ref_logprobs, importance_weights, num_items_in_batch,
                           sampling_logprobs, per_token_kl)
    need = (o.need_hidden, o.need_weight, o.need_bias and bias is not None)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False), _autograd_inside():
        loss, metrics, grads, logp_all, ent_all, grad_kl = P._one_pass(
            h2, weight, bias, t2, B, T, inputs, config, o.tf(config), o.backend, pairs, need, compact=o.compact,
        )
    keys = metric_keys(config)
    assert tuple(metrics) == keys, f"metric_keys drifted from the loss arithmetic: {tuple(metrics)} vs {keys}"
    gh, gw, gb = grads
    return (
        loss, torch.stack([metrics[k] for k in keys]),
        gh.view(B, T, H) if gh is not None else _empty(hidden),
        gw if gw is not None else _empty(weight),
        gb if gb is not None else _empty(hidden),
        logp_all, ent_all,
        grad_kl if grad_kl is not None else hidden.new_empty((0,), dtype=_acc(hidden.dtype)),
    )


@policy_loss_one_pass.register_fake
def _(hidden, weight, bias, targets, advantages, mask, old_logprobs, ref_logprobs, importance_weights,
      num_items_in_batch, sampling_logprobs, per_token_kl, chunks, opt_str, opt_float, opt_int):
    o, config = PolicyOptions.unpack_symbolic(opt_str, opt_float, opt_int)
    B, T, _ = hidden.shape
    cdt = _acc(hidden.dtype)
    return (
        hidden.new_empty((), dtype=cdt),
        hidden.new_empty((len(metric_keys(config)),), dtype=cdt),
        torch.empty_like(hidden) if o.need_hidden else _empty(hidden),
        torch.empty_like(weight) if o.need_weight else _empty(weight),
        torch.empty_like(bias) if o.need_bias and bias is not None else _empty(hidden),
        hidden.new_empty((B * T,), dtype=cdt),
        hidden.new_empty((B * T,), dtype=cdt),
        hidden.new_empty((B, T), dtype=cdt) if per_token_kl is not None else hidden.new_empty((0,), dtype=cdt),
    )


_KL_INPUT = 11  # position of per_token_kl among policy_loss_one_pass's 16 inputs


def _policy_setup(ctx, inputs, output):
    _, metrics, gh, gw, gb, logp, ent, grad_kl = output
    # the gradients were formed in the forward: backward only scales them (PyTorch's rules for saved tensors
    # hold: a second backward through a retained graph hands them out again, a freed graph raises)
    ctx.save_for_backward(gh, gw, gb, grad_kl)
    ctx.mark_non_differentiable(metrics, gh, gw, gb, logp, ent, grad_kl)
    ctx.set_materialize_grads(False)


def _policy_backward(ctx, grad_loss, *_unused):
    _refuse_double_backward("fastrl.policy_loss")
    gh, gw, gb, grad_kl = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if grad_loss is None:
        return (None,) * 16

    def scale(g, needed):
        return g * grad_loss.to(g.dtype) if needed and g.numel() else None

    grads = [scale(gh, need[0]), scale(gw, need[1]), scale(gb, need[2])] + [None] * 13
    grads[_KL_INPUT] = scale(grad_kl, ctx.needs_input_grad[_KL_INPUT])  # into the exact KL's own graph
    return tuple(grads)


policy_loss_one_pass.register_autograd(_policy_backward, setup_context=_policy_setup)


# ---------------------------------------------------------------------------------------------------------
# value_loss: fastrl::value_loss (PPO's clipped value loss: plain arithmetic, an op so that it is one node)
# ---------------------------------------------------------------------------------------------------------


@_op("value_loss")
def value_loss_op(
    values: torch.Tensor,  # [B, T]
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # loss [], clipfrac []
    from fastrl.losses.arithmetic import value_loss_reference

    loss, metrics = value_loss_reference(values, old_values, returns, mask, cliprange_value)
    return loss.clone(), metrics["val/clipfrac_avg"]


@value_loss_op.register_fake
def _(values, old_values, returns, mask, cliprange_value):
    return values.new_empty(()), values.new_empty(())


def _value_setup(ctx, inputs, output):
    values, old_values, returns, mask, cliprange_value = inputs
    ctx.save_for_backward(values, old_values, returns, mask)
    ctx.cliprange_value = cliprange_value
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _value_backward(ctx, grad_loss, _grad_clipfrac):
    _refuse_double_backward("fastrl.value_loss")
    if grad_loss is None or not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    values, old_values, returns, mask = ctx.saved_tensors
    g = torch.ops.fastrl.value_loss_backward(grad_loss, values, old_values, returns, mask, ctx.cliprange_value)
    return g, None, None, None, None


value_loss_op.register_autograd(_value_backward, setup_context=_value_setup)


@_op("value_loss_backward")
def value_loss_backward(
    grad_loss: torch.Tensor, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
    mask: torch.Tensor, cliprange_value: float,
) -> torch.Tensor:  # [B, T]
    from fastrl.losses.arithmetic import value_loss_reference

    # the gradient of the one definition of the loss, by autograd over it (O(B T), no logits involved)
    with _autograd_inside(), torch.enable_grad():
        v = values.detach().requires_grad_()
        loss, _ = value_loss_reference(v, old_values, returns, mask, cliprange_value)
        (g,) = torch.autograd.grad(loss, v, grad_loss)
    return g


@value_loss_backward.register_fake
def _(grad_loss, values, old_values, returns, mask, cliprange_value):
    return torch.empty_like(values)
