"""fastrl.DistillationTrainer under DeepSpeed ZeRO-3, two gloo processes on CPU, against stock TRL in the same launch.

``accelerate launch --config_file examples/ppo_configs/deepspeed_zero3.yaml`` (two processes, float32) runs this
file's worker. Each rank runs one training step (``Trainer.train``, SGD, no clipping, so the update is
``-lr * gradient``) of stock ``trl.DistillationTrainer`` and of ``fastrl.DistillationTrainer`` on its own batch (in
place of generation; ``num_items_in_batch`` counted over both ranks), student and teacher both ZeRO-3 partitioned
(the teacher prepared by TRL as a DeepSpeed inference engine). The parent checks: each rank's loss equals stock
TRL's, the gathered parameter update equals stock TRL's (1e-5 relative per parameter), the ranks hold the same
parameters, and both LM heads were partitioned when the loss began (fastrl gathers them itself for the divergence's
forward and again for its backward).

Uses ``tests/test_distributed.py``'s launch environment (DeepSpeed's CPU communication op built once, cached).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from test_distributed import CONFIGS, _free_port, _held, _run, _tail, dist_env  # noqa: F401 (dist_env: fixture)

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.distributed

REL = 1e-5
STEP = dict(optim="sgd", learning_rate=50.0, max_grad_norm=0.0, lr_scheduler_type="constant", max_steps=1,
            beta=0.5)


def _full_state(trainer) -> dict[str, torch.Tensor]:
    import deepspeed

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def _worker(out: Path) -> None:
    sys.path.insert(0, str(HERE))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from test_distillation_trainer import make_batch, ours, stock

    rank = int(os.environ["RANK"])
    batches = [make_batch(seed=10 + r) for r in (0, 1)]
    batch = dict(batches[rank])
    batch["num_items_in_batch"] = sum(b["completion_mask"].sum() for b in batches)  # TRL gathers it
    result = {"rank": rank}
    for name, make in (("stock", stock), ("fastrl", ours)):
        trainer = make(out / f"tmp-{name}-{rank}", **STEP)
        assert trainer.accelerator.num_processes == 2, trainer.accelerator.num_processes
        losses, heads = [], {}
        compute_loss = trainer.compute_loss

        def recording(*args, _compute=compute_loss, _t=trainer, _heads=heads, _losses=losses, **kwargs):
            unwrap = _t.accelerator.unwrap_model
            _heads["student"] = _held(unwrap(_t.model_wrapped).get_output_embeddings().weight)
            _heads["teacher"] = _held(unwrap(_t.teacher_model).get_output_embeddings().weight)
            loss = _compute(*args, **kwargs)
            _losses.append(loss.detach().item())
            return loss

        trainer.compute_loss = recording
        trainer._generate_and_score_completions = lambda generation_batch, _b=batch: dict(_b)
        trainer.train()
        state = _full_state(trainer)
        flat = torch.cat([v.reshape(-1) for v in state.values()])
        rank0 = flat.clone()
        dist.broadcast(rank0, src=0)
        result[name] = dict(losses=losses, heads=heads, path=getattr(trainer, "_fastrl_last_path", None),
                            teacher=type(trainer.teacher_model).__name__,
                            max_diff_vs_rank0=(flat - rank0).abs().max().item())
        if rank == 0:
            torch.save(state, out / f"state-{name}.pt")
            if name == "stock":  # the step's starting point: the same seeds build the same student
                torch.save(_initial_state(), out / "state-before.pt")
        del trainer
    with open(out / f"rank{rank}.json", "w") as f:
        json.dump(result, f)


def _initial_state() -> dict[str, torch.Tensor]:
    from test_distillation_trainer import student_model

    return {n: p.detach().clone() for n, p in student_model().named_parameters()}


def test_zero3_distillation_step_matches_stock_trl(dist_env, tmp_path):  # noqa: F811 (dist_env: the fixture)
    worker = [str(Path(__file__).resolve()), "--worker", str(tmp_path)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "deepspeed_zero3.yaml"),
           "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(_free_port()), *worker]
    _run(cmd, dist_env, tmp_path / "launch.log", "the ZeRO-3 distillation launch")
    ranks = []
    for r in (0, 1):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), \
            f"rank {r} wrote no result; the launch's output ends with:\n{_tail(tmp_path / 'launch.log')}"
        ranks.append(json.loads(path.read_text()))
    for res in ranks:
        label = f"rank {res['rank']}"
        st, fr = res["stock"], res["fastrl"]
        assert fr["path"] == "fused", label
        assert fr["teacher"] == "DeepSpeedEngine", f"{label}: teacher held as {fr['teacher']}"
        assert len(st["losses"]) == len(fr["losses"]) == 1, label
        assert abs(fr["losses"][0] - st["losses"][0]) <= REL * abs(st["losses"][0]), \
            f"{label}: loss {fr['losses'][0]!r}, stock TRL under ZeRO-3 {st['losses'][0]!r}"
        for who in ("student", "teacher"):
            head = fr["heads"][who]
            assert head["kind"] == "zero3" and head["local"] * 2 == head["full"] and not head["available"], \
                f"{label}: the {who}'s LM head was not partitioned when the loss began: {head}"
        assert fr["max_diff_vs_rank0"] == 0.0 and st["max_diff_vs_rank0"] == 0.0, f"{label}: ranks diverged"
    assert ranks[0]["fastrl"]["losses"] != ranks[1]["fastrl"]["losses"], "each rank should have its own batch"
    before = torch.load(tmp_path / "state-before.pt")
    ref, got = torch.load(tmp_path / "state-stock.pt"), torch.load(tmp_path / "state-fastrl.pt")
    assert set(got) == set(ref) == set(before)
    for name in ref:
        expected, update = ref[name] - before[name], got[name] - before[name]
        assert expected.norm() > 0, f"stock TRL's step did not move {name}"
        err = ((update - expected).norm() / expected.norm()).item()
        assert err <= REL, f"the update of {name} differs from stock TRL's under ZeRO-3 by {err:.2e} (relative)"


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(Path(sys.argv[2]))
