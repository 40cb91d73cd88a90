"""``python -m bench session``: its plan and budget, its float64 checks, crash recovery, and the whole command at tiny
shapes on this CPU (``--smoke``: the Triton kernels interpreted). Nothing here times anything against a target."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import session as S
from bench import session_checks as C

REPO = Path(__file__).resolve().parent.parent
IMPLS = ["triton-hybrid", "triton-fused"]


def _estimates(impls, tunable, smoke=False, costs=S.GPU_COSTS):
    device = "cpu" if smoke else "cuda"
    return {s: S.estimate(s, costs, S.points(s, smoke=smoke, device=device, impls=impls, tunable=tunable))
            for s in S.SECTIONS}


def test_gpu_estimates_are_the_documented_arithmetic():
    """The module docstring sizes the default budget; these are its numbers (change both together)."""
    est = _estimates(IMPLS, ["triton-fused"])
    assert {s: round(v) for s, v in est.items()} == {"checks": 47, "tournament": 48, "configs": 90, "autotune": 27,
                                                     "keptset": 20, "divergence": 39, "compile": 103, "w4": 70}
    assert round(sum(est.values())) == 444 <= S.DEFAULT_BUDGET["cuda"] - S.GPU_COSTS.grace
    doc = " ".join(S.__doc__.split())
    for phrase in ("checks 7 + 2 x 20 = 47", "= 48", "= 90 per implementation", "Total 444 s",
                   "adds 20 + 7 + 90 + 27 = 144"):
        assert phrase in doc, phrase
    kept, dropped = S.plan_budget(S.DEFAULT_BUDGET["cuda"] - S.GPU_COSTS.grace, est, list(S.SECTIONS))
    assert kept == list(S.SECTIONS) and not dropped
    # a third implementation that takes launch configurations: w4 and compile go to a second call
    est3 = _estimates(IMPLS + ["triton-x"], ["triton-fused", "triton-x"])
    assert round(sum(est3.values()) - sum(est.values())) == 144
    kept, dropped = S.plan_budget(S.DEFAULT_BUDGET["cuda"] - S.GPU_COSTS.grace, est3, list(S.SECTIONS))
    assert [s for s, _ in dropped] == ["w4", "compile"] and "would not fit" in dropped[0][1]


def test_a_smaller_budget_drops_whole_sections_last_first():
    est = _estimates(IMPLS, ["triton-fused"])
    for budget, gone in ((400, ["w4"]), (300, ["w4", "compile"]), (150, ["w4", "compile", "divergence", "keptset",
                                                                          "autotune", "configs"])):
        kept, dropped = S.plan_budget(budget, est, list(S.SECTIONS))
        assert [s for s, _ in dropped] == gone and kept == [s for s in S.SECTIONS if s not in gone]
    kept, dropped = S.plan_budget(10, est, list(S.SECTIONS))
    assert kept == ["checks", "tournament"]  # never dropped: the budget cuts their points instead (deadlines)
    dls = S.deadlines(kept, est, end=1000.0, grace=20.0)
    assert dls == {"checks": 1000 - 20 - est["tournament"], "tournament": 980.0}
    # two processes at a time (smoke): the checks leave the rest half their estimated time, the rest share the end
    dls = S.deadlines(list(S.SECTIONS), est, end=1000.0, grace=20.0, jobs=2)
    assert dls["checks"] == pytest.approx(980 - sum(v for k, v in est.items() if k != "checks") / 2)
    assert {dls[s] for s in S.SECTIONS if s != "checks"} == {980.0}
    # --sections: configs / autotune need the tournament's rows and the checks' verdict
    assert S._wanted("autotune,w4") == ["checks", "tournament", "autotune", "w4"]
    assert S._wanted("compile") == ["compile"]
    with pytest.raises(SystemExit, match="unknown gpu"):
        S._wanted("gpu")


def test_every_implementation_every_candidate_and_the_peers_are_planned():
    pts = S.points("tournament", smoke=False, device="cuda", impls=IMPLS + ["triton-new"], tunable=[])
    got = {(p["workload"], p["provider"], p.get("implementation")) for p in pts}
    for wl in ("W1", "W1-lp", "W2", "W2-lp", "W3"):
        assert (wl, "trl", None) in got and (wl, "cublas", None) in got and (wl, "fastrl", "triton-new") in got
    assert ("W1", "fastrl-fused", "triton-new") in got and ("W3", "fastrl-fused", "triton-new") not in got
    cfg = S.points("configs", smoke=False, device="cuda", impls=IMPLS, tunable=["triton-fused"])
    from fastrl.kernels.tuning import CANDIDATES

    assert {p["config"] for p in cfg} == {str(c) for c in CANDIDATES}
    assert [p["workload"] for p in cfg][:len(CANDIDATES)] == ["W1-lp"] * len(CANDIDATES)  # log-prob workloads first
    assert {p["probe"] for p in cfg if p["workload"] in ("W1", "W3")} == {"W1-lp"}
    assert len({p["id"] for p in cfg}) == len(cfg)
    kept = S.points("keptset", smoke=False, device="cuda", impls=IMPLS, tunable=[])
    assert {(p["spec"]["N"], p["spec"]["H"], p["spec"]["K"]) for p in kept} == {(16384, 4096, 64), (16384, 896, 64)}
    assert {p["spec"]["beta"] for p in S.points("divergence", smoke=False, device="cuda", impls=IMPLS, tunable=[])} \
        == {0.0, 0.5, 1.0}
    assert [p["provider"] for p in S.points("compile", smoke=False, device="cuda", impls=IMPLS, tunable=[])] == \
        ["fastrl-eager", "fastrl-compile", "fastrl-compile-ro"]


def test_check_tolerances_are_the_test_suites():
    from test_logprobs import TOLERANCES

    assert C.TOLERANCES == TOLERANCES


def test_checks_pass_a_right_implementation_and_fail_a_wrong_one(monkeypatch):
    import fastrl

    p = {"workload": "awkward-bias", "implementation": "torch", "smoke": True}
    row = C.run_check(p, torch.device("cpu"))
    assert row["pass"] and row["error"]["logp"] < 1e-5 < row["error"]["logp_torch"]
    real = fastrl.fused_logprobs

    def off_by_2e3(*a, **k):  # right gradients, log-probs 2e-3 nats off: PyTorch's own bf16 error is larger here
        logp, ent = real(*a, **k)
        return logp + 2e-3, ent

    monkeypatch.setattr(fastrl, "fused_logprobs", off_by_2e3)
    row = C.run_check(p, torch.device("cpu"))
    assert not row["pass"] and "limit 1e-03" in row["reason"]


def test_a_crashed_process_costs_one_point(tmp_path, monkeypatch):
    """The parent's side: a process that dies mid-point gives that point an error row and a fresh process the rest."""
    pts = [{"id": f"p{i}", "section": "checks", "smoke": True, "workload": f"w{i}", "provider": "fastrl"}
           for i in range(3)]
    calls = []

    def fake_run(cmd, **kw):
        spec = json.loads(Path(cmd[-1]).read_text())
        calls.append([p["id"] for p in spec["points"]])
        with open(spec["rows"], "a") as f:
            if len(calls) == 1:  # first process: p0 done, dies inside p1
                f.write(json.dumps({"begin": "p0"}) + "\n" + json.dumps({"id": "p0", "section": "checks",
                                                                          "status": "ok"}) + "\n")
                f.write(json.dumps({"begin": "p1"}) + "\n")
                return subprocess.CompletedProcess(cmd, -11, stderr="Segmentation fault\n")
            for p in spec["points"]:
                f.write(json.dumps({"begin": p["id"]}) + "\n" + json.dumps({"id": p["id"], "section": "checks",
                                                                             "status": "ok"}) + "\n")
            return subprocess.CompletedProcess(cmd, 0, stderr="")

    monkeypatch.setattr(S.subprocess, "run", fake_run)
    import io
    import time

    from rich.console import Console

    rows = S.run_family("checks", pts, {"checks": time.time() + 60}, "cpu", tmp_path, 5, Console(file=io.StringIO()))
    assert calls == [["p0", "p1", "p2"], ["p2"]]
    by = {r["id"]: r for r in rows}
    assert by["p0"]["status"] == "ok" and by["p2"]["status"] == "ok"
    assert by["p1"]["status"] == "error"
    assert "exit code -11" in by["p1"]["reason"] and "Segmentation" in by["p1"]["reason"]


