"""The shared machinery of fastrl's ``torch.library`` custom ops (``torch.ops.fastrl.*``): what ``torch.compile`` sees.

Each op lives in the module of its operation (``fastrl.ops.linear_logprob``: ``linear_logprob`` and its backward;
``fastrl.losses.one_pass``: ``policy_loss_one_pass``; ``fastrl.losses.value``: ``value_loss`` and its backward;
``fastrl.ops.divergence_op``: ``divergence`` and its backward), registered when that module is imported; this module holds what they share.

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
chunk, the value loss's backward differentiates its formula) re-enable autograd with ``autograd_inside``:
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
import sys
import types
import typing

import torch

from fastrl.ops.torch_backend import acc_dtype

__all__ = ["DoubleBackwardError", "IMPLEMENTATIONS", "PackedOptions", "host_sync_enabled", "define_op",
           "refuse_double_backward", "autograd_inside", "layout_of", "empty_output", "or_none", "zero_rows", "live_rows",
           "grad_rows", "head_grads", "head_grads_like", "input_grads", "acc_dtype"]


# op name -> its Python implementation (what the op runs; tests run it under a dispatch mode to see inside)
IMPLEMENTATIONS: dict = {}


# the library that defines every fastrl op (kept alive for the process: dropping it would unregister them)
_LIB = torch.library.Library("fastrl", "FRAGMENT")


class _OpDef:
    """What ``@define_op`` returns: the op's two registration hooks (as ``torch.library.custom_op``'s object has them)."""

    def __init__(self, name: str):
        self.qualname = f"fastrl::{name}"

    def register_fake(self, fn):
        torch.library.register_fake(self.qualname, fn, lib=_LIB)
        return fn

    def register_autograd(self, backward, *, setup_context=None) -> None:
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context, lib=_LIB)

    def __call__(self, *args):
        return getattr(torch.ops.fastrl, self.qualname.split("::")[1])(*args)


def _hidden_from_dynamo(fn):
    """``fn``, skipped by dynamo's frame evaluation once ``torch._dynamo`` is loaded, without loading it.

    ``torch.library.custom_op`` wraps each implementation in ``torch._disable_dynamo``, which imports
    ``torch._dynamo`` on the op's first call: ~170 MB of modules and 1-2 s in a process that never compiles (the
    C1 regression: a fresh process's first ``fused_logprobs`` step went from 62 MB to 204 MB of extra peak RSS).
    Skipping matters only while dynamo evaluates frames (a graph break running eager code under
    ``torch.compile``), and nothing can compile before ``torch._dynamo`` is imported, so until then ``fn`` runs
    as it is; afterwards through ``torch._dynamo.disable``, as custom_op would."""
    disabled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal disabled
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = dynamo.disable(fn, recursive=True)
        return disabled(*args, **kwargs)

    return run


def define_op(name: str):
    """Define ``fastrl::<name>`` from a typed Python function (its schema inferred as ``torch.library.custom_op``
    does; no argument mutated, tagged pt2-compliant) and register the function as its implementation for every
    device; records the implementation. Not ``custom_op`` itself: see ``_hidden_from_dynamo``."""
    def register(fn):
        qualname = f"fastrl::{name}"
        IMPLEMENTATIONS[qualname] = fn
        schema = torch.library.infer_schema(fn, mutates_args=())
        _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIB.impl(name, _hidden_from_dynamo(fn), "CompositeExplicitAutograd")
        return _OpDef(name)
    return register


class DoubleBackwardError(RuntimeError):
    """A second derivative (``create_graph=True``) through a fastrl op, which has no differentiable backward."""


def refuse_double_backward(op: str) -> None:
    # autograd runs a backward with grad mode on only for create_graph=True; AOTAutograd traces the compiled
    # backward with grad mode off, so this fires for a real double backward only
    if torch.is_grad_enabled():
        raise DoubleBackwardError(
            f"{op} does not support double backward (create_graph=True): its backward is computed by fastrl's "
            "kernels and carries no graph, so a second derivative through it would silently be zero. For "
            "higher-order gradients use fastrl.reference (materialised logits, plain PyTorch)."
        )


@contextlib.contextmanager
def autograd_inside():
    """Record autograd graphs inside a custom op's implementation (which runs below the autograd key)."""
    K = torch._C.DispatchKey
    with torch._C._SetExcludeDispatchKeyGuard(K.AutogradFunctionality, False), \
            torch._C._SetExcludeDispatchKeyGuard(K.ADInplaceOrView, False):
        yield


def host_sync_enabled(host_sync: bool | None) -> bool:
    """Whether an op may read device values on the host (checks, compaction of ignored rows): ``host_sync``
    when given, else True in eager and False while ``torch.compile`` traces (where a host read would break the
    graph, and in a CUDA graph could not run at all)."""
    if host_sync is None:
        return not torch.compiler.is_compiling()
    if not isinstance(host_sync, bool):
        raise TypeError(f"host_sync must be None or a bool, got {type(host_sync).__name__}")
    return host_sync


