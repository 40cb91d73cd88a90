"""``fastrl.patch_trainer``: swap fastrl's LM head and fused policy loss into an already constructed TRL trainer.

    trainer = trl.GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...)
    fastrl.patch_trainer(trainer)
    trainer.train()

For a ``trl.GRPOTrainer`` this does what ``fastrl.GRPOTrainer`` does at construction: the policy's and the
reference model's ``fused_lm_head`` forward is patched to score with fastrl, and ``_compute_loss`` takes the
one-pass fused policy loss when the options allow it (TRL's own loss math on fastrl's log-probs otherwise).
For a ``trl.RLOOTrainer`` only the LM head is swapped (its loss math stays TRL's, on fastrl's log-probs).
Call it before ``train()``. Patching twice is harmless.
"""

from __future__ import annotations

import types

__all__ = ["patch_trainer"]


def patch_trainer(
    trainer,
    *,
    one_pass_loss: bool = True,
    backend: str | None = None,
    vocab_chunk: int | None = None,
    chunk_tokens: int | None = None,
    health_checks: bool = False,
):
    """Patch ``trainer`` (a ``trl.GRPOTrainer`` or ``trl.RLOOTrainer``, or a subclass) in place; return it.

    Args:
        one_pass_loss: GRPO only: use the one-pass fused policy loss when the loss options allow it.
        backend, vocab_chunk, chunk_tokens: as ``fastrl.GRPOConfig``'s ``fastrl_backend``,
            ``fastrl_vocab_chunk`` and ``fastrl_chunk_tokens``.
        health_checks: also attach ``fastrl.TrainingHealthCallback`` (off by default here: the trainer's
            callbacks are the user's).
    """
    import trl

    from fastrl.trainers._guards import check_fused_head_protocol, check_overrides
    from fastrl.trainers.grpo import GRPOTrainer as FastrlGRPOTrainer
    from fastrl.trainers.grpo_loss import compute_loss_one_pass, install_fastrl_head, one_pass_reason

    rloo = getattr(trl, "RLOOTrainer", None)
    is_grpo = isinstance(trainer, trl.GRPOTrainer)
    if not is_grpo and not (rloo is not None and isinstance(trainer, rloo)):
        raise TypeError(f"patch_trainer expects a trl.GRPOTrainer or trl.RLOOTrainer, got {type(trainer).__name__}")
    if isinstance(trainer, FastrlGRPOTrainer):
        return trainer  # already fastrl's
    check_fused_head_protocol(type(trainer))
    if is_grpo:
        check_overrides(trl.GRPOTrainer, [("_compute_loss", ("model", "inputs"))], "fastrl.patch_trainer")
    install_fastrl_head(trainer, backend=backend, vocab_chunk=vocab_chunk, chunk_tokens=chunk_tokens)

    if is_grpo and not getattr(trainer, "_fastrl_patched_loss", False):
        trl_compute_loss = trainer._compute_loss  # the bound method of the trainer's own class

        def _compute_loss(self, model, inputs):
            if one_pass_loss and one_pass_reason(self, inputs) is None:
                self._fastrl_last_path = "one_pass"
                return compute_loss_one_pass(self, model, inputs)
            self._fastrl_last_path = "trl"
            return trl_compute_loss(model, inputs)

        trainer._compute_loss = types.MethodType(_compute_loss, trainer)
        trainer._fastrl_patched_loss = True

    if health_checks:
        from fastrl.trainers.health import TrainingHealthCallback

        if not any(isinstance(cb, TrainingHealthCallback) for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(TrainingHealthCallback())
    return trainer
