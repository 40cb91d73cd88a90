"""Long completions on limited memory (issue 10): ``tiled_mlp`` and ``activation_offloading`` in fastrl's trainers.

* The tiled MLP changes nothing but memory: one GRPO step's loss and every parameter gradient equal those without
  it (float32, 1e-6 relative), alone, under activation checkpointing (non-reentrant and reentrant) and with LoRA
  (adapters inside the MLP too); the MLPs are checked to have really run in chunks.
* Activation offloading: TRL's ``OffloadActivations`` round-trips every saved tensor and gives the same loss and
  gradients (driven on a host "accelerator", since this machine has none; on a CPU-only model the option warns
  and does nothing).
* Peak RSS of one step at a long completion, each in a fresh process as ``bench`` measures it: lower with the tiled
  MLP.
* ``train()`` leaves the model as it found it; where tiling cannot apply, a clear error and nothing patched.
* PPO: the rollout (generation, policy / value / reference / reward forwards) and the update honour the option.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from tiny import EOS_ID, PAD_ID, tiny_qwen2, tiny_tokenizer, toy_prompt_dataset

trl = pytest.importorskip("trl")

import fastrl  # noqa: E402
from fastrl.trainers import memory  # noqa: E402
from fastrl.trainers.memory import MemoryOptions, find_decoder_mlps, tile_mlp  # noqa: E402

V, H, I, LAYERS = 160, 32, 128, 2
B, P, C = 4, 5, 24
TILES = 3
REL = 1e-6  # the bar: loss and every gradient, relative


def reward_len(completions, **kwargs):
    return [float(len(c.split()) % 3) for c in completions]


def policy(seed: int = 0):
    return tiny_qwen2(V, H, LAYERS, seed=seed, intermediate_size=I)


def grpo(tmp_path, *, model=None, peft_config=None, **overrides):
    tok = tiny_tokenizer(V)
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
              max_completion_length=C, report_to="none", use_cpu=True, save_strategy="no", logging_steps=1, seed=0,
              max_steps=1, disable_tqdm=True, bf16=False, activation_checkpointing=False, health_checks=False)
    kw.update(overrides)
    trainer = fastrl.GRPOTrainer(model=model if model is not None else policy(), reward_funcs=reward_len,
                                 args=fastrl.GRPOConfig(**kw), processing_class=tok,
                                 train_dataset=toy_prompt_dataset(tok, n=8), peft_config=peft_config)
    trainer.current_gradient_accumulation_steps = 1  # set by train(); compute_loss outside train() reads it
    return trainer


def grpo_batch(seed: int = 0) -> dict:
    """A batch as TRL's generation returns it: left-padded prompts, completions ending early with EOS + padding."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, V, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.int64)
    prompt_ids[0, :2], prompt_mask[0, :2] = PAD_ID, 0
    completion_ids = torch.randint(3, V, (B, C), generator=g)
    completion_mask = torch.ones(B, C, dtype=torch.int64)
    completion_ids[1, 9], completion_ids[1, 10:], completion_mask[1, 10:] = EOS_ID, PAD_ID, 0
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, advantages=torch.randn(B, generator=g),
                num_items_in_batch=completion_mask.sum())


def enable_checkpointing(model, reentrant: bool) -> None:
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})


def count_calls(modules):
    """Forward calls of each module in ``modules`` (a list), counted by hooks; returns (counter list, removers)."""
    counts = [0]

    def hook(*_):
        counts[0] += 1

    handles = [m.register_forward_hook(hook) for m in modules]
    return counts, handles


def gate_projs(model):
    return [mlp.gate_proj for _, mlp in find_decoder_mlps(model)]


def grpo_step(trainer, inputs):
    """One training step as ``training_step`` runs it: in the memory step context, compute_loss + backward."""
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    counts, handles = count_calls(gate_projs(model))
    try:
        with trainer._fastrl_memory.step_context():
            loss = trainer.compute_loss(model, dict(inputs))
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, counts[0]


