"""DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2 through fastrl's trainers, two gloo processes on CPU.

Three launches, each running several checks (a launch costs more than its checks):

* ZeRO-3: ``accelerate launch --config_file examples/ppo_configs/deepspeed_zero3.yaml`` (two processes, float32)
  runs this file's worker. GRPO: one training step (``Trainer.train``, SGD, no clipping, so the update is
  ``-lr * gradient``) of ``fastrl.GRPOTrainer`` on a hand-built batch per rank, for an untied model with a
  reference model, tied embeddings, and LoRA (frozen head); the same step of stock ``trl.GRPOTrainer``; the
  reference model's forward-only log-probs; one step with real generation. PPO: ``examples/ppo.py`` itself, three
  updates saving a checkpoint each, then a second run resumed from the first checkpoint.
* ZeRO-2: the same GRPO steps (fastrl's and stock TRL's) with ``examples/ppo_configs/deepspeed_zero2.yaml``, and
  two PPO updates of ``examples/ppo.py``.
* FSDP2: the same GRPO steps under ``torch.distributed.run`` with models sharded at load time by transformers
  (``from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))``: torch's ``fully_shard`` on a gloo CPU
  mesh); the Trainer then trains the sharded model as is. Accelerate cannot do FSDP on CPU processes (it falls
  back to DDP), so accelerate's own FSDP2 (``examples/ppo_configs/fsdp2.yaml``) is not run here.

The parent process computes the single-process step on the union of the two ranks' batches and compares: the
mean of the ranks' losses equals its loss, the gathered parameter update equals its update (float32, 1e-5
relative per parameter), frozen parameters do not move, and ZeRO-3 / FSDP2 really held the LM head partitioned
(ZeRO-3: before the loss and again after its forward).

DeepSpeed builds one small communication op with g++ on its first CPU launch; the ``dist_env`` fixture builds it
once into a cache directory that every launch reuses (``TORCH_EXTENSIONS_DIR``; pytest's cache keeps it between
sessions). ``python -m pytest -m "not distributed"`` skips this file.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIGS = ROOT / "examples" / "ppo_configs"
PPO_EXAMPLE = ROOT / "examples" / "ppo.py"

pytestmark = pytest.mark.distributed

REL = 1e-5  # float32: losses and per-parameter updates against the single-process step
STEP = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0, lr_scheduler_type="constant", max_steps=1,
            loss_type="dapo", save_strategy="no")
GRPO_CASES = {  # case -> (weights folder, trainer options)
    "untied": ("untied", dict(beta=0.04)),  # TRL builds the reference model from the saved weights
    "tied": ("tied", dict(beta=0.0)),
    "lora": ("untied", dict(beta=0.04)),  # frozen head; the reference is the policy without its adapter
}
LAUNCH_TIMEOUT = 420  # seconds per launch (each takes 20-60 s on two idle cores)


# ---------------------------------------------------------------------------------------------------------------
# Shared by the parent and the workers
# ---------------------------------------------------------------------------------------------------------------


def _policy(case: str, models: Path, **load_kwargs):
    """The case's policy from its saved weights; LoRA adapters initialised at random (not the identity)."""
    from transformers import AutoModelForCausalLM

    folder, _ = GRPO_CASES[case]
    model = AutoModelForCausalLM.from_pretrained(models / folder, attn_implementation="eager", **load_kwargs)
    if case == "lora":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                            init_lora_weights=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            model = get_peft_model(model, config)
    return model


def _grpo_trainer(case: str, models: Path, tmp: Path, cls: str = "fastrl", **overrides):
    from test_grpo_trainer import ours, stock

    factory = ours if cls == "fastrl" else stock
    model = _policy(case, models, **overrides.pop("load_kwargs", {}))
    return factory(tmp / f"{case}-{cls}", model=model, **{**STEP, **GRPO_CASES[case][1], **overrides})


