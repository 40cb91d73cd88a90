"""Log-probabilities and entropies from an LM head sharded over the vocabulary (tensor parallelism).

A head distributed as a ``torch.distributed.tensor.DTensor`` placed ``Shard(0)`` on a 1-D device mesh (what
transformers' tensor-parallel plan or ``distribute_tensor`` hands over) holds rows ``[v0, v0 + V_l)`` of the weight
on each rank, ``torch.chunk``'s split (DTensor's own: ``ceil(V / P)`` rows per rank, the last ranks shorter or
empty). The hidden states are the same on every rank (a plain tensor, or a DTensor placed ``Replicate()``).

Each rank runs the ordinary statistics of its backend (``fastrl.ops.linear_logprob.linear_stats``: any backend,
never more than one bounded tile of ``[N, V_l]``) on its shard, then two all-reduces per call merge them, O(N)
numbers, never logits:

* MAX of the local log-sum-exp ``lse_l`` -> ``M``;
* SUM of ``[e_l, zt_l, e_l (lse_l - M - H_l)]`` with ``e_l = exp(lse_l - M)``: the sum of exps rescaled, the target's
  logit (only the owning rank contributes), and the entropy's ``sum p z`` term relative to ``M`` (``lse_l - H_l`` is
  the shard's mean logit under its own softmax), so ``lse = M + log S`` and ``H = log S - sum_l e_l (lse_l - M -
  H_l) / S``.

Backward: with the global ``lse`` and ``H``, each rank forms its shard's ``G = dL/dy`` exactly as the unsharded
backward does (``linear_backward``, the indicator ``1[j = t]`` only where the shard holds the target), writes its
own shard of the weight (and bias) gradient, and the hidden-state gradient (a partial sum over the shard's columns)
is all-reduced once. Bytes sent per token: 4 floats forward, H floats backward (the hidden gradient itself), both
independent of V.

``fastrl.ops.sharded_base`` recognises such a head (``vocab_shard``) and holds the merge; ``fastrl.ops.sharded_kept``
and ``fastrl.ops.sharded_rules`` compute over kept sets and replay sampler rules on the shards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from fastrl.ops._checks import (
    autocast_inputs, check_finite_outputs, check_linear_inputs, check_targets, check_triton_dtypes, compact_rows,
    dense_bias, unit_stride,
)
from fastrl.ops.backend import resolve_backend
from fastrl.ops.config import LogitTransform
from fastrl.ops.custom_ops import host_sync_enabled
from fastrl.ops.sharded_base import (  # noqa: F401 (re-exported: the names callers know this module by)
    VocabShard, all_reduce, chunk_range, is_vocab_sharded, local_replica, merge_stats, vocab_shard,
)
from fastrl.ops.torch_backend import acc_dtype

__all__ = ["VocabShard", "vocab_shard", "is_vocab_sharded", "local_replica", "sharded_logprobs", "merge_stats",
           "all_reduce", "chunk_range", "resolve_sharded_support", "LocalOps"]


@dataclass(frozen=True)
class LocalOps:
    """The unsharded op's pieces this module runs on a shard, handed over by ``fastrl.ops.linear_logprob`` (which
    imports this module: importing it back would be a cycle): its statistics and backward dispatch and options."""

    stats: Callable  # linear_stats(hidden, weight, bias, targets, tf, backend, with_entropy, vocab_chunk)
    backward: Callable  # linear_backward(hidden, weight, bias, targets, lse, entropy, g_logp, g_ent, opts, need)
    options: type  # LinearOptions


class ShardedLogprob(torch.autograd.Function):
    """(logp [A], entropy [A] | None) of live rows from this rank's vocabulary shard; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, shard: VocabShard, opts, ops: LocalOps):
        local = targets - shard.v0  # outside [0, V_l): the target is on another rank (no logit, no indicator)
        Vl = weight.shape[0]
        cdt = acc_dtype(hidden.dtype)
        if Vl > 0:
            with torch.autocast(hidden.device.type, enabled=False):
                lse_l, zt_l, ent_l = ops.stats(hidden, weight, bias, local, opts.tf, opts.backend,
                                               opts.with_entropy, opts.vocab_chunk)
            zt_l = torch.where((local >= 0) & (local < Vl), zt_l, torch.zeros_like(zt_l))
        else:  # an empty shard (V < P): no mass, no target
            lse_l = torch.full(targets.shape, float("-inf"), dtype=cdt, device=hidden.device)
            zt_l = torch.zeros_like(lse_l)
            ent_l = torch.zeros_like(lse_l) if opts.with_entropy else None
        lse, ent, zt = merge_stats(lse_l, ent_l, zt_l, shard.group)
        ctx.save_for_backward(hidden, weight, bias, local, lse, ent)
        ctx.shard, ctx.opts, ctx.ops = shard, opts, ops
        ctx.mark_non_differentiable(lse)
        return zt - lse, ent, lse

    @staticmethod
    def backward(ctx, grad_logp, grad_ent, _grad_lse):
        hidden, weight, bias, local, lse, ent = ctx.saved_tensors
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        cdt = lse.dtype
        g_lp = None if grad_logp is None else grad_logp.to(cdt).contiguous()
        g_en = None if (grad_ent is None or ent is None) else grad_ent.to(cdt).contiguous()
        if g_lp is None and g_en is None:
            return None, None, None, None, None, None, None
        if weight.shape[0] > 0:
            with torch.autocast(hidden.device.type, enabled=False):
                gh, gw, gb = ctx.ops.backward(hidden, weight, bias, local, lse, ent, g_lp, g_en, ctx.opts, need)
        else:
            gh = torch.zeros_like(hidden) if need[0] else None
            gw, gb = torch.zeros_like(weight) if need[1] else None, torch.zeros_like(bias) if need[2] else None
        if need[0]:  # each rank summed over its own columns: the full gradient is the sum over ranks
            gh = all_reduce(gh.to(cdt), "sum", ctx.shard.group).to(hidden.dtype)
        return gh, gw, gb, None, None, None, None


