"""Test configuration: run the Triton kernels on CPU tensors through Triton's interpreter.

TRITON_INTERPRET must be set before fastrl's kernel modules are imported (Triton decides at decoration
time), so it is set here, before any test module imports fastrl.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Backends the CPU test-suite checks: the chunked torch path and the Triton kernels (interpreted). "triton"
# is what users get (the hybrid kernels, as on a current CUDA install); the op-level tests also run each
# Triton implementation by name.
CPU_BACKENDS = ("torch", "triton")
KERNEL_BACKENDS = ("torch", "triton-hybrid", "triton-fused")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
