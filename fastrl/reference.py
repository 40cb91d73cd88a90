"""Plain-PyTorch reference for every number fastrl computes: the spec.

Everything here materialises the full ``[N, V]`` logits, in whatever dtype it is asked for (float64 for
ground truth, the input dtype for "what PyTorch itself would do"). Tests and benchmarks import these
functions; nothing here is fast and nothing here should be.

The math (docs/design.md, "The math"): logits ``y = h W^T + b``; transformed ``z = softcap(scale * y) / T``;
``logp_n = z[n, t_n] - logsumexp(z[n])``; entropy ``H_n = -sum_j p_nj log p_nj``.
"""

from __future__ import annotations


import torch

from fastrl.losses.arithmetic import kl_estimate, policy_loss_from_logprobs, value_loss_reference

__all__ = [
    "transform_logits",
    "logits_reference",
    "logprobs_reference",
    "kl_estimate",
    "policy_loss_from_logprobs",
    "value_loss_reference",
]


def transform_logits(
    logits: torch.Tensor,  # [..., V]
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """``softcap(logit_scale * logits) / temperature``; softcap is ``c * tanh(x / c)`` when set."""
    z = logits * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def logits_reference(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None = None,  # [V]
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [N, V]
    """Transformed logits, materialised. ``dtype`` casts the inputs first (None: keep the input dtype)."""
    if dtype is not None:
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    y = hidden @ weight.T
    if bias is not None:
        y = y + bias
    return transform_logits(y, temperature=temperature, logit_scale=logit_scale, softcap=softcap)


def logprobs_reference(
    hidden: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [...] int64
    *,
    bias: torch.Tensor | None = None,  # [V]
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([...], [...]) in the compute dtype
    """Log-probabilities of ``targets`` and entropies, from materialised logits.

    ``dtype=None`` computes in the input dtype, exactly as a plain PyTorch trainer would (logits rounded
    to bf16 when the inputs are bf16); ``dtype=torch.float64`` gives ground truth. Ignored targets give
    log-prob 0 and entropy 0 (and no gradient).
    """
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    z = logits_reference(
        h, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap, dtype=dtype
    )
    logp_all = torch.log_softmax(z, dim=-1)
    active = t != ignore_index
    safe_t = torch.where(active, t, torch.zeros_like(t))
    logp = logp_all.gather(-1, safe_t[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(active, logp, zero)
    entropy = torch.where(active, entropy, zero)
    return logp.reshape(lead), entropy.reshape(lead)
