"""The trainers with ``torch_compile=True`` (TRL's / transformers' training argument): the model is compiled by the
accelerator, and fastrl's fused head and loss run inside the compiled forward. Same loss and gradients as the
eager trainer, one graph, no graph break (tiny Qwen2 models, float32 on CPU, aot_eager to keep compiling cheap;
the inductor path of the same ops is checked in test_compile.py)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("trl")

import test_grpo_trainer as G  # noqa: E402
import test_ppo_trainer as P  # noqa: E402

COMPILE = dict(torch_compile=True, torch_compile_backend="aot_eager")


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def test_grpo_trainer_torch_compile_same_step(tmp_path):
    eager = G.ours(tmp_path / "eager", "one_pass", beta=0.04)
    comp = G.ours(tmp_path / "compiled", "one_pass", beta=0.04, **COMPILE)
    batch = G.make_batch(eager)
    opts = {**G.DEFAULTS, "beta": 0.04, "entropy_coef": 0.01}
    G.set_loss_options(eager, **opts)
    G.set_loss_options(comp, **opts)
    want = G.run_step(eager, batch)

    model = comp.accelerator.prepare_model(comp.model)  # what Trainer.train does with torch_compile=True
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    torch._dynamo.reset()
    counters.clear()
    model.train()
    model.zero_grad(set_to_none=True)
    comp._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    loss = comp.compute_loss(model, dict(batch))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in comp.model.named_parameters() if p.grad is not None}
    got = (loss.item(), grads, {k: v[-1] for k, v in comp._metrics["train"].items()})
    assert comp._fastrl_last_path == "one_pass"
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (
        dict(counters["stats"]), dict(counters["graph_break"]))
    G.assert_same_step(want, got, "GRPOTrainer torch_compile=True", rel=1e-6)


def test_ppo_trainer_torch_compile_same_micro_batch(tmp_path):
    def micro_batch(trainer, batch):
        wrapper = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        params = {n.replace("_orig_mod.", ""): p for n, p in wrapper.named_parameters() if p.requires_grad}
        trainer.optimizer.step = lambda *a, **k: None  # keep this micro-batch's gradients
        trainer.optimizer.zero_grad = lambda *a, **k: None
        for p in params.values():
            p.grad = None
        with trainer.accelerator.accumulate(trainer.model_wrapped):
            metrics = trainer._train_micro_batch(batch, torch.arange(4))
        return metrics, {n: p.grad.clone() for n, p in params.items() if p.grad is not None}

    opts = dict(cliprange=0.1, cliprange_value=0.05, vf_coef=0.3)
    eager = P.make_trainer(tmp_path / "eager", **opts)
    comp = P.make_trainer(tmp_path / "compiled", **opts, **COMPILE)
    assert isinstance(comp.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    torch.manual_seed(5)
    batch = eager._rollout(eager._queries(0))
    want_m, want_g = micro_batch(eager, batch)
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):  # a second micro-batch reuses the graph (the head closure is new each time)
        got_m, got_g = micro_batch(comp, batch)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (
        dict(counters["stats"]), dict(counters["graph_break"]))
    for k in ("loss/policy_avg", "loss/value_avg", "policy/clipfrac_avg", "val/clipfrac_avg"):
        assert abs(got_m[k].item() - want_m[k].item()) <= 1e-6 * max(abs(want_m[k].item()), 1e-6), k
    assert set(got_g) == set(want_g)
    for n in want_g:
        assert _rel(got_g[n], want_g[n]) <= 1e-6, n
