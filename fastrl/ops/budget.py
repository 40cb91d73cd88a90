"""How large a path's float32 tiles may be: one table, one function (``tile_budget``), the arithmetic behind each row.

Every fastrl path that walks the logits does it in float32 tiles ``[rows, cols]`` (token rows x vocabulary columns
or kept ids), never ``[N, V]``. A tile's size trades three things, and they weigh differently on each path:

* **memory**: the path's extra memory is about ``live`` tiles (the buffers of that size alive at once: the logits,
  a ``exp`` of them, the sort's values and ids, both heads' tiles ...), ``TileBudget.nbytes``;
* **fixed cost per tile**: what a path pays once per chunk whatever its width. Path A's backward adds each
  vocabulary slice's ``G @ W[slice]`` into a float32 ``[N, H]`` accumulator (``8 N H`` bytes read and written per
  ``2 N cols H`` FLOPs: ``cols / 4`` FLOP per byte); the one-pass loss reads and writes the float32 ``[V, H]``
  weight-gradient accumulator once per token chunk (``8 V H`` bytes per ``2 rows V H`` FLOPs: ``rows / 4`` FLOP per
  byte). Past the device's balance (~10-30 FLOP/B for a CPU core's caches and DRAM, ~300 for an H100's HBM) the
  GEMMs are compute-bound and a wider tile buys nothing;
* **GEMM width and cache**: a GPU's tensor cores want GEMMs thousands wide (cuBLAS is at full speed from about
  4096 x 4096 tiles), so GPU tiles are 128 MB-1 GB; a CPU's GEMMs are at full speed from a few hundred columns, and
  its elementwise passes (exp, the online statistics, G) run from cache when the tiles alive fit in L2/L3, so CPU
  tiles are 4-32 MB.

The rows, by path (``path`` argument of ``tile_budget``; "cpu" is every device that is not CUDA):

========================  ======  ======  ====  ==========================================================
path                      device  tile    live  why
========================  ======  ======  ====  ==========================================================
``logprob``               any     16 MB   2     torch backend, path A and C (``torch_backend``; also the
                                                one-pass chunk's vocabulary blocks): the logits tile and its
                                                ``exp`` (a third, dz/dy, with softcap). At C1 (N=4096) that is
                                                1024 columns: 256 FLOP/B on grad_h's accumulator, far past a
                                                CPU's balance; 32 MB extra besides the O(N) statistics.
``hybrid``                any     256 MB  1     Triton backends (``hybrid``): the fold / G kernels write
                                                over the GEMM's own float32 tile. 4096 tokens x 16384
                                                columns for the statistics, 16384 x 4096 in the backward
                                                (``hybrid.MAX_ROWS``: 1024 FLOP/B on grad_h).
``divergence-hybrid``     any     128 MB  2     the same budget shared by both heads' tiles.
``kept``                  cpu     16 MB   2     the kept-set engine (``kept``): a union unit's ``[rows,
                          cuda    256 MB        |U|]`` logits tile and its G in the backward (``cap``
                                                bounds a unit's ids: at most ``max(cap, K)`` logits per
                                                token on the host plan); the per-row plan's gathered
                                                ``[rows, K, H]`` weight rows (one buffer) and the weight
                                                gradient's ``[rows, K, H]`` products.
``rule``                  cpu     16 MB   4     ``replay_rule``: a rule without top_k takes whole rows,
                          cuda    128 MB        ``[chunk, V]``: the logits tile, then a sort's values (one
                                                more) and int64 ids (two more). A rule with top_k walks
                                                vocabulary blocks of many rows with a running top-(k+1) per
                                                row: one tile (its GEMMs as wide as path A's), then whole
                                                rows of top_k's survivors for top_p. ``rows``, when set:
                                                tokens per chunk.
``one-pass``              cpu     32 MB   1     one-pass loss with a trained head: the ``[chunk, V]`` tile;
                          cuda    1 GiB         the float32 [V, H] accumulator is read and written once per
                                                chunk, so GPU chunks are long (1766 tokens at V=151936:
                                                440 FLOP/B); a CPU keeps 32 MB (as fast as 64 MB at C1).
``one-pass-frozen``       cpu     32 MB   1     the same with a frozen head: no accumulator, so no reason
                          cuda    256 MB        for long chunks on a GPU.
``exact-kl``              cpu     1 MB    3     the blocks the one-pass chunk's exact KL walks over its two
                          cuda    256 MB        tiles (the policy's and the reference's; ``losses.exact_kl``):
                                                a block of each and one temporary. On a CPU a 1 MB block stays
                                                in a core's L2 across the statistics and G passes (exp,
                                                differences, products): the exact-KL loss took 1.15-1.23x the
                                                k3 loss's time with 1 MB blocks, 1.40-1.47x with the 16 MB of
                                                ``logprob`` (B=8 x 256, H=512, V=32768, interleaved, a loaded
                                                2-core machine). On CUDA fewer, larger launches.
``sm90-one-pass``         cuda    1/16 of       the one-pass loss on ``triton-sm90`` (``one_pass_rows``): the
                                  the device's  ``[chunk, V]`` tile of scaled exps in the input dtype (2 bytes
                                  total memory  at bf16). The float32 [V, H] weight-gradient accumulator is
                                                read and written once per chunk (8 V H bytes: 5 GB at
                                                V=151936, H=4096, 10 times at W1 with the ``one-pass`` row's
                                                1664 rows: 50 GB). So: (1) every token in one chunk when its
                                                tile fits 1/16 of the device: no accumulator at all, grad_W
                                                is one GEMM written once, and the memory is the tile's alone
                                                (80 GiB / 16 = 5 GiB: up to 17667 tokens at V=151936, so W1
                                                and W2, N=16384, in one chunk of 4.98 GB, against 0.5 GB of
                                                tile + 2.5 GB of accumulator at W1 before; 141 GiB: up to
                                                31139 tokens); (2) else a tile as large as the accumulator it
                                                amortises, 4 V H bytes (2 H rows in bf16: the accumulator's
                                                passes cost ~1.3 x 163 / (2 H) of the GEMMs' time at 700
                                                TFLOP/s and 4.3 TB/s: 2.6% at H=4096), within [the
                                                ``one-pass`` row's rows, the 1/16 share]: N=65536 at H=4096
                                                in 8 chunks of 8192 (5 GB with the accumulator), W4's 131072
                                                tokens at H=896 in 74 of 1792 (as before: 0.5 GB + 0.5 GB).
                                                Memory unknown (not CUDA): the ``one-pass`` row.
``sm90-grad``             cuda    1/128 of      path A's backward on ``triton-sm90`` (``grad_columns``): the
                                  the device's  ``[rows, cols]`` G slice in the input dtype; grad_h's float32
                                  total memory  [N, H] accumulator is read and written once per vocabulary
                                                slice (8 N H bytes: 537 MB at N=16384, H=4096), 38 times at
                                                the ``hybrid`` row's 4096 columns. 80 GiB / 128 = 640 MiB =
                                                20480 columns of 16384 bf16 rows: 8 slices at V=151936; 141
                                                GiB / 128: 36096 columns, 5 slices. Memory unknown: the
                                                ``hybrid`` row.
========================  ======  ======  ====  ==========================================================

Tests shrink a path's tiles by replacing its row: ``monkeypatch.setitem(budget.BUDGETS, "logprob", TileBudget(...))``.

**The memory ceiling.** The rows above are each path's *speed* choice. On a GPU each is capped by one number, the
memory budget of the work (``memory_budget``): by default the ``ceiling``, what the implementation fastrl replaces
holds on the same work (TRL 1.16's chunked log-prob, ``GRPOTrainer``'s default LM head: one ``[4096, 32768]`` tile
in the input dtype, plus its float32 ``[V, H]`` weight-gradient and ``[N, H]`` hidden-gradient accumulators when
those gradients are needed; on an H200 it held 2887, 831.5 and 256.5 MiB at W1-lp, W2-lp and W3, the formula
2886, 831 and 256). So a default never holds more memory than what it replaces. A user who has memory to spare
raises the budget, one knob for every path: ``fastrl.set_memory_budget(0.0625)`` (a fraction of the device's total
memory), ``fastrl.set_memory_budget(8 << 30)`` (bytes), or ``FASTRL_MEMORY_BUDGET`` (``0.0625``, ``8GiB``,
``512MiB``) before fastrl is imported; then each path takes its speed choice up to that budget (``1/16`` restores the
``sm90-one-pass`` row's share). A budget below what a path needs for its smallest tile gives that smallest tile (one
128-row block of the one-pass tile, one 256-column slice of path A's ``G``), or, for the one-pass loss, path A
instead (``one_pass.chunk_budget`` returns 0). On a CPU the rows above are cache-sized (32 MB at most) and only an
explicit budget in bytes caps them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

__all__ = ["TileBudget", "BUDGETS", "MEMORY_SHARES", "tile_budget", "tile_columns", "device_memory", "one_pass_rows",
           "grad_columns", "ceiling", "memory_budget", "set_memory_budget", "get_memory_budget", "parse_budget",
           "one_pass_bytes", "O_N_BYTES"]

_FLOAT32 = 4  # bytes


@dataclass(frozen=True)
class TileBudget:
    """One path's tile budget on one kind of device."""

    elems: int  # float32 elements of one [rows, cols] tile
    live: int  # tiles of that size the path holds at once
    cap: int | None = None  # kept-set paths: the most vocabulary ids in one chunk's union
    rows: int | None = None  # token rows per chunk where the path fixes them

    @property
    def nbytes(self) -> int:
        """The path's tile memory: ``live`` float32 tiles of ``elems`` elements."""
        return _FLOAT32 * self.elems * self.live


