"""Both Triton implementations compiled on a GPU: float64 checks, TMA against pointer loads, the in-place gradient
under real concurrency, the one-pass loss with padding, and opt-in autotuning.

Skipped where there is no CUDA device (CI, most laptops); on a GPU machine ``python -m pytest -q`` runs them.
What the interpreter cannot show is checked here: warps racing on the in-place bf16 G (one program per row, a
barrier between its loads and stores), TMA descriptors on real hardware, and cuBLAS's float32-output GEMMs.
"""

import pytest
import torch

import fastrl
from fastrl.losses.config import PolicyLossConfig
from fastrl.reference import logprobs_reference, policy_loss_from_logprobs

from test_logprobs import check_against_float64, make_inputs, max_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

IMPLS = ("triton-hybrid", "triton-fused")


@pytest.mark.parametrize("backend", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(47, 31, 123), (300, 896, 32000), (1030, 4096, 151936)], ids=str)
def test_logprobs_cuda_each_impl(backend, dtype, shape):
    if dtype == torch.float32 and shape[2] > 100000:
        pytest.skip("float32 at V=151936 runs on the FMA units: minutes, and the bf16 case covers the shape")
    check_against_float64(backend, dtype, *shape, device="cuda")


@pytest.mark.parametrize("backend", IMPLS)
@pytest.mark.parametrize("tf", [dict(temperature=0.7), dict(softcap=30.0, logit_scale=0.5)], ids=str)
def test_transforms_cuda_each_impl(backend, tf):
    check_against_float64(backend, torch.bfloat16, 300, 256, 5000, device="cuda", **tf)


def test_fused_tma_and_pointer_loads_agree_cuda():
    from fastrl.kernels import linear_logprob as K

    hidden, weight, b, targets = make_inputs(1000, 1024, 40000, torch.bfloat16, device="cuda")
    kw = dict(logit_scale=1.0, softcap=None, temperature=1.0, with_entropy=True)
    with torch.no_grad():
        a = K.linear_stats(hidden, weight, b, targets, use_tma=True, **kw)
        p = K.linear_stats(hidden, weight, b, targets, use_tma=False, **kw)
    for x, y in zip(a, p):
        assert max_err(x, y) < 1e-4


def test_in_place_bf16_gradient_has_no_race_cuda():
    """G written over its own float32 logits must equal G computed into float32 and then rounded (to within one
    bf16 rounding: the two compiled variants may contract a multiply-add differently). A warp that stored before
    another had loaded would make the other read bf16 bytes as float32: garbage, far outside that."""
    from fastrl.kernels import logits_fold as F

    g = torch.Generator(device="cuda").manual_seed(0)
    R, C = 512, 151936
    y = torch.randn(R, C, generator=g, device="cuda") * 4
    targets = torch.randint(0, C, (R,), generator=g, device="cuda")
    lse = torch.logsumexp(y, 1)
    p = torch.softmax(y, 1)
    ent = -(p * torch.log_softmax(y, 1)).sum(1)
    glp, gen = torch.randn(R, generator=g, device="cuda"), torch.randn(R, generator=g, device="cuda")
    kw = dict(logit_scale=1.0, softcap=None, temperature=1.0)
    ref = F.grad_tile(y.clone(), None, targets, 0, lse, ent, glp, gen, torch.float32, **kw).bfloat16()
    for _ in range(3):
        got = F.grad_tile(y.clone(), None, targets, 0, lse, ent, glp, gen, torch.bfloat16, **kw).float()
        assert ((got - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-30).all()


@pytest.mark.parametrize("backend", ("triton-hybrid", "triton-fused"))
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_policy_loss_with_padding_cuda(backend, loss_type):
    """The loss on live rows only against float64 (padding in every row): on triton-hybrid the one-pass path in
    several chunks (cuBLAS float32 tiles + the logits_fold kernels); on triton-fused path A on the fused kernels,
    which never store a logit."""
    check_policy_loss_with_padding(backend, loss_type)


def check_policy_loss_with_padding(backend, loss_type):
    """policy_loss on ``backend`` (CUDA, bf16, 1000-token chunks) against float64, padding in every row."""
    g = torch.Generator().manual_seed(1)
    B, T, H, V = 6, 700, 896, 32000
    hidden = torch.randn(B, T, H, generator=g).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H**0.5).cuda().bfloat16().requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g).cuda()
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).cuda()
    adv = torch.randn(B, generator=g).cuda()
    old = (-torch.rand(B, T, generator=g) * 8).cuda()
    ref = (-torch.rand(B, T, generator=g) * 8).cuda()
    config = PolicyLossConfig(loss_type=loss_type, beta=0.04, entropy_coef=0.01)
    loss, _ = fastrl.policy_loss(hidden, weight, targets, adv, mask, config=config, old_logprobs=old,
                                 ref_logprobs=ref, backend=backend, chunk_tokens=1000)
    gh, gw = torch.autograd.grad(loss, [hidden, weight])
    t = torch.where(mask, targets, -100)
    h64, w64 = (x.detach().double().requires_grad_() for x in (hidden, weight))  # float64 leaves: unrounded grads
    lp, en = logprobs_reference(h64, w64, t)
    loss64, _ = policy_loss_from_logprobs(lp, en, adv.double(), mask, config=config, old_logprobs=old.double(),
                                          ref_logprobs=ref.double())
    g64 = torch.autograd.grad(loss64, [h64, w64])
    assert abs(loss.item() - loss64.item()) <= 1e-4 * (1 + abs(loss64.item()))
    for got, want in zip((gh, gw), g64):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2**-7
    assert torch.equal(gh[~mask], torch.zeros_like(gh[~mask]))


def test_autotune_is_opt_in_and_picks_a_config_cuda(monkeypatch):
    from fastrl.kernels import tuning

    monkeypatch.setenv("FASTRL_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "_TUNED", {})
    check_against_float64("triton-fused", torch.bfloat16, 256, 512, 8192, device="cuda")
    # both kernels (the forward statistics and the backward's G) were timed and a choice kept for each
    assert {key[0] for key in tuning._TUNED} == {"stats", "grad"}, tuning._TUNED
