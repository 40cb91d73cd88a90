"""A ``SamplerRule`` as a support: its replay (``fastrl.replay_rule``) in eager, and as the op
``torch.ops.fastrl.replay_rule`` while ``torch.compile`` traces.

A rule's kept sets have a size that depends on the logits (how many ids survive top_p / min_p, ties at the k-th
value), so the op's output is like ``nonzero``'s: its fake implementation gives the CSR ids a new unbacked size,
and the graph carries it into the kept-set op (``fastrl::kept_logprob``, ``fastrl::policy_loss_one_pass``) without a
graph break. Finding the sets reads that size on the host inside the op: a rule is not CUDA-graph safe, so
``host_sync=False`` refuses one by name (replay it first, ``fastrl.replay_rule``, and pass the ``KeptSet``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fastrl.ops.config import LogitTransform
from fastrl.ops.custom_ops import PackedOptions, define_op, host_sync_enabled, layout_of
from fastrl.ops.support import KeptSet, SamplerRule
from fastrl.ops.torch_backend import acc_dtype

__all__ = ["replay", "RuleOptions"]


@dataclasses.dataclass(frozen=True)
class RuleOptions(PackedOptions):
    """A ``SamplerRule`` (but its stop ids, an argument of their own) and the logit transform, as
    ``fastrl::replay_rule``'s options."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    order: str = "vllm"
    ties: str = "keep"
    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    ignore_index: int = -100

    @staticmethod
    def of(rule: SamplerRule, tf: LogitTransform, ignore_index: int) -> "RuleOptions":
        return RuleOptions(
            top_k=rule.top_k, top_p=float(rule.top_p), min_p=float(rule.min_p), min_tokens=rule.min_tokens,
            order=rule.order, ties=rule.ties,
            temperature=float(tf.temperature), logit_scale=float(tf.logit_scale),
            softcap=None if tf.softcap is None else float(tf.softcap), ignore_index=ignore_index)

    @property
    def tf(self) -> LogitTransform:
        return LogitTransform(temperature=self.temperature, logit_scale=self.logit_scale, softcap=self.softcap)

    def rule(self, stop_token_ids) -> SamplerRule:
        stops = tuple(int(s) for s in stop_token_ids)
        return SamplerRule(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, min_tokens=self.min_tokens,
                           stop_token_ids=stops, order=self.order, ties=self.ties)


RuleOptions._LAYOUT = layout_of(RuleOptions)


@define_op("replay_rule")
def replay_rule_op(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: Optional[torch.Tensor],  # [V]
    targets: torch.Tensor,  # [N] int64, ignore_index where not counted
    positions: Optional[torch.Tensor],  # [N] completion positions (min_tokens), or None
    stop_token_ids: list[int],  # the rule's stop ids (a list of its own: under dynamic=True they may be symbolic)
    opt_str: str,  # RuleOptions.pack()
    opt_float: list[float],
    opt_int: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # CSR ids [nnz] (nnz from the data), offsets [N + 1], outside [N], the kept entries' logits [nnz] (compute dtype)
    from fastrl.ops.rules import check_replay_inputs, replay_checked

    o = RuleOptions.unpack(opt_str, opt_float, opt_int)
    hidden, weight, bias = check_replay_inputs(hidden, weight, bias, targets, o.ignore_index, "torch")
    ks, outside, z = replay_checked(hidden, weight, bias, targets, o.rule(stop_token_ids), o.tf, o.ignore_index,
                                    positions)
    return ks.ids.clone(), ks.offsets.clone(), outside.clone(), z


@replay_rule_op.register_fake
def _(hidden, weight, bias, targets, positions, stop_token_ids, opt_str, opt_float, opt_int):
    nnz = torch.library.get_ctx().new_dynamic_size()  # how many ids the rule keeps: known after it ran
    N = targets.shape[0]
    return (targets.new_empty((nnz,), dtype=torch.int64), targets.new_empty((N + 1,), dtype=torch.int64),
            targets.new_empty((N,), dtype=torch.bool), hidden.new_empty((nnz,), dtype=acc_dtype(hidden.dtype)))


def replay(
    hidden: torch.Tensor,  # [N, H] or [B, T, H]
    weight: torch.Tensor,  # [V, H]
    targets: torch.Tensor,  # [N] or [B, T]
    rule: SamplerRule,
    *,
    bias: torch.Tensor | None,
    tf: LogitTransform,
    ignore_index: int,
    positions: torch.Tensor | None,
    host_sync: bool | None,
) -> tuple[KeptSet, torch.Tensor, torch.Tensor]:  # (KeptSet of N rows, outside: targets' shape, logits [nnz])
    """The rule's kept sets on this model's logits: ``fastrl.replay_rule`` in eager, the op while compiling.
    ``logits``: the kept entries' transformed logits that the replay read (``rules.replay_checked``), which the
    kept-set engine then takes instead of computing them again."""
    from fastrl.ops.rules import replay_checked, rule_positions

    lead = tuple(targets.shape)
    if host_sync_enabled(host_sync):  # the inputs were checked by the caller (the loss's plan, fused_logprobs)
        return replay_checked(hidden, weight, bias, targets, rule, tf, ignore_index, positions)
    if host_sync is False:
        raise ValueError(
            "support=SamplerRule cannot run with host_sync=False: how many ids a rule keeps depends on the logits, "
            "so finding the sets reads the host. Replay it first (kept, outside = fastrl.replay_rule(...)) and pass "
            "support=kept, which runs without a host read; under torch.compile (host_sync=None) a rule traces as "
            "one op (fastrl::replay_rule) with no graph break, but is not CUDA-graph safe")
    pos = rule_positions(targets, rule, positions)
    h = hidden.reshape(-1, hidden.shape[-1])
    ids, offsets, outside, logits = torch.ops.fastrl.replay_rule(
        h, weight, bias, targets.reshape(-1).to(torch.int64), pos, list(rule.stop_token_ids),
        *RuleOptions.of(rule, tf, ignore_index).pack())
    V = weight.shape[0]
    return KeptSet(ids, offsets, V, lead, validate=False), outside.reshape(lead), logits
