"""The kept-set engine's per-row plan: each token's hidden state against the weight rows of its own kept ids.

A token row ``n`` keeps ``ids[n, :]`` (``[N, K]``, padded with ``-1``: K the widest set, a shape). The logits are one
batched product, ``y[n, k] = h[n] . W[ids[n, k]] (+ b[ids[n, k]])``: ``N K H`` multiply-adds, ``N K`` logits, no
union of neighbouring tokens' sets and nothing computed for an id the token did not keep (a padding slot costs its
logit, ``-inf``). The backward reads the same gather: ``grad_h[n] = sum_k G[n, k] W[ids[n, k]]`` and
``grad_W[ids[n, k]] += G[n, k] h[n]``, a scatter-add over the kept ids (``G = dL/dy``, ignored at padding). Every
shape is a shape of the inputs (no host read, nothing data-dependent): ``torch.compile`` and CUDA graphs take it.

Two implementations of one semantics:

* torch (every device): row chunks of at most ``tile_elems`` gathered weight elements (``[rows, K, H]``), a batched
  matmul with float32 accumulation (float64 for float64 inputs; bf16/fp16 operands upcast on a CPU, where the
  products are exact, cuBLAS's float32-out ``bmm`` on CUDA); ``grad_W`` over the chunk's ids: ``deterministic=True``
  (what the engine asks) sums each id's rows first on CUDA (sorted by id, ``segment_reduce``: no atomics) and adds
  each distinct id once per chunk; on a CPU ``index_add_``, which adds in index order (deterministic; with
  ``segment_reduce`` over ``[rows, H]`` a ragged 4096 x 512 step took 1.0 s there instead of 0.29 s, one thread).
* Triton (``fastrl.kernels.kept_rows``, on a Triton backend when that module is installed): gather + dot in the
  input dtype with float32 accumulation, a sorted segment reduction for ``grad_W`` (no atomics); the same arguments
  and results.

The engine (``fastrl.ops.kept``) calls these once per bucket of rows of one padded width (``KeptPlan``).
"""

from __future__ import annotations

import importlib.util

import torch

from fastrl.ops.backend import cuda_f32_out, is_triton
from fastrl.ops.config import get_batch_invariant
from fastrl.ops.torch_backend import acc_dtype

__all__ = ["rows_logits", "rows_backward", "kernels_for", "chunk_rows"]

# looked up once, without importing it (a module constant: torch.compile traces the choice without a break)
_KERNELS_PRESENT = importlib.util.find_spec("fastrl.kernels.kept_rows") is not None


def kernels_for(backend: str, dtype: torch.dtype):
    """``fastrl.kernels.kept_rows`` where the per-row plan runs on Triton (a Triton backend, a float32/bf16/fp16
    head, the module installed), else None: the torch implementation below."""
    if not (_KERNELS_PRESENT and is_triton(backend) and dtype != torch.float64):
        return None
    from fastrl.kernels import kept_rows  # imported here: only a Triton backend loads the kernels

    return kept_rows


