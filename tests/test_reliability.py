"""Reliability of the public ops on bad or unusual input (issue 11): strided views of every tensor argument,
target dtypes, float64 under autocast, checks of the loss inputs (non-finite values, num_items_in_batch, mask
values, devices), and a second backward through the one-pass loss.

Each test here failed before the fix it covers: the strided-bias case differed from the contiguous one by two
nats on the Triton backend, uint8 targets were accepted, float64 was demoted under autocast, NaN advantages and
inf old log-probs gave a NaN or a wrong loss without an error, num_items_in_batch=0 and masks of 0.5 or 2 were
taken silently, and a second backward died with a TypeError.
"""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl.losses.config import PolicyLossConfig
from fastrl.reference import logprobs_reference, policy_loss_from_logprobs

from conftest import CPU_BACKENDS

B, T, H, V = 3, 5, 24, 150  # V > one Triton vocabulary block (128): two blocks, the second ragged


def rel(x, y):
    return ((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-12)).item()


def _base(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden=torch.randn(B, T, H, generator=g),
        weight=torch.randn(V, H, generator=g) / 3,
        bias=torch.randn(V, generator=g) * 0.5,
        targets=torch.randint(0, V, (B, T), generator=g),
        adv=torch.randn(B, generator=g),
        adv_tok=torch.randn(B, T, generator=g),
        mask=torch.rand(B, T, generator=g) > 0.2,
        old=-torch.rand(B, T, generator=g) * 3 - 1,
        ref=-torch.rand(B, T, generator=g) * 3 - 1,
        isw=torch.rand(B, T, generator=g) + 0.5,
    )


# ---------------------------------------------------------------- item 1: strided and transposed views

