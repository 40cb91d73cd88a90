"""``python -m bench session``: everything a GPU window should measure, in one command sized to the window.

A lent GPU is here for about 15 minutes, machine start included, at most 10 minutes a command. One fresh process
per measured point (``python -m bench gpu``: about 30 minutes for everything) cannot use that; this runs one
process per provider family, rows appended (flushed) as they finish, sections in a fixed order of value:

1. ``checks``: every Triton implementation (each name of ``fastrl.ops.backend.CONCRETE`` that runs on CUDA),
   compiled, against float64 (``bench/session_checks.py``); an implementation that fails cannot become a default;
2. ``tournament``: W1, W1-lp, W2, W2-lp, W3 for every implementation at its default launch configuration (W1/W2
   both as ``policy_loss``, the one-pass op, and as ``fused_logprobs`` + the loss math, two-pass), next to TRL
   1.16 and the cuBLAS floor of the same GEMMs, in one process (``bench/session_points.py``);
3. ``configs``: the same for every candidate launch configuration (``fastrl.kernels.tuning.CANDIDATES``, forced
   with ``forced_config``) of every implementation whose kernels take one, log-prob workloads first; a candidate
   1.3x slower than the default at its H's log-prob workload is pruned there;
4. ``autotune``: the same with ``FASTRL_AUTOTUNE=1``;
5. ``keptset``: the LM head over kept sets of K=64 ids (Zipf and uniform) against the full head, W1 and W2 shapes;
6. ``divergence``: ``fused_divergence`` against TRL (and Liger when installed) at beta 0, 0.5 and 1;
7. ``compile``: a training step with fastrl under ``torch.compile``, with and without CUDA graphs, and eager;
8. ``w4``: one GRPOTrainer step, stock TRL against fastrl, 8 completions of 4096 tokens.

Sections 2-4 share a process (same inputs, float64 references and TRL rows). ``--budget S`` (default 480 s on a
GPU: 8 minutes, so that one 10-minute command also installs the wheels and packs the results) is split by the
estimates below: sections are dropped whole, last first (w4, compile, divergence, keptset, autotune, configs), until
the rest fits, and the command says which; each kept section gets a deadline that leaves the later ones their
estimated time, a point past it is skipped, a process past it killed. ``--sections`` runs named sections only (the
second call of a window: what the first dropped). ``--smoke`` runs the same plumbing on a CPU at tiny shapes, the
Triton kernels interpreted (a test runs it).

Estimates on an H100/H200 (seconds; from the H200 run of main 8f83654 in bench/results/nvidia-h200/2026-11-26-8f83654/
unless marked as assumed): a process starts in 7 (its divergence rows: 20.6 s in the process, 14.0 measuring);
TRL's imports add 12 (29.1 - 10.1 - 7). A point runs 9 steps (2 warm-up, 1 for memory, 6 timed) plus 0.3 s
(inputs, the float64 error): W1 9 x 0.130 + 0.3 = 1.5, W1-lp 1.5, W2 / W2-lp / W3 0.6-0.7 (steps of 38-40 and 36
ms). With two implementations: checks 7 + 2 x 20 = 47 (8 cases per implementation, mostly Triton compiling; the
CUDA tests ran 344 cases for two in 86); tournament 24 points = 24 s + 7 + 12 + 2 (float64 loss references) + 3 =
48; configs 6 candidates x (8 compiling + 7 points = 7 s) = 90 per implementation that takes configurations;
autotune 20 (each candidate timed per kernel and shape) + 7 = 27 per such implementation; keptset 20; divergence
7 + 12 + 9 points x 1.25 + 9 compiling = 39; compile 7 + 2 + 2 x 47 = 103 (inductor's compile assumed 40 s per
compiled variant: not yet measured on a GPU; 8.3 s on a quiet 2-core CPU); w4 2 x 35 = 70 (its processes took 38-44
s at 16384 tokens, 10 of them in steps). Total 444 s: everything fits 480 with today's two implementations; a third
that takes configurations adds 20 + 7 + 90 + 27 = 144 and w4 and compile move to the second call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["DROP_ORDER", "GPU_COSTS", "SECTIONS", "SMOKE_COSTS", "Costs", "add_options", "command", "deadlines",
           "estimate", "plan_budget", "points", "run_family"]

REPO_ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("checks", "tournament", "configs", "autotune", "keptset", "divergence", "compile", "w4")
DROP_ORDER = ("w4", "compile", "divergence", "keptset", "autotune", "configs")  # checks and tournament always run
FAMILY = {"checks": "checks", "tournament": "lmhead", "configs": "lmhead", "autotune": "lmhead",
          "keptset": "keptset", "divergence": "divergence", "compile": "compile", "w4": "w4"}
WORKLOAD_ORDER = ("W1", "W1-lp", "W2", "W2-lp", "W3")
CONFIG_ORDER = ("W1-lp", "W2-lp", "W3", "W1", "W2")  # the log-prob workloads first: they decide the configurations
DEFAULT_BUDGET = {"cuda": 480.0, "smoke": 120.0}
RESTART = 3  # a measuring process exits with this after a CUDA fault: the parent starts a fresh one


@dataclass(frozen=True)
class Costs:
    """Seconds a section is expected to take (the module docstring says where the GPU numbers come from)."""
    process: float  # start a measuring process: imports, CUDA context
    trl_import: float
    check_impl: float  # the float64 checks of one implementation, compiling included
    jit_config: float  # compiling one implementation's kernels at one more configuration
    autotune_impl: float  # FASTRL_AUTOTUNE's own timing of the candidates, per implementation
    point: dict = field(default_factory=dict)  # workload -> one point (steps + overhead)
    references: float = 0.0  # float64 loss references of the tournament
    keptset: float = 0.0
    divergence_point: float = 0.0
    divergence_jit: float = 0.0
    compile_eager: float = 0.0
    compile_variant: float = 0.0
    w4_point: float = 0.0
    grace: float = 20.0  # a process killed this long after its last deadline


GPU_COSTS = Costs(process=7, trl_import=12, check_impl=20, jit_config=8, autotune_impl=20,
                  point={"W1": 1.5, "W1-lp": 1.5, "W2": 0.65, "W2-lp": 0.65, "W3": 0.6}, references=2 + 3,
                  keptset=13, divergence_point=1.25, divergence_jit=9, compile_eager=2, compile_variant=47,
                  w4_point=35, grace=20)
# a 2-core CPU, Triton interpreted: a third of what the CPU this was written on took at load average 7-10 (where the
# whole smoke run took 3-4 minutes; idle machines were not to be had)
SMOKE_COSTS = Costs(process=3, trl_import=5, check_impl=4, jit_config=0.5, autotune_impl=0,
                    point={w: 0.5 for w in WORKLOAD_ORDER}, references=0.3, keptset=5, divergence_point=1.5,
                    divergence_jit=0, compile_eager=4, compile_variant=6, w4_point=12, grace=20)


# ---------------------------------------------------------------------------------------------------------------
# What runs: points per section
# ---------------------------------------------------------------------------------------------------------------

def cuda_implementations() -> list[str]:
    """Every concrete backend that runs the Triton kernels (on CUDA; interpreted in a smoke run)."""
    from fastrl.ops.backend import CONCRETE, is_triton

    return [n for n in CONCRETE if is_triton(n)]


def candidates(smoke: bool) -> list[str]:
    from fastrl.kernels.tuning import CANDIDATES

    return [str(c) for c in (CANDIDATES[:2] if smoke else CANDIDATES)]  # smoke: two, the plumbing is the same


def _providers(kind: str) -> tuple[str, ...]:
    from bench.session_points import LOSS_PROVIDERS

    return LOSS_PROVIDERS if kind == "loss" else ("fastrl",)


def _kind(wl: str) -> str:
    return {"W1": "loss", "W2": "loss", "W3": "forward"}.get(wl, "logprob")


def points(section: str, *, smoke: bool, device: str, impls: list[str], tunable: list[str]) -> list[dict]:
    """The points of one section, in the order they run."""
    base = {"section": section, "smoke": smoke}
    out = []
    if section == "checks":
        from bench.session_checks import CASES, SMOKE_CASES

        for impl in impls:
            for c in SMOKE_CASES if smoke else CASES:
                out.append({**base, "workload": c.name, "provider": "fastrl", "implementation": impl})
    elif section == "tournament":
        for wl in WORKLOAD_ORDER:
            out += [{**base, "workload": wl, "provider": p} for p in ("cublas", "trl")]
            out += [{**base, "workload": wl, "provider": p, "implementation": i, "config": "default"}
                    for i in impls for p in _providers(_kind(wl))]
    elif section == "configs":
        for wl in CONFIG_ORDER[:2] if smoke else CONFIG_ORDER:  # smoke: the log-prob workloads (the same code)
            probe = None if wl.endswith("-lp") else ("W2-lp" if wl == "W2" else "W1-lp")
            out += [{**base, "workload": wl, "provider": p, "implementation": i, "config": c, "probe": probe}
                    for i in tunable for c in candidates(smoke) for p in _providers(_kind(wl))]
    elif section == "autotune":
        out += [{**base, "workload": wl, "provider": p, "implementation": i, "config": "autotune"}
                for i in tunable for wl in (CONFIG_ORDER[:2] if smoke else CONFIG_ORDER) for p in _providers(_kind(wl))]
    elif section == "keptset":
        from bench import keptset

        shapes = keptset.SMOKE_SHAPES if smoke else keptset.GPU_SHAPES
        V = 512 if smoke else keptset.V_FULL
        for name, N, H, dtype in shapes:
            spec = dict(shape=name, N=N, H=H, V=V, K=64, dtype=dtype)
            out += [{**base, "workload": f"keptset-{name}", "provider": prov, "spec": {**spec, **point}}
                    for prov, point in keptset.session_points(smoke)]
    elif section == "divergence":
        from bench import divergence

        for wl in divergence.workloads(device, smoke=smoke):
            out += [{**base, "workload": wl.name, "provider": p, "spec": asdict(wl)}
                    for p in ("fastrl", "trl", "liger")]
    elif section == "compile":
        variants = ["fastrl-eager", "fastrl-compile"] + (["fastrl-compile-ro"] if device == "cuda" else [])
        out += [{**base, "workload": "compile-step", "provider": v} for v in variants]
    elif section == "w4":
        out += [{**base, "workload": "W4", "provider": p} for p in ("trl", "fastrl")]
    for i, p in enumerate(out):
        p["id"] = f"{section}/{i}/{p['workload']}/{p['provider']}/{p.get('implementation', '')}/{p.get('config', '')}"
    return out


def estimate(section: str, c: Costs, pts: list[dict]) -> float:
    """Seconds this section should take (``Costs``), from its points; a process's start counted with its first
    section."""
    impls = {p.get("implementation") for p in pts}
    steps = sum(c.point.get(p["workload"], 0.0) for p in pts)
    if section == "checks":
        return c.process + len(impls) * c.check_impl
    if section == "tournament":
        return c.process + c.trl_import + c.references + steps
    if section == "configs":
        return len({(p["implementation"], p["config"]) for p in pts}) * c.jit_config + steps
    if section == "autotune":
        return len(impls) * c.autotune_impl + steps
    if section == "keptset":
        return c.process + c.keptset
    if section == "divergence":
        return c.process + c.trl_import + len(pts) * c.divergence_point + c.divergence_jit
    if section == "compile":
        return c.process + c.compile_eager + (len(pts) - 1) * c.compile_variant
    if section == "w4":
        return len(pts) * c.w4_point
    raise ValueError(f"unknown section {section!r}; one of {', '.join(SECTIONS)}")


def plan_budget(budget: float, estimates: dict[str, float], wanted: list[str],
                jobs: int = 1) -> tuple[list[str], list[tuple]]:
    """(the sections kept, in SECTIONS order; [(section, why)] dropped): whole sections dropped in DROP_ORDER until
    the estimates fit ``budget`` (the caller passes its budget less the grace a process gets past its deadline);
    with ``jobs`` > 1 (smoke runs) the sections after the checks share the time ``jobs`` at a time."""
    kept = [s for s in SECTIONS if s in wanted]
    dropped = []
    for s in DROP_ORDER:
        total = sum(estimates[k] for k in kept if k == "checks") + sum(
            estimates[k] for k in kept if k != "checks") / max(1, jobs)
        if total <= budget:
            break
        if s in kept:
            kept.remove(s)
            dropped.append((s, f"~{estimates[s]:.0f} s would not fit: {total:.0f} s estimated, budget {budget:.0f} s"))
    return kept, dropped


def deadlines(kept: list[str], estimates: dict[str, float], end: float, grace: float,
              jobs: int = 1) -> dict[str, float]:
    """Each section's deadline: the end of the budget less the grace and the later sections' estimated time (with
    ``jobs`` > 1 the sections after the checks run side by side: they share one deadline, and the checks leave them
    their time divided by ``jobs``)."""
    if jobs > 1:
        rest = sum(estimates[k] for k in kept if k != "checks") / jobs
        return {s: end - grace - (rest if s == "checks" else 0.0) for s in kept}
    out = {}
    for i, s in enumerate(kept):
        out[s] = end - grace - sum(estimates[k] for k in kept[i + 1:])
    return out


# ---------------------------------------------------------------------------------------------------------------
# Running a family: one process for many points, a fresh one after a crash
# ---------------------------------------------------------------------------------------------------------------

def _child_env(device: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # a smoke run interprets the Triton kernels on CPU tensors
    return env


def _read_rows(path: Path) -> tuple[list[dict], set[str]]:
    """(the rows written so far, the ids begun)."""
    rows, begun = [], set()
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if "begin" in r:
                begun.add(r["begin"])
            else:
                rows.append(r)
    return rows, begun


def run_family(name: str, pts: list[dict], dls: dict[str, float], device: str, work: Path, grace: float,
               con) -> list[dict]:
    """Every point of one family in as few processes as it takes: a process that dies (a CUDA fault is sticky) or
    outlives its deadline gives its point an error row, and a fresh one takes the points left."""
    rows_path = work / f"{name}.rows.jsonl"
    spec_path = work / f"{name}.spec.json"
    todo = list(pts)
    while todo:
        spec = {"device": device, "smoke": todo[0]["smoke"], "points": todo, "deadlines": dls, "rows": str(rows_path)}
        spec_path.write_text(json.dumps(spec))
        limit = max(dls[p["section"]] for p in todo) + grace - time.time()
        t0 = time.time()
        try:
            proc = subprocess.run([sys.executable, "-m", "bench.session_points", str(spec_path)], cwd=REPO_ROOT,
                                  env=_child_env(device), timeout=max(limit, 1), stderr=subprocess.PIPE, text=True,
                                  check=False)
            why = f"the {name} process died (exit code {proc.returncode}): " + (
                [ln for ln in proc.stderr.splitlines() if ln.strip()] or ["no output"])[-1][:300]
            killed = False
        except subprocess.TimeoutExpired:
            why, killed = f"killed at the section's deadline after {time.time() - t0:.0f} s in the {name} process", True
        rows, begun = _read_rows(rows_path)
        done = {r["id"] for r in rows}
        left = [p for p in todo if p["id"] not in done]
        if not left:
            break
        if not killed and proc.returncode == RESTART:  # it wrote its broken point's row and stopped: go on afresh
            todo = left
            continue
        stuck = left[0] if left[0]["id"] in begun else None
        if stuck is not None:  # the point that killed (or outlived) the process
            row = {k: stuck[k] for k in ("id", "section", "workload", "provider", "implementation", "config")
                   if k in stuck}
            with open(rows_path, "a") as f:
                f.write(json.dumps({**row, "status": "error", "reason": why}) + "\n")
            con.print(f"[red]  {stuck['id']}: {why}[/red]")
            left = left[1:]
        if killed or stuck is None:  # out of time, or died before its first point: the rest cannot run
            with open(rows_path, "a") as f:
                for p in left:
                    row = {k: p[k] for k in ("id", "section", "workload", "provider", "implementation", "config")
                           if k in p}
                    f.write(json.dumps({**row, "status": "skipped", "reason": why if stuck is None else
                                        "the section's time ran out (its process was stopped)"}) + "\n")
            break
        todo = left
    return _read_rows(rows_path)[0]


def run_w4(pts: list[dict], deadline: float, device: str, smoke: bool, grace: float, con) -> list[dict]:
    """W4 at 4096 tokens (smoke: its tiny model) through bench/w4.py: a process per trainer, as that command runs."""
    from bench import w4

    shape = w4.shape_for(device, "smoke" if smoke else "full")
    if not smoke:
        shape = w4.with_overrides(shape, "4096", None)
    left = deadline + grace - time.time()
    if left <= 10:
        return [{**{k: p[k] for k in ("id", "section", "workload", "provider")}, "status": "skipped",
                 "reason": "the section's time ran out (--budget)"} for p in pts]
    rows, _ = w4.run(shape, device, con, reps=1 if smoke else 3, warmup=1, timeout_s=int(left / 2))
    out = []
    for p in pts:
        r = next(x for x in rows if x["provider"] == p["provider"])
        row = {k: p[k] for k in ("id", "section", "provider")}
        row.update(workload=f"W4-{r['completion_len']}", status=r["status"], reason=r.get("reason", ""),
                   total_ms=r.get("step_ms"), extra_mb=r.get("peak_extra_mb"), loss_value=r.get("loss_value"),
                   tokens=r.get("tokens"), path=r.get("path"))
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------

def add_options(ap) -> None:
    ap.add_argument("--budget", type=float, help="seconds for the whole session (default 480 on a GPU, 120 with "
                                                 "--smoke); whole sections are dropped, last first, to fit")
    ap.add_argument("--sections", help=f"comma list of {', '.join(SECTIONS)} (default all; checks and tournament "
                                       "always run first when configs or autotune are named)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU (kernels interpreted): the plumbing")
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    ap.add_argument("--out", help="results folder (default bench/results/<device-slug>/; --smoke: a temporary one)")
    ap.add_argument("--name", default="session", help="file name stem (default session: <out>/session.json)")
    ap.add_argument("--jobs", type=int, help="processes at once after the checks (default 1; --smoke 2): above 1 "
                                             "they share the machine, so times are not comparable")


def _family(device: str) -> str:
    import torch

    from fastrl.kernels.tuning import device_family

    return device_family(torch.device(device))


def _wanted(spec: str | None) -> list[str]:
    if not spec:
        return list(SECTIONS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in SECTIONS]
    if bad:
        raise SystemExit(f"--sections: unknown {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    if {"configs", "autotune"} & set(names):  # they are judged against the tournament's rows of the same process
        names += ["tournament"]
    if {"tournament", "configs", "autotune"} & set(names):
        names += ["checks"]  # which implementations take configurations, and which may become defaults
    return [s for s in SECTIONS if s in names]


def command(args, device: str, con) -> int:
    from bench import report
    from bench.provenance import provenance
    from bench.session_report import add_ratios, print_summary, targets

    smoke = bool(args.smoke)
    if device != "cuda" and not smoke:
        con.print("[red]`python -m bench session` measures on a GPU; add --smoke to run its plumbing on a CPU[/red]")
        return 2
    costs = SMOKE_COSTS if smoke else GPU_COSTS
    budget = args.budget or DEFAULT_BUDGET["smoke" if smoke else "cuda"]
    jobs = args.jobs or (2 if smoke else 1)
    wanted = _wanted(args.sections)
    env = {**report.environment(device), **provenance(), "family": _family(device)}
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="fastrl-session-smoke-")) if smoke
                                           else REPO_ROOT / "bench" / "results" / env["device_slug"])
    # the rows, as each process appends them, next to the results: a run killed before it writes its JSON keeps them
    work = out / f"{args.name}-rows"
    work.mkdir(parents=True, exist_ok=True)
    for f in work.glob("*.rows.jsonl"):
        f.unlink()
    t_start = time.time()
    end = t_start + budget
    impls = cuda_implementations()
    con.print(f"[bold]fastrl bench session[/bold]{' (smoke)' if smoke else ''} on {env['device']} ({env['family']}): "
              f"torch {env['torch']}, triton {env['triton']}, driver {env['driver']}, fastrl "
              f"{env['fastrl_commit'][:10]} ({'clean' if env['tree_clean'] else 'NOT a clean tree'}); "
              f"implementations {', '.join(impls)}; budget {budget:.0f} s")
    rows: list[dict] = []

    def estimates(tunable: list[str]) -> dict[str, float]:
        return {s: estimate(s, costs, points(s, smoke=smoke, device=device, impls=impls, tunable=tunable))
                for s in SECTIONS}

    est = estimates(impls)  # before the checks say which implementations take configurations: all of them
    dropped: list[tuple] = []
    # the checks first and alone: which implementations take launch configurations decides the rest of the plan
    if "checks" in wanted:
        kept, _ = plan_budget(budget - costs.grace, est, wanted, jobs)
        dls = deadlines(kept, est, end, costs.grace, jobs)
        con.print(f"[bold]checks[/bold] (~{est['checks']:.0f} s)")
        rows += run_family("checks", points("checks", smoke=smoke, device=device, impls=impls, tunable=[]),
                           dls, device, work, costs.grace, con)
    tunable = sorted({r["implementation"] for r in rows if r["section"] == "checks" and r.get("configs_served")},
                     key=impls.index) if "checks" in wanted else impls
    est = estimates(tunable)
    est["checks"] = time.time() - t_start if "checks" in wanted else 0.0
    kept, dropped = plan_budget(budget - costs.grace, est, wanted, jobs)
    dls = deadlines(kept, est, end, costs.grace, jobs)
    con.print("plan: " + ", ".join(f"{s} ~{est[s]:.0f} s" for s in kept if s != "checks")
              + (f"; implementations taking launch configurations: {', '.join(tunable) or 'none'}"))
    for s, why in dropped:
        con.print(f"[yellow]dropped {s}: {why}; run it later with --sections {s}[/yellow]")

    families: dict[str, list[str]] = {}
    for s in kept:
        if s != "checks":
            families.setdefault(FAMILY[s], []).append(s)

    def one(fam: str) -> list[dict]:
        secs = families[fam]
        con.print(f"[bold]{fam}[/bold]: {', '.join(secs)}")
        if fam == "w4":
            return run_w4(points("w4", smoke=smoke, device=device, impls=impls, tunable=tunable), dls["w4"], device,
                          smoke, costs.grace, con)
        pts = [p for s in secs for p in points(s, smoke=smoke, device=device, impls=impls, tunable=tunable)]
        return run_family(fam, pts, dls, device, work, costs.grace, con)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for fam_rows in pool.map(one, list(families)):
            rows += fam_rows
    elapsed = time.time() - t_start
    add_ratios(rows)
    con.print()
    print_summary(con, rows, f"session{' (smoke)' if smoke else ''} on {env['device']} | torch {env['torch']} | "
                             f"triton {env['triton']} | fastrl {env['fastrl_commit'][:10]} | ms: median of "
                             f"{'1' if smoke else '6'} timed steps")
    tg = targets(rows, con, smoke=smoke)
    payload = {"command": "session", "argv": getattr(args, "argv", []), "env": env, "budget_s": budget,
               "elapsed_s": elapsed, "smoke": smoke, "jobs": jobs, "sections_run": [s for s in kept],
               "dropped": [{"section": s, "reason": why} for s, why in dropped],
               "estimates_s": {s: est[s] for s in SECTIONS}, "implementations": impls, "tunable": tunable,
               "candidates": candidates(smoke), "targets": tg, "rows": rows}
    path = out / f"{args.name}.json"
    report.write_json(path, payload)
    con.print(f"wrote {path}  ({elapsed:.0f} s of a {budget:.0f} s budget)"
              + (f"; dropped: {', '.join(s for s, _ in dropped)}" if dropped else ""))
    errors = [r for r in rows if r.get("status") == "error"]
    return 1 if smoke and errors else 0
