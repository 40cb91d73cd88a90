"""The kept-set engine: log-probs, entropies (and, through ``fastrl.ops.divergence_kept`` and the one-pass loss,
divergences and losses) under ``pi^S``, the softmax restricted to each token's kept set ``S`` and renormalised.

For each token n with kept ids ``S_n`` (a ``KeptSet``) and target ``t_n`` in ``S_n``:

    LSE_S   = log sum_{j in S} exp(z_j)
    logp    = z_t - LSE_S
    H^S     = LSE_S - sum_{j in S} pi^S_j z_j
    d logp / d z_j = 1[j = t] - pi^S_j,   d H^S / d z_j = -pi^S_j (z_j - LSE_S + H^S)   (j in S; 0 outside)

The work never walks the vocabulary. The engine computes the transformed logits of the kept entries only,
``z[e]`` for each (token, id) entry of the CSR, on one of three plans (``fastrl.ops.kept_plan``; ``build_plan`` is the
one place a plan is chosen, for ``fused_logprobs``, ``policy_loss`` and ``fused_divergence`` alike, and
``KeptSet.describe_plan()`` prints the choice):

* the per-row plan (``fastrl.ops.kept_rows``): rows bucketed by set size (``kept_plan.bucket_width``: four padded
  widths per octave), one batched product per bucket of each row's hidden state with its own gathered weight rows:
  at most ``1.25 nnz`` logits in all (``N x K_max`` under CUDA graph capture, where the op cannot read the bucket
  counts); the backward from the same gather, skipping singleton rows (their log-prob and entropy are 0 whatever
  the logit), the weight gradient a deterministic scatter-add over the kept ids. On a Triton backend it runs
  ``fastrl.kernels.kept_rows`` where that module is installed. The default for sampled sets (different sequences
  share few ids), with or without host reads;
* union tiles (the host plan, or the fixed plan without host reads): per unit the rows ``W[U]`` (and ``b[U]``) of a
  token chunk's union gathered once, one GEMM ``[rows, H] x [H, |U|]`` with a float32 result (cuBLAS with a float32
  output on CUDA: no logit is rounded to bf16), the unit's entries read out of the tile. Chosen where neighbouring
  tokens share most of their ids (measured on the host, or ``KeptSet.overlap=True``).

Statistics are segment reductions over each token's entries (``torch.segment_reduce``: deterministic, no atomics).
The per-entry logits (O(nnz) floats) are kept for the backward, which forms ``G = dL/dy`` per entry and runs the
plan's gradient products: ``grad_h = G W[ids]`` and ``G^T h`` added to the kept rows of the weight gradient: of the
gradient itself for a float32 (float64) head, of a float32 buffer over the kept ids for a bf16/fp16 one on the torch
path (cast into the gradient at the end). Forward ``2 L H`` FLOPs per token, backward ``4 L H`` (nothing recomputed),
``L`` the logits the plan computes per token: at most ``1.25 K`` on the per-row plan (``K`` the mean set size), at
most ``max(cap, K_max)`` on the host union plan and ``3.5 C`` plus one chunk on the fixed union plan
(``C = min(cap, 4 K)``; docs/kept-set-costs.md; held by tests/test_kept_costs.py and tests/test_kept_ragged.py, which
read ``KeptPlan.computed``, counted where the products run).

Autograd and ``torch.compile`` see one op, ``torch.ops.fastrl.kept_logprob`` (its backward the op
``kept_logprob_backward``): opaque, with fake implementations, in eager and compiled alike. The plan is an
argument (``PlanChoice.arg``: the host plan's chunk boundaries, ``[]`` for the fixed union plan, ``[-K_max]`` for the
per-row plan), its bounds and the backend are options.

Determinism: every reduction of the engine runs in a fixed order (segment reductions over the CSR, one
``index_add_`` of distinct ids per union unit, the per-row plan's sorted segment sums on CUDA and Triton and a CPU's
in-order ``index_add_``): two backward runs give bitwise-equal gradients (tests/test_kept_ragged.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from fastrl.ops import torch_backend as TB
from fastrl.ops._gemm import addmm_f32, mm_f32
from fastrl.ops.backend import cuda_f32_out
from fastrl.ops.budget import kept_capacity
from fastrl.ops.config import Head, LogitTransform
from fastrl.ops.custom_ops import (
    PackedOptions, define_op, empty_output, grad_rows, head_grads, head_grads_like, host_sync_enabled, input_grads,
    layout_of, live_rows, or_none, refuse_double_backward,
)
from fastrl.ops import kept_plan, kept_rows
from fastrl.ops.kept_plan import KeptPlan, PlanChoice, Unit, host_bounds
from fastrl.ops.support import KeptSet

__all__ = ["KeptOptions", "Head", "entry_logits", "entry_backward", "segment_lse", "segment_sum", "logprob_stats",
           "logprob_grad", "kept_logprob", "plan_for", "build_plan", "op_plan", "dead_rows", "resolve_support",
           "chunk_plan", "capacity", "entries"]

def capacity(device: torch.device, tile_elems: int = 0, cap: int = 0) -> tuple[int, int]:
    """(tile_elems, cap) of the engine on ``device`` (``fastrl.ops.budget.kept_capacity``, the one capacity rule)."""
    return kept_capacity(device, tile_elems, cap)


def build_plan(support: KeptSet, V: int, device: torch.device, host_sync: bool) -> PlanChoice:
    """The plan of ``support``'s final rows (ignored rows already dropped where the host may be read) over ``V`` ids
    on ``device`` (``fastrl.ops.kept_plan.choose_for``, the one place a kept set's plan is chosen, which
    ``KeptSet.describe_plan`` prints too). ``.arg()`` is the ops' plan argument, ``.tile_elems`` / ``.cap`` their
    options."""
    return kept_plan.choose_for(support.ids, support.offsets, V, support.width, support.overlap, host_sync, device)


def dead_rows(active: torch.Tensor | None, found: torch.Tensor | None, *xs: torch.Tensor | None):
    """The one dead-row rule of the no-sync paths (``active`` None: every row counts, nothing changes): a row that
    does not count gives 0; a counted row whose set is empty or lacks its target (``found`` False) gives NaN, as
    the no-sync path cannot raise. ``xs``: per-row results [N] (None stays None)."""
    if active is None:
        return xs
    zero = torch.zeros((), dtype=torch.float32, device=active.device)
    bad = active & ~found if found is not None else None
    out = []
    for x in xs:
        if x is not None:
            x = torch.where(active, x, zero.to(x.dtype))
            if bad is not None:
                x = torch.where(bad, torch.full((), float("nan"), dtype=x.dtype, device=x.device), x)
        out.append(x)
    return tuple(out)


def chunk_plan(ks: KeptSet, V: int, tile_elems: int, cap: int) -> list[tuple[int, int]]:
    """The host plan's token chunks ``[c0, c1)`` for ``ks`` (``fastrl.ops.kept_plan.chunk_plan``)."""
    return kept_plan.chunk_plan(ks.ids, ks.offsets, tile_elems, cap)


