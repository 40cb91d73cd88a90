"""Plans of the kept-set engine (``fastrl.ops.kept``): which token rows and vocabulary ids each dense GEMM covers.

A kept set holds ``nnz`` (token, id) entries in CSR order (``ids`` ascending within each token, ``offsets``
``[N + 1]``). The engine never computes a logit per token per vocabulary id; it computes the logits of the
entries, ``z[e] = h[row(e)] . W[id(e)]`` (then bias and transform), through *units*: a block of token rows, a set
of ids (the union of those rows' kept ids, or a block of it), one dense GEMM ``[rows, H] x [H, |ids|]`` into a
float32 tile, and the entries of the unit read out of the tile. A row costs ``2 H`` FLOPs per id of its unit, so
the plan bounds the ids of a unit (``cap``) and the tile (``tile_elems``).

Three plans. Two cut the set into *units* (``Unit``: one dense GEMM over a chunk's union):

* the host plan (``host_bounds``; eager, ``host_sync`` allowed): token chunks grown greedily while their union stays
  within ``cap`` ids and their tile within ``tile_elems`` (``chunk_plan``; one ``unique`` per candidate).
  Overlapping sets (neighbouring tokens share ids) give long chunks and wide GEMMs; disjoint sets ``cap // K`` rows
  per chunk, each row paying for the whole union: ``cap`` logits per token whatever K.
* the fixed union plan (no host read and no data-dependent shape): chunks of ``R`` rows (``R`` from the mean set size
  ``nnz / N``, a shape); the entries sorted by (chunk, id) on the device; a chunk's union is cut into units of at
  most ``C = min(cap, 4 K)`` ids and ``E = 4 C`` entries, so a chunk whose union exceeds the capacity is split, never
  truncated. The number of units is data-dependent, so the plan provisions its bound, ``ceil(N / R) + nnz // C +
  nnz // E`` (``fixed_shape``), computed from shapes; units past the real count hold no entry and compute a tile
  that is never read. At most ``3.5 C + R C / N`` logits per token (``union_bound``).

The third has no units: the per-row plan (``fastrl.ops.kept_rows``), rows bucketed by set size (``bucket_width``:
four padded widths per octave, at most ``1.25 nnz`` logits in all), one batched product per bucket of each row's
hidden state with its own gathered weight rows: no union, static shapes at the op's boundary, one host read of the
bucket counts inside the op (none under CUDA graph capture, which runs one ``[N, K_max]`` bucket). ``choose`` picks
the plan (the sets' overlap, measured on the host or stated by ``KeptSet.overlap``) and says why (``PlanChoice``,
printable).

The op argument that names a plan (``PlanChoice.arg``; ``decode``): ``[0, c1, ..., N]`` the host plan's chunk
boundaries, ``[]`` the fixed union plan, ``[-K_max]`` the per-row plan.

Entries that a unit does not hold, padding rows and padding ids point at a scratch slot: the per-entry arrays
have ``nnz + 1`` elements and the tiles ``rows * ids + 1`` (the last one written and read only as scratch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastrl.ops.budget import kept_capacity
from fastrl.ops.config import get_batch_invariant

__all__ = ["Unit", "KeptPlan", "PlanChoice", "RowBucket", "chunk_plan", "host_bounds", "fixed_shape", "union_bound",
           "bucket_width", "rows_count", "choose", "decode", "UNION_ADVANTAGE"]


@dataclass
class Unit:
    """One dense GEMM of the engine: the rows of a token chunk against a set of vocabulary ids."""

    rows: slice | torch.Tensor  # token rows: a range (host plan), or [R] ids clamped to N - 1 (fixed plan)
    cols: torch.Tensor  # [C] vocabulary ids (fixed plan: padded with id 0, whose padding column holds no entry)
    entries: slice | torch.Tensor  # the unit's CSR entries: a range, or [E] entry ids (nnz: none)
    flat: torch.Tensor  # [entries] position of each entry in the [n_rows, C] tile (n_rows * C: none)
    n_rows: int

    @property
    def n_cols(self) -> int:
        return self.cols.numel()

    def take_rows(self, x: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [n_rows, ...]
        return x[self.rows] if isinstance(self.rows, slice) else x.index_select(0, self.rows)

    def add_rows_(self, acc: torch.Tensor, x: torch.Tensor) -> None:  # acc[rows] += x
        if isinstance(self.rows, slice):
            acc[self.rows] += x
        else:  # clamped padding rows carry zeros (no entry lives there)
            acc.index_add_(0, self.rows, x)


def chunk_plan(ids: torch.Tensor, offsets: torch.Tensor, tile_elems: int, cap: int) -> list[tuple[int, int]]:
    """Token ranges ``[c0, c1)`` grown greedily from each start by doubling while the chunk's union ``U`` stays
    within ``cap`` ids and the ``[rows, |U|]`` tile within ``tile_elems`` (reads the sets on the host).

    A row costs ``2 |U| H`` FLOPs per GEMM, so ``cap`` bounds the work per token at ``max(cap, K)`` ids whatever
    the overlap. The start is the largest row count that is safe for any ids (``rows * K_max <= cap``); each
    doubling costs one ``unique`` over the candidate's ids."""
    N = offsets.numel() - 1
    if N == 0:
        return []
    sizes = offsets[1:] - offsets[:-1]
    k = max(1, int(sizes.max()))
    base = max(1, min(cap // k, tile_elems // max(cap, k)))
    off = offsets.tolist()
    plan, c0 = [], 0
    while c0 < N:
        r = min(base, N - c0)
        while c0 + r < N:
            r2 = min(2 * r, N - c0)
            u = torch.unique(ids[off[c0] : off[c0 + r2]]).numel()
            if u > cap or r2 * u > tile_elems:
                break
            r = r2
        plan.append((c0, c0 + r))
        c0 += r
    return plan


def host_bounds(ids: torch.Tensor, offsets: torch.Tensor, tile_elems: int, cap: int) -> list[int]:
    """``chunk_plan`` as the op argument: the chunk boundaries ``[0, c1, ..., N]`` ([] for no token)."""
    plan = chunk_plan(ids, offsets, tile_elems, cap)
    return [0] + [c1 for _, c1 in plan] if plan else []


FIXED_WIDTH = 4  # the fixed union plan's unit holds at most this many mean set sizes of ids (fixed_shape)


def fixed_shape(N: int, nnz: int, V: int, tile_elems: int, cap: int) -> tuple[int, int, int, int]:
    """(rows per chunk R, ids per unit C, entries per unit E, units provisioned S) of the fixed plan, from shapes
    only: ``C = min(cap, nnz, V, FIXED_WIDTH K)`` (``K = ceil(nnz / N)``, the mean set size), ``R = 2 C / K`` (disjoint
    sets then fill two units per chunk), ``E = 4 C``. Every provisioned unit computes an ``R x C`` tile, so the plan
    computes ``S R C <= 3.5 C N + R C`` logits per pass (``union_bound``): at most ``14 K`` per token plus one
    chunk's tile (896 at K=64, against 7168 with ``C = cap = 2048`` before the ``FIXED_WIDTH`` bound)."""
    if N == 0 or nnz == 0:
        return 1, 1, 1, 0
    k = -(-nnz // N)
    # a unit of at most FIXED_WIDTH mean sets: every chunk costs at least one unit of R x C logits, read or not,
    # whatever its union, so C beyond a few sets' width only adds logits that are never read
    C = max(1, min(cap, nnz, V, FIXED_WIDTH * k))
    R = max(1, min(N, 2 * C // k, max(1, tile_elems // C)))
    E = 4 * C
    S = -(-N // R) + nnz // C + nnz // E
    return R, C, E, S


def union_bound(N: int, nnz: int, V: int, tile_elems: int, cap: int) -> int:
    """The logits the fixed union plan computes: ``S`` provisioned units of ``R`` rows x ``C`` ids
    (``fixed_shape``), at most ``3.5 C N + R C`` (``S <= N / R + 1 + 1.25 nnz / C`` and ``R <= 2 C N / nnz``)."""
    R, C, _, S = fixed_shape(N, nnz, V, tile_elems, cap)
    return S * R * C


def bucket_width(sizes: torch.Tensor, width: int) -> torch.Tensor:
    """[N] the padded width of each row's bucket on the per-row plan: a set of ``s`` ids is padded to ``s`` rounded up
    to a multiple of ``q = 2^max(0, floor(log2 s) - 2)`` (four widths per octave), at most ``width``. Exact below 8 ids;
    from 8 on the padding is under ``q <= s / 4``, so a plan pays at most ``1.25 nnz`` logits whatever the sizes."""
    s = sizes.clamp(min=1)
    e = torch.log2(s.double()).floor_().long()
    e -= ((1 << e) > s).long()  # floor(log2 s) exactly, whatever log2's last bit
    e += ((2 << e) <= s).long()
    q = 1 << (e - 2).clamp_(min=0)
    return torch.where(sizes > 0, (s + q - 1) // q * q, 0).clamp_(max=width)


def rows_count(offsets: torch.Tensor, width: int) -> int:
    """The logits the per-row plan's forward computes for the sets of ``offsets`` (bucketed: ``bucket_width`` summed;
    a host read). At most ``1.25 nnz``."""
    if offsets.numel() <= 1 or not width:
        return 0
    return int(bucket_width(offsets[1:] - offsets[:-1], width).sum())


def decode(plan: list[int]) -> tuple[list[int] | None, int]:
    """An op's plan argument as (host plan boundaries, or None for no host plan; per-row width, 0 for none)."""
    if len(plan) == 1 and plan[0] < 0:
        return None, -plan[0]
    return (list(plan) if plan else None), 0


# A union tile computes at least each row's own ids (|U| >= K), so it never computes fewer logits than the per-row
# plan on sets of one size; but its GEMM is dense and each gathered weight row serves every row of the chunk, where
# the per-row plan gathers K_max rows of W per token and does a batched matrix-vector product. So the union is taken
# where it computes at most this many times the per-row plan's logits: neighbouring rows sharing most of their ids.
# (On a CPU, 1024 Zipf sets of 64 ids, whose host plan computes 18.6x the per-row plan's logits, ran both in about
# the same time, one thread, a loaded machine: 4 leaves the union the cases it clearly wins.)
UNION_ADVANTAGE = 4.0


@dataclass(frozen=True)
class PlanChoice:
    """Which plan the engine runs for a kept set, what it computes and why: ``print(choice)`` says it.

    ``kind``: "rows" (the per-row plan), "union-host" or "union-fixed". ``logits``: how many the plan computes in
    one pass (``rows x ids`` summed over its GEMMs; the per-row plan's buckets, ``rows_count``), None where not
    counted; ``other``: the other plan's count where it was measured (host plan) or bounded (fixed plan), else None."""

    kind: str
    N: int
    nnz: int
    width: int  # K_max (the per-row plan's), 0 when unknown
    bounds: tuple[int, ...]  # union-host: the chunk boundaries
    tile_elems: int
    cap: int
    logits: int | None  # None while compiling (symbolic sizes)
    other: int | None
    reason: str

    def arg(self) -> list[int]:
        """The ops' ``plan`` argument (``decode``)."""
        if self.kind == "rows":
            return [-self.width] if self.N and self.width else []
        return list(self.bounds) if self.kind == "union-host" else []

    def per_token(self) -> float:
        return (self.logits or 0) / max(1, self.N)

    def __str__(self) -> str:
        k = self.nnz / max(1, self.N)
        what = {"rows": f"per-row plan, {self.N} rows bucketed by set size (K_max = {self.width})",
                "union-host": f"union tiles, host plan ({max(0, len(self.bounds) - 1)} chunks, cap {self.cap})",
                "union-fixed": f"union tiles, fixed plan (cap {self.cap}, provisioned from shapes)"}[self.kind]
        if self.logits is None:
            s = f"{what}: logits counted where the op runs (no host read here)"
        else:
            s = (f"{what}: {self.logits} logits, {self.per_token():.1f} per token "
                 f"({self.per_token() / max(k, 1e-9):.2f} x the mean set size {k:.1f})")
        if self.other is not None:
            s += f"; the other plan: {self.other} ({self.other / max(1, self.N):.1f} per token)"
        return s + f". Why: {self.reason}"


def choose_for(ids: torch.Tensor, offsets: torch.Tensor, V: int, width: int | None, overlap: bool | None, sync: bool,
               device: torch.device | str | None, count: bool | None = None) -> PlanChoice:
    """``choose`` with ``device``'s engine capacity (``fastrl.ops.budget.kept_capacity``): the one place a kept set's
    plan is chosen (``fastrl.ops.kept.build_plan`` for the ops, ``KeptSet.describe_plan`` to print it)."""
    return choose(ids, offsets, V, width, overlap, sync, *kept_capacity(device), count=count)


def choose(ids: torch.Tensor, offsets: torch.Tensor, V: int, width: int | None, overlap: bool | None, sync: bool,
           tile_elems: int, cap: int, count: bool | None = None) -> PlanChoice:
    """The plan for a kept set (CSR ``ids`` / ``offsets``) of rows at most ``width`` wide (None: unknown).

    ``overlap`` (the set's ``KeptSet.overlap``): True takes union tiles, False the per-row plan, None decides: with
    ``sync`` (host reads allowed) on a CPU by measuring the host plan's unions against the per-row plan's logits
    (``UNION_ADVANTAGE``), on CUDA the per-row plan (the GPU window's rows: union tiles never won there); without, the per-row plan (sampled sets of different sequences share few ids), or the fixed union plan where
    no width is known (a rule replayed while compiling).

    ``count``: whether the per-row plan's logits (``rows_count``, a read of the set sizes) are counted into the
    choice; None: where host reads are allowed (``sync``; ``describe_plan`` asks for them). Uncounted, the
    choice's ``logits`` is None (the op counts them where it runs: ``KeptPlan.computed``)."""
    N, nnz = offsets.numel() - 1, ids.numel()
    if sync and N and width is None:
        width = int((offsets[1:] - offsets[:-1]).max())
    # while compiling, sizes may be symbolic (a replayed rule's nnz is data-dependent): nothing is counted then
    counted = not torch.compiler.is_compiling()
    count = sync or bool(count)
    rows_logits = rows_count(offsets, width or 0) if counted and count else None
    base = dict(N=N, nnz=nnz, width=width or 0, tile_elems=tile_elems, cap=cap)

    def rows(other, why):
        return PlanChoice("rows", bounds=(), logits=rows_logits, other=other, reason=why, **base)

    if overlap is False and width is not None:
        return rows(None, "the set says its rows share few ids (KeptSet.overlap=False)")
    if get_batch_invariant() and width is not None:  # a union tile's GEMM width follows the other rows' ids
        return rows(None, "batch-invariant mode (fastrl.set_batch_invariant): a row's logits from its own ids only")
    if not sync:
        fixed = union_bound(N, nnz, V, tile_elems, cap) if counted else None
        if overlap is None and width is not None:
            return rows(fixed, "no host read: the per-row plan unless the set says its rows overlap")
        why = ("the set says its rows overlap (KeptSet.overlap=True)" if overlap else
               "no host read and no known set width (a rule replayed while compiling)")
        return PlanChoice("union-fixed", bounds=(), logits=fixed, other=rows_logits or None, reason=why, **base)
    if overlap is None and offsets.device.type == "cuda":
        # measuring the unions costs a host sync per chunk (the H200 window's eager per-row row took 45.1 ms at W1,
        # 22.0 without host reads), and there union tiles never won: 0.68-3.5x the full head's time against the
        # per-row plan's 0.17-1.11x
        return rows(None, "on CUDA the per-row plan unless the set says its rows overlap (docs/kept-set-costs.md)")
    bounds = host_bounds(ids, offsets, tile_elems, cap)
    off = offsets.tolist()
    union = sum((c1 - c0) * torch.unique(ids[off[c0]:off[c1]]).numel() for c0, c1 in zip(bounds[:-1], bounds[1:]))
    if overlap is None and union > UNION_ADVANTAGE * rows_logits:
        return rows(union, f"measured: the union tiles would compute {union / max(1, rows_logits):.2f}x its logits")
    why = ("the set says its rows overlap (KeptSet.overlap=True)" if overlap else
           f"measured: neighbouring rows share ids, the union tiles compute {union / max(1, rows_logits):.2f}x the "
           "per-row plan's logits")
    return PlanChoice("union-host", bounds=tuple(bounds), logits=union, other=rows_logits, reason=why, **base)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (no host read possible)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass
class RowBucket:
    """Rows of the per-row plan whose sets pad to one width: a ``[count, width]`` batched product."""

    rows: torch.Tensor | None  # [count] token rows (None: every row, in order)
    base: int  # its first slot in the plan's flat tile
    count: int
    width: int
    singleton: bool = False  # rows of one id each: log-prob and entropy 0, zero gradient (no backward product)
    ids: torch.Tensor | None = None  # [count, width] kept ids, -1 after a row's last

    def take(self, x: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [count, ...]
        return x if self.rows is None else x.index_select(0, self.rows)


class KeptPlan:
    """How the engine computes one kept set's entries: the units of a union plan covering every entry once, or the
    per-row plan's padded ids; and each entry's row.

    ``bounds``: the host plan's chunk boundaries (``host_bounds``), or None for the fixed plan (no host read);
    ``width`` > 0: the per-row plan of that width instead (``bounds`` unused). ``computed`` counts the logits the
    engine computed with this plan (``entry_logits`` adds each GEMM's ``rows x ids``), ``computed_backward`` the
    gradient products' (``entry_backward``: the per-row plan skips its singleton rows there)."""

    def __init__(self, ids: torch.Tensor, offsets: torch.Tensor, V: int, bounds: list[int] | None,
                 tile_elems: int, cap: int, width: int = 0, backend: str = "torch"):
        self.N = offsets.numel() - 1
        self.nnz = ids.numel()
        self.ids, self.offsets = ids, offsets
        self.sizes = offsets[1:] - offsets[:-1]  # [N]
        self.tile_elems, self.backend, self.width = tile_elems, backend, width
        self.computed = self.computed_backward = 0
        dev = ids.device
        # the row of each entry, without a host read (output_size is the known nnz)
        self.row = torch.repeat_interleave(torch.arange(self.N, device=dev), self.sizes, output_size=self.nnz)
        self.fixed = bounds is None
        if width:
            self.units = []
            self._rows_layout()
        else:
            self.units = self._fixed_units(V, tile_elems, cap) if self.fixed else self._host_units(bounds)

    @classmethod
    def from_arg(cls, ids: torch.Tensor, offsets: torch.Tensor, V: int, plan: list[int], tile_elems: int, cap: int,
                 backend: str = "torch") -> "KeptPlan":
        """The plan an op argument names (``decode``)."""
        bounds, width = decode(plan)
        return cls(ids, offsets, V, bounds, tile_elems, cap, width=width, backend=backend)

    @property
    def logits(self) -> int:
        """The logits one pass of this plan computes (the per-row plan's buckets; the units' tiles)."""
        if self.width:
            return self.tile
        return sum(u.n_rows * u.n_cols for u in self.units)

    # ------------------------------------------------------------------------------------------- per-row plan

    def _rows_layout(self) -> None:
        """The per-row plan's buckets (``RowBucket``) and ``pos`` [nnz]: each entry's place in the flat tile of all
        buckets (``tile`` logits), or ``tile`` (a scratch slot, read as NaN) for an entry past the plan's width (a set
        wider than its KeptSet said: its token's results are NaN, never silently short).

        Rows are bucketed by set size (``bucket_width``: one host read of the bucket counts, which the op may do as
        it runs eagerly, under ``torch.compile`` too); under CUDA graph capture, where no host read is possible, one
        bucket of every row at the plan's width (``N x K_max`` logits)."""
        N, W, dev = self.N, self.width, self.ids.device
        col = torch.arange(self.nnz, device=dev) - self.offsets[:-1][self.row]
        capturing = _capturing(dev)
        if capturing:  # no host read: every row at the width
            key = width = torch.full((N,), W, dtype=torch.int64, device=dev)
            keys, counts = [W], [N]
        else:
            width = bucket_width(self.sizes, W)
            # singleton rows: a bucket of their own (width 1), skipped by the backward (their gradient is zero)
            key = torch.where(self.sizes == 1, 0, torch.where(self.sizes == 0, -1, width))
            keys, counts = (x.tolist() for x in torch.unique(key, return_counts=True))  # the host read
        order = torch.argsort(key, stable=True)  # rows grouped by bucket, in row order within one
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(N, device=dev))
        start = torch.zeros(N, dtype=torch.int64, device=dev)  # each row's first slot in the flat tile
        self.buckets, base, first = [], 0, 0
        for k, c in zip(keys, counts):
            if k >= 0:
                w = max(k, 1)
                sel = key == k
                start = torch.where(sel, base + (rank - first) * w, start)
                rows = None if c == N else order[first : first + c]
                self.buckets.append(RowBucket(rows, base, c, w, singleton=k == 0 and not capturing))
                base += c * w
            first += c
        self.tile = base
        self.pos = torch.where(col < width[self.row], start[self.row] + col, base)
        flat = torch.full((base + 1,), -1, dtype=torch.int64, device=dev)
        flat[self.pos] = self.ids
        for bk in self.buckets:
            bk.ids = flat[bk.base : bk.base + bk.count * bk.width].view(bk.count, bk.width)

    # -------------------------------------------------------------------------------------------- host plan

    def _host_units(self, bounds: list[int]) -> list[Unit]:
        if not bounds or self.nnz == 0:
            return []
        off = self.offsets.tolist()
        units = []
        for c0, c1 in zip(bounds[:-1], bounds[1:]):
            lo, hi = off[c0], off[c1]
            if hi == lo:
                continue
            U, col = torch.unique(self.ids[lo:hi], sorted=True, return_inverse=True)
            flat = (self.row[lo:hi] - c0) * U.numel() + col
            units.append(Unit(slice(c0, c1), U, slice(lo, hi), flat, c1 - c0))
        return units

    # ------------------------------------------------------------------------------------------- fixed plan

    def _fixed_units(self, V: int, tile_elems: int, cap: int) -> list[Unit]:
        N, nnz = self.N, self.nnz
        R, C, E, S = fixed_shape(N, nnz, V, tile_elems, cap)
        if S == 0:
            return []
        dev = self.ids.device
        chunk = self.row // R
        # entries sorted by (chunk, id): a chunk's entries keep their CSR range, its union comes out sorted
        key, perm = torch.sort(chunk * V + self.ids, stable=True)
        chunk_p, row_p, ids_p = chunk[perm], self.row[perm], self.ids[perm]
        first = torch.ones(nnz, dtype=torch.bool, device=dev)
        first[1:] = key[1:] != key[:-1]  # the first entry of each distinct (chunk, id)
        g = torch.cumsum(first, 0) - 1  # the rank of the entry's (chunk, id) among all distinct pairs
        n_chunks = -(-N // R)
        # column of each entry within its chunk's union, and its rank among the chunk's entries
        distinct = torch.zeros(n_chunks, dtype=torch.int64, device=dev).index_add_(0, chunk_p, first.long())
        col = g - (torch.cumsum(distinct, 0) - distinct)[chunk_p]
        chunk_start = self.offsets[(torch.arange(n_chunks, device=dev) * R).clamp_(max=N)]
        rank = torch.arange(nnz, device=dev) - chunk_start[chunk_p]
        # a new unit at each chunk, every C ids of its union and every E of its entries
        new = torch.ones(nnz, dtype=torch.bool, device=dev)
        new[1:] = ((chunk_p[1:] != chunk_p[:-1]) | (col[1:] // C != col[:-1] // C)
                   | (rank[1:] // E != rank[:-1] // E))
        unit = torch.cumsum(new, 0) - 1  # non-decreasing, < S (fixed_shape's bound)
        first_col = torch.zeros(S, dtype=torch.int64, device=dev).scatter_(0, unit[new], col[new])
        slot = col - first_col[unit]  # < C: a unit never crosses a block of C ids
        unit_chunk = torch.zeros(S, dtype=torch.int64, device=dev).scatter_(0, unit[new], chunk_p[new])
        unit_cols = torch.zeros(S * C, dtype=torch.int64, device=dev)
        unit_cols.scatter_(0, unit * C + slot, ids_p)  # (duplicates write one value)
        unit_cols = unit_cols.view(S, C)
        s_ar = torch.arange(S, device=dev)
        start = torch.searchsorted(unit, s_ar)
        end = torch.searchsorted(unit, s_ar, right=True)
        flat_p = (row_p - chunk_p * R) * C + slot
        rows = (unit_chunk[:, None] * R + torch.arange(R, device=dev)).clamp_(max=N - 1)  # [S, R]
        e_ar = torch.arange(E, device=dev)
        units = []
        for s in range(S):
            pos = start[s] + e_ar
            valid = pos < end[s]
            pos = pos.clamp_(max=nnz - 1)
            entries = torch.where(valid, perm[pos], nnz)
            flat = torch.where(valid, flat_p[pos], R * C)
            units.append(Unit(rows[s], unit_cols[s], entries, flat, R))
        return units