def _one_step(trainer, batch: dict, probe=None) -> float:
    """One ``Trainer.train`` step on ``batch`` (in place of generation); returns the loss it computed.

    ``probe(trainer, when)`` runs inside the step, where the distributed wrapper holds the model: before the loss
    (``"before"``) and after its forward (``"after_forward"``).
    """
    losses = []
    compute_loss = trainer.compute_loss

    def recording(*args, **kwargs):
        if probe is not None:
            probe(trainer, "before")
        loss = compute_loss(*args, **kwargs)
        if probe is not None:
            probe(trainer, "after_forward")
        losses.append(loss.detach().item())
        return loss

    trainer.compute_loss = recording
    trainer._generate_and_score_completions = lambda generation_batch: dict(batch)
    trainer.train()
    assert len(losses) == 1, losses
    return losses[0]


def _full_state(trainer) -> dict[str, torch.Tensor]:
    """Every parameter, whole: gathered from ZeRO-3 partitions or FSDP2 shards."""
    from torch.distributed.tensor import DTensor

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    params = dict(model.named_parameters())
    if any(hasattr(p, "ds_id") for p in params.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()}


def _lm_head(trainer):
    from fastrl.trainers._lm_head import unwrap_causal_lm

    return unwrap_causal_lm(trainer.accelerator.unwrap_model(trainer.model_wrapped)).get_output_embeddings()


# ---------------------------------------------------------------------------------------------------------------
# Workers (run under accelerate launch / torch.distributed.run)
# ---------------------------------------------------------------------------------------------------------------


def _held(w) -> dict:
    """How a parameter is held right now: a ZeRO-3 partition, an FSDP2 shard, or whole."""
    if hasattr(w, "ds_id"):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return dict(kind="zero3", numel=w.numel(), local=w.ds_tensor.numel(), full=w.ds_numel,
                    available=w.ds_status == ZeroParamStatus.AVAILABLE)
    if type(w).__name__ == "DTensor":
        return dict(kind="dtensor", numel=w.to_local().numel(), local=w.to_local().numel(), full=w.numel())
    return dict(kind="plain", numel=w.numel(), local=w.numel(), full=w.numel())


def _grpo_worker(out: Path, models: Path, batch: dict, rank: int, stage: str) -> dict:
    """One training step of each case on this rank's batch; saves the gathered parameters (rank 0)."""
    import torch.distributed as dist

    load_kwargs = {}
    if stage == "fsdp2":
        from transformers.distributed import DistributedConfig

        load_kwargs = dict(distributed_config=DistributedConfig(fsdp_size=2))
    result = {}
    for case, cls in [(case, "fastrl") for case in GRPO_CASES] + [("untied", "stock")]:
        trainer = _grpo_trainer(case, models, out / f"tmp-{rank}", cls, load_kwargs=load_kwargs)
        assert trainer.accelerator.num_processes == 2, trainer.accelerator.num_processes
        if case == "untied" and cls == "fastrl" and stage == "zero3":
            # the reference model (a DeepSpeed engine, ZeRO-3 partitioned): fastrl's forward-only log-probs
            assert type(trainer.ref_model).__name__ == "DeepSpeedEngine", type(trainer.ref_model)
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            with torch.no_grad():
                logp, ent = trainer._get_per_token_logps_and_entropies(
                    trainer.ref_model, ids, mask, batch["completion_ids"].shape[1], compute_entropy=True)[:2]
            torch.save({"logp": logp, "entropy": ent}, out / f"ref-logps-rank{rank}.pt")
        head = {}
        loss = _one_step(trainer, batch, probe=lambda t, when: head.update({when: _held(_lm_head(t).weight)}))
        entry = dict(loss=loss, head=head, engine=type(trainer.model_wrapped).__name__)
        if trainer.is_deepspeed_enabled:
            entry["zero_stage"] = trainer.model_wrapped.zero_optimization_stage()
        state = _full_state(trainer)
        flat = torch.cat([v.reshape(-1) for v in state.values()])
        rank0 = flat.clone()
        dist.broadcast(rank0, src=0)
        entry["max_diff_vs_rank0"] = (flat - rank0).abs().max().item()
        if rank == 0:
            torch.save(state, out / f"state-{case}-{cls}.pt")
        result[f"{case}-{cls}"] = entry
        del trainer
    return result


