"""What both backends of ``fused_divergence`` share: the divergence modes.

``fastrl.ops.divergence`` (the public function, the autograd Function and the torch backend) and
``fastrl.ops.divergence_hybrid`` (the Triton backend) both import from here, so neither imports the other's
definitions. ``fastrl.kernels.divergence_fold`` compares the same values as literals (its ``MODE`` constexpr);
tests/test_divergence.py checks that they agree.
"""

from __future__ import annotations

__all__ = ["FORWARD_KL", "REVERSE_KL", "JSD"]

FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2  # beta = 0, beta = 1, 0 < beta < 1
