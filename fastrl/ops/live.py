"""Live rows on the no-sync path: the rows whose target counts, found on the device, computed alone where the host
may know how many there are without a device synchronisation.

In eager (``host_sync`` allowed) the public functions drop masked rows before their op (``compact_rows``: one host
synchronisation). While ``torch.compile`` traces, or with ``host_sync=False``, the ops receive every row and the mask,
and nothing outside them may read the host. Inside an op's implementation the code runs eagerly even under
``torch.compile``, so the op itself may decide how many rows to compute; the only question is whether reading the
count costs a synchronisation:

* the rows live in host memory (CPU tensors): reading the count is a memory read, not a synchronisation, so the op
  computes the live rows alone and scatters their results back (``LiveRows.ids``): a compiled loss over half-masked
  rows costs what eager's does;
* the rows live on a device (CUDA, eager ``host_sync=False``, ``torch.compile``, CUDA-graph capture): the count is
  never read (the issue's "no host read"; ``LiveRows.of`` gives ``ids`` None). Where the GEMMs run in Triton (the
  ``fastrl::linear_logprob`` op on ``triton-fused`` and ``triton-sm90``: statistics and the backward's ``G``; the
  one-pass loss's forward kernel on ``triton-sm90`` with token chunks) the op sorts the rows live-first and passes
  the count as a device tensor (``SortedRows``, ``LiveRows.sorted``): a program or persistent work item past it
  skips its GEMM, results are scattered back, nothing waits for the stream. Elsewhere (cuBLAS GEMMs, whose shapes
  are host values: ``triton-hybrid``, ``torch``, the backward's two gradient GEMMs, whole-sequence chunks, the
  divergence) every row is computed with the masked rows' hidden states zeroed.

``LiveRows.of`` finds the live rows with a stable sort of the mask (live rows first, in their order: a permutation,
a static shape), so the ids equal ``nonzero``'s and every result equals eager's row for row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LiveRows", "SortedRows", "count_readable", "live_first"]


def count_readable(device: torch.device) -> bool:
    """Whether the live count may be read on the host without a device synchronisation: the rows are in host memory.
    (A CUDA tensor's value is read only by waiting for the stream, which a CUDA-graph capture forbids and the no-sync
    path promises not to do.)"""
    return device.type == "cpu"


def live_first(live: torch.Tensor) -> torch.Tensor:  # [N] bool -> [N] int64
    """The permutation that puts the live rows first, each group in row order (a stable sort: static shape, computed
    where ``live`` is, no host read)."""
    return torch.sort(torch.logical_not(live).to(torch.uint8), stable=True).indices


@dataclass(frozen=True)
class LiveRows:
    """The rows an op computes on the no-sync path: ``ids`` [n] (ascending) of the live rows when their count is
    readable and some rows are masked, else None: every row is computed (all live, or the count is on a device)."""

    ids: torch.Tensor | None
    n_rows: int
    known: bool  # the live count was read: ``ids`` None then means every row is live
    # on a device (``known`` False), where the op's Triton GEMMs skip dead row blocks: ``ids`` is then every row,
    # live first (``SortedRows.order``), and this the live count on the device ([1] int32)
    count: torch.Tensor | None = None

    @staticmethod
    def of(live: torch.Tensor) -> LiveRows:  # [N] bool
        N = live.numel()
        if N == 0 or not count_readable(live.device):
            return LiveRows(None, N, N == 0)
        count = int(live.sum())  # host memory: a read, not a synchronisation (count_readable)
        if count == N:
            return LiveRows(None, N, True)
        return LiveRows(live_first(live)[:count], N, True)  # the first `count` entries are nonzero()'s ids

    @staticmethod
    def sorted(live: torch.Tensor) -> LiveRows:  # [N] bool on a device: every row, live first, the count on it
        rows = SortedRows.of(live)
        return LiveRows(rows.order, live.numel(), False, rows.count)

    def take(self, x: torch.Tensor | None) -> torch.Tensor | None:  # [N, ...] -> [n, ...]
        return x if x is None or self.ids is None else x.index_select(0, self.ids)

    def put(self, x: torch.Tensor | None, fill: float = 0.0) -> torch.Tensor | None:  # [n, ...] -> [N, ...]
        """The live rows' values at their rows, ``fill`` at the others (no autograd: the ops' outputs)."""
        if x is None or self.ids is None:
            return x
        out = torch.full((self.n_rows, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        return out.index_copy_(0, self.ids, x)


@dataclass(frozen=True)
class SortedRows:
    """The rows of an op whose GEMMs run in Triton, on a device (the count unreadable): permuted live-first
    (``order`` [N], a static shape) with the live count as a device tensor (``count`` [1] int32) that the kernels load:
    a program or persistent work item whose first row is ``>= count`` skips its GEMM (``fastrl.kernels``'
    ``live_count`` arguments). No host read: CUDA-graph safe."""

    order: torch.Tensor  # [N] int64: sorted row i is row order[i]
    count: torch.Tensor  # [1] int32 on the rows' device

    @staticmethod
    def of(live: torch.Tensor) -> SortedRows:  # [N] bool
        return SortedRows(live_first(live), live.sum(dtype=torch.int32).reshape(1))

    def take(self, x: torch.Tensor | None) -> torch.Tensor | None:  # [N, ...] rows -> sorted
        return None if x is None else x.index_select(0, self.order)

    def put(self, x: torch.Tensor | None) -> torch.Tensor | None:  # [N, ...] sorted -> rows (no autograd)
        return None if x is None else torch.empty_like(x).index_copy_(0, self.order, x)
