"""fused_logprobs against float64 ground truth, on both CPU backends (torch, Triton interpreted).

The rule (Cut Cross-Entropy's): the fast path's error against float64 must be no worse than PyTorch's
own materialised computation at the same input dtype, plus a small per-dtype tolerance.
"""

import pytest
import torch

import fastrl
from fastrl.reference import logprobs_reference

from conftest import KERNEL_BACKENDS as CPU_BACKENDS

# Additive slack over PyTorch's own error, per input dtype: "out" absolute on log-probs/entropies,
# "grad" relative to the largest gradient entry. bf16/fp16 gradients are returned in the input dtype,
# so one rounding of the output (2^-8, 2^-11) is the floor there.
TOLERANCES = {
    torch.float32: dict(out=1e-6, grad=1e-6),
    torch.bfloat16: dict(out=1e-5, grad=2**-8),
    torch.float16: dict(out=1e-5, grad=2**-10),
}


def make_inputs(N, H, V, dtype, bias=True, scale=3.0, seed=0, lead=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (scale / H**0.5)
    b = torch.randn(V, generator=g) if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    if lead is not None:
        hidden, targets = hidden.reshape(*lead, H), targets.reshape(lead)
    ins = [hidden.to(device, dtype).requires_grad_(), weight.to(device, dtype).requires_grad_()]
    ins.append(b.to(device, dtype).requires_grad_() if bias else None)
    return ins[0], ins[1], ins[2], targets.to(device)


def loss_weights(shape, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape, generator=g, dtype=torch.float64)
    c = torch.randn(shape, generator=g, dtype=torch.float64)
    return a.to(device), c.to(device)


def grads(logp, ent, a, c, params):
    loss = (logp.double() * a).sum() + (ent.double() * c).sum()
    return torch.autograd.grad(loss, params)


def max_err(x, y):
    return (x.double() - y.double()).abs().max().item()


def rel_err(x, y):
    return max_err(x, y) / max(y.double().abs().max().item(), 1e-30)


def check_against_float64(backend, dtype, N, H, V, bias=True, lead=None, device="cpu", **tf):
    hidden, weight, b, targets = make_inputs(N, H, V, dtype, bias=bias, lead=lead, device=device)
    params = [p for p in (hidden, weight, b) if p is not None]
    a, c = loss_weights(targets.shape, device=device)

    logp, ent = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend, **tf)
    assert logp.shape == targets.shape and ent.shape == targets.shape
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    g_fast = grads(logp, ent, a, c, params)

    lp64, en64 = logprobs_reference(hidden, weight, targets, bias=b, dtype=torch.float64, **tf)
    g64 = grads(lp64, en64, a, c, params)
    lpt, ent_t = logprobs_reference(hidden, weight, targets, bias=b, **tf)  # PyTorch at the input dtype
    g_torch = grads(lpt, ent_t, a, c, params)

    tol = TOLERANCES[dtype]
    for name, fast, ref, torch_ in (("logp", logp, lp64, lpt), ("entropy", ent, en64, ent_t)):
        e_fast, e_torch = max_err(fast, ref), max_err(torch_, ref)
        assert e_fast <= e_torch + tol["out"], (
            f"{name}: fastrl error {e_fast:.3e} vs float64 exceeds PyTorch's own {e_torch:.3e} + {tol['out']:.0e}"
        )
    for name, gf, gr, gt in zip(("hidden", "weight", "bias"), g_fast, g64, g_torch):
        e_fast, e_torch = rel_err(gf, gr), rel_err(gt, gr)
        assert e_fast <= e_torch + tol["grad"], (
            f"grad {name}: fastrl relative error {e_fast:.3e} exceeds PyTorch's own {e_torch:.3e} + {tol['grad']:.0e}"
        )
    # an absolute cap too: "no worse than PyTorch" alone would pass a kernel that rounds its logits to the input
    # dtype, as PyTorch does (that costs 4e-3 to 8e-2 nats here; fastrl's float32 logits about 1e-6)
    if dtype in (torch.bfloat16, torch.float16):
        assert max_err(logp, lp64) < 1e-3, f"{dtype} log-probs {max_err(logp, lp64):.2e} from float64 (limit 1e-3)"
    return logp, ent


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_awkward_shape(backend, dtype, bias):
    check_against_float64(backend, dtype, 47, 31, 123, bias=bias)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "tf",
    [dict(temperature=0.7), dict(temperature=1.6), dict(softcap=5.0), dict(logit_scale=0.5),
     dict(softcap=3.0, logit_scale=1.7, temperature=0.9)],
    ids=["T0.7", "T1.6", "softcap", "scale", "all"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transforms(backend, tf, dtype):
    check_against_float64(backend, dtype, 47, 31, 123, **tf)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_batched_leading_shape(backend):
    logp, ent = check_against_float64(backend, torch.float32, 21, 40, 300, lead=(3, 7))
    assert logp.shape == (3, 7)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_real_vocabulary(backend, dtype):
    check_against_float64(backend, dtype, 16, 64, 32000)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_several_backward_slices(backend):
    """The backward walks the vocabulary in slices; a narrow slice width exercises the seams."""
    hidden, weight, b, targets = make_inputs(40, 24, 700, torch.float32)
    a, c = loss_weights(targets.shape)
    params = [hidden, weight, b]
    ref = grads(*logprobs_reference(hidden, weight, targets, bias=b, dtype=torch.float64), a, c, params)
    for chunk in (128, 256, 700):
        lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend, vocab_chunk=chunk)
        for g, r in zip(grads(lp, en, a, c, params), ref):
            assert rel_err(g, r) < 5e-6, f"vocab_chunk={chunk}"