_MB = (1 << 20) // _FLOAT32  # float32 elements per MiB

# path -> one budget for every device, or {"cpu": ..., "cuda": ...}; the module docstring says why each is what it is
BUDGETS: dict[str, TileBudget | dict[str, TileBudget]] = {
    "logprob": TileBudget(elems=16 * _MB, live=2),
    "hybrid": TileBudget(elems=256 * _MB, live=1),
    "divergence-hybrid": TileBudget(elems=128 * _MB, live=2),
    "kept": {"cpu": TileBudget(elems=16 * _MB, live=2, cap=2048),
             "cuda": TileBudget(elems=256 * _MB, live=2, cap=8192)},
    "rule": {"cpu": TileBudget(elems=16 * _MB, live=4), "cuda": TileBudget(elems=128 * _MB, live=4)},
    "one-pass": {"cpu": TileBudget(elems=32 * _MB, live=1), "cuda": TileBudget(elems=1024 * _MB, live=1)},
    "one-pass-frozen": {"cpu": TileBudget(elems=32 * _MB, live=1), "cuda": TileBudget(elems=256 * _MB, live=1)},
    "exact-kl": {"cpu": TileBudget(elems=1 * _MB, live=3), "cuda": TileBudget(elems=256 * _MB, live=3)},
}