def plan_for(ks: KeptSet, sync: bool, device: torch.device) -> list[int]:
    """A union plan's op argument: the host plan's boundaries when the host may be read, else [] (the fixed union
    plan). The public functions take ``build_plan``'s choice instead."""
    if not sync:
        return []
    tile, cap = capacity(device)
    return host_bounds(ks.ids, ks.offsets, tile, cap)


# ---------------------------------------------------------------------------------------------------------
# the engine: per-entry logits forward, per-entry G backward
# ---------------------------------------------------------------------------------------------------------


def unit_logits(head: Head, u: Unit, out: torch.Tensor) -> torch.Tensor:
    """A union unit's transformed logits into ``out`` ([n_rows * |U| + 1] flat, the last element scratch)."""
    R, C = u.n_rows, u.n_cols
    t = out[: R * C].view(R, C)
    h_u, w_u = u.take_rows(head.hidden), head.weight.index_select(0, u.cols)
    if TB.acc_dtype(h_u.dtype) != t.dtype:  # a head of another precision than the first (a float64 student)
        h_u, w_u = h_u.to(t.dtype), w_u.to(t.dtype)
    if cuda_f32_out(t.device) or w_u.dtype == t.dtype:
        mm_f32(h_u, w_u.T, out=t)
    else:  # low-precision operands on a CPU: the products in float32 (bf16 x bf16 is exact there)
        torch.mm(TB.upcast(h_u), TB.upcast(w_u).T, out=t)
    if head.bias is not None:
        t += head.bias.index_select(0, u.cols).to(t.dtype)
    head.tf.apply_(t)
    return out


