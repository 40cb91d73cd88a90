"""The one-pass policy loss inside a TRL ``GRPOTrainer``: TRL 1.16's ``_compute_loss`` with the per-token part fused
into the LM head (``fastrl.policy_loss`` on the hidden states, inside the model's forward), and the head install
that scores every log-prob with fastrl. Used by ``fastrl.GRPOTrainer`` and ``fastrl.patch_trainer``.

``compute_loss_one_pass`` reproduces the trainer-level parts of TRL's ``_compute_loss`` around the per-token math
of ``fastrl.losses.arithmetic.policy_loss_from_logprobs`` (which is TRL's arithmetic with gradient accumulation 1
on one process): the gradient-accumulation / ``num_processes`` / ``steps_per_generation`` normalisers, the adaptive
entropy controller, the MoE aux loss and the cross-process metric reductions. Scaling: with ``n' =
num_items_in_batch / (num_processes * steps_per_generation)`` (train; eval: ``/ num_processes``) every loss type's
TRL value is ``policy_loss_from_logprobs(..., num_items_in_batch=n') / gradient_accumulation_steps`` (eval: ``/ 1``).
"""

from __future__ import annotations

import torch
from trl.trainer.utils import nanmax, nanmin

from fastrl.losses.policy import policy_loss
from fastrl.ops.linear_logprob import fused_logprobs
from fastrl.trainers._common import MULTIMODAL_KEYS, SAMPLING_METRICS, opt
from fastrl.trainers._lm_head import add_fastrl_lm_head, head_precision, head_settings_from_config, unwrap_causal_lm
from fastrl.trainers.grpo_vllm import sampling_gap_from_loss

__all__ = ["TRLEntropyState", "compute_loss_one_pass", "exact_kl", "fastrl_kl", "install_fastrl_head", "kept_mass_mean",
           "one_pass_config", "one_pass_reason"]


def install_fastrl_head(trainer, *, backend: str | None = None, vocab_chunk: int | None = None,
                        chunk_tokens: int | None = None) -> None:
    """Patch the policy (PEFT: its base model) and the reference model of a TRL trainer to score with fastrl."""
    args = trainer.args
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        base = unwrap_causal_lm(trainer.accelerator.unwrap_model(model) if hasattr(trainer, "accelerator") else model)
        settings = head_settings_from_config(
            base,
            temperature=float(getattr(trainer, "temperature", getattr(args, "temperature", 1.0))),
            cast_lm_head_to_fp32=bool(getattr(args, "cast_lm_head_to_fp32", False)),
            backend=backend,
            vocab_chunk=vocab_chunk,
            chunk_tokens=chunk_tokens,
        )
        add_fastrl_lm_head(base, settings)
    trainer._fastrl_installed = True


def one_pass_config(trainer, entropy_coef: float):
    """TRL's loss options on ``trainer`` as a ``PolicyLossConfig`` (``entropy_coef``: the one applied this step)."""
    from fastrl.losses.config import CLIPPED_LOSS_TYPES, PolicyLossConfig

    a = trainer.args
    return PolicyLossConfig(
        loss_type=trainer.loss_type,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=a.delta if trainer.loss_type in CLIPPED_LOSS_TYPES else None,  # TRL reads it only there
        beta=trainer.beta,
        kl_estimator=opt(a, "kl_estimator", "k3"),
        use_bias_correction_kl=bool(a.use_bias_correction_kl),
        entropy_coef=float(entropy_coef),
        importance_sampling_level=trainer.importance_sampling_level,
        temperature=float(trainer.temperature),
        max_completion_length=trainer.max_completion_length,
        sapo_temperature_neg=a.sapo_temperature_neg,
        sapo_temperature_pos=a.sapo_temperature_pos,
        vespo_k_pos=a.vespo_k_pos,
        vespo_lambda_pos=a.vespo_lambda_pos,
        vespo_k_neg=a.vespo_k_neg,
        vespo_lambda_neg=a.vespo_lambda_neg,
        top_entropy_quantile=trainer.top_entropy_quantile,
        off_policy_mask_threshold=trainer.off_policy_mask_threshold,
    )


