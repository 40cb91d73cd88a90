"""The supported version range: declared floors = what CI's lower-bound environment installs, Triton's
interpreter under every Triton of the range, and the transformers API differences fastrl bridges."""

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# Packages whose lower bound .ci/run installs and tests. torch is declared but not pinned there: the only CPU
# build CI can install is torch 2.13.0 (README.md says what is tested where).
PINNED = {"triton", "transformers", "trl", "accelerate"}


def _declared_floors() -> dict[str, Version]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    floors: dict[str, set[Version]] = {}
    for line in reqs:
        req = Requirement(line)
        for spec in req.specifier:
            if spec.operator == ">=":
                floors.setdefault(req.name.lower(), set()).add(Version(spec.version))
    for name, versions in floors.items():
        assert len(versions) == 1, f"pyproject.toml declares several floors for {name}: {sorted(versions)}"
    return {name: versions.pop() for name, versions in floors.items()}


def _ci_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / ".ci" / "lower-bounds.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f".ci/lower-bounds.txt pins with ==, got {line!r}"
            pins[req.name.lower()] = Version(spec.version)
    return pins


def test_ci_lower_bounds_are_the_declared_floors():
    floors, pins = _declared_floors(), _ci_pins()
    assert set(pins) == PINNED, f".ci/lower-bounds.txt pins {sorted(pins)}, expected {sorted(PINNED)}"
    for name in PINNED:
        assert name in floors, f"pyproject.toml declares no lower bound (>=) for {name}"
        assert floors[name] == pins[name], (
            f"{name}: pyproject.toml declares >={floors[name]} but CI's lower-bound environment installs {pins[name]}")
    assert "torch" in floors


@pytest.mark.interpreter
def test_interpreter_takes_runtime_loop_bounds():
    """Triton 3.6's interpreter under numpy >= 2.4 fails every `range` with a runtime bound; fastrl repairs it
    where (and only where) that happens."""
    import fastrl.kernels  # noqa: F401  (applies the repair if this Triton + numpy need it)
    from fastrl.kernels import _interpreter_compat as compat
    from triton.runtime import interpreter

    assert compat._interpreter_indexes_tensors()
    if compat._applied:  # the repair is there only because the bug is real here
        repaired = interpreter._patch_lang_tensor
        interpreter._patch_lang_tensor = compat._original_patch_lang_tensor
        try:
            assert not compat._interpreter_indexes_tensors()
        finally:
            interpreter._patch_lang_tensor = repaired


def test_ppo_reads_checkpointing_under_both_transformers_names():
    pytest.importorskip("trl")
    from fastrl.trainers._common import args_checkpointing as _args_checkpointing
    from fastrl.trainers._common import checkpointing_on as _checkpointing_on

    kw = {"use_reentrant": True}
    # transformers < 5.23: only gradient_checkpointing*; 5.23 renamed them activation_checkpointing*
    assert _args_checkpointing(SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs=kw)) == (True, kw)
    new = SimpleNamespace(activation_checkpointing=True, activation_checkpointing_kwargs=kw,
                          gradient_checkpointing=False, gradient_checkpointing_kwargs=None)
    assert _args_checkpointing(new) == (True, kw)
    assert _checkpointing_on(SimpleNamespace(is_gradient_checkpointing=True))
    assert not _checkpointing_on(SimpleNamespace(is_activation_checkpointing=False, is_gradient_checkpointing=True))


def test_ppo_trains_with_gradient_checkpointing(tmp_path):
    """`--gradient_checkpointing`, the flag of TRL's PPO documentation, under the installed transformers."""
    pytest.importorskip("trl")
    from test_ppo_trainer import make_trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.23 calls the flag a deprecated alias
        trainer = make_trainer(tmp_path, gradient_checkpointing=True, total_episodes=8, num_ppo_epochs=1)
        assert trainer.model.is_gradient_checkpointing
        trainer.train()
    assert trainer.state.global_step == 1
