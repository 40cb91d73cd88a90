"""What the backends of ``fused_divergence`` share: the divergence modes and the divergences from the online
statistics (one definition of the KLs' closing formulas, whichever backend folded the tiles).

``fastrl.ops.divergence_op`` (the modes of ``DivergenceOptions``) and the backends (``divergence_torch``,
``divergence_hybrid``, ``divergence_sm90``, ``divergence_kept``) import from here, so none imports another's
definitions. ``fastrl.kernels.divergence_fold`` compares the same values as literals (its ``MODE`` constexpr);
tests/test_divergence.py checks that they agree.
"""

from __future__ import annotations

import torch

__all__ = ["FORWARD_KL", "REVERSE_KL", "JSD", "TINY", "finite_max", "finish_stats", "log_mix"]

FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2  # beta = 0, beta = 1, 0 < beta < 1

TINY = torch.finfo(torch.float32).tiny  # log(m) where both probabilities underflow: finite, and weighted by 0


def log_mix(ps: torch.Tensor, pt: torch.Tensor, beta: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The JSD's ``log m = log((1 - beta) p_s + beta p_t)`` (into ``out``, ``ps``'s shape, when given); clamped at
    ``TINY`` where both probabilities underflow (their terms carry weight 0)."""
    return torch.mul(ps, 1.0 - beta, out=out).add_(pt, alpha=beta).clamp_min_(TINY).log_()


def finite_max(m: torch.Tensor) -> torch.Tensor:
    """The running max with -inf (nothing folded yet) replaced by 0, so ``z - m`` and ``m_old - m`` never give nan."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def finish_stats(
    stats: torch.Tensor,  # [6, N]: (m_s, s_s, u_s, c, m_t, s_t), every vocabulary tile folded
    mode: int,
    with_entropy: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(divergence [N] (None for the JSD, which needs a second pass), student entropy [N] | None, lse_s [N], lse_t [N]).

    ``m`` the running max, ``s = sum e^(z-m)``, ``u_s = sum e^(d_s) d_s``, ``c`` the cross term of the KL direction
    (``d = z - m``): ``KL(p_t || p_s) = c / s_t - log s_t + log s_s`` and ``KL(p_s || p_t) = c / s_s - log s_s +
    log s_t`` (the maxima cancel), ``H_s = log s_s - u_s / s_s``."""
    m_s, s_s, u_s, c, m_t, s_t = stats.unbind(0)
    log_ss, log_st = torch.log(s_s), torch.log(s_t)
    lse_s, lse_t = finite_max(m_s) + log_ss, finite_max(m_t) + log_st
    entropy = log_ss - u_s / s_s if with_entropy else None
    if mode == FORWARD_KL:
        div = c / s_t - log_st + log_ss
    elif mode == REVERSE_KL:
        div = c / s_s - log_ss + log_st
    else:
        div = None
    return div, entropy, lse_s, lse_t