@pytest.mark.interpreter
def test_triton_vocab_splits_merge():
    """The forward kernel splits the vocabulary across programs on a GPU; the merge must be exact."""
    from fastrl.kernels.linear_logprob import linear_stats

    hidden, weight, b, targets = make_inputs(33, 20, 1000, torch.float32)
    with torch.no_grad():
        one = linear_stats(hidden, weight, b, targets, logit_scale=1.0, softcap=None, temperature=1.0,
                           with_entropy=True, splits=1)
        for splits in (2, 3, 8):
            many = linear_stats(hidden, weight, b, targets, logit_scale=1.0, softcap=None, temperature=1.0,
                                with_entropy=True, splits=splits)
            for x, y in zip(one, many):
                assert max_err(x, y) < 1e-5, f"splits={splits}"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_float64_inputs_match_reference_tightly(backend):
    if backend.startswith("triton"):
        hidden, weight, b, targets = make_inputs(8, 16, 50, torch.float64)
        with pytest.raises(TypeError, match="float64"):
            fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend)
        return
    hidden, weight, b, targets = make_inputs(47, 31, 123, torch.float64)
    lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend, vocab_chunk=50)
    lp64, en64 = logprobs_reference(hidden, weight, targets, bias=b)
    assert lp.dtype == torch.float64
    assert max_err(lp, lp64) < 1e-12 and max_err(en, en64) < 1e-12


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ignored_targets(backend):
    hidden, weight, b, targets = make_inputs(30, 16, 200, torch.float32)
    targets[[0, 7, 29]] = -100
    a, c = loss_weights(targets.shape)
    lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend)
    assert torch.equal(lp[[0, 7, 29]], torch.zeros(3)) and torch.equal(en[[0, 7, 29]], torch.zeros(3))
    gh, gw, gb = grads(lp, en, a, c, [hidden, weight, b])
    assert torch.equal(gh[[0, 7, 29]], torch.zeros(3, 16)), "ignored tokens must get exactly zero gradient"
    # the weight gradient is the same as if the ignored tokens were not there at all
    keep = targets != -100
    h2 = hidden.detach()[keep].requires_grad_()
    lp2, en2 = fastrl.fused_logprobs(h2, weight, targets[keep], bias=b, backend=backend)
    _, gw2, gb2 = grads(lp2, en2, a[keep], c[keep], [h2, weight, b])
    assert rel_err(gw, gw2) < 1e-5 and rel_err(gb, gb2) < 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_custom_ignore_index(backend):
    hidden, weight, b, targets = make_inputs(10, 16, 50, torch.float32)
    targets[3] = 7777
    lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend, ignore_index=7777)
    assert lp[3] == 0 and en[3] == 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_shift_invariance(backend):
    """Adding a constant to every logit (here through the bias) changes nothing."""
    hidden, weight, b, targets = make_inputs(20, 16, 300, torch.float32)
    with torch.no_grad():
        lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend)
        lp2, en2 = fastrl.fused_logprobs(hidden, weight, targets, bias=b + 1000.0, backend=backend)
    assert max_err(lp, lp2) < 1e-4 and max_err(en, en2) < 1e-4


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_extreme_logits_stay_finite(backend):
    hidden, weight, b, targets = make_inputs(20, 16, 300, torch.float32, scale=3000.0)
    a, c = loss_weights(targets.shape)
    lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend)
    g = grads(lp, en, a, c, [hidden, weight, b])
    assert torch.isfinite(lp).all() and torch.isfinite(en).all() and all(torch.isfinite(x).all() for x in g)
    lp64, en64 = logprobs_reference(hidden, weight, targets, bias=b, dtype=torch.float64)
    lpt, ent = logprobs_reference(hidden, weight, targets, bias=b)  # PyTorch's own float32 computation
    # logits near 1e4 carry float32 rounding of their own (~1e-3): allow PyTorch's error plus one ulp there
    ulp = 2.0**-23 * lp64.abs().max().item()
    assert max_err(lp, lp64) <= max_err(lpt, lp64) + ulp
    assert max_err(en, en64) <= max_err(ent, en64) + 1e-6
    assert (en >= -1e-3).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_only_logp_gradient_and_without_entropy(backend):
    hidden, weight, b, targets = make_inputs(25, 16, 150, torch.float32)
    a, _ = loss_weights(targets.shape)
    lp, ent = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend, with_entropy=False)
    assert ent is None
    g = torch.autograd.grad((lp.double() * a).sum(), [hidden, weight, b])
    lp64, _ = logprobs_reference(hidden, weight, targets, bias=b, dtype=torch.float64)
    g64 = torch.autograd.grad((lp64 * a).sum(), [hidden, weight, b])
    assert all(rel_err(x, y) < 5e-6 for x, y in zip(g, g64))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_only_entropy_gradient(backend):
    hidden, weight, b, targets = make_inputs(25, 16, 150, torch.float32)
    _, c = loss_weights(targets.shape)
    _, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend)
    g = torch.autograd.grad((en.double() * c).sum(), [hidden, weight, b])
    _, en64 = logprobs_reference(hidden, weight, targets, bias=b, dtype=torch.float64)
    g64 = torch.autograd.grad((en64 * c).sum(), [hidden, weight, b])
    assert all(rel_err(x, y) < 5e-6 for x, y in zip(g, g64))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_forward_only_keeps_no_autograd_state(backend):
    hidden, weight, b, targets = make_inputs(10, 16, 100, torch.float32)
    with torch.no_grad():
        lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend)
    assert lp.grad_fn is None and en.grad_fn is None and not lp.requires_grad
    lp2, _ = fastrl.fused_logprobs(hidden.detach(), weight.detach(), targets, bias=b.detach(), backend=backend)
    assert lp2.grad_fn is None
    assert torch.equal(lp, lp2)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_frozen_head_runs_no_weight_gradient_gemm(backend, monkeypatch):
    """LoRA-style frozen LM head: only hidden needs grad, and no [V_blk, H] weight-gradient GEMM runs."""
    hidden, weight, _, targets = make_inputs(12, 16, 300, torch.float32, bias=False)
    weight = weight.detach()
    calls = []
    real_mm = torch.mm

    def spy(a, b, *args, **kw):
        out = real_mm(a, b, *args, **kw)
        calls.append(tuple(out.shape))
        return out

    def weight_gemms():
        return [s for s in calls if s[1] == 16 and s[0] in (128, 300 - 256)]

    monkeypatch.setattr(torch, "mm", spy)
    # positive control: with a trainable head the spy does see the weight-gradient GEMMs
    w_trainable = weight.clone().requires_grad_()
    lp, en = fastrl.fused_logprobs(hidden, w_trainable, targets, backend=backend, vocab_chunk=128)
    torch.autograd.grad((lp + en).sum(), [hidden, w_trainable])
    assert len(weight_gemms()) == 3, f"expected one weight-gradient GEMM per vocabulary slice, saw {calls}"
    calls.clear()
    lp, en = fastrl.fused_logprobs(hidden, weight, targets, backend=backend, vocab_chunk=128)
    (gh,) = torch.autograd.grad((lp + en).sum(), [hidden])
    monkeypatch.setattr(torch, "mm", real_mm)
    assert weight.grad is None
    assert not weight_gemms(), f"weight-gradient GEMM ran: {calls}"
    lp64, en64 = logprobs_reference(hidden, weight, targets, dtype=torch.float64)
    (g64,) = torch.autograd.grad((lp64 + en64).sum(), [hidden])
    assert rel_err(gh, g64) < 5e-6


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_batch(backend):
    hidden, weight, b, _ = make_inputs(4, 16, 50, torch.float32)
    h0 = hidden.detach()[:0].requires_grad_()
    lp, en = fastrl.fused_logprobs(h0, weight, torch.zeros(0, dtype=torch.long), bias=b, backend=backend)
    assert lp.shape == (0,) and en.shape == (0,)
    gh, gw, gb = torch.autograd.grad((lp.sum() + en.sum()), [h0, weight, b])
    assert gh.shape == (0, 16) and torch.equal(gw, torch.zeros_like(gw)) and torch.equal(gb, torch.zeros_like(gb))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fully_masked_batch(backend):
    hidden, weight, b, targets = make_inputs(6, 16, 50, torch.float32)
    targets[:] = -100
    lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend)
    assert torch.equal(lp, torch.zeros(6)) and torch.equal(en, torch.zeros(6))
    for g in torch.autograd.grad(lp.sum() + en.sum(), [hidden, weight, b]):
        assert torch.equal(g, torch.zeros_like(g))


