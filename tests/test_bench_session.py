"""``python -m bench session``: its plan and budget, its float64 checks, crash recovery, and the whole command at tiny
shapes on this CPU (``--smoke``: the Triton kernels interpreted). Nothing here times anything against a target."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import session as S
from bench import session_checks as C

REPO = Path(__file__).resolve().parent.parent
IMPLS = ["triton-hybrid", "triton-fused", "triton-sm90"]
KERNELS = {"triton-fused": ("stats", "grad"), "triton-sm90": ("sm90_stats", "sm90_exp_stats", "sm90_grad")}


def _tunable(smoke=False):
    return {i: S.candidates_for(k, smoke) for i, k in KERNELS.items()}


def _estimates(impls=IMPLS, tunable=None, costs=S.GPU_COSTS):
    tunable = _tunable() if tunable is None else tunable
    return {s: S.estimate(s, costs, S.points(s, smoke=False, device="cuda", impls=impls, tunable=tunable))
            for s in S.SECTIONS}


def test_gpu_estimates_are_the_documented_arithmetic():
    """docs/gpu-window.md sizes the window from these numbers, computed from the points each section plans (change
    both together)."""
    est = _estimates()
    assert {s: round(v, 2) for s, v in est.items()} == {
        "w4": 70, "checks": 89.5, "tournament": 54.95, "divergence": 52.0, "keptset": 46.6, "profile": 26.3,
        "budget": 19.05, "compile": 105, "configs": 159.5}
    assert [len(_tunable()[i]) for i in ("triton-fused", "triton-sm90")] == [6, 5]
    doc = " ".join((REPO / "docs" / "gpu-window.md").read_text().split())
    for phrase in ("checks 7 + 33 x 2.5 = 89.5", "31 points in 30.95 = 54.95", "2 x 9 compiling = 52",
                   "18 x 2.2 = 46.6",
                   "profile 7 + 12 + 2 x (1.5 + 1.5 + 0.65) = 26.3", "budget 7 + 5 + 7 points in 7.05 = 19.05",
                   "11 x 8 compiling + 56 points in 59.5 = 159.5", "2 + 2 + 2 x 47 = 105", "Total 622.9 s",
                   "w4 to profile (339.4 s + 20 s grace)", "7 + 3 x 2.5 = 14.5"):
        assert phrase in doc, phrase
    assert round(sum(est.values()), 1) == 622.9
    assert round(sum(est[s] for s in S.SECTIONS[:6]), 1) == 339.4
    quick = S.points("checks", smoke=False, device="cuda", impls=IMPLS, tunable={}, quick_checks=True)
    assert S.estimate("checks", S.GPU_COSTS, quick) == 14.5 and len(quick) == 3
    # the first call's session (365 s after W5's 150) keeps w4 to profile and leaves the rest to the second call
    kept, dropped = S.fit(list(S.SECTIONS), est, 365 - S.GPU_COSTS.grace)
    assert kept == ["w4", "checks", "tournament", "divergence", "keptset", "profile"]
    assert [s for s, _ in dropped] == ["configs", "compile", "budget"] and "would not fit" in dropped[0][1]


def test_a_smaller_budget_drops_whole_sections_from_the_end():
    est = _estimates()
    assert S.DROP_ORDER == ("configs", "compile", "budget", "profile", "keptset", "divergence", "w4")
    late = ["configs", "compile", "budget", "profile", "keptset", "divergence"]
    for budget, gone in ((500, late[:1]), (400, late[:2]), (340, late[:3]), (300, late[:5]), (10, late)):
        kept, dropped = S.fit(list(S.SECTIONS), est, budget)
        assert [s for s, _ in dropped] == gone and kept == [s for s in S.SECTIONS if s not in gone]
    # the first section after the checks and the tournament runs what fits of it, never dropped whole at the start:
    # a second call of 150 s for the configurations measures the log-prob workloads' candidates first
    kept, dropped = S.fit(["checks", "configs", "compile"], est, 150)
    assert kept == ["checks", "configs"] and [s for s, _ in dropped] == ["compile"]
    assert S._wanted("configs,w4") == (["w4", "checks", "configs"], True)  # quick checks: which kernels run
    assert S._wanted("checks,configs") == (["checks", "configs"], False)
    assert S._wanted("compile") == (["compile"], False)
    assert S._wanted(None) == (list(S.SECTIONS), False)
    with pytest.raises(SystemExit, match="--sections: expected a comma list of w4, checks, .*; got 'gpu'"):
        S._wanted("gpu")


def test_every_implementation_every_kernels_candidates_and_the_peers_are_planned():
    pts = S.points("tournament", smoke=False, device="cuda", impls=IMPLS + ["triton-new"], tunable={})
    got = {(p["workload"], p["provider"], p.get("implementation")) for p in pts}
    for wl in ("W1", "W1-lp", "W2", "W2-lp", "W3"):
        assert (wl, "trl", None) in got and (wl, "cublas", None) in got and (wl, "fastrl", "triton-new") in got
    assert ("W1", "fastrl-fused", "triton-new") in got and ("W3", "fastrl-fused", "triton-new") not in got
    from fastrl.kernels.tuning import CANDIDATES_BY_KERNEL, candidates

    # each implementation's candidates are its kernels' own (the sm90 kernels' lists, not the generic CANDIDATES)
    tun = _tunable()
    assert set(tun["triton-sm90"]) == {str(c) for k in KERNELS["triton-sm90"] for c in CANDIDATES_BY_KERNEL[k]}
    assert set(tun["triton-fused"]) == {str(c) for c in candidates("stats")}
    cfg = S.points("configs", smoke=False, device="cuda", impls=IMPLS, tunable=tun)
    for impl in tun:
        assert {p["config"] for p in cfg if p["implementation"] == impl} == set(tun[impl]) | {"default"}
    w1lp = [p for p in cfg if p["workload"] == "W1-lp"]
    # the built-in choice and each tunable implementation at its built-in configuration first, in the same process
    assert [(p["implementation"], p["config"]) for p in w1lp[:3]] == [
        ("triton-hybrid", "default"), ("triton-fused", "default"), ("triton-sm90", "default")]
    assert [p["workload"] for p in cfg][:len(w1lp)] == ["W1-lp"] * len(w1lp)  # log-prob workloads first
    assert {p["provider"] for p in cfg if p["workload"] == "W1"} == {"fastrl-fused"}  # sm90_exp_stats runs only there
    assert {p["probe"] for p in cfg if p["workload"] in ("W1", "W3") and p["config"] != "default"} == {"W1-lp"}
    assert len({p["id"] for p in cfg}) == len(cfg)
    # the divergence: one row per implementation with its own kernels (triton-fused runs the hybrid's), TRL, Liger
    div = S.points("divergence", smoke=False, device="cuda", impls=IMPLS, tunable={})
    assert {(p["provider"], p.get("implementation")) for p in div} == {
        ("fastrl", "triton-hybrid"), ("fastrl", "triton-sm90"), ("trl", None), ("liger", None)}
    assert {p["spec"]["beta"] for p in div} == {0.0, 0.5, 1.0}
    kept = S.points("keptset", smoke=False, device="cuda", impls=IMPLS, tunable={})
    # K=64 and the ragged sampler-like sets (at most 128 ids) at W1's and W2's shapes
    assert {(p["spec"]["N"], p["spec"]["H"], p["spec"]["K"]) for p in kept} == {
        (16384, H, K) for H in (4096, 896) for K in (64, 128)}
    assert [p["provider"] for p in S.points("compile", smoke=False, device="cuda", impls=IMPLS, tunable={})] == \
        ["fastrl-eager", "fastrl-nosync", "fastrl-compile", "fastrl-compile-ro"]
    prof = S.points("profile", smoke=False, device="cuda", impls=IMPLS, tunable={})
    assert [(p["workload"], p["provider"]) for p in prof] == [(w, p) for w, f in S.PROFILED for p in (f, "trl")]
    budget = S.points("budget", smoke=False, device="cuda", impls=IMPLS, tunable={})
    assert {p["memory_budget"] for p in budget} == {0.0625} and not any("implementation" in p for p in budget)
    # the checks: a bias at H=896, float32 and the divergence, for every implementation
    from bench.session_checks import CASES

    names = {c.name: c for c in CASES}
    assert names["bias-896"].bias and names["bias-896"].H == 896 and names["float32"].dtype == "float32"
    assert names["divergence-jsd"].divergence
    chk = S.points("checks", smoke=False, device="cuda", impls=IMPLS, tunable={})
    assert len(chk) == len(CASES) * len(IMPLS)


def test_the_watchdog_bounds_follow_the_estimates():
    c = S.GPU_COSTS
    pts = S.points("tournament", smoke=False, device="cuda", impls=IMPLS, tunable={})
    b = S.point_bounds("tournament", c, pts)
    w1 = [p for p in pts if p["workload"] == "W1" and p.get("implementation") == "triton-sm90"]
    w3 = [p for p in pts if p["workload"] == "W3" and p.get("implementation") == "triton-sm90"]
    factor, floor = c.watchdog
    # the implementation's first point compiles its kernels; a later one only runs
    assert b[w1[0]["id"]] == factor * (1.5 + c.jit) + floor
    assert b[w3[0]["id"]] == factor * 0.6 + floor < 60
    assert b["start"] == factor * c.setup["tournament"] + floor
    cfg = S.points("configs", smoke=False, device="cuda", impls=IMPLS, tunable=_tunable())
    b = S.point_bounds("configs", c, cfg)
    forced = [p for p in cfg if p["implementation"] == "triton-sm90" and p["config"] != "default"]
    assert b[forced[0]["id"]] == factor * (1.5 + c.compile["configs"]) + floor  # W1-lp at a new configuration


def test_a_section_that_runs_long_drops_later_sections_from_the_end_not_its_own_points(tmp_path, monkeypatch):
    """Each section may run to the end of the budget (its deadline reserves nothing for later sections: the rows the
    targets need come first); the sections after it are dropped whole, from the end, before they start, and the
    first of them that fits in part runs in part."""
    import io

    from rich.console import Console

    class Args:
        smoke, budget, jobs, out, name, sections = False, 1000, 1, str(tmp_path), "session", None

    run = S.SessionRun(Args, "cpu", Console(file=io.StringIO()), {"device_slug": "cpu"})
    run.costs = S.GPU_COSTS
    seen = {}
    monkeypatch.setattr(S, "run_points", lambda name, pts, deadline, r, bounds: seen.setdefault(name, deadline) and [])
    run.est = {"tournament": 50, "divergence": 50, "keptset": 20, "w4": 70, "configs": 160}
    run.pending = ["tournament", "divergence", "keptset", "w4", "configs"]
    run.end = time.time() + 500
    assert run.next_section() == "tournament" and not run.dropped  # 350 s of estimates, ~480 s left
    run.run_section("tournament")
    assert seen["tournament"] == pytest.approx(run.end - run.costs.grace)  # nothing reserved for later sections
    run.end = time.time() + 120  # the tournament ran long: 100 s left
    assert run.next_section() == "divergence"
    assert [s for s, _ in run.dropped] == ["configs", "w4"] and run.pending == ["keptset"]
    assert "would not fit" in run.dropped[0][1]
    run.end = time.time() + 40  # 20 s left: keptset (20 s) is the last one, it runs what fits
    assert run.next_section() == "keptset" and run.next_section() is None
    run.pending, run.end = ["w4"], time.time() + 10  # no time at all: dropped
    assert run.next_section() is None and run.dropped[-1][0] == "w4"
    saved = json.loads((tmp_path / "session.json").read_text())  # rewritten after the tournament
    assert saved["partial"] and saved["sections_run"] == ["tournament"]


def test_check_tolerances_are_the_test_suites():
    from test_divergence import TOLERANCES as DIV
    from test_logprobs import TOLERANCES

    assert C.TOLERANCES == TOLERANCES and C.DIV_TOLERANCES == DIV


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


def _run(tmp_path, pts, section, costs, deadline_s=120):
    import io

    from rich.console import Console

    class Args:
        smoke, budget, jobs, out, name, sections = True, deadline_s, 1, str(tmp_path), "session", "checks"

    run = S.SessionRun(Args, "cpu", Console(file=io.StringIO()), {"device_slug": "cpu"})
    run.costs = costs
    from bench.session_run import run_points

    return run_points(section, pts, time.time() + deadline_s, run, S.point_bounds(section, costs, pts)), run


def test_a_hang_and_a_crash_cost_one_point_each_and_break_only_their_implementation(tmp_path, monkeypatch):
    """Real measuring processes with injected faults (FASTRL_SESSION_FAULT, which only tests set): the hybrid's first
    point kills its process, sm90's first point never returns. Each gets its row (error, timeout: the watchdog killed
    it at its bound), each implementation's other points are skipped with the reason, and a fresh process measures
    the torch points."""
    monkeypatch.setenv("FASTRL_SESSION_FAULT", "crash:/triton-hybrid/;hang:/triton-sm90/")
    pts = [{"section": "checks", "smoke": True, "workload": "awkward-bias", "provider": "fastrl", "implementation": i}
           for i in ("triton-hybrid", "triton-hybrid", "triton-sm90", "triton-sm90", "torch")]
    for n, p in enumerate(pts):
        p["id"] = f"checks/{n}/awkward-bias/fastrl/{p['implementation']}/"
    costs = S.Costs(setup={"checks": 10.0}, point={"checks": 1.0}, compile={}, jit=0.0, watchdog=(1.0, 8.0))
    t0 = time.time()
    rows, run = _run(tmp_path, pts, "checks", costs)
    took = time.time() - t0
    by = [r["status"] for r in rows]
    assert by == ["error", "skipped", "timeout", "skipped", "ok"], rows
    assert "died" in rows[0]["reason"] and "exit code -9" in rows[0]["reason"]
    assert "triton-hybrid broke earlier" in rows[1]["reason"] and "error at checks/0" in rows[1]["reason"]
    assert "watchdog" in rows[2]["reason"] and "bound 9 s" in rows[2]["reason"]
    assert "triton-sm90 broke earlier" in rows[3]["reason"]
    assert rows[4]["pass"] and took < 100  # the hang cost its bound, not the section's time
    lines = [json.loads(x) for x in run.rows_path.read_text().splitlines()]
    assert [r["id"] for r in lines if "id" in r] == [r["id"] for r in rows] or \
        sorted(r["id"] for r in lines if "id" in r) == sorted(r["id"] for r in rows)


@pytest.mark.slow
def test_session_smoke(tmp_path):
    """The whole command at tiny shapes: every section runs, nothing errors, the file holds what a GPU run's would."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "bench", "session", "--smoke", "--budget", "900", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-5000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "session.json").read_text())
    assert sorted(data["sections_run"]) == sorted(S.SECTIONS) and not data["dropped"] and not data["partial"]
    assert data["checks"] == "full" and set(data["tunable"]) == {"triton-fused", "triton-sm90"}
    # every row was appended to the rows file as it finished (what a cut call returns)
    lines = [json.loads(x) for x in (tmp_path / "session.rows.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in lines if "status" in r) == sorted(r["id"] for r in data["rows"])
    env_rec = data["env"]
    for key in ("device", "driver", "torch", "triton", "fastrl_commit", "tree_clean", "family"):
        assert key in env_rec, key
    assert re.fullmatch(r"[0-9a-f]{40}", env_rec["fastrl_commit"])
    rows = data["rows"]
    assert not [r for r in rows if r["status"] in ("error", "timeout")], [r for r in rows if r["status"] == "error"]
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
    assert {r["kind"] for r in checks if r["status"] == "ok"} == {"logprob", "loss", "divergence"}
    assert {(r["implementation"], r["workload"]) for r in checks if r["status"] == "n/a"} <= {("triton-sm90",
                                                                                              "awkward-bias")}
    lm = [r for r in rows
          if r["section"] in ("tournament", "configs") and r["provider"].startswith("fastrl")]
    assert all(r["status"] in ("ok", "pruned") for r in lm)
    assert {r["implementation"] for r in lm if r["section"] == "tournament"} == set(S.cuda_implementations())
    forced = [r for r in lm if r["section"] == "configs" and r["status"] == "ok" and r["config"] != "default"]
    assert forced and all({s["config"] for s in r["configs_served"].values()} == {r["config"]} for r in forced)
    assert all(s["source"] == "forced" for r in forced for s in r["configs_served"].values())
    loss = next(r for r in lm if r["workload"] == "W1" and r["status"] == "ok")
    assert loss["error"]["loss"] < 1e-5 and "time_vs_trl" in loss
    lp = next(r for r in lm if r["workload"] == "W1-lp" and r["status"] == "ok")
    assert lp["error"]["logp"] < 1e-5 and lp["auto"] in S.cuda_implementations()
    assert {"full", "kept-zipf", "kept-uniform"} <= {r["provider"] for r in rows if r["section"] == "keptset"}
    div = {(r["provider"], r.get("implementation")) for r in rows
           if r["section"] == "divergence" and r["status"] == "ok"}
    assert {("fastrl", "triton-hybrid"), ("fastrl", "triton-sm90"), ("trl", None)} <= div
    assert all(r["error"]["div"] < 1e-5 for r in rows if r["section"] == "divergence" and r["provider"] == "fastrl")
    # the configs section measured the built-in choice and each implementation's default next to its candidates
    cfg = {(r["implementation"], r["config"]) for r in rows if r["section"] == "configs" and r["status"] == "ok"}
    assert {("triton-hybrid", "default"), ("triton-sm90", "default")} <= cfg
    assert {c for i, c in cfg if i == "triton-sm90"} - {"default"} <= set(data["tunable"]["triton-sm90"])
    assert {r["provider"] for r in rows if r["section"] == "w4" and r["status"] == "ok"} == {"trl", "fastrl"}
    # PASS / FAIL per target, each naming what it judged
    for name in ("W1 time vs TRL", "W3 time vs TRL", "W1 two pass extra memory vs TRL", "divergence D-smoke-b0.5"):
        assert re.search(re.escape(name) + r".*(PASS|FAIL)", out), name
    assert set(data["targets"]) >= {"W1 time vs TRL", "W1-lp time vs TRL", "W2 time vs TRL", "W2-lp time vs TRL"}
    # a smoke file never sets defaults
    from bench import defaults

    run = defaults.build([tmp_path])["RUNS"][0]
    assert not run["used"] and "smoke" in run["why"]
