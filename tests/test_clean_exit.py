"""A user's distributed run exits 0: fastrl's trainers take the process group down before the interpreter's
teardown (``fastrl.trainers._distributed``), and ``examples/distributed_cpu.py`` (GRPO, then distillation, two
processes over gloo) launched with ``accelerate launch`` exits 0 five times in a row.

The mechanism is checked in a world of one process (a few seconds): the exit hook releases the wrapped model,
destroys the group, and a handler that runs after it sees no group left; ``fastrl.finish()`` does the same on
request. The launches are the end-to-end check (about 15 s each on 2 cores: mostly the imports).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "distributed_cpu.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


WORLD_OF_ONE = """
import atexit, sys
import torch
import torch.distributed as dist

def report():  # registered first, so it runs after fastrl's exit hook (atexit runs last-registered first)
    with open({out!r}, "w") as f:
        f.write(f"initialized={{dist.is_initialized()}} wrapped={{type(trainer.model_wrapped).__name__}}")
atexit.register(report)

import fastrl
from fastrl.trainers._distributed import release_at_exit

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)

class Trainer:  # what a trainer holds of the group: a DDP-wrapped model and an optimizer over it
    def __init__(self):
        self.model = torch.nn.Linear(4, 4)
        self.model_wrapped = torch.nn.parallel.DistributedDataParallel(self.model)
        self.optimizer = torch.optim.SGD(self.model_wrapped.parameters(), lr=0.1)

trainer = Trainer()
release_at_exit(trainer)
trainer.model_wrapped(torch.randn(2, 4)).sum().backward()  # one all-reduced backward
trainer.optimizer.step()
if {finish}:
    fastrl.finish()
    assert not dist.is_initialized()
    fastrl.finish()  # a second call, outside a group: nothing to do
"""


@pytest.mark.parametrize("explicit", [False, True], ids=["at-exit", "fastrl.finish"])
def test_the_group_is_gone_before_the_interpreter_exits(tmp_path, explicit):
    out = tmp_path / "state.txt"
    code = WORLD_OF_ONE.format(out=str(out), port=_free_port(), finish=explicit)
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the exit hook released the DDP wrapper (replaced by the module it wraps) and destroyed the group
    assert out.read_text() == "initialized=False wrapped=Linear", out.read_text()


def test_finish_outside_a_group_does_nothing():
    import torch.distributed as dist

    import fastrl

    assert not dist.is_initialized()
    fastrl.finish()
    assert not dist.is_initialized()


@pytest.mark.distributed
def test_the_example_launch_exits_zero_five_times_in_a_row(tmp_path):
    pytest.importorskip("trl")
    # `--multi_gpu` is accelerate's name for its multi-process launcher (torch.distributed.run); the script's
    # use_cpu=True joins the processes over gloo. (`--cpu` would start one process whatever --num_processes says.)
    for run in range(1, 6):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(_free_port()), str(EXAMPLE)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
        seconds = time.perf_counter() - t0
        log = f"run {run} ({seconds:.0f} s), exit code {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        assert proc.returncode == 0, log
        assert "done: 2 GRPO steps and 2 distillation steps on 2 processes" in proc.stdout, log
        assert "destroy_process_group() was not called" not in proc.stderr, log
        assert not list(tmp_path.iterdir()), f"the example wrote into the working directory: {list(tmp_path.iterdir())}"
