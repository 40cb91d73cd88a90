"""The GPU workloads of `python -m bench run --device cuda` and `python -m bench targets` over session files, checked
on made-up rows (nothing is timed here)."""

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


def test_targets_over_several_session_calls(tmp_path):
    """`python -m bench targets`: the session's targets over the session files of several calls, each file's ratios
    against its own TRL row only; a path with no session file is refused."""
    import io
    import json
    from argparse import Namespace

    def row(wl, prov, ms, mb, impl=None):
        return dict(section="tournament", workload=wl, provider=prov, implementation=impl, status="ok",
                    total_ms={"median": ms}, extra_mb=mb)

    def session(folder, name, rows):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(json.dumps({"env": {"device": "H", "fastrl_commit": "abc"},
                                                          "rows": rows}))

    session("call1", "session.json", [row("W1", "trl", 132.0, 2900.0),
                                      row("W1", "fastrl-fused", 95.0, 2000.0, "triton-hybrid")])
    # a later call: its W2 is compared with its own TRL row, not with the first call's
    session("call2", "session-rest.json", [row("W2", "trl", 35.0, 700.0),
                                           row("W2", "fastrl-fused", 31.5, 800.0, "triton-hybrid"),
                                           row("W1", "fastrl-fused", 10.0, 1.0, "triton-hybrid")])
    out = io.StringIO()
    assert cli._targets_command(Namespace(paths=[str(tmp_path)]), "cpu", Console(file=out, width=200)) == 0
    text = out.getvalue()
    assert "call1/session.json" in text and "call2/session-rest.json" in text
    assert "W1 time vs TRL: triton-hybrid (one pass) 0.720x (target <= 0.75x): PASS" in text
    assert "W2 time vs TRL: triton-hybrid (one pass) 0.900x (target <= 0.85x): FAIL" in text
    assert "0.08" not in text  # the second call's W1 has no TRL row of its own: not evaluated there
    assert "W3 time vs TRL: not evaluated" in text
    assert cli._targets_command(Namespace(paths=[str(tmp_path / "none")]), "cpu", Console(file=out)) == 2
    (tmp_path / "empty").mkdir()
    assert cli._targets_command(Namespace(paths=[str(tmp_path / "empty")]), "cpu", Console(file=out)) == 2


def test_keptset_points_and_one_point_in_process():
    """`python -m bench keptset`: its points (K 20/64/512 x Zipf/disjoint sets, the full path, the rule, the fixed
    plan, the policy loss with and without a support) and one tiny point measured in this process (the CLI runs
    each in a fresh one)."""
    import torch

    from bench import keptset

    pts = keptset.points("cpu", smoke=False, quick=False)
    kept = {(p["K"], p["sets"]) for p in pts if p["mode"] == "kept"}
    assert kept == {(k, s) for k in (20, 64, 512) for s in ("zipf", "uniform")} | {(128, "ragged")}
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
