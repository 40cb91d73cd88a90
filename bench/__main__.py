"""``python -m bench [COMMAND] [options]``: the benchmark CLI (bench/README.md says what each number means).

    python -m bench --quick              CPU-sized workloads and sweeps, a few minutes on 2 cores
    python -m bench                      everything for this device (GPU sizes on CUDA, CPU sizes otherwise)
    python -m bench COMMAND --help       that command's options (the commands are listed below)

The workloads (W1-W5, C1) are defined in docs/design.md. Every command measures its points on the session's harness
(``bench.session_run``: a fresh measuring process per point, or per section for ``session``, under a watchdog); the
summary table is printed last and the rows are written as JSON and CSV, with PNG plots, under ``--out`` (default: a
new folder outside the repository, ``$FASTRL_BENCH_OUT`` or the system's temporary folder; committing results is a
deliberate ``--out bench/results/<device>/``). The console summary fits 120 columns.
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
from bench import divergence, lmhead, report, session_report, w4, w5
from bench import workloads as W

C1_PROVIDERS = "fastrl,fastrl-fused,torch,trl,liger-fused"
# the CPU targets (bench/README.md, `python -m bench c1`): workload -> (provider, max time ratio, max extra-peak
# ratio), both against materialised torch measured in the same run
C1_TARGETS = {"C1": ("fastrl", 1.1, 0.10), "C1-loss": ("fastrl-fused", 1.0, 0.10)}
# W4 rides along with `python -m bench` (full run); --quick and --smoke only when --workload names it
W4_IN_QUICK = False  # CPU W4 at the quick lengths: ~2 min quiet, ~4 loaded; `python -m bench w4 --quick`
GPU_WORKLOADS = ("W1", "W1-lp", "W2", "W2-lp", "W3", "W1-frozen")  # + the loss sweeps (groups sweep-loss-*)
# The GPU targets, as ratios against TRL 1.16 measured in the same run: workload (or loss-sweep group) ->
# [(provider, ratio, max)]. time: fwd+bwd (forward-only for W3); mem: peak extra memory. "mem_vs_trl@W1" compares
# with TRL's extra peak at W1 (trained head): the frozen-head memory target is a fraction of what TRL needs at W1.
# The time limits are the GPU session's (bench.session_report.TIME_TARGETS), one table for both commands.
_TIME = dict(session_report.TIME_TARGETS)
GPU_TARGETS = {
    "W1": [("fastrl-fused", "time_vs_trl", _TIME["W1"]), ("fastrl-fused", "mem_vs_trl", 1.5)],
    "W1-lp": [("fastrl", "time_vs_trl", _TIME["W1-lp"]), ("fastrl", "mem_vs_trl", 0.2)],
    "W2": [("fastrl-fused", "time_vs_trl", _TIME["W2"])],
    "W2-lp": [("fastrl", "time_vs_trl", _TIME["W2-lp"])],
    "W3": [("fastrl", "time_vs_trl", _TIME["W3"])],
    "W1-frozen": [("fastrl-fused", "mem_vs_trl@W1", 0.2)],
    "sweep-loss-h4096": [("fastrl-fused", "time_vs_trl", _TIME["W1"])],
    "sweep-loss-h896": [("fastrl-fused", "time_vs_trl", _TIME["W2"])],
}
# what --quick on CPU trims to stay within a few minutes on 2 cores
QUICK_ONLY_ON = {
    "torch-compile": (("C1-quick",), "inductor compiles every shape afresh, tens of seconds each on CPU"),
    "trl": (("core",), "each TRL process pays ~5 s of imports at its first backward; sweeps use fastrl vs torch"),
}
SMOKE_LEAVE_OUT = {"torch-compile": "left out by --smoke: compiling alone takes longer than the whole smoke run"}


# ---------------------------------------------------------------------------------------------------------------
# Options, by group; each command picks its groups
# ---------------------------------------------------------------------------------------------------------------


def _device_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")


def _run_options(ap: argparse.ArgumentParser) -> None:
    """Options of every measuring command."""
    ap.add_argument("--quick", action="store_true", help="smaller shapes and fewer points (CPU: a few minutes)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, one repetition: checks the plumbing only (results go to a temporary folder "
                         "unless --out is given)")
    ap.add_argument("--out", help="results folder (default: a new folder under $FASTRL_BENCH_OUT or the system's "
                                  "temporary folder, never the committed bench/results/)")
    _device_option(ap)
    ap.add_argument("--reps", type=int, help="timed repetitions per measurement on CPU (default 3; smoke 1)")
    ap.add_argument("--warmup", type=int, help="untimed steps before timing (default 1; smoke 0)")
    ap.add_argument("--timeout", type=int, help="seconds per measuring process")
    ap.add_argument("--jobs", type=int, help="measuring processes at once (default 1; --smoke 2): "
                                             "above 1 they share the cores, so times are not comparable")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads per worker (default: torch's)")
    ap.add_argument("--fastrl-backend", choices=("triton", "triton-hybrid", "triton-fused", "torch"),
                    help="force fastrl's backend")
    ap.add_argument("--no-plots", action="store_true", help="write JSON and CSV only")


def _workload_options(ap: argparse.ArgumentParser) -> None:
    """Options of the commands that measure workloads x providers."""
    ap.add_argument("--workload", help="comma list: names (W1, C1, tokens-4096), 'W1' also picks W1-lp; "
                                       "groups core, sweeps, sweep-tokens, sweep-vocab, sweep-hidden")
    ap.add_argument("--providers", help=f"comma list of {', '.join(P.PROVIDERS)} (default: all; c1: {C1_PROVIDERS})")
    ap.add_argument("--sets", type=int, help="input sets rotated through the repetitions (CPU 2, CUDA 3)")


def _w4_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lengths", help="W4: comma list of completion lengths (default: by device and mode)")
    ap.add_argument("--budget-mb", type=float, help="W4: step-memory budget in MB for 'longest that fits'")


@dataclass(frozen=True)
class Command:
    name: str
    summary: str  # one line in `python -m bench --help`
    description: str  # the head of `python -m bench NAME --help`
    options: tuple[Callable[[argparse.ArgumentParser], None], ...]
    run: Callable[[argparse.Namespace, str, object], int]  # (args, device, console) -> exit status


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", title="commands", metavar="COMMAND",
                            help="what to measure (default: run); `python -m bench COMMAND --help` lists its options")
    for c in COMMANDS.values():
        sp = sub.add_parser(c.name, help=c.summary, description=c.description,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        for add in c.options:
            add(sp)
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
    # options a command does not take read as unset in the shared code below
    for name in ("quick", "smoke", "no_plots"):
        setattr(args, name, getattr(args, name, False))
    for name in ("out", "device", "workload", "providers", "reps", "warmup", "sets", "timeout", "jobs",
                 "fastrl_backend", "lengths", "budget_mb"):
        setattr(args, name, getattr(args, name, None))
    args.threads = getattr(args, "threads", 0)
    return args


def _config(args, device: str) -> lmhead.RunConfig:
    cuda = device == "cuda"
    cfg = lmhead.RunConfig(command=args.command, device=device)
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
    cfg.mode = report.mode(args)
    for a, f in (("reps", "reps"), ("warmup", "warmup"), ("sets", "n_sets"), ("timeout", "timeout_s"), ("jobs", "jobs")):
        if getattr(args, a) is not None:
            setattr(cfg, f, getattr(args, a))
    cfg.threads = args.threads
    if args.fastrl_backend:
        cfg.options = {**cfg.options, "fastrl_backend": args.fastrl_backend}
    return cfg


def _workloads(args, device: str) -> list[W.Workload]:
    if args.command == "c1":
        wls = [W.C1, W.C1_LOSS]
    elif args.command == "gpu":
        wls = [w for w in W.gpu_workloads() if w.name in GPU_WORKLOADS or w.group.startswith("sweep-loss")]
    elif args.smoke:
        wls = W.smoke_workloads()
    else:
        wls = W.gpu_workloads() if device == "cuda" else W.cpu_workloads(args.quick)
    if args.smoke and args.command != "run":
        wls = [W.tiny(w) for w in wls]
    spec = _without_w4(args.workload)
    if spec and args.command == "gpu":  # the divergence has its own workloads (_gpu_divergence)
        spec = ",".join(k for k in spec.split(",") if k.strip().lower() != "divergence")
    if args.workload and not spec:
        return []  # --workload W4 (or divergence) alone
    return W.select(wls, spec)


def _is_w4(key: str) -> bool:
    return key.strip().lower().split("-")[0] == "w4"


def _without_w4(spec: str | None) -> str | None:
    return ",".join(k for k in spec.split(",") if k.strip() and not _is_w4(k)) if spec else spec


def _want_w4(args, device: str) -> bool:
    """Whether this command measures W4 too: `w4`, and `run` (full; --quick if W4_IN_QUICK; --smoke when named)."""
    if args.command == "w4":
        return True
    if args.command != "run":
        return False
    if args.workload:
        return any(_is_w4(k) for k in args.workload.split(","))
    return not args.smoke and (not args.quick or W4_IN_QUICK)


def _list(args, device: str, con) -> int:
    con.print(f"[bold]device[/bold]: {report.device_name(device)}")
    for title, wls in (("GPU workloads", W.gpu_workloads()), ("CPU workloads (--quick)", W.cpu_workloads(True)),
                       ("CPU workloads", W.cpu_workloads(False))):
        con.print(f"\n[bold]{title}[/bold]")
        for w in wls:
            shape = f"N={w.N} H={w.H} V={w.V} {w.dtype}"
            con.print(f"  {w.name:<14} {w.kind:<8} {shape:<36} {w.note}")
        mode = "full" if title == "GPU workloads" or "quick" not in title else "quick"
        s = w4.shape_for("cuda" if title == "GPU workloads" else "cpu", mode)
        con.print(f"  {s.name:<14} {'trainer':<8} {f'V={s.vocab} H={s.hidden} L={s.layers} {s.dtype}':<36} "
                  f"{s.note}; {s.completions} x {'/'.join(map(str, s.lengths))} tokens, budget {s.budget_mb:.0f} MB")
    con.print("\n[bold]providers[/bold] (on this device, C1 / W1 at CPU size / W3)")
    probe = [W.C1] + [w for w in W.cpu_workloads(True) if w.name in ("W1", "W3")]
    for p in P.PROVIDERS.values():
        why = [p.unavailable(w, device) for w in probe]
        txt = "; ".join(f"{w.kind}: {y[0]} ({y[1]})" if y else f"{w.kind}: runs" for w, y in zip(probe, why))
        con.print(f"  {p.name:<14} {p.label}\n  {'':<14} [dim]{txt}[/dim]")
    return 0


def _gpu_targets(rows: list[dict], con) -> dict:
    """GPU_TARGETS against the rows of this run: each (workload, provider, ratio) with its value and PASS/FAIL."""
    out = {}
    for key, checks in GPU_TARGETS.items():
        wl_rows = [r for r in rows if r["workload"] == key or r["group"] == key]
        for wl_name in dict.fromkeys(r["workload"] for r in wl_rows):
            for prov, ratio, limit in checks:
                r = next((r for r in wl_rows if r["workload"] == wl_name and r["provider"] == prov), None)
                if "@" in ratio:  # against another workload's TRL row
                    other = ratio.split("@")[1]
                    base = next((x for x in rows if x["workload"] == other and x["provider"] == "trl"
                                 and x["status"] == "ok"), None)
                    ok = r is not None and r["status"] == "ok" and base is not None and base["peak_extra_mb"] > 0
                    value = r["peak_extra_mb"] / base["peak_extra_mb"] if ok else None
                else:
                    value = None if r is None else r.get(ratio)
                res = {"provider": prov, "ratio": ratio, "target": limit, "value": value,
                       "pass": value is not None and value <= limit}
                out.setdefault(wl_name, []).append(res)
                what = f"{wl_name}: {prov} {ratio.replace('_vs_', ' vs ').replace('@', ' at ')}"
                if value is None:
                    why = "did not run" if r is None or r["status"] != "ok" else "no TRL row to compare with"
                    con.print(f"[yellow]{what}: not evaluated ({why}); target <= {limit:.2f}[/yellow]")
                else:
                    verdict = "[green]PASS[/green]" if res["pass"] else "[red]FAIL[/red]"
                    con.print(f"{what} = {value:.2f}x (target <= {limit:.2f}x): {verdict}")
    _fastest_paths(rows, con)
    return out


def _fastest_paths(rows: list[dict], con) -> dict[str, list[tuple[str, float]]]:
    """Per workload, fastrl's paths (the fastrl* providers) from fastest to slowest, as time vs TRL's in the same
    run: the evidence for backend.choose_triton and for which path a loss should take at that shape."""
    ranked: dict[str, list[tuple[str, float]]] = {}
    for r in rows:
        ratio = r.get("time_vs_trl")
        if r["provider"].startswith("fastrl") and r["status"] == "ok" and ratio is not None:
            ranked.setdefault(r["workload"], []).append((r["provider"], ratio))
    for wl_name, paths in ranked.items():
        paths.sort(key=lambda p: p[1])
        con.print(f"{wl_name} fastest fastrl path: " + ", ".join(f"{p} {x:.2f}x" for p, x in paths) + " (vs trl)")
    return ranked


def _c1_targets(rows: list[dict], con) -> dict:
    """The CPU targets, per workload (C1_TARGETS): time and extra peak memory as ratios of torch's.

    C1: fastrl (path A) extra peak <= 10% of torch's, time <= 1.1x (issue 26; 1.2x before). C1-loss:
    fastrl.policy_loss (one pass) extra peak <= 10% of torch's, time <= 1.0x.
    """
    out = {}
    for wl_name in dict.fromkeys(r["workload"] for r in rows):
        key = wl_name.removesuffix("-smoke")
        if key not in C1_TARGETS:
            continue
        prov, t_max, m_max = C1_TARGETS[key]
        fr = next((r for r in rows if r["workload"] == wl_name and r["provider"] == prov and r["status"] == "ok"), None)
        tr = next((r for r in rows if r["workload"] == wl_name and r["provider"] == "torch" and r["status"] == "ok"),
                  None)
        if fr is None or tr is None:
            con.print(f"[red]{wl_name} targets: cannot evaluate ({prov} or torch did not run)[/red]")
            out[wl_name] = {"provider": prov, "evaluated": False}
            continue
        if fr["kind"] == "loss":  # no float64 check for the loss workloads: at least the providers agree on the value
            vals = {r["provider"]: r["loss_value"] for r in rows
                    if r["workload"] == wl_name and r["status"] == "ok" and "loss_value" in r}
            ref = vals.get("torch")
            con.print(f"{wl_name} loss values: " + ", ".join(
                f"{p} {v:+.6f}" + (f" (|d| {abs(v - ref):.1e})" if p != "torch" else "") for p, v in vals.items())
                + ("; liger has no entropy term" if "liger-fused" in vals else ""))
        mem, tim = fr.get("mem_vs_torch"), fr.get("time_vs_torch")
        res = {"provider": prov, "evaluated": True,
               "mem_ratio": mem, "mem_target": m_max, "mem_pass": mem is not None and mem <= m_max,
               "time_ratio": tim, "time_target": t_max, "time_pass": tim is not None and tim <= t_max}
        # a fresh process's first step (lazy imports included), reported next to the targets, not judged by them
        if fr.get("first_step_ms") and tr.get("first_step_ms"):
            res["first_step_time_ratio"] = fr["first_step_ms"] / tr["first_step_ms"]
            res["first_step_extra_mb"] = fr["first_step_extra_mb"]
            con.print(f"{wl_name} first step of a fresh process, {prov}: {fr['first_step_ms']:.0f} ms "
                      f"({res['first_step_time_ratio']:.2f}x torch's {tr['first_step_ms']:.0f} ms), "
                      f"{fr['first_step_extra_mb']:.0f} MB extra peak RSS (torch {tr['first_step_extra_mb']:.0f} MB)")
        out[wl_name] = res
        for what, tgt, ok, unit in (
            ("extra peak RSS", f"<= {100 * m_max:.0f}% of torch's", res["mem_pass"],
             f"{100 * mem:.1f}% of torch's" if mem is not None else "?"),
            ("fwd+bwd time", f"<= {t_max:.1f}x torch's", res["time_pass"],
             f"{tim:.2f}x torch's" if tim is not None else "?"),
        ):
            verdict = "[green]PASS[/green]" if ok else "[red]FAIL[/red]"
            con.print(f"{wl_name} target, {prov} {what}: {unit} (target {tgt}): {verdict}")
    return out


def _sass_options(ap: argparse.ArgumentParser) -> None:
    """Here, not in bench/sass.py: that module refuses to import under TRITON_INTERPRET (``python -m bench.sass``
    has its own parser)."""
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100 / H200)")
    ap.add_argument("--only", help="only kernels whose name contains this")
    ap.add_argument("--checked-only", action="store_true", help="only the variants the check covers")


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


def _divergence_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--beta", help="comma list of betas (default 0,0.5,1)")
    ap.add_argument("--tokens", type=int, help="tokens N (default: by device; results go to divergence-nN.json)")
    ap.add_argument("--providers", help=f"comma list of {', '.join(divergence.PROVIDERS)} (default all)")


def _gpu_divergence(args, device: str, con) -> dict | None:
    """`bench gpu` measures the divergence too (bench/divergence.py), unless --workload leaves it out."""
    if args.workload and "divergence" not in [k.strip().lower() for k in args.workload.split(",")]:
        return None
    wls = divergence.workloads(device, smoke=args.smoke)
    rows = divergence.run(wls, list(divergence.PROVIDERS), device, reps=args.reps or 3, warmup=args.warmup or 2,
                          n_sets=1 if args.smoke else 2, timeout_s=args.timeout or 1200, threads=args.threads,
                          options={"fastrl_backend": args.fastrl_backend} if args.fastrl_backend else {},
                          rep_ms=50 if args.smoke else 500 if args.quick else 2000, console=con)
    return {"rows": rows, "targets": divergence.targets(rows, device, None)}


def _w5_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workload", help="W5: comma list of architectures (0.5B,1.5B; default both)")
    ap.add_argument("--providers", help="W5: comma list of configurations: trl, fastrl, fastrl+offload, fastrl+tiled, "
                                        "fastrl+both (default all)")
    ap.add_argument("--lengths", help="W5: comma list of completion lengths to search (default: by device and mode)")
    ap.add_argument("--budget-mb", type=float, help="W5: one step-memory budget in MB (default: 24 and 80 GiB on CUDA)")


def _targets_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("paths", nargs="+", help="result files (session*.json, gpu*.json, or gpu*.rows.jsonl of a run "
                                             "stopped part-way) or folders holding them")


def _load_rows(path: Path) -> list[dict]:
    """One run's rows: its JSON when it finished, else the rows it appended as it went (without ratios)."""
    if path.suffix == ".json":
        rows = json.loads(path.read_text()).get("rows", [])
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if r.get("group") != "floor"]


