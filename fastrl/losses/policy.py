"""Fused GRPO-family / PPO policy loss straight from hidden states: ``policy_loss`` and ``FusedPolicyLoss``.

Three execution paths, chosen by the configuration (never by the user), with the same numbers:

* one pass (path B, 6NHV FLOPs): when the loss gradient of a token is known as soon as the token's (or its
  sequence's) log-prob and entropy are (``PolicyLossConfig.one_pass_granularity``), each chunk of tokens has
  its logits computed once (stored in float32, with the row statistics), the per-token loss gradients are
  taken from the loss arithmetic, and ``G = dL/dy`` and the three gradient GEMMs follow at once. The
  gradients are ready when the forward returns; backward only scales them. This path is the custom op
  ``torch.ops.fastrl.policy_loss_one_pass`` (``fastrl.losses.one_pass``), one node under ``torch.compile``.
  With ``kl_estimator="exact"`` on the torch backend the reference's tile is computed next to the policy's in
  each chunk (``fastrl.losses.exact_kl``).
* over a support (``support=``): the same op on the kept-set engine (``fastrl.ops.one_pass_kept``): every
  value over the kept ids first, then the loss gradient once, for every loss type.
* two pass (path A, 8NHV): ``fused_logprobs`` + the loss arithmetic under autograd, for everything else
  (e.g. ``top_entropy_quantile`` < 1, which compares every token's entropy with a batch quantile, or a
  sequence-level ratio over sequences longer than a chunk), and always with ``backend="triton-fused"``, whose
  kernels never store a logit. Without gradients it is the forward-only path.

The loss arithmetic is ``fastrl.losses.arithmetic.policy_loss_from_logprobs`` (TRL 1.16's ``_compute_loss``;
``fastrl.reference`` re-exports it as the spec) in every path: there is one definition of the loss. For the
one-pass path it is differentiated with respect to a [B, T] buffer of log-probs and entropies in which rows not
yet computed hold placeholders; for a token- (or sequence-) separable loss the gradient of the rows just computed
does not depend on those placeholders.

``policy_loss`` checks once, plans once, then runs: ``_loss_side`` checks the loss's own inputs (types, shapes by a dry
run of the loss arithmetic, then the values, or the no-sync path's NaN flag) into a ``fastrl.ops.policy_run.LossSpec``;
``fastrl.ops.policy_run.plan`` checks the LM head (autocast, arguments, backend) and resolves the support, the path and
the op's chunks and options into one frozen ``LossPlan``; ``fastrl.ops.policy_run.run`` runs it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from fastrl.losses._checks import check_loss_inputs, check_loss_values, loss_values_bad
from fastrl.losses.config import PolicyLossConfig
from fastrl.losses.exact_kl import check_ref_inputs
from fastrl.losses.one_pass import LossInputs, PolicyOptions
from fastrl.ops import policy_run
from fastrl.ops.custom_ops import host_sync_enabled
from fastrl.ops.one_pass import IGNORE
from fastrl.ops.sharded import is_vocab_sharded

__all__ = ["policy_loss", "FusedPolicyLoss"]


def policy_loss(
    hidden: torch.Tensor,  # [B, T, H] last hidden states at the completion positions
    weight: torch.Tensor,  # [V, H] LM-head weight
    targets: torch.Tensor,  # [B, T] int64 completion token ids
    advantages: torch.Tensor,  # [B] or [B, T]
    mask: torch.Tensor,  # [B, T] bool or 0/1 completion mask
    *,
    config: PolicyLossConfig,
    old_logprobs: torch.Tensor | None = None,  # [B, T]; None: on-policy
    ref_logprobs: torch.Tensor | None = None,  # [B, T]; needed iff config.beta != 0
    bias: torch.Tensor | None = None,  # [V]
    importance_weights: torch.Tensor | None = None,  # [B] or [B, T]
    num_items_in_batch: torch.Tensor | int | float | None = None,
    sampling_logprobs: torch.Tensor | None = None,  # [B, T]; only for config.off_policy_mask_threshold
    ref_hidden: torch.Tensor | None = None,  # [B, T, H_ref]; config.kl_estimator == "exact" (instead of ref_logprobs)
    ref_weight: torch.Tensor | None = None,  # [V, H_ref]
    ref_bias: torch.Tensor | None = None,  # [V]
    logit_scale: float = 1.0,
    softcap: float | None = None,
    backend: str | None = None,
    chunk_tokens: int | None = None,
    check_finite: bool = True,
    support=None,  # None | fastrl.KeptSet (B*T rows) | fastrl.SamplerRule
    positions: torch.Tensor | None = None,  # [B, T] completion positions (SamplerRule.min_tokens)
    host_sync: bool | None = None,
    return_logprobs: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO-family (or PPO) policy loss from hidden states and the LM head, fused, with its metrics.

    Same value, gradients and metrics as TRL 1.16's ``GRPOTrainer._compute_loss`` on the log-probs of
    ``softmax(softcap(logit_scale * (hidden @ weight.T + bias)) / config.temperature)`` (gradient
    accumulation 1, one process), without materialising logits. PPO's policy loss (TRL PPOv2: token-level
    masked mean of the clipped surrogate, no KL in the loss) is ``config=PolicyLossConfig.ppo(cliprange)``.

    Args:
        hidden: ``[B, T, H]``, float32, bfloat16, float16 or float64: the last hidden states at the positions
            that predict the ``T`` completion tokens (in a causal LM, one position before each token).
        weight: ``[V, H]``, the LM head's weight; ``hidden``'s dtype and device. Or, under tensor parallelism, a
            ``DTensor`` placed ``Shard(0)`` on a 1-D mesh (``hidden`` the same on every rank): each rank computes
            its vocabulary rows, the statistics merged by O(N) all-reduces (``fastrl.ops.sharded``; eager only;
            docs/scaling-out.md).
        targets: ``[B, T]``, int32 or int64: the completion token ids. Only positions inside ``mask`` are
            read; they must be in ``[0, V)``.
        advantages: ``[B]`` (one per completion, GRPO) or ``[B, T]`` (per token, PPO), floating; a constant
            (no gradient flows into it).
        mask: ``[B, T]``, bool or 0/1 of any dtype: the completion tokens that count (usually up to and
            including EOS). Tokens outside it contribute nothing to the loss, the gradients or the metrics.
        config: a ``fastrl.PolicyLossConfig``: loss type, clipping, KL, entropy bonus, temperature, ...
        old_logprobs: ``[B, T]``, floating: the completion's log-probs under the policy that sampled it (before
            this update), for the ratio ``exp(logp - old)``. None means on-policy: ``old = logp.detach()``,
            so the ratio is 1 with the gradient of ``logp`` (TRL's case when each generation is trained on
            once).
        ref_logprobs: ``[B, T]``, floating: log-probs under the reference model, for the KL term; required
            when ``config.beta != 0`` with a k1/k2/k3 ``kl_estimator``, unused when beta is 0; must be None with
            ``kl_estimator="exact"``.
        bias: ``[V]`` or None; ``hidden``'s dtype.
        importance_weights: ``[B]`` or ``[B, T]`` (``[B, T]`` for vespo), floating, or None (all 1): a weight
            on each token's policy term (not on the KL): TRL's vLLM importance-sampling correction, the
            truncated or masked ratio between the trainer's old log-probs and the inference engine's.
        num_items_in_batch: tensor or number: the token count that the dapo, cispo and vespo losses divide
            their summed per-token terms by (TRL's ``num_items_in_batch``: the completion tokens of a whole
            optimizer step, which ``fastrl.GRPOTrainer`` rescales per process and micro-batch). None: the
            number of tokens in ``mask`` (one process, no gradient accumulation). Other loss types ignore it.
        sampling_logprobs: ``[B, T]``, floating: log-probs from the engine that sampled the completions
            (e.g. vLLM); read only by ``config.off_policy_mask_threshold`` (the off-policy sequence mask).
            None: ``old_logprobs``, as in TRL.
        ref_hidden, ref_weight, ref_bias: with ``config.kl_estimator="exact"`` and ``beta != 0`` (required then;
            refused with another estimator): the reference model's last hidden states ``[B, T, H_ref]`` at the
            same positions, its LM-head weight ``[V, H_ref]`` (same vocabulary, any hidden width) and bias. The KL
            term is then the exact ``KL(pi_theta || pi_ref)`` over the whole vocabulary at every token in the mask
            (``fastrl.fused_divergence(hidden, weight, ref_hidden, ref_weight, beta=1.0, ...)``'s number) under the
            same ``logit_scale``, ``softcap`` and ``config.temperature`` for both models, with its exact gradient
            w.r.t. hidden, weight and bias (none to the reference); placed where the k3 term is, not multiplied by
            the ratio, and the ``kl`` metric is its exact masked mean. On the one-pass path (torch backend) and over
            a support it is computed inside the loss's chunks, next to the policy's logits tile: 2N H_ref V FLOPs
            more than the loss (``fastrl.losses.exact_kl``); on the two-pass path and the Triton backends' one-pass
            path it is its own ``fused_divergence`` pass (2N(H + H_ref)V forward, 2N(H + H_ref)V + 4NHV
            backward). Never an ``[N, V]`` tensor.
        logit_scale, softcap, backend, check_finite: as in :func:`fastrl.fused_logprobs` (the temperature is
            ``config.temperature``). With ``backend="triton-fused"`` the loss always takes the two-pass path,
            on kernels that never store a logit (more FLOPs, less memory than the one-pass tile).
        chunk_tokens: tokens per one-pass chunk (default: a [chunk, V] float32 tile of 1 GiB on a GPU with a
            trained head, 256 MiB with a frozen one, 32 MB on a CPU; whole sequences when the loss couples the
            tokens of a sequence). Smaller uses less memory.
        support: None (the full softmax), a ``fastrl.KeptSet`` with one row per token of ``targets`` (``B * T``
            rows, row-major; tokens outside ``mask`` may keep nothing) or a ``fastrl.SamplerRule`` replayed on
            the policy's own logits (``fastrl.replay_rule``; a target the rule dropped is added to its set). The
            policy's log-probs and entropies are then those of ``pi^S`` (``fused_logprobs(support=...)``) for
            every loss type and both importance-sampling levels, and ``top_entropy_quantile`` ranks the support
            entropies. ``old_logprobs`` / ``ref_logprobs`` stay inputs: compute them over the same support. With
            a support the loss is one op over the kept ids on the kept-set engine (``fastrl.ops.kept``; ``K_max``
            logits per token on its per-row plan, docs/kept-set-costs.md), never a vocabulary walk: every value first, then the loss gradient once (exact for every loss type)
            and the gradient GEMMs; ``chunk_tokens`` is not read. The metrics gain ``sampling/kept_size_mean``
            (mean kept-set size over the tokens in ``mask``) and, for a rule, ``sampling/label_outside_frac`` (the
            fraction of those whose target the rule dropped). With ``kl_estimator="exact"`` the exact KL is over the support too (both
            models renormalised over each token's kept set; for a rule, the set replayed on the policy's logits).
        positions: with a ``SamplerRule`` that has ``min_tokens``: ``[B, T]`` completion positions (default:
            column t is position t).
        host_sync: None (default): host reads in eager, none while ``torch.compile`` traces; False forces the
            no-sync path (for CUDA graphs): on a device tokens outside the mask are computed (zeroed hidden states,
            no gradient) instead of being dropped and one-pass chunks are fixed ranges of whole rows (on CPU tensors
            the ops compute the live rows alone, without a support: docs/compile.md), a KeptSet runs on
            a kept-set plan chosen without host reads (the per-row plan unless the set overlaps), the value checks below multiply the loss by NaN instead of raising
            (so a bad input gives a NaN loss and NaN gradients; so does a KeptSet that lacks a counted target),
            and the ``check_finite`` checks are skipped (a non-finite value the loss reads makes the loss
            non-finite by itself). A ``SamplerRule`` is refused there (replay it first: ``fastrl.replay_rule``).

        return_logprobs: also return the per-token log-probs the loss computed (``[B, T]``, detached, 0 outside
            ``mask``; over the support when one is given): no extra pass, the ones the loss read (e.g. the
            trainer's side of the vLLM sampler gap, ``fastrl.trainers.grpo_vllm``).

    Returns:
        ``(loss, metrics)`` (``(loss, metrics, logprobs)`` with ``return_logprobs``): a 0-dim loss (float32; float64 for float64 inputs), differentiable w.r.t.
        hidden, weight and bias, and a dict of detached 0-dim metrics computed in the same pass (``kl``,
        ``entropy``, ``clip_ratio/*``, ``cispo_clip_ratio``, ``policy/*``, ``val/ratio``, ``val/ratio_var``;
        see ``fastrl.losses.arithmetic.policy_loss_from_logprobs`` for each).

    Fully masked rows and fully masked batches give loss 0 and gradient 0. Tokens outside the mask cost no
    work: the one-pass path computes logits for the tokens in the mask only.

    Input checks (``fastrl.losses._checks``), before any kernel runs: a non-empty batch (B, T >= 1); every tensor on
    hidden's device; ``mask``
    bool or 0/1 only (it selects tokens, it does not weight them: TRL's completion_mask is binary; per-token
    weights go in ``importance_weights``); no target equal to -100 inside the mask; ``num_items_in_batch`` a
    number or one-element tensor, >= 0, and 0 only for an empty mask; a target out of range inside the mask.
    With ``check_finite`` (the default), also non-finite ``advantages``, ``old_logprobs``, ``ref_logprobs``
    (beta != 0) and ``importance_weights`` where the loss reads them, and non-finite log-probs / entropies,
    raise ``FloatingPointError`` naming the tensor and position; ``check_finite=False`` turns those value
    checks off. A second backward through a retained graph accumulates the gradients again; double backward
    (``create_graph=True``) raises ``fastrl.ops.custom_ops.DoubleBackwardError`` (a RuntimeError).

    Example::

        import torch
        import fastrl

        B, T, H, V = 4, 16, 64, 1000
        hidden = torch.randn(B, T, H, requires_grad=True)  # model body output at the completion positions
        weight = torch.randn(V, H, requires_grad=True)  # LM-head weight
        completion_ids = torch.randint(0, V, (B, T))
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[0, 10:] = False  # this completion ended after 10 tokens
        advantages = torch.randn(B)  # one per completion (GRPO)
        with torch.no_grad():  # the log-probs before the update: forward only
            old, _ = fastrl.fused_logprobs(hidden, weight, completion_ids, with_entropy=False)
        config = fastrl.PolicyLossConfig(loss_type="dapo", entropy_coef=0.01)
        loss, metrics = fastrl.policy_loss(hidden, weight, completion_ids, advantages, mask,
                                           config=config, old_logprobs=old)
        loss.backward()  # fills hidden.grad and weight.grad
        print(loss.item(), metrics["clip_ratio/region_mean"].item(), metrics["entropy"].item())
    """
    spec, bad = _loss_side(hidden, weight, targets, advantages, mask, config, old_logprobs, ref_logprobs,
                           importance_weights, num_items_in_batch, sampling_logprobs, ref_hidden, ref_weight, ref_bias,
                           chunk_tokens, check_finite, host_sync)
    if is_vocab_sharded(weight):  # tensor parallelism (DTensor Shard(0)): two passes on the shards
        from fastrl.losses.sharded import run_sharded

        loss, metrics, logp = run_sharded(spec, hidden, weight, bias, logit_scale, softcap, backend, support,
                                          positions)
    else:
        plan = policy_run.plan(spec, hidden, weight, bias, targets, logit_scale, softcap, backend, chunk_tokens,
                               support, positions)
        loss, metrics, logp = policy_run.run(plan)
    loss = loss if bad is None else loss * torch.where(bad, float("nan"), 1.0).to(loss.dtype)
    if return_logprobs:
        return loss, metrics, torch.where(spec.in_mask, logp.detach().reshape(spec.in_mask.shape), 0.0)
    return loss, metrics


