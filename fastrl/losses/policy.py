"""Fused GRPO-family / PPO policy loss straight from hidden states: ``policy_loss`` and ``FusedPolicyLoss``.

Two execution paths, chosen by the configuration (never by the user), with the same numbers:

* one pass (path B, 6NHV FLOPs): when the loss gradient of a token is known as soon as the token's (or its
  sequence's) log-prob and entropy are (``PolicyLossConfig.one_pass_granularity``), each chunk of tokens has
  its logits computed once (stored in float32, with the row statistics), the per-token loss gradients are
  taken from the loss arithmetic, and ``G = dL/dy`` and the three gradient GEMMs follow at once. The
  gradients are ready when the forward returns; backward only scales them.
* two pass (path A, 8NHV): ``fused_logprobs`` + the loss arithmetic under autograd, for everything else
  (e.g. ``top_entropy_quantile`` < 1, which compares every token's entropy with a batch quantile, or a
  sequence-level ratio over sequences longer than a chunk). Without gradients it is the forward-only path.

The loss arithmetic is ``fastrl.reference.policy_loss_from_logprobs`` (TRL 1.16's ``_compute_loss``) in both:
there is one definition of the loss. For the one-pass path it is differentiated with respect to a [B, T]
buffer of log-probs and entropies in which rows not yet computed hold placeholders; for a token- (or
sequence-) separable loss the gradient of the rows just computed does not depend on those placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fastrl.losses.config import PolicyLossConfig
from fastrl.ops import torch_backend as TB
from fastrl.ops._checks import autocast_inputs, check_finite_outputs, check_linear_inputs, check_targets
from fastrl.ops.backend import resolve_backend
from fastrl.ops.config import LogitTransform
from fastrl.ops.linear_logprob import _addmm_acc, fused_logprobs
from fastrl.reference import policy_loss_from_logprobs

__all__ = ["policy_loss", "FusedPolicyLoss"]

_IGNORE = -100
# elements of the one-pass [chunk, V] float32 logits tile: 512 MB on a GPU, 32 MB on a CPU. Larger chunks
# mean fewer read-modify-write passes over the float32 weight-gradient accumulator; on a CPU, 32 MB was as
# fast as 64 MB at C1 (5.4 s) with 48 MB less peak memory.
_TILE_ELEMS = {"cuda": 1 << 27, "cpu": 1 << 23}


@dataclass(frozen=True)
class _LossInputs:
    """The per-token tensors and constants of the loss (everything but log-probs and entropies)."""

    advantages: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    importance_weights: torch.Tensor | None
    num_items_in_batch: torch.Tensor | int | float | None
    sampling_logprobs: torch.Tensor | None

    def loss(self, logp: torch.Tensor, entropy: torch.Tensor, config: PolicyLossConfig):
        return policy_loss_from_logprobs(
            logp, entropy, self.advantages, self.mask, config=config, old_logprobs=self.old_logprobs,
            ref_logprobs=self.ref_logprobs, importance_weights=self.importance_weights,
            num_items_in_batch=self.num_items_in_batch, sampling_logprobs=self.sampling_logprobs,
        )


def _chunk_tokens(granularity: str, T: int, V: int, device: torch.device, requested: int | None) -> int | None:
    """Tokens per one-pass chunk: whole sequences when the loss couples a sequence; None if none fits."""
    budget = requested or max(1, _TILE_ELEMS.get(device.type, _TILE_ELEMS["cuda"]) // V)
    if granularity == "token":
        return budget
    seqs = budget // T
    return seqs * T if seqs >= 1 else None


class _AttachGradients(torch.autograd.Function):
    """Return the loss value; backward hands out the gradients computed in the forward, scaled."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, grads):
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw, gb = ctx.grads
        ctx.grads = None  # each gradient is handed out once

        def scale(g):
            return None if g is None else g * grad_out.to(g.dtype)

        return None, scale(gh), scale(gw), scale(gb), None


