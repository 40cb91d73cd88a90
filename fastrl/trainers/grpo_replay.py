"""Sampling replay in ``fastrl.GRPOTrainer`` (``GRPOConfig.sampling_replay``; what it means and how a kept set travels
with a batch: ``fastrl.trainers.sampling``).

``SamplingReplayMixin`` overrides the TRL 1.16 ``GRPOTrainer`` methods that generate and score: where kept sets are
recorded (``_generate_single_turn``: transformers ``generate``, or vLLM colocate through ``grpo_vllm``), how they
ride in the generation batch (``_generate_and_score_completions_replayed``), and which support each forward scores
over (``_get_per_token_logps_and_entropies`` for old / reference / TRL-loss log-probs, ``_loss_support`` for the
one-pass loss). With ``sampling_replay="off"`` every method is TRL's.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from fastrl.trainers._common import SAMPLING_METRICS, opt
from fastrl.trainers._guards import check_logits_processor_hook
from fastrl.trainers._lm_head import unwrap_causal_lm
from fastrl.trainers.grpo_vllm import keep_vllm_outputs, vllm_kept_sets, vllm_rule
from fastrl.trainers.sampling import (
    KEPT_KEY,
    record_kept_sets,
    rule_from_generation_config,
    stack_sequences,
    warn_if_untruncated,
)

__all__ = ["SamplingReplayMixin"]


class SamplingReplayMixin:
    """Sampling replay on a TRL ``GRPOTrainer`` subclass (placed before ``trl.GRPOTrainer`` in the bases)."""

    _fastrl_collect = None

    def _setup_sampling_replay(self, replay: str) -> None:
        self._fastrl_replay = replay
        self._fastrl_log_kept_mass = bool(opt(self.args, "log_kept_mass", False))
        self._fastrl_rule = None
        self._fastrl_pending_kept = None  # per-sequence KeptSets of the generation batch being scored
        self._fastrl_loss_support = None  # the support of the micro-batch whose loss is being computed
        self._fastrl_vllm_outputs = None
        if replay == "off":
            return
        if replay == "rule":
            if self.use_vllm:
                self._fastrl_rule = vllm_rule(self)
            else:
                self._fastrl_rule = rule_from_generation_config(self.generation_config, self.eos_token_ids)
            return
        # kept_set: who generates must be able to record
        if not self.use_vllm:
            warn_if_untruncated(self.generation_config)
            check_logits_processor_hook(unwrap_causal_lm(self.accelerator.unwrap_model(self.model)))
        if self.rollout_func is not None:
            raise ValueError("sampling_replay='kept_set' records kept sets where TRL generates; a custom rollout_func "
                             "returns none. Use sampling_replay='rule'.")
        if self.tools:
            raise ValueError("sampling_replay='kept_set' is not supported with tools (tool-call turns append tokens "
                             "that were not sampled); use sampling_replay='rule'")
        if getattr(self, "use_transformers_continuous_batching", False):
            raise ValueError("sampling_replay='kept_set' records in transformers' generate, not in generate_batch "
                             "(continuous batching); use sampling_replay='rule'")
        if self.use_vllm:
            keep_vllm_outputs(self)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if getattr(self, "_fastrl_replay", "off") != "kept_set":
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        V = unwrap_causal_lm(self.accelerator.unwrap_model(self.model)).config.get_text_config().vocab_size
        generate = functools.partial(super()._generate_single_turn, prompt_ids, images, multimodal_fields,
                                     num_generations, has_tool_images)
        if self.use_vllm:
            completion_ids, logprobs, kept = vllm_kept_sets(self, generate, V)
        else:
            with record_kept_sets(unwrap_causal_lm(self.accelerator.unwrap_model(self.model))) as recorders:
                completion_ids, logprobs = generate()
            if len(recorders) != 1:
                raise RuntimeError(f"sampling_replay='kept_set': expected one generate call, saw {len(recorders)}")
            kept = recorders[0].kept_sets([len(c) for c in completion_ids], V)
        for i, (k, c) in enumerate(zip(kept, completion_ids)):
            k.check_tokens(torch.as_tensor(list(c), dtype=torch.int64), name=f"the kept set of completion {i}")
        self._fastrl_pending_kept = kept
        return completion_ids, logprobs

    def _generate_and_score_completions_replayed(self, inputs):
        self._fastrl_pending_kept = None
        try:
            output = super()._generate_and_score_completions(inputs)
            if self._fastrl_replay == "kept_set":
                # one KeptSet per sequence, in a list: TRL's shuffle / split index it together with the tensors
                output[KEPT_KEY] = list(self._fastrl_pending_kept)
        finally:
            self._fastrl_pending_kept = None
        return output

    @contextlib.contextmanager
    def _loss_support(self, inputs):
        replay = getattr(self, "_fastrl_replay", "off")
        if replay == "off":
            yield
            return
        if replay == "kept_set":
            seqs = inputs.get(KEPT_KEY)
            K = inputs["completion_ids"].size(1)
            if seqs is None or len(seqs) != inputs["completion_ids"].size(0):
                raise ValueError(f"sampling_replay='kept_set': the batch holds {None if seqs is None else len(seqs)} "
                                 f"kept sets for {inputs['completion_ids'].size(0)} completions")
            support = stack_sequences(seqs, K, device=inputs["completion_ids"].device)
        else:
            support = self._fastrl_rule
        self._fastrl_loss_support = support
        try:
            yield
        finally:
            self._fastrl_loss_support = None

    def _batch_support(self, n_seqs: int, logits_to_keep: int):
        """The support of the sequences being scored: the loss micro-batch's, or the generation batch's."""
        if self._fastrl_replay == "rule":
            return self._fastrl_rule
        if self._fastrl_loss_support is not None:
            support = self._fastrl_loss_support
        elif self._fastrl_pending_kept is not None:
            support = stack_sequences(self._fastrl_pending_kept, logits_to_keep, device=self.accelerator.device)
        else:
            raise RuntimeError("sampling_replay='kept_set': log-probs were asked for sequences with no recorded kept "
                               "set")
        if support.lead_shape != (n_seqs, logits_to_keep):
            raise ValueError(f"sampling_replay='kept_set': the kept sets are laid out {support.lead_shape}, the "
                             f"sequences being scored ({n_seqs}, {logits_to_keep}): misaligned")
        return support

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        if getattr(self, "_fastrl_replay", "off") == "off":
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            raise ValueError(f"sampling_replay={self._fastrl_replay!r} supports text models only, got inputs {given}")
        support = self._batch_support(input_ids.size(0), logits_to_keep)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies, aux = [], [], []
        for start in range(0, input_ids.size(0), batch_size):  # TRL's loop, each chunk with its rows of the support
            end = min(start + batch_size, input_ids.size(0))
            ids, am = input_ids[start:end], attention_mask[start:end]
            labels = ids.masked_fill(am == 0, -100)
            labels[:, :-logits_to_keep] = -100
            chunk = support if self._fastrl_replay == "rule" else support.rows_of_sequences(start, end)
            extra = {"output_router_logits": True} if compute_aux_loss else {}
            with self.accelerator.autocast():
                out = model(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True,
                            fastrl_support=chunk, fastrl_completion_length=logits_to_keep,
                            fastrl_kept_mass=self._fastrl_collect is not None and self._fastrl_log_kept_mass, **extra)
            logps.append(out.log_probs[:, -logits_to_keep:])
            if compute_entropy:
                entropies.append(out.entropy[:, -logits_to_keep:])
            if compute_aux_loss:
                aux.append(out.aux_loss)
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
                torch.stack(aux).mean() if compute_aux_loss else None)

    def _trl_loss_with_stats(self, model, inputs):
        """TRL's ``_compute_loss`` on fastrl's log-probs; with sampling replay, the ``sampling/*`` metrics of the
        policy's forward (summed by the patched head over its calls)."""
        if getattr(self, "_fastrl_replay", "off") == "off":
            return super()._compute_loss(model, inputs)
        base = unwrap_causal_lm(self.accelerator.unwrap_model(self.model))
        base._fastrl_support_stats = self._fastrl_collect = []
        try:
            loss = super()._compute_loss(model, inputs)
            stats = self._fastrl_collect
        finally:
            base._fastrl_support_stats = self._fastrl_collect = None
        mode = "train" if self.model.training else "eval"
        names = dict(zip(("kept", "outside", "mass"), SAMPLING_METRICS))  # support_stats' sums -> metric names
        keys = [k for k in names if stats and k in stats[0]]
        totals = torch.tensor([[sum(s["tokens"] for s in stats)] + [sum(s[k] for s in stats) for k in keys]],
                              dtype=torch.float64, device=self.accelerator.device)
        totals = self.accelerator.reduce(totals, reduction="sum")[0]
        for i, k in enumerate(keys):
            self._metrics[mode][names[k]].append((totals[i + 1] / totals[0].clamp(min=1)).item())
        return loss