# ---------------------------------------------------------------- bad input


def _inputs():
    return make_inputs(6, 8, 20, torch.float32)


def test_bad_shapes():
    hidden, weight, b, targets = _inputs()
    with pytest.raises(ValueError, match=r"weight must be \[V, H\] with H = hidden.shape\[-1\] = 8.*\(20, 9\)"):
        fastrl.fused_logprobs(hidden, torch.randn(20, 9), targets)
    with pytest.raises(ValueError, match=r"targets must have hidden's leading shape \(6,\), got \(5,\)"):
        fastrl.fused_logprobs(hidden, weight, targets[:5])
    with pytest.raises(ValueError, match=r"bias must be \[V\] = \[20\], got shape \(19,\)"):
        fastrl.fused_logprobs(hidden, weight, targets, bias=b[:19])
    with pytest.raises(ValueError, match=r"hidden must be \[N, H\] or \[B, T, H\]"):
        fastrl.fused_logprobs(hidden[0], weight, targets[0])


def test_bad_dtypes():
    hidden, weight, b, targets = _inputs()
    with pytest.raises(TypeError, match="targets must be int32 or int64"):
        fastrl.fused_logprobs(hidden, weight, targets.float())
    with pytest.raises(TypeError, match="share a dtype.*float32.*bfloat16"):
        fastrl.fused_logprobs(hidden, weight.bfloat16(), targets)
    with pytest.raises(TypeError, match="bias must have hidden's dtype"):
        fastrl.fused_logprobs(hidden, weight, targets, bias=b.double())


