"""The light install: the core library needs torch alone; the trainers say which extra to install.

``pip install -e .`` (no extra) must give a working ``fastrl.fused_logprobs`` / ``policy_loss`` without triton,
transformers, accelerate, TRL or datasets. A fresh process with those packages made unimportable stands in for
that install (the suite's own environment has them all).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fastrl

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("triton", "transformers", "trl", "accelerate", "datasets", "tokenizers", "rich", "peft", "liger_kernel")

LIGHT_SCRIPT = f"""
import sys
for name in {HEAVY!r}:
    sys.modules[name] = None  # `import name` now fails as if the package were not installed
import torch
import fastrl
from fastrl.reference import logprobs_reference

torch.manual_seed(0)
h = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
w = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
t = torch.randint(0, 40, (2, 5))
logp, ent = fastrl.fused_logprobs(h, w, t)
ref_logp, ref_ent = logprobs_reference(h.detach().reshape(-1, 16), w.detach(), t.reshape(-1))
assert torch.allclose(logp.detach().reshape(-1), ref_logp, atol=1e-12), (logp, ref_logp)
(logp.sum() + ent.sum()).backward()
assert h.grad is not None and w.grad is not None
config = fastrl.PolicyLossConfig(loss_type="dapo", beta=0.04)
loss, metrics = fastrl.policy_loss(h, w, t, torch.randn(2, dtype=torch.float64), torch.ones(2, 5, dtype=torch.bool),
                                   config=config, ref_logprobs=logp.detach() + 0.1)
loss.backward()
assert torch.isfinite(loss) and "kl" in metrics
fastrl.value_loss(torch.zeros(2, 5), torch.zeros(2, 5), torch.ones(2, 5), torch.ones(2, 5), 0.2)
loaded = sorted(m for m in sys.modules if sys.modules[m] is not None and m.split(".")[0] in {HEAVY!r})
assert not loaded, loaded
try:
    from fastrl import GRPOTrainer
except ModuleNotFoundError as e:
    print("ERROR:", e)
else:
    raise AssertionError("GRPOTrainer imported without trl")
print("LIGHT OK")
"""


def test_core_library_works_without_the_trainer_packages():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTRL_BACKEND")}
    proc = subprocess.run([sys.executable, "-c", LIGHT_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "LIGHT OK" in proc.stdout, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    error = next(line for line in proc.stdout.splitlines() if line.startswith("ERROR:"))
    assert "fastrl.GRPOTrainer needs the package 'trl'" in error and 'pip install "fastrl-kernels[trl]"' in error


@pytest.mark.parametrize("name,module,missing", [("GRPOTrainer", "fastrl.trainers.grpo", "trl"),
                                                 ("PPOTrainer", "fastrl.trainers.ppo", "transformers")])
def test_trainer_without_its_packages_names_the_extra(monkeypatch, name, module, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # as if `pip install -e .` without [trl]
    monkeypatch.delitem(sys.modules, module, raising=False)  # import it afresh (restored afterwards)
    monkeypatch.delitem(vars(fastrl), name, raising=False)  # drop the cached lazy attribute (restored afterwards)
    with pytest.raises(ModuleNotFoundError) as info:
        exec(f"from fastrl import {name}", {})
    msg = str(info.value)
    assert f"fastrl.{name} needs the package '{missing}'" in msg
    assert 'pip install "fastrl-kernels[trl]"' in msg and 'pip install -e ".[trl]"' in msg
    assert info.value.name == missing


def test_pyproject_core_needs_torch_alone():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert [d.split(">")[0].split("=")[0].strip() for d in meta["dependencies"]] == ["torch"]
    extras = meta["optional-dependencies"]
    names = {k: {d.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip() for d in v}
             for k, v in extras.items()}
    assert {"trl", "transformers", "accelerate", "datasets"} <= names["trl"]
    assert "triton" not in names["trl"]  # a CPU user of the trainers needs no Triton; CUDA torch brings its own
    for extra in ("test", "bench"):
        assert {"fastrl-kernels[trl]", "triton"} <= names[extra], extra


def test_the_installed_distribution_has_the_documented_name():
    """The package index's ``fastrl`` is an unrelated project: this one installs as ``DISTRIBUTION`` (import name
    ``fastrl``). The installed metadata, pyproject.toml and every ``pip install`` of README.md and docs/ say so."""
    import re
    from importlib import metadata

    from fastrl._extras import DISTRIBUTION

    # a set: an editable install from a checkout is found twice (its dist-info, and the egg-info that the build
    # leaves in the checkout, on sys.path when Python runs from there)
    assert set(metadata.packages_distributions().get("fastrl", [])) == {DISTRIBUTION}
    assert metadata.version(DISTRIBUTION) == fastrl.__version__
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"] == DISTRIBUTION
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {m for page in pages for m in re.findall(r"pip install\s+\"?(fastrl[\w.-]*)", page.read_text())}
    assert named == {DISTRIBUTION}, named


def test_trainers_name_deepspeeds_cpu_accelerator(monkeypatch):
    """Without CUDA, DeepSpeed (imported by accelerate while a trainer is built, where it is installed) would warn
    "Setting accelerator to CPU ..." on every run; the trainers name the CPU, its only choice there, first."""
    import torch

    pytest.importorskip("trl")
    from fastrl.trainers._distributed import name_deepspeed_cpu

    monkeypatch.setenv("DS_ACCELERATOR", "restored-after-the-test")
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    name_deepspeed_cpu()
    assert "DS_ACCELERATOR" not in os.environ  # a CUDA machine: DeepSpeed detects it itself
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    name_deepspeed_cpu()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")  # a user's choice is left alone
    name_deepspeed_cpu()
    assert os.environ["DS_ACCELERATOR"] == "xpu"
