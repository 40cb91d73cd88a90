"""``python -m bench roofline``: the model's arithmetic, and measured times read from committed session results."""

import json
import os
import subprocess
import sys

from bench import roofline as R

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_prints_every_workload_and_implementation():
    r = subprocess.run([sys.executable, "-m", "bench", "roofline"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.split()[:1] and line.split()[0] in
            {w.name for w in R.WORKLOADS}]
    for w in R.WORKLOADS:
        impls = {row[1] for row in rows if row[0] == w.name}
        assert {"floor", "trl", "hybrid", "fused", "sm90"} <= impls, (w.name, impls)
    # nothing is measured for the new kernels unless a committed session result says so
    assert any(row[1] == "sm90" and "not measured" in " ".join(row) for row in rows)


def test_arithmetic():
    w1 = R.WORKLOADS[0]
    fl, by, _ = R.model(w1, "floor")
    assert fl == 6 * 16384 * 4096 * 151936 and by == 0
    # W3: the fused kernels move no logits; the hybrid float32 tile costs twice TRL's bf16 tile
    w3 = next(w for w in R.WORKLOADS if w.name == "W3")
    assert R.model(w3, "sm90")[1] == 0 and R.model(w3, "hybrid")[1] == 2 * R.model(w3, "trl")[1]
    # one pass on bf16 scaled exps moves less than on float32 logits, same FLOPs
    assert R.model(w1, "sm90")[0] == R.model(w1, "hybrid")[0] and R.model(w1, "sm90")[1] < R.model(w1, "hybrid")[1]
    # the fully fused atomics backward moves an order of magnitude more than G through HBM (why it was not built)
    w1lp = next(w for w in R.WORKLOADS if w.name == "W1-lp")
    assert R.model(w1lp, "atomics")[1] > 10 * R.model(w1lp, "sm90")[1]
    # the divergence on triton-sm90 stores no tile of either head: only G and the float32 grad_h accumulation
    div = next(w for w in R.WORKLOADS if w.name == "divergence")
    assert R.model(div, "sm90")[1] < R.model(div, "hybrid")[1] / 3


def test_measured_times_come_from_session_results(tmp_path):
    d = tmp_path / "nvidia-h200"
    d.mkdir()
    rows = [dict(workload="W3", provider="fastrl", implementation="triton-sm90", status="ok",
                 total_ms=dict(median=30.5, min=30.0, max=31.0)),
            dict(workload="W3", provider="fastrl", implementation="triton-sm90", status="ok", config="other",
                 total_ms=dict(median=29.5, min=29.0, max=30.0)),
            dict(workload="W3", provider="trl", status="failed", total_ms=None)]
    (d / "session.json").write_text(json.dumps(dict(rows=rows)))
    got = R.measured(str(tmp_path))
    assert got == {("W3", "sm90"): 29.5}  # the best configuration; failed rows are not times
