"""The benchmark rows of issues 26 and 34 (kept-set engine and its plans, exact KL), one tiny point each, measured in this process (the
CLIs run each point in a fresh one): ``bench keptset``'s fixed-plan and policy-loss rows, ``bench divergence``'s
disjoint K=64 support row and its exact-KL vs k3 rows, and the ratios and targets the CLIs derive from them."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from bench import divergence, keptset
from bench.lmhead import add_ratios


@pytest.mark.parametrize("mode", ["nosync", "loss", "loss-kept"])
def test_keptset_new_rows_run(mode):
    spec = next(p for p in keptset.points("cpu", smoke=True, quick=False) if p["mode"] == mode)
    res = keptset.run_point({**spec, "reps": 1, "warmup": 0})
    assert res["ms"] > 0 and res["kept_mean"] == spec["K"]


@pytest.mark.parametrize("sets", keptset.KINDS)
@pytest.mark.parametrize("mode, kind, plan", [("kept", None, "rows"), ("kept", "union", "union-host"),
                                              ("nosync", None, "rows"), ("nosync", "union", "union-fixed")])
def test_keptset_plan_rows(mode, kind, plan, sets):
    """Issue 34: both plans on both kinds of sets, eager and without host reads, each row naming the plan it ran and
    its logits per token (the per-row plan: K); the full run has them all at K=64, the GPU session both plans."""
    smoke = keptset.points("cpu", smoke=True, quick=False)
    spec = next(p for p in smoke if p["mode"] == mode and p["sets"] == sets and p.get("plan_kind") == kind
                and p["K"] == 20)
    res = keptset.run_point({**spec, "reps": 1, "warmup": 0})
    assert res["ms"] > 0 and res["plan"] == plan, res.get("plan_text")
    if plan == "rows":
        assert res["logits_per_token"] == spec["K"]
    else:
        assert res["logits_per_token"] > spec["K"]
    full = {(p["mode"], p["sets"], p.get("plan_kind")) for p in keptset.points("cpu", False, True) if p["K"] == 64}
    assert full >= {(m, s, k) for m in keptset.KEPT_MODES for s in keptset.KINDS for k in (None, "union")}
    session = [p for _, p in keptset.session_points(smoke=False)]
    assert {(p["mode"], p["sets"], p.get("plan_kind")) for p in session} >= {
        ("kept", s, k) for s in keptset.KINDS for k in (None, "union")}


def test_divergence_kept_support_is_disjoint_and_measured():
    wl = divergence.workloads("cpu", smoke=True, betas=(0.5,))[0]
    x = divergence.make_inputs(wl, torch.device("cpu"), seed=1)
    ks = x["support"]
    assert len(ks) == wl.N and ks.sizes().eq(divergence.KEPT_K).all()
    if wl.N * divergence.KEPT_K <= wl.V:
        assert torch.unique(ks.ids).numel() == ks.ids.numel()  # disjoint
    spec = {"workload": asdict(wl), "provider": "fastrl-kept64", "device": "cpu", "reps": 1, "warmup": 0,
            "n_sets": 1, "seed": 1, "accuracy_rows": 16}
    res = divergence.run_point(spec)
    assert res["status"] == "ok" and res["div_max_abs_err"] < 1e-5  # over the support, against float64


def test_exact_kl_rows_and_targets():
    (wl,) = divergence.kl_workloads("cpu", smoke=True)
    assert divergence.providers_for(wl, list(divergence.PROVIDERS)) == ["k3", "exact"]
    rows = []
    for p in ("k3", "exact"):
        spec = {"workload": asdict(wl), "provider": p, "device": "cpu", "reps": 1, "warmup": 1, "n_sets": 1,
                "seed": 1}
        rows.append({"workload": wl.name, "provider": p, **asdict(wl), **divergence.run_point(spec)})
    assert all(r["status"] == "ok" for r in rows)
    add_ratios(rows, divergence.REFERENCES)
    exact = rows[1]
    assert exact["time_vs_k3"] == pytest.approx(exact["total_ms"]["median"] / rows[0]["total_ms"]["median"])
    inter = exact["interleaved"]  # k3 and exact alternately in the exact row's process: the ratio judged
    pairs = sorted(e / k for e, k in zip(inter["exact_all_ms"], inter["k3_all_ms"]))
    assert inter["reps"] >= 5 and inter["ratio"] == pytest.approx(pairs[len(pairs) // 2])
    tg = divergence.targets(rows, "cpu")[f"{wl.name}: exact time vs k3's"]
    assert tg["target"] == divergence.EXACT_KL_TARGET and tg["value"] == inter["ratio"]
    assert tg["pass"] == (inter["ratio"] <= divergence.EXACT_KL_TARGET)
