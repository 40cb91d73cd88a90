"""``tiny.end_worker``, the last call of every multi-process test worker: a rank whose results are written exits 0
even when the interpreter's teardown would abort, and a rank that failed before it still fails.

The teardown abort itself is intermittent (gloo's threads against Python finalisers and C++ static destructors at
exit); here it is made certain by an ``atexit`` handler that aborts the process, which runs in exactly that
teardown. One process, a world of one over gloo: a few seconds.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

WORKER = """
import atexit, os, sys
sys.path.insert(0, {here!r})
import torch.distributed as dist
from tiny import end_worker

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
atexit.register(os.abort)  # stands in for gloo's teardown abort: SIGABRT after the work is done
if {fail}:
    raise RuntimeError("the work failed")
open({out!r}, "w").write("done")
end_worker()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, fail: bool) -> subprocess.CompletedProcess:
    out = tmp_path / "result.txt"
    code = WORKER.format(here=str(HERE), port=_free_port(), fail=fail, out=str(out))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_finished_rank_exits_zero_past_a_teardown_abort(tmp_path):
    proc = _run(tmp_path, fail=False)
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert (tmp_path / "result.txt").read_text() == "done"


def test_a_failed_rank_still_fails(tmp_path):
    proc = _run(tmp_path, fail=True)
    assert proc.returncode != 0 and "the work failed" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "result.txt").exists()