def _generation_step(out: Path, models: Path, rank: int) -> list[dict]:
    """A real GRPO step: generation (the policy gathered for it), the reference model, the loss; its logs."""
    trainer = _grpo_trainer("untied", models, out / f"tmp-{rank}", "fastrl", optim="adamw_torch", learning_rate=1e-3)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def _ppo_args(tiny: Path, output_dir: Path, total_episodes: int, *extra: str) -> list[str]:
    return [
        "--dataset_name", str(tiny / "dataset"), "--dataset_train_split", "descriptiveness",
        "--model_name_or_path", str(tiny / "policy"), "--sft_model_path", str(tiny / "policy"),
        "--reward_model_path", str(tiny / "reward"), "--output_dir", str(output_dir),
        "--learning_rate", "3e-3", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--num_ppo_epochs", "2", "--total_episodes", str(total_episodes), "--response_length", "8",
        "--missing_eos_penalty", "1.0", "--report_to", "none", "--num_sample_generations", "0",
        "--disable_tqdm", "true", "--seed", "0", "--use_cpu", "true", *extra,
    ]


def _run_ppo_example(args: list[str]) -> None:
    saved = sys.argv
    sys.argv = [str(PPO_EXAMPLE), *args]
    try:
        runpy.run_path(str(PPO_EXAMPLE), run_name="__main__")
    finally:
        sys.argv = saved


def _worker(stage: str, out: Path, inputs_dir: Path) -> None:
    sys.path.insert(0, str(HERE))
    torch.set_num_threads(1)
    import torch.distributed as dist

    if stage == "fsdp2":
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    inputs = torch.load(inputs_dir / "inputs.pt")
    models = inputs_dir / "models"
    t0 = time.time()
    result = {"rank": rank}
    if stage != "fsdp2":
        import deepspeed.comm

        # fastrl's trainer initialises DeepSpeed's communication (with use_cpu=True accelerate does not): the first
        # case's reference model, built under ZeRO-3's zero.Init, needs it (and so does stock TRL's, later)
        result["ds_comm_before_first_trainer"] = deepspeed.comm.is_initialized()
    result["grpo"] = _grpo_worker(out, models, inputs["batches"][rank], rank, stage)
    result["grpo_seconds"] = time.time() - t0

    tiny = inputs_dir / "tiny_ppo"
    if stage == "zero3":
        result["generation_step"] = _generation_step(out, models, rank)
        t0 = time.time()
        _run_ppo_example(_ppo_args(tiny, out / "ppo-full", 24, "--save_strategy", "steps", "--save_steps", "1"))
        _run_ppo_example(_ppo_args(tiny, out / "ppo-resumed", 24, "--save_strategy", "steps", "--save_steps", "1",
                                   "--resume_from_checkpoint", str(out / "ppo-full" / "checkpoint-1")))
        result["ppo_seconds"] = time.time() - t0
        result["launch_check"] = _launch_check_message(out)
    elif stage == "zero2":
        t0 = time.time()
        _run_ppo_example(_ppo_args(tiny, out / "ppo-full", 16, "--save_strategy", "steps", "--save_steps", "2"))
        result["ppo_seconds"] = time.time() - t0
    with open(out / f"rank{rank}.json", "w") as f:
        json.dump(result, f)
    from tiny import end_worker

    end_worker()


def _launch_check_message(out: Path) -> str:
    """What fastrl says when the TrainingArguments miss ``use_cpu`` under DeepSpeed on a machine without GPUs."""
    from fastrl import PPOConfig, PPOTrainer

    args = PPOConfig(output_dir=str(out / "unused"), report_to="none")  # no use_cpu: a one-process state
    try:
        PPOTrainer(args=args, processing_class=None, model=None, ref_model=None, reward_model=None,
                   train_dataset=None, value_model=None)
    except ValueError as e:
        return str(e)
    return "no error"


