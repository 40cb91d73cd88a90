"""The updates of ``fastrl.PPOTrainer``: ``num_ppo_epochs`` shuffled passes over a rollout in minibatches of
micro-batches, each micro-batch's loss ``fastrl.policy_loss`` (one pass, gradients formed in the forward, with
``PolicyLossConfig.ppo(cliprange)``) plus ``vf_coef * fastrl.value_loss``; the rollout's finiteness check before
any optimizer step, and TRL's per-update metric dict."""

from __future__ import annotations

import time

import numpy as np
import torch

from fastrl.losses.policy import policy_loss
from fastrl.losses.value import value_loss
from fastrl.trainers._common import SAMPLING_METRICS
from fastrl.trainers._lm_head import head_precision
from fastrl.trainers.ppo_models import lm_inputs
from fastrl.trainers.sampling import sequence_rows

__all__ = ["UpdateMixin"]


class UpdateMixin:
    """``PPOTrainer``'s optimisation (its constructor sets what these methods read)."""

    def _train_micro_batch(self, batch: dict[str, torch.Tensor], inds) -> dict[str, torch.Tensor]:
        """Loss ``pg + vf_coef * vf`` on one micro-batch, backward, (accumulated) optimizer step; its metrics."""
        args = self.args
        context_length = int(batch["context_length"])
        mb_query_responses = batch["query_responses"][inds]
        mb_responses = batch["responses"][inds]
        mb_mask = ~batch["padding_mask"][inds]
        ids, attn, pos = lm_inputs(mb_query_responses, self.processing_class.pad_token_id)
        settings = self.head_settings
        config = self.loss_config
        mb_advantage = batch["advantages"][inds]
        mb_logprobs = batch["logprobs"][inds]
        extra = {}
        if "kept_sets" in batch:
            extra["support"] = sequence_rows(batch["kept_sets"], inds)
        elif self.sampling_rule is not None:
            extra["support"] = self.sampling_rule

        def head(h, w, b):
            with head_precision(h, w, b, settings) as (h_, w_, b_):
                return policy_loss(
                    h_, w_, mb_responses, mb_advantage, mb_mask, config=config, old_logprobs=mb_logprobs, bias=b_,
                    logit_scale=settings.logit_scale, softcap=settings.softcap, backend=settings.backend, **extra,
                )

        (pg_loss, pg_metrics), vpred = self.model_wrapped(ids, attn, pos, context_length=context_length, head_fn=head)
        vf_loss, vf_metrics = value_loss(
            vpred.float(), batch["values"][inds], batch["returns"][inds], ~batch["padding_mask_p1"][inds],
            args.cliprange_value,
        )
        loss = pg_loss + args.vf_coef * vf_loss
        # never let a non-finite loss reach the optimizer (gathered: every process raises together, none hangs)
        if bool(self.accelerator.gather((~torch.isfinite(loss.detach())).reshape(1)).any()):
            raise FloatingPointError(
                f"PPO loss is non-finite (policy {pg_loss.item()}, value {vf_loss.item()} on this process) at update "
                f"{self.state.global_step + 1}; stopped before the optimizer step. The rollout's rewards, values and "
                "advantages were finite: the policy or value model produced inf/nan (learning rate too high?)."
            )
        self.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        stats = {
            "policy/approxkl_avg": pg_metrics["policy/approxkl_avg"],
            "policy/clipfrac_avg": pg_metrics["policy/clipfrac_avg"],
            "loss/policy_avg": pg_loss.detach(),
            "loss/value_avg": vf_metrics["loss/value_avg"],
            "val/clipfrac_avg": vf_metrics["val/clipfrac_avg"],
            "policy/entropy_avg": pg_metrics["policy/entropy_avg"],
            "val/ratio": pg_metrics["val/ratio"],
            "val/ratio_var": pg_metrics["val/ratio_var"],
        }
        for name in ("sampling/kept_size_mean", "sampling/label_outside_frac"):  # the supports of this update
            if name in pg_metrics:
                stats[name] = pg_metrics[name]
        return stats

    def _check_rollout(self, batch: dict[str, torch.Tensor], update: int) -> None:
        """Raise before any optimizer step when the rollout holds non-finite rewards, values, log-probs or
        advantages, naming the first culprit; the bad rollout's scores are logged first, so the health callback
        reports the reward too. One host synchronisation; the flags are gathered, so every process raises."""
        real, real_p1 = ~batch["padding_mask"], ~batch["padding_mask_p1"]
        checks = (
            ("scores", "the reward (the reward model's score, after the EOS penalty)", batch["scores"], None),
            ("values", "the value model's values", batch["values"], real_p1),
            ("logprobs", "the policy's rollout log-probs", batch["logprobs"], real),
            ("ref_logprobs", "the reference policy's log-probs", batch["ref_logprobs"], real) if "ref_logprobs" in batch
            else ("kl", "the exact KL to the reference policy", batch["kl"], real),
            ("advantages", "the advantages", batch["advantages"], real),
            ("returns", "the returns", batch["returns"], real_p1),
        )
        bad = [~torch.isfinite(x) if where is None else ~torch.isfinite(x) & where for _, _, x, where in checks]
        flags = torch.stack([b.any() for b in bad])
        everywhere = self.accelerator.gather(flags[None]).reshape(-1, len(checks)).any(0)
        if not bool(everywhere.any()):
            return
        with torch.no_grad():
            self.log({"objective/scores": batch["scores"].float().mean().item(),
                      "objective/kl": batch["kl"].sum(1).mean().item()})
        i = int(everywhere.nonzero()[0, 0])
        name, what, x, _ = checks[i]
        if bool(flags[i]):
            pos = tuple(int(j) for j in bad[i].nonzero()[0])
            detail = f"{int(bad[i].sum())} non-finite, the first {x[pos].item()} at {name}[{', '.join(map(str, pos))}]"
        else:
            detail = "on another process"
        raise FloatingPointError(
            f"{what} ({name}) is not finite in the rollout of update {update}: {detail}. No optimizer step was "
            "taken on it."
        )

    def _ppo_epochs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``num_ppo_epochs`` shuffled passes over the rollout; each metric averaged over every micro-batch."""
        args = self.args
        model = self.model_wrapped
        stats: dict[str, torch.Tensor] = {}
        shape = (args.num_ppo_epochs, args.num_mini_batches, args.gradient_accumulation_steps)
        for ppo_epoch_idx in range(args.num_ppo_epochs):
            b_inds = np.random.permutation(args.local_batch_size)
            for minibatch_idx, mini_batch_start in enumerate(range(0, args.local_batch_size, args.local_mini_batch_size)):
                mini_batch_inds = b_inds[mini_batch_start : mini_batch_start + args.local_mini_batch_size]
                micro_starts = range(0, args.local_mini_batch_size, args.per_device_train_batch_size)
                for ga_idx, micro_batch_start in enumerate(micro_starts):
                    with self.accelerator.accumulate(model), self._fastrl_memory.step_context():
                        micro_inds = torch.as_tensor(
                            mini_batch_inds[micro_batch_start : micro_batch_start + args.per_device_train_batch_size],
                            device=self.accelerator.device,
                        )
                        for key, value in self._train_micro_batch(batch, micro_inds).items():
                            if key not in stats:
                                stats[key] = torch.zeros(shape, device=self.accelerator.device)
                            stats[key][ppo_epoch_idx, minibatch_idx, ga_idx] = value.float()
        return {k: v.mean() for k, v in stats.items()}

    def _update_metrics(self, batch, stats, start_time: float, start_episode: int) -> dict[str, float]:
        """TRL's metric dict for one update (every documented name; see the module docstring for meanings)."""
        acc = self.accelerator
        real = ~batch["padding_mask"]
        with torch.no_grad():
            local = {
                "objective/kl": batch["kl"].sum(1).mean(),
                "objective/entropy": torch.where(real, -batch["logprobs"], 0.0).sum(1).mean(),
                "objective/non_score_reward": batch["non_score_reward"].sum(1).mean(),
                "objective/scores": batch["scores"].mean(),
            }
            local["objective/rlhf_reward"] = local["objective/non_score_reward"] + local["objective/scores"]
            n_real = real.sum().clamp(min=1)
            if "kept_mass" in batch:
                local["sampling/kept_mass_mean"] = batch["kept_mass"].sum() / n_real
            local.update(stats)
            keys = list(local)
            gathered = acc.gather(torch.stack([local[k].float() for k in keys])[None]).reshape(-1, len(keys)).mean(0)
            num_eos = acc.gather((batch["postprocessed_responses"] == self.processing_class.eos_token_id).sum()[None])
        elapsed = max(time.time() - start_time, 1e-9)
        metrics = {"eps": int((self.state.episode - start_episode) / elapsed)}
        order = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                 "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg",
                 "loss/value_avg", "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var"]
        values = dict(zip(keys, gathered.tolist()))
        metrics.update({k: values[k] for k in order})
        metrics.update({k: values[k] for k in SAMPLING_METRICS if k in values})
        metrics["val/num_eos_tokens"] = int(num_eos.sum().item())
        metrics["lr"] = self.lr_scheduler.get_last_lr()[0]
        metrics["episode"] = self.state.episode
        return metrics
