"""Where results go: environment record, JSON, CSV, the one plot and the summary table printed last."""

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

__all__ = ["environment", "device_name", "device_slug", "new_out_dir", "out_dir", "mode", "prefix", "write_json",
           "save_results", "write_csv", "plot", "print_table", "console", "SUMMARY_WIDTH"]

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


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device.startswith("cuda") else f"{_cpu_name()} ({os.cpu_count()} cores)"


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

    prov = provenance()
    git = str(prov["fastrl_commit"])[:7] + (" (tree modified)" if prov["tree_clean"] is False else "")
    return {
        "device": device_name(device), "device_slug": device_slug(device),
        "device_type": "cuda" if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "triton": _version("triton"), "driver": _driver(device),
        "cuda_runtime": torch.version.cuda or "n/a (CPU build)", "python": platform.python_version(),
        "platform": platform.platform(), "cpu_threads": torch.get_num_threads(),
        "fastrl": getattr(fastrl, "__version__", "?"), "fastrl_git": git, "trl": _version("trl"),
        "liger_kernel": _version("liger-kernel"), "cut_cross_entropy": _version("cut-cross-entropy"),
        "transformers": _version("transformers"),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **prov,
    }


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def save_results(con, path: Path, payload: dict, elapsed: float, also: list | tuple = ()) -> None:
    """Write a command's JSON and say so, with the other files it wrote and how long it took."""
    write_json(path, payload)
    con.print("wrote " + ", ".join(str(p) for p in [path, *also]) + f"  ({elapsed:.0f} s)")