def _one_pass(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    targets: torch.Tensor,  # [N], ignore where masked out
    B: int,
    T: int,
    inputs: _LossInputs,
    config: PolicyLossConfig,
    tf: LogitTransform,
    backend: str,
    chunk: int,
    need: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, dict, tuple, torch.Tensor, torch.Tensor]:
    need_h, need_w, need_b = need
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    cdt = TB.acc_dtype(hidden.dtype)
    active = targets != _IGNORE
    # placeholders for rows not yet computed: ratio 1 against old log-probs, zero entropy
    if inputs.old_logprobs is not None:
        logp_all = inputs.old_logprobs.detach().reshape(-1).to(cdt).clone()
    else:
        logp_all = torch.zeros(N, dtype=cdt, device=dev)
    ent_all = torch.zeros(N, dtype=cdt, device=dev)

    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros((V, H), dtype=cdt, device=dev) if need_w else None
    grad_b = torch.zeros(V, dtype=cdt, device=dev) if need_b else None

    chunk = min(chunk, max(N, 1))
    zbuf = torch.empty((chunk, V), dtype=cdt, device=dev)
    if backend == "triton":
        from fastrl.kernels import linear_logprob as K

        gbuf = zbuf if hidden.dtype == cdt else torch.empty((chunk, V), dtype=hidden.dtype, device=dev)
    w_mm = weight if weight.dtype == cdt or backend == "triton" else None

    for c0 in range(0, N, chunk):
        c1 = min(c0 + chunk, N)
        h_c, t_c, a_c = hidden[c0:c1], targets[c0:c1], active[c0:c1]
        z = zbuf[: c1 - c0]
        if backend == "triton":
            lse, zt, ent = K.linear_stats(
                h_c, weight, bias, t_c, logit_scale=tf.logit_scale, softcap=tf.softcap,
                temperature=tf.temperature, with_entropy=True, z_out=z,
            )
        else:
            TB.chunk_logits(h_c, weight, bias, tf, out=z)
            lse, zt, ent = TB.stats_from_logits(z, t_c)
        zero = torch.zeros((), dtype=cdt, device=dev)
        logp_all[c0:c1] = torch.where(a_c, zt - lse, zero)
        ent_all[c0:c1] = torch.where(a_c, ent, zero)

        # per-token loss gradients of this chunk's rows, from the one loss definition
        lp = logp_all.detach().view(B, T).requires_grad_()
        en = ent_all.detach().view(B, T).requires_grad_()
        with torch.enable_grad():
            loss, _ = inputs.loss(lp, en, config)
        g_lp, g_en = torch.autograd.grad(loss, [lp, en], allow_unused=True)
        g_lp = None if g_lp is None else torch.where(a_c, g_lp.reshape(-1)[c0:c1], zero).contiguous()
        g_en = None if g_en is None else torch.where(a_c, g_en.reshape(-1)[c0:c1], zero).contiguous()
        if g_lp is None and g_en is None:
            if need_h:
                grad_h[c0:c1] = 0
            continue

        if backend == "triton":
            G = K.grad_from_logits(
                z, t_c, lse, ent, g_lp, g_en, out=gbuf[: c1 - c0], logit_scale=tf.logit_scale,
                softcap=tf.softcap, temperature=tf.temperature,
            )
            h_mm = h_c
        else:
            has_grad = torch.zeros(c1 - c0, dtype=torch.bool, device=dev)
            for g in (g_lp, g_en):
                if g is not None:
                    has_grad |= g != 0
            G = TB.grad_from_logits_(z, t_c, 0, lse, ent, g_lp, g_en, has_grad, tf)
            h_mm = TB._f32(h_c)
        if need_h:
            if w_mm is not None:
                grad_h[c0:c1] = torch.mm(G, w_mm)
            else:  # low-precision weight on the torch backend: float32 copies of bounded slices only
                acc = torch.zeros((c1 - c0, H), dtype=cdt, device=dev)
                step = TB.tile_columns(c1 - c0, V)
                for v0 in range(0, V, step):
                    acc.addmm_(G[:, v0 : v0 + step], TB._f32(weight[v0 : v0 + step]))
                grad_h[c0:c1] = acc
        if need_w:
            _addmm_acc(grad_w, G.T, h_mm)
        if need_b:
            grad_b += G.sum(0, dtype=cdt)

    with torch.no_grad():
        loss, metrics = inputs.loss(logp_all.view(B, T), ent_all.view(B, T), config)
    grads = (
        grad_h,
        grad_w.to(weight.dtype) if need_w else None,
        grad_b.to(bias.dtype) if need_b else None,
    )
    return loss, metrics, grads, logp_all, ent_all


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
    logit_scale: float = 1.0,
    softcap: float | None = None,
    backend: str | None = None,
    chunk_tokens: int | None = None,
    check_finite: bool = True,
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
        targets: ``[B, T]``, any integer dtype: the completion token ids. Only positions inside ``mask`` are
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
            when ``config.beta != 0``, unused otherwise.
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
        logit_scale, softcap, backend, check_finite: as in :func:`fastrl.fused_logprobs` (the temperature is
            ``config.temperature``).
        chunk_tokens: tokens per one-pass chunk (default: a [chunk, V] float32 tile of 512 MB on a GPU,
            32 MB on a CPU; whole sequences when the loss couples the tokens of a sequence). Smaller uses
            less memory.

    Returns:
        ``(loss, metrics)``: a 0-dim loss (float32; float64 for float64 inputs), differentiable w.r.t.
        hidden, weight and bias, and a dict of detached 0-dim metrics computed in the same pass (``kl``,
        ``entropy``, ``clip_ratio/*``, ``cispo_clip_ratio``, ``policy/*``, ``val/ratio``, ``val/ratio_var``;
        see ``fastrl.reference.policy_loss_from_logprobs`` for each).

    Fully masked rows and fully masked batches give loss 0 and gradient 0. Bad input (shapes, a missing
    ``ref_logprobs``, a target out of range inside the mask) raises before any kernel runs.

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
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H] for a policy loss, got shape {tuple(hidden.shape)}")
    if tuple(mask.shape) != tuple(targets.shape):
        raise ValueError(f"mask must have targets' shape {tuple(targets.shape)}, got {tuple(mask.shape)}")
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens <= 0):
        raise ValueError(f"chunk_tokens must be None or a positive int, got {chunk_tokens!r}")
    tf = LogitTransform(temperature=config.temperature, logit_scale=logit_scale, softcap=softcap)
    B, T, H = hidden.shape
    V = weight.shape[0]
    inputs = _LossInputs(advantages, mask, old_logprobs, ref_logprobs, importance_weights,
                         num_items_in_batch, sampling_logprobs)
    # Validate every loss input (shapes, missing ref log-probs, ...) before any kernel runs: a dry run of
    # the O(B T) loss arithmetic on zeros.
    with torch.no_grad():
        z0 = torch.zeros((B, T), dtype=TB.acc_dtype(hidden.dtype), device=hidden.device)
        inputs.loss(z0, z0, config)

    in_mask = mask.bool()
    eff_targets = torch.where(in_mask, targets.to(torch.int64), torch.full_like(targets, _IGNORE, dtype=torch.int64))
    check_targets(eff_targets, V, _IGNORE)
    name = resolve_backend(hidden.device, backend)

    need = (
        hidden.requires_grad,
        weight.requires_grad,
        bias is not None and bias.requires_grad,
    )
    granularity = config.one_pass_granularity
    chunk = None
    if torch.is_grad_enabled() and any(need) and granularity is not None:
        chunk = _chunk_tokens(granularity, T, V, hidden.device, chunk_tokens)
    if chunk is None:
        # two-pass path (or forward-only under no_grad): the same loss on fused per-token outputs
        logp, ent = fused_logprobs(
            hidden, weight, eff_targets, bias=bias, temperature=tf.temperature, logit_scale=tf.logit_scale,
            softcap=tf.softcap, with_entropy=True, ignore_index=_IGNORE, check_finite=check_finite,
            backend=name,
        )
        return inputs.loss(logp, ent, config)

    if name == "triton" and hidden.dtype == torch.float64:
        raise TypeError("the triton backend computes from float32, bfloat16 or float16 inputs; use backend='torch' for float64")
    h2 = hidden.reshape(B * T, H)
    t2 = eff_targets.reshape(-1).contiguous()
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        loss, metrics, grads, logp_all, ent_all = _one_pass(
            h2.detach(), weight.detach(), None if bias is None else bias.detach(), t2, B, T, inputs, config,
            tf, name, chunk, need,
        )
    if check_finite:
        check_finite_outputs(logp_all, ent_all, t2 != _IGNORE, h2.detach(), (B, T))
    gh, gw, gb = grads
    if gh is not None:
        gh = gh.view(B, T, H)
    return _AttachGradients.apply(loss, hidden, weight, bias, (gh, gw, gb)), metrics


class FusedPolicyLoss(nn.Module):
    """``nn.Module`` form of :func:`policy_loss` with a fixed configuration.

    ``forward(hidden, weight, targets, advantages, mask, **kwargs)`` takes the arguments of ``policy_loss``
    after ``config`` (old_logprobs, ref_logprobs, bias, importance_weights, num_items_in_batch, ...).
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
