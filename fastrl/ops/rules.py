"""Sampler rules replayed on logits: ``apply_rule`` (the one definition of a rule) and ``replay_rule``.

``apply_rule`` turns a materialised tile of transformed logits ``[n, V]`` into the kept mask of a
``fastrl.SamplerRule``; the reference (``fastrl.reference.rule_mask_reference``) and the fast path
(``replay_rule``) both call it, so there is one definition of every rule.

``replay_rule`` applies a rule to the model's own logits, token chunk by token chunk, one pass over the vocabulary
per chunk (one GEMM per tile, cuBLAS on CUDA with a float32 result, so no logit is rounded to bf16), never
``[N, V]``; the target is added where the rule dropped it, and the kept ids are appended to a CSR ``KeptSet``:

* a rule with top_k, ``_select_top_k``: each chunk of many tokens walks the vocabulary in blocks, each block merged
  into a running top-(k+1) per row (``_running_top``): no sort of a row, GEMMs as wide as the full path's, one
  bounded tile. Cost ``2 N H V`` FLOPs plus, on a CPU, one read of each block for its 32-column segment maxima
  and a look into the few segments above each row's floor (no ``topk`` of a block; a GPU takes each block's
  ``topk``). What follows top_k (top_p, transformers' min_p) then runs on whole
  rows holding only top_k's survivors, the same functions ``apply_rule`` runs after its top_k: top_p sorts the
  survivors only (``_sort_desc``'s bound), never a row;
* a rule without top_k: whole rows per chunk (``[chunk, V]``: 16 MB on a CPU, 128 MB on CUDA), ``apply_rule`` on the
  tile (top_p sorts the whole row; no histogram pass: the tile holds whole rows).

Either way the kept set is ``apply_rule``'s on those logits, exactly (ties included; see ``_select_top_k``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from fastrl.ops import torch_backend as TB
from fastrl.ops._checks import autocast_inputs, check_linear_inputs, check_targets, dense_bias
from fastrl.ops._gemm import mm_f32
from fastrl.ops.backend import cuda_f32_out, resolve_backend
from fastrl.ops.budget import tile_budget, tile_columns
from fastrl.ops.config import LogitTransform
from fastrl.ops.support import KeptSet, SamplerRule

__all__ = ["replay_checked", "apply_rule", "replay_rule", "rule_positions", "check_replay_inputs"]


def _pack(row: torch.Tensor, col: torch.Tensor, values: torch.Tensor, n: int, fill: float):
    """Entries given row-major as (row, col, value) -> values [n, m] and cols [n, m] packed left in that order
    (``m``: the most any row has; the rest ``fill`` and col 0)."""
    counts = torch.bincount(row, minlength=n)
    m = int(counts.max()) if row.numel() else 0
    vals = values.new_full((n, m), fill)
    cols = torch.zeros((n, m), dtype=torch.int64, device=row.device)
    if m:
        slot = torch.arange(row.numel(), device=row.device) - (counts.cumsum(0) - counts).index_select(0, row)
        flat = row * m + slot  # 1-D scatters: faster on a CPU than a 2-D index_put
        vals.view(-1).scatter_(0, flat, values)
        cols.view(-1).scatter_(0, flat, col)
    return vals, cols


def _sort_desc(z: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[n, V]`` and ids ``[n, B]`` of each row from largest to smallest; equal values in ascending id order
    (a stable sort of ``-z``), which is the order ``ties="index"`` keeps them in.

    ``bound``: no row has more than ``bound`` finite entries (what top_k left). Then only those are sorted: gathered
    in id order, then stably sorted by value, which is the same (value desc, id asc) order; the values past them are
    ``-inf``, as the full sort's are, so the values returned are the full sort's, element for element, and the ids
    cover the first ``B = bound`` positions (past a row's finite entries an id that is ``-inf`` in that row)."""
    V = z.shape[-1]
    if bound is None or bound * 8 > V:  # near V, gathering costs what the sort does
        return torch.sort(z, dim=-1, descending=True, stable=True)
    row, col = (z > -math.inf).nonzero().unbind(1)  # row-major: ids ascending within a row
    vals_b, ids = _pack(row, col, z[row, col], z.shape[0], -math.inf)
    # a row with fewer finite entries than the widest is padded, and callers write flags back through these ids
    # (_unsort): the padding gets an id that is -inf in its own row (a padded row has one), never a kept id. Packed
    # left, a row is padded iff its last slot is; usually (top_k without ties or min_p) none is, and no pass is made
    padded = vals_b[:, -1] == -math.inf if vals_b.shape[1] else None
    if padded is not None and bool(padded.any()):
        r = padded.nonzero().squeeze(1)
        spare = torch.zeros_like(ids[:, :1])
        spare[r] = (z.index_select(0, r) == -math.inf).to(torch.uint8).argmax(dim=-1, keepdim=True)
        ids = torch.where(vals_b > -math.inf, ids, spare)
    vals_b, o = torch.sort(vals_b, dim=-1, descending=True, stable=True)
    vals = z.new_full(z.shape, -math.inf)
    vals[:, : vals_b.shape[1]] = vals_b
    return vals, ids.gather(1, o)


