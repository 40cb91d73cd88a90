"""Sampler rules replayed on logits: ``apply_rule`` (the one definition of a rule) and ``replay_rule``.

``apply_rule`` turns a materialised tile of transformed logits ``[n, V]`` into the kept mask of a
``fastrl.SamplerRule``; the reference (``fastrl.reference.rule_mask_reference``) and the fast path
(``replay_rule``) both call it, so there is one definition of every rule.

``replay_rule`` applies a rule to the model's own logits, token chunk by token chunk: each chunk's logits tile
(``[chunk, V]`` float32, 16 MB on a CPU and 128 MB on CUDA, never ``[N, V]``) is computed once
(one GEMM, cuBLAS on CUDA with a float32 result, so no logit is rounded to bf16), the rule is applied to it
(one sort of the tile; top_p needs the order), the target is added where the rule dropped it, and the kept ids
are appended to a CSR ``KeptSet``. That is **one pass over the vocabulary per token chunk** for every rule,
top_p without top_k included: the tile holds whole rows, so no histogram pass is needed. Cost: ``2 N H V``
FLOPs (a forward pass) plus a sort of each row, no gradient.
"""

from __future__ import annotations

import math

import torch

from fastrl.ops import torch_backend as TB
from fastrl.ops._checks import autocast_inputs, check_linear_inputs, check_targets, dense_bias
from fastrl.ops._gemm import cuda_f32_out, mm_f32
from fastrl.ops.backend import resolve_backend
from fastrl.ops.budget import tile_budget
from fastrl.ops.config import LogitTransform
from fastrl.ops.support import KeptSet, SamplerRule

__all__ = ["apply_rule", "replay_rule", "rule_positions"]


