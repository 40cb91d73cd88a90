"""``fused_divergence`` on ``triton-sm90``: both heads' tiles in registers (``kernels/persistent_divergence``).

The same interface as ``fastrl.ops.divergence_hybrid`` (``forward`` / ``backward`` over ``fastrl.ops.config.Head``s
whose ``h`` keeps the input dtype), without its two float32 logits tiles: the statistics and the JSD pass compute both
heads' logits with ``tl.dot`` and fold them in registers; the backward recomputes them per vocabulary slice, stores
only the student's ``G`` (input dtype) and hands it to ``fastrl.ops.hybrid.sliced_backward``'s cuBLAS GEMMs. Tensors
must be TMA-addressable (``fastrl.ops.sm90.check_tensors``); the kept-set path (``support=``) runs on the torch
implementation, as on every backend.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fastrl.kernels import persistent_divergence as PD
from fastrl.kernels.tuning import KernelConfig, config_for
from fastrl.ops import hybrid
from fastrl.ops.config import invariant_splits
from fastrl.ops.divergence_stats import JSD, finish_stats
from fastrl.ops.sm90 import check_tensors

__all__ = ["forward", "backward"]


def _config(student, teacher) -> KernelConfig:
    h = student.h
    return config_for("sm90_div", h.device, H=h.shape[1], V=student.weight.shape[0], dtype=h.dtype, use_tma=True,
                      has_bias=student.bias is not None or teacher.bias is not None,
                      has_softcap=student.tf.softcap is not None or teacher.tf.softcap is not None)


def forward(student, teacher, opts, mode: int):
    """(divergence, entropy | None, lse_s, lse_t, aux) [N] float32, as ``divergence_hybrid.forward``."""
    check_tensors(student.h, student.weight, teacher.h, teacher.weight)
    cfg = _config(student, teacher)
    splits = invariant_splits()  # fixed in the batch-invariant mode, else chosen for N
    stats = PD.div_stats(student, teacher, mode, opts.with_entropy, cfg, splits)
    div, entropy, lse_s, lse_t = finish_stats(stats, mode, opts.with_entropy)
    if mode != JSD:  # a KL: it is also what the backward needs
        return div, entropy, lse_s, lse_t, div
    kl_sm, kl_tm = PD.div_jsd(student, teacher, lse_s.contiguous(), lse_t.contiguous(), opts.beta, cfg, splits)
    return opts.beta * kl_tm + (1.0 - opts.beta) * kl_sm, entropy, lse_s, lse_t, kl_sm


def backward(student, teacher, opts, mode: int, lse_s, lse_t, aux, entropy, grad_div, grad_ent, need):
    """Student gradients (hidden, weight, bias), vocabulary-sliced by ``hybrid.sliced_backward``."""
    check_tensors(student.h, student.weight, teacher.h, teacher.weight)
    h = student.h
    N, V = h.shape[0], student.weight.shape[0]
    cfg = _config(student, teacher)
    rows = min(max(N, 1), hybrid.MAX_ROWS)
    cols = hybrid.tile_columns(rows, V)  # the log-prob path's slice rule: one G tile alive, not two float32 tiles
    buf = torch.empty((rows, -(-cols // 256) * 256), dtype=h.dtype, device=h.device)

    def part(x, n0, n1):
        return None if x is None else x[n0:n1].contiguous()

    def tile_grad(n0: int, n1: int, v0: int, v1: int) -> torch.Tensor:
        s = SimpleNamespace(h=h[n0:n1], weight=student.weight, bias=student.bias, tf=student.tf)
        t = SimpleNamespace(h=teacher.h[n0:n1], weight=teacher.weight, bias=teacher.bias, tf=teacher.tf)
        return PD.div_grad_block(s, t, v0, v1, part(lse_s, n0, n1), part(lse_t, n0, n1), part(aux, n0, n1),
                                 part(entropy, n0, n1), part(grad_div, n0, n1), part(grad_ent, n0, n1), mode,
                                 opts.beta, buf[: n1 - n0, : v1 - v0], cfg)

    return hybrid.sliced_backward(h, student.weight, student.bias, need, rows, cols, tile_grad)
