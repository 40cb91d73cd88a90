"""fused_divergence against float64 materialised divergences (autograd gradients), against TRL 1.16's own
``_chunked_divergence_loss``, over kept sets, and on bad input.

The rule (Cut Cross-Entropy's): the fast path's error against float64 must be no worse than PyTorch's own
materialised computation at the same input dtype, plus a small per-dtype tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch

import fastrl
from fastrl import KeptSet
from fastrl.ops import budget, divergence_stats, divergence_torch
from fastrl.reference import divergence_reference

BETAS = (0.0, 0.3, 0.5, 1.0)
# "out": absolute on divergences/entropies; "grad": relative to the largest gradient entry. 2-byte gradients are
# returned in the input dtype: one rounding (2^-8, 2^-11) is the floor there.
TOLERANCES = {
    torch.float32: dict(out=2e-6, grad=2e-6),
    torch.bfloat16: dict(out=1e-5, grad=2**-8),
    torch.float16: dict(out=1e-5, grad=2**-10),
}
TRANSFORMS = {
    "plain": dict(),
    "all": dict(temperature=0.7, logit_scale=1.3, softcap=6.0, teacher_logit_scale=0.8, teacher_softcap=4.0),
}


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 64 columns: every row walks several vocabulary tiles (the online re-basing); kept-set units of at most
    12 ids and 64-element tiles: many units per token chunk, chunks split (the seams of the kept-set engine)."""
    monkeypatch.setitem(budget.BUDGETS, "kept", {"cpu": budget.TileBudget(elems=64, live=2, cap=12)})
    monkeypatch.setattr(divergence_torch, "VOCAB_TILE", 64)  # the torch backend's fixed vocabulary tile


