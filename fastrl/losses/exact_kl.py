"""The exact reference KL of ``kl_estimator="exact"``: ``KL(pi_theta || pi_ref)`` over the whole vocabulary (or the
support) at each token, and its input checks.

Two ways to compute it, the same numbers:

* inside the one-pass chunks (``policy_loss``'s one-pass path on the torch backend, and over a support): each chunk
  of tokens has the policy's logits tile computed once anyway; the reference's tile is computed next to it
  (``2 n H_ref V`` FLOPs), the KL per row from the pair, ``KL = sum p (z - z_ref) - lse + lse_ref``, and its
  gradient ``dKL/dz_j = p_j (log p_j - log p_ref,j - KL)`` added to the chunk's ``G`` before the gradient GEMMs
  (``fastrl.ops.one_pass.tile_stats_kl`` / ``tile_grad_kl_``). Nothing is recomputed: ``6 N H V + 2 N H_ref V``
  FLOPs for the loss with its KL;
* its own pass (``fastrl.ops.policy_run``): ``fastrl.fused_divergence``'s plan and run with beta = 1 (both heads,
  forward and backward): the two-pass path and the Triton backends' one-pass path.
"""

from __future__ import annotations

import torch

__all__ = ["check_ref_inputs"]


def check_ref_inputs(config, hidden, weight, ref_logprobs, ref_hidden, ref_weight, ref_bias) -> bool:
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
