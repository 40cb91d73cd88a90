"""The benchmark CLI's command line: subcommands with their own --help, `run` by default, --smoke's folder.

One fresh process from the repository root (where ``bench`` is importable) runs the checks below and prints
what it found; nothing is measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import contextlib, io, json, tempfile
from pathlib import Path
import bench.__main__ as cli
from bench import report

def help_of(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli.main(argv)
        except SystemExit as e:
            assert e.code == 0, e.code
    return out.getvalue()

def error_of(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            cli._parse(argv)
        except SystemExit as e:
            return e.code, err.getvalue()
    return 0, ""

res = {"commands": list(cli.COMMANDS)}
res["help"] = {name: help_of([name, "--help"]) for name in cli.COMMANDS}
res["top"] = help_of(["--help"])
cases = ([], ["--quick"], ["c1", "--smoke"], ["w4", "--lengths", "64"])
res["parsed"] = {" ".join(a): vars(cli._parse(a)) for a in cases}
res["errors"] = {" ".join(a): error_of(a) for a in (["--quick", "c1"], ["w4", "--providers", "torch"])}
from bench import compiled_step
def exit_of(argv):
    try:
        compiled_step.parse_args(cli._parse(argv), "cpu")
    except SystemExit as e:
        return str(e)
    return ""
res["compile"] = {" ".join(a): exit_of(a) for a in (["compile", "--variants", "fastrl-eager,bogus"],
                  ["compile", "--variants", "fastrl-compile-ro"], ["compile", "--shape", "4,512,512"],
                  ["compile", "--shape", "4,512,0,32768"],
                  ["compile", "--variants", "fastrl-eager", "--shape", "2,8,16,64"])}
tempfile.tempdir = TMP
ns = cli._parse
res["out"] = {
    "smoke": str(report.out_dir(ns(["--smoke"]), "cpu-x", "run")),
    "smoke_out": str(report.out_dir(ns(["--smoke", "--out", "/some/where"]), "cpu-x", "run")),
    "full": str(report.out_dir(ns([]), "cpu-x", "run")),
}
print("RESULT " + json.dumps(res))
"""


def test_bench_cli_commands(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTRL_BENCH_OUT")}
    script = SCRIPT.replace("TMP", repr(str(tmp_path)))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    res = json.loads(line[len("RESULT "):])
    assert res["commands"] == ["run", "c1", "w4", "w5", "keptset", "divergence", "gap", "compile", "targets",
                               "session", "defaults", "sass", "tp", "roofline"]
    assert "--budget" in res["help"]["session"] and "--sections" in res["help"]["session"]
    assert "--check" in res["help"]["defaults"]
    assert "--results" in res["help"]["roofline"] and "4.3 TB/s" in res["help"]["roofline"]
    assert "--beta" in res["help"]["divergence"] and "LigerFusedLinearJSD" in res["help"]["divergence"]

    helps = res["help"]
    assert helps["c1"].startswith("usage: python -m bench c1") and "C1-loss" in helps["c1"]
    assert "--providers" in helps["c1"] and "--lengths" not in helps["c1"]  # its own options, not the CLI's
    assert "--lengths" in helps["w4"] and "--budget-mb" in helps["w4"] and "--providers" not in helps["w4"]
    assert "--lengths" not in helps["run"] and "--workload" in helps["run"]  # W4 is `w4`'s alone
    assert "--device" not in helps["targets"] and "--smoke" not in helps["targets"]
    for name in res["commands"]:  # the command list, with a line of help each
        assert f"\n    {name} " in res["top"] or f"\n    {name}\n" in res["top"], name  # long names: help below
    assert "COMMAND --help" in res["top"] and "DESIGN.md" not in res["top"] and "issues" not in res["top"]

    parsed = res["parsed"]
    assert parsed[""]["command"] == "run" and parsed[""]["quick"] is False
    assert parsed["--quick"]["command"] == "run" and parsed["--quick"]["quick"] is True
    assert parsed["c1 --smoke"]["command"] == "c1" and parsed["c1 --smoke"]["smoke"] is True
    assert parsed["c1 --smoke"]["lengths"] is None  # an option c1 does not take reads as unset
    assert parsed["w4 --lengths 64"]["lengths"] == "64" and parsed["w4 --lengths 64"]["providers"] is None

    code, err = res["errors"]["--quick c1"]
    assert code == 2 and "the command comes first: python -m bench c1" in err
    code, err = res["errors"]["w4 --providers torch"]
    assert code == 2 and "unrecognized arguments for `w4`: --providers torch" in err

    errs = res["compile"]  # bad --variants / --shape: a clear error before any process starts
    assert "--variants: expected a comma list of fastrl-eager," in errs["compile --variants fastrl-eager,bogus"]
    assert errs["compile --variants fastrl-eager,bogus"].endswith("got 'bogus'")
    assert "got 'fastrl-compile-ro'" in errs["compile --variants fastrl-compile-ro"]  # CUDA graphs: CUDA only
    assert errs["compile --shape 4,512,512"] == "--shape: expected B,T,H,V (four positive integers, e.g. " \
        "4,512,512,32768); got '4,512,512'"
    assert "got '4,512,0,32768'" in errs["compile --shape 4,512,0,32768"]
    assert errs["compile --variants fastrl-eager --shape 2,8,16,64"] == ""

    out = res["out"]  # a new folder outside the repository unless --out names one
    assert Path(out["smoke"]).parent == tmp_path / "fastrl-bench" and Path(out["smoke"]).name.startswith("run-smoke-cpu-x-")
    assert out["smoke_out"] == "/some/where"
    assert Path(out["full"]).parent == tmp_path / "fastrl-bench" and Path(out["full"]).name.startswith("run-cpu-x-")
    assert out["full"] != out["smoke"] and not Path(out["full"]).is_relative_to(REPO)


def test_the_summary_fits_120_columns():
    """The committed quick run's rows, printed as the summary: no line past 120 columns, no figure cut."""
    import json

    from rich.console import Console

    from bench import report

    rows = json.loads((REPO / "bench" / "results" / "cpu-amd-epyc-2c" / "run-quick.json").read_text())["rows"]
    con = Console(width=report.SUMMARY_WIDTH, record=True)
    report.print_table(con, rows, "summary")
    text = con.export_text()
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "\u2026" not in text  # rich's ellipsis: a cell cut short
    measured = [r for r in rows if r["status"] == "ok" and r["group"] != "floor"]
    for r in measured:  # every measured row's time, memory and ratio, as its own line
        line = next(x for x in text.splitlines() if x.split()[:2] == [r["workload"], r["provider"]])
        assert f"{r['peak_extra_mb']:.1f}" in line and f"{r['time_vs_torch']:.2f}" in line, line