def test_device_mismatch():
    hidden, weight, _, targets = _inputs()
    with pytest.raises(ValueError, match="one device.*meta"):
        fastrl.fused_logprobs(hidden, weight.to("meta"), targets)


@pytest.mark.parametrize("bad", [20, -1, 10**6])
def test_target_out_of_range_names_position(bad):
    hidden, weight, _, targets = _inputs()
    targets[4] = bad
    with pytest.raises(ValueError, match=rf"position \(4,\): got {bad}, expected an id in \[0, 20\)"):
        fastrl.fused_logprobs(hidden, weight, targets)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_finite_hidden_is_reported(backend):
    hidden, weight, _, targets = make_inputs(12, 8, 40, torch.float32, lead=(3, 4))
    with torch.no_grad():
        hidden[1, 2, 5] = float("nan")
    with pytest.raises(FloatingPointError, match=r"token \(1, 2\).*hidden\[1, 2\] holds inf/nan"):
        fastrl.fused_logprobs(hidden, weight, targets, backend=backend)
    lp, _ = fastrl.fused_logprobs(hidden, weight, targets, backend=backend, check_finite=False)
    assert torch.isnan(lp[1, 2])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_finite_weight_is_reported(backend):
    hidden, weight, _, targets = _inputs()
    with torch.no_grad():
        weight[3, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"token \(\d+,\).*weight \(or bias\) holds inf/nan"):
        fastrl.fused_logprobs(hidden, weight, targets, backend=backend)


