"""PPO's clipped value loss: ``fastrl.value_loss``.

A value head's output is one number per token, so there are no logits to fuse: the loss is the reference
arithmetic itself (TRL PPOv2's), exposed here so trainers import every loss from ``fastrl``. It runs as the
custom op ``fastrl::value_loss`` (defined here: one node under ``torch.compile``), whose backward, the op
``fastrl::value_loss_backward``, differentiates the same formula.
"""

from __future__ import annotations

import torch

from fastrl.losses.arithmetic import check_value_inputs, value_loss_reference
from fastrl.ops.custom_ops import autograd_inside, define_op, refuse_double_backward

__all__ = ["value_loss", "value_loss_op"]


# ---------------------------------------------------------------------------------------------------------
# the custom ops: fastrl::value_loss (plain arithmetic, an op so that it is one node) and its backward
# ---------------------------------------------------------------------------------------------------------


@define_op("value_loss")
def value_loss_op(
    values: torch.Tensor,  # [B, T]
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # loss [], clipfrac []
    loss, metrics = value_loss_reference(values, old_values, returns, mask, cliprange_value)
    return loss.clone(), metrics["val/clipfrac_avg"]


@value_loss_op.register_fake
def _(values, old_values, returns, mask, cliprange_value):
    return values.new_empty(()), values.new_empty(())


def _value_setup(ctx, inputs, output):
    values, old_values, returns, mask, cliprange_value = inputs
    ctx.save_for_backward(values, old_values, returns, mask)
    ctx.cliprange_value = cliprange_value
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _value_backward(ctx, grad_loss, _grad_clipfrac):
    refuse_double_backward("fastrl.value_loss")
    if grad_loss is None or not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    values, old_values, returns, mask = ctx.saved_tensors
    g = torch.ops.fastrl.value_loss_backward(grad_loss, values, old_values, returns, mask, ctx.cliprange_value)
    return g, None, None, None, None


value_loss_op.register_autograd(_value_backward, setup_context=_value_setup)


@define_op("value_loss_backward")
def value_loss_backward(
    grad_loss: torch.Tensor, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
    mask: torch.Tensor, cliprange_value: float,
) -> torch.Tensor:  # [B, T]
    # the gradient of the one definition of the loss, by autograd over it (O(B T), no logits involved)
    with autograd_inside(), torch.enable_grad():
        v = values.detach().requires_grad_()
        loss, _ = value_loss_reference(v, old_values, returns, mask, cliprange_value)
        (g,) = torch.autograd.grad(loss, v, grad_loss)
    return g


@value_loss_backward.register_fake
def _(grad_loss, values, old_values, returns, mask, cliprange_value):
    return torch.empty_like(values)


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

    The arithmetic is ``fastrl.losses.arithmetic.value_loss_reference``, run as the op ``torch.ops.fastrl.value_loss``
    (one node under ``torch.compile``; its backward differentiates the same formula).
    """
    check_value_inputs(values, old_values, returns, mask, cliprange_value)
    loss, clipfrac = torch.ops.fastrl.value_loss(values, old_values, returns, mask, float(cliprange_value))
    return loss, {"loss/value_avg": loss.detach(), "val/clipfrac_avg": clipfrac}
