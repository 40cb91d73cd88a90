"""The hybrid Triton backend: cuBLAS GEMMs with float32 logits, Triton kernels for everything elementwise.

Each tile of raw logits ``y = h W^T`` is one GEMM into a reused float32 buffer (``mm_f32``: bf16 operands,
float32 accumulation and result), then one pass of a Triton kernel over it (``fastrl.kernels.logits_fold``):
either folding it into the rows' online statistics or turning it into ``G = dL/dy``, written over the tile.
The weight- and hidden-gradient GEMMs read ``G`` straight from there.

Tile shapes (elements of the float32 buffer bounded by the ``hybrid`` row of ``fastrl.ops.budget``, 256 MB):

* statistics (path C, and path A's forward): up to ``ROWS`` tokens x as many vocabulary columns as fit;
* path A's backward: the vocabulary is the outer loop and a tile holds every token of a vocabulary slice, so
  each ``grad_W`` slice is one GEMM over all tokens, written once (no float32 ``[V, H]`` buffer); ``grad_h``
  accumulates over the slices in float32. Past ``MAX_ROWS`` tokens the rows are chunked too, and each
  ``grad_W`` slice accumulates in a float32 ``[slice, H]`` buffer first.
"""

from __future__ import annotations

from typing import Callable

import torch

from fastrl.kernels import logits_fold as F
from fastrl.ops import torch_backend as _TB
from fastrl.ops._gemm import addmm_f32, mm_f32
from fastrl.ops.budget import O_N_BYTES, memory_budget, tile_budget
from fastrl.ops.config import LogitTransform, get_batch_invariant

__all__ = ["linear_stats", "linear_backward", "sliced_backward", "tile_columns", "chunk_logits_f32", "invariant_rows"]

ROWS = 4096  # tokens per statistics tile (TRL's token tile; cuBLAS is at full speed there)
# Tokens per backward tile before the rows are chunked as well. A tile of E elements (the budget) holds E / rows
# vocabulary columns, and grad_h's float32 accumulation (addmm_f32 over a [rows, cols] G) moves 8 bytes of [N, H]
# per 2*cols FLOPs: at 16384 rows the slices keep 4096 columns (1024 FLOP/B, compute-bound on an H100, whose
# balance is ~300 FLOP/B), where 65536 rows would leave 1024 columns (256 FLOP/B, memory-bound). Chunking the rows
# instead costs grad_W one float32 [cols, H] read-modify-write per extra chunk: K = 16384 tokens per 8 bytes of
# output, 4096 FLOP/B. (A roofline choice, not yet timed on a GPU; up to 16384 tokens nothing changes.)
MAX_ROWS = 1 << 14
_ALIGN = 256
# The batch-invariant mode's statistics tile (``fastrl.set_batch_invariant``): cuBLAS (and MKL) pick a GEMM's kernel,
# and so the order of an output's inner sum, by its shape, so every GEMM has INVARIANT_ROWS rows (the last block
# padded with zero rows) and INVARIANT_COLS columns (the last one narrower, the same for every N): a 32 MB float32
# tile on CUDA. Costs the padded rows (a batch of 1 token computes 1024) and GEMMs narrower than ROWS. On a CPU (the
# interpreter) 128 rows: MKL is at full speed there, and the interpreter's cost follows the padded rows.
INVARIANT_ROWS = {"cuda": 1024, "cpu": 128}
INVARIANT_COLS = 8192