def chunk_rows(N: int, K: int, H: int, tile_elems: int) -> int:
    """Token rows per chunk of the torch implementation: the ``[rows, K, H]`` gathered weight rows within
    ``tile_elems`` elements (at least one row)."""
    return max(1, min(N, tile_elems // max(1, K * H)))


def _bmm_f32(a: torch.Tensor, b: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """``a @ b`` (batched) in the compute dtype, the products never rounded to a 2-byte input dtype."""
    if a.dtype == cdt and b.dtype == cdt:
        return torch.bmm(a, b)
    if cuda_f32_out(a.device) and cdt == torch.float32 and a.dtype == b.dtype:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.to(cdt), b.to(cdt))


def rows_logits(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    ids: torch.Tensor,  # [N, K] int64, -1 at padding
    bias: torch.Tensor | None,  # [V]
    *,
    backend: str = "torch",
    tile_elems: int = 1 << 22,
) -> torch.Tensor:  # [N, K] raw logits (float32; float64 for float64 inputs), -inf at padding
    """Each row's raw logits at its kept ids (no transform)."""
    kern = kernels_for(backend, hidden.dtype)
    if kern is not None:
        # the ids were checked where the set was built (KeptSet): no host read here, so graphs can take it
        return kern.kept_rows_logits(hidden, weight, ids, bias, check_ids=False)
    N, K = ids.shape
    H = hidden.shape[1]
    cdt = acc_dtype(hidden.dtype)
    out = torch.empty((N, K), dtype=cdt, device=hidden.device)
    pad = ids < 0
    safe = ids.clamp(min=0)
    step = chunk_rows(N, K, H, tile_elems)
    buf = weight.new_empty((min(step, N) * K, H))  # one gather buffer for every chunk (no fresh pages per chunk)
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        n = r1 - r0
        # the gather: K rows of W per token
        w = torch.index_select(weight, 0, safe[r0:r1].reshape(-1), out=buf[: n * K]).view(n, K, H)
        if get_batch_invariant():  # bmm's sum order follows the batch count; a product and a row sum do not
            out[r0:r1] = w.to(cdt).mul_(hidden[r0:r1, None, :].to(cdt)).sum(-1)
        else:
            out[r0:r1] = _bmm_f32(w, hidden[r0:r1, :, None], cdt).squeeze(2)
    if bias is not None:
        out += bias.index_select(0, safe.reshape(-1)).view(N, K).to(cdt)
    return out.masked_fill_(pad, float("-inf"))


def rows_backward(
    grad: torch.Tensor,  # [N, K] dL/d raw logit (compute dtype), ignored at padding
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    ids: torch.Tensor,  # [N, K] int64, -1 at padding
    grad_weight: torch.Tensor | None,  # [V', H] float32 (float64): scatter-ADDED into, at rows ``weight_rows``
    grad_bias: torch.Tensor | None,  # [V] float32 (float64): scatter-ADDED into
    *,
    deterministic: bool = False,
    backend: str = "torch",
    tile_elems: int = 1 << 22,
    weight_rows: torch.Tensor | None = None,  # [N, K] the row of grad_weight of each id (default: the id)
) -> torch.Tensor:  # grad_hidden [N, H] (compute dtype)
    """``grad_h = G W[ids]``; ``grad_W[ids] += G^T h`` and ``grad_b[ids] += G`` into the given accumulators.

    ``weight_rows`` lets a bf16/fp16 head's weight gradient accumulate in a float32 buffer over the kept ids only
    (``fastrl.ops.kept``), on both implementations."""
    kern = kernels_for(backend, hidden.dtype)
    if kern is not None:
        return kern.kept_rows_backward(grad, hidden, weight, ids, grad_weight, grad_bias, deterministic=deterministic,
                                       weight_rows=weight_rows, check_ids=False)
    N, K = ids.shape
    H = hidden.shape[1]
    cdt = grad.dtype
    pad = ids < 0
    g = grad.masked_fill(pad, 0.0)
    safe = ids.clamp(min=0)
    dst = safe if weight_rows is None else weight_rows.masked_fill(pad, 0)  # the weight gradient's rows
    if weight.dtype == cdt:  # sum_k G[n, k] W[ids[n, k]] as one bag per row: no gathered copy of W
        grad_h = torch.nn.functional.embedding_bag(safe, weight, mode="sum", per_sample_weights=g)
    else:
        grad_h = _rows_grad_hidden(g, weight, safe, tile_elems)
    step = chunk_rows(N, K, H, tile_elems)
    buf = torch.empty((min(step, N) * K, H), dtype=cdt, device=hidden.device) if grad_weight is not None else None
    for r0 in range(0, N if grad_weight is not None else 0, step):
        r1 = min(N, r0 + step)
        n = r1 - r0
        # G[n, k] h[n] for every kept (n, k), added at its id
        rows = torch.mul(g[r0:r1, :, None], hidden[r0:r1, None, :].to(cdt), out=buf[: n * K].view(n, K, H))
        _scatter_add(grad_weight, dst[r0:r1].reshape(-1), rows.view(n * K, H), deterministic)
    if grad_bias is not None:
        _scatter_add(grad_bias, safe.reshape(-1), g.reshape(-1), deterministic)
    return grad_h


def _rows_grad_hidden(g: torch.Tensor, weight: torch.Tensor, safe: torch.Tensor, tile_elems: int) -> torch.Tensor:
    """``grad_h[n] = sum_k g[n, k] W[ids[n, k]]`` for a bf16/fp16 head: gathered chunks, float32 products."""
    N, K = safe.shape
    H = weight.shape[1]
    cdt = g.dtype
    grad_h = torch.empty((N, H), dtype=cdt, device=g.device)
    step = chunk_rows(N, K, H, tile_elems)
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        w = weight.index_select(0, safe[r0:r1].reshape(-1)).view(r1 - r0, K, H)
        g_c = g[r0:r1, None, :]
        if cuda_f32_out(w.device):  # bf16 operands on the tensor cores, float32 results
            g_c = g_c.to(w.dtype)
        grad_h[r0:r1] = _bmm_f32(g_c, w, cdt).squeeze(1)
    return grad_h


def _scatter_add(acc: torch.Tensor, index: torch.Tensor, src: torch.Tensor, deterministic: bool) -> None:
    """``acc[index] += src`` (rows). Deterministic: the rows of each index summed in a fixed order first (sort by
    index, then ``segment_reduce``: no atomics), then one add per distinct index, all without a data-dependent
    shape (the unused segments are empty and add exact zeros to row 0)."""
    if not deterministic or acc.device.type == "cpu":  # a CPU's index_add_ adds in index order: deterministic
        acc.index_add_(0, index, src.to(acc.dtype))
        return
    M = index.numel()
    srt, order = torch.sort(index, stable=True)
    first = torch.ones(M, dtype=torch.bool, device=index.device)
    first[1:] = srt[1:] != srt[:-1]
    slot = torch.cumsum(first, 0) - 1  # each sorted row's distinct-index rank
    lengths = torch.zeros(M, dtype=torch.int64, device=index.device).index_add_(0, slot, torch.ones_like(slot))
    sums = torch.segment_reduce(src.index_select(0, order).to(acc.dtype), "sum", lengths=lengths, axis=0)
    dest = torch.zeros(M, dtype=torch.int64, device=index.device).scatter_(0, slot, srt)
    acc.index_add_(0, dest, sums)
