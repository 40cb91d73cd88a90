"""The ``torch`` backend: the same algorithm as the Triton kernels, in chunked PyTorch.

Online statistics over vocabulary blocks, so memory beyond inputs and outputs is O(N) plus the tiles: the
statistics walk ``[ROW_BLOCK, VOCAB_TILE]`` tiles (1 MB of float32; below), path A's backward two ``[N, V_blk]``
float32 tiles alive at once (the logits and their ``exp``; the ``logprob`` row of ``fastrl.ops.budget`` bounds
them, ``tile_columns``). Low-precision inputs are computed in float32: logits are never rounded to bf16/fp16.

**Batch invariance.** A token's log-prob and entropy are bitwise the same whatever else is in the batch: the row
statistics (``linear_stats``, and ``chunk_logits`` + ``stats_from_logits`` of the one-pass loss) are computed over
fixed ``[ROW_BLOCK, VOCAB_TILE]`` tiles, the last row block padded with zero rows. A BLAS GEMM's value at one output
element depends on the GEMM's shape (MKL picks its kernel and its split of the inner sum by ``M``, the row count; the
column count matters for some widths too), never on the other rows' values or a row's position; the elementwise passes
and row reductions of a fixed-shape tile likewise. So fixed tile shapes, merged in vocabulary order, make every
row's numbers a function of that row alone: not of ``N``, of the rows next to it, of the memory budget or of the
one-pass chunking (whose logits and statistics are bitwise those of path A). Gradients are not batch invariant (a
row's ``grad_h`` is a GEMM over the batch's ``G``) but are deterministic run to run (no atomics).
"""

from __future__ import annotations

import torch

from fastrl.ops.budget import tile_columns
from fastrl.ops.config import LogitTransform

__all__ = ["tile_columns", "acc_dtype", "upcast", "logits_block", "linear_stats", "stats_from_logits", "chunk_logits",
           "grad_from_logits_", "grad_block", "ROW_BLOCK", "VOCAB_TILE"]

# The invariant statistics' tile: rows per GEMM (a partial block is padded) and vocabulary columns per tile. 1 MB of
# float32, in a core's L2: as fast at C1 as the [N, 1024] tiles of the ``logprob`` budget row (docs/functions.md,
# "Reproducibility", says what was measured). Changing either changes every log-prob's last bits.
ROW_BLOCK = 128
VOCAB_TILE = 2048


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Compute dtype: float32 for float32/bf16/fp16 inputs, float64 for float64 ones."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Upcast to the compute dtype (a no-op for float32 and float64)."""
    return x.to(acc_dtype(x.dtype))




def logits_block(
    h32: torch.Tensor,  # [N, H] in the compute dtype (acc_dtype)
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    v0: int,
    v1: int,
    tf: LogitTransform,
    buf: torch.Tensor | None = None,  # flat buffer of >= N * (v1 - v0) elements to write into
) -> torch.Tensor:  # [N, v1 - v0] float32, transformed
    if buf is None:
        y = torch.mm(h32, upcast(weight[v0:v1]).T)
    else:
        # one reused tile instead of a fresh allocation per block: the C allocator tends to keep freed
        # tiles mapped, which showed as ~60 MB of extra peak RSS at C1
        y = torch.mm(h32, upcast(weight[v0:v1]).T, out=buf[: h32.shape[0] * (v1 - v0)].view(h32.shape[0], v1 - v0))
    if bias is not None:
        y += upcast(bias[v0:v1])
    return tf.apply_(y)


