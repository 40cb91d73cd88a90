"""The exact reference KL of ``kl_estimator="exact"``: ``KL(pi_theta || pi_ref)`` over the whole vocabulary (or the
support) at each token, its input checks, and its terms inside the one-pass chunks.

Two ways to compute it, the same numbers:

* inside the one-pass chunks (``policy_loss``'s one-pass path on the torch backend, and over a support): each chunk
  of tokens has the policy's logits tile computed once anyway; the reference's tile is computed next to it
  (``2 n H_ref V`` FLOPs), the KL per row from the pair, ``KL = sum p (z - z_ref) - lse + lse_ref``, and its
  gradient ``dKL/dz_j = p_j (log p_j - log p_ref,j - KL)`` added to the chunk's ``G`` before the gradient GEMMs.
  Nothing is recomputed: ``6 N H V + 2 N H_ref V`` FLOPs for the loss with its KL;
* ``exact_reference_kl``: ``fastrl.fused_divergence`` with beta = 1 (its own pass over both heads, forward and
  backward): the two-pass path, the Triton backends' one-pass path, and the PPO trainer's rollout reward.
"""

from __future__ import annotations

import torch

from fastrl.ops import torch_backend as TB
from fastrl.ops.budget import tile_budget
from fastrl.ops.config import LogitTransform

__all__ = ["check_ref_inputs", "exact_reference_kl", "check_kl_finite", "tile_stats_kl", "tile_grad_kl_"]


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


def exact_reference_kl(
    hidden: torch.Tensor,  # [B, T, H], the policy; the KL's gradient flows to it, weight and bias
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    ref_hidden: torch.Tensor,  # [B, T, H_ref], a constant
    ref_weight: torch.Tensor,  # [V, H_ref], a constant
    ref_bias: torch.Tensor | None,  # [V], a constant
    mask: torch.Tensor,  # [B, T] bool
    tf: LogitTransform,
    backend: str,
    check_finite: bool,
    support=None,  # a KeptSet: both distributions renormalised over it (sampling replay)
    ref_tf: LogitTransform | None = None,  # the reference's logit scale / softcap; None: the policy's
    host_sync: bool | None = None,
) -> torch.Tensor:  # [B, T]
    """Per-token KL(pi_theta || pi_ref) over the whole vocabulary (or the support), 0 outside the mask, as its own
    ``fused_divergence`` pass (beta=1, the policy as the student and the reference as the teacher, under the
    policy's temperature; the reference's logit scale and softcap are the policy's unless ``ref_tf`` says
    otherwise: a separate reference model with its own config)."""
    from fastrl.ops.divergence import fused_divergence

    ref_tf = tf if ref_tf is None else ref_tf
    options = {} if support is None else {"support": support}
    try:
        return fused_divergence(
            hidden, weight, ref_hidden.detach(), ref_weight.detach(), beta=1.0, temperature=tf.temperature, bias=bias,
            teacher_bias=None if ref_bias is None else ref_bias.detach(), logit_scale=tf.logit_scale,
            teacher_logit_scale=ref_tf.logit_scale, softcap=tf.softcap, teacher_softcap=ref_tf.softcap, mask=mask,
            check_finite=check_finite, backend=backend, host_sync=host_sync, **options,
        )
    except (FloatingPointError, ValueError, TypeError) as e:
        raise _as_ref_error(e) from None


def _as_ref_error(e: Exception) -> Exception:
    """fused_divergence's error, naming the arguments as the caller knows them (the reference is its teacher)."""
    return type(e)(str(e).replace("teacher_", "ref_").replace("non-finite divergence", "non-finite exact KL"))


def check_kl_finite(kl: torch.Tensor, live: torch.Tensor, hidden: torch.Tensor, ref_hidden: torch.Tensor,
                    lead: tuple[int, ...]) -> None:
    """Raise ``FloatingPointError`` naming the first counted token whose exact KL (computed in the one-pass chunks)
    is not finite, and the input at fault: the message ``exact_reference_kl`` gives for the same input."""
    from fastrl.ops.divergence import _check_finite

    try:
        _check_finite(kl, None, live, hidden.reshape(-1, hidden.shape[-1]),
                      ref_hidden.reshape(-1, ref_hidden.shape[-1]), lead)
    except FloatingPointError as e:
        raise _as_ref_error(e) from None


# ---------------------------------------------------------------------------------------------------------
# the KL's terms on a chunk's [n, V] tiles (the one-pass path)
# ---------------------------------------------------------------------------------------------------------