def _session_targets(files: list[Path], con) -> None:
    """A session file's targets, recomputed from its rows (bench/session_report.py)."""
    from bench.session_report import add_ratios, targets

    for f in files:
        data = json.loads(f.read_text())
        add_ratios(data["rows"])
        con.print(f"[bold]{f}[/bold] ({data['env'].get('device')}, fastrl {str(data['env'].get('fastrl_commit'))[:10]})")
        targets(data["rows"], con, smoke=data.get("smoke", False))


def _targets_command(args, device: str, con) -> int:
    """The GPU targets over several runs (e.g. the stages of bench/gpu_session.sh): ratios within each run."""
    files: list[Path] = []
    sessions: list[Path] = []
    for p in map(Path, args.paths):
        if not p.exists():
            con.print(f"[red]{p}: no such file or folder[/red]")
            return 2
        if p.is_dir() or p.name.startswith("session"):
            sessions += sorted(p.rglob("session*.json")) if p.is_dir() else [p]
            if not p.is_dir():
                continue
        found = sorted(p.rglob("gpu*.json")) + sorted(p.rglob("gpu*.rows.jsonl")) if p.is_dir() else [p]
        # a run that finished has both files: its JSON is the whole record
        done = {f.with_suffix("") for f in found if f.suffix == ".json"}
        files += [f for f in found if f.suffix == ".json" or f.with_suffix("").with_suffix("") not in done]
    if sessions:
        _session_targets(sessions, con)
    if not files:
        if sessions:
            return 0
        con.print(f"[red]no session*.json, gpu*.json or gpu*.rows.jsonl under {', '.join(args.paths)}[/red]")
        return 2
    rows = []
    for f in files:
        run_rows = _load_rows(f)
        lmhead.add_ratios(run_rows)  # against the TRL row of the same run only
        rows += run_rows
        con.print(f"{f}: {len(run_rows)} rows")
    _gpu_targets(rows, con)
    return 0


