"""TrainingHealthCallback: table-driven checks on GRPO and PPO metric names, start-of-training warnings."""

from __future__ import annotations

import logging
import random
import types

import pytest

from fastrl import TrainingHealthCallback
from fastrl.trainers.health import CHECKS, LARGE_NEG_KL, NEG_KL, NEG_KL_WINDOW


def fired(logs_seq, **kw):
    cb = TrainingHealthCallback(**kw)
    out = []
    for i, logs in enumerate(logs_seq):
        out.append(cb.check_logs(logs, step=i))
    return cb, out


@pytest.mark.parametrize("logs,name", [
    ({"loss": float("nan")}, "loss_nan"),
    ({"loss/value_avg": float("inf")}, "loss_nan"),
    ({"reward": float("nan")}, "reward_nan"),
    ({"kl": -0.5}, "kl_negative"),  # one log far below zero is enough
    ({"objective/kl": -0.5}, "kl_negative"),  # PPO name
    ({"kl": 3.0}, "kl_high"),
    ({"val/ratio": 1.6}, "ratio_off"),  # PPO name
    ({"clip_ratio/region_mean": 0.4}, "clip_high"),
    ({"policy/clipfrac_avg": 0.5}, "clip_high"),
    ({"completions/clipped_ratio": 0.9}, "truncated"),
    ({"eval_kl": -0.2}, "kl_negative"),  # eval metrics are checked too
])
def test_each_check_fires(logs, name, caplog):
    with caplog.at_level(logging.WARNING, logger="fastrl.health"):
        cb, out = fired([logs])
    assert name in out[0]
    assert cb.events and cb.events[0][1] == name
    assert any(name.split("_")[0] in r.getMessage().lower() or "nan" in r.getMessage().lower()
               or "clip" in r.getMessage() for r in caplog.records)


def test_healthy_logs_are_quiet():
    healthy = {"loss": 0.01, "reward": 0.5, "kl": 0.002, "entropy": 2.0, "clip_ratio/region_mean": 0.01,
               "completions/clipped_ratio": 0.1, "val/ratio": 1.01, "objective/kl": 0.3, "loss/value_avg": 0.2}
    cb, out = fired([healthy] * 5)
    assert out == [[]] * 5 and cb.events == []


def test_kl_growing_and_value_spike():
    _, out = fired([{"kl": 0.02}, {"kl": 0.03}, {"kl": 0.05}, {"kl": 0.2}])
    assert "kl_growing" in out[-1]
    _, out = fired([{"loss/value_avg": 0.1}] * 4 + [{"loss/value_avg": 5.0}])
    assert "value_loss_spike" in out[-1]


def _kl_events(values, key="objective/kl"):
    cb, out = fired([{key: v} for v in values])
    return [i for i, o in enumerate(out) if "kl_negative" in o]


def test_negative_kl_fires_when_sustained():
    rng = random.Random(0)
    run = [-0.005 + rng.gauss(0.0, 0.002) for _ in range(12)]  # consistently below zero, small noise
    assert max(run) < 0 and min(run) > LARGE_NEG_KL  # never one "large" value: only the window can tell
    hits = _kl_events(run)
    assert hits and hits[0] == NEG_KL_WINDOW - 1  # as soon as the window is full, not before


def test_negative_kl_quiet_on_noisy_healthy_runs():
    # the README's tiny PPO run: one log at -0.0095 between positive ones (the old check fired on it)
    assert _kl_events([0.0, 0.007787, -0.009542, -0.002808]) == []
    rng = random.Random(1)
    for mean in (0.0, 0.002):  # a true KL of zero (the hardest case) and a small positive one
        run = [mean + rng.gauss(0.0, 0.01) for _ in range(300)]
        assert sum(v < NEG_KL for v in run) > 50  # plenty of single negative logs
        assert _kl_events(run) == [], mean
        assert _kl_events(run, key="kl") == [], mean  # GRPO's name, same rule


def test_negative_kl_large_is_judged_against_the_recent_spread():
    assert _kl_events([-0.3]) == [0]  # far below zero on the first log
    swinging = [1.0, 0.8, -0.2, 0.9, 0.1, 0.6]  # a KL that swings by ~0.5 from log to log
    assert _kl_events(swinging + [-0.15]) == []  # -0.2 and -0.15 are within its noise
    assert _kl_events(swinging + [-3.0]) == [len(swinging)]


def test_repeat_is_rate_limited():
    cb, out = fired([{"kl": -1.0}] * 6, repeat_every=3)
    assert all("kl_negative" in o for o in out)
    assert len([e for e in cb.events if e[1] == "kl_negative"]) == 2  # logs 1 and 4


def test_generation_settings_warning():
    cb = TrainingHealthCallback()
    args = types.SimpleNamespace(top_k=50, top_p=0.9, min_p=None, repetition_penalty=1.0,
                                 generation_kwargs={"min_new_tokens": 4})
    bad = cb.check_generation_settings(args)
    assert bad == ["top_k=50", "top_p=0.9", "min_new_tokens=4"]
    assert "negative" in cb.events[0][2]
    cb = TrainingHealthCallback()
    assert cb.check_generation_settings(types.SimpleNamespace(top_k=0, top_p=1.0, min_p=None)) == []
    assert cb.events == []


def test_checks_table_names_are_unique():
    assert len({c.name for c in CHECKS}) == len(CHECKS)


def test_attached_callback_warns_on_train_begin(tmp_path, caplog):
    from test_grpo_trainer import ours

    trainer = ours(tmp_path, top_p=0.8, max_steps=1)
    with caplog.at_level(logging.WARNING, logger="fastrl.health"):
        trainer.train()
    assert any("top_p=0.8" in r.getMessage() for r in caplog.records)
