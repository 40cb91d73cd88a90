"""The one benchmark harness for the commands that are not a session (``bench.session_run.run_fresh``): each point
in a fresh measuring process, a point whose process dies or hangs becomes an ``error`` row saying why, and the
points after it still run. Tiny CPU points; the faults are injected with ``FASTRL_SESSION_FAULT`` as in the
session's tests (tests/test_bench_session.py)."""

from __future__ import annotations

import pytest

from bench.session_run import run_fresh
from bench.w4 import spawn_point
from bench.workloads import Workload


def _spec(provider: str) -> dict:
    return {"workload": Workload("tiny", "logprob", 8, 4, 16, "float32").to_dict(), "provider": provider,
            "device": "cpu", "reps": 1, "warmup": 0, "n_sets": 1, "seed": 0, "accuracy_rows": 8}


@pytest.mark.parametrize("fault", ["crash", "hang"])
def test_a_point_that_dies_or_hangs_is_an_error_row_and_the_next_runs(monkeypatch, fault):
    monkeypatch.setenv("FASTRL_SESSION_FAULT", f"{fault}:/fastrl")
    seen = []
    res = run_fresh([_spec("fastrl"), _spec("torch")], "cpu", 20, on_result=lambda s, r: seen.append(s["provider"]))
    bad, good = res
    assert bad["status"] == "error", bad
    assert ("exit code -9" if fault == "crash" else "killed by the watchdog") in bad["reason"], bad
    assert good["status"] == "ok" and good["total_ms"]["median"] > 0 and good["logp_max_abs_err"] < 1e-5, good
    assert seen == ["fastrl", "torch"] and "id" not in good and "section" not in good


def test_a_w4_point_killed_by_sigkill_reads_as_out_of_memory(monkeypatch):
    monkeypatch.setenv("FASTRL_SESSION_FAULT", "crash:/fastrl")
    res = spawn_point({"kind": "w4", "trainer": "fastrl", "device": "cpu"}, 30)
    assert res["status"] == "oom" and "OOM killer" in res["reason"], res
