"""The ``triton-sm90`` backend's persistent TMA kernels (kernels/persistent_stats.py, kernels/persistent_grad.py)
against float64, on CPU tensors under Triton's interpreter (tests/conftest.py), at the interpreter's block size (the
64x128x64 tile of ``fastrl.kernels.tuning``'s "interpreter" rows, not the sm90 defaults, which ``python -m bench sass``
compiles for sm_90).

The interpreter runs the persistent grid with 4 programs (``persistent_stats.num_programs``), so every program loops
over several work items; the shapes leave the vocabulary off the tile (V = 700, 150, 262144) and the tokens off the
token block. Compiled for sm_90, the same kernels are checked by ``python -m bench sass`` (test_kernels.py).
"""

import pytest
import torch

import fastrl
from fastrl.kernels import persistent_grad as PG
from fastrl.kernels import persistent_stats as PS
from fastrl.kernels import tuning
from fastrl.ops import one_pass as one_pass_mod
from fastrl.losses.config import PolicyLossConfig
from fastrl.ops import sm90
from fastrl.ops.backend import BACKENDS, CONCRETE, resolve_backend
from fastrl.reference import logits_reference, logprobs_reference

from test_logprobs import check_against_float64, grads, loss_weights, make_inputs, max_err
from test_policy_loss import assert_matches, fused, make_batch, reference

pytestmark = pytest.mark.interpreter
SM90 = "triton-sm90"


def _stats64(hidden, weight, bias, targets, **tf):
    z = logits_reference(hidden, weight, bias, dtype=torch.float64, **tf)
    p = torch.softmax(z, 1)
    return z, torch.logsumexp(z, 1), z.gather(1, targets[:, None]).squeeze(1), -(p * torch.log_softmax(z, 1)).sum(1)


def _g64(z64, lse64, ent64, targets, glp, gen, dzdy=1.0):
    p = torch.softmax(z64, 1)
    onehot = torch.nn.functional.one_hot(targets, z64.shape[1]).double()
    gz = glp.double()[:, None] * (onehot - p) - gen.double()[:, None] * p * (z64 - lse64[:, None] + ent64[:, None])
    return gz * dzdy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_logprobs_and_gradients_against_float64(dtype, bias):
    """Forward statistics and the path-A backward (recomputed tiles -> G -> GEMMs): N and V off their blocks."""
    check_against_float64(SM90, dtype, 47, 40, 700, bias=bias)


