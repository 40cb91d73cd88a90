"""Fused GRPO-family / PPO policy loss straight from hidden states: ``policy_loss`` and ``FusedPolicyLoss``.

Two execution paths, chosen by the configuration (never by the user), with the same numbers:

* one pass (path B, 6NHV FLOPs): when the loss gradient of a token is known as soon as the token's (or its
  sequence's) log-prob and entropy are (``PolicyLossConfig.one_pass_granularity``), each chunk of tokens has
  its logits computed once (stored in float32, with the row statistics), the per-token loss gradients are
  taken from the loss arithmetic, and ``G = dL/dy`` and the three gradient GEMMs follow at once. The
  gradients are ready when the forward returns; backward only scales them. This path is the custom op
  ``torch.ops.fastrl.policy_loss_one_pass`` (``fastrl.losses.one_pass``), one node under ``torch.compile``.
* two pass (path A, 8NHV): ``fused_logprobs`` + the loss arithmetic under autograd, for everything else
  (e.g. ``top_entropy_quantile`` < 1, which compares every token's entropy with a batch quantile, or a
  sequence-level ratio over sequences longer than a chunk), and always with ``backend="triton-fused"``, whose
  kernels never store a logit. Without gradients it is the forward-only path.

The loss arithmetic is ``fastrl.reference.policy_loss_from_logprobs`` (TRL 1.16's ``_compute_loss``) in both:
there is one definition of the loss. For the one-pass path it is differentiated with respect to a [B, T]
buffer of log-probs and entropies in which rows not yet computed hold placeholders; for a token- (or
sequence-) separable loss the gradient of the rows just computed does not depend on those placeholders.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fastrl.losses._checks import check_loss_inputs, check_loss_values, loss_values_bad
from fastrl.losses.config import PolicyLossConfig
from fastrl.losses import one_pass
from fastrl.losses.one_pass import _IGNORE, PolicyOptions, _chunk_budget, _LossInputs, metric_keys
from fastrl.ops import torch_backend as TB
from fastrl.ops._checks import autocast_inputs, check_finite_outputs, check_linear_inputs, check_targets, dense_bias
from fastrl.ops.backend import is_triton, resolve_backend
from fastrl.ops.config import LogitTransform
from fastrl.ops.linear_logprob import fused_logprobs, host_sync_enabled, unit_stride

__all__ = ["policy_loss", "FusedPolicyLoss"]


# ----------------------------------------------------------------------------------------------------------
# The exact reference KL (kl_estimator="exact")
# ----------------------------------------------------------------------------------------------------------


def _check_ref_inputs(config, hidden, weight, ref_logprobs, ref_hidden, ref_weight, ref_bias) -> bool:
    """Validate the reference-model inputs of the exact KL; True when the loss needs the exact KL.

    Runs before any kernel. With ``kl_estimator="exact"`` and ``beta != 0``: ``ref_hidden`` ``[B, T, H_ref]`` and
    ``ref_weight`` ``[V, H_ref]`` (the policy's vocabulary; the hidden width may differ), ``ref_bias`` None or
    ``[V]``, floating, on hidden's device, no ``ref_logprobs``. Otherwise none of the three may be given.
    """
    given = [n for n, t in (("ref_hidden", ref_hidden), ("ref_weight", ref_weight), ("ref_bias", ref_bias))
             if t is not None]
    if config.kl_estimator != "exact":
        if given:
            raise ValueError(
                f"{', '.join(given)} given but config.kl_estimator={config.kl_estimator!r}: the reference model's "
                "hidden states and head are read only with kl_estimator='exact' (k1/k2/k3 take ref_logprobs)"
            )
        return False
    if ref_logprobs is not None:
        raise ValueError(
            "ref_logprobs must be None with config.kl_estimator='exact': the exact KL is computed over the whole "
            "vocabulary from the reference model's last hidden states and head (ref_hidden, ref_weight, ref_bias)"
        )
    if config.beta == 0.0:
        return False  # no KL term: the reference inputs, if any, are not read
    for name, t in (("ref_hidden", ref_hidden), ("ref_weight", ref_weight)):
        if t is None:
            raise ValueError(
                f"{name} is None but config.kl_estimator='exact' with beta={config.beta} needs the reference "
                "model's last hidden states ref_hidden [B, T, H_ref] and LM-head weight ref_weight [V, H_ref]"
            )
    for name, t in (("ref_hidden", ref_hidden), ("ref_weight", ref_weight), ("ref_bias", ref_bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}, got {t.device}")
    B, T = hidden.shape[:2]
    if ref_hidden.dim() != 3 or tuple(ref_hidden.shape[:2]) != (B, T):
        raise ValueError(
            f"ref_hidden must be [B, T, H_ref] = [{B}, {T}, H_ref] (the reference model's last hidden states at "
            f"hidden's positions), got shape {tuple(ref_hidden.shape)}"
        )
    V = weight.shape[0]
    if ref_weight.dim() != 2 or ref_weight.shape[1] != ref_hidden.shape[2]:
        raise ValueError(
            f"ref_weight must be [V, H_ref] with H_ref = ref_hidden.shape[-1] = {ref_hidden.shape[2]}, got shape "
            f"{tuple(ref_weight.shape)}"
        )
    if ref_weight.shape[0] != V:
        raise ValueError(
            f"ref_weight's vocabulary must be the policy's (V = weight.shape[0] = {V}): the KL compares the two "
            f"distributions token by token, got ref_weight with V = {ref_weight.shape[0]}"
        )
    if ref_bias is not None and tuple(ref_bias.shape) != (V,):
        raise ValueError(f"ref_bias must be None or [V] = [{V}], got shape {tuple(ref_bias.shape)}")
    return True


def exact_reference_kl(
    hidden: torch.Tensor,  # [B, T, H], the policy; the KL's gradient flows to it, weight and bias
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    ref_hidden: torch.Tensor,  # [B, T, H_ref], a constant
    ref_weight: torch.Tensor,  # [V, H_ref], a constant
    ref_bias: torch.Tensor | None,  # [V], a constant
    mask: torch.Tensor,  # [B, T] bool
    tf: LogitTransform,
    backend: str,
    check_finite: bool,
    support=None,  # a KeptSet: both distributions renormalised over it (sampling replay)
    ref_tf: LogitTransform | None = None,  # the reference's logit scale / softcap; None: the policy's
) -> torch.Tensor:  # [B, T]
    """Per-token KL(pi_theta || pi_ref) over the whole vocabulary (or the support), 0 outside the mask.

    The one definition of the exact reference KL (``policy_loss`` and ``fastrl.PPOTrainer``'s rollout reward):
    ``fused_divergence`` with beta=1 (KL(student || teacher)), the policy as the student and the reference as the
    teacher, under the policy's temperature; the reference's logit scale and softcap are the policy's unless
    ``ref_tf`` says otherwise (a separate reference model with its own config).
    """
    from fastrl.ops.divergence import fused_divergence

    ref_tf = tf if ref_tf is None else ref_tf
    options = {} if support is None else {"support": support}
    try:
        return fused_divergence(
            hidden, weight, ref_hidden.detach(), ref_weight.detach(), beta=1.0, temperature=tf.temperature, bias=bias,
            teacher_bias=None if ref_bias is None else ref_bias.detach(), logit_scale=tf.logit_scale,
            teacher_logit_scale=ref_tf.logit_scale, softcap=tf.softcap, teacher_softcap=ref_tf.softcap, mask=mask,
            check_finite=check_finite, backend=backend, **options,
        )
    except (FloatingPointError, ValueError, TypeError) as e:
        # name the arguments as the caller knows them (the reference is fused_divergence's teacher)
        message = str(e).replace("teacher_", "ref_").replace("non-finite divergence", "non-finite exact KL")
        raise type(e)(message) from None


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO-family (or PPO) policy loss from hidden states and the LM head, fused, with its metrics.

    Same value, gradients and metrics as TRL 1.16's ``GRPOTrainer._compute_loss`` on the log-probs of
    ``softmax(softcap(logit_scale * (hidden @ weight.T + bias)) / config.temperature)`` (gradient
    accumulation 1, one process), without materialising logits. PPO's policy loss (TRL PPOv2: token-level
    masked mean of the clipped surrogate, no KL in the loss) is ``config=PolicyLossConfig.ppo(cliprange)``.

    Args:
        hidden: ``[B, T, H]``, float32, bfloat16, float16 or float64: the last hidden states at the positions
            that predict the ``T`` completion tokens (in a causal LM, one position before each token).
        weight: ``[V, H]``, the LM head's weight; ``hidden``'s dtype and device.
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
            term is then the exact ``KL(pi_theta || pi_ref)`` over the whole vocabulary at every token in the mask,
            ``fastrl.fused_divergence(hidden, weight, ref_hidden, ref_weight, beta=1.0, ...)`` under the same
            ``logit_scale``, ``softcap`` and ``config.temperature`` for both models, with its exact gradient
            w.r.t. hidden, weight and bias (none to the reference); placed where the k3 term is, not multiplied by
            the ratio, and the ``kl`` metric is its exact masked mean. Costs ``fused_divergence``'s passes over
            both heads (2N(H + H_ref)V FLOPs forward; the backward recomputes both heads' tiles and adds 4NHV),
            on top of the policy loss's, never an ``[N, V]`` tensor.
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
            a support the loss takes path A over the kept ids, O(B T K H), never the one-pass vocabulary tile;
            ``chunk_tokens`` is not read. The metrics gain ``sampling/kept_size_mean`` (mean kept-set size over
            the tokens in ``mask``) and, for a rule, ``sampling/label_outside_frac`` (the fraction of those whose
            target the rule dropped). With ``kl_estimator="exact"`` the exact KL is over the support too (both
            models renormalised over each token's kept set; for a rule, the set replayed on the policy's logits).
        positions: with a ``SamplerRule`` that has ``min_tokens``: ``[B, T]`` completion positions (default:
            column t is position t).
        host_sync: None (default): host reads in eager, none while ``torch.compile`` traces; False forces the
            no-sync path (for CUDA graphs): tokens outside the mask are computed (zeroed hidden states, no
            gradient) instead of being dropped, one-pass chunks are fixed ranges of whole rows, the value checks
            below multiply the loss by NaN instead of raising (so a bad input gives a NaN loss and NaN
            gradients), and the ``check_finite`` checks are skipped (a non-finite value the loss reads makes the
            loss non-finite by itself).

    Returns:
        ``(loss, metrics)``: a 0-dim loss (float32; float64 for float64 inputs), differentiable w.r.t.
        hidden, weight and bias, and a dict of detached 0-dim metrics computed in the same pass (``kl``,
        ``entropy``, ``clip_ratio/*``, ``cispo_clip_ratio``, ``policy/*``, ``val/ratio``, ``val/ratio_var``;
        see ``fastrl.reference.policy_loss_from_logprobs`` for each).

    Fully masked rows and fully masked batches give loss 0 and gradient 0. Tokens outside the mask cost no
    work: the one-pass path computes logits for the tokens in the mask only.

    Input checks (``fastrl.losses._checks``), before any kernel runs: every tensor on hidden's device; ``mask``
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
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config must be a fastrl.PolicyLossConfig, got {type(config).__name__}")
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    check_linear_inputs(hidden, weight, targets, bias)
    bias = dense_bias(bias)
    check_loss_inputs(hidden, advantages=advantages, mask=mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                      importance_weights=importance_weights, sampling_logprobs=sampling_logprobs,
                      num_items_in_batch=num_items_in_batch)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H] for a policy loss, got shape {tuple(hidden.shape)}")
    exact_kl = _check_ref_inputs(config, hidden, weight, ref_logprobs, ref_hidden, ref_weight, ref_bias)
    if tuple(mask.shape) != tuple(targets.shape):
        raise ValueError(f"mask must have targets' shape {tuple(targets.shape)}, got {tuple(mask.shape)}")
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens <= 0):
        raise ValueError(f"chunk_tokens must be None or a positive int, got {chunk_tokens!r}")
    tf = LogitTransform(temperature=config.temperature, logit_scale=logit_scale, softcap=softcap)
    B, T, H = hidden.shape
    V = weight.shape[0]
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.device != hidden.device:
        # once here rather than in every one-pass chunk's loss: a host-to-device copy waits for all queued work
        num_items_in_batch = num_items_in_batch.to(hidden.device)
    inputs = _LossInputs(advantages, mask, old_logprobs, ref_logprobs, importance_weights,
                         num_items_in_batch, sampling_logprobs)
    # Validate every loss input (shapes, missing ref log-probs, ...) before any kernel runs: a dry run of
    # the O(B T) loss arithmetic on zeros.
    with torch.no_grad():
        z0 = torch.zeros((B, T), dtype=TB.acc_dtype(hidden.dtype), device=hidden.device)
        (dataclasses.replace(inputs, per_token_kl=z0) if exact_kl else inputs).loss(z0, z0, config)
    if host_sync is False and (support is not None or exact_kl):
        raise ValueError(
            "support= and kl_estimator='exact' need host synchronisation in eager (the kept-set path sizes its "
            "chunks on the host; fused_divergence compacts masked rows), so they cannot run with host_sync=False. "
            "Under torch.compile the exact KL without a support traces as one op (fastrl::divergence); a support "
            "runs as a graph break"
        )
    sync = host_sync_enabled(host_sync)
    poison = None
    if sync:
        check_loss_values(targets, advantages, mask, config=config, old_logprobs=old_logprobs,
                          ref_logprobs=ref_logprobs, importance_weights=importance_weights,
                          num_items_in_batch=num_items_in_batch, ignore_index=_IGNORE, check_finite=check_finite)
    else:  # no host read: a failed value check multiplies the loss (and so every gradient) by NaN
        bad = loss_values_bad(targets, advantages, mask, config=config, num_items_in_batch=num_items_in_batch,
                              ignore_index=_IGNORE, vocab_size=V)
        poison = torch.where(bad, float("nan"), 1.0).to(TB.acc_dtype(hidden.dtype))

    in_mask = mask.bool()
    eff_targets = torch.where(in_mask, targets.to(torch.int64), torch.full_like(targets, _IGNORE, dtype=torch.int64))
    if sync:
        check_targets(eff_targets, V, _IGNORE)
    name = resolve_backend(hidden.device, backend)
    kept = outside = None
    if support is not None:
        from fastrl.ops.kept import resolve_support

        # a KeptSet is checked against the targets; a rule is replayed on the policy's own logits (no grad)
        kept, outside = resolve_support(support, hidden, weight, bias, eff_targets, tf, _IGNORE, positions, name)
    if exact_kl:
        # the exact KL first, under autograd (its gradient reaches hidden / weight / bias through its own graph);
        # with a support, over it (a rule: the policy's replayed sets, both distributions renormalised there)
        kl = exact_reference_kl(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, in_mask, tf, name, check_finite,
                                support=kept)
        inputs = dataclasses.replace(inputs, per_token_kl=kl)

    need = (
        hidden.requires_grad,
        weight.requires_grad,
        bias is not None and bias.requires_grad,
    )
    if support is not None:
        return _support_loss(hidden, weight, bias, eff_targets, in_mask, inputs, config, tf, name, support, kept,
                             outside, check_finite)
    granularity = config.one_pass_granularity
    chunks = None
    # The one-pass path keeps each chunk's logits in a float32 tile (cuBLAS writes it on the Triton backends).
    # "triton-fused" promises that no logit is ever stored, so there the loss takes path A on the fused kernels:
    # 8NHV instead of 6NHV, but no [chunk, V] tile and no float32 [V, H] weight-gradient accumulator.
    if torch.is_grad_enabled() and any(need) and granularity is not None and name != "triton-fused":
        if sync:
            chunks = one_pass._chunks(in_mask, granularity, V, hidden.device, need[1], chunk_tokens)
        else:  # fixed chunks over all rows, from shapes alone; a sequence longer than a chunk: two passes
            budget = _chunk_budget(V, hidden.device, need[1], chunk_tokens)
            chunks = [] if granularity == "token" or T <= budget else None
    if chunks is None:
        # two-pass path (or forward-only under no_grad): the same loss on fused per-token outputs
        logp, ent = fused_logprobs(
            hidden, weight, eff_targets, bias=bias, temperature=tf.temperature, logit_scale=tf.logit_scale,
            softcap=tf.softcap, with_entropy=True, ignore_index=_IGNORE, check_finite=check_finite,
            backend=name, host_sync=sync,
        )
        loss, metrics = inputs.loss(logp, ent, config)
        return (loss if poison is None else loss * poison), metrics

    if is_triton(name) and hidden.dtype == torch.float64:
        raise TypeError("the triton backends compute from float32, bfloat16 or float16 inputs; use backend='torch' for float64")
    opts = PolicyOptions(
        logit_scale=float(tf.logit_scale),
        softcap=None if tf.softcap is None else float(tf.softcap), backend=name, need_hidden=need[0],
        need_weight=need[1], need_bias=need[2], compact=sync,
        chunk_rows=_chunk_budget(V, hidden.device, need[1], chunk_tokens),
    )
    num_items = num_items_in_batch
    if num_items is not None and not isinstance(num_items, torch.Tensor):
        num_items = torch.full((), float(num_items), dtype=torch.float64, device=hidden.device)
    # the exact KL (a [B, T] tensor with its own graph) enters the op as an input: the op returns d loss / d KL
    # with the loss, and its backward hands grad_out times that to the KL's graph
    loss, mvec, _, _, _, logp_all, ent_all, _ = torch.ops.fastrl.policy_loss_one_pass(
        hidden, unit_stride(weight), bias, eff_targets, advantages, mask, old_logprobs, ref_logprobs,
        importance_weights, num_items, sampling_logprobs, inputs.per_token_kl, [c for pair in chunks for c in pair],
        *opts.pack(config),
    )
    if sync and check_finite:
        check_finite_outputs(logp_all, ent_all, eff_targets.reshape(-1) != _IGNORE,
                             hidden.detach().reshape(B * T, H), (B, T))
    metrics = dict(zip(metric_keys(config), mvec.unbind(0)))
    return (loss if poison is None else loss * poison), metrics


def _support_loss(hidden, weight, bias, eff_targets, in_mask, inputs: _LossInputs, config, tf, name, support,
                  ks, outside, check_finite):
    """Path A over the kept set ``ks`` (``resolve_support``'s; None: a rule that keeps every id): O(B T K H), no
    vocabulary walk, so the one-pass tile would buy nothing."""
    from fastrl.ops.support import SamplerRule

    logp, ent = fused_logprobs(
        hidden, weight, eff_targets, bias=bias, temperature=tf.temperature, logit_scale=tf.logit_scale,
        softcap=tf.softcap, with_entropy=True, ignore_index=_IGNORE, check_finite=check_finite, backend=name,
        support=ks,
    )
    loss, metrics = inputs.loss(logp, ent, config)
    dt, dev = logp.dtype, logp.device
    live = in_mask.reshape(-1)
    count = live.sum().clamp(min=1).to(dt)
    if ks is None:  # a rule that keeps every id
        sizes = torch.full(live.shape, weight.shape[0], dtype=dt, device=dev)
    else:
        sizes = ks.sizes().to(dt)
    metrics["sampling/kept_size_mean"] = torch.where(live, sizes, 0).sum() / count
    if isinstance(support, SamplerRule):
        metrics["sampling/label_outside_frac"] = (outside.reshape(-1) & live).sum().to(dt) / count
    return loss, metrics


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
