"""The same float64 checks on a GPU: the compiled Triton kernels (not the interpreter) on CUDA tensors.

Skipped where there is no CUDA device (CI, most laptops); run on a GPU machine with
``python -m pytest tests/test_cuda.py -q``. Shapes are real ones: 64-bit offsets, vocabulary splits and
the tensor-core bf16 path are only exercised here.
"""

import pytest
import torch

import fastrl
from fastrl.losses.config import PolicyLossConfig
from fastrl.reference import logprobs_reference, policy_loss_from_logprobs

from test_logprobs import check_against_float64

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(47, 31, 123), (256, 896, 32000), (1024, 1024, 151936)], ids=str)
def test_logprobs_cuda(dtype, shape):
    check_against_float64("triton", dtype, *shape, device="cuda")


@pytest.mark.parametrize("tf", [dict(temperature=0.7), dict(softcap=30.0, logit_scale=0.5)], ids=str)
def test_transforms_cuda(tf):
    check_against_float64("triton", torch.bfloat16, 300, 256, 5000, device="cuda", **tf)


def test_int64_offsets_cuda():
    """N * V > 2^31: a 32-bit offset into the [N, V_blk] gradient tile or the vocabulary would wrap."""
    free = torch.cuda.mem_get_info()[0]
    if free < 24 * 2**30:
        pytest.skip("needs 24 GiB free")
    check_against_float64("triton", torch.bfloat16, 16384, 64, 151936, bias=False, device="cuda")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "vespo"])
def test_policy_loss_cuda(loss_type):
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 4, 512, 896, 32000
    hidden = torch.randn(B, T, H, generator=g).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H**0.5).cuda().bfloat16().requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g).cuda()
    mask = (torch.rand(B, T, generator=g) > 0.1).cuda()
    adv = torch.randn(B, generator=g).cuda()
    old = (-torch.rand(B, T, generator=g) * 8).cuda()
    ref = (-torch.rand(B, T, generator=g) * 8).cuda()
    config = PolicyLossConfig(loss_type=loss_type, beta=0.04, entropy_coef=0.01,
                              epsilon_high=5.0 if loss_type == "cispo" else None)
    loss, _ = fastrl.policy_loss(hidden, weight, targets, adv, mask, config=config, old_logprobs=old,
                                 ref_logprobs=ref, chunk_tokens=512)
    gh, gw = torch.autograd.grad(loss, [hidden, weight])
    t = torch.where(mask, targets, -100)

    def ref_loss(dtype):
        lp, en = logprobs_reference(hidden, weight, t, dtype=dtype)
        cast = (lambda x: x.to(lp.dtype))
        loss, _ = policy_loss_from_logprobs(lp, en, cast(adv), mask, config=config, old_logprobs=cast(old),
                                            ref_logprobs=cast(ref))
        return loss, torch.autograd.grad(loss, [hidden, weight])

    loss64, g64 = ref_loss(torch.float64)
    loss_bf, g_bf = ref_loss(None)  # what PyTorch itself gets from bf16 inputs

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

    assert abs(loss.item() - loss64.item()) <= abs(loss_bf.item() - loss64.item()) + 1e-4 * (1 + abs(loss64.item()))
    for got, want, theirs in zip((gh, gw), g64, g_bf):
        assert rel(got, want) <= rel(theirs, want) + 2**-8
