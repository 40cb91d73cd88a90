"""Fused linear -> per-token log-prob and entropy: the statistics / backward dispatch and the public function.

Paths (docs/design.md): with gradients, path A (forward: one pass of online statistics; backward: recompute
each vocabulary slice's logits, form ``G = dL/dy`` and run the two gradient GEMMs); without, path C (the
forward pass alone, no autograd state kept). Each backend (``fastrl.ops.backend``) implements the statistics
and the backward; this module dispatches to them. Autograd is the custom op ``torch.ops.fastrl.linear_logprob``
(defined here on ``fastrl.ops.custom_ops``' machinery: what ``torch.compile`` sees), whose implementation calls
``linear_stats`` and whose registered backward (the op ``linear_logprob_backward``) calls ``linear_backward``. In eager, ``fused_logprobs`` hands the op only the tokens that are
not ignored (``compact_rows``, one host sync): padding costs no work, and whatever an ignored row holds (even
inf/NaN) cannot reach a gradient GEMM. On the no-sync path (under ``torch.compile``, or ``host_sync=False``) the op
gets every row: it computes the live ones alone where their count is read without a synchronisation (rows in host
memory, ``fastrl.ops.live``), else every row with the hidden states and gradients of the ignored ones zeroed.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fastrl.ops import sharded, torch_backend
from fastrl.ops.custom_ops import (
    PackedOptions, acc_dtype, define_op, empty_output, grad_rows, head_grads, head_grads_like, host_sync_enabled,
    input_grads, layout_of, live_rows, or_none, refuse_double_backward,
)
from fastrl.ops._checks import (
    autocast_inputs, check_finite_outputs, check_linear_inputs, check_targets, check_triton_dtypes, compact_rows,
    dense_bias, unit_stride,
)
from fastrl.ops._gemm import addmm_f32
from fastrl.ops.backend import resolve_backend
from fastrl.ops.config import LogitTransform, invariant_splits
from fastrl.ops import live
from fastrl.ops.live import LiveRows, SortedRows

__all__ = ["fused_logprobs", "run_logprobs", "linear_stats", "linear_backward", "host_sync_enabled",
           "LinearOptions"]


@dataclasses.dataclass(frozen=True)
class LinearOptions(PackedOptions):
    """Scalar options of ``fastrl::linear_logprob`` (see ``fastrl.fused_logprobs``).

    ``all_live``: every row is a counted token (the eager wrapper compacted the ignored ones away). False: rows
    whose target is ``ignore_index`` are computed too (no data-dependent shape, no host synchronisation), with
    their hidden row replaced by zeros (so whatever it holds cannot reach a gradient) and their outputs and
    gradients zero; a target outside ``[0, V)`` that is not ``ignore_index`` gives a NaN log-prob and entropy
    (the no-sync path cannot raise, so it poisons instead of returning a wrong number).
    """

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    backend: str = "torch"  # concrete: "triton-hybrid", "triton-fused", "triton-sm90" or "torch"
    with_entropy: bool = True
    vocab_chunk: Optional[int] = None
    ignore_index: int = -100
    all_live: bool = True

    @property
    def tf(self) -> LogitTransform:
        return LogitTransform(temperature=self.temperature, logit_scale=self.logit_scale, softcap=self.softcap)


LinearOptions._LAYOUT = layout_of(LinearOptions)


def linear_stats(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    targets: torch.Tensor,  # [N] int64
    tf: LogitTransform,
    backend: str,
    with_entropy: bool,
    vocab_chunk: int | None = None,
    live_count: torch.Tensor | None = None,  # [1] int32 on the device, rows sorted live-first (SKIPS_DEAD_ROWS)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # lse [N], target logit [N], entropy [N]
    """Row statistics of the transformed logits on the chosen (concrete) backend (no autograd); with
    ``live_count`` the rows from it on are dead: skipped by the kernels, 0 in every output."""
    N = hidden.shape[0]
    if N == 0:
        e = hidden.new_zeros((0,), dtype=torch_backend.acc_dtype(hidden.dtype))
        return e, e, (e if with_entropy else None)
    if backend == "triton-hybrid":
        from fastrl.ops import hybrid

        return hybrid.linear_stats(hidden, weight, bias, targets, tf, with_entropy, vocab_chunk)
    if backend == "triton-sm90":
        from fastrl.ops import sm90

        return sm90.linear_stats(hidden, weight, bias, targets, tf, with_entropy, live_count)
    if backend == "triton-fused":
        from fastrl.kernels.linear_logprob import linear_stats as fused_stats

        return fused_stats(
            hidden, weight, bias, targets, logit_scale=tf.logit_scale, softcap=tf.softcap,
            temperature=tf.temperature, with_entropy=with_entropy, live_count=live_count,
            splits=invariant_splits(),
        )
    assert live_count is None, f"{backend} computes every row"
    return torch_backend.linear_stats(hidden, weight, bias, targets, tf, with_entropy=with_entropy)


def linear_backward(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    targets: torch.Tensor,  # [N]
    lse: torch.Tensor,  # [N]
    entropy: torch.Tensor | None,  # [N]
    grad_logp: torch.Tensor | None,  # [N] compute dtype, zero where no gradient flows
    grad_entropy: torch.Tensor | None,  # [N]
    opts: LinearOptions,
    need: tuple[bool, bool, bool],  # (hidden, weight, bias)
    live_count: torch.Tensor | None = None,  # [1] int32 on the device, rows sorted live-first (SKIPS_DEAD_ROWS)
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``sum(grad_logp * logp + grad_entropy * entropy)`` w.r.t. hidden, weight, bias.

    Vocabulary-sliced: each slice's ``G = dL/dy`` [N, V_blk] is formed once, then
    ``grad_W[slice] = G^T h`` (one GEMM over all tokens, float32 accumulation inside it, written once)
    and ``grad_h += G W[slice]`` into a float32 [N, H] accumulator. No [V, H] float32 buffer is needed,
    and the weight-gradient GEMM is skipped entirely when the weight is frozen.
    """
    if hidden.shape[0] == 0:  # nothing flows back from no tokens
        return (torch.zeros_like(hidden) if need[0] else None, torch.zeros_like(weight) if need[1] else None,
                torch.zeros_like(bias) if need[2] else None)
    if opts.backend == "triton-hybrid":
        from fastrl.ops import hybrid

        return hybrid.linear_backward(hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy,
                                      opts.tf, need, opts.vocab_chunk)
    if opts.backend == "triton-sm90":
        from fastrl.ops import sm90

        return sm90.linear_backward(hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy,
                                    opts.tf, need, opts.vocab_chunk, live_count)
    assert live_count is None or opts.backend == "triton-fused", f"{opts.backend} computes every row"
    return _sliced_backward(hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy, opts, need,
                            live_count)


