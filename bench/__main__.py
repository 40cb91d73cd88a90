"""``python -m bench [COMMAND] [options]``: the benchmark CLI (bench/README.md says what each command measures).

    python -m bench --quick              CPU-sized workloads and sweeps, a few minutes on 2 cores
    python -m bench                      everything for this device (GPU sizes on CUDA, CPU sizes otherwise)
    python -m bench COMMAND --help       that command's options (the commands are listed below)

Results go to --out (default: a new folder under $FASTRL_BENCH_OUT or the system's temporary folder).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from bench import providers as P
from bench import divergence, lmhead, report, w4, w5
from bench import workloads as W

C1_PROVIDERS = "fastrl,fastrl-fused,torch,trl,liger-fused"
# the CPU targets: workload -> (provider, max time ratio, max extra-peak ratio), against torch in the same run
C1_TARGETS = {"C1": ("fastrl", 1.1, 0.10), "C1-loss": ("fastrl-fused", 1.0, 0.10)}
# what --quick on CPU trims to stay within a few minutes on 2 cores
QUICK_ONLY_ON = {
    "torch-compile": (("C1-quick",), "inductor compiles every shape afresh, tens of seconds each on CPU"),
    "trl": (("core",), "each TRL process pays ~5 s of imports at its first backward; sweeps use fastrl vs torch"),
}
SWEEP_X = {"sweep-tokens": "tokens N", "sweep-vocab": "vocabulary V", "sweep-hidden": "hidden size H"}
SMOKE_LEAVE_OUT = {"torch-compile": "left out by --smoke: compiling alone takes longer than the whole smoke run"}
# Options, as (flag, argparse keywords) by group; each command takes its groups (or a module's add_options)
RUN = (  # every measuring command
    ("--quick", {"action": "store_true", "help": "smaller shapes and fewer points (CPU: a few minutes)"}),
    ("--smoke", {"action": "store_true", "help": "tiny shapes, one repetition: checks the plumbing only"}),
    ("--out", {"help": "results folder (default: a new one under $FASTRL_BENCH_OUT or the system's temporary folder)"}),
    ("--device", {"choices": ("cpu", "cuda"), "help": "default: cuda when available"}),
    ("--reps", {"type": int, "help": "timed repetitions per measurement on CPU (default 3; smoke 1)"}),
    ("--warmup", {"type": int, "help": "untimed steps before timing (default 1; smoke 0)"}),
    ("--timeout", {"type": int, "help": "seconds per measuring process"}),
    ("--threads", {"type": int, "default": 0, "help": "CPU threads per worker (default: torch's)"}),
    ("--fastrl-backend", {"choices": ("triton", "triton-hybrid", "triton-fused", "torch"), "help": "force it"}),
    ("--no-plots", {"action": "store_true", "help": "write JSON and CSV only"}),
)
WORKLOADS = (  # the commands that measure workloads x providers
    ("--workload", {"help": "comma list: names (W1, C1, tokens-4096), 'W1' also picks W1-lp; groups core, sweeps, "
                            "sweep-tokens, sweep-vocab, sweep-hidden"}),
    ("--providers", {"help": f"comma list of {', '.join(P.PROVIDERS)} (default: all; c1: {C1_PROVIDERS})"}),
    ("--sets", {"type": int, "help": "input sets rotated through the repetitions (CPU 2, CUDA 3)"}),
)
W4_OPTIONS = (
    ("--lengths", {"help": "W4: comma list of completion lengths (default: by device and mode)"}),
    ("--budget-mb", {"type": float, "help": "W4: step-memory budget in MB for 'longest that fits'"}),
)
W5_OPTIONS = (
    ("--workload", {"help": "W5: comma list of architectures (0.5B,1.5B; default both)"}),
    ("--providers", {"help": "W5: comma list of configurations: trl, fastrl, fastrl+offload, fastrl+tiled, "
                             "fastrl+both (default all)"}),
    ("--lengths", {"help": "W5: comma list of completion lengths to search (default: by device and mode)"}),
    ("--budget-mb", {"type": float, "help": "W5: one step-memory budget in MB (default: 24 and 80 GiB on CUDA)"}),
)
DIVERGENCE = (
    ("--beta", {"help": "comma list of betas (default 0,0.5,1)"}),
    ("--tokens", {"type": int, "help": "tokens N (default: by device; results go to divergence-nN.json)"}),
    ("--providers", {"help": f"comma list of {', '.join(divergence.PROVIDERS)} (default all)"}),
)
SASS = (  # here: bench/sass.py refuses to import under TRITON_INTERPRET
    ("--arch", {"type": int, "default": 90, "help": "compute capability x 10 (default 90: H100 / H200)"}),
    ("--only", {"help": "only kernels whose name contains this"}),
)
TARGETS = (("paths", {"nargs": "+", "help": "session*.json files or folders holding them"}),)
# what a command that does not take a measuring option reads for it
_UNSET = {flag.lstrip("-").replace("-", "_"): kw.get("default", False if kw.get("action") == "store_true" else None)
          for flag, kw in RUN + WORKLOADS + W4_OPTIONS}


@dataclass(frozen=True)
class Command:
    name: str
    summary: str  # its line in `python -m bench --help`, and the head of `python -m bench NAME --help`
    options: tuple  # option groups: (flag, keywords) tuples, or a function that adds its own
    run: Callable[[argparse.Namespace, str, object], int]  # (args, device, console) -> exit status


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", title="commands", metavar="COMMAND",
                            help="what to measure (default: run); `python -m bench COMMAND --help` lists its options")
    for c in COMMANDS.values():
        sp = sub.add_parser(c.name, help=c.summary, description=f"{c.summary}; bench/README.md says more.")
        for group in c.options:
            if callable(group):
                group(sp)
            else:
                for flag, kw in group:
                    sp.add_argument(flag, **kw)
    return ap


def _parse(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; no command (``python -m bench --quick``) means ``run``."""
    ap = _parser()
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    args, extra = ap.parse_known_args(argv)
    misplaced = [a for a in extra if a in COMMANDS]
    if misplaced:
        ap.error(f"the command comes first: python -m bench {misplaced[0]} [options] (got: {' '.join(argv[1:])})")
    if extra:
        ap.error(f"unrecognized arguments for `{args.command}`: {' '.join(extra)} "
                 f"(python -m bench {args.command} --help lists its options)")
    for name, unset in _UNSET.items():
        setattr(args, name, getattr(args, name, unset))
    return args


