"""``python -m bench gap``: the gap between vLLM's log-probs and the trainer's as GRPO users meet it (TRL's colocated
vLLM), for stock TRL, fastrl, and fastrl with vLLM's LM head in float32; sampling replay off and on; float32 and
bf16 policies; each configuration in a fresh process, run with the vLLM environment's python (``bash
.ci/vllm-env.sh`` prints it). What it measures: docs/benchmarks.md#python--m-bench-gap."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench import report
from bench.session_run import Fresh, run_fresh

STEPS, QUICK_STEPS = 3, 1
METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/min",
           "sampling/importance_sampling_ratio/max", "sampling/kept_size_mean")
MODEL = {"vocab_size": 2048, "hidden_size": 256, "layers": 2, "heads": 4, "kv_heads": 2, "head_scale": 8.0}
QUICK_MODEL = {"vocab_size": 512, "hidden_size": 128, "layers": 2, "heads": 2, "kv_heads": 1, "head_scale": 8.0}
PROMPTS = ["the quick brown fox", "what is two plus two", "hello world", "the lazy dog jumps", "one two three",
           "answer is four", "a cat sat on the mat", "rain falls in spring"]


def configurations(dtypes=("float32", "bfloat16")) -> list[dict]:
    """The table's rows per policy dtype, each with its label."""
    out = []
    for dtype in dtypes:
        f32 = dtype == "float32"
        rows = [("TRL (its LLM(...) and head)", {"trainer": "trl"})]
        if f32:  # what sampling at the policy's precision buys: fastrl's replay on TRL's engine dtype
            rows.append(("fastrl, vLLM dtype as TRL's", {"replay": "kept_set", "engine_dtype": "auto"}))
        for head in (False,) if f32 else (False, True):  # a float32 policy's vLLM head is float32 already
            rows += [("fastrl + vLLM float32 head" if head else "fastrl", {"replay": replay, "fp32_head": head})
                     for replay in ("off", "kept_set")]
        if f32:  # the metrics' own cost: TRL's IS correction off, fastrl's gap metrics on and off
            rows += [(f"fastrl, no IS corr., gap {'on' if on else 'off'}", {"is_correction": False, "gap_metrics": on})
                     for on in (True, False)]
        out += [{"dtype": dtype, "trainer": "fastrl", "replay": "off", "fp32_head": False, **kw, "label": label}
                for label, kw in rows]
    return out


def reward_len(completions, **kwargs):
    return [len(set(c)) / 10.0 for c in completions]


def run_config(spec: dict) -> dict:
    """One configuration in this fresh process (``bench.session_points.run_spec``, ``{"kind": "gap"}``)."""
    from fastrl import testing_vllm as vllm_cpu

    vllm_cpu.prepare()
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    import fastrl
    from fastrl.trainers import grpo_vllm
    from fastrl.trainers.grpo_vllm import plain_cpu_gemm

    if spec.get("engine_dtype") == "auto":  # TRL's LLM(...) passes no dtype: vLLM's "auto" (bf16 where it can)
        ours = grpo_vllm.engine_kwargs
        grpo_vllm.engine_kwargs = lambda *a: {k: v for k, v in ours(*a).items() if k != "dtype"}
        grpo_vllm.check_engine = lambda *a, **k: None  # it would refuse the dtype fastrl did not ask for

    dtype = getattr(torch, spec["dtype"])
    tok = vllm_cpu.load_tokenizer(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype)
    kw = dict(output_dir=spec["out_dir"], use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=8,
              num_generations=4, max_completion_length=16, max_steps=spec["steps"], learning_rate=0.0,
              report_to="none", use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", seed=0,
              vllm_gpu_memory_utilization=0.1, vllm_max_model_length=256, top_k=20, top_p=0.9, temperature=1.0,
              beta=0.0, disable_tqdm=True, vllm_importance_sampling_correction=spec.get("is_correction", True))
    ds = Dataset.from_dict({"prompt": PROMPTS})
    if spec["trainer"] == "trl":
        with plain_cpu_gemm():  # TRL's own LLM(...) arguments; only the CPU GEMM choice, so its sync can run
            trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_len, args=trl.GRPOConfig(**kw),
                                      processing_class=tok, train_dataset=ds)
    else:
        args = fastrl.GRPOConfig(**kw, sampling_replay=spec["replay"], vllm_fp32_lm_head=spec["fp32_head"],
                                 log_sampling_gap=spec.get("gap_metrics", True))
        trainer = fastrl.GRPOTrainer(model=model, reward_funcs=reward_len, args=args, processing_class=tok,
                                     train_dataset=ds)
    mc = trainer.vllm_generation.llm.llm_engine.model_config
    engine = {k: str(v).removeprefix("torch.")
              for k, v in (("vllm_dtype", mc.dtype), ("vllm_head_dtype", mc.head_dtype))}
    t0 = time.perf_counter()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    train_s = time.perf_counter() - t0
    res = {"steps": len(logs), "train_s": train_s, "step_s": train_s / max(len(logs), 1), **engine}
    for m in METRICS:
        vals = [h[m] for h in logs if m in h]
        if vals:
            res[m] = max(vals) if m.endswith("/max") else min(vals) if m.endswith("/min") else sum(vals) / len(vals)
    return res