def _finite_bound(keep: torch.Tensor) -> int:
    """The most ids any row keeps (one host read): ``_sort_desc``'s ``bound`` after top_k."""
    return int(keep.sum(dim=-1).max()) if keep.numel() else 0


def _tie_group_first(vals: torch.Tensor) -> torch.Tensor:  # [n, V] sorted values -> [n, V] int64
    """Index (in sorted order) of the first element of each element's run of equal values."""
    n, V = vals.shape
    start = torch.ones_like(vals, dtype=torch.bool)
    start[:, 1:] = vals[:, 1:] != vals[:, :-1]
    pos = torch.arange(V, device=vals.device).expand(n, V)
    return torch.where(start, pos, torch.zeros_like(pos)).cummax(dim=1).values


def _unsort(keep_sorted: torch.Tensor, order: torch.Tensor, V: int) -> torch.Tensor:
    """[n, B] flags of the first B sorted positions (``order``'s) -> [n, V] by id; nothing past them is set
    (``_sort_desc``'s bound: nothing past them is finite)."""
    return keep_sorted.new_zeros((keep_sorted.shape[0], V)).scatter_(1, order, keep_sorted)


def _top_k(z: torch.Tensor, k: int, ties: str) -> torch.Tensor:  # bool [n, V]
    """The k largest of each row (among finite entries); ``keep``: every id tied with the k-th value too;
    ``index``: exactly k, the lowest ids among those tied with the k-th value (the first k of a stable sort).

    No sort: ``topk`` gives the k-th value, every id above it is kept, and of the ids equal to it (``topk`` picks
    among them in no defined order) the lowest ``k - #above`` by a running count in id order."""
    V = z.shape[-1]
    k = min(k, V)
    kth = torch.topk(z, k, dim=-1).values[:, -1:]
    finite = z > -math.inf
    if ties == "keep":
        return (z >= kth) & finite
    above = z > kth
    tied = z == kth
    room = k - above.sum(dim=-1, keepdim=True)  # >= 1: the k-th value itself is not above it
    if bool((tied.sum(dim=-1, keepdim=True) > room).any()):  # more ids equal the k-th value than places are left
        tied &= tied.cumsum(dim=-1) <= room
    return (above | tied) & finite


def _top_p_vllm(z: torch.Tensor, top_p: float, ties: str, bound: int | None = None) -> torch.Tensor:  # bool [n, V]
    """Keep an id iff the renormalised mass strictly above it is < top_p (the top id always kept).

    ``keep``: "above" means a strictly larger logit, so tied ids share a fate; ``index``: the ids before it in
    the (value descending, id ascending) order. ``bound``: see ``_sort_desc``."""
    vals, order = _sort_desc(z, bound)
    B = order.shape[1]
    # the softmax and its running sum over the whole sorted row, so their roundings do not depend on the bound;
    # past the first B positions (all -inf, never kept) nothing more is needed
    p = torch.softmax(vals, dim=-1)
    above = p.cumsum(dim=-1)[:, :B] - p[:, :B]
    vals = vals[:, :B]
    if ties == "keep":
        above = above.gather(1, _tie_group_first(vals))
    keep = (above < top_p) & (vals > -math.inf)
    keep[:, 0] = vals[:, 0] > -math.inf
    return _unsort(keep, order, z.shape[-1])


def _vllm(z: torch.Tensor, rule: SamplerRule) -> torch.Tensor:
    keep = z > -math.inf
    if rule.min_p > 0.0:
        zmax = z.amax(dim=-1, keepdim=True)
        keep &= z >= zmax + math.log(rule.min_p)
        z = z.masked_fill(~keep, -math.inf)
    if rule.top_k == 0:
        return keep & _top_p_vllm(z, rule.top_p, rule.ties) if rule.top_p < 1.0 else keep
    keep &= _top_k(z, rule.top_k, rule.ties)
    return _vllm_after_top_k(z.masked_fill(~keep, -math.inf) if rule.top_p < 1.0 else z, keep, rule)


def _vllm_after_top_k(z: torch.Tensor, keep: torch.Tensor, rule: SamplerRule) -> torch.Tensor:  # bool [n, V]
    """vLLM's order past top_k (top_p): ``keep`` the survivors so far, ``z`` -inf outside them (when top_p is on).
    ``_select_top_k`` enters here too, with the same survivors and values: one definition of what follows."""
    if rule.top_p < 1.0:  # top_p sorts the survivors only
        keep = keep & _top_p_vllm(z, rule.top_p, rule.ties, _finite_bound(keep))
    return keep


