"""The one-pass engine (path B, 6NHV FLOPs): chunks of rows whose logits are computed once, with the loss gradient
formed in the forward.

Each chunk of tokens has its logits computed once (float32 logits, or the ``triton-sm90`` scaled exps, with the row
statistics), the per-row gradients of the loss w.r.t. log-prob, entropy (and exact KL) are asked of the caller, and
``G = dL/dy`` and the three gradient GEMMs follow at once. The engine knows no loss: the custom op
``fastrl::policy_loss_one_pass`` (``fastrl.losses.one_pass``) hands it the loss as a ``ChunkLoss`` (two functions
over the ``[N]`` buffers of log-probs, entropies and KLs in which rows not yet computed hold placeholders). For a
token- (or sequence-) separable loss the gradient of the rows just computed does not depend on those placeholders.

With the exact KL inside the chunks (``ref``: the torch backend) the reference's tile is computed next to the
policy's and the KL per row from the pair (``tile_stats_kl``), its gradient added to ``G`` (``tile_grad_kl_``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fastrl.ops import torch_backend as TB
from fastrl.ops._checks import compact_rows
from fastrl.ops._gemm import addmm_f32, compensated_addmm_
from fastrl.ops.backend import is_triton
from fastrl.ops.budget import fit_one_pass_rows, memory_budget, one_pass_rows, tile_budget
from fastrl.ops.config import LogitTransform
from fastrl.ops.live import LiveRows

__all__ = ["IGNORE", "ChunkLoss", "Chunk", "chunk_budget", "live_chunks", "plan_chunks", "nosync_chunks",
           "fixed_chunks", "run", "tile_stats_kl", "tile_grad_kl_"]

IGNORE = -100  # the target id of a row outside the mask (the ops' ignore_index)
EXACT_KL_COLUMNS = 1024  # vocabulary columns per block of the exact KL's passes over a chunk's tiles (_block_columns)


def chunk_budget(V: int, device: torch.device, trained_head: bool, requested: int | None, backend: str = "torch",
                 dtype: torch.dtype = torch.float32, tokens: int | None = None, H: int = 0, N: int | None = None,
                 need_hidden: bool = True, with_ref: bool = False) -> int:
    """Rows per one-pass chunk (of ``tokens`` rows with hidden size ``H``, of ``N`` rows in all): the requested
    number, else the speed choice of the device's tile rows (``fastrl.ops.budget``) cut to the memory budget
    (``budget.fit_one_pass_rows``: by default what TRL's chunked log-prob holds on the same work); 0 when not one
    block of rows fits beside the weight-gradient accumulator (then the loss takes path A)."""
    if requested:
        return requested
    sm90, cuda = backend == "triton-sm90", device.type == "cuda"
    if trained_head and cuda and tokens is not None:
        # the chunk tile sized by the device's memory (budget's sm90-one-pass row; the hybrid's float32 logits the
        # same way): long chunks read and write the weight-gradient accumulator fewer times, one chunk never
        rows = one_pass_rows(V, H, tokens, dtype, device, row_bytes=None if sm90 else 4 * V)
    else:
        # a 256 MiB tile with a frozen head on a GPU, 32 MB on a CPU (fastrl.ops.budget); on a GPU, whole 128-row
        # blocks keep the GEMMs on full tiles; a CPU keeps its small tile (memory first)
        rows = tile_budget("one-pass" if trained_head else "one-pass-frozen", device).elems // V
        rows = max(128, rows // 128 * 128) if cuda else max(1, rows)
    if tokens is None:
        return rows
    cap = memory_budget(max(N or tokens, tokens), V, H, dtype, device, trained_head, need_hidden)
    return fit_one_pass_rows(rows, cap, tokens, V, H, dtype, backend, trained_head, with_ref, 128 if cuda else 1)


def live_chunks(
    live: torch.Tensor,  # [B, T] bool: tokens that are scored (in the mask)
    granularity: str,
    V: int,
    device: torch.device,
    trained_head: bool,
    requested: int | None,
    backend: str = "torch",
    dtype: torch.dtype = torch.float32,
    H: int = 0,
    mem: tuple[bool, bool] = (True, False),  # (hidden-state gradient needed, exact KL's reference tile inside)
) -> list[tuple[int, int]] | None:
    """One-pass chunks as ranges of *live* rows (row-major order): whole sequences when the loss couples the
    tokens of a sequence; None when a sequence does not fit in one chunk, or no chunk fits the memory budget (then
    two passes it is)."""
    n_live = int(live.sum())  # one host sync: chunk boundaries are host-side ranges
    budget = chunk_budget(V, device, trained_head, requested, backend, dtype, n_live, H, live.numel(), *mem)
    if budget == 0:
        return None
    if granularity == "token":
        return [(c0, min(c0 + budget, n_live)) for c0 in range(0, n_live, budget)]
    per_seq = live.sum(1).tolist()
    if max(per_seq, default=0) > budget:
        return None
    return _whole_sequences(per_seq, budget)


def _whole_sequences(per_seq: list[int], budget: int) -> list[tuple[int, int]]:
    """Ranges of live rows holding as many whole sequences (``per_seq`` live rows each, none over ``budget``) as
    fit in ``budget`` rows."""
    out, start, size = [], 0, 0
    for n in per_seq:
        if size + n > budget:
            out.append((start, start + size))
            start, size = start + size, 0
        size += n
    if size:
        out.append((start, start + size))
    return out


def plan_chunks(live: torch.Tensor, granularity: str, V: int, trained_head: bool, requested: int | None,
                backend: str, dtype: torch.dtype, H: int, sync: bool,
                mem: tuple[bool, bool] = (True, False)) -> tuple[list[tuple[int, int]] | None, int]:
    """(the op's chunks, rows per chunk) for ``live`` [B, T] (the tokens in the mask): ranges of live rows (``sync``:
    host reads allowed), [] for fixed chunks over all rows (no-sync, from shapes alone), None when a sequence does
    not fit in one chunk or no chunk fits the memory budget (then two passes it is). ``mem``: (hidden-state
    gradient needed, the exact KL's reference tile inside the chunks), for the memory budget."""
    (B, T), device = live.shape, live.device
    rows = chunk_budget(V, device, trained_head, requested, backend, dtype, B * T, H, B * T, *mem)
    if rows == 0:
        return None, 0
    if sync:
        return live_chunks(live, granularity, V, device, trained_head, requested, backend, dtype, H, mem), rows
    return ([] if granularity == "token" or T <= rows else None), rows


def nosync_chunks(live: torch.Tensor, granularity: str, chunk_rows: int,
                  backend: str = "torch") -> tuple[list[tuple[int, int]], LiveRows]:
    """The no-sync op's chunks for ``live`` [B, T] (the tokens in the mask): ranges of live rows of ``chunk_rows``
    tokens (or of whole sequences) where the live count is read without a synchronisation (``fastrl.ops.live``), else
    ``fixed_chunks`` over every row (token chunks on ``triton-sm90``: of every row sorted live-first, the count on the
    device, so the forward kernel skips dead row blocks); with the ``LiveRows`` that ``run`` takes."""
    B, T = live.shape
    rows = LiveRows.of(live.reshape(-1))
    if rows.ids is None:
        if not rows.known and granularity == "token" and backend == "triton-sm90":
            rows = LiveRows.sorted(live.reshape(-1))
        return fixed_chunks(B, T, granularity, chunk_rows), rows
    n = rows.ids.shape[0]
    if granularity == "token":
        return [(c0, min(c0 + chunk_rows, n)) for c0 in range(0, n, chunk_rows)], rows
    # the plan checked that a whole row of T tokens fits in a chunk: so does each sequence's live part
    return _whole_sequences(live.sum(1).tolist(), chunk_rows), rows


def fixed_chunks(B: int, T: int, granularity: str, chunk_rows: int) -> list[tuple[int, int]]:
    """Row ranges over all B*T rows, chosen from shapes only (the no-sync path): ``chunk_rows`` tokens, or as many
    whole sequences as fit (the caller has checked that one does)."""
    N = B * T
    step = chunk_rows if granularity == "token" else max(1, chunk_rows // T) * T
    return [(c0, min(c0 + step, N)) for c0 in range(0, N, step)]


@dataclass
class Chunk:
    """One chunk of rows: its hidden states and targets, and where its rows live among the N rows."""

    c0: int
    c1: int
    rows: torch.Tensor | None  # the live rows' ids (compact, or every row sorted live-first), or None: rows c0:c1
    h: torch.Tensor  # [n, H]
    t: torch.Tensor  # [n]
    count: torch.Tensor | None = None  # [1] int32 on the device: rows [count, n) are dead (sorted last), skipped

    def take(self, x: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [n, ...]
        return x[self.c0 : self.c1] if self.rows is None else x.index_select(0, self.rows)

    def put_(self, dst: torch.Tensor, x: torch.Tensor) -> None:  # dst[rows] = x
        if self.rows is None:
            dst[self.c0 : self.c1] = x
        else:
            dst.index_copy_(0, self.rows, x.to(dst.dtype))


@dataclass(frozen=True)
class ChunkLoss:
    """The loss as the engine sees it (the caller's; the engine knows no loss).

    ``grads(chunk, logp [N], entropy [N], kl [N] | None)``: d loss / d (logp, entropy, KL) at the chunk's rows (each
    [n] or None), the rows not yet computed holding placeholders. ``final(logp, entropy, kl)``: (loss, metrics,
    d loss / d the caller's own per-token KL or None) once every row is computed. ``logp_init``: [N] the log-prob
    placeholders (ratio 1 against the old log-probs), None: zeros."""

    grads: Callable
    final: Callable
    logp_init: torch.Tensor | None = None


def _chunk(hidden, targets, idx, live, c0: int, c1: int, compact: bool, count: torch.Tensor | None = None) -> Chunk:
    rows = None if idx is None else idx[c0:c1]
    h = hidden[c0:c1] if rows is None else hidden.index_select(0, rows)
    if not compact:  # rows outside the mask: zeroed, so that whatever they hold cannot reach grad_W
        live_c = live[c0:c1] if rows is None else live.index_select(0, rows)
        h = torch.where(live_c[:, None], h, torch.zeros((), dtype=h.dtype, device=h.device))
    if count is not None:  # the chunk's own live count, on the device
        count = count if c0 == 0 else (count - c0).clamp_(min=0)
    return Chunk(c0, c1, rows, h, targets[c0:c1] if rows is None else targets.index_select(0, rows), count)


def run(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V] contiguous
    targets: torch.Tensor,  # [N], IGNORE where masked out
    tf: LogitTransform,
    backend: str,
    chunks: list[tuple[int, int]],  # ranges of live rows (compact), else of all rows
    need: tuple[bool, bool, bool],
    loss: ChunkLoss,
    compact: bool = True,  # False: no host sync; live_rows' rows alone, else every row (masked: zeroed, no gradient)
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,  # the exact KL's (hidden, W, b)
    live_rows: LiveRows | None = None,  # no-sync (compact False): the live rows nosync_chunks found, its chunks' rows
) -> tuple[torch.Tensor, dict, tuple, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, metrics, (grad_h, grad_w, grad_b), logp [N], entropy [N], d loss / d the caller's KL | None, the exact
    KL computed here [N] | None)."""
    assert ref is None or not is_triton(backend), "the exact KL inside the chunks runs on the torch backend's tiles"
    live = targets != IGNORE
    # live rows only: padding costs nothing and cannot poison grad_W (compact: found with a host sync in eager, or
    # by the no-sync op where the count is read without one); or every row, with the hidden states of rows outside
    # the mask zeroed so that whatever they hold cannot reach grad_W either
    if compact:
        idx = compact_rows(live)
    else:
        idx = None if live_rows is None else live_rows.ids
        compact = live_rows is not None and live_rows.known
    count = None if compact or live_rows is None else live_rows.count
    rows = _Rows(hidden, loss.logp_init, ref is not None)
    tiles = _Tiles(hidden, weight, bias, tf, backend, max((c1 - c0 for c0, c1 in chunks), default=0), ref)
    acc = _Grads(hidden, weight, bias, need, single=len(chunks) == 1, direct=weight.dtype == tiles.cdt or tiles.triton,
                 triton=tiles.triton)
    for c0, c1 in chunks:
        ck = _chunk(hidden, targets, idx, live, c0, c1, compact, count)
        ref_h = None if ref is None else _chunk(ref[0], targets, idx, live, c0, c1, compact).h
        st = tiles.stats(ck, ref_h)
        rows.put_(ck, st)
        g_lp, g_en, g_kl = loss.grads(ck, rows.logp, rows.ent, rows.kl)
        if g_lp is None and g_en is None and g_kl is None:
            continue
        G, h_mm = tiles.grad(ck, st, g_lp, g_en, g_kl)
        acc.add_(ck, G, h_mm)
    # the float32 logits tiles (1 GiB at W1) are dead: free them before grad_W's cast allocates its copy
    tiles.free()
    total, metrics, grad_kl = loss.final(rows.logp, rows.ent, rows.kl)
    return total, metrics, acc.result(), rows.logp, rows.ent, grad_kl, rows.kl


class _Rows:
    """The [N] buffers of log-probs, entropies (and exact KLs): placeholders until a chunk computes its rows (ratio 1
    against the old log-probs, zero entropy, zero KL)."""

    def __init__(self, hidden: torch.Tensor, logp_init: torch.Tensor | None, with_kl: bool):
        N, cdt, dev = hidden.shape[0], TB.acc_dtype(hidden.dtype), hidden.device
        self.logp = logp_init.detach().reshape(-1).to(cdt).clone() if logp_init is not None else torch.zeros(
            N, dtype=cdt, device=dev)
        self.ent = torch.zeros(N, dtype=cdt, device=dev)
        self.kl = torch.zeros(N, dtype=cdt, device=dev) if with_kl else None

    def put_(self, ck: Chunk, st: _Stats) -> None:
        logp, ent = st.zt - st.lse, st.ent
        if ck.count is not None:  # dead rows (skipped on the device) keep their placeholders, as in eager
            dead = torch.arange(logp.shape[0], device=logp.device, dtype=torch.int32) >= ck.count
            logp, ent = torch.where(dead, ck.take(self.logp), logp), torch.where(dead, ck.take(self.ent), ent)
        ck.put_(self.logp, logp)
        ck.put_(self.ent, ent)
        if st.kl is not None:
            ck.put_(self.kl, st.kl)


@dataclass
class _Stats:
    """One chunk's tiles and row statistics."""

    z: torch.Tensor | None  # [n, V] the policy's logits (None: the sm90 scaled-exp tile holds them)
    lse: torch.Tensor  # [n]
    zt: torch.Tensor  # [n]
    ent: torch.Tensor  # [n]
    zr: torch.Tensor | None = None  # [n, V] the reference's (the exact KL in the chunks)
    kl: torch.Tensor | None = None  # [n]
    lse_r: torch.Tensor | None = None  # [n]


class _Tiles:
    """The chunk tiles of one backend, allocated once for the longest chunk: the logits (or scaled exps) and row
    statistics, then ``G`` in their storage."""

    def __init__(self, hidden, weight, bias, tf: LogitTransform, backend: str, chunk: int, ref):
        V, cdt, dev = weight.shape[0], TB.acc_dtype(hidden.dtype), hidden.device
        self.weight, self.bias, self.tf, self.ref = weight, bias, tf, ref
        self.cdt, self.out_dtype = cdt, hidden.dtype
        self.triton, self.sm90 = is_triton(backend), backend == "triton-sm90"
        if self.triton:
            from fastrl.kernels import logits_fold as F
            from fastrl.ops import hybrid as HY
            from fastrl.ops import sm90 as S

            self.F, self.S, self.H = F, S, HY
        # sm90: scaled exps in the input dtype instead of float32 logits (fastrl.ops.sm90)
        self.zbuf = torch.empty(0 if self.sm90 else chunk * V, dtype=cdt, device=dev)
        self.zrbuf = torch.empty(chunk * V, dtype=cdt, device=dev) if ref is not None else None
        self.exp_tile = self.S.ExpTile(chunk, hidden, weight, bias, tf) if self.sm90 else None
        self.stats_buf = torch.empty((4, chunk), dtype=torch.float32, device=dev) if self.triton else None
        self.w_mm = weight if weight.dtype == cdt or self.triton else None
        self.tkw = dict(logit_scale=tf.logit_scale, softcap=tf.softcap, temperature=tf.temperature)

    def stats(self, ck: Chunk, ref_h: torch.Tensor | None) -> _Stats:
        n, V = ck.h.shape[0], self.weight.shape[0]
        w, b, tf = self.weight, self.bias, self.tf
        if self.sm90:
            return _Stats(None, *self.S.chunk_stats(self.exp_tile, ck.h, w, b, ck.t, tf, ck.count))
        z = self.zbuf[: n * V].view(n, V)
        if self.triton:
            # raw logits from cuBLAS in float32; the fold and G kernels apply bias and transform on the fly
            self.H.chunk_logits_f32(ck.h, w, out=z)  # fixed row blocks in the batch-invariant mode
            st = self.stats_buf[:, :n]
            self.F.fold_tile(z, b, ck.t, 0, st, first=True, with_entropy=True, **self.tkw)
            return _Stats(z, *self.F.finish_stats(st, True))
        TB.chunk_logits(ck.h, w, b, tf, out=z)
        if ref_h is None:
            return _Stats(z, *TB.stats_from_logits(z, ck.t))
        # the reference's tile next to the policy's, and the KL from the pair
        zr = self.zrbuf[: n * V].view(n, V)
        TB.chunk_logits(ref_h, self.ref[1], self.ref[2], tf, out=zr)
        lse, zt, ent, kl, lse_r = tile_stats_kl(z, zr, ck.t)
        return _Stats(z, lse, zt, ent, zr, kl, lse_r)

    def grad(self, ck: Chunk, st: _Stats, g_lp, g_en, g_kl) -> tuple[torch.Tensor, torch.Tensor]:
        """(G = dL/dy [n, V], the chunk's hidden states as the gradient GEMMs read them)."""
        if g_kl is not None:
            return tile_grad_kl_(st.z, st.zr, ck.t, st.lse, st.ent, st.lse_r, st.kl, g_lp, g_en, g_kl, self.tf), \
                TB.upcast(ck.h)
        if self.sm90:
            return self.S.chunk_grad(self.exp_tile, ck.t, st.zt, st.lse, st.ent, g_lp, g_en, self.tf), ck.h
        if self.triton:
            return self.F.grad_tile(st.z, self.bias, ck.t, 0, st.lse, st.ent, g_lp, g_en, out_dtype=self.out_dtype,
                                    **self.tkw), ck.h
        has_grad = torch.zeros(ck.h.shape[0], dtype=torch.bool, device=ck.h.device)
        for g in (g_lp, g_en):
            if g is not None:
                has_grad |= g != 0
        return TB.grad_from_logits_(st.z, ck.t, 0, st.lse, st.ent, g_lp, g_en, has_grad, self.tf), TB.upcast(ck.h)

    def free(self) -> None:
        self.zbuf = self.zrbuf = self.stats_buf = self.exp_tile = None


class _Grads:
    """The gradient GEMMs' accumulators: grad_h rows written per chunk, grad_W (one GEMM over every row when there is
    one chunk: no accumulator at all), grad_b. Over several chunks a bf16 grad_W is kept as a compensated pair of bf16
    halves (``_gemm.compensated_addmm_``: the gradient itself and 2 V H bytes beside it, against a float32 [V, H]
    accumulator's 4 V H and its cast), a float32 / float64 one accumulates in itself, an fp16 one in float32."""

    def __init__(self, hidden, weight, bias, need: tuple[bool, bool, bool], single: bool, direct: bool,
                 triton: bool = False):
        V, H, cdt, dev = weight.shape[0], hidden.shape[1], TB.acc_dtype(hidden.dtype), hidden.device
        self.need, self.single, self.weight, self.bias, self.cdt = need, single, weight, bias, cdt
        self.direct, self.triton = direct, triton  # grad_h = G W straight (W in G's dtype); the combine's kernel
        self.h = torch.zeros_like(hidden) if need[0] else None
        self.compensated = need[1] and not single and weight.dtype == torch.bfloat16
        acc = weight.dtype if self.compensated else cdt
        self.w = torch.zeros((V, H), dtype=acc, device=dev) if need[1] and not single else None
        self.w_lo = torch.zeros((V, H), dtype=acc, device=dev) if self.compensated else None
        self.b = torch.zeros(V, dtype=cdt, device=dev) if need[2] else None

    def add_(self, ck: Chunk, G: torch.Tensor, h_mm: torch.Tensor) -> None:
        need_h, need_w, need_b = self.need
        if need_h:
            ck.put_(self.h, self._grad_h(G))
        if need_w:
            if self.single:  # G and h in one dtype: the GEMM accumulates in float32 and rounds once, as the cast did
                self.w = torch.mm(G.T, h_mm)  # (as path A's grad_W slices in hybrid.sliced_backward)
            elif self.compensated:
                compensated_addmm_(self.w, self.w_lo, G.T, h_mm, self.triton)
            else:
                addmm_f32(self.w, G.T, h_mm)
        if need_b:
            self.b += G.sum(0, dtype=self.cdt)

    def _grad_h(self, G: torch.Tensor) -> torch.Tensor:
        weight, cdt = self.weight, self.cdt
        if self.direct:
            return torch.mm(G, weight)
        # low-precision weight on the torch backend: float32 copies of bounded slices only
        n, V = G.shape
        gh = torch.zeros((n, weight.shape[1]), dtype=cdt, device=G.device)
        step = TB.tile_columns(n, V)
        for v0 in range(0, V, step):
            gh.addmm_(G[:, v0 : v0 + step], TB.upcast(weight[v0 : v0 + step]))
        return gh

    def result(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        need_h, need_w, need_b = self.need
        self.w_lo = None  # the compensation's low half is dead: hi is the gradient
        grad_w = (torch.zeros_like(self.weight) if self.w is None else self.w.to(self.weight.dtype)) if need_w else None
        return self.h, grad_w, self.b.to(self.bias.dtype) if need_b else None


# ---------------------------------------------------------------------------------------------------------
# the exact KL's terms on a chunk's [n, V] tiles
# ---------------------------------------------------------------------------------------------------------


def tile_stats_kl(
    z: torch.Tensor,  # [n, V] the policy's transformed logits (left unchanged)
    zr: torch.Tensor,  # [n, V] the reference's (left unchanged)
    targets: torch.Tensor,  # [n]; ids outside [0, V) give target logit 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # lse, z_t, H, KL, lse_ref [n]
    """The policy's row statistics and ``KL(p || p_ref)`` from both tiles, one bounded vocabulary block at a time:
    a pass over the reference's tile for its lse, one over the policy's for ``s = sum e^d``, ``sum e^d d`` (the
    entropy) and ``sum e^d (z - z_ref)`` (``d = z - max``), so ``KL = sum e^d (z - z_ref) / s - lse + lse_ref``:
    the logit difference is taken per element, before any large sum (no cancellation between two big sums)."""
    n, V = z.shape
    lse_r = _lse(zr)
    m = z.amax(dim=1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s, u, w = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
    step = _block_columns(z)
    for v0 in range(0, V, step):
        zb = z[:, v0 : v0 + step]
        d = zb - m[:, None]
        e = torch.exp(d)
        s += e.sum(1)
        u += d.mul_(e).sum(1)
        w += torch.sub(zb, zr[:, v0 : v0 + step], out=d).mul_(e).sum(1)
    log_s = torch.log(s)
    lse = m + log_s
    inside = (targets >= 0) & (targets < V)
    zt = torch.where(inside, z.gather(1, targets.clamp(0, V - 1)[:, None]).squeeze(1), 0.0)
    return lse, zt, log_s - u / s, w / s - lse + lse_r, lse_r


def _block_columns(z: torch.Tensor) -> int:
    """Vocabulary columns per block of an [n, V] tile: ``EXACT_KL_COLUMNS`` whatever n, so a row's sums are added in
    one order in every chunk (batch invariant); at the CPU's 256-row chunks a block is the ``exact-kl`` budget's
    1 MB (a core's L2: the passes over a block then run from cache)."""
    return min(z.shape[1], EXACT_KL_COLUMNS)


def _lse(z: torch.Tensor) -> torch.Tensor:  # [n, V] -> [n], blockwise (no tile-sized temporary)
    n, V = z.shape
    m = z.amax(dim=1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.zeros_like(m)
    step = _block_columns(z)
    for v0 in range(0, V, step):
        s += torch.exp(z[:, v0 : v0 + step] - m[:, None]).sum(1)
    return m + torch.log(s)


def tile_grad_kl_(
    z: torch.Tensor,  # [n, V] the policy's transformed logits; overwritten with G
    zr: torch.Tensor,  # [n, V] the reference's; overwritten (scratch)
    targets: torch.Tensor,  # [n]
    lse: torch.Tensor, ent: torch.Tensor, lse_r: torch.Tensor, kl: torch.Tensor,  # [n] each
    g_lp: torch.Tensor | None, g_en: torch.Tensor | None, g_kl: torch.Tensor,  # [n] d loss / d (logp, H, KL)
    tf: LogitTransform,
) -> torch.Tensor:  # G = dL/dy [n, V] in z's storage
    """``G`` of a chunk whose loss reads log-probs, entropies and the exact KL, in one set of passes: with
    ``ls = z - lse``, ``lr = z_ref - lse_ref``, ``p = e^ls``,

        G = p ((g_kl - g_en) ls - g_kl lr - g_lp - g_en H - g_kl KL) + g_lp 1[j = t]      (times dz/dy)

    (logp: ``1[j = t] - p``; entropy: ``-p (ls + H)``; KL: ``p (ls - lr - KL)``)."""
    n, V = z.shape
    zero = torch.zeros_like(lse)
    g_lp = zero if g_lp is None else g_lp
    g_en = zero if g_en is None else g_en
    a, b = (g_kl - g_en)[:, None], (-g_kl)[:, None]
    c = (-g_lp - g_en * ent - g_kl * kl)[:, None]
    step = _block_columns(z)
    for v0 in range(0, V, step):
        zb, rb = z[:, v0 : v0 + step], zr[:, v0 : v0 + step]
        dzdy = tf.dz_dy(zb)  # a float, or a block with a softcap (taken before zb is reused)
        ls = zb.sub_(lse[:, None])
        p = torch.exp(ls)
        g = ls.mul_(a).addcmul_(rb.sub_(lse_r[:, None]), b).add_(c).mul_(p)
        local = targets - v0
        hit = (local >= 0) & (local < g.shape[1])
        g.scatter_add_(1, local.clamp(0, g.shape[1] - 1)[:, None], torch.where(hit, g_lp, zero)[:, None])
        if not isinstance(dzdy, float) or dzdy != 1.0:
            g.mul_(dzdy)
    return z