@pytest.mark.parametrize("tf", [dict(temperature=0.7), dict(softcap=3.0, logit_scale=1.7, temperature=0.9)],
                         ids=["T0.7", "softcap-scale-T"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transforms(tf, dtype):
    check_against_float64(SM90, dtype, 47, 32, 300, **tf)


def test_several_backward_slices_and_leading_shape():
    """vocab_chunk smaller than V: the G slices meet at seams (128 is half a 256-column block)."""
    hidden, weight, b, targets = make_inputs(21, 24, 700, torch.float32, lead=(3, 7))
    a, c = loss_weights(targets.shape)
    ref = grads(*logprobs_reference(hidden, weight, targets, bias=b, dtype=torch.float64), a, c, [hidden, weight, b])
    for chunk in (128, 300):
        lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=SM90, vocab_chunk=chunk)
        assert lp.shape == (3, 7)
        for g, r in zip(grads(lp, en, a, c, [hidden, weight, b]), ref):
            assert max_err(g, r) < 1e-5 * (1 + r.abs().max().item()), f"vocab_chunk={chunk}"


def test_bf16_logprob_error_within_2e4_nats():
    """Issue 28's bound: bf16 inputs, log-probs within 2e-4 nats of float64 (logits never rounded to bf16)."""
    hidden, weight, b, targets = make_inputs(64, 256, 4096, torch.bfloat16, bias=False, scale=8.0)
    with torch.no_grad():
        lp, en = fastrl.fused_logprobs(hidden, weight, targets, backend=SM90)
        lp64, en64 = logprobs_reference(hidden, weight, targets, dtype=torch.float64)
        lp_bf16, _ = logprobs_reference(hidden, weight, targets, dtype=torch.bfloat16)  # what bf16 logits cost
    assert max_err(lp, lp64) <= 2e-4, max_err(lp, lp64)
    assert max_err(en, en64) <= 2e-4, max_err(en, en64)
    assert max_err(lp_bf16, lp64) > 50 * max_err(lp, lp64)  # the check can tell rounded logits from ours


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_vocabulary_splits_and_their_combine(splits):
    """Each split holds partial statistics; the target logit comes from split 0 wherever the target lies."""
    hidden, weight, b, targets = make_inputs(33, 24, 1000, torch.float32)
    targets[:5] = torch.tensor([0, 999, 500, 256, 255])
    with torch.no_grad():
        _, lse64, zt64, ent64 = _stats64(hidden, weight, b, targets)
        lse, zt, ent = PS.persistent_stats(hidden, weight, b, targets, logit_scale=1.0, softcap=None,
                                           temperature=1.0, with_entropy=True, splits=splits)
    for name, x, w in (("lse", lse, lse64), ("target", zt, zt64), ("entropy", ent, ent64)):
        assert max_err(x, w) < 2e-5, f"{name} with {splits} splits"


def test_choose_splits_fills_the_last_wave():
    assert PS.choose_splits(128, 594, 132) in range(4, 33)
    s = PS.choose_splits(128, 594, 132)
    items = 128 * -(-594 // -(-594 // s))
    assert items % 132 == 0 or items / (-(-items // 132) * 132) > 0.9
    assert PS.choose_splits(1, 594, 132) == 132  # one token block: a split per program
    assert PS.choose_splits(2, 3, 132) == 3  # never more splits than vocabulary blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tf", [{}, dict(softcap=4.0, temperature=0.8, logit_scale=1.3)], ids=["plain", "softcap"])
def test_scaled_exp_tile_and_its_gradient(dtype, tf):
    """The one-pass layout: e = 2^(z log2 e - k) in (0, 1] per (row, 256-column block) with exact statistics, and
    G from it (in place) equal to float64's dL/dy within the input dtype's rounding."""
    N, H, V = 40, 32, 600
    hidden, weight, b, targets = make_inputs(N, H, V, dtype)
    kw = dict(logit_scale=tf.get("logit_scale", 1.0), softcap=tf.get("softcap"), temperature=tf.get("temperature", 1.0))
    tile = sm90.ExpTile(N, hidden, weight, b, sm90.LogitTransform(**kw))
    with torch.no_grad():
        z64, lse64, zt64, ent64 = _stats64(hidden, weight, b, targets, **tf)
        lse, zt, ent = PS.persistent_stats(hidden, weight, b, targets, with_entropy=True, exp_out=tile.e[:, :V],
                                           k_out=tile.k, config=tile.config, **kw)
        for name, x, w in (("lse", lse, lse64), ("target", zt, zt64), ("entropy", ent, ent64)):
            assert max_err(x, w) < 3e-5, name
        e = tile.e[:, :V].double()
        k = tile.k.repeat_interleave(tile.config.block_v, dim=1)[:, :V].double()
        assert e.max() <= 1.0 and e.min() >= 0.0
        # relative error of e 2^k against exp(z): the float32 logits' own error (~1e-6 absolute in z, as in the
        # statistics above) plus, in bf16, the rounding of e (unit roundoff 2^-8, round to nearest)
        err = ((e * torch.exp2(k) - torch.exp(z64)).abs() / torch.exp(z64)).max().item()
        assert err <= (2.0**-8 if dtype == torch.bfloat16 else 0.0) + 1e-5, err
        assert (k.amax(1) - z64.amax(1) / torch.log(torch.tensor(2.0, dtype=torch.float64))).max() < 1.0 + 1e-6

        glp, gen = (x.float() for x in loss_weights((N,)))
        glp[3] = 0.0
        gen[3] = 0.0  # a row with no upstream gradient: exact zeros
        G = PG.scaled_exp_grad(tile.e[:, :V], tile.k, tile.config.block_v, targets, 0, zt, lse, ent, glp, gen,
                               **kw)
        x = logits_reference(hidden, weight, b, dtype=torch.float64) * kw["logit_scale"]
        dzdy = kw["logit_scale"] / kw["temperature"] * (
            1 - torch.tanh(x / kw["softcap"]) ** 2 if kw["softcap"] else torch.ones_like(x))
        g64 = _g64(z64, lse64, ent64, targets, glp, gen, dzdy)
    assert G.data_ptr() == tile.e.data_ptr()  # written over the exps
    assert torch.equal(G[3], torch.zeros_like(G[3]))
    # bf16: the rounding of G itself (2^-9 relative) plus z recovered from a bf16 e (within ~2^-9 absolute)
    tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    assert max_err(G, g64) <= tol * g64.abs().max().item(), max_err(G, g64) / g64.abs().max().item()


def test_large_vocabulary_few_tokens():
    """V = 262144 (Gemma's vocabulary) with 3 tokens, through the one-pass pair (statistics + scaled exps, then G):
    2048 vocabulary blocks over the splits. The interpreter spends ~25 ms per tile (about a minute here), so the
    path-A backward, which is the same tile loop again, is left to the smaller shapes above."""
    N, H, V = 3, 16, 262144
    hidden, weight, _, targets = make_inputs(N, H, V, torch.bfloat16, bias=False)
    targets[:] = torch.tensor([0, V - 1, 131071])
    tf = sm90.LogitTransform()
    tile = sm90.ExpTile(N, hidden, weight, None, tf)
    with torch.no_grad():
        lse, zt, ent = sm90.chunk_stats(tile, hidden, weight, None, targets, tf)
        z64, lse64, zt64, ent64 = _stats64(hidden, weight, None, targets)
        for name, x, w in (("lse", lse, lse64), ("target", zt, zt64), ("entropy", ent, ent64)):
            assert max_err(x, w) < 3e-5, name
        glp, gen = (x.float() for x in loss_weights((N,)))
        G = sm90.chunk_grad(tile, targets, zt, lse, ent, glp, gen, tf)
        g64 = _g64(z64, lse64, ent64, targets, glp, gen)
    assert max_err(G, g64) <= 2.0**-7 * g64.abs().max().item()


def test_ignored_tokens_and_no_sync_path():
    """Ignored targets: log-prob 0, no gradient; the no-sync path (zeroed rows, no compaction) agrees."""
    hidden, weight, b, targets = make_inputs(30, 32, 400, torch.bfloat16)
    targets[::4] = -100
    a, c = loss_weights(targets.shape)
    out = {}
    for sync in (True, False):
        lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=SM90, host_sync=sync)
        out[sync] = (lp, en, grads(lp, en, a, c, [hidden, weight, b]))
        assert torch.equal(lp[::4], torch.zeros_like(lp[::4])) and torch.equal(en[::4], torch.zeros_like(en[::4]))
        assert torch.equal(out[sync][2][0][::4], torch.zeros_like(hidden[::4]))
    for x, y in zip(out[True][:2], out[False][:2]):
        assert max_err(x, y) < 1e-6
    t = torch.where(targets == -100, 0, targets)
    lp64, _ = logprobs_reference(hidden, weight, t, bias=b, dtype=torch.float64)
    live = targets != -100
    assert max_err(out[True][0][live], lp64[live]) < 1e-4


def test_deterministic():
    """No atomics: the same inputs give bitwise the same outputs and gradients."""
    hidden, weight, b, targets = make_inputs(40, 32, 500, torch.bfloat16)
    a, c = loss_weights(targets.shape)
    runs = []
    for _ in range(2):
        lp, en = fastrl.fused_logprobs(hidden, weight, targets, bias=b, backend=SM90)
        runs.append((lp, en) + grads(lp, en, a, c, [hidden, weight, b]))
    for x, y in zip(*runs):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", [
    PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01),
    PolicyLossConfig(loss_type="grpo", importance_sampling_level="sequence", delta=1.5, beta=0.04, kl_estimator="k1"),
], ids=["dapo-k3-entropy", "grpo-seq-delta-k1"])
def test_one_pass_loss_on_scaled_exps(config, dtype, monkeypatch):
    """policy_loss on triton-sm90 takes the one-pass path on the scaled-exp tile and matches float64."""
    calls = []
    real = one_pass_mod.run
    monkeypatch.setattr(one_pass_mod, "run", lambda *a, **k: calls.append(a[5]) or real(*a, **k))
    stats = []
    real_stats = sm90.chunk_stats
    monkeypatch.setattr(sm90, "chunk_stats", lambda *a, **k: stats.append(1) or real_stats(*a, **k))
    batch = make_batch(dtype=dtype, seed=7)
    got = fused(batch, config, SM90)
    assert calls == [SM90] and stats, "the loss did not run one pass on the scaled-exp tile"
    want, same = reference(batch, config), reference(batch, config, dtype=None)
    if dtype == torch.float32:
        assert_matches(got, want, same, config.loss_type)
    else:  # bf16: no worse than PyTorch at bf16 (the gradients are bf16 either way)
        assert abs(got[0].item() - want[0].item()) <= abs(same[0].item() - want[0].item()) + 1e-5
        for gf, g64, gt in zip(got[2], want[2], same[2]):
            rel = lambda x: ((x.double() - g64.double()).abs().max() / g64.double().abs().max()).item()  # noqa: E731
            assert rel(gf) <= rel(gt) + 2**-8


