"""Defaults that come from committed GPU measurements (issue 28 item 4), and forcing a launch configuration.

``python -m bench defaults`` turns session results into ``fastrl/kernels/_defaults.py``; ``choose_triton`` and
``config_for`` read it. Checked here without a GPU: a CUDA device is faked by its family (``device_family``),
which is the only thing the lookups ask of it.
"""

import pytest
import torch

from fastrl.kernels import tuning
from fastrl.ops import backend

CUDA = torch.device("cuda")
CFG = tuning.KernelConfig(64, 256, 64, 8, 4)


@pytest.fixture
def sm90(monkeypatch):
    """A CUDA device of family sm90 as far as the dispatch can tell (gpu_family too, for the built-in table)."""
    monkeypatch.setattr(tuning, "device_family", lambda device: "sm90" if device.type == "cuda" else "cpu")
    monkeypatch.setattr(backend, "device_family", tuning.device_family)
    monkeypatch.setattr(tuning, "gpu_family", lambda device: "sm90" if device.type == "cuda" else "interpreter")
    monkeypatch.setattr(backend, "cuda_f32_out", lambda device: device.type == "cuda")
    monkeypatch.setattr(backend, "_triton_available", lambda: True)


def test_parse_config_round_trips_and_names_bad_text():
    for cfg in tuning.CANDIDATES:
        assert tuning.parse_config(str(cfg)) == cfg
    assert tuning.parse_config("128x256x64w8s3") == tuning.KernelConfig(128, 256, 64, 8, 3)
    with pytest.raises(ValueError, match="FASTRL_KERNEL_CONFIG must read .* got '128x256'"):
        tuning.parse_config("128x256", tuning.FORCE_ENV)


def test_forced_config_wins_over_table_and_autotune(monkeypatch):
    kw = dict(H=64, V=1000, dtype=torch.bfloat16, use_tma=True)
    cpu = torch.device("cpu")
    tuning.reset_served()
    assert tuning.config_for("stats", cpu, **kw) == tuning.CONFIGS[("stats", "interpreter", True, "default")]
    assert tuning.served()["stats"][1] == "table"
    with tuning.forced_config(CFG):
        with tuning.forced_config("128x128x64 w4 s4"):  # the innermost wins
            assert tuning.config_for("grad", cpu, **kw) == tuning.KernelConfig(128, 128, 64, 4, 4)
        monkeypatch.setenv("FASTRL_AUTOTUNE", "1")
        calls = []
        assert tuning.config_for("stats", cpu, launch=calls.append, **kw) == CFG and not calls
    assert tuning.served() == {"stats": (CFG, "forced"), "grad": (tuning.KernelConfig(128, 128, 64, 4, 4), "forced")}
    # the environment forces a whole process (how `bench session` runs each candidate)
    monkeypatch.delenv("FASTRL_AUTOTUNE")
    monkeypatch.setenv(tuning.FORCE_ENV, "64x256x64 w8 s4")
    assert tuning.config_for("stats", cpu, **kw) == CFG
    monkeypatch.setenv(tuning.FORCE_ENV, "big")
    with pytest.raises(ValueError, match="FASTRL_KERNEL_CONFIG"):
        tuning.config_for("stats", cpu, **kw)


def _config_entry(**kw):
    entry = dict(family="sm90", implementation="triton-fused", dtype="bfloat16", h_min=1916, h_max=None, use_tma=True,
                 configs={"stats": str(CFG)}, run="bench/results/x/session.json", evidence="")
    entry.update(kw)
    return entry


def test_measured_config_by_family_h_range_dtype_and_variant(sm90, monkeypatch):
    monkeypatch.setattr(tuning, "_MEASURED", tuning._index_measured([_config_entry()]))
    kw = dict(V=151936, dtype=torch.bfloat16, use_tma=True)
    assert tuning.config_for("stats", CUDA, H=4096, **kw) == CFG
    assert tuning.served()["stats"] == (CFG, "measured")
    built_in = tuning.CONFIGS[("stats", "sm90", True, "default")]
    assert tuning.config_for("stats", CUDA, H=896, **kw) == built_in  # below the measured H range
    assert tuning.config_for("grad", CUDA, H=4096, **kw) == tuning.CONFIGS[("grad", "sm90", True, "default")]
    assert tuning.config_for("stats", CUDA, H=4096, V=151936, dtype=torch.float16, use_tma=True) == built_in
    assert tuning.config_for("stats", CUDA, H=4096, has_bias=True, **kw) == tuning.CONFIGS[("stats", "sm90", True, "bias")]
    assert tuning.config_for("stats", CUDA, H=4096, V=151936, dtype=torch.bfloat16, use_tma=False) == \
        tuning.CONFIGS[("stats", "sm90", False, "default")]
    monkeypatch.setattr(tuning, "device_family", lambda device: "sm100")  # another family: the built-in table
    assert tuning.config_for("stats", CUDA, H=4096, **kw) == built_in


def test_empty_table_keeps_todays_choice(sm90, monkeypatch):
    monkeypatch.setattr(backend, "_CHOICES", ())
    for kind in ("loss", "logprob", "forward", None):
        assert backend.resolve_backend(CUDA, kind=kind, H=4096, dtype=torch.bfloat16) == "triton-hybrid"
    monkeypatch.setattr(backend, "cuda_f32_out", lambda device: False)
    assert backend.resolve_backend(CUDA, "triton", kind="logprob", H=4096, dtype=torch.bfloat16) == "triton-fused"
    assert backend.resolve_backend(torch.device("cpu")) == "torch"