def _measure_w4(args, device: str, cfg, con) -> tuple[list, dict, float]:
    """W4 in `run` and `w4`: its rows, its summary (with its seconds) and its seconds."""
    shape = w4.with_overrides(w4.shape_for(device, cfg.mode), args.lengths, args.budget_mb)
    t1 = time.perf_counter()
    # one timed step per point on CPU (a step at 2048 tokens takes seconds), three on CUDA
    rows, summary = w4.run(
        shape, device, con, reps=args.reps or (3 if device == "cuda" else 1),
        warmup=args.warmup if args.warmup is not None else 1,
        timeout_s=args.timeout or (1200 if device == "cuda" else 900), threads=cfg.threads,
        options=cfg.options, jobs=cfg.jobs)
    summary["elapsed_s"] = time.perf_counter() - t1
    return rows, summary, summary["elapsed_s"]


def _summary(args, cfg, env, rows, info, con) -> dict:
    """The summary table of W1-W3 / C1 rows, the floor, and the command's targets (the payload's ``targets``)."""
    title = (f"{args.command} ({cfg.mode}) on {env['device']} | torch {env['torch']} | triton {env['triton']} | "
             f"driver {env['driver']} | ms: median of {cfg.reps if cfg.device == 'cpu' else 'do_bench'} runs")
    report.print_table(con, rows, title)
    for dt, f in info["floor_tflops"].items():
        con.print(f"matmul floor ({dt}, {'x'.join(map(str, cfg.floor_shape))}), measured in this run: "
                  f"{f:.3f} TFLOP/s; '% floor' = (6NHV / floor) / time (2NHV for forward-only)")
    measured = [r for r in rows if r["group"] != "floor"]
    if args.command == "c1":
        return {"targets": _c1_targets(measured, con)}
    if args.command == "gpu" and not args.smoke:
        return {"targets": _gpu_targets(measured, con)}
    return {}


