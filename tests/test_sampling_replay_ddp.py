"""Sampling replay under DDP: two gloo processes on CPU, real ``fastrl.GRPOTrainer.train()`` runs.

The test launches this file with ``torch.distributed.run --nproc_per_node 2``. Each rank trains the tiny model of
``tests/test_sampling_replay.py`` (top_k=5, top_p=0.9, transformers generate) through DistributedDataParallel,
first with ``sampling_replay="kept_set"`` and gradient accumulation 2 (the kept sets are shuffled and split with
their rows on each rank), then with ``sampling_replay="rule"``. Checks: both runs complete on both ranks (the
trainer checks each kept set against its completion and raises on misalignment), every generation batch's
recorded kept sets contain that rank's sampled tokens, ``sampling/kept_size_mean`` is logged in (0, top_k], the
ranks trained on different completions, and their parameters stay identical (DDP all-reduces the gradients).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from tiny import end_worker, launch_two_gloo, param_diff_vs_rank0

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.distributed


def _worker(out_dir: str) -> None:
    import tempfile

    sys.path.insert(0, str(HERE))
    import torch
    from test_sampling_replay import TOP_K, grpo_trainer

    from fastrl.trainers.sampling import KEPT_KEY, stack_sequences

    # one directory per rank: the reference weights are saved (before the first trainer builds accelerate's
    # distributed state) where this rank's trainers load them
    tmp = Path(tempfile.mkdtemp())
    result = {"runs": {}}
    for replay, overrides in (("kept_set", {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}),
                              ("rule", {})):
        trainer = grpo_trainer(tmp, sampling_replay=replay, max_steps=2, **overrides)
        rank = trainer.accelerator.process_index
        assert trainer.accelerator.num_processes == 2, trainer.accelerator.num_processes
        seen = {"batches": 0, "tokens": 0, "outside": 0, "completion_sum": 0}
        generate = trainer._generate_and_score_completions

        def checked(inputs, generate=generate, seen=seen, replay=replay):
            out = generate(inputs)
            ids, mask = out["completion_ids"], out["completion_mask"].bool()
            seen["batches"] += 1
            seen["tokens"] += int(mask.sum())
            seen["completion_sum"] += int(ids[mask].sum())
            if replay == "kept_set":
                kept = stack_sequences(out[KEPT_KEY], ids.size(1))
                seen["outside"] += int((~kept.contains(ids)[mask.reshape(-1)]).sum())
            return out

        trainer._generate_and_score_completions = checked
        params = trainer.accelerator.unwrap_model(trainer.model).parameters()
        before = torch.cat([p.detach().reshape(-1).clone() for p in params])
        trainer.train()
        assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel), type(trainer.model_wrapped)
        flat, diff = param_diff_vs_rank0(trainer.accelerator.unwrap_model(trainer.model))
        logs = [h for h in trainer.state.log_history if "loss" in h]
        result["rank"] = rank
        result["runs"][replay] = dict(
            seen, param_max_diff_vs_rank0=diff, steps=len(logs),
            param_change=(flat - before).abs().max().item(),
            kept_size=[h.get("sampling/kept_size_mean") for h in logs], top_k=TOP_K,
            outside_frac=[h.get("sampling/label_outside_frac") for h in logs],
        )
    with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    end_worker()


def test_sampling_replay_ddp_two_gloo_processes(tmp_path):
    pytest.importorskip("trl")
    launch_two_gloo(Path(__file__), tmp_path, "--worker", port_base=31500)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for res in results:
        for replay, run in res["runs"].items():
            label = f"rank {res['rank']} {replay}"
            assert run["steps"] == 2, label
            assert run["batches"] >= 1 and run["tokens"] > 0, label
            assert run["outside"] == 0, f"{label}: sampled tokens outside their recorded kept sets"
            # kept_set: at most top_k ids; rule: the rule's set extended by the sampled token where it falls
            # outside (the policy moved since sampling: the second iteration), so at most top_k + that fraction
            extra = run["outside_frac"] if replay == "rule" else [0.0] * run["steps"]
            for size, more in zip(run["kept_size"], extra):
                assert more is not None and 0.0 <= more <= 1.0, f"{label}: sampling/label_outside_frac {more}"
                assert size is not None and 0.0 < size <= run["top_k"] + more + 1e-6, \
                    f"{label}: sampling/kept_size_mean {size}"
            if replay == "rule":  # the first step trains the policy that sampled: each rank replays its own sampler
                assert run["outside_frac"][0] == 0.0, f"{label}: sampled tokens outside the sampler's own rule"
            assert run["param_change"] > 0.0, f"{label}: training did not move the parameters"
            assert run["param_max_diff_vs_rank0"] == 0.0, f"{label}: ranks' parameters diverged under DDP"
    for replay in ("kept_set", "rule"):
        r0, r1 = (res["runs"][replay] for res in results)
        assert r0["completion_sum"] != r1["completion_sum"], f"{replay}: each rank should have its own completions"
        assert r0["kept_size"] == r1["kept_size"], f"{replay}: the metric is gathered over both ranks"


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(sys.argv[2])
