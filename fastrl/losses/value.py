"""PPO's clipped value loss: ``fastrl.value_loss``.

A value head's output is one number per token, so there are no logits to fuse: the loss is the reference
arithmetic itself (TRL PPOv2's), exposed here so trainers import every loss from ``fastrl``.
"""

from __future__ import annotations

import torch

from fastrl.losses.arithmetic import check_value_inputs
from fastrl.ops import custom_ops  # noqa: F401  (registers torch.ops.fastrl.value_loss)

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

    The arithmetic is ``fastrl.reference.value_loss_reference``, run as the op ``torch.ops.fastrl.value_loss``
    (one node under ``torch.compile``; its backward differentiates the same formula).
    """
    check_value_inputs(values, old_values, returns, mask, cliprange_value)
    loss, clipfrac = torch.ops.fastrl.value_loss(values, old_values, returns, mask, float(cliprange_value))
    return loss, {"loss/value_avg": loss.detach(), "val/clipfrac_avg": clipfrac}
