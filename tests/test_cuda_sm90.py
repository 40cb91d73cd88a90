"""The ``triton-sm90`` kernels compiled on a Hopper (or newer) GPU, against float64.

Skipped without a CUDA device of compute capability 9.0 or more (CI, this project's CPU machines); on a GPU machine
``python -m pytest -q tests/test_cuda_sm90.py`` runs them. What the interpreter (tests/test_kernels_sm90.py) cannot
show: TMA descriptors and stores on real hardware, the persistent grid over 132 SMs with its vocabulary splits, the
software pipeline, and the scaled-exp tile at real sizes. No test here times anything.
"""

import pytest
import torch

import fastrl
from fastrl.reference import logprobs_reference

from test_cuda_kernels import check_policy_loss_with_padding
from test_logprobs import check_against_float64, make_inputs, max_err

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA device with TMA (compute capability 9.0 or newer)")

SM90 = "triton-sm90"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(47, 32, 123), (300, 896, 32000), (1030, 4096, 151936), (16, 896, 262144)],
                         ids=str)
def test_logprobs_cuda(dtype, shape):
    if dtype == torch.float32 and shape[0] * shape[2] > 10**7:
        pytest.skip("float32 at this size runs on the FMA units: minutes, and the bf16 case covers the shape")
    check_against_float64(SM90, dtype, *shape, device="cuda")


@pytest.mark.parametrize("tf", [dict(temperature=0.7), dict(softcap=30.0, logit_scale=0.5)], ids=str)
def test_transforms_cuda(tf):
    check_against_float64(SM90, torch.bfloat16, 300, 256, 5000, device="cuda", **tf)


def test_bf16_logprob_error_cuda():
    """Issue 28's bound on the compiled kernels: bf16 log-probs within 2e-4 nats of float64 at W1's head."""
    hidden, weight, _, targets = make_inputs(2048, 4096, 151936, torch.bfloat16, bias=False, scale=8.0,
                                             device="cuda")
    with torch.no_grad():
        lp, _ = fastrl.fused_logprobs(hidden, weight, targets, backend=SM90, with_entropy=False)
        lp64, _ = logprobs_reference(hidden, weight, targets, dtype=torch.float64)
    assert max_err(lp, lp64) <= 2e-4


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_policy_loss_one_pass_cuda(loss_type):
    """The one-pass loss on the scaled-exp tile, live rows only, several chunks, against float64."""
    check_policy_loss_with_padding(SM90, loss_type)
