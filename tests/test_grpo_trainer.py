"""fastrl.GRPOTrainer against stock trl.GRPOTrainer on a tiny Qwen2-architecture model, float32 on CPU.

Equivalence: the same model, the same hand-built batch (left-padded prompts, completions ending early with EOS,
old / reference / sampling log-probs perturbed so that ratios spread over both clip sides) through both trainers'
``compute_loss`` and ``backward``: the loss and every parameter gradient agree to 1e-5 relative, and the metrics
logged by the loss computation have the same names and values. Every loss type at both importance-sampling levels,
through both fastrl paths (the one-pass policy loss and TRL's loss math on fastrl's log-probs), and each loss
option once. Then short real training runs (generation, rewards, optimizer steps) per main configuration.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import pytest
import torch

import fastrl
import tiny
from tiny import (
    EOS_ID,
    PAD_ID,
    rel_err,
    reward_even,
    run_step,
    save_for_reference,
    tiny_qwen2,
    tiny_tokenizer,
    toy_prompt_dataset,
)

trl = pytest.importorskip("trl")

V, H = 160, 32
B, P, C = 4, 5, 12
TEMPERATURE = 0.9  # every equivalence case runs at a non-unit temperature
REL = 1e-5  # loss and gradients: relative agreement with stock TRL
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
PATHS = ("one_pass", "trl")


def make_trainer(cls, cfg_cls, tmp_path, *, model=None, train_dataset=None, reward=reward_even, peft_config=None,
                 **overrides):
    tok = tiny_tokenizer(V)
    if model is None:
        model = tiny_qwen2(V, H, 1, seed=0)
    if overrides.get("beta", 0.0) != 0.0 and peft_config is None and not os.path.isdir(model.config._name_or_path):
        save_for_reference(model, tmp_path / f"ref-{cls.__module__}")
    kw = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, max_completion_length=C,
        report_to="none", use_cpu=True, save_strategy="no", logging_steps=1, seed=0, temperature=TEMPERATURE,
        learning_rate=1e-3, max_steps=2, disable_tqdm=True, bf16=False,
    )
    kw.update(overrides)
    return cls(model=model, reward_funcs=reward, args=cfg_cls(**kw), processing_class=tok,
               train_dataset=train_dataset if train_dataset is not None else toy_prompt_dataset(tok, n=8),
               peft_config=peft_config)


def stock(tmp_path, **kw):
    return make_trainer(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, **kw)


def ours(tmp_path, path="one_pass", **kw):
    return make_trainer(fastrl.GRPOTrainer, fastrl.GRPOConfig, tmp_path, one_pass_loss=(path == "one_pass"), **kw)


def make_batch(trainer, seed: int = 0, *, noise: float = 0.3) -> dict:
    """A batch as ``_generate_and_score_completions`` returns it, with off-policy old / ref / sampling log-probs."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, V, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.int64)
    prompt_ids[0, :2], prompt_mask[0, :2] = PAD_ID, 0  # left padding
    prompt_ids[3, :1], prompt_mask[3, :1] = PAD_ID, 0
    completion_ids = torch.randint(3, V, (B, C), generator=g)
    completion_mask = torch.ones(B, C, dtype=torch.int64)
    for row, eos in ((1, 6), (2, 2)):  # completions that end early: EOS, then padding
        completion_ids[row, eos], completion_ids[row, eos + 1:] = EOS_ID, PAD_ID
        completion_mask[row, eos + 1:] = 0
    advantages = torch.randn(B, generator=g)
    advantages[1] = 0.0
    with torch.no_grad():
        logps, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1), C)

    def near():
        return (logps + noise * torch.randn(B, C, generator=g)) * completion_mask

    return dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, advantages=advantages,
        num_items_in_batch=completion_mask.sum(), old_per_token_logps=near(), ref_per_token_logps=near(),
        sampling_per_token_logps=near(),
    )


