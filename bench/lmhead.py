"""``python -m bench run`` and ``python -m bench c1``: workloads x providers, each point in a fresh process.

One flat row per workload and provider, whatever happened: ``status`` "ok", "skipped" (cannot run here: ``reason``),
"n/a" (does not compute this) or "error"."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench import providers as P
from bench import report
from bench import workloads as W
from bench.workloads import Workload, bytes_moved, flops, flops_executed

__all__ = ["RunConfig", "run", "add_ratios", "cli"]

C1_PROVIDERS = "fastrl,fastrl-fused,torch,trl,liger-fused"
# the CPU targets: workload -> (provider, max time ratio, max extra-peak ratio), against torch in the same run
C1_TARGETS = {"C1": ("fastrl", 1.1, 0.10), "C1-loss": ("fastrl-fused", 1.0, 0.10)}
# what --quick on CPU trims to stay within a few minutes on 2 cores
QUICK_ONLY_ON = {
    "torch-compile": (("C1-quick",), "inductor compiles every shape afresh, tens of seconds each on CPU"),
    "trl": (("core",), "each TRL process pays ~5 s of imports at its first backward; sweeps use fastrl vs torch"),
}
SWEEP_X = {"sweep-tokens": "tokens N", "sweep-vocab": "vocabulary V", "sweep-hidden": "hidden size H"}


@dataclass
class RunConfig:
    command: str  # "run" | "c1"
    device: str  # "cpu" | "cuda"
    reps: int = 3  # timed repetitions per provider (CUDA: 20)
    warmup: int = 1  # untimed full steps first
    n_sets: int = 2  # input sets rotated through the repetitions
    accuracy_rows: int = 256  # tokens checked against float64
    timeout_s: int = 3600  # per measuring process (its watchdog)
    seed: int = 1234
    threads: int = 0  # CPU threads in the measuring processes (0: torch's default)
    options: dict = field(default_factory=dict)  # passed to the providers (fastrl_backend, liger_compiled)
    # provider -> reason, for providers this mode leaves out on purpose (e.g. torch.compile in --smoke)
    leave_out: dict = field(default_factory=dict)
    # provider -> (workload names or groups it still runs on, why only there): --quick trims the slow ones
    only_on: dict = field(default_factory=dict)
    mode: str = ""  # "full" | "quick" | "smoke" (recorded with the results)


def _config(args, device: str) -> RunConfig:
    cfg = RunConfig(command=args.command, device=device, mode=report.mode(args), threads=args.threads)
    if device == "cuda":
        cfg = replace(cfg, reps=20, warmup=2, n_sets=3, timeout_s=1200)
    else:  # Liger compiles its per-chunk loss for CUDA; on CPU that recompiles per shape and dominates the time
        cfg = replace(cfg, options={"liger_compiled": False})
        if args.quick and args.command == "run":
            cfg = replace(cfg, timeout_s=600, only_on=dict(QUICK_ONLY_ON))
    if args.smoke:
        cfg = replace(cfg, reps=1, warmup=0, n_sets=1, accuracy_rows=16, timeout_s=300, only_on={},
                      leave_out={"torch-compile": "left out by --smoke: compiling alone takes longer than the whole "
                                                  "smoke run"}, options={"liger_compiled": False})
    if args.command == "c1":  # C1 is about the CPU path, named explicitly
        cfg.options = {**cfg.options, "fastrl_backend": "torch"}
    for option, name in (("reps", "reps"), ("warmup", "warmup"), ("sets", "n_sets"), ("timeout", "timeout_s")):
        if getattr(args, option) is not None:
            setattr(cfg, name, getattr(args, option))
    if args.fastrl_backend:
        cfg.options = {**cfg.options, "fastrl_backend": args.fastrl_backend}
    return cfg


def _workloads(args, device: str) -> list[Workload]:
    if args.command == "c1":
        wls = [W.tiny(w) for w in (W.C1, W.C1_LOSS)] if args.smoke else [W.C1, W.C1_LOSS]
    elif args.smoke:
        wls = W.smoke_workloads()
    else:
        wls = W.gpu_workloads() if device == "cuda" else W.cpu_workloads(args.quick)
    if any(k.strip().lower().startswith("w4") for k in (args.workload or "").split(",")):
        raise SystemExit("--workload W4: `python -m bench w4` measures W4 (`run` no longer does)")
    return W.select(wls, args.workload)


def _row(wl: Workload, provider: P.Provider, status: str = "error", reason: str = "no result") -> dict:
    return {
        "workload": wl.name, "group": wl.group, "kind": wl.kind, "provider": provider.name, "label": provider.label,
        "status": status, "reason": reason, "N": wl.N, "H": wl.H, "V": wl.V, "B": wl.batch, "dtype": wl.dtype,
        "sweep_value": wl.sweep_value, "workload_note": wl.note,
    }


def _add_flops(row: dict, wl: Workload) -> None:
    row["flops_useful"] = flops(wl, "total")
    row["flops_executed"] = flops_executed(wl, row.get("path", "materialised"))
    row.update(bytes_moved(wl))
    row["tflops"] = row["flops_useful"] / (row["total_ms"]["median"] * 1e-3) / 1e12
    for phase in ("fwd", "bwd"):
        if row.get(f"{phase}_ms"):
            row[f"tflops_{phase}"] = flops(wl, phase) / (row[f"{phase}_ms"]["median"] * 1e-3) / 1e12


def add_ratios(rows: list[dict], references: tuple[str, ...] = ("torch", "trl")) -> None:
    """``time_vs_<ref>`` / ``mem_vs_<ref>`` against each reference provider's row of the same workload (same run)."""
    for ref in references:
        report.add_ratios(rows, ref, lambda r, ref=ref: r["provider"] == ref)


