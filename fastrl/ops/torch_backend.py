"""The ``torch`` backend: the same algorithm as the Triton kernels, in chunked PyTorch.

Online statistics over vocabulary blocks, so memory beyond inputs and outputs is O(N) plus two ``[N, V_blk]``
float32 tiles alive at once (the logits and their ``exp``; the ``logprob`` row of ``fastrl.ops.budget`` bounds
them, ``tile_columns``). Low-precision inputs are computed in float32: logits are never rounded to bf16/fp16.
"""

from __future__ import annotations

import torch

from fastrl.ops.budget import tile_columns
from fastrl.ops.config import LogitTransform

__all__ = ["tile_columns", "acc_dtype", "upcast", "logits_block", "linear_stats", "stats_from_logits", "chunk_logits",
           "grad_from_logits_", "grad_block"]


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
    N = hidden.shape[0]
    V = weight.shape[0]
    dev = hidden.device
    h32 = upcast(hidden)
    dt = h32.dtype
    m = torch.full((N,), float("-inf"), dtype=dt, device=dev)
    s = torch.zeros(N, dtype=dt, device=dev)
    u = torch.zeros(N, dtype=dt, device=dev) if with_entropy else None
    zt = torch.zeros(N, dtype=dt, device=dev)
    step = tile_columns(N, V, columns)
    buf = torch.empty(N * step, dtype=dt, device=dev)
    for v0 in range(0, V, step):
        v1 = min(v0 + step, V)
        z = logits_block(h32, weight, bias, v0, v1, tf, buf=buf)
        local = targets - v0
        inside = (local >= 0) & (local < v1 - v0)
        zt += torch.where(inside, z.gather(1, local.clamp(0, v1 - v0 - 1)[:, None]).squeeze(1), 0.0)
        m_new = torch.maximum(m, z.amax(dim=1))
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        z.sub_(m_safe[:, None])  # z now holds d = z - m
        p = torch.exp(z)
        if with_entropy:
            shift = torch.where(s > 0, (m - m_safe) * s, torch.zeros_like(s))
            s_blk = p.sum(1)
            u = alpha * (u + shift) + p.mul_(z).sum(1)
            s = alpha * s + s_blk
        else:
            s = alpha * s + p.sum(1)
        m = m_new
        del z, p
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    lse = m_safe + torch.log(s)
    entropy = torch.log(s) - u / s if with_entropy else None
    return lse, zt, entropy


def stats_from_logits(
    z: torch.Tensor,  # [N, V] transformed logits, compute dtype (left unchanged)
    targets: torch.Tensor,  # [N]; ids outside [0, V) give target logit 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # lse [N], target z [N], entropy [N]
    """Row statistics of a stored logits chunk (the one-pass loss path).

    Walks the chunk in vocabulary blocks so the temporaries stay one bounded tile, not two more chunks.
    """
    N, V = z.shape
    m = z.amax(dim=1)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    s = torch.zeros_like(m)
    u = torch.zeros_like(m)
    step = tile_columns(N, V)
    for v0 in range(0, V, step):
        d = z[:, v0 : v0 + step] - m[:, None]
        p = torch.exp(d)
        s += p.sum(1)
        u += d.mul_(p).sum(1)
        del d, p
    inside = (targets >= 0) & (targets < V)
    zt = torch.where(inside, z.gather(1, targets.clamp(0, V - 1)[:, None]).squeeze(1), 0.0)
    log_s = torch.log(s)
    return m + log_s, zt, log_s - u / s


def chunk_logits(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    tf: LogitTransform,
    out: torch.Tensor,  # [N, V] compute dtype
    columns: int | None = None,
) -> torch.Tensor:
    """Transformed logits of a token chunk, in vocabulary blocks (bounded float32 copies of the weight)."""
    h32 = upcast(hidden)
    V = weight.shape[0]
    if weight.dtype == out.dtype:
        torch.mm(h32, weight.T, out=out)
    else:
        step = tile_columns(hidden.shape[0], V, columns)
        for v0 in range(0, V, step):
            v1 = min(v0 + step, V)
            out[:, v0:v1] = torch.mm(h32, upcast(weight[v0:v1]).T)
    if bias is not None:
        out += upcast(bias)
    return tf.apply_(out)


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
