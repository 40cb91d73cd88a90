"""fastrl.DistillationTrainer against stock TRL through DistributedDataParallel: two gloo processes on CPU.

The test launches this file with ``torch.distributed.run --nproc_per_node 2``. Each rank builds a stock and a
fastrl trainer on the same tiny student and teacher, wraps both students with ``accelerator.prepare_model`` (DDP
over gloo), feeds each its rank's own batch (``num_items_in_batch`` counted over both ranks, as TRL gathers it),
and compares the loss, the all-reduced gradients and the cross-process ``entropy`` metric for beta in {0, 0.5, 1};
then it runs two real training steps (generation, loss, optimizer) with fastrl and checks that the ranks'
parameters stay identical.
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
    import torch.distributed as dist

    from test_distillation_trainer import BETAS, make_batch, ours, rel_err, run_step, stock

    tmp = Path(tempfile.mkdtemp())
    st, fr = stock(tmp), ours(tmp)
    rank = st.accelerator.process_index
    assert st.accelerator.num_processes == 2, st.accelerator.num_processes
    for t in (st, fr):
        t.model = t.accelerator.prepare_model(t.model)
    assert isinstance(fr.model, torch.nn.parallel.DistributedDataParallel), type(fr.model)
    batch = make_batch(seed=10 + rank)  # a different batch on each rank
    count = batch["completion_mask"].sum()
    dist.all_reduce(count)
    batch["num_items_in_batch"] = count  # TRL's gathered count over both ranks
    result = {"rank": rank, "cases": []}
    for beta in BETAS:
        (l_ref, g_ref, m_ref), (l_got, g_got, m_got) = (run_step(t, batch, beta=beta) for t in (st, fr))
        result["cases"].append(dict(
            beta=beta, path=fr._fastrl_last_path, loss=[l_ref, l_got],
            grad_rel=max(rel_err(g_got[n], g_ref[n]) for n in g_ref), metrics=[m_ref, m_got],
            grad_norm=sum(g.norm() ** 2 for g in g_got.values()).item() ** 0.5,
        ))

    run = ours(tmp, max_steps=2, beta=0.5)
    run.train()
    _, result["param_max_diff_vs_rank0"] = param_diff_vs_rank0(run.accelerator.unwrap_model(run.model))
    result["train_losses"] = [h["loss"] for h in run.state.log_history if "loss" in h]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    end_worker()


def test_ddp_two_gloo_processes(tmp_path):
    pytest.importorskip("trl")
    launch_two_gloo(Path(__file__), tmp_path, "--worker", port_base=30500)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for res in results:
        for case in res["cases"]:
            label = f"rank {res['rank']} beta={case['beta']}"
            l_ref, l_got = case["loss"]
            assert case["path"] == "fused", label
            assert abs(l_got - l_ref) <= 1e-5 * abs(l_ref), f"{label}: loss {l_got} vs stock TRL {l_ref}"
            assert case["grad_rel"] <= 1e-5, f"{label}: all-reduced gradients differ by {case['grad_rel']:.2e}"
            m_ref, m_got = case["metrics"]
            assert set(m_ref) == set(m_got) == {"entropy"}, label
            assert m_got["entropy"] == pytest.approx(m_ref["entropy"], rel=1e-5), label
        assert res["param_max_diff_vs_rank0"] == 0.0, "ranks' parameters diverged under DDP"
        assert len(res["train_losses"]) == 2
    # gradients are all-reduced: both ranks hold the same gradient although their batches differ
    for c0, c1 in zip(results[0]["cases"], results[1]["cases"]):
        assert c0["grad_norm"] == pytest.approx(c1["grad_norm"], rel=1e-6), c0["beta"]
        assert c0["loss"][1] != c1["loss"][1], "each rank should have its own batch"
        # the entropy metric is gathered over both ranks: the same number on each
        assert c0["metrics"][1]["entropy"] == pytest.approx(c1["metrics"][1]["entropy"], rel=1e-6)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(sys.argv[2])
