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
    kw = {"extra_mb": 100.0, **kw}  # within any workload's memory ceiling unless a test says otherwise
    return dict(section=section, workload=workload, provider=provider, implementation=impl, config=config, kind=kind,
                N=16384, V=151936, H=H, dtype="bfloat16", status="ok", total_ms={"median": ms},
                configs_served=served or {}, **kw)


def _fused(cfg):
    return {k: {"config": cfg, "source": "forced" if cfg != str(tuning.CANDIDATES[0]) else "table", "use_tma": True}
            for k in ("stats", "grad")}


def _session(path, rows, *, family="sm90", clean=True, smoke=False, created="2026-12-01T10:00:00+00:00",
             commit="abc1234", checks="full"):
    checks_kind = checks
    checks = [dict(section="checks", workload="awkward", provider="fastrl", implementation=i, status="ok", pass_=True)
              for i in ("triton-hybrid", "triton-fused")]
    for c in checks:
        c["pass"] = c.pop("pass_")
    data = {"command": "session", "smoke": smoke, "rows": checks + rows, "checks": checks_kind,
            "env": {"device": "NVIDIA H200", "device_type": "cpu" if smoke else "cuda", "family": family,
                    "fastrl_commit": commit, "tree_clean": clean, "created": created}}
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
    # only wins enter: the hybrid (the built-in choice) winning W2-lp and the loss leaves those keys to it unwritten;
    # the fused 64x256 row at W2-lp has no default-configuration fused row to beat, so no configuration at H=896
    assert picks == {("logprob", 1916, None): "triton-fused", ("forward", 1916, None): "triton-fused"}
    assert all(e["run"].endswith("nvidia-h200/run/session.json") for e in table["CHOICES"])
    ns = _install(monkeypatch, table)
    assert ns["RUNS"][0]["used"] and "(0.743x)" in next(e["evidence"] for e in ns["CHOICES"] if e["kind"] == "logprob"
                                                            and e["h_min"] == 1916)  # 101 ms against the hybrid's 136
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
    assert tuning.config_for("grad", CUDA, H=896, **kw) == tuning.CONFIGS[("grad", "sm90", True, "default")]
    monkeypatch.setattr(tuning, "device_family", lambda device: "sm80")  # a family no session measured
    monkeypatch.setattr(backend, "device_family", tuning.device_family)
    assert backend.resolve_backend(CUDA, kind="logprob", H=4096, dtype=bf16) == "triton-hybrid"
    assert tuning.config_for("stats", CUDA, H=4096, **kw) == tuning.CONFIGS[("stats", "sm90", True, "default")]


def test_only_checked_clean_gpu_runs_decide(tmp_path):
    from bench import defaults

    rows = _crowning_rows()
    failed = [dict(r) for r in rows] + [dict(section="checks", workload="V262144", provider="fastrl",
                                             implementation="triton-fused", status="ok", **{"pass": False})]
    _session(tmp_path / "a" / "session.json", failed, created="2026-12-02T00:00:00+00:00")
    table = defaults.build([tmp_path])
    assert not table["CHOICES"] and not table["CONFIGS"]  # the fused rows cannot count: it failed a float64 check
    _session(tmp_path / "b" / "session.json", rows, clean=False, created="2026-12-03T00:00:00+00:00", commit="def5678")
    _session(tmp_path / "c" / "session.json", rows, smoke=True, created="2026-12-04T00:00:00+00:00")
    runs = {r["run"].split("/")[-2]: r for r in defaults.build([tmp_path])["RUNS"]}
    assert not runs["a"]["used"] and "beat" in runs["a"]["why"]
    assert "uncommitted" in runs["b"]["why"] and "smoke" in runs["c"]["why"]
    table = defaults.build([tmp_path], allow_dirty=True)
    runs = {r["run"].split("/")[-2]: r for r in table["RUNS"]}
    assert runs["b"]["used"] and "triton-fused" in {e["implementation"] for e in table["CHOICES"]}
    # a second call's quick check (one case) cannot clear what the first call's full checks failed at that commit,
    # and alone it clears nothing
    _session(tmp_path / "a" / "session-rest.json", rows, created="2026-12-02T00:09:00+00:00", checks="quick")
    table = defaults.build([tmp_path / "a"])
    assert not table["CHOICES"] and not table["CONFIGS"]
    _session(tmp_path / "d" / "session-rest.json", rows, commit="0123abc", checks="quick")
    assert "full float64 checks" in defaults.build([tmp_path / "d"])["RUNS"][0]["why"]