def tile_stats_kl(
    z: torch.Tensor,  # [n, V] the policy's transformed logits (left unchanged)
    zr: torch.Tensor,  # [n, V] the reference's (left unchanged)
    targets: torch.Tensor,  # [n]; ids outside [0, V) give target logit 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # lse, z_t, H, KL, lse_ref [n]
    """The policy's row statistics and ``KL(p || p_ref)`` from both tiles, one bounded vocabulary block at a time:
    a pass over the reference's tile for its lse, one over the policy's for ``s = sum e^d``, ``sum e^d d`` (the
    entropy) and ``sum e^d (z - z_ref)`` (``d = z - max``), so ``KL = sum e^d (z - z_ref) / s - lse + lse_ref``:
    the logit difference is taken per element, before any large sum (no cancellation between two big sums)."""
    n, V = z.shape
    lse_r = _lse(zr)
    m = z.amax(dim=1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s, u, w = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
    step = _block_columns(z)
    for v0 in range(0, V, step):
        zb = z[:, v0 : v0 + step]
        d = zb - m[:, None]
        e = torch.exp(d)
        s += e.sum(1)
        u += d.mul_(e).sum(1)
        w += torch.sub(zb, zr[:, v0 : v0 + step], out=d).mul_(e).sum(1)
    log_s = torch.log(s)
    lse = m + log_s
    inside = (targets >= 0) & (targets < V)
    zt = torch.where(inside, z.gather(1, targets.clamp(0, V - 1)[:, None]).squeeze(1), 0.0)
    return lse, zt, log_s - u / s, w / s - lse + lse_r, lse_r


def _block_columns(z: torch.Tensor) -> int:
    """Vocabulary columns per block of an [n, V] tile: the ``exact-kl`` budget (a CPU core's L2: the passes over a
    block then run from cache)."""
    n, V = z.shape
    return TB.tile_columns(n, V, tile_elems=tile_budget("exact-kl", z.device).elems)


def _lse(z: torch.Tensor) -> torch.Tensor:  # [n, V] -> [n], blockwise (no tile-sized temporary)
    n, V = z.shape
    m = z.amax(dim=1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.zeros_like(m)
    step = _block_columns(z)
    for v0 in range(0, V, step):
        s += torch.exp(z[:, v0 : v0 + step] - m[:, None]).sum(1)
    return m + torch.log(s)


def tile_grad_kl_(
    z: torch.Tensor,  # [n, V] the policy's transformed logits; overwritten with G
    zr: torch.Tensor,  # [n, V] the reference's; overwritten (scratch)
    targets: torch.Tensor,  # [n]
    lse: torch.Tensor, ent: torch.Tensor, lse_r: torch.Tensor, kl: torch.Tensor,  # [n] each
    g_lp: torch.Tensor | None, g_en: torch.Tensor | None, g_kl: torch.Tensor,  # [n] d loss / d (logp, H, KL)
    tf: LogitTransform,
) -> torch.Tensor:  # G = dL/dy [n, V] in z's storage
    """``G`` of a chunk whose loss reads log-probs, entropies and the exact KL, in one set of passes: with
    ``ls = z - lse``, ``lr = z_ref - lse_ref``, ``p = e^ls``,

        G = p ((g_kl - g_en) ls - g_kl lr - g_lp - g_en H - g_kl KL) + g_lp 1[j = t]      (times dz/dy)

    (logp: ``1[j = t] - p``; entropy: ``-p (ls + H)``; KL: ``p (ls - lr - KL)``)."""
    n, V = z.shape
    zero = torch.zeros_like(lse)
    g_lp = zero if g_lp is None else g_lp
    g_en = zero if g_en is None else g_en
    a, b = (g_kl - g_en)[:, None], (-g_kl)[:, None]
    c = (-g_lp - g_en * ent - g_kl * kl)[:, None]
    step = _block_columns(z)
    for v0 in range(0, V, step):
        zb, rb = z[:, v0 : v0 + step], zr[:, v0 : v0 + step]
        dzdy = tf.dz_dy(zb)  # a float, or a block with a softcap (taken before zb is reused)
        ls = zb.sub_(lse[:, None])
        p = torch.exp(ls)
        g = ls.mul_(a).addcmul_(rb.sub_(lse_r[:, None]), b).add_(c).mul_(p)
        local = targets - v0
        hit = (local >= 0) & (local < g.shape[1])
        g.scatter_add_(1, local.clamp(0, g.shape[1] - 1)[:, None], torch.where(hit, g_lp, zero)[:, None])
        if not isinstance(dzdy, float) or dzdy != 1.0:
            g.mul_(dzdy)
    return z
