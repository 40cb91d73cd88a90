"""Fused divergence between two LM heads (student and teacher): the public function ``fused_divergence``.

Per token, student ``p_s = softmax(z_s)`` and teacher ``p_t = softmax(z_t)``, each from its own hidden state and
head (``z = softcap(scale * (h W^T + b)) / T``, the same transform as ``fused_logprobs``; the hidden widths may
differ, the vocabulary may not). ``beta`` picks the divergence, exactly as TRL 1.16's ``DistillationTrainer``:

* ``beta = 0``: forward KL(p_t || p_s) = sum p_t (z_t - z_s) - lse_t + lse_s
* ``beta = 1``: reverse KL(p_s || p_t) = sum p_s (z_s - z_t) - lse_s + lse_t
* ``0 < beta < 1``: the generalized JSD ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)``, ``m = (1-beta) p_s + beta p_t``

The layers, imports running downward: this module checks the inputs once and builds one frozen
``DivergencePlan`` (the op's options, backend included, the rows it computes, the kept-set engine's plan);
``fastrl.ops.divergence_op`` holds the ``torch.library`` ops that run it (autograd and ``torch.compile`` see them);
the backends compute: ``divergence_torch`` (PyTorch tiles, the CPU default), ``divergence_hybrid`` and
``divergence_sm90`` (the Triton backends) and, with ``support=`` (a ``KeptSet``), ``divergence_kept`` on the
kept-set engine (both distributions renormalised over each token's kept ids, never a pass over the vocabulary: on
the per-row plan ``K_max`` logits per token and head; docs/kept-set-costs.md, the bounds of every plan).
The math of the passes (online statistics, the student's ``G = dD/dy``) is written out in ``divergence_torch``'s
docstring and in docs/design.md, "Divergences".

In eager, ``fused_divergence`` drops masked tokens before the op (one host sync) and plans the support on the host;
while ``torch.compile`` traces (or with ``host_sync=False``) it hands the op every row and the mask (``active``):
masked rows are computed with both models' hidden states replaced by zeros and give 0 and no gradient, and a
support runs on a plan chosen without host reads. So ``fullgraph=True`` and ``dynamic=True`` trace it with no graph
break, and the no-sync op reads nothing on the host, with or without a support (CUDA-graph safe).

``DivergenceOptions``, ``divergence_op`` and ``divergence_backward_op`` (``fastrl.ops.divergence_op``) are
re-exported here, at the import paths they had; the torch backend's ``divergence_forward`` / ``divergence_backward``
moved to ``fastrl.ops.divergence_torch``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from fastrl.ops._checks import (
    autocast_inputs, check_divergence_finite, check_head, check_triton_dtypes, compact_rows, dense_bias, token_name,
    unit_stride,
)
from fastrl.ops.backend import resolve_backend
from fastrl.ops.config import LogitTransform, is_finite_number
from fastrl.ops.custom_ops import host_sync_enabled
from fastrl.ops.sharded import is_vocab_sharded
from fastrl.ops.divergence_op import DivergenceOptions, divergence_backward_op, divergence_op
from fastrl.ops.support import KeptSet

__all__ = ["fused_divergence", "check_divergence_finite", "DivergencePlan", "plan_divergence", "run_divergence",
           "DivergenceOptions",
           "divergence_op", "divergence_backward_op"]


@dataclass(frozen=True)
class DivergencePlan:
    """What ``fused_divergence`` checked and chose, once; the op runs it and checks nothing again."""

    opts: DivergenceOptions  # the op's scalar options: beta, both transforms, the concrete backend, kept-set bounds
    lead: tuple[int, ...]  # hidden's leading shape: the outputs' shape
    sync: bool  # the host may be read (eager): masked rows dropped, the support planned on the host
    active: torch.Tensor | None  # [N] bool: the counted tokens (None: every token counts)
    rows: torch.Tensor | None  # [A] int64: the rows the op computes when masked ones were dropped (None: all N)
    support: KeptSet | None  # over the rows the op computes
    kept: list[int]  # the kept-set engine's plan argument (``fastrl.ops.kept.build_plan(...).arg()``; [] without)

    @property
    def n_tokens(self) -> int:
        return math.prod(self.lead)


# ---------------------------------------------------------------------------------------------------------
# the checks (each error names the argument, what was expected and what came)
# ---------------------------------------------------------------------------------------------------------


def _finite_number(v) -> bool:
    """A real number (not a bool) that is finite (``config.is_finite_number``: safe on symbolic floats)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and is_finite_number(v)


def _check_number(name: str, v, lo: float | None = None, hi: float | None = None) -> None:
    if not _finite_number(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v!r}")


