"""The rollout of ``fastrl.PPOTrainer`` (TRL's PPOv2 steps 1-6): generate, score with the reward model, take the
policy's and the reference's log-probs (forward-only fused passes over the sampled sequences' hidden states, with
the values in the policy's forward), then rewards, GAE advantages and returns (``fastrl.trainers.ppo_math``).

``RolloutMixin`` holds the trainer's methods; ``negative_kl_settings`` names the generation settings that make the
KL estimate biased.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict

import torch
from torch import nn
from transformers import GenerationConfig

from fastrl.ops.divergence import fused_divergence
from fastrl.ops.rules import replay_rule
from fastrl.ops.support import SamplerRule
from fastrl.trainers._common import args_checkpointing
from fastrl.trainers._lm_head import HeadSettings, head_precision, is_zero3_param, lm_head_logprobs, unwrap_causal_lm
from fastrl.trainers.ppo_math import (
    INVALID_LOGPROB,
    apply_eos_penalty,
    compute_gae,
    kl_rewards,
    masked_whiten,
    padding_masks,
    response_lengths,
    truncate_response,
)
from fastrl.trainers.ppo_models import fused_head_outputs, get_reward, lm_inputs, unwrap_engine
from fastrl.trainers.sampling import record_kept_sets, stack_sequences

__all__ = ["IGNORE", "REPLAYED", "RolloutMixin", "negative_kl_settings", "pad_right"]

IGNORE = -100  # a target fastrl's ops skip


def pad_right(tensors: list[torch.Tensor], value: int) -> torch.Tensor:  # list of [b_i, L_i] -> [sum b_i, max L_i]
    L = max(t.shape[1] for t in tensors)
    return torch.cat([nn.functional.pad(t, (0, L - t.shape[1]), value=value) for t in tensors], 0)


# ---------------------------------------------------------------------------------------------------------------
# Generation settings
# ---------------------------------------------------------------------------------------------------------------

# generation settings whose effect on the support each sampling_replay mode reproduces (penalties, a logit bias and a
# different temperature reweight the kept ids too: no mode reproduces those)
REPLAYED = {
    "kept_set": ("top_k", "top_p", "typical_p", "min_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size",
                 "min_length", "min_new_tokens", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
                 "forced_bos_token_id", "forced_eos_token_id"),
    "rule": ("top_k", "top_p", "min_p", "min_new_tokens"),
}


def negative_kl_settings(generation_config: GenerationConfig, temperature: float) -> list[str]:
    """Generation settings that sample from something other than ``softmax(logits / temperature)``.

    The KL estimate and the PPO ratio use the policy's full-distribution log-probs at ``temperature``; tokens
    drawn from a truncated / penalised / re-tempered distribution make the KL estimate biased and often
    negative (TRL's Training FAQ, "What Is the Concern with Negative KL Divergence?").
    """
    cfg = generation_config
    bad = []

    def flag(name):
        bad.append(f"{name}={getattr(cfg, name)!r}")

    if not cfg.do_sample:
        flag("do_sample")
    if (cfg.num_beams or 1) > 1:
        flag("num_beams")
    if cfg.top_k not in (None, 0):
        flag("top_k")
    for name in ("top_p", "typical_p"):
        if getattr(cfg, name, None) is not None and getattr(cfg, name) < 1.0:
            flag(name)
    for name in ("min_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size", "min_length", "min_new_tokens"):
        if getattr(cfg, name, None):
            flag(name)
    for name in ("repetition_penalty", "encoder_repetition_penalty"):
        if getattr(cfg, name, None) not in (None, 1.0):
            flag(name)
    for name in ("bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
                 "forced_bos_token_id", "forced_eos_token_id"):
        if getattr(cfg, name, None) is not None:
            flag(name)
    if cfg.temperature is not None and abs(cfg.temperature - temperature) > 1e-6:
        bad.append(f"temperature={cfg.temperature!r} (the log-probs use {temperature!r})")
    return bad


def rollout_exact_kl(
    hidden: torch.Tensor,  # [b, R, H], the policy (its head's precision)
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    ref: tuple,  # the reference's (hidden [b, R, H_ref], weight [V, H_ref], bias [V] | None)
    mask: torch.Tensor,  # [b, R] bool: the scored tokens
    settings: HeadSettings,  # the policy's logit transform and temperature
    ref_settings: HeadSettings,  # the reference's logit transform
    support=None,  # a KeptSet: both distributions renormalised over it (sampling replay)
) -> torch.Tensor:  # [b, R]
    """Per-token KL(pi || pi_ref) over the whole vocabulary (or the support), 0 outside ``mask``: the public
    ``fastrl.fused_divergence`` with beta=1 (KL(student || teacher)), the policy as the student, the reference as the
    teacher, both at the policy's temperature (the definition ``fastrl.policy_loss(kl_estimator="exact")`` uses).

    ``check_finite=False``: a non-finite KL is reported by ``PPOTrainer._check_rollout`` on every process at once,
    naming the exact KL, before any optimizer step."""
    ref_h, ref_w, ref_b = ref
    dt = hidden.dtype
    return fused_divergence(
        hidden, weight, ref_h.to(dt), ref_w.to(dt), beta=1.0, temperature=settings.temperature, bias=bias,
        teacher_bias=None if ref_b is None else ref_b.to(dt), logit_scale=settings.logit_scale,
        teacher_logit_scale=ref_settings.logit_scale, softcap=settings.softcap, teacher_softcap=ref_settings.softcap,
        mask=mask, check_finite=False, backend=settings.backend, **({} if support is None else {"support": support}),
    )


class RolloutMixin:
    """``PPOTrainer``'s generation and rollout (its constructor sets what these methods read)."""

    def _rollout_generation_config(self, temperature: float) -> GenerationConfig:
        """TRL's rollout sampling (Training FAQ settings): sample from the full distribution, pad with EOS."""
        tok = self.processing_class
        kw = dict(
            max_new_tokens=self.args.response_length,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            do_sample=True,
            min_length=0,
            eos_token_id=self.stop_token_id,
            pad_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id,
            use_cache=True,
        )
        kw.update(self.args.generation_kwargs or {})
        return GenerationConfig(**kw)

    def _check_fused_head(self, causal_lm: nn.Module, settings: HeadSettings) -> None:
        """Warn if the fused log-probs disagree with the model's own logits on one training prompt.

        fastrl reads the LM head's weight and the config's logit transform; a model whose head does something
        else would silently get other log-probs. Skipped where the weights are not materialised (ZeRO-3).
        """
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            return
        row = self.train_dataset[0]
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)[None, :16]
        if ids.shape[1] < 2:
            return
        device = next(causal_lm.parameters()).device
        ids = ids.to(device)
        with torch.no_grad():
            logits = causal_lm(input_ids=ids).logits[:, :-1].float() / settings.temperature
            expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            got, _ = fused_head_outputs(
                causal_lm, ids, torch.ones_like(ids, dtype=torch.bool),
                torch.arange(ids.shape[1], device=device)[None], 1,
                lambda h, w, b: lm_head_logprobs(h, w, b, ids[:, 1:], settings, with_entropy=False),
            )
        err = (got.float() - expected).abs().max().item()
        tol = 1e-3 if unwrap_causal_lm(causal_lm).dtype in (torch.float32, torch.float64) else 0.15  # bf16 logits
        if not err <= tol:
            warnings.warn(
                f"fastrl's fused log-probs differ from the model's own logits by up to {err:.3g} nats on a training "
                f"prompt ({type(causal_lm).__name__}): its LM head applies a transform fastrl does not know "
                "(settings read: " + f"logit_scale={settings.logit_scale}, softcap={settings.softcap}). "
                "PPO would optimise the wrong log-probs.",
                stacklevel=3,
            )

    @contextlib.contextmanager
    def null_ref_context(self):
        """The reference policy under PEFT: the policy with its adapter disabled (or the reference adapter)."""
        policy = self.accelerator.unwrap_model(self.model_wrapped).policy
        with (
            policy.disable_adapter() if self.is_peft_model and not self.ref_adapter_name else contextlib.nullcontext()
        ):
            if self.ref_adapter_name:
                policy.set_adapter(self.ref_adapter_name)
            yield
            if self.ref_adapter_name:
                policy.set_adapter(self.model_adapter_name or "default")

    @contextlib.contextmanager
    def _unwrapped_for_generation(self):
        from trl.models import unwrap_model_for_generation

        with (
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=args_checkpointing(self.args)[1],
            ) as unwrapped,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            yield unwrapped

    def _generate(self, policy: nn.Module, queries: torch.Tensor, batch: int, config: GenerationConfig,
                  kept: list | None = None) -> torch.Tensor:
        """``[B, Lq + R]`` query + sampled response, generated ``batch`` prompts at a time (TRL's batch_generation).

        The generation config replaces the policy's own for the call, so nothing model-specific (a hub
        ``generation_config.json`` with top_k / top_p / repetition_penalty) leaks into the sampling. ``kept``: a
        list that receives one ``KeptSet`` per sequence, the ids each response token could be drawn from
        (recorded after every warper of ``generate``; sampling_replay="kept_set").
        """
        pad = self.processing_class.pad_token_id
        lm = unwrap_causal_lm(policy)
        saved = lm.generation_config
        lm.generation_config = config
        recording = record_kept_sets(lm) if kept is not None else contextlib.nullcontext([])
        try:
            chunks = []
            with recording as recorders:
                for i in range(0, queries.shape[0], batch):
                    query = queries[i : i + batch]
                    context_length = query.shape[1]
                    attention_mask = query != pad
                    input_ids = torch.masked_fill(query, ~attention_mask, 0)
                    out = policy.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
                    chunks.append(torch.cat((query, out[:, context_length:]), dim=1))
                    if kept is not None:
                        r = out.shape[1] - context_length
                        kept.extend(recorders[-1].kept_sets([r] * out.shape[0], lm.config.get_text_config().vocab_size))
        finally:
            lm.generation_config = saved
        return pad_right(chunks, pad)

    def _policy_logprobs_and_values(self, query_responses, targets, context_length, support=None, ref=None):
        """Forward-only fused log-probs of ``targets`` [b, R] (-100: skip) and values, in one forward.

        ``support`` (sampling replay): the log-probs are over it. ``ref``: the reference's ``(hidden [b, R, H_ref],
        weight, bias)`` (``kl_estimator="exact"``): the exact per-token KL(pi || pi_ref) [b, R] (0 where the target
        is skipped) is computed in the same forward, with the policy's head gathered, over the same support (a
        rule: the set replayed on the policy's logits). Returns ``(logprob, value, extras)``: ``extras["kl"]``
        (with ``ref``) and ``extras["kept_mass"]``, the log of the support's full-softmax mass (``log_kept_mass``),
        each None when not asked for.
        """
        ids, mask, pos = lm_inputs(query_responses, self.processing_class.pad_token_id)
        settings = self.head_settings
        mass = support is not None and self.args.log_kept_mass

        def head(h, w, b):
            sup, kl = support, None
            if ref is not None:
                with head_precision(h, w, b, settings) as (h_, w_, b_):
                    if isinstance(sup, SamplerRule):  # one kept set for the log-probs and the KL: the policy's
                        sup = None if sup.is_identity else replay_rule(
                            h_, w_, targets, sup, bias=b_, temperature=settings.temperature,
                            logit_scale=settings.logit_scale, softcap=settings.softcap, backend=settings.backend)[0]
                    kl = rollout_exact_kl(h_, w_, b_, ref, targets != IGNORE, settings, self.ref_head_settings, sup)
            outs = lm_head_logprobs(h, w, b, targets, settings, with_entropy=False, support=sup,
                                    return_kept_mass=mass and sup is not None)
            kept_mass = outs[2] if mass and sup is not None else (torch.zeros_like(outs[0]) if mass else None)
            return outs[0], kept_mass, kl

        (logprob, kept_mass, kl), value = self.model_wrapped(ids, mask, pos, context_length=context_length,
                                                             head_fn=head)
        return logprob, value, {"kl": kl, "kept_mass": kept_mass}

    def _ref_forward(self, query_responses, context_length, head):
        """``head(hidden, weight, bias)`` on the reference model's hidden states at the response positions."""
        ids, mask, pos = lm_inputs(query_responses, self.processing_class.pad_token_id)
        if self.ref_model is None:
            with self.null_ref_context():
                out, _ = self.model_wrapped(ids, mask, pos, context_length=context_length, head_fn=head,
                                            with_values=False)
            return out
        # the policy's forward runs under the accelerator's autocast (mixed precision); the reference must
        # be computed the same way, or the KL between two identical models is not 0
        with self.accelerator.autocast():
            return fused_head_outputs(unwrap_engine(self.ref_model), ids, mask, pos, context_length, head)

    def _ref_logprobs(self, query_responses, targets, context_length, support=None):
        settings = self.ref_head_settings

        def head(h, w, b):
            return lm_head_logprobs(h, w, b, targets, settings, with_entropy=False, support=support)

        logprob, _ = self._ref_forward(query_responses, context_length, head)
        return logprob

    def _ref_hidden(self, query_responses, context_length):
        """The reference's ``(hidden [b, R, H_ref], weight, bias)`` for the exact KL of one rollout chunk.

        The hidden states are copied out of the forward (a slice would keep the whole body output alive); the head
        is held by reference (the reference is frozen), copied only under DeepSpeed ZeRO-3, whose partitioned
        weight has no storage outside the gather.
        """
        def head(h, w, b):
            keep = is_zero3_param(w)
            return (h.detach().clone(), w.detach().clone() if keep else w.detach(),
                    None if b is None else (b.detach().clone() if keep else b.detach()))

        return tuple(self._ref_forward(query_responses, context_length, head))

    @torch.no_grad()
    def _rollout(self, queries: torch.Tensor) -> dict[str, torch.Tensor]:
        """Generate, score, and turn scores and log-probs into advantages and returns (TRL's steps 1-6)."""
        context_length = queries.shape[1]
        query_responses, kept = self._generate_responses(queries)
        responses = query_responses[:, context_length:]
        out = self._score_responses(queries, query_responses, context_length, kept)  # steps 1-2
        batch = dict(
            query_responses=query_responses, responses=responses,
            postprocessed_responses=out["postprocessed_responses"],
            **self._advantages(out, responses.shape[1]),  # steps 3-6
            context_length=torch.tensor(context_length),
        )
        if kept is not None:
            batch["kept_sets"] = kept  # [B, R] KeptSet: the updates index its rows with the micro-batch's
        if "kept_mass" in out:
            batch["kept_mass"] = out["kept_mass"]
        if batch["ref_logprobs"] is None:  # kl_estimator="exact": the reference gave its hidden states, not log-probs
            del batch["ref_logprobs"]
        return batch

    def _generate_responses(self, queries: torch.Tensor):
        """``query_responses`` [B, Lq + R] sampled by the policy, and the kept sets [B, R] of its tokens when
        ``sampling_replay="kept_set"`` (else None)."""
        args = self.args
        kept_seqs = [] if self.sampling_replay == "kept_set" else None
        with self._unwrapped_for_generation() as unwrapped:
            query_responses = self._generate(
                unwrapped.policy, queries, args.local_rollout_forward_batch_size, self.generation_config, kept_seqs
            )
        R = query_responses.shape[1] - queries.shape[1]
        # the support of every response token (sampling replay): recorded kept sets [B, R], or the rule
        kept = stack_sequences(kept_seqs, R, device=query_responses.device) if kept_seqs is not None else None
        return query_responses, kept

    def _score_responses(self, queries, query_responses, context_length: int, kept) -> dict[str, torch.Tensor]:
        """Steps 1-2, one ``local_rollout_forward_batch_size`` slice at a time: truncate, the policy's log-probs and
        values, the reference's log-probs (or the exact per-token KL), the reward model's score. Concatenated over
        the slices: ``postprocessed_responses``, ``logprobs``, ``sequence_lengths``, ``scores``, ``values`` and
        ``ref_logprobs`` or ``kl``, and ``kept_mass`` when the policy pass returns it."""
        args = self.args
        pad = self.processing_class.pad_token_id
        R = query_responses.shape[1] - context_length
        parts = defaultdict(list)
        for i in range(0, queries.shape[0], args.local_rollout_forward_batch_size):
            query = queries[i : i + args.local_rollout_forward_batch_size]
            query_response = query_responses[i : i + args.local_rollout_forward_batch_size]
            response = query_response[:, context_length:]
            # 1. truncate after the first stop token
            postprocessed_response = response
            if self.stop_token_id is not None:  # the stop token id may be 0
                postprocessed_response = truncate_response(self.stop_token_id, pad, response)
            sequence_length = response_lengths(postprocessed_response, pad)
            # log-probs only where they are used (positions 0..L); the rest are skipped by the fused op
            padding_mask, _ = padding_masks(sequence_length, R)
            targets = response.masked_fill(padding_mask, IGNORE)
            fb = query.shape[0]
            support = kept.rows_of_sequences(i, i + fb) if kept is not None else self.sampling_rule
            # the exact KL needs the reference's hidden states, not its log-probs: one pass over both heads
            ref = self._ref_hidden(query_response, context_length) if args.kl_estimator == "exact" else None
            logprob, value, extras = self._policy_logprobs_and_values(query_response, targets, context_length,
                                                                      support, ref=ref)
            if extras["kept_mass"] is not None:
                parts["kept_mass"].append(extras["kept_mass"].double().exp().masked_fill(padding_mask, 0.0))
            if ref is not None:
                parts["kl"].append(extras["kl"])
                del ref
            else:
                parts["ref_logprobs"].append(self._ref_logprobs(query_response, targets, context_length, support))
            # 2. the reward model scores the truncated response
            postprocessed_query_response = torch.cat((query, postprocessed_response), 1)
            _, score, _ = get_reward(self.reward_model, postprocessed_query_response, pad, context_length)
            parts["postprocessed_responses"].append(postprocessed_response)
            parts["logprobs"].append(logprob)
            parts["sequence_lengths"].append(sequence_length)
            parts["scores"].append(score.float())
            parts["values"].append(value.float())
        return {k: torch.cat(v, 0) for k, v in parts.items()}

    def _advantages(self, out: dict[str, torch.Tensor], R: int) -> dict[str, torch.Tensor | None]:
        """Steps 3-6 on the scored rollout ``out`` (``_score_responses``): the EOS penalty, the padding masks, the
        per-token rewards (KL penalty, the score at the end), whitening, GAE. ``ref_logprobs`` is None with the
        exact KL."""
        args = self.args
        postprocessed_responses, sequence_lengths = out["postprocessed_responses"], out["sequence_lengths"]
        # 3. the EOS trick
        contain_eos_token = torch.any(postprocessed_responses == self.processing_class.eos_token_id, dim=-1)
        scores = apply_eos_penalty(
            out["scores"], contain_eos_token, missing_eos_penalty=args.missing_eos_penalty,
            non_eos_penalty=args.non_eos_penalty, penalty_reward_value=args.penalty_reward_value,
        )
        # padding: log-probs after the last real token, values one further
        padding_mask, padding_mask_p1 = padding_masks(sequence_lengths, R)
        logprobs = torch.masked_fill(out["logprobs"], padding_mask, INVALID_LOGPROB)
        ref_logprobs = None
        if "ref_logprobs" in out:
            ref_logprobs = torch.masked_fill(out["ref_logprobs"], padding_mask, INVALID_LOGPROB)
        values = torch.masked_fill(out["values"], padding_mask_p1, 0)
        # 4. rewards: -kl_coef * kl per token, the score at the end
        rewards, non_score_reward, kl = kl_rewards(
            logprobs, ref_logprobs, scores, sequence_lengths, args.kl_coef, args.kl_estimator,
            per_token_kl=out.get("kl"),
        )
        # 5. whiten rewards
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
            rewards = torch.masked_fill(rewards, padding_mask_p1, 0)
        # 6. advantages and returns
        advantages, returns = compute_gae(rewards, values, args.gamma, args.lam)
        advantages = masked_whiten(advantages, ~padding_mask)
        advantages = torch.masked_fill(advantages, padding_mask, 0)
        return dict(
            logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, scores=scores, kl=kl,
            non_score_reward=non_score_reward, advantages=advantages, returns=returns, padding_mask=padding_mask,
            padding_mask_p1=padding_mask_p1,
        )
