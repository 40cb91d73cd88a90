"""The hybrid Triton backend of ``fused_divergence``: cuBLAS tiles of both heads, one Triton pass over the pair.

Per (token chunk, vocabulary slice) cuBLAS writes the raw logits of the student and of the teacher as float32
tiles (``mm_f32``: bf16 operands, float32 accumulation and result, never rounded); one kernel of
``fastrl.kernels.divergence_fold`` then reads both tiles of a row together: folding them into the online
statistics, adding the JSD's share, or writing the student's ``G`` over its tile. The gradient GEMMs read ``G``
from there, in ``fastrl.ops.hybrid.sliced_backward`` (shared with the log-prob path): the vocabulary is the outer
loop of the backward, so each ``grad_W`` slice is one GEMM over all tokens written once (no float32 ``[V, H]``
buffer); past ``hybrid.MAX_ROWS`` tokens the rows are chunked and a ``grad_W`` slice accumulates in a float32
``[slice, H]``.

Two tiles are alive instead of one, so each gets half of the log-prob path's (the ``divergence-hybrid`` row of
``fastrl.ops.budget``). The kept-set path (``support=``)
gathers ids per token chunk and runs on the torch implementation on every backend.
"""

from __future__ import annotations

import torch

from fastrl.kernels import divergence_fold as K
from fastrl.ops import hybrid, torch_backend
from fastrl.ops._gemm import mm_f32
from fastrl.ops.budget import tile_budget
from fastrl.ops.config import get_batch_invariant
from fastrl.ops.divergence_stats import finish_stats

__all__ = ["forward", "backward"]

COLUMNS: int | None = None  # vocabulary columns per slice (None: as many as the tile budget allows); tests shrink it
INVARIANT_COLUMNS = 4096  # the batch-invariant mode's: two 16 MB float32 tiles of 1024 rows on CUDA


def _cols(rows: int, V: int) -> int:
    return torch_backend.tile_columns(rows, V, COLUMNS, multiple=256,
                                      tile_elems=tile_budget("divergence-hybrid").elems)


def _tiles(student, teacher, n0, n1, v0, v1, bufs):
    """Raw float32 logits of rows [n0, n1) x columns [v0, v1) of both heads, in the two reused buffers."""
    R, C = n1 - n0, v1 - v0
    ys = mm_f32(student.h[n0:n1], student.weight[v0:v1].T, out=bufs[0][: R * C].view(R, C))
    yt = mm_f32(teacher.h[n0:n1], teacher.weight[v0:v1].T, out=bufs[1][: R * C].view(R, C))
    return ys, yt


def _bias(head, v0, v1):
    return None if head.bias is None else head.bias[v0:v1]


def forward(student, teacher, opts, mode: int):
    """(divergence, entropy | None, lse_s, lse_t, aux) [N] float32, as ``divergence_torch.forward``.

    ``student`` / ``teacher`` are ``fastrl.ops.config.Head``s whose ``h`` keeps the input dtype (cuBLAS reads bf16).
    In the batch-invariant mode (``fastrl.set_batch_invariant``) every GEMM has ``hybrid.INVARIANT_ROWS`` rows (the
    hidden states padded with zero rows) and ``INVARIANT_COLUMNS`` columns, so a token's divergence follows neither
    N nor the budget."""
    N, V = student.h.shape[0], student.weight.shape[0]
    if not get_batch_invariant():
        rows = min(max(N, 1), hybrid.ROWS)
        return _forward(student, teacher, opts, mode, rows, _cols(rows, V))
    rows = hybrid.invariant_rows(student.h.device)
    n_pad = -(-N // rows) * rows
    out = _forward(student.padded(n_pad), teacher.padded(n_pad), opts, mode, rows, min(INVARIANT_COLUMNS, V))
    return tuple(None if x is None else x[:N] for x in out)


def _forward(student, teacher, opts, mode: int, rows: int, cols: int):
    N, V = student.h.shape[0], student.weight.shape[0]
    dev = student.h.device
    bufs = [torch.empty(rows * cols, dtype=torch.float32, device=dev) for _ in range(2)]
    stats = torch.empty((6, N), dtype=torch.float32, device=dev)
    kw = dict(student=student.tf, teacher=teacher.tf)
    for n0 in range(0, N, rows):
        n1 = min(n0 + rows, N)
        for v0 in range(0, V, cols):
            v1 = min(v0 + cols, V)
            ys, yt = _tiles(student, teacher, n0, n1, v0, v1, bufs)
            K.stats_tile(ys, yt, _bias(student, v0, v1), _bias(teacher, v0, v1), stats[:, n0:n1], first=v0 == 0,
                         mode=mode, with_entropy=opts.with_entropy, **kw)
    # the same closing formulas as the torch backend (the kernels start from a finite NEG_LARGE max: never -inf)
    div, entropy, lse_s, lse_t = finish_stats(stats, mode, opts.with_entropy)
    if div is not None:  # a KL: it is also what the backward needs
        return div, entropy, lse_s, lse_t, div
    div = torch.zeros(N, dtype=torch.float32, device=dev)
    aux = torch.zeros(N, dtype=torch.float32, device=dev)
    for n0 in range(0, N, rows):
        n1 = min(n0 + rows, N)
        for v0 in range(0, V, cols):
            v1 = min(v0 + cols, V)
            ys, yt = _tiles(student, teacher, n0, n1, v0, v1, bufs)
            K.jsd_tile(ys, yt, _bias(student, v0, v1), _bias(teacher, v0, v1), lse_s[n0:n1], lse_t[n0:n1],
                       div[n0:n1], aux[n0:n1], beta=opts.beta, **kw)
    return div, entropy, lse_s, lse_t, aux


def backward(student, teacher, opts, mode: int, lse_s, lse_t, aux, entropy, grad_div, grad_ent, need):
    """Student gradients (hidden, weight, bias), vocabulary-sliced by ``hybrid.sliced_backward``."""
    h, weight = student.h, student.weight
    N, V = h.shape[0], weight.shape[0]
    rows = min(max(N, 1), hybrid.MAX_ROWS)
    cols = _cols(rows, V)
    bufs = [torch.empty(rows * cols, dtype=torch.float32, device=h.device) for _ in range(2)]
    kw = dict(mode=mode, beta=opts.beta, student=student.tf, teacher=teacher.tf)

    def part(x, n0, n1):
        return None if x is None else x[n0:n1]

    def tile_grad(n0: int, n1: int, v0: int, v1: int) -> torch.Tensor:
        ys, yt = _tiles(student, teacher, n0, n1, v0, v1, bufs)
        return K.grad_tile(ys, yt, _bias(student, v0, v1), _bias(teacher, v0, v1), lse_s[n0:n1], lse_t[n0:n1],
                           aux[n0:n1], part(entropy, n0, n1), part(grad_div, n0, n1), part(grad_ent, n0, n1),
                           out_dtype=h.dtype, **kw)

    return hybrid.sliced_backward(h, weight, student.bias, need, rows, cols, tile_grad)
