"""DDP and FSDP2 with two gloo processes on CPU.

DDP: fastrl.GRPOTrainer against stock TRL through DistributedDataParallel.

The test launches this file with ``torch.distributed.run --nproc_per_node 2``. Each rank builds a stock and a
fastrl trainer on the same tiny model, wraps both models with ``accelerator.prepare_model`` (DDP over gloo), feeds
each its rank's own batch, and compares the all-reduced gradients, the loss and the cross-process metrics; then it
runs two real training steps with fastrl and checks that the ranks' parameters stay identical.

FSDP2: ``fully_shard`` on a tiny model (the LM head sharded on its own, so it is a ``DTensor`` when fastrl's head
reads it, and with the root only); fastrl's ``fused_lm_head`` forward gives the unsharded model's log-probs and
entropies, and the gathered gradients of every parameter equal the unsharded model's.
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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from test_grpo_trainer import DEFAULTS, H, V, make_batch, ours, rel_err, run_step, set_loss_options, stock
    from tiny import save_for_reference, tiny_qwen2

    tmp = Path(tempfile.mkdtemp())
    # the reference weights are saved before accelerate's distributed state exists (save_pretrained is
    # main-process-only afterwards); both trainers build their reference model from them
    ref_dir = save_for_reference(tiny_qwen2(V, H, 1, seed=0), tmp / "ref")
    models = [tiny_qwen2(V, H, 1, seed=0) for _ in range(2)]
    for m in models:
        m.config._name_or_path = ref_dir
    st, fr = stock(tmp, beta=0.04, model=models[0]), ours(tmp, beta=0.04, model=models[1])
    rank = st.accelerator.process_index
    assert st.accelerator.num_processes == 2, st.accelerator.num_processes
    for t in (st, fr):
        t.model = t.accelerator.prepare_model(t.model)
    assert isinstance(fr.model, torch.nn.parallel.DistributedDataParallel), type(fr.model)
    batch = make_batch(st, seed=10 + rank)  # a different batch on each rank
    batch["num_items_in_batch"] = batch["num_items_in_batch"] * 2  # TRL's gathered count over both ranks
    result = {"rank": rank, "cases": []}
    for loss_type, level in (("dapo", "token"), ("grpo", "sequence"), ("bnpo", "token"), ("cispo", "token")):
        opts = {**DEFAULTS, "loss_type": loss_type, "importance_sampling_level": level, "beta": 0.04,
                "epsilon_high": 4.0 if loss_type == "cispo" else 0.28}
        runs = []
        for t in (st, fr):
            set_loss_options(t, **opts)
            runs.append(run_step(t, batch))
        (l_ref, g_ref, m_ref), (l_got, g_got, m_got) = runs
        worst = max(rel_err(g_got[n], g_ref[n]) for n in g_ref)
        result["cases"].append(dict(
            case=f"{loss_type}-{level}", path=fr._fastrl_last_path, loss=[l_ref, l_got], grad_rel=worst,
            metric_names_equal=sorted(m_ref) == sorted(m_got),
            metric_max_rel=max(abs(m_got[k] - v) / max(abs(v), 1e-6) for k, v in m_ref.items()),
            grad_norm=sum(g.norm() ** 2 for g in g_got.values()).item() ** 0.5,
        ))

    # two real training steps under DDP (generation, rewards, optimizer), then compare ranks' parameters
    run = ours(tmp, loss_type="dapo", max_steps=2)
    run.train()
    _, result["param_max_diff_vs_rank0"] = param_diff_vs_rank0(run.accelerator.unwrap_model(run.model))
    result["train_losses"] = [h["loss"] for h in run.state.log_history if "loss" in h]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    end_worker()


def _fsdp_worker(out_dir: str) -> None:
    sys.path.insert(0, str(HERE))
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for separate_head in (True, False):
        _fsdp_case(out_dir, separate_head)
    end_worker()


def _fsdp_case(out_dir: str, separate_head: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fastrl.trainers._lm_head import HeadSettings, add_fastrl_lm_head
    from tiny import tiny_qwen2

    rank = dist.get_rank()
    V, H = 160, 32
    ref, model = tiny_qwen2(V, H, 2, seed=0), tiny_qwen2(V, H, 2, seed=0)
    for m in (ref, model):
        add_fastrl_lm_head(m, HeadSettings(temperature=0.9))
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if separate_head:
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (4, 10), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    outs = []
    for m in (ref, model):
        out = m(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)
        (out.log_probs.sum() + 0.3 * out.entropy.sum()).backward()
        outs.append(out)
    grad_rel = 0.0
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grad_rel = max(grad_rel, ((full - q.grad).norm() / q.grad.norm()).item())  # FSDP2 averages; same batch
    res = dict(rank=rank, logp_err=(outs[1].log_probs - outs[0].log_probs).abs().max().item(),
               ent_err=(outs[1].entropy - outs[0].entropy).abs().max().item(), grad_rel=grad_rel,
               head_type=type(model.lm_head.weight).__name__)
    with open(os.path.join(out_dir, f"fsdp{int(separate_head)}-rank{rank}.json"), "w") as f:
        json.dump(res, f)


def _launch(tmp_path, *worker_args):
    launch_two_gloo(Path(__file__), tmp_path, *worker_args, port_base=29500)


def test_fsdp2_two_gloo_processes(tmp_path):
    _launch(tmp_path, "--fsdp-worker")
    for separate_head in (1, 0):  # the LM head sharded on its own (a DTensor when read), or with the root
        for r in (0, 1):
            res = json.loads((tmp_path / f"fsdp{separate_head}-rank{r}.json").read_text())
            assert res["logp_err"] <= 1e-6 and res["ent_err"] <= 1e-5, res
            assert res["grad_rel"] <= 1e-5, f"FSDP2 gradients differ from the unsharded model's: {res}"


def test_ddp_two_gloo_processes(tmp_path):
    pytest.importorskip("trl")
    _launch(tmp_path, "--worker")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for res in results:
        for case in res["cases"]:
            label = f"rank {res['rank']} {case['case']}"
            l_ref, l_got = case["loss"]
            assert abs(l_got - l_ref) <= 1e-5 * abs(l_ref), f"{label}: loss {l_got} vs stock TRL {l_ref}"
            assert case["grad_rel"] <= 1e-5, f"{label}: all-reduced gradients differ by {case['grad_rel']:.2e}"
            assert case["metric_names_equal"], label
            assert case["metric_max_rel"] <= 1e-5, f"{label}: metrics differ by {case['metric_max_rel']:.2e}"
            assert case["path"] == "one_pass", label
        assert res["param_max_diff_vs_rank0"] == 0.0, "ranks' parameters diverged under DDP"
        assert len(res["train_losses"]) == 2
    # gradients are all-reduced: both ranks see the same gradient although their batches differ
    for c0, c1 in zip(results[0]["cases"], results[1]["cases"]):
        assert c0["grad_norm"] == pytest.approx(c1["grad_norm"], rel=1e-6), c0["case"]
        assert c0["loss"][1] != c1["loss"][1], "each rank should have its own batch"


if __name__ == "__main__" and len(sys.argv) == 3:
    if sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    elif sys.argv[1] == "--fsdp-worker":
        _fsdp_worker(sys.argv[2])
