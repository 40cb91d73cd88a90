"""The Triton kernels one level down: both load paths of the fused kernels, the hybrid kernels' tiling and
in-place gradient, dropping ignored rows, the launch table, and the offline sm_90 compile check.

Everything runs on CPU tensors under Triton's interpreter (tests/conftest.py); ground truth is float64.
"""

import os
import subprocess
import sys

import pytest
import torch

import fastrl
from fastrl.kernels import linear_logprob as K
from fastrl.kernels import logits_fold as F
from fastrl.kernels import tuning
from fastrl.ops import budget, hybrid
from fastrl.reference import logits_reference, logprobs_reference

from conftest import CPU_BACKENDS, KERNEL_BACKENDS
from test_logprobs import grads, loss_weights, make_inputs, max_err, rel_err

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stats64(hidden, weight, bias, targets, **tf):
    z = logits_reference(hidden, weight, bias, dtype=torch.float64, **tf)
    lse = torch.logsumexp(z, 1)
    p = torch.softmax(z, 1)
    return lse, z.gather(1, targets[:, None]).squeeze(1), -(p * torch.log_softmax(z, 1)).sum(1)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tf", [{}, dict(softcap=4.0, temperature=0.8)], ids=["plain", "softcap"])
def test_fused_stats_tma_and_pointer_loads_agree(dtype, tf):
    """H = 40 is 16-byte aligned for both dtypes, so the same call can run either load path."""
    hidden, weight, b, targets = make_inputs(70, 40, 700, dtype)
    kw = dict(logit_scale=1.0, softcap=tf.get("softcap"), temperature=tf.get("temperature", 1.0), with_entropy=True)
    assert K.tma_ok(hidden, weight)
    with torch.no_grad():
        via_tma = K.linear_stats(hidden, weight, b, targets, use_tma=True, **kw)
        via_ptr = K.linear_stats(hidden, weight, b, targets, use_tma=False, **kw)
        want = _stats64(hidden, weight, b, targets, **tf)
    for name, x, y, w in zip(("lse", "target", "entropy"), via_tma, via_ptr, want):
        assert max_err(x, y) < 1e-5, name
        assert max_err(x, w) < 2e-5, name


@pytest.mark.interpreter
def test_fused_stats_split_merge_with_target_in_any_split():
    """The target logit comes from split 0's row dot product whichever split holds the target."""
    hidden, weight, b, targets = make_inputs(33, 24, 1000, torch.float32)
    targets[:5] = torch.tensor([0, 999, 500, 128, 127])
    with torch.no_grad():
        want = _stats64(hidden, weight, b, targets)
        for splits in (1, 3, 8):
            got = K.linear_stats(hidden, weight, b, targets, logit_scale=1.0, softcap=None, temperature=1.0,
                                 with_entropy=True, splits=splits)
            for x, w in zip(got, want):
                assert max_err(x, w) < 2e-5, f"splits={splits}"


@pytest.mark.interpreter
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
def test_fused_grad_block_both_load_paths(use_tma):
    hidden, weight, b, targets = make_inputs(50, 32, 300, torch.bfloat16)
    with torch.no_grad():
        lse, _, ent = K.linear_stats(hidden, weight, b, targets, logit_scale=1.0, softcap=None, temperature=1.0,
                                     with_entropy=True)
        glp, gen = (x.float() for x in loss_weights(targets.shape))
        out = torch.empty(50, 256, dtype=torch.bfloat16)
        G = K.linear_grad_block(hidden, weight[:256], b[:256], targets, 0, lse, ent, glp, gen, out,
                                logit_scale=1.0, softcap=None, temperature=1.0, use_tma=use_tma)
        z = logits_reference(hidden, weight, b, dtype=torch.float64)
        p = torch.softmax(z, 1)
        onehot = torch.nn.functional.one_hot(targets, 300).double()
        g64 = glp.double()[:, None] * (onehot - p) - gen.double()[:, None] * p * (
            torch.log_softmax(z, 1) + ent.double()[:, None])
    assert rel_err(G, g64[:, :256]) < 2**-7