def tile_budget(path: str, device: torch.device | str | None = None) -> TileBudget:
    """The tile budget of ``path`` (a key of ``BUDGETS``) on ``device`` (CUDA, or anything else: the CPU row)."""
    try:
        entry = BUDGETS[path]
    except KeyError:
        raise ValueError(f"path must be one of {sorted(BUDGETS)}, got {path!r}") from None
    if isinstance(entry, TileBudget):
        return entry
    kind = torch.device(device).type if device is not None else "cpu"
    return entry["cuda" if kind == "cuda" else "cpu"]


def tile_columns(n_rows: int, vocab: int, requested: int | None = None, multiple: int = 128,
                 tile_elems: int | None = None) -> int:
    """Vocabulary columns per tile: the requested number, else the largest multiple of ``multiple`` that keeps an
    ``n_rows``-row tile within ``tile_elems`` (default: the ``logprob`` budget), at least ``multiple``."""
    if requested is not None:
        return max(1, min(int(requested), vocab))
    if tile_elems is None:
        tile_elems = tile_budget("logprob").elems
    cols = max(multiple, (tile_elems // max(n_rows, 1)) // multiple * multiple)
    return min(cols, vocab)


# path -> the divisor of the device's total memory its tile may take (the rows of the table that scale with the
# device). Total memory, not free memory: the chunk count is a function of the device, not of what else is allocated
# at the moment, so a run is reproducible.
MEMORY_SHARES = {"sm90-one-pass": 16, "sm90-grad": 128}


def device_memory(device: torch.device | str | None) -> int | None:
    """The total memory of a CUDA ``device`` in bytes, None when unknown (any other device, no CUDA). A constant to
    torch.compile (the chunk plan reads it inside compiled functions)."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    except (RuntimeError, AssertionError):  # pragma: no cover - a device index that does not exist
        return None


# what torch.compiler.assume_constant_result sets, without its import of torch._dynamo (as kernels.tuning does)
device_memory._dynamo_marked_constant = True


def one_pass_rows(V: int, H: int, tokens: int, dtype: torch.dtype, device: torch.device | str | None = None,
                  total_memory: int | None = None, row_bytes: int | None = None) -> int:
    """Tokens per chunk of the one-pass loss on ``triton-sm90`` with a trained head, for ``tokens`` tokens (the
    ``sm90-one-pass`` row, the speed choice before the memory budget caps it): all of them when their ``[tokens, V]``
    scaled exps in ``dtype`` fit 1/16 of ``total_memory`` (default: the device's); else whole 128-row blocks of a tile
    as large as the float32 ``[V, H]`` accumulator, no fewer rows than the ``one-pass`` row's and no more than the
    share holds. Memory unknown (not CUDA): the ``one-pass`` row's rows (a 1 GiB float32 tile: 1664 rows at
    V=151936). ``row_bytes``: another backend's bytes per tile row (the hybrid's float32 logits, ``4 V``)."""
    default = max(128, tile_budget("one-pass", "cuda").elems // V // 128 * 128)
    if total_memory is None:
        total_memory = device_memory(device)
    if total_memory is None:
        return default
    row_bytes = row_bytes or _exp_row_bytes(V, dtype)
    share_rows = total_memory // MEMORY_SHARES["sm90-one-pass"] // row_bytes
    if tokens <= share_rows:
        return max(tokens, 1)  # one chunk: no accumulator
    acc_rows = _FLOAT32 * V * H // row_bytes
    return max(128, min(share_rows, max(default, acc_rows)) // 128 * 128)


def _exp_row_bytes(V: int, dtype: torch.dtype) -> int:
    """Bytes of one row of the sm90 scaled-exp tile: ``V`` values in ``dtype``, rows padded to 16 bytes (ExpTile)."""
    item = dtype.itemsize
    return -(-V * item // 16) * 16


def grad_columns(rows: int, V: int, dtype: torch.dtype, device: torch.device | str | None = None,
                 total_memory: int | None = None, multiple: int = 256, budget: int | None = None, H: int = 0,
                 need_hidden: bool = True) -> int:
    """Vocabulary columns per slice of path A's backward on ``triton-sm90`` (the ``sm90-grad`` row): the largest
    multiple of ``multiple`` whose ``[rows, cols]`` G in ``dtype`` fits 1/128 of ``total_memory`` (default: the
    device's), at most V; memory unknown, the ``hybrid`` row's columns. ``budget`` (bytes, ``memory_budget``) caps
    the slice besides the float32 ``[rows, H]`` hidden-gradient accumulator it sits next to (``need_hidden``); at
    least ``multiple`` columns."""
    if total_memory is None:
        total_memory = device_memory(device)
    if total_memory is None:
        elems = tile_budget("hybrid").elems
    else:
        elems = total_memory // MEMORY_SHARES["sm90-grad"] // dtype.itemsize
    if budget is not None:
        room = budget - (_FLOAT32 * rows * H if need_hidden else 0) - O_N_BYTES * rows
        elems = min(elems, max(room, 0) // dtype.itemsize)
    return tile_columns(rows, V, multiple=multiple, tile_elems=elems)


# ---------------------------------------------------------------------------------------------------------
# the memory ceiling and the user's budget
# ---------------------------------------------------------------------------------------------------------

REPLACED_TILE = (4096, 32768)  # TRL 1.16's chunked log-prob: tokens x vocabulary ids per tile, in the input dtype
O_N_BYTES = 64 * _FLOAT32  # per token: the O(N) vectors a path keeps (statistics, masks, per-row scalars)
COMPENSATED_SLICE_BYTES = 32 << 20  # the float32 [rows, H] product slice of the compensated weight-gradient sum


def ceiling(N: int, V: int, H: int, dtype: torch.dtype, need_weight: bool = False, need_hidden: bool = False) -> int:
    """Bytes that the implementation fastrl replaces holds on this work (TRL 1.16's ``ChunkedLogProbFunction``,
    ``GRPOTrainer``'s default LM head): its ``[min(N, 4096), min(V, 32768)]`` tile in ``dtype``, plus its float32
    ``[V, H]`` weight-gradient accumulator when the weight trains and its float32 ``[N, H]`` hidden-gradient buffer
    when the hidden states do. A default path never holds more (``memory_budget``)."""
    tile = min(N, REPLACED_TILE[0]) * min(V, REPLACED_TILE[1]) * dtype.itemsize
    return tile + (_FLOAT32 * V * H if need_weight else 0) + (_FLOAT32 * N * H if need_hidden else 0)


_ENV = "FASTRL_MEMORY_BUDGET"
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_budget(value, name: str = "memory budget") -> int | float | None:
    """A memory budget as ``set_memory_budget`` takes it: None (or "auto"): the ceiling; a float in (0, 1]: that
    fraction of the device's total memory; an int: bytes (at least 1 MiB); a string of either ("0.0625", "8GiB",
    "512MiB", "3000000000")."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto", "none")):
        return None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{name} must be a fraction of device memory in (0, 1] (e.g. 0.0625), bytes (e.g. "
                             f"8589934592) or bytes with a unit (e.g. 8GiB, 512MiB), or 'auto'; got {value!r}")
        number = float(m.group(1))
        value = number if (unit == "" and ("." in m.group(1) or "e" in m.group(1).lower())) else int(
            number * _UNITS[unit])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be None, a float fraction in (0, 1], an int of bytes or a string, "
                        f"got {type(value).__name__}")
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{name} as a fraction of device memory must be in (0, 1], got {value!r} (bytes are an "
                             f"int, e.g. {int(value)} or '{value:g}B')")
        return value
    if value < (1 << 20):
        raise ValueError(f"{name} in bytes must be at least 1 MiB (1048576), got {value!r} (a fraction of device "
                         f"memory is a float, e.g. 0.0625)")
    return int(value)


