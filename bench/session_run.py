"""The benchmarks' one harness: measuring processes (``bench.session_points``) under a watchdog, rows as they finish.

``run_points``: one section of ``python -m bench session`` in as few processes as it takes; ``run_fresh``: the other
commands' points, one fresh process each.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

__all__ = ["RESTART", "Fresh", "append_rows", "run_fresh", "run_points", "stub"]

REPO_ROOT = Path(__file__).resolve().parent.parent
RESTART = 3  # a measuring process exits with this after a CUDA fault: the parent starts a fresh one
try:  # looked up here, not in the forked child (no import between fork and exec)
    _PRCTL = ctypes.CDLL("libc.so.6").prctl
except (OSError, AttributeError):  # not Linux: the watchdog and the deadline still bound the processes
    _PRCTL = None


def append_rows(path: Path, rows: list[dict]) -> None:
    """Each row one line, one write (O_APPEND): processes writing side by side never interleave inside a line."""
    for r in rows:
        with open(path, "a") as f:
            f.write(json.dumps(r, default=str) + "\n")


def stub(p: dict, status: str, reason: str) -> dict:
    row = {k: p[k] for k in ("id", "section", "workload", "provider", "implementation", "config") if k in p}
    return {**row, "status": status, "reason": reason}


def _key(p: dict) -> str:
    """Whose fault a crash or hang is: the implementation's, else the provider's (TRL, Liger, cuBLAS)."""
    return p.get("implementation") or p["provider"]


class _Tail:
    """The lines of the run's rows file that belong to one section's points, read as they come."""

    def __init__(self, path: Path, ids: set[str]):
        self.path, self.ids, self.offset, self.partial = path, ids, 0, ""
        self.rows: dict[str, dict] = {}
        self.begun: dict[str, float] = {}
        self.current: str | None = None  # begun, no row yet
        self.last = time.time()  # when this section's latest line came

    def read(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            data = self.partial + f.read()
            self.offset = f.tell()
        *lines, self.partial = data.split("\n")
        for r in (json.loads(line) for line in lines if line.strip()):
            if r.get("begin") in self.ids:
                self.begun[r["begin"]], self.current, self.last = r["t"], r["begin"], time.time()
            elif r.get("id") in self.ids:
                self.rows[r["id"]], self.last = r, time.time()
                self.current = None if self.current == r["id"] else self.current


def _watch(proc, tail: _Tail, bounds: dict, deadline: float, grace: float) -> tuple[str, str]:
    """Poll the process and its rows until it exits (``("exit", "")``) or is killed: ``("watchdog", why)`` when its
    current point (or its start) outlives its bound, ``("deadline", why)`` past the section's deadline + grace."""
    t0 = time.time()
    while proc.poll() is None:
        tail.read()
        now, cur = time.time(), tail.current
        bound, since = (bounds[cur], tail.begun[cur]) if cur else (bounds["start"], max(t0, tail.last))
        verdict = None
        if now > deadline + grace:
            verdict = ("deadline", f"killed {now - t0:.0f} s into its process: the section's deadline passed")
        elif now - since > bound:
            verdict = ("watchdog", f"killed by the watchdog after {now - since:.0f} s (bound {bound:.0f} s, from "
                                   f"its estimate)")
        if verdict is not None:
            os.killpg(proc.pid, signal.SIGKILL)  # the process and anything it started
            proc.wait()
            tail.read()
            return verdict
        time.sleep(0.2)
    tail.read()
    return "exit", ""


def _process(name: str, todo: list[dict], deadline: float, run, tail: _Tail, bounds: dict):
    """One measuring process over ``todo``: (how it ended, why, its exit code, its last stderr line). It runs in a
    process group of its own (the watchdog kills it whole) and dies with the session (PR_SET_PDEATHSIG, Linux)."""
    spec_path, err_path = run.work / f"{name}.spec.json", run.work / f"{name}.stderr"
    spec_path.write_text(json.dumps({"device": run.device, "smoke": run.smoke, "points": todo, "deadline": deadline,
                                     "rows": str(run.rows_path)}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the other commands measure what users run
    env.update(PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
               PYTHONUNBUFFERED="1", **({"TRITON_INTERPRET": "1"} if run.interpret else {}))  # a smoke run interprets
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "bench.session_points", str(spec_path)], cwd=REPO_ROOT, env=env,
                                stderr=err, stdout=err if run.quiet else None, start_new_session=True,
                                preexec_fn=None if _PRCTL is None else functools.partial(_PRCTL, 1, signal.SIGKILL))
        how, why = _watch(proc, tail, bounds, deadline, run.costs.grace)
    lines = [ln for ln in err_path.read_text(errors="replace").splitlines() if ln.strip()]
    return how, why, proc.returncode, (lines or ["no output"])[-1][:300]


