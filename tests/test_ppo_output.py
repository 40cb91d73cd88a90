"""What a PPO run prints: each sample-completions table once, and above the progress bar, not inside it."""

from __future__ import annotations

import pandas as pd
import pytest
import tqdm.std

pytest.importorskip("trl")

from test_ppo_trainer import make_trainer  # noqa: E402

from fastrl.trainers import ppo_tables  # noqa: E402


def test_final_completions_table_is_not_printed_twice(tmp_path, capsys):
    # 2 updates, a sample table after each; then the example script's final generate_completions() call
    trainer = make_trainer(tmp_path, num_sample_generations=2, total_episodes=16)
    trainer.train()
    assert capsys.readouterr().out.count("model response") == 2  # one table per update
    df = trainer.generate_completions()
    assert capsys.readouterr().out.count("model response") == 0  # the rows the last update just printed
    assert trainer.last_completions is df and len(df) == 6  # still computed in full (and sent to trackers)


def test_tables_go_through_tqdm_write(monkeypatch):
    written = []
    monkeypatch.setattr(tqdm.std.tqdm, "write", classmethod(lambda cls, s, *a, **k: written.append(s)))
    ppo_tables.print_rich_table(pd.DataFrame({"query": ["w1 w2"], "model response": ["w7 w7"], "score": [0.5]}))
    assert len(written) == 1 and "model response" in written[0] and "w7 w7" in written[0]