def tile_columns(rows: int, vocab: int, requested: int | None = None, room: int | None = None) -> int:
    """Vocabulary columns of a ``rows``-row tile on the Triton backends: the requested number, else as many as
    the ``hybrid`` budget allows, in whole 256-column blocks (one rule with the torch backend's, another budget),
    within ``room`` bytes of float32 tile when given (the memory budget less what the path holds besides)."""
    elems = tile_budget("hybrid").elems
    if room is not None:
        elems = min(elems, max(room, 0) // 4)
    return _TB.tile_columns(rows, vocab, requested, multiple=_ALIGN, tile_elems=elems)


def _room(N: int, H: int, V: int, hidden: torch.Tensor, need: tuple[bool, bool, bool] = (False, False, False)):
    """Bytes of float32 tile the memory budget leaves (``budget.memory_budget``) beside the O(N) vectors and, with
    gradients, the float32 ``[N, H]`` hidden-gradient accumulator; None where the budget does not size tiles."""
    cap = memory_budget(N, V, H, hidden.dtype, hidden.device, need[1], need[0])
    return None if cap is None else cap - O_N_BYTES * N - (4 * N * H if need[0] else 0)


def _transform_kw(tf: LogitTransform) -> dict:
    return dict(logit_scale=tf.logit_scale, softcap=tf.softcap, temperature=tf.temperature)


def linear_stats(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V] contiguous
    targets: torch.Tensor,  # [N] int64 contiguous
    tf: LogitTransform,
    with_entropy: bool,
    vocab_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # lse [N], target logit [N], entropy [N] | None
    if get_batch_invariant():
        return _invariant_stats(hidden, weight, bias, targets, tf, with_entropy, vocab_chunk)
    N = hidden.shape[0]
    V = weight.shape[0]
    rows = min(N, ROWS)
    cols = tile_columns(rows, V, vocab_chunk, _room(N, hidden.shape[1], V, hidden))
    buf = torch.empty(rows * cols, dtype=torch.float32, device=hidden.device)
    stats = torch.empty((4, N), dtype=torch.float32, device=hidden.device)
    for n0 in range(0, N, rows):
        n1 = min(n0 + rows, N)
        part = stats[:, n0:n1]
        for v0 in range(0, V, cols):
            v1 = min(v0 + cols, V)
            y = mm_f32(hidden[n0:n1], weight[v0:v1].T, out=buf[: (n1 - n0) * (v1 - v0)].view(n1 - n0, v1 - v0))
            F.fold_tile(y, None if bias is None else bias[v0:v1], targets[n0:n1], v0, part, first=v0 == 0,
                        with_entropy=with_entropy, **_transform_kw(tf))
    return F.finish_stats(stats, with_entropy)


def _invariant_stats(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V] contiguous
    targets: torch.Tensor,  # [N] int64 contiguous
    tf: LogitTransform,
    with_entropy: bool,
    vocab_chunk: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # lse [N], target logit [N], entropy [N] | None
    """``linear_stats`` over the fixed tiles of ``_invariant_tiles`` (``vocab_chunk`` columns when given), whatever N
    and the memory budget: a token's statistics are a function of its own row (batch invariant)."""
    N = hidden.shape[0]
    rows = invariant_rows(hidden.device)
    n_pad = -(-N // rows) * rows
    stats = torch.empty((4, n_pad), dtype=torch.float32, device=hidden.device)
    t_pad = torch.full((n_pad,), -1, dtype=targets.dtype, device=targets.device)  # padding rows: no target logit
    t_pad[:N] = targets
    for n0, _, v0, v1, y in _invariant_tiles(hidden, weight, vocab_chunk):
        F.fold_tile(y, None if bias is None else bias[v0:v1], t_pad[n0 : n0 + rows], v0, stats[:, n0 : n0 + rows],
                    first=v0 == 0, with_entropy=with_entropy, **_transform_kw(tf))
    lse, zt, ent = F.finish_stats(stats, with_entropy)
    return lse[:N], zt[:N], (ent[:N] if ent is not None else None)


def invariant_rows(device: torch.device) -> int:
    """Rows per GEMM of the batch-invariant mode on ``device``'s kind (``INVARIANT_ROWS``)."""
    return INVARIANT_ROWS["cuda" if device.type == "cuda" else "cpu"]


def _invariant_tiles(hidden: torch.Tensor, weight: torch.Tensor, cols: int | None = None):
    """``(n0, n1, v0, v1, raw float32 logits [INVARIANT_ROWS, v1 - v0])`` over blocks of ``INVARIANT_ROWS`` rows (the
    last one padded with zero rows: its rows past ``n1`` are padding), each block's vocabulary tiles of ``cols``
    (default ``INVARIANT_COLS``) columns in order: every GEMM one shape whatever N. One reused tile."""
    N, H = hidden.shape
    V = weight.shape[0]
    rows, cols = invariant_rows(hidden.device), max(1, min(cols or INVARIANT_COLS, V))
    buf = torch.empty(rows * cols, dtype=torch.float32, device=hidden.device)
    pad = torch.zeros((rows, H), dtype=hidden.dtype, device=hidden.device) if N % rows else None
    for n0 in range(0, N, rows):
        n1 = min(n0 + rows, N)
        h_b = hidden[n0:n1]
        if n1 - n0 < rows:  # the last block, padded: every GEMM has the same shape
            pad[: n1 - n0] = h_b
            h_b = pad
        for v0 in range(0, V, cols):
            v1 = min(v0 + cols, V)
            yield n0, n1, v0, v1, mm_f32(h_b, weight[v0:v1].T, out=buf[: rows * (v1 - v0)].view(rows, v1 - v0))


def chunk_logits_f32(
    hidden: torch.Tensor,  # [n, H] a one-pass chunk's tokens
    weight: torch.Tensor,  # [V, H]
    out: torch.Tensor,  # [n, V] float32
) -> torch.Tensor:
    """The raw float32 logits of a one-pass chunk: one GEMM, or in the batch-invariant mode the GEMMs of
    ``_invariant_tiles`` (through one 32 MB tile on CUDA), so a row's logits follow neither the chunk's length nor
    its neighbours."""
    if not get_batch_invariant():
        return mm_f32(hidden, weight.T, out=out)
    for n0, n1, v0, v1, y in _invariant_tiles(hidden, weight):
        out[n0:n1, v0:v1] = y[: n1 - n0]
    return out


def linear_backward(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V] contiguous
    targets: torch.Tensor,  # [N] int64
    lse: torch.Tensor,  # [N] float32
    entropy: torch.Tensor | None,  # [N] float32
    grad_logp: torch.Tensor | None,  # [N] float32, zero where no gradient flows
    grad_entropy: torch.Tensor | None,  # [N] float32
    tf: LogitTransform,
    need: tuple[bool, bool, bool],  # (hidden, weight, bias)
    vocab_chunk: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # grad_h, grad_W, grad_b
    """Gradients of ``sum(grad_logp * logp + grad_entropy * entropy)`` w.r.t. hidden, weight and bias (path A)."""
    N = hidden.shape[0]
    V = weight.shape[0]
    rows = min(max(N, 1), MAX_ROWS)
    cols = tile_columns(rows, V, vocab_chunk, _room(N, hidden.shape[1], V, hidden, need))
    buf = torch.empty(rows * cols, dtype=torch.float32, device=hidden.device)

    def part(x, n0, n1):
        return None if x is None else x[n0:n1]

    def tile_grad(n0: int, n1: int, v0: int, v1: int) -> torch.Tensor:
        y = mm_f32(hidden[n0:n1], weight[v0:v1].T, out=buf[: (n1 - n0) * (v1 - v0)].view(n1 - n0, v1 - v0))
        return F.grad_tile(
            y, part(bias, v0, v1), targets[n0:n1], v0, lse[n0:n1], part(entropy, n0, n1),
            part(grad_logp, n0, n1), part(grad_entropy, n0, n1), out_dtype=hidden.dtype, **_transform_kw(tf),
        )

    return sliced_backward(hidden, weight, bias, need, rows, cols, tile_grad)


def sliced_backward(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V] (only its dtype is read)
    need: tuple[bool, bool, bool],  # (hidden, weight, bias)
    rows: int,  # tokens per tile; N > rows chunks the rows as well
    cols: int,  # vocabulary columns per slice
    tile_grad: Callable[[int, int, int, int], torch.Tensor],  # (n0, n1, v0, v1) -> G [n1 - n0, v1 - v0], hidden's dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # grad_h, grad_W, grad_b
    """The gradient GEMMs of the hybrid backends around a tile's ``G = dL/dy`` (from ``tile_grad``): the vocabulary
    is the outer loop, so each ``grad_W`` slice is one GEMM over all tokens, written once (a float32 ``[cols, H]``
    accumulator only when the rows are chunked); ``grad_h`` and ``grad_b`` accumulate in float32. Shared by
    ``linear_backward`` and ``fastrl.ops.divergence_hybrid``: one definition of the accumulation."""
    need_h, need_w, need_b = need
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    grad_h = torch.zeros((N, H), dtype=torch.float32, device=dev) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    grad_b = torch.zeros((V,), dtype=torch.float32, device=dev) if need_b else None
    chunked = N > rows
    w_acc = torch.empty((cols, H), dtype=torch.float32, device=dev) if need_w and chunked else None

    for v0 in range(0, V, cols):
        v1 = min(v0 + cols, V)
        w_s = weight[v0:v1]
        for n0 in range(0, N, rows):
            n1 = min(n0 + rows, N)
            h_c = hidden[n0:n1]
            G = tile_grad(n0, n1, v0, v1)
            if need_w:
                if not chunked:
                    torch.mm(G.T, h_c, out=grad_w[v0:v1])  # one GEMM over all tokens, written once
                elif n0 == 0:
                    mm_f32(G.T, h_c, out=w_acc[: v1 - v0])
                else:
                    addmm_f32(w_acc[: v1 - v0], G.T, h_c)
            if need_h:
                addmm_f32(grad_h[n0:n1], G, w_s)
            if need_b:
                grad_b[v0:v1] += G.sum(0, dtype=torch.float32)
        if need_w and chunked:
            grad_w[v0:v1] = w_acc[: v1 - v0]
    return (
        grad_h.to(hidden.dtype) if need_h else None,
        grad_w,
        grad_b.to(bias.dtype) if need_b else None,
    )