def _transformers(z: torch.Tensor, rule: SamplerRule) -> torch.Tensor:
    """transformers' TopKLogitsWarper -> TopPLogitsWarper -> MinPLogitsWarper (min_tokens_to_keep=1), in their
    arithmetic: top_p sorts ascending, takes the softmax of the sorted logits and its cumulative sum, and drops
    the ids with ``cumsum <= 1 - top_p`` except the last (largest); min_p drops ``softmax < min_p * max``."""
    if rule.top_k == 0:
        return _transformers_after_top_k(z, rule, None)
    kept_k = _top_k(z, max(rule.top_k, 1), rule.ties)
    return _transformers_after_top_k(z.masked_fill(~kept_k, -math.inf), rule, kept_k)


def _transformers_after_top_k(z: torch.Tensor, rule: SamplerRule, kept_k: torch.Tensor | None) -> torch.Tensor:
    """transformers' order past top_k (top_p, then min_p) on ``z``, -inf outside top_k's survivors ``kept_k`` (None
    without top_k). ``_select_top_k`` enters here too, with the same ``z``: one definition of what follows."""
    V = z.shape[-1]
    # top_p then sorts the survivors only
    bound = _finite_bound(kept_k) if kept_k is not None and rule.top_p < 1.0 else None
    if rule.top_p < 1.0:
        # transformers sorts ascending; here the ascending order is the flip of (value desc, id asc), so among
        # equal logits the lowest id comes last: "index" drops the higher ids first
        vals_d, order = _sort_desc(z, bound)
        B = order.shape[1]
        # the softmax and its running sum over the whole ascending row (roundings independent of the bound); then
        # only the last B ascending positions, the first B descending ones, matter (the rest is -inf)
        cum = vals_d.flip(-1).softmax(dim=-1).cumsum(dim=-1)
        remove_a = cum <= (1 - rule.top_p)
        remove_a[:, -1] = False
        kept = ~remove_a[:, V - B :].flip(-1)  # descending positions 0..B-1
        if rule.ties == "keep":  # a run of equal logits is kept whole when any of its ids is kept
            first = _tie_group_first(vals_d[:, :B])
            grp = torch.zeros_like(kept, dtype=torch.uint8).scatter_reduce(1, first, kept.to(torch.uint8), "amax")
            kept = grp.gather(1, first).bool()
        z = z.masked_fill(_unsort(~kept, order, V), -math.inf)
    if rule.min_p > 0.0:
        probs = torch.softmax(z, dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        remove = probs < rule.min_p * top
        remove.scatter_(-1, torch.topk(probs, min(1, V), dim=-1).indices, False)
        z = z.masked_fill(remove, -math.inf)
    return z > -math.inf


def _stop_ids(rule: SamplerRule, V: int, positions: torch.Tensor | None, device: torch.device):
    """(stop ids < V [s], early [n] bool: position < min_tokens), or (None, None) when no row's stop ids are masked."""
    if rule.min_tokens == 0:
        return None, None
    stops = torch.tensor([s for s in rule.stop_token_ids if s < V], dtype=torch.int64, device=device)
    early = positions.to(device) < rule.min_tokens
    if stops.numel() == 0 or not bool(early.any()):
        return None, None
    return stops, early


def apply_rule(
    z: torch.Tensor,  # [n, V] transformed logits (after temperature), float32 or float64
    rule: SamplerRule,
    positions: torch.Tensor | None = None,  # [n] int: completion position of each row (min_tokens)
) -> torch.Tensor:  # [n, V] bool, True where the id is kept
    """The kept mask of ``rule`` on a materialised logits tile (exact; sort based). See ``fastrl.SamplerRule``.

    First, at rows whose position is < ``rule.min_tokens``, the stop ids leave the support; then the truncation
    rules in ``rule.order``. ``positions`` is required when ``rule.min_tokens > 0``.
    """
    if not isinstance(rule, SamplerRule):
        raise TypeError(f"rule must be a fastrl.SamplerRule, got {type(rule).__name__}")
    if not isinstance(z, torch.Tensor) or z.dim() != 2 or not z.is_floating_point():
        raise TypeError(f"apply_rule takes a float [n, V] logits tile, got "
                        f"{type(z).__name__ if not isinstance(z, torch.Tensor) else (z.dtype, tuple(z.shape))}")
    V = z.shape[-1]
    if rule.min_tokens > 0:
        if positions is None:
            raise ValueError("apply_rule: rule.min_tokens > 0 needs positions (each row's completion position)")
        if positions.shape != (z.shape[0],):
            raise ValueError(f"apply_rule: positions must be [{z.shape[0]}], got {tuple(positions.shape)}")
        stops, early = _stop_ids(rule, V, positions, z.device)
        if stops is not None:
            block = torch.zeros_like(z, dtype=torch.bool)
            block[:, stops] = True
            z = z.masked_fill(block & early[:, None], -math.inf)
    if rule.order == "vllm":
        return _vllm(z, rule)
    return _transformers(z, rule)


def rule_positions(
    targets: torch.Tensor,  # [N] or [B, T]
    rule: SamplerRule,
    positions: torch.Tensor | None,
) -> torch.Tensor | None:  # [N] int64, or None when the rule needs none
    """Each token's completion position for ``rule.min_tokens``: ``positions`` (targets' shape) if given, else
    column t of a ``[B, T]`` targets is position t. Flat targets without positions raise when min_tokens > 0."""
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise TypeError(f"positions must be an integer tensor of targets' shape, got {type(positions).__name__}"
                            + (f" {positions.dtype}" if isinstance(positions, torch.Tensor) else ""))
        if tuple(positions.shape) != tuple(targets.shape):
            raise ValueError(f"positions must have targets' shape {tuple(targets.shape)}, got {tuple(positions.shape)}")
        return positions.reshape(-1).to(device=targets.device, dtype=torch.int64)
    if rule.min_tokens == 0:
        return None
    if targets.dim() != 2:
        raise ValueError(
            f"SamplerRule(min_tokens={rule.min_tokens}) needs each token's completion position: pass targets as "
            f"[B, T] (column t is position t) or positions=, got flat targets of shape {tuple(targets.shape)}")
    B, T = targets.shape
    return torch.arange(T, device=targets.device).repeat(B)


def _rows_per_tile(V: int, device: torch.device) -> int:
    # replay_rule's [chunk, V] float32 logits tile (the "rule" row of fastrl.ops.budget; its rows, where set)
    b = tile_budget("rule", device)
    return b.rows or max(1, b.elems // V)


def _bounded(rule: SamplerRule) -> bool:
    """Whether ``replay_rule`` takes the bounded selection (``_select_top_k``): every rule with top_k, whose kept set
    lies within top_k's survivors (what follows top_k sees nothing else)."""
    return rule.top_k > 0


def _after_top_k(rule: SamplerRule) -> bool:
    """Whether the rule has stages past top_k and vLLM's min_p: top_p, or transformers' min_p (after top_p)."""
    return rule.top_p < 1.0 or (rule.min_p > 0.0 and rule.order == "transformers")


_SEG = 32  # columns per segment: the running selection reads a block's segment maxima first
_MERGE = 2  # the running buffer is cut back to c entries once it holds _MERGE * c


def _seg_max(z: torch.Tensor) -> torch.Tensor:  # [n, C // _SEG]
    """The maxima of each row's whole ``_SEG``-column segments (one vectorised read of the block)."""
    n, C = z.shape
    S = C // _SEG
    return z[:, : S * _SEG].reshape(n, S, _SEG).amax(dim=-1)


def _above(
    z: torch.Tensor,  # [n, C] a block of logits
    seg_max: torch.Tensor,  # [n, C // _SEG] its segment maxima (_seg_max)
    floor: torch.Tensor,  # [n, 1] each row's floor
    v0: int,  # id of the block's first column
) -> tuple[torch.Tensor, torch.Tensor]:  # values [n, m], ids [n, m]: each row's entries > floor, padded with -inf
    """The entries of each row strictly above ``floor``, packed left (``m``: the most any row has). On a CPU, where
    ``topk`` of a block (k=65: a partial sort of every row) costs far more than reading it once; CUDA's
    ``topk`` is fast and reads nothing back to the host, so a GPU takes each block's ``topk`` instead.

    Once the floor is a few blocks' best, a block brings each row a handful of such entries, so only the segments
    whose maximum passes are looked into (gathered as whole rows of a ``[n * S, 32]`` view, no mask of the block).
    Dropping an entry equal to the floor is safe: ``_select_top_k`` keeps the floor's value itself, and its tie
    check sees when such an entry could have been kept."""
    z = z.contiguous()
    n, C = z.shape
    S = C // _SEG
    whole = S * _SEG
    r, b = (seg_max > floor).nonzero().unbind(1)  # row-major
    segs = z.view(n * S, _SEG) if whole == C else z[:, :whole].reshape(n * S, _SEG)
    seg = segs.index_select(0, r * S + b)  # [s, 32] the segments that pass
    above = seg > floor.view(-1).index_select(0, r)[:, None]
    i, j = above.nonzero().unbind(1)
    # index_select, not seg[above] or r[i]: boolean and tensor indexing are slower on a CPU
    row, col = r.index_select(0, i), b.index_select(0, i) * _SEG + j
    val = seg.view(-1).index_select(0, i * _SEG + j)
    if whole < C:  # the block's last, partial segment: looked into directly
        r2, c2 = (z[:, whole:] > floor).nonzero().unbind(1)
        row, col = torch.cat([row, r2]), torch.cat([col, c2 + whole])
        val = torch.cat([val, z[:, whole:][r2, c2]])
        order = torch.sort(row * C + col).indices  # back to row-major
        row, col, val = row.index_select(0, order), col.index_select(0, order), val.index_select(0, order)
    return _pack(row, col + v0, val, n, -math.inf)


def _cut(top_v: torch.Tensor, top_i: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``c`` largest of each row's buffer (values descending, with their ids); narrower buffers as they are."""
    if top_v.shape[1] <= c:
        return top_v, top_i
    top_v, sel = torch.topk(top_v, c, dim=-1)
    return top_v, top_i.gather(1, sel)


def _running_top(
    blocks,  # iterable of (v0, [n, C] transformed logits)
    c: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # each row's c largest values [n, c] descending, and ids
    """Each row's ``c`` largest values with their multiplicity, from its vocabulary blocks, never a sort of a row.

    A row's ``floor`` is a value that at least ``c`` of its entries reach, and every entry left out is <= it. The
    first block of at least ``c`` whole segments gives one without a ``topk`` of the block: its ``c``-th largest
    segment maximum (the maxima are ``c`` distinct entries); until one exists, each block's own ``topk``. From
    then on a block adds its entries above the floor (``_above``), and when the buffer holds ``_MERGE * c`` it is
    cut back to its ``c`` largest, whose smallest raises the floor. At the end the buffer, padded with the floor's
    value (at least ``c`` entries reach it, and every entry above it is in the buffer), gives exactly the ``c``
    largest values; a padding entry's id (0) is unknown, which ``_select_top_k``'s tie check covers: a padding
    entry among the first ``k`` means the ``k``-th and ``(k + 1)``-th values are both the floor."""
    top_v = top_i = floor = None
    for v0, z in blocks:
        sm = None
        if floor is None and not z.is_cuda and z.shape[1] // _SEG >= c:
            sm = _seg_max(z)
            floor = torch.topk(sm, c, dim=-1).values[:, -1:]
        if floor is None or z.is_cuda:  # the block's own topk
            bv, bi = torch.topk(z, min(c, z.shape[1]), dim=-1)
            bi += v0
        else:  # CPU: only values above the floor can enter (few, once a few blocks are seen)
            bv, bi = _above(z, _seg_max(z) if sm is None else sm, floor, v0)
        if top_v is not None:
            bv, bi = torch.cat([top_v, bv], dim=1), torch.cat([top_i, bi], dim=1)
        top_v, top_i = bv, bi
        if top_v.shape[1] >= (_MERGE * c if floor is not None and not z.is_cuda else c + 1):
            top_v, top_i = _cut(top_v, top_i, c)
            if top_v.shape[1] == c and not z.is_cuda:
                floor = top_v[:, -1:] if floor is None else torch.maximum(floor, top_v[:, -1:])
    if floor is not None:  # the floor's value, c times: fills the places of entries equal to it left out
        top_v = torch.cat([top_v, floor.expand(-1, c)], dim=1)
        top_i = torch.cat([top_i, top_i.new_zeros((top_i.shape[0], c))], dim=1)
    if top_v.shape[1] > c:
        return _cut(top_v, top_i, c)
    top_v, o = torch.sort(top_v, dim=-1, descending=True)  # a buffer never cut: blocks' topk side by side
    return top_v, top_i.gather(1, o)


def _select_top_k(
    block: Callable[[int, int], torch.Tensor],  # (v0, v1) -> [n, v1 - v0] transformed logits (may be overwritten)
    full_rows: Callable[[torch.Tensor], torch.Tensor],  # row ids [r] -> [r, V] transformed logits of those rows
    n: int,
    V: int,
    cols: int,  # vocabulary columns per block
    rule: SamplerRule,
    positions: torch.Tensor | None,  # [n] (min_tokens)
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # kept (row [m], id [m], logit [m]): row-major, ids ascending
    """``apply_rule``'s kept set for a ``_bounded`` rule, with each kept id's logit (the selection's own value), from the logits in vocabulary blocks (GEMMs over every row
    of the chunk: wide, not a few whole rows) and a running top-``(k + 1)`` of each row (``_running_top``), never a
    sort of a row.

    Exact by construction: the buffer holds the ``k + 1`` largest values of the row (with their multiplicity).
    When its ``(k + 1)``-th value is below the k-th, the first k entries are exactly the ids with a value >= the
    k-th: top_k's set under either tie rule. Where they are equal, ids equal to the k-th value may have been
    dropped, and which of them a rule keeps depends on all of them: those rows (rare with real logits) are
    recomputed whole and handed to ``apply_rule`` itself. vLLM's min_p keeps ``z >= z_max + log(min_p)``, a
    threshold every top-k survivor of it passes in the same order (``z_max`` is the buffer's first value), and
    min_tokens sets the stop ids to ``-inf`` block by block, as ``apply_rule`` does on the whole row. Stages past
    top_k (``_after_top_k``) see only its survivors, so ``_finish_after_top_k`` rebuilds exactly the tile they get
    inside ``apply_rule``."""
    k = min(rule.top_k, V)
    c = min(k + 1, V)
    stops, early = _stop_ids(rule, V, positions, device)

    def blocks():
        for v0 in range(0, V, cols):
            v1 = min(v0 + cols, V)
            z = block(v0, v1)
            if stops is not None:
                s = stops[(stops >= v0) & (stops < v1)] - v0
                if s.numel():
                    z[:, s] = z[:, s].masked_fill(early[:, None], -math.inf)
            yield v0, z

    top_v, top_i = _running_top(blocks(), c)
    # top_v [n, c]: each row's c largest values, descending; top_i their ids
    width = top_v.shape[1]
    keep = (top_v > -math.inf) & (torch.arange(width, device=device) < k)
    if rule.min_p > 0.0 and rule.order == "vllm":
        keep &= top_v >= top_v[:, :1] + math.log(rule.min_p)
    tie = (top_v[:, -1] == top_v[:, k - 1]) & (top_v[:, k - 1] > -math.inf) if width > k else None
    if tie is not None:
        keep &= ~tie[:, None]
    per = _rows_per_tile(V, device)  # whole rows, a bounded tile at a time
    if _after_top_k(rule):
        rows, ids, vals = _finish_after_top_k(top_v, top_i, keep, tie, rule, V, per)
    else:
        rows, ids, vals = _kept_pairs(torch.arange(n, device=device), top_v, top_i, keep, V)
    tie_rows = tie.nonzero().squeeze(1) if tie is not None else rows[:0]
    if tie_rows.numel() == 0:
        return rows, ids, vals
    t_rows, t_ids, t_vals = [rows], [ids], [vals]
    for r0 in range(0, tie_rows.numel(), per):
        r = tie_rows[r0 : r0 + per]
        z = full_rows(r)
        m = apply_rule(z, rule, None if positions is None else positions.index_select(0, r))
        i, j = m.nonzero().unbind(1)
        t_rows.append(r.index_select(0, i))
        t_ids.append(j)
        t_vals.append(z[i, j])
    rows, ids, vals = torch.cat(t_rows), torch.cat(t_ids), torch.cat(t_vals)
    order = torch.sort(rows * (V + 1) + ids).indices
    return rows.index_select(0, order), ids.index_select(0, order), vals.index_select(0, order)


def _kept_pairs(r: torch.Tensor, top_v: torch.Tensor, top_i: torch.Tensor, keep: torch.Tensor, V: int):
    """The buffer entries that ``keep`` marks, as (row, id, value) triples: rows ``r`` in order, ids ascending
    within a row (the buffer is in value order)."""
    width = top_v.shape[1]
    ids, o = torch.where(keep, top_i, V).sort(dim=-1)  # kept ids ascending, then the sentinel V
    taken = torch.arange(width, device=r.device) < keep.sum(dim=-1, keepdim=True)
    rows = r[:, None].expand(r.numel(), width)[taken]
    return rows, ids[taken], top_v.gather(1, o)[taken]


def _finish_after_top_k(top_v, top_i, keep, tie, rule: SamplerRule, V: int, per: int):
    """The stages past top_k (``_after_top_k``) for the rows without a tie, ``per`` whole rows at a time: each row's
    logits with every id but top_k's survivors at ``-inf`` (the survivors' values are the row's own, from the
    buffer), which is the tile ``apply_rule`` hands to the same functions after its own top_k. (row, id, value)
    triples, as ``_kept_pairs`` gives them."""
    n = top_v.shape[0]
    dev = top_v.device
    ok = torch.arange(n, device=dev) if tie is None else (~tie).nonzero().squeeze(1)
    out = []
    for r0 in range(0, ok.numel(), per):
        r = ok[r0 : r0 + per]
        kv, iv, tv = keep.index_select(0, r), top_i.index_select(0, r), top_v.index_select(0, r)
        vals = tv.masked_fill(~kv, -math.inf)
        # amax: padding in the buffer (-inf at a block's first id) may share its id with a real entry
        z = top_v.new_full((r.numel(), V), -math.inf).scatter_reduce_(1, iv, vals, "amax")
        survivors = z > -math.inf
        m = (_vllm_after_top_k(z, survivors, rule) if rule.order == "vllm"
             else _transformers_after_top_k(z, rule, survivors))
        kv &= m.gather(1, iv)  # what is kept lies among the survivors: read it at their ids, not over the row
        out.append(_kept_pairs(r, tv, iv, kv, V))
    if not out:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return empty, empty, top_v.new_zeros((0,))
    return tuple(torch.cat(x) for x in zip(*out))


def logits_tile(
    h: torch.Tensor,  # [n, H]
    weight: torch.Tensor,  # [V or |U|, H]
    bias: torch.Tensor | None,
    tf: LogitTransform,
    out: torch.Tensor,  # [n, V] float32 (float64 for float64 inputs)
) -> torch.Tensor:
    """Transformed logits of a token chunk, never rounded to the input dtype (cuBLAS float32 output on CUDA)."""
    if cuda_f32_out(out.device) or weight.dtype == out.dtype:
        mm_f32(h, weight.T, out=out)
        if bias is not None:
            out += TB.upcast(bias)
        return tf.apply_(out)
    return TB.chunk_logits(h, weight, bias, tf, out=out)


def _replay_sorted(h, weight, bias, t, tf, rule, pos, live, cdt, sizes, outside, pieces) -> None:
    """``replay_rule``'s loop for any rule: token chunks of whole rows ``[chunk, V]``, ``apply_rule`` on each; fills
    ``sizes`` [N], ``outside`` [N] and ``pieces`` (each chunk's kept ids and their logits, row-major) for the live
    rows ``live``."""
    V = weight.shape[0]
    rows = _rows_per_tile(V, h.device)
    buf = torch.empty(min(rows, max(live.numel(), 1)) * V, dtype=cdt, device=h.device)
    for c0 in range(0, live.numel(), rows):
        r = live[c0 : c0 + rows]
        n = r.numel()
        z = logits_tile(h.index_select(0, r), weight, bias, tf, out=buf[: n * V].view(n, V))
        keep = apply_rule(z, rule, None if pos is None else pos.index_select(0, r))
        tc = t.index_select(0, r)
        ar = torch.arange(n, device=h.device)
        outside[r] = ~keep[ar, tc]
        keep[ar, tc] = True
        sizes[r] = keep.sum(1)
        i, j = keep.nonzero().unbind(1)  # row-major: ascending ids within each row, rows in order
        pieces.append((j, z[i, j]))


def _replay_bounded(h, weight, bias, t, tf, rule, pos, live, cdt, sizes, outside, pieces) -> None:
    """``replay_rule``'s loop for a ``_bounded`` rule: token chunks of many rows, each walked in vocabulary blocks
    by ``_select_top_k``; fills ``sizes``, ``outside`` and ``pieces`` as the sort path does."""
    V = weight.shape[0]
    dev = h.device
    budget = tile_budget("rule", dev)
    # blocks of at least ~16 buffer widths of columns, so a block's topk outweighs merging it into the buffer; as
    # many rows as then fit the tile (every row of a C1-sized chunk: GEMMs as wide as the full path's)
    c = min(rule.top_k + 1, V)
    per = budget.rows or max(1, budget.elems // min(V, max(1024, 16 * c)))
    n_max = min(per, max(live.numel(), 1))
    cols = tile_columns(n_max, V, multiple=1, tile_elems=budget.elems)
    buf = torch.empty(n_max * cols, dtype=cdt, device=dev)
    for c0 in range(0, live.numel(), per):
        r = live[c0 : c0 + per]
        n = r.numel()
        h_c = h.index_select(0, r)

        def block(v0, v1, h_c=h_c, n=n):
            return logits_tile(h_c, weight[v0:v1], None if bias is None else bias[v0:v1], tf,
                               out=buf[: n * (v1 - v0)].view(n, v1 - v0))

        def full_rows(rr, h_c=h_c):
            return logits_tile(h_c.index_select(0, rr), weight, bias, tf,
                               out=torch.empty((rr.numel(), V), dtype=cdt, device=dev))

        kr, ki, kz = _select_top_k(block, full_rows, n, V, cols, rule,
                                   None if pos is None else pos.index_select(0, r), dev)
        tc = t.index_select(0, r)
        present = torch.zeros(n, dtype=torch.bool, device=dev)
        present[kr[ki == tc.index_select(0, kr)]] = True
        outside[r] = ~present
        add = (~present).nonzero().squeeze(1)
        if add.numel():  # the target joins the set of a token whose target the rule dropped, with its own logit
            ta = tc.index_select(0, add)
            za = _row_logits(h_c.index_select(0, add), weight, bias, ta, tf, cdt)
            kr, ki, kz = torch.cat([kr, add]), torch.cat([ki, ta]), torch.cat([kz, za])
            order = torch.sort(kr * (V + 1) + ki).indices
            kr, ki, kz = kr.index_select(0, order), ki.index_select(0, order), kz.index_select(0, order)
        sizes[r] = torch.bincount(kr, minlength=n)
        pieces.append((ki, kz))


def _row_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                tf: LogitTransform, cdt: torch.dtype) -> torch.Tensor:  # [n]
    """Each row's transformed logit at its own id ``ids[i]``: ``h[i] . W[ids[i]] (+ b)``, products and sum in the
    compute dtype (never rounded to a 2-byte input dtype)."""
    z = (h.to(cdt) * weight.index_select(0, ids).to(cdt)).sum(-1)
    if bias is not None:
        z += bias.index_select(0, ids).to(cdt)
    return tf.apply_(z)


@torch.no_grad()
def replay_rule(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] or [B, T]
    rule: SamplerRule,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    positions: torch.Tensor | None = None,  # targets' shape: completion positions (min_tokens)
    backend: str | None = None,
) -> tuple[KeptSet, torch.Tensor]:  # (KeptSet of N rows, outside: bool of targets' shape)
    """The kept set ``rule`` gives at each token under this model's own logits (no gradient).

    The rule runs on ``softcap(logit_scale * (hidden @ weight.T + bias)) / temperature`` in token chunks of
    a bounded tile (one pass over the vocabulary per chunk; never ``[N, V]``). A counted token whose target the
    rule dropped gets the target added to its set, and ``outside`` marks it (the trainers log the fraction);
    an ignored token (``targets == ignore_index``) gets an empty set. ``positions``: see ``rule_positions``.
    The same code serves every backend (the GEMM is cuBLAS on CUDA; the rest a selection or a sort, see the module
    docstring): ``backend`` is validated only.
    """
    if not isinstance(rule, SamplerRule):
        raise TypeError(f"rule must be a fastrl.SamplerRule, got {type(rule).__name__}")
    tf = LogitTransform(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    hidden, weight, bias = check_replay_inputs(hidden, weight, bias, targets, ignore_index, backend)
    kept, outside, _ = replay_checked(hidden, weight, bias, targets, rule, tf, ignore_index, positions)
    return kept, outside


def check_replay_inputs(hidden, weight, bias, targets, ignore_index, backend) -> tuple:
    """``replay_rule``'s input checks (named errors); returns (hidden, weight, bias) with autocast applied and the
    bias dense, as ``replay_checked`` takes them."""
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    check_linear_inputs(hidden, weight, targets, bias)
    bias = dense_bias(bias)
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_targets(targets, weight.shape[0], ignore_index)
    resolve_backend(hidden.device, backend)
    return hidden, weight, bias


@torch.no_grad()
def replay_checked(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # dense [V]
    targets: torch.Tensor,  # [N] or [B, T]
    rule: SamplerRule,
    tf: LogitTransform,
    ignore_index: int,
    positions: torch.Tensor | None,
) -> tuple[KeptSet, torch.Tensor, torch.Tensor]:  # (KeptSet, outside, logits [nnz])
    """``replay_rule`` on inputs its caller has checked (autocast applied, shapes, dense bias, targets in range,
    backend): the loss and log-prob paths, which checked them once already. Also returns the transformed logits of
    the kept entries (CSR order, compute dtype: float32, float64 for float64 inputs), the values the selection
    read, so the kept-set engine does not compute them again (``fastrl.ops.kept``'s ``given``)."""
    V = weight.shape[0]
    pos = rule_positions(targets, rule, positions)
    lead = tuple(targets.shape)
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(torch.int64)
    N = t.numel()
    live = (t != ignore_index).nonzero().squeeze(1)
    cdt = TB.acc_dtype(hidden.dtype)
    sizes = torch.zeros(N, dtype=torch.int64, device=h.device)
    outside = torch.zeros(N, dtype=torch.bool, device=h.device)
    pieces: list[torch.Tensor] = []
    with torch.autocast(h.device.type, enabled=False):
        replay = _replay_bounded if _bounded(rule) else _replay_sorted
        replay(h, weight, bias, t, tf, rule, pos, live, cdt, sizes, outside, pieces)
    offsets = torch.zeros(N + 1, dtype=torch.int64, device=h.device)
    offsets[1:] = sizes.cumsum(0)
    ids = torch.cat([p[0] for p in pieces]) if pieces else torch.zeros(0, dtype=torch.int64, device=h.device)
    z = torch.cat([p[1] for p in pieces]) if pieces else torch.zeros(0, dtype=cdt, device=h.device)
    return KeptSet(ids, offsets, V, lead, validate=False), outside.reshape(lead), z
