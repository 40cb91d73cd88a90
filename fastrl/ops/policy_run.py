"""Planning and running a policy loss: ``fastrl.policy_loss`` checks its inputs (the loss's as a ``LossSpec``, the LM
head's), ``plan`` resolves the call into one frozen ``LossPlan`` and ``run`` executes it, on one of three paths, with
the same numbers:

* ``"one-pass"``: the custom op ``fastrl::policy_loss_one_pass`` over vocabulary chunks (``fastrl.ops.one_pass``);
* ``"kept"``: the same op over a support, on the kept-set engine (``fastrl.ops.one_pass_kept``);
* ``"two-pass"``: ``fastrl.fused_logprobs``'s op (``run_logprobs``: nothing checked twice), then the spec's loss
  under autograd.

The ops know no loss: the spec carries it (``LossSpec.loss`` for the two-pass path; the op's packed options, from
``LossSpec.pack``, and loss tensors for the others, which ``fastrl.losses.one_pass`` turns back into the loss). The
exact reference KL (``kl_estimator="exact"``) is inside the op's chunks where the plan says so, else its own
``fused_divergence`` pass (``_reference_kl``: divergence's plan and run on the inputs checked here) whose [B, T] result
enters the loss with its own graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fastrl.ops import divergence as D
from fastrl.ops import one_pass
from fastrl.ops import torch_backend as TB
from fastrl.ops._checks import (
    autocast_inputs, check_divergence_finite, check_finite_outputs, check_head, check_linear_inputs, check_targets,
    check_triton_dtypes, compact_rows, dense_bias, unit_stride,
)
from fastrl.ops.backend import is_triton, resolve_backend
from fastrl.ops.config import LogitTransform
from fastrl.ops.kept import build_plan, resolve_support
from fastrl.ops.linear_logprob import run_logprobs
from fastrl.ops.one_pass import IGNORE
from fastrl.ops.support import KeptSet, SamplerRule

__all__ = ["LossSpec", "LossPlan", "plan", "run"]


@dataclass(frozen=True)
class LossSpec:
    """What the ops need to know of a checked loss (``fastrl.losses.policy`` builds it; the ops know no loss)."""

    eff_targets: torch.Tensor  # [B, T] int64, IGNORE outside the mask
    in_mask: torch.Tensor  # [B, T] bool
    temperature: float  # the loss config's (the logit transform's last step)
    granularity: str | None  # PolicyLossConfig.one_pass_granularity: None, "token" or "sequence"
    exact_kl: bool  # the loss needs the exact KL (kl_estimator="exact", beta != 0)
    ref: tuple  # the exact KL's (ref_hidden, ref_weight, ref_bias)
    loss: Callable  # (logp [B, T], entropy [B, T], per_token_kl [B, T] | None) -> (loss, metrics): two passes
    pack: Callable  # (**op option fields) -> the op's packed options (the loss config travels with them)
    loss_tensors: tuple  # the op's (advantages, mask, old, ref, importance weights, num_items [] | None, sampling)
    metric_names: tuple[str, ...]  # as the loss arithmetic names them, in its order
    sync: bool  # host reads allowed
    host_sync: bool | None  # as given
    check_finite: bool


@dataclass(frozen=True)
class LossPlan:
    """One ``policy_loss`` call, checked and resolved: what to run and on what."""

    spec: LossSpec
    hidden: torch.Tensor  # [B, T, H] (autocast applied)
    weight: torch.Tensor  # [V, H], unit stride
    bias: torch.Tensor | None  # [V] dense
    ref: tuple  # the exact KL's (ref_hidden, ref_weight, ref_bias) for its own pass: checked, autocast, bias dense
    tf: LogitTransform
    backend: str  # concrete
    path: str  # "one-pass" | "kept" | "two-pass"
    options: tuple = ("", (), ())  # the op's packed options
    chunks: tuple[int, ...] = ()  # the op's chunks: flattened live-row ranges, [] (fixed chunks), or the kept plan
    kl: str | None = None  # where the exact KL is computed: "inside" (the op's chunks), "outside" (its own pass)
    support: KeptSet | None = None  # the checked KeptSet ("kept")
    support_metrics: dict | None = None  # sampling/* metrics, computed when the support was resolved
    support_logits: torch.Tensor | None = None  # a rule's kept entries' logits, as its replay read them ("kept")


def plan(spec: LossSpec, hidden, weight, bias, targets, logit_scale: float, softcap: float | None,
         backend: str | None, chunk_tokens: int | None, support, positions) -> LossPlan:
    """The LM head checked (after autocast) and its backend resolved, then the path (over the support, one pass, or
    two) and the op's chunks and options."""
    ref = _reference_head(spec.ref) if spec.exact_kl else spec.ref
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    check_linear_inputs(hidden, weight, targets, bias)
    bias, weight = dense_bias(bias), unit_stride(weight)
    if spec.sync:
        check_targets(spec.eff_targets, weight.shape[0], IGNORE)
    tf = LogitTransform(temperature=spec.temperature, logit_scale=logit_scale, softcap=softcap)
    need = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    grads = torch.is_grad_enabled() and any(need)
    need = need if grads else (False, False, False)
    # the measured default of the route the loss takes: the one-pass loss ("loss"), else path A's log-probs with
    # gradients ("logprob"), else the forward alone: each route's default decided on its own rows (bench defaults)
    one_pass_route = grads and spec.granularity is not None
    requested, kind = backend, "loss" if one_pass_route else "logprob" if grads else "forward"
    backend = _backend(hidden, weight, requested, kind, ref, spec.exact_kl)
    head = dict(spec=spec, hidden=hidden, weight=weight, bias=bias, ref=ref, tf=tf, backend=backend)
    if support is not None:
        kept, outside, given = resolve_support(support, hidden, weight, bias, spec.eff_targets, tf, IGNORE,
                                               positions, spec.host_sync)
        head["support_metrics"] = support_metrics(kept, outside, spec.in_mask, weight.shape[0],
                                                  isinstance(support, SamplerRule), TB.acc_dtype(hidden.dtype))
        if kept is not None:
            return _kept_plan(head, kept, need, given)
    if one_pass_route and backend != "triton-fused":
        one = _one_pass_plan(head, need, chunk_tokens)
        if one is not None:
            return one
        # two passes after all (a sequence longer than a chunk, or no chunk within the memory budget): path A's default
        head["backend"] = _backend(hidden, weight, requested, "logprob", ref, spec.exact_kl)
    # Path A (or forward-only under no_grad): "triton-fused" promises that no logit is ever stored, so there the
    # loss takes path A on the fused kernels: 8NHV instead of 6NHV, but no [chunk, V] tile and no float32 [V, H]
    # weight-gradient accumulator
    return LossPlan(**head, path="two-pass", kl="outside" if spec.exact_kl else None)