class TRLEntropyState:
    """TRL 1.16's adaptive-entropy controller state on a ``GRPOTrainer``, the one place fastrl reads or writes it.

    The state stays TRL's (``_guards.TRL_ENTROPY_STATE``: TRL's checkpoints save ``entropy_coef`` and
    ``_last_world_entropy``, and TRL's own loss route reads the same window), so a fallback to TRL's loss or a resumed
    run sees one controller. ``check_entropy_controller`` (at the trainer's construction) checks TRL still has it."""

    def __init__(self, trainer):
        self.trainer = trainer

    @property
    def enabled(self) -> bool:
        return bool(self.trainer._entropy_bonus_enabled)

    @property
    def adaptive(self) -> bool:
        return bool(self.trainer.use_adaptive_entropy)

    @property
    def coef(self) -> float:
        return self.trainer.entropy_coef

    def applied_coef(self) -> float:
        """TRL: the coefficient and gate from the end of the previous optimizer step."""
        t = self.trainer
        if not self.enabled:
            return 0.0
        if self.adaptive:
            return t.entropy_coef if t._last_world_entropy <= t.args.entropy_target else 0.0
        return t.entropy_coef

    def add_to_window(self, stats: torch.Tensor) -> None:  # [entropy sum, token count] of one micro-batch
        t = self.trainer
        t._entropy_window_stats = stats if t._entropy_window_stats is None else t._entropy_window_stats + stats

    def close_window(self, reduce) -> None:
        """At an optimizer step: the window-global entropy (``reduce``: the sum over processes) moves the
        coefficient by ``entropy_coef_delta`` towards ``entropy_target``, within its bounds."""
        t, a = self.trainer, self.trainer.args
        window = reduce(t._entropy_window_stats)
        world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
        if world_entropy <= a.entropy_target:
            t.entropy_coef = min(t.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max)
        else:
            t.entropy_coef = max(t.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
        t._last_world_entropy = world_entropy
        t._entropy_window_stats = None


def fastrl_kl(trainer) -> bool:
    """Whether the loss has a KL term that only fastrl's loss computes (``kl_estimator`` other than TRL's k3)."""
    return trainer.beta != 0.0 and opt(trainer.args, "kl_estimator", "k3") != "k3"


def exact_kl(trainer) -> bool:
    """Whether the loss has the exact KL term (the reference's hidden states replace its log-probs)."""
    return trainer.beta != 0.0 and opt(trainer.args, "kl_estimator", "k3") == "exact"



def one_pass_reason(trainer, inputs) -> str | None:
    """Why this batch cannot take the one-pass path (None: it can)."""
    if not opt(trainer.args, "fused_loss", True) or not opt(trainer.args, "one_pass_loss", True):
        return "disabled in the config"
    if not getattr(trainer, "_fastrl_installed", False):
        return "fastrl's head is not installed"
    if any(inputs.get(k) is not None for k in MULTIMODAL_KEYS):
        return "multimodal inputs"
    # fastrl.policy_loss computes the entropy mask (two passes) with the quantile of this process's tokens, which is
    # TRL's (cross-process) quantile on one process; with a KL only fastrl computes, that is the route
    if trainer.top_entropy_quantile < 1.0 and not (fastrl_kl(trainer) and trainer.accelerator.num_processes == 1):
        return "top_entropy_quantile < 1 couples every sequence of the batch"
    isr = inputs.get("importance_sampling_ratio")
    if trainer.loss_type == "vespo" and isr is not None and isr.shape[-1] == 1:
        return "vespo with sequence-level IS ratios"
    return None


def compute_loss_one_pass(trainer, model, inputs):
    """TRL 1.16's ``_compute_loss`` with the per-token part fused into the LM head (see the module docstring)."""
    completion_ids = inputs["completion_ids"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    K = completion_ids.size(1)
    mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
    mode = "train" if trainer.model.training else "eval"
    ga = trainer.current_gradient_accumulation_steps if mode == "train" else 1
    entropy = TRLEntropyState(trainer)
    config = one_pass_config(trainer, entropy.applied_coef())
    kwargs, ref = _loss_kwargs(trainer, inputs, config, mode)
    st = unwrap_causal_lm(trainer.accelerator.unwrap_model(trainer.model))._fastrl_head_settings
    support = kwargs.get("support")
    log_mass = support is not None and getattr(trainer, "_fastrl_log_kept_mass", False)
    # the vLLM sampler gap of this generation batch is left to this pass (grpo_vllm.log_sampling_gap)
    gap = getattr(trainer, "_fastrl_gap_window", None) is not None
    keys: list[str] = []
    logprobs: list[torch.Tensor] = []

    def head_fn(hidden, weight, bias):  # hidden [B, K, H]; runs inside the model's forward, head gathered
        with head_precision(hidden, weight, bias, st) as (h, w, b):
            if ref is not None:  # the reference in the policy head's precision (a constant: no gradient)
                ref_hidden, ref_weight, ref_bias = ref
                kwargs.update(ref_hidden=ref_hidden.to(h.dtype), ref_weight=ref_weight.to(h.dtype),
                              ref_bias=None if ref_bias is None else ref_bias.to(h.dtype))
            loss, metrics, *lp = policy_loss(h, w, completion_ids, inputs["advantages"], mask, bias=b,
                                                    return_logprobs=gap, **kwargs)
            logprobs[:] = lp
            if log_mass:
                metrics = {**metrics, "sampling/kept_mass_mean": kept_mass_mean(
                    h, w, b, completion_ids, mask, support, config.temperature, st)}
        keys[:] = sorted(metrics)
        return (loss, *[metrics[k] for k in keys])

    forward_kwargs = {"output_router_logits": True} if trainer.aux_loss_enabled else {}
    with trainer.accelerator.autocast():
        out = model(input_ids=input_ids, attention_mask=attention_mask, fused_lm_head=True, logits_to_keep=K,
                    fastrl_head_fn=head_fn, **forward_kwargs)
    loss, *values = out.head_outputs
    metrics = {k: v.detach() for k, v in zip(keys, values)}
    loss = loss / ga
    _entropy_bonus_step(trainer, entropy, mode, metrics, loss, ga, mask)
    if logprobs:
        sampling_gap_from_loss(trainer, inputs, logprobs[0])
    if trainer.aux_loss_enabled:
        aux_loss = out.aux_loss
        loss = loss + trainer.router_aux_loss_coef * aux_loss / ga
        trainer._metrics[mode]["aux_loss"].append(trainer.accelerator.gather_for_metrics(aux_loss).mean().item())
    _log_loss_metrics(trainer, mode, metrics, mask)
    return loss


def _loss_kwargs(trainer, inputs, config, mode: str) -> tuple[dict, tuple | None]:
    """``fastrl.policy_loss``'s keyword arguments for this micro-batch (TRL's normalisers, the IS ratios, old /
    reference log-probs, the head's transform, the sampling support), and the exact KL's reference
    ``(hidden [B, K, H_ref], weight, bias)`` (None without it)."""
    acc = trainer.accelerator
    K = inputs["completion_ids"].size(1)
    n_items = inputs["num_items_in_batch"].clamp(min=1.0) / acc.num_processes
    if mode == "train":
        n_items = n_items / trainer.args.steps_per_generation
    isr = None
    if (trainer.use_vllm and trainer.vllm_importance_sampling_correction) or trainer.loss_type == "vespo":
        isr = inputs.get("importance_sampling_ratio")
        if isr is not None and isr.dim() == 2 and isr.shape[1] == 1 and K != 1:
            isr = isr.squeeze(1)  # TRL's sequence-level ratio is [B, 1]; fastrl takes [B]
    exact = exact_kl(trainer)
    kwargs = dict(
        config=config,
        old_logprobs=inputs.get("old_per_token_logps"),
        ref_logprobs=inputs.get("ref_per_token_logps") if trainer.beta != 0.0 and not exact else None,
        importance_weights=isr,
        num_items_in_batch=n_items,
    )
    ref = None
    if exact:
        ref_hidden = inputs.get("ref_hidden_states")
        if ref_hidden is None or getattr(trainer, "_fastrl_ref_head", None) is None:
            raise ValueError(
                "kl_estimator='exact' needs the batch's ref_hidden_states (the reference model's last hidden states), "
                "which fastrl.GRPOTrainer._generate_and_score_completions adds; this batch has none"
            )
        ref = (ref_hidden, *trainer._fastrl_ref_head)
    st = unwrap_causal_lm(acc.unwrap_model(trainer.model))._fastrl_head_settings
    extras = {"logit_scale": st.logit_scale if st.logit_scale != 1.0 else None, "softcap": st.softcap,
              "backend": st.backend, "vocab_chunk": st.vocab_chunk, "chunk_tokens": st.chunk_tokens,
              # KeptSet [B, K] or SamplerRule (sampling replay)
              "support": getattr(trainer, "_fastrl_loss_support", None)}
    if trainer.off_policy_mask_threshold is not None:
        extras["sampling_logprobs"] = inputs.get("sampling_per_token_logps")
    kwargs.update({name: value for name, value in extras.items() if value is not None})
    return kwargs, ref


def _entropy_bonus_step(trainer, entropy: TRLEntropyState, mode: str, metrics: dict, loss: torch.Tensor, ga: int,
                        mask: torch.Tensor) -> None:
    """TRL's logged ``policy_loss`` and its adaptive entropy controller (when the entropy bonus is on)."""
    if not entropy.enabled:
        return
    acc = trainer.accelerator
    store = trainer._metrics[mode]
    # TRL's `policy_loss`: dapo/cispo/vespo's already includes the accumulation factor, the other loss types' does not
    logged = metrics.get("policy_loss", None)
    if logged is None:
        logged = loss.detach() * ga
    if trainer.loss_type in ("cispo", "dapo", "vespo"):
        logged = logged / ga
    store["policy_loss"].append(acc.gather(logged.float()).nanmean().item())
    if entropy.adaptive and mode == "train":
        # window-global entropy statistics, from the masked mean entropy and the token count
        n_tok = mask.to(torch.float32).sum()
        entropy.add_to_window(torch.stack([metrics["entropy"].float() * n_tok, n_tok]).detach())
        if acc.sync_gradients:
            entropy.close_window(lambda stats: acc.reduce(stats, reduction="sum"))
    if mode == "train" and acc.sync_gradients:
        store["entropy_coef"].append(entropy.coef)


def _log_loss_metrics(trainer, mode: str, metrics: dict, mask: torch.Tensor) -> None:
    """TRL's metrics of the loss, reduced over processes as TRL reduces them (fastrl's are local means)."""
    acc = trainer.accelerator
    store = trainer._metrics[mode]
    B, K = mask.shape
    n_tok = mask.to(torch.float32).sum()
    seq_level = trainer.importance_sampling_level == "sequence"

    def global_mean(name: str, count):
        # TRL: reduce (sum, count) over processes; fastrl gives the local mean
        local = metrics[name].float()
        count = torch.as_tensor(count, dtype=torch.float32, device=local.device)
        totals = acc.reduce(torch.stack([local * count, count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if trainer.beta != 0.0:
        store["kl"].append(global_mean("kl", n_tok))
    store["entropy"].append(global_mean("entropy", n_tok))
    if trainer.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        count = float(B) if seq_level and K > 1 else n_tok
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            store[name].append(global_mean(name, count))
        store["clip_ratio/low_min"].append(nanmin(acc.gather(metrics["clip_ratio/low_min"].float().reshape(1))).item())
        store["clip_ratio/high_max"].append(
            nanmax(acc.gather(metrics["clip_ratio/high_max"].float().reshape(1))).item()
        )
    elif trainer.loss_type == "cispo":
        store["cispo_clip_ratio"].append(global_mean("cispo_clip_ratio", float(B) if seq_level and K > 1 else n_tok))
    elif trainer.loss_type == "vespo":
        store["vespo/phi_seq_mean"].append(global_mean("vespo/phi_seq_mean", float(B)))
    for name in SAMPLING_METRICS:
        if name in metrics:
            store[name].append(global_mean(name, n_tok))


def kept_mass_mean(hidden, weight, bias, targets, mask, support, temperature: float, st) -> torch.Tensor:
    """Mean over ``mask`` of the full-softmax probability of the support (``return_kept_mass``; one forward-only
    pass over the vocabulary, no gradient)."""
    m = mask.bool()
    with torch.no_grad():
        out = fused_logprobs(
            hidden.detach(), weight.detach(), targets.masked_fill(~m, -100),
            bias=None if bias is None else bias.detach(), temperature=temperature, logit_scale=st.logit_scale,
            softcap=st.softcap, with_entropy=False, backend=st.backend, support=support, return_kept_mass=True,
        )
        mass = out[-1].double().exp()
        return (mass * m).sum().div(m.sum().clamp(min=1)).float()