def _plan(workloads: list[Workload], provs: list[P.Provider], cfg: RunConfig) -> tuple[list, list, list]:
    """(the points to measure: each (workload, provider) that runs here, once per distinct shape; the rows of those
    that cannot run, with the reason; the copies: (workload, provider, the workload whose row it repeats)). Sweeps
    share their base point, and on CUDA W1-lp is also tokens-16384, vocab-151936 and hidden-4096."""
    plan, rows, same_as, first = [], [], [], {}
    for wl in workloads:
        for p in provs:
            why = p.unavailable(wl, cfg.device)
            if why is None and p.name in cfg.leave_out:
                why = ("skipped", cfg.leave_out[p.name])
            if why is None and p.name in cfg.only_on:
                where, because = cfg.only_on[p.name]
                if wl.name not in where and wl.group not in where:
                    why = ("skipped", f"left out by --{cfg.mode}: {p.name} runs on {', '.join(where)} only ({because})")
            key = (p.name, wl.kind, wl.N, wl.H, wl.V, wl.dtype, wl.batch, wl.frozen_head)
            if why is not None:
                rows.append(_row(wl, p, *why))
            elif key in first:
                same_as.append((wl, p, first[key]))
            else:
                first[key] = wl
                plan.append((wl, p))
    return plan, rows, same_as


def run(workloads: list[Workload], provs: list[P.Provider], cfg: RunConfig, con, log: Path | None = None
        ) -> tuple[list[dict], dict]:
    """Measure every (workload, provider), each in a fresh process; returns (rows, the load average's range)."""
    plan, unrun, same_as = _plan(workloads, provs, cfg)
    specs = [{"workload": wl.to_dict(), "provider": p.name, "device": cfg.device, "reps": cfg.reps,
              "warmup": cfg.warmup, "n_sets": cfg.n_sets, "seed": cfg.seed, "accuracy_rows": cfg.accuracy_rows,
              "threads": cfg.threads, "options": cfg.options} for wl, p in plan]
    rows = [_row(wl, p) for wl, p in plan]
    lo, hi = report.run_points(specs, rows, cfg.device, cfg.timeout_s, con, log=log)
    for row, (wl, _) in zip(rows, plan):
        if row["status"] == "ok":
            _add_flops(row, wl)
    rows += unrun
    for wl, p, src in same_as:
        orig = next(r for r in rows if r["workload"] == src.name and r["provider"] == p.name)
        row = {**orig, **_row(wl, p, orig["status"], orig["reason"]), "same_as": src.name}
        rows.append({**row, **{k: dict(orig[k]) for k in ("fwd_ms", "bwd_ms", "total_ms") if k in orig}})
    order = {w.name: i for i, w in enumerate(workloads)}
    porder = {p.name: i for i, p in enumerate(provs)}
    rows.sort(key=lambda r: (order.get(r["workload"], 1 << 20), porder.get(r["provider"], 1 << 20)))
    add_ratios(rows)
    return rows, {"loadavg_max": hi, "loadavg_min": lo}


