"""What every measuring command shares: its points run in fresh processes with a line each, the environment record,
the summary table printed last, the targets judged from a table, JSON + CSV (and the one plot)."""

from __future__ import annotations

import csv
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["environment", "device_slug", "new_out_dir", "out_dir", "mode", "prefix", "write_json", "save_results",
           "session_files", "write_csv", "plot", "print_table", "console", "cell", "pick", "run_points", "add_ratios",
           "median_ms", "judge", "SUMMARY_WIDTH"]

# the console summary fits this many columns; every figure it leaves out is in the JSON / CSV files
SUMMARY_WIDTH = 120


def console() -> Console:
    """A rich console at most ``SUMMARY_WIDTH`` columns wide (also when piped: not rich's 80-column default)."""
    c = Console()
    return Console(width=min(c.width, SUMMARY_WIDTH) if c.is_terminal else SUMMARY_WIDTH)


def new_out_dir(device_slug: str, what: str = "bench") -> Path:
    """A new folder outside the repository, never the committed ``bench/results/``:
    ``$FASTRL_BENCH_OUT/<what>-<device>-<UTC time>-XXXX`` (default root: the system's temporary folder)."""
    root = Path(os.environ.get("FASTRL_BENCH_OUT") or Path(tempfile.gettempdir()) / "fastrl-bench")
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(tempfile.mkdtemp(prefix=f"{what}-{device_slug}-{stamp}-", dir=root))


def out_dir(args, device_slug: str, what: str) -> Path:
    """``--out``, else ``new_out_dir`` (``<what>-smoke`` under --smoke)."""
    return Path(args.out) if args.out else new_out_dir(device_slug, f"{what}-smoke" if args.smoke else what)


def pick(option: str, text: str | None, known) -> list[str]:
    """The names in the comma list ``text`` (none: every one of ``known``), or a SystemExit naming ``option``, what it
    expects and what came: the one check of every command's list options."""
    names = [x.strip() for x in (text or ",".join(known)).split(",") if x.strip()]
    bad = [x for x in names if x not in known]
    if bad:
        raise SystemExit(f"{option}: expected a comma list of {', '.join(known)}; got {', '.join(map(repr, bad))}")
    return names


def mode(args) -> str:
    """The run's size from --smoke / --quick: 'smoke', 'quick' or 'full'."""
    return "smoke" if args.smoke else ("quick" if args.quick else "full")


def prefix(command: str, args) -> str:
    """The result files' stem: ``<command>``, ``<command>-quick`` or ``<command>-smoke``."""
    return command if mode(args) == "full" else f"{command}-{mode(args)}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.lower().startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "cpu"


def device_slug(device: str) -> str:
    """'nvidia-h100-80gb-hbm3', or 'cpu-amd-epyc-2c': the default results folder name."""
    def slug(s: str) -> str:
        return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")

    if device.startswith("cuda"):
        return slug(torch.cuda.get_device_name(0))
    return f"cpu-{slug(_cpu_name()).replace('-processor', '').replace('-cpu', '')}-{os.cpu_count()}c"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _driver(device: str) -> str:
    if not device.startswith("cuda"):
        return "n/a (CPU)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0] if out else f"unknown (CUDA runtime {torch.version.cuda})"


def environment(device: str) -> dict:
    """Everything needed to know where a number came from."""
    import fastrl

    from bench.provenance import provenance

    prov, cuda = provenance(), device.startswith("cuda")
    git = str(prov["fastrl_commit"])[:7] + (" (tree modified)" if prov["tree_clean"] is False else "")
    return {
        "device": torch.cuda.get_device_name(0) if cuda else f"{_cpu_name()} ({os.cpu_count()} cores)",
        "device_slug": device_slug(device), "device_type": "cuda" if cuda else "cpu",
        "torch": torch.__version__, "triton": _version("triton"), "driver": _driver(device),
        "cuda_runtime": torch.version.cuda or "n/a (CPU build)", "python": platform.python_version(),
        "platform": platform.platform(), "cpu_threads": torch.get_num_threads(),
        "fastrl": getattr(fastrl, "__version__", "?"), "fastrl_git": git, "trl": _version("trl"),
        "liger_kernel": _version("liger-kernel"), "cut_cross_entropy": _version("cut-cross-entropy"),
        "transformers": _version("transformers"),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **prov,
    }


