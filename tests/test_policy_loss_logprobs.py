"""``fastrl.policy_loss(..., return_logprobs=True)``: the per-token log-probs the loss computed (what the trainer's
side of the vLLM sampler gap is taken from, instead of an extra forward), on every route of the loss, against float64
ground truth; 0 outside the mask; the loss and metrics unchanged by asking."""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl.losses.config import PolicyLossConfig
from fastrl.reference import logprobs_reference, masked_logprobs_reference

B, T, H, V = 3, 7, 31, 123  # awkward shapes


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5 * 4
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 1:] = False
    advantages = torch.randn(B, generator=g)
    return hidden, weight, targets, mask, advantages


@pytest.mark.parametrize("route", ["one_pass", "two_pass_no_grad", "kept_set", "triton"])
def test_returned_logprobs_are_the_losss(route):
    hidden, weight, targets, mask, adv = inputs()
    config = PolicyLossConfig(loss_type="dapo", beta=0.0, temperature=0.7)
    kw = {"backend": "triton" if route == "triton" else "torch"}
    kept = None
    if route == "kept_set":
        g = torch.Generator().manual_seed(1)
        kept = torch.rand(B, T, V, generator=g) < 0.2
        kept.scatter_(-1, targets[..., None], True)  # the sampled token is always kept
        kw["support"] = fastrl.KeptSet.from_mask(kept.reshape(B * T, V))
    h = hidden.clone().requires_grad_(route != "two_pass_no_grad")
    w = weight.clone().requires_grad_(route != "two_pass_no_grad")
    with torch.set_grad_enabled(route != "two_pass_no_grad"):
        loss, metrics, logp = fastrl.policy_loss(h, w, targets, adv, mask, config=config, return_logprobs=True, **kw)
        loss_plain, metrics_plain = fastrl.policy_loss(hidden, weight, targets, adv, mask, config=config, **kw)
    assert logp.shape == (B, T) and not logp.requires_grad
    ids = targets.masked_fill(~mask, -100)
    if kept is None:
        want = logprobs_reference(hidden.double(), weight.double(), ids, temperature=0.7)[0]
    else:
        want = masked_logprobs_reference(hidden.double(), weight.double(), ids, kept, temperature=0.7)[0]
    err = (logp.double() - want).abs()[mask].max().item()
    assert err < 2e-5, f"{route}: the returned log-probs are {err:.2e} nats from float64"
    assert torch.equal(logp[~mask], torch.zeros_like(logp[~mask]))
    assert loss.item() == pytest.approx(loss_plain.item(), rel=1e-6, abs=1e-7)
    assert set(metrics) == set(metrics_plain)
