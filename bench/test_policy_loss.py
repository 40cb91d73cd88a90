"""pytest-benchmark: GRPO policy loss (dapo, beta 0.04 with k3 KL, entropy 0.01) from hidden states, every provider.

    pytest bench/test_policy_loss.py --benchmark-only            (shape: FASTRL_BENCH_SHAPE="N,H,V,dtype")

fastrl-fused is ``fastrl.policy_loss`` (one pass where the config allows); fastrl is path A log-probs plus the
reference loss math; torch / torch-compile materialise the logits; trl is TRL 1.16's chunked log-probs plus
its loss math; liger-fused is LigerFusedLinearGRPOLoss; liger-triton is triton_grpo_loss on materialised logits
(CUDA). Liger has no entropy term. N tokens are split into 16 sequences (8 on CPU).
"""

from __future__ import annotations

import pytest

from bench import _pytest as B

LOSS_PROVIDERS = ("fastrl-fused", "fastrl", "torch", "torch-compile", "trl", "liger-fused", "liger-triton")


@pytest.mark.parametrize("phase", B.PHASES)
@pytest.mark.parametrize("provider", LOSS_PROVIDERS)
def test_grpo_loss(benchmark, provider, phase):
    benchmark.group = f"grpo loss {phase}"
    B.run(benchmark, B.workload("loss", batch=16 if B.DEVICE == "cuda" else 8), provider, phase)
