"""A ``SamplerRule`` replayed across the shards of a head sharded over the vocabulary (tensor parallelism).

A rule with ``top_k = k > 0`` keeps only ids among the global top k (ties with the k-th value included); each of them
is in its own shard's top k. So per token chunk each rank computes its rows' logits over its shard (whole local rows
per chunk, a bounded tile, the stop ids of ``min_tokens`` removed first), takes the ``C`` largest per row (``C`` >= k:
the most ids any row of any rank ties at or above its local k-th value, agreed by a MAX all-reduce), and all ranks
all-gather these candidates (values and ids, ``P C`` per token: independent of V). Laid out by ascending id, the
candidates are a logits tile on which ``fastrl.ops.rules.apply_rule`` (the one definition of every rule: both orders,
both tie rules, top-p over the renormalised survivors, min-p against the row's maximum, which is a candidate) gives
exactly the kept set of the full row: every id outside the candidates is below the k-th value, dropped by top_k in
either order. Every rank then holds the same ``KeptSet``; the target is added where the rule dropped it, as
``replay_rule`` does.

A rule without top_k (top_p or min_p alone) can keep any number of ids per shard and is refused by name.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fastrl.ops import torch_backend as TB
from fastrl.ops.sharded_base import VocabShard, all_reduce
from fastrl.ops.support import KeptSet, SamplerRule

__all__ = ["replay_sharded"]

_TILE_BYTES = 64 << 20  # a chunk's [rows, V_local] float32 logits tile


def _all_gather(t: torch.Tensor, shard: VocabShard) -> torch.Tensor:  # [P, *t.shape]
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(shard.world)]
    dist.all_gather(out, t.contiguous(), group=shard.group)
    return torch.stack(out)


def _local_logits(h, shard: VocabShard, tf, stop_early: torch.Tensor | None, stops: torch.Tensor | None):
    """[n, V_l] transformed logits of the local rows, stop ids at early rows removed (-inf)."""
    z = TB.logits_block(TB.upcast(h), shard.weight.detach(), None if shard.bias is None else shard.bias.detach(),
                        0, shard.weight.shape[0], tf)
    if stops is not None and stops.numel():
        z[:, stops] = torch.where(stop_early[:, None], float("-inf"), z[:, stops])
    return z


def replay_sharded(hidden: torch.Tensor, targets: torch.Tensor, live: torch.Tensor, rule: SamplerRule,
                   shard: VocabShard, tf, positions: torch.Tensor | None) -> tuple[KeptSet, torch.Tensor]:
    """(KeptSet of N rows, outside [N] bool) of ``rule`` on the sharded head; ignored rows (``~live``) keep nothing.
    ``hidden`` [N, H] and ``targets`` [N] flat; ``positions`` [N] or None."""
    if rule.top_k == 0:
        raise ValueError("a SamplerRule without top_k (top_p or min_p alone) is not implemented with a "
                         "vocabulary-sharded weight (DTensor Shard(0)): its kept set per shard is unbounded; pass "
                         "the KeptSet the sampler recorded (fastrl.KeptSet) instead")
    from fastrl.ops.rules import apply_rule

    N, V, v0, Vl = hidden.shape[0], shard.vocab, shard.v0, shard.weight.shape[0]
    stops = None
    if rule.min_tokens > 0:
        stops = torch.tensor([s - v0 for s in rule.stop_token_ids if v0 <= s < v0 + Vl], dtype=torch.int64,
                             device=hidden.device)
    # the stop ids leave the local logits before the candidates are taken; apply_rule then sees the rule without them
    # (its columns are candidates, not ids)
    truncation = dataclasses.replace(rule, min_tokens=0, stop_token_ids=())
    rows = live.nonzero().squeeze(1)
    per = max(1, _TILE_BYTES // (4 * max(Vl, 1)))
    n_chunks = all_reduce(torch.tensor([math.ceil(rows.numel() / per)], dtype=torch.float64), "max", shard.group)
    kept_rows, width = [], 1
    for c in range(int(n_chunks.item())):  # every rank runs the same number of collectives
        r = rows[c * per:(c + 1) * per]
        early = None if stops is None else positions[r] < rule.min_tokens
        z = _local_logits(hidden[r], shard, tf, early, stops) if Vl else hidden.new_empty((r.numel(), 0))
        k = min(rule.top_k, Vl)
        C = 0
        if k and r.numel():  # how many local ids tie at or above each row's local k-th value: C >= k covers them
            kth = torch.topk(z, k, dim=1).values[:, -1:]
            C = int(((z >= kth) & (z > float("-inf"))).sum(1).max())
        C = int(all_reduce(torch.tensor([max(C, 1)], dtype=torch.float64), "max", shard.group).item())
        vals = torch.full((r.numel(), C), float("-inf"), dtype=z.dtype, device=z.device)
        ids = torch.full((r.numel(), C), -1, dtype=torch.int64, device=z.device)
        if Vl and r.numel():
            top = torch.topk(z, min(C, Vl), dim=1)
            order = top.indices.sort(dim=1).values  # ascending ids: apply_rule breaks index ties by column
            vals[:, : order.shape[1]] = z.gather(1, order)
            ids[:, : order.shape[1]] = order + v0
        cand = _all_gather(vals, shard).permute(1, 0, 2).reshape(r.numel(), -1)  # rank-major: ascending ids
        cid = _all_gather(ids, shard).permute(1, 0, 2).reshape(r.numel(), -1)
        keep = apply_rule(cand, truncation) & (cid >= 0)
        kept_rows.append((r, torch.where(keep, cid, -1)))
        width = max(width, cid.shape[1])
    padded = torch.full((N, width + 1), -1, dtype=torch.int64, device=hidden.device)
    for r, k_ids in kept_rows:
        padded[r, : k_ids.shape[1]] = k_ids
    t = torch.where(live, targets, -1)
    outside = live & ~(padded == t[:, None]).any(1)
    padded[:, -1] = torch.where(outside, t, -1)  # the target, where the rule dropped it
    return KeptSet.from_padded(padded, V, pad_id=-1), outside
