"""``fastrl::divergence`` and ``fastrl::divergence_backward``: the ``torch.library`` ops of ``fused_divergence``.

Autograd and ``torch.compile`` see two custom ops (``fastrl.ops.custom_ops``'s machinery: options packed into
``(str, float[], int[])`` from ``DivergenceOptions``, a fake implementation, a registered backward):
``torch.ops.fastrl.divergence`` (forward: divergence, entropy and what the backward needs) and
``torch.ops.fastrl.divergence_backward`` (the student's gradients). The teacher receives no gradient. A ``KeptSet``
crosses the op boundary as its two CSR tensors (``ids``, ``offsets``) and the engine's plan
(``fastrl.ops.kept.build_plan``'s choice, made by the public function); the ops run what they are handed and check
nothing again (``fastrl.ops.divergence.fused_divergence`` checked it).

Given the mask (``active``, the no-sync path) the ops compute the live rows alone where their count is read without
a synchronisation (rows in host memory, ``fastrl.ops.live``; without a support), else every row with both models'
hidden states replaced by zeros at the masked ones (whatever they hold, NaN included, cannot reach an output or a
gradient): masked rows give 0 and no gradient, and nothing is read on a device (CUDA-graph safe). Without it every
row counts.

The backends, one interface (``forward`` / ``backward`` over ``fastrl.ops.config.Head``s): ``divergence_torch``
(PyTorch tiles), ``divergence_hybrid`` (cuBLAS tiles, one Triton pass over the pair: the Triton backends),
``divergence_sm90`` (persistent TMA kernels, ``triton-sm90``); with a support, ``divergence_kept`` on the kept-set
engine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from fastrl.ops import divergence_torch
from fastrl.ops.backend import is_triton
from fastrl.ops.config import Head, LogitTransform
from fastrl.ops.custom_ops import (
    PackedOptions, define_op, empty_output, grad_rows, head_grads, head_grads_like, input_grads, layout_of,
    refuse_double_backward, zero_rows,
)
from fastrl.ops.divergence_stats import FORWARD_KL, JSD, REVERSE_KL
from fastrl.ops.live import LiveRows
from fastrl.ops.torch_backend import acc_dtype

__all__ = ["DivergenceOptions", "divergence_op", "divergence_backward_op"]


@dataclass(frozen=True)
class DivergenceOptions(PackedOptions):
    """Scalar options of ``fastrl::divergence`` and its backward (see ``fused_divergence``), packed into the ops'
    ``(str, float[], int[])`` arguments by ``pack``. ``tile_elems`` / ``cap``: the kept-set engine's bounds when a
    ``KeptSet`` travels as the ops' ``support_ids`` / ``support_offsets`` (0: ``fastrl.ops.kept.capacity`` of the
    device), fixed by the caller so that forward and backward plan alike."""

    beta: float = 1.0
    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    teacher_logit_scale: float = 1.0
    teacher_softcap: Optional[float] = None
    with_entropy: bool = False
    backend: str = "torch"  # concrete backend name
    tile_elems: int = 0
    cap: int = 0

    @staticmethod
    def of(beta: float, student: LogitTransform, teacher: LogitTransform, with_entropy: bool,
           backend: str) -> "DivergenceOptions":
        """The options of one call: the student's transform and the teacher's scale and softcap (the temperature is
        the student's, shared); the inverse of ``student`` / ``teacher``."""
        return DivergenceOptions(
            beta=float(beta), temperature=float(student.temperature), logit_scale=float(student.logit_scale),
            softcap=None if student.softcap is None else float(student.softcap),
            teacher_logit_scale=float(teacher.logit_scale),
            teacher_softcap=None if teacher.softcap is None else float(teacher.softcap), with_entropy=with_entropy,
            backend=backend)

    @functools.cached_property
    def student(self) -> LogitTransform:
        return LogitTransform(temperature=self.temperature, logit_scale=self.logit_scale, softcap=self.softcap)

    @functools.cached_property
    def teacher(self) -> LogitTransform:
        return LogitTransform(temperature=self.temperature, logit_scale=self.teacher_logit_scale,
                              softcap=self.teacher_softcap)

    @property
    def mode(self) -> int:
        return FORWARD_KL if self.beta == 0.0 else REVERSE_KL if self.beta == 1.0 else JSD


DivergenceOptions._LAYOUT = layout_of(DivergenceOptions)


def _backend(o: DivergenceOptions):
    """The module that runs the full-vocabulary passes on ``o.backend`` (``forward`` / ``backward``, one interface)."""
    if o.backend == "triton-sm90":
        from fastrl.ops import divergence_sm90

        return divergence_sm90
    if is_triton(o.backend):  # the other Triton backends run the hybrid kernels
        from fastrl.ops import divergence_hybrid

        return divergence_hybrid
    return divergence_torch


def _heads(h, w, b, ht, wt, bt, o: DivergenceOptions) -> tuple[Head, Head]:
    return Head(h, w, b, o.student), Head(ht, wt, bt, o.teacher)


def _kept_plan(ids: torch.Tensor, offsets: torch.Tensor, V: int, plan: list[int], o: DivergenceOptions):
    """The kept-set engine's plan of the support that crossed the op boundary as its CSR tensors, with the plan
    argument ``fastrl.ops.kept.build_plan`` chose."""
    from fastrl.ops import kept

    return kept.op_plan(ids, offsets, V, plan, o.tile_elems, o.cap, o.backend)


def _forward(h, w, b, ht, wt, bt, active, ids, offsets, plan, o: DivergenceOptions):
    """(divergence, entropy | None, lse_s, lse_t, aux, entries | None) [N] of the rows handed in (the masked ones
    already zeroed)."""
    student, teacher = _heads(h, w, b, ht, wt, bt, o)
    if ids is None:
        return (*_backend(o).forward(student, teacher, o, o.mode), None)
    from fastrl.ops import divergence_kept, kept

    kp = _kept_plan(ids, offsets, w.shape[0], plan, o)
    div, ent, lse_s, lse_t, aux, entries = divergence_kept.forward(kp, student, teacher, o.mode, o.beta,
                                                                   o.with_entropy, acc_dtype(h.dtype))
    div, = kept.dead_rows(active, kp.sizes > 0, div)  # an empty set at a counted token (eager raises): NaN, not 0
    return div, ent, lse_s, lse_t, aux, entries


@define_op("divergence")
def divergence_op(
    hidden: torch.Tensor,  # [N, H] the student
    weight: torch.Tensor,  # [V, H]
    bias: Optional[torch.Tensor],  # [V]
    teacher_hidden: torch.Tensor,  # [N, H_t]
    teacher_weight: torch.Tensor,  # [V, H_t]
    teacher_bias: Optional[torch.Tensor],  # [V]
    active: Optional[torch.Tensor],  # [N] bool: counted rows (None: every row counts)
    support_ids: Optional[torch.Tensor],  # a KeptSet's CSR ids [nnz] and offsets [N + 1], or None
    support_offsets: Optional[torch.Tensor],
    plan: list[int],  # with a support: fastrl.ops.kept.build_plan(...).arg() ([] without one)
    opt_str: str,  # DivergenceOptions.pack()
    opt_float: list[float],
    opt_int: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # divergence [N], entropy [N] (or [0]), lse_s [N], lse_t [N], aux [N], the support's entry logits of both heads
    # [2, nnz] (or [0]) (what the backward reads): the compute dtype; rows outside ``active`` give 0, a counted row
    # with an empty support NaN
    o = DivergenceOptions.unpack(opt_str, opt_float, opt_int)
    N = hidden.shape[0]
    if N == 0:  # distinct empty outputs (an op's outputs may not alias one another)
        return tuple(hidden.new_zeros((0,), dtype=acc_dtype(hidden.dtype)) for _ in range(6))
    rows = _live(active, support_ids)
    if rows is None:
        return _forward_rows(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, active, support_ids,
                             support_offsets, plan, o)
    # the live rows alone, their results scattered back: 0 at the masked rows
    take = rows.take
    div, ent, lse_s, lse_t, aux, entries = _forward_rows(take(hidden), weight, bias, take(teacher_hidden),
                                                         teacher_weight, teacher_bias, take(active), None, None, plan,
                                                         o)
    return (rows.put(div), rows.put(ent) if o.with_entropy else ent, rows.put(lse_s), rows.put(lse_t), rows.put(aux),
            entries)


def _live(active: torch.Tensor | None, support_ids: torch.Tensor | None) -> LiveRows | None:
    """The no-sync op's live rows when it computes them alone (``fastrl.ops.live``: their count read without a
    synchronisation; without a support), else None (every row)."""
    if active is None or support_ids is not None:
        return None
    rows = LiveRows.of(active)
    return rows if rows.ids is not None else None


def _forward_rows(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, active, support_ids,
                  support_offsets, plan, o: DivergenceOptions):
    """The forward op's outputs for the rows handed in (those outside ``active`` zeroed first, 0 in the outputs)."""
    if hidden.shape[0] == 0:  # no live row
        return tuple(hidden.new_zeros((0,), dtype=acc_dtype(hidden.dtype)) for _ in range(6))
    h, ht = zero_rows(active, hidden), zero_rows(active, teacher_hidden)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        div, ent, lse_s, lse_t, aux, entries = _forward(h, weight, bias, ht, teacher_weight, teacher_bias, active,
                                                        support_ids, support_offsets, plan, o)
    if active is not None:
        div, aux = zero_rows(active, div), zero_rows(active, aux)
        ent = None if ent is None else zero_rows(active, ent)
    elif aux is div:  # the KLs: the divergence is what the backward reads
        aux = div.clone()
    return (div, (ent if ent is not None else empty_output(div)), lse_s, lse_t, aux,
            entries if entries is not None else empty_output(div))


@divergence_op.register_fake
def _(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, active, support_ids, support_offsets, plan,
      opt_str, opt_float, opt_int):
    o = DivergenceOptions.unpack_symbolic(opt_str, opt_float, opt_int)
    div = hidden.new_empty((hidden.shape[0],), dtype=acc_dtype(hidden.dtype))
    entries = empty_output(div) if support_ids is None else div.new_empty((2, support_ids.shape[0]))
    return (div, torch.empty_like(div) if o.with_entropy else empty_output(div), torch.empty_like(div),
            torch.empty_like(div), torch.empty_like(div), entries)


_DIV_INPUTS = 13  # inputs of fastrl::divergence


def _divergence_setup(ctx, inputs, output):
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, active, ids, offsets, plan, *options = inputs
    _, ent, lse_s, lse_t, aux, entries = output
    ctx.save_for_backward(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, active, ids, offsets,
                          lse_s, lse_t, aux, ent, entries)
    ctx.plan, ctx.options = plan, options
    ctx.with_entropy = bool(DivergenceOptions.unpack_symbolic(*options).with_entropy)
    ctx.mark_non_differentiable(lse_s, lse_t, aux, entries)
    ctx.set_materialize_grads(False)  # an output whose gradient is not needed costs no backward work


def _divergence_backward(ctx, grad_div, grad_ent, _grad_lse_s, _grad_lse_t, _grad_aux, _grad_entries):
    refuse_double_backward("fastrl.fused_divergence")
    (hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, active, ids, offsets, lse_s, lse_t, aux, ent,
     entries) = ctx.saved_tensors
    if not ctx.with_entropy:  # no entropy was computed: nothing flows back through its (empty) output
        grad_ent, ent = None, None
    need = tuple(ctx.needs_input_grad[:3])  # the teacher's inputs never need one (read detached)
    if grad_div is None and grad_ent is None or not any(need):
        return (None,) * _DIV_INPUTS
    gh, gw, gb = torch.ops.fastrl.divergence_backward(
        grad_div, grad_ent, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, active, ids, offsets,
        ctx.plan, lse_s, lse_t, aux, ent, entries, *ctx.options, *need)
    return input_grads(need, (gh, gw, gb), _DIV_INPUTS)


divergence_op.register_autograd(_divergence_backward, setup_context=_divergence_setup)


@define_op("divergence_backward")
def divergence_backward_op(
    grad_div: Optional[torch.Tensor],  # [N]
    grad_entropy: Optional[torch.Tensor],  # [N]
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: Optional[torch.Tensor],
    active: Optional[torch.Tensor],
    support_ids: Optional[torch.Tensor],
    support_offsets: Optional[torch.Tensor],
    plan: list[int],
    lse_s: torch.Tensor,  # [N] the forward op's outputs
    lse_t: torch.Tensor,
    aux: torch.Tensor,
    entropy: Optional[torch.Tensor],
    entries: torch.Tensor,  # [2, nnz] with a support, else [0]
    opt_str: str,
    opt_float: list[float],
    opt_int: list[int],
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # grad hidden [N, H], weight [V, H], bias [V] (each [0] if not needed)
    o = DivergenceOptions.unpack(opt_str, opt_float, opt_int)
    need = (need_hidden, need_weight, need_bias and bias is not None)
    rows = _live(active, support_ids)
    if rows is None:
        return _backward_rows(grad_div, grad_entropy, hidden, weight, bias, teacher_hidden, teacher_weight,
                              teacher_bias, active, support_ids, support_offsets, plan, lse_s, lse_t, aux, entropy,
                              entries, o, need)
    take = rows.take  # the live rows alone (the masked ones' gradient rows are 0)
    gh, gw, gb = _backward_rows(take(grad_div), take(grad_entropy), take(hidden), weight, bias, take(teacher_hidden),
                                teacher_weight, teacher_bias, take(active), None, None, plan, take(lse_s),
                                take(lse_t), take(aux), take(entropy), entries, o, need)
    return rows.put(gh) if need[0] else gh, gw, gb


def _backward_rows(grad_div, grad_entropy, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, active,
                   support_ids, support_offsets, plan, lse_s, lse_t, aux, entropy, entries, o: DivergenceOptions,
                   need):
    """The backward op's outputs for the rows handed in (those outside ``active`` zeroed first: no gradient)."""
    if hidden.shape[0] == 0:  # no token: nothing flows back
        return (torch.zeros_like(hidden) if need[0] else empty_output(hidden),
                torch.zeros_like(weight) if need[1] else empty_output(weight),
                torch.zeros_like(bias) if need[2] else empty_output(hidden))
    cdt = lse_s.dtype
    gd, ge = grad_rows(grad_div, active, cdt), grad_rows(grad_entropy, active, cdt)
    h, ht = zero_rows(active, hidden), zero_rows(active, teacher_hidden)
    student, teacher = _heads(h, weight, bias, ht, teacher_weight, teacher_bias, o)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        if support_ids is not None:
            from fastrl.ops import divergence_kept

            kp = _kept_plan(support_ids, support_offsets, weight.shape[0], plan, o)
            gh, gw, gb = divergence_kept.backward(kp, student, entries.to(cdt), lse_s, lse_t, aux, entropy, gd, ge,
                                                  o.mode, o.beta, need)
        else:
            gh, gw, gb = _backend(o).backward(student, teacher, o, o.mode, lse_s, lse_t, aux, entropy, gd, ge, need)
    return head_grads(gh, gw, gb, hidden, weight)


@divergence_backward_op.register_fake
def _(grad_div, grad_entropy, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, active, support_ids,
      support_offsets, plan, lse_s, lse_t, aux, entropy, entries, opt_str, opt_float, opt_int, need_hidden, need_weight,
      need_bias):
    return head_grads_like(hidden, weight, bias, need_hidden, need_weight, need_bias)
