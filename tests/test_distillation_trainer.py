"""fastrl.DistillationTrainer against stock trl.DistillationTrainer on tiny Qwen2-architecture models, float32, CPU.

Equivalence: the same student and teacher (the teacher wider than the student, its own weights), the same
hand-built batch (left-padded prompts, completions ending early with EOS) through both trainers' ``compute_loss``
and ``backward``: the loss and every student gradient agree to 1e-5 relative and the logged metrics have the same
names and values, for beta in {0, 0.5, 1} at a non-unit temperature (and a second one), with logit scales and
softcaps, a biased head, tied embeddings, LoRA, tool masks, gradient accumulation's ``num_items_in_batch`` and
the memory options. Then one real optimizer step with generation: the same logs and the same updated weights.
Bad input and options get named errors at construction.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict

import pytest
import torch

import fastrl
import tiny
from tiny import EOS_ID, PAD_ID, rel_err, tiny_qwen2, tiny_tokenizer, toy_prompt_dataset

trl = pytest.importorskip("trl")

V, H, H_TEACHER = 160, 32, 48
B, P, C = 4, 5, 12
TEMPERATURE = 0.9  # every equivalence case runs at a non-unit temperature
REL = 1e-5  # loss, gradients and metrics: relative agreement with stock TRL (float32)
BETAS = (0.0, 0.5, 1.0)
# Randomly initialised tiny models put a near-uniform distribution on every token (logits ~0.1), so the divergences
# would be ~1e-3: below float32's resolution of a log-normaliser (~5e-7 absolute per token), a relative comparison
# of two float32 losses would measure rounding luck. Scaling the heads makes the distributions peaked, as trained
# models' are (logits of a few units), and the divergences O(0.1-1).
HEAD_GAIN = 30.0


def student_model(**kw):
    return peaked(tiny_qwen2(V, H, 1, seed=0, **kw))


def teacher_model(**kw):
    return peaked(tiny_qwen2(V, H_TEACHER, 1, seed=1, **kw))


def peaked(model):
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_GAIN)
    return model


def make_trainer(cls, cfg_cls, tmp_path, *, model=None, teacher=None, peft_config=None, **overrides):
    tok = tiny_tokenizer(V)
    kw = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_completion_length=C, report_to="none",
        use_cpu=True, save_strategy="no", logging_steps=1, seed=0, temperature=TEMPERATURE, learning_rate=1e-3,
        max_steps=1, disable_tqdm=True, bf16=False,
    )
    kw.update(overrides)
    return cls(
        model=model if model is not None else student_model(),
        teacher_model=teacher if teacher is not None else teacher_model(),
        args=cfg_cls(**kw), processing_class=tok, train_dataset=toy_prompt_dataset(tok, n=8), peft_config=peft_config,
    )


def stock(tmp_path, **kw):
    return make_trainer(trl.DistillationTrainer, trl.DistillationConfig, tmp_path, **kw)


def ours(tmp_path, **kw):
    return make_trainer(fastrl.DistillationTrainer, fastrl.DistillationConfig, tmp_path, **kw)


def make_batch(seed: int = 0) -> dict:
    """A micro-batch as TRL's ``_generate_and_score_completions`` returns it."""
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
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, num_items_in_batch=completion_mask.sum())


def run_step(trainer, inputs, *, beta=None, temperature=None):
    """One ``compute_loss`` + ``backward`` (``tiny.run_step``) at the given beta / temperature: (loss, student
    gradients, metrics logged by the loss)."""
    if beta is not None:
        trainer.beta = beta
    if temperature is not None:
        trainer.temperature = temperature
    return tiny.run_step(trainer, inputs)


