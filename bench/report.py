"""Where results go: environment record, JSON, CSV, PNG plots and the summary table printed last."""

from __future__ import annotations

import csv
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["environment", "device_slug", "new_out_dir", "out_dir", "mode", "prefix", "write_json", "save_results",
           "save_figure", "write_csv", "plot", "print_table", "console", "SUMMARY_WIDTH"]

REPO_ROOT = Path(__file__).resolve().parent.parent
# the console summary fits this many columns (a terminal narrower than it gets its own width); every figure the
# summary leaves out is in the JSON / CSV files
SUMMARY_WIDTH = 120


def console() -> Console:
    """A rich console at most ``SUMMARY_WIDTH`` columns wide (also when piped: not rich's 80-column default)."""
    c = Console()
    return Console(width=min(c.width, SUMMARY_WIDTH) if c.is_terminal else SUMMARY_WIDTH)


def new_out_dir(device_slug: str, what: str = "bench") -> Path:
    """Where results go without ``--out``: a new folder outside the repository, never the committed
    ``bench/results/`` (committing results is a deliberate ``--out bench/results/<device>/...``):
    ``$FASTRL_BENCH_OUT/<what>-<device>-<UTC time>-XXXX`` (default root: the system's temporary folder)."""
    root = Path(os.environ.get("FASTRL_BENCH_OUT") or Path(tempfile.gettempdir()) / "fastrl-bench")
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(tempfile.mkdtemp(prefix=f"{what}-{device_slug}-{stamp}-", dir=root))


def out_dir(args, device_slug: str, what: str) -> Path:
    """``--out``; else a new folder outside the repository (``new_out_dir``, ``<what>-smoke`` under --smoke):
    committed results are written only by a deliberate ``--out bench/results/<device>/``."""
    if args.out:
        return Path(args.out)
    return new_out_dir(device_slug, f"{what}-smoke" if args.smoke else what)


def mode(args) -> str:
    """The run's size from --smoke / --quick: 'smoke', 'quick' or 'full'."""
    return "smoke" if args.smoke else ("quick" if args.quick else "full")


def prefix(command: str, args) -> str:
    """The result files' stem: ``<command>``, ``<command>-quick`` or ``<command>-smoke``."""
    m = mode(args)
    return command if m == "full" else f"{command}-{m}"


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    return f"{_cpu_name()} ({os.cpu_count()} cores)"