def entry_logits(plan: KeptPlan, heads: Sequence[Head], cdt: torch.dtype,
                 given: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each head's transformed logits at every kept entry: [nnz + 1] each (CSR order; the last element scratch).
    Adds the logits computed to ``plan.computed`` (per head).

    ``given``: the first head's, already computed ([nnz]: a rule's replay read them, ``rules.replay_checked``),
    taken as they are (nothing computed for that head); an entry the per-row plan cannot hold (past its width)
    still reads NaN, as if computed here."""
    if given is not None:
        z = given.to(cdt)
        if plan.width:
            z = z.masked_fill(plan.pos == plan.tile, float("nan"))
        return [entries(z)] + (entry_logits(plan, heads[1:], cdt) if len(heads) > 1 else [])
    if plan.width:
        return [_rows_entry_logits(plan, head, cdt) for head in heads]
    dev = plan.ids.device
    outs = [torch.empty(plan.nnz + 1, dtype=cdt, device=dev) for _ in heads]
    largest = max((u.n_rows * u.n_cols for u in plan.units), default=0)
    buf = torch.empty(largest + 1, dtype=cdt, device=dev)
    for u in plan.units:
        for head, out in zip(heads, outs):
            out[u.entries] = unit_logits(head, u, buf)[u.flat]
            plan.computed += u.n_rows * u.n_cols  # counted where the GEMM ran
    return outs


def _rows_entry_logits(plan: KeptPlan, head: Head, cdt: torch.dtype) -> torch.Tensor:
    """The per-row plan's logits of one head (a batched product per bucket, ``[count, width]``), transformed, read
    out per entry; an entry past the plan's width reads NaN (its token's results are NaN)."""
    flat = torch.empty(plan.tile + 1, dtype=cdt, device=plan.ids.device)
    for b in plan.buckets:
        y = kept_rows.rows_logits(b.take(head.hidden), head.weight, b.ids, head.bias, backend=plan.backend,
                                  tile_elems=plan.tile_elems)
        flat[b.base : b.base + y.numel()] = y.reshape(-1)
        plan.computed += y.numel()  # counted where the product ran
    head.tf.apply_(flat[: plan.tile])
    flat[plan.tile] = float("nan")
    return entries(flat[plan.pos])


def _rows_backward(plan: KeptPlan, head: Head, G: torch.Tensor, need: tuple[bool, bool, bool]):
    """``entry_backward`` on the per-row plan: G scattered into the buckets' flat tile, then per bucket
    ``kept_rows.rows_backward`` (the same gather; the weight gradient a sorted segment reduction over the bucket's
    kept ids, each id's row added once per bucket: deterministic); singleton rows are skipped (zero gradient)."""
    need_h, need_w, need_b = need
    hidden, weight, bias = head.hidden, head.weight, head.bias
    cdt, dev = G.dtype, G.device
    Gt = torch.zeros(plan.tile + 1, dtype=cdt, device=dev)
    Gt[plan.pos] = G[: plan.nnz]
    direct_w = weight.dtype == cdt
    slots = None
    if need_w and direct_w:  # the gradient itself
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=dev)
    elif need_w:  # a bf16/fp16 head: a float32 buffer of min(V, nnz) rows (_WeightSlots: [V, H] once N K >= V)
        slots = _WeightSlots(plan, weight.shape[0])
        grad_w = torch.zeros((slots.count, weight.shape[1]), dtype=cdt, device=dev)
    else:
        grad_w = None
    grad_b = torch.zeros(weight.shape[0], dtype=cdt, device=dev) if need_b else None
    gh = torch.zeros(hidden.shape, dtype=cdt, device=dev) if need_h else None
    for b in plan.buckets:
        if b.singleton:  # log-prob and entropy 0 whatever the logit: no gradient, no product
            continue
        Gb = Gt[b.base : b.base + b.count * b.width].view(b.count, b.width)
        rows = slots.of(b.ids.clamp(min=0)) if slots is not None else None
        gh_b = kept_rows.rows_backward(Gb, b.take(hidden), weight, b.ids, grad_w, grad_b,
                                       deterministic=True, backend=plan.backend, tile_elems=plan.tile_elems,
                                       weight_rows=rows)
        plan.computed_backward += b.count * b.width
        if need_h:
            gh = gh_b.to(cdt) if b.rows is None else gh.index_copy_(0, b.rows, gh_b.to(cdt))
    if slots is not None:
        grad_w = slots.scatter(grad_w, weight)
    elif grad_w is not None and grad_w.dtype != weight.dtype:
        grad_w = grad_w.to(weight.dtype)
    return ((gh.to(hidden.dtype) if need_h else None), grad_w, (grad_b.to(bias.dtype) if need_b else None))