def assert_same_step(ref, got, label: str, rel: float = REL, grad_rel: float | None = None) -> float:
    (l_ref, g_ref, m_ref), (l_got, g_got, m_got) = ref, got
    assert math.isfinite(l_ref) and l_ref != 0.0, f"{label}: stock TRL loss is {l_ref}"
    assert abs(l_got - l_ref) <= rel * abs(l_ref), f"{label}: loss {l_got!r}, stock TRL {l_ref!r}"
    assert set(g_got) == set(g_ref), f"{label}: parameters with gradients differ: {set(g_got) ^ set(g_ref)}"
    worst = max(g_ref, key=lambda n: rel_err(g_got[n], g_ref[n]))
    err = rel_err(g_got[worst], g_ref[worst])
    assert err <= (grad_rel or rel), f"{label}: gradient of {worst} differs from stock TRL by {err:.2e} (relative norm)"
    assert set(m_got) == set(m_ref), f"{label}: metric names {sorted(m_got)} vs stock TRL {sorted(m_ref)}"
    for k, v in m_ref.items():
        assert m_got[k] == pytest.approx(v, rel=rel, abs=1e-7), f"{label}: metric {k} = {m_got[k]}, stock TRL {v}"
    return err


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distill")
    return stock(tmp), ours(tmp)


@pytest.mark.parametrize("temperature", (TEMPERATURE, 2.0))
@pytest.mark.parametrize("beta", BETAS)
def test_equivalence_beta(pair, beta, temperature):
    st, fr = pair
    batch = make_batch()
    ref = run_step(st, batch, beta=beta, temperature=temperature)
    got = run_step(fr, batch, beta=beta, temperature=temperature)
    assert fr._fastrl_last_path == "fused"
    assert_same_step(ref, got, f"beta={beta} T={temperature}")


@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_equivalence_backends(pair, backend):
    """``fastrl_backend``: each backend of ``fused_divergence`` (the Triton kernels under the interpreter on a CPU)."""
    st, fr = pair
    batch = make_batch(seed=8)
    fr.args.fastrl_backend = backend
    try:
        for beta in BETAS:
            ref = run_step(st, batch, beta=beta, temperature=TEMPERATURE)
            got = run_step(fr, batch, beta=beta, temperature=TEMPERATURE)
            assert_same_step(ref, got, f"{backend} beta={beta}")
    finally:
        fr.args.fastrl_backend = None


def test_equivalence_tool_mask_and_global_count(pair):
    """Tool-result tokens out of the loss (``tool_mask``), and a ``num_items_in_batch`` counted over more than this
    micro-batch (gradient accumulation / several processes): TRL divides by it, not by the local count."""
    st, fr = pair
    batch = make_batch(seed=3)
    tool = torch.ones(B, C, dtype=torch.int64)
    tool[0, 3:6] = 0
    tool[3, 1:4] = 0
    batch["tool_mask"] = tool
    batch["num_items_in_batch"] = (batch["completion_mask"] * tool).sum() * 3
    for beta in (0.0, 0.5):
        assert_same_step(run_step(st, batch, beta=beta, temperature=TEMPERATURE),
                         run_step(fr, batch, beta=beta, temperature=TEMPERATURE), f"tool mask beta={beta}")


def test_equivalence_eval_mode(pair):
    """Evaluation: no ``num_items_in_batch`` (the mean over the valid tokens) and the ``eval`` metrics."""
    st, fr = pair
    batch = make_batch(seed=5)
    out = []
    for t in (st, fr):
        t.beta, t.temperature = 0.5, TEMPERATURE
        t.model.eval()
        t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        with torch.no_grad():
            loss = t.compute_loss(t.model, dict(batch))
        out.append((loss.item(), {k: v[-1] for k, v in t._metrics["eval"].items()}))
    (l_ref, m_ref), (l_got, m_got) = out
    assert l_got == pytest.approx(l_ref, rel=REL) and set(m_got) == set(m_ref) == {"entropy"}
    assert m_got["entropy"] == pytest.approx(m_ref["entropy"], rel=REL)


def _scaled(model, **config):
    for k, v in config.items():
        setattr(model.config, k, v)
    return model


