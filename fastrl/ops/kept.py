"""The kept-set engine: log-probs, entropies (and, through ``fastrl.ops.divergence_kept`` and the one-pass loss,
divergences and losses) under ``pi^S``, the softmax restricted to each token's kept set ``S`` and renormalised.

For each token n with kept ids ``S_n`` (a ``KeptSet``) and target ``t_n`` in ``S_n``:

    LSE_S   = log sum_{j in S} exp(z_j)
    logp    = z_t - LSE_S
    H^S     = LSE_S - sum_{j in S} pi^S_j z_j
    d logp / d z_j = 1[j = t] - pi^S_j,   d H^S / d z_j = -pi^S_j (z_j - LSE_S + H^S)   (j in S; 0 outside)

The work never walks the vocabulary. The engine computes the transformed logits of the kept entries only,
``z[e]`` for each (token, id) entry of the CSR, through the units of a plan (``fastrl.ops.kept_plan``): per unit the
rows ``W[U]`` (and ``b[U]``) gathered once, one GEMM ``[rows, H] x [H, |U|]`` with a float32 result (cuBLAS with
a float32 output on CUDA: no logit is rounded to bf16), and the unit's entries read out of the tile. Statistics are
segment reductions over each token's entries (``torch.segment_reduce``: deterministic, no atomics). The per-entry
logits (O(N K) floats) are kept for the backward, which forms ``G = dL/dy`` per entry, scatters it into each unit's
tile, and runs ``grad_h = G W[U]`` and ``G^T h`` (``[|U|, H]``), added to the rows ``U`` of the weight gradient: of
the gradient itself for a float32 (float64) head, of a float32 buffer over the kept ids for a bf16/fp16 one (cast
into the gradient at the end): never a float32 ``[V, H]`` buffer when the sets together hold fewer than V ids.
So forward 2 |U| H FLOPs per token, backward 4 |U| H (nothing recomputed), ``|U|`` the ids of the token's unit.

Autograd and ``torch.compile`` see one op, ``torch.ops.fastrl.kept_logprob`` (its backward the op
``kept_logprob_backward``): opaque, with fake implementations, in eager and compiled alike. The plan is an
argument: the host plan's chunk boundaries (eager: reads the sets on the host) or ``[]`` for the fixed plan (no
host read, no data-dependent shape: ``host_sync=False`` and ``torch.compile``). Every backend runs this code
(dense GEMMs on cuBLAS on CUDA, on the CPU's BLAS elsewhere): there is no vocabulary walk for a kernel to fuse.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fastrl.ops import torch_backend as TB
from fastrl.ops._gemm import addmm_f32, cuda_f32_out, mm_f32
from fastrl.ops.budget import tile_budget
from fastrl.ops.config import LogitTransform
from fastrl.ops.custom_ops import (
    PackedOptions, _acc, _empty, _grad_rows, _head_grads, _head_grads_like, _input_grads, _layout, _live_rows, _op,
    _or_none, _refuse_double_backward, host_sync_enabled,
)
from fastrl.ops import kept_plan
from fastrl.ops.kept_plan import KeptPlan, Unit, host_bounds
from fastrl.ops.support import KeptSet

__all__ = ["KeptOptions", "Head", "entry_logits", "entry_backward", "segment_lse", "segment_sum", "logprob_stats",
           "logprob_grad", "kept_logprob", "plan_for", "resolve_support", "chunk_plan", "capacity"]

def capacity(device: torch.device) -> tuple[int, int]:
    """(tile_elems, cap) of the engine on ``device``: what the public functions put in the ops' options. The
    ``kept`` tile budget (``fastrl.ops.budget``): the ``[rows, |U|]`` float32 tile of a unit, and the most ids a
    unit may hold (the work per token is at most ``max(cap, K)`` ids on the host plan; a GPU wants wider GEMMs)."""
    b = tile_budget("kept", device)
    return b.elems, b.cap


def chunk_plan(ks: KeptSet, V: int, tile_elems: int, cap: int) -> list[tuple[int, int]]:
    """The host plan's token chunks ``[c0, c1)`` for ``ks`` (``fastrl.ops.kept_plan.chunk_plan``)."""
    return kept_plan.chunk_plan(ks.ids, ks.offsets, tile_elems, cap)


def plan_for(ks: KeptSet, sync: bool, device: torch.device) -> list[int]:
    """The op's plan argument: the host plan's boundaries when the host may be read, else [] (the fixed plan)."""
    if not sync:
        return []
    tile, cap = capacity(device)
    return host_bounds(ks.ids, ks.offsets, tile, cap)