def test_a_later_partial_session_never_erases_an_earlier_choice(tmp_path):
    """Call 2 of a window measures compile and W4 only (session-rest.json, newer): call 1's choices stand. A newer
    session that measures the same key again decides it, whichever way it goes."""
    from bench import defaults

    _session(tmp_path / "w" / "session.json", _crowning_rows(), created="2026-12-01T10:00:00+00:00")
    alone = defaults.build([tmp_path])
    rest = [dict(section="compile", workload="compile-step", provider="fastrl-eager", status="ok",
                 total_ms={"median": 50.0}), dict(section="w4", workload="W4-4096", provider="trl", status="ok",
                                                  total_ms={"median": 900.0})]
    _session(tmp_path / "w" / "session-rest.json", rest, created="2026-12-01T10:09:00+00:00")
    merged = defaults.build([tmp_path])
    assert merged["CHOICES"] == alone["CHOICES"] and merged["CONFIGS"] == alone["CONFIGS"] and alone["CHOICES"]
    runs = {r["run"].split("/")[-1]: r for r in merged["RUNS"]}
    assert runs["session.json"]["used"] and not runs["session-rest.json"]["used"]
    # a newer full session where the hybrid is now the faster at W1-lp: the logprob choice at H=4096 goes back to it
    hybrid_wins = [dict(r, total_ms={"median": 90.0}) if (r["workload"], r["implementation"]) == ("W1-lp",
                   "triton-hybrid") else r for r in _crowning_rows()]
    _session(tmp_path / "x" / "session.json", hybrid_wins, created="2026-12-05T00:00:00+00:00")
    newer = defaults.build([tmp_path])
    assert ("logprob", 1916) not in {(e["kind"], e["h_min"]) for e in newer["CHOICES"]}
    assert ("forward", 1916) in {(e["kind"], e["h_min"]) for e in newer["CHOICES"]}  # W3 stays decided by the newest


def test_a_winner_must_beat_the_built_in_choice_by_the_margin_in_the_same_process(tmp_path):
    from bench import defaults

    def table(fused_ms, pid=None):
        rows = [_row("tournament", "W3", "fastrl", "triton-hybrid", 100.0, pid=1),
                _row("tournament", "W3", "fastrl", "triton-fused", fused_ms, pid=pid or 1)]
        _session(tmp_path / "s" / "session.json", rows)
        return {e["kind"]: e["implementation"] for e in defaults.build([tmp_path])["CHOICES"]}

    assert defaults.MARGIN == 0.03
    assert table(98.0) == {}  # 2% faster: noise, the built-in choice stays
    assert table(96.9) == {"forward": "triton-fused"}
    assert table(50.0, pid=2) == {}  # another process (a restart between them): not comparable


def test_each_kernel_gets_the_configuration_that_won_for_it(tmp_path):
    """sm90's one-pass forward (sm90_exp_stats) runs only in the loss: its configuration comes from the loss rows,
    the log-prob kernels' from the log-prob rows; a row whose configuration loses for a kernel cannot crown its
    implementation, and autotune's rows never decide anything."""
    from bench import defaults

    sm90, a, b = "triton-sm90", "128x128x64 w8 s4", "128x256x64 w8 s3"

    def served(cfg, kernels):
        return {k: {"config": cfg, "source": "forced", "use_tma": True} for k in kernels}

    lp, loss = ("sm90_stats", "sm90_grad"), ("sm90_exp_stats", "sm90_grad")
    builtin = {"sm90_stats": b, "sm90_grad": "128x256x64 w8 s4", "sm90_exp_stats": "128x128x64 w4 s4"}
    base_lp = {k: {"config": builtin[k], "source": "table", "use_tma": True} for k in lp}
    base_loss = {k: {"config": builtin[k], "source": "table", "use_tma": True} for k in loss}
    rows = [
        _row("tournament", "W1-lp", "fastrl", "triton-hybrid", 120.0),
        _row("tournament", "W1-lp", "fastrl", sm90, 118.0, served=base_lp),
        _row("configs", "W1-lp", "fastrl", sm90, 100.0, config=a, served=served(a, lp)),
        _row("configs", "W1-lp", "fastrl", sm90, 119.0, config=b, served=served(b, lp)),
        _row("autotune", "W1-lp", "fastrl", sm90, 50.0, config="autotune", served=served("64x64x64 w4 s2", lp)),
        _row("tournament", "W1", "fastrl-fused", "triton-hybrid", 110.0),
        _row("tournament", "W1", "fastrl-fused", sm90, 108.0, served=base_loss),
        _row("configs", "W1", "fastrl-fused", sm90, 100.0, config=a, served=served(a, loss)),
        _row("configs", "W1", "fastrl-fused", sm90, 95.0, config=b, served=served(b, loss)),
    ]
    for r in rows:
        r.setdefault("implementation", None)
    data_rows = [dict(section="checks", workload="awkward", provider="fastrl", implementation=sm90, status="ok",
                      **{"pass": True})] + rows
    _session(tmp_path / "s" / "session.json", data_rows)
    table = defaults.build([tmp_path])
    (cfg,) = table["CONFIGS"]
    assert cfg["implementation"] == sm90 and cfg["configs"] == {"sm90_stats": a, "sm90_grad": a, "sm90_exp_stats": b}
    assert "sm90_exp_stats at W1" in cfg["evidence"] and "sm90_stats at W1-lp" in cfg["evidence"]
    # log-prob: sm90 at `a` (100 ms) against the hybrid's 120. The loss: no sm90 row ran what the table installs
    # (sm90_exp_stats at `b` with sm90_grad at `a`): none can crown it, the built-in choice stays
    picks = {e["kind"]: (e["implementation"], e["evidence"]) for e in table["CHOICES"]}
    assert picks["logprob"][0] == sm90 and "100.00 ms against triton-hybrid 120.00 ms" in picks["logprob"][1]
    assert "loss" not in picks


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
    assert [{k: v for k, v in kw.items() if k != "tensors"} for kw in seen] == \
        [dict(kind="logprob", H=8, dtype=fp32)] + [dict(kind="forward", H=8, dtype=fp32)] * 2
    assert all(kw["tensors"][0].shape == (5, 8) and kw["tensors"][1] is weight for kw in seen)


