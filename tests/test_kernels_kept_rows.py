"""The per-row kept-set kernels (kernels/kept_rows.py) against float64, at their real block sizes: on CPU tensors
under Triton's interpreter (tests/conftest.py), or, where CUDA is present (and the kernels run compiled), on CUDA
tensors: the same checks then hold the compiled kernels. No kernel uses atomics: the weight and bias gradients are
sorted segment reductions whatever ``deterministic`` says (issue 47).

Shapes leave K off the 32- and 16-id blocks and H off the 128-column block; the ids are ragged (pads at the end
and in the middle of a row), repeated within a row and across rows, with one all-pad row and one hot id whose
entries span several 16-entry blocks of the deterministic scatter (its tail path). Ground truth is float64 from
the same inputs; the kernels' error must be no worse than PyTorch's own computing the same thing at the input
dtype, and also within a float32-accumulation bound (PyTorch at bf16 rounds its outputs to bf16, so "no worse
than PyTorch" alone would pass a kernel that did too). Compiled for sm_90 the same kernels are in
``python -m bench sass``.
"""

import re

import pytest
import torch

from fastrl.kernels import tuning
from fastrl.kernels.kept_rows import DEFAULT_CONFIGS, kept_rows_backward, kept_rows_logits
from fastrl.kernels.tuning import KernelConfig

from test_logprobs import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HOT = 5  # an id every row (but the all-pad one) keeps four times: several blocks of the deterministic scatter
# relative error (to the largest reference value) of float32 accumulation of H or N K terms: products of bf16 / fp16
# inputs are exact in float32; float32 inputs round each product once
BOUND = 2e-6


@pytest.fixture(autouse=True)
def _on_device():
    """Tensors the tests create land on DEVICE (nothing to do on a CPU-only machine)."""
    if DEVICE == "cpu":
        yield
        return
    torch.set_default_device(DEVICE)
    yield
    torch.set_default_device(None)


def make_case(N, K, H, V, dtype, bias=True, seed=0):
    with torch.device("cpu"):  # the same numbers on every machine
        case = _case(N, K, H, V, dtype, bias, seed)
    return [x.to(DEVICE) if x is not None else None for x in case]


