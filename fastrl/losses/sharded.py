"""``policy_loss`` on a vocabulary-sharded LM head (tensor parallelism; ``fastrl.ops.sharded``).

Under TP every loss type takes the two-pass route (path A): the per-token log-probs and entropies of the sharded
head (``fused_logprobs`` on it, ``fastrl.ops.sharded``: two all-reduces of O(N) numbers forward, one of the hidden gradient
backward), then the loss arithmetic (``fastrl.losses.arithmetic``, the one definition of the loss) under autograd,
identical on every rank. The one-pass route (path B) is not taken: its op holds a ``[chunk, V]`` tile of one
process's whole vocabulary, so a sharded head falls back to two passes (8 N H V / P FLOPs per rank instead of
6 N H V / P). The k1/k2/k3 KL estimators read ``ref_logprobs`` as given; the exact KL (``kl_estimator="exact"``)
is ``fused_divergence`` with beta = 1 on the same heads, sharded or replicated each (``fastrl.ops.sharded_divergence``).
A support takes the same route over the kept ids (``fastrl.ops.sharded_kept``); a ``SamplerRule`` is replayed across
the shards first (``fastrl.ops.sharded_rules``: rules with top_k).
"""

from __future__ import annotations

import torch

from fastrl.ops.config import LogitTransform
from fastrl.ops.one_pass import IGNORE
from fastrl.ops.policy_run import LossSpec
from fastrl.ops.linear_logprob import fused_logprobs
from fastrl.ops.sharded import resolve_sharded_support

__all__ = ["run_sharded"]


def run_sharded(spec: LossSpec, hidden: torch.Tensor, weight, bias, logit_scale: float, softcap: float | None,
                backend: str | None, support, positions=None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(loss, metrics, per-token log-probs [B * T]) of a checked ``policy_loss`` call whose weight is a DTensor
    placed Shard(0)."""
    if support is not None and spec.exact_kl:
        raise ValueError("kl_estimator='exact' over a support is not implemented with a vocabulary-sharded weight "
                         "(DTensor Shard(0)): use k1/k2/k3 with ref_logprobs over the same support")
    tf = LogitTransform(temperature=spec.temperature, logit_scale=logit_scale, softcap=softcap)
    kept, outside = resolve_sharded_support(support, hidden, weight, bias, spec.eff_targets, tf, IGNORE, positions)
    logp, ent = fused_logprobs(hidden, weight, spec.eff_targets, bias=bias, temperature=spec.temperature,
                               logit_scale=logit_scale, softcap=softcap, with_entropy=True, ignore_index=IGNORE,
                               check_finite=spec.check_finite, backend=backend, host_sync=spec.host_sync, support=kept)
    kl = None
    if spec.exact_kl:
        from fastrl.ops.divergence import fused_divergence

        ref_hidden, ref_weight, ref_bias = spec.ref
        kl = fused_divergence(hidden, weight, ref_hidden, ref_weight, beta=1.0, temperature=spec.temperature,
                              bias=bias, teacher_bias=ref_bias, logit_scale=logit_scale,
                              teacher_logit_scale=logit_scale, softcap=softcap, teacher_softcap=softcap,
                              mask=spec.in_mask, check_finite=spec.check_finite, backend=backend,
                              host_sync=spec.host_sync)
    loss, metrics = spec.loss(logp, ent, kl)
    if support is not None:  # sampling/* metrics, as the unsharded kept-set route reports them
        from fastrl.ops.policy_run import support_metrics
        from fastrl.ops.support import SamplerRule

        metrics.update(support_metrics(kept, outside, spec.in_mask, weight.shape[0], isinstance(support, SamplerRule),
                                       logp.dtype))
    return loss, metrics, logp.reshape(-1)