CSV_COLUMNS = [
    "workload", "group", "kind", "provider", "status", "reason", "N", "H", "V", "B", "dtype",
    "fwd_ms_median", "fwd_ms_min", "fwd_ms_max", "bwd_ms_median", "bwd_ms_min", "bwd_ms_max",
    "total_ms_median", "total_ms_min", "total_ms_max", "total_ms_q25", "total_ms_q75", "total_ms_n",
    "peak_extra_fwd_mb", "peak_extra_mb", "first_step_ms", "first_step_extra_mb", "time_vs_torch", "mem_vs_torch",
    "time_vs_trl", "mem_vs_trl", "tflops", "tflops_fwd", "tflops_bwd",
    "floor_tflops", "floor_fraction", "flops_useful", "flops_executed", "bytes_inputs_outputs", "bytes_logits",
    "logp_max_abs_err", "entropy_max_abs_err", "grad_h_max_abs_err", "loss_value", "path", "notes",
    "device", "torch", "triton", "driver",
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


def save_figure(plt, fig, path: Path, written: list) -> None:
    """Lay out, write (110 dpi) and close one figure; its path joins ``written``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)


def _value(r: dict, key: str | Callable[[dict], object]):
    return key(r) if callable(key) else r[key]


def plot(rows: list[dict], path: Path, title: str, x: tuple, panels: tuple, series: str | Callable = "provider",
         lines: tuple = ()) -> list[Path]:
    """The one plot every command draws: a panel per (y label, key or function of a row) in ``panels`` against ``x``
    (x label, key or function), log-log, a line per ``series`` value among the ok rows; ``lines`` ((label, y), ...)
    across the first panel (budgets). Writes ``path`` and returns ``[path]``, or ``[]`` without matplotlib."""
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
        for name in dict.fromkeys(_value(r, series) for r in ok):
            pts = sorted((r for r in ok if _value(r, series) == name), key=lambda r: _value(r, x[1]))
            ax.plot([_value(r, x[1]) for r in pts], [_value(r, y) for r in pts], marker="o", label=name)
        for label, at in lines if ax is axes[0][0] else ():
            ax.axhline(at, ls="--", color="gray", lw=1, label=label)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel=x[0], ylabel=ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    written: list[Path] = []
    save_figure(plt, fig, path, written)
    return written


def _cell(key: str, fmt: str | Callable[[float], str], scale: float = 1.0) -> Callable[[dict], str]:
    """A cell showing ``row[key]`` (times ``scale``) in ``fmt`` (or the format it picks from the value), '' when
    the row has none."""
    def cell(r: dict) -> str:
        x = r.get(key)
        return "" if x is None else format(scale * x, fmt(x) if callable(fmt) else fmt)
    return cell


def _ms(r: dict) -> str:
    m = r["total_ms"]["median"] if r.get("total_ms") else None
    return "" if m is None else ("fwd " if r["kind"] == "forward" else "") + format(m, ".1f" if m < 1e4 else ".0f")


# the summary's columns; the files hold the rest (forward and backward apart, the spread, the entropy and gradient
# errors, every memory figure)
SUMMARY_COLUMNS = (
    ("workload", "left", lambda r: r["workload"]), ("provider", "left", lambda r: r["provider"]),
    ("ms", "right", _ms), ("MB", "right", _cell("peak_extra_mb", ".1f")),
    ("t/torch", "right", _cell("time_vs_torch", ".2f")), ("m/torch", "right", _cell("mem_vs_torch", ".3f")),
    ("t/trl", "right", _cell("time_vs_trl", ".2f")), ("m/trl", "right", _cell("mem_vs_trl", ".3f")),
    ("TFLOP/s", "right", _cell("tflops", lambda x: ".3f" if x < 10 else ".0f")),
    ("floor%", "right", _cell("floor_fraction", ".0f", 100)), ("|dlogp|", "right", _cell("logp_max_abs_err", ".1e")),
)
SUMMARY_LEGEND = ("ms: forward + backward, median (fwd: forward only); MB: extra peak memory; t/, m/: time and memory "
                  "against torch and TRL in this run; floor%: of the plain GEMM's FLOP rate; |dlogp|: max abs log-prob "
                  "error against float64")


def _where(wls: dict) -> str:
    wls = list(wls)
    return escape("[" + (", ".join(wls) if len(wls) <= 4 else f"{len(wls)} workloads ({wls[0]} ... {wls[-1]})") + "]")


def print_table(con: Console, rows: list[dict], title: str) -> None:
    """The summary within ``SUMMARY_WIDTH`` columns: one line per measured row, a section per workload; then each
    workload's shape, each provider's notes, and the rows that did not run (one line per reason)."""
    t = Table(title=title, box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False)
    for header, just, _ in SUMMARY_COLUMNS:
        t.add_column(header, justify=just, no_wrap=True)
    shapes, last = {}, None
    notes: dict[tuple, dict] = {}  # (provider, note) -> its workloads, in order (a dict as an ordered set)
    not_run: dict[tuple, dict] = {}  # (provider, status, reason) -> its workloads
    for r in (r for r in rows if r["group"] != "floor"):
        shapes.setdefault(r["workload"], f"N={r['N']} H={r['H']} V={r['V']} {r['dtype']}")
        if r["status"] != "ok":
            not_run.setdefault((r["provider"], r["status"], r["reason"]), {})[r["workload"]] = None
            continue
        if last not in (None, r["workload"]):
            t.add_section()
        last = r["workload"]
        t.add_row(*(cell(r) for _, _, cell in SUMMARY_COLUMNS))
        note = r.get("notes", "") + (f"; same measurement as {r['same_as']}" if r.get("same_as") else "")
        if note:
            notes.setdefault((r["provider"], note), {})[r["workload"]] = None
    con.print(t)
    con.print(SUMMARY_LEGEND, style="dim")
    if shapes:
        con.print("shapes: " + escape("; ".join(f"{wl} {shape}" for wl, shape in shapes.items())), style="dim")
    for (prov, note), wls in notes.items():
        con.print(f"[dim]{escape(prov)}: {escape(note)} {_where(wls)}[/dim]")
    for (prov, status, reason), wls in not_run.items():
        style = "red" if status == "error" else "dim"
        con.print(f"[{style}]{status:>7} {escape(prov)}: {escape(reason)} {_where(wls)}[/{style}]")