# ---------------------------------------------------------------------------------------------------------------
# Parent: launching, the single-process reference, the comparisons
# ---------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 6000) -> str:
    """The first traceback in a launch's output (the rank that failed first; the launcher's own report of the
    failure follows it), then the output's last ``n`` characters."""
    text = path.read_text(errors="replace") if path.exists() else ""
    first = text.find("Traceback")
    head = text[first : first + n] + "\n[...]\n" if 0 <= first < len(text) - n else ""
    return head + text[-n:]


def _run(cmd: list[str], env: dict, log: Path, label: str, timeout: int = LAUNCH_TIMEOUT) -> float:
    """Run ``cmd`` in its own process group, output to ``log``; fail with the output's tail. Returns seconds."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"{label} did not finish within {timeout} s; its output ends with:\n{_tail(log)}")
    if rc != 0:
        pytest.fail(f"{label} failed with exit code {rc}; its output ends with:\n{_tail(log)}")
    return time.time() - t0


@pytest.fixture(scope="session")
def dist_env(request, tmp_path_factory):
    """Environment for the launches, with DeepSpeed's CPU communication op built once (cached)."""
    for name in ("deepspeed", "trl", "peft"):
        if importlib.util.find_spec(name) is None:  # not imported here: DeepSpeed picks its accelerator at import
            pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    # DeepSpeed compiles the op as a torch extension: it needs a C++ compiler and Python's headers
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if compiler is None or not headers.is_file():
        pytest.fail(f"DeepSpeed on CPU builds a C++ op at its first launch: it needs g++ (found: {compiler}) and "
                    f"{headers} (found: {headers.is_file()}); install them (apt-get install g++ python3-dev) or "
                    "skip these tests with -m 'not distributed'")
    ext = os.environ.get("TORCH_EXTENSIONS_DIR")
    if ext is None:
        cache = getattr(request.config, "cache", None)
        ext = str(cache.mkdir("torch_extensions") if cache is not None else tmp_path_factory.mktemp("ext"))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": ext, "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    build = ("from deepspeed.accelerator import get_accelerator; "
             "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")
    log = tmp_path_factory.mktemp("ds-op") / "build.log"
    _run([sys.executable, "-c", build], env, log, "building DeepSpeed's CPU communication op (g++)", timeout=600)
    return env


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Saved model weights, the two ranks' batches, tiny PPO models, and the single-process GRPO steps."""
    sys.path.insert(0, str(HERE))
    from test_grpo_trainer import H, V, make_batch
    from tiny import tiny_qwen2

    root = tmp_path_factory.mktemp("dist-inputs")
    models = root / "models"
    tiny_qwen2(V, H, 1, seed=0).save_pretrained(models / "untied")
    tiny_qwen2(V, H, 1, tie_word_embeddings=True, seed=1).save_pretrained(models / "tied")
    tmp = root / "tmp"
    trainer = _grpo_trainer("untied", models, tmp)
    batches = [make_batch(trainer, seed=10 + r) for r in (0, 1)]
    total = sum(b["completion_mask"].sum() for b in batches)
    for b in batches:
        b["num_items_in_batch"] = total.clone()  # TRL gathers the count over both processes
    union = {k: torch.cat([b[k] for b in batches]) if batches[0][k].dim() else total.clone() for k in batches[0]}
    torch.save({"batches": batches}, root / "inputs.pt")

    # the single-process step on the union (8 completions), per case
    reference = {}
    for case in GRPO_CASES:
        t = _grpo_trainer(case, models, tmp, per_device_train_batch_size=8)
        before = _full_state(t)
        loss = _one_step(t, union)
        trainable = {n for n, p in t.model.named_parameters() if p.requires_grad}
        reference[case] = dict(loss=loss, before=before, after=_full_state(t), trainable=trainable)
    ids = torch.cat([union["prompt_ids"], union["completion_ids"]], 1)
    mask = torch.cat([union["prompt_mask"], union["completion_mask"]], 1)
    with torch.no_grad():  # the reference policy is the untied policy before its step
        logp, ent = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, union["completion_ids"].shape[1], compute_entropy=True)[:2]
    # a positive control for the update check: rank 0's batch alone gives a clearly different update
    t = _grpo_trainer("untied", models, tmp)
    _one_step(t, {**batches[0], "num_items_in_batch": batches[0]["completion_mask"].sum()})
    control = _full_state(t)

    tiny = root / "tiny_ppo"
    saved = sys.argv
    sys.argv = ["make_tiny_ppo_models.py", "--output_dir", str(tiny)]
    try:
        runpy.run_path(str(ROOT / "examples" / "make_tiny_ppo_models.py"), run_name="__main__")
    finally:
        sys.argv = saved
    return dict(root=root, reference=reference, ref_logps=(logp, ent), control=control)