def _w4_summary(args, cfg, env, rows, summary, con) -> None:
    s = w4.W4Shape.from_dict(summary["shape"])
    reps = summary["reps"]
    title = (f"{s.name} ({cfg.mode}): one GRPO training step (compute_loss + backward), V={s.vocab} "
             f"H={s.hidden} layers={s.layers} {s.dtype} | {env['device']} | torch {env['torch']} | "
             f"driver {env['driver']} | step ms: {'median of ' + str(reps) if reps > 1 else 'one'} timed step"
             f"{'s' if reps > 1 else ''} after a warm-up")
    w4.print_table(con, rows, summary, title)


def _measure(args, device: str, con) -> int:
    """run, c1, gpu, w4: measure, print the summary last, write the files."""
    if args.command == "gpu" and device != "cuda" and not args.smoke:
        con.print("[red]`python -m bench gpu` measures W1-W3 at full size and needs CUDA; on CPU use "
                  "`python -m bench --quick` or `python -m bench c1` (or add --smoke to check the plumbing)[/red]")
        return 2
    cfg = _config(args, device)
    wls = [] if args.command == "w4" else _workloads(args, device)
    want_w4 = _want_w4(args, device)
    provs = P.select(args.providers or (C1_PROVIDERS if args.command == "c1" else None))
    env = report.environment(device)
    out_dir = report.out_dir(args, env["device_slug"], args.command)
    prefix = report.prefix(args.command, args)
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
    div = _gpu_divergence(args, device, con) if args.command == "gpu" else None
    elapsed = time.perf_counter() - t0
    w4_rows, w4_sum, w4_s = _measure_w4(args, device, cfg, con) if want_w4 else ([], None, 0.0)
    payload = {"command": args.command, "mode": cfg.mode, "argv": args.argv, "env": env, "config": asdict(cfg),
               **info, "elapsed_s": elapsed + w4_s, "workloads": [w.to_dict() for w in wls], "rows": rows,
               **({"w4": {**w4_sum, "rows": w4_rows}} if want_w4 else {}),
               **({"divergence": div} if div is not None else {})}
    plots = [] if args.no_plots or not rows else report.plot(rows, out_dir, prefix, env)
    written = [out_dir / f"{prefix}.json"]
    con.print()  # the summary is printed last
    if rows:
        payload.update(_summary(args, cfg, env, rows, info, con))
        report.write_csv(out_dir / f"{prefix}.csv", rows, env)
        written.append(out_dir / f"{prefix}.csv")
    if div is not None:
        con.print()
        divergence.print_table(con, div["rows"], f"divergence on {env['device']} (student vs teacher head)")
        if not args.smoke:
            divergence.targets(div["rows"], device, con)
    if want_w4:
        if rows:
            con.print()
        _w4_summary(args, cfg, env, w4_rows, w4_sum, con)
        w4_prefix = prefix if args.command == "w4" else f"{prefix}-w4"
        written += w4.write_files(out_dir, w4_prefix, w4_rows, w4_sum, env, plots=not args.no_plots)
    report.write_json(written[0], payload)
    con.print("wrote " + ", ".join(str(p) for p in written + plots) + f"  ({elapsed + w4_s:.0f} s)")
    if args.command == "gpu" and not args.workload and not args.providers:  # the whole GPU set: keptset too
        con.print()
        _lazy("keptset", "cli")(args, device, con)
    bad = [r for r in rows + w4_rows if r["status"] == "error"]
    return 1 if bad and args.smoke else 0


