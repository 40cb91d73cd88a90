"""Log-probs and entropies under a kept set: ``pi^S = softmax`` restricted to ``S`` and renormalised.

For each token n with kept ids ``S_n`` (a ``KeptSet``) and target ``t_n`` in ``S_n``:

    LSE_S   = log sum_{j in S} exp(z_j)
    logp    = z_t - LSE_S
    H^S     = LSE_S - sum_{j in S} pi^S_j z_j
    d logp / d z_j = 1[j = t] - pi^S_j,   d H^S / d z_j = -pi^S_j (z_j - LSE_S + H^S)   (j in S; 0 outside)

which is the full-softmax math (``fastrl.ops.torch_backend``) on the kept logits alone, so the statistics and
``G = dL/dy`` are computed by the same functions (``stats_from_logits``, ``_grad_from_logits_block_``) on a
tile whose dropped entries are pushed ``_FILL`` nats below the row's kept maximum (``exp`` of that is exactly 0
in float32 and float64, and the entries stay finite, so no ``0 * inf``).

The work never walks the vocabulary. Per token chunk: the union ``U`` of the chunk's kept ids, the rows
``W[U]`` (and ``b[U]``) gathered once, one GEMM ``[chunk, H] x [H, |U|]`` with a float32 result (cuBLAS with a
float32 output on CUDA: no logit is rounded to bf16), and the ids each row did not keep filled in. The
backward recomputes that tile, forms G, and runs ``grad_h = G W[U]`` and ``G^T h`` (``[|U|, H]``), which is added
to the rows ``U`` of the weight gradient: of the gradient itself for a float32 (float64) head, of a float32 buffer
over the rows of the *global* union of kept ids for a bf16/fp16 one (cast into the gradient at the end): never
a float32 ``[V, H]`` buffer. Work ``2 |U| H`` per token and GEMM, with chunks chosen (``chunk_plan``) so that ``|U|`` stays
within a cap (2048 ids on a CPU, 8192 on CUDA): O(N K H) up to the factor ``max(cap, K) / K`` when the sets are
disjoint, and far less when they overlap, as neighbouring tokens' sets do (then chunks grow and the GEMMs get
wide). Memory O(N K) plus one bounded tile and the float32 gradient rows of the kept ids.

Every backend runs this same code (dense GEMMs on cuBLAS on CUDA, on the CPU's BLAS elsewhere): there is no
vocabulary walk for a Triton kernel to fuse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastrl.ops import torch_backend as TB
from fastrl.ops._gemm import addmm_f32, cuda_f32_out, mm_f32
from fastrl.ops.budget import tile_budget
from fastrl.ops.config import LogitTransform
from fastrl.ops.support import KeptSet

__all__ = ["KeptOptions", "kept_logprobs", "chunk_plan", "resolve_support"]

# Dropped ids sit this many nats below the row's kept maximum: exp(-1e4) is exactly 0 in float32 and float64,
# and the value stays finite (softcap's derivative and the entropy's z * p stay 0, never NaN).
_FILL = 1.0e4


@dataclass(frozen=True)
class KeptOptions:
    tf: LogitTransform
    with_entropy: bool
    tile_elems: int | None = None  # None: the "kept" tile budget of the device


def chunk_plan(ks: KeptSet, V: int, tile_elems: int, cap: int) -> list[tuple[int, int]]:
    """Token ranges ``[c0, c1)`` for the union GEMMs, grown greedily from each start by doubling while the chunk's
    union ``U`` stays within ``cap`` ids and the ``[rows, |U|]`` tile within ``tile_elems``.

    A row costs ``2 |U| H`` FLOPs per GEMM, so ``cap`` bounds the work per token at ``max(cap, K)`` ids whatever
    the overlap: kept sets that share ids (neighbouring tokens do) give long chunks and large GEMMs; disjoint
    sets give ``cap // K`` rows per chunk. The start is the largest row count that is safe for any ids
    (``rows * K_max <= cap``); each doubling costs one ``unique`` over the candidate's ids."""
    N = len(ks)
    if N == 0:
        return []
    sizes = ks.sizes()
    k = max(1, int(sizes.max()))
    base = max(1, min(cap // k, tile_elems // max(cap, k)))
    offsets = ks.offsets.tolist()
    plan, c0 = [], 0
    while c0 < N:
        r = min(base, N - c0)
        while c0 + r < N:
            r2 = min(2 * r, N - c0)
            u = torch.unique(ks.ids[offsets[c0] : offsets[c0 + r2]]).numel()
            if u > cap or r2 * u > tile_elems:
                break
            r = r2
        plan.append((c0, c0 + r))
        c0 += r
    return plan


def _chunk_tile(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    targets: torch.Tensor,  # [N]
    ks: KeptSet,
    c0: int,
    c1: int,
    tf: LogitTransform,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z [n, |U|] kept logits with dropped entries filled, U [|U|], W[U], target column [n], h chunk)."""
    lo, hi = int(ks.offsets[c0]), int(ks.offsets[c1])
    n = c1 - c0
    U, col = torch.unique(ks.ids[lo:hi], sorted=True, return_inverse=True)
    row = torch.repeat_interleave(torch.arange(n, device=U.device), ks.sizes()[c0:c1])
    h_c = hidden[c0:c1]
    w_u = weight.index_select(0, U)
    b_u = None if bias is None else bias.index_select(0, U)
    cdt = TB.acc_dtype(hidden.dtype)
    z = torch.empty((n, U.numel()), dtype=cdt, device=hidden.device)
    if cuda_f32_out(z.device) or w_u.dtype == cdt:
        mm_f32(h_c, w_u.T, out=z)
    else:  # low-precision operands on a CPU: the products in float32 (bf16 x bf16 is exact there)
        torch.mm(TB._f32(h_c), TB._f32(w_u).T, out=z)
    if b_u is not None:
        z += TB._f32(b_u)
    tf.apply_(z)
    # dropped ids: _FILL below the row's kept maximum; only the kept entries are copied (O(nnz), not passes
    # over the tile)
    zk = z[row, col]
    m = torch.full((n,), -math.inf, dtype=cdt, device=z.device).scatter_reduce_(0, row, zk, "amax")
    z = (m - _FILL)[:, None].expand(n, U.numel()).clone()
    z[row, col] = zk
    tcol = torch.searchsorted(U, targets[c0:c1].contiguous())
    return z, U, w_u, tcol, h_c


def _stats(hidden, weight, bias, targets, ks, opts: KeptOptions, plan):
    N = hidden.shape[0]
    cdt = TB.acc_dtype(hidden.dtype)
    lse = torch.empty(N, dtype=cdt, device=hidden.device)
    zt = torch.empty_like(lse)
    ent = torch.empty_like(lse) if opts.with_entropy else None
    for c0, c1 in plan:
        z, _U, _w, tcol, _h = _chunk_tile(hidden, weight, bias, targets, ks, c0, c1, opts.tf)
        l_c, zt_c, e_c = TB.stats_from_logits(z, tcol)
        lse[c0:c1], zt[c0:c1] = l_c, zt_c
        if ent is not None:
            ent[c0:c1] = e_c
    return lse, zt, ent


def _backward(hidden, weight, bias, targets, ks, lse, ent, g_lp, g_en, opts: KeptOptions, plan, need):
    need_h, need_w, need_b = need
    N, H = hidden.shape
    cdt = lse.dtype
    dev = hidden.device
    has_grad = torch.zeros(N, dtype=torch.bool, device=dev)
    for g in (g_lp, g_en):
        if g is not None:
            has_grad |= g != 0
    grad_h = torch.zeros((N, H), dtype=cdt, device=dev) if need_h else None
    U_all = torch.unique(ks.ids) if (need_w or need_b) else None
    # the weight gradient: a float32 (float64) weight's gradient is its own accumulator; a bf16/fp16 one gets a
    # float32 buffer over the kept rows only, never a float32 [V, H]
    direct_w = need_w and weight.dtype == cdt
    grad_w = torch.zeros_like(weight) if direct_w else None
    gw_u = torch.zeros((U_all.numel(), H), dtype=cdt, device=dev) if need_w and not direct_w else None
    gb_u = torch.zeros((U_all.numel(),), dtype=cdt, device=dev) if need_b else None
    low = hidden.dtype not in (torch.float32, torch.float64)
    for c0, c1 in plan:
        z, U, w_u, tcol, h_c = _chunk_tile(hidden, weight, bias, targets, ks, c0, c1, opts.tf)
        sl = slice(c0, c1)
        G = TB._grad_from_logits_block_(
            z, tcol, 0, lse[sl], None if ent is None else ent[sl], None if g_lp is None else g_lp[sl],
            None if g_en is None else g_en[sl], has_grad[sl], opts.tf,
        )
        if low and cuda_f32_out(dev):  # bf16 operands on the tensor cores, float32 results (as the hybrid path)
            G_mm, h_mm, w_mm = G.to(hidden.dtype), h_c, w_u
        else:
            G_mm, h_mm, w_mm = G, TB._f32(h_c), TB._f32(w_u)
        if need_h:
            addmm_f32(grad_h[sl], G_mm, w_mm)
        if need_b or (need_w and not direct_w):
            pos = torch.searchsorted(U_all, U)
        if need_w:
            gw_c = torch.empty((U.numel(), H), dtype=cdt, device=dev)
            mm_f32(G_mm.T, h_mm, out=gw_c)
            # U is duplicate-free, so each row is added once (deterministic on CUDA too); index_add_ measured
            # 0.3-0.5 ms per chunk on a CPU against 1-2 ms for a gather, an add and a scatter
            if direct_w:
                grad_w.index_add_(0, U, gw_c)
            else:
                gw_u.index_add_(0, pos, gw_c)
        if need_b:
            gb_u.index_add_(0, pos, G.sum(0))
    grad_b = None
    if need_w and not direct_w:
        grad_w = torch.zeros_like(weight)
        grad_w.index_copy_(0, U_all, gw_u.to(weight.dtype))
    if need_b:
        grad_b = torch.zeros_like(bias)
        grad_b.index_copy_(0, U_all, gb_u.to(bias.dtype))
    return (grad_h.to(hidden.dtype) if need_h else None), grad_w, grad_b


class KeptLogprobFunction(torch.autograd.Function):
    """(hidden [N,H], weight [V,H], bias [V]|None, targets [N], ids [nnz], offsets [N+1])
    -> (logp [N], H^S [N] | None, LSE_S [N] not differentiable).

    Every row is a live token with a non-empty set holding its target (checked by the caller)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ids, offsets, opts: KeptOptions, V: int):
        ks = KeptSet(ids, offsets, V, validate=False)
        plan = _plan(ks, V, opts, hidden.device)
        lse, zt, ent = _stats(hidden, weight, bias, targets, ks, opts, plan)
        ctx.save_for_backward(hidden, weight, bias, targets, ids, offsets, lse, ent)
        ctx.opts, ctx.V, ctx.plan = opts, V, plan
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return zt - lse, ent, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_ent, _grad_lse):
        hidden, weight, bias, targets, ids, offsets, lse, ent = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        if grad_logp is None and grad_ent is None or not any(need):
            return (None,) * 8
        cdt = lse.dtype
        g_lp = None if grad_logp is None else grad_logp.to(cdt).contiguous()
        g_en = None if grad_ent is None else grad_ent.to(cdt).contiguous()
        ks = KeptSet(ids, offsets, ctx.V, validate=False)
        with torch.autocast(hidden.device.type, enabled=False):
            gh, gw, gb = _backward(hidden, weight, bias, targets, ks, lse, ent, g_lp, g_en, ctx.opts, ctx.plan, need)
        return (gh, gw, gb) + (None,) * 5