def _strided(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as ``x`` in a non-contiguous layout."""
    if how == "rows":  # every other row of a taller buffer: leading stride doubled
        buf = torch.zeros((2 * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype)
        buf[::2] = x
        out = buf[::2]
    elif how == "cols":  # every other element of the last dimension
        buf = torch.zeros(tuple(x.shape[:-1]) + (2 * x.shape[-1],), dtype=x.dtype)
        buf[..., ::2] = x
        out = buf[..., ::2]
    elif how == "transposed":  # all dimensions reversed in memory: last-dim stride != 1
        out = x.permute(*reversed(range(x.dim()))).contiguous().permute(*reversed(range(x.dim())))
    elif how == "column":  # a 1-D tensor as a column of a matrix
        buf = torch.zeros((x.shape[0], 3), dtype=x.dtype)
        buf[:, 1] = x
        out = buf[:, 1]
    else:
        raise AssertionError(how)
    assert torch.equal(out, x) and not out.is_contiguous()
    return out


LINEAR_VIEWS = [("hidden", "rows"), ("hidden", "cols"), ("hidden", "transposed"), ("weight", "rows"),
                ("weight", "cols"), ("weight", "transposed"), ("bias", "rows"), ("bias", "column"),
                ("targets", "cols"), ("targets", "column")]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("arg,how", LINEAR_VIEWS, ids=[f"{a}-{h}" for a, h in LINEAR_VIEWS])
def test_fused_logprobs_honours_strided_views(arg, how, backend):
    """Outputs and gradients from a strided view equal those from contiguous inputs and the float64 reference;
    the gradient of a view lands in the view's own values."""
    base = _base()
    # [N, H] hidden and [N] targets: the views reach the kernels as they are (a [B, T, H] view may be copied by
    # the reshape to [N, H])
    base["hidden"], base["targets"] = base["hidden"].reshape(B * T, H), base["targets"].reshape(B * T)
    leaves = {k: base[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    dense = dict(leaves, targets=base["targets"])
    inputs = dict(dense)
    if arg == "targets":
        inputs["targets"] = _strided(base["targets"], how)
    else:
        # the view is a differentiable function of the leaf, so the leaf's gradient is the view's
        inputs[arg] = _strided(leaves[arg], how)

    def run(x):
        lp, en = fastrl.fused_logprobs(x["hidden"], x["weight"], x["targets"], bias=x["bias"], backend=backend)
        w = torch.linspace(-1, 1, lp.numel())
        return lp, en, torch.autograd.grad((w * lp).sum() + (w.flip(0) * en).sum(), list(leaves.values()))

    lp, en, grads = run(inputs)
    lp_d, en_d, grads_d = run(dense)
    lp64, en64 = logprobs_reference(*(base[k].double() for k in ("hidden", "weight")), base["targets"],
                                    bias=base["bias"].double())
    assert (lp - lp_d).abs().max().item() <= 1e-5, f"{arg} {how}: log-probs differ from contiguous inputs"
    assert (lp.double() - lp64).abs().max().item() <= 1e-5 and (en.double() - en64).abs().max().item() <= 1e-5
    assert (en - en_d).abs().max().item() <= 1e-5
    for name, g, gd in zip(leaves, grads, grads_d):
        assert rel(g, gd) <= 1e-5, f"{arg} {how}: grad {name} off by {rel(g, gd):.2e} (relative)"


POLICY_VIEWS = LINEAR_VIEWS[:-2] + [("targets", "cols"), ("targets", "transposed"), ("adv", "rows"), ("adv_tok", "transposed"), ("mask", "transposed"),
                               ("mask", "cols"), ("old", "transposed"), ("old", "cols"), ("ref", "transposed"),
                               ("isw", "transposed"), ("isw", "rows")]


def _policy_call(x, backend):
    config = PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)
    return fastrl.policy_loss(
        x["hidden"], x["weight"], x["targets"], x["adv_tok"] if "adv_tok" in x else x["adv"], x["mask"],
        config=config, old_logprobs=x["old"], ref_logprobs=x["ref"], bias=x["bias"], importance_weights=x["isw"],
        backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("arg,how", POLICY_VIEWS, ids=[f"{a}-{h}" for a, h in POLICY_VIEWS])
def test_policy_loss_honours_strided_views(arg, how, backend):
    """The one-pass loss (it launches the kernels itself) from a strided view of any argument: the same loss,
    gradients and metrics as from contiguous inputs, and the float64 reference's loss."""
    base = _base(seed=1)
    leaves = {k: base[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    dense = {**base, **leaves}
    if arg != "adv_tok":
        dense.pop("adv_tok")
    inputs = dict(dense)
    inputs[arg] = _strided(leaves[arg] if arg in leaves else base[arg], how)

    def run(x):
        loss, metrics = _policy_call(x, backend)
        return loss, metrics, torch.autograd.grad(loss, list(leaves.values()))

    loss, metrics, grads = run(inputs)
    loss_d, metrics_d, grads_d = run(dense)
    assert abs(loss.item() - loss_d.item()) <= 1e-6 * (1 + abs(loss_d.item())), f"{arg} {how}: loss differs"
    for name, g, gd in zip(leaves, grads, grads_d):
        assert rel(g, gd) <= 1e-5, f"{arg} {how}: grad {name} off by {rel(g, gd):.2e} (relative)"
    for k in metrics_d:
        assert abs(metrics[k].item() - metrics_d[k].item()) <= 1e-5 * (1 + abs(metrics_d[k].item())), k
    t = torch.where(base["mask"], base["targets"], -100)
    lp64, en64 = logprobs_reference(base["hidden"].double(), base["weight"].double(), t, bias=base["bias"].double())
    loss64, _ = policy_loss_from_logprobs(
        lp64, en64, (base["adv_tok"] if arg == "adv_tok" else base["adv"]).double(), base["mask"],
        config=PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01), old_logprobs=base["old"].double(),
        ref_logprobs=base["ref"].double(), importance_weights=base["isw"].double())
    assert abs(loss.item() - loss64.item()) <= 1e-5 * (1 + abs(loss64.item()))


# ---------------------------------------------------------------- item 3: target dtypes

@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.float32, torch.bool], ids=str)
def test_targets_must_hold_ignore_index(dtype):
    """uint8 wraps -100 to 156 (a valid id in a larger vocabulary); int8/int16 cannot hold real vocabularies."""
    x = _base()
    targets = x["targets"].clamp(max=100).to(dtype)
    with pytest.raises(TypeError, match=rf"targets must be int32 or int64.*got {dtype}"):
        fastrl.fused_logprobs(x["hidden"], x["weight"], targets)
    with pytest.raises(TypeError, match="targets must be int32 or int64"):
        fastrl.policy_loss(x["hidden"], x["weight"], targets, x["adv"], x["mask"], config=PolicyLossConfig())


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_int32_targets_equal_int64(backend):
    x = _base()
    t = x["targets"].clone()
    t[1, 2] = -100
    h = x["hidden"].requires_grad_()
    lp64, en64 = fastrl.fused_logprobs(h, x["weight"], t, backend=backend)
    lp32, en32 = fastrl.fused_logprobs(h, x["weight"], t.int(), backend=backend)
    assert torch.equal(lp32, lp64) and torch.equal(en32, en64) and lp32[1, 2] == 0
    g64, = torch.autograd.grad(lp64.sum(), h)
    g32, = torch.autograd.grad(lp32.sum(), h)
    assert torch.equal(g32, g64)


# ---------------------------------------------------------------- item 4: float64 under autocast

def test_float64_is_left_alone_under_autocast():
    """PyTorch's autocast does not cast float64; neither does fastrl: float64 results, bit for bit."""
    x = _base()
    h = x["hidden"].double().requires_grad_()
    w, b = x["weight"].double(), x["bias"].double()
    lp, en = fastrl.fused_logprobs(h, w, x["targets"], bias=b, backend="torch")
    (g,) = torch.autograd.grad(lp.sum() + en.sum(), h)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp_a, en_a = fastrl.fused_logprobs(h, w, x["targets"], bias=b, backend="torch")
        (g_a,) = torch.autograd.grad(lp_a.sum() + en_a.sum(), h)
        loss_a, _ = fastrl.policy_loss(h, w, x["targets"], x["adv"], x["mask"], config=PolicyLossConfig(),
                                       old_logprobs=x["old"], bias=b, backend="torch")
    loss, _ = fastrl.policy_loss(h, w, x["targets"], x["adv"], x["mask"], config=PolicyLossConfig(),
                                 old_logprobs=x["old"], bias=b, backend="torch")
    assert lp_a.dtype == torch.float64 and g_a.dtype == torch.float64 and loss_a.dtype == torch.float64
    assert torch.equal(lp_a, lp) and torch.equal(en_a, en) and torch.equal(g_a, g) and torch.equal(loss_a, loss)


# ---------------------------------------------------------------- items 5, 6, 7, 13, 14: loss inputs

def _loss(x, *, backend="torch", grad=True, **kw):
    args = dict(config=PolicyLossConfig(loss_type="dapo"), old_logprobs=x["old"], backend=backend)
    args.update(kw)
    hidden = x["hidden"].clone().requires_grad_(grad)
    return fastrl.policy_loss(hidden, x["weight"], x["targets"], args.pop("advantages", x["adv"]),
                              args.pop("mask", x["mask"]), **args)


@pytest.mark.parametrize("grad", [True, False], ids=["one_pass", "forward_only"])
def test_non_finite_loss_inputs_are_named(grad):
    x = _base()
    x["mask"][0, 1] = True
    x["mask"][2] = False  # a fully masked row
    cases = []
    adv = x["adv"].clone()
    adv[0] = float("nan")  # a group whose rewards have std 0
    cases.append(("advantages", dict(advantages=adv), r"advantages holds nan at position \(0,\)"))
    adv_tok = x["adv_tok"].clone()
    adv_tok[0, 1] = float("-inf")
    cases.append(("advantages", dict(advantages=adv_tok), r"advantages holds -inf at position \(0, 1\)"))
    old = x["old"].clone()
    old[0, 1] = float("inf")
    cases.append(("old_logprobs", dict(old_logprobs=old), r"old_logprobs holds inf at position \(0, 1\)"))
    ref = x["ref"].clone()
    ref[0, 1] = float("nan")
    cases.append(("ref_logprobs", dict(ref_logprobs=ref, config=PolicyLossConfig(beta=0.04)),
                  r"ref_logprobs holds nan at position \(0, 1\)"))
    isw = x["isw"].clone()
    isw[0, 1] = float("nan")
    cases.append(("importance_weights", dict(importance_weights=isw), r"importance_weights holds nan"))
    for name, kw, match in cases:
        with pytest.raises(FloatingPointError, match=match + ".*check_finite=False"):
            _loss(x, grad=grad, **kw)
        loss, _ = _loss(x, grad=grad, check_finite=False, **kw)  # the check, not the op, raised

    # where the loss does not read a value, it may be anything: same loss as with a finite value there
    clean, _ = _loss(x, grad=grad, config=PolicyLossConfig(beta=0.04), ref_logprobs=x["ref"])
    adv = x["adv"].clone()
    adv[2] = float("nan")  # the fully masked row
    old, ref = x["old"].clone(), x["ref"].clone()
    outside = (~x["mask"]).nonzero()[0].tolist()
    old[tuple(outside)] = float("inf")
    ref[tuple(outside)] = float("nan")
    loss, _ = _loss(x, grad=grad, advantages=adv, old_logprobs=old, config=PolicyLossConfig(beta=0.04), ref_logprobs=ref)
    assert loss.item() == clean.item()
    ref_nan = x["ref"].clone()
    ref_nan[0, 1] = float("nan")
    _loss(x, grad=grad, ref_logprobs=ref_nan)  # beta = 0: ref log-probs are not read


def test_vespo_reads_importance_weights_at_every_position_of_a_row():
    x = _base()
    x["mask"][0] = True
    x["mask"][0, -1] = False
    isw = x["isw"].clone()
    isw[0, -1] = float("nan")  # outside the mask, but vespo sums log IS ratios over the whole row (as TRL)
    with pytest.raises(FloatingPointError, match=rf"importance_weights holds nan at position \(0, {T - 1}\)"):
        _loss(x, importance_weights=isw, config=PolicyLossConfig(loss_type="vespo"))


@pytest.mark.parametrize("value", [0, -3, 0.0, float("nan"), float("inf"), "tensor0", "tensor-1"])
def test_num_items_in_batch_must_count_the_tokens(value):
    x = _base()
    if isinstance(value, str):
        value = torch.tensor(float(value[len("tensor"):]))
    with pytest.raises(ValueError, match="num_items_in_batch must be"):
        _loss(x, num_items_in_batch=value)


def test_num_items_in_batch_valid_values():
    x = _base()
    n = int(x["mask"].sum())
    default, _ = _loss(x)
    for value in (n, float(n), torch.tensor(n), torch.tensor([float(n)])):
        loss, _ = _loss(x, num_items_in_batch=value)
        assert abs(loss.item() - default.item()) <= 1e-6 * abs(default.item()), value
    loss4, _ = _loss(x, num_items_in_batch=4)
    assert abs(loss4.item() - default.item() * n / 4) <= 1e-5 * abs(default.item() * n / 4)
    # 0 is consistent with a fully masked batch (TRL's count there): loss 0
    loss0, _ = _loss(x, mask=torch.zeros_like(x["mask"]), num_items_in_batch=0)
    assert loss0.item() == 0.0


@pytest.mark.parametrize("value", [torch.tensor([3.0, 4.0]), torch.zeros(2, 1)], ids=["[2]", "[2,1]"])
def test_num_items_in_batch_of_several_elements_says_what_is_expected(value):
    with pytest.raises(ValueError, match=rf"num_items_in_batch must be a number or a one-element tensor.*"
                                         rf"shape {tuple(value.shape)}".replace("(", r"\(").replace(")", r"\)")):
        _loss(_base(), num_items_in_batch=value)
    with pytest.raises(TypeError, match="num_items_in_batch must be None, a number or a one-element tensor, got str"):
        _loss(_base(), num_items_in_batch="8")


@pytest.mark.parametrize("grad", [True, False], ids=["one_pass", "forward_only"])
def test_masks_must_be_binary(grad):
    """TRL's completion_mask is 0/1; fastrl selects with the mask and refuses anything it would have to round."""
    x = _base()
    pos = tuple((x["mask"]).nonzero()[0].tolist())
    for dtype, bad in ((torch.float32, 0.5), (torch.int64, 2), (torch.float32, -1.0), (torch.float32, float("nan"))):
        mask = x["mask"].to(dtype)
        mask[pos] = bad
        with pytest.raises(ValueError, match=rf"mask must be bool or hold only 0 and 1, got {bad}.*{pos}"
                                             .replace("(", r"\(").replace(")", r"\)")):
            _loss(x, grad=grad, mask=mask)
    # 0/1 masks of any dtype are the bool mask
    want, _ = _loss(x, grad=grad)
    for dtype in (torch.float32, torch.int64, torch.uint8):
        got, _ = _loss(x, grad=grad, mask=x["mask"].to(dtype))
        assert got.item() == want.item(), dtype


def test_ignored_target_inside_the_mask_is_an_error():
    x = _base()
    pos = tuple(x["mask"].nonzero()[0].tolist())
    x["targets"][pos] = -100
    with pytest.raises(ValueError, match=r"targets at position \(%d, %d\) is -100 .*inside the mask" % pos):
        _loss(x)
    x["mask"][pos] = False  # outside the mask it is just padding
    loss, _ = _loss(x)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("arg", ["advantages", "mask", "old_logprobs", "ref_logprobs", "importance_weights",
                                 "sampling_logprobs", "num_items_in_batch"])
def test_inputs_on_another_device_are_named(arg):
    x = _base()
    values = dict(advantages=x["adv"], mask=x["mask"], old_logprobs=x["old"], ref_logprobs=x["ref"],
                  importance_weights=x["isw"], sampling_logprobs=x["old"], num_items_in_batch=torch.tensor(4.0))
    kw = {arg: values[arg].to("meta")}
    if arg == "ref_logprobs":
        kw["config"] = PolicyLossConfig(beta=0.04)
    if arg == "sampling_logprobs":
        kw["config"] = PolicyLossConfig(off_policy_mask_threshold=0.5)
    with pytest.raises(ValueError, match=rf"loss inputs must be on hidden's device cpu, got {arg} on meta"):
        _loss(x, **kw)


# ---------------------------------------------------------------- item 9: second and double backward

def test_second_backward_through_the_one_pass_loss():
    x = _base()
    w = x["weight"].requires_grad_()
    h = x["hidden"].requires_grad_()

    def loss():
        out, _ = fastrl.policy_loss(h, w, x["targets"], x["adv"], x["mask"], config=PolicyLossConfig(),
                                    old_logprobs=x["old"], backend="torch")
        assert "policy_loss_one_pass" in type(out.grad_fn).__name__  # the one-pass path
        return out

    L = loss()
    g1 = torch.autograd.grad(L, [h, w], retain_graph=True)
    g2 = torch.autograd.grad(L, [h, w])  # a second call through the retained graph: the same gradients
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))

    L = loss()
    L.backward(retain_graph=True)
    L.backward()  # gradients accumulate, as for any PyTorch op
    assert torch.equal(w.grad, 2 * g1[1]) and torch.equal(h.grad, 2 * g1[0])

    L = loss()
    L.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        L.backward()  # the graph (and the gradients it held) were freed: PyTorch's own error


def test_double_backward_is_refused():
    x = _base()
    h = x["hidden"].requires_grad_()
    L, _ = fastrl.policy_loss(h, x["weight"], x["targets"], x["adv"], x["mask"], config=PolicyLossConfig(),
                              old_logprobs=x["old"], backend="torch")
    with pytest.raises(RuntimeError, match=r"does not support double backward \(create_graph=True\)"):
        torch.autograd.grad(L, h, create_graph=True)