def set_loss_options(trainer, **opts):
    """Set loss options the way ``GRPOTrainer.__init__`` derives them from ``GRPOConfig`` (read per call)."""
    for key, value in opts.items():
        if key in ("loss_type", "beta", "importance_sampling_level", "top_entropy_quantile",
                   "off_policy_mask_threshold", "entropy_coef", "use_adaptive_entropy", "max_completion_length"):
            setattr(trainer, key, value)
        elif key == "epsilon":
            trainer.epsilon_low = value
        elif key in ("epsilon_high",):
            trainer.epsilon_high = value
        elif key == "vllm_is":
            trainer.use_vllm = trainer.vllm_importance_sampling_correction = value
        elif key == "grad_accum":
            trainer.current_gradient_accumulation_steps = value
        else:
            setattr(trainer.args, key, value)
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy


def assert_same_step(ref, got, label: str, rel: float = REL):
    (l_ref, g_ref, m_ref), (l_got, g_got, m_got) = ref, got
    assert math.isfinite(l_ref), f"{label}: stock TRL loss is {l_ref}"
    assert abs(l_got - l_ref) <= rel * max(abs(l_ref), 1e-6), f"{label}: loss {l_got!r}, stock TRL {l_ref!r}"
    assert set(g_got) == set(g_ref), f"{label}: parameters with gradients differ: {set(g_got) ^ set(g_ref)}"
    worst = max(g_ref, key=lambda n: rel_err(g_got[n], g_ref[n]))
    err = rel_err(g_got[worst], g_ref[worst])
    assert err <= rel, f"{label}: gradient of {worst} differs from stock TRL by {err:.2e} (relative norm)"
    assert set(m_got) == set(m_ref), f"{label}: metric names {sorted(m_got)} vs stock TRL {sorted(m_ref)}"
    for k, v in m_ref.items():
        assert m_got[k] == pytest.approx(v, rel=rel, abs=1e-6), f"{label}: metric {k} = {m_got[k]}, stock TRL {v}"
    return err


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(stock, fastrl one-pass, fastrl two-pass) trainers on identical models, beta != 0 so a reference exists."""
    tmp = tmp_path_factory.mktemp("pair")
    trainers = (stock(tmp, beta=0.04), ours(tmp, "one_pass", beta=0.04), ours(tmp, "trl", beta=0.04))
    batch = make_batch(trainers[0])
    return trainers, batch


DEFAULTS = dict(loss_type="dapo", beta=0.0, importance_sampling_level="token", epsilon=0.2, epsilon_high=0.2,
                delta=None, use_bias_correction_kl=True, entropy_coef=0.0, use_adaptive_entropy=False,
                top_entropy_quantile=1.0, off_policy_mask_threshold=None, vllm_is=False, grad_accum=1,
                steps_per_generation=1, max_completion_length=C)


def check_case(pair, path, expect_path=None, batch_edit=None, **opts):
    (st, one, two), batch = pair
    trainer = one if path == "one_pass" else two
    inputs = dict(batch)
    if batch_edit:
        inputs = batch_edit(inputs)
    results = []
    for t in (st, trainer):
        set_loss_options(t, **{**DEFAULTS, **opts})
        if t is not st and opts.get("use_adaptive_entropy"):
            t._last_world_entropy, t._entropy_window_stats = st._last_world_entropy, None
        results.append(run_step(t, inputs))
    assert trainer._fastrl_last_path == (expect_path or path), trainer._fastrl_last_path
    return assert_same_step(*results, label=f"{path} {opts}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("level", ("token", "sequence"))
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_equivalence_loss_types(pair, loss_type, level, path):
    check_case(pair, path, loss_type=loss_type, importance_sampling_level=level, beta=0.04,
               epsilon_high=0.28 if loss_type != "cispo" else 4.0)


OPTION_CASES = {
    "delta": dict(loss_type="grpo", delta=1.3),
    "beta_no_bias_correction": dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=False),
    "entropy_bonus": dict(loss_type="dapo", entropy_coef=0.05),
    "entropy_bonus_grpo": dict(loss_type="grpo", entropy_coef=0.05, beta=0.04),
    "off_policy_mask": dict(loss_type="dapo", off_policy_mask_threshold=0.05),
    "vllm_is_token": dict(loss_type="grpo", vllm_is=True),
    "vllm_is_vespo": dict(loss_type="vespo", vllm_is=True),
    "vllm_is_sequence": dict(loss_type="grpo", vllm_is="sequence"),
    "grad_accum": dict(loss_type="dapo", grad_accum=2, steps_per_generation=2, entropy_coef=0.02),
    "grad_accum_grpo": dict(loss_type="grpo", grad_accum=3),
}


def _with_is_ratio(inputs, sequence=False):
    g = torch.Generator().manual_seed(7)
    # TRL's token_* modes give a [B, T] ratio, its sequence_* modes a [B, 1] one
    inputs["importance_sampling_ratio"] = torch.rand(B, 1 if sequence else C, generator=g) * 1.5 + 0.25
    return inputs


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_equivalence_options(pair, case, path):
    opts = OPTION_CASES[case]
    edit = (lambda x: _with_is_ratio(x, sequence=opts["vllm_is"] == "sequence")) if opts.get("vllm_is") else None
    check_case(pair, path, batch_edit=edit, **{**opts, "vllm_is": bool(opts.get("vllm_is"))})


@pytest.mark.parametrize("loss_type", ("dapo", "grpo"))
def test_equivalence_eval_mode(pair, loss_type):
    """prediction_step's loss (eval mode, no grad): TRL's eval normalisers and eval metrics."""
    (st, one, _), batch = pair
    results = []
    for t in (st, one):
        set_loss_options(t, **{**DEFAULTS, "loss_type": loss_type, "grad_accum": 2, "steps_per_generation": 2})
        t.model.eval()
        t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        with torch.no_grad():
            loss = t.compute_loss(t.model, dict(batch)).item()
        results.append((loss, {k: v[-1] for k, v in t._metrics["eval"].items()}))
        t.model.train()
    (l_ref, m_ref), (l_got, m_got) = results
    assert one._fastrl_last_path == "one_pass"
    assert abs(l_got - l_ref) <= REL * abs(l_ref), (l_got, l_ref)
    assert set(m_got) == set(m_ref) and all(m_got[k] == pytest.approx(v, rel=REL, abs=1e-6) for k, v in m_ref.items())


@pytest.mark.parametrize("path", PATHS)
def test_equivalence_top_entropy_quantile(pair, path):
    # the entropy mask couples every sequence of the batch: always TRL's loss math on fastrl's log-probs
    check_case(pair, path, expect_path="trl", loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.01)


@pytest.mark.parametrize("path", PATHS)
def test_equivalence_adaptive_entropy(pair, path):
    (st, one, two), batch = pair
    trainer = one if path == "one_pass" else two
    for t in (st, trainer):  # the controller state is updated at every optimizer-step boundary
        t.entropy_coef, t._last_world_entropy, t._entropy_window_stats = 0.01, 0.0, None
        t.args.entropy_target, t.args.entropy_coef_delta = 100.0, 0.005
        t.args.entropy_coef_min, t.args.entropy_coef_max = 0.0, 0.1
    for step in range(2):
        results = []
        for t in (st, trainer):
            set_loss_options(t, **{**DEFAULTS, "loss_type": "grpo", "use_adaptive_entropy": True,
                                   "entropy_coef": t.entropy_coef})
            results.append(run_step(t, batch))
        assert_same_step(*results, label=f"adaptive entropy step {step}")
        assert trainer.entropy_coef == pytest.approx(st.entropy_coef)
        assert trainer._last_world_entropy == pytest.approx(st._last_world_entropy, rel=REL)
    set_loss_options(st, use_adaptive_entropy=False, entropy_coef=0.0)
    set_loss_options(trainer, use_adaptive_entropy=False, entropy_coef=0.0)


def test_forward_only_reference_logprobs(pair):
    """Reference / old log-probs: fastrl's forward-only path (no autograd state), TRL's numbers."""
    (st, one, _), batch = pair
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        ref = st._get_per_token_logps_and_entropies(st.model, ids, am, C, compute_entropy=True)
        got = one._get_per_token_logps_and_entropies(one.model, ids, am, C, compute_entropy=True)
        got_ref_model = one._get_per_token_logps_and_entropies(one.ref_model, ids, am, C)
    assert not got[0].requires_grad and got[0].grad_fn is None
    torch.testing.assert_close(got[0], ref[0], rtol=REL, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=REL, atol=1e-6)
    torch.testing.assert_close(got_ref_model[0], ref[0], rtol=REL, atol=1e-6)  # same weights


# ---------------------------------------------------------------------------------------------------------------
# Model variants: tied embeddings, a bf16 model with cast_lm_head_to_fp32, PEFT/LoRA (frozen head), MoE aux loss
# ---------------------------------------------------------------------------------------------------------------


def _pair_for(tmp_path, model_fn, **kw):
    return stock(tmp_path, model=model_fn(), **kw), ours(tmp_path, model=model_fn(), **kw)


def test_equivalence_tied_embeddings(tmp_path):
    st, fr = _pair_for(tmp_path, lambda: tiny_qwen2(V, H, 1, tie_word_embeddings=True, seed=1))
    assert fr.model.lm_head.weight is fr.model.model.embed_tokens.weight
    batch = make_batch(st, seed=1)
    for loss_type in ("dapo", "grpo"):
        for t in (st, fr):
            set_loss_options(t, **{**DEFAULTS, "loss_type": loss_type})
        assert_same_step(run_step(st, batch), run_step(fr, batch), label=f"tied {loss_type}")


def test_cast_lm_head_to_fp32_bf16_model(tmp_path):
    """bf16 body, fp32 head: same hidden states, so the loss and the (fp32) head gradient match TRL's to 1e-5."""
    st, fr = _pair_for(tmp_path, lambda: tiny_qwen2(V, H, 1, seed=2, dtype=torch.bfloat16),
                       cast_lm_head_to_fp32=True, bf16=True)
    assert fr.model.lm_head.weight.dtype == torch.float32
    batch = make_batch(st, seed=2)
    for t in (st, fr):
        set_loss_options(t, **{**DEFAULTS, "loss_type": "dapo"})
    (l_ref, g_ref, _), (l_got, g_got, _) = run_step(st, batch), run_step(fr, batch)
    assert fr._fastrl_last_path == "one_pass"
    assert abs(l_got - l_ref) <= REL * abs(l_ref), (l_got, l_ref)
    err = rel_err(g_got["lm_head.weight"], g_ref["lm_head.weight"])
    assert err <= REL, f"lm_head gradient differs by {err:.2e}"


