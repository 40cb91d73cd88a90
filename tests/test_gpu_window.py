"""``bench/gpu_session.sh``: a call cut at any moment still returns its rows, and call 2 plans inside the seconds given.

The device tool returns only what is under ``$OUT`` when a call ends, and a call past its limit is killed. A cut at an
instant returns the files as they are at that instant: the test copies ``$OUT`` at several seconds of a smoke run (the
same plumbing as a GPU run, interpreted on this CPU), then kills the whole process group, and every copy must hold
only whole, parseable rows, more of them as time goes on.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_session.sh"


def _env(out: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # python3 = this Python
    return {**env, "OUT": str(out), **extra}


def _rows(folder: Path) -> tuple[list[dict], int]:
    """(every line of the rows file, parsed: a line that does not parse fails the test; finished points)."""
    path = folder / "session.rows.jsonl"
    if not path.exists():
        return [], 0
    text = path.read_text()
    assert text == "" or text.endswith("\n"), "a cut left half a line"
    lines = [json.loads(x) for x in text.splitlines()]
    return lines, sum(1 for r in lines if "id" in r and "status" in r)


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux /proc), whatever its process group or session."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_a_cut_call_returns_every_finished_row(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", str(SCRIPT), "smoke"], cwd=REPO, env=_env(out), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, start_new_session=True)
    copies, t0 = [], time.time()
    try:
        while time.time() - t0 < 150:  # a loaded 2-core machine: the first point finishes after 15-40 s
            time.sleep(2)
            snap = tmp_path / f"cut-{len(copies)}"
            shutil.copytree(out, snap)  # what a cut at this instant would return
            copies.append(snap)
            if _rows(snap)[1] >= 2:
                break
    finally:
        below = _descendants(proc.pid) if Path("/proc").is_dir() else set()
        os.killpg(proc.pid, signal.SIGKILL)  # the limit: the whole call, at once
        proc.wait()
    # the measuring processes run in process groups of their own (the watchdog kills them whole): they die with the
    # session, not minutes later
    time.sleep(2)
    assert not [p for p in below if _alive(p)], "a measuring process outlived the cut"
    assert len(copies) >= 3, "the run never started"
    counts = []
    for snap in copies + [out]:
        assert (snap / "smoke.log").read_text().startswith("plan (570 s): smoke")  # the plan, before anything ran
        lines, done = _rows(snap)
        counts.append(done)
        assert all("begin" in r or "plan" in r or ("id" in r and "status" in r) for r in lines)
    assert counts == sorted(counts) and counts[-1] >= 2, counts
    lines, _ = _rows(out)
    assert lines[0]["plan"]["wanted"][:2] == ["w4", "checks"] and any(r.get("status") == "ok" for r in lines)
    # the archive, refreshed in the background, is whole whenever it exists (replaced, never rewritten in place)
    for snap in copies + [out]:
        if (snap / "smoke.tgz").exists():
            with tarfile.open(snap / "smoke.tgz") as tar:
                assert "./smoke.log" in tar.getnames() or "smoke.log" in tar.getnames()


def test_call_two_needs_the_seconds_left_and_plans_inside_them(tmp_path):
    for args in (["rest"], ["rest", "configs"]):
        proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=_env(tmp_path / "a"), capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 2 and "SECONDS, the device seconds left in the window, is required" in proc.stdout
    # 240 s left: the call plans 220 (its files must come back inside the window): the GPU tests first, the session
    # in the 55 s left; 150 s left: the tests get what the call has
    proc = subprocess.run(["bash", str(SCRIPT), "rest", "240", "compile"], cwd=REPO,
                          env=_env(tmp_path / "b", PLAN_ONLY="1"), capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.startswith(
        "plan (220 s of the 240 s left): install ~30 s; every GPU test file <= 120 s; python -m bench session "
        "--sections compile in the ~55 s left (not under 30); pack 15 s"), proc.stdout
    proc = subprocess.run(["bash", str(SCRIPT), "rest", "150"], cwd=REPO, env=_env(tmp_path / "d", PLAN_ONLY="1"),
                          capture_output=True, text=True, timeout=60, check=False)
    assert "every GPU test file <= 85 s; python -m bench session --sections compile,configs in the ~0 s" in proc.stdout
    proc = subprocess.run(["bash", str(SCRIPT), "rest", "900"], cwd=REPO, env=_env(tmp_path / "c", PLAN_ONLY="1"),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.stdout.startswith("plan (570 s of the 900 s left)")  # never past the command's limit


def test_call_one_prints_the_plan_sized_to_the_window(tmp_path):
    """The plan's arithmetic: 570 s less install, W5's bound and the packing leave the session 365 s
    (docs/gpu-window.md sizes the session's sections on that: tests/test_bench_session.py)."""
    proc = subprocess.run(["bash", str(SCRIPT), "window"], cwd=REPO, env=_env(tmp_path, PLAN_ONLY="1"),
                          capture_output=True, text=True, timeout=60, check=False)
    first = proc.stdout.splitlines()[0]
    assert first == ("plan (570 s): install ~30 s; W5 at 24 GiB (python -m bench w5) <= 150 s; python -m bench "
                     "session ~365 s (W4 first; sections that do not fit are left to call 2); pack 15 s"), first


def test_every_gpu_test_file_is_entered():
    """Call 2 runs every tests/test_cuda*.py, the kept-rows kernels' file (on CUDA when there is one) and
    tests/test_invariance.py once it exists, then test_divergence.py's CUDA tests; no CPU-only file."""
    text = SCRIPT.read_text()
    assert "GPU_TESTS=(tests/test_cuda*.py tests/test_kernels_kept_rows.py)" in text
    assert "[ -e tests/test_invariance.py ] && GPU_TESTS+=(tests/test_invariance.py)" in text
    assert "tests/test_divergence.py -k cuda" in text
    assert len(list((REPO / "tests").glob("test_cuda*.py"))) >= 3


@pytest.fixture(autouse=True)
def _bash():
    if shutil.which("bash") is None:
        pytest.skip("needs bash")


def test_instafail_writes_a_failure_as_it_happens(tmp_path):
    """bench/gpu_session.sh sets FASTRL_INSTAFAIL=1: a call cut at its limit loses pytest's summary, so each failure's
    traceback is written to stderr when the test fails (tests/conftest.py); unset, nothing extra is written."""
    (tmp_path / "test_fails.py").write_text("def test_fails():\n    assert 1 == 2, 'the reason'\n")
    out = {}
    for flag in ("1", ""):
        env = {**os.environ, "FASTRL_INSTAFAIL": flag, "PYTHONPATH": str(REPO / "tests")}
        out[flag] = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                                    str(tmp_path / "test_fails.py")], cwd=tmp_path, env=env, capture_output=True,
                                   text=True, timeout=120)
    assert out["1"].returncode == 1 and "test_fails.py::test_fails (call) FAILED:" in out["1"].stderr
    assert "AssertionError: the reason" in out["1"].stderr
    assert out[""].returncode == 1 and "FAILED:" not in out[""].stderr
