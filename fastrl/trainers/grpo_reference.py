"""The reference model of ``fastrl.GRPOTrainer``: where it comes from, and its capture for ``kl_estimator="exact"``.

* ``reference_from_instance``: with ``beta != 0`` TRL builds the reference by loading the policy's ``name_or_path``
  (``create_model_from_path``), which a model built in memory does not have (TRL then stops in the hub's "Repo id
  must use alphanumeric chars"). For such a policy the reference is a copy of it, as built.
* ``kl_estimator="exact"``: the reference model's last hidden states at the completion positions, taken once per
  generation, instead of its log-probs. ``skip_trl_reference_pass`` sets the trainer's ``beta`` to 0 while TRL's
  ``_generate_and_score_completions`` runs (the only place TRL's generation reads ``beta``: it then skips its
  reference log-prob pass), and ``ReferenceCaptureMixin._reference_hidden_states`` takes the hidden states and keeps
  the reference head.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch

from fastrl.trainers._common import MULTIMODAL_KEYS
from fastrl.trainers._guards import check_reference_from_path
from fastrl.trainers._lm_head import is_zero3_param, unwrap_causal_lm

__all__ = ["ReferenceCaptureMixin", "reference_from_instance", "skip_trl_reference_pass"]


def _loadable(name: str) -> bool:
    """Whether TRL can load ``name``: a local folder, or a valid hub id (which TRL downloads, as it always has)."""
    if not name:
        return False
    if os.path.isdir(name):
        return True
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not os.path.isabs(name) and not name.startswith(".")  # a path that does not exist is not a hub id


@contextlib.contextmanager
def reference_from_instance(model, beta: float):
    """While TRL's constructor runs: when ``model`` is a model object whose ``name_or_path`` TRL cannot load and
    ``beta != 0``, TRL's ``create_model_from_path`` for that name returns a deep copy of ``model`` instead (the
    policy's weights as passed, its dtype and attention implementation: what TRL's reload would give for a saved
    model). Anything else loads as TRL loads it."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    if isinstance(model, str) or name is None or beta == 0.0 or _loadable(name):
        yield
        return
    check_reference_from_path()
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.create_model_from_path

    def create_model_from_path(model_id, *args, **kwargs):
        if model_id != name:
            return original(model_id, *args, **kwargs)
        dtype = kwargs.get("dtype")
        ref = copy.deepcopy(model)
        return ref.to(dtype) if isinstance(dtype, torch.dtype) else ref

    grpo_module.create_model_from_path = create_model_from_path
    try:
        yield
    finally:
        grpo_module.create_model_from_path = original


@contextlib.contextmanager
def skip_trl_reference_pass(trainer):
    """``trainer.beta = 0`` inside the block (TRL's generation then computes no reference log-probs)."""
    beta, trainer.beta = trainer.beta, 0.0
    try:
        yield
    finally:
        trainer.beta = beta


class ReferenceCaptureMixin:
    """The exact KL's reference capture on a TRL ``GRPOTrainer`` subclass."""

    @torch.no_grad()
    def _reference_hidden_states(self, batch) -> torch.Tensor:  # [B, K, H_ref]
        """The reference model's last hidden states that predict the completion tokens, and (kept on the trainer as
        ``_fastrl_ref_head``) its LM-head weight and bias: what the exact KL needs at loss time.

        Why stored rather than recomputed at loss time: the reference body then runs once per generation, as TRL's
        reference log-probs do, whatever ``num_iterations`` and gradient accumulation are, and the batch splits
        (``shuffle_sequence_dict`` / ``split_tensor_dict``, dim 0) carry the ``[B, K, H]`` tensor with the rest.
        The cost is memory: ``B * K * H_ref`` values per generation batch in the body's output dtype (128 MB at
        16384 completion tokens x 4096 in bf16), against TRL's ``B * K`` float32 log-probs; recomputing would
        instead cost a reference forward per micro-batch and iteration. The head is the reference model's own
        (PEFT without a separate reference: the base model with adapters disabled, i.e. the same head); it is
        held by reference, copied only when its storage may change or vanish before the loss (DeepSpeed ZeRO-3
        partitions, ``sync_ref_model``).
        """
        from trl.trainer.utils import use_adapter

        if any(batch.get(k) is not None for k in MULTIMODAL_KEYS):
            raise ValueError("GRPOConfig.kl_estimator='exact' does not support multimodal inputs yet")
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        K = batch["completion_ids"].size(1)
        mode = "train" if self.model.training else "eval"
        step = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        copy_head = bool(getattr(self.args, "sync_ref_model", False))
        head: list = []

        def capture(h, w, b):  # runs inside the reference's forward, its head gathered
            if not head:
                keep = copy_head or is_zero3_param(w)
                head[:] = [w.detach().clone() if keep else w.detach(),
                           None if b is None else (b.detach().clone() if keep else b.detach())]
            return (h.detach().clone(),)  # a copy: the slice would keep the whole [B, L, H] output alive

        if self.ref_model is not None:
            # fastrl.policy_loss applies the policy's logit transform to both heads (one model family, as TRL builds
            # the reference from the policy's checkpoint); refuse a reference whose config says otherwise
            ours = unwrap_causal_lm(self.accelerator.unwrap_model(self.model))._fastrl_head_settings
            theirs = getattr(unwrap_causal_lm(self.accelerator.unwrap_model(self.ref_model)), "_fastrl_head_settings",
                             None)
            if theirs is not None and (theirs.logit_scale, theirs.softcap) != (ours.logit_scale, ours.softcap):
                raise ValueError(
                    "kl_estimator='exact' needs the reference model's logit transform to be the policy's, got "
                    f"logit_scale={theirs.logit_scale}, softcap={theirs.softcap} for the reference and "
                    f"logit_scale={ours.logit_scale}, softcap={ours.softcap} for the policy"
                )
            model, ctx = self.ref_model, contextlib.nullcontext
        else:  # PEFT: the base model (adapters disabled), or the "ref" adapter when re-training an adapter
            peft_model = self.accelerator.unwrap_model(self.model)
            name = "ref" if "ref" in peft_model.peft_config else None
            model, ctx = self.model, lambda: use_adapter(peft_model, adapter_name=name)
        parts = []
        for start in range(0, input_ids.size(0), step):
            with ctx(), self.accelerator.autocast():
                out = model(input_ids=input_ids[start : start + step],
                            attention_mask=attention_mask[start : start + step], fused_lm_head=True,
                            logits_to_keep=K, fastrl_head_fn=capture)
            parts.append(out.head_outputs[0])
        self._fastrl_ref_head = tuple(head)
        return torch.cat(parts, dim=0)