def session_files(paths) -> list[tuple[Path, dict]]:
    """Every ``session*.json`` under ``paths`` (files, or folders searched at any depth), parsed; one that does not
    parse (cut short) is left out."""
    out = []
    for f in (f for p in map(Path, paths) for f in (sorted(p.rglob("session*.json")) if p.is_dir() else [p])):
        try:
            out.append((f, json.loads(f.read_text())))
        except (OSError, ValueError):
            continue
    return out


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def save_results(con, path: Path, command: str, args, env: dict, t0: float, fields: dict, also=()) -> None:
    """Write a command's JSON: its name, argv, environment and seconds since ``t0`` (``time.perf_counter``) beside
    ``fields``; and say so, with the other files it wrote and how long it took."""
    elapsed = time.perf_counter() - t0
    write_json(path, {"command": command, "argv": list(getattr(args, "argv", []) or []), "env": env,
                      "elapsed_s": elapsed, **fields})
    con.print("wrote " + ", ".join(str(p) for p in [path, *also]) + f"  ({elapsed:.0f} s)")


CSV_COLUMNS = [
    "workload", "group", "kind", "provider", "status", "reason", "N", "H", "V", "B", "dtype",
    "fwd_ms_median", "fwd_ms_min", "fwd_ms_max", "bwd_ms_median", "bwd_ms_min", "bwd_ms_max",
    "total_ms_median", "total_ms_min", "total_ms_max", "total_ms_q25", "total_ms_q75", "total_ms_n",
    "peak_extra_fwd_mb", "peak_extra_mb", "first_step_ms", "first_step_extra_mb", "time_vs_torch", "mem_vs_torch",
    "time_vs_trl", "mem_vs_trl", "tflops", "tflops_fwd", "tflops_bwd", "flops_useful", "flops_executed",
    "bytes_inputs_outputs", "bytes_logits", "logp_max_abs_err", "entropy_max_abs_err", "grad_h_max_abs_err",
    "loss_value", "path", "notes", "device", "torch", "triton", "driver",
]