def test_non_finite_on_ignored_token_is_not_an_error():
    hidden, weight, _, targets = _inputs()
    with torch.no_grad():
        hidden[2, 0] = float("inf")
    targets[2] = -100
    lp, en = fastrl.fused_logprobs(hidden, weight, targets)
    assert lp[2] == 0 and torch.isfinite(lp).all()


@pytest.mark.parametrize(
    "kw, match",
    [(dict(temperature=0.0), "temperature must be a finite number > 0, got 0.0"),
     (dict(temperature=float("nan")), "temperature"),
     (dict(logit_scale=-1.0), "logit_scale must be a finite number > 0, got -1.0"),
     (dict(softcap=0.0), "softcap must be None or a finite number > 0, got 0.0"),
     (dict(vocab_chunk=0), "vocab_chunk must be None or a positive int, got 0"),
     (dict(backend="cuda"), "backend must be one of")],
)
def test_bad_options(kw, match):
    hidden, weight, _, targets = _inputs()
    with pytest.raises(ValueError, match=match):
        fastrl.fused_logprobs(hidden, weight, targets, **kw)


@pytest.mark.interpreter
def test_backend_env_override(monkeypatch):
    from fastrl.ops.backend import resolve_backend

    assert resolve_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    assert resolve_backend(torch.device("cpu")) == "triton-hybrid"  # what current CUDA installs run
    monkeypatch.setenv("FASTRL_BACKEND", "triton-fused")
    assert resolve_backend(torch.device("cpu")) == "triton-fused"
    monkeypatch.setenv("FASTRL_BACKEND", "nope")
    with pytest.raises(ValueError, match="FASTRL_BACKEND"):
        resolve_backend(torch.device("cpu"))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_autocast_casts_inputs_but_never_rounds_logits(backend, hidden_dtype):
    """Under autocast the LM-head inputs are cast to bf16 (as autocast would for the matmul), but the
    logits, statistics and gradient GEMMs stay float32: log-probs within 2e-3 of float64 on the cast inputs,
    where autocast's own materialised bf16 logits are off by far more."""
    hidden, weight, b, targets = make_inputs(40, 64, 3000, torch.float32)
    hidden = hidden.detach().to(hidden_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=backend)
        (lp.sum() + en.sum()).backward()
    assert lp.dtype == torch.float32
    assert weight.grad is not None and weight.grad.dtype == torch.float32 and hidden.grad.dtype == hidden_dtype
    cast = [x.detach().bfloat16() for x in (hidden, weight, b)]
    lp64, en64 = logprobs_reference(*cast[:2], targets, bias=cast[2], dtype=torch.float64)
    assert max_err(lp, lp64) < 2e-3 and max_err(en, en64) < 2e-3