def _sort_desc(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values and ids of each row from largest to smallest; equal values in ascending id order (a stable sort of
    ``-z``), which is the order ``ties="index"`` keeps them in."""
    vals, order = torch.sort(z, dim=-1, descending=True, stable=True)
    return vals, order


def _tie_group_first(vals: torch.Tensor) -> torch.Tensor:  # [n, V] sorted values -> [n, V] int64
    """Index (in sorted order) of the first element of each element's run of equal values."""
    n, V = vals.shape
    start = torch.ones_like(vals, dtype=torch.bool)
    start[:, 1:] = vals[:, 1:] != vals[:, :-1]
    pos = torch.arange(V, device=vals.device).expand(n, V)
    return torch.where(start, pos, torch.zeros_like(pos)).cummax(dim=1).values


def _unsort(keep_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def _top_k(z: torch.Tensor, k: int, ties: str) -> torch.Tensor:  # bool [n, V]
    """The k largest of each row (among finite entries); ``keep``: every id tied with the k-th value too."""
    V = z.shape[-1]
    k = min(k, V)
    if ties == "keep":
        kth = torch.topk(z, k, dim=-1).values[:, -1:]
        return (z >= kth) & (z > -math.inf)
    vals, order = _sort_desc(z)
    keep = (torch.arange(V, device=z.device) < k).expand_as(vals) & (vals > -math.inf)
    return _unsort(keep, order)


def _top_p_vllm(z: torch.Tensor, top_p: float, ties: str) -> torch.Tensor:  # bool [n, V]
    """Keep an id iff the renormalised mass strictly above it is < top_p (the top id always kept).

    ``keep``: "above" means a strictly larger logit, so tied ids share a fate; ``index``: the ids before it in
    the (value descending, id ascending) order."""
    vals, order = _sort_desc(z)
    p = torch.softmax(vals, dim=-1)
    above = p.cumsum(dim=-1) - p
    if ties == "keep":
        above = above.gather(1, _tie_group_first(vals))
    keep = (above < top_p) & (vals > -math.inf)
    keep[:, 0] = vals[:, 0] > -math.inf
    return _unsort(keep, order)


def _vllm(z: torch.Tensor, rule: SamplerRule) -> torch.Tensor:
    keep = z > -math.inf
    if rule.min_p > 0.0:
        zmax = z.amax(dim=-1, keepdim=True)
        keep &= z >= zmax + math.log(rule.min_p)
        z = z.masked_fill(~keep, -math.inf)
    if rule.top_k > 0:
        keep &= _top_k(z, rule.top_k, rule.ties)
        z = z.masked_fill(~keep, -math.inf)
    if rule.top_p < 1.0:
        keep &= _top_p_vllm(z, rule.top_p, rule.ties)
    return keep


def _transformers(z: torch.Tensor, rule: SamplerRule) -> torch.Tensor:
    """transformers' TopKLogitsWarper -> TopPLogitsWarper -> MinPLogitsWarper (min_tokens_to_keep=1), in their
    arithmetic: top_p sorts ascending, takes the softmax of the sorted logits and its cumulative sum, and drops
    the ids with ``cumsum <= 1 - top_p`` except the last (largest); min_p drops ``softmax < min_p * max``."""
    V = z.shape[-1]
    if rule.top_k > 0:
        z = z.masked_fill(~_top_k(z, max(rule.top_k, 1), rule.ties), -math.inf)
    if rule.top_p < 1.0:
        # transformers sorts ascending; here the ascending order is the flip of (value desc, id asc), so among
        # equal logits the lowest id comes last: "index" drops the higher ids first
        vals_d, order = _sort_desc(z)
        cum = vals_d.flip(-1).softmax(dim=-1).cumsum(dim=-1)
        remove_a = cum <= (1 - rule.top_p)
        remove_a[:, -1] = False
        kept = ~remove_a.flip(-1)  # descending positions
        if rule.ties == "keep":  # a run of equal logits is kept whole when any of its ids is kept
            first = _tie_group_first(vals_d)
            grp = torch.zeros_like(kept, dtype=torch.uint8).scatter_reduce(1, first, kept.to(torch.uint8), "amax")
            kept = grp.gather(1, first).bool()
        remove = ~kept
        z = z.masked_fill(_unsort(remove, order), -math.inf)
    if rule.min_p > 0.0:
        probs = torch.softmax(z, dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        remove = probs < rule.min_p * top
        remove.scatter_(-1, torch.topk(probs, min(1, V), dim=-1).indices, False)
        z = z.masked_fill(remove, -math.inf)
    return z > -math.inf


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
        stops = torch.tensor([s for s in rule.stop_token_ids if s < V], dtype=torch.int64, device=z.device)
        early = positions.to(z.device) < rule.min_tokens
        if stops.numel() and bool(early.any()):
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
    # replay_rule's [chunk, V] float32 logits tile (the "rule" row of fastrl.ops.budget)
    return max(1, tile_budget("rule", device).elems // V)


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
            out += TB._f32(bias)
        return tf.apply_(out)
    return TB.chunk_logits(h, weight, bias, tf, out=out)


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
    The same code serves every backend (the GEMM is cuBLAS on CUDA; the rest is a sort): ``backend`` is
    validated only.
    """
    if not isinstance(rule, SamplerRule):
        raise TypeError(f"rule must be a fastrl.SamplerRule, got {type(rule).__name__}")
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    check_linear_inputs(hidden, weight, targets, bias)
    bias = dense_bias(bias)
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    tf = LogitTransform(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    V = weight.shape[0]
    check_targets(targets, V, ignore_index)
    resolve_backend(hidden.device, backend)
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
    rows = _rows_per_tile(V, h.device)
    buf = torch.empty(min(rows, max(live.numel(), 1)) * V, dtype=cdt, device=h.device)
    with torch.autocast(h.device.type, enabled=False):
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
            pieces.append(keep.nonzero()[:, 1])  # row-major: ascending ids within each row, rows in order
    offsets = torch.zeros(N + 1, dtype=torch.int64, device=h.device)
    offsets[1:] = sizes.cumsum(0)
    ids = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=h.device)
    return KeptSet(ids, offsets, V, lead, validate=False), outside.reshape(lead)