def _config(args, device: str) -> lmhead.RunConfig:
    cfg = lmhead.RunConfig(command=args.command, device=device, mode=report.mode(args), threads=args.threads)
    if device == "cuda":
        cfg = replace(cfg, warmup=2, n_sets=3, rep_ms=500 if args.quick else 2000, timeout_s=1200,
                      floor_shape=(8192, 8192, 8192))
    else:  # Liger compiles its per-chunk loss for CUDA; on CPU that recompiles per shape and dominates the time
        cfg = replace(cfg, options={"liger_compiled": False})
        if args.quick and args.command == "run":
            cfg = replace(cfg, timeout_s=600, only_on=dict(QUICK_ONLY_ON))
    if args.smoke:
        cfg = replace(cfg, reps=1, warmup=0, n_sets=1, accuracy_rows=16, rep_ms=50, timeout_s=300,
                      floor_shape=(256, 256, 256), leave_out=dict(SMOKE_LEAVE_OUT), only_on={},
                      options={"liger_compiled": False})
    if args.command == "c1":  # C1 is about the CPU path, named explicitly
        cfg.options = {**cfg.options, "fastrl_backend": "torch"}
    for option, field in (("reps", "reps"), ("warmup", "warmup"), ("sets", "n_sets"), ("timeout", "timeout_s")):
        if getattr(args, option) is not None:
            setattr(cfg, field, getattr(args, option))
    if args.fastrl_backend:
        cfg.options = {**cfg.options, "fastrl_backend": args.fastrl_backend}
    return cfg


def _is_w4(key: str) -> bool:
    return key.strip().lower().split("-")[0] == "w4"


def _workloads(args, device: str) -> list[W.Workload]:
    if args.command == "c1":
        wls = [W.tiny(w) for w in (W.C1, W.C1_LOSS)] if args.smoke else [W.C1, W.C1_LOSS]
    elif args.smoke:
        wls = W.smoke_workloads()
    else:
        wls = W.gpu_workloads() if device == "cuda" else W.cpu_workloads(args.quick)
    # W4 is measured apart: --workload W4 alone measures no rows here
    keys = [k for k in (args.workload or "").split(",") if k.strip() and not _is_w4(k)]
    if args.workload and not keys:
        return []
    return W.select(wls, ",".join(keys) if args.workload else None)


