"""``python -m fastrl.demo``: device choice, progress lines, verdict, and a short run end to end.

The CUDA path of the demo cannot run on the CI machine; its pieces that decide (device, precision, batch shape)
are checked here with CUDA faked, and the whole demo runs on the CPU at a tiny comparison shape.
"""

from __future__ import annotations

import re
import sys
import tempfile
import warnings

import pytest
import torch

from fastrl import demo


def _fake_cuda(monkeypatch, available: bool, bf16: bool = True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


def test_pick_device(monkeypatch):
    _fake_cuda(monkeypatch, available=True)
    assert demo.pick_device("auto") == "cuda"
    assert demo.pick_device("cuda") == "cuda"
    assert demo.pick_device("cpu") == "cpu"  # --device overrides
    _fake_cuda(monkeypatch, available=False)
    assert demo.pick_device("auto") == "cpu"
    with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
        demo.pick_device("cuda")
    with pytest.raises(ValueError, match="--device must be one of"):
        demo.pick_device("tpu")


def test_precision_and_shapes_follow_the_device(monkeypatch):
    _fake_cuda(monkeypatch, available=True, bf16=True)
    assert demo.use_bf16("cuda") and not demo.use_bf16("cpu")
    _fake_cuda(monkeypatch, available=True, bf16=False)  # e.g. a V100: float32
    assert not demo.use_bf16("cuda")

    kw = demo.train_config_kwargs("/x", "cuda", True, 7)
    assert kw["use_cpu"] is False and kw["bf16"] is True and kw["max_steps"] == 7
    kw = demo.train_config_kwargs("/x", "cpu", False, 7)
    assert kw["use_cpu"] is True and kw["bf16"] is False

    gpu = demo.measurement_shape("cuda", quick=False)
    assert gpu["device"] == "cuda" and gpu["dtype"] == "bfloat16" and gpu["vocab"] == 151936
    assert demo.measurement_shape("cuda", quick=True)["completion_len"] < gpu["completion_len"]
    cpu = demo.measurement_shape("cpu", quick=False)
    assert cpu["device"] == "cpu" and cpu["dtype"] == "float32"


def test_demo_config_builds_without_warnings():
    from fastrl import GRPOConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = GRPOConfig(**demo.train_config_kwargs("/tmp/unused", "cpu", False, 3))
    assert not caught, [str(w.message) for w in caught]
    assert args.activation_checkpointing is False and args.health_checks is False


def test_grpo_config_keeps_trls_checkpointing_default_without_a_future_warning():
    from fastrl import GRPOConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on = GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False)
        off = GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, activation_checkpointing=False)
    assert not caught, [str(w.message) for w in caught]
    assert on.activation_checkpointing is True and on.gradient_checkpointing is True  # TRL's default: on
    assert off.activation_checkpointing is False and off.gradient_checkpointing is False
    # the old name still works (transformers warns about it, rightly: the user wrote it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, gradient_checkpointing=False)
    assert old.activation_checkpointing is False
    assert any("gradient_checkpointing" in str(w.message) for w in caught)


def test_step_line():
    logs = {"loss": -0.0174, "reward": 0.5, "reward_std": 0.1, "entropy": 4.14, "completions/mean_length": 7.7,
            "step_time": 0.05, "grad_norm": 1.0, "clip_ratio/low_mean": 0.0}
    line = demo.step_line(3, 40, logs)
    assert line == "step  3/40  reward 0.500 (std 0.100)  entropy 4.14  loss -0.0174  length 7.7  0.05 s"
    assert demo.step_line(40, 40, {"train_runtime": 1.0, "train_loss": 0.1}) is None  # the end-of-run summary
    # a GRPO loss is often tiny: significant digits, never "-0.0000"
    assert "loss -2.35e-05  " in demo.step_line(3, 40, {**logs, "loss": -2.345e-5})


def _row(which, mb, s):
    return {"which": which, "peak_extra_mb": mb, "seconds": s, "loss": 0.1}


def test_verdict():
    learned = demo.TrainResult(steps=40, rewards=[0.02, 0.03, 0.04] + [0.5] * 10 + [0.98, 0.99, 1.0], seconds=30)
    flat = demo.TrainResult(steps=10, rewards=[0.02] * 10, seconds=5)
    rising = demo.TrainResult(steps=10, rewards=[0.02, 0.03, 0.04, 0.1, 0.2, 0.3], seconds=5)
    v = demo.verdict(learned, [_row("trl", 1400, 13.7), _row("fastrl", 336, 7.1)])
    assert v.startswith("Verdict: The policy learned the task (reward 0.03 -> 0.99 in 40 steps, 30 s).")
    assert "fastrl's step took 4.2x less memory than stock TRL's (336 vs 1400 MB), and was 1.9x faster" in v
    v = demo.verdict(flat, [_row("trl", 1000, 1.0), _row("fastrl", 2000, 1.5)])
    assert "did not rise" in v and "2.0x MORE memory" in v and "1.5x slower" in v
    assert "not learned yet" in demo.verdict(rising, None)
    assert "about the same memory" in demo.verdict(None, [_row("trl", 1000, 1.0), _row("fastrl", 1020, 1.02)])
    failed = demo.verdict(None, [_row("trl", 1000, 1.0), {"which": "fastrl", "error": "Traceback ...\nOOM"}])
    assert "did not complete (fastrl failed" in failed


def test_demo_without_the_trl_extra_names_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if `pip install -e .` without [trl]
    assert demo.main(["--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "'datasets'" in err and 'pip install "fastrl-kernels[trl]"' in err and 'pip install -e ".[trl]"' in err


def test_demo_runs_clean(tmp_path, monkeypatch, capsys):
    """A 3-step demo with a tiny comparison batch: one line per step, a verdict, no warning, no temp folder left.

    In this process (a fresh one costs ~5 s of imports per trainer on 2 cores): the comparison's two steps run
    through ``measure_step`` directly instead of ``run_measurement``'s fresh processes.
    """
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    def in_process(which, **kw):  # run_measurement's progress lines, without its fresh process
        return demo.measure_step(which, progress=lambda m: print(f"  {demo.LABELS[which]}: {m}"), **kw)

    monkeypatch.setattr(demo, "run_measurement", in_process)
    shape = dict(vocab=512, hidden=32, layers=1, batch=2, prompt_len=8, completion_len=16, dtype="float32",
                 device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert demo.main(["--device", "cpu", "--steps", "3"], shape=shape) == 0
    out, err = capsys.readouterr()
    steps = [line for line in out.splitlines() if re.match(r"\s+step\s+\d+/3\s", line)]
    assert len(steps) == 3, out  # one progress line per step, not TRL's dict as well
    assert "{'loss'" not in out and "'train_runtime'" not in out
    assert re.search(r"stock TRL:\s+[\d.]+ MB", out) and re.search(r"fastrl:\s+[\d.]+ MB", out), out
    assert "\nVerdict: " in out
    for label in ("stock TRL", "fastrl"):  # progress while each step is measured: warm-up, then each timed step
        assert re.search(rf"{label}: trainer built; warm-up: one untimed step on 2 x 16 tokens \(first-call set-up\)\n"
                         rf"\s+{label}: warm-up done \([\d.]+ s\); timing 1 step on 2 x 16 tokens\n"
                         rf"\s+{label}: step 1/1: [\d.]+ s", out), out
    assert not caught, [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
    assert not re.search(r"warn", out + err, re.IGNORECASE), f"stdout:\n{out}\nstderr:\n{err}"
    assert "VmHWM" not in out
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("fastrl-")]
