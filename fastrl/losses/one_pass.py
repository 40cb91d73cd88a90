"""The one-pass policy loss (path B, 6NHV FLOPs): ``_one_pass`` and the custom op ``fastrl::policy_loss_one_pass``.

When the loss gradient of a token is known as soon as the token's (or its sequence's) log-prob and entropy are
(``PolicyLossConfig.one_pass_granularity``), each chunk of tokens has its logits computed once (stored in
float32, with the row statistics), the per-token loss gradients are taken from the loss arithmetic
(``fastrl.losses.arithmetic.policy_loss_from_logprobs``, the one definition of the loss), and ``G = dL/dy`` and
the three gradient GEMMs follow at once. The gradients are ready when the forward returns; the op's backward
only scales them. ``fastrl.policy_loss`` (``fastrl.losses.policy``) checks the input, chooses this path or the
two-pass one, and calls the op; the op is registered when this module is imported (by ``fastrl.losses.policy``).

For a token- (or sequence-) separable loss the gradient of the rows just computed does not depend on the
placeholders that rows not yet computed hold in the [B, T] buffers of log-probs and entropies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from dataclasses import dataclass
from typing import Optional

import torch

from fastrl.losses.arithmetic import policy_loss_from_logprobs
from fastrl.losses.config import CLIPPED_LOSS_TYPES, PolicyLossConfig
from fastrl.losses.exact_kl import tile_grad_kl_, tile_stats_kl
from fastrl.ops import torch_backend as TB
from fastrl.ops._gemm import addmm_f32, mm_f32
from fastrl.ops.backend import is_triton
from fastrl.ops.budget import one_pass_rows, tile_budget
from fastrl.ops.config import LogitTransform
from fastrl.ops.custom_ops import (
    _acc, _autograd_inside, _empty, _key, _layout, _op, _pack, _refuse_double_backward, _unpack,
)
from fastrl.ops.linear_logprob import compact_rows

__all__ = ["PolicyOptions", "metric_keys", "fixed_chunks", "policy_loss_one_pass"]

_IGNORE = -100


@dataclass(frozen=True)
class _LossInputs:
    """The per-token tensors and constants of the loss (everything but log-probs and entropies)."""

    advantages: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    importance_weights: torch.Tensor | None
    num_items_in_batch: torch.Tensor | int | float | None
    sampling_logprobs: torch.Tensor | None
    per_token_kl: torch.Tensor | None = None  # [B, T] exact KL (kl_estimator="exact"), may carry a graph

    def loss(self, logp: torch.Tensor, entropy: torch.Tensor, config: PolicyLossConfig, metrics: bool = True):
        return policy_loss_from_logprobs(
            logp, entropy, self.advantages, self.mask, config=config, old_logprobs=self.old_logprobs,
            ref_logprobs=self.ref_logprobs, importance_weights=self.importance_weights,
            num_items_in_batch=self.num_items_in_batch, sampling_logprobs=self.sampling_logprobs,
            per_token_kl=self.per_token_kl, with_metrics=metrics,
        )

    def constant_kl(self) -> _LossInputs:
        """The same inputs with the exact KL detached (the one-pass path's per-chunk gradient evaluations)."""
        if self.per_token_kl is None:
            return self
        return dataclasses.replace(self, per_token_kl=self.per_token_kl.detach())


def _chunk_budget(V: int, device: torch.device, trained_head: bool, requested: int | None, backend: str = "torch",
                  dtype: torch.dtype = torch.float32, tokens: int | None = None, H: int = 0) -> int:
    """Rows per one-pass chunk (of ``tokens`` rows with hidden size ``H``): the requested number, else what fits the
    device's [chunk, V] tile budget."""
    if not requested and trained_head and backend == "triton-sm90" and device.type == "cuda" and tokens is not None:
        # the scaled-exp tile in the input dtype, sized by the device's memory (budget's sm90-one-pass row): at W1 on
        # an 80 GB device one chunk, so grad_W is one GEMM and the float32 [V, H] accumulator is never read back
        return one_pass_rows(V, H, tokens, dtype, device)
    # the [chunk, V] logits tile: long chunks with a trained head on a GPU (the float32 [V, H] accumulator is read and
    # written once per chunk; 1664 rows at V=151936, 8 accumulator passes over W1's ~12k live tokens, extra memory
    # about 1.25x TRL's at W1), a 256 MiB tile with a frozen one, 32 MB on a CPU (fastrl.ops.budget)
    rows = tile_budget("one-pass" if trained_head else "one-pass-frozen", device).elems // V
    # on a GPU, whole 128-row blocks keep the GEMMs on full tiles; a CPU keeps its small tile (memory first)
    return requested or (max(128, rows // 128 * 128) if device.type == "cuda" else max(1, rows))


def _chunks(
    live: torch.Tensor,  # [B, T] bool: tokens that are scored (in the mask)
    granularity: str,
    V: int,
    device: torch.device,
    trained_head: bool,
    requested: int | None,
    backend: str = "torch",
    dtype: torch.dtype = torch.float32,
    H: int = 0,
) -> list[tuple[int, int]] | None:
    """One-pass chunks as ranges of *live* rows (row-major order): whole sequences when the loss couples the
    tokens of a sequence; None when a sequence does not fit in one chunk (then two passes it is)."""
    n_live = int(live.sum())  # one host sync: chunk boundaries are host-side ranges
    budget = _chunk_budget(V, device, trained_head, requested, backend, dtype, n_live, H)
    if granularity == "token":
        return [(c0, min(c0 + budget, n_live)) for c0 in range(0, n_live, budget)]
    per_seq = live.sum(1).tolist()
    if max(per_seq, default=0) > budget:
        return None
    out, start, size = [], 0, 0
    for n in per_seq:
        if size + n > budget:
            out.append((start, start + size))
            start, size = start + size, 0
        size += n
    if size:
        out.append((start, start + size))
    return out


@dataclass
class _Chunk:
    """One chunk of rows: its hidden states and targets, and where its rows live among the N rows."""

    c0: int
    c1: int
    rows: torch.Tensor | None  # the live rows' ids (compact), or None: rows c0:c1
    h: torch.Tensor  # [n, H]
    t: torch.Tensor  # [n]

    def take(self, x: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [n, ...]
        return x[self.c0 : self.c1] if self.rows is None else x.index_select(0, self.rows)

    def put_(self, dst: torch.Tensor, x: torch.Tensor) -> None:  # dst[rows] = x
        if self.rows is None:
            dst[self.c0 : self.c1] = x
        else:
            dst.index_copy_(0, self.rows, x.to(dst.dtype))


def _chunk(hidden, targets, idx, live, c0: int, c1: int, compact: bool) -> _Chunk:
    rows = None if idx is None else idx[c0:c1]
    h = hidden[c0:c1] if rows is None else hidden.index_select(0, rows)
    if not compact:  # rows outside the mask: zeroed, so that whatever they hold cannot reach grad_W
        h = torch.where(live[c0:c1, None], h, torch.zeros((), dtype=h.dtype, device=h.device))
    return _Chunk(c0, c1, rows, h, targets[c0:c1] if rows is None else targets.index_select(0, rows))


def _loss_grads(inputs: _LossInputs, config, B: int, T: int, ck: _Chunk, logp_all, ent_all, kl_all):
    """This chunk's rows' d loss / d (logp, entropy, exact KL), from the one loss definition, with the rows not yet
    computed holding placeholders (a token- or sequence-separable loss does not read them for these rows)."""
    lp = logp_all.detach().view(B, T).requires_grad_()
    en = ent_all.detach().view(B, T).requires_grad_()
    leaves = [lp, en]
    if kl_all is not None:  # the KL computed in these chunks: its placeholders are 0
        leaves.append(kl_all.detach().view(B, T).requires_grad_())
        inputs = dataclasses.replace(inputs, per_token_kl=leaves[2])
    with torch.enable_grad():
        loss, _ = inputs.loss(lp, en, config, metrics=False)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return tuple(None if g is None else ck.take(g.reshape(-1)).contiguous() for g in grads) + (None,) * (3 - len(grads))


def _one_pass(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V] contiguous
    targets: torch.Tensor,  # [N], _IGNORE where masked out
    B: int,
    T: int,
    inputs: _LossInputs,
    config: PolicyLossConfig,
    tf: LogitTransform,
    backend: str,
    chunks: list[tuple[int, int]],  # ranges of live rows (compact), else of all rows
    need: tuple[bool, bool, bool],
    compact: bool = True,  # False: no host sync; rows outside the mask are computed (zeroed hidden, no gradient)
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,  # the exact KL's (hidden, W, b)
) -> tuple[torch.Tensor, dict, tuple, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    # (loss, metrics, (grad_h, grad_w, grad_b), logp [N], entropy [N], d loss / d per_token_kl | None,
    #  the exact KL computed here [N] | None)
    need_h, need_w, need_b = need
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    cdt = TB.acc_dtype(hidden.dtype)
    triton = is_triton(backend)
    sm90 = backend == "triton-sm90"  # scaled exps in the input dtype instead of float32 logits (fastrl.ops.sm90)
    assert ref is None or not triton, "the exact KL inside the chunks runs on the torch backend's tiles"
    if triton:
        from fastrl.kernels import logits_fold as F
        from fastrl.ops import sm90 as S
    live = targets != _IGNORE
    # live rows only: padding costs nothing and cannot poison grad_W (compact); or every row, with the hidden
    # states of rows outside the mask zeroed so that whatever they hold cannot reach grad_W either
    idx = compact_rows(live) if compact else None
    # A KL given from outside (the Triton backends' fused_divergence pass) enters additively, so the per-token
    # gradients w.r.t. logp / entropy do not depend on it: the chunks treat it as a constant, and its own gradient
    # is taken on the final loss (below). A KL computed here (``ref``) fills kl_all chunk by chunk.
    full_inputs, inputs = inputs, inputs.constant_kl()
    # placeholders for rows not yet computed: ratio 1 against old log-probs, zero entropy
    if inputs.old_logprobs is not None:
        logp_all = inputs.old_logprobs.detach().reshape(-1).to(cdt).clone()
    else:
        logp_all = torch.zeros(N, dtype=cdt, device=dev)
    ent_all = torch.zeros(N, dtype=cdt, device=dev)
    kl_all = torch.zeros(N, dtype=cdt, device=dev) if ref is not None else None

    grad_h = torch.zeros_like(hidden) if need_h else None
    # one chunk: grad_W is one GEMM over every row, written once (no float32 [V, H] accumulator, 8 V H bytes saved)
    single = len(chunks) == 1
    grad_w = torch.zeros((V, H), dtype=cdt, device=dev) if need_w and not single else None
    grad_b = torch.zeros(V, dtype=cdt, device=dev) if need_b else None

    chunk = max((c1 - c0 for c0, c1 in chunks), default=0)
    zbuf = torch.empty(0 if sm90 else chunk * V, dtype=cdt, device=dev)
    zrbuf = torch.empty(chunk * V, dtype=cdt, device=dev) if ref is not None else None  # the reference's tile
    exp_tile = S.ExpTile(chunk, hidden, weight, bias, tf) if sm90 else None
    stats = torch.empty((4, chunk), dtype=torch.float32, device=dev) if triton else None
    w_mm = weight if weight.dtype == cdt or triton else None
    tkw = dict(logit_scale=tf.logit_scale, softcap=tf.softcap, temperature=tf.temperature)

    for c0, c1 in chunks:
        n = c1 - c0
        ck = _chunk(hidden, targets, idx, live, c0, c1, compact)
        z = None if sm90 else zbuf[: n * V].view(n, V)
        if sm90:
            lse, zt, ent = S.chunk_stats(exp_tile, ck.h, weight, bias, ck.t, tf)
        elif triton:
            # raw logits from cuBLAS in float32; the fold and G kernels apply bias and transform on the fly
            mm_f32(ck.h, weight.T, out=z)
            st = stats[:, :n]
            F.fold_tile(z, bias, ck.t, 0, st, first=True, with_entropy=True, **tkw)
            lse, zt, ent = F.finish_stats(st, True)
        elif ref is None:
            TB.chunk_logits(ck.h, weight, bias, tf, out=z)
            lse, zt, ent = TB.stats_from_logits(z, ck.t)
        else:  # the reference's tile next to the policy's, and the KL from the pair
            TB.chunk_logits(ck.h, weight, bias, tf, out=z)
            zr = zrbuf[: n * V].view(n, V)
            TB.chunk_logits(_chunk(ref[0], targets, idx, live, c0, c1, compact).h, ref[1], ref[2], tf, out=zr)
            lse, zt, ent, kl_c, lse_r = tile_stats_kl(z, zr, ck.t)
            ck.put_(kl_all, kl_c)
        ck.put_(logp_all, zt - lse)
        ck.put_(ent_all, ent)

        g_lp, g_en, g_kl = _loss_grads(inputs, config, B, T, ck, logp_all, ent_all, kl_all)
        if g_lp is None and g_en is None and g_kl is None:
            continue

        if g_kl is not None:
            G = tile_grad_kl_(z, zr, ck.t, lse, ent, lse_r, kl_c, g_lp, g_en, g_kl, tf)
            h_mm = TB.upcast(ck.h)
        elif sm90:
            G = S.chunk_grad(exp_tile, ck.t, zt, lse, ent, g_lp, g_en, tf)
            h_mm = ck.h
        elif triton:
            G = F.grad_tile(z, bias, ck.t, 0, lse, ent, g_lp, g_en, out_dtype=hidden.dtype, **tkw)
            h_mm = ck.h
        else:
            has_grad = torch.zeros(n, dtype=torch.bool, device=dev)
            for g in (g_lp, g_en):
                if g is not None:
                    has_grad |= g != 0
            G = TB.grad_from_logits_(z, ck.t, 0, lse, ent, g_lp, g_en, has_grad, tf)
            h_mm = TB.upcast(ck.h)
        if need_h:
            if w_mm is not None:
                gh_c = torch.mm(G, w_mm)
            else:  # low-precision weight on the torch backend: float32 copies of bounded slices only
                gh_c = torch.zeros((n, H), dtype=cdt, device=dev)
                step = TB.tile_columns(n, V)
                for v0 in range(0, V, step):
                    gh_c.addmm_(G[:, v0 : v0 + step], TB.upcast(weight[v0 : v0 + step]))
            ck.put_(grad_h, gh_c)
        if need_w:
            if single:  # G and h in one dtype: the GEMM accumulates in float32 and rounds once, as the cast did
                grad_w = torch.mm(G.T, h_mm)  # (as path A's grad_W slices in hybrid.sliced_backward)
            else:
                addmm_f32(grad_w, G.T, h_mm)
        if need_b:
            grad_b += G.sum(0, dtype=cdt)

    # the float32 logits tiles (1 GiB at W1) are dead: free them before grad_W's cast allocates its copy
    del zbuf, zrbuf, stats, exp_tile
    z = zr = G = None
    loss, metrics, grad_kl = _final_loss(full_inputs, config, B, T, logp_all, ent_all, kl_all)
    grads = (
        grad_h,
        (torch.zeros_like(weight) if grad_w is None else grad_w.to(weight.dtype)) if need_w else None,
        grad_b.to(bias.dtype) if need_b else None,
    )
    return loss, metrics, grads, logp_all, ent_all, grad_kl, kl_all


def _final_loss(inputs: _LossInputs, config, B: int, T: int, logp_all, ent_all, kl_all):
    """(loss, metrics, d loss / d per_token_kl or None) once every row is computed."""
    if kl_all is not None:  # the KL computed in the chunks: a constant here, its gradient is in the GEMMs already
        inputs = dataclasses.replace(inputs, per_token_kl=kl_all.view(B, T))
    elif inputs.per_token_kl is not None:
        # log-probs and entropies enter as constants; d loss / d KL (the loss type's normaliser times beta, per
        # token) is what the caller's backward hands to the KL's own graph
        with torch.enable_grad():
            kl = inputs.per_token_kl.detach().requires_grad_()
            loss, metrics = dataclasses.replace(inputs, per_token_kl=kl).loss(
                logp_all.view(B, T), ent_all.view(B, T), config)
            (grad_kl,) = torch.autograd.grad(loss, kl)
        return loss.detach(), metrics, grad_kl
    with torch.no_grad():
        loss, metrics = inputs.loss(logp_all.view(B, T), ent_all.view(B, T), config)
    return loss, metrics, None


# ---------------------------------------------------------------------------------------------------------
# the custom op: fastrl::policy_loss_one_pass (the gradients are formed in the forward)
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyOptions:
    """Scalar options of ``fastrl::policy_loss_one_pass``: the loss config, the logit transform (its
    temperature is the config's), the backend, which inputs need a gradient, and how rows are chunked.

    ``compact``: the ``chunks`` argument holds ranges of live (in-mask) rows found on the host (eager). False:
    no host synchronisation: fixed chunks over all rows (``chunk_rows`` rows each, whole sequences when the loss
    couples a sequence's tokens), rows outside the mask computed with zeroed hidden states and no gradient.
    """

    logit_scale: float = 1.0
    softcap: Optional[float] = None
    backend: str = "torch"
    need_hidden: bool = True
    need_weight: bool = True
    need_bias: bool = False
    compact: bool = True
    chunk_rows: int = 1
    tile_elems: int = 0  # the kept-set engine's bounds with a support (fastrl.ops.kept.capacity)
    cap: int = 0

    def pack(self, config: PolicyLossConfig) -> tuple[str, list[float], list[int]]:
        """These options and the loss config, as the op's three option arguments."""
        return _pack(((self, _POLICY_LAYOUT), (config, _CONFIG_LAYOUT)))

    @staticmethod
    def unpack(strs: str, floats, ints) -> tuple[PolicyOptions, PolicyLossConfig]:
        return _policy_options(strs, _key(floats), tuple(ints))

    @staticmethod
    def unpack_symbolic(strs: str, floats, ints) -> tuple[types.SimpleNamespace, types.SimpleNamespace]:
        """As ``LinearOptions.unpack_symbolic``: unvalidated attributes, for fake implementations."""
        d_opts, d_config = _unpack(strs, floats, ints, (_POLICY_LAYOUT, _CONFIG_LAYOUT))
        return types.SimpleNamespace(**d_opts), types.SimpleNamespace(**d_config)

    def tf(self, config: PolicyLossConfig) -> LogitTransform:
        return LogitTransform(temperature=config.temperature, logit_scale=self.logit_scale, softcap=self.softcap)


_POLICY_LAYOUT = _layout(PolicyOptions)
_CONFIG_LAYOUT = _layout(PolicyLossConfig)


@functools.lru_cache(maxsize=256)
def _policy_options(strs: str, floats: tuple, ints: tuple) -> tuple[PolicyOptions, PolicyLossConfig]:
    floats = tuple(math.nan if x is None else x for x in floats)
    d_opts, d_config = _unpack(strs, floats, ints, (_POLICY_LAYOUT, _CONFIG_LAYOUT))
    return PolicyOptions(**d_opts), PolicyLossConfig(**d_config)


def metric_keys(config: PolicyLossConfig) -> tuple[str, ...]:
    """The metric names ``policy_loss_from_logprobs`` returns for ``config`` when entropies are given (their
    order there). The one-pass op returns the metrics as one [M] tensor in this order; the op checks at run
    time that the arithmetic returned exactly these names, so the two cannot drift apart silently."""
    keys = []
    if config.entropy_coef != 0.0:
        keys += ["policy_loss", "entropy_coef"]
    if config.beta != 0.0:
        keys.append("kl")
    keys.append("entropy")
    if config.loss_type in CLIPPED_LOSS_TYPES:
        keys += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                 "clip_ratio/high_max", "policy/clipfrac_avg"]
    elif config.loss_type == "cispo":
        keys += ["cispo_clip_ratio", "policy/clipfrac_avg"]
    elif config.loss_type == "vespo":
        keys.append("vespo/phi_seq_mean")
    keys += ["policy/approxkl_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var"]
    return tuple(keys)


def fixed_chunks(B: int, T: int, granularity: str, chunk_rows: int) -> list[tuple[int, int]]:
    """Row ranges over all B*T rows, chosen from shapes only (the no-sync path): ``chunk_rows`` tokens, or as many
    whole sequences as fit (the caller has checked that one does)."""
    N = B * T
    step = chunk_rows if granularity == "token" else max(1, chunk_rows // T) * T
    return [(c0, min(c0 + step, N)) for c0 in range(0, N, step)]


@_op("policy_loss_one_pass")
def policy_loss_one_pass(
    hidden: torch.Tensor,  # [B, T, H]
    weight: torch.Tensor,  # [V, H]
    bias: Optional[torch.Tensor],  # [V]
    targets: torch.Tensor,  # [B, T] int64, -100 outside the mask
    advantages: torch.Tensor,  # [B] or [B, T]
    mask: torch.Tensor,  # [B, T]
    old_logprobs: Optional[torch.Tensor],
    ref_logprobs: Optional[torch.Tensor],
    importance_weights: Optional[torch.Tensor],
    num_items_in_batch: Optional[torch.Tensor],  # 0-dim
    sampling_logprobs: Optional[torch.Tensor],
    per_token_kl: Optional[torch.Tensor],  # [B, T] the exact KL (kl_estimator="exact"), differentiable outside
    ref_hidden: Optional[torch.Tensor],  # [B, T, H_ref] or the exact KL computed in the chunks from the reference
    ref_weight: Optional[torch.Tensor],  # [V, H_ref]
    ref_bias: Optional[torch.Tensor],  # [V]
    support_ids: Optional[torch.Tensor],  # a KeptSet's CSR ids [nnz] and offsets [B*T + 1]: the loss over it
    support_offsets: Optional[torch.Tensor],
    chunks: list[int],  # flattened (c0, c1) ranges of live rows (compact), or [] (no-sync: fixed chunks); with a
    # support: the kept-set engine's plan argument (fastrl.ops.kept.build_plan(...).arg() on the rows it computes)
    opt_str: str,  # PolicyOptions.pack(config)
    opt_float: list[float],
    opt_int: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    # (loss [], metrics [M] in metric_keys order, grad hidden [B, T, H], grad weight [V, H], grad bias [V]
    #  (each [0] when not needed), logprobs [B*T], entropy [B*T], d loss / d per_token_kl [B, T] (or [0]),
    #  the exact KL computed from ref_hidden [B*T] (or [0]))
    o, config = PolicyOptions.unpack(opt_str, opt_float, opt_int)
    B, T, H = hidden.shape
    h2 = hidden.reshape(B * T, H)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    t2 = targets.reshape(-1)
    if o.compact:
        pairs = list(zip(chunks[0::2], chunks[1::2]))
    else:
        pairs = fixed_chunks(B, T, config.one_pass_granularity, o.chunk_rows)
    inputs = _LossInputs(advantages, mask, old_logprobs, ref_logprobs, importance_weights, num_items_in_batch,
                         sampling_logprobs, per_token_kl)
    need = (o.need_hidden, o.need_weight, o.need_bias and bias is not None)
    ref = None if ref_hidden is None else (ref_hidden.reshape(B * T, -1), ref_weight, ref_bias)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False), _autograd_inside():
        if support_ids is not None:  # the kept-set engine: every value first, then one loss gradient
            from fastrl.losses.one_pass_kept import kept_one_pass

            loss, metrics, grads, logp_all, ent_all, kl = kept_one_pass(
                h2, weight, bias, t2, B, T, inputs, config, o.tf(config), support_ids, support_offsets, need,
                o.compact, ref, (o.tile_elems, o.cap), _IGNORE, plan_arg=chunks, backend=o.backend)
            grad_kl = None
        else:
            loss, metrics, grads, logp_all, ent_all, grad_kl, kl = _one_pass(
                h2, weight, bias, t2, B, T, inputs, config, o.tf(config), o.backend, pairs, need, compact=o.compact,
                ref=ref,
            )
    keys = metric_keys(config)
    assert tuple(metrics) == keys, f"metric_keys drifted from the loss arithmetic: {tuple(metrics)} vs {keys}"
    gh, gw, gb = grads
    return (
        loss, torch.stack([metrics[k] for k in keys]),
        gh.view(B, T, H) if gh is not None else _empty(hidden),
        gw if gw is not None else _empty(weight),
        gb if gb is not None else _empty(hidden),
        logp_all, ent_all,
        grad_kl if grad_kl is not None else hidden.new_empty((0,), dtype=_acc(hidden.dtype)),
        kl.reshape(-1) if kl is not None else hidden.new_empty((0,), dtype=_acc(hidden.dtype)),
    )


@policy_loss_one_pass.register_fake
def _(hidden, weight, bias, targets, advantages, mask, old_logprobs, ref_logprobs, importance_weights,
      num_items_in_batch, sampling_logprobs, per_token_kl, ref_hidden, ref_weight, ref_bias, support_ids,
      support_offsets, chunks, opt_str, opt_float, opt_int):
    o, config = PolicyOptions.unpack_symbolic(opt_str, opt_float, opt_int)
    B, T, _ = hidden.shape
    cdt = _acc(hidden.dtype)
    return (
        hidden.new_empty((), dtype=cdt),
        hidden.new_empty((len(metric_keys(config)),), dtype=cdt),
        torch.empty_like(hidden) if o.need_hidden else _empty(hidden),
        torch.empty_like(weight) if o.need_weight else _empty(weight),
        torch.empty_like(bias) if o.need_bias and bias is not None else _empty(hidden),
        hidden.new_empty((B * T,), dtype=cdt),
        hidden.new_empty((B * T,), dtype=cdt),
        hidden.new_empty((B, T), dtype=cdt) if per_token_kl is not None else hidden.new_empty((0,), dtype=cdt),
        hidden.new_empty((B * T,), dtype=cdt) if ref_hidden is not None else hidden.new_empty((0,), dtype=cdt),
    )


_KL_INPUT = 11  # position of per_token_kl among policy_loss_one_pass's inputs
_N_INPUTS = 21


def _policy_setup(ctx, inputs, output):
    _, metrics, gh, gw, gb, logp, ent, grad_kl, kl = output
    # the gradients were formed in the forward: backward only scales them (PyTorch's rules for saved tensors
    # hold: a second backward through a retained graph hands them out again, a freed graph raises)
    ctx.save_for_backward(gh, gw, gb, grad_kl)
    ctx.mark_non_differentiable(metrics, gh, gw, gb, logp, ent, grad_kl, kl)
    ctx.set_materialize_grads(False)


def _policy_backward(ctx, grad_loss, *_unused):
    _refuse_double_backward("fastrl.policy_loss")
    gh, gw, gb, grad_kl = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if grad_loss is None:
        return (None,) * _N_INPUTS

    def scale(g, needed):
        return g * grad_loss.to(g.dtype) if needed and g.numel() else None

    grads = [scale(gh, need[0]), scale(gw, need[1]), scale(gb, need[2])] + [None] * (_N_INPUTS - 3)
    grads[_KL_INPUT] = scale(grad_kl, ctx.needs_input_grad[_KL_INPUT])  # into the exact KL's own graph
    return tuple(grads)


policy_loss_one_pass.register_autograd(_policy_backward, setup_context=_policy_setup)