def _loss_side(hidden, weight, targets, advantages, mask, config, old_logprobs, ref_logprobs, importance_weights,
               num_items_in_batch, sampling_logprobs, ref_hidden, ref_weight, ref_bias, chunk_tokens, check_finite,
               host_sync) -> tuple[policy_run.LossSpec, torch.Tensor | None]:
    """Every check of the loss's own inputs, before any kernel runs: types, devices and shapes (a dry run of the
    O(B T) loss arithmetic on zeros), then the values (raise in eager; on the no-sync path a device flag, returned
    with the spec: the loss is multiplied by NaN where it is set)."""
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config must be a fastrl.PolicyLossConfig, got {type(config).__name__}")
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_loss_inputs(hidden, advantages=advantages, mask=mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                      importance_weights=importance_weights, sampling_logprobs=sampling_logprobs,
                      num_items_in_batch=num_items_in_batch)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H] for a policy loss, got shape {tuple(hidden.shape)}")
    B, T, H = hidden.shape
    if B == 0 or T == 0:
        raise ValueError(f"policy_loss needs at least one completion token: hidden has shape {tuple(hidden.shape)} "
                         f"and targets {tuple(targets.shape)} (B={B}, T={T}); skip the call for an empty batch")
    exact_kl = check_ref_inputs(config, hidden, weight, ref_logprobs, ref_hidden, ref_weight, ref_bias)
    if tuple(mask.shape) != tuple(targets.shape):
        raise ValueError(f"mask must have targets' shape {tuple(targets.shape)}, got {tuple(mask.shape)}")
    if tuple(targets.shape) != (B, T):
        raise ValueError(f"targets must have hidden's leading shape {(B, T)}, got {tuple(targets.shape)}")
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens <= 0):
        raise ValueError(f"chunk_tokens must be None or a positive int, got {chunk_tokens!r}")
    num_items = num_items_in_batch  # as the op takes it: a 0-dim tensor on hidden's device
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.device != hidden.device:
        # once here rather than in every one-pass chunk's loss: a host-to-device copy waits for all queued work
        num_items = num_items_in_batch = num_items_in_batch.to(hidden.device)
    elif num_items is not None and not isinstance(num_items, torch.Tensor):
        num_items = torch.full((), float(num_items), dtype=torch.float64, device=hidden.device)
    inputs = LossInputs(advantages, mask, old_logprobs, ref_logprobs, importance_weights,
                        num_items_in_batch, sampling_logprobs)
    # Validate every loss input (shapes, missing ref log-probs, ...) before any kernel runs: a dry run of the
    # O(B T) loss arithmetic on zeros, in the compute dtype (float64 for float64 inputs, else float32)
    with torch.no_grad():
        z0 = torch.zeros((B, T), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        _, dry = (dataclasses.replace(inputs, per_token_kl=z0) if exact_kl else inputs).loss(z0, z0, config)
    in_mask = mask.bool()
    eff_targets = torch.where(in_mask, targets.to(torch.int64), torch.full_like(targets, IGNORE, dtype=torch.int64))
    sync = host_sync_enabled(host_sync)
    if sync:
        check_loss_values(targets, advantages, mask, config=config, old_logprobs=old_logprobs,
                          ref_logprobs=ref_logprobs, importance_weights=importance_weights,
                          num_items_in_batch=num_items_in_batch, ignore_index=IGNORE, check_finite=check_finite)
        bad = None
    else:
        bad = loss_values_bad(targets, advantages, mask, config=config, num_items_in_batch=num_items_in_batch,
                              ignore_index=IGNORE, vocab_size=weight.shape[0])
    spec = policy_run.LossSpec(
        eff_targets, in_mask, config.temperature, config.one_pass_granularity, exact_kl,
        (ref_hidden, ref_weight, ref_bias),
        loss=functools.partial(_two_pass_loss, inputs, config), pack=functools.partial(_pack_options, config),
        loss_tensors=(advantages, mask, old_logprobs, ref_logprobs, importance_weights, num_items, sampling_logprobs),
        metric_names=tuple(dry), sync=sync, host_sync=host_sync,
        check_finite=check_finite)
    return spec, bad


def _two_pass_loss(inputs: LossInputs, config: PolicyLossConfig, logp, ent, per_token_kl):
    """The loss and its metrics on [B, T] log-probs and entropies (the two-pass path, under autograd)."""
    return (inputs if per_token_kl is None else dataclasses.replace(inputs, per_token_kl=per_token_kl)).loss(
        logp, ent, config)


def _pack_options(config: PolicyLossConfig, **fields) -> tuple[str, list[float], list[int]]:
    """The op's three option arguments: ``PolicyOptions(**fields)`` and the loss config."""
    return PolicyOptions(**fields).pack(config)


class FusedPolicyLoss(nn.Module):
    """``nn.Module`` form of :func:`policy_loss` with a fixed configuration.

    ``forward(hidden, weight, targets, advantages, mask, **kwargs)`` takes the arguments of ``policy_loss``
    after ``config`` (old_logprobs, ref_logprobs, bias, importance_weights, num_items_in_batch, ref_hidden,
    ref_weight, ref_bias, ...).
    """

    def __init__(self, config: PolicyLossConfig | None = None, **options):
        super().__init__()
        self.config = config if config is not None else PolicyLossConfig()
        if not isinstance(self.config, PolicyLossConfig):
            raise TypeError(f"config must be a fastrl.PolicyLossConfig, got {type(self.config).__name__}")
        self.options = options

    def forward(self, hidden, weight, targets, advantages, mask, **kwargs):
        return policy_loss(hidden, weight, targets, advantages, mask, config=self.config, **{**self.options, **kwargs})

    def extra_repr(self) -> str:
        return f"config={self.config}"