def assert_same(ref, got, label: str, rel: float = REL) -> None:
    (l_ref, g_ref), (l_got, g_got) = ref[:2], got[:2]
    assert abs(l_got - l_ref) <= rel * abs(l_ref), f"{label}: loss {l_got!r}, without the option {l_ref!r}"
    assert set(g_got) == set(g_ref) and g_ref, f"{label}: parameters with gradients differ: {set(g_got) ^ set(g_ref)}"
    for name, ref_g in g_ref.items():  # relative error of each gradient tensor, as in test_grpo_trainer
        scale = ref_g.norm().item()
        assert scale > 0, f"{label}: the gradient of {name} is zero: the comparison would be vacuous"
        err = (g_got[name] - ref_g).norm().item() / scale
        assert err <= rel, f"{label}: gradient of {name} differs by {err:.2e} relative (allowed {rel:.0e})"


def assert_untiled(model) -> None:
    for name, mlp in find_decoder_mlps(model):
        assert "forward" not in vars(mlp), f"{name} still has an instance forward after undo"


# ---------------------------------------------------------------------------------------------------------------
# tiled_mlp: same loss and gradients
# ---------------------------------------------------------------------------------------------------------------


CASES = {  # name: (activation checkpointing: None off / reentrant flag, LoRA)
    "plain": (None, False),
    "checkpointing": (False, False),
    "checkpointing_reentrant": (True, False),
    "lora": (None, True),
    "lora_checkpointing": (False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiled_mlp_same_loss_and_gradients(tmp_path, case):
    reentrant, lora = CASES[case]
    peft_config = None
    if lora:
        peft = pytest.importorskip("peft")
        # init_lora_weights=False: B != 0, so every adapter weight gets a gradient from the first step
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                      target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = grpo(tmp_path, tiled_mlp=TILES, peft_config=peft_config, activation_checkpointing=reentrant is not None)
    if reentrant is not None:
        enable_checkpointing(trainer.model, reentrant)
    inputs = grpo_batch()
    tiled = grpo_step(trainer, inputs)
    assert trainer._fastrl_last_path == "one_pass"  # fastrl's fused head and loss, composed with the tiled MLPs
    trainer._fastrl_memory.undo()
    assert_untiled(trainer.model)
    plain = grpo_step(trainer, inputs)
    # each MLP really ran over TILES chunks (forward and recomputation), the plain one whole
    assert tiled[2] > 2 * plain[2], f"gate_proj calls: tiled {tiled[2]}, plain {plain[2]}"
    if lora:
        assert any("lora" in n and "mlp" in n for n in tiled[1]), "LoRA adapters inside the MLP got no gradient"
    assert_same(plain, tiled, f"tiled_mlp={TILES}, {case}")


# ---------------------------------------------------------------------------------------------------------------
# activation offloading: TRL's module, same loss and gradients
# ---------------------------------------------------------------------------------------------------------------


def test_activation_offloading_same_loss_and_gradients(tmp_path, monkeypatch):
    from trl.models.activation_offloading import OffloadActivations

    trainer = grpo(tmp_path, activation_offloading=True, tiled_mlp=TILES, activation_checkpointing=True)
    mem = trainer._fastrl_memory
    with pytest.warns(UserWarning, match="no effect"):  # CPU-only: activations already live in host memory
        with mem.step_context():
            pass
    assert mem.offload_context is None and mem.applied
    enable_checkpointing(trainer.model, False)
    inputs = grpo_batch(1)

    # TRL's OffloadActivations as on a GPU, with the host as the "accelerator": every saved tensor of at least 1 KB
    # is copied to a new host tensor in the forward and back in the backward (no pinning, no side stream)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    head = trainer.model.lm_head
    hooks_before = (dict(head._forward_pre_hooks), dict(head._forward_hooks))
    mem.undo()
    mem.apply()
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    ctx = mem.step_context()
    assert isinstance(ctx, OffloadActivations) and ctx is mem.offload_context
    with ctx:
        assert len(head._forward_hooks) == len(hooks_before[1]) + 1  # TRL's output-head hooks, as in its SFTTrainer
        loss = trainer.compute_loss(model, dict(inputs))
        offloaded = sum(1 for entry in ctx.tracker.values() if entry[1])
        loss.backward()
    assert offloaded > 0, "no activation was offloaded"
    left = [entry for entry in ctx.tracker.values() if entry[1]]  # (saved tensors off the loss's graph stay unread)
    assert not left, f"{len(left)} offloaded activations were never brought back"
    got = (loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    mem.undo()
    assert (dict(head._forward_pre_hooks), dict(head._forward_hooks)) == hooks_before, "offloading hooks left behind"
    assert_untiled(model)
    plain = grpo_step(trainer, inputs)
    assert_same(plain, got, "activation_offloading + tiled_mlp")


# ---------------------------------------------------------------------------------------------------------------
# peak RSS at a long CPU-scaled completion, fresh processes (bench's measurement)
# ---------------------------------------------------------------------------------------------------------------


def test_tiled_mlp_lowers_peak_rss_of_a_long_step():
    from bench.w4 import W4Shape, point_spec, spawn_point

    # the MLP is most of one layer's memory (intermediate 32x hidden); 2 completions of 2048 tokens
    s = W4Shape("W5-test", vocab=512, hidden=64, layers=1, heads=2, kv_heads=1, intermediate=2048,
                tie_embeddings=False, dtype="float32", completions=2, prompt_len=16, lengths=(2048,), budget_mb=0.0)
    specs = [point_spec(s, "fastrl", 2048, "cpu", options={"tiled_mlp": n}, kind="w5", threads=1) for n in (0, 8)]
    with ThreadPoolExecutor(2) as pool:  # separate processes: each has its own peak RSS
        plain, tiled = pool.map(lambda spec: spawn_point(spec, 600), specs)
    for r in (plain, tiled):
        assert r["status"] == "ok", r.get("reason")
    assert (plain["tiled_mlp"], tiled["tiled_mlp"]) == (0, 8) and plain["activation_checkpointing"]
    assert tiled["loss_value"] == pytest.approx(plain["loss_value"], rel=1e-5)
    # plain: the [4128, 2048] float32 gate / up / activation / product (34 MB each) and their gradients while the
    # layer is differentiated; tiled: an eighth of that at a time. Measured (2 cores): plain 216-218 MB, tiled
    # 88-99 MB (ratio 0.40-0.46); 0.6 leaves room for the allocator's noise, while an MLP that kept its whole
    # [tokens, intermediate] tensors would stay near 1
    assert plain["peak_extra_mb"] > 120, plain["peak_extra_mb"]
    assert tiled["peak_extra_mb"] <= 0.6 * plain["peak_extra_mb"], (tiled["peak_extra_mb"], plain["peak_extra_mb"])


# ---------------------------------------------------------------------------------------------------------------
# undo, refusals
# ---------------------------------------------------------------------------------------------------------------


def test_train_runs_tiled_and_leaves_the_model_as_it_found_it(tmp_path):
    trainer = grpo(tmp_path, tiled_mlp=2, activation_checkpointing=True)
    model = trainer.model
    mlps = find_decoder_mlps(model)
    assert len(mlps) == LAYERS and all("forward" in vars(m) for _, m in mlps)  # tiled from construction
    keys, modules = list(model.state_dict()), {n: m for n, m in model.named_modules()}
    mlp_calls, h1 = count_calls([m for _, m in mlps])
    gate_calls, h2 = count_calls(gate_projs(model))
    contexts = []
    step_context = trainer._fastrl_memory.step_context
    trainer._fastrl_memory.step_context = lambda: contexts.append(1) or step_context()
    try:
        trainer.train()
    finally:
        for h in h1 + h2:
            h.remove()
    assert contexts, "training_step did not enter the memory step context"
    assert gate_calls[0] > mlp_calls[0] > 0, "the MLPs did not run in chunks during training"
    assert_untiled(model)
    for _, mlp in mlps:
        assert mlp.forward.__func__ is type(mlp).forward
    assert list(model.state_dict()) == keys
    assert all(modules[n] is m for n, m in model.named_modules())

    # an instance forward the MLP had before (accelerate's hooks put one there) is put back, not dropped
    mlp = mlps[0][1]
    own = mlp.forward
    mlp.forward = lambda x: own(x)
    mine = vars(mlp)["forward"]
    t = tile_mlp(model, 2)
    assert vars(mlp)["forward"] is not mine
    t.undo()
    assert vars(mlp)["forward"] is mine


class _MeanMLP(nn.Module):  # not token-wise: mixes every token of the sequence
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x - x.mean(dim=-2, keepdim=True))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _MeanMLP()


def test_refuses_where_it_cannot_apply(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM, OPTConfig, OPTForCausalLM

    opt = OPTForCausalLM(OPTConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                   num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16))
    with pytest.raises(ValueError, match=r"tiled_mlp=2: the policy \(OPTForCausalLM\) has no decoder layers with an "
                                         r"`mlp` module.*Set tiled_mlp=0"):
        grpo(tmp_path, model=opt, tiled_mlp=2)

    moe = MixtralForCausalLM(MixtralConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                           num_experts_per_tok=1))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        tile_mlp(moe, 2)
    with pytest.raises(ValueError, match="not token-wise"):
        tile_mlp(nn.ModuleList([_Layer()]), 2)

    qwen = policy()
    with pytest.raises(ValueError, match="no decoder layers"):  # the second model fails: the first is restored
        MemoryOptions(qwen, {"policy": qwen, "reward model": opt}, tiled_mlp=2)
    assert_untiled(qwen)
    t = tile_mlp(qwen, 2)
    with pytest.raises(ValueError, match="tiled already"):
        tile_mlp(qwen, 4)
    t.undo()
    assert_untiled(qwen)

    for bad in (-1, True, 2.0, "8"):
        with pytest.raises(ValueError, match="tiled_mlp must be an int >= 0"):
            fastrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, tiled_mlp=bad)
        with pytest.raises(ValueError, match="tiled_mlp must be an int >= 0"):
            fastrl.PPOConfig(output_dir=str(tmp_path), tiled_mlp=bad)
    with pytest.raises(ValueError, match="activation_offloading must be True or False"):
        fastrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, activation_offloading="yes")
    with pytest.raises(ValueError, match="tiled_mlp must be an int >= 1"):
        tile_mlp(qwen, 0)


