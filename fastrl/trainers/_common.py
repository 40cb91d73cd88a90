"""What fastrl's trainers share, once: option lookup on a stock TRL config, multimodal input names, the activation
checkpointing names of transformers 4 and 5, and the ``sampling/*`` metric names.

Below every trainer module (GRPO, PPO, distillation): it imports nothing of theirs.
"""

from __future__ import annotations

from dataclasses import fields

__all__ = [
    "MULTIMODAL_KEYS",
    "SAMPLING_METRICS",
    "args_checkpointing",
    "checkpointing_on",
    "default_activation_checkpointing",
    "opt",
]

# TRL 1.16's multimodal batch fields (GRPO's `_get_per_token_logps_and_entropies` keywords): a batch holding any of
# them is multimodal. fastrl's one-pass loss and exact KL pass only input_ids / attention_mask to the body.
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                   "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")

# the support metrics of sampling replay, as logged by the GRPO and PPO trainers (means over the completion tokens)
SAMPLING_METRICS = ("sampling/kept_size_mean", "sampling/label_outside_frac", "sampling/kept_mass_mean")


def opt(args, name: str, default):
    """A fastrl option from ``args`` (a stock TRL config has none: fastrl's default)."""
    return getattr(args, name, default)


# ---------------------------------------------------------------------------------------------------------------
# Activation checkpointing: transformers 5.23 renamed gradient_checkpointing* to activation_checkpointing* (the old
# names stay as deprecated aliases until v6); earlier versions have only the old names.
# ---------------------------------------------------------------------------------------------------------------


def default_activation_checkpointing(config, trl_config_cls) -> None:
    """TRL's default (activation checkpointing on) under the name this transformers uses, on a config whose
    ``gradient_checkpointing`` field defaults to None (call first in ``__post_init__``).

    TRL turns checkpointing on through the old name, ``gradient_checkpointing=True``, which transformers 5 answers
    with a FutureWarning on every config built, even when the user named neither; a value given under either name
    still wins."""
    if config.gradient_checkpointing is not None:
        return
    if "activation_checkpointing" in {f.name for f in fields(trl_config_cls)}:  # transformers >= 5: the new name
        if config.activation_checkpointing is None:
            config.activation_checkpointing = True
    else:
        config.gradient_checkpointing = True


def args_checkpointing(args) -> tuple[bool, dict | None]:  # (on, kwargs) of TrainingArguments
    if hasattr(args, "activation_checkpointing"):
        return bool(args.activation_checkpointing), args.activation_checkpointing_kwargs
    return bool(args.gradient_checkpointing), args.gradient_checkpointing_kwargs


def checkpointing_on(model) -> bool:
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)
