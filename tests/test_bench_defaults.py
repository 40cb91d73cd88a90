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
    assert tuning.served()["stats"][1:] == ("table", True)
    with tuning.forced_config(CFG):
        with tuning.forced_config("128x128x64 w4 s4"):  # the innermost wins
            assert tuning.config_for("grad", cpu, **kw) == tuning.KernelConfig(128, 128, 64, 4, 4)
        monkeypatch.setenv("FASTRL_AUTOTUNE", "1")
        calls = []
        assert tuning.config_for("stats", cpu, launch=calls.append, **kw) == CFG and not calls
    assert tuning.served() == {"stats": (CFG, "forced", True),
                               "grad": (tuning.KernelConfig(128, 128, 64, 4, 4), "forced", True)}
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
    assert tuning.served()["stats"] == (CFG, "measured", True)
    built_in = tuning.CONFIGS[("stats", "sm90", True, "default")]
    assert tuning.config_for("stats", CUDA, H=896, **kw) == built_in  # below the measured H range
    assert tuning.config_for("grad", CUDA, H=4096, **kw) == tuning.CONFIGS[("grad", "sm90", True, "default")]
    assert tuning.config_for("stats", CUDA, H=4096, V=151936, dtype=torch.float16, use_tma=True) == built_in
    biased = tuning.CONFIGS[("stats", "sm90", True, "bias")]
    assert tuning.config_for("stats", CUDA, H=4096, has_bias=True, **kw) == biased
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


# ---------------------------------------------------------------------------------------------------------------
# python -m bench defaults: from session files to the table, and from the table to what `auto` picks
# ---------------------------------------------------------------------------------------------------------------

def _row(section, workload, provider, impl, ms, config="default", served=None, **kw):
    kind = {"W1": "loss", "W2": "loss", "W3": "forward"}.get(workload, "logprob")
    H = 896 if workload.startswith("W2") else 4096
    return dict(section=section, workload=workload, provider=provider, implementation=impl, config=config, kind=kind,
                H=H, dtype="bfloat16", status="ok", total_ms={"median": ms}, configs_served=served or {}, **kw)


def _fused(cfg):
    return {k: {"config": cfg, "source": "forced" if cfg != str(tuning.CANDIDATES[0]) else "table", "use_tma": True}
            for k in ("stats", "grad")}