def entry_backward(
    plan: KeptPlan,
    head: Head,
    G: torch.Tensor,  # [nnz + 1] dL/dy per entry (compute dtype), 0 in the scratch slot
    need: tuple[bool, bool, bool],  # (hidden, weight, bias)
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``grad_h = G W``, ``grad_W = G^T h``, ``grad_b = sum G`` over the kept entries, one unit's tile at a time
    (the per-row plan: one batched product, ``_rows_backward``)."""
    if plan.width:
        return _rows_backward(plan, head, G, need)
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
        plan.computed_backward += R * C
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
        if plan.fixed or plan.width:  # no host read: min(V, nnz) slots, the distinct ids first, then unused (id 0,
            # zero rows)
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


def entries(x: torch.Tensor) -> torch.Tensor:
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
    return entries(G)


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
    ``backend``: the concrete backend (a Triton one runs the per-row plan on ``fastrl.kernels.kept_rows``).
    """

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    with_entropy: bool = True
    ignore_index: int = -100
    all_live: bool = True
    tile_elems: int = 0  # 0: capacity(device)
    cap: int = 0
    backend: str = "torch"

    @property
    def tf(self) -> LogitTransform:
        return LogitTransform(temperature=self.temperature, logit_scale=self.logit_scale, softcap=self.softcap)


KeptOptions._LAYOUT = layout_of(KeptOptions)


def op_plan(ids: torch.Tensor, offsets: torch.Tensor, V: int, plan: list[int], tile_elems: int, cap: int,
            backend: str) -> KeptPlan:
    """The plan an op runs, from its arguments: the CSR tensors, the plan argument (``PlanChoice.arg``) and its
    options' bounds (``capacity``: 0 means the device's) and backend. The three kept-set ops build it here."""
    tile, cap = capacity(ids.device, tile_elems, cap)
    return KeptPlan.from_arg(ids, offsets, V, plan, tile, cap, backend)


@define_op("kept_logprob")
def kept_logprob(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: Optional[torch.Tensor],  # [V]
    targets: torch.Tensor,  # [N] int64
    ids: torch.Tensor,  # [nnz] the KeptSet's CSR ids
    offsets: torch.Tensor,  # [N + 1]
    plan: list[int],  # PlanChoice.arg(): the host plan's chunk boundaries, [] the fixed plan, [-K] the per-row plan
    opt_str: str,  # KeptOptions.pack()
    opt_float: list[float],
    opt_int: list[int],
    given: Optional[torch.Tensor] = None,  # [nnz] the entries' transformed logits, already computed (a rule's replay)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # logp [N], entropy [N] (or [0]), lse_S [N], the kept entries' logits [nnz] (what the backward reads)
    o = KeptOptions.unpack(opt_str, opt_float, opt_int)
    cdt = TB.acc_dtype(hidden.dtype)
    active, h = live_rows(targets, hidden, o)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        p = op_plan(ids, offsets, weight.shape[0], plan, o.tile_elems, o.cap, o.backend)
        (z,) = entry_logits(p, [Head(h, weight, bias, o.tf)], cdt, given)
        logp, ent, lse, found = logprob_stats(p, z, targets, o.with_entropy)
    logp, ent = dead_rows(active, found, logp, ent)
    return logp, (ent if ent is not None else empty_output(logp)), lse, z[: p.nnz].clone()


@kept_logprob.register_fake
def _(hidden, weight, bias, targets, ids, offsets, plan, opt_str, opt_float, opt_int, given=None):
    o = KeptOptions.unpack_symbolic(opt_str, opt_float, opt_int)
    logp = hidden.new_empty((hidden.shape[0],), dtype=TB.acc_dtype(hidden.dtype))
    return (logp, torch.empty_like(logp) if o.with_entropy else empty_output(logp), torch.empty_like(logp),
            hidden.new_empty((ids.shape[0],), dtype=TB.acc_dtype(hidden.dtype)))


_KEPT_INPUTS = 11  # inputs of fastrl::kept_logprob


def _kept_setup(ctx, inputs, output):
    hidden, weight, bias, targets, ids, offsets, plan, *options, _given = inputs
    _, ent, lse, z = output
    ctx.save_for_backward(hidden, weight, bias, targets, ids, offsets, lse, ent, z)
    ctx.plan, ctx.options = plan, options
    ctx.mark_non_differentiable(lse, z)
    ctx.set_materialize_grads(False)  # an output whose gradient is not needed costs no backward work


def _kept_backward(ctx, grad_logp, grad_ent, _grad_lse, _grad_z):
    refuse_double_backward("fastrl.fused_logprobs (support=)")
    hidden, weight, bias, targets, ids, offsets, lse, ent, z = ctx.saved_tensors
    ent = or_none(ent)
    if ent is None:
        grad_ent = None
    need = tuple(ctx.needs_input_grad[:3])
    if grad_logp is None and grad_ent is None or not any(need):
        return (None,) * _KEPT_INPUTS
    gh, gw, gb = torch.ops.fastrl.kept_logprob_backward(
        grad_logp, grad_ent, hidden, weight, bias, targets, ids, offsets, z, lse, ent, ctx.plan, *ctx.options, *need)
    return input_grads(need, (gh, gw, gb), _KEPT_INPUTS)


kept_logprob.register_autograd(_kept_backward, setup_context=_kept_setup)


@define_op("kept_logprob_backward")
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
    active, h = live_rows(targets, hidden, o)
    cdt = lse.dtype

    need = (need_hidden, need_weight, need_bias and bias is not None)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        p = op_plan(ids, offsets, weight.shape[0], plan, o.tile_elems, o.cap, o.backend)
        G = logprob_grad(p, entries(z.to(cdt)), targets, lse, entropy, grad_rows(grad_logp, active, cdt),
                           grad_rows(grad_entropy, active, cdt), o.tf)
        gh, gw, gb = entry_backward(p, Head(h, weight, bias, o.tf), G, need)
    return head_grads(gh, gw, gb, hidden, weight)


@kept_logprob_backward.register_fake
def _(grad_logp, grad_entropy, hidden, weight, bias, targets, ids, offsets, z, lse, entropy, plan, opt_str, opt_float,
      opt_int, need_hidden, need_weight, need_bias):
    return head_grads_like(hidden, weight, bias, need_hidden, need_weight, need_bias)


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
    host_sync: bool | None = True,
) -> tuple[KeptSet | None, torch.Tensor | None, torch.Tensor | None]:  # (KeptSet | None, outside | None, logits)
    """The KeptSet an op computes over, checked against ``targets`` (``KeptSet.check_tokens``, host reads: eager
    only; the no-sync ops poison a bad token with NaN instead), and for a rule the tokens whose target the rule
    dropped (``outside``, targets' shape) and, in eager, the kept entries' transformed logits under this head (the
    replay computed them: the ops take them as ``given`` and compute none). None: the full softmax (no support, or
    a rule that keeps every id)."""
    from fastrl.ops.support import SamplerRule

    V = weight.shape[0]
    if support is None:
        return None, None, None
    if isinstance(support, SamplerRule):
        if support.is_identity:
            return None, torch.zeros(targets.shape, dtype=torch.bool, device=targets.device), None
        from fastrl.ops.kept_rules import replay

        return replay(hidden, weight, targets, support, bias=bias, tf=tf, ignore_index=ignore_index,
                      positions=positions, host_sync=host_sync)
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
    return support, None, None