# A new command: an option function for what only it takes (if anything), a handler (args, device, console) ->
# exit status, and a Command below; `python -m bench NAME --help` and the command list follow from it.
_MEASURE_OPTIONS = (_run_options, _workload_options)
COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("run", "every workload for this device (the default command)",
            "Every workload for this device: W1-W3 at GPU sizes (bf16) on CUDA; CPU-scaled W1-W3 and the token,\n"
            "vocabulary and hidden-size sweeps on a CPU; and W4 in a full run (with --quick or --smoke only when\n"
            "--workload names it). `python -m bench --quick` is `python -m bench run --quick`.",
            (*_MEASURE_OPTIONS, _w4_options), _measure),
    Command("c1", "C1 and C1-loss on CPU against the CPU targets",
            "C1 (log-prob + entropy, N=4096, H=512, V=32768, float32, forward + backward) and C1-loss (the same\n"
            "shapes through a dapo loss) on the CPU: fastrl, materialised torch, TRL 1.16 and Liger, with the CPU\n"
            "targets: C1 fastrl extra peak <= 10% of torch's and time <= 1.1x; C1-loss fastrl.policy_loss extra\n"
            "peak <= 10% and time <= 1.0x. About 5-6 minutes on 2 cores.",
            _MEASURE_OPTIONS, _measure),
    Command("gpu", "W1-W3 at full size, every provider, with the GPU targets (needs CUDA)",
            "W1-W3 at full size for every provider (W1 and W2 as a GRPO loss and as log-probs, -lp), W1 with a frozen\n"
            "head, and W1 / W2 as losses at 2k-16k tokens; then the targets as ratios against TRL in the same run\n"
            "(W1 <= 0.75x, W2 <= 0.85x at every token count, W3 <= 0.95x, W1-lp <= 0.95x, W2-lp <= 0.9x; memory\n"
            "W1 <= 1.5x, W1-lp "
            "and W1-frozen <= 0.2x). Refuses to run without CUDA (with --smoke it runs tiny shapes anywhere).\n"
            "About 30 minutes on an H100 for everything; pick with --workload / --providers to fit a time budget.",
            _MEASURE_OPTIONS, _measure),
    Command("w4", "W4: one GRPOTrainer step, stock TRL vs fastrl, per completion length",
            "W4: one GRPO training step (compute_loss + backward) of stock trl.GRPOTrainer and fastrl.GRPOTrainer\n"
            "per completion length, each in a fresh process: peak extra memory, step time, and the longest\n"
            "completion whose step fits --budget-mb. CUDA: Qwen2.5-0.5B architecture, bf16, 8 completions of\n"
            "4k-16k tokens; CPU: scaled down (H=256, 1 layer, float32, 2 completions of 256-2048 tokens).",
            (_run_options, _w4_options), _measure),
    Command("w5", "W5: the longest completion whose GRPO step fits a memory budget, per trainer and option set",
            "W5: per architecture (Qwen2.5-0.5B, 1.5B from configs, random init) and configuration (stock TRL, fastrl,\n"
            "fastrl with activation offloading, with the MLP tiled over 8 chunks, with both), the longest completion\n"
            "whose GRPO step (8 completions on CUDA, bf16) fits the budget (24 and 80 GiB on CUDA; a CPU-scaled variant\n"
            "in peak RSS), each point in a fresh process. Writes JSON / CSV and a plot of step memory against length.\n"
            "A full GPU run is long: split it with --workload and --providers.",
            (_run_options, _w5_options), w5.cli),
    Command("keptset", "the LM head over a kept set (K = 20, 64, 512) vs the full vocabulary",
            "fastrl.fused_logprobs forward + backward with support=KeptSet (K ids per token: Zipf-distributed ids that\n"
            "recur across tokens, and uniformly random disjoint ones) and with support=SamplerRule(top_k=64), against\n"
            "the full-vocabulary path on the same inputs, each point in a fresh process: time, extra peak memory and\n"
            "their ratios. V=151936; CPU: N=1024, H=512, float32 (85 s on a quiet 2-core machine with --threads 1, the\n"
            "run in bench/results/; 14 min once on a 2-core machine shared with other jobs); CUDA: W1 and W2 shapes,\n"
            "bf16 (also run at the end of `python -m bench gpu`). Target: K=64 fwd+bwd <= 0.1x the full path.",
            (_run_options,), _lazy("keptset", "cli")),
    Command("divergence", "student vs teacher head: fused_divergence vs TRL, Liger and torch, beta 0/0.5/1",
            "The per-token divergence between a student's and a teacher's LM head (bench/divergence.py), forward +\n"
            "backward, beta 0 (forward KL), 0.5 (TRL's generalized JSD), 1 (reverse KL): fastrl.fused_divergence,\n"
            "TRL 1.16's ChunkedDivergenceFunction, Liger's LigerFusedLinearJSD (CUDA) and materialised torch; time,\n"
            "extra memory and error against float64, with issue 21's targets (CPU: <= 0.7x TRL's time at <= 0.5x its\n"
            "extra memory; GPU: <= 0.8x TRL's time). CUDA: N=16384, H=896, teacher 1536, V=151936, bf16; CPU:\n"
            "N=1024 (--quick 512), H=256, teacher 384, V=65536, float32.",
            (_run_options, _divergence_options), divergence.cli),
    Command("gap", "the vLLM-trainer log-prob gap: TRL, fastrl, fastrl + vLLM float32 head; replay off and on",
            "The gap between vLLM's log-probs of the sampled tokens and the trainer's (TRL's metrics\n"
            "sampling/sampling_logp_difference/* and the IS ratio) with TRL's colocated vLLM on a tiny Qwen2: stock\n"
            "trl.GRPOTrainer, fastrl.GRPOTrainer, and fastrl with vLLM's LM head in float32, sampling replay off and\n"
            "kept_set, for a float32 and a bf16 policy (bench/gap.py). Needs vLLM: run it with the python that\n"
            "`bash .ci/vllm-env.sh` prints. About 10 minutes on 2 cores (--quick: a smaller model, one step).",
            (_run_options, _lazy("gap", "add_options")), _lazy("gap", "command")),
    Command("compile", "a training step with fastrl inside torch.compile vs eager vs compiled materialised reference",
            "One training step (an MLP body, the LM head and the W1 GRPO loss, backward, SGD) with fastrl.policy_loss\n"
            "eager and under torch.compile(fullgraph=True), against the materialised reference eager and compiled;\n"
            "on CUDA also mode='reduce-overhead' (CUDA graphs). See bench/compiled_step.py. CPU: a few minutes.",
            (_lazy("compiled_step", "add_options"),), _lazy("compiled_step", "command")),
    Command("list", "workloads and providers, and why a provider cannot run here",
            "The workloads (GPU and CPU sizes), the providers, and why a provider cannot run on this device.",
            (_device_option,), _list),
    Command("targets", "the GPU targets over the result files of several runs",
            "Reads the rows of finished runs (gpu*.json) or of runs stopped part-way (gpu*.rows.jsonl), computes the\n"
            "ratios against TRL within each run, and prints the GPU targets PASS/FAIL, as `python -m bench gpu` does\n"
            "at the end of one run. For a measurement split into stages (bench/gpu_session.sh).",
            (_targets_options,), _targets_command),
    Command("session", "everything a GPU window measures, in one command sized to a time budget",
            "One command for a short GPU window (bench/session.py): the float64 checks of every Triton implementation,\n"
            "W1-W3 for each implementation, launch configuration and FASTRL_AUTOTUNE=1 next to TRL and the cuBLAS\n"
            "floor in one process, keptset K=64, divergence beta 0/0.5/1, compile with and without CUDA graphs, W4 at\n"
            "4096 tokens; one process per provider family, rows written as they finish. --budget S (default 480)\n"
            "drops whole sections, last first, to fit. Writes <out>/session.json and prints PASS/FAIL per target.\n"
            "--smoke: the same plumbing on a CPU at tiny shapes.",
            (_lazy("session", "add_options"),), _lazy("session", "command")),
    Command("defaults", "the measured defaults table (kernels/_defaults.py) from committed session results",
            "Reads every session*.json under the folders given (default bench/results) and writes kernels/_defaults.py:\n"
            "per GPU family, kind of work, dtype and H range, the implementation and launch configurations that were\n"
            "fastest in the family's newest GPU session of a clean tree, among those that passed its float64 checks;\n"
            "what backend='auto' and the kernels' launch configuration follow. --check: exit 1 if the file is stale.",
            (_lazy("defaults", "add_options"),), _lazy("defaults", "command", device=False)),
    Command("sass", "compile every kernel for sm_90 without a GPU; fail on spills or missing HGMMA",
            "Compiles every fastrl kernel at its default launch configuration for a GPU target (no GPU needed) and\n"
            "prints registers, stack, spill loads/stores, shared memory, tensor-core (HGMMA) and TMA instruction\n"
            "counts. Exits 1 when a checked kernel spills or a bf16/fp16 matmul kernel has no HGMMA (sm_90).",
            (_sass_options,), _lazy("sass", "command", device=False)),
    Command("roofline", "bytes moved and FLOPs of every implementation per workload, and the time they imply",
            "A model, no GPU: per workload (W1, W1-lp, W2, W2-lp, W3, divergence, kept set K=64) and\n"
            "implementation (cuBLAS floor, TRL, fastrl's hybrid, fused and triton-sm90 kernels, the kept-set\n"
            "engine, designs on paper) the FLOPs and the HBM bytes beyond one read of the inputs, the time they\n"
            "imply at 700 TFLOP/s and 4.3 TB/s, the measured time where a committed bench/results session.json has\n"
            "one (else 'not measured'), and per target of issue 33 the design that meets it on paper, or none.\n"
            "See bench/roofline.py and docs/roofline.md.",
            (_lazy("roofline", "add_options"),), _lazy("roofline", "command", device=False)),
)}


if __name__ == "__main__":
    sys.exit(main())