def _session(path, rows, *, family="sm90", clean=True, smoke=False, created="2026-12-01T10:00:00+00:00"):
    checks = [dict(section="checks", workload="awkward", provider="fastrl", implementation=i, status="ok", pass_=True)
              for i in ("triton-hybrid", "triton-fused")]
    for c in checks:
        c["pass"] = c.pop("pass_")
    data = {"command": "session", "smoke": smoke, "rows": checks + rows,
            "env": {"device": "NVIDIA H200", "device_type": "cpu" if smoke else "cuda", "family": family,
                    "fastrl_commit": "abc1234", "tree_clean": clean, "created": created}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(__import__("json").dumps(data))
    return path


def _crowning_rows():
    """triton-fused wins W1-lp and W3 (H=4096) in its 64x256 configuration; the hybrid wins W2-lp (H=896) and the
    one-pass loss at W1; TRL is slower everywhere."""
    hybrid, fused = "triton-hybrid", "triton-fused"
    return [
        _row("tournament", "W1-lp", "trl", None, 128.0),
        _row("tournament", "W1-lp", "fastrl", hybrid, 136.0),
        _row("tournament", "W1-lp", "fastrl", fused, 140.0, served=_fused("128x256x64 w8 s3")),
        _row("configs", "W1-lp", "fastrl", fused, 101.0, config=str(CFG), served=_fused(str(CFG))),
        _row("configs", "W1-lp", "fastrl", fused, 150.0, config="128x128x64 w8 s3", served=_fused("128x128x64 w8 s3")),
        _row("tournament", "W3", "fastrl", hybrid, 36.0),
        _row("configs", "W3", "fastrl", fused, 30.0, config=str(CFG), served={"stats": _fused(str(CFG))["stats"]}),
        _row("tournament", "W2-lp", "fastrl", hybrid, 40.0),
        _row("configs", "W2-lp", "fastrl", fused, 44.0, config=str(CFG), served=_fused(str(CFG))),
        _row("tournament", "W1", "fastrl-fused", hybrid, 116.0),
        _row("tournament", "W1", "fastrl-fused", fused, 200.0, served=_fused("128x256x64 w8 s3")),
    ]


def _install(monkeypatch, table):
    """The generated module, executed, as the dispatch would import it."""
    from bench import defaults

    ns = {}
    exec(defaults.render(table), ns)  # noqa: S102 - our own generated module text
    monkeypatch.setattr(backend, "_CHOICES", backend._index_choices(ns["CHOICES"]))
    monkeypatch.setattr(tuning, "_MEASURED", tuning._index_measured(ns["CONFIGS"]))
    return ns


def test_a_session_that_crowns_another_implementation_changes_the_table_and_auto(tmp_path, sm90, monkeypatch):
    from bench import defaults

    _session(tmp_path / "nvidia-h200" / "run" / "session.json", _crowning_rows())
    table = defaults.build([tmp_path])
    picks = {(e["kind"], e["h_min"], e["h_max"]): e["implementation"] for e in table["CHOICES"]}
    assert picks == {("loss", 1916, None): "triton-hybrid", ("logprob", None, 1916): "triton-hybrid",
                     ("logprob", 1916, None): "triton-fused", ("forward", 1916, None): "triton-fused"}
    assert all(e["run"].endswith("nvidia-h200/run/session.json") for e in table["CHOICES"])
    ns = _install(monkeypatch, table)
    assert ns["RUNS"][0]["used"] and "0.79x TRL" in next(e["evidence"] for e in ns["CHOICES"] if e["kind"] == "logprob"
                                                             and e["h_min"] == 1916)
    bf16 = torch.bfloat16
    assert backend.resolve_backend(CUDA, kind="logprob", H=4096, dtype=bf16) == "triton-fused"
    assert backend.resolve_backend(CUDA, "triton", kind="forward", H=2048, dtype=bf16) == "triton-fused"
    assert backend.resolve_backend(CUDA, kind="logprob", H=896, dtype=bf16) == "triton-hybrid"
    assert backend.resolve_backend(CUDA, kind="loss", H=4096, dtype=bf16) == "triton-hybrid"
    assert backend.resolve_backend(CUDA, kind="logprob", H=4096, dtype=torch.float16) == "triton-hybrid"  # unmeasured
    assert backend.resolve_backend(CUDA, kind=None, H=4096, dtype=bf16) == "triton-hybrid"  # no kind: today's choice
    assert backend.resolve_backend(CUDA, "triton-hybrid", kind="logprob", H=4096, dtype=bf16) == "triton-hybrid"
    # the fused kernels' launch configuration: its fastest log-prob row's, per H range
    kw = dict(V=151936, dtype=bf16, use_tma=True)
    assert tuning.config_for("stats", CUDA, H=4096, **kw) == CFG == tuning.config_for("grad", CUDA, H=4096, **kw)
    assert tuning.config_for("grad", CUDA, H=896, **kw) == CFG  # W2-lp's only fused row
    monkeypatch.setattr(tuning, "device_family", lambda device: "sm80")  # a family no session measured
    monkeypatch.setattr(backend, "device_family", tuning.device_family)
    assert backend.resolve_backend(CUDA, kind="logprob", H=4096, dtype=bf16) == "triton-hybrid"
    assert tuning.config_for("stats", CUDA, H=4096, **kw) == tuning.CONFIGS[("stats", "sm90", True, "default")]


def test_only_checked_clean_gpu_runs_decide_and_the_newest_wins(tmp_path):
    from bench import defaults

    rows = _crowning_rows()
    failed = [dict(r) for r in rows] + [dict(section="checks", workload="V262144", provider="fastrl",
                                             implementation="triton-fused", status="ok", **{"pass": False})]
    _session(tmp_path / "a" / "session.json", failed, created="2026-12-02T00:00:00+00:00")
    table = defaults.build([tmp_path])
    assert {e["implementation"] for e in table["CHOICES"]} == {"triton-hybrid"} and not table["CONFIGS"]
    _session(tmp_path / "b" / "session.json", rows, clean=False, created="2026-12-03T00:00:00+00:00")
    _session(tmp_path / "c" / "session.json", rows, smoke=True, created="2026-12-04T00:00:00+00:00")
    runs = {r["run"].split("/")[-2]: r for r in defaults.build([tmp_path])["RUNS"]}
    assert runs["a"]["used"] and "uncommitted" in runs["b"]["why"] and "smoke" in runs["c"]["why"]
    table = defaults.build([tmp_path], allow_dirty=True)
    runs = {r["run"].split("/")[-2]: r for r in table["RUNS"]}
    assert runs["b"]["used"] and "superseded" in runs["a"]["why"]
    assert "triton-fused" in {e["implementation"] for e in table["CHOICES"]}


def test_committed_table_is_what_the_committed_results_give():
    from bench import defaults

    table = defaults.build([defaults.REPO_ROOT / "bench" / "results"])
    assert defaults.TABLE_PATH.read_text() == defaults.render(table), "run `python -m bench defaults`"


def test_fused_logprobs_tells_the_dispatch_what_work_it_is(monkeypatch):
    """The measured defaults are per kind of work: fused_logprobs says whether a gradient will follow."""
    import fastrl
    from fastrl.ops import linear_logprob

    seen = []

    def spy(device, requested=None, **kw):
        seen.append(kw)
        return backend.resolve_backend(device, requested, **kw)

    monkeypatch.setattr(linear_logprob, "resolve_backend", spy)
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8)
    targets = torch.randint(0, 11, (5,))
    fastrl.fused_logprobs(hidden, weight, targets, backend="torch")
    with torch.no_grad():
        fastrl.fused_logprobs(hidden, weight, targets, backend="torch")
    fastrl.fused_logprobs(hidden.detach(), weight, targets, backend="torch")
    fp32 = torch.float32
    assert seen == [dict(kind="logprob", H=8, dtype=fp32)] + [dict(kind="forward", H=8, dtype=fp32)] * 2


def test_policy_loss_tells_the_dispatch_it_is_a_loss(monkeypatch):
    """policy_loss asks for the 'loss' kind's measured default (the one-pass kernel), not today's choice."""
    import fastrl
    from fastrl.losses import policy

    seen = []

    def spy(device, requested=None, **kw):
        seen.append(kw)
        return backend.resolve_backend(device, requested, **kw)

    monkeypatch.setattr(policy, "resolve_backend", spy)
    B, T, H, V = 2, 3, 8, 11
    hidden, weight = torch.randn(B, T, H, requires_grad=True), torch.randn(V, H)
    targets, mask = torch.randint(0, V, (B, T)), torch.ones(B, T)
    fastrl.policy_loss(hidden, weight, targets, advantages=torch.randn(B), mask=mask, backend="torch",
                       config=fastrl.PolicyLossConfig())
    assert seen == [dict(kind="loss", H=H, dtype=torch.float32)]
