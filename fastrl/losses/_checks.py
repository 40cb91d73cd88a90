"""Checks of the per-token loss inputs of ``policy_loss``: devices, ``num_items_in_batch``, mask values, and
non-finite values where the loss reads them. Every error names the argument and the first bad position.

Two entry points, called by ``policy_loss`` before any kernel runs:

* ``check_loss_inputs``: what can be told without reading tensor values (types, devices, the form of
  ``num_items_in_batch``); no host synchronisation.
* ``check_loss_values``: what needs the values. All conditions are reduced on the device into one small
  tensor and read with a single host synchronisation; the (slower) search for the first bad position runs
  only when something is wrong.

The values checked, and why:

* ``mask`` holds only 0 and 1 (or is bool). TRL multiplies its per-token loss by ``completion_mask``, which
  is always binary there; fastrl selects tokens with the mask (``torch.where``) and would silently binarise a
  weight such as 0.5 (and count a 2 once). Per-token weights belong in ``importance_weights``.
* No target equals the ignore index (-100) inside the mask: such a token would enter the loss with a
  log-prob of 0 (a ratio of ``exp(-old_logprob)``), a term TRL never forms.
* ``num_items_in_batch`` (when given) is finite and >= 0, and 0 only when the mask selects no token. TRL
  clamps the normaliser at 1, so 0 with tokens in the mask would silently divide by 1 instead of the count.
* With ``check_finite`` (the default): ``advantages``, ``old_logprobs``, ``ref_logprobs`` (when ``beta != 0``)
  and ``importance_weights`` are finite wherever the loss reads them (inside the mask; rows with at least one
  masked-in token for per-sequence values; vespo reads importance weights at every position of such a row).
  A NaN advantage (from a group reward std of 0) or an inf old log-prob would otherwise give a NaN loss or,
  worse, a finite wrong one. ``sampling_logprobs`` is not checked: TRL maps its NaN/inf to numbers on purpose
  (``nan_to_num``), and so does the reference.
"""

from __future__ import annotations

import math

import torch

from fastrl.losses.config import PolicyLossConfig

__all__ = ["check_loss_inputs", "check_loss_values", "loss_values_bad"]

def _num_items_form(num_items_in_batch: object) -> None:
    if num_items_in_batch is None:
        return
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(
                "num_items_in_batch must be a number or a one-element tensor (the token count that the dapo, "
                f"cispo and vespo losses divide by), got a tensor of shape {tuple(num_items_in_batch.shape)}"
            )
        if num_items_in_batch.dtype == torch.bool or num_items_in_batch.is_complex():
            raise TypeError(f"num_items_in_batch must be a real number, got a {num_items_in_batch.dtype} tensor")
        return
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float)):
        raise TypeError(
            f"num_items_in_batch must be None, a number or a one-element tensor, got {type(num_items_in_batch).__name__}"
        )
    if not -math.inf < num_items_in_batch < math.inf or num_items_in_batch < 0:  # (comparisons: may be symbolic)
        raise ValueError(f"num_items_in_batch must be a finite number >= 0, got {num_items_in_batch!r}")


def check_loss_inputs(
    hidden: torch.Tensor,  # [B, T, H]
    *,
    advantages: object,
    mask: object,
    old_logprobs: object = None,
    ref_logprobs: object = None,
    importance_weights: object = None,
    sampling_logprobs: object = None,
    num_items_in_batch: object = None,
) -> None:
    """Types and devices of the loss inputs, and the form of ``num_items_in_batch``; reads no values."""
    tensors = {
        "advantages": advantages, "mask": mask, "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs,
        "importance_weights": importance_weights, "sampling_logprobs": sampling_logprobs,
    }
    for name in ("advantages", "mask"):
        if not isinstance(tensors[name], torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensors[name]).__name__}")
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be None or a torch.Tensor, got {type(t).__name__}")
    elsewhere = [(n, t.device) for n, t in tensors.items() if t is not None and t.device != hidden.device]
    if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.device not in (
        hidden.device, torch.device("cpu")
    ):
        elsewhere.append(("num_items_in_batch", num_items_in_batch.device))
    if elsewhere:
        where = ", ".join(f"{n} on {d}" for n, d in elsewhere)
        raise ValueError(f"the loss inputs must be on hidden's device {hidden.device}, got {where}")
    if mask.is_complex():
        raise TypeError(f"mask must be bool or hold 0/1 values, got {mask.dtype}")
    _num_items_form(num_items_in_batch)


def _first(bad: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in bad.nonzero()[0])