def _sliced_backward(hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy, opts: LinearOptions,
                     need: tuple[bool, bool, bool], live_count: torch.Tensor | None = None):
    """``linear_backward`` on the torch and triton-fused backends: one vocabulary slice's G at a time."""
    need_h, need_w, need_b = need
    N, H = hidden.shape
    V = weight.shape[0]
    cdt = torch_backend.acc_dtype(hidden.dtype)
    grad_h = torch.zeros((N, H), dtype=cdt, device=hidden.device) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    grad_b = torch.empty((V,), dtype=cdt, device=hidden.device) if need_b else None
    cols, h_mm, slice_grad = _slice_grads(hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy, opts,
                                          live_count)
    for v0 in range(0, V, cols):
        v1 = min(v0 + cols, V)
        G, w_mm = slice_grad(v0, v1)
        if need_w:
            if G.dtype == grad_w.dtype and h_mm.dtype == grad_w.dtype:
                torch.mm(G.T, h_mm, out=grad_w[v0:v1])  # written in place: no [V_blk, H] temporary
            else:
                grad_w[v0:v1] = torch.mm(G.T, h_mm)
        if need_h:
            addmm_f32(grad_h, G, w_mm)
        if need_b:
            grad_b[v0:v1] = G.sum(0, dtype=cdt)
    return (
        grad_h.to(hidden.dtype) if need_h else None,
        grad_w,
        grad_b.to(bias.dtype) if need_b else None,
    )


