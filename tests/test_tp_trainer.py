"""fastrl.GRPOTrainer and fastrl.DistillationTrainer on models loaded under transformers' tensor-parallel plan, two
gloo processes (CPU).

``AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")`` under ``torch.distributed.run`` shards a tiny Qwen2
(4 heads, 2 KV heads, V = 161: uneven shards) over a 1-D "tp" mesh; its ``lm_head.weight`` is a DTensor placed
``Shard(0)`` and its plan, ``colwise_gather_output``, would gather ``[N, V]`` logits. fastrl's head reads the shard
instead (``fastrl.trainers._lm_head.call_with_head`` -> ``fastrl.ops.sharded``): the ``lm_head`` module is never
called, and the loss and every parameter gradient (gathered with ``full_tensor``) equal the same trainer's on the
model loaded whole, in the same process, for both fastrl paths (the one-pass policy loss; TRL's loss math on
fastrl's log-probs) and with a reference model (beta != 0); for distillation (beta 0.5, the JSD) with the student
loaded under the plan and the teacher whole, then both under the plan.

What does not run on a CPU: ``Trainer.train()`` with a TP model. transformers' ``Trainer`` builds accelerate's
``ParallelismConfig(tp_size=2)`` for a model whose ``tp_size > 1``, and accelerate 1.x refuses it on CPU processes
("ParallelismConfig is only compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or
DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU"). The trainer here is built with the model's TP degree
hidden from that check (``model._tp_size = 1`` during ``__init__`` only) and its ``compute_loss`` + ``backward`` run
on the TP model directly: the part fastrl owns (the loss on the sharded head), not accelerate's TP training loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

pytestmark = pytest.mark.distributed

REL = 1e-5  # float32, as tests/test_grpo_trainer.py
V, H = 161, 32
CASES = {  # name -> fastrl.GRPOConfig overrides
    "one_pass": dict(one_pass_loss=True, beta=0.0),
    "trl_path": dict(one_pass_loss=False, beta=0.0),
    "one_pass_ref": dict(one_pass_loss=True, beta=0.04),
    # sampling replay: the generation's rule (top_k, top_p, min_new_tokens) replayed across the shards
    "rule_replay": dict(one_pass_loss=True, beta=0.0, sampling_replay="rule", top_k=5, top_p=0.9,
                        generation_kwargs={"min_new_tokens": 2}),
}


def _trainer(model, tmp: Path, **kw):
    import fastrl
    from test_grpo_trainer import make_trainer

    trainer = make_trainer(fastrl.GRPOTrainer, fastrl.GRPOConfig, tmp, model=model, **kw)
    trainer.current_gradient_accumulation_steps = 1  # set by train(); compute_loss outside train() reads it
    return trainer


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from test_grpo_trainer import make_batch
    from tiny import end_worker, run_step, save_for_reference, tiny_qwen2

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    path = out / "model"
    if rank == 0:
        save_for_reference(tiny_qwen2(V, H, 1, seed=0, heads=4, kv_heads=2), path)
    dist.barrier()
    result = {}
    for name, kw in CASES.items():
        tp = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="eager")
        w = tp.lm_head.weight
        result.setdefault("head", dict(kind=type(w).__name__, placements=str(tuple(getattr(w, "placements", ()))),
                                       mesh=list(w.device_mesh.mesh_dim_names or ()), local=list(w.to_local().shape),
                                       plan=tp._tp_plan.get("lm_head"), tp_size=tp.tp_size))
        calls = []
        tp.lm_head.register_forward_hook(lambda *a: calls.append(1))
        degree, tp._tp_size = tp._tp_size, 1  # accelerate's ParallelismConfig refuses CPU processes (module docstring)
        trainer = _trainer(tp, out / f"tp-{name}-{rank}", **kw)
        tp._tp_size = degree
        batch = make_batch(trainer, seed=10)  # the same batch on both ranks: TP ranks share their data
        loss, grads, metrics = run_step(trainer, batch)
        grads = {n: (g.full_tensor() if isinstance(g, DTensor) else g) for n, g in grads.items()}
        whole = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
        loss1, grads1, metrics1 = run_step(_trainer(whole, out / f"whole-{name}-{rank}", **kw), batch)
        rel = {n: ((grads[n] - g).norm() / g.norm().clamp(min=1e-30)).item() for n, g in grads1.items()}
        result[name] = dict(loss=loss, loss_whole=loss1, grad_rel=rel, missing=sorted(set(grads1) - set(grads)),
                            lm_head_calls=len(calls), metrics={k: float(v) for k, v in metrics.items()},
                            metrics_whole={k: float(v) for k, v in metrics1.items()})
    result.update(_distillation(out, rank))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_worker()


def _distillation(out: Path, rank: int) -> dict:
    """fastrl.DistillationTrainer with the student (and then the teacher too) loaded under the TP plan."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import test_distillation_trainer as D
    from tiny import run_step

    if rank == 0:
        D.student_model(heads=4, kv_heads=2).save_pretrained(out / "student")
        D.teacher_model(heads=4, kv_heads=2).save_pretrained(out / "teacher")
    dist.barrier()
    batch, result = D.make_batch(seed=3), {}

    def load(name, tp):
        kw = dict(tp_plan="auto") if tp else {}
        return AutoModelForCausalLM.from_pretrained(out / name, attn_implementation="eager", **kw)

    for case, teacher_tp in (("distill_tp_student", False), ("distill_tp_both", True)):
        student, teacher = load("student", True), load("teacher", teacher_tp)
        calls = []
        for m in (student, teacher):
            m.lm_head.register_forward_hook(lambda *a: calls.append(1))
        hidden = [m for m in (student, teacher) if m.tp_size]
        for m in hidden:  # accelerate's ParallelismConfig refuses CPU processes (module docstring)
            m._tp_size = 1
        trainer = D.ours(out / f"{case}-{rank}", model=student, teacher=teacher, beta=0.5)
        for m in hidden:
            m._tp_size = 2
        loss, grads, _ = run_step(trainer, batch)
        grads = {n: (g.full_tensor() if isinstance(g, DTensor) else g) for n, g in grads.items()}
        loss1, grads1, _ = run_step(D.ours(out / f"{case}-whole-{rank}", model=load("student", False),
                                           teacher=load("teacher", False), beta=0.5), batch)
        rel = {n: ((grads[n] - g).norm() / g.norm().clamp(min=1e-30)).item() for n, g in grads1.items()}
        result[case] = dict(loss=loss, loss_whole=loss1, grad_rel=rel, missing=sorted(set(grads1) - set(grads)),
                            lm_head_calls=len(calls))
    return result


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-trainer")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "ACCELERATE_USE_CPU": "true", "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(35500 + os.getpid() % 1000), str(Path(__file__).resolve()), "--worker", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_model_loads_with_a_vocabulary_sharded_head(launched):
    for rank, res in enumerate(launched):
        head = res["head"]
        assert head["kind"] == "DTensor" and head["placements"] == "(Shard(dim=0),)", head
        assert head["mesh"] == ["tp"] and head["tp_size"] == 2 and head["plan"] == "colwise_gather_output", head
        assert head["local"] == [(V + 1) // 2 if rank == 0 else V // 2, H], head  # torch.chunk's uneven split


@pytest.mark.parametrize("case", [*CASES, "distill_tp_student", "distill_tp_both"])
def test_step_on_tp_model_equals_whole_model(launched, case):
    for rank, res in enumerate(launched):
        r = res[case]
        assert r["lm_head_calls"] == 0, f"rank {rank}: the gathering lm_head module ran {r['lm_head_calls']} times"
        assert abs(r["loss"] - r["loss_whole"]) <= REL * max(abs(r["loss_whole"]), 1e-3), (rank, r["loss"],
                                                                                               r["loss_whole"])
        assert not r["missing"], f"rank {rank}: no gradient for {r['missing']}"
        worst = max(r["grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= REL, f"rank {rank}: gradient of {worst[0]} differs by {worst[1]:.2e} relative"
        if "metrics" in r:  # the metrics the loss logged: same names, same values
            assert sorted(r["metrics"]) == sorted(r["metrics_whole"]), (rank, sorted(r["metrics"]))
            for k, v in r["metrics_whole"].items():
                assert r["metrics"][k] == pytest.approx(v, rel=REL, abs=1e-6), (rank, k, r["metrics"][k], v)
        if case == "rule_replay":  # the replay ran: its metrics are there
            assert "sampling/label_outside_frac" in r["metrics"] and "sampling/kept_size_mean" in r["metrics"]


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(Path(sys.argv[sys.argv.index("--worker") + 1]))