def linear_stats(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    targets: torch.Tensor,  # [N] int64
    tf: LogitTransform,
    *,
    with_entropy: bool,
    columns: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # lse [N], target z [N], entropy [N]
    """Row statistics in fixed ``[ROW_BLOCK, columns or VOCAB_TILE]`` tiles (batch invariant, module docstring)."""
    N, H = hidden.shape
    V = weight.shape[0]
    dt = acc_dtype(hidden.dtype)
    step = _invariant_columns(V, columns)
    blocks = list(_RowBlocks(hidden, targets, dt))
    states = [_Online(ROW_BLOCK, dt, hidden.device, with_entropy) for _ in blocks]
    z = torch.empty((ROW_BLOCK, step), dtype=dt, device=hidden.device)
    for b, v0, v1, w_t, b_t in _tile_order(len(blocks), weight, bias, step, dt):
        zb = z[:, : v1 - v0]
        torch.mm(blocks[b][2], w_t, out=zb)
        if b_t is not None:
            zb += b_t
        states[b].fold_(tf.apply_(zb), blocks[b][3], v0)
    out = torch.empty((3, N), dtype=dt, device=hidden.device)
    for (n0, n1, _, _), st in zip(blocks, states):
        st.finish(out[:, n0:n1], n1 - n0)
    return out[0], out[1], (out[2] if with_entropy else None)


def _tile_order(n_blocks: int, weight: torch.Tensor, bias: torch.Tensor | None, step: int, dt: torch.dtype):
    """``(row block, v0, v1, weight tile^T, bias tile)`` over every tile, each row block's tiles in vocabulary order.
    Row blocks outer (a block's hidden rows stay in cache: vocabulary outer made C1's statistics 1.3-1.6x slower),
    unless the weight needs an upcast: then vocabulary outer, each tile upcast once instead of once per row block. The
    order changes no bits (a row's tiles are folded in vocabulary order either way)."""
    V = weight.shape[0]
    cols = [(v0, min(v0 + step, V)) for v0 in range(0, V, step)]
    cached: dict[int, tuple] = {}

    def tile(v0: int, v1: int) -> tuple:
        if v0 not in cached:
            cached.clear()
            cached[v0] = (upcast(weight[v0:v1]).T, upcast(bias[v0:v1]) if bias is not None else None)
        return cached[v0]

    if weight.dtype == dt:
        pairs = ((b, v0, v1) for b in range(n_blocks) for v0, v1 in cols)
    else:
        pairs = ((b, v0, v1) for v0, v1 in cols for b in range(n_blocks))
    for b, v0, v1 in pairs:
        yield (b, v0, v1, *tile(v0, v1))


def _invariant_columns(V: int, requested: int | None) -> int:
    """Vocabulary columns per invariant tile: the requested number (``vocab_chunk``), else ``VOCAB_TILE``; never the
    budget's, which follows N."""
    return max(1, min(int(requested) if requested else VOCAB_TILE, V))


class _RowBlocks:
    """``(n0, n1, hidden block [ROW_BLOCK, H], targets block [ROW_BLOCK])`` over the rows in order, in the compute
    dtype; the last block padded with zero rows and target -1 (no target logit), so every GEMM has ROW_BLOCK rows."""

    def __init__(self, hidden: torch.Tensor, targets: torch.Tensor | None, dt: torch.dtype):
        self.hidden, self.targets = hidden, targets
        N, H = hidden.shape
        partial = N % ROW_BLOCK != 0
        self.pad_h = torch.zeros((ROW_BLOCK, H), dtype=dt, device=hidden.device) if partial else None
        self.pad_t = (torch.full((ROW_BLOCK,), -1, dtype=targets.dtype, device=targets.device)
                      if partial and targets is not None else None)

    def __iter__(self):
        N = self.hidden.shape[0]
        for n0 in range(0, N, ROW_BLOCK):
            n1 = min(n0 + ROW_BLOCK, N)
            if n1 - n0 == ROW_BLOCK:
                yield n0, n1, upcast(self.hidden[n0:n1]).contiguous(), _part(self.targets, n0, n1)
            else:
                self.pad_h[: n1 - n0] = self.hidden[n0:n1]
                if self.pad_t is not None:
                    self.pad_t[: n1 - n0] = self.targets[n0:n1]
                yield n0, n1, self.pad_h, self.pad_t


def _part(x: torch.Tensor | None, n0: int, n1: int) -> torch.Tensor | None:
    return None if x is None else x[n0:n1]


class _Online:
    """One row block's online statistics over vocabulary tiles folded in order: running max ``m``, ``s = sum
    e^(z-m)``, ``u = sum e^(z-m) (z-m)`` (the entropy), the target logit ``zt``. The one definition of the merge that
    path A's statistics and the one-pass loss's share, so both give a row the same bits."""

    def __init__(self, rows: int, dt: torch.dtype, dev: torch.device, with_entropy: bool):
        self.m = torch.full((rows,), float("-inf"), dtype=dt, device=dev)
        self.s = torch.zeros(rows, dtype=dt, device=dev)
        self.u = torch.zeros(rows, dtype=dt, device=dev) if with_entropy else None
        self.zt = torch.zeros(rows, dtype=dt, device=dev)

    def fold_(self, z: torch.Tensor, targets: torch.Tensor, v0: int) -> None:
        """Fold a tile ``z`` [rows, C] of transformed logits (columns ``v0 ..``); overwrites ``z``."""
        C = z.shape[1]
        local = targets - v0
        inside = (local >= 0) & (local < C)
        self.zt += torch.where(inside, z.gather(1, local.clamp(0, C - 1)[:, None]).squeeze(1), 0.0)
        m, s = self.m, self.s
        m_new = torch.maximum(m, z.amax(dim=1))
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        z.sub_(m_safe[:, None])  # z now holds d = z - m
        p = torch.exp(z)
        if self.u is not None:
            shift = torch.where(s > 0, (m - m_safe) * s, torch.zeros_like(s))
            s_blk = p.sum(1)
            self.u = alpha * (self.u + shift) + p.mul_(z).sum(1)
            self.s = alpha * s + s_blk
        else:
            self.s = alpha * s + p.sum(1)
        self.m = m_new

    def finish(self, out: torch.Tensor, n: int) -> None:
        """Write (lse, target z, entropy) of the first ``n`` rows into ``out`` [3, n] (entropy row untouched without)."""
        m_safe = torch.where(torch.isneginf(self.m), torch.zeros_like(self.m), self.m)
        log_s = torch.log(self.s)
        out[0] = (m_safe + log_s)[:n]
        out[1] = self.zt[:n]
        if self.u is not None:
            out[2] = (log_s - self.u / self.s)[:n]


def stats_from_logits(
    z: torch.Tensor,  # [N, V] transformed logits, compute dtype (left unchanged)
    targets: torch.Tensor,  # [N]; ids outside [0, V) give target logit 0
    columns: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # lse [N], target z [N], entropy [N]
    """Row statistics of a stored logits chunk (the one-pass loss path), bitwise those of ``linear_stats`` on the
    same rows: each ``[ROW_BLOCK, VOCAB_TILE]`` block is copied into one reused tile and folded by the same merge."""
    N, V = z.shape
    step = _invariant_columns(V, columns)
    tile = torch.zeros((ROW_BLOCK, step), dtype=z.dtype, device=z.device)
    tgt = torch.full((ROW_BLOCK,), -1, dtype=targets.dtype, device=targets.device)
    out = torch.empty((3, N), dtype=z.dtype, device=z.device)
    for n0 in range(0, N, ROW_BLOCK):
        n1 = min(n0 + ROW_BLOCK, N)
        tgt[: n1 - n0] = targets[n0:n1]
        st = _Online(ROW_BLOCK, z.dtype, z.device, True)
        for v0 in range(0, V, step):
            v1 = min(v0 + step, V)
            zb = tile[:, : v1 - v0]
            zb[: n1 - n0] = z[n0:n1, v0:v1]
            st.fold_(zb, tgt, v0)
        st.finish(out[:, n0:n1], n1 - n0)
    return out[0], out[1], out[2]


def chunk_logits(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    tf: LogitTransform,
    out: torch.Tensor,  # [N, V] compute dtype
    columns: int | None = None,
) -> torch.Tensor:
    """Transformed logits of a token chunk, computed in the fixed tiles of ``linear_stats`` (so they are bitwise its
    logits, whatever the chunk's length) and copied into ``out``."""
    N, V = out.shape
    step = _invariant_columns(V, columns)
    tile = torch.empty((ROW_BLOCK, step), dtype=out.dtype, device=out.device)
    blocks = list(_RowBlocks(hidden, None, out.dtype))
    for b, v0, v1, w_t, b_t in _tile_order(len(blocks), weight, bias, step, out.dtype):
        n0, n1, hb, _ = blocks[b]
        zb = tile[:, : v1 - v0]
        torch.mm(hb, w_t, out=zb)
        if b_t is not None:
            zb += b_t
        out[n0:n1, v0:v1] = tf.apply_(zb)[: n1 - n0]
    return out


def grad_from_logits_(
    z: torch.Tensor,  # [N, V] transformed logits, compute dtype; overwritten with G
    targets: torch.Tensor,  # [N] global ids
    v0: int,  # global id of z's first column
    lse: torch.Tensor,  # [N]
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,  # [N], zero on ignored rows
    grad_entropy: torch.Tensor | None,
    has_grad: torch.Tensor,  # [N] bool
    tf: LogitTransform,
) -> torch.Tensor:  # G = dL/dy, in z's storage
    """G in place over a stored logits chunk, one bounded vocabulary block at a time."""
    step = tile_columns(z.shape[0], z.shape[1])
    for c0 in range(0, z.shape[1], step):
        _grad_from_logits_block_(z[:, c0 : c0 + step], targets, v0 + c0, lse, entropy, grad_logp, grad_entropy,
                                 has_grad, tf)
    return z


def _grad_from_logits_block_(
    z: torch.Tensor,  # [N, V_blk] transformed logits of a vocabulary slice, compute dtype; overwritten with G
    targets: torch.Tensor,  # [N] global ids
    v0: int,  # global id of the slice's first column
    lse: torch.Tensor,  # [N]
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,  # [N], zero on ignored rows
    grad_entropy: torch.Tensor | None,
    has_grad: torch.Tensor,  # [N] bool
    tf: LogitTransform,
) -> torch.Tensor:  # G = dL/dy, in z's storage
    v1 = v0 + z.shape[1]
    dzdy = tf.dz_dy(z)  # a float, or a tensor when softcap is set (taken before z is reused)
    p = z.sub(lse[:, None]).exp_()
    if grad_entropy is not None:
        # d H / d z_j = -p_j (z_j - lse + H)
        g = z.sub_(lse[:, None]).add_(entropy[:, None]).mul_(p).mul_(-grad_entropy[:, None])
        if grad_logp is not None:
            g.sub_(p.mul_(grad_logp[:, None]))
    else:
        g = z.copy_(p).mul_(-grad_logp[:, None])
    del p
    if grad_logp is not None:
        # d logp / d z_j = 1[j = t] - p_j: add the indicator part
        # (a scatter of zeros where the target is in another slice: no nonzero(), so no host synchronisation
        # and no data-dependent shape; adding 0 leaves those entries unchanged)
        local = targets - v0
        inside = (local >= 0) & (local < v1 - v0) & has_grad
        add = torch.where(inside, grad_logp, torch.zeros((), dtype=g.dtype, device=g.device))
        g.scatter_add_(1, local.clamp(0, v1 - v0 - 1)[:, None], add[:, None].to(g.dtype))
    if not isinstance(dzdy, float) or dzdy != 1.0:
        g.mul_(dzdy)
    # rows without upstream gradient are exactly zero even where their logits are not finite
    g.masked_fill_(~has_grad[:, None], 0.0)
    return g


def grad_block(
    h32: torch.Tensor,  # [N, H] in the compute dtype (acc_dtype)
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    targets: torch.Tensor,  # [N]
    v0: int,
    v1: int,
    lse: torch.Tensor,  # [N] float32
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,  # [N] float32, zero on ignored rows
    grad_entropy: torch.Tensor | None,
    has_grad: torch.Tensor,  # [N] bool
    tf: LogitTransform,
    buf: torch.Tensor | None = None,  # reused flat tile buffer (see logits_block)
) -> torch.Tensor:  # [N, v1 - v0] float32: dL/dy for the slice
    """Recompute one vocabulary slice's logits and turn them into G (path A's backward)."""
    z = logits_block(h32, weight, bias, v0, v1, tf, buf=buf)
    return _grad_from_logits_block_(z, targets, v0, lse, entropy, grad_logp, grad_entropy, has_grad, tf)
