"""The scalar options of the logits transform, carried as one frozen object; the batch-invariant mode's switch."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

__all__ = ["LogitTransform", "Head", "set_batch_invariant", "get_batch_invariant", "invariant_splits",
           "INVARIANT_SPLITS"]

_INVARIANT_ENV = "FASTRL_BATCH_INVARIANT"


def _parse_flag(value: str | None) -> bool:
    v = (value or "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{_INVARIANT_ENV} must be 0/1 (or true/false, yes/no, on/off), got {value!r}")


_BATCH_INVARIANT: bool = _parse_flag(os.environ.get(_INVARIANT_ENV))


def set_batch_invariant(enabled: bool) -> bool:
    """Batch-invariant mode (``fastrl.set_batch_invariant``); returns the previous setting.

    On: a token's log-prob, entropy, loss terms and divergence are bitwise the same whatever else shares its batch on
    every backend: ``triton-hybrid`` computes its GEMMs over fixed padded row blocks and vocabulary tiles,
    ``triton-fused`` and ``triton-sm90`` use ``INVARIANT_SPLITS`` vocabulary splits whatever N, and a ``KeptSet`` takes
    the per-row plan. The ``torch`` backend's full-softmax paths are batch invariant either way. Also
    ``FASTRL_BATCH_INVARIANT=1`` before fastrl is imported. docs/functions.md, "Reproducibility", lists what is
    guaranteed and what it costs."""
    global _BATCH_INVARIANT
    if not isinstance(enabled, bool):
        raise TypeError(f"set_batch_invariant takes a bool, got {type(enabled).__name__}")
    previous, _BATCH_INVARIANT = _BATCH_INVARIANT, enabled
    return previous


def get_batch_invariant() -> bool:
    """Whether the batch-invariant mode is on (``set_batch_invariant`` or ``FASTRL_BATCH_INVARIANT``)."""
    return _BATCH_INVARIANT


# Vocabulary splits of the split-vocabulary statistics kernels (``triton-fused``'s and ``triton-sm90``'s) in the
# batch-invariant mode. Their default split count follows N (enough programs for every SM), and a row's statistics
# merge per split, so it changed a token's last bits with the batch; a fixed count makes the splits a function of V
# alone. 8: the persistent kernel's floor of 4 doubled, so a few-token batch still spreads over some programs (the
# cost on a GPU is not measured yet).
INVARIANT_SPLITS = 8


def invariant_splits() -> int | None:
    """The split count the statistics kernels must use now: ``INVARIANT_SPLITS`` in the batch-invariant mode, else
    None (their own choice)."""
    return INVARIANT_SPLITS if _BATCH_INVARIANT else None


def is_finite_number(v) -> bool:
    # comparisons rather than math.isfinite: under torch.compile(dynamic=True) a float may be symbolic, which
    # math.isfinite cannot take (NaN fails both comparisons)
    return -math.inf < v < math.inf


@dataclass(frozen=True)
class LogitTransform:
    """``z = softcap(logit_scale * (h W^T + b)) / temperature``; softcap ``c tanh(x / c)`` when set."""

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "logit_scale"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not is_finite_number(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.softcap is not None and (
            not isinstance(self.softcap, (int, float)) or not is_finite_number(self.softcap) or self.softcap <= 0
        ):
            raise ValueError(f"softcap must be None or a finite number > 0, got {self.softcap!r}")

    @property
    def inv_temp(self) -> float:
        return 1.0 / float(self.temperature)

    def apply_(self, y: torch.Tensor) -> torch.Tensor:
        """In place on a float32 logits block: y <- softcap(scale * y) / T."""
        if self.logit_scale != 1.0:
            y.mul_(self.logit_scale)
        if self.softcap is not None:
            y.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.temperature != 1.0:
            y.mul_(self.inv_temp)
        return y

    def dz_dy(self, z: torch.Tensor) -> torch.Tensor | float:
        """Derivative of the transform at transformed logits z: scale / T * (1 - tanh^2)."""
        k = float(self.logit_scale) * self.inv_temp
        if self.softcap is None:
            return k
        # one new tile, worked in place (z / c, then th * th, 1 - th^2 and k * (1 - th^2) with the same roundings as
        # the out-of-place expression, which held four tiles at once)
        th = z / (float(self.softcap) * self.inv_temp)
        return th.mul_(th).neg_().add_(1.0).mul_(k)


@dataclass
class Head:
    """One LM head as every computation reads it (the vocabulary tiles of ``fused_divergence`` and its Triton
    kernels, the kept-set engine): hidden states ``[N, H]`` (rows that do not count already zeroed; upcast to the
    compute dtype where a path wants that, ``upcast``), weight ``[V, H]``, bias ``[V]`` or None, and the transform.
    ``dtype``: the input dtype, that of the gradients returned (hidden's own when not given)."""

    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None  # [V]
    tf: LogitTransform
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.dtype is None:
            self.dtype = self.hidden.dtype

    @property
    def h(self) -> torch.Tensor:  # [N, H] (the name the kernels' launchers read)
        return self.hidden

    def upcast(self, cdt: torch.dtype) -> "Head":
        """The same head with its hidden states in ``cdt`` (once; a no-op for float32), ``dtype`` kept."""
        return Head(self.hidden.to(cdt), self.weight, self.bias, self.tf, self.dtype)

    def padded(self, rows: int) -> "Head":
        """The same head with its hidden states padded with zero rows to ``rows`` (no copy when none are needed): the
        batch-invariant paths' whole row blocks."""
        N = self.hidden.shape[0]
        if N == rows:
            return self
        h = self.hidden.new_zeros((rows, self.hidden.shape[1]))
        h[:N] = self.hidden
        return Head(h, self.weight, self.bias, self.tf, self.dtype)