def _plan(ks: KeptSet, V: int, opts: KeptOptions, device: torch.device) -> list[tuple[int, int]]:
    b = tile_budget("kept", device)  # the [chunk, |U|] tile and the union cap (fastrl.ops.budget)
    return chunk_plan(ks, V, opts.tile_elems or b.elems, b.cap)


def kept_logprobs(
    hidden: torch.Tensor,  # [N, H] live rows only
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [N] int64, each inside its set
    ks: KeptSet,  # N rows, each non-empty
    opts: KeptOptions,
    needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # logp [N], entropy [N] | None, LSE_S [N] (detached)
    """Log-probs and entropies under each row's kept set (differentiable when ``needs_grad``), and ``LSE_S``."""
    V = weight.shape[0]
    if hidden.shape[0] == 0:
        e = hidden.new_zeros((0,), dtype=TB.acc_dtype(hidden.dtype))
        return e, (e if opts.with_entropy else None), e
    with torch.autocast(hidden.device.type, enabled=False):
        if needs_grad:
            return KeptLogprobFunction.apply(hidden, weight, bias, targets, ks.ids, ks.offsets, opts, V)
        with torch.no_grad():  # forward only: nothing saved
            plan = _plan(ks, V, opts, hidden.device)
            lse, zt, ent = _stats(hidden, weight, bias, targets, ks, opts, plan)
            return zt - lse, ent, lse


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
) -> tuple[KeptSet | None, torch.Tensor | None]:  # (checked KeptSet or None for the full softmax, outside | None)
    """The KeptSet an op computes over, checked against ``targets`` (``KeptSet.check_tokens``), and for a rule
    the tokens whose target the rule dropped (``outside``, targets' shape). None: the full softmax (no support,
    or a rule that keeps every id)."""
    from fastrl.ops.support import SamplerRule

    V = weight.shape[0]
    if support is None:
        return None, None
    if isinstance(support, SamplerRule):
        if support.is_identity:
            return None, torch.zeros(targets.shape, dtype=torch.bool, device=targets.device)
        from fastrl.ops.rules import replay_rule

        return replay_rule(hidden, weight, targets, support, bias=bias, temperature=tf.temperature,
                           logit_scale=tf.logit_scale, softcap=tf.softcap, ignore_index=ignore_index,
                           positions=positions, backend=backend)
    if not isinstance(support, KeptSet):
        raise TypeError(f"support must be None, a fastrl.KeptSet or a fastrl.SamplerRule, got {type(support).__name__}")
    if support.vocab_size != V:
        raise ValueError(f"support is a KeptSet over vocab_size={support.vocab_size}, but weight has V={V} rows")
    if support.device != targets.device:
        raise ValueError(f"support is on {support.device}, the inputs on {targets.device}: move it with .to()")
    support.check_tokens(targets, ignore_index, name="support")
    return support, None
