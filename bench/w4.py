"""W4 (bench/README.md): one GRPO training step, stock ``trl.GRPOTrainer`` vs ``fastrl.GRPOTrainer``, per completion
length, each point in a fresh process; W5 (``bench/w5.py``) is the same point with more configurations and a search.
The shapes per device and mode: ``plan_for``."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench import report
from bench.session_run import append_rows

__all__ = ["W4Shape", "Config", "Plan", "plan_for", "with_overrides", "run_point", "point_spec",
           "spawn_point", "point_row", "add_ratios", "sweep", "print_points", "command", "cli", "TRAINERS"]

TRAINERS = ("trl", "fastrl")
LABELS = {"trl": "stock trl.GRPOTrainer (TRL 1.16 chunked LM head)", "fastrl": "fastrl.GRPOTrainer"}
GIB = 1024.0
# Qwen2.5-0.5B (its config.json): tied embeddings, rope theta 1e6
QWEN25_05B = dict(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, tie_embeddings=True)


@dataclass(frozen=True)
class W4Shape:
    name: str  # "W4", "W4-cpu", "W4-smoke", "W5-0.5B", ...
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tie_embeddings: bool
    dtype: str  # "bfloat16" | "float32" (the model's weights; the trainer's bf16 flag follows it)
    completions: int  # completions per step (B)
    prompt_len: int
    lengths: tuple  # completion lengths T, shortest first
    budget_mb: float = 0.0  # W4's step-memory budget for "longest completion that fits" (W5's are its plan's)
    note: str = ""

    @staticmethod
    def from_dict(d: dict) -> "W4Shape":
        return W4Shape(**{**d, "lengths": tuple(d["lengths"])})


@dataclass(frozen=True)
class Config:
    """A trainer with fastrl's memory options: W4 runs the plain two, W5 every one of its ``CONFIGS``."""
    name: str
    trainer: str  # "trl" | "fastrl"
    activation_offloading: bool = False
    tiled_mlp: int = 0


@dataclass
class Plan:
    """What ``w4`` and ``w5`` measure: shapes (by architecture), configurations, budgets, and how each point runs."""
    device: str
    mode: str
    shapes: dict  # arch name -> W4Shape (its lengths: W4's sweep, the grid W5 searches)
    budgets_mb: tuple
    budget_on: str  # "total" (CUDA W5: weights, grads and activations, what a card must hold) | "extra"
    configs: tuple = tuple(Config(t, t) for t in TRAINERS)
    headline: str = "fastrl+both"  # the fastrl config W5's summary compares with stock TRL
    reps: int = 1
    warmup: int = 1
    warmup_len: int = 0  # 0: run_point's default
    timeout_s: int = 900
    threads: int = 0
    extra_options: dict = field(default_factory=dict)
    log: str = ""  # a file each point's row is appended to as it finishes (a command cut at its limit keeps them)


def plan_for(device: str, mode: str) -> Plan:
    """W4 for this device and mode ("smoke", "quick", "full"): one shape, its budget on the extra step memory, one
    timed step per point on CPU (a step at 2048 tokens takes seconds), three on CUDA."""
    cuda = device.startswith("cuda")
    if mode == "smoke":
        s = W4Shape("W4-smoke", 512, 32, 1, 4, 2, 64, False, "float32", 2, 8, (32,), 64.0,
                    note="smoke test: tiny model, numbers mean nothing")
    elif cuda:
        s = W4Shape("W4", **QWEN25_05B, dtype="bfloat16", completions=8, prompt_len=128,
                    lengths=(4096, 8192) if mode == "quick" else (4096, 8192, 16384), budget_mb=60 * GIB,
                    note="Qwen2.5-0.5B architecture, random init, bf16, 8 completions per step")
    else:
        s = W4Shape("W4-cpu", 151936, 256, 1, 4, 2, 512, False, "float32", 2, 32,
                    (256, 512, 1024) if mode == "quick" else (256, 512, 1024, 2048), budget_mb=2048.0,
                    note="CPU-scaled W4: Qwen2 architecture with Qwen2.5's vocabulary (151936) but H=256, 1 layer, "
                         "float32, 2 completions per step (GPU W4: H=896, 24 layers, bf16, 8 completions of 4k-16k)")
    return Plan(device, mode, {s.name: s}, (s.budget_mb,), "extra", reps=3 if cuda else 1,
                timeout_s=1200 if cuda else 900)