def _launch(stage: str, dist_env, inputs, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp(f"launch-{stage}")
    worker = [str(Path(__file__).resolve()), f"--{stage}-worker", str(out), str(inputs["root"])]
    if stage == "fsdp2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(_free_port()), *worker]
        env = {**dist_env, "ACCELERATE_USE_CPU": "true"}
    else:
        config = CONFIGS / ("deepspeed_zero3.yaml" if stage == "zero3" else "deepspeed_zero2.yaml")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(_free_port()), *worker]
        env = dist_env
    seconds = _run(cmd, env, out / "launch.log", f"the {stage} launch ({' '.join(cmd[1:4])} ...)")
    ranks = []
    for r in (0, 1):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result; the launch's output ends with:\n{_tail(out / 'launch.log')}"
        ranks.append(json.loads(path.read_text()))
    return dict(out=out, ranks=ranks, seconds=seconds)


@pytest.fixture(scope="module")
def zero3(dist_env, inputs, tmp_path_factory):
    return _launch("zero3", dist_env, inputs, tmp_path_factory)


@pytest.fixture(scope="module")
def zero2(dist_env, inputs, tmp_path_factory):
    return _launch("zero2", dist_env, inputs, tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp2(dist_env, inputs, tmp_path_factory):
    return _launch("fsdp2", dist_env, inputs, tmp_path_factory)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _check_grpo_step(run: dict, inputs: dict, case: str, cls: str = "fastrl") -> None:
    """The launch's step equals the single-process step on the union batch (see the module docstring)."""
    ref = inputs["reference"][case]
    label = f"{case} ({cls})"
    entries = [r["grpo"][f"{case}-{cls}"] for r in run["ranks"]]
    losses = [e["loss"] for e in entries]
    assert losses[0] != losses[1], f"{label}: both ranks computed the same loss; each should have its own batch"
    mean = sum(losses) / 2
    assert abs(mean - ref["loss"]) <= REL * abs(ref["loss"]), \
        f"{label}: mean of the ranks' losses {mean!r} (ranks: {losses}), single process {ref['loss']!r}"
    for e in entries:
        assert e["max_diff_vs_rank0"] == 0.0, f"{label}: the ranks' parameters differ by {e['max_diff_vs_rank0']}"
    got = torch.load(run["out"] / f"state-{case}-{cls}.pt")
    assert set(got) == set(ref["after"]), f"{label}: parameter names differ: {set(got) ^ set(ref['after'])}"
    for name, after in ref["after"].items():
        before = ref["before"][name]
        if name not in ref["trainable"]:
            assert torch.equal(got[name], before), f"{label}: frozen parameter {name} changed"
            continue
        expected, update = after - before, got[name] - before
        assert expected.norm() > 0, f"{label}: the single-process step did not move {name}"
        err = _rel(update, expected)
        assert err <= REL, f"{label}: the update of {name} differs from the single-process one by {err:.2e} (relative)"


def _check_head(entry: dict, kind: str, label: str) -> None:
    """The LM head was split over the two ranks when the step began; under ZeRO-3 it was partitioned again after
    the loss's forward (gathered only while the head ran). (FSDP2 keeps the root unit, which holds the head,
    unsharded from the forward to the backward by design.)"""
    for when in ("before", "after_forward") if kind == "zero3" else ("before",):
        head = entry["head"].get(when, {})
        assert head.get("kind") == kind, f"{label}: LM head held as {head} ({when}), expected {kind}"
        assert head["local"] * 2 == head["full"], f"{label}: the LM head is not split over the two ranks: {head}"
        if kind == "zero3":
            assert head["numel"] == 0 and not head["available"], \
                f"{label}: the LM head is gathered ({when}: {head}); ZeRO-3 should hold only its partition there"


def test_zero3_grpo_step_matches_single_process_and_stock_trl(zero3, inputs):
    for case in GRPO_CASES:
        _check_grpo_step(zero3, inputs, case)
    _check_grpo_step(zero3, inputs, "untied", "stock")
    for r in zero3["ranks"]:
        assert r["ds_comm_before_first_trainer"] is False, "the launch check did not get to initialise DeepSpeed"
        for key, e in r["grpo"].items():
            assert e["engine"] == "DeepSpeedEngine" and e["zero_stage"] == 3, (key, e)
            _check_head(e, "zero3", f"rank {r['rank']} {key}")
    # fastrl and stock TRL agree with each other as closely as each does with the single process
    ours = torch.load(zero3["out"] / "state-untied-fastrl.pt")
    theirs = torch.load(zero3["out"] / "state-untied-stock.pt")
    before = inputs["reference"]["untied"]["before"]
    for name in ours:
        err = _rel(ours[name] - before[name], theirs[name] - before[name])
        assert err <= REL, f"{name}: fastrl's ZeRO-3 update differs from stock TRL's by {err:.2e}"


def test_update_check_has_power(inputs):
    """Positive control: the check above tells the union's update from rank 0's batch alone."""
    ref = inputs["reference"]["untied"]
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        err = _rel(inputs["control"][name] - ref["before"][name], ref["after"][name] - ref["before"][name])
        assert err > 1000 * REL, f"{name}: rank 0's batch alone gives nearly the same update ({err:.2e})"


def test_zero3_reference_model_logprobs(zero3, inputs):
    logp, ent = inputs["ref_logps"]
    for r in (0, 1):
        got = torch.load(zero3["out"] / f"ref-logps-rank{r}.pt")
        rows = slice(4 * r, 4 * r + 4)
        torch.testing.assert_close(got["logp"], logp[rows], rtol=REL, atol=1e-6)
        torch.testing.assert_close(got["entropy"], ent[rows], rtol=REL, atol=1e-6)


def test_zero3_grpo_step_with_generation(zero3):
    for r in zero3["ranks"]:
        logs = r["generation_step"]
        assert len(logs) == 1 and math.isfinite(logs[0]["loss"]), logs
        assert "kl" in logs[0] and math.isfinite(logs[0]["kl"]) and "reward" in logs[0], logs


def _ppo_log(run_dir: Path, checkpoint: int) -> list[dict]:
    state = json.loads((run_dir / f"checkpoint-{checkpoint}" / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "objective/kl" in h]


def _check_ppo_metrics(logs: list[dict], episodes: list[int], label: str) -> None:
    from test_ppo_trainer import DOCUMENTED_METRICS

    assert [h["episode"] for h in logs] == episodes, f"{label}: episodes {[h['episode'] for h in logs]}"
    for h in logs:
        missing = [k for k in DOCUMENTED_METRICS if k not in h]
        assert not missing, f"{label}: metrics missing from update {h['step']}: {missing}"
        bad = {k: h[k] for k in DOCUMENTED_METRICS if not math.isfinite(h[k])}
        assert not bad, f"{label}: non-finite metrics at update {h['step']}: {bad}"
    kl = logs[0]["objective/kl"]
    assert kl == 0.0, f"{label}: first rollout, policy == reference, yet KL {kl}"


def _deepspeed_stage(checkpoint: Path) -> int:
    """The ZeRO stage a DeepSpeed checkpoint was written under; it must hold each rank's optimizer partition."""
    optim = sorted(checkpoint.glob("global_step*/*zero_pp_rank_*_optim_states.pt"))
    assert len(optim) == 2, f"{checkpoint}: expected one optimizer partition per rank, found {optim}"
    states = sorted(checkpoint.glob("global_step*/*model_states.pt"))
    assert states, f"{checkpoint}: no DeepSpeed model states"
    return torch.load(states[0], weights_only=False)["ds_config"]["zero_optimization"]["stage"]


def test_zero3_ppo_example_runs_and_resumes(zero3):
    from safetensors.torch import load_file

    from test_ppo_trainer import DOCUMENTED_METRICS

    full, resumed = zero3["out"] / "ppo-full", zero3["out"] / "ppo-resumed"
    assert _deepspeed_stage(full / "checkpoint-1") == 3
    a = _ppo_log(full, 3)
    _check_ppo_metrics(a, [8, 16, 24], "ZeRO-3 PPO")  # batch_size = 2 processes x 4 prompts
    b = _ppo_log(resumed, 3)
    assert len(b) == 3, "the resumed run should hold the checkpoint's update and its own two"
    for la, lb in zip(a[1:], b[1:]):
        for k in DOCUMENTED_METRICS:
            if k != "eps":
                assert lb[k] == pytest.approx(la[k], rel=1e-6, abs=1e-7), f"update {la['step']}: {k} {lb[k]} vs {la[k]}"
    for rel_path in ("model.safetensors", "checkpoint-3/value_model/model.safetensors"):
        wa, wb = load_file(full / rel_path), load_file(resumed / rel_path)
        assert set(wa) == set(wb)
        for n in wa:
            assert torch.equal(wa[n], wb[n]), f"{rel_path}: {n} differs between the full and the resumed run"
    first = load_file(full / "checkpoint-1" / "model.safetensors")
    assert any(not torch.equal(first[n], wa[n]) for n in first if n in wa), "the policy did not move after update 1"


def test_zero3_launch_without_use_cpu_says_so(zero3):
    message = zero3["ranks"][0]["launch_check"]
    assert "use_cpu" in message and "2 processes" in message, message


def test_zero2_grpo_step_matches_single_process(zero2, inputs):
    for case in GRPO_CASES:
        _check_grpo_step(zero2, inputs, case)
    _check_grpo_step(zero2, inputs, "untied", "stock")
    for r in zero2["ranks"]:
        for key, e in r["grpo"].items():
            assert e["engine"] == "DeepSpeedEngine" and e["zero_stage"] == 2, (key, e)


def test_zero2_ppo_example(zero2):
    assert _deepspeed_stage(zero2["out"] / "ppo-full" / "checkpoint-2") == 2
    _check_ppo_metrics(_ppo_log(zero2["out"] / "ppo-full", 2), [8, 16], "ZeRO-2 PPO")


def test_fsdp2_grpo_step_matches_single_process(fsdp2, inputs):
    for case in GRPO_CASES:
        _check_grpo_step(fsdp2, inputs, case)
    _check_grpo_step(fsdp2, inputs, "untied", "stock")
    for r in fsdp2["ranks"]:
        for key, e in r["grpo"].items():
            _check_head(e, "dtensor", f"rank {r['rank']} {key}")


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1].endswith("-worker"):
    _worker(sys.argv[1][2:-len("-worker")], Path(sys.argv[2]), Path(sys.argv[3]))
