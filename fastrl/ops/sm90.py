"""The ``triton-sm90`` backend: persistent TMA kernels that never store a logit, with cuBLAS gradient GEMMs.

* statistics (path C, and path A's forward): one launch of ``fastrl.kernels.persistent_stats`` over all tokens and
  the whole vocabulary (split across programs, then a small combine): no logits tile at all, O(splits * N) floats.
* path A's backward: vocabulary slices of ``G = dL/dy`` from ``fastrl.kernels.persistent_grad`` (recomputed logits,
  ``G`` formed in registers and stored once in the input dtype), each consumed by the two gradient GEMMs of
  ``fastrl.ops.hybrid.sliced_backward`` (the same accumulation as the hybrid backend: ``grad_W`` slices written once,
  ``grad_h`` accumulated in float32). The slices are as wide as 1/128 of the device's memory allows
  (``fastrl.ops.budget.grad_columns``): each costs one read and write of the float32 ``[N, H]`` accumulator.
* the one-pass policy loss (its engine, ``fastrl.ops.one_pass``): ``chunk_stats`` runs the same forward kernel with
  the QuACK scaled-exp layout (``e = 2^(z log2(e) - k)`` in the input dtype, one power-of-two ``k`` per row and vocabulary
  block) into a ``[chunk, V]`` tile, and ``chunk_grad`` turns that tile into ``G`` in place: half the bytes of the
  hybrid path's float32 logits tile, written and read once less. The chunks are as long as 1/16 of the device's
  memory allows (``fastrl.ops.budget.one_pass_rows``): W1 in one chunk on an 80 GB device, whose ``grad_W`` is then
  one GEMM written once instead of a float32 ``[V, H]`` accumulator read and written per chunk (5 GB each at W1).

Requirements, checked before any launch (``check_tensors``): TMA (CUDA compute capability 9.0 or newer, or Triton's
interpreter on CPU tensors) and 16-byte aligned rows (``H`` a multiple of 8 in bf16/fp16, of 4 in float32). Nothing
falls back silently: ``backend="triton-sm90"`` on an older GPU or with unaligned tensors raises and names the backends
that run there (``backend="triton"`` or ``"triton-fused"``). ``backend="auto"`` never picks this backend: only a
committed GPU measurement may make it a default. Deterministic: no atomics, a fixed reduction order per launch
configuration. The statistics' vocabulary split count follows N (``choose_splits``: enough work items for every
program), so a token's log-prob changes in its last bits with the batch; in the batch-invariant mode
(``fastrl.set_batch_invariant``) it is ``fastrl.ops.config.INVARIANT_SPLITS`` whatever N, a function of V alone (each row block's
programs are independent and the splits merge in a fixed order, so the rows are then batch invariant).
"""

from __future__ import annotations

import torch

from fastrl.kernels import persistent_grad as PG
from fastrl.kernels import persistent_stats as PS
from fastrl.kernels.linear_logprob import tma_ok
from fastrl.kernels.tuning import KernelConfig, config_for
from fastrl.ops.config import LogitTransform, invariant_splits
from fastrl.ops.budget import grad_columns, memory_budget
from fastrl.ops.hybrid import MAX_ROWS, sliced_backward

__all__ = ["NAME", "check_tensors", "supports_width", "linear_stats", "linear_backward", "ExpTile", "chunk_stats", "chunk_grad"]

NAME = "triton-sm90"