_NONE_INT = -(1 << 62)  # an Optional[int] field that is None (no option takes this value)


def layout_of(cls) -> tuple[tuple[str, str, bool], ...]:
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


class PackedOptions:
    """Base of a frozen dataclass holding one op's scalar options.

    ``pack()`` gives the op's three option arguments; ``unpack`` rebuilds the validated dataclass (cached: ops
    call it on every launch); ``unpack_symbolic`` gives the fields unvalidated, for fake implementations, where a
    float or int may be symbolic (``dynamic=True``), which neither the cache nor the dataclass checks can take.
    A subclass sets ``_LAYOUT = layout_of(Subclass)`` after its definition (a class attribute, read without a
    cached call so that dynamo traces ``pack`` as plain attribute reads).

    Options that travel with another frozen dataclass (the policy loss op's ``PolicyLossConfig``) name its class and
    layout in ``_WITH`` (``((Config, layout_of(Config)), ...)``): ``pack(config)`` then packs both, in that order, and
    ``unpack`` / ``unpack_symbolic`` return ``(options, config)``.
    """

    _LAYOUT: tuple = ()
    _WITH: tuple = ()

    def pack(self, *companions) -> tuple[str, list[float], list[int]]:
        layouts = (type(self)._LAYOUT,) + tuple(layout for _, layout in type(self)._WITH)
        return _pack(tuple(zip((self, *companions), layouts)))

    @classmethod
    def unpack(cls, strs: str, floats, ints):
        return _unpack_cached(cls, strs, _key(floats), tuple(ints))

    @classmethod
    def unpack_symbolic(cls, strs: str, floats, ints):
        ds = _unpack(strs, floats, ints, (cls._LAYOUT, *(layout for _, layout in cls._WITH)))
        out = tuple(types.SimpleNamespace(**d) for d in ds)
        return out if cls._WITH else out[0]


@functools.lru_cache(maxsize=512)
def _unpack_cached(cls, strs: str, floats: tuple, ints: tuple):
    floats = tuple(math.nan if x is None else x for x in floats)
    ds = _unpack(strs, floats, ints, (cls._LAYOUT, *(layout for _, layout in cls._WITH)))
    out = (cls(**ds[0]),) + tuple(kind(**d) for (kind, _), d in zip(cls._WITH, ds[1:]))
    return out if cls._WITH else out[0]


def empty_output(like: torch.Tensor) -> torch.Tensor:  # the "no tensor" output of an op (outputs cannot be None)
    return like.new_empty((0,))


def or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or t.numel() == 0 and t.dim() == 1 else t


def zero_rows(active: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``x`` [N, ...] with the rows outside ``active`` replaced by zeros (nothing they hold reaches a result)."""
    if active is None:
        return x
    return torch.where(active.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))


def live_rows(targets: torch.Tensor, hidden: torch.Tensor, o):
    """(active [N] bool, hidden with ignored rows zeroed) on an op's no-sync path (``o.all_live`` False: rows whose
    target is ``o.ignore_index`` are computed, so whatever they hold must not reach a result); (None, hidden)
    otherwise."""
    if o.all_live:
        return None, hidden
    active = targets != o.ignore_index
    return active, zero_rows(active, hidden)


def grad_rows(g: torch.Tensor | None, active: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """An incoming per-row gradient [N] in the compute dtype, zero at rows outside ``active`` (their G is then
    exactly 0), contiguous for the kernels; None stays None."""
    return None if g is None else zero_rows(active, g.to(dtype)).contiguous()


def head_grads(gh, gw, gb, hidden: torch.Tensor, weight: torch.Tensor):
    """A head backward op's three outputs: the gradients, an empty tensor where none was computed."""
    return (gh if gh is not None else empty_output(hidden), gw if gw is not None else empty_output(weight),
            gb if gb is not None else empty_output(hidden))


def head_grads_like(hidden, weight, bias, need_hidden: bool, need_weight: bool, need_bias: bool):
    """The fake (meta) outputs of a head backward op: what ``head_grads`` returns, by shape."""
    return (torch.empty_like(hidden) if need_hidden else empty_output(hidden),
            torch.empty_like(weight) if need_weight else empty_output(weight),
            torch.empty_like(bias) if need_bias and bias is not None else empty_output(hidden))


def input_grads(need: tuple, grads: tuple, n_inputs: int) -> tuple:
    """An op's registered backward result: the head's three gradients where ``need`` asks for them, None for the
    other ``n_inputs - 3`` inputs."""
    return tuple(g if n else None for g, n in zip(grads, need)) + (None,) * (n_inputs - 3)