def write_csv(path: Path, rows: list[dict], env: dict, columns: list[str] = CSV_COLUMNS,
              nested: tuple[str, ...] = ("fwd_ms", "bwd_ms", "total_ms")) -> Path:
    """One CSV line per row: each ``nested`` dict flattened (``total_ms`` -> ``total_ms_median`` ...), and the
    device, torch, triton and driver from ``env``; the columns not in ``columns`` left out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            flat = {**r, **{f"{ph}_{k}": v for ph in nested for k, v in (r.get(ph) or {}).items()}}
            w.writerow({**flat, **{k: env.get(k) for k in ("device", "torch", "triton", "driver")}})
    return path


def plot(rows: list[dict], path: Path, title: str, x: tuple[str, str], panels: tuple) -> list[Path]:
    """A panel per (y label, function of a row) in ``panels`` against ``x`` (label, row key), log-log, a line per
    provider among the ok rows. Writes ``path`` and returns ``[path]``, or ``[]`` without matplotlib."""
    try:
        import matplotlib
    except ImportError:  # the GPU machine may not have it; the JSON and CSV hold every number anyway
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (ylabel, y) in zip(axes[0], panels):
        for name in dict.fromkeys(r["provider"] for r in ok):
            pts = sorted((r for r in ok if r["provider"] == name), key=lambda r: r[x[1]])
            ax.plot([r[x[1]] for r in pts], [y(r) for r in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel=x[0], ylabel=ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def cell(key: str, fmt: str | Callable[[float], str]) -> Callable[[dict], str]:
    """A table cell: ``row[key]`` in ``fmt`` (or the format it picks from the value), '' when the row has none."""
    def show(r: dict) -> str:
        x = r.get(key)
        return "" if x is None else format(x, fmt(x) if callable(fmt) else fmt)
    return show


def _ms(r: dict) -> str:
    m = r["total_ms"]["median"] if r.get("total_ms") else None
    return "" if m is None else ("fwd " if r["kind"] == "forward" else "") + format(m, ".1f" if m < 1e4 else ".0f")


# the summary's columns; the files hold the rest (forward and backward apart, the spread, the entropy and gradient
# errors, every memory figure)
SUMMARY_COLUMNS = (
    ("workload", "left", cell("workload", "")), ("provider", "left", cell("provider", "")),
    ("ms", "right", _ms), ("MB", "right", cell("peak_extra_mb", ".1f")),
    ("t/torch", "right", cell("time_vs_torch", ".2f")), ("m/torch", "right", cell("mem_vs_torch", ".3f")),
    ("t/trl", "right", cell("time_vs_trl", ".2f")), ("m/trl", "right", cell("mem_vs_trl", ".3f")),
    ("TFLOP/s", "right", cell("tflops", lambda x: ".3f" if x < 10 else ".0f")),
    ("|dlogp|", "right", cell("logp_max_abs_err", ".1e")),
)
SUMMARY_LEGEND = ("ms: forward + backward, median (fwd: forward only); MB: extra peak memory; t/, m/: time and memory "
                  "against torch and TRL in this run; |dlogp|: max abs log-prob error against float64")


def _where(wls: dict) -> str:
    wls = list(wls)
    return escape("[" + (", ".join(wls) if len(wls) <= 4 else f"{len(wls)} workloads ({wls[0]} ... {wls[-1]})") + "]")


def print_table(con: Console, rows: list[dict], title: str, columns: tuple = SUMMARY_COLUMNS,
                legend: str = SUMMARY_LEGEND, section: Callable = lambda r: r["workload"]) -> None:
    """The summary within ``SUMMARY_WIDTH`` columns: one line per measured row ((header, justify, cell) per column),
    a section per value of ``section``; then the legend, each workload's shape, each provider's notes, and the rows
    that did not run (one line per reason). A committed run's ``floor`` rows (a retired matmul floor) are left out."""
    t = Table(title=title, box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False)
    for header, just, _ in columns:
        t.add_column(header, justify=just, no_wrap=True)
    shapes, last = {}, None
    notes: dict[tuple, dict] = {}  # (provider, note) -> its workloads, in order (a dict as an ordered set)
    not_run: dict[tuple, dict] = {}  # (provider, status, reason) -> its workloads
    for r in (r for r in rows if r.get("group") != "floor"):
        if "N" in r:
            shapes.setdefault(r["workload"], f"N={r['N']} H={r['H']} V={r['V']} {r['dtype']}")
        if r.get("status", "ok") != "ok":
            not_run.setdefault((r["provider"], r["status"], r.get("reason", "")), {})[r["workload"]] = None
            continue
        if last not in (None, section(r)):
            t.add_section()
        last = section(r)
        t.add_row(*(show(r) for _, _, show in columns))
        note = r.get("notes", "") + (f"; same measurement as {r['same_as']}" if r.get("same_as") else "")
        if note:
            notes.setdefault((r["provider"], note), {})[r["workload"]] = None
    con.print(t)
    con.print(legend, style="dim")
    if shapes:
        con.print("shapes: " + escape("; ".join(f"{wl} {shape}" for wl, shape in shapes.items())), style="dim")
    for (prov, note), wls in notes.items():
        con.print(f"[dim]{escape(prov)}: {escape(note)} {_where(wls)}[/dim]")
    for (prov, status, reason), wls in not_run.items():
        style = "red" if status == "error" else "dim"
        con.print(f"[{style}]{status:>7} {escape(prov)}: {escape(reason)} {_where(wls)}[/{style}]")


def _progress(r: dict, who: str) -> str:
    if r.get("status", "ok") != "ok":
        return f"[dim]{who} {r.get('status')}: {escape(str(r.get('reason', '')))}[/dim]"
    t = r.get("total_ms") or {"median": r["ms"]}
    spread = f" [{t['min']:.1f}-{t['max']:.1f}]" if "min" in t else ""
    err = "".join(f"  |d{k}| {r[f'{k}_max_abs_err']:.1e}" for k in ("logp", "div", "grad_h") if f"{k}_max_abs_err" in r)
    return f"{who} {t['median']:10.1f} ms{spread}  {r['peak_extra_mb']:9.1f} MB{err}"