def check_tensors(*tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless TMA descriptors can address every one of these 2-D tensors."""
    t0 = tensors[0]
    if t0.device.type == "cuda" and torch.cuda.get_device_capability(t0.device)[0] < 9:
        major, minor = torch.cuda.get_device_capability(t0.device)
        raise RuntimeError(f"backend {NAME!r} needs TMA (compute capability 9.0 or newer: H100, H200, B200), got "
                           f"sm_{major}{minor}; use backend 'triton' or 'triton-fused'")
    if PS.TensorDescriptor is None:
        raise RuntimeError(f"backend {NAME!r} needs Triton's tensor descriptors (Triton >= 3.4)")
    for t in tensors:
        if not tma_ok(t):
            raise ValueError(
                f"backend {NAME!r} loads tiles through TMA, which needs unit column stride and rows of a multiple of "
                f"16 bytes on a 16-byte aligned base; got a {tuple(t.shape)} {t.dtype} tensor with strides {t.stride()} "
                f"(for bf16/fp16 the hidden size must be a multiple of 8, for float32 of 4); use backend 'triton'"
            )


def supports_width(H: int, dtype: torch.dtype) -> bool:
    """Whether contiguous ``[*, H]`` tensors of ``dtype`` have the 16-byte rows TMA needs (else ``check_tensors``
    refuses them)."""
    return H * torch.empty((), dtype=dtype).element_size() % 16 == 0


def _tf_kw(tf: LogitTransform) -> dict:
    return dict(logit_scale=tf.logit_scale, softcap=tf.softcap, temperature=tf.temperature)


def linear_stats(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V] contiguous
    targets: torch.Tensor,  # [N] int64 contiguous
    tf: LogitTransform,
    with_entropy: bool,
    live_count: torch.Tensor | None = None,  # [1] int32 on the device: rows [count, N) dead (sorted last), skipped
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # lse [N], target logit [N], entropy [N] | None
    check_tensors(hidden, weight)
    return PS.persistent_stats(hidden, weight, bias, targets, with_entropy=with_entropy, live_count=live_count,
                               splits=invariant_splits(),
                               **_tf_kw(tf))


def linear_backward(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V] contiguous
    targets: torch.Tensor,  # [N] int64
    lse: torch.Tensor,  # [N] float32
    entropy: torch.Tensor | None,  # [N] float32
    grad_logp: torch.Tensor | None,  # [N] float32, zero where no gradient flows
    grad_entropy: torch.Tensor | None,  # [N] float32
    tf: LogitTransform,
    need: tuple[bool, bool, bool],  # (hidden, weight, bias)
    vocab_chunk: int | None = None,
    live_count: torch.Tensor | None = None,  # [1] int32 on the device: rows [count, N) dead (sorted last): G = 0
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # grad_h, grad_W, grad_b
    """Gradients of ``sum(grad_logp * logp + grad_entropy * entropy)`` (path A): ``G`` slices from recomputed tiles
    (with ``live_count``, the dead row blocks' ``G`` stored as zeros without their GEMM; the cuBLAS GEMMs still see
    every row)."""
    check_tensors(hidden, weight)
    N = hidden.shape[0]
    V = weight.shape[0]
    rows = min(max(N, 1), MAX_ROWS)
    # G slices sized by the device's memory (budget's sm90-grad row, whole 256-column blocks): grad_h's float32
    # [N, H] accumulator is read and written once per slice (38 slices at W1 with the hybrid row, 8 on 80 GB)
    cap = memory_budget(N, V, hidden.shape[1], hidden.dtype, hidden.device, need[1], need[0])
    cols = vocab_chunk or grad_columns(rows, V, hidden.dtype, hidden.device, budget=cap, H=hidden.shape[1],
                                       need_hidden=need[0])
    cols = max(1, min(int(cols), V))
    # G in the input dtype; a row stride of whole 256-column blocks keeps every row 16-byte aligned for the TMA store
    buf = torch.empty((rows, -(-cols // 256) * 256), dtype=hidden.dtype, device=hidden.device)

    def part(x, n0, n1):
        return None if x is None else x[n0:n1]

    def count_from(n0: int) -> torch.Tensor | None:  # the live count of the row chunk starting at n0 (device op)
        return live_count if live_count is None or n0 == 0 else (live_count - n0).clamp_(min=0)

    def tile_grad(n0: int, n1: int, v0: int, v1: int) -> torch.Tensor:
        return PG.persistent_grad_block(
            hidden[n0:n1], weight[v0:v1], part(bias, v0, v1), targets[n0:n1], v0, lse[n0:n1],
            part(entropy, n0, n1), part(grad_logp, n0, n1), part(grad_entropy, n0, n1), buf[: n1 - n0, : v1 - v0],
            live_count=count_from(n0), **_tf_kw(tf),
        )

    return sliced_backward(hidden, weight, bias, need, rows, cols, tile_grad)


class ExpTile:
    """The one-pass loss's ``[chunk, V]`` tile of scaled exps (input dtype, 16-byte aligned rows) and its offsets."""

    def __init__(self, rows: int, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 tf: LogitTransform, with_entropy: bool = True):
        check_tensors(hidden, weight)
        V = weight.shape[0]
        pad = 16 // hidden.element_size()
        self.config: KernelConfig = config_for(
            "sm90_exp_stats", hidden.device, H=hidden.shape[1], V=V, dtype=hidden.dtype, use_tma=True,
            has_bias=bias is not None, has_softcap=tf.softcap is not None, with_entropy=with_entropy)
        self.e = torch.empty((rows, -(-V // pad) * pad), dtype=hidden.dtype, device=hidden.device)
        self.k = torch.empty(PS.exp_offsets_shape(rows, V, self.config), dtype=torch.float32, device=hidden.device)
        self.V = V


def chunk_stats(
    tile: ExpTile,
    h_c: torch.Tensor,  # [n, H] a chunk of tokens
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    t_c: torch.Tensor,  # [n] int64
    tf: LogitTransform,
    live_count: torch.Tensor | None = None,  # [1] int32 on the device: rows [count, n) dead (sorted last), skipped
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # lse [n], target logit [n], entropy [n]
    """The chunk's statistics, leaving its scaled exps in ``tile`` for ``chunk_grad`` (a dead row's are not written:
    its incoming gradient is 0, and ``chunk_grad`` writes exact zeros where it is)."""
    n = h_c.shape[0]
    check_tensors(h_c)
    return PS.persistent_stats(h_c, weight, bias, t_c, with_entropy=True, exp_out=tile.e[:n, : tile.V],
                               k_out=tile.k[:n], config=tile.config, live_count=live_count,
                               splits=invariant_splits(), **_tf_kw(tf))


def chunk_grad(
    tile: ExpTile,
    t_c: torch.Tensor,  # [n] int64
    zt: torch.Tensor,  # [n] float32 target logit (from chunk_stats)
    lse: torch.Tensor,  # [n] float32
    entropy: torch.Tensor,  # [n] float32
    grad_logp: torch.Tensor | None,  # [n] float32
    grad_entropy: torch.Tensor | None,  # [n] float32
    tf: LogitTransform,
) -> torch.Tensor:  # [n, V] G = dL/dy in the input dtype, written over the tile's exps
    n = t_c.shape[0]
    return PG.scaled_exp_grad(tile.e[:n, : tile.V], tile.k[:n], tile.config.block_v, t_c, 0, zt, lse, entropy,
                              grad_logp, grad_entropy, **_tf_kw(tf))