def add_options(ap) -> None:
    ap.add_argument("--steps", type=int, help=f"GRPO steps per configuration (default {STEPS}; --quick {QUICK_STEPS})")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="policy dtypes (default float32,bfloat16)")


def command(args, device: str, con) -> int:
    """Each configuration in a fresh process, its table line printed as it finishes; ``gap.json``."""
    from fastrl import testing_vllm as vllm_cpu

    if vllm_cpu.vllm_version() is None:
        con.print("[red]`python -m bench gap` needs vLLM: run it with the vLLM environment's python "
                  "(`PY=$(bash .ci/vllm-env.sh); $PY -m bench gap`)[/red]")
        return 2
    env = {**report.environment("cpu"), "vllm": vllm_cpu.vllm_version()}
    quick = bool(args.quick or args.smoke)
    steps = args.steps or (QUICK_STEPS if quick else STEPS)
    shape = QUICK_MODEL if quick else MODEL
    out_dir = Path(args.out) if args.out else report.new_out_dir(env["device_slug"], "gap")
    con.print(f"sampler-trainer gap on {env['device']} (CPU) | vLLM {env['vllm']} (CPU build), TRL {env['trl']}, "
              f"torch {env['torch']} | tiny Qwen2 V={shape['vocab_size']} H={shape['hidden_size']}, top_k=20 "
              f"top_p=0.9, {steps} step(s) of 8 completions x 16 tokens, learning rate 0")
    # 120 columns: dtypes short (bf16, fp32), the IS ratio's min and max to 2 digits (gap.json has them whole)
    con.print(f"{'policy':<7}{'trainer':<29}{'vLLM / head':<13}{'replay':<9}{'gap mean':>9}{'gap max':>9}"
              f"{'IS ratio mean [min, max]':>28}{'kept':>6}{'step s':>8}")
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fastrl-gap-models-") as tmp:
        dirs = {dtype: vllm_cpu.save_tiny_qwen2(Path(tmp) / dtype, dtype=dtype, **shape)
                for dtype in args.dtypes.split(",")}
        fresh = Fresh("cpu", interpret=True)  # one fresh process per configuration, the kernels interpreted
        for i, c in enumerate(configurations(tuple(dirs))):
            spec = {**c, "kind": "gap", "model_dir": dirs[c["dtype"]], "steps": steps, "out_dir": f"{tmp}/out-{i}"}
            (res,) = run_fresh([spec], "cpu", args.timeout or 1200, run=fresh)
            rows.append({**c, **res, "status": res.get("status", "ok")})
            con.print(_line(rows[-1]))
    report.save_results(con, out_dir / f"{report.prefix('gap', args)}.json", "gap", args, env, t0,
                        {"model": shape, "steps": steps, "rows": rows})
    return 1 if any(r["status"] != "ok" for r in rows) else 0


def _line(r: dict) -> str:
    """A configuration's line of the table."""
    if r["status"] != "ok":
        return f"{_short(r['dtype']):<7}{r['label']:<29}{'':<13}{r['replay']:<9}[red]{r.get('reason')}[/red]"
    m = [r.get(k) for k in METRICS]
    gap = f"{m[0]:>9.3g}{m[1]:>9.3g}" if m[0] is not None else f"{'-':>9}{'-':>9}"
    ratio = f"{m[2]:.3g} [{m[3]:.2g}, {m[4]:.2g}]" if m[2] is not None else "-"
    engine = f"{_short(r['vllm_dtype'])} / {_short(r['vllm_head_dtype'])}"
    return (f"{_short(r['dtype']):<7}{r['label']:<29}{engine:<13}{r['replay']:<9}{gap}{ratio:>28}"
            f"{'-' if m[5] is None else format(m[5], '.1f'):>6}{r['step_s']:>8.2f}")


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)
