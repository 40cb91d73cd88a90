"""PPO's clipped value loss: ``fastrl.value_loss``.

A value head's output is one number per token, so there are no logits to fuse: the loss is the reference
arithmetic itself (TRL PPOv2's), exposed here so trainers import every loss from ``fastrl``.
"""

from __future__ import annotations

import torch

from fastrl.losses.arithmetic import value_loss_reference

__all__ = ["value_loss"]


def value_loss(
    values: torch.Tensor,  # [B, T] value-head output, differentiable
    old_values: torch.Tensor,  # [B, T] values at rollout time
    returns: torch.Tensor,  # [B, T] GAE returns
    mask: torch.Tensor,  # [B, T] bool or 0/1 response mask
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``0.5 * masked_mean(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2))`` and its metrics.

    Metrics: ``loss/value_avg`` (the loss) and ``val/clipfrac_avg`` (fraction of tokens where the clipped
    term is the larger one). A fully masked batch gives loss 0 and zero gradient.
    """
    return value_loss_reference(values, old_values, returns, mask, cliprange_value)
