"""The GPU workloads and targets of `python -m bench gpu`, checked on made-up rows (nothing is timed here)."""

from rich.console import Console

from bench import __main__ as cli
from bench import workloads as W


def test_gpu_workloads_include_the_loss_sweeps_and_the_frozen_head():
    wls = {w.name: w for w in W.gpu_workloads()}
    for base, h in (("W1", 4096), ("W2", 896)):
        for n in W.SWEEP_LOSS_TOKENS:
            w = wls[f"{base}-{n}"]
            assert (w.kind, w.N, w.H, w.T, w.group) == ("loss", n, h, 1024, f"sweep-loss-h{h}")
    # the 16k points are W1 / W2 themselves (same shape: the runner measures them once)
    assert (wls["W1-16384"].N, wls["W1-16384"].batch) == (wls["W1"].N, wls["W1"].batch)
    frozen = wls["W1-frozen"]
    assert frozen.frozen_head and W.flops(frozen, "total") == 4.0 * frozen.N * frozen.H * frozen.V


def _row(wl, prov, **kw):
    return dict(workload=wl, group="sweep-loss-h896" if wl.startswith("W2-") else "core", provider=prov,
                status="ok", **kw)


def test_gpu_targets_pass_fail_and_missing():
    rows = [
        _row("W1", "trl", peak_extra_mb=2900.0, time_vs_trl=1.0, mem_vs_trl=1.0),
        _row("W1", "fastrl-fused", peak_extra_mb=3600.0, time_vs_trl=0.80, mem_vs_trl=1.24),
        _row("W1-frozen", "fastrl-fused", peak_extra_mb=300.0, time_vs_trl=0.5, mem_vs_trl=0.9),
        _row("W2-2048", "fastrl-fused", peak_extra_mb=100.0, time_vs_trl=0.84),
    ]
    res = cli._gpu_targets(rows, Console(file=open("/dev/null", "w")))
    w1 = {r["ratio"]: r for r in res["W1"]}
    assert not w1["time_vs_trl"]["pass"] and w1["mem_vs_trl"]["pass"]
    frozen = res["W1-frozen"][0]  # against TRL's W1 extra peak: 300 / 2900
    assert abs(frozen["value"] - 300 / 2900) < 1e-12 and frozen["pass"]
    assert res["W2-2048"][0]["pass"]
    assert "W3" not in res  # no rows: nothing claimed


def test_targets_over_staged_runs(tmp_path):
    """`python -m bench targets`: rows of a finished run (JSON) and of a run stopped part-way (rows.jsonl, no
    ratios yet) give the same verdicts as one run; ratios only against the TRL row of the same run."""
    import io
    import json
    from argparse import Namespace

    def row(wl, prov, ms, mb):
        return dict(workload=wl, group="core", provider=prov, status="ok", total_ms={"median": ms}, peak_extra_mb=mb)

    (tmp_path / "check").mkdir()
    (tmp_path / "check" / "gpu.json").write_text(json.dumps({"rows": [
        dict(workload="W1", group="floor", provider="matmul", status="ok"),
        row("W1", "trl", 132.0, 2900.0), row("W1", "fastrl-fused", 95.0, 3600.0),
        row("W1-frozen", "fastrl-fused", 90.0, 290.0)]}))
    # that run finished, so its rows log is there too: read once, through its JSON
    (tmp_path / "check" / "gpu.rows.jsonl").write_text(json.dumps(row("W1", "fastrl-fused", 999.0, 1.0)))
    # a later stage, stopped by its time limit: only its rows file; its W2 is compared with its own TRL row
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "gpu.rows.jsonl").write_text("\n".join(json.dumps(r) for r in (
        row("W2", "trl", 35.0, 700.0), row("W2", "fastrl-fused", 31.5, 800.0), row("W2", "fastrl-tfused", 28.0, 90.0),
        row("W3", "fastrl", 30.0, 10.0))))
    out = io.StringIO()
    assert cli._targets_command(Namespace(paths=[str(tmp_path)]), "cpu", Console(file=out, width=200)) == 0
    text = out.getvalue()
    assert "gpu.rows.jsonl: 1 rows" not in text and "0.72x" in text and "7.57x" not in text
    assert "W1: fastrl-fused time vs trl = 0.72x (target <= 0.75x): PASS" in text
    assert "W1: fastrl-fused mem vs trl = 1.24x (target <= 1.50x): PASS" in text
    assert "W1-frozen: fastrl-fused mem vs trl at W1 = 0.10x (target <= 0.20x): PASS" in text
    assert "W2: fastrl-fused time vs trl = 0.90x (target <= 0.85x): FAIL" in text
    assert "W3: fastrl time vs trl: not evaluated (no TRL row to compare with)" in text
    # which of fastrl's paths is fastest at each shape, within each run
    assert "W2 fastest fastrl path: fastrl-tfused 0.80x, fastrl-fused 0.90x (vs trl)" in text
    assert "W1 fastest fastrl path: fastrl-fused 0.72x (vs trl)" in text
    assert "W3 fastest" not in text
    assert cli._targets_command(Namespace(paths=[str(tmp_path / "none")]), "cpu", Console(file=out)) == 2


def test_keptset_points_and_one_point_in_process():
    """`python -m bench keptset`: its points (K 20/64/512 x Zipf/disjoint sets, the full path, the rule, the fixed
    plan, the policy loss with and without a support) and one tiny point measured in this process (the CLI runs
    each in a fresh one)."""
    import torch

    from bench import keptset

    pts = keptset.points("cpu", smoke=False, quick=False)
    kept = {(p["K"], p["sets"]) for p in pts if p["mode"] == "kept"}
    assert kept == {(k, s) for k in (20, 64, 512) for s in ("zipf", "uniform")}
    assert {p["mode"] for p in pts} == {"full", "kept", "rule", "replay", "rule-p", "nosync", "loss", "loss-kept"}
    assert all(p["V"] == 151936 for p in pts)
    assert {p["shape"] for p in keptset.points("cuda", False, False)} == {"W1-kept", "W2-kept"}
    ks, targets = keptset.make_sets(50, 300, 7, "zipf", torch.device("cpu"))
    assert ks.sizes().eq(7).all() and ks.contains(targets).all()
    spec = {**keptset.points("cpu", smoke=True, quick=False)[1], "reps": 1, "warmup": 0}
    res = keptset.run_point(spec)
    assert res["ms"] > 0 and res["chunks"] >= 1 and 0 < res["union_work_vs_full"] <= 1
    replay = next(p for p in keptset.points("cpu", smoke=True, quick=False) if p["mode"] == "replay")
    assert keptset.run_point({**replay, "reps": 1, "warmup": 0})["ms"] > 0