def with_overrides(plan: Plan, args, archs: dict | None = None) -> Plan:
    """The plan with the command line's ``--lengths``, ``--budget-mb``, ``--reps``, ``--warmup``, ``--timeout``,
    ``--threads``, ``--fastrl-backend``; W5's also ``--providers`` (configurations) and ``--workload`` (``archs``:
    architecture -> its shape)."""
    if getattr(args, "providers", None):
        want = report.pick("--providers", args.providers, [c.name for c in plan.configs])
        plan = replace(plan, configs=tuple(c for c in plan.configs if c.name in want))
    if getattr(args, "workload", None):
        want = report.pick("--workload", args.workload, list(archs))
        if plan.mode == "smoke":
            raise SystemExit("w5 --workload: --smoke runs one tiny model; leave --workload out")
        plan = replace(plan, shapes={a: archs[a] for a in want})
    if args.lengths:
        lengths = tuple(sorted({int(x) for x in args.lengths.split(",") if x.strip()}))
        plan = replace(plan, shapes={a: replace(s, lengths=lengths) for a, s in plan.shapes.items()})
    if args.budget_mb:
        plan = replace(plan, budgets_mb=(float(args.budget_mb),))
    given = {"reps": args.reps, "warmup": args.warmup, "timeout_s": args.timeout}
    return replace(plan, threads=args.threads or 0, **{k: v for k, v in given.items() if v is not None},
                   extra_options={"fastrl_backend": args.fastrl_backend} if args.fastrl_backend else {})


# One point, in the measuring process

def _enable_checkpointing(trainer) -> bool:
    """Activation checkpointing as ``Trainer.train`` switches it on (compute_loss alone would run without it); older
    transformers call it gradient checkpointing."""
    args, m = trainer.args, trainer.model
    on = getattr(args, "activation_checkpointing", None)
    if not (on if on is not None else getattr(args, "gradient_checkpointing", False)):
        return False
    kw = dict(getattr(args, "activation_checkpointing_kwargs", None)
              or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    every, offload = kw.pop("every_n_layers", 1), kw.pop("offload", False)
    if hasattr(m, "activation_checkpointing_enable"):
        m.activation_checkpointing_enable(activation_checkpointing_kwargs=kw or None, every_n_layers=every,
                                          offload=offload)
    else:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw or None)
    return True


def _inputs(s: W4Shape, L: int, device, seed: int) -> dict:
    import torch

    g, B = torch.Generator().manual_seed(seed), s.completions
    mask = torch.ones(B, L, dtype=torch.int64)  # every completion token counts
    inp = dict(prompt_ids=torch.randint(3, s.vocab, (B, s.prompt_len), generator=g),
               prompt_mask=torch.ones(B, s.prompt_len, dtype=torch.int64),
               completion_ids=torch.randint(3, s.vocab, (B, L), generator=g), completion_mask=mask,
               advantages=torch.randn(B, generator=g), num_items_in_batch=mask.sum())
    return {k: v.to(device) for k, v in inp.items()}