def _slice_grads(hidden, weight, bias, targets, lse, entropy, grad_logp, grad_entropy, opts: LinearOptions,
                 live_count: torch.Tensor | None = None):
    """(columns per slice, hidden as the weight-gradient GEMM reads it, ``(v0, v1) -> (G [N, v1 - v0], W slice as
    the hidden-gradient GEMM reads it)``) of the torch or triton-fused backend."""
    N, V, tf = hidden.shape[0], weight.shape[0], opts.tf
    if opts.backend == "triton-fused":
        from fastrl.kernels import linear_logprob as K

        from fastrl.ops.hybrid import tile_columns

        cols = tile_columns(N, V, opts.vocab_chunk)  # the [N, V_blk] G tile: the same budget as the hybrid path
        buf = torch.empty((N, cols), dtype=hidden.dtype, device=hidden.device)

        def fused(v0: int, v1: int):
            G = buf[:, : v1 - v0]
            b_blk = bias[v0:v1] if bias is not None else None
            K.linear_grad_block(
                hidden, weight[v0:v1], b_blk, targets, v0, lse, entropy, grad_logp, grad_entropy, G,
                logit_scale=tf.logit_scale, softcap=tf.softcap, temperature=tf.temperature, live_count=live_count,
            )
            return G, weight[v0:v1]

        return cols, hidden, fused
    has_grad = torch.zeros(N, dtype=torch.bool, device=hidden.device)
    if grad_logp is not None:
        has_grad |= grad_logp != 0
    if grad_entropy is not None:
        has_grad |= grad_entropy != 0
    cols = torch_backend.tile_columns(N, V, opts.vocab_chunk)
    h_mm = torch_backend.upcast(hidden)
    tile = torch.empty(N * cols, dtype=torch_backend.acc_dtype(hidden.dtype), device=hidden.device)

    def torch_slice(v0: int, v1: int):
        G = torch_backend.grad_block(
            h_mm, weight, bias, targets, v0, v1, lse, entropy, grad_logp, grad_entropy, has_grad, tf, buf=tile
        )
        return G, torch_backend.upcast(weight[v0:v1])

    return cols, h_mm, torch_slice


# ---------------------------------------------------------------------------------------------------------
# the custom ops: fastrl::linear_logprob (statistics) and fastrl::linear_logprob_backward (its gradients)
# ---------------------------------------------------------------------------------------------------------


