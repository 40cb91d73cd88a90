"""The runner ``sampling_replay="kept_set"`` needs: vLLM returns sampling masks only from its Model Runner V2, and
picks V1 where ``VLLM_USE_V2_MODEL_RUNNER=0`` is set, where it finds no Triton, or where the engine uses a feature V2
does not support yet (vLLM 0.32's ``VllmConfig.use_v2_model_runner``). fastrl refuses such a trainer at
construction, before the engine is built, naming the installed vLLM, why V1 and what to change.

Runs in the vLLM environment (``bash .ci/vllm-env.sh``; ``.ci/run`` runs it there, where a missing vLLM fails);
skipped, saying so, anywhere else (tests/vllm_harness.py). The harness leaves ``VLLM_USE_V2_MODEL_RUNNER`` unset (vLLM
chooses, as in a user's process): the colocated kept-set runs of tests/test_vllm_colocate.py get V2 that way.
"""

from __future__ import annotations

import pytest
import torch

from vllm_harness import PROMPTS, grpo_kwargs, require_vllm, reward_len

vllm = require_vllm()

import vllm.config.vllm as vllm_config_module  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl.generation import vllm_generation  # noqa: E402
from vllm import envs  # noqa: E402

import fastrl  # noqa: E402
from fastrl import testing_vllm as vllm_cpu  # noqa: E402
from fastrl.trainers.grpo_vllm import runner_v2_problem  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vllm_cpu.save_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "qwen2", vocab_size=512)


@pytest.fixture
def runner_env(monkeypatch):
    """Set or unset VLLM_USE_V2_MODEL_RUNNER for one test (vLLM caches its variables once an engine started)."""

    def set_(value):
        if value is None:
            monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
        else:
            monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
        envs.disable_envs_cache()

    yield set_
    envs.disable_envs_cache()


@pytest.fixture
def engine_calls(monkeypatch):
    """TRL's LLM(...) calls that reached vLLM (none may, when fastrl refuses before the engine)."""
    calls = []
    real = vllm_generation.LLM

    def llm(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(vllm_generation, "LLM", llm)
    return calls


def kept_set_trainer(model_dir, out_dir, **overrides):
    args = fastrl.GRPOConfig(**grpo_kwargs(out_dir, sampling_replay="kept_set", **overrides))
    return fastrl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                              reward_funcs=reward_len, args=args, processing_class=vllm_cpu.load_tokenizer(model_dir),
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}))


def test_vllm_itself_picks_v2_without_the_variable(model_dir, runner_env):
    """What the harness relies on: with the variable unset, vLLM's own choice for a sampling-mask engine is V2."""
    from vllm.engine.arg_utils import EngineArgs

    runner_env(None)
    assert runner_v2_problem() is None
    config = EngineArgs(model=model_dir, dtype="float32", return_sampling_mask=True, max_model_len=128,
                        logprobs_mode="processed_logprobs", enforce_eager=True).create_engine_config()
    assert config.use_v2_model_runner is True


def test_v1_forced_by_the_variable_refused_before_the_engine(model_dir, tmp_path, runner_env, engine_calls):
    runner_env("0")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.32\.0 would run its V1 runner here: VLLM_USE_V2_MODEL_RUNNER=0 "
                                           r"is set.*Unset it.*sampling_replay='rule'") as info:
        kept_set_trainer(model_dir, tmp_path)
    assert "Model Runner V2" in str(info.value)
    assert not engine_calls, "vLLM was asked for an engine fastrl knew it could not build"


def test_no_triton_refused_naming_it(model_dir, tmp_path, runner_env, engine_calls, monkeypatch):
    runner_env(None)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", False)  # what vLLM's config module found at import
    with pytest.raises(RuntimeError, match=r"V1 runner here: vLLM finds no usable Triton.*triton-cpu"):
        kept_set_trainer(model_dir, tmp_path)
    assert not engine_calls


def test_unsupported_feature_named_from_vllms_own_report(model_dir, tmp_path, runner_env, engine_calls, monkeypatch):
    """A feature V2 does not support yet (vLLM decides it from the engine's config): vLLM's config check refuses the
    sampling-mask engine before loading anything, and fastrl says which feature vLLM reported."""
    runner_env(None)
    monkeypatch.setattr(vllm_config_module.VllmConfig, "_get_v2_model_runner_unsupported_features",
                        lambda self: ["speculative method 'suffix' (test)"])
    with pytest.raises(RuntimeError, match=r"V1 runner here: vLLM reports that Model Runner V2 does not yet support "
                                           r"speculative method 'suffix' \(test\); turn that off"):
        kept_set_trainer(model_dir, tmp_path)
    assert len(engine_calls) == 1  # TRL's LLM(...) was called; vLLM refused its config, no engine was built
