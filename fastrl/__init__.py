"""fastrl: fused LM-head kernels for RL fine-tuning (log-probs, entropy, KL, clipped policy losses).

``import fastrl`` needs only torch: Triton kernels are imported when a Triton backend first runs, and
trainer classes (which need TRL) are imported on first attribute access.
"""

from fastrl.ops.linear_logprob import fused_logprobs

__version__ = "0.1.0"

__all__ = ["__version__", "fused_logprobs"]