# ---------------------------------------------------------------------------------------------------------------
# PPO: rollout and update
# ---------------------------------------------------------------------------------------------------------------


def _seq_cls(seed: int):
    from transformers import Qwen2ForSequenceClassification

    config = policy(seed).config
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForSequenceClassification(config)


def test_ppo_rollout_and_update_honour_tiled_mlp(tmp_path, monkeypatch):
    tok = tiny_tokenizer(V)
    ds = toy_prompt_dataset(tok, n=8, vocab_size=V).map(lambda e: {"input_ids": tok(e["prompt"])["input_ids"]},
                                                        remove_columns=["prompt"])
    args = fastrl.PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_mini_batches=1,
                            total_episodes=4, response_length=12, num_ppo_epochs=1, report_to="none",
                            num_sample_generations=0, save_strategy="no", disable_tqdm=True,
                            local_rollout_forward_batch_size=4, seed=0, tiled_mlp=TILES, health_checks=False,
                            activation_offloading=True)
    trainer = fastrl.PPOTrainer(args=args, processing_class=tok, model=policy(0), ref_model=policy(7),
                                reward_model=_seq_cls(1), train_dataset=ds, value_model=_seq_cls(2))
    mem = trainer._fastrl_memory
    models = [trainer.policy_model, trainer.value_model, trainer.ref_model, trainer.reward_model]
    assert all(all("forward" in vars(m) for _, m in find_decoder_mlps(x)) for x in models)
    # rollout sequences are short: let the no-gradient forwards chunk them anyway
    monkeypatch.setattr(memory, "NO_GRAD_MIN_CHUNK_TOKENS", 1)
    queries = trainer._queries(0)

    def rollout():
        torch.manual_seed(5)
        calls, handles = count_calls([p for x in models for p in gate_projs(x)])
        try:
            batch = trainer._rollout(queries)
        finally:
            for h in handles:
                h.remove()
        return batch, calls[0]

    def update(batch):
        wrapper = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        params = {n: p for n, p in wrapper.named_parameters() if p.requires_grad}
        for p in params.values():
            p.grad = None
        with trainer.accelerator.accumulate(trainer.model_wrapped), mem.step_context():
            metrics = trainer._train_micro_batch(batch, torch.arange(4))
        loss = metrics["loss/policy_avg"].item() + args.vf_coef * metrics["loss/value_avg"].item()
        return loss, {n: p.grad.clone() for n, p in params.items() if p.grad is not None}

    opt = trainer.optimizer
    saved = opt.step, opt.zero_grad  # (the LR scheduler's wrapper of step included)
    opt.step = opt.zero_grad = lambda *a, **k: None  # keep the weights and this micro-batch's gradients
    tiled_batch, tiled_calls = rollout()
    with pytest.warns(UserWarning, match="no effect"):  # offloading on a CPU-only model, at the first update
        tiled_update = update(tiled_batch)
    mem.undo()
    for x in models:
        assert_untiled(x)
    plain_batch, plain_calls = rollout()
    plain_update = update(tiled_batch)
    assert tiled_calls > 2 * plain_calls, (tiled_calls, plain_calls)
    assert torch.equal(tiled_batch["query_responses"], plain_batch["query_responses"])
    for key in ("logprobs", "ref_logprobs", "values", "scores"):
        a, b = tiled_batch[key], plain_batch[key]
        assert (a - b).abs().max().item() <= 1e-5 * max(b.abs().max().item(), 1.0), key
    assert_same(plain_update, tiled_update, "PPO update, tiled_mlp")

    # train() applies the options for its run and undoes them when it returns
    opt.step, opt.zero_grad = saved
    contexts = []
    step_context = mem.step_context
    mem.step_context = lambda: contexts.append(1) or step_context()
    trainer.train()
    assert contexts and not mem.applied
    for x in models:
        assert_untiled(x)