def test_equivalence_logit_transforms_and_bias(tmp_path):
    """Each model's own logit transform (TRL's rules: logit scale, then softcap, then the temperature) and a
    biased student head. The models' own forwards ignore these config entries; both trainers' losses read them."""
    student = _scaled(student_model(), logit_scale=1.7, final_logit_softcapping=4.0)
    teacher = _scaled(teacher_model(), logits_scaling=0.5, final_logit_softcapping=6.0)
    g = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(H, V, bias=True)
    with torch.no_grad():
        head.weight.copy_(student.lm_head.weight)
        head.bias.copy_(torch.randn(V, generator=g))
    student.lm_head = head
    models = [(student, teacher)]
    import copy

    models.append((copy.deepcopy(student), copy.deepcopy(teacher)))
    st = stock(tmp_path, model=models[0][0], teacher=models[0][1])
    fr = ours(tmp_path, model=models[1][0], teacher=models[1][1])
    settings = fr._head_settings(fr.model)
    assert (settings.logit_scale, settings.softcap) == (1.7, 4.0)
    assert fr._head_settings(fr.teacher_model).logit_scale == 2.0
    batch = make_batch(seed=1)
    for beta in BETAS:
        ref, got = run_step(st, batch, beta=beta), run_step(fr, batch, beta=beta)
        assert "lm_head.bias" in got[1]
        assert_same_step(ref, got, f"transforms beta={beta}")


def test_equivalence_bf16_autocast(pair):
    """Under bf16 autocast (mixed precision) both models' bodies and heads run in bf16 and both trainers take the
    divergence from float32 logits of the bf16 operands (TRL's compute-dtype rule): the same loss and entropy to
    float32 rounding. The head's gradients come back in bf16 (TRL also rounds its ``dD/dy`` tiles to bf16 before
    the gradient GEMMs, fastrl does not), so the body's gradients agree to bf16 rounding amplified through the
    body (about 1e-2); which of the two is closer to float64 is ``test_distillation_loss_bf16_accuracy``."""
    st, fr = pair
    batch = make_batch(seed=7)
    for beta in BETAS:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = run_step(st, batch, beta=beta, temperature=TEMPERATURE)
            got = run_step(fr, batch, beta=beta, temperature=TEMPERATURE)
        assert_same_step(ref, got, f"bf16 autocast beta={beta}", grad_rel=5e-2)


def test_equivalence_tied_embeddings(tmp_path):
    st = stock(tmp_path, model=tiny_qwen2(V, H, 1, tie_word_embeddings=True, seed=0))  # no gain: it scales the inputs
    fr = ours(tmp_path, model=tiny_qwen2(V, H, 1, tie_word_embeddings=True, seed=0))
    batch = make_batch(seed=2)
    assert_same_step(run_step(st, batch, beta=0.5), run_step(fr, batch, beta=0.5), "tied")


def test_equivalence_lora(tmp_path):
    """LoRA on the student's attention (frozen head): the adapters' gradients equal stock TRL's."""
    peft = pytest.importorskip("peft")

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                               init_lora_weights=False)

    st, fr = stock(tmp_path, peft_config=lora()), ours(tmp_path, peft_config=lora())
    batch = make_batch(seed=4)
    ref, got = run_step(st, batch, beta=1.0), run_step(fr, batch, beta=1.0)
    assert got[1] and all("lora" in n for n in got[1]), sorted(got[1])
    assert_same_step(ref, got, "lora")


def test_memory_options_same_step(tmp_path):
    """tiled_mlp on student and teacher leaves the loss and gradients as stock TRL's; train() undoes it."""
    st, fr = stock(tmp_path), ours(tmp_path, tiled_mlp=3)
    batch = make_batch(seed=6)
    for t in (fr.model, fr.teacher_model):
        assert getattr(vars(t.model.layers[0].mlp).get("forward"), "_fastrl_tiled", False)
    assert_same_step(run_step(st, batch, beta=0.5), run_step(fr, batch, beta=0.5), "tiled_mlp", rel=2e-5)
    with pytest.warns(UserWarning, match="no effect here"):
        with ours(tmp_path, activation_offloading=True)._fastrl_memory.step_context():
            pass


# ---------------------------------------------------------------------------------------------------------------
# Fallback to TRL's loss, with the reason logged
# ---------------------------------------------------------------------------------------------------------------