def _find(rows: list[dict], workload: str, provider: str) -> dict:
    return next((r for r in rows if (r["workload"], r["provider"], r["status"]) == (workload, provider, "ok")), {})


def _c1_targets(rows: list[dict], con) -> dict:
    """C1_TARGETS per workload: time and extra peak memory as ratios of torch's in the same run; a fresh process's
    first step (lazy imports included) printed next to them, not judged."""
    checks = []
    for wl in dict.fromkeys(r["workload"] for r in rows if r["workload"].removesuffix("-smoke") in C1_TARGETS):
        prov, t_max, m_max = C1_TARGETS[wl.removesuffix("-smoke")]
        fr, tr = _find(rows, wl, prov), _find(rows, wl, "torch")
        vals = {r["provider"]: f"{r['loss_value']:+.6f}" for r in rows
                if r["workload"] == wl and r["kind"] == "loss" and "loss_value" in r}
        if vals:  # no float64 check for the loss workloads: at least the providers agree on the value
            con.print(f"{wl} loss values: " + ", ".join(f"{p} {v}" for p, v in vals.items()))
        checks += [(f"{wl} target, {prov} extra peak RSS vs torch's", fr.get("mem_vs_torch"), m_max),
                   (f"{wl} target, {prov} fwd+bwd time vs torch's", fr.get("time_vs_torch"), t_max)]
        if fr.get("first_step_ms") and tr.get("first_step_ms"):
            con.print(f"{wl} first step of a fresh process, {prov}: {fr['first_step_ms']:.0f} ms "
                      f"({fr['first_step_ms'] / tr['first_step_ms']:.2f}x torch's {tr['first_step_ms']:.0f} ms), "
                      f"{fr['first_step_extra_mb']:.0f} MB extra peak RSS (torch {tr['first_step_extra_mb']:.0f} MB)")
    return report.judge(con, checks)


def cli(args, device: str, con) -> int:
    """run, c1: measure, print the summary last (c1: and its targets), write JSON, CSV and a plot per sweep."""
    cfg, wls = _config(args, device), _workloads(args, device)
    provs = P.select(args.providers or (C1_PROVIDERS if args.command == "c1" else None))
    env = report.environment(device)
    out_dir, prefix = report.out_dir(args, env["device_slug"], args.command), report.prefix(args.command, args)
    out_dir.mkdir(parents=True, exist_ok=True)
    con.print(f"[bold]fastrl bench {args.command}[/bold] ({cfg.mode}) on {env['device']}: torch {env['torch']}, "
              f"triton {env['triton']}, driver {env['driver']}; {len(wls)} workloads x {len(provs)} providers, "
              f"each measurement in a fresh process")
    if any("scaled down" in w.note or "quick" in w.note for w in wls):
        con.print("[yellow]CPU-scaled shapes (see each row's N/H/V; the GPU sizes are in docs/design.md)[/yellow]")
    t0, log = time.perf_counter(), out_dir / f"{prefix}.rows.jsonl"
    log.unlink(missing_ok=True)
    rows, info = run(wls, provs, cfg, con, log=log)
    payload = {"mode": cfg.mode, "config": {**asdict(cfg), "rows_log": str(log)}, **info,
               "workloads": [w.to_dict() for w in wls], "rows": rows}
    con.print()  # the summary is printed last
    report.print_table(con, rows, f"{args.command} ({cfg.mode}) on {env['device']} | torch {env['torch']} | triton "
                       f"{env['triton']} | driver {env['driver']} | ms: median of "
                       f"{cfg.reps} runs")
    if args.command == "c1":
        payload["targets"] = _c1_targets(rows, con)
    written = [report.write_csv(out_dir / f"{prefix}.csv", rows, env)]
    panels = (("time, ms (median)", lambda r: r["total_ms"]["median"]), ("peak extra memory, MB",
                                                                           lambda r: r["peak_extra_mb"]))
    for group in [] if args.no_plots else sorted({r["group"] for r in rows if r["group"].startswith("sweep")}):
        written += report.plot([r for r in rows if r["group"] == group], out_dir / f"{prefix}-{group}.png",
                               f"{group} | {env['device']} | torch {env['torch']}",
                               (SWEEP_X.get(group, "tokens N"), "sweep_value"), panels)
    report.save_results(con, out_dir / f"{prefix}.json", args.command, args, env, t0, payload, written)
    return 1 if args.smoke and any(r["status"] == "error" for r in rows) else 0