def test_policy_loss_tells_the_dispatch_it_is_a_loss(monkeypatch):
    """policy_loss asks for the 'loss' kind's measured default (the one-pass kernel), not today's choice."""
    import fastrl
    from fastrl.ops import policy_run

    seen = []

    def spy(device, requested=None, **kw):
        seen.append(kw)
        return backend.resolve_backend(device, requested, **kw)

    monkeypatch.setattr(policy_run, "resolve_backend", spy)
    B, T, H, V = 2, 3, 8, 11
    hidden, weight = torch.randn(B, T, H, requires_grad=True), torch.randn(V, H)
    targets, mask = torch.randint(0, V, (B, T)), torch.ones(B, T)
    fastrl.policy_loss(hidden, weight, targets, advantages=torch.randn(B), mask=mask, backend="torch",
                       config=fastrl.PolicyLossConfig())
    assert [{k: v for k, v in kw.items() if k != "tensors"} for kw in seen] == [dict(kind="loss", H=H,
                                                                                      dtype=torch.float32)]
    assert seen[0]["tensors"] == (hidden, weight)


def test_auto_never_picks_an_implementation_that_refuses_the_work(sm90, monkeypatch):
    """sm90 crowned for log-probs at H >= 1916 in bf16: ``auto`` still falls back (to the built-in choice) where sm90
    would raise: an H whose bf16 rows are not 16-byte multiples, a view that starts mid-row, a GPU older than sm_90."""
    entry = dict(family="sm90", kind="logprob", dtype="bfloat16", h_min=1916, h_max=None, implementation="triton-sm90")
    monkeypatch.setattr(backend, "_CHOICES", backend._index_choices([entry, {**entry, "dtype": "float32"}]))
    bf16 = torch.bfloat16

    def pick(H, dtype=bf16, tensors=()):
        return backend.resolve_backend(CUDA, kind="logprob", H=H, dtype=dtype, tensors=tensors)

    assert pick(4096) == "triton-sm90"
    assert pick(4100) == "triton-hybrid"  # 8200-byte rows: TMA needs multiples of 16
    assert pick(4100, torch.float32) == "triton-sm90"  # 16400 bytes
    w = torch.randn(64, 4100, dtype=bf16)
    assert pick(4096, tensors=(w[:, :4096],)) == "triton-hybrid"  # rows 8200 bytes apart
    assert pick(4096, tensors=(w[:, 4:].contiguous(), w[:, :4096].contiguous())) == "triton-sm90"
    assert pick(4096, tensors=(torch.randn(4, 4097, dtype=bf16)[:, 1:],)) == "triton-hybrid"  # base off by 2 bytes
    assert pick(4096, tensors=(torch.randn(4096, 8, dtype=bf16).T,)) == "triton-sm90"  # copied by the op: aligned
    monkeypatch.setattr(backend, "device_family", lambda device: "sm90" if device.type == "cuda" else "cpu")
    assert backend.runs_here("triton-sm90", CUDA, 4096, bf16) and not backend.runs_here("triton-sm90", CUDA, 4096,
                                                                                          torch.float64)
    monkeypatch.setattr(backend, "device_family", lambda device: "sm80")
    assert not backend.runs_here("triton-sm90", CUDA, 4096, bf16)
    assert not backend.runs_here("triton-gone", CUDA, 4096, bf16)


