"""Checkpoints of ``fastrl.PPOTrainer``: saving the policy (``from_pretrained``-loadable) and, in checkpoints, the
value model in its ``value_model`` sub-folder; resuming a run from one, with everything read and checked before
anything is loaded (``CheckpointMixin._resume``)."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from transformers import TrainerState
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.utils import logging

__all__ = ["CheckpointMixin", "OnlineTrainerState", "VALUE_MODEL_DIR"]

logger = logging.get_logger(__name__)

VALUE_MODEL_DIR = "value_model"  # checkpoint sub-folder holding the value model (plain / DDP runs)


@dataclass
class OnlineTrainerState(TrainerState):
    """``TrainerState`` plus the number of prompts used so far (TRL's ``OnlineTrainerState``)."""

    episode: int = 0


class CheckpointMixin:
    """``PPOTrainer``'s checkpoint saving and loading (a ``transformers.Trainer`` subclass's)."""

    def _resume(self, checkpoint: str) -> None:
        """Load everything a checkpoint holds, so the next update is the one the saved run would have done.

        Everything is read and checked before anything is loaded (the trainer state; both models' weights,
        names and shapes, against the models; the optimizer's parameter groups and state shapes; the scheduler
        file), so a checkpoint that does not fit raises and leaves this trainer as it was.
        """
        state_file = os.path.join(checkpoint, TRAINER_STATE_NAME)
        if not os.path.isfile(state_file):
            raise ValueError(f"{checkpoint} is not a PPOTrainer checkpoint (no {TRAINER_STATE_NAME})")
        state = OnlineTrainerState.load_from_json(state_file)
        weights = None
        if not (self.is_fsdp_enabled or self.is_deepspeed_enabled):
            weights = self._read_checkpoint_weights(checkpoint)
            self._check_optimizer_checkpoint(checkpoint)
        # nothing above changed the trainer; from here on the checkpoint is known to fit
        self.state = state
        self._load_callback_state()
        if self.is_deepspeed_enabled:
            from transformers.integrations.deepspeed import deepspeed_load_checkpoint

            deepspeed_load_checkpoint(self.model_wrapped, checkpoint, load_module_strict=not self.is_peft_model)
        elif weights is None:
            super()._load_from_checkpoint(checkpoint, self.model_wrapped)
        else:
            for module, state_dict in weights:
                apply_weights(module, state_dict)
        self._load_optimizer_and_scheduler(checkpoint)
        self._load_scaler(checkpoint)
        self._load_rng_state(checkpoint)

    def _read_checkpoint_weights(self, checkpoint: str) -> list[tuple[nn.Module, dict]]:
        """The policy's weights from the checkpoint folder, the value model's from its ``value_model`` sub-folder,
        read and checked against the models (nothing is loaded)."""
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        return [
            (wrapper.policy, read_weights(wrapper.policy, checkpoint)),
            (wrapper.value_model, read_weights(wrapper.value_model, os.path.join(checkpoint, VALUE_MODEL_DIR))),
        ]

    def _check_optimizer_checkpoint(self, checkpoint: str) -> None:
        """The checkpoint's optimizer state must fit this optimizer (groups, parameter counts, state shapes)."""
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        for name in (OPTIMIZER_NAME, SCHEDULER_NAME):
            if not os.path.isfile(os.path.join(checkpoint, name)):
                raise ValueError(f"checkpoint {checkpoint} has no {name}: it cannot continue the run")
        saved = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True, mmap=True)
        groups = saved.get("param_groups", [])
        mine = self.optimizer.param_groups
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in mine]:
            raise ValueError(
                f"checkpoint {checkpoint}: the optimizer state has parameter groups of sizes "
                f"{[len(g['params']) for g in groups]}, this trainer's optimizer {[len(g['params']) for g in mine]}"
            )
        ids = [i for g in groups for i in g["params"]]
        params = [p for g in mine for p in g["params"]]
        for i, (key, p) in enumerate(zip(ids, params)):
            for k, v in saved.get("state", {}).get(key, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                    raise ValueError(
                        f"checkpoint {checkpoint}: optimizer state {k!r} of parameter {i} has shape {tuple(v.shape)}, "
                        f"the parameter {tuple(p.shape)}"
                    )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Policy from the checkpoint folder, value model from its ``value_model`` sub-folder (FSDP: the Trainer's)."""
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        for module, state_dict in self._read_checkpoint_weights(resume_from_checkpoint):
            apply_weights(module, state_dict)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy (``from_pretrained``-loadable) and the tokenizer; checkpoints also get the value model."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        try:
            state_dict = self.accelerator.get_state_dict(self.model_wrapped)  # collective under ZeRO-3 / FSDP
        except ValueError:
            # ZeRO-3 without stage3_gather_16bit_weights_on_model_save: DeepSpeed's own checkpoint is the record
            logger.warning("ZeRO-3 weights not gathered on save (set zero3_save_16bit_model: true); policy not saved")
            return
        if not self.args.should_save:
            return
        wrapper = self.accelerator.unwrap_model(self.model_wrapped)
        os.makedirs(output_dir, exist_ok=True)
        parts = [("policy.", wrapper.policy, output_dir)]
        if _internal_call:
            parts.append(("value_model.", wrapper.value_model, os.path.join(output_dir, VALUE_MODEL_DIR)))
        for prefix, module, folder in parts:
            sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
            module.save_pretrained(folder, state_dict=sub)
        self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def shared_storage(module: nn.Module) -> dict[str, list[str]]:
    """For each state-dict key, the keys whose tensors share its storage (tied weights), itself included."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for k, v in module.state_dict(keep_vars=True).items():
        groups[(v.device, v.data_ptr()) if v.numel() else ("empty", k)].append(k)
    return {k: keys for keys in groups.values() for k in keys}


def weights_mismatch(module: nn.Module, state_dict: dict) -> str | None:
    """What keeps ``state_dict`` from loading into ``module`` exactly (None: it fits). A tied weight may be
    saved under one of its names only (``save_pretrained`` drops the others)."""
    expected = module.state_dict()
    tied = shared_storage(module)
    missing = sorted(k for k in expected if k not in state_dict and not any(t in state_dict for t in tied[k]))
    unexpected = sorted(k for k in state_dict if k not in expected)
    shapes = [f"{k} {tuple(v.shape)} (model {tuple(expected[k].shape)})" for k, v in state_dict.items()
              if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    if not (missing or unexpected or shapes):
        return None
    return f"missing {missing[:8]}, unexpected {unexpected[:8]}, shape mismatches {shapes[:8]}"


def read_weights(module: nn.Module, folder: str):
    """A ``save_pretrained`` folder's weights for ``module``, checked against it (names and shapes); nothing is
    loaded. Single file or sharded; a PEFT model's adapter.

    transformers >= 5 saves some architectures in their original key format (GPT-NeoX's ``lm_head`` as
    ``embed_out``); when the file's names are not the module's, transformers' own loader maps them.
    """
    import json

    import safetensors.torch

    if hasattr(module, "peft_config"):
        from peft import get_peft_model_state_dict

        path = os.path.join(folder, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise ValueError(f"no adapter_model.safetensors in {folder}")
        state_dict = safetensors.torch.load_file(path)
        expected = get_peft_model_state_dict(module, adapter_name=module.active_adapter)
        if set(state_dict) != set(expected) or any(state_dict[k].shape != expected[k].shape for k in expected):
            raise ValueError(f"adapter checkpoint {folder} does not match the model's adapter: saved "
                             f"{sorted(state_dict)[:8]}, model {sorted(expected)[:8]}")
        return state_dict
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(folder, v) for v in json.load(f)["weight_map"].values()})
    else:
        raise ValueError(f"no model.safetensors (or index) in {folder}")
    state_dict = {}
    for path in files:
        state_dict.update(safetensors.torch.load_file(path, device="cpu"))
    problem = weights_mismatch(module, state_dict)
    if problem is not None and hasattr(module, "config") and hasattr(type(module), "from_pretrained"):
        converted = converted_weights(module, folder)
        if converted is not None:
            state_dict, problem = converted, None
    if problem is not None:
        raise ValueError(f"checkpoint {folder} does not match {type(module).__name__}: {problem}")
    return state_dict


def converted_weights(module: nn.Module, folder: str) -> dict | None:
    """The folder's weights as transformers' ``from_pretrained`` names them for this architecture (None: they do
    not fit even then)."""
    try:
        loaded, info = type(module).from_pretrained(folder, config=module.config, output_loading_info=True)
    except (OSError, ValueError, RuntimeError):
        return None
    if info.get("missing_keys") or info.get("unexpected_keys") or info.get("mismatched_keys"):
        return None  # a weight the file does not hold would be left at its random initialisation
    state_dict = loaded.state_dict()
    return state_dict if weights_mismatch(module, state_dict) is None else None


def apply_weights(module: nn.Module, state_dict: dict) -> None:
    """Load weights checked by ``_read_weights`` into ``module`` in place."""
    if hasattr(module, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(module, state_dict, adapter_name=module.active_adapter)
        return
    module.load_state_dict(state_dict, strict=False)  # strict=False: tied weights are saved once