def test_refusals_name_what_is_wrong():
    assert SM90 in BACKENDS and SM90 in CONCRETE
    assert resolve_backend(torch.device("cpu"), SM90) == SM90
    assert resolve_backend(torch.device("cpu")) != SM90  # auto never picks it
    hidden, weight, _, targets = make_inputs(8, 31, 100, torch.bfloat16, bias=False)  # rows of 62 bytes
    with pytest.raises(ValueError, match="multiple of 8"):
        fastrl.fused_logprobs(hidden, weight, targets, backend=SM90)


def test_launch_table_has_every_case():
    for kernel in ("sm90_stats", "sm90_exp_stats", "sm90_grad"):
        for family in ("sm90", "other", "interpreter"):
            for variant in ("default", "softcap", "bias", "fp32"):
                cfg = tuning.CONFIGS[(kernel, family, True, variant)]
                assert cfg.block_v % 2 == 0  # the epilogues store column halves
        assert tuning.candidates(kernel) and tuning.CONFIGS[(kernel, "sm90", True, "default")] is not None
    assert tuning.candidates("stats") == tuning.CANDIDATES


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype, tf", [(torch.float32, "all"), (torch.bfloat16, "plain")], ids=["fp32-all", "bf16"])
def test_divergence_against_float64(beta, dtype, tf):
    """fused_divergence on triton-sm90: both heads' tiles in registers (forward KL, the JSD's two passes, reverse KL),
    the student's G from recomputed tiles; teacher wider than the student, V off the tile."""
    from test_divergence import check_against_float64 as check_divergence

    check_divergence(beta, dtype=dtype, tf=tf, backend=SM90, H=16, Ht=24, V=300)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_divergence_masked_batched_several_blocks_per_split(beta):
    """V = 1000: each of the 4 interpreted programs' splits walks two vocabulary blocks (the in-kernel re-basing of
    every sum, the cross term with both shifts) before the splits are merged."""
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(3, 11, generator=g) > 0.3
    from test_divergence import check_against_float64 as check_divergence

    check_divergence(beta, lead=(3, 11), mask=mask, H=12, Ht=40, V=1000, tf="all", backend=SM90)