@pytest.mark.interpreter
def test_a_misaligned_view_runs_under_auto_with_a_crowned_sm90(sm90, monkeypatch):
    """The same through ``fused_logprobs`` on the interpreter: the dispatch's answer is what the op runs, and it runs
    (sm90 itself would raise ValueError on this view)."""
    import fastrl
    from fastrl.ops import linear_logprob

    entry = dict(family="sm90", kind="logprob", dtype="bfloat16", h_min=None, h_max=None, implementation="triton-sm90")
    monkeypatch.setattr(backend, "_CHOICES", backend._index_choices([entry]))
    picked = []

    def as_if_cuda(device, requested=None, **kw):  # resolve on the faked sm90 device, run on this CPU
        name = backend.resolve_backend(CUDA, requested, **kw)
        picked.append(name)
        return name

    g = torch.Generator().manual_seed(0)
    big = torch.randn(6, 33, generator=g).to(torch.bfloat16)
    hidden = big[:, 1:].requires_grad_()  # 32 wide, but 2 bytes past a 16-byte boundary
    weight = torch.randn(40, 32, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, 40, (6,), generator=g)
    with pytest.raises(ValueError, match="16 bytes"):
        fastrl.fused_logprobs(hidden, weight, targets, backend="triton-sm90")
    monkeypatch.setattr(linear_logprob, "resolve_backend", as_if_cuda)
    logp, _ = fastrl.fused_logprobs(hidden, weight, targets)
    assert picked == ["triton-hybrid"] and torch.isfinite(logp).all()


def test_a_winner_must_fit_the_memory_ceiling(tmp_path):
    """A row faster than the built-in choice is crowned only if its extra memory is at most TRL's on the same workload
    in the same process; a faster row over it is listed in REFUSED, and the fastest row within the ceiling competes."""
    from bench import defaults

    def table(sm90_mb, fused_ms=100.0):
        rows = [dict(section="checks", workload="awkward", provider="fastrl", implementation="triton-sm90",
                     status="ok", **{"pass": True}),
                _row("tournament", "W2-lp", "trl", None, 34.0, extra_mb=831.0, pid=1),
                _row("tournament", "W2-lp", "fastrl", "triton-hybrid", 38.0, extra_mb=312.0, pid=1),
                _row("tournament", "W2-lp", "fastrl", "triton-sm90", 31.0, extra_mb=sm90_mb, pid=1),
                _row("tournament", "W2-lp", "fastrl", "triton-fused", fused_ms, extra_mb=184.0, pid=1)]
        _session(tmp_path / "s" / "session.json", rows)
        t = defaults.build([tmp_path])
        return {e["kind"]: e["implementation"] for e in t["CHOICES"]}, [e["implementation"] for e in t["REFUSED"]], t

    assert table(800.0)[:2] == ({"logprob": "triton-sm90"}, [])
    assert table(1168.0)[:2] == ({}, ["triton-sm90"])  # over TRL's 831 MiB: the built-in choice stays
    choices, refused, t = table(1168.0, fused_ms=34.0)  # the fastest within the ceiling wins instead
    assert choices == {"logprob": "triton-fused"} and refused == ["triton-sm90"]
    assert "memory 184 MiB (ceiling 831)" in t["CHOICES"][0]["evidence"]
    _session(tmp_path / "s" / "session.json", [_row("tournament", "W3", "fastrl", "triton-hybrid", 36.0),
                                                _row("tournament", "W3", "fastrl", "triton-sm90", 30.0, extra_mb=None)])
    assert defaults.build([tmp_path])["CHOICES"] == []  # memory not measured: never crowned


def test_policy_loss_asks_for_the_default_of_its_route(monkeypatch):
    """The one-pass loss asks for the 'loss' kind, a loss on path A (a coupled loss whose sequence does not fit a
    chunk) for 'logprob', a loss without gradients for 'forward': each route's default is decided on its own rows."""
    import fastrl
    from fastrl.ops import policy_run

    seen = []

    def spy(device, requested=None, **kw):
        seen.append(kw["kind"])
        return backend.resolve_backend(device, requested, **kw)

    monkeypatch.setattr(policy_run, "resolve_backend", spy)
    B, T, H, V = 2, 3, 8, 11
    hidden, weight = torch.randn(B, T, H, requires_grad=True), torch.randn(V, H)
    targets, mask = torch.randint(0, V, (B, T)), torch.ones(B, T)
    kw = dict(advantages=torch.randn(B), mask=mask, backend="torch", old_logprobs=torch.randn(B, T) - 3)
    fastrl.policy_loss(hidden, weight, targets, config=fastrl.PolicyLossConfig(), **kw)
    fastrl.policy_loss(hidden, weight, targets, chunk_tokens=1, **kw,
                       config=fastrl.PolicyLossConfig(importance_sampling_level="sequence"))
    with torch.no_grad():
        fastrl.policy_loss(hidden, weight, targets, config=fastrl.PolicyLossConfig(), **kw)
    assert seen == ["loss", "loss", "logprob", "forward"]
