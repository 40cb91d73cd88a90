"""Per-row kept-set logits and their gradients: gather each token's kept weight rows, one dot product per id.

A kept set gives every token n its own K ids (``ids[n, k]``, padded with -1); the logits needed are only
``y[n, k] = h_n . W[ids[n, k]] (+ b[ids[n, k]])``: N K H multiply-adds, no union of ids, no [N, V] tile. Three
kernels, nothing here knows about autograd (``fastrl/ops`` orchestrates):

* ``logits_kernel``: one program per (row, block of BLOCK_K ids) walks H in BLOCK_H slices, loading the row's
  hidden slice and its BLOCK_K gathered weight rows, and keeps a [BLOCK_K, BLOCK_H] float32 accumulator reduced
  once at the end.
* ``backward_kernel``: one program per (row, H slice): ``dh_n = sum_k g[n, k] W[ids[n, k]]`` from the same gather.
* ``segment_dw_kernel``: the scatter-add ``dW[ids[n, k]] += g[n, k] h_n`` (``db`` likewise; with ``weight_rows``
  into row ``weight_rows[n, k]`` of a compact [R, H] buffer instead), a sorted segment reduction (issue 47: no
  float32 atomics anywhere in the kept path, so the gradients are deterministic by construction). The launcher
  sorts the flat (id, n, k) entries once (stable, so equal ids keep their (n, k) order); each program owns the id
  segments that *start* in its block of sorted positions and sums each one in a fixed order (within the block, then
  the tail of the block's last segment in later blocks), writing every touched ``dW`` row exactly once: two runs
  give bitwise-equal gradients. The in-block segment sums are one float32 ``tl.dot`` of a 0/1 "same segment" matrix
  with the block's contributions: a fixed order, BLOCK_E multiply-adds per element.

Why no ``tl.dot``. Per token the forward is a [K, H] x [H] matrix-vector product: every weight element loaded is
used for exactly one multiply-add (2 FLOPs per 2 bytes in bf16). Tokens share no weight rows in general (sets
drawn for different sequences share few ids), so batching rows into an M >= 16 tile for the tensor cores would
multiply by zeros, not reuse data. On paper, at N=16384, K=64, H=4096 the forward moves N K H 2 = 8.6 GB of
gathered rows for 8.6 GFLOP, 1 FLOP per byte: at an H100's 3.35 TB/s that asks ~3.4 TFLOP/s of float32 FMA units
rated ~67, so a float32 multiply-reduce is bound by memory, not arithmetic, and tensor cores could not make it
faster (not yet measured on a GPU). It is also exact where it matters: bf16 x bf16 and fp16 x fp16 products are exact in
float32, so upcasting and accumulating in float32 is the tensor cores' arithmetic (float32 inputs: IEEE products,
never TF32). The backward's dH is the same gather (K H per token). The segment dW reads each entry's hidden row again
(N K H input-dtype bytes, which atomics would not) and reads and writes each touched dW row once per segment (per
block of sorted entries it spans): no more than the N K H float32 read-modify-writes of atomics, fewer where ids
recur (Zipf sets), and no contention on a hot id.

int64 addressing: every row offset (``ids * stride``, ``n * stride``) is a 64-bit scalar or vector before it meets a
pointer, since V H and N K H exceed 2^31 at real sizes; offsets within a row stay 32-bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastrl.kernels.tuning import KernelConfig

__all__ = ["kept_rows_logits", "kept_rows_backward", "DEFAULT_CONFIGS", "KERNELS"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Launch configurations, written as KernelConfig(rows per program, ids per step, BLOCK_H, warps, stages): the
# first two fields are the per-row kernels' BLOCK_N (1: one token per program) and BLOCK_K; the segment kernel
# reads them as its block of sorted positions (BLOCK_E) and 1. A step loads BLOCK_K weight-row slices of BLOCK_H
# contiguous elements (256 bytes in bf16). The backward steps 16 ids (chosen when it also added dW with atomics,
# whose 64-bit addresses doubled its registers at 32 ids; ``python -m bench sass --only kept`` prints them).
# Candidates for a GPU tournament: tuning.CANDIDATES_BY_KERNEL["kept_logits" | "kept_backward" | "kept_segment_dw"].
DEFAULT_CONFIGS: dict[str, KernelConfig] = {
    "kept_logits": KernelConfig(1, 32, 128, 4, 2),
    "kept_backward": KernelConfig(1, 16, 128, 4, 2),
    "kept_segment_dw": KernelConfig(16, 1, 128, 4, 2),
}
KERNELS = tuple(DEFAULT_CONFIGS)


# ---------------------------------------------------------------------------------------------------------------
# Forward: y[n, k] = h_n . W[ids[n, k]] (+ b[ids[n, k]])
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def logits_kernel(
    h_ptr,  # [N, H] hidden, unit column stride
    w_ptr,  # [V, H] weight, unit column stride
    b_ptr,  # [V] bias (HAS_BIAS)
    ids_ptr,  # [N, K] int64 kept ids, negative = pad
    y_ptr,  # [N, K] float32 out
    K, H, V,
    stride_hn, stride_wv, stride_in, stride_ik, stride_yn, stride_yk,
    # Meta-parameters
    HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = rk < K
    ids = tl.load(ids_ptr + n * stride_in + rk * stride_ik, mask=k_ok, other=-1)
    # an id >= V is never read (the launcher refuses it unless told not to look; then its logit is NaN)
    live = (ids >= 0) & (ids < V)
    w_rows = w_ptr + tl.where(live, ids, 0) * stride_wv  # [BLOCK_K] 64-bit row addresses
    h_row = h_ptr + n * stride_hn
    rh = tl.arange(0, BLOCK_H)
    # a 2-D accumulator: one FMA per loaded element in the loop, one cross-lane reduction after it
    acc = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + rh
        h_ok = cols < H
        h = tl.load(h_row + cols, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows[:, None] + cols[None, :], mask=live[:, None] & h_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * h[None, :]  # exact products of bf16 / fp16 inputs
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + tl.where(live, ids, 0), mask=live, other=0.0).to(tl.float32)
    y = tl.where(live, y, tl.where(ids < 0, float("-inf"), float("nan")))
    tl.store(y_ptr + n * stride_yn + rk * stride_yk, y, mask=k_ok)


def kept_rows_logits(
    hidden: torch.Tensor,  # [N, H] float32 / bf16 / fp16
    weight: torch.Tensor,  # [V, H] hidden's dtype
    ids: torch.Tensor,  # [N, K] int64, pad = -1 (any negative id is a pad)
    bias: torch.Tensor | None = None,  # [V]
    *,
    check_ids: bool = True,  # False: no host read of ids.max() (no-sync / graph capture); an id >= V gives NaN
    config: KernelConfig | None = None,  # None: DEFAULT_CONFIGS["kept_logits"]
) -> torch.Tensor:  # [N, K] float32 raw logits, -inf at pads
    """Raw logits of each token's kept ids: ``y[n, k] = hidden[n] . weight[ids[n, k]] (+ bias[ids[n, k]])``,
    float32 products of the input dtype's values accumulated in float32; ``-inf`` where ``ids[n, k] < 0``."""
    hidden, weight = _check_inputs(hidden, weight, ids, bias, check_ids)
    N, H = hidden.shape
    V, K = weight.shape[0], ids.shape[1]
    y = torch.empty((N, K), dtype=torch.float32, device=hidden.device)
    if N == 0 or K == 0:
        return y
    cfg = config or DEFAULT_CONFIGS["kept_logits"]
    logits_kernel[(N, triton.cdiv(K, cfg.block_v))](
        hidden, weight, bias if bias is not None else hidden, ids, y,
        K, H, V,
        hidden.stride(0), weight.stride(0), ids.stride(0), ids.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, BLOCK_K=cfg.block_v, BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


# ---------------------------------------------------------------------------------------------------------------
# Backward: dh_n = sum_k g[n, k] W[ids[n, k]]; dW[ids[n, k]] += g[n, k] h_n; db[ids[n, k]] += g[n, k]
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def backward_kernel(
    g_ptr,  # [N, K] float32 dL/dy (never read at pads)
    h_ptr, w_ptr, ids_ptr,
    gh_ptr,  # [N, H] float32 out: grad of hidden
    K, H, V,
    stride_gn, stride_gk, stride_wv, stride_in, stride_ik, stride_ghn,
    # Meta-parameters
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = cols < H
    rk0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        ids = tl.load(ids_ptr + n * stride_in + rk * stride_ik, mask=rk < K, other=-1)
        live = (ids >= 0) & (ids < V)
        safe = tl.where(live, ids, 0)
        g = tl.load(g_ptr + n * stride_gn + rk * stride_gk, mask=live, other=0.0)
        w = tl.load(w_ptr + safe[:, None] * stride_wv + cols[None, :], mask=live[:, None] & h_ok[None, :], other=0.0)
        acc += g[:, None] * w.to(tl.float32)
    tl.store(gh_ptr + n * stride_ghn + cols, tl.sum(acc, axis=0), mask=h_ok)


@triton.jit
def _segment_tail(
    order_ptr, g_ptr, h_ptr, start, end, K, cols, h_ok, stride_gn, stride_gk, stride_hn,
    HAS_GW: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Sum of ``g[e] h[n_e]`` (and of ``g[e]``) over sorted positions [start, end), BLOCK_E at a time, in order."""
    re = tl.arange(0, BLOCK_E)
    acc = tl.zeros((BLOCK_E, BLOCK_H), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for e0 in range(start, end, BLOCK_E):
        e_ok = (e0 + re) < end
        flat = tl.load(order_ptr + e0 + re, mask=e_ok, other=0)
        n = flat // K
        g = tl.load(g_ptr + n * stride_gn + (flat - n * K) * stride_gk, mask=e_ok, other=0.0)
        if HAS_GW:
            h = tl.load(h_ptr + n[:, None] * stride_hn + cols[None, :], mask=e_ok[:, None] & h_ok[None, :],
                        other=0.0)
            acc += g[:, None] * h.to(tl.float32)
        acc_b += g
    return tl.sum(acc, axis=0), tl.sum(acc_b, axis=0)


@triton.jit
def segment_dw_kernel(
    order_ptr,  # [E] int64: flat entry n * K + k of each sorted position (stable sort by key)
    sid_ptr,  # [E] int64: the sorted keys, ids or grad_weight rows (pads, negative, first)
    end_ptr,  # [E] int64: one past the last sorted position holding the same key
    g_ptr, h_ptr,
    gw_ptr,  # [R, H] float32, row = key, each touched row read and written once (HAS_GW)
    gb_ptr,  # [V] float32, row = key (HAS_GB: the keys are the ids)
    E, K, H,
    stride_gn, stride_gk, stride_hn, stride_gwv,
    # Meta-parameters
    HAS_GW: tl.constexpr, HAS_GB: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    p0 = tl.program_id(0).to(tl.int64) * BLOCK_E
    pid_h = tl.program_id(1)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = cols < H
    pos = p0 + tl.arange(0, BLOCK_E)
    ok = pos < E
    sid = tl.load(sid_ptr + pos, mask=ok, other=-1)
    prev = tl.load(sid_ptr + pos - 1, mask=ok & (pos > 0), other=-1)
    nxt = tl.load(sid_ptr + pos + 1, mask=(pos + 1) < E, other=-1)
    start = (sid >= 0) & (sid != prev)
    # positions before the block's first segment start belong to a segment an earlier program owns
    owned = (tl.cumsum(start.to(tl.int32), axis=0) > 0) & ok
    last = owned & ((nxt != sid) | (pos == p0 + BLOCK_E - 1))  # a segment's last position inside this block
    flat = tl.load(order_ptr + pos, mask=owned, other=0)
    n = flat // K
    g = tl.load(g_ptr + n * stride_gn + (flat - n * K) * stride_gk, mask=owned, other=0.0)
    # the block's last segment may run on past the block: its owner sums the rest in order
    tail_start = tl.minimum(p0 + BLOCK_E, E)
    tail_end = tl.load(end_ptr + tail_start - 1)
    tail_owned = tl.max(tl.where(pos == tail_start - 1, owned.to(tl.int32), 0), axis=0) > 0
    tail_end = tl.where(tail_owned, tail_end, tail_start)
    tail, tail_b = _segment_tail(order_ptr, g_ptr, h_ptr, tail_start, tail_end, K, cols, h_ok, stride_gn, stride_gk,
                                 stride_hn, HAS_GW, BLOCK_E, BLOCK_H)
    at_tail = pos == tail_start - 1
    rows = tl.where(last, sid, 0)
    # same[i, j]: positions i and j hold one segment (the block's own): row i of same @ x is its segment's sum, in
    # the dot's fixed order. BLOCK_E multiply-adds per element, on the FMA units (IEEE float32, 0/1 weights).
    segno = tl.cumsum(start.to(tl.int32), axis=0)
    same = (segno[:, None] == segno[None, :]) & owned[None, :]
    if HAS_GW:
        h = tl.load(h_ptr + n[:, None] * stride_hn + cols[None, :], mask=owned[:, None] & h_ok[None, :], other=0.0)
        x = g[:, None] * h.to(tl.float32)
        seg = tl.dot(same.to(tl.float32), x, input_precision="ieee")
        seg = tl.where(at_tail[:, None], seg + tail[None, :], seg)
        dst = gw_ptr + rows[:, None] * stride_gwv + cols[None, :]
        m = last[:, None] & h_ok[None, :]
        tl.store(dst, tl.load(dst, mask=m, other=0.0) + seg, mask=m)
    if HAS_GB:
        if pid_h == 0:
            seg_b = tl.sum(tl.where(same, g[None, :], 0.0), axis=1)
            seg_b = tl.where(at_tail, seg_b + tail_b, seg_b)
            tl.store(gb_ptr + rows, tl.load(gb_ptr + rows, mask=last, other=0.0) + seg_b, mask=last)


def kept_rows_backward(
    grad: torch.Tensor,  # [N, K] float32 dL/dy, ignored (never read) where ids < 0
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    ids: torch.Tensor,  # [N, K] int64, pad = -1
    grad_weight: torch.Tensor | None = None,  # [V, H] float32, added to in place
    grad_bias: torch.Tensor | None = None,  # [V] float32, added to in place
    deterministic: bool = True,  # kept for callers: the weight and bias gradients are always deterministic
    *,
    weight_rows: torch.Tensor | None = None,  # [N, K] int64: grad_weight's row of each entry (default: its id)
    check_ids: bool = True,
    config: KernelConfig | None = None,  # the per-row kernel's; None: DEFAULT_CONFIGS["kept_backward"]
    segment_config: KernelConfig | None = None,  # None: DEFAULT_CONFIGS["kept_segment_dw"]
) -> torch.Tensor:  # [N, H] float32 grad of hidden
    """Gradients of :func:`kept_rows_logits`: returns ``dh[n] = sum_k grad[n, k] weight[ids[n, k]]`` and adds
    ``grad[n, k] hidden[n]`` into ``grad_weight[ids[n, k]]`` (``grad[n, k]`` into ``grad_bias[ids[n, k]]``) when
    given: the entries sorted by id once, each id's contributions summed in a fixed order and its row written once (no
    atomics: bitwise-reproducible whatever ``deterministic`` says).

    ``weight_rows`` redirects the weight gradient: ``grad_weight[weight_rows[n, k]] += grad[n, k] hidden[n]``, with
    ``grad_weight`` any ``[R, H]`` float32 buffer (e.g. one row per distinct kept id instead of a [V, H] one); the
    bias gradient stays indexed by the ids."""
    hidden, weight = _check_inputs(hidden, weight, ids, None, check_ids)
    _check_grads(grad, grad_weight, grad_bias, hidden, weight, ids, weight_rows, check_ids)
    N, H = hidden.shape
    V, K = weight.shape[0], ids.shape[1]
    grad_hidden = torch.empty((N, H), dtype=torch.float32, device=hidden.device)
    if N == 0 or H == 0:
        return grad_hidden
    cfg = config or DEFAULT_CONFIGS["kept_backward"]
    backward_kernel[(N, triton.cdiv(H, cfg.block_h))](
        grad, hidden, weight, ids, grad_hidden, K, H, V,
        grad.stride(0), grad.stride(1), weight.stride(0), ids.stride(0), ids.stride(1), grad_hidden.stride(0),
        BLOCK_K=cfg.block_v, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    gw, gb, rows = grad_weight, grad_bias, weight_rows
    if K > 0 and (gw is not None or gb is not None):
        seg_cfg = segment_config or DEFAULT_CONFIGS["kept_segment_dw"]
        if rows is not None and gw is not None:  # the weight gradient's segments are its rows, the bias's the ids
            _segment_scatter(grad, hidden, rows.masked_fill(ids < 0, -1), gw, None, seg_cfg)
            gw = None
        if gw is not None or gb is not None:
            _segment_scatter(grad, hidden, ids, gw, gb, seg_cfg)
    return grad_hidden


def _segment_scatter(grad, hidden, keys, gw, gb, cfg: KernelConfig) -> None:
    """The deterministic dW / db: a stable sort of the flat keys (the ids, or grad_weight's rows; negative: none)
    with no host read, then ``segment_dw_kernel`` writes each key's row once."""
    N, K = keys.shape
    H = hidden.shape[1]
    E = N * K
    sid, order = torch.sort(keys.reshape(E), stable=True)
    end = torch.searchsorted(sid, sid, right=True)
    block_e = cfg.block_n
    h_blocks = triton.cdiv(H, cfg.block_h) if gw is not None else 1
    dummy = sid.new_empty(0, dtype=torch.float32)
    segment_dw_kernel[(triton.cdiv(E, block_e), h_blocks)](
        order, sid, end, grad, hidden,
        gw if gw is not None else dummy, gb if gb is not None else dummy,
        E, K, H,
        grad.stride(0), grad.stride(1), hidden.stride(0), gw.stride(0) if gw is not None else 0,
        HAS_GW=gw is not None, HAS_GB=gb is not None, BLOCK_E=block_e, BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


# ---------------------------------------------------------------------------------------------------------------
# Input checks (before any launch)
# ---------------------------------------------------------------------------------------------------------------

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _unit_columns(x: torch.Tensor) -> torch.Tensor:
    # the kernels read rows with unit column stride (coalesced); any row stride is fine
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _check_inputs(hidden, weight, ids, bias, check_ids: bool):
    for name, x in (("hidden", hidden), ("weight", weight), ("ids", ids)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor, got {_describe(x)}")
    if hidden.dtype not in _FLOATS or weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share one dtype of {_names(_FLOATS)}, got {hidden.dtype} and "
                        f"{weight.dtype}")
    if ids.dtype != torch.int64:
        raise TypeError(f"ids must be int64, got {ids.dtype}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] must share H, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"ids must be [N, K] with hidden's N = {hidden.shape[0]}, got {tuple(ids.shape)}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],) or not bias.is_floating_point():
            raise ValueError(f"bias must be a floating [V] = [{weight.shape[0]}] tensor, got {_describe(bias)}")
        _same_device(hidden, bias=bias)
    _same_device(hidden, weight=weight, ids=ids)
    if hidden.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"the kept-row kernels run on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got "
                         f"hidden on {hidden.device}")
    if check_ids and ids.numel():
        top = int(ids.max())  # a host read: the no-sync path passes check_ids=False
        if top >= weight.shape[0]:
            raise ValueError(f"ids must lie in [0, V) = [0, {weight.shape[0]}) or be negative (pad), got an id {top}")
    return _unit_columns(hidden), _unit_columns(weight)


def _check_grads(grad, grad_weight, grad_bias, hidden, weight, ids, weight_rows, check_ids: bool) -> None:
    if not isinstance(grad, torch.Tensor) or grad.shape != ids.shape or grad.dtype != torch.float32:
        raise ValueError(f"grad must be a float32 tensor shaped like ids {tuple(ids.shape)}, got {_describe(grad)}")
    V, H = weight.shape
    R = V
    if weight_rows is not None:
        rows = weight_rows
        if not isinstance(rows, torch.Tensor) or rows.shape != ids.shape or rows.dtype != torch.int64:
            raise ValueError(f"weight_rows must be an int64 tensor shaped like ids {tuple(ids.shape)}, got "
                             f"{_describe(weight_rows)}")
        _same_device(hidden, weight_rows=weight_rows)
        R = grad_weight.shape[0] if isinstance(grad_weight, torch.Tensor) and grad_weight.dim() == 2 else R
        if check_ids and weight_rows.numel():
            kept = weight_rows[ids >= 0]
            if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= R):  # host reads, as for ids
                raise ValueError(f"weight_rows must lie in [0, {R}) (grad_weight's rows) where ids are kept, got "
                                 f"[{int(kept.min())}, {int(kept.max())}]")
    for name, x, shape in (("grad_weight", grad_weight, (R, H)), ("grad_bias", grad_bias, (V,))):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype != torch.float32:
            raise ValueError(f"{name} must be a float32 tensor of shape {shape}, got {_describe(x)}")
        if x.stride(-1) != 1 and x.shape[-1] > 1:
            raise ValueError(f"{name} is added to in place and must have a unit last stride, got strides {x.stride()}")
        _same_device(hidden, **{name: x})
    _same_device(hidden, grad=grad)


def _same_device(hidden, **tensors) -> None:
    for name, x in tensors.items():
        if x.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}, got {x.device}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)