def run_points(name: str, pts: list[dict], deadline: float, run, bounds: dict) -> list[dict]:
    """Every point of one section in as few processes as it takes, the faults isolated as docs/gpu-window.md says
    (Faults): a hang or a crash costs its point, and its implementation's (or provider's) later points are skipped."""
    tail, broken, todo = _Tail(run.rows_path, {p["id"] for p in pts}), {}, list(pts)
    while todo:
        append_rows(run.rows_path, [stub(p, "skipped", f"{_key(p)} broke earlier in this section: {broken[_key(p)]}")
                                    for p in todo if _key(p) in broken])
        todo = [p for p in todo if _key(p) not in broken]
        if not todo:
            break
        how, why, rc, last_err = _process(name, todo, deadline, run, tail, bounds)
        left = [p for p in todo if p["id"] not in tail.rows]
        if not left:
            break
        if how == "exit" and rc == RESTART:  # it wrote its broken point's row and stopped
            crashed = next((p for p in reversed(todo) if tail.rows.get(p["id"], {}).get("crashed")), None)
            if crashed is not None:
                broken[_key(crashed)] = f"a CUDA fault at {crashed['id']}"
            todo = left
            continue
        why = f"the {name} process died (exit code {rc}): {last_err}" if how == "exit" else why
        stuck = left[0] if left[0]["id"] in tail.begun else None
        if stuck is None or how == "deadline":  # died before its first point, or the section's time ran out
            reason = why if how != "deadline" else "the section's time ran out (its process was stopped)"
            append_rows(run.rows_path, [stub(p, "skipped", reason) for p in left])
            break
        status = "timeout" if how == "watchdog" else "error"
        append_rows(run.rows_path, [stub(stuck, status, why)])
        broken[_key(stuck)] = f"{status} at {stuck['id']}: {why}"
        run.say(f"[red]  {stuck['id']}: {status}: {why}[/red]")
        todo = left[1:]
    tail.read()
    return [tail.rows[p["id"]] for p in pts if p["id"] in tail.rows]


@dataclass
class Fresh:
    """What ``run_points`` needs of a command that is not a session: one point per process, specs and rows in a scratch
    folder, their output kept out of the console (the command prints its own lines)."""
    device: str
    con: object = None
    smoke: bool = False
    interpret: bool = False
    quiet: bool = True
    costs: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(grace=0.0))  # no deadline
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fastrl-bench-")))

    rows_path = property(lambda self: self.work / "points.rows.jsonl")

    def say(self, text: str) -> None:
        if self.con is not None:
            self.con.print(text)


def run_fresh(specs: list[dict], device: str, timeout_s: float, *, con=None, on_result=None,
              run: Fresh | None = None) -> list[dict]:
    """Each spec measured in a fresh ``bench.session_points`` process (``run_spec``) under the session's watchdog: a
    process past ``timeout_s`` or one that died (exit code -9: most likely the OOM killer) gives an ``error`` row.
    The results in the order of ``specs``; ``on_result(spec, result)`` as each finishes."""
    run, out = run or Fresh(device, con), []
    for spec in specs:
        who, n = str(spec.get("provider") or spec.get("trainer") or spec.get("mode", "")), uuid.uuid4().hex[:12]
        p = {"id": f"point/{n}/{who}", "section": "point", "provider": who, "smoke": run.smoke, "spec": spec}
        t0 = time.perf_counter()
        rows = run_points(f"point-{n}", [p], float("inf"), run, {"start": timeout_s, p["id"]: timeout_s})
        res = {k: v for k, v in (rows[0] if rows else stub(p, "error", "no row")).items()
               if k not in ("id", "section", "spec", "crashed", "provider")}
        if res.get("status") == "timeout":
            res["status"] = "error"  # the per-point commands' word for a killed point
        out.append({**res, "process_s": time.perf_counter() - t0})
        if on_result is not None:
            on_result(spec, out[-1])
    return out