def test_peft_lora_frozen_head(tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    lora = lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)  # noqa
    st = stock(tmp_path, model=tiny_qwen2(V, H, 1, seed=3), peft_config=lora(), beta=0.04)
    fr = ours(tmp_path, model=tiny_qwen2(V, H, 1, seed=3), peft_config=lora(), beta=0.04)
    # same LoRA init in both (PEFT draws it from the global RNG)
    fr.model.load_state_dict(st.model.state_dict())
    batch = make_batch(st, seed=3)
    weight_grads = []
    from fastrl.ops import linear_logprob

    real = linear_logprob.linear_backward

    def spy(*args, **kwargs):
        weight_grads.append(args[-1])  # need = (hidden, weight, bias)
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_logprob, "linear_backward", spy)
    for t in (st, fr):
        set_loss_options(t, **{**DEFAULTS, "loss_type": "dapo", "beta": 0.04})
    ref, got = run_step(st, batch), run_step(fr, batch)
    assert_same_step(ref, got, label="peft")
    assert any(n for n in got[1] if "lora" in n) and not any("lm_head" in n for n in got[1])
    assert fr.model.get_base_model().lm_head.weight.grad is None
    if fr._fastrl_last_path == "one_pass" and not hasattr(fastrl, "policy_loss"):
        assert weight_grads and all(need[1] is False for need in weight_grads), weight_grads