_USER: int | float | None = parse_budget(os.environ.get(_ENV), name=_ENV)


def set_memory_budget(value) -> int | float | None:
    """Set the memory budget every fastrl path sizes its tiles by (``fastrl.set_memory_budget``) and return the
    previous one. None (the default): each path holds at most what the implementation it replaces holds on the same
    work (``ceiling``); a float in (0, 1]: that fraction of the device's total memory; an int: bytes. Raising it buys
    speed with memory (longer one-pass chunks, wider slices); lowering it below a path's smallest tile gives that
    tile (the one-pass loss switches to path A). On a CPU only a budget in bytes applies (its tiles are cache-sized)."""
    global _USER
    previous, _USER = _USER, parse_budget(value)
    return previous


def get_memory_budget() -> int | float | None:
    """The memory budget set by ``set_memory_budget`` or ``FASTRL_MEMORY_BUDGET`` (None: the ceiling)."""
    return _USER


def memory_budget(N: int, V: int, H: int, dtype: torch.dtype, device: torch.device | str | None = None,
                  need_weight: bool = False, need_hidden: bool = False, total_memory: int | None = None) -> int | None:
    """Bytes a path may hold on this work: the user's budget (bytes, or its fraction of the device's memory) if set,
    else the ``ceiling``. None on a device whose tiles the budget does not size (a CPU without a budget in bytes, a
    fraction where the device's memory is unknown)."""
    user = _USER
    cuda = device is not None and torch.device(device).type == "cuda"
    if isinstance(user, int):
        return user
    if isinstance(user, float):
        total = total_memory if total_memory is not None else device_memory(device)
        return int(user * total) if total is not None else (ceiling(N, V, H, dtype, need_weight, need_hidden)
                                                             if cuda or total_memory is not None else None)
    return ceiling(N, V, H, dtype, need_weight, need_hidden) if cuda or total_memory is not None else None


