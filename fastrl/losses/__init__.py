"""Policy and value losses built on the fused ops (GRPO family, PPO)."""