def test_fallback_to_trl_is_logged(pair, tmp_path, caplog):
    st, _ = pair
    off = ours(tmp_path, fused_loss=False)
    batch = make_batch()
    with caplog.at_level(logging.WARNING, logger="fastrl.distillation"):
        got = run_step(off, batch, beta=0.5, temperature=TEMPERATURE)
        run_step(off, batch)
    assert off._fastrl_last_path == "trl"
    said = [r.getMessage() for r in caplog.records if r.name == "fastrl.distillation"]
    assert len(said) == 1 and "fused_loss=False" in said[0], said  # once, with the reason
    ref = run_step(st, batch, beta=0.5, temperature=TEMPERATURE)
    assert got[0] == ref[0]  # TRL's own code: bit for bit


# ---------------------------------------------------------------------------------------------------------------
# One real optimizer step, generation included
# ---------------------------------------------------------------------------------------------------------------


def _logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("accumulation", (1, 2))
def test_one_training_step_equals_stock(tmp_path, accumulation):
    """``train()`` for one SGD step (on-policy generation, the loss, the update): the same logs and weights, also
    with gradient accumulation (one generation for both micro-batches, each loss over the whole step's token
    count). The learning rate is large so that the update, not float32 rounding of ``weight + update``, is what
    is compared."""
    from transformers import set_seed

    kw = dict(optim="sgd", learning_rate=50.0, max_grad_norm=0.0, lr_scheduler_type="constant", beta=0.5,
              per_device_train_batch_size=4 // accumulation, gradient_accumulation_steps=accumulation)
    runs = []
    for make in (stock, ours):
        trainer = make(tmp_path, **kw)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        set_seed(0)  # Trainer.train does not re-seed: both runs sample from the same RNG state
        trainer.train()
        after = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        runs.append((trainer, before, after))
    (st, b_ref, a_ref), (fr, b_got, a_got) = runs
    assert fr._fastrl_last_path == "fused"
    x, y = _logs(st), _logs(fr)
    assert len(x) == len(y) == 1 and set(x[0]) == set(y[0]), (x, y)
    for k in ("loss", "entropy", "completions/mean_length", "grad_norm"):
        assert y[0][k] == pytest.approx(x[0][k], rel=REL), f"{k}: {y[0][k]} vs stock TRL {x[0][k]}"
    for n in a_ref:
        step_ref, step_got = a_ref[n] - b_ref[n], a_got[n] - b_got[n]
        assert torch.equal(b_ref[n], b_got[n])
        if step_ref.norm() > 0:
            assert rel_err(step_got, step_ref) <= REL, f"update of {n} differs by {rel_err(step_got, step_ref):.2e}"
        else:
            assert step_got.norm() == 0, n


# ---------------------------------------------------------------------------------------------------------------
# Bad input and options: named errors, at construction
# ---------------------------------------------------------------------------------------------------------------


def test_options_validated_at_construction(tmp_path):
    base = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    cases = [
        (dict(beta=1.5), "beta"), (dict(beta=-0.1), "beta"), (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"), (dict(fastrl_backend="cuda"), "fastrl_backend"),
        (dict(tiled_mlp=-1), "tiled_mlp"), (dict(activation_offloading="yes"), "activation_offloading"),
        (dict(fused_loss=1), "fused_loss"),
    ]
    for kw, name in cases:
        with pytest.raises(ValueError, match=name):
            fastrl.DistillationConfig(**base, **kw)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # TRL's default through the deprecated name warns; ours not
        default = fastrl.DistillationConfig(**base)
    assert default.gradient_checkpointing and (
        default.activation_checkpointing if hasattr(default, "activation_checkpointing") else True)
    assert (default.fused_loss, default.fastrl_backend, default.tiled_mlp, default.activation_offloading) == \
        (True, None, 0, False)
    # a stock config, or one changed after it was made, is checked when the trainer is built
    args = trl.DistillationConfig(**base, bf16=False)
    args.temperature = -1.0
    tok = tiny_tokenizer(V)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        fastrl.DistillationTrainer(model=tiny_qwen2(V, H, 1), teacher_model=tiny_qwen2(V, H, 1), args=args,
                                   processing_class=tok, train_dataset=toy_prompt_dataset(tok, n=4))
    with pytest.raises(TypeError, match="args must be"):
        fastrl.DistillationTrainer(model=tiny_qwen2(V, H, 1), teacher_model=tiny_qwen2(V, H, 1),
                                   args=dict(beta=0.5), processing_class=tok)


def test_bad_teacher_named_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab"):  # TRL's check, kept: config vocabularies differ
        ours(tmp_path, teacher=tiny_qwen2(V + 16, H_TEACHER, 1, seed=1))
    with pytest.raises(ValueError, match="teacher_model is None"):
        fastrl.DistillationTrainer(
            model=tiny_qwen2(V, H, 1), teacher_model=None,
            args=fastrl.DistillationConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False))
    # a teacher head whose rows differ from its config's vocab_size (TRL compares the configs only)
    teacher = tiny_qwen2(V, H_TEACHER, 1, seed=1)
    teacher.lm_head = torch.nn.Linear(H_TEACHER, V + 8, bias=False)
    with pytest.raises(ValueError, match=rf"student's LM head has {V} vocabulary rows but the teacher's has {V + 8}"):
        ours(tmp_path, teacher=teacher)


def test_distillation_loss_bad_input():
    from fastrl.trainers._lm_head import HeadSettings
    from fastrl.trainers.distillation import distillation_loss

    g = torch.Generator().manual_seed(0)
    hs, ht = torch.randn(2, 3, H, generator=g), torch.randn(2, 3, H_TEACHER, generator=g)
    ws, wt = torch.randn(V, H, generator=g), torch.randn(V + 1, H_TEACHER, generator=g)
    st = HeadSettings(temperature=0.9)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=f"{V} vocabulary rows but the teacher's has {V + 1}"):
        distillation_loss(hs, ht, ws, wt, mask, beta=0.5, student=st, teacher=st)
    with pytest.raises(ValueError, match=r"mask's shape \(2, 4\)"):
        distillation_loss(hs, ht, ws, wt[:V], torch.ones(2, 4), beta=0.5, student=st, teacher=st)
    with pytest.raises(ValueError, match="one temperature"):
        distillation_loss(hs, ht, ws, wt[:V], mask, beta=0.5, student=st, teacher=HeadSettings(temperature=1.0))