@pytest.mark.parametrize("chunk_tokens", [None, 4], ids=["one-chunk", "4-token-chunks"])
def test_one_pass_chunks_and_the_weight_gradient(chunk_tokens, monkeypatch):
    """The one-pass loss in one chunk (what budget.one_pass_rows gives W1 on an 80 GB device): grad_W is one GEMM
    written once, so the weight-gradient sum (bf16: the compensated pair, compensated_addmm_) never runs; in several
    chunks it runs once per chunk. Both against float64 (bf16, dapo with k3 KL and entropy, a fully masked row)."""
    adds, stats = [], []
    real_add, real_stats = one_pass_mod.compensated_addmm_, sm90.chunk_stats
    monkeypatch.setattr(one_pass_mod, "compensated_addmm_",
                        lambda hi, lo, a, b, t: adds.append(tuple(hi.shape)) or real_add(hi, lo, a, b, t))
    monkeypatch.setattr(sm90, "chunk_stats", lambda *a, **k: stats.append(a[1].shape[0]) or real_stats(*a, **k))
    config = PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)
    batch = make_batch(dtype=torch.bfloat16, seed=11)
    got = fused(batch, config, SM90, chunk_tokens=chunk_tokens)
    live = int(batch["mask"].sum())
    V, H = batch["weight"].shape
    if chunk_tokens is None:  # the CPU row of the budget holds these 21 tokens in one chunk
        assert stats == [live] and adds == []
    else:
        assert stats == [min(4, live - c0) for c0 in range(0, live, 4)] and adds == [(V, H)] * len(stats)
    want, same = reference(batch, config), reference(batch, config, dtype=None)
    assert abs(got[0].item() - want[0].item()) <= abs(same[0].item() - want[0].item()) + 1e-5
    for gf, g64, gt in zip(got[2], want[2], same[2]):
        rel = lambda x: ((x.double() - g64.double()).abs().max() / g64.double().abs().max()).item()  # noqa: E731
        assert rel(gf) <= rel(gt) + 2**-8


def test_backward_slices_sized_by_device_memory(monkeypatch):
    """Path A's backward takes its slice width from budget.grad_columns (1/128 of the device's memory): a memory that
    leaves 256-column slices (3 at V=700, seams inside the kernel's blocks) and one that holds the vocabulary in one
    slice; gradients against float64 both times."""
    from fastrl.ops import budget

    slices = []
    real = PG.persistent_grad_block
    monkeypatch.setattr(PG, "persistent_grad_block", lambda *a, **k: slices.append(a[4]) or real(*a, **k))
    N, V = 47, 700
    for total, want in ((128 * N * 256 * 2, [0, 256, 512]), (1 << 40, [0])):
        monkeypatch.setattr(sm90, "grad_columns", lambda rows, V, dtype, device, t=total, **kw: budget.grad_columns(
            rows, V, dtype, total_memory=t))
        slices.clear()
        check_against_float64(SM90, torch.bfloat16, N, 40, V, bias=True)
        assert slices == want
