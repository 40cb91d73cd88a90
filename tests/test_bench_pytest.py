"""``pytest bench/ --benchmark-only`` (bench/test_benchmarks.py, pytest-benchmark): the file stays collectable with
the core ops and their peers, the ``[bench]`` extra installs pytest-benchmark, and the default test run never
collects it."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IDS = {f"test_op[{op}-{who}]" for op, whos in (
    ("logprob", ("fastrl", "torch", "trl")), ("loss", ("fastrl-fused", "fastrl", "torch", "trl", "liger-fused")),
    ("divergence", ("fastrl", "torch", "trl", "liger")), ("kept", ("kept", "full"))) for who in whos}


def _pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_the_benchmarks_collect_the_core_ops_and_their_peers():
    out = _pytest("bench/", "--collect-only", "-q")
    assert out.returncode == 0, out.stdout + out.stderr
    ids = {line.split("::")[-1] for line in out.stdout.splitlines() if line.startswith("bench/test_benchmarks.py::")}
    assert ids == IDS, ids ^ IDS


def test_the_default_run_leaves_them_out_and_the_bench_extra_brings_pytest_benchmark():
    text = (REPO / "pyproject.toml").read_text()
    assert '\ntestpaths = ["tests"]\n' in text  # `python -m pytest` never times anything
    assert '"pytest-benchmark>=' in text.split("\nbench = [", 1)[1].split("\n]", 1)[0]


@pytest.mark.skipif(importlib.util.find_spec("pytest_benchmark") is None, reason="pytest-benchmark not installed")
def test_one_benchmark_runs_once():
    """--benchmark-disable: each benchmark once, untimed (what CI can afford); the kept set against the full head."""
    out = _pytest("bench/", "-k", "kept", "--benchmark-disable", "-q")
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout + out.stderr