# ---------------------------------------------------------------------------------------------------------------
# distillation_loss itself, against TRL's _chunked_divergence_loss on the same tensors
# ---------------------------------------------------------------------------------------------------------------


def _loss_inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(3, 7, H, generator=g, requires_grad=True)
    ht = torch.randn(3, 7, H_TEACHER, generator=g)
    ws = torch.nn.Parameter(torch.randn(V, H, generator=g) * 0.3)
    wt = torch.randn(V, H_TEACHER, generator=g) * 0.3
    bs = torch.nn.Parameter(torch.randn(V, generator=g)) if bias else None
    bt = torch.randn(V, generator=g) if bias else None
    mask = torch.ones(3, 7, dtype=torch.int64)
    mask[0, 4:] = 0
    mask[2, :2] = 0
    return hs, ht, ws, wt, bs, bt, mask


@pytest.mark.parametrize("beta", (0.0, 0.3, 1.0))
@pytest.mark.parametrize("num_items", (None, 40))
def test_distillation_loss_equals_trl(beta, num_items):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from fastrl.trainers._lm_head import HeadSettings
    from fastrl.trainers.distillation import distillation_loss

    hs, ht, ws, wt, bs, bt, mask = _loss_inputs()
    s, t = HeadSettings(temperature=0.7, logit_scale=1.3, softcap=5.0), HeadSettings(temperature=0.7, softcap=3.0)
    out = []
    for which in ("trl", "fastrl"):
        hs.grad = ws.grad = bs.grad = None
        if which == "trl":
            loss, ent, n = _chunked_divergence_loss(
                hs, ht, ws, wt, mask, beta, num_items_in_batch=num_items, student_lm_head_bias=bs,
                teacher_lm_head_bias=bt, student_logit_scale=1.3, student_final_logit_softcapping=5.0,
                teacher_final_logit_softcapping=3.0, temperature=0.7)
        else:
            loss, ent, n = distillation_loss(hs, ht, ws, wt, mask, beta=beta, student=s, teacher=t,
                                             num_items_in_batch=num_items, student_bias=bs, teacher_bias=bt)
        loss.backward()
        out.append((loss.detach(), ent, n, hs.grad.clone(), ws.grad.clone(), bs.grad.clone()))
    (l_ref, e_ref, n_ref, *g_ref), (l_got, e_got, n_got, *g_got) = out
    assert int(n_got) == int(n_ref) == int(mask.sum())
    torch.testing.assert_close(l_got, l_ref, rtol=REL, atol=0)
    torch.testing.assert_close(e_got, e_ref, rtol=REL, atol=0)
    for name, a, b in zip(("hidden", "weight", "bias"), g_got, g_ref):
        assert rel_err(a, b) <= REL, f"grad {name}: {rel_err(a, b):.2e}"
    assert g_got[0][0, 4:].abs().max() == 0 and g_got[0][2, :2].abs().max() == 0  # masked tokens: no gradient