@pytest.mark.slow
def test_session_smoke(tmp_path):
    """The whole command at tiny shapes: every section runs, nothing errors, the file holds what a GPU run's would."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "bench", "session", "--smoke", "--budget", "900", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-5000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "session.json").read_text())
    assert data["sections_run"] == list(S.SECTIONS) and not data["dropped"]
    env_rec = data["env"]
    for key in ("device", "driver", "torch", "triton", "fastrl_commit", "tree_clean", "family"):
        assert key in env_rec, key
    assert re.fullmatch(r"[0-9a-f]{40}", env_rec["fastrl_commit"])
    rows = data["rows"]
    assert not [r for r in rows if r["status"] == "error"], [r for r in rows if r["status"] == "error"]
    sections = {r["section"] for r in rows}
    assert sections == set(S.SECTIONS)
    for r in rows:
        if r["status"] == "ok" and r["section"] != "checks":
            assert {"workload", "provider", "total_ms", "extra_mb"} <= set(r), r
            assert r["total_ms"]["min"] <= r["total_ms"]["median"] <= r["total_ms"]["max"]
    checks = [r for r in rows if r["section"] == "checks"]
    assert {r["implementation"] for r in checks} == set(S.cuda_implementations())
    # n/a: a shape the implementation refuses by design (triton-sm90 and H=31 in bf16: rows TMA cannot address)
    assert all(r["pass"] for r in checks if r["status"] != "n/a")
    assert {(r["implementation"], r["workload"]) for r in checks if r["status"] == "n/a"} <= {("triton-sm90",
                                                                                              "awkward-bias")}
    lm = [r for r in rows
          if r["section"] in ("tournament", "configs", "autotune") and r["provider"].startswith("fastrl")]
    assert all(r["status"] in ("ok", "pruned") for r in lm)
    assert {r["implementation"] for r in lm if r["section"] == "tournament"} == set(S.cuda_implementations())
    forced = [r for r in lm if r["section"] == "configs" and r["status"] == "ok"]
    assert forced and all({s["config"] for s in r["configs_served"].values()} == {r["config"]} for r in forced)
    assert all(s["source"] == "forced" for r in forced for s in r["configs_served"].values())
    loss = next(r for r in lm if r["workload"] == "W1" and r["status"] == "ok")
    assert loss["error"]["loss"] < 1e-5 and "time_vs_trl" in loss
    lp = next(r for r in lm if r["workload"] == "W1-lp" and r["status"] == "ok")
    assert lp["error"]["logp"] < 1e-5 and lp["auto"] in S.cuda_implementations()
    assert {r["provider"] for r in rows if r["section"] == "keptset"} == {"full", "kept-zipf", "kept-uniform"}
    assert {r["provider"] for r in rows if r["section"] == "w4" and r["status"] == "ok"} == {"trl", "fastrl"}
    # PASS / FAIL per target, each naming what it judged
    for name in ("W1 time vs TRL", "W3 time vs TRL", "W1 two pass extra memory vs TRL", "divergence D-smoke-b0.5"):
        assert re.search(re.escape(name) + r".*(PASS|FAIL)", out), name
    assert set(data["targets"]) >= {"W1 time vs TRL", "W1-lp time vs TRL", "W2 time vs TRL", "W2-lp time vs TRL"}
    # a smoke file never sets defaults
    from bench import defaults

    run = defaults.build([tmp_path])["RUNS"][0]
    assert not run["used"] and "smoke" in run["why"]