def _want_w4(args) -> bool:
    """Whether this command measures W4 too: `w4`, and `run` (full; --quick and --smoke when --workload names it)."""
    if args.command != "run":
        return args.command == "w4"
    if args.workload:
        return any(_is_w4(k) for k in args.workload.split(","))
    return not args.smoke and not args.quick


def _find(rows: list[dict], workload: str, provider: str) -> dict | None:
    return next((r for r in rows if r["workload"] == workload and r["provider"] == provider and r["status"] == "ok"),
                None)


def _judge(con, what: str, value, limit: float, why: str, unit: Callable = lambda v: f"{v:.2f}x") -> bool:
    """Print one target's verdict (or why it was not evaluated); whether it passed."""
    if value is None:
        con.print(f"[yellow]{what}: not evaluated ({why}); target <= {limit:.2f}[/yellow]")
        return False
    ok = value <= limit
    verdict = "[green]PASS[/green]" if ok else "[red]FAIL[/red]"
    con.print(f"{what} = {unit(value)} (target <= {unit(limit)}): {verdict}")
    return ok


def _c1_targets(rows: list[dict], con) -> dict:
    """C1_TARGETS per workload: time and extra peak memory as ratios of torch's in the same run."""
    out = {}
    for wl in dict.fromkeys(r["workload"] for r in rows if r["workload"].removesuffix("-smoke") in C1_TARGETS):
        prov, t_max, m_max = C1_TARGETS[wl.removesuffix("-smoke")]
        fr, tr = _find(rows, wl, prov), _find(rows, wl, "torch")
        if fr is None or tr is None:
            con.print(f"[red]{wl} targets: cannot evaluate ({prov} or torch did not run)[/red]")
            out[wl] = {"provider": prov, "evaluated": False}
            continue
        if fr["kind"] == "loss":  # no float64 check for the loss workloads: at least the providers agree on the value
            vals = {r["provider"]: r["loss_value"] for r in rows
                    if r["workload"] == wl and r["status"] == "ok" and "loss_value" in r}
            con.print(f"{wl} loss values: " + ", ".join(f"{p} {v:+.6f}" + (
                f" (|d| {abs(v - vals['torch']):.1e})" if p != "torch" else "") for p, v in vals.items())
                + ("; liger has no entropy term" if "liger-fused" in vals else ""))
        mem, tim = fr.get("mem_vs_torch"), fr.get("time_vs_torch")
        mem_ok = _judge(con, f"{wl} target, {prov} extra peak RSS", mem, m_max, "no ratio",
                        lambda v: f"{100 * v:.1f}% of torch's")
        time_ok = _judge(con, f"{wl} target, {prov} fwd+bwd time", tim, t_max, "no ratio",
                         lambda v: f"{v:.2f}x torch's")
        res = out[wl] = {"provider": prov, "evaluated": True, "mem_ratio": mem, "mem_target": m_max, "mem_pass": mem_ok,
                         "time_ratio": tim, "time_target": t_max, "time_pass": time_ok}
        # a fresh process's first step (lazy imports included), reported next to the targets, not judged by them
        if fr.get("first_step_ms") and tr.get("first_step_ms"):
            res["first_step_time_ratio"] = fr["first_step_ms"] / tr["first_step_ms"]
            res["first_step_extra_mb"] = fr["first_step_extra_mb"]
            con.print(f"{wl} first step of a fresh process, {prov}: {fr['first_step_ms']:.0f} ms "
                      f"({res['first_step_time_ratio']:.2f}x torch's {tr['first_step_ms']:.0f} ms), "
                      f"{fr['first_step_extra_mb']:.0f} MB extra peak RSS (torch {tr['first_step_extra_mb']:.0f} MB)")
    return out


def _targets_command(args, device: str, con) -> int:
    """The session's targets over the session files of several calls (e.g. bench/gpu_session.sh's), ratios within
    each file."""
    from bench.session_report import add_ratios, targets

    paths = [Path(p) for p in args.paths]
    files = [f for p in paths for f in (sorted(p.rglob("session*.json")) if p.is_dir() else [p])]
    missing = [str(p) for p in paths if not p.exists()]
    if missing or not files:
        con.print(f"[red]no session*.json at {', '.join(missing or args.paths)}[/red]")
        return 2
    for f in files:
        data = json.loads(f.read_text())
        add_ratios(data["rows"])
        env = data["env"]
        con.print(f"[bold]{f}[/bold] ({env.get('device')}, fastrl {str(env.get('fastrl_commit'))[:10]})")
        targets(data["rows"], con, smoke=data.get("smoke", False))
    return 0