def _transform(temperature, logit_scale, softcap, prefix: str) -> LogitTransform:
    """A LogitTransform whose errors name the caller's argument (``teacher_logit_scale``, ...)."""
    for name, v in (("logit_scale", logit_scale), ("softcap", softcap)):
        if name == "softcap" and v is None:
            continue
        if not _finite_number(v) or v <= 0:
            raise ValueError(f"{prefix}{name} must be {'None or ' if name == 'softcap' else ''}a finite number > 0, "
                             f"got {v!r}")
    return LogitTransform(temperature=temperature, logit_scale=logit_scale, softcap=softcap)


def _check_heads(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias) -> tuple[int, ...]:
    """Both heads' inputs (one vocabulary, one leading shape, one device); returns the leading shape."""
    check_head(hidden, weight, bias, hidden_name="hidden", weight_name="weight", bias_name="bias")
    tw = teacher_weight
    if isinstance(tw, torch.Tensor) and tw.dim() == 2 and tw.shape[0] != weight.shape[0]:
        raise ValueError(f"the vocabularies differ: weight has V = {weight.shape[0]} rows, teacher_weight "
                         f"{teacher_weight.shape[0]}; the divergence compares distributions over one vocabulary")
    check_head(teacher_hidden, teacher_weight, teacher_bias, hidden_name="teacher_hidden",
               weight_name="teacher_weight", bias_name="teacher_bias")
    lead = tuple(hidden.shape[:-1])
    if tuple(teacher_hidden.shape[:-1]) != lead:
        raise ValueError(f"teacher_hidden must have hidden's leading shape {lead}, got "
                         f"{tuple(teacher_hidden.shape[:-1])}")
    if teacher_hidden.device != hidden.device:
        raise ValueError(f"teacher and student must be on one device, got hidden on {hidden.device} and "
                         f"teacher_hidden on {teacher_hidden.device}")
    return lead


def _check_mask(mask, lead: tuple[int, ...], device: torch.device, sync: bool) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if tuple(mask.shape) != lead:
        raise ValueError(f"mask must have hidden's leading shape {lead}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"mask must be on hidden's device {device}, got {mask.device}")
    if mask.dtype != torch.bool and sync:  # under compile: skipped (any nonzero value counts)
        odd = (mask != 0) & (mask != 1)
        if bool(odd.any()):
            pos = tuple(int(i) for i in odd.nonzero()[0])
            raise ValueError(f"mask must be bool or hold only 0 and 1, got {mask[pos].item()} at position {pos}: "
                             "it selects tokens, it does not weight them")


def _check_support(support, V: int, lead: tuple[int, ...], device: torch.device, active: torch.Tensor | None,
                   sync: bool) -> KeptSet | None:
    """The support checked against the heads (and, where the host may be read, non-empty at every counted token),
    on ``device``."""
    if support is None:
        return None
    if not isinstance(support, KeptSet):
        raise TypeError(f"support must be a fastrl.KeptSet or None, got {type(support).__name__}")
    if support.vocab_size != V:
        raise ValueError(f"support has vocab_size {support.vocab_size}, the heads have V = {V}")
    N = math.prod(lead)
    if len(support) != N:
        raise ValueError(f"support has {len(support)} tokens, expected one per token of the leading shape {lead} "
                         f"({N})")
    support = support.to(device)
    if sync:  # the no-sync op gives NaN there instead
        empty = support.sizes() == 0
        if active is not None:
            empty &= active
        if bool(empty.any()):
            raise ValueError(f"support is empty at counted {token_name(int(empty.nonzero()[0, 0]), lead)}: every "
                             "counted token must keep at least one id")
    return support


def _backend_name(hidden: torch.Tensor, teacher_hidden: torch.Tensor, backend: str | None) -> str:
    name = resolve_backend(hidden.device, backend)
    check_triton_dtypes(name, hidden.dtype, teacher_hidden.dtype)
    return name


# ---------------------------------------------------------------------------------------------------------
# the plan and its run
# ---------------------------------------------------------------------------------------------------------


def plan_divergence(opts: DivergenceOptions, lead: tuple[int, ...], sync: bool, active: torch.Tensor | None,
                    support: KeptSet | None, V: int, device: torch.device) -> DivergencePlan:
    """The rows the op computes (eager: the counted ones, one host sync; under compile every row, the op zeroes the
    masked ones: no data-dependent shape) and the kept-set engine's plan for them."""
    rows = compact_rows(active) if sync and active is not None else None
    if rows is not None and support is not None:
        support = support[rows]
    kept = []
    if support is not None:
        from fastrl.ops import kept as kept_engine

        choice = kept_engine.build_plan(support, V, device, sync)
        kept = choice.arg()
        opts = dataclasses.replace(opts, tile_elems=choice.tile_elems, cap=choice.cap)
    return DivergencePlan(opts, lead, sync, active, rows, support, kept)


def run_divergence(plan: DivergencePlan, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias):
    """(divergence [N], entropy [N] | None) of every token: the op on the plan's rows, scattered back. The inputs
    are checked, autocast applied and both biases dense (``dense_bias``); the teacher's are read detached."""
    h = unit_stride(hidden.reshape(-1, hidden.shape[-1]))
    ht = unit_stride(teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]))
    w, wt = unit_stride(weight), unit_stride(teacher_weight.detach())
    b, bt = bias, None if teacher_bias is None else teacher_bias.detach()
    idx, support = plan.rows, plan.support
    if idx is not None:
        h, ht = h.index_select(0, idx), ht.index_select(0, idx)
    # autograd (when an input needs grad) is the op's registered backward; under no_grad the forward alone runs
    div, ent, *_ = torch.ops.fastrl.divergence(
        h, w, b, ht, wt, bt, None if plan.sync else plan.active, None if support is None else support.ids,
        None if support is None else support.offsets, plan.kept, *plan.opts.pack())
    ent = ent if plan.opts.with_entropy else None
    if idx is not None:
        N = plan.n_tokens
        div = div.new_zeros((N,)).index_copy(0, idx, div)
        ent = None if ent is None else ent.new_zeros((N,)).index_copy(0, idx, ent)
    return div, ent


