"""Masked rows skipped on the no-sync path (``torch.compile(fullgraph=True)``, ``host_sync=False``): the GEMMs see the
live rows alone where their count is read without a synchronisation (rows in host memory: ``fastrl.ops.live``).

* Counted where the products run: every ``aten::mm`` / ``aten::addmm`` the profiler records while a compiled call
  runs forward and backward (inside fastrl's ops too), as multiply-adds; they must equal ``k * live * H * V`` with
  ``k`` the path's GEMMs per row (one pass: forward, grad_h, grad_W = 3; two passes and ``fused_logprobs``: 4; the
  exact KL inside the chunks adds the reference's forward). Masks: half of every sequence, none, all, the middle of
  every sequence; the torch backend, and the Triton hybrid backend under the interpreter (real block sizes).
* Compiled equals eager (which drops the masked rows with a host sync): loss, metrics and gradients, bitwise where the
  same rows meet the same GEMMs in the same order, else within float32 rounding (<= 1e-6 relative).
* Masked rows give what they gave before: 0 log-prob and entropy, exactly 0 gradient rows, even when their hidden
  state holds NaN. On a device the count is never read (``tests/test_compile.py``'s host-read recorder, with the
  count treated as on a device): the backends whose GEMMs run in Triton (triton-fused, triton-sm90) sort the rows
  live-first and hand the kernels the live count as a device tensor, so dead row blocks skip their GEMM (counted as
  the tiles ``dot_tile`` computes); the others compute every row, as the last test shows by counting.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fastrl
from fastrl import PolicyLossConfig
from fastrl.kernels import linear_logprob as kernels_lp
from fastrl.kernels import persistent_grad, persistent_stats
from fastrl.kernels.tuning import config_for
from fastrl.ops import linear_logprob as op_lp
from fastrl.ops import live
from fastrl.reference import logprobs_reference

B, T, H, V = 4, 10, 24, 200  # B*T = 40 rows: no dimension of a GEMM is ambiguous
# the torch backend's GEMMs run over fixed 128-row blocks, the last one padded (batch invariance, docs/functions.md
# "Reproducibility"): its counts use sequences whose live rows fill whole blocks (2 x 256 rows, 256 or 512 live)
BIG = (2, 256)
REL = 1e-6
DAPO = PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01, temperature=0.7)
GSPO = PolicyLossConfig(loss_type="grpo", temperature=0.7, importance_sampling_level="sequence")  # whole sequences
TWO_PASS = PolicyLossConfig(loss_type="dapo", temperature=0.7, top_entropy_quantile=0.5)  # path A
EXACT = PolicyLossConfig(loss_type="grpo", beta=0.04, kl_estimator="exact", temperature=0.7)


def masks(b: int = B, t: int = T) -> dict[str, torch.Tensor]:
    full = torch.ones(b, t, dtype=torch.bool)
    half, middle = full.clone(), full.clone()
    half[:, t // 2:] = False
    middle[:, t // 4: 3 * t // 4] = False
    return {"half": half, "none": full, "all": torch.zeros(B, T, dtype=torch.bool), "middle": middle}


def inputs(mask: torch.Tensor, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    B, T = mask.shape
    h = torch.randn(B, T, H, generator=g)
    h[~mask] = float("nan")  # whatever a masked row holds must reach nothing
    return dict(h=h, w=0.3 * torch.randn(V, H, generator=g), bias=0.1 * torch.randn(V, generator=g),
                targets=torch.randint(0, V, (B, T), generator=g), mask=mask, adv=torch.randn(B, generator=g),
                old=-5.0 + 0.3 * torch.randn(B, T, generator=g), ref_h=torch.randn(B, T, H, generator=g))


def gemm_macs(fn) -> int:
    """Multiply-adds of every GEMM ``fn`` runs (the profiler's recorded shapes, inside custom ops too)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    total = 0
    for e in prof.events():
        if e.name == "aten::mm":
            a, b = e.input_shapes[0], e.input_shapes[1]
        elif e.name in ("aten::addmm", "aten::addmm_"):
            a, b = e.input_shapes[1], e.input_shapes[2]
        else:
            continue
        total += a[0] * a[1] * b[1]
    return total


def loss_step(config: PolicyLossConfig, backend: str = "torch", host_sync=None):
    def step(h, w, bias, targets, mask, adv, old, ref_h):
        ref = (dict(ref_hidden=ref_h, ref_weight=w.detach()) if config.kl_estimator == "exact"
               else dict(ref_logprobs=old - 0.1) if config.beta else {})
        loss, metrics = fastrl.policy_loss(h, w, targets, adv, mask, config=config, old_logprobs=old, bias=bias,
                                           softcap=4.0, backend=backend, check_finite=False, host_sync=host_sync,
                                           **ref)
        return loss, tuple(metrics.values())

    return step


def logprob_step(backend: str = "torch"):
    def step(h, w, bias, targets, mask, adv, old, ref_h):
        lp, ent = fastrl.fused_logprobs(h, w, torch.where(mask, targets, -100), bias=bias, temperature=0.7,
                                        softcap=4.0, backend=backend, check_finite=False)
        return lp.sum() + 0.3 * ent.sum(), (lp, ent)

    return step


def run(fn, x: dict):
    """(first output, other outputs, gradients of hidden, weight, bias) of fn's forward and backward."""
    leaves = [x[k].clone().requires_grad_() for k in ("h", "w", "bias")]
    out, rest = fn(*leaves, x["targets"], x["mask"], x["adv"], x["old"], x["ref_h"])
    out.backward()
    return out.detach(), tuple(r.detach() for r in rest), tuple(t.grad for t in leaves)


def assert_close(got, want, what: str) -> None:
    for i, (g, e) in enumerate(zip(got, want)):
        if torch.equal(g, e):
            continue
        both_nan = torch.isnan(g) & torch.isnan(e)
        err = (g.double() - e.double()).abs().masked_fill(both_nan, 0).max()
        scale = e.double().abs().nan_to_num().max().clamp(min=1e-30)
        assert err / scale <= REL, f"{what} [{i}]: compiled differs from eager by {float(err / scale):.2e} relative"


CASES = {  # name: (step, GEMMs per live row (in units of H * V))
    "one-pass": (loss_step(DAPO), 3),
    "one-pass-sequences": (loss_step(GSPO), 3),
    "two-pass": (loss_step(TWO_PASS), 4),
    "exact-kl-inside": (loss_step(EXACT), 4),
    "fused_logprobs": (logprob_step(), 4),
}


@pytest.mark.parametrize("mask_name", list(masks()))
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_gemms_see_live_rows_only(case, mask_name):
    torch._dynamo.reset()
    step, per_row = CASES[case]
    x = inputs(masks(*BIG)[mask_name])
    compiled = torch.compile(step, fullgraph=True)
    run(compiled, x)  # compiles
    got = {}
    macs = gemm_macs(lambda: got.setdefault("r", run(compiled, x)))
    live_rows = int(x["mask"].sum())
    assert macs == per_row * live_rows * H * V, (
        f"{case}, {mask_name} masked: the GEMMs computed {macs / (H * V):g} row-products, expected {per_row} x "
        f"{live_rows} live rows")
    out, rest, grads = got["r"]
    e_out, e_rest, e_grads = run(step, x)  # eager: masked rows dropped with a host sync
    assert_close((out, *rest, *grads), (e_out, *e_rest, *e_grads), f"{case}, {mask_name} masked")
    masked = ~x["mask"]
    assert torch.isfinite(grads[1]).all() and (grads[0][masked] == 0).all(), "a masked row reached a gradient"
    if case == "fused_logprobs":
        assert (rest[0][masked] == 0).all() and (rest[1][masked] == 0).all()


@pytest.mark.parametrize("mask_name", ("half", "middle"))
def test_host_sync_false_eager_skips_masked_rows(mask_name):
    """``host_sync=False`` in eager is the compiled path: the same GEMMs."""
    x = inputs(masks(*BIG)[mask_name])
    step = loss_step(DAPO, host_sync=False)
    got = {}
    macs = gemm_macs(lambda: got.setdefault("r", run(step, x)))
    assert macs == 3 * int(x["mask"].sum()) * H * V
    want = run(loss_step(DAPO), x)
    assert_close((got["r"][0], *got["r"][2]), (want[0], *want[2]), f"host_sync=False, {mask_name} masked")


@pytest.mark.interpreter
@pytest.mark.parametrize("mask_name", ("half", "middle"))
@pytest.mark.parametrize("kind", ("loss", "logprobs"))
def test_triton_hybrid_compiled_skips_masked_rows(kind, mask_name):
    """The hybrid backend (cuBLAS-style GEMMs + Triton folds, interpreted) compiled: the same GEMM count and values."""
    torch._dynamo.reset()
    step, per_row = (loss_step(DAPO, "triton-hybrid"), 3) if kind == "loss" else (logprob_step("triton-hybrid"), 4)
    x = inputs(masks()[mask_name])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    run(compiled, x)
    got = {}
    macs = gemm_macs(lambda: got.setdefault("r", run(compiled, x)))
    assert macs == per_row * int(x["mask"].sum()) * H * V
    out, rest, grads = got["r"]
    e_out, e_rest, e_grads = run(step, x)
    assert_close((out, *rest, *grads), (e_out, *e_rest, *e_grads), f"triton-hybrid {kind}, {mask_name} masked")


def test_divergence_no_sync_skips_masked_rows(monkeypatch):
    """``fused_divergence(host_sync=False)``: its GEMMs are those of every row computed, scaled by live / all rows."""
    x = inputs(masks(*BIG)["middle"])

    def div(mask, host_sync):
        h = x["h"].clone().requires_grad_()
        d = fastrl.fused_divergence(h, x["w"], x["ref_h"], x["w"] * 0.9, beta=0.5, mask=mask, host_sync=host_sync,
                                    check_finite=False)
        d.sum().backward()
        return h.grad

    got = {}
    macs = gemm_macs(lambda: got.setdefault("g", div(x["mask"], False)))
    want = div(x["mask"], None)  # eager: masked rows dropped with a host sync
    assert_close((got["g"],), (want,), "divergence host_sync=False")
    assert (got["g"][~x["mask"]] == 0).all()
    monkeypatch.setattr(live, "count_readable", lambda device: False)  # as on a device: every row computed
    every = gemm_macs(lambda: div(x["mask"], False))
    assert macs > 0 and macs * x["mask"].numel() == every * int(x["mask"].sum()), (macs, every)


def test_on_a_device_every_row_is_computed(monkeypatch):
    """Where the count would need a synchronisation (rows on a device) it is never read: every row is computed
    (masked ones zeroed), and the values are the same."""
    x = inputs(masks(*BIG)["half"])
    step = loss_step(DAPO, host_sync=False)
    want = run(step, x)
    monkeypatch.setattr(live, "count_readable", lambda device: False)
    got = {}
    macs = gemm_macs(lambda: got.setdefault("r", run(step, x)))
    assert macs == 3 * x["mask"].numel() * H * V
    assert_close((got["r"][0], *got["r"][2]), (want[0], *want[2]), "every row computed")


# Triton's real block sizes under the interpreter (64-row blocks): 3 row blocks, 3 vocabulary blocks
TB, TT, TH, TV = 8, 24, 32, 300


def device_masks() -> dict[str, torch.Tensor]:
    full = torch.ones(TB, TT, dtype=torch.bool)
    half, middle = full.clone(), full.clone()
    half[:, TT // 2:] = False  # 96 live rows spread over every block: sorted, they fill blocks 0 and 1
    middle[:, 5:19] = False
    return {"half": half, "none": full, "all": torch.zeros(TB, TT, dtype=torch.bool), "middle": middle}


@pytest.fixture
def tiles(monkeypatch):
    """Counts the logit tiles the Triton kernels compute (each ``dot_tile`` call is one [BLOCK_N, BLOCK_V] GEMM tile;
    under the interpreter a kernel looks its helpers up in its module when it runs)."""
    count = [0]
    real = kernels_lp.dot_tile

    def counted(*args):
        count[0] += 1
        return real(*args)

    for mod in (kernels_lp, persistent_stats, persistent_grad):
        monkeypatch.setattr(mod, "dot_tile", counted)
    return count


def device_inputs(mask: torch.Tensor):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(TB, TT, TH, generator=g)
    h[~mask] = float("nan")  # whatever a masked row holds must reach nothing
    w, b = 0.3 * torch.randn(TV, TH, generator=g), 0.1 * torch.randn(TV, generator=g)
    return h, w, b, torch.where(mask, torch.randint(0, TV, (TB, TT), generator=g), -100)


def device_step(backend: str, host_sync):
    def step(h, w, b, targets):
        lp, ent = fastrl.fused_logprobs(h, w, targets, bias=b, temperature=0.7, softcap=4.0, backend=backend,
                                        check_finite=False, host_sync=host_sync)
        return lp.sum() + 0.3 * ent.sum(), lp, ent

    return step


def device_run(backend: str, mask: torch.Tensor, host_sync, step=None):
    """((logp, entropy, grad hidden, grad weight, grad bias), the inputs) of a forward and backward."""
    inputs = device_inputs(mask)
    leaves = [x.clone().requires_grad_() for x in inputs[:3]]
    loss, lp, ent = (step or device_step(backend, host_sync))(*leaves, inputs[3])
    loss.backward()
    return (lp.detach(), ent.detach(), *(x.grad for x in leaves)), inputs


@pytest.mark.interpreter
@pytest.mark.parametrize("mask_name", list(device_masks()))
@pytest.mark.parametrize("backend", ("triton-fused", "triton-sm90"))
def test_device_count_skips_dead_row_blocks(backend, mask_name, tiles, monkeypatch):
    """Rows on a device (the count unreadable), no-sync path, Triton GEMMs: the rows are sorted live-first and every
    program or persistent work item past the live count skips its GEMM (forward statistics and backward G); results
    equal eager's (which drops the masked rows with a host sync), masked rows exactly 0, NaN there reaches nothing."""
    mask = device_masks()[mask_name]
    want, (h, w, b, targets) = device_run(backend, mask, None)  # eager: the masked rows compacted away
    monkeypatch.setattr(live, "count_readable", lambda device: False)  # as on a device
    tiles[0] = 0
    got, _ = device_run(backend, mask, False)
    computed = tiles[0]
    monkeypatch.setattr(op_lp, "SKIPS_DEAD_ROWS", ())  # the same call computing every row (what cuBLAS paths do)
    tiles[0] = 0
    device_run(backend, mask, False)
    every = tiles[0]

    cfg = config_for("sm90_stats" if backend == "triton-sm90" else "stats", h.device, H=TH, V=TV, dtype=h.dtype,
                     use_tma=True)
    blocks, live_blocks = -(-mask.numel() // cfg.block_n), -(-int(mask.sum()) // cfg.block_n)
    v_blocks = -(-TV // cfg.block_v)
    assert every == 2 * blocks * v_blocks, (every, blocks, v_blocks)  # forward + backward G, every tile
    assert computed == 2 * live_blocks * v_blocks, (
        f"{backend}, {mask_name} masked: {computed} tiles computed, expected {2 * live_blocks * v_blocks} "
        f"({live_blocks} live row blocks of {blocks})")
    assert_close(got, want, f"{backend} device count, {mask_name} masked")
    masked = ~mask
    assert (got[0][masked] == 0).all() and (got[1][masked] == 0).all() and (got[2][masked] == 0).all()
    assert all(torch.isfinite(x).all() for x in got[1:3] + got[3:])
    if mask.any():  # against float64 (the live rows)
        lp64, ent64 = logprobs_reference(torch.where(mask[..., None], h, 0.0), w, targets, bias=b, temperature=0.7,
                                         softcap=4.0, dtype=torch.float64)
        for x, ref in ((got[0], lp64), (got[1], ent64)):
            assert (x[mask].double() - ref[mask]).abs().max() < 1e-5


@pytest.mark.interpreter
def test_device_count_compiled_sm90(tiles, monkeypatch):
    """The same under ``torch.compile(fullgraph=True)``: no graph break, dead blocks skipped, eager's values."""
    torch._dynamo.reset()
    mask = device_masks()["middle"]
    want, _ = device_run("triton-sm90", mask, None)
    monkeypatch.setattr(live, "count_readable", lambda device: False)
    compiled = torch.compile(device_step("triton-sm90", None), fullgraph=True, backend="aot_eager")
    device_run("triton-sm90", mask, None, compiled)
    tiles[0] = 0
    got, _ = device_run("triton-sm90", mask, None, compiled)
    assert tiles[0] == 2 * -(-int(mask.sum()) // 64) * -(-TV // 128), tiles[0]
    assert_close(got, want, "triton-sm90 compiled, device count")


@pytest.mark.interpreter
@pytest.mark.parametrize("mask_name", list(device_masks()))
def test_device_count_one_pass_sm90(mask_name, tiles, monkeypatch):
    """The one-pass loss on triton-sm90 with the count on a device (token chunks): every row sorted live-first, the
    forward kernel's dead row blocks skipped (its gradient comes from the stored exps, no GEMM in Triton); loss,
    metrics and gradients equal eager's, masked gradient rows exactly 0, and no op reads the host."""
    mask = device_masks()[mask_name]
    g = torch.Generator().manual_seed(2)
    h, w, b, targets = device_inputs(mask)
    adv, old = torch.randn(TB, generator=g), -5.0 + 0.3 * torch.randn(TB, TT, generator=g)

    def run_loss():
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]
        loss, metrics = fastrl.policy_loss(leaves[0], leaves[1], targets.clamp(min=0), adv, mask, config=DAPO,
                                           old_logprobs=old, ref_logprobs=old - 0.1, bias=leaves[2], softcap=4.0,
                                           backend="triton-sm90", check_finite=False, host_sync=False)
        loss.backward()
        return (loss.detach(), *(m.detach() for m in metrics.values()), *(x.grad for x in leaves))

    want = run_loss()  # on CPU tensors: the live rows alone, found by reading the count
    monkeypatch.setattr(live, "count_readable", lambda device: False)
    tiles[0] = 0
    from test_compile import SYNC_OPS, RecordOps

    with RecordOps() as rec:
        got = run_loss()
    assert "fastrl.policy_loss_one_pass" in rec.ops and not set(SYNC_OPS) & rec.ops, set(SYNC_OPS) & rec.ops
    assert tiles[0] == -(-int(mask.sum()) // 64) * -(-TV // 128), f"{mask_name}: {tiles[0]} tiles"
    assert_close(got, want, f"one-pass triton-sm90 device count, {mask_name} masked")
    assert (got[-3][~mask] == 0).all() and torch.isfinite(got[-2]).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ("triton-fused", "triton-sm90"))
def test_device_count_reads_nothing_on_the_host(backend, monkeypatch):
    """The device path (sort, count, kernels' early exits, scatter back) runs no op that reads a device value on the
    host (``tests/test_compile.py``'s recorder: CUDA-graph safe)."""
    from test_compile import SYNC_OPS, RecordOps

    mask = device_masks()["middle"]
    monkeypatch.setattr(live, "count_readable", lambda device: False)
    with RecordOps() as rec:
        device_run(backend, mask, False)
    assert "fastrl.linear_logprob" in rec.ops and "aten.sort" in rec.ops
    assert not set(SYNC_OPS) & rec.ops, f"host reads on the device path: {set(SYNC_OPS) & rec.ops}"


@pytest.mark.interpreter
@pytest.mark.parametrize("mask_name", ("half", "middle"))
def test_device_count_sm90_row_chunks(mask_name, tiles, monkeypatch):
    """sm90's backward over row chunks (``MAX_ROWS`` rows each): each chunk's kernels get its own live count."""
    from fastrl.ops import sm90

    mask = device_masks()[mask_name]
    want, _ = device_run("triton-sm90", mask, None)
    monkeypatch.setattr(live, "count_readable", lambda device: False)
    monkeypatch.setattr(sm90, "MAX_ROWS", 64)  # 3 chunks of one row block each
    tiles[0] = 0
    got, _ = device_run("triton-sm90", mask, False)
    assert tiles[0] == 2 * -(-int(mask.sum()) // 64) * -(-TV // 128), tiles[0]
    assert_close(got, want, f"triton-sm90 row chunks, {mask_name} masked")