@pytest.mark.parametrize("marked", ("student", "teacher", "both"))
def test_zero3_route_matches_direct(marked):
    """The DeepSpeed ZeRO-3 route (heads gathered for the forward, gathered again and recomputed in the backward)
    gives the direct route's loss and gradients. Without DeepSpeed the gather is a no-op; ``ds_id`` marks a head
    as partitioned (and ``ds_shape`` gives its full shape, as DeepSpeed's does)."""
    from fastrl.trainers._lm_head import HeadSettings
    from fastrl.trainers.distillation import distillation_loss

    hs, ht, ws, wt, bs, bt, mask = _loss_inputs(seed=1)
    wt = torch.nn.Parameter(wt, requires_grad=False)
    s = HeadSettings(temperature=0.8)
    results = []
    for zero3 in (False, True):
        for w, who in ((ws, "student"), (wt, "teacher")):
            if zero3 and marked in (who, "both"):
                w.ds_id, w.ds_shape = 0, w.shape
        hs.grad = ws.grad = bs.grad = None
        loss, ent, _ = distillation_loss(hs, ht, ws, wt, mask, beta=0.5, student=s, teacher=s, student_bias=bs,
                                         teacher_bias=bt)
        (loss * 2.0).backward()
        results.append((loss.detach(), ent, hs.grad.clone(), ws.grad.clone(), bs.grad.clone()))
    for w in (ws, wt):
        for attr in ("ds_id", "ds_shape"):
            if hasattr(w, attr):
                delattr(w, attr)
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-8)


def test_no_full_logits_in_a_training_step(tmp_path):
    """Every tensor produced while the loss runs forward and backward (both models' bodies, the divergence) is
    smaller than one model's [batch, completion, vocab] logits. The vocabulary is large enough (2^16) that fastrl's
    bounded tiles (2^20 elements) are a fraction of it, as at real sizes."""

    big_v, c = 1 << 16, 32
    trainer = make_trainer(fastrl.DistillationTrainer, fastrl.DistillationConfig, tmp_path,
                           model=tiny_qwen2(big_v, 16, 1, seed=0), teacher=tiny_qwen2(big_v, 24, 1, seed=1))
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        prompt_ids=torch.randint(3, big_v, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.int64),
        completion_ids=torch.randint(3, big_v, (B, c), generator=g),
        completion_mask=torch.ones(B, c, dtype=torch.int64), num_items_in_batch=torch.tensor(B * c),
    )
    rec = tiny.LargestAllocations()
    largest = rec.allocs

    trainer.beta = 0.5
    trainer.model.train()
    with rec:
        trainer.compute_loss(trainer.model, inputs).backward()
    assert trainer._fastrl_last_path == "fused"
    numel, op, shape = max(largest)
    assert numel < B * c * big_v, f"{op} produced {shape}: as large as the [B, C, V] logits ({B}x{c}x{big_v})"