def make(lead=(37,), H=16, Ht=24, V=300, dtype=torch.float32, bias=True, seed=0, spread=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    s = dict(hidden=torch.randn(*lead, H, generator=g), weight=torch.randn(V, H, generator=g) * (spread * 2 / H**0.5),
             bias=torch.randn(V, generator=g) if bias else None)
    t = dict(teacher_hidden=torch.randn(*lead, Ht, generator=g),
             teacher_weight=torch.randn(V, Ht, generator=g) * (spread * 2 / Ht**0.5),
             teacher_bias=torch.randn(V, generator=g) if bias else None)
    s = {k: None if v is None else v.to(device, dtype).requires_grad_() for k, v in s.items()}
    t = {k: None if v is None else v.to(device, dtype) for k, v in t.items()}
    return s, t


def _params(s):
    return [v for v in s.values() if v is not None]


def _grads(div, ent, a, c, params):
    loss = (div.double() * a).sum() + ((ent.double() * c).sum() if ent is not None else 0.0)
    return torch.autograd.grad(loss, params)


def _err(x, y):
    return (x.double() - y.double()).abs().max().item()


def _rel(x, y):
    return _err(x, y) / max(y.double().abs().max().item(), 1e-30)


def check_against_float64(beta, dtype=torch.float32, lead=(37,), mask=None, support=None, tf="plain", device="cpu",
                          backend=None, host_sync=None, **make_kw):
    s, t = make(lead=lead, dtype=dtype, device=device, **make_kw)
    kw = dict(beta=beta, mask=mask, **TRANSFORMS[tf])
    g = torch.Generator().manual_seed(5)
    a, c = torch.randn(lead, generator=g, dtype=torch.float64), torch.randn(lead, generator=g, dtype=torch.float64)
    a, c = a.to(device), c.to(device)
    div, ent = fastrl.fused_divergence(**s, **t, with_entropy=True, support=support, backend=backend,
                                       host_sync=host_sync, **kw)
    assert div.shape == lead and ent.shape == lead and div.dtype == torch.float32
    g_fast = _grads(div, ent, a, c, _params(s))
    d64, e64 = divergence_reference(**s, **t, support=support, dtype=torch.float64, **kw)
    g64 = _grads(d64, e64, a, c, _params(s))
    dpt, ept = divergence_reference(**s, **t, support=support, **kw)  # PyTorch at the input dtype
    g_pt = _grads(dpt, ept, a, c, _params(s))
    tol = TOLERANCES[dtype]
    for name, fast, ref, pt in (("divergence", div, d64, dpt), ("entropy", ent, e64, ept)):
        e_fast, e_pt = _err(fast, ref), _err(pt, ref)
        assert e_fast <= e_pt + tol["out"], f"{name}: error {e_fast:.2e} vs float64, PyTorch's {e_pt:.2e}"
    # the Triton backends feed a 2-byte G to the gradient GEMMs (as TRL and the log-prob path do): one more rounding
    slack = tol["grad"] * (2 if backend is not None and backend.startswith("triton") and dtype != torch.float32 else 1)
    for name, gf, gr, gp in zip(("hidden", "weight", "bias"), g_fast, g64, g_pt):
        e_fast, e_pt = _rel(gf, gr), _rel(gp, gr)
        assert e_fast <= e_pt + slack, f"grad {name}: rel. error {e_fast:.2e} vs float64, PyTorch's {e_pt:.2e}"
    if mask is not None:
        off = ~mask.bool()
        assert (div[off] == 0).all() and (ent[off] == 0).all()
    return div


@pytest.mark.parametrize("tf", list(TRANSFORMS))
@pytest.mark.parametrize("beta", BETAS)
def test_float32_against_float64(beta, tf, small_tiles):
    check_against_float64(beta, tf=tf)


@pytest.mark.parametrize("beta", BETAS)
def test_float64_is_exact(beta, small_tiles):
    """float64 inputs: the derived gradients (the JSD's included) equal float64 autograd to rounding."""
    s, t = make(dtype=torch.float64, V=200)
    kw = dict(beta=beta, **TRANSFORMS["all"])
    div, ent = fastrl.fused_divergence(**s, **t, with_entropy=True, **kw)
    d64, e64 = divergence_reference(**s, **t, **kw)
    assert div.dtype == torch.float64
    assert _err(div, d64) < 1e-12 and _err(ent, e64) < 1e-12
    a = torch.randn(37, dtype=torch.float64)
    for gf, gr in zip(_grads(div, ent, a, a.flip(0), _params(s)), _grads(d64, e64, a, a.flip(0), _params(s))):
        assert _rel(gf, gr) < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_low_precision_inputs(beta, dtype, small_tiles):
    check_against_float64(beta, dtype=dtype)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_masks_teacher_wider_batched(beta, small_tiles):
    """[B, T] tokens with a mask, a teacher twice as wide as the student, no biases."""
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(3, 11, generator=g) > 0.3
    check_against_float64(beta, lead=(3, 11), mask=mask, H=12, Ht=40, bias=False)
    check_against_float64(beta, lead=(3, 11), mask=mask.long(), H=12, Ht=40, tf="all")


def test_real_vocabulary_size():
    check_against_float64(0.5, lead=(6,), V=32000, H=8, Ht=12, spread=3.0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_masked_tokens_cost_nothing_and_leak_nothing(beta):
    """Masked rows are never computed: inf/nan there changes nothing, gives 0 and exactly zero gradient."""
    s, t = make(lead=(4, 6))
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 2:] = False
    div = fastrl.fused_divergence(**s, **t, beta=beta, mask=mask)
    with torch.no_grad():
        s["hidden"][1, 3] = float("nan")
        t["teacher_hidden"][1, 4] = float("inf")
    div2 = fastrl.fused_divergence(**s, **t, beta=beta, mask=mask)
    assert torch.equal(div, div2) and (div2[1, 2:] == 0).all()
    div2.sum().backward()
    assert (s["hidden"].grad[1, 2:] == 0).all() and torch.isfinite(s["weight"].grad).all()


def test_properties():
    s, t = make(V=200)
    # a constant added to every logit of a model (a bias shift) changes nothing
    base = fastrl.fused_divergence(**s, **t, beta=0.5)
    with torch.no_grad():
        shifted = fastrl.fused_divergence(**{**s, "bias": s["bias"] + 7.0}, **t, beta=0.5)
    assert _err(base, shifted) < 1e-5
    # a model against itself: 0 for every beta; divergences are never negative beyond rounding
    for beta in BETAS:
        same = fastrl.fused_divergence(s["hidden"], s["weight"], s["hidden"].detach(), s["weight"].detach(),
                                       bias=s["bias"], teacher_bias=s["bias"].detach(), beta=beta)
        assert same.abs().max() < 1e-5
        assert fastrl.fused_divergence(**s, **t, beta=beta).min() > -1e-6
    # extreme logits stay finite
    big = {**s, "weight": s["weight"] * 300}
    assert torch.isfinite(fastrl.fused_divergence(**big, **t, beta=0.5, with_entropy=True)[1]).all()


def test_no_grad_path_equals_the_autograd_path():
    s, t = make()
    with_grad = fastrl.fused_divergence(**s, **t, beta=0.3, with_entropy=True)
    with torch.no_grad():
        without = fastrl.fused_divergence(**s, **t, beta=0.3, with_entropy=True)
    assert torch.equal(with_grad[0], without[0]) and torch.equal(with_grad[1], without[1])


def test_teacher_gets_no_gradient():
    s, t = make()
    t = {k: v.requires_grad_() for k, v in t.items()}
    fastrl.fused_divergence(**s, **t, beta=0.5).sum().backward()
    assert all(v.grad is None for v in t.values()) and s["weight"].grad is not None


def test_frozen_student_weight_and_entropy_only_gradient(small_tiles):
    s, t = make()
    s["weight"].requires_grad_(False)
    div, ent = fastrl.fused_divergence(**s, **t, beta=1.0, with_entropy=True)
    gh, gb = torch.autograd.grad(ent.sum(), [s["hidden"], s["bias"]])
    d64, e64 = divergence_reference(**s, **t, beta=1.0, dtype=torch.float64)
    rh, rb = torch.autograd.grad(e64.sum(), [s["hidden"], s["bias"]])
    assert _rel(gh, rh) < 1e-5 and _rel(gb, rb) < 1e-5


# ------------------------------------------------------------------------------------------- kept sets


def _support(lead, V, frac=0.05, seed=4, mask=None):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(*lead, V, generator=g) < frac
    keep[..., 0] = True  # never empty
    if mask is not None:
        keep[~mask.bool()] = False  # masked tokens may keep nothing
    return KeptSet.from_mask(keep)


@pytest.mark.parametrize("host_sync", (None, False))
@pytest.mark.parametrize("beta", BETAS)
def test_support_against_float64(beta, host_sync, small_tiles):
    """The kept-set engine's host plan (eager) and fixed plan (host_sync=False: masked rows computed, no host read)."""
    mask = torch.rand(3, 11, generator=torch.Generator().manual_seed(2)) > 0.2
    check_against_float64(beta, lead=(3, 11), mask=mask, support=_support((3, 11), 300, mask=mask), tf="all",
                          host_sync=host_sync)


def test_support_bf16_weight_gradient_touches_kept_rows_only(small_tiles):
    s, t = make(dtype=torch.bfloat16)
    sup = _support((37,), 300, frac=0.02)
    check_against_float64(0.5, dtype=torch.bfloat16, support=sup)
    fastrl.fused_divergence(**s, **t, beta=0.5, support=sup).sum().backward()
    untouched = ~sup.to_mask().any(0)
    assert untouched.any() and (s["weight"].grad[untouched] == 0).all() and (s["bias"].grad[untouched] == 0).all()


def test_full_support_is_the_plain_divergence():
    s, t = make(V=100)
    full = KeptSet.from_mask(torch.ones(37, 100, dtype=torch.bool))
    for beta in (0.0, 0.5, 1.0):
        a = fastrl.fused_divergence(**s, **t, beta=beta)
        b = fastrl.fused_divergence(**s, **t, beta=beta, support=full)
        assert _err(a, b) < 1e-5


# ------------------------------------------------------------------------------------------ TRL itself


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_matches_trl_chunked_divergence_loss(beta):
    """TRL 1.16's own function on the same float32 inputs: its loss (mean over the mask) and student gradients."""
    trl_dt = pytest.importorskip("trl.trainer.distillation_trainer")
    s, t = make(lead=(3, 7), H=16, Ht=20, V=250)
    mask = torch.rand(3, 7, generator=torch.Generator().manual_seed(1)) > 0.25
    tf = dict(temperature=0.8, softcap=5.0, teacher_softcap=7.0, logit_scale=1.2, teacher_logit_scale=0.9)
    loss_trl, ent_sum, n = trl_dt._chunked_divergence_loss(
        s["hidden"], t["teacher_hidden"], s["weight"], t["teacher_weight"], mask.long(), beta,
        student_lm_head_bias=s["bias"], teacher_lm_head_bias=t["teacher_bias"], student_logit_scale=1.2,
        teacher_logit_scale=0.9, student_final_logit_softcapping=5.0, teacher_final_logit_softcapping=7.0,
        temperature=0.8)
    g_trl = torch.autograd.grad(loss_trl, _params(s))
    div, ent = fastrl.fused_divergence(**s, **t, beta=beta, mask=mask, with_entropy=True, **tf)
    loss = div.sum() / mask.sum()
    g = torch.autograd.grad(loss, _params(s))
    assert abs(loss.item() - loss_trl.item()) <= 2e-6 * max(1.0, abs(loss_trl.item()))
    assert abs(ent.sum().item() - ent_sum.item()) <= 1e-5 * abs(ent_sum.item())
    for a, b in zip(g, g_trl):
        assert _rel(a, b) < 1e-5


# ------------------------------------------------------------------------------------------- bad input


def _call(**over):
    s, t = make(lead=(2, 5), V=50)
    kw = {**s, **t, "beta": 0.5}
    kw.update(over)
    return fastrl.fused_divergence(**kw)


@pytest.mark.parametrize("over, exc, msg", [
    (dict(teacher_weight=torch.randn(51, 24)), ValueError, r"vocabularies differ: weight has V = 50 rows, "
                                                           r"teacher_weight 51"),
    (dict(beta=1.5), ValueError, r"beta must be in \[0.0, 1.0\], got 1.5"),
    (dict(beta=-0.1), ValueError, r"beta must be in"),
    (dict(beta=float("nan")), ValueError, r"beta must be a finite number"),
    (dict(beta=True), ValueError, r"beta must be a finite number"),
    (dict(temperature=0.0), ValueError, r"temperature must be a finite number > 0, got 0.0"),
    (dict(temperature=-1.0), ValueError, r"temperature must be a finite number > 0"),
    (dict(teacher_logit_scale=0), ValueError, r"teacher_logit_scale must be a finite number > 0"),
    (dict(teacher_softcap=-2.0), ValueError, r"teacher_softcap must be None or a finite number > 0"),
    (dict(teacher_hidden=torch.randn(2, 4, 24)), ValueError, r"teacher_hidden must have hidden's leading shape "
                                                             r"\(2, 5\), got \(2, 4\)"),
    (dict(teacher_weight=torch.randn(50, 23)), ValueError, r"teacher_weight must be \[V, H\] with H = "
                                                           r"teacher_hidden.shape\[-1\] = 24"),
    (dict(teacher_bias=torch.randn(49)), ValueError, r"teacher_bias must be \[V\] = \[50\]"),
    (dict(teacher_hidden=torch.randn(2, 5, 24).double()), TypeError, r"teacher_weight and teacher_hidden must "
                                                                     r"share a dtype"),
    (dict(weight=torch.randn(50, 16).half()), TypeError, r"weight and hidden must share a dtype"),
    (dict(teacher_hidden=torch.randint(0, 3, (2, 5, 24))), TypeError, r"teacher_hidden must be float32"),
    (dict(teacher_hidden=[1.0]), TypeError, r"teacher_hidden must be a torch.Tensor, got list"),
    (dict(mask=torch.ones(2, 4)), ValueError, r"mask must have hidden's leading shape \(2, 5\), got \(2, 4\)"),
    (dict(mask=torch.full((2, 5), 0.5)), ValueError, r"mask must be bool or hold only 0 and 1, got 0.5 at "
                                                     r"position \(0, 0\)"),
    (dict(mask=[1]), TypeError, r"mask must be a torch.Tensor or None, got list"),
    (dict(support=torch.ones(2, 5, 50, dtype=torch.bool)), TypeError, r"support must be a fastrl.KeptSet"),
    (dict(support=KeptSet.from_mask(torch.ones(10, 40, dtype=torch.bool))), ValueError,
     r"support has vocab_size 40, the heads have V = 50"),
    (dict(support=KeptSet.from_mask(torch.ones(9, 50, dtype=torch.bool))), ValueError,
     r"support has 9 tokens, expected one per token"),
    (dict(backend="cuda"), ValueError, r"backend must be one of"),
    (dict(with_entropy=1), TypeError, r"with_entropy must be a bool, got int"),
    (dict(teacher_hidden=torch.randn(2, 5, 24).double(), teacher_weight=torch.randn(50, 24).double(),
          teacher_bias=None, backend="triton"), TypeError, r"the triton backends compute from float32"),
])
def test_bad_input_is_named(over, exc, msg):
    with pytest.raises(exc, match=msg):
        _call(**over)


def test_empty_kept_set_at_a_counted_token_is_named():
    keep = torch.ones(2, 5, 50, dtype=torch.bool)
    keep[1, 3] = False
    with pytest.raises(ValueError, match=r"support is empty at counted token \(1, 3\)"):
        _call(support=KeptSet.from_mask(keep))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3] = False
    _call(support=KeptSet.from_mask(keep), mask=mask)  # masked: fine