def one_pass_bytes(rows: int, tokens: int, V: int, H: int, dtype: torch.dtype, backend: str, trained_head: bool,
                   with_ref: bool = False) -> int:
    """Planned extra bytes of the one-pass engine (``fastrl.ops.one_pass``) on ``tokens`` tokens in chunks of
    ``rows``: the chunk tile (float32 logits, or ``triton-sm90``'s scaled exps in ``dtype``; the reference's too with
    the exact KL inside); the weight-gradient accumulator when there is more than one chunk (bf16: the compensated
    sum's low half and two product slices; fp16: float32; float32 / float64 weights accumulate in the gradient
    itself); a chunk's float32 hidden-gradient rows; the torch backend's block temporaries (two blocks of the
    ``logprob`` row, and float32 copies of a 2-byte weight's block); O(N) vectors. The gradients are outputs."""
    acc_item = 8 if dtype == torch.float64 else _FLOAT32
    row = _exp_row_bytes(V, dtype) if backend == "triton-sm90" else V * acc_item
    tile = rows * row * (2 if with_ref else 1)
    acc = 0  # float32 / float64 weights accumulate in the gradient itself
    if trained_head and rows < tokens and dtype == torch.bfloat16:  # the compensated sum's low half and slices
        acc = V * H * dtype.itemsize + 2 * min(COMPENSATED_SLICE_BYTES, _FLOAT32 * V * H)
    elif trained_head and rows < tokens and dtype == torch.float16:  # a float32 accumulator
        acc = _FLOAT32 * V * H
    temps = 0
    if backend == "torch" and rows:
        block = min(rows * V, tile_columns(rows, V) * rows)  # the vocabulary blocks the chunk is walked in
        temps = 2 * block * acc_item + (block // rows * H * acc_item if dtype.itemsize < acc_item else 0)
    return tile + acc + temps + acc_item * rows * H + O_N_BYTES * tokens


def fit_one_pass_rows(speed_rows: int, budget: int | None, tokens: int, V: int, H: int, dtype: torch.dtype,
                      backend: str, trained_head: bool, with_ref: bool = False, multiple: int = 128) -> int:
    """Rows per one-pass chunk within ``budget`` bytes (``one_pass_bytes``): every token in one chunk when the speed
    rule allows it and it fits (no accumulator), else the most rows of the speed rule's that fit beside the
    accumulator, in whole ``multiple``-row blocks; 0 when not even one block fits (then the loss takes path A)."""
    if budget is None:
        return speed_rows
    tokens = max(tokens, 1)

    def fits(r: int) -> bool:
        return one_pass_bytes(r, tokens, V, H, dtype, backend, trained_head, with_ref) <= budget

    if speed_rows >= tokens and fits(tokens):
        return tokens
    lo, hi = 0, min(speed_rows, tokens - 1) // multiple  # blocks: fits(lo * multiple) holds or lo == 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * multiple) else (lo, mid - 1)
    return lo * multiple


def kept_capacity(device: torch.device | str | None, tile_elems: int = 0, cap: int = 0) -> tuple[int, int]:
    """(tile_elems, cap) of the kept-set engine on ``device``, the one capacity rule: the values given (an op's
    options), 0 meaning the ``kept`` tile budget: the ``[rows, |U|]`` float32 tile of a union unit (the per-row plan's
    gathered ``[rows, K, H]`` block), and the most ids a union unit may hold."""
    b = tile_budget("kept", device)
    return tile_elems or b.elems, cap or b.cap