def sharded_logprobs(
    hidden: torch.Tensor,  # [N, H] or [B, T, H], replicated over the mesh
    weight,  # DTensor [V, H] placed Shard(0)
    targets: torch.Tensor,  # hidden's leading shape, global ids or ignore_index
    *,
    bias=None,  # [V]: a DTensor placed Shard(0), replicated, or None
    tf: LogitTransform,
    with_entropy: bool,
    ignore_index: int,
    check_finite: bool,
    backend: str | None,
    vocab_chunk: int | None,
    host_sync: bool | None,
    ops: LocalOps,
    support=None,  # None, a KeptSet or a SamplerRule
    return_kept_mass: bool = False,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``fastrl.fused_logprobs`` on a vocabulary-sharded head (checked here on the local shard; the same outputs
    on every rank). Eager only: the ignored rows are dropped first (one host sync). With a ``KeptSet``: each rank
    computes the kept ids in its rows (``fastrl.ops.sharded_kept``)."""
    if not host_sync_enabled(host_sync):
        raise ValueError("a vocabulary-sharded head (DTensor Shard(0)) runs in eager only: host_sync must be None "
                         "or True outside torch.compile")
    shard = vocab_shard(weight, bias)
    hidden = local_replica(hidden, "hidden")
    hidden, w, b = autocast_inputs(hidden, shard.weight, shard.bias)
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    check_linear_inputs(hidden, w if w.shape[0] else w.new_empty((1, w.shape[1])), targets, b if w.shape[0] else None)
    check_targets(targets, shard.vocab, ignore_index)
    b = dense_bias(b)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, w, b))
    name = resolve_backend(hidden.device, backend, kind="logprob" if grad else "forward", H=hidden.shape[-1],
                           dtype=hidden.dtype, tensors=(hidden, w))
    check_triton_dtypes(name, hidden.dtype)
    kept = resolve_sharded_support(support, hidden, weight, bias, targets, tf, ignore_index, positions)[0]
    lead = tuple(targets.shape)
    h = unit_stride(hidden.reshape(-1, hidden.shape[-1]))
    t = targets.reshape(-1).to(torch.int64).contiguous()
    live = t != ignore_index
    idx = compact_rows(live)
    h_live, t_live = (h, t) if idx is None else (h.index_select(0, idx), t.index_select(0, idx))
    opts = ops.options(temperature=float(tf.temperature), logit_scale=float(tf.logit_scale),
                         softcap=None if tf.softcap is None else float(tf.softcap), backend=name,
                         with_entropy=with_entropy, vocab_chunk=vocab_chunk, ignore_index=ignore_index)
    w = unit_stride(w)
    if kept is None:
        logp, ent, lse = ShardedLogprob.apply(h_live, w, b, t_live, shard, opts, ops)
    else:
        from fastrl.ops.sharded_kept import ShardedKept, local_entries

        rows_kept = kept if idx is None else kept[idx]
        rows, cols = local_entries(rows_kept.ids, rows_kept.offsets, shard.v0, shard.v0 + w.shape[0])
        logp, ent, lse = ShardedKept.apply(h_live, w, b, t_live, rows, cols, shard, tf, with_entropy)
    mass = None
    if return_kept_mass:  # log of the full softmax's mass on the kept set: one more (forward-only) full pass
        if kept is None:
            mass = torch.zeros_like(lse)
        else:
            with torch.no_grad():
                no_ent = dataclasses.replace(opts, with_entropy=False)
                mass = lse - ShardedLogprob.apply(h_live, w, b, t_live, shard, no_ent, ops)[2]
    N = t.shape[0]
    if idx is not None:  # back to every token: 0 at the ignored ones
        logp, ent, mass = (None if x is None else x.new_zeros((N,)).index_copy(0, idx, x) for x in (logp, ent, mass))
    if check_finite:
        check_finite_outputs(logp.detach(), None if ent is None else ent.detach(), live, h, lead)
    out = (logp.reshape(lead), (ent.reshape(lead) if ent is not None else None))
    return out + (mass.reshape(lead),) if return_kept_mass else out


def _kept_support(support, hidden, weight, targets, tf, ignore_index, positions):
    """The KeptSet to compute over (checked against the targets on the host), or None for the full softmax."""
    return resolve_sharded_support(support, hidden, weight, None, targets, tf, ignore_index, positions)[0]


def resolve_sharded_support(support, hidden, weight, bias, targets, tf, ignore_index, positions
                            ) -> tuple:  # (KeptSet | None, outside [targets' shape] bool | None)
    """``fastrl.ops.kept.resolve_support`` for a vocabulary-sharded weight: a KeptSet checked as it is; a
    SamplerRule replayed across the shards (``fastrl.ops.sharded_rules``: top_k rules), the target added where the
    rule dropped it and ``outside`` marking those tokens; an identity rule: the full softmax."""
    if support is None:
        return None, None
    from fastrl.ops.kept import resolve_support
    from fastrl.ops.support import SamplerRule

    if isinstance(support, SamplerRule) and not support.is_identity:
        from fastrl.ops.rules import rule_positions
        from fastrl.ops.sharded_rules import replay_sharded

        pos = rule_positions(targets, support, positions)
        t = targets.reshape(-1).to(torch.int64)
        h = local_replica(hidden, "hidden").detach().reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            kept, outside = replay_sharded(h, t, t != ignore_index, support, vocab_shard(weight, bias), tf, pos)
        return kept, outside.reshape(targets.shape)
    kept, outside, _ = resolve_support(support, hidden, weight, None, targets, tf, ignore_index, positions, True)
    return kept, outside
