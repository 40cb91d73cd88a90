"""fastrl: fused LM-head kernels for RL fine-tuning (log-probs, entropy, KL, clipped policy losses).

``import fastrl`` needs only torch: Triton kernels are imported when a Triton backend first runs, and
the trainer classes (which need TRL: ``pip install "fastrl-kernels[trl]"``) are imported on first attribute access.
"""

from __future__ import annotations

import importlib

from fastrl.ops.linear_logprob import fused_logprobs

__version__ = "0.1.0"

# public name -> module that defines it, imported on first access (keeps `import fastrl` light)
_LAZY = {
    "KeptSet": "fastrl.ops.support",
    "SamplerRule": "fastrl.ops.support",
    "replay_rule": "fastrl.ops.rules",
    "fused_divergence": "fastrl.ops.divergence",
    "set_memory_budget": "fastrl.ops.budget",
    "get_memory_budget": "fastrl.ops.budget",
    "set_batch_invariant": "fastrl.ops.config",
    "get_batch_invariant": "fastrl.ops.config",
    "PolicyLossConfig": "fastrl.losses.config",
    "policy_loss": "fastrl.losses.policy",
    "FusedPolicyLoss": "fastrl.losses.policy",
    "value_loss": "fastrl.losses.value",
    "GRPOTrainer": "fastrl.trainers.grpo",
    "GRPOConfig": "fastrl.trainers.grpo_config",
    "patch_trainer": "fastrl.trainers.patch",
    "PPOTrainer": "fastrl.trainers.ppo",
    "PPOConfig": "fastrl.trainers.ppo_config",
    "DistillationTrainer": "fastrl.trainers.distillation",
    "DistillationConfig": "fastrl.trainers.distillation",
    "TrainingHealthCallback": "fastrl.trainers.health",
    "finish": "fastrl.trainers._distributed",
}
# the names above that need the `trl` extra (trl, transformers, accelerate, datasets)
_NEEDS_TRL = {n for n, module in _LAZY.items() if module.startswith("fastrl.trainers.")} - {"finish"}

__all__ = ["__version__", "fused_logprobs", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as e:
            if e.name != _LAZY[name]:
                if name in _NEEDS_TRL and e.name:
                    from fastrl._extras import extra_error

                    raise extra_error(f"fastrl.{name}", e.name.split(".")[0]) from e
                raise  # a dependency is missing: say so, not "no attribute"
            raise AttributeError(f"fastrl.{name} is not available in this build ({e.name} missing)") from e
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fastrl' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