@pytest.mark.parametrize("beta", BETAS)
def test_distillation_loss_bf16_accuracy(beta):
    """bf16 operands under autocast: against float64 on the same (bf16-representable) values, fastrl's loss and
    student gradients are no worse than TRL's ``_chunked_divergence_loss`` (plus a small tolerance; both are
    limited by returning the gradients in bf16, ~2e-3 relative)."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from fastrl.reference import divergence_reference
    from fastrl.trainers._lm_head import HeadSettings
    from fastrl.trainers.distillation import distillation_loss

    g = torch.Generator().manual_seed(0)

    def bf16_values(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16().float()

    hs0, ht, ws0, wt = bf16_values(4, 12, H), bf16_values(4, 12, H_TEACHER), bf16_values(V, H, scale=0.6), \
        bf16_values(V, H_TEACHER, scale=0.6)
    mask = torch.ones(4, 12, dtype=torch.int64)
    mask[1, 7:] = 0
    s = HeadSettings(temperature=TEMPERATURE)
    res = {}
    for which in ("float64", "trl", "fastrl"):
        dt = torch.float64 if which == "float64" else torch.float32
        hs, ws = hs0.to(dt, copy=True).requires_grad_(), ws0.to(dt, copy=True).requires_grad_()
        if which == "float64":
            d, _ = divergence_reference(hs, ws, ht.double(), wt.double(), beta=beta, temperature=TEMPERATURE,
                                        mask=mask, dtype=torch.float64)
            loss = d.sum() / mask.sum()
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if which == "trl":
                    loss = _chunked_divergence_loss(hs, ht, ws, wt, mask, beta, temperature=TEMPERATURE)[0]
                else:
                    loss = distillation_loss(hs, ht, ws, wt, mask, beta=beta, student=s, teacher=s)[0]
        loss.backward()
        res[which] = (loss.detach().double(), hs.grad.double(), ws.grad.double())
    truth = res["float64"]
    errs = {w: [rel_err(a, b) for a, b in zip(res[w], truth)] for w in ("trl", "fastrl")}
    for i, what in enumerate(("loss", "grad hidden", "grad weight")):
        tol = 1e-6 if i == 0 else 5e-4
        assert errs["fastrl"][i] <= errs["trl"][i] + tol, \
            f"{what}: fastrl {errs['fastrl'][i]:.2e}, TRL {errs['trl'][i]:.2e} (relative error against float64)"


@pytest.mark.parametrize("name", ("DistillationTrainer", "DistillationConfig"))
def test_lazy_export_without_trl_names_the_extra(monkeypatch, name):
    import sys

    assert name in fastrl.__all__
    monkeypatch.setitem(sys.modules, "trl", None)  # as if `pip install -e .` without [trl]
    monkeypatch.delitem(sys.modules, "fastrl.trainers.distillation", raising=False)
    monkeypatch.delitem(vars(fastrl), name, raising=False)  # drop the cached lazy attribute (restored afterwards)
    with pytest.raises(ModuleNotFoundError) as info:
        exec(f"from fastrl import {name}", {})
    msg = str(info.value)
    assert f"fastrl.{name} needs the package 'trl'" in msg and 'pip install "fastrl-kernels[trl]"' in msg


def test_non_finite_student_stops_with_a_named_error(tmp_path):
    """A NaN in the student's head: stock TRL returns a NaN loss and trains on it; fastrl stops before the
    optimizer step with an error naming the first token and the input at fault."""
    fr = ours(tmp_path)
    with torch.no_grad():
        fr.model.lm_head.weight[5, 3] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite divergence at"):
        run_step(fr, make_batch(), beta=0.5)


def test_fully_masked_micro_batch(pair):
    """A micro-batch with no counted token (every completion masked, as a rank can get under DDP): loss 0 and a
    zero gradient for every parameter stock TRL's reaches, so DDP's all-reduce still sees each of them."""
    st, fr = pair
    batch = make_batch(seed=9)
    batch["completion_mask"] = torch.zeros_like(batch["completion_mask"])
    batch["num_items_in_batch"] = torch.tensor(0)
    (l_ref, g_ref, m_ref), (l_got, g_got, m_got) = (run_step(t, batch, beta=0.5, temperature=TEMPERATURE)
                                                    for t in (st, fr))
    assert l_ref == l_got == 0.0 and m_ref == m_got == {"entropy": 0.0}
    assert set(g_got) == set(g_ref) and all(g.abs().max() == 0 for g in g_got.values())