def _trainer(spec: dict, s: W4Shape, which: str, L: int, cuda: bool):
    """The trainer of one point (``which``: stock TRL or fastrl, fastrl with W5's options) on a fresh random Qwen2."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import fastrl
    from fastrl.testing import tiny_tokenizer

    torch.manual_seed(spec.get("seed", 0))
    cfg = Qwen2Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      max_position_embeddings=max(32768, s.prompt_len + max(s.lengths)), rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=s.tie_embeddings, pad_token_id=0, eos_token_id=1,
                      bos_token_id=2)
    cfg._attn_implementation = "sdpa"  # transformers' default: memory linear in the sequence length
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, s.dtype))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    cls, cfg_cls = (trl.GRPOTrainer, trl.GRPOConfig) if which == "trl" else (fastrl.GRPOTrainer, fastrl.GRPOConfig)
    out_dir = tempfile.mkdtemp(prefix="fastrl-w4-")  # the trainer's (unused) output folder, gone at exit
    atexit.register(shutil.rmtree, out_dir, True)
    kw = dict(output_dir=out_dir, use_cpu=not cuda, bf16=s.dtype == "bfloat16", report_to="none",
              save_strategy="no", logging_strategy="no", per_device_train_batch_size=s.completions,
              num_generations=s.completions, max_completion_length=L, loss_type="dapo", disable_tqdm=True)
    if which == "fastrl":
        kw["health_checks"] = False
        # fastrl's own options (W5: activation_offloading, tiled_mlp); bench-only keys are not config fields
        kw.update({k: v for k, v in spec.get("options", {}).items()
                   if k in ("fastrl_backend", "activation_offloading", "tiled_mlp") and v not in (None, False, 0)})
    # the reward is never called: the step starts from completions and advantages
    trainer = cls(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=cfg_cls(**kw),
                  processing_class=tiny_tokenizer(s.vocab, model_max_length=1 << 16),
                  train_dataset=Dataset.from_dict({"prompt": ["w1"] * s.completions}))
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def run_point(spec: dict) -> dict:
    """Measure one (trainer, completion length) in this fresh process; returns a result dict for the row."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from bench import measure

    s, which, L = W4Shape.from_dict(spec["shape"]), spec["trainer"], int(spec["completion_len"])
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    if cuda and spec.get("cap_mb"):  # a card of that size: a step over it fails here as it would there, at once
        total_mb = torch.cuda.get_device_properties(0).total_memory / measure.MB
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_mb"] / total_mb))
    if not cuda and spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    trainer = _trainer(spec, s, which, L, cuda)
    ckpt, model = _enable_checkpointing(trainer), trainer.model
    model.train()
    memory = getattr(trainer, "_fastrl_memory", None)  # fastrl's long-completion options (fastrl.trainers.memory)
    res: dict = {"status": "ok", "reason": "", "activation_checkpointing": ckpt, "beta": trainer.beta,
                 "model_params": sum(p.numel() for p in model.parameters()), "loss_type": trainer.loss_type,
                 "tiled_mlp": memory.tiled_mlp if memory is not None and memory.applied else 0}

    def step(inputs) -> float:
        # what Trainer.training_step does once the batch exists, in fastrl's step context (offloading) as
        # fastrl.GRPOTrainer.training_step enters it
        with memory.step_context() if memory is not None else contextlib.nullcontext():
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, inputs)
            trainer.accelerator.backward(loss)
        return float(loss.detach())

    # warm-up: CUDA at the measured length (compile, autotune, allocator), CPU short (lazy initialisation)
    warm_len = min(L, int(spec["warmup_len"])) if spec.get("warmup_len") else (L if cuda else min(L, 64))
    where = " in the warm-up step"
    try:
        for _ in range(spec.get("warmup", 1)):
            step(_inputs(s, warm_len, device, 1))
            model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        where = ""
        inputs = _inputs(s, L, device, spec.get("seed", 0))
        t = measure.time_steps(lambda: step(inputs), spec.get("reps", 1), 0, cuda,
                               before=lambda: model.zero_grad(set_to_none=True))
        res.update(step_ms=measure.summarize(t["ms"]), peak_extra_mb=t["extra_mb"], peak_total_mb=t["peak_mb"],
                   baseline_mb=t["base_mb"], loss_value=t["outs"][0])
    except Exception as e:  # noqa: BLE001
        text = str(e).lower()
        if not (isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        res.update(status="oom", reason=f"out of memory{where}: {type(e).__name__}: {first}"[:240])
        if cuda:
            res["peak_total_mb"] = torch.cuda.max_memory_allocated() / measure.MB
        return res
    res.update({
        "path": getattr(trainer, "_fastrl_last_path", "trl") if which == "fastrl" else "trl",
        # TRL's OffloadActivations ran the steps (built at the first one; none on a CPU-only model)
        "activation_offloading": memory is not None and memory.offload_context is not None,
        "memory_method": "torch.cuda.max_memory_allocated() minus allocated before the step" if cuda
        else "peak RSS (VmHWM, reset before the step) minus RSS before the step",
    })
    if cuda:
        res["device_total_mb"] = torch.cuda.get_device_properties(0).total_memory / measure.MB
    return res


# The points, in the parent: W4's sweep here, W5's search in bench/w5.py

def point_spec(s: W4Shape, which: str, L: int, device: str, *, reps: int = 1, warmup: int = 1, threads: int = 0,
               options: dict | None = None, kind: str = "w4", **extra) -> dict:
    """The spec of one point (trainer ``which`` at completion length ``L``)."""
    return {"kind": kind, "shape": asdict(s), "trainer": which, "completion_len": L, "device": device,
            "reps": reps, "warmup": warmup, "threads": threads, "options": options or {}, "seed": 0, **extra}


def spawn_point(spec: dict, timeout_s: int) -> dict:
    """One point in a fresh process (``bench.session_run.run_fresh``); one the kernel killed (SIGKILL) is an ``oom``."""
    from bench.session_run import run_fresh

    (res,) = run_fresh([spec], spec["device"], timeout_s)
    if "exit code -9" in res.get("reason", ""):
        res["status"], res["reason"] = "oom", res["reason"] + " (the kernel's OOM killer, most likely)"
    return res


def point_row(group: str, s: W4Shape, arch: str, c: Config, L, status: str, reason: str = "") -> dict:
    """A row of W4 or W5 (``group``): config ``c`` of ``arch`` (shape ``s``) at completion length ``L``."""
    return {"workload": s.name, "group": group, "kind": "trainer", "arch": arch, "config": c.name,
            "provider": c.trainer, "activation_offloading": c.activation_offloading, "tiled_mlp": c.tiled_mlp,
            "status": status, "reason": reason, "completion_len": L, "completions": s.completions,
            "tokens": s.completions * L if L else None, "prompt_len": s.prompt_len, "V": s.vocab, "H": s.hidden,
            "intermediate": s.intermediate, "layers": s.layers, "dtype": s.dtype, "workload_note": s.note}


def measure_point(plan: Plan, group: str, arch: str, c: Config, L: int, con) -> dict:
    """Config ``c`` of ``arch`` at completion length ``L`` in a fresh process: its row, printed as it comes; an ok
    row says which of the plan's budgets its step memory fits (``fits``)."""
    from rich.markup import escape

    s = plan.shapes[arch]
    options = {**plan.extra_options, "activation_offloading": c.activation_offloading, "tiled_mlp": c.tiled_mlp}
    spec = point_spec(s, c.trainer, L, plan.device, kind=group, options=options, reps=plan.reps,
                      warmup=plan.warmup, threads=plan.threads, warmup_len=plan.warmup_len or None,
                      cap_mb=max(plan.budgets_mb) if plan.budget_on == "total" else None)
    row = {**point_row(group, s, arch, c, L, "error"), "loadavg": os.getloadavg()[0],
           **spawn_point(spec, plan.timeout_s)}
    ran = (row.get("tiled_mlp"), row.get("activation_offloading"))
    if row["status"] == "ok" and c.trainer == "fastrl" and ran != (c.tiled_mlp, c.activation_offloading):
        row["status"], row["reason"] = "error", (f"the worker ran tiled_mlp={ran[0]}, offloading={ran[1]}, not what "
                                                 f"{c.name} asks for")
    head = f"{s.name:>12} {c.name:<15} {L:>7} tokens"
    if row["status"] == "ok":
        row["fits"] = {f"{b:.0f}": row[f"peak_{plan.budget_on}_mb"] <= b for b in plan.budgets_mb}
        con.print(f"{head} {row['step_ms']['median']:10.0f} ms {row['peak_extra_mb']:9.1f} MB extra "
                  f"{row['peak_total_mb']:9.1f} MB peak")
    else:
        style = "red" if row["status"] == "error" else "dim"
        con.print(f"[{style}]{head} {row['status']}: {escape(row['reason'])}[/{style}]")
    if plan.log:
        append_rows(Path(plan.log), [row])
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each measured fastrl row's step time and extra memory against stock TRL's at the same shape and length."""
    report.add_ratios(rows, "trl", lambda r: r["config"] == "trl", key=lambda r: (r["workload"], r["completion_len"]),
                      ms=lambda r: (r.get("step_ms") or {}).get("median"), where=lambda r: r["provider"] != "trl")


def sweep(plan: Plan, con) -> list[dict]:
    """W4: every (completion length, trainer) of the plan's one shape, shortest first; a trainer that ran out of
    memory or failed is not tried at longer completions."""
    ((arch, s),), (budget,) = plan.shapes.items(), plan.budgets_mb
    rows: list[dict] = []
    failed: dict[str, int] = {}  # trainer -> the length at which it ran out of memory / failed
    for L in s.lengths:
        for c in plan.configs:
            if c.name in failed:
                why = f"not tried: failed already at {failed[c.name]} tokens"
                rows.append(point_row("w4", s, arch, c, L, "skipped", why))
                continue
            rows.append(measure_point(plan, "w4", arch, c, L, con))
            if rows[-1]["status"] == "ok":
                rows[-1]["fits_budget"] = rows[-1].pop("fits")[f"{budget:.0f}"]
            else:
                failed[c.name] = L
    for r in rows:
        r.update(label=LABELS[r["provider"]], budget_mb=budget)
    add_ratios(rows)
    return rows


def _step_ms(r: dict) -> str:
    sm = r["step_ms"]
    return f"{sm['median']:.0f}" + (f" [{sm['min']:.0f}-{sm['max']:.0f}]" if sm.get("n", 1) > 1 else "")


def print_points(con, rows: list[dict], title: str, plan: Plan, by=("completion_len",)) -> None:
    """One line per measured point (``report.print_table``), a section per value of ``by``, a "fits" column per budget
    of the plan; then the points that did not run or ran out of memory, one line per reason."""
    cell = report.cell
    fits = tuple((f"fits {b:.0f}", "right", lambda r, b=b: "yes" if r[f"peak_{plan.budget_on}_mb"] <= b else "no")
                 for b in plan.budgets_mb)
    columns = (("shape", "left", cell("arch", "")), ("config", "left", cell("config", "")),
               ("completion", "right", lambda r: f"{r['completions']} x {r['completion_len']}"),
               ("step ms", "right", _step_ms), ("extra MB", "right", cell("peak_extra_mb", ".1f")),
               ("peak MB", "right", cell("peak_total_mb", ".1f")), ("t/trl", "right", cell("time_vs_trl", ".2f")),
               ("m/trl", "right", cell("mem_vs_trl", ".3f")), *fits, ("path", "left", cell("path", "")),
               ("loss", "right", cell("loss_value", "+.5f")))
    legend = (f"step ms: median (min-max); extra / peak MB: the step's peak over what it began with / in all; t/, m/: "
              f"time and extra memory against stock TRL at the same length; fits: {plan.budget_on} step memory "
              "within the budget (MB)")
    shown = [{**r, "provider": r["config"], "workload": f"{r['workload']} x {r['completion_len'] or '-'}"}
             for r in rows]  # the points that did not run: by config and length
    report.print_table(con, shown, title, columns, legend, section=lambda r: tuple(r[k] for k in by))


def _report(plan: Plan, rows: list[dict], con, title: str, elapsed: float) -> dict:
    """W4's table, its longest fitting completion per trainer, and its JSON (``"w4"``: the summary and rows)."""
    (s,), budget = plan.shapes.values(), plan.budgets_mb[0]
    print_points(con, rows, title, plan)
    longest = {}
    for which in TRAINERS:
        v = longest[which] = max((r["completion_len"] for r in rows if r["provider"] == which and r.get("fits_budget")),
                                 default=None)
        con.print(f"W4 longest completion within {budget:.0f} MB of step memory ({s.completions} completions), "
                  f"{which}: {v if v is not None else 'none of ' + ', '.join(map(str, s.lengths))}"
                  + (" (the longest tried)" if v == max(s.lengths) else ""))
    return {"w4": {"shape": asdict(replace(s, budget_mb=budget)), "budget_mb": budget, "longest_fitting": longest,
                   "reps": plan.reps, "loadavg_max": max((r["loadavg"] for r in rows if "loadavg" in r), default=None),
                   "warmup": plan.warmup, "elapsed_s": elapsed, "rows": rows}}


# one CSV for W4 and W5: a row per point, the JSON holds the rest
CSV_COLUMNS = ["workload", "arch", "config", "provider", "activation_offloading", "tiled_mlp", "status", "reason",
               "completion_len", "completions", "tokens", "prompt_len", "V", "H", "intermediate", "layers", "dtype",
               "step_ms_median", "step_ms_min", "step_ms_max", "step_ms_n", "peak_extra_mb", "peak_total_mb",
               "baseline_mb", "time_vs_trl", "mem_vs_trl", "budget_mb", "fits_budget", "loss_value", "path",
               "activation_checkpointing", "model_params", "device", "torch", "driver"]


def command(name: str, args, device: str, con, plan: Plan, measure, report_rows, archs: dict | None = None) -> int:
    """``python -m bench w4`` / ``w5``: the plan with the command line's overrides, ``measure(plan, con)`` -> rows,
    ``report_rows(plan, rows, con, title, elapsed)`` -> the JSON's own fields (it prints the tables), then
    ``<prefix>.json`` and ``<prefix>.csv``."""
    env, mode = report.environment(device), report.mode(args)
    out_dir, prefix = report.out_dir(args, env["device_slug"], name), report.prefix(name, args)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = replace(with_overrides(plan, args, archs), log=str(out_dir / f"{prefix}.rows.jsonl"))
    con.print(f"[bold]fastrl bench {name}[/bold] ({mode}) on {env['device']}: torch {env['torch']}, triton "
              f"{env['triton']}, driver {env['driver']}; architectures {', '.join(plan.shapes)}, configs "
              f"{', '.join(c.name for c in plan.configs)}; each point in a fresh process")
    t0 = time.perf_counter()
    for s in plan.shapes.values():
        con.print(f"[bold]{s.name}[/bold]: {s.note}; V={s.vocab} H={s.hidden} I={s.intermediate} layers={s.layers}, "
                  f"{s.completions} completions x {', '.join(map(str, s.lengths))} tokens (+{s.prompt_len} prompt); "
                  "budgets " + ", ".join(f"{b:.0f} MB" for b in plan.budgets_mb) + f" ({plan.budget_on} step memory)")
    rows = measure(plan, con)
    elapsed = time.perf_counter() - t0
    steps = f"median of {plan.reps} timed steps" if plan.reps > 1 else "one timed step"
    con.print()
    fields = report_rows(plan, rows, con, f"{name.upper()} ({mode}): one GRPO training step (compute_loss + backward) "
                         f"per point | {env['device']} | torch {env['torch']} | driver {env['driver']} | step ms: "
                         f"{steps} after a warm-up", elapsed)
    written = [report.write_csv(out_dir / f"{prefix}.csv", rows, env, CSV_COLUMNS, nested=("step_ms",))]
    report.save_results(con, out_dir / f"{prefix}.json", name, args, env, t0, {"mode": mode, **fields}, written)
    return 1 if args.smoke and any(r["status"] == "error" for r in rows) else 0


def cli(args, device: str, con) -> int:
    """``python -m bench w4`` (``bench/__main__.py`` parses the shared options and ``--lengths``, ``--budget-mb``)."""
    return command("w4", args, device, con, plan_for(device, report.mode(args)), sweep, _report)