@pytest.mark.interpreter
def test_hybrid_grad_tile_in_place_across_column_blocks():
    """A bf16 G written over its own float32 logits (first half of each row), over several column blocks."""
    R, C = 7, 2 * F.BLOCK_C + 301
    g = torch.Generator().manual_seed(3)
    y = torch.randn(R, C, generator=g) * 3
    targets = torch.randint(0, C, (R,), generator=g)
    targets[2] = -100  # a row with no gradient is exactly zero
    lse = torch.logsumexp(y.double(), 1).float()
    p = torch.softmax(y.double(), 1)
    ent = -(p * torch.log_softmax(y.double(), 1)).sum(1).float()
    glp = torch.randn(R, generator=g)
    gen = torch.randn(R, generator=g)
    glp[2] = gen[2] = 0.0
    onehot = torch.zeros(R, C, dtype=torch.float64)
    onehot[torch.arange(R) != 2, targets[torch.arange(R) != 2]] = 1.0
    want = glp.double()[:, None] * (onehot - p) - gen.double()[:, None] * p * (y.double() - lse.double()[:, None] + ent.double()[:, None])
    buf = y.clone()
    G = F.grad_tile(buf, None, targets, 0, lse, ent, glp, gen, torch.bfloat16, logit_scale=1.0, softcap=None,
                    temperature=1.0)
    assert G.dtype == torch.bfloat16 and G.data_ptr() == buf.data_ptr() and G.stride() == (2 * C, 1)
    assert torch.equal(G[2].float(), torch.zeros(C))
    assert rel_err(G, want) < 2**-8


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hybrid_multi_tile_stats_and_chunked_backward(dtype, monkeypatch):
    """Tiny tiles force several row and vocabulary tiles, and the backward's row-chunked weight accumulation."""
    monkeypatch.setattr(hybrid, "ROWS", 16)
    monkeypatch.setattr(hybrid, "MAX_ROWS", 16)
    monkeypatch.setitem(budget.BUDGETS, "hybrid", budget.TileBudget(elems=16 * 256, live=1))
    hidden, weight, b, targets = make_inputs(45, 24, 700, dtype)
    a, c = loss_weights(targets.shape)
    lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend="triton-hybrid", softcap=6.0)
    lp64, en64 = logprobs_reference(hidden, weight, targets, bias=b, softcap=6.0, dtype=torch.float64)
    assert max_err(lp, lp64) < 1e-5 and max_err(en, en64) < 1e-5
    got = grads(lp, en, a, c, [hidden, weight, b])
    want = grads(lp64, en64, a, c, [hidden, weight, b])
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for name, x, y in zip(("hidden", "weight", "bias"), got, want):
        assert rel_err(x, y) < tol, name


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_ignored_rows_do_not_reach_the_weight_gradient(backend, bad):
    """Ignored rows are dropped before any kernel: inf/nan there cannot poison grad_W through 0 * nan."""
    hidden, weight, b, targets = make_inputs(20, 16, 200, torch.float32)
    with torch.no_grad():
        hidden[5] = bad
        hidden[11, 3] = bad
    targets[[5, 11]] = -100
    a, c = loss_weights(targets.shape)
    lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend)
    gh, gw, gb = grads(lp, en, a, c, [hidden, weight, b])
    assert torch.isfinite(gw).all() and torch.isfinite(gb).all() and torch.isfinite(gh).all()
    assert torch.equal(gh[[5, 11]], torch.zeros(2, 16))
    keep = targets != -100
    lp64, en64 = logprobs_reference(hidden.detach()[keep], weight, targets[keep], bias=b, dtype=torch.float64)
    gw64, gb64 = grads(lp64, en64, a[keep], c[keep], [weight, b])
    assert rel_err(gw, gw64) < 1e-5 and rel_err(gb, gb64) < 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
def test_policy_loss_masked_rows_with_nan_hidden(backend, one_pass, monkeypatch):
    from fastrl.losses.config import PolicyLossConfig

    if not one_pass:
        monkeypatch.setattr(PolicyLossConfig, "one_pass_granularity", property(lambda self: None))
    B, T, H, V = 3, 6, 16, 120
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, T, H, generator=g)
    hidden[1, 4] = float("nan")
    hidden = hidden.requires_grad_()
    weight = (torch.randn(V, H, generator=g) / 4).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False
    adv = torch.randn(B, generator=g)
    config = PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)
    ref = -torch.rand(B, T, generator=g) * 3 - 2
    loss, _ = fastrl.policy_loss(hidden, weight, targets, adv, mask, config=config, ref_logprobs=ref,
                                 backend=backend, chunk_tokens=5)
    gh, gw = torch.autograd.grad(loss, [hidden, weight])
    assert torch.isfinite(loss) and torch.isfinite(gw).all() and torch.isfinite(gh).all()
    assert torch.equal(gh[1, 4:], torch.zeros(2, H))


def test_launch_table_covers_every_case_and_autotune_is_opt_in(monkeypatch):
    for kernel in ("stats", "grad"):
        for family in ("sm90", "other", "interpreter"):
            for tma in (True, False):
                for variant in ("default", "softcap", "bias", "fp32"):
                    cfg = tuning.CONFIGS[(kernel, family, tma, variant)]
                    assert cfg.block_n * cfg.block_v <= 128 * 256 and cfg.num_stages >= 1
    assert tuning.variant_of(torch.float32, True) == "fp32"
    assert tuning.variant_of(torch.bfloat16, True) == "softcap"
    calls = []
    monkeypatch.setenv("FASTRL_AUTOTUNE", "1")
    cfg = tuning.config_for("stats", torch.device("cpu"), H=64, V=1000, dtype=torch.bfloat16, use_tma=True,
                            launch=calls.append)
    assert cfg == tuning.CONFIGS[("stats", "interpreter", True, "default")] and not calls  # never under the interpreter


@pytest.mark.slow
def test_sass_check_passes_for_sm90():
    """``python -m bench sass``: every checked kernel compiles for sm_90 without spills and with HGMMA."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "bench", "sass"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for kernel in ("stats", "grad", "fold", "grad_tile", "div_stats", "div_jsd", "div_grad", "sm90_stats", "sm90_grad",
                   "sm90_exp_grad", "sm90_div_stats", "sm90_div_jsd", "sm90_div_grad", "kept_logits",
                   "kept_grad_dh", "kept_segment_dw"):
        assert f"\n{kernel} " in r.stdout
    assert "FAIL" not in r.stdout and "OK: no spills" in r.stdout