# ---------------------------------------------------------------------------------------------------------
# the engine: per-entry logits forward, per-entry G backward
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Head:
    """One LM head as the units read it: hidden states (rows that do not count already zeroed), weight, bias,
    transform."""

    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None  # [V]
    tf: LogitTransform

    def tile(self, u: Unit, out: torch.Tensor) -> torch.Tensor:
        """The unit's transformed logits into ``out`` ([n_rows * |U| + 1] flat, the last element scratch)."""
        R, C = u.n_rows, u.n_cols
        t = out[: R * C].view(R, C)
        h_u, w_u = u.take_rows(self.hidden), self.weight.index_select(0, u.cols)
        if TB.acc_dtype(h_u.dtype) != t.dtype:  # a head of another precision than the first (a float64 student)
            h_u, w_u = h_u.to(t.dtype), w_u.to(t.dtype)
        if cuda_f32_out(t.device) or w_u.dtype == t.dtype:
            mm_f32(h_u, w_u.T, out=t)
        else:  # low-precision operands on a CPU: the products in float32 (bf16 x bf16 is exact there)
            torch.mm(TB._f32(h_u), TB._f32(w_u).T, out=t)
        if self.bias is not None:
            t += self.bias.index_select(0, u.cols).to(t.dtype)
        self.tf.apply_(t)
        return out


def entry_logits(plan: KeptPlan, heads: Sequence[Head], cdt: torch.dtype) -> list[torch.Tensor]:
    """Each head's transformed logits at every kept entry: [nnz + 1] each (CSR order; the last element scratch)."""
    dev = plan.ids.device
    outs = [torch.empty(plan.nnz + 1, dtype=cdt, device=dev) for _ in heads]
    largest = max((u.n_rows * u.n_cols for u in plan.units), default=0)
    buf = torch.empty(largest + 1, dtype=cdt, device=dev)
    for u in plan.units:
        for head, out in zip(heads, outs):
            out[u.entries] = head.tile(u, buf)[u.flat]
    return outs


