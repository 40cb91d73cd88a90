"""Fused divergence between two LM heads (student and teacher): the ``torch.library`` ops and the public function.

Per token, student ``p_s = softmax(z_s)`` and teacher ``p_t = softmax(z_t)``, each from its own hidden state and
head (``z = softcap(scale * (h W^T + b)) / T``, the same transform as ``fused_logprobs``; the hidden widths may
differ, the vocabulary may not). ``beta`` picks the divergence, exactly as TRL 1.16's ``DistillationTrainer``:

* ``beta = 0``: forward KL(p_t || p_s) = sum p_t (z_t - z_s) - lse_t + lse_s
* ``beta = 1``: reverse KL(p_s || p_t) = sum p_s (z_s - z_t) - lse_s + lse_t
* ``0 < beta < 1``: the generalized JSD ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``, ``m = (1-beta) p_s + beta p_t``

Neither model's ``[N, V]`` logits are held. The KLs take one pass over matching vocabulary tiles of both heads with
online statistics (running max ``m``, ``s = sum e^(z-m)`` and a cross term ``c = sum e^(z-m) (d_self - d_other)`` of
the max-shifted logits ``d = z - m``, all re-based when a max moves); the JSD needs both normalisers before the
mixture, so a statistics pass, then the divergence pass. The backward recomputes each vocabulary slice of both
heads and forms the student's ``G = dD/dy`` (docs/design.md, "Divergences"):

* forward KL: ``dD/dz_s = p_s - p_t``; reverse KL: ``p_s (log p_s - log p_t - KL)``;
* JSD: ``(1 - beta) p_s (log p_s - log m - KL(p_s || m))`` (the ``m``-terms of the chain rule sum to a constant
  that the softmax Jacobian removes);
* the student's entropy: ``-p_s (log p_s + H)``.

The teacher receives no gradient. Tokens whose ``mask`` is 0 are dropped before any GEMM (``compact_rows``).
With ``support=`` (a ``KeptSet``) both distributions are renormalised over each token's kept ids, on the kept-set
engine (``fastrl.ops.divergence_kept``), never a pass over the vocabulary: on the per-row plan ``K_max`` logits per
token and head (docs/kept-set-costs.md, the bounds of every plan).

Autograd and ``torch.compile`` see two custom ops (``fastrl.ops.custom_ops``'s machinery: options packed into
``(str, float[], int[])`` from ``DivergenceOptions``, a fake implementation, a registered backward):
``torch.ops.fastrl.divergence`` (forward: divergence, entropy and what the backward needs) and
``torch.ops.fastrl.divergence_backward`` (the student's gradients). A ``KeptSet`` crosses the op boundary as its
two CSR tensors (``ids``, ``offsets``) and the engine's plan (``fastrl.ops.kept.build_plan``'s choice). In eager,
``fused_divergence`` drops masked tokens before the op (one host sync) and plans the support on the host; while
``torch.compile`` traces (or with ``host_sync=False``) it hands the op every row and the mask (``active``): masked
rows are computed with both models' hidden states replaced by zeros (whatever they hold, NaN included, cannot reach
an output or a gradient) and give 0 and no gradient, and a support runs on a plan chosen without host reads. So
``fullgraph=True`` and ``dynamic=True`` trace it with no graph break, and the no-sync op reads nothing on the host,
with or without a support (CUDA-graph safe).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from fastrl.ops._checks import autocast_inputs, check_head, dense_bias
from fastrl.ops.backend import is_triton, resolve_backend
from fastrl.ops.budget import tile_budget
from fastrl.ops.config import Head, LogitTransform, _finite
from fastrl.ops.custom_ops import (
    PackedOptions,
    DoubleBackwardError,  # noqa: F401  (raised by the backward below, through _refuse_double_backward)
    _acc,
    _empty,
    _grad_rows,
    _head_grads,
    _head_grads_like,
    _input_grads,
    _layout,
    _op,
    _refuse_double_backward,
    _zero_rows,
    host_sync_enabled,
)
from fastrl.ops.divergence_stats import FORWARD_KL, JSD, REVERSE_KL, finish_stats, finite_max, log_mix
from fastrl.ops.linear_logprob import compact_rows, unit_stride
from fastrl.ops.support import KeptSet, _token_name
from fastrl.ops.torch_backend import acc_dtype, tile_columns

__all__ = ["fused_divergence", "divergence_forward", "divergence_backward", "DivergenceOptions", "divergence_op",
           "divergence_backward_op"]

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


DivergenceOptions._LAYOUT = _layout(DivergenceOptions)


@dataclass
class _Tile:
    rows: slice  # token rows (of the compacted tokens)
    v0: int  # vocabulary columns [v0, v1)
    v1: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.stop - self.rows.start, self.v1 - self.v0


def _tiles(N: int, V: int) -> Iterator[_Tile]:
    """The [rows, cols] tiles that cover every (token, id) pair once, each row's tiles in vocabulary order."""
    cols = tile_columns(N, V, tile_elems=tile_budget("divergence").elems)
    for v0 in range(0, V, cols):
        yield _Tile(slice(0, N), v0, min(v0 + cols, V))


