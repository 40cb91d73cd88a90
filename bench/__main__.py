"""``python -m bench [run|c1|gpu|list]``: the benchmark CLI (see bench/README.md).

    python -m bench --quick              CPU-sized workloads and sweeps, a few minutes on 2 cores
    python -m bench c1                   DESIGN.md's C1 on CPU: fastrl vs materialised torch vs TRL, with targets
    python -m bench gpu                  W1-W3 at full size, every provider (for the H100)
    python -m bench                      everything for this device (GPU sizes on CUDA, CPU sizes otherwise)
    python -m bench list                 workloads and providers, and why a provider cannot run here

Every measurement runs in a fresh process (``bench.worker``); the summary table is printed last and the
rows are written as JSON and CSV, with PNG plots, under ``--out`` (default ``bench/results/<device>/``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench import providers as P
from bench import report, runner
from bench import workloads as W

COMMANDS = ("run", "c1", "gpu", "list")
C1_PROVIDERS = "fastrl,torch,trl"
GPU_WORKLOADS = ("W1", "W1-lp", "W2", "W2-lp", "W3")
# what --quick on CPU trims to stay within a few minutes on 2 cores
QUICK_ONLY_ON = {
    "torch-compile": (("C1-quick",), "inductor compiles every shape afresh, tens of seconds each on CPU"),
    "trl": (("core",), "each TRL process pays ~5 s of imports at its first backward; sweeps use fastrl vs torch"),
}
SMOKE_LEAVE_OUT = {"torch-compile": "left out by --smoke: compiling alone takes longer than the whole smoke run"}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs="?", default="run", choices=COMMANDS)
    ap.add_argument("--quick", action="store_true", help="smaller shapes and fewer points (CPU: a few minutes)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one repetition: checks the plumbing only")
    ap.add_argument("--out", help="results folder (default bench/results/<device-slug>/)")
    ap.add_argument("--workload", help="comma list: names (W1, C1, tokens-4096), 'W1' also picks W1-lp; "
                                       "groups core, sweeps, sweep-tokens, sweep-vocab, sweep-hidden")
    ap.add_argument("--providers", help=f"comma list of {', '.join(P.PROVIDERS)} (default: all; c1: {C1_PROVIDERS})")
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    ap.add_argument("--reps", type=int, help="timed repetitions per measurement on CPU (default 3; smoke 1)")
    ap.add_argument("--warmup", type=int, help="untimed steps before timing (default 1; smoke 0)")
    ap.add_argument("--sets", type=int, help="input sets rotated through the repetitions (CPU 2, CUDA 3)")
    ap.add_argument("--timeout", type=int, help="seconds per measuring process")
    ap.add_argument("--jobs", type=int, help="measuring processes at once (default 1; --smoke 2): "
                                             "above 1 they share the cores, so times are not comparable")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads per worker (default: torch's)")
    ap.add_argument("--fastrl-backend", choices=("triton", "torch"), help="force fastrl's backend")
    ap.add_argument("--no-plots", action="store_true")
    return ap


def _config(args, device: str) -> runner.RunConfig:
    cuda = device == "cuda"
    cfg = runner.RunConfig(command=args.command, device=device)
    if cuda:
        cfg = replace(cfg, warmup=2, n_sets=3, rep_ms=500 if args.quick else 2000, timeout_s=1200,
                      floor_shape=(8192, 8192, 8192))
    else:
        # Liger compiles its per-chunk loss for CUDA; on CPU that recompiles per shape and dominates the time
        cfg = replace(cfg, options={"liger_compiled": False})
        if args.quick and args.command == "run":
            cfg = replace(cfg, timeout_s=600, only_on=dict(QUICK_ONLY_ON))
    if args.smoke:
        cfg = replace(cfg, reps=1, warmup=0, n_sets=1, accuracy_rows=16, rep_ms=50, timeout_s=300,
                      floor_shape=(256, 256, 256), leave_out=dict(SMOKE_LEAVE_OUT), only_on={},
                      options={"liger_compiled": False}, jobs=2)
    if args.command == "c1":
        cfg.options = {**cfg.options, "fastrl_backend": "torch"}  # C1 is about the CPU path, named explicitly
    cfg.mode = "smoke" if args.smoke else ("quick" if args.quick else "full")
    for a, f in (("reps", "reps"), ("warmup", "warmup"), ("sets", "n_sets"), ("timeout", "timeout_s"), ("jobs", "jobs")):
        if getattr(args, a) is not None:
            setattr(cfg, f, getattr(args, a))
    cfg.threads = args.threads
    if args.fastrl_backend:
        cfg.options = {**cfg.options, "fastrl_backend": args.fastrl_backend}
    return cfg


def _workloads(args, device: str) -> list[W.Workload]:
    if args.command == "c1":
        wls = [W.C1]
    elif args.command == "gpu":
        wls = [w for w in W.gpu_workloads() if w.name in GPU_WORKLOADS]
    elif args.smoke:
        wls = W.smoke_workloads()
    else:
        wls = W.gpu_workloads() if device == "cuda" else W.cpu_workloads(args.quick)
    if args.smoke and args.command != "run":
        wls = [W.tiny(w) for w in wls]
    return W.select(wls, args.workload)


def _list(device: str, con) -> int:
    con.print(f"[bold]device[/bold]: {report.device_name(device)}")
    for title, wls in (("GPU workloads", W.gpu_workloads()), ("CPU workloads (--quick)", W.cpu_workloads(True)),
                       ("CPU workloads", W.cpu_workloads(False))):
        con.print(f"\n[bold]{title}[/bold]")
        for w in wls:
            shape = "" if w.kind == "trainer" else f"N={w.N} H={w.H} V={w.V} {w.dtype}"
            con.print(f"  {w.name:<14} {w.kind:<8} {shape:<36} {w.note}")
    con.print("\n[bold]providers[/bold] (on this device, C1 / W1 at CPU size / W3)")
    probe = [W.C1] + [w for w in W.cpu_workloads(True) if w.name in ("W1", "W3")]
    for p in P.PROVIDERS.values():
        why = [p.unavailable(w, device) for w in probe]
        txt = "; ".join(f"{w.kind}: {y[0]} ({y[1]})" if y else f"{w.kind}: runs" for w, y in zip(probe, why))
        con.print(f"  {p.name:<14} {p.label}\n  {'':<14} [dim]{txt}[/dim]")
    return 0


def _c1_targets(rows: list[dict], con) -> dict:
    """C1's acceptance targets (core issue): fastrl extra peak memory <= 10% of torch's, time <= 1.2x torch's."""
    fr = next((r for r in rows if r["provider"] == "fastrl" and r["status"] == "ok"), None)
    tr = next((r for r in rows if r["provider"] == "torch" and r["status"] == "ok"), None)
    if fr is None or tr is None:
        con.print("[red]C1 targets: cannot evaluate (fastrl or torch did not run)[/red]")
        return {}
    mem, tim = fr.get("mem_vs_torch"), fr.get("time_vs_torch")
    out = {"mem_ratio": mem, "mem_target": 0.10, "mem_pass": mem is not None and mem <= 0.10,
           "time_ratio": tim, "time_target": 1.2, "time_pass": tim is not None and tim <= 1.2}
    for what, r, tgt, ok, unit in (
        ("extra peak RSS", mem, "<= 10% of torch's", out["mem_pass"], f"{100 * mem:.1f}% of torch's" if mem else "?"),
        ("fwd+bwd time", tim, "<= 1.2x torch's", out["time_pass"], f"{tim:.2f}x torch's" if tim else "?"),
    ):
        verdict = "[green]PASS[/green]" if ok else "[red]FAIL[/red]"
        con.print(f"C1 target, fastrl {what}: {unit} (target {tgt}): {verdict}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    con = report.console()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        con.print("[red]--device cuda: no CUDA device here[/red]")
        return 2
    if args.command == "list":
        return _list(device, con)
    if args.command == "gpu" and device != "cuda" and not args.smoke:
        con.print("[red]`python -m bench gpu` measures W1-W3 at full size and needs CUDA; on CPU use "
                  "`python -m bench --quick` or `python -m bench c1` (or add --smoke to check the plumbing)[/red]")
        return 2

    cfg = _config(args, device)
    wls = _workloads(args, device)
    provs = P.select(args.providers or (C1_PROVIDERS if args.command == "c1" else None))
    env = report.environment(device)
    out_dir = Path(args.out) if args.out else report.REPO_ROOT / "bench" / "results" / env["device_slug"]
    prefix = args.command + ("-smoke" if args.smoke else "-quick" if args.quick else "")

    con.print(f"[bold]fastrl bench {args.command}[/bold] ({cfg.mode}) on {env['device']}: torch {env['torch']}, "
              f"triton {env['triton']}, driver {env['driver']}; {len(wls)} workloads x {len(provs)} providers, "
              f"each measurement in a fresh process")
    scaled = [w for w in wls if "scaled down" in w.note or "quick" in w.note]
    if scaled:
        con.print(f"[yellow]{len(scaled)} workloads use CPU-scaled shapes (see each row's N/H/V; the GPU sizes "
                  f"are in DESIGN.md)[/yellow]")
    t0 = time.perf_counter()
    rows, info = runner.run(wls, provs, cfg, con)
    floor = info["floor_tflops"]
    elapsed = time.perf_counter() - t0

    payload = {
        "command": args.command, "mode": cfg.mode, "argv": sys.argv[1:] if argv is None else argv,
        "env": env, "config": asdict(cfg), **info, "elapsed_s": elapsed,
        "workloads": [w.to_dict() for w in wls], "rows": rows,
    }
    title = (f"{args.command} ({cfg.mode}) on {env['device']} | torch {env['torch']} | triton {env['triton']} | "
             f"driver {env['driver']} | ms: median of {cfg.reps if device == 'cpu' else 'do_bench'} runs")
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = [] if args.no_plots else report.plot(rows, out_dir, prefix, env)
    json_path, csv_path = out_dir / f"{prefix}.json", out_dir / f"{prefix}.csv"

    # the summary is printed last
    con.print()
    report.print_table(con, rows, title)
    for dt, f in floor.items():
        con.print(f"matmul floor ({dt}, {'x'.join(map(str, cfg.floor_shape))}), measured in this run: "
                  f"{f:.3f} TFLOP/s; '% floor' = (6NHV / floor) / time (2NHV for forward-only)")
    if args.command == "c1":
        payload["targets"] = _c1_targets([r for r in rows if r["group"] != "floor"], con)
    report.write_json(json_path, payload)
    report.write_csv(csv_path, rows, env)
    con.print(f"wrote {json_path}, {csv_path}" + "".join(f", {p}" for p in plots) + f"  ({elapsed:.0f} s)")
    return 1 if any(r["status"] == "error" for r in rows) and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