def test_moe_aux_loss(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    def moe():
        torch.manual_seed(4)
        cfg = MixtralConfig(vocab_size=V, hidden_size=H, intermediate_size=H, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                            num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
                            pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=2)
        cfg._attn_implementation = "eager"
        return MixtralForCausalLM(cfg)

    st, fr = _pair_for(tmp_path, moe)
    assert st.aux_loss_enabled and fr.aux_loss_enabled
    batch = make_batch(st, seed=4)
    for t in (st, fr):
        set_loss_options(t, **{**DEFAULTS, "loss_type": "grpo", "grad_accum": 2})
    ref, got = run_step(st, batch), run_step(fr, batch)
    assert "aux_loss" in got[2]
    assert_same_step(ref, got, label="moe")


# ---------------------------------------------------------------------------------------------------------------
# Real short training runs
# ---------------------------------------------------------------------------------------------------------------


def _logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


LOG_KEYS = ("loss", "reward", "entropy", "kl", "completions/mean_length", "clip_ratio/region_mean")


def test_short_run_logs_agree_with_trl(tmp_path):
    """Two optimizer steps with generation: the same completions and the same logged numbers as stock TRL."""
    kw = dict(loss_type="grpo", beta=0.04, max_steps=2)
    st, fr = stock(tmp_path, **kw), ours(tmp_path, **kw)
    from transformers import set_seed

    set_seed(0)  # Trainer.train does not re-seed: both runs start sampling from the same RNG state
    st.train()
    set_seed(0)
    fr.train()
    a, b = _logs(st), _logs(fr)
    assert len(a) == len(b) == 2
    for step, (x, y) in enumerate(zip(a, b)):
        assert set(x) == set(y), f"step {step}: logged keys differ: {set(x) ^ set(y)}"
        for k in LOG_KEYS:
            if k in x:
                assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-6), f"step {step} {k}: {y[k]} vs TRL {x[k]}"