def _buffers(N: int, V: int, cdt: torch.dtype, dev: torch.device) -> list[torch.Tensor]:
    """The five flat tile buffers (both heads' logits, three scratch), each as large as the largest tile."""
    elems = max(N, 1) * tile_columns(N, V, tile_elems=tile_budget("divergence").elems)
    return [torch.empty(elems, dtype=cdt, device=dev) for _ in range(5)]


def _weight_block(head: Head, tile: _Tile) -> torch.Tensor:  # [C, H] in the compute dtype (the upcast hidden's)
    return head.weight[tile.v0 : tile.v1].to(head.hidden.dtype)


def _tile_logits(head: Head, tile: _Tile, buf: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """Transformed logits of the tile [R, C], written into ``buf`` (``head`` upcast to the compute dtype)."""
    R, C = tile.shape
    w = _weight_block(head, tile) if w is None else w
    z = torch.mm(head.hidden[tile.rows], w.T, out=buf[: R * C].view(R, C))
    if head.bias is not None:
        z += head.bias[tile.v0 : tile.v1]
    return head.tf.apply_(z)


def _like(buf: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A flat buffer's first elements viewed with ``x``'s shape (an ``out=`` that is never resized)."""
    return buf[: x.numel()].view_as(x)


def _rowdot(a: torch.Tensor, b: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:  # [R, C] x [R, C] -> [R]
    return torch.mul(a, b, out=_like(buf, a)).sum(1)


def _fold(zs, zt, st, mode: int, with_entropy: bool, bufs) -> None:
    """Fold one tile of both heads into the rows' online statistics ``st`` = (m_s, s_s, u_s, c, m_t, s_t) [6, R].

    ``u_s = sum e^(d_s) d_s`` (the entropy), ``c`` the cross term of the KL direction (``mode``); d = z - m.
    """
    m_s, s_s, u_s, c, m_t, s_t = st.unbind(0)
    ms_new, mt_new = torch.maximum(m_s, zs.amax(1)), torch.maximum(m_t, zt.amax(1))
    ms0, mt0 = finite_max(ms_new), finite_max(mt_new)
    ds, dt = zs.sub_(ms0[:, None]), zt.sub_(mt0[:, None])
    es, et = torch.exp(ds, out=_like(bufs[0], ds)), torch.exp(dt, out=_like(bufs[1], dt))
    a_s, a_t = torch.exp(m_s - ms0), torch.exp(m_t - mt0)
    # how far each reference point moved (0 while nothing is folded: no -inf * 0)
    sh_s = torch.where(s_s > 0, m_s - ms0, torch.zeros_like(s_s))
    sh_t = torch.where(s_t > 0, m_t - mt0, torch.zeros_like(s_t))
    if with_entropy:
        u_s.copy_(a_s * (u_s + sh_s * s_s) + _rowdot(es, ds, bufs[2]))
    if mode == FORWARD_KL:  # c = sum e^(d_t) (d_t - d_s)
        c.copy_(a_t * (c + (sh_t - sh_s) * s_t) + _rowdot(et, torch.sub(dt, ds, out=ds), bufs[2]))
    elif mode == REVERSE_KL:  # c = sum e^(d_s) (d_s - d_t)
        c.copy_(a_s * (c + (sh_s - sh_t) * s_s) + _rowdot(es, torch.sub(ds, dt, out=dt), bufs[2]))
    s_s.copy_(a_s * s_s + es.sum(1))
    s_t.copy_(a_t * s_t + et.sum(1))
    m_s.copy_(ms_new)
    m_t.copy_(mt_new)


def _jsd_terms(zs, zt, lse_s, lse_t, beta: float, bufs) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's share of (JSD, KL(p_s || m)) per row [R] each; overwrites zs, zt."""
    ls, lt = zs.sub_(lse_s[:, None]), zt.sub_(lse_t[:, None])
    ps, pt = torch.exp(ls, out=_like(bufs[0], ls)), torch.exp(lt, out=_like(bufs[1], lt))
    lm = log_mix(ps, pt, beta, out=_like(bufs[2], ps))
    ls.sub_(lm)
    lt.sub_(lm)  # lm (in bufs[2]) is dead from here: the row dots may use its buffer
    kl_sm, kl_tm = _rowdot(ps, ls, bufs[2]), _rowdot(pt, lt, bufs[2])
    return beta * kl_tm + (1.0 - beta) * kl_sm, kl_sm


def divergence_forward(
    student: Head, teacher: Head, opts: DivergenceOptions,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(divergence [N], entropy [N] | None, lse_s [N], lse_t [N], aux [N]): aux is the KL for the KL modes and
    KL(p_s || m) for the JSD (what the backward needs)."""
    N, V = student.h.shape[0], student.weight.shape[0]
    cdt, dev = student.hidden.dtype, student.h.device
    mode = opts.mode
    st = torch.zeros((6, N), dtype=cdt, device=dev)
    st[0].fill_(float("-inf"))
    st[4].fill_(float("-inf"))
    bufs = _buffers(N, V, cdt, dev)
    for tile in _tiles(N, V):
        zs, zt = _tile_logits(student, tile, bufs[3]), _tile_logits(teacher, tile, bufs[4])
        _fold(zs, zt, st[:, tile.rows], mode, opts.with_entropy, bufs)
    div, entropy, lse_s, lse_t = finish_stats(st, mode, opts.with_entropy)
    if div is not None:  # a KL: it is also what the backward needs
        aux = div
    else:
        div = torch.zeros(N, dtype=cdt, device=dev)
        aux = torch.zeros(N, dtype=cdt, device=dev)
        for tile in _tiles(N, V):
            zs, zt = _tile_logits(student, tile, bufs[3]), _tile_logits(teacher, tile, bufs[4])
            j, k = _jsd_terms(zs, zt, lse_s[tile.rows], lse_t[tile.rows], opts.beta, bufs)
            div[tile.rows] += j
            aux[tile.rows] += k
    return div, entropy, lse_s, lse_t, aux


def _student_grad(zs, zt, lse_s, lse_t, aux, entropy, gd, ge, opts: DivergenceOptions, bufs) -> torch.Tensor:
    """G = dL/dy_s over one tile [R, C] for ``L = sum gd * D + ge * H``; overwrites zs, zt (G lands in one of them)."""
    dzdy = opts.student.dz_dy(zs)  # a float, or a tile with a softcap (taken before zs is reused)
    mode, beta = opts.mode, opts.beta
    gd = gd if gd is not None else torch.zeros_like(lse_s)
    ls, lt = zs.sub_(lse_s[:, None]), zt.sub_(lse_t[:, None])
    ps = torch.exp(ls, out=_like(bufs[0], ls))
    # every case is p_s * (a log p_s + b log p_t|m + c) (+ a p_t term for the forward KL), a, b, c per row
    a = -ge if ge is not None else torch.zeros_like(gd)
    cst = -ge * entropy if ge is not None else torch.zeros_like(gd)
    if mode == FORWARD_KL:  # gd (p_s - p_t) - ge p_s (log p_s + H)
        pt = torch.exp(lt, out=_like(bufs[1], lt))
        g = ls.mul_(a[:, None]).add_((gd + cst)[:, None]).mul_(ps).sub_(pt.mul_(gd[:, None]))
    elif mode == REVERSE_KL:  # gd p_s (log p_s - log p_t - KL) - ge p_s (log p_s + H)
        g = ls.mul_((a + gd)[:, None]).sub_(lt.mul_(gd[:, None])).add_((cst - gd * aux)[:, None]).mul_(ps)
    else:  # (1 - beta) gd p_s (log p_s - log m - KL(p_s || m)) - ge p_s (log p_s + H)
        pt = torch.exp(lt, out=_like(bufs[1], lt))
        lm = log_mix(ps, pt, beta, out=_like(bufs[2], ps))
        w = (1.0 - beta) * gd
        g = ls.mul_((a + w)[:, None]).sub_(lm.mul_(w[:, None])).add_((cst - w * aux)[:, None]).mul_(ps)
    if not isinstance(dzdy, float) or dzdy != 1.0:
        g.mul_(dzdy)
    return g


def divergence_backward(
    student: Head, teacher: Head, opts: DivergenceOptions,
    lse_s: torch.Tensor, lse_t: torch.Tensor, aux: torch.Tensor, entropy: torch.Tensor | None,
    grad_div: torch.Tensor | None, grad_ent: torch.Tensor | None,  # [N] compute dtype
    need: tuple[bool, bool, bool],  # (hidden, weight, bias)
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Student gradients, vocabulary-sliced: each slice's G [N, C] is formed once, ``grad_W[slice] = G^T h`` is one
    GEMM written once (no float32 [V, H] buffer), ``grad_h += G W[slice]`` accumulates in the compute dtype."""
    need_h, need_w, need_b = need
    h, weight, bias = student.h, student.weight, student.bias
    N, V = h.shape[0], weight.shape[0]
    cdt, dev = h.dtype, h.device
    grad_h = torch.zeros_like(h) if need_h else None
    grad_b = torch.zeros((V,), dtype=cdt, device=dev) if need_b else None
    grad_w = torch.empty_like(weight) if need_w else None
    bufs = _buffers(N, V, cdt, dev)
    for tile in _tiles(N, V):
        r = tile.rows
        w = _weight_block(student, tile)
        zs, zt = _tile_logits(student, tile, bufs[3], w), _tile_logits(teacher, tile, bufs[4])
        g = _student_grad(zs, zt, lse_s[r], lse_t[r], aux[r], None if entropy is None else entropy[r],
                          None if grad_div is None else grad_div[r], None if grad_ent is None else grad_ent[r],
                          opts, bufs)
        if need_h:
            grad_h[r].addmm_(g, w)
        if need_w:
            if grad_w.dtype == cdt:
                torch.mm(g.T, h, out=grad_w[tile.v0 : tile.v1])  # written once, no temporary
            else:
                grad_w[tile.v0 : tile.v1] = torch.mm(g.T, h)
        if need_b:
            grad_b[tile.v0 : tile.v1] = g.sum(0)
    return (
        grad_h.to(student.dtype) if need_h else None,
        grad_w if need_w else None,
        grad_b.to(bias.dtype) if need_b else None,
    )


def _hybrid(opts: DivergenceOptions) -> bool:
    """The Triton backends run the hybrid kernels (cuBLAS tiles, one Triton pass over both heads')."""
    return is_triton(opts.backend)


def _forward(h, w, b, ht, wt, bt, opts: DivergenceOptions):
    if opts.backend == "triton-sm90":
        from fastrl.ops import divergence_sm90

        return divergence_sm90.forward(Head(h, w, b, opts.student), Head(ht, wt, bt, opts.teacher),
                                       opts, opts.mode)
    if _hybrid(opts):
        from fastrl.ops import divergence_hybrid

        return divergence_hybrid.forward(Head(h, w, b, opts.student), Head(ht, wt, bt, opts.teacher),
                                         opts, opts.mode)
    cdt = acc_dtype(h.dtype)
    return divergence_forward(Head(h, w, b, opts.student).upcast(cdt), Head(ht, wt, bt, opts.teacher).upcast(cdt),
                              opts)


# ---------------------------------------------------------------------------------------------------------
# fastrl::divergence and fastrl::divergence_backward
# ---------------------------------------------------------------------------------------------------------


def _kept_plan(ids: torch.Tensor, offsets: torch.Tensor, V: int, plan: list[int], opts: DivergenceOptions):
    """The kept-set engine's plan of the support that crossed the op boundary as its CSR tensors (validated by the
    public function) with the plan argument ``fastrl.ops.kept.build_plan`` chose."""
    from fastrl.ops import kept

    return kept.op_plan(ids, offsets, V, plan, opts.tile_elems, opts.cap, opts.backend)


def _kept_heads(h, w, b, ht, wt, bt, opts: DivergenceOptions):
    return Head(h, w, b, opts.student), Head(ht, wt, bt, opts.teacher)


@_op("divergence")
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
        return tuple(hidden.new_zeros((0,), dtype=_acc(hidden.dtype)) for _ in range(6))
    h, ht = _zero_rows(active, hidden), _zero_rows(active, teacher_hidden)
    entries = None
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        if support_ids is None:
            div, ent, lse_s, lse_t, aux = _forward(h, weight, bias, ht, teacher_weight, teacher_bias, o)
        else:
            from fastrl.ops import divergence_kept, kept

            kp = _kept_plan(support_ids, support_offsets, weight.shape[0], plan, o)
            div, ent, lse_s, lse_t, aux, entries = divergence_kept.forward(
                kp, *_kept_heads(h, weight, bias, ht, teacher_weight, teacher_bias, o), o.mode, o.beta,
                o.with_entropy, acc_dtype(hidden.dtype))
            # an empty set at a counted token (the eager wrapper raises): NaN, not 0
            div, = kept.dead_rows(active, kp.sizes > 0, div)
    if active is not None:
        div, aux = _zero_rows(active, div), _zero_rows(active, aux)
        ent = None if ent is None else _zero_rows(active, ent)
    elif aux is div:  # the KLs: the divergence is what the backward reads
        aux = div.clone()
    return (div, (ent if ent is not None else _empty(div)), lse_s, lse_t, aux,
            entries if entries is not None else _empty(div))


@divergence_op.register_fake
def _(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, active, support_ids, support_offsets, plan,
      opt_str, opt_float, opt_int):
    o = DivergenceOptions.unpack_symbolic(opt_str, opt_float, opt_int)
    div = hidden.new_empty((hidden.shape[0],), dtype=_acc(hidden.dtype))
    entries = _empty(div) if support_ids is None else div.new_empty((2, support_ids.shape[0]))
    return (div, torch.empty_like(div) if o.with_entropy else _empty(div), torch.empty_like(div),
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
    _refuse_double_backward("fastrl.fused_divergence")
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
    return _input_grads(need, (gh, gw, gb), _DIV_INPUTS)


divergence_op.register_autograd(_divergence_backward, setup_context=_divergence_setup)


@_op("divergence_backward")
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
    if hidden.shape[0] == 0:  # no token: nothing flows back
        return (torch.zeros_like(hidden) if need[0] else _empty(hidden),
                torch.zeros_like(weight) if need[1] else _empty(weight),
                torch.zeros_like(bias) if need[2] else _empty(hidden))
    cdt = lse_s.dtype

    gd, ge = _grad_rows(grad_div, active, cdt), _grad_rows(grad_entropy, active, cdt)
    h, ht = _zero_rows(active, hidden), _zero_rows(active, teacher_hidden)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        if support_ids is not None:
            from fastrl.ops import divergence_kept

            kp = _kept_plan(support_ids, support_offsets, weight.shape[0], plan, o)
            student, _ = _kept_heads(h, weight, bias, ht, teacher_weight, teacher_bias, o)
            gh, gw, gb = divergence_kept.backward(kp, student, entries.to(cdt), lse_s, lse_t, aux, entropy, gd, ge,
                                                  o.mode, o.beta, need)
        elif _hybrid(o):
            from fastrl.ops import divergence_hybrid, divergence_sm90

            impl = divergence_sm90 if o.backend == "triton-sm90" else divergence_hybrid
            gh, gw, gb = impl.backward(
                Head(h, weight, bias, o.student), Head(ht, teacher_weight, teacher_bias, o.teacher),
                o, o.mode, lse_s, lse_t, aux, entropy, gd, ge, need)
        else:
            gh, gw, gb = divergence_backward(
                Head(h, weight, bias, o.student).upcast(cdt),
                Head(ht, teacher_weight, teacher_bias, o.teacher).upcast(cdt),
                o, lse_s, lse_t, aux, entropy, gd, ge, need)
    return _head_grads(gh, gw, gb, hidden, weight)


@divergence_backward_op.register_fake
def _(grad_div, grad_entropy, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, active, support_ids,
      support_offsets, plan, lse_s, lse_t, aux, entropy, entries, opt_str, opt_float, opt_int, need_hidden, need_weight,
      need_bias):
    return _head_grads_like(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _check_number(name: str, v, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v!r}")


def _transform(temperature, logit_scale, softcap, prefix: str) -> LogitTransform:
    """A LogitTransform whose errors name the caller's argument (``teacher_logit_scale``, ...)."""
    for name, v in (("logit_scale", logit_scale), ("softcap", softcap)):
        if name == "softcap" and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) or v <= 0:
            raise ValueError(f"{prefix}{name} must be {'None or ' if name == 'softcap' else ''}a finite number > 0, "
                             f"got {v!r}")
    return LogitTransform(temperature=temperature, logit_scale=logit_scale, softcap=softcap)


def _check_finite(div, ent, active, hidden, teacher_hidden, lead) -> None:
    """Raise if a counted token's divergence or entropy is not finite, naming the token and the input at fault."""
    bad = ~torch.isfinite(div)
    if ent is not None:
        bad |= ~torch.isfinite(ent)
    bad &= active
    if not bool(bad.any()):
        return
    n = int(bad.nonzero()[0, 0])
    what, value = ("divergence", div[n]) if not torch.isfinite(div[n]) else ("entropy", ent[n])
    if not bool(torch.isfinite(hidden[n]).all()):
        culprit = "hidden holds inf/nan there"
    elif not bool(torch.isfinite(teacher_hidden[n]).all()):
        culprit = "teacher_hidden holds inf/nan there"
    else:
        culprit = ("both hidden states are finite there, so weight, teacher_weight or a bias holds inf/nan, or the "
                   "logits overflow")
    raise FloatingPointError(f"non-finite {what} at {_token_name(n, lead)} (value {float(value)}): {culprit}. "
                             "Pass check_finite=False to skip this check.")


def fused_divergence(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]: the student's last hidden states
    weight: torch.Tensor,  # [V, H]: the student's LM head
    teacher_hidden: torch.Tensor,  # [N, H_t] or [B, T, H_t]
    teacher_weight: torch.Tensor,  # [V, H_t]
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,  # [V]
    teacher_bias: torch.Tensor | None = None,  # [V]
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    mask: torch.Tensor | None = None,  # hidden's leading shape; 0 / False: the token does not count
    with_entropy: bool = False,
    check_finite: bool = True,
    backend: str | None = None,
    support: KeptSet | None = None,
    host_sync: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token divergence between the student's and the teacher's next-token distributions, without logits.

    ``beta=0``: KL(teacher || student) (forward KL); ``beta=1``: KL(student || teacher) (reverse KL, the exact
    per-token KL to a reference policy); ``0 < beta < 1``: TRL 1.16's generalized JSD, ``beta KL(p_t || m) +
    (1 - beta) KL(p_s || m)`` with ``m = (1 - beta) p_s + beta p_t``. Each model's distribution is
    ``softmax(softcap(scale * (h W^T + b)) / temperature)`` with its own scale and softcap (TRL's order); no
    ``temperature**2`` factor, as TRL.

    Args:
        hidden, weight, bias: the student (float32/bf16/fp16/float64; one dtype and device). Gradients flow to
            these three.
        teacher_hidden, teacher_weight, teacher_bias: the teacher, with its own hidden width ``H_t`` and the same
            vocabulary ``V`` and leading shape. It gets no gradient (its tensors are read detached).
        beta: in [0, 1]. temperature: > 0, divides both models' logits.
        mask: hidden's leading shape, bool or 0/1 of any dtype (nonzero = counted). Masked tokens give 0 and no
            gradient; in eager they are never computed (dropped first, one host sync).
        with_entropy: also return the student's entropy (differentiable).
        check_finite: raise ``FloatingPointError`` naming the first counted token whose divergence or entropy is
            not finite and the input at fault (eager only: skipped while ``torch.compile`` traces).
        backend: as ``fused_logprobs`` ("torch", the CPU default; "triton" / "triton-hybrid", the CUDA default:
            cuBLAS float32 tiles of both heads and one Triton pass over the pair, ``divergence_hybrid``;
            "triton-fused" runs the hybrid kernels too; "triton-sm90", opt-in on Hopper or newer: persistent TMA
            kernels with both heads' tiles in registers, ``divergence_sm90``). With ``support`` the kept-set engine
            runs (its per-row plan on Triton kernels on a Triton backend where they are installed).
        support: a ``fastrl.KeptSet`` (one row per token of the leading shape, masked tokens included): both
            distributions renormalised over each token's kept ids (the exact KL under a truncating sampler), on the
            kept-set engine (``fastrl.ops.kept``), never a pass over the vocabulary (the logits it computes per
            token: below).
        host_sync: whether the op may read device values on the host. None (default): yes in eager, no while
            ``torch.compile`` traces. False (the no-sync path, for ``torch.compile`` and CUDA graphs): masked tokens
            are computed with zeroed hidden states instead of being dropped, a support runs on a plan chosen
            without host reads (the per-row plan unless the set says it overlaps), and the checks that need the host
            are skipped (the mask's 0/1 check, ``check_finite``; an empty support at a counted token gives a NaN divergence there instead of an exception).

    Returns:
        ``divergence`` of ``mask``'s shape (hidden's leading shape without a mask), float32 (float64 for float64
        inputs); ``(divergence, entropy)`` with ``with_entropy=True``.

    Under ``torch.compile``: one custom op (``torch.ops.fastrl.divergence``, its backward
    ``fastrl::divergence_backward``), traced with ``fullgraph=True`` and ``dynamic=True`` with no graph break, with
    or without a support. While compiling it takes the no-sync path (``host_sync``): nothing reads the host, so the
    compiled op is CUDA-graph capturable. Double backward (``create_graph=True``) raises
    ``fastrl.ops.custom_ops.DoubleBackwardError``.

    Memory beyond inputs and outputs: O(N) statistics plus bounded tiles of each model (no ``[N, V]``, no float32
    ``[V, H]``). Cost: the KLs 2N(H+H_t)V FLOPs forward, the JSD twice that (a statistics pass first); the backward
    recomputes both heads' tiles and adds 4NHV for the student's gradients. With a support: per token, ``L`` logits of
    each head forward (2 L (H + H_t) FLOPs) and 4 L H backward (nothing recomputed: the kept entries' logits are kept,
    O(nnz) floats), where ``L`` is what the engine's plan computes (``support.describe_plan()`` prints it): ``K_max``
    (the widest set) on the per-row plan, at most ``max(cap, K_max)`` on the host union plan and ``3.5 C`` plus one
    chunk on the fixed union plan (``C = min(cap, 4 K)``, ``K`` the mean set size; docs/kept-set-costs.md,
    tests/test_kept_costs.py holds these bounds).

    Example::

        import torch
        import fastrl

        hidden = torch.randn(2, 8, 64, requires_grad=True)  # student [B, T, H]
        head = torch.nn.Linear(64, 1000, bias=False)  # student head, weight [V, H]
        teacher_hidden = torch.randn(2, 8, 96)  # teacher [B, T, H_t]
        teacher_head = torch.nn.Linear(96, 1000, bias=False)
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 6:] = 0  # padding
        div = fastrl.fused_divergence(hidden, head.weight, teacher_hidden, teacher_head.weight, beta=0.5, mask=mask)
        (div.sum() / mask.sum()).backward()  # TRL's DistillationTrainer loss; grads to hidden and head.weight
    """
    sync = host_sync_enabled(host_sync)  # False while torch.compile traces: no host read here
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    teacher_hidden, teacher_weight, teacher_bias = autocast_inputs(teacher_hidden, teacher_weight, teacher_bias)
    check_head(hidden, weight, bias, hidden_name="hidden", weight_name="weight", bias_name="bias")
    if isinstance(teacher_weight, torch.Tensor) and teacher_weight.dim() == 2 and teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"the vocabularies differ: weight has V = {weight.shape[0]} rows, teacher_weight "
                         f"{teacher_weight.shape[0]}; the divergence compares distributions over one vocabulary")
    check_head(teacher_hidden, teacher_weight, teacher_bias, hidden_name="teacher_hidden",
               weight_name="teacher_weight", bias_name="teacher_bias")
    lead = tuple(hidden.shape[:-1])
    if tuple(teacher_hidden.shape[:-1]) != lead:
        raise ValueError(f"teacher_hidden must have hidden's leading shape {lead}, got "
                         f"{tuple(teacher_hidden.shape[:-1])}")
    if teacher_hidden.device != hidden.device:
        raise ValueError(f"teacher and student must be on one device, got hidden on {hidden.device} and "
                         f"teacher_hidden on {teacher_hidden.device}")
    _check_number("beta", beta, 0.0, 1.0)
    beta = float(beta)
    tf_s = _transform(temperature, logit_scale, softcap, "")
    tf_t = _transform(temperature, teacher_logit_scale, teacher_softcap, "teacher_")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if tuple(mask.shape) != lead:
            raise ValueError(f"mask must have hidden's leading shape {lead}, got {tuple(mask.shape)}")
        if mask.device != hidden.device:
            raise ValueError(f"mask must be on hidden's device {hidden.device}, got {mask.device}")
        if mask.dtype != torch.bool and sync:  # under compile: skipped (any nonzero value counts)
            odd = (mask != 0) & (mask != 1)
            if bool(odd.any()):
                pos = tuple(int(i) for i in odd.nonzero()[0])
                raise ValueError(f"mask must be bool or hold only 0 and 1, got {mask[pos].item()} at position {pos}: "
                                 "it selects tokens, it does not weight them")
    for name, flag in (("with_entropy", with_entropy), ("check_finite", check_finite)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    N = math.prod(lead)
    active = (mask.reshape(-1) != 0) if mask is not None else None
    if support is not None:
        if not isinstance(support, KeptSet):
            raise TypeError(f"support must be a fastrl.KeptSet or None, got {type(support).__name__}")
        if support.vocab_size != weight.shape[0]:
            raise ValueError(f"support has vocab_size {support.vocab_size}, the heads have V = {weight.shape[0]}")
        if len(support) != N:
            raise ValueError(f"support has {len(support)} tokens, expected one per token of the leading shape {lead} "
                             f"({N})")
        support = support.to(hidden.device)
        if sync:  # the no-sync op gives NaN there instead
            empty = support.sizes() == 0
            if active is not None:
                empty &= active
            if bool(empty.any()):
                raise ValueError(f"support is empty at counted {_token_name(int(empty.nonzero()[0, 0]), lead)}: every "
                                 "counted token must keep at least one id")
    name = resolve_backend(hidden.device, backend)
    if is_triton(name) and torch.float64 in (hidden.dtype, teacher_hidden.dtype):
        raise TypeError("the triton backends compute from float32, bfloat16 or float16 inputs; use backend='torch' "
                        "for float64")
    opts = DivergenceOptions(
        beta=beta, temperature=float(tf_s.temperature), logit_scale=float(tf_s.logit_scale),
        softcap=None if tf_s.softcap is None else float(tf_s.softcap), teacher_logit_scale=float(tf_t.logit_scale),
        teacher_softcap=None if tf_t.softcap is None else float(tf_t.softcap), with_entropy=with_entropy,
        backend=name,
    )

    h = unit_stride(hidden.reshape(-1, hidden.shape[-1]))
    ht = unit_stride(teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]))
    w, wt = unit_stride(weight), unit_stride(teacher_weight.detach())
    b, bt = dense_bias(bias), dense_bias(None if teacher_bias is None else teacher_bias.detach())
    # eager: masked tokens are dropped before the op (one host sync); under compile the op computes every row and
    # zeroes the masked ones (no data-dependent shape)
    idx = compact_rows(active) if sync and active is not None else None
    if idx is not None:
        h, ht = h.index_select(0, idx), ht.index_select(0, idx)
        support = support[idx] if support is not None else None
    plan = []
    if support is not None:  # the kept-set engine's plan for the rows the op computes
        from fastrl.ops import kept

        choice = kept.build_plan(support, weight.shape[0], hidden.device, sync)
        plan = choice.arg()
        opts = dataclasses.replace(opts, tile_elems=choice.tile_elems, cap=choice.cap)
    # autograd (when an input needs grad) is the op's registered backward; under no_grad the forward alone runs
    div, ent, *_ = torch.ops.fastrl.divergence(
        h, w, b, ht, wt, bt, None if sync else active, None if support is None else support.ids,
        None if support is None else support.offsets, plan, *opts.pack())
    ent = ent if with_entropy else None
    if idx is not None:
        div = div.new_zeros((N,)).index_copy(0, idx, div)
        ent = None if ent is None else ent.new_zeros((N,)).index_copy(0, idx, ent)
    if check_finite and sync:
        _check_finite(div.detach(), None if ent is None else ent.detach(),
                      active if active is not None else torch.ones(N, dtype=torch.bool, device=hidden.device),
                      hidden.reshape(-1, hidden.shape[-1]), teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), lead)
    div = div.reshape(lead)
    if with_entropy:
        return div, ent.reshape(lead)
    return div