def _measure_w4(args, device: str, cfg, con) -> tuple[list, dict]:
    """W4 in `run` and `w4`: its rows and its summary (with its seconds)."""
    shape = w4.with_overrides(w4.shape_for(device, cfg.mode), args.lengths, args.budget_mb)
    t1 = time.perf_counter()
    # one timed step per point on CPU (a step at 2048 tokens takes seconds), three on CUDA
    rows, summary = w4.run(
        shape, device, con, reps=args.reps or (3 if device == "cuda" else 1),
        warmup=args.warmup if args.warmup is not None else 1,
        timeout_s=args.timeout or (1200 if device == "cuda" else 900), threads=cfg.threads, options=cfg.options)
    summary["elapsed_s"] = time.perf_counter() - t1
    return rows, summary


def _plots(rows: list[dict], out_dir: Path, prefix: str, env: dict) -> list[Path]:
    """A PNG per sweep: time and extra memory against the swept size, a line per provider."""
    panels = (("time, ms (median)", lambda r: r["total_ms"]["median"]), ("peak extra memory, MB", "peak_extra_mb"))
    written = []
    for group in sorted({r["group"] for r in rows if r["group"].startswith("sweep")}):
        written += report.plot([r for r in rows if r["group"] == group], out_dir / f"{prefix}-{group}.png",
                               f"{group} | {env['device']} | torch {env['torch']}",
                               (SWEEP_X.get(group, "tokens N"), "sweep_value"), panels)
    return written


def _w4_summary(cfg, env, rows, summary, con) -> None:
    s, reps = w4.W4Shape.from_dict(summary["shape"]), summary["reps"]
    steps = f"median of {reps} timed steps" if reps > 1 else "one timed step"
    w4.print_table(con, rows, summary, f"{s.name} ({cfg.mode}): one GRPO training step (compute_loss + backward), "
                   f"V={s.vocab} H={s.hidden} layers={s.layers} {s.dtype} | {env['device']} | torch {env['torch']} | "
                   f"driver {env['driver']} | step ms: {steps} after a warm-up")


def _measure(args, device: str, con) -> int:
    """run, c1, w4: measure, print the summary last, write the files."""
    cfg, want_w4 = _config(args, device), _want_w4(args)
    wls = [] if args.command == "w4" else _workloads(args, device)
    provs = P.select(args.providers or (C1_PROVIDERS if args.command == "c1" else None))
    env = report.environment(device)
    out_dir, prefix = report.out_dir(args, env["device_slug"], args.command), report.prefix(args.command, args)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.rows_log = str(out_dir / f"{prefix}.rows.jsonl")
    Path(cfg.rows_log).unlink(missing_ok=True)
    what = f"{len(wls)} workloads x {len(provs)} providers" if wls else "W4 only"
    con.print(f"[bold]fastrl bench {args.command}[/bold] ({cfg.mode}) on {env['device']}: torch {env['torch']}, "
              f"triton {env['triton']}, driver {env['driver']}; {what}{' + W4' if wls and want_w4 else ''}, "
              f"each measurement in a fresh process")
    scaled = [w for w in wls if "scaled down" in w.note or "quick" in w.note]
    if scaled:
        con.print(f"[yellow]{len(scaled)} workloads use CPU-scaled shapes (see each row's N/H/V; the GPU sizes "
                  f"are in docs/design.md)[/yellow]")
    t0 = time.perf_counter()
    rows, info = lmhead.run(wls, provs, cfg, con) if wls else ([], {"floor_tflops": {}})
    w4_rows, w4_sum = _measure_w4(args, device, cfg, con) if want_w4 else ([], None)
    elapsed = time.perf_counter() - t0
    payload = {"command": args.command, "mode": cfg.mode, "argv": args.argv, "env": env, "config": asdict(cfg),
               **info, "elapsed_s": elapsed, "workloads": [w.to_dict() for w in wls], "rows": rows,
               **({"w4": {**w4_sum, "rows": w4_rows}} if want_w4 else {})}
    plots = [] if args.no_plots else _plots(rows, out_dir, prefix, env)
    written = []
    con.print()  # the summary is printed last
    if rows:
        report.print_table(con, rows, f"{args.command} ({cfg.mode}) on {env['device']} | torch {env['torch']} | triton "
                           f"{env['triton']} | driver {env['driver']} | ms: median of "
                           f"{cfg.reps if cfg.device == 'cpu' else 'do_bench'} runs")
        for dt, f in info["floor_tflops"].items():
            con.print(f"matmul floor ({dt}, {'x'.join(map(str, cfg.floor_shape))}), measured in this run: "
                      f"{f:.3f} TFLOP/s; '% floor' = (6NHV / floor) / time (2NHV for forward-only)")
        if args.command == "c1":
            payload["targets"] = _c1_targets(rows, con)
        written.append(report.write_csv(out_dir / f"{prefix}.csv", rows, env))
    if want_w4:
        if rows:
            con.print()
        _w4_summary(cfg, env, w4_rows, w4_sum, con)
        w4_prefix = prefix if args.command == "w4" else f"{prefix}-w4"
        written += w4.write_files(out_dir, w4_prefix, w4_rows, env)
    report.save_results(con, out_dir / f"{prefix}.json", payload, elapsed, written + plots)
    return 1 if args.smoke and any(r["status"] == "error" for r in rows + w4_rows) else 0


