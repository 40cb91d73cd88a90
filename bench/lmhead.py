"""The points of ``run`` and ``c1``: workloads x providers, each in a fresh process (``bench.session_run.run_fresh``).

One flat row per workload and provider, whatever happened: ``status`` "ok", "skipped" (cannot run here: ``reason``),
"n/a" (does not compute this) or "error"."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape

from bench import providers as P
from bench.session_run import run_fresh
from bench.workloads import Workload, bytes_moved, flops, flops_executed

__all__ = ["RunConfig", "run", "add_ratios"]


@dataclass
class RunConfig:
    command: str  # "run" | "c1" | "w4"
    device: str  # "cpu" | "cuda"
    reps: int = 3  # timed repetitions per provider on CPU (on CUDA do_bench picks its own count)
    warmup: int = 1  # untimed full steps first
    n_sets: int = 2  # input sets rotated through the repetitions
    accuracy_rows: int = 256  # tokens checked against float64
    rep_ms: int = 2000  # do_bench's timing budget per measurement (CUDA)
    timeout_s: int = 3600  # per measuring process (its watchdog)
    seed: int = 1234
    threads: int = 0  # CPU threads in the measuring processes (0: torch's default)
    options: dict = field(default_factory=dict)  # passed to the providers (fastrl_backend, liger_compiled)
    # provider -> reason, for providers this mode leaves out on purpose (e.g. torch.compile in --smoke)
    leave_out: dict = field(default_factory=dict)
    # provider -> (workload names or groups it still runs on, why only there): --quick trims the slow ones
    only_on: dict = field(default_factory=dict)
    floor_shape: tuple = (2048, 2048, 2048)
    mode: str = ""  # "full" | "quick" | "smoke" (recorded with the results)
    rows_log: str | None = None  # each row appended here as a JSON line when it finishes (None: the final files only)


def _row(wl: Workload, provider: str, label: str, status: str, reason: str = "") -> dict:
    return {
        "workload": wl.name, "group": wl.group, "kind": wl.kind, "provider": provider, "label": label,
        "status": status, "reason": reason, "N": wl.N, "H": wl.H, "V": wl.V, "B": wl.batch, "dtype": wl.dtype,
        "sweep_value": wl.sweep_value, "workload_note": wl.note,
    }


def _finish_row(row: dict, wl: Workload, res: dict, floor: dict) -> dict:
    row.update({k: v for k, v in res.items() if k != "traceback" or v})
    if row["status"] != "ok":
        return row
    row["flops_useful"] = flops(wl, "total")
    row["flops_executed"] = flops_executed(wl, res.get("path", "materialised"))
    row.update(bytes_moved(wl))
    tot = res["total_ms"]["median"]
    row["tflops"] = row["flops_useful"] / (tot * 1e-3) / 1e12
    for phase in ("fwd", "bwd"):
        if res.get(f"{phase}_ms"):
            row[f"tflops_{phase}"] = flops(wl, phase) / (res[f"{phase}_ms"]["median"] * 1e-3) / 1e12
    f = floor.get(wl.dtype)
    if f:
        row["floor_tflops"] = f
        row["floor_ms"] = row["flops_useful"] / (f * 1e12) * 1e3
        row["floor_fraction"] = row["floor_ms"] / tot
    return row


def add_ratios(rows: list[dict], references: tuple[str, ...] = ("torch", "trl")) -> None:
    """Time and peak-memory ratios against the materialised torch row and TRL's row of the same workload (same
    run): ``time_vs_torch`` / ``mem_vs_torch``, ``time_vs_trl`` / ``mem_vs_trl``."""
    for reference in references:
        ref = {r["workload"]: r for r in rows if r["provider"] == reference and r["status"] == "ok"}
        for r in rows:
            base = ref.get(r["workload"])
            if r["status"] != "ok" or base is None:
                continue
            r[f"time_vs_{reference}"] = r["total_ms"]["median"] / base["total_ms"]["median"]
            if base["peak_extra_mb"] > 0:
                r[f"mem_vs_{reference}"] = r["peak_extra_mb"] / base["peak_extra_mb"]


def _one_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"[dim]{row['workload']:>14} {row['provider']:<14} {row['status']}: {escape(row['reason'])}[/dim]"
    t = row["total_ms"]
    err = f"  |dlogp| {row['logp_max_abs_err']:.1e}" if "logp_max_abs_err" in row else ""
    return (f"{row['workload']:>14} {row['provider']:<14} {t['median']:10.1f} ms [{t['min']:.1f}-{t['max']:.1f}]"
            f"  {row['peak_extra_mb']:9.1f} MB{err}")


def _plan(workloads: list[Workload], provs: list[P.Provider], cfg: RunConfig) -> tuple[list, list, list]:
    """(the points to measure: the floors first, then each (workload, provider) that runs here, once per distinct
    shape; the rows of those that cannot run, with the reason; the copies: (workload, provider, the workload whose
    row it repeats)). Sweeps share their base point, and on CUDA W1-lp is also tokens-16384, vocab-151936 and
    hidden-4096."""
    m, k, n = cfg.floor_shape
    plan: list[tuple[Workload, P.Provider | None]] = [
        (Workload(f"matmul-{dt}", "forward", m, k, n, dt, group="floor",
                  note=f"plain [{m},{k}] @ [{k},{n}] GEMM: the floor every FLOP rate is compared with"), None)
        for dt in sorted({w.dtype for w in workloads})]
    rows, same_as, first = [], [], {}
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
                rows.append(_row(wl, p.name, p.label, *why))
            elif key in first:
                same_as.append((wl, p, first[key]))
            else:
                first[key] = wl
                plan.append((wl, p))
    return plan, rows, same_as


def _spec(wl: Workload, name: str, cfg: RunConfig) -> dict:
    floor = name == "matmul"
    return {"workload": wl.to_dict(), "provider": name, "device": cfg.device,
            "reps": max(cfg.reps, 5) if floor else cfg.reps, "warmup": max(cfg.warmup, 1) if floor else cfg.warmup,
            "n_sets": cfg.n_sets, "seed": cfg.seed, "accuracy_rows": cfg.accuracy_rows, "rep_ms": cfg.rep_ms,
            "threads": cfg.threads, "options": cfg.options}


def _floor_row(wl: Workload, res: dict, floor: dict, con) -> dict:
    """The floor's row; its GFLOP/s goes into ``floor`` (every row's "% floor" needs it)."""
    row = _row(wl, "matmul", "plain GEMM (floor)", res.get("status", "error"), res.get("reason", ""))
    row.update({k: v for k, v in res.items() if k != "traceback"})
    if row["status"] == "ok":
        f = flops(wl, "fwd") / (res["fwd_ms"]["median"] * 1e-3) / 1e12
        row["tflops"] = floor[wl.dtype] = f
        con.print(f"{'floor':>14} matmul {wl.dtype:<9} {res['fwd_ms']['median']:9.1f} ms -> {f * 1e3:.1f} GFLOP/s")
    else:
        con.print(f"[red]floor matmul failed: {escape(row['reason'])}[/red]")
    return row


def run(workloads: list[Workload], provs: list[P.Provider], cfg: RunConfig,
        console: Console) -> tuple[list[dict], dict]:
    """Measure every (workload, provider), each in a fresh process (the floors first); returns (rows, {floor TFLOP/s
    by dtype, the load average's range})."""
    plan, unrun, same_as = _plan(workloads, provs, cfg)
    rows: list[dict] = []
    floor: dict[str, float] = {}
    floor_rows: list[dict] = []
    loads: list[float] = [os.getloadavg()[0]]
    specs = [_spec(wl, "matmul" if p is None else p.name, cfg) for wl, p in plan]  # the floors first
    points = {id(s): point for s, point in zip(specs, plan)}

    def done(spec: dict, res: dict) -> None:
        wl, p = points[id(spec)]
        if p is None:
            row = _floor_row(wl, res, floor, console)
            floor_rows.append(row)
        else:
            loads.append(os.getloadavg()[0])
            row = _row(wl, p.name, p.label, res.get("status", "error"), res.get("reason", ""))
            rows.append(_finish_row(row, wl, res, floor))
            console.print(f"{len(floor_rows) + len(rows):>4}/{len(plan)} " + _one_line(row))
        if cfg.rows_log:  # kept as it finishes: a run stopped part-way keeps what it measured
            with open(cfg.rows_log, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")

    run_fresh(specs, cfg.device, cfg.timeout_s, on_result=done)
    rows += unrun
    for wl, p, src in same_as:
        orig = next(r for r in rows if r["workload"] == src.name and r["provider"] == p.name)
        row = {**orig, **_row(wl, p.name, p.label, orig["status"], orig["reason"]), "same_as": src.name}
        rows.append({**row, **{k: dict(orig[k]) for k in ("fwd_ms", "bwd_ms", "total_ms") if k in orig}})
    # a measuring process itself keeps about `cores` threads busy; well above that, something else ran too
    if max(loads) > 1.5 * (os.cpu_count() or 1):
        console.print(f"[yellow]load average reached {max(loads):.1f} on {os.cpu_count()} cores during this run: "
                      f"other processes competed for the CPU, so times are noisier than usual[/yellow]")
    order = {w.name: i for i, w in enumerate(workloads)}
    porder = {p.name: i for i, p in enumerate(provs)}
    rows.sort(key=lambda r: (order.get(r["workload"], 1 << 20), porder.get(r["provider"], 1 << 20)))
    add_ratios(rows)
    return floor_rows + rows, {"floor_tflops": floor, "loadavg_max": max(loads), "loadavg_min": min(loads)}