def _case(N, K, H, V, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    ids = torch.randint(0, V, (N, K), generator=g)
    ids[::2, : K // 2] = torch.randint(0, 12, (len(range(0, N, 2)), K // 2), generator=g)  # shared across rows
    ids[:, 1] = ids[:, 0]  # repeated within a row
    lengths = torch.randint(K // 3, K + 1, (N,), generator=g)
    ids[torch.arange(K)[None, :] >= lengths[:, None]] = -1  # ragged: each row padded at its end
    ids[:, [3, 4, 6, 7]] = HOT  # (after the padding, so short rows have pads between ids)
    ids[:, K // 2] = -1  # and a pad inside every row
    ids[N // 2] = -1  # a row with nothing kept
    grad = torch.randn(N, K, generator=g)
    grad[ids < 0] = float("nan")  # never read at pads
    return hidden, weight, b, ids, grad


def truth(hidden, weight, bias, ids, grad):
    """float64 logits [N, K] (-inf at pads), dh [N, H], dW [V, H], db [V]."""
    h, w = hidden.double(), weight.double()
    safe, pad = ids.clamp(min=0), ids < 0
    y = torch.einsum("nh,nkh->nk", h, w[safe])
    if bias is not None:
        y = y + bias.double()[safe]
    g = torch.where(pad, 0.0, grad.double())
    dh = torch.einsum("nk,nkh->nh", g, w[safe])
    dw = torch.zeros_like(w).index_add_(0, safe.flatten(), (g[:, :, None] * h[:, None, :]).flatten(0, 1))
    db = torch.zeros(w.shape[0], dtype=torch.float64).index_add_(0, safe.flatten(), g.flatten())
    return y.masked_fill(pad, float("-inf")), dh, dw, db


def torch_at_dtype(hidden, weight, bias, ids, grad):
    """The same four at the input dtype, as PyTorch computes them there (bmm, index_add_)."""
    dt, safe, pad = hidden.dtype, ids.clamp(min=0), ids < 0
    rows = weight[safe]  # [N, K, H]
    y = torch.bmm(rows, hidden[:, :, None])[..., 0]
    if bias is not None:
        y = y + bias[safe]
    g = torch.where(pad, 0.0, grad).to(dt)
    dh = torch.bmm(g[:, None, :], rows)[:, 0]
    dw = torch.zeros_like(weight).index_add_(0, safe.flatten(), (g[:, :, None] * hidden[:, None, :]).flatten(0, 1))
    db = torch.zeros(weight.shape[0], dtype=dt).index_add_(0, safe.flatten(), g.flatten())
    return y.masked_fill(pad, float("-inf")), dh, dw, db


def assert_close(name, fast, ref, torch_):
    """fastrl's error no worse than PyTorch's at the input dtype (+ float32 rounding), and within BOUND."""
    live = torch.isfinite(ref)
    e_fast, e_torch = rel_err(fast[live], ref[live]), rel_err(torch_[live], ref[live])
    assert e_fast <= e_torch + 1e-6, f"{name}: relative error {e_fast:.3e} exceeds PyTorch's own {e_torch:.3e} + 1e-6"
    assert e_fast <= BOUND, f"{name}: relative error {e_fast:.3e} over float32 accumulation's {BOUND:.0e}"


def run_backward(hidden, weight, ids, grad, bias, deterministic, gw0=None, **kw):
    V, H = weight.shape
    gw = torch.zeros(V, H) if gw0 is None else gw0.clone()
    gb = torch.zeros(V) if bias is not None else None
    gh = kept_rows_backward(grad, hidden, weight, ids, gw, gb, deterministic, **kw)
    return gh, gw, gb


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_logits_against_float64(dtype, bias):
    hidden, weight, b, ids, grad = make_case(9, 37, 150, 300, dtype, bias)
    y = kept_rows_logits(hidden, weight, ids, b)
    y64, *_ = truth(hidden, weight, b, ids, grad)
    yt, *_ = torch_at_dtype(hidden, weight, b, ids, grad)
    assert y.dtype == torch.float32 and y.shape == ids.shape
    assert torch.equal(torch.isneginf(y), ids < 0), "-inf exactly at the pads"
    assert_close("logits", y, y64, yt)
    if dtype != torch.float32:  # the check tells float32 logits from logits rounded to the input dtype
        assert rel_err(yt[ids >= 0], y64[ids >= 0]) > 50 * rel_err(y[ids >= 0], y64[ids >= 0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True], ids=["flag-off", "deterministic"])
def test_backward_against_float64(dtype, deterministic):
    """dh, and dW / db scatter-ADDED into buffers that already hold values; an all-pad row gets exactly zero."""
    hidden, weight, b, ids, grad = make_case(6, 37, 150, 300, dtype)
    V, H = weight.shape
    gw0 = torch.randn(V, H)
    gh, gw, gb = run_backward(hidden, weight, ids, grad, b, deterministic, gw0=gw0)
    _, dh64, dw64, db64 = truth(hidden, weight, b, ids, grad)
    _, dht, dwt, dbt = torch_at_dtype(hidden, weight, b, ids, grad)
    assert gh.dtype == torch.float32 and gh.shape == hidden.shape
    assert_close("grad hidden", gh, dh64, dht)
    assert_close("grad weight", gw - gw0, dw64, dwt)  # the increment; the rest of the buffer is untouched:
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[ids[ids >= 0]] = False
    assert torch.equal(gw[untouched], gw0[untouched])
    assert_close("grad bias", gb, db64, dbt)
    assert torch.equal(gh[6 // 2], torch.zeros(H)), "an all-pad row has no gradient"


def test_backward_without_bias_and_hidden_only():
    hidden, weight, _, ids, grad = make_case(9, 37, 40, 300, torch.bfloat16, bias=False)
    _, dh64, dw64, _ = truth(hidden, weight, None, ids, grad)
    for det in (False, True):
        gh, gw, _ = run_backward(hidden, weight, ids, grad, None, det)
        assert rel_err(gh, dh64) <= BOUND and rel_err(gw, dw64) <= BOUND, det
    gh_only = kept_rows_backward(grad, hidden, weight, ids)  # no dW, no dB asked
    assert torch.equal(gh_only, gh)


def test_deterministic_is_bitwise_reproducible_whatever_the_flag():
    """Two runs are bitwise equal, ``deterministic=False`` included (no atomics left to ask for). Id HOT has
    4 (N - 1) = 44 entries (three 16-entry blocks): its owner sums the tail; short segments start and end inside
    blocks."""
    hidden, weight, b, ids, grad = make_case(12, 24, 40, 64, torch.bfloat16)
    assert (ids == HOT).sum() >= 44
    runs = [run_backward(hidden, weight, ids, grad, b, True) for _ in range(2)]
    for x, y in zip(*runs):
        assert torch.equal(x, y)
    flag_off = run_backward(hidden, weight, ids, grad, b, False)
    _, dh64, dw64, db64 = truth(hidden, weight, b, ids, grad)
    for name, det, off, ref in zip(("hidden", "weight", "bias"), runs[0], flag_off, (dh64, dw64, db64)):
        assert torch.equal(det, off), name
        assert rel_err(det, ref) <= BOUND, name


@pytest.mark.parametrize("deterministic", [False, True], ids=["flag-off", "deterministic"])
def test_weight_rows_into_a_compact_buffer(deterministic):
    """weight_rows sends each entry's weight gradient to a row of an [R, H] buffer (one row per distinct kept id):
    the same sums as the [V, H] one, read at those ids; the bias gradient stays per id; pads' rows are ignored."""
    hidden, weight, b, ids, grad = make_case(6, 37, 40, 300, torch.bfloat16)
    kept = torch.unique(ids[ids >= 0])
    slot = torch.full((300,), 10**9, dtype=torch.int64)  # far off the buffer: must never be used
    slot[kept] = torch.randperm(len(kept))
    rows = slot[ids.clamp(min=0)]
    gw = torch.zeros(len(kept), 40)
    gb = torch.zeros(300)
    gh = kept_rows_backward(grad, hidden, weight, ids, gw, gb, deterministic, weight_rows=rows)
    gh_full, gw_full, gb_full = run_backward(hidden, weight, ids, grad, b, deterministic)
    assert torch.equal(gh, gh_full)
    # (not bitwise, even when deterministic: the rows' order moves the 16-entry block boundaries of the sorted sums)
    assert rel_err(gw[slot[kept]], gw_full[kept]) <= 1e-6 and rel_err(gb, gb_full) <= 1e-6


def test_gathers_only_the_kept_rows():
    """Rows of the weight (and bias) no token keeps are NaN: nothing computed may touch them (N K H work)."""
    hidden, weight, b, ids, grad = make_case(9, 37, 40, 300, torch.bfloat16)
    unkept = torch.ones(300, dtype=torch.bool)
    unkept[ids[ids >= 0]] = False
    weight[unkept] = float("nan")
    b[unkept] = float("nan")
    y = kept_rows_logits(hidden, weight, ids, b)
    assert torch.isfinite(y[ids >= 0]).all()
    for det in (False, True):
        gh, gw, gb = run_backward(hidden, weight, ids, grad, b, det)
        assert torch.isfinite(gh).all() and torch.isfinite(gw).all() and torch.isfinite(gb).all()


def test_large_vocabulary_few_tokens():
    """V = 262144 (Gemma's vocabulary): ids at both ends and the middle, 64-bit row offsets into W and dW."""
    N, K, H, V = 3, 40, 16, 262144
    hidden, weight, b, ids, grad = make_case(N, K, H, V, torch.bfloat16)
    ids[::2, 20:23] = torch.tensor([0, V - 1, 131071])  # rows 0 and 2 (row 1 keeps nothing)
    ids[0, 30] = V - 1
    grad = torch.where(ids < 0, float("nan"), grad.nan_to_num(0.5))
    y = kept_rows_logits(hidden, weight, ids, b)
    y64, dh64, dw64, db64 = truth(hidden, weight, b, ids, grad)
    assert rel_err(y[ids >= 0], y64[ids >= 0]) <= BOUND
    for det in (False, True):
        gh, gw, gb = run_backward(hidden, weight, ids, grad, b, det)
        for name, x, ref in (("hidden", gh, dh64), ("weight", gw, dw64), ("bias", gb, db64)):
            assert rel_err(x, ref) <= BOUND, (name, det)


def test_strided_inputs_give_the_same_bits():
    """Row strides of hidden and weight, transposed ids and grad: the same results as contiguous inputs."""
    hidden, weight, b, ids, grad = make_case(5, 37, 40, 300, torch.float16)
    wide_h = torch.zeros(5, 64, dtype=hidden.dtype)
    wide_h[:, 8:48] = hidden
    wide_w = torch.zeros(300, 48, dtype=weight.dtype)
    wide_w[:, :40] = weight
    ids_t, grad_t = ids.t().contiguous().t(), grad.t().contiguous().t()
    args = (wide_h[:, 8:48], wide_w[:, :40], ids_t)
    assert torch.equal(kept_rows_logits(*args, b), kept_rows_logits(hidden, weight, ids, b))
    for det in (False, True):
        strided = run_backward(*args[:2], ids_t, grad_t, b, det)
        for name, x, y in zip(("hidden", "weight", "bias"), strided, run_backward(hidden, weight, ids, grad, b, det)):
            assert torch.equal(x, y), (name, det)


def test_other_block_sizes():
    """A forced configuration (what a GPU tournament would try) computes the same sums."""
    hidden, weight, b, ids, grad = make_case(5, 37, 150, 300, torch.bfloat16)
    y64, dh64, dw64, db64 = truth(hidden, weight, b, ids, grad)
    y = kept_rows_logits(hidden, weight, ids, b, config=KernelConfig(1, 16, 256, 4, 2))
    assert rel_err(y[ids >= 0], y64[ids >= 0]) <= BOUND
    gh, gw, gb = run_backward(hidden, weight, ids, grad, b, True, config=KernelConfig(1, 32, 64, 4, 2),
                              segment_config=KernelConfig(32, 1, 256, 4, 2))
    for name, x, ref in (("hidden", gh, dh64), ("weight", gw, dw64), ("bias", gb, db64)):
        assert rel_err(x, ref) <= BOUND, name


def test_empty_shapes():
    hidden, weight, b, ids, grad = make_case(4, 8, 16, 50, torch.float32)
    assert kept_rows_logits(hidden[:0], weight, ids[:0], b).shape == (0, 8)
    assert kept_rows_logits(hidden, weight, ids[:, :0], b).shape == (4, 0)
    gw = torch.zeros(50, 16)
    gh = kept_rows_backward(grad[:, :0], hidden, weight, ids[:, :0], gw, None, True)
    assert torch.equal(gh, torch.zeros(4, 16)) and torch.equal(gw, torch.zeros(50, 16))


def test_unchecked_out_of_range_id_is_nan_not_a_wild_read():
    """check_ids=False (no host read, for the no-sync path): an id >= V is never loaded; its logit is NaN."""
    hidden, weight, b, ids, grad = make_case(4, 8, 16, 50, torch.float32)
    ids[1, 2] = 50
    y = kept_rows_logits(hidden, weight, ids, b, check_ids=False)
    assert torch.isnan(y[1, 2])
    assert torch.isfinite(y[(ids >= 0) & (ids < 50)]).all() and torch.isneginf(y[ids < 0]).all()


@pytest.mark.parametrize("case, error, words", [
    (dict(ids_max=True), ValueError, "ids must lie in [0, V) = [0, 50)"),
    (dict(ids=torch.zeros(4, 8, dtype=torch.int32)), TypeError, "ids must be int64, got torch.int32"),
    (dict(ids=torch.zeros(3, 8, dtype=torch.int64)), ValueError, "ids must be [N, K] with hidden's N = 4"),
    (dict(ids=torch.zeros(32, dtype=torch.int64)), ValueError, "ids must be a 2-D tensor"),
    (dict(weight=torch.zeros(50, 16, dtype=torch.bfloat16)), TypeError, "hidden and weight must share one dtype"),
    (dict(weight=torch.zeros(50, 17)), ValueError, "must share H"),
    (dict(hidden=torch.zeros(4, 16, dtype=torch.float64), weight=torch.zeros(50, 16, dtype=torch.float64)),
     TypeError, "one dtype of float32, bfloat16, float16"),
    (dict(bias=torch.zeros(49)), ValueError, "bias must be a floating [V] = [50] tensor"),
])
def test_bad_input_names_the_argument(case, error, words):
    hidden, weight, b, ids, grad = make_case(4, 8, 16, 50, torch.float32)
    case = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    if case.pop("ids_max", False):
        ids[2, 3] = 50
    kw = dict(dict(hidden=hidden, weight=weight, ids=ids, bias=b), **case)
    with pytest.raises(error, match=re.escape(words)):
        kept_rows_logits(**kw)


@pytest.mark.parametrize("case, words", [
    (dict(grad=torch.zeros(4, 8, dtype=torch.bfloat16)), "grad must be a float32 tensor shaped like ids (4, 8)"),
    (dict(grad=torch.zeros(4, 7)), "grad must be a float32 tensor shaped like ids"),
    (dict(grad_weight=torch.zeros(50, 16, dtype=torch.bfloat16)),
     "grad_weight must be a float32 tensor of shape (50, 16)"),
    (dict(grad_weight=torch.zeros(16, 50).t()), "grad_weight is added to in place and must have a unit last stride"),
    (dict(grad_bias=torch.zeros(51)), "grad_bias must be a float32 tensor of shape (50,)"),
    (dict(weight_rows=torch.zeros(4, 8, dtype=torch.int32)), "weight_rows must be an int64 tensor shaped like ids"),
    (dict(weight_rows=torch.full((4, 8), 7), grad_weight=torch.zeros(7, 16)),
     "weight_rows must lie in [0, 7) (grad_weight's rows) where ids are kept, got [7, 7]"),
    (dict(weight_rows=torch.zeros(4, 8, dtype=torch.int64), grad_weight=torch.zeros(7, 15)),
     "grad_weight must be a float32 tensor of shape (7, 16)"),
])
def test_bad_gradient_buffers(case, words):
    hidden, weight, _, ids, grad = make_case(4, 8, 16, 50, torch.float32)
    case = {k: v.to(DEVICE) for k, v in case.items()}
    kw = dict(dict(grad=grad, hidden=hidden, weight=weight, ids=ids), **case)
    with pytest.raises(ValueError, match=re.escape(words)):
        kept_rows_backward(**kw)


def test_defaults_lead_the_tournament_candidates():
    """Each kernel's default launch configuration is the first candidate a GPU tournament times."""
    for kernel, cfg in DEFAULT_CONFIGS.items():
        assert tuning.candidates(kernel)[0] == cfg, kernel