def device_slug(device: str) -> str:
    """'nvidia-h100-80gb-hbm3', or 'cpu-amd-epyc-2c': the default results folder name."""
    if device.startswith("cuda"):
        return _slug(torch.cuda.get_device_name(0))
    name = _slug(_cpu_name())
    for noise in ("-processor", "-cpu"):
        name = name.replace(noise, "")
    return f"cpu-{name}-{os.cpu_count()}c"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _driver(device: str) -> str:
    if not device.startswith("cuda"):
        return "n/a (CPU)"
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
            if out:
                return out[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return f"unknown (CUDA runtime {torch.version.cuda})"


def _git() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "fastrl", "kernels"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + (" (fastrl/ or kernels/ modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: str) -> dict:
    """Everything needed to know where a number came from."""
    import fastrl

    return {
        "device": device_name(device),
        "device_slug": device_slug(device),
        "device_type": "cuda" if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "driver": _driver(device),
        "cuda_runtime": torch.version.cuda or "n/a (CPU build)",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "fastrl": getattr(fastrl, "__version__", "?"),
        "fastrl_git": _git(),
        "trl": _version("trl"),
        "liger_kernel": _version("liger-kernel"),
        "cut_cross_entropy": _version("cut-cross-entropy"),
        "transformers": _version("transformers"),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------

def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def save_results(con, path: Path, payload: dict, elapsed: float, also: list | tuple = ()) -> None:
    """Write a command's JSON and say so, with the other files it wrote and how long it took."""
    write_json(path, payload)
    con.print("wrote " + ", ".join(str(p) for p in [path, *also]) + f"  ({elapsed:.0f} s)")


def save_figure(plt, fig, path: Path, written: list) -> None:
    """Lay out, write (110 dpi) and close one figure; its path joins ``written``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)


CSV_COLUMNS = [
    "workload", "group", "kind", "provider", "status", "reason", "N", "H", "V", "B", "dtype",
    "fwd_ms_median", "fwd_ms_min", "fwd_ms_max", "bwd_ms_median", "bwd_ms_min", "bwd_ms_max",
    "total_ms_median", "total_ms_min", "total_ms_max", "total_ms_q25", "total_ms_q75", "total_ms_n",
    "peak_extra_fwd_mb", "peak_extra_mb", "first_step_ms", "first_step_extra_mb", "time_vs_torch", "mem_vs_torch", "time_vs_trl", "mem_vs_trl", "tflops",
    "tflops_fwd", "tflops_bwd",
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
            flat.update({k: env.get(k) for k in ("device", "torch", "triton", "driver")})
            w.writerow(flat)
    return path


# ---------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------

_XLABEL = {"sweep-tokens": "tokens N", "sweep-vocab": "vocabulary V", "sweep-hidden": "hidden size H"}
_KIND = {"logprob": "log-prob + entropy fwd+bwd", "loss": "GRPO loss fwd+bwd", "forward": "forward only"}


def plot(rows: list[dict], out_dir: Path, prefix: str, env: dict) -> list[Path]:
    """One PNG per sweep (time and memory against the swept size, a line per provider), one for the rest."""
    try:
        import matplotlib
    except ImportError:  # the GPU machine may not have it; the JSON and CSV hold every number anyway
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r["group"] != "floor"]
    written: list[Path] = []
    title_dev = f"{env['device']} | torch {env['torch']}"
    for group in sorted({r["group"] for r in ok if r["group"].startswith("sweep")}):
        rs = [r for r in ok if r["group"] == group]
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
        for prov in dict.fromkeys(r["provider"] for r in rs):
            pts = sorted((r for r in rs if r["provider"] == prov), key=lambda r: r["sweep_value"])
            x = [r["sweep_value"] for r in pts]
            med = [r["total_ms"]["median"] for r in pts]
            lo = [r["total_ms"]["median"] - r["total_ms"]["min"] for r in pts]
            hi = [r["total_ms"]["max"] - r["total_ms"]["median"] for r in pts]
            ax_t.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, label=prov)
            ax_m.plot(x, [max(r["peak_extra_mb"], 1e-3) for r in pts], marker="o", label=prov)
        r0 = rs[0]
        fixed = {"sweep-vocab": f"N={r0['N']} H={r0['H']}",
                 "sweep-hidden": f"N={r0['N']} V={r0['V']}"}.get(group, f"H={r0['H']} V={r0['V']}")
        for ax, ylab in ((ax_t, "fwd+bwd time, ms (median, min-max)"), (ax_m, "peak extra memory, MB")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(_XLABEL.get(group, "tokens N"))
            ax.set_ylabel(ylab)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{group}: {fixed} {r0['dtype']}, {_KIND.get(r0['kind'], r0['kind'])}\n{title_dev}", fontsize=9)
        save_figure(plt, fig, out_dir / f"{prefix}-{group}.png", written)

    core = [r for r in ok if not r["group"].startswith("sweep")]
    if core:
        wls = list(dict.fromkeys(r["workload"] for r in core))
        provs = list(dict.fromkeys(r["provider"] for r in core))
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(wls) + 4), 4.5))
        width = 0.8 / max(1, len(provs))
        for j, prov in enumerate(provs):
            xs, ts, errs, ms = [], [], [[], []], []
            for i, w in enumerate(wls):
                r = next((r for r in core if r["workload"] == w and r["provider"] == prov), None)
                if r is None:
                    continue
                t = r["total_ms"]
                xs.append(i + (j - (len(provs) - 1) / 2) * width)
                ts.append(t["median"])
                errs[0].append(t["median"] - t["min"])
                errs[1].append(t["max"] - t["median"])
                ms.append(r["peak_extra_mb"])
            ax_t.bar(xs, ts, width, yerr=errs, capsize=2, label=prov)
            ax_m.bar(xs, ms, width, label=prov)
        for ax, ylab in ((ax_t, "time, ms (median, min-max)"), (ax_m, "peak extra memory, MB")):
            ax.set_xticks(range(len(wls)))
            ax.set_xticklabels(wls)
            ax.set_ylabel(ylab)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"workloads (fwd+bwd; forward-only for forward workloads)\n{title_dev}", fontsize=9)
        save_figure(plt, fig, out_dir / f"{prefix}-workloads.png", written)
    return written


# ---------------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------------

def _ms(d: dict | None, spread: bool = False) -> str:
    if not d:
        return ""
    s = f"{d['median']:.1f}" if d["median"] < 1e4 else f"{d['median']:.0f}"
    if spread and d.get("n", 1) > 1:
        s += f" [{d['min']:.1f}-{d['max']:.1f}]" if d["max"] < 1e4 else f" [{d['min']:.0f}-{d['max']:.0f}]"
    return s


def _f(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


# the summary's columns: (header, justification); the files hold the rest (forward and backward apart, the spread,
# the entropy and gradient errors, every memory figure)
SUMMARY_COLUMNS = (("workload", "left"), ("provider", "left"), ("ms", "right"), ("MB", "right"),
                   ("t/torch", "right"), ("m/torch", "right"), ("t/trl", "right"), ("m/trl", "right"),
                   ("TFLOP/s", "right"), ("floor%", "right"), ("|dlogp|", "right"))
SUMMARY_LEGEND = ("ms: forward + backward, median (fwd: forward only); MB: extra peak memory; t/, m/: time and memory "
                  "against torch and TRL in this run; floor%: of the plain GEMM's FLOP rate; |dlogp|: max abs log-prob "
                  "error against float64")


def _summary_cells(r: dict) -> list[str]:
    """One measured row's cells of the summary, in ``SUMMARY_COLUMNS`` order."""
    fwd_only = r["kind"] == "forward"
    return [
        r["workload"], r["provider"],
        ("fwd " if fwd_only else "") + _ms(r.get("total_ms")),
        _f(r.get("peak_extra_mb"), ".1f"),
        _f(r.get("time_vs_torch"), ".2f"), _f(r.get("mem_vs_torch"), ".3f"),
        _f(r.get("time_vs_trl"), ".2f"), _f(r.get("mem_vs_trl"), ".3f"),
        _f(r.get("tflops"), ".3f" if r.get("tflops", 0) < 10 else ".0f"),
        _f(100 * r["floor_fraction"] if "floor_fraction" in r else None, ".0f"),
        _f(r.get("logp_max_abs_err"), ".1e"),
    ]


def _grouped(pairs) -> dict:
    """{key: [workload, ...]} in first-seen order, for one line per key below the table."""
    out: dict = {}
    for key, wl in pairs:
        out.setdefault(key, [])
        if wl not in out[key]:
            out[key].append(wl)
    return out


def _where(wls: list[str]) -> str:
    return escape("[" + (", ".join(wls) if len(wls) <= 4 else f"{len(wls)} workloads ({wls[0]} ... {wls[-1]})") + "]")


def print_table(con: Console, rows: list[dict], title: str, sweeps_compact: bool = True) -> None:
    """The summary, within ``SUMMARY_WIDTH`` columns: one line per measured row (fwd+bwd ms: the median; extra MB:
    peak memory above the inputs; t/ and m/: time and memory against torch and TRL measured in the same run), then
    each workload's shape, each provider's notes, and the rows that did not run (one line per reason). The JSON
    and CSV files hold every figure."""
    from rich import box

    t = Table(title=title, box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False)
    for col, just in SUMMARY_COLUMNS:
        t.add_column(col, justify=just, no_wrap=True)
    shapes: dict[str, str] = {}
    notes, not_run = [], []
    last_wl = None
    for r in rows:
        if r["group"] == "floor":
            continue
        shapes.setdefault(r["workload"], f"N={r['N']} H={r['H']} V={r['V']} {r['dtype']}")
        if r["status"] != "ok":
            not_run.append(((r["provider"], r["status"], r["reason"]), r["workload"]))
            continue
        if last_wl is not None and r["workload"] != last_wl:
            t.add_section()
        last_wl = r["workload"]
        t.add_row(*_summary_cells(r))
        note = r.get("notes", "") + (f"; same measurement as {r['same_as']}" if r.get("same_as") else "")
        if note:
            notes.append(((r["provider"], note), r["workload"]))
    con.print(t)
    con.print(SUMMARY_LEGEND, style="dim")
    if shapes:
        con.print("shapes: " + escape("; ".join(f"{wl} {shape}" for wl, shape in shapes.items())), style="dim")
    for (prov, note), wls in _grouped(notes).items():
        con.print(f"[dim]{escape(prov)}: {escape(note)} {_where(wls)}[/dim]")
    for (prov, status, reason), wls in _grouped(not_run).items():
        style = "red" if status == "error" else "dim"
        con.print(f"[{style}]{status:>7} {escape(prov)}: {escape(reason)} {_where(wls)}[/{style}]")
