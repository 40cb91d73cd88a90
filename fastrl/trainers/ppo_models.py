"""The models of ``fastrl.PPOTrainer``: the policy and the value model as one module (``PolicyAndValueWrapper``), the
reward model's score (``get_reward``), and the fused head on a causal LM's body (``fused_head_outputs``: the
hidden states that predict the response tokens handed to a function with the LM head gathered, never the
``[B, R, V]`` logits)."""

from __future__ import annotations

import torch
from torch import nn

from fastrl.trainers._common import checkpointing_on
from fastrl.trainers._lm_head import call_with_head, unwrap_causal_lm
from fastrl.trainers.ppo_math import first_true_indices

__all__ = ["PolicyAndValueWrapper", "fused_head_outputs", "get_reward", "lm_inputs", "unwrap_engine"]


def lm_inputs(query_responses: torch.Tensor, pad_token_id: int):  # [B, L] -> (ids, mask, positions), each [B, L]
    """TRL's forward inputs: pad tokens masked out, positions counted over real tokens (left padding)."""
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    return input_ids, attention_mask, position_ids

def unwrap_engine(model):
    """The module inside a DeepSpeed inference engine (reference / reward model under DeepSpeed)."""
    return model.module if type(model).__name__ == "DeepSpeedEngine" else model


def get_reward(
    model: nn.Module,  # a sequence-classification model with a `score` head
    query_responses: torch.Tensor,  # [B, L]
    pad_token_id: int,
    context_length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # (score head on every position [B, L, 1], scores [B], index [B])
    """TRL's ``get_reward``: the ``score`` head on the backbone's last hidden state, read at the last non-pad token.

    The last token is found in the response part only (``context_length`` on): the last token before the
    response's first pad token.
    """
    model = unwrap_engine(model)
    input_ids, attention_mask, position_ids = lm_inputs(query_responses, pad_token_id)
    output = model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
    )
    reward_logits = model.score(output.last_hidden_state)
    sequence_lengths = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    scores = reward_logits[torch.arange(reward_logits.size(0), device=reward_logits.device), sequence_lengths]
    return reward_logits, scores.squeeze(-1), sequence_lengths


def fused_head_outputs(causal_lm, input_ids, attention_mask, position_ids, context_length, head_fn):
    """Run ``causal_lm``'s body, then ``head_fn(hidden [B, R, H], weight, bias)`` with the LM head gathered.

    ``hidden`` are the states that predict the response tokens (positions ``context_length - 1 .. L - 2``);
    the head's ``[B, R, V]`` logits are never formed.
    """
    lm = unwrap_causal_lm(causal_lm)
    out = lm.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
    )
    head = lm.get_output_embeddings()
    hidden = out.last_hidden_state[:, context_length - 1 : -1].to(head.weight.device)
    return call_with_head(head_fn, hidden, head.weight, head.bias)


class PolicyAndValueWrapper(nn.Module):
    """The policy and the value model as one module (TRL's wrapper): one optimizer, one DDP / DeepSpeed / FSDP
    wrapper and one ``forward`` for both. The value head is the value model's ``score`` on its own backbone.

    ``forward(input_ids, attention_mask, position_ids, context_length=, head_fn=, with_values=)`` returns
    ``(head_fn(policy_hidden, lm_head.weight, lm_head.bias) or None, values [B, R] or None)``: the fused
    loss runs inside the forward, so distributed wrappers have the LM head materialised while it runs.
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        # FSDP's transformer-based auto wrap reads the layer classes from here
        no_split = []
        for m in (unwrap_causal_lm(policy), value_model):
            no_split += [c for c in (getattr(m, "_no_split_modules", None) or []) if c not in no_split]
        self._no_split_modules = no_split

    @property
    def critic_backbone(self) -> nn.Module:
        return unwrap_engine(self.value_model).base_model

    def forward(self, input_ids, attention_mask, position_ids, *, context_length: int, head_fn=None,
                with_values: bool = True):
        head_out = None
        if head_fn is not None:
            head_out = fused_head_outputs(self.policy, input_ids, attention_mask, position_ids, context_length, head_fn)
        values = None
        if with_values:
            out = self.critic_backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
            )
            values = self.value_model.score(out.last_hidden_state[:, context_length - 1 : -1])
            values = values.squeeze(-1).clone()  # not a view: FSDP2 warns about views returned by a forward
        return head_out, values

    # TRL's generation helpers toggle activation checkpointing on the unwrapped model around generate().
    def _models(self):
        return [unwrap_causal_lm(self.policy), self.value_model]

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(checkpointing_on(m) for m in self._models())

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        for m in self._models():
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self):
        for m in self._models():
            m.gradient_checkpointing_disable()
