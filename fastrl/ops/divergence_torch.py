"""The torch backend of ``fused_divergence``: vocabulary tiles of both heads in PyTorch (the CPU default, float64).

Neither model's ``[N, V]`` logits are held. The KLs take one pass over matching vocabulary tiles of both heads with
online statistics (running max ``m``, ``s = sum e^(z-m)`` and a cross term ``c = sum e^(z-m) (d_self - d_other)`` of
the max-shifted logits ``d = z - m``, all re-based when a max moves); the JSD needs both normalisers before the
mixture, so a statistics pass, then the divergence pass. The backward recomputes each vocabulary slice of both
heads and forms the student's ``G = dD/dy`` (docs/design.md, "Divergences"):

* forward KL: ``dD/dz_s = p_s - p_t``; reverse KL: ``p_s (log p_s - log p_t - KL)``;
* JSD: ``(1 - beta) p_s (log p_s - log m - KL(p_s || m))`` (the ``m``-terms of the chain rule sum to a constant
  that the softmax Jacobian removes);
* the student's entropy: ``-p_s (log p_s + H)``.

The forward walks fixed ``[ROW_BLOCK, VOCAB_TILE]`` tiles (the hidden states padded to whole row blocks), so a
token's divergence and entropy are bitwise the same in any batch (``fastrl.ops.torch_backend``'s docstring says
why); the backward recomputes the logits in the same tiles, one ``[N, VOCAB_TILE]`` slice of G at a time
(deterministic run to run).

``forward`` / ``backward`` have the interface of ``fastrl.ops.divergence_hybrid`` and ``fastrl.ops.divergence_sm90``
(``fastrl.ops.config.Head``s whose ``h`` keeps the input dtype; ``opts`` the op's ``DivergenceOptions``, read for
``beta``, ``with_entropy``, ``mode`` and the student's transform): they upcast both heads to the compute dtype
(``acc_dtype``: float32, float64 for float64) and run ``divergence_forward`` / ``divergence_backward``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from fastrl.ops.config import Head
from fastrl.ops.divergence_stats import FORWARD_KL, REVERSE_KL, finish_stats, finite_max, log_mix
from fastrl.ops.torch_backend import ROW_BLOCK, VOCAB_TILE, acc_dtype

__all__ = ["forward", "backward", "divergence_forward", "divergence_backward"]


@dataclass
class _Tile:
    rows: slice  # token rows (of the compacted tokens)
    v0: int  # vocabulary columns [v0, v1)
    v1: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.stop - self.rows.start, self.v1 - self.v0


def _invariant_tiles(N_pad: int, V: int) -> Iterator[_Tile]:
    """The forward's tiles: blocks of ``ROW_BLOCK`` rows (``N_pad`` a multiple of it) x ``VOCAB_TILE`` columns, each
    row block's tiles in vocabulary order. Every GEMM and every fold has one shape whatever N, so a token's divergence
    is a function of its own rows alone (batch invariant: ``fastrl.ops.torch_backend``'s docstring says why)."""
    cols = min(VOCAB_TILE, V)
    for n0 in range(0, N_pad, ROW_BLOCK):
        for v0 in range(0, V, cols):
            yield _Tile(slice(n0, n0 + ROW_BLOCK), v0, min(v0 + cols, V))


def _buffers(V: int, cdt: torch.dtype, dev: torch.device) -> list[torch.Tensor]:
    """The five flat tile buffers (both heads' logits, three scratch), each one ``[ROW_BLOCK, VOCAB_TILE]`` tile."""
    return [torch.empty(ROW_BLOCK * min(VOCAB_TILE, V), dtype=cdt, device=dev) for _ in range(5)]


def _weight_block(head: Head, tile: _Tile) -> torch.Tensor:  # [C, H] in the compute dtype (the upcast hidden's)
    return head.weight[tile.v0 : tile.v1].to(head.hidden.dtype)


def _tile_logits(head: Head, tile: _Tile, buf: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """Transformed logits of the tile [R, C], written into ``buf`` (``head`` upcast to the compute dtype)."""
    R, C = tile.shape
    w = _weight_block(head, tile) if w is None else w
    z = torch.mm(head.hidden[tile.rows], w.T, out=buf[: R * C].view(R, C))
    if head.bias is not None:
        z += head.bias[tile.v0 : tile.v1]
    return head.tf.apply_(z)


def _like(buf: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A flat buffer's first elements viewed with ``x``'s shape (an ``out=`` that is never resized)."""
    return buf[: x.numel()].view_as(x)


def _rowdot(a: torch.Tensor, b: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:  # [R, C] x [R, C] -> [R]
    return torch.mul(a, b, out=_like(buf, a)).sum(1)


def _fold(zs, zt, st, mode: int, with_entropy: bool, bufs) -> None:
    """Fold one tile of both heads into the rows' online statistics ``st`` = (m_s, s_s, u_s, c, m_t, s_t) [6, R].

    ``u_s = sum e^(d_s) d_s`` (the entropy), ``c`` the cross term of the KL direction (``mode``); d = z - m.
    """
    m_s, s_s, u_s, c, m_t, s_t = st.unbind(0)
    ms_new, mt_new = torch.maximum(m_s, zs.amax(1)), torch.maximum(m_t, zt.amax(1))
    ms0, mt0 = finite_max(ms_new), finite_max(mt_new)
    ds, dt = zs.sub_(ms0[:, None]), zt.sub_(mt0[:, None])
    es, et = torch.exp(ds, out=_like(bufs[0], ds)), torch.exp(dt, out=_like(bufs[1], dt))
    a_s, a_t = torch.exp(m_s - ms0), torch.exp(m_t - mt0)
    # how far each reference point moved (0 while nothing is folded: no -inf * 0)
    sh_s = torch.where(s_s > 0, m_s - ms0, torch.zeros_like(s_s))
    sh_t = torch.where(s_t > 0, m_t - mt0, torch.zeros_like(s_t))
    if with_entropy:
        u_s.copy_(a_s * (u_s + sh_s * s_s) + _rowdot(es, ds, bufs[2]))
    if mode == FORWARD_KL:  # c = sum e^(d_t) (d_t - d_s)
        c.copy_(a_t * (c + (sh_t - sh_s) * s_t) + _rowdot(et, torch.sub(dt, ds, out=ds), bufs[2]))
    elif mode == REVERSE_KL:  # c = sum e^(d_s) (d_s - d_t)
        c.copy_(a_s * (c + (sh_s - sh_t) * s_s) + _rowdot(es, torch.sub(ds, dt, out=dt), bufs[2]))
    s_s.copy_(a_s * s_s + es.sum(1))
    s_t.copy_(a_t * s_t + et.sum(1))
    m_s.copy_(ms_new)
    m_t.copy_(mt_new)


def _jsd_terms(zs, zt, lse_s, lse_t, beta: float, bufs) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's share of (JSD, KL(p_s || m)) per row [R] each; overwrites zs, zt."""
    ls, lt = zs.sub_(lse_s[:, None]), zt.sub_(lse_t[:, None])
    ps, pt = torch.exp(ls, out=_like(bufs[0], ls)), torch.exp(lt, out=_like(bufs[1], lt))
    lm = log_mix(ps, pt, beta, out=_like(bufs[2], ps))
    ls.sub_(lm)
    lt.sub_(lm)  # lm (in bufs[2]) is dead from here: the row dots may use its buffer
    kl_sm, kl_tm = _rowdot(ps, ls, bufs[2]), _rowdot(pt, lt, bufs[2])
    return beta * kl_tm + (1.0 - beta) * kl_sm, kl_sm


def divergence_forward(
    student: Head, teacher: Head, opts,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(divergence [N], entropy [N] | None, lse_s [N], lse_t [N], aux [N]): aux is the KL for the KL modes and
    KL(p_s || m) for the JSD (what the backward needs)."""
    N, V = student.h.shape[0], student.weight.shape[0]
    cdt, dev = student.hidden.dtype, student.h.device
    mode = opts.mode
    N_pad = -(-N // ROW_BLOCK) * ROW_BLOCK
    student, teacher = student.padded(N_pad), teacher.padded(N_pad)
    st = torch.zeros((6, N_pad), dtype=cdt, device=dev)
    st[0].fill_(float("-inf"))
    st[4].fill_(float("-inf"))
    bufs = _buffers(V, cdt, dev)
    for tile in _invariant_tiles(N_pad, V):
        zs, zt = _tile_logits(student, tile, bufs[3]), _tile_logits(teacher, tile, bufs[4])
        _fold(zs, zt, st[:, tile.rows], mode, opts.with_entropy, bufs)
    div, entropy, lse_s, lse_t = finish_stats(st, mode, opts.with_entropy)
    if div is not None:  # a KL: it is also what the backward needs
        aux = div
    else:
        div = torch.zeros(N_pad, dtype=cdt, device=dev)
        aux = torch.zeros(N_pad, dtype=cdt, device=dev)
        for tile in _invariant_tiles(N_pad, V):
            zs, zt = _tile_logits(student, tile, bufs[3]), _tile_logits(teacher, tile, bufs[4])
            j, k = _jsd_terms(zs, zt, lse_s[tile.rows], lse_t[tile.rows], opts.beta, bufs)
            div[tile.rows] += j
            aux[tile.rows] += k
    return tuple(None if x is None else x[:N] for x in (div, entropy, lse_s, lse_t, aux))


def _student_grad(zs, zt, lse_s, lse_t, aux, entropy, gd, ge, opts, bufs) -> torch.Tensor:
    """G = dL/dy_s over one tile [R, C] for ``L = sum gd * D + ge * H``; overwrites zs, zt (G lands in one of them)."""
    dzdy = opts.student.dz_dy(zs)  # a float, or a tile with a softcap (taken before zs is reused)
    mode, beta = opts.mode, opts.beta
    gd = gd if gd is not None else torch.zeros_like(lse_s)
    ls, lt = zs.sub_(lse_s[:, None]), zt.sub_(lse_t[:, None])
    ps = torch.exp(ls, out=_like(bufs[0], ls))
    # every case is p_s * (a log p_s + b log p_t|m + c) (+ a p_t term for the forward KL), a, b, c per row
    a = -ge if ge is not None else torch.zeros_like(gd)
    cst = -ge * entropy if ge is not None else torch.zeros_like(gd)
    if mode == FORWARD_KL:  # gd (p_s - p_t) - ge p_s (log p_s + H)
        pt = torch.exp(lt, out=_like(bufs[1], lt))
        g = ls.mul_(a[:, None]).add_((gd + cst)[:, None]).mul_(ps).sub_(pt.mul_(gd[:, None]))
    elif mode == REVERSE_KL:  # gd p_s (log p_s - log p_t - KL) - ge p_s (log p_s + H)
        g = ls.mul_((a + gd)[:, None]).sub_(lt.mul_(gd[:, None])).add_((cst - gd * aux)[:, None]).mul_(ps)
    else:  # (1 - beta) gd p_s (log p_s - log m - KL(p_s || m)) - ge p_s (log p_s + H)
        pt = torch.exp(lt, out=_like(bufs[1], lt))
        lm = log_mix(ps, pt, beta, out=_like(bufs[2], ps))
        w = (1.0 - beta) * gd
        g = ls.mul_((a + w)[:, None]).sub_(lm.mul_(w[:, None])).add_((cst - w * aux)[:, None]).mul_(ps)
    if not isinstance(dzdy, float) or dzdy != 1.0:
        g.mul_(dzdy)
    return g


def divergence_backward(
    student: Head, teacher: Head, opts,
    lse_s: torch.Tensor, lse_t: torch.Tensor, aux: torch.Tensor, entropy: torch.Tensor | None,
    grad_div: torch.Tensor | None, grad_ent: torch.Tensor | None,  # [N] compute dtype
    need: tuple[bool, bool, bool],  # (hidden, weight, bias)
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Student gradients, vocabulary-sliced: each slice's G [N, C] is formed once, ``grad_W[slice] = G^T h`` is one
    GEMM written once (no float32 [V, H] buffer), ``grad_h += G W[slice]`` accumulates in the compute dtype. The
    slices are the forward's ``VOCAB_TILE`` columns and G's logits are recomputed in the forward's
    ``[ROW_BLOCK, VOCAB_TILE]`` tiles: bitwise the logits the forward's statistics came from (a GEMM of another shape
    rounds differently, and a log-sum-exp off by an ulp scales every probability of its row alike)."""
    need_h, need_w, need_b = need
    h, weight, bias = student.h, student.weight, student.bias
    N, V = h.shape[0], weight.shape[0]
    cdt, dev = h.dtype, h.device
    grad_h = torch.zeros_like(h) if need_h else None
    grad_b = torch.zeros((V,), dtype=cdt, device=dev) if need_b else None
    grad_w = torch.empty_like(weight) if need_w else None
    N_pad, cols = -(-N // ROW_BLOCK) * ROW_BLOCK, min(VOCAB_TILE, V)
    padded_s, padded_t = student.padded(N_pad), teacher.padded(N_pad)
    bufs = _buffers(V, cdt, dev)
    g_slice = torch.empty((N, cols), dtype=cdt, device=dev)
    for v0 in range(0, V, cols):
        v1 = min(v0 + cols, V)
        g = g_slice[:, : v1 - v0]
        w = _weight_block(student, _Tile(slice(0, N), v0, v1))
        for n0 in range(0, N, ROW_BLOCK):
            n1 = min(n0 + ROW_BLOCK, N)
            r, tile = slice(n0, n1), _Tile(slice(n0, n0 + ROW_BLOCK), v0, v1)
            zs = _tile_logits(padded_s, tile, bufs[3], w)[: n1 - n0]
            zt = _tile_logits(padded_t, tile, bufs[4])[: n1 - n0]
            g[r] = _student_grad(zs, zt, lse_s[r], lse_t[r], aux[r], None if entropy is None else entropy[r],
                                 None if grad_div is None else grad_div[r], None if grad_ent is None else grad_ent[r],
                                 opts, bufs)
        if need_h:
            grad_h.addmm_(g, w)
        if need_w:
            if grad_w.dtype == cdt:
                torch.mm(g.T, h, out=grad_w[v0:v1])  # written once, no temporary
            else:
                grad_w[v0:v1] = torch.mm(g.T, h)
        if need_b:
            grad_b[v0:v1] = g.sum(0)
    return (
        grad_h.to(student.dtype) if need_h else None,
        grad_w if need_w else None,
        grad_b.to(bias.dtype) if need_b else None,
    )


def forward(student: Head, teacher: Head, opts, mode: int):
    """(divergence, entropy | None, lse_s, lse_t, aux) [N] in the compute dtype, as ``divergence_hybrid.forward``."""
    assert mode == opts.mode
    cdt = acc_dtype(student.h.dtype)
    return divergence_forward(student.upcast(cdt), teacher.upcast(cdt), opts)


def backward(student: Head, teacher: Head, opts, mode: int, lse_s, lse_t, aux, entropy, grad_div, grad_ent, need):
    """Student gradients (hidden, weight, bias) in the input dtypes, as ``divergence_hybrid.backward``."""
    assert mode == opts.mode
    cdt = lse_s.dtype
    return divergence_backward(student.upcast(cdt), teacher.upcast(cdt), opts, lse_s, lse_t, aux, entropy, grad_div,
                               grad_ent, need)
