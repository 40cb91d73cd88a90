"""The benchmark CLI end to end at tiny shapes: it runs, prints its table, writes JSON and CSV.

Nothing here times or compares speed (CI has 2 cores and no GPU); it only checks the plumbing: every
provider x workload gets a row (measured, or skipped / not applicable with a reason), no row is an error,
and the files a real run would write are there.
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
# three that run, two that say why they cannot here (not installed / CUDA only, or not applicable)
PROVIDERS = ["fastrl", "fastrl-fused", "torch", "liger-triton", "cce"]


def test_bench_cli_smoke(tmp_path):
    # measure what users run: not Triton's interpreter, which tests/conftest.py turns on for this process
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "bench", "--smoke", "--device", "cpu", "--providers", ",".join(PROVIDERS),
           "--workload", "C1,W1,sweep-tokens", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"

    # the summary table comes after the per-measurement progress lines
    header = out.rfind("  t/torch  ")  # the summary table's header row
    assert header != -1, f"no summary table in the output:\n{out[-4000:]}"
    assert out.rfind("C1-smoke") > header and "wrote" in out[header:]

    data = json.loads((tmp_path / "run-smoke.json").read_text())
    assert data["env"]["driver"] == "n/a (CPU)" and data["env"]["torch"] and data["env"]["triton"]
    rows = [r for r in data["rows"] if r["group"] != "floor"]
    by = {(r["workload"], r["provider"]): r for r in rows}
    workloads = {"C1-smoke", "C1-loss-smoke", "W1-smoke", "tokens-64", "tokens-256"}
    assert {w for w, _ in by} == workloads
    assert len(by) == len(workloads) * len(PROVIDERS), sorted(by)
    errors = [f"{w}/{p}: {r['reason']}" for (w, p), r in by.items() if r["status"] == "error"]
    assert not errors, errors
    for key in [("C1-smoke", "fastrl"), ("C1-smoke", "torch"), ("W1-smoke", "fastrl"), ("tokens-256", "fastrl"),
                ("C1-loss-smoke", "fastrl-fused"), ("C1-loss-smoke", "torch")]:
        r = by[key]
        assert r["status"] == "ok", (key, r["reason"])
        assert r["total_ms"]["median"] > 0 and r["peak_extra_mb"] is not None
    assert by[("C1-smoke", "fastrl")]["logp_max_abs_err"] < 1e-4  # float32 vs float64, 16 tokens
    assert by[("C1-smoke", "fastrl")]["time_vs_torch"] > 0  # a ratio against torch measured in the same run
    assert by[("W1-smoke", "liger-triton")]["status"] == "skipped" and by[("W1-smoke", "liger-triton")]["reason"]
    assert by[("C1-smoke", "liger-triton")]["status"] == "n/a"
    # CCE's backward refuses float32 (the smoke dtype): not applicable, with the reason, on any device
    assert by[("C1-smoke", "cce")]["status"] == "n/a" and "bf16" in by[("C1-smoke", "cce")]["reason"]
    assert by[("C1-loss-smoke", "fastrl-fused")]["loss_value"] == pytest.approx(by[("C1-loss-smoke", "torch")]["loss_value"],
                                                                                rel=1e-4, abs=1e-5)

    with open(tmp_path / "run-smoke.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(data["rows"])
    assert {"total_ms_median", "peak_extra_mb", "time_vs_torch", "device", "driver"} <= set(csv_rows[0])
    assert (tmp_path / "run-smoke-sweep-tokens.png").stat().st_size > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_cli_smoke_cuda(tmp_path):
    """`python -m bench --smoke` on a GPU: every provider gets a row, none is an error (a peer that refuses the
    smoke dtype, as Cut Cross-Entropy's backward refuses float32, is n/a with its reason), and it exits 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "bench", "--smoke", "--device", "cuda", "--workload", "C1,W1,W3",
           "--out", str(tmp_path), "--no-plots"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    rows = [r for r in json.loads((tmp_path / "run-smoke.json").read_text())["rows"] if r["group"] != "floor"]
    errors = [f"{r['workload']}/{r['provider']}: {r['reason']}" for r in rows if r["status"] == "error"]
    assert not errors, errors
    assert all(r["reason"] for r in rows if r["status"] != "ok")
    assert {r["status"] for r in rows if r["provider"] == "fastrl"} == {"ok"}


def test_divergence_bench_smoke(tmp_path):
    """`python -m bench divergence --smoke`: fastrl, TRL and torch measured in fresh processes, Liger skipped with
    the reason off CUDA, the same loss from all three, errors against float64 recorded, the JSON written."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "bench", "divergence", "--smoke", "--device", "cpu", "--beta", "0.5",
           "--providers", "fastrl,trl,liger,torch", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    rows = {r["provider"]: r for r in json.loads((tmp_path / "divergence-smoke.json").read_text())["rows"]}
    assert set(rows) == {"fastrl", "trl", "liger", "torch"}
    assert rows["liger"]["status"] == "skipped" and "CUDA" in rows["liger"]["reason"]
    for p in ("fastrl", "trl", "torch"):
        assert rows[p]["status"] == "ok", rows[p]
        assert rows[p]["loss_value"] == pytest.approx(rows["torch"]["loss_value"], rel=1e-5)
        assert rows[p]["grad_h_max_abs_err"] <= 1e-5 * rows[p]["grad_h_max_abs"]
    assert rows["fastrl"]["div_max_abs_err"] < 1e-5 and rows["fastrl"]["time_vs_trl"] > 0