# ---------------------------------------------------------------------------------------------------------
# the public function
# ---------------------------------------------------------------------------------------------------------


def fused_divergence(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]: the student's last hidden states
    weight: torch.Tensor,  # [V, H]: the student's LM head
    teacher_hidden: torch.Tensor,  # [N, H_t] or [B, T, H_t]
    teacher_weight: torch.Tensor,  # [V, H_t]
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,  # [V]
    teacher_bias: torch.Tensor | None = None,  # [V]
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    mask: torch.Tensor | None = None,  # hidden's leading shape; 0 / False: the token does not count
    with_entropy: bool = False,
    check_finite: bool = True,
    backend: str | None = None,
    support: KeptSet | None = None,
    host_sync: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token divergence between the student's and the teacher's next-token distributions, without logits.

    ``beta=0``: KL(teacher || student) (forward KL); ``beta=1``: KL(student || teacher) (reverse KL, the exact
    per-token KL to a reference policy); ``0 < beta < 1``: TRL 1.16's generalized JSD, ``beta KL(p_t || m) +
    (1 - beta) KL(p_s || m)`` with ``m = (1 - beta) p_s + beta p_t``. Each model's distribution is
    ``softmax(softcap(scale * (h W^T + b)) / temperature)`` with its own scale and softcap (TRL's order); no
    ``temperature**2`` factor, as TRL.

    Args:
        hidden, weight, bias: the student (float32/bf16/fp16/float64; one dtype and device). Gradients flow to
            these three. Under tensor parallelism either weight (or both) may be a ``DTensor`` placed ``Shard(0)`` on
            a 1-D mesh (``fastrl.ops.sharded_divergence``; eager only, no support; docs/scaling-out.md).
        teacher_hidden, teacher_weight, teacher_bias: the teacher, with its own hidden width ``H_t`` and the same
            vocabulary ``V`` and leading shape. It gets no gradient (its tensors are read detached).
        beta: in [0, 1]. temperature: > 0, divides both models' logits.
        mask: hidden's leading shape, bool or 0/1 of any dtype (nonzero = counted). Masked tokens give 0 and no
            gradient; in eager they are never computed (dropped first, one host sync).
        with_entropy: also return the student's entropy (differentiable).
        check_finite: raise ``FloatingPointError`` naming the first counted token whose divergence or entropy is
            not finite and the input at fault (eager only: skipped while ``torch.compile`` traces).
        backend: as ``fused_logprobs`` ("torch", the CPU default; "triton" / "triton-hybrid", the CUDA default:
            cuBLAS float32 tiles of both heads and one Triton pass over the pair, ``divergence_hybrid``;
            "triton-fused" runs the hybrid kernels too; "triton-sm90", opt-in on Hopper or newer: persistent TMA
            kernels with both heads' tiles in registers, ``divergence_sm90``). With ``support`` the kept-set engine
            runs (its per-row plan on Triton kernels on a Triton backend where they are installed).
        support: a ``fastrl.KeptSet`` (one row per token of the leading shape, masked tokens included): both
            distributions renormalised over each token's kept ids (the exact KL under a truncating sampler), on the
            kept-set engine (``fastrl.ops.kept``), never a pass over the vocabulary (the logits it computes per
            token: below).
        host_sync: whether the op may read device values on the host. None (default): yes in eager, no while
            ``torch.compile`` traces. False (the no-sync path, for ``torch.compile`` and CUDA graphs): masked tokens
            are computed with zeroed hidden states instead of being dropped on a device or with a support (on CPU
            tensors the op computes the live rows alone: docs/compile.md), a support runs on a plan chosen
            without host reads (the per-row plan unless the set says it overlaps), and the checks that need the host
            are skipped (the mask's 0/1 check, ``check_finite``; an empty support at a counted token gives a NaN
            divergence there instead of an exception).

    Returns:
        ``divergence`` of ``mask``'s shape (hidden's leading shape without a mask), float32 (float64 for float64
        inputs); ``(divergence, entropy)`` with ``with_entropy=True``.

    Under ``torch.compile``: one custom op (``torch.ops.fastrl.divergence``, its backward
    ``fastrl::divergence_backward``), traced with ``fullgraph=True`` and ``dynamic=True`` with no graph break, with
    or without a support. While compiling it takes the no-sync path (``host_sync``): nothing reads the host, so the
    compiled op is CUDA-graph capturable. Double backward (``create_graph=True``) raises
    ``fastrl.ops.custom_ops.DoubleBackwardError``.

    Memory beyond inputs and outputs: O(N) statistics plus bounded tiles of each model (no ``[N, V]``, no float32
    ``[V, H]``). Cost: the KLs 2N(H+H_t)V FLOPs forward, the JSD twice that (a statistics pass first); the backward
    recomputes both heads' tiles and adds 4NHV for the student's gradients. With a support: per token, ``L`` logits of
    each head forward (2 L (H + H_t) FLOPs) and 4 L H backward (nothing recomputed: the kept entries' logits are kept,
    O(nnz) floats), where ``L`` is what the engine's plan computes (``support.describe_plan()`` prints it): ``K_max``
    (the widest set) on the per-row plan, at most ``max(cap, K_max)`` on the host union plan and ``3.5 C`` plus one
    chunk on the fixed union plan (``C = min(cap, 4 K)``, ``K`` the mean set size; docs/kept-set-costs.md,
    tests/test_kept_costs.py holds these bounds).

    Example::

        import torch
        import fastrl

        hidden = torch.randn(2, 8, 64, requires_grad=True)  # student [B, T, H]
        head = torch.nn.Linear(64, 1000, bias=False)  # student head, weight [V, H]
        teacher_hidden = torch.randn(2, 8, 96)  # teacher [B, T, H_t]
        teacher_head = torch.nn.Linear(96, 1000, bias=False)
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 6:] = 0  # padding
        div = fastrl.fused_divergence(hidden, head.weight, teacher_hidden, teacher_head.weight, beta=0.5, mask=mask)
        (div.sum() / mask.sum()).backward()  # TRL's DistillationTrainer loss; grads to hidden and head.weight
    """
    if is_vocab_sharded(weight) or is_vocab_sharded(teacher_weight):  # tensor parallelism (DTensor Shard(0))
        if support is not None:
            raise ValueError("support= is not implemented with a vocabulary-sharded head (DTensor Shard(0))")
        from fastrl.ops.sharded_divergence import sharded_divergence

        return sharded_divergence(
            hidden, weight, teacher_hidden, teacher_weight, beta=beta, temperature=temperature, bias=bias,
            teacher_bias=teacher_bias, logit_scale=logit_scale, teacher_logit_scale=teacher_logit_scale,
            softcap=softcap, teacher_softcap=teacher_softcap, mask=mask, with_entropy=with_entropy,
            check_finite=check_finite, backend=backend, host_sync=host_sync)
    sync = host_sync_enabled(host_sync)  # False while torch.compile traces: no host read here
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    teacher_hidden, teacher_weight, teacher_bias = autocast_inputs(teacher_hidden, teacher_weight, teacher_bias)
    lead = _check_heads(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias)
    _check_number("beta", beta, 0.0, 1.0)
    tf_s = _transform(temperature, logit_scale, softcap, "")
    tf_t = _transform(temperature, teacher_logit_scale, teacher_softcap, "teacher_")
    _check_mask(mask, lead, hidden.device, sync)
    for name, flag in (("with_entropy", with_entropy), ("check_finite", check_finite)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    active = (mask.reshape(-1) != 0) if mask is not None else None
    support = _check_support(support, weight.shape[0], lead, hidden.device, active, sync)
    opts = DivergenceOptions.of(beta, tf_s, tf_t, with_entropy, _backend_name(hidden, teacher_hidden, backend))
    planned = plan_divergence(opts, lead, sync, active, support, weight.shape[0], hidden.device)
    div, ent = run_divergence(planned, hidden, weight, dense_bias(bias), teacher_hidden, teacher_weight,
                              dense_bias(teacher_bias))
    if check_finite and sync:
        check_divergence_finite(
            div.detach(), None if ent is None else ent.detach(),
            active if active is not None else torch.ones(planned.n_tokens, dtype=torch.bool, device=hidden.device),
            hidden.reshape(-1, hidden.shape[-1]), teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), lead)
    if with_entropy:
        return div.reshape(lead), ent.reshape(lead)
    return div.reshape(lead)