def entry_backward(
    plan: KeptPlan,
    head: Head,
    G: torch.Tensor,  # [nnz + 1] dL/dy per entry (compute dtype), 0 in the scratch slot
    need: tuple[bool, bool, bool],  # (hidden, weight, bias)
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``grad_h = G W``, ``grad_W = G^T h``, ``grad_b = sum G`` over the kept entries, one unit's tile at a time."""
    need_h, need_w, need_b = need
    hidden, weight, bias = head.hidden, head.weight, head.bias
    N, H = hidden.shape
    cdt, dev = G.dtype, G.device
    grad_h = torch.zeros((N, H), dtype=cdt, device=dev) if need_h else None
    # the weight gradient: a float32 (float64) weight's gradient is its own accumulator; a bf16/fp16 one gets a
    # float32 buffer over the kept ids only (their number: exact on the host plan, min(V, nnz) on the fixed one)
    direct_w = weight.dtype == cdt
    grad_w = torch.zeros_like(weight) if need_w and direct_w else None
    slots = _WeightSlots(plan, weight.shape[0]) if need_w and not direct_w else None
    gw_buf = torch.zeros((slots.count, H), dtype=cdt, device=dev) if slots is not None else None
    grad_b = torch.zeros(weight.shape[0], dtype=cdt, device=dev) if need_b else None
    low = hidden.dtype not in (torch.float32, torch.float64)
    largest = max((u.n_rows * u.n_cols for u in plan.units), default=0)
    buf = torch.empty(largest + 1, dtype=cdt, device=dev)
    for u in plan.units:
        R, C = u.n_rows, u.n_cols
        buf.zero_()
        buf[u.flat] = G[u.entries]
        Gt = buf[: R * C].view(R, C)
        w_u = weight.index_select(0, u.cols)
        h_u = u.take_rows(hidden)
        if low and cuda_f32_out(dev):  # bf16 operands on the tensor cores, float32 results (as the hybrid path)
            G_mm, h_mm, w_mm = Gt.to(hidden.dtype), h_u, w_u
        else:
            G_mm, h_mm, w_mm = Gt, h_u.to(cdt), w_u.to(cdt)
        if need_h:
            if isinstance(u.rows, slice):
                addmm_f32(grad_h[u.rows], G_mm, w_mm)
            else:
                u.add_rows_(grad_h, mm_f32(G_mm, w_mm, out=torch.empty((R, H), dtype=cdt, device=dev)))
        if need_w:
            gw = mm_f32(G_mm.T, h_mm, out=torch.empty((C, H), dtype=cdt, device=dev))
            # the ids of a unit are distinct (padding ids carry zero rows), so each row is added once per unit:
            # deterministic on CUDA too
            if direct_w:
                grad_w.index_add_(0, u.cols, gw)
            else:
                gw_buf.index_add_(0, slots.of(u.cols), gw)
        if need_b:
            grad_b.index_add_(0, u.cols, Gt.sum(0))
    if slots is not None:
        grad_w = slots.scatter(gw_buf, weight)
    return (grad_h.to(hidden.dtype) if need_h else None), grad_w, (grad_b.to(bias.dtype) if need_b else None)


class _WeightSlots:
    """Rows of the float32 weight-gradient buffer of a bf16/fp16 head: one per distinct kept id."""

    def __init__(self, plan: KeptPlan, V: int):
        if plan.fixed:  # no host read: min(V, nnz) slots, the distinct ids first, then unused (id 0, zero rows)
            srt, _ = torch.sort(plan.ids)
            first = torch.ones_like(srt, dtype=torch.bool)
            first[1:] = srt[1:] != srt[:-1]
            self.sorted, self.slot = srt, torch.cumsum(first, 0) - 1
            self.count = min(V, plan.nnz)
            self.ids = torch.zeros(self.count, dtype=torch.int64, device=srt.device).scatter_(0, self.slot, srt)
        else:
            self.ids = torch.unique(plan.ids)
            self.sorted, self.slot, self.count = self.ids, None, self.ids.numel()

    def of(self, cols: torch.Tensor) -> torch.Tensor:
        pos = torch.searchsorted(self.sorted, cols)
        return pos if self.slot is None else self.slot[pos.clamp_(max=self.slot.numel() - 1)]

    def scatter(self, buf: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        grad_w = torch.zeros_like(weight)
        if self.slot is None:
            return grad_w.index_copy_(0, self.ids, buf.to(weight.dtype))
        return grad_w.index_add_(0, self.ids, buf.to(weight.dtype))  # unused slots add exact zeros to row 0


def segment_lse(plan: KeptPlan, z: torch.Tensor):
    """(lse [N], max m [N] (0 for an empty set), d = z - m[row] [nnz], e = exp(d) [nnz], s = sum e [N]) over each
    token's entries of ``z`` ([nnz + 1]). An empty set gives lse = -inf."""
    zk = z[: plan.nnz]
    m = torch.segment_reduce(zk, "max", lengths=plan.sizes)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype, device=m.device))
    d = zk - m[plan.row]
    e = torch.exp(d)
    s = torch.segment_reduce(e, "sum", lengths=plan.sizes)
    return m + torch.log(s), m, d, e, s


def segment_sum(plan: KeptPlan, x: torch.Tensor) -> torch.Tensor:  # [nnz] -> [N]
    return torch.segment_reduce(x, "sum", lengths=plan.sizes)


def _entries(x: torch.Tensor) -> torch.Tensor:
    """A per-entry array of ``nnz + 1`` elements (the scratch slot 0)."""
    return torch.cat([x, x.new_zeros((1,))])


# ---------------------------------------------------------------------------------------------------------
# log-probs and entropies: the math on the entries
# ---------------------------------------------------------------------------------------------------------