RUN_CONFIGS = {
    "dapo_default": dict(),
    "grpo_beta_num_iterations": dict(loss_type="grpo", beta=0.04, num_iterations=2, max_steps=2),
    "gspo_sequence_grad_accum": dict(loss_type="grpo", importance_sampling_level="sequence",
                                     per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2),
    "dr_grpo_grad_checkpointing": dict(loss_type="dr_grpo", gradient_checkpointing=True, max_steps=1),
    "bnpo_entropy_quantile": dict(loss_type="bnpo", top_entropy_quantile=0.5, max_steps=1),
    "cispo_adaptive_entropy": dict(loss_type="cispo", epsilon_high=4.0, use_adaptive_entropy=True,
                                   entropy_coef=0.01, entropy_target=100.0, max_steps=2),
}


@pytest.mark.parametrize("name", sorted(RUN_CONFIGS))
def test_short_training_run(tmp_path, name):
    trainer = ours(tmp_path, **RUN_CONFIGS[name])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = _logs(trainer)
    assert logs and all(math.isfinite(h["loss"]) for h in logs)
    assert "entropy" in logs[0] and "reward" in logs[0]
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved, "no parameter changed"
    assert any(type(cb).__name__ == "TrainingHealthCallback" for cb in trainer.callback_handler.callbacks)


def test_fastrl_options(tmp_path):
    with pytest.raises(ValueError, match="fastrl_backend"):
        fastrl.GRPOConfig(output_dir=str(tmp_path), fastrl_backend="cuda", report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="fastrl_vocab_chunk"):
        fastrl.GRPOConfig(output_dir=str(tmp_path), fastrl_vocab_chunk=0, report_to="none", use_cpu=True)
    off = ours(tmp_path, fused_loss=False, health_checks=False)
    assert getattr(off.model, "_fastrl_head_settings", None) is None
    assert not any(type(cb).__name__ == "TrainingHealthCallback" for cb in off.callback_handler.callbacks)
    small = ours(tmp_path, fastrl_vocab_chunk=32, fastrl_backend="torch")
    assert small.model._fastrl_head_settings.vocab_chunk == 32
    assert small.model._fastrl_head_settings.temperature == TEMPERATURE