def _backend(hidden, weight, requested: str | None, kind: str, ref: tuple, exact_kl: bool) -> str:
    """The concrete backend for this route (``kind``), its dtypes checked."""
    backend = resolve_backend(hidden.device, requested, kind=kind, H=hidden.shape[-1], dtype=hidden.dtype,
                              tensors=(hidden, weight))
    check_triton_dtypes(backend, hidden.dtype, *((ref[0].dtype,) if exact_kl else ()))
    return backend


def _reference_head(ref: tuple) -> tuple:
    """The reference head of the exact KL, as ``fused_divergence`` would take it as its teacher: autocast applied,
    one dtype and device (``check_ref_inputs`` checked the shapes), the bias dense."""
    ref_hidden, ref_weight, ref_bias = autocast_inputs(*ref)
    check_head(ref_hidden, ref_weight, ref_bias, hidden_name="ref_hidden", weight_name="ref_weight",
               bias_name="ref_bias")
    return ref_hidden, ref_weight, dense_bias(ref_bias)


def support_metrics(kept: KeptSet | None, outside: torch.Tensor | None, in_mask: torch.Tensor, V: int, rule: bool,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``sampling/kept_size_mean`` over the tokens in ``in_mask`` and, for a rule, ``sampling/label_outside_frac`` (the
    fraction of those whose target the rule dropped). ``kept`` None: a rule that keeps every id."""
    live = in_mask.reshape(-1)
    count = live.sum().clamp(min=1).to(dtype)
    if kept is None:
        sizes = torch.full(live.shape, V, dtype=dtype, device=live.device)
    else:
        sizes = kept.sizes().to(dtype)
    out = {"sampling/kept_size_mean": torch.where(live, sizes, 0).sum() / count}
    if rule:
        out["sampling/label_outside_frac"] = (outside.reshape(-1) & live).sum().to(dtype) / count
    return out


def _options(head: dict, need, **extra) -> tuple:
    """The op's packed options."""
    spec, tf = head["spec"], head["tf"]
    return spec.pack(
        logit_scale=float(tf.logit_scale), softcap=None if tf.softcap is None else float(tf.softcap),
        backend=head["backend"], need_hidden=need[0], need_weight=need[1], need_bias=need[2], compact=spec.sync,
        consume_grads=spec.sync,
        n_metrics=len(spec.metric_names), **extra,
    )


def _kept_plan(head: dict, kept: KeptSet, need, given: torch.Tensor | None) -> LossPlan:
    """The loss over a support: the one-pass op on the kept-set engine (the exact KL over the support inside it)."""
    spec = head["spec"]
    # planned on the rows the op computes: in eager the live ones (it drops the rest first), else every row
    idx = compact_rows(spec.eff_targets.reshape(-1) != IGNORE) if spec.sync else None
    rows = kept if idx is None else kept[idx]
    choice = build_plan(rows, head["weight"].shape[0], head["hidden"].device, spec.sync)
    opts = _options(head, need, tile_elems=choice.tile_elems, cap=choice.cap)
    return LossPlan(**head, path="kept", options=opts, chunks=tuple(choice.arg()), support=kept,
                    kl="inside" if spec.exact_kl else None, support_logits=given)


def _one_pass_plan(head: dict, need, chunk_tokens: int | None) -> LossPlan | None:
    """Path B, or None when a sequence does not fit in one chunk (then two passes it is). The exact KL, if any:
    inside the chunks on the torch backend (the reference's tile next to the policy's), else its own
    ``fused_divergence`` pass whose [B, T] result enters the op."""
    spec, hidden, weight, backend = head["spec"], head["hidden"], head["weight"], head["backend"]
    chunks, rows = one_pass.plan_chunks(spec.in_mask, spec.granularity, weight.shape[0], need[1], chunk_tokens,
                                        backend, hidden.dtype, hidden.shape[-1], spec.sync,
                                        (need[0], spec.exact_kl and not is_triton(backend)))
    if chunks is None:
        return None
    kl = None if not spec.exact_kl else "outside" if is_triton(backend) else "inside"
    return LossPlan(**head, path="one-pass", options=_options(head, need, chunk_rows=rows),
                    chunks=tuple(x for pair in chunks for x in pair), kl=kl)


def run(plan: LossPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(loss, metrics, per-token log-probs [B * T]) of the planned call."""
    kl = _reference_kl(plan) if plan.kl == "outside" else None
    if plan.path == "two-pass":
        loss, metrics, logp = _two_pass(plan, kl)
    else:
        loss, metrics, logp = _op(plan, kl)
    if plan.support_metrics:
        metrics.update(plan.support_metrics)
    return loss, metrics, logp


def _op(plan: LossPlan, per_token_kl: torch.Tensor | None):
    """``fastrl::policy_loss_one_pass`` on the plan's tensors."""
    B, T, H = plan.hidden.shape
    spec = plan.spec
    ref = spec.ref if plan.kl == "inside" else (None, None, None)
    detached = tuple(None if t is None else t.detach() for t in ref)  # the reference gets no gradient
    support = (plan.support.ids, plan.support.offsets) if plan.path == "kept" else (None, None)
    # the exact KL given as a tensor (with its own graph) enters as an input: the op returns d loss / d KL with the
    # loss, and its backward hands grad_out times that to the KL's graph
    loss, mvec, _, _, _, logp_all, ent_all, _, kl = torch.ops.fastrl.policy_loss_one_pass(
        plan.hidden, plan.weight, plan.bias, spec.eff_targets, *spec.loss_tensors, per_token_kl,
        *detached, *support, list(plan.chunks), *plan.options, plan.support_logits,
    )
    if spec.sync and spec.check_finite:
        live = spec.eff_targets.reshape(-1) != IGNORE
        check_finite_outputs(logp_all, ent_all, live, plan.hidden.detach().reshape(B * T, H), (B, T))
        if kl.numel():
            check_divergence_finite(kl, None, live, plan.hidden.detach().reshape(B * T, H), ref[0].reshape(B * T, -1),
                                    (B, T), name="exact KL", teacher="ref_")
    return loss, dict(zip(spec.metric_names, mvec.unbind(0))), logp_all


def _two_pass(plan: LossPlan, per_token_kl: torch.Tensor | None):
    """Path A (or forward-only under no_grad): the plan's loss on fused per-token outputs."""
    tf, spec = plan.tf, plan.spec
    logp, ent = run_logprobs(plan.hidden, plan.weight, plan.bias, spec.eff_targets, tf, plan.backend,
                             with_entropy=True, ignore_index=IGNORE, check_finite=spec.check_finite, vocab_chunk=None,
                             sync=spec.sync)
    return (*spec.loss(logp, ent, per_token_kl), logp)


def _reference_kl(plan: LossPlan) -> torch.Tensor:  # [B, T]
    """Per-token KL(pi_theta || pi_ref) over the whole vocabulary, 0 outside the mask, as its own divergence pass
    (``fastrl.ops.divergence``'s plan and run, what ``fused_divergence`` runs with beta=1: the policy as the student
    and the reference as the teacher, with the policy's logit transform). The gradient flows to hidden, weight and
    bias; the reference is a constant."""
    spec, tf = plan.spec, plan.tf
    B, T, H = plan.hidden.shape
    opts = D.DivergenceOptions.of(1.0, tf, tf, False, plan.backend)
    active = spec.in_mask.reshape(-1)
    planned = D.plan_divergence(opts, (B, T), spec.sync, active, None, plan.weight.shape[0], plan.hidden.device)
    kl, _ = D.run_divergence(planned, plan.hidden, plan.weight, plan.bias, *plan.ref)
    if spec.check_finite and spec.sync:
        check_divergence_finite(kl.detach(), None, active, plan.hidden.reshape(B * T, H),
                                plan.ref[0].reshape(B * T, -1), (B, T), name="exact KL", teacher="ref_")
    return kl.reshape(B, T)
