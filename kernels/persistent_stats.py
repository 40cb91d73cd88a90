"""LM head -> row statistics in one persistent, TMA-fed kernel: no logit is ever stored (the ``triton-sm90`` forward).

``persistent_stats_kernel`` computes tiles of ``y = h W^T`` with ``tl.dot`` (float32 accumulation) from tiles that
TMA tensor descriptors load, and folds each tile into the online statistics of its rows in registers
(``docs/design.md``: running max ``m``, ``s = sum exp(z - m)``, ``u = sum exp(z - m) (z - m)``). What is new next to
``linear_logprob.stats_fwd_kernel`` (the ``triton-fused`` forward):

* a persistent grid: one program per SM loops over work items ``(token block, vocabulary split)``. Consecutive items
  take consecutive splits of the same token block, so the programs running at one moment share a few token blocks
  (``[BLOCK_N, H]`` each) and read neighbouring weight panels: both stay in L2 instead of every program streaming its
  own token block from HBM once per vocabulary block (what a ``(token blocks, splits)`` grid in launch order does).
* the vocabulary split across programs with a small combine step (``merge_partial_stats``: O(splits * N) floats),
  as Liger's CuTe-DSL SM90 forward does; the split count also evens out the last wave of the persistent grid.
* optionally (``STORE_EXP``) the QuACK scaled-exp layout for a one-pass loss: the epilogue also writes
  ``e = 2^(z log2(e) - k)`` in the input dtype with one power-of-two offset ``k = ceil(max_j z_j log2(e))`` per
  (row, vocabulary block), so ``e`` lies in (0, 1] and ``p = e 2^(k - lse log2(e))`` later needs one exact power of
  two per row and block. The gradient kernel (``scaled_exp_grad``) turns it into ``G`` in place: half the bytes of
  the float32 logits tile the hybrid path writes and reads, and the log-prob, log-sum-exp and entropy still come
  from the float32 statistics here (a bf16 ``e`` only feeds the gradient, which is bf16 anyway).

Warp specialisation: Triton 3.6 and 3.9 ignore ``tl.range(..., warp_specialize=True)`` on sm_90 (it only partitions
warps on sm_100; ``python -m bench sass`` and docs/gpu-map.md say how that was found), so the loads are overlapped
with the tensor cores by the software pipeline (``num_stages`` shared-memory buffers) instead of a producer warp.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fastrl.kernels.linear_logprob import (
    INTERPRET, NEG_LARGE, TensorDescriptor, dot_precision, dot_tile, interp_bf16, round_to, load_target_logit,
    transform_tile, merge_partial_stats, tma_ok, dead_rows_zero,
)
from fastrl.kernels.tuning import KernelConfig, config_for

__all__ = ["persistent_stats", "num_programs", "choose_splits", "exp_offsets_shape"]

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def persistent_stats_kernel(
    h_desc, w_desc,  # [N, H], [V, H] TMA descriptors, blocks [BLOCK_N, BLOCK_H] / [BLOCK_V, BLOCK_H]
    h_ptr, w_ptr,  # the same tensors as pointers (the target rows' gather)
    b_ptr, t_ptr,  # [V] bias (HAS_BIAS), [N] int64 targets
    part_ptr,  # [3, SPLITS, N] float32 out: m, s, u per split
    zt_ptr,  # [N] float32 out: target logit
    e_desc,  # [N, V] scaled exp out (STORE_EXP): a TMA descriptor, blocks [BLOCK_N, BLOCK_V // 2]
    k_ptr,  # [N, cdiv(V, BLOCK_V)] float32 out: the power-of-two offset of each (row, vocabulary block)
    count_ptr,  # [1] int32 (HAS_COUNT): rows [count, N) are dead (sorted last): their items are never visited
    N, V, H, n_splits, v_per_split,
    stride_hn, stride_wv, stride_k,
    logit_scale, softcap, inv_temp,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr, STORE_EXP: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, NUM_PROGS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    if HAS_COUNT:  # items are token-block major, so the live rows' items come first: the loop stops after them
        n_items = tl.cdiv(tl.minimum(tl.load(count_ptr), N), BLOCK_N) * n_splits
    else:
        n_items = tl.cdiv(N, BLOCK_N) * n_splits
    for item in tl.range(pid, n_items, NUM_PROGS):
        nb = item // n_splits
        sp = item % n_splits
        n0 = nb * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        v_start = sp * v_per_split
        v_end = tl.minimum(v_start + v_per_split, V)

        m = tl.full((BLOCK_N,), NEG_LARGE, dtype=tl.float32)
        s = tl.zeros((BLOCK_N,), dtype=tl.float32)
        u = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for v0 in range(v_start, v_end, BLOCK_V):
            y = dot_tile(h_desc, w_desc, n0, v0, N, V, H, stride_hn, stride_wv,
                          BLOCK_N, BLOCK_V, BLOCK_H, True, DOT_PRECISION, INTERP_BF16)
            offs_v = v0 + tl.arange(0, BLOCK_V)
            if HAS_BIAS:
                y += tl.load(b_ptr + offs_v, mask=offs_v < V, other=0.0).to(tl.float32)[None, :]
            # columns past the split (or past V) are NEG_LARGE: exp of them underflows to exactly 0
            z = tl.where(offs_v[None, :] < v_end, transform_tile(y, logit_scale, softcap, inv_temp, HAS_SOFTCAP),
                         NEG_LARGE)
            if STORE_EXP:
                m, s, u = _fold_tile_storing_exps(z, m, s, u, e_desc, k_ptr, n0, v0, offs_n, n_ok, stride_k,
                                                  HAS_ENTROPY, BLOCK_N, BLOCK_V, INTERP_BF16)
            else:
                m, s, u = _fold_tile(z, m, s, u, HAS_ENTROPY)

        out = sp * N + offs_n
        tl.store(part_ptr + out, m, mask=n_ok)
        tl.store(part_ptr + n_splits * N + out, s, mask=n_ok)
        if HAS_ENTROPY:
            tl.store(part_ptr + 2 * n_splits * N + out, u, mask=n_ok)

        if sp == 0:  # the target logit once per token (linear_logprob.load_target_logit: a row-wise dot)
            zt = load_target_logit(h_ptr, w_ptr, b_ptr, t_ptr, offs_n, n_ok, V, H, stride_hn, stride_wv,
                               logit_scale, softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, BLOCK_N, BLOCK_H)
            tl.store(zt_ptr + offs_n, zt, mask=n_ok)


@triton.jit
def _fold_tile(z, m, s, u, HAS_ENTROPY: tl.constexpr):
    """The running row statistics ``(m, s, u)`` with the ``[BLOCK_N, BLOCK_V]`` tile ``z`` of transformed logits
    folded in (``m`` the max, ``s = sum exp(z - m)``, ``u = sum exp(z - m) (z - m)``)."""
    m_new = tl.maximum(m, tl.max(z, axis=1))
    alpha = tl.exp(m - m_new)
    d = z - m_new[:, None]
    p = tl.exp(d)
    if HAS_ENTROPY:
        # re-base u from the old max to the new one: u' = alpha (u + (m - m_new) s)
        u = alpha * (u + (m - m_new) * s) + tl.sum(p * d, axis=1)
    s = alpha * s + tl.sum(p, axis=1)
    return m_new, s, u


@triton.jit
def _fold_tile_storing_exps(z, m, s, u, e_desc, k_ptr, n0, v0, offs_n, n_ok, stride_k,
                            HAS_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                            INTERP_BF16: tl.constexpr):
    """``_fold_tile`` that also stores the tile's scaled exps ``e`` (through ``e_desc``) and their offsets ``k``."""
    # k = ceil(max z log2 e): e = 2^(z log2 e - k) in (0, 1], exact to rescale by any power of two.
    # The same exps give the tile's statistics relative to r = k ln 2 (no second exp), merged into the
    # running ones like two vocabulary splits. Two column halves: a half-width store buffer and half
    # the temporaries at once (no register spills at 128x256, python -m bench sass).
    k = tl.math.ceil(tl.max(z, axis=1) * LOG2E)
    r = k * LN2
    z0, z1 = tl.split(tl.permute(tl.reshape(z, (BLOCK_N, 2, BLOCK_V // 2)), (0, 2, 1)))
    s_t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    u_t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for half in tl.static_range(2):
        zh = z0 if half == 0 else z1
        e = tl.exp2(zh * LOG2E - k[:, None])
        # rows and columns past N, V are clipped by the TMA store
        e_desc.store([n0, v0 + half * (BLOCK_V // 2)], round_to(e, e_desc.dtype, INTERP_BF16))
        s_t += tl.sum(e, axis=1)
        if HAS_ENTROPY:
            u_t += tl.sum(e * (zh - r[:, None]), axis=1)
    tl.store(k_ptr + offs_n.to(tl.int64) * stride_k + v0 // BLOCK_V, k, mask=n_ok)
    m_new = tl.maximum(m, r)
    alpha = tl.exp(m - m_new)
    beta = tl.exp(r - m_new)
    if HAS_ENTROPY:
        u = alpha * (u + (m - m_new) * s) + beta * (u_t + (r - m_new) * s_t)
    s = alpha * s + beta * s_t
    return m_new, s, u


def num_programs(device: torch.device, n_items: int) -> int:
    """Programs of the persistent grid: one per SM (at most one per work item); 4 under the interpreter, so
    the CPU tests run several work items per program."""
    if device.type != "cuda":
        return max(1, min(4, n_items))
    return max(1, min(torch.cuda.get_device_properties(device).multi_processor_count, n_items))


def choose_splits(n_blocks: int, v_blocks: int, programs: int) -> int:
    """Vocabulary splits per token block: at least 4 (so the programs of one moment share token blocks, see the
    module docstring) and at least enough work items for every program (few tokens: up to one split per program);
    beyond that at most 32 (the combine step reads ``3 * splits * N`` floats); in that range, the count whose last
    wave of the persistent grid is fullest."""
    lo = max(1, min(v_blocks, max(4, triton.cdiv(programs, n_blocks))))
    hi = max(lo, min(v_blocks, 32))

    def waste(s: int) -> float:
        items = n_blocks * triton.cdiv(v_blocks, triton.cdiv(v_blocks, s))
        return math.ceil(items / programs) * programs / items

    return min(range(lo, hi + 1), key=lambda s: (waste(s), s))


def exp_offsets_shape(N: int, V: int, cfg: KernelConfig) -> tuple[int, int]:
    """Shape of the ``k`` offsets of the scaled-exp layout: one per (row, vocabulary block)."""
    return N, triton.cdiv(V, cfg.block_v)


def persistent_stats(
    hidden: torch.Tensor,  # [N, H] 16-byte aligned rows (tma_ok)
    weight: torch.Tensor,  # [V, H] 16-byte aligned rows
    bias: torch.Tensor | None,  # [V] contiguous
    targets: torch.Tensor,  # [N] int64 contiguous (outside [0, V): no target logit)
    *,
    logit_scale: float,
    softcap: float | None,
    temperature: float,
    with_entropy: bool,
    exp_out: torch.Tensor | None = None,  # [N, V] hidden's dtype, 16-byte aligned rows: the scaled exps (STORE_EXP)
    k_out: torch.Tensor | None = None,  # [N, cdiv(V, BLOCK_V)] float32: their offsets
    splits: int | None = None,
    config: KernelConfig | None = None,
    live_count: torch.Tensor | None = None,  # [1] int32 on the device: rows [count, N) are dead, skipped, 0 out
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # lse [N], target logit [N], entropy [N] or None
    """Log-sum-exp, target logit and entropy of the transformed logits, with no logit stored (unless ``exp_out``
    asks for the scaled-exp tile of a one-pass loss; a dead row's exps and offsets are then left unwritten)."""
    N, H = hidden.shape
    V = weight.shape[0]
    assert TensorDescriptor is not None and tma_ok(hidden, weight) and targets.is_contiguous()
    store_exp = exp_out is not None
    if store_exp:
        assert exp_out.shape == (N, V) and exp_out.dtype == hidden.dtype and tma_ok(exp_out) and k_out is not None
    variant = dict(has_bias=bias is not None, has_softcap=softcap is not None, with_entropy=with_entropy)

    def launch(cfg: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
        n_blocks = triton.cdiv(N, cfg.block_n)
        v_blocks = triton.cdiv(V, cfg.block_v)
        progs = num_programs(hidden.device, n_blocks * v_blocks)
        n_splits = splits or choose_splits(n_blocks, v_blocks, progs)
        # each split covers a whole number of vocabulary blocks (the k offsets are per block)
        v_per_split = triton.cdiv(v_blocks, max(1, min(n_splits, v_blocks))) * cfg.block_v
        n_splits = triton.cdiv(V, v_per_split)
        progs = min(progs, n_blocks * n_splits)
        part = torch.empty((3, n_splits, N), dtype=torch.float32, device=hidden.device)
        zt = torch.empty((N,), dtype=torch.float32, device=hidden.device)
        h_desc = TensorDescriptor.from_tensor(hidden, [cfg.block_n, cfg.block_h])
        w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_v, cfg.block_h])
        e_desc = TensorDescriptor.from_tensor(exp_out, [cfg.block_n, cfg.block_v // 2]) if store_exp else h_desc
        if store_exp:
            assert k_out.shape == exp_offsets_shape(N, V, cfg) and k_out.dtype == torch.float32
        persistent_stats_kernel[(progs,)](
            h_desc, w_desc, hidden, weight, bias if bias is not None else hidden, targets,
            part, zt, e_desc, k_out if store_exp else zt, live_count if live_count is not None else targets,
            N, V, H, n_splits, v_per_split,
            hidden.stride(0), weight.stride(0), k_out.stride(0) if store_exp else 0,
            float(logit_scale), float(softcap or 1.0), 1.0 / float(temperature),
            HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_ENTROPY=with_entropy,
            STORE_EXP=store_exp, HAS_COUNT=live_count is not None, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v,
            BLOCK_H=cfg.block_h, NUM_PROGS=progs,
            DOT_PRECISION=dot_precision(hidden.dtype), INTERP_BF16=interp_bf16(hidden.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return part, zt

    cfg = config or config_for("sm90_stats", hidden.device, H=H, V=V, dtype=hidden.dtype, use_tma=True,
                               launch=None if store_exp else launch, **variant)
    part, zt = launch(cfg)
    m, s, u = part.unbind(0)
    lse, _, entropy = merge_partial_stats(m, s, u if with_entropy else None, zt[None])
    return dead_rows_zero(live_count, lse, zt, entropy)


# the interpreter flag is re-exported for the ops layer's CPU checks
__all__ += ["INTERPRET"]