def test_zero3_recompute_matches_direct():
    """The DeepSpeed ZeRO-3 route (gather for the forward, gather again and recompute in the backward) gives the
    direct route's outputs and gradients. Without DeepSpeed the gather is a no-op; a ``ds_id`` marks the weight."""
    from fastrl.trainers._lm_head import HeadSettings, call_with_head, lm_head_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, H, generator=g, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(V, H, generator=g) * 0.2)
    targets = torch.randint(0, V, (13,), generator=g)
    targets[3] = -100
    st = HeadSettings(temperature=0.7)

    def head(h, w, b):
        return lm_head_logprobs(h, w, b, targets, st)

    results = []
    for zero3 in (False, True):
        if zero3:
            weight.ds_id = 0
        hidden.grad = weight.grad = None
        logp, ent = call_with_head(head, hidden, weight, None)
        (logp.sum() * 1.5 - ent.sum() * 0.3).backward()
        results.append((logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()))
    del weight.ds_id
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_no_full_logits_in_a_training_step(tmp_path):
    """Every tensor produced during a fastrl training step (loss forward + backward, reference log-probs) is
    smaller than the [batch, completion, vocab] logits. The vocabulary is large enough (2^17) that fastrl's
    bounded tiles are a fraction of it, as at real sizes."""

    big_v, C = 1 << 17, 64  # 256 tokens: more than one of fastrl's default CPU chunks at this vocabulary
    model = tiny_qwen2(big_v, 16, 1, seed=0, heads=2, kv_heads=1)
    trainer = make_trainer(fastrl.GRPOTrainer, fastrl.GRPOConfig, tmp_path, model=model, beta=0.0)
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        prompt_ids=torch.randint(3, big_v, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.int64),
        completion_ids=torch.randint(3, big_v, (B, C), generator=g),
        completion_mask=torch.ones(B, C, dtype=torch.int64), advantages=torch.randn(B, generator=g),
        num_items_in_batch=torch.tensor(B * C),
    )
    rec = tiny.LargestAllocations()
    largest = rec.allocs

    set_loss_options(trainer, **{**DEFAULTS, "loss_type": "dapo"})
    trainer.model.train()
    with rec:
        with torch.no_grad():  # reference / old log-probs: forward-only
            trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), C)
        trainer.compute_loss(trainer.model, inputs).backward()
    assert trainer._fastrl_last_path == "one_pass"
    numel, op, shape = max(largest)
    assert numel < B * C * big_v, f"{op} produced {shape}: as large as the [B, C, V] logits ({B}x{C}x{big_v})"


def test_beta_with_an_in_memory_model_copies_it_as_the_reference(tmp_path):
    """``beta != 0`` with a policy built in memory (no ``name_or_path`` to load): stock TRL stops in the hub's
    "Repo id must use alphanumeric chars"; fastrl's reference is a copy of the policy as passed, and a step trains
    with it (KL 0 at the first step: the policy has not moved yet)."""
    from fastrl.testing import tiny_model, tiny_prompt_dataset

    model = tiny_model(V, H, 1, seed=3)
    assert model.config._name_or_path == ""
    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
              report_to="none", use_cpu=True, save_strategy="no", logging_steps=1, max_steps=1, disable_tqdm=True,
              beta=0.04)
    with pytest.raises(Exception, match="Repo id|repo_id|alphanumeric"):  # what TRL does with it
        trl.GRPOTrainer(model=model, reward_funcs=reward_even, args=trl.GRPOConfig(**kw),
                        processing_class=tiny_tokenizer(V), train_dataset=tiny_prompt_dataset(8, vocab_size=V))
    trainer = fastrl.GRPOTrainer(model=model, reward_funcs=reward_even, args=fastrl.GRPOConfig(**kw),
                                 processing_class=tiny_tokenizer(V), train_dataset=tiny_prompt_dataset(8, vocab_size=V))
    ref, policy = trainer.ref_model, trainer.accelerator.unwrap_model(trainer.model)
    assert ref is not None and ref is not policy
    for (name, p), (_, q) in zip(policy.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name
    trainer.train()
    log = next(h for h in trainer.state.log_history if "kl" in h)
    assert log["kl"] == 0.0
    assert any(not torch.equal(p, q) for p, q in zip(policy.parameters(), ref.parameters()))  # only the policy moved