# ---------------------------------------------------------------------------------------------------------------
# bench W5: the search and the summary (the measurement itself is the peak-RSS test's)
# ---------------------------------------------------------------------------------------------------------------


def test_w5_search_finds_the_longest_fit_measuring_each_point_once():
    from bench.w5 import longest_fit

    for n in range(8):
        for answer in range(-1, n):
            for hint in range(-1, n):
                calls = []

                def fits(i):
                    assert i not in calls, f"point {i} measured twice"
                    calls.append(i)
                    return i <= answer

                assert longest_fit(fits, n, hint) == answer, (n, answer, hint)
                assert len(calls) <= 2 * max(n, 1).bit_length() + 1, (n, answer, hint, calls)


def test_w5_summary_and_targets(tmp_path):
    from rich.console import Console

    from bench import report, w5
    from bench.w4 import point_row

    plan = w5.plan_for("cuda", "full")
    grid = plan.shapes["0.5B"].lengths

    def row(arch, config, L, total_gib, seconds, status="ok"):
        c = next(c for c in plan.configs if c.name == config)
        r = point_row("w5", plan.shapes[arch], arch, c, L, status)
        if status == "ok":
            r.update(peak_total_mb=total_gib * 1024, peak_extra_mb=total_gib * 1024 - 1000,
                     step_ms={"median": seconds * 1e3, "n": 1})
            r["fits"] = {f"{b:.0f}": r["peak_total_mb"] <= b for b in plan.budgets_mb}
        return r

    # 0.5B: trl fits 8192 at 24 GiB, fastrl+both 32768 (4x), 8% slower at 8192; 1.5B: both only at 80 GiB
    rows = [row("0.5B", "trl", 8192, 20, 1.0), row("0.5B", "trl", 12288, 30, 1.5),
            row("0.5B", "fastrl+both", 8192, 5, 1.08), row("0.5B", "fastrl+both", 32768, 23, 5.0),
            row("0.5B", "fastrl+both", 49152, 0, 0, status="oom"),
            row("1.5B", "trl", 4096, 25, 1.0), row("1.5B", "trl", 8192, 60, 2.0),
            row("1.5B", "fastrl+both", 8192, 12, 2.5), row("1.5B", "fastrl+both", 131072, 70, 40.0)]
    summary = w5.summarize(plan, rows)
    e = summary["0.5B"][f"{24 * 1024.0:.0f}"]
    assert e["longest"]["trl"] == 8192 and e["longest"]["fastrl+both"] == 32768 and e["length_ratio"] == 4
    assert e["time_ratio_at"] == 8192 and e["time_ratio"] == pytest.approx(1.08)
    e15 = summary["1.5B"][f"{80 * 1024.0:.0f}"]
    assert e15["longest"]["fastrl+both"] == max(grid) and e15["fits_largest_length_tried"]["fastrl+both"]
    assert e15["length_ratio"] == 16 and e15["time_ratio"] == pytest.approx(1.25)
    checks = {(c["arch"], c["budget_mb"]): c for c in w5.targets(plan, summary)["checks"]}
    assert checks[("0.5B", 24 * 1024.0)]["pass"]
    assert not checks[("1.5B", 24 * 1024.0)]["evaluated"]  # trl fits nothing at 24 GiB: no ratio
    assert not checks[("1.5B", 80 * 1024.0)]["pass"]  # 16x the length, but 1.25x the time
    assert checks[("1.5B", 80 * 1024.0)]["lower_bound"]
    con = Console(record=True, width=250)
    w5.print_tables(con, plan, rows, summary, w5.targets(plan, summary), "test")
    text = con.export_text()
    assert "4.00x" in text and ">=131072" in text and "FAIL" in text and "PASS" in text
    path = report.write_csv(tmp_path / "w5.csv", rows, {"device": "test"}, w5.CSV_COLUMNS, nested=("step_ms",))
    assert path.read_text().count("\n") == len(rows) + 1


