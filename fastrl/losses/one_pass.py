"""The one-pass policy loss (path B, 6NHV FLOPs) as the custom op ``fastrl::policy_loss_one_pass``.

When the loss gradient of a token is known as soon as the token's (or its sequence's) log-prob and entropy are
(``PolicyLossConfig.one_pass_granularity``), the one-pass engine (``fastrl.ops.one_pass``) computes each chunk's
logits once and asks this module for the per-token loss gradients, taken from the loss arithmetic
(``fastrl.losses.arithmetic.policy_loss_from_logprobs``, the one definition of the loss: ``LossInputs.chunk_loss``);
``G = dL/dy`` and the three gradient GEMMs follow at once. The gradients are ready when the forward returns; the
op's backward only scales them. Over a support the op runs the kept-set engine instead
(``fastrl.ops.one_pass_kept``). ``fastrl.policy_loss`` (``fastrl.losses.policy``) checks the input, plans the
call and runs it; the op is registered when this module is imported (by ``fastrl.losses.policy``).

For a token- (or sequence-) separable loss the gradient of the rows just computed does not depend on the
placeholders that rows not yet computed hold in the [B, T] buffers of log-probs and entropies.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fastrl.losses.arithmetic import policy_loss_from_logprobs
from fastrl.losses.config import PolicyLossConfig
from fastrl.ops import one_pass as engine
from fastrl.ops import one_pass_kept as kept_engine
from fastrl.ops.config import LogitTransform
from fastrl.ops.custom_ops import (
    PackedOptions, acc_dtype, autograd_inside, define_op, empty_output, layout_of, refuse_double_backward,
)

__all__ = ["PolicyOptions", "LossInputs", "metric_names", "policy_loss_one_pass"]


@dataclass(frozen=True)
class LossInputs:
    """The per-token tensors and constants of the loss (everything but log-probs and entropies)."""

    advantages: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    importance_weights: torch.Tensor | None
    num_items_in_batch: torch.Tensor | int | float | None
    sampling_logprobs: torch.Tensor | None
    per_token_kl: torch.Tensor | None = None  # [B, T] exact KL (kl_estimator="exact"), may carry a graph

    def loss(self, logp: torch.Tensor, entropy: torch.Tensor, config: PolicyLossConfig, metrics: bool = True):
        return policy_loss_from_logprobs(
            logp, entropy, self.advantages, self.mask, config=config, old_logprobs=self.old_logprobs,
            ref_logprobs=self.ref_logprobs, importance_weights=self.importance_weights,
            num_items_in_batch=self.num_items_in_batch, sampling_logprobs=self.sampling_logprobs,
            per_token_kl=self.per_token_kl, with_metrics=metrics,
        )

    def constant_kl(self) -> LossInputs:
        """The same inputs with the exact KL detached (the one-pass path's per-chunk gradient evaluations)."""
        if self.per_token_kl is None:
            return self
        return dataclasses.replace(self, per_token_kl=self.per_token_kl.detach())

    def chunk_loss(self, config: PolicyLossConfig, B: int, T: int) -> engine.ChunkLoss:
        """This loss as the one-pass engine asks for it (``fastrl.ops.one_pass.ChunkLoss``). A KL given from outside
        (the Triton backends' fused_divergence pass) enters additively, so the per-token gradients w.r.t. logp /
        entropy do not depend on it: the chunks treat it as a constant, and its own gradient is taken on the final
        loss. A KL computed in the chunks (the op's ``ref_hidden``) fills the engine's KL buffer chunk by chunk."""
        constant = self.constant_kl()
        return engine.ChunkLoss(
            grads=functools.partial(_loss_grads, constant, config, B, T),
            final=functools.partial(_final_loss, self, config, B, T),
            logp_init=self.old_logprobs,
        )


def _loss_grads(inputs: LossInputs, config, B: int, T: int, ck: engine.Chunk, logp_all, ent_all, kl_all):
    """This chunk's rows' d loss / d (logp, entropy, exact KL), from the one loss definition, with the rows not yet
    computed holding placeholders (a token- or sequence-separable loss does not read them for these rows)."""
    lp = logp_all.detach().view(B, T).requires_grad_()
    en = ent_all.detach().view(B, T).requires_grad_()
    leaves = [lp, en]
    if kl_all is not None:  # the KL computed in these chunks: its placeholders are 0
        leaves.append(kl_all.detach().view(B, T).requires_grad_())
        inputs = dataclasses.replace(inputs, per_token_kl=leaves[2])
    with torch.enable_grad():
        loss, _ = inputs.loss(lp, en, config, metrics=False)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return tuple(None if g is None else ck.take(g.reshape(-1)).contiguous() for g in grads) + (None,) * (3 - len(grads))


def _final_loss(inputs: LossInputs, config, B: int, T: int, logp_all, ent_all, kl_all):
    """(loss, metrics, d loss / d per_token_kl or None) once every row is computed."""
    if kl_all is not None:  # the KL computed in the chunks: a constant here, its gradient is in the GEMMs already
        inputs = dataclasses.replace(inputs, per_token_kl=kl_all.view(B, T))
    elif inputs.per_token_kl is not None:
        # log-probs and entropies enter as constants; d loss / d KL (the loss type's normaliser times beta, per
        # token) is what the caller's backward hands to the KL's own graph
        with torch.enable_grad():
            kl = inputs.per_token_kl.detach().requires_grad_()
            loss, metrics = dataclasses.replace(inputs, per_token_kl=kl).loss(
                logp_all.view(B, T), ent_all.view(B, T), config)
            (grad_kl,) = torch.autograd.grad(loss, kl)
        return loss.detach(), metrics, grad_kl
    with torch.no_grad():
        loss, metrics = inputs.loss(logp_all.view(B, T), ent_all.view(B, T), config)
    return loss, metrics, None


def _whole_loss(inputs: LossInputs, config, logp_all, ent_all, kl_all, leaves: bool):
    """(loss, metrics, d loss / d (logp, entropy[, KL]) when ``leaves``) with every row's value known (the kept-set
    engine's loss: no placeholders, exact for every loss type)."""
    with torch.enable_grad():
        lp, en = logp_all.detach().requires_grad_(), ent_all.detach().requires_grad_()
        kl = None if kl_all is None else kl_all.detach().requires_grad_()
        loss, metrics = (inputs if kl is None else dataclasses.replace(inputs, per_token_kl=kl)).loss(lp, en, config)
        grads = None
        if leaves:
            grads = torch.autograd.grad(loss, [lp, en] + ([kl] if kl is not None else []), allow_unused=True)
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads


def metric_names(config: PolicyLossConfig) -> tuple[str, ...]:
    """The metric names the loss arithmetic returns for ``config`` (entropies given), in its order: read off the
    arithmetic itself, run on one zero token (the op's ``n_metrics`` option is their count)."""
    z = torch.zeros((1, 1), dtype=torch.float32)
    exact = config.kl_estimator == "exact"
    _, metrics = LossInputs(z[:, 0], z.bool(), None, None if exact else z, None, None, None,
                            z if exact else None).loss(z, z, config)
    return tuple(metrics)


# ---------------------------------------------------------------------------------------------------------
# the custom op: fastrl::policy_loss_one_pass (the gradients are formed in the forward)
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyOptions(PackedOptions):
    """Scalar options of ``fastrl::policy_loss_one_pass``: the loss config, the logit transform (its
    temperature is the config's), the backend, which inputs need a gradient, and how rows are chunked.

    ``compact``: the ``chunks`` argument holds ranges of live (in-mask) rows found on the host (eager). False:
    no host synchronisation: chunks of ``chunk_rows`` rows (whole sequences when the loss couples a sequence's tokens)
    over the live rows where their count is read without a synchronisation (CPU tensors, ``engine.nosync_chunks``),
    else fixed chunks over all rows, rows outside the mask computed with zeroed hidden states and no gradient.

    ``consume_grads``: the backward may scale the gradient outputs (2-4) in place and hand them on, when it runs
    eagerly through a graph not kept for another backward (``fastrl.policy_loss`` sets it: nothing else holds them);
    no second ``[V, H]`` gradient is then alive at the peak. False: they are outputs like any other, never changed.
    """

    logit_scale: float = 1.0
    softcap: Optional[float] = None
    backend: str = "torch"
    need_hidden: bool = True
    need_weight: bool = True
    need_bias: bool = False
    compact: bool = True
    chunk_rows: int = 1
    tile_elems: int = 0  # the kept-set engine's bounds with a support (fastrl.ops.kept.capacity)
    cap: int = 0
    consume_grads: bool = False

    n_metrics: int = 0  # len(metric_names(config)): the length of the op's metrics output

    def tf(self, config: PolicyLossConfig) -> LogitTransform:
        return LogitTransform(temperature=config.temperature, logit_scale=self.logit_scale, softcap=self.softcap)


PolicyOptions._LAYOUT = layout_of(PolicyOptions)
PolicyOptions._WITH = ((PolicyLossConfig, layout_of(PolicyLossConfig)),)  # pack(config): the loss config travels too


@define_op("policy_loss_one_pass")
def policy_loss_one_pass(
    hidden: torch.Tensor,  # [B, T, H]
    weight: torch.Tensor,  # [V, H]
    bias: Optional[torch.Tensor],  # [V]
    targets: torch.Tensor,  # [B, T] int64, -100 outside the mask
    advantages: torch.Tensor,  # [B] or [B, T]
    mask: torch.Tensor,  # [B, T]
    old_logprobs: Optional[torch.Tensor],
    ref_logprobs: Optional[torch.Tensor],
    importance_weights: Optional[torch.Tensor],
    num_items_in_batch: Optional[torch.Tensor],  # 0-dim
    sampling_logprobs: Optional[torch.Tensor],
    per_token_kl: Optional[torch.Tensor],  # [B, T] the exact KL (kl_estimator="exact"), differentiable outside
    ref_hidden: Optional[torch.Tensor],  # [B, T, H_ref] or the exact KL computed in the chunks from the reference
    ref_weight: Optional[torch.Tensor],  # [V, H_ref]
    ref_bias: Optional[torch.Tensor],  # [V]
    support_ids: Optional[torch.Tensor],  # a KeptSet's CSR ids [nnz] and offsets [B*T + 1]: the loss over it
    support_offsets: Optional[torch.Tensor],
    chunks: list[int],  # flattened (c0, c1) ranges of live rows (compact), or [] (no-sync: fixed chunks); with a
    # support: the kept-set engine's plan argument (fastrl.ops.kept.build_plan(...).arg() on the rows it computes)
    opt_str: str,  # PolicyOptions.pack(config)
    opt_float: list[float],
    opt_int: list[int],
    support_logits: Optional[torch.Tensor] = None,  # [nnz] the support's entries' logits, computed (a rule's replay)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    # (loss [], metrics [n_metrics] in the order the loss arithmetic names them, grad hidden [B, T, H],
    #  grad weight [V, H], grad bias [V] (each [0] when not needed), logprobs [B*T], entropy [B*T], d loss / d per_token_kl [B, T] (or [0]),
    #  the exact KL computed from ref_hidden [B*T] (or [0]))
    o, config = PolicyOptions.unpack(opt_str, opt_float, opt_int)
    B, T, H = hidden.shape
    h2 = hidden.reshape(B * T, H)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    t2 = targets.reshape(-1)
    inputs = LossInputs(advantages, mask, old_logprobs, ref_logprobs, importance_weights, num_items_in_batch,
                        sampling_logprobs, per_token_kl)
    need = (o.need_hidden, o.need_weight, o.need_bias and bias is not None)
    ref = None if ref_hidden is None else (ref_hidden.reshape(B * T, -1), ref_weight, ref_bias)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False), autograd_inside():
        if support_ids is not None:  # the kept-set engine: every value first, then one loss gradient
            loss, metrics, grads, logp_all, ent_all, kl = kept_engine.run(
                h2, weight, bias, t2, B, T, functools.partial(_whole_loss, inputs, config), o.tf(config), support_ids,
                support_offsets, need, o.compact, ref, (o.tile_elems, o.cap), plan_arg=chunks, backend=o.backend,
                given=support_logits)
            grad_kl = None
        else:
            if o.compact:
                pairs, rows = list(zip(chunks[0::2], chunks[1::2])), None
            else:  # no-sync: the live rows alone where their count is read without a sync (fastrl.ops.live)
                pairs, rows = engine.nosync_chunks(t2.view(B, T) != engine.IGNORE, config.one_pass_granularity,
                                                   o.chunk_rows, o.backend)
            loss, metrics, grads, logp_all, ent_all, grad_kl, kl = engine.run(
                h2, weight, bias, t2, o.tf(config), o.backend, pairs, need,
                inputs.chunk_loss(config, B, T), compact=o.compact, ref=ref, live_rows=rows,
            )
    assert len(metrics) == o.n_metrics, f"{len(metrics)} metrics, the options say {o.n_metrics}"
    gh, gw, gb = grads
    return (
        loss, torch.stack(list(metrics.values())),
        gh.view(B, T, H) if gh is not None else empty_output(hidden),
        gw if gw is not None else empty_output(weight),
        gb if gb is not None else empty_output(hidden),
        logp_all, ent_all,
        grad_kl if grad_kl is not None else hidden.new_empty((0,), dtype=acc_dtype(hidden.dtype)),
        kl.reshape(-1) if kl is not None else hidden.new_empty((0,), dtype=acc_dtype(hidden.dtype)),
    )


@policy_loss_one_pass.register_fake
def _(hidden, weight, bias, targets, advantages, mask, old_logprobs, ref_logprobs, importance_weights,
      num_items_in_batch, sampling_logprobs, per_token_kl, ref_hidden, ref_weight, ref_bias, support_ids,
      support_offsets, chunks, opt_str, opt_float, opt_int, support_logits=None):
    o, config = PolicyOptions.unpack_symbolic(opt_str, opt_float, opt_int)
    B, T, _ = hidden.shape
    cdt = acc_dtype(hidden.dtype)
    return (
        hidden.new_empty((), dtype=cdt),
        hidden.new_empty((o.n_metrics,), dtype=cdt),
        torch.empty_like(hidden) if o.need_hidden else empty_output(hidden),
        torch.empty_like(weight) if o.need_weight else empty_output(weight),
        torch.empty_like(bias) if o.need_bias and bias is not None else empty_output(hidden),
        hidden.new_empty((B * T,), dtype=cdt),
        hidden.new_empty((B * T,), dtype=cdt),
        hidden.new_empty((B, T), dtype=cdt) if per_token_kl is not None else hidden.new_empty((0,), dtype=cdt),
        hidden.new_empty((B * T,), dtype=cdt) if ref_hidden is not None else hidden.new_empty((0,), dtype=cdt),
    )


_KL_INPUT = 11  # position of per_token_kl among policy_loss_one_pass's inputs
_N_INPUTS = 22


def _policy_setup(ctx, inputs, output):
    _, metrics, gh, gw, gb, logp, ent, grad_kl, kl = output
    # the gradients were formed in the forward: backward only scales them (PyTorch's rules for saved tensors
    # hold: a second backward through a retained graph hands them out again, a freed graph raises)
    ctx.save_for_backward(gh, gw, gb, grad_kl)
    ctx.consume = PolicyOptions.unpack_symbolic(*inputs[_N_INPUTS - 4 : _N_INPUTS - 1])[0].consume_grads
    ctx.mark_non_differentiable(metrics, gh, gw, gb, logp, ent, grad_kl, kl)
    ctx.set_materialize_grads(False)


def _policy_backward(ctx, grad_loss, *_unused):
    refuse_double_backward("fastrl.policy_loss")
    gh, gw, gb, grad_kl = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if grad_loss is None:
        return (None,) * _N_INPUTS

    # In eager, when the graph is not kept for another backward, the saved gradients die with this call: scale them
    # in place and hand them on (no second [V, H] / [N, H] gradient alive at the peak: 2 V H bytes at bf16). A kept
    # graph (retain_graph=True) or a traced backward gets scaled copies, so a second backward sees the saved ones.
    in_place = (ctx.consume and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
                and not torch._C._autograd._get_current_graph_task_keep_graph())

    def scale(g, needed):
        if not needed or not g.numel():
            return None
        if in_place and type(g) is torch.Tensor:  # not a traced (fake, functional) tensor
            return g.mul_(grad_loss.to(g.dtype))
        return g * grad_loss.to(g.dtype)

    grads = [scale(gh, need[0]), scale(gw, need[1]), scale(gb, need[2])] + [None] * (_N_INPUTS - 3)
    grads[_KL_INPUT] = scale(grad_kl, ctx.needs_input_grad[_KL_INPUT])  # into the exact KL's own graph
    return tuple(grads)


policy_loss_one_pass.register_autograd(_policy_backward, setup_context=_policy_setup)