@define_op("linear_logprob")
def linear_logprob(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: Optional[torch.Tensor],  # [V]
    targets: torch.Tensor,  # [N] int64
    opt_str: str,  # LinearOptions.pack()
    opt_float: list[float],
    opt_int: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # logp [N], entropy [N] (or [0]), lse [N]
    o = LinearOptions.unpack(opt_str, opt_float, opt_int)
    if hidden.shape[0] == 0:  # three distinct empty outputs (an op's outputs may not alias one another)
        e = hidden.new_zeros((0,), dtype=acc_dtype(hidden.dtype))
        return e, e.clone(), e.clone()
    rows = _live(targets, o)
    dev = _sorted(targets, o) if rows is None else None
    if rows is not None:  # the live rows alone, their results scattered back: 0 at the masked rows
        logp, ent, lse = (rows.put(x) for x in _stats_rows(rows.take(hidden), weight, bias, rows.take(targets), o))
    elif dev is not None:  # sorted live-first, the dead row blocks skipped on the device, then unsorted
        logp, ent, lse = (dev.put(x) for x in _stats_rows(dev.take(hidden), weight, bias, dev.take(targets), o,
                                                         dev.count))
    else:
        logp, ent, lse = _stats_rows(hidden, weight, bias, targets, o)
    return logp, (ent if ent is not None else empty_output(logp)), lse


def _live(targets: torch.Tensor, o: LinearOptions) -> LiveRows | None:
    """The no-sync op's live rows when it computes them alone (``fastrl.ops.live``: their count read without a
    synchronisation), else None (every row)."""
    if o.all_live:
        return None
    rows = LiveRows.of(targets != o.ignore_index)
    return rows if rows.ids is not None else None


# the backends whose GEMMs of the statistics and of G run in Triton: a program reads the live count from the device
SKIPS_DEAD_ROWS = ("triton-fused", "triton-sm90")


def _sorted(targets: torch.Tensor, o: LinearOptions) -> SortedRows | None:
    """The no-sync op's rows sorted live-first with the count on the device, where ``_live`` cannot read the count
    and the backend's Triton GEMMs skip dead row blocks (``SKIPS_DEAD_ROWS``); else None."""
    if o.all_live or o.backend not in SKIPS_DEAD_ROWS or targets.shape[0] == 0:
        return None
    return None if live.count_readable(targets.device) else SortedRows.of(targets != o.ignore_index)


def _stats_rows(hidden, weight, bias, targets, o: LinearOptions, live_count: torch.Tensor | None = None):
    """(logp, entropy | None, lse) [N] of the rows handed in; on the no-sync path 0 at an ignored row (its hidden
    state zeroed first) and NaN at a counted row whose target is outside [0, V)."""
    active, h = live_rows(targets, hidden, o)
    with torch.autocast(hidden.device.type, enabled=False):
        lse, zt, ent = linear_stats(h, weight, bias, targets, o.tf, o.backend, o.with_entropy, o.vocab_chunk,
                                    live_count)
    logp = zt - lse
    if active is not None:
        V = weight.shape[0]
        bad = active & ((targets < 0) | (targets >= V))
        nan = torch.full((), float("nan"), dtype=logp.dtype, device=logp.device)
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        logp = torch.where(bad, nan, torch.where(active, logp, zero))
        if ent is not None:
            ent = torch.where(bad, nan, torch.where(active, ent, zero))
    return logp, ent, lse


@linear_logprob.register_fake
def _(hidden, weight, bias, targets, opt_str, opt_float, opt_int):
    o = LinearOptions.unpack_symbolic(opt_str, opt_float, opt_int)
    N = hidden.shape[0]
    logp = hidden.new_empty((N,), dtype=acc_dtype(hidden.dtype))
    return logp, (torch.empty_like(logp) if o.with_entropy else empty_output(logp)), torch.empty_like(logp)


def _linear_setup(ctx, inputs, output):
    hidden, weight, bias, targets, *options = inputs
    _, ent, lse = output
    ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
    ctx.options = options
    ctx.mark_non_differentiable(lse)
    # an output whose gradient is not needed (often the entropy) costs no backward work
    ctx.set_materialize_grads(False)


def _linear_backward(ctx, grad_logp, grad_ent, _grad_lse):
    refuse_double_backward("fastrl.fused_logprobs")
    hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
    ent = or_none(ent)
    if ent is None:  # no entropy was computed: nothing flows back through its (empty) output
        grad_ent = None
    need = tuple(ctx.needs_input_grad[:3])
    if grad_logp is None and grad_ent is None or not any(need):
        return (None,) * 7
    gh, gw, gb = torch.ops.fastrl.linear_logprob_backward(
        grad_logp, grad_ent, hidden, weight, bias, targets, lse, ent, *ctx.options, *need
    )
    return input_grads(need, (gh, gw, gb), 7)


linear_logprob.register_autograd(_linear_backward, setup_context=_linear_setup)


@define_op("linear_logprob_backward")
def linear_logprob_backward(
    grad_logp: Optional[torch.Tensor],  # [N]
    grad_entropy: Optional[torch.Tensor],  # [N]
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,  # [N]
    lse: torch.Tensor,  # [N]
    entropy: Optional[torch.Tensor],  # [N]
    opt_str: str,
    opt_float: list[float],
    opt_int: list[int],
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # grad hidden [N, H], weight [V, H], bias [V] (or [0])
    o = LinearOptions.unpack(opt_str, opt_float, opt_int)
    need = (need_hidden, need_weight, need_bias and bias is not None)
    rows = _live(targets, o) or _sorted(targets, o)
    if rows is None:
        gh, gw, gb = _backward_rows(grad_logp, grad_entropy, hidden, weight, bias, targets, lse, entropy, o, need)
    else:  # the live rows alone, or all sorted live-first with the dead blocks skipped (the masked gradient rows 0)
        take = rows.take
        gh, gw, gb = _backward_rows(take(grad_logp), take(grad_entropy), take(hidden), weight, bias, take(targets),
                                    take(lse), take(entropy), o, need, getattr(rows, "count", None))
        gh = rows.put(gh)
    return head_grads(gh, gw, gb, hidden, weight)


def _backward_rows(grad_logp, grad_entropy, hidden, weight, bias, targets, lse, entropy, o: LinearOptions, need,
                   live_count: torch.Tensor | None = None):
    """``linear_backward`` of the rows handed in (on the no-sync path the ignored ones zeroed: no gradient)."""
    active, h = live_rows(targets, hidden, o)
    cdt = lse.dtype
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        return linear_backward(h, weight, bias, targets, lse, entropy, grad_rows(grad_logp, active, cdt),
                               grad_rows(grad_entropy, active, cdt), o, need, live_count)


@linear_logprob_backward.register_fake
def _(grad_logp, grad_entropy, hidden, weight, bias, targets, lse, entropy, opt_str, opt_float, opt_int,
      need_hidden, need_weight, need_bias):
    return head_grads_like(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _scatter_rows(x: torch.Tensor | None, idx: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """[A] values of the live rows -> [N], zero at ignored rows (differentiable)."""
    if x is None or idx is None:
        return x
    return x.new_zeros((n,)).index_copy(0, idx, x)


def fused_logprobs(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] or [B, T] int32 or int64
    *,
    bias: torch.Tensor | None = None,  # [V]
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    with_entropy: bool = True,
    ignore_index: int = -100,
    check_finite: bool = True,
    backend: str | None = None,
    vocab_chunk: int | None = None,
    support=None,
    return_kept_mass: bool = False,
    positions: torch.Tensor | None = None,
    host_sync: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``targets`` and entropies under the LM head, without materialising logits.

    The distribution is ``softmax(softcap(logit_scale * (hidden @ weight.T + bias)) / temperature)``
    (softcap ``c * tanh(x / c)`` only when set; temperature divides last, as TRL does).

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]``, float32, bfloat16, float16 or float64: the last hidden states
            at the positions that predict ``targets`` (in a causal LM, position ``t`` predicts token
            ``t + 1``). Under ``torch.autocast`` it is cast to the autocast dtype, as the LM-head matmul
            would be.
        weight: ``[V, H]``, the LM head's weight; ``hidden``'s dtype and device. Or, under tensor parallelism, a
            ``DTensor`` placed ``Shard(0)`` on a 1-D mesh (``hidden`` the same on every rank): each rank computes
            its vocabulary rows, the statistics merged by O(N) all-reduces (``fastrl.ops.sharded``; eager only;
            docs/scaling-out.md).
        targets: ``hidden``'s leading shape (``[N]`` or ``[B, T]``), int32 or int64 (a dtype that holds
            ``ignore_index``): ids in ``[0, V)``, or ``ignore_index`` for "no token here".
        bias: ``[V]`` or None; ``hidden``'s dtype.
        temperature: > 0; divides the scaled, capped logits (TRL divides by its sampling temperature).
        logit_scale: multiplies the logits first (for models that scale their logits).
        softcap: None, or ``c`` for ``c * tanh(x / c)`` (final-logit soft-capping, as in Gemma 2).
        with_entropy: False skips the entropy and its cost; ``entropy`` is then None.
        ignore_index: the target id of tokens to skip: log-prob 0, entropy 0, no gradient.
        check_finite: raise ``FloatingPointError`` on a non-finite log-prob or entropy of a counted token,
            naming the token and whether hidden or weight holds inf/nan (checked on the O(N) outputs only).
        backend: "triton" (the CUDA default: "triton-hybrid" with torch >= 2.8, else "triton-fused"),
            "triton-hybrid", "triton-fused", "triton-sm90" (Hopper or newer, opt-in) or "torch" (the CPU default);
            env ``FASTRL_BACKEND``. See
            ``fastrl.ops.backend`` and docs/design.md.
        vocab_chunk: vocabulary columns per logits tile (default: bounded automatically); smaller uses
            less memory, larger gives the GEMMs more work per call.
        support: None (the full softmax), a ``fastrl.KeptSet`` (one row per token of the flattened ``targets``,
            ignored tokens included; the ids each token was sampled from) or a ``fastrl.SamplerRule`` (replayed
            on these logits by ``fastrl.replay_rule``, each counted token's set extended by its target where
            the rule dropped it). Log-probs and entropies are then those of ``pi^S``, the softmax restricted to
            the kept set and renormalised, with their gradients; a KeptSet never costs a pass over the vocabulary
            (the kept-set engine, ``fastrl.ops.kept``: one op, ``fastrl::kept_logprob``; per token ``K_max`` logits
            on its per-row plan, the bounds of every plan in docs/kept-set-costs.md, ``support.describe_plan()``
            prints the one that runs); a rule adds one
            forward pass to find the sets (``fastrl::replay_rule`` while compiling). A counted target outside its
            KeptSet, an empty set at a counted token, or a KeptSet whose length is not the number of tokens raise
            ``ValueError`` naming the token (on the no-sync path: a NaN log-prob and entropy there, the length
            still raises).
        return_kept_mass: True appends a third output, ``log`` of the full-softmax mass of the kept set
            (``LSE_S - LSE``; 0 without a support, 0 at ignored tokens; not differentiable). Costs one full
            forward pass over the vocabulary.
        positions: with a ``SamplerRule`` that has ``min_tokens``: each token's completion position (targets'
            shape); default: column t of ``[B, T]`` targets is position t (flat targets raise).
        host_sync: whether the op may read device values on the host. None (default): yes in eager, no while
            ``torch.compile`` traces. False (the no-sync path, for ``torch.compile`` and CUDA graphs): ignored
            rows are computed with zeroed hidden states instead of being dropped on a device (no host read; on CPU
            tensors the op computes the live rows alone: docs/compile.md), the
            target-range check becomes a NaN log-prob and entropy at the bad token, and ``check_finite`` is
            skipped (a non-finite output shows as a non-finite value downstream instead of an exception). A
            KeptSet runs on a kept-set plan chosen without host reads (the per-row plan unless the set says its
            rows overlap; no data-dependent shape); a
            SamplerRule is refused (how many ids it keeps needs a host read: replay it first, ``replay_rule``).

    Returns:
        ``(logprobs, entropy)``, each of ``targets``' shape, float32 (float64 for float64 inputs);
        ``entropy`` is None when ``with_entropy=False``; ``(logprobs, entropy, log_kept_mass)`` with
        ``return_kept_mass=True``.

    Differentiable w.r.t. hidden, weight and bias through both outputs; gradients are accumulated in
    float32 and logits are never rounded to the input dtype. An output whose gradient is not needed costs
    no backward work, and a weight that needs no gradient (a frozen head) runs no weight-gradient GEMM.
    Under ``torch.no_grad()`` (or when no input needs grad) this is the forward-only path and keeps no
    autograd state. Memory beyond inputs and outputs: O(N) plus one bounded tile. Ignored tokens are dropped
    before any kernel runs (one host sync to count them), so padding costs no work and whatever an ignored
    row of ``hidden`` holds cannot reach a gradient.

    Errors, before any kernel runs: a target outside ``[0, V)`` that is not ``ignore_index`` raises
    ``ValueError`` naming the first bad position; shape, dtype and device mismatches raise
    ``ValueError`` / ``TypeError`` naming the argument.

    Example::

        import torch
        import fastrl

        hidden = torch.randn(2, 8, 64, requires_grad=True)  # [B, T, H]
        lm_head = torch.nn.Linear(64, 1000, bias=False)  # weight [V, H]
        targets = torch.randint(0, 1000, (2, 8))  # [B, T]
        targets[1, 6:] = -100  # padding: ignored
        logp, entropy = fastrl.fused_logprobs(hidden, lm_head.weight, targets, temperature=0.7)  # [B, T] each
        (logp.sum() + 0.01 * entropy.sum()).backward()  # fills hidden.grad and lm_head.weight.grad
    """
    if sharded.is_vocab_sharded(weight):  # tensor parallelism: the head's rows spread over ranks (DTensor Shard(0))
        return sharded.sharded_logprobs(
            hidden, weight, targets, bias=bias, tf=LogitTransform(temperature=temperature, logit_scale=logit_scale,
                                                                   softcap=softcap),
            with_entropy=with_entropy, ignore_index=ignore_index, check_finite=check_finite, backend=backend,
            vocab_chunk=vocab_chunk, host_sync=host_sync, ops=sharded.LocalOps(linear_stats, linear_backward,
                                                                               LinearOptions),
            support=support, return_kept_mass=return_kept_mass, positions=positions)
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    check_linear_inputs(hidden, weight, targets, bias)
    bias = dense_bias(bias)
    tf = LogitTransform(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if vocab_chunk is not None and (not isinstance(vocab_chunk, int) or vocab_chunk <= 0):
        raise ValueError(f"vocab_chunk must be None or a positive int, got {vocab_chunk!r}")
    V = weight.shape[0]
    sync = host_sync_enabled(host_sync)
    if sync:
        check_targets(targets, V, ignore_index)
    # the kind of work, for the defaults measured on GPUs (fastrl.ops.backend.choose_triton)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    name = resolve_backend(hidden.device, backend, kind="logprob" if grad else "forward", H=hidden.shape[-1],
                           dtype=hidden.dtype, tensors=(hidden, weight))
    check_triton_dtypes(name, hidden.dtype)
    if support is not None or return_kept_mass:
        return _support_logprobs(hidden, weight, bias, targets, tf, with_entropy, ignore_index, check_finite, name,
                                 vocab_chunk, support, bool(return_kept_mass), positions, host_sync)

    return run_logprobs(hidden, weight, bias, targets, tf, name, with_entropy=with_entropy, ignore_index=ignore_index,
                        check_finite=check_finite, vocab_chunk=vocab_chunk, sync=sync)


def run_logprobs(
    hidden: torch.Tensor,  # [N, H] or [B, T, H], autocast applied
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V] dense
    targets: torch.Tensor,  # hidden's leading shape
    tf: LogitTransform,
    backend: str,  # concrete (fastrl.ops.backend.resolve_backend)
    *,
    with_entropy: bool,
    ignore_index: int,
    check_finite: bool,
    vocab_chunk: int | None,
    sync: bool,  # host reads allowed (fastrl.ops.custom_ops.host_sync_enabled)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fused_logprobs`` (the full softmax) on inputs its caller has checked: the op, nothing checked again."""
    lead = tuple(targets.shape)
    h = unit_stride(hidden.reshape(-1, hidden.shape[-1]))
    w = unit_stride(weight)
    t = targets.reshape(-1).to(torch.int64).contiguous()
    N = t.shape[0]
    # eager: ignored rows are dropped before the op (one host sync); no-sync: the op computes every row
    idx = compact_rows(t != ignore_index) if sync else None
    h_live, t_live = (h, t) if idx is None else (h.index_select(0, idx), t.index_select(0, idx))
    opts = LinearOptions(
        temperature=float(tf.temperature), logit_scale=float(tf.logit_scale),
        softcap=None if tf.softcap is None else float(tf.softcap), backend=backend, with_entropy=with_entropy,
        vocab_chunk=vocab_chunk, ignore_index=ignore_index, all_live=sync,
    )
    # Autograd (when any input needs grad) is the op's registered backward; under no_grad it is path C, the
    # forward pass alone, nothing saved.
    logp, ent, _ = torch.ops.fastrl.linear_logprob(h_live, w, bias, t_live, *opts.pack())
    ent = ent if with_entropy else None
    logp, ent = _scatter_rows(logp, idx, N), _scatter_rows(ent, idx, N)
    if check_finite and sync:
        check_finite_outputs(logp.detach(), None if ent is None else ent.detach(), t != ignore_index, h, lead)
    logp = logp.reshape(lead)
    ent = ent.reshape(lead) if ent is not None else None
    return logp, ent


def _support_logprobs(hidden, weight, bias, targets, tf, with_entropy, ignore_index, check_finite, name, vocab_chunk,
                      support, return_kept_mass, positions, host_sync):
    """``fused_logprobs`` under a support (the kept-set engine, ``fastrl.ops.kept``), inputs already checked."""
    from fastrl.ops import kept

    sync = host_sync_enabled(host_sync)
    ks, _outside, given = kept.resolve_support(support, hidden, weight, bias, targets, tf, ignore_index, positions,
                                               host_sync)
    kw = dict(bias=bias, temperature=tf.temperature, logit_scale=tf.logit_scale, softcap=tf.softcap,
              with_entropy=with_entropy, ignore_index=ignore_index, check_finite=check_finite, backend=name,
              vocab_chunk=vocab_chunk, host_sync=host_sync)
    if ks is None:  # the full softmax: the kept mass is 1
        logp, ent = fused_logprobs(hidden, weight, targets, **kw)
        return (logp, ent, torch.zeros_like(logp.detach())) if return_kept_mass else (logp, ent)
    lead = tuple(targets.shape)
    h = unit_stride(hidden.reshape(-1, hidden.shape[-1]))
    w = unit_stride(weight)
    t = targets.reshape(-1).to(torch.int64).contiguous()
    N = t.shape[0]
    active = t != ignore_index
    # eager: ignored rows are dropped before the op (one host sync); no-sync: the op computes every row
    idx = compact_rows(active) if sync else None
    if idx is None:
        h_live, t_live, ks_live = h, t, ks
    else:
        h_live, t_live, ks_live = h.index_select(0, idx), t.index_select(0, idx), ks[idx]
    if given is not None and given.shape != ks_live.ids.shape:  # a replay gives ignored rows no entries: never here
        given = None
    plan = kept.build_plan(ks_live, w.shape[0], h.device, sync)
    opts = kept.KeptOptions(
        temperature=float(tf.temperature), logit_scale=float(tf.logit_scale),
        softcap=None if tf.softcap is None else float(tf.softcap), with_entropy=with_entropy,
        ignore_index=ignore_index, all_live=sync, tile_elems=plan.tile_elems, cap=plan.cap, backend=name,
    )
    # autograd (when an input needs grad) is the op's registered backward; under no_grad the forward alone runs
    logp, ent, lse_s, _ = torch.ops.fastrl.kept_logprob(h_live, w, bias, t_live, ks_live.ids, ks_live.offsets,
                                                        plan.arg(), *opts.pack(), given)
    ent = ent if with_entropy else None
    mass = None
    if return_kept_mass:  # the one full pass: LSE over the whole vocabulary (path C of the plain op)
        lin = LinearOptions(temperature=opts.temperature, logit_scale=opts.logit_scale, softcap=opts.softcap,
                            backend=name, with_entropy=False, vocab_chunk=vocab_chunk, ignore_index=ignore_index,
                            all_live=sync)
        with torch.no_grad():
            _, _, lse_full = torch.ops.fastrl.linear_logprob(h_live, w, bias, t_live, *lin.pack())
        mass = lse_s - lse_full
        if not sync:
            mass = torch.where(active, mass, torch.zeros((), dtype=mass.dtype, device=mass.device))
        mass = _scatter_rows(mass, idx, N).reshape(lead)
    logp, ent = _scatter_rows(logp, idx, N), _scatter_rows(ent, idx, N)
    if check_finite and sync:
        check_finite_outputs(logp.detach(), None if ent is None else ent.detach(), active, h, lead)
    logp = logp.reshape(lead)
    ent = ent.reshape(lead) if ent is not None else None
    return (logp, ent, mass) if return_kept_mass else (logp, ent)