def test_non_finite_inputs_are_named_by_token():
    s, t = make(lead=(2, 5), V=50)
    with torch.no_grad():
        t["teacher_hidden"][1, 2, 3] = float("nan")
    with pytest.raises(FloatingPointError, match=r"non-finite divergence at token \(1, 2\).*teacher_hidden holds "
                                                  r"inf/nan there.*check_finite=False"):
        fastrl.fused_divergence(**s, **t, beta=0.5)
    div = fastrl.fused_divergence(**s, **t, beta=0.5, check_finite=False)
    assert torch.isnan(div[1, 2]) and torch.isfinite(div[0]).all()
    s, t = make(lead=(2, 5), V=50)
    with torch.no_grad():
        s["weight"][7, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"token \(0, 0\).*weight, teacher_weight or a bias holds inf/nan"):
        fastrl.fused_divergence(**s, **t, beta=1.0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_and_fully_masked_inputs(backend):
    s, t = make(lead=(2, 5), V=50)
    div, ent = fastrl.fused_divergence(**s, **t, mask=torch.zeros(2, 5, dtype=torch.bool), with_entropy=True,
                                       backend=backend)
    assert (div == 0).all() and (ent == 0).all()
    div.sum().backward()
    assert (s["hidden"].grad == 0).all() and (s["weight"].grad == 0).all() and (s["bias"].grad == 0).all()
    s, t = make(lead=(0,), V=50)
    assert fastrl.fused_divergence(**s, **t, backend=backend).shape == (0,)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_views_are_honoured(backend):
    """Transposed weights, every-other-row hidden states, a bias that is a column of a matrix: the same numbers."""
    s, t = make(lead=(9,), V=70)
    want = fastrl.fused_divergence(**s, **t, beta=0.5, backend=backend)
    g_want = torch.autograd.grad(want.sum(), [s["hidden"], s["weight"], s["bias"]])
    tall = torch.zeros(18, 16)
    tall[::2] = s["hidden"].detach()
    h = tall[::2].requires_grad_()
    w = s["weight"].detach().T.contiguous().T.requires_grad_()
    col = torch.zeros(70, 3)
    col[:, 1] = s["bias"].detach()
    b = col[:, 1].requires_grad_()
    tw = t["teacher_weight"].T.contiguous().T
    got = fastrl.fused_divergence(h, w, t["teacher_hidden"], tw, bias=b, teacher_bias=t["teacher_bias"], beta=0.5,
                                  backend=backend)
    assert _err(got, want) < 1e-6
    for a, c in zip(torch.autograd.grad(got.sum(), [h, w, b]), g_want):
        assert _rel(a, c) < 1e-6


# ----------------------------------------------------------------------------- the Triton (hybrid) backend


@pytest.fixture
def small_hybrid_tiles(monkeypatch):
    """Slices of 256 columns read in blocks of 128, 16-token chunks: every loop of the kernels and of the
    orchestration runs more than once, the last slice and block ragged (V=300), the backward's rows chunked."""
    from fastrl.kernels import divergence_fold as K
    from fastrl.ops import divergence_hybrid, hybrid

    monkeypatch.setattr(divergence_hybrid, "COLUMNS", 256)
    monkeypatch.setattr(K, "BLOCK_C", 128)
    monkeypatch.setattr(hybrid, "ROWS", 16)
    monkeypatch.setattr(hybrid, "MAX_ROWS", 16)


@pytest.mark.parametrize("beta, dtype", [(0.0, torch.float32), (0.5, torch.float32), (1.0, torch.float32),
                                         (0.5, torch.bfloat16)], ids=["b0-f32", "b0.5-f32", "b1-f32", "b0.5-bf16"])
@pytest.mark.parametrize("backend", ["triton"])
def test_triton_backend_against_float64(backend, beta, dtype, small_hybrid_tiles):
    N = 26  # 16-token chunks: two, the second ragged, after the 20% masked are dropped
    s, t = make(lead=(N,), dtype=dtype)
    kw = dict(beta=beta, **TRANSFORMS["all"])
    g = torch.Generator().manual_seed(5)
    a, c = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    mask = torch.rand(N, generator=g) > 0.2
    div, ent = fastrl.fused_divergence(**s, **t, with_entropy=True, backend=backend, mask=mask, **kw)
    d64, e64 = divergence_reference(**s, **t, dtype=torch.float64, mask=mask, **kw)
    dpt, ept = divergence_reference(**s, **t, mask=mask, **kw)
    tol = TOLERANCES[dtype]
    for name, fast, ref, pt in (("divergence", div, d64, dpt), ("entropy", ent, e64, ept)):
        assert _err(fast, ref) <= _err(pt, ref) + tol["out"], name
    g_fast, g64, g_pt = (_grads(x, y, a, c, _params(s)) for x, y in ((div, ent), (d64, e64), (dpt, ept)))
    for name, gf, gr, gp in zip(("hidden", "weight", "bias"), g_fast, g64, g_pt):
        # a 2-byte G feeds the gradient GEMMs (as TRL's and the log-prob path's): one more rounding than torch's
        slack = tol["grad"] * (2 if dtype != torch.float32 else 1)
        assert _rel(gf, gr) <= _rel(gp, gr) + slack, f"grad {name}: {_rel(gf, gr):.2e} vs PyTorch's {_rel(gp, gr):.2e}"
    with torch.no_grad():
        assert torch.equal(fastrl.fused_divergence(**s, **t, backend=backend, mask=mask, **kw), div)
    from fastrl.kernels import divergence_fold as K

    assert (K.FORWARD_KL, K.REVERSE_KL, K.JSD) == (divergence_stats.FORWARD_KL, divergence_stats.REVERSE_KL,
                                                   divergence_stats.JSD)  # the kernels' MODE literals


# ------------------------------------------------------------------------- compiled kernels on a GPU

needs_compiled_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device and compiled Triton kernels (TRITON_INTERPRET not 1)",
)


@needs_compiled_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("shape", [(47, 31, 57, 123), (256, 896, 1536, 151936)], ids=str)
def test_divergence_cuda(shape, beta, dtype):
    """The compiled hybrid kernels (the CUDA default) against float64: awkward and real shapes, every dtype."""
    N, H, Ht, V = shape
    mask = torch.rand(N, generator=torch.Generator().manual_seed(0)) > 0.1
    check_against_float64(beta, dtype=dtype, lead=(N,), mask=mask.cuda(), tf="all", device="cuda", backend="triton",
                          H=H, Ht=Ht, V=V)


@needs_compiled_cuda
def test_divergence_cuda_support_and_torch_backend():
    mask = torch.ones(3, 11, dtype=torch.bool)
    sup = _support((3, 11), 5000, frac=0.01).to("cuda")
    check_against_float64(0.5, lead=(3, 11), mask=mask.cuda(), support=sup, device="cuda", backend="triton", V=5000)
    check_against_float64(1.0, dtype=torch.bfloat16, lead=(3, 11), device="cuda", backend="torch", V=5000)