def logprob_stats(plan: KeptPlan, z: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """(logp [N], entropy [N] | None, lse [N], found [N] bool: the target is among the token's entries)."""
    lse, m, d, e, s = segment_lse(plan, z)
    zk = z[: plan.nnz]
    hit = plan.ids == targets[plan.row]
    zero = torch.zeros((), dtype=zk.dtype, device=zk.device)
    zt = segment_sum(plan, torch.where(hit, zk, zero))
    found = segment_sum(plan, hit.to(zk.dtype)) > 0
    ent = None
    if with_entropy:
        ent = torch.log(s) - segment_sum(plan, e * d) / s  # H = log s - sum e^d d / s
    return zt - lse, ent, lse, found


def logprob_grad(plan: KeptPlan, z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                 ent: torch.Tensor | None, g_lp: torch.Tensor | None, g_en: torch.Tensor | None,
                 tf: LogitTransform, extra: torch.Tensor | None = None) -> torch.Tensor:
    """``dL/dy`` per entry ([nnz + 1], scratch 0) for ``L = sum g_lp logp + g_en H^S`` (per-token weights [N]),
    plus ``extra`` (``dL/dz`` per entry [nnz] of another term, e.g. the exact KL) before the transform's derivative."""
    zk = z[: plan.nnz]
    row = plan.row
    ls = zk - lse[row]  # log pi^S
    p = torch.exp(ls)
    G = torch.zeros_like(zk) if extra is None else extra.clone()
    if g_en is not None:
        G -= g_en[row] * p * (ls + ent[row])
    if g_lp is not None:
        g = g_lp[row]
        G -= g * p
        G += torch.where(plan.ids == targets[row], g, torch.zeros((), dtype=g.dtype, device=g.device))
    dzdy = tf.dz_dy(zk)
    if not isinstance(dzdy, float) or dzdy != 1.0:
        G *= dzdy
    return _entries(G)


# ---------------------------------------------------------------------------------------------------------
# fastrl::kept_logprob and fastrl::kept_logprob_backward
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KeptOptions(PackedOptions):
    """Scalar options of ``fastrl::kept_logprob`` (see ``fastrl.fused_logprobs(support=)``).

    ``all_live``: every row counts, its set holds its target (the eager wrapper compacted and checked). False (the
    no-sync path): rows whose target is ``ignore_index`` are computed with zeroed hidden states and give 0 and no
    gradient; a counted row whose set is empty or lacks the target gives NaN (the no-sync path cannot raise).
    ``tile_elems`` / ``cap``: the plan's bounds (``capacity``), fixed by the caller so forward and backward agree.
    """

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    with_entropy: bool = True
    ignore_index: int = -100
    all_live: bool = True
    tile_elems: int = 0  # 0: capacity(device)
    cap: int = 0

    @property
    def tf(self) -> LogitTransform:
        return LogitTransform(temperature=self.temperature, logit_scale=self.logit_scale, softcap=self.softcap)


KeptOptions._LAYOUT = _layout(KeptOptions)


def _plan(ids, offsets, V, plan: list[int], o) -> KeptPlan:
    tile, cap = capacity(ids.device)
    return KeptPlan(ids, offsets, V, list(plan) if plan else None, o.tile_elems or tile, o.cap or cap)


@_op("kept_logprob")
def kept_logprob(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: Optional[torch.Tensor],  # [V]
    targets: torch.Tensor,  # [N] int64
    ids: torch.Tensor,  # [nnz] the KeptSet's CSR ids
    offsets: torch.Tensor,  # [N + 1]
    plan: list[int],  # the host plan's chunk boundaries, or [] for the fixed plan
    opt_str: str,  # KeptOptions.pack()
    opt_float: list[float],
    opt_int: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # logp [N], entropy [N] (or [0]), lse_S [N], the kept entries' logits [nnz] (what the backward reads)
    o = KeptOptions.unpack(opt_str, opt_float, opt_int)
    cdt = _acc(hidden.dtype)
    active, h = _live_rows(targets, hidden, o)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        p = _plan(ids, offsets, weight.shape[0], plan, o)
        (z,) = entry_logits(p, [Head(h, weight, bias, o.tf)], cdt)
        logp, ent, lse, found = logprob_stats(p, z, targets, o.with_entropy)
    if active is not None:
        nan = torch.full((), float("nan"), dtype=cdt, device=hidden.device)
        zero = torch.zeros((), dtype=cdt, device=hidden.device)
        logp = torch.where(active & ~found, nan, torch.where(active, logp, zero))
        if ent is not None:
            ent = torch.where(active & ~found, nan, torch.where(active, ent, zero))
    return logp, (ent if ent is not None else _empty(logp)), lse, z[: p.nnz].clone()


@kept_logprob.register_fake
def _(hidden, weight, bias, targets, ids, offsets, plan, opt_str, opt_float, opt_int):
    o = KeptOptions.unpack_symbolic(opt_str, opt_float, opt_int)
    logp = hidden.new_empty((hidden.shape[0],), dtype=_acc(hidden.dtype))
    return (logp, torch.empty_like(logp) if o.with_entropy else _empty(logp), torch.empty_like(logp),
            hidden.new_empty((ids.shape[0],), dtype=_acc(hidden.dtype)))


_KEPT_INPUTS = 10  # inputs of fastrl::kept_logprob


def _kept_setup(ctx, inputs, output):
    hidden, weight, bias, targets, ids, offsets, plan, *options = inputs
    _, ent, lse, z = output
    ctx.save_for_backward(hidden, weight, bias, targets, ids, offsets, lse, ent, z)
    ctx.plan, ctx.options = plan, options
    ctx.mark_non_differentiable(lse, z)
    ctx.set_materialize_grads(False)  # an output whose gradient is not needed costs no backward work


def _kept_backward(ctx, grad_logp, grad_ent, _grad_lse, _grad_z):
    _refuse_double_backward("fastrl.fused_logprobs (support=)")
    hidden, weight, bias, targets, ids, offsets, lse, ent, z = ctx.saved_tensors
    ent = _or_none(ent)
    if ent is None:
        grad_ent = None
    need = tuple(ctx.needs_input_grad[:3])
    if grad_logp is None and grad_ent is None or not any(need):
        return (None,) * _KEPT_INPUTS
    gh, gw, gb = torch.ops.fastrl.kept_logprob_backward(
        grad_logp, grad_ent, hidden, weight, bias, targets, ids, offsets, z, lse, ent, ctx.plan, *ctx.options, *need)
    return _input_grads(need, (gh, gw, gb), _KEPT_INPUTS)


kept_logprob.register_autograd(_kept_backward, setup_context=_kept_setup)


@_op("kept_logprob_backward")
def kept_logprob_backward(
    grad_logp: Optional[torch.Tensor],  # [N]
    grad_entropy: Optional[torch.Tensor],  # [N]
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    z: torch.Tensor,  # [nnz] the forward's entry logits
    lse: torch.Tensor,  # [N]
    entropy: Optional[torch.Tensor],  # [N]
    plan: list[int],
    opt_str: str,
    opt_float: list[float],
    opt_int: list[int],
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # grad hidden [N, H], weight [V, H], bias [V] (or [0])
    o = KeptOptions.unpack(opt_str, opt_float, opt_int)
    active, h = _live_rows(targets, hidden, o)
    cdt = lse.dtype

    need = (need_hidden, need_weight, need_bias and bias is not None)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        p = _plan(ids, offsets, weight.shape[0], plan, o)
        G = logprob_grad(p, _entries(z.to(cdt)), targets, lse, entropy, _grad_rows(grad_logp, active, cdt),
                           _grad_rows(grad_entropy, active, cdt), o.tf)
        gh, gw, gb = entry_backward(p, Head(h, weight, bias, o.tf), G, need)
    return _head_grads(gh, gw, gb, hidden, weight)


@kept_logprob_backward.register_fake
def _(grad_logp, grad_entropy, hidden, weight, bias, targets, ids, offsets, z, lse, entropy, plan, opt_str, opt_float,
      opt_int, need_hidden, need_weight, need_bias):
    return _head_grads_like(hidden, weight, bias, need_hidden, need_weight, need_bias)


# ---------------------------------------------------------------------------------------------------------
# resolving a support argument
# ---------------------------------------------------------------------------------------------------------


def resolve_support(
    support,  # None | KeptSet | SamplerRule
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    targets: torch.Tensor,  # [N] or [B, T], ignore_index where not counted
    tf: LogitTransform,
    ignore_index: int,
    positions: torch.Tensor | None,
    backend: str | None,
    host_sync: bool | None = True,
) -> tuple[KeptSet | None, torch.Tensor | None]:  # (checked KeptSet or None for the full softmax, outside | None)
    """The KeptSet an op computes over, checked against ``targets`` (``KeptSet.check_tokens``, host reads: eager
    only; the no-sync ops poison a bad token with NaN instead), and for a rule the tokens whose target the rule
    dropped (``outside``, targets' shape). None: the full softmax (no support, or a rule that keeps every id)."""
    from fastrl.ops.support import SamplerRule

    V = weight.shape[0]
    if support is None:
        return None, None
    if isinstance(support, SamplerRule):
        if support.is_identity:
            return None, torch.zeros(targets.shape, dtype=torch.bool, device=targets.device)
        from fastrl.ops.kept_rules import replay

        return replay(hidden, weight, targets, support, bias=bias, tf=tf, ignore_index=ignore_index,
                      positions=positions, backend=backend, host_sync=host_sync)
    if not isinstance(support, KeptSet):
        raise TypeError(f"support must be None, a fastrl.KeptSet or a fastrl.SamplerRule, got {type(support).__name__}")
    if support.vocab_size != V:
        raise ValueError(f"support is a KeptSet over vocab_size={support.vocab_size}, but weight has V={V} rows")
    if support.device != targets.device:
        raise ValueError(f"support is on {support.device}, the inputs on {targets.device}: move it with .to()")
    if len(support) != targets.numel():
        raise ValueError(f"support has {len(support)} tokens, expected one per target: targets of shape "
                         f"{tuple(targets.shape)} hold {targets.numel()}")
    if host_sync_enabled(host_sync):
        support.check_tokens(targets, ignore_index, name="support")
    return support, None