def _lazy(module: str, name: str, device: bool = True) -> Callable:
    """``bench.<module>.<name>``, imported when called: options (``add_options(ap)``) or a command (``command(args,
    device, con)``; ``device=False``: ``command(args, con)``) of a module the CLI does not import up front."""
    def call(*a):
        import importlib

        fn = getattr(importlib.import_module(f"bench.{module}"), name)
        return fn(*a) if device or len(a) == 1 else fn(a[0], a[2])
    return call


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    args.argv = argv  # recorded with the results
    con = report.console()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        con.print("[red]--device cuda: no CUDA device here[/red]")
        return 2
    return COMMANDS[args.command].run(args, device, con)


# A new command: an option function for what only it takes, a handler (args, device, console) -> exit status, and a
# Command below; `python -m bench NAME --help` and the command list follow. bench/README.md says what each measures.
_MEASURE = (RUN, WORKLOADS)
COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("run", "every workload for this device (the default command: `python -m bench --quick` is `run --quick`)",
            (*_MEASURE, W4_OPTIONS), _measure),
    Command("c1", "C1 and C1-loss on CPU against the CPU targets (time and extra peak memory vs torch)", _MEASURE,
            _measure),
    Command("w4", "W4: one GRPOTrainer step, stock TRL vs fastrl, per completion length", (RUN, W4_OPTIONS),
            _measure),
    Command("w5", "W5: the longest completion whose GRPO step fits a memory budget, per trainer and option set",
            (RUN, W5_OPTIONS), w5.cli),
    Command("keptset", "the LM head over a kept set (K = 20, 64, 512) vs the full vocabulary", (RUN,),
            _lazy("keptset", "cli")),
    Command("divergence", "student vs teacher head: fused_divergence vs TRL, LigerFusedLinearJSD and torch, beta "
            "0/0.5/1", (RUN, DIVERGENCE), divergence.cli),
    Command("gap", "the vLLM-trainer log-prob gap: TRL, fastrl, fastrl + vLLM float32 head; replay off and on (needs "
            "vLLM: the python `bash .ci/vllm-env.sh` prints)", (RUN, _lazy("gap", "add_options")),
            _lazy("gap", "command")),
    Command("compile", "a training step with fastrl inside torch.compile vs eager vs the compiled reference",
            (_lazy("compiled_step", "add_options"),), _lazy("compiled_step", "command")),
    Command("targets", "the session's targets over the session files of several calls", (TARGETS,),
            _targets_command),
    Command("session", "everything a GPU window measures, in one command sized to a time budget",
            (_lazy("session", "add_options"),), _lazy("session", "command")),
    Command("defaults", "the measured defaults table (kernels/_defaults.py) from committed session results",
            (_lazy("defaults", "add_options"),), _lazy("defaults", "command", device=False)),
    Command("sass", "compile every kernel for sm_90 without a GPU; fail on spills or missing HGMMA", (SASS,),
            _lazy("sass", "command", device=False)),
    Command("roofline", "the FLOPs and HBM bytes of every implementation per workload, and the time they imply at "
            "700 TFLOP/s and 4.3 TB/s", (_lazy("roofline", "add_options"),),
            _lazy("roofline", "command", device=False)),
)}

if __name__ == "__main__":
    sys.exit(main())