def run_points(specs: list[dict], rows: list[dict], device: str, timeout_s: float, con: Console,
               who: Callable[[dict], str] = lambda r: f"{r['workload']:>14} {r['provider']:<14}",
               log: Path | None = None) -> tuple[float, float]:
    """Each of ``specs`` measured in a fresh process (``bench.session_run.run_fresh``, its watchdog at ``timeout_s``),
    its result merged into the row of the same index, a line printed (``who(row)`` names the point) and the row
    appended to ``log`` as each finishes (a run stopped part-way keeps what it measured); a warning when the load
    average went well above the cores. Returns the load average's (min, max) over the run."""
    from bench.session_run import append_rows, run_fresh

    index, loads = {id(s): i for i, s in enumerate(specs)}, [os.getloadavg()[0]]

    def done(spec: dict, res: dict) -> None:
        i = index[id(spec)]
        rows[i].update(res)
        loads.append(os.getloadavg()[0])
        con.print(f"{i + 1:>4}/{len(specs)} " + _progress(rows[i], who(rows[i])))
        if log is not None:
            append_rows(log, [rows[i]])

    run_fresh(specs, device, timeout_s, on_result=done)
    # a measuring process itself keeps about `cores` threads busy; well above that, something else ran too
    if max(loads) > 1.5 * (os.cpu_count() or 1):
        con.print(f"[yellow]load average reached {max(loads):.1f} on {os.cpu_count()} cores during this run: "
                  f"other processes competed for the CPU, so times are noisier than usual[/yellow]")
    return min(loads), max(loads)


def median_ms(r: dict) -> float | None:
    """A row's median step time (``total_ms``), None when it has none."""
    return (r.get("total_ms") or {}).get("median")


def add_ratios(rows: list[dict], name: str, is_ref: Callable[[dict], bool], key: Callable = lambda r: r["workload"],
               ms: Callable = median_ms, mb: str = "peak_extra_mb", where: Callable = lambda r: True) -> None:
    """The benchmarks' one ratio rule: each ok row (``where``) gets ``time_vs_<name>`` and ``mem_vs_<name>`` against
    the ok reference row (``is_ref``) of the same ``key`` (time ``ms(row)``, memory ``row[mb]``; None where the
    reference held none)."""
    def ok(r: dict) -> bool:
        return r.get("status", "ok") == "ok" and ms(r) is not None

    refs = {key(r): r for r in rows if is_ref(r) and ok(r)}
    for r in rows:
        b = refs.get(key(r)) if ok(r) and where(r) else None
        if b is not None:
            r[f"time_vs_{name}"] = ms(r) / ms(b)
            r[f"mem_vs_{name}"] = r[mb] / b[mb] if r.get(mb) is not None and b.get(mb) else None


def judge(con: Console | None, checks) -> dict[str, dict]:
    """The benchmarks' one targets judge. Each check (name, value, limit[, what[, at_least]]) printed as "name: what
    value (target <= limit): PASS / FAIL" (``at_least``: >=; value None: not evaluated, a fail, ``what`` saying why);
    returns {name: {"value", "target", "pass", "row"}}."""
    out = {}
    for name, value, limit, what, at_least in ((*c, "", False)[:5] for c in checks):
        ok = value is not None and (value >= limit if at_least else value <= limit)
        out[name] = {"value": value, "target": limit, "pass": ok, "row": what}
        bound = f"target {'>=' if at_least else '<='} {limit:g}x"
        if con is not None and value is None:
            con.print(f"[yellow]{name}: not evaluated ({what or 'a row it needs did not run'}); {bound}[/yellow]")
        elif con is not None:
            con.print(f"{name}: {what + ' ' if what else ''}{value:.3f}x ({bound}): "
                      + ("[green]PASS[/green]" if ok else "[red]FAIL[/red]"))
    return out