def test_w4_command_smoke(tmp_path):
    """`python -m bench w4 --smoke` (``bench.w4.cli``): one GRPOTrainer step per trainer, each in a fresh process, its
    table, the longest fitting completion per trainer, ``w4-smoke.json`` (summary and rows under "w4") and the CSV."""
    import argparse
    import csv
    import json

    from rich.console import Console

    from bench import w4

    args = argparse.Namespace(quick=False, smoke=True, out=str(tmp_path), reps=None, warmup=None, timeout=None,
                              threads=0, fastrl_backend=None, lengths=None, budget_mb=None, argv=["w4", "--smoke"])
    con = Console(record=True, width=120)
    assert w4.cli(args, "cpu", con) == 0
    out = con.export_text()
    assert "W4-smoke" in out and "W4 longest completion within 64 MB" in out
    data = json.loads((tmp_path / "w4-smoke.json").read_text())
    assert data["command"] == "w4" and data["env"]["driver"] == "n/a (CPU)"
    rows = {r["provider"]: r for r in data["w4"]["rows"]}
    assert set(rows) == {"trl", "fastrl"}, data["w4"]["rows"]
    for r in rows.values():
        assert r["status"] == "ok", r["reason"]
        assert r["step_ms"]["median"] > 0 and r["peak_extra_mb"] is not None and r["fits_budget"] is not None
    assert rows["fastrl"]["loss_value"] == pytest.approx(rows["trl"]["loss_value"], rel=1e-4, abs=1e-5)
    assert rows["fastrl"]["time_vs_trl"] > 0 and data["w4"]["longest_fitting"] == {"trl": 32, "fastrl": 32}
    assert data["w4"]["shape"]["lengths"] == [32] and data["w4"]["budget_mb"] == 64.0
    with open(tmp_path / "w4-smoke.csv", newline="") as f:
        lines = list(csv.DictReader(f))
    assert [r["provider"] for r in lines] == ["trl", "fastrl"] and float(lines[1]["step_ms_median"]) > 0