def check_loss_values(
    targets: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B] or [B, T]
    mask: torch.Tensor,  # [B, T]
    *,
    config: PolicyLossConfig,
    old_logprobs: torch.Tensor | None = None,  # [B, T]
    ref_logprobs: torch.Tensor | None = None,  # [B, T]
    importance_weights: torch.Tensor | None = None,  # [B] or [B, T]
    num_items_in_batch: torch.Tensor | int | float | None = None,
    ignore_index: int = -100,
    check_finite: bool = True,
) -> None:
    """Value checks of the loss inputs (shapes already validated); one host synchronisation when all is well."""
    conditions = _conditions(targets, advantages, mask, config=config, old_logprobs=old_logprobs,
                             ref_logprobs=ref_logprobs, importance_weights=importance_weights,
                             num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                             check_finite=check_finite)
    if not bool(torch.stack([bad.any() for _, bad, _ in conditions]).any()):  # the one host synchronisation
        return
    in_mask = mask if mask.dtype == torch.bool else mask != 0  # [B, T]
    _raise_first(conditions, mask, in_mask, num_items_in_batch, ignore_index,
                 dict(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                      importance_weights=importance_weights))


def loss_values_bad(
    targets: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,
    mask: torch.Tensor,  # [B, T]
    *,
    config: PolicyLossConfig,
    num_items_in_batch: torch.Tensor | int | float | None = None,
    ignore_index: int = -100,
    vocab_size: int,
) -> torch.Tensor:  # 0-dim bool, on the device
    """The no-sync path's form of ``check_loss_values``: whether any value check fails, as a device flag (no host
    read), plus a target outside ``[0, V)`` inside the mask. The caller multiplies the loss by NaN where it is
    set, so a bad input shows as a NaN loss and NaN gradients, never as a finite wrong number. The finiteness
    checks are not needed here: a non-finite value the loss reads already makes the loss non-finite."""
    conditions = _conditions(targets, advantages, mask, config=config, num_items_in_batch=num_items_in_batch,
                             ignore_index=ignore_index, check_finite=False)
    in_mask = mask if mask.dtype == torch.bool else mask != 0
    bad = in_mask & ((targets < 0) | (targets >= vocab_size))
    return torch.stack([bad.any()] + [b.any() for _, b, _ in conditions]).any()


def _conditions(targets, advantages, mask, *, config, old_logprobs=None, ref_logprobs=None, importance_weights=None,
                num_items_in_batch=None, ignore_index=-100, check_finite=True):
    """(argument, where it is bad: a bool tensor of its shape, which check), computed on the device."""
    in_mask = mask if mask.dtype == torch.bool else mask != 0  # [B, T]
    rows = in_mask.any(1)  # [B] rows the loss reads per-sequence values of

    # (argument, where it is bad: a bool tensor of its shape, which check)
    conditions: list[tuple[str, torch.Tensor, str]] = []
    if mask.dtype != torch.bool:
        conditions.append(("mask", (mask != 0) & (mask != 1), "value"))
    conditions.append(("targets", in_mask & (targets == ignore_index), "ignored"))
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            n = num_items_in_batch.to(mask.device).reshape(()).double()
        else:  # torch.full, not as_tensor: under torch.compile(dynamic=True) a count that changes stays symbolic
            n = torch.full((), num_items_in_batch, dtype=torch.float64, device=mask.device)
        conditions.append(("num_items_in_batch", ~torch.isfinite(n) | (n < 0) | ((n == 0) & rows.any()), "count"))
    if check_finite:
        where = {1: rows, 2: in_mask}
        used = [("advantages", advantages), ("old_logprobs", old_logprobs)]
        if config.beta != 0.0:
            used.append(("ref_logprobs", ref_logprobs))
        used.append(("importance_weights", importance_weights))
        for name, t in used:
            if t is None:
                continue
            reads = where[t.dim()]
            if name == "importance_weights" and config.loss_type == "vespo" and t.dim() == 2:
                # vespo sums the log IS ratios over every position of a sequence, masked or not (as TRL does)
                reads = rows[:, None].expand_as(t)
            conditions.append((name, ~torch.isfinite(t) & reads, "finite"))
    return conditions


def _raise_first(conditions, mask, in_mask, num_items_in_batch, ignore_index, tensors) -> None:
    for name, bad, kind in conditions:
        if not bool(bad.any()):
            continue
        if kind == "value":
            pos = _first(bad)
            raise ValueError(
                f"mask must be bool or hold only 0 and 1, got {mask[pos].item()} at position {pos}. fastrl's loss "
                "selects tokens with the mask (TRL's completion_mask is binary), it does not weight them: give "
                "per-token weights as importance_weights"
            )
        if kind == "ignored":
            pos = _first(bad)
            raise ValueError(
                f"targets at position {pos} is {ignore_index} (the ignore index) inside the mask: a token in the "
                "mask needs a real token id (or set the mask to 0 there)"
            )
        if kind == "count":
            raise ValueError(
                f"num_items_in_batch must be finite and >= 0, and > 0 when the mask selects tokens "
                f"({int(in_mask.sum())} here), got {float(num_items_in_batch)}"
            )
        t = tensors[name]
        pos = _first(bad)
        raise FloatingPointError(
            f"{name} holds {t[pos].item()} at position {pos}, where the loss reads it (inside the mask): the loss "
            "would be NaN or silently wrong. Pass check_finite=False to skip this check."
        )
