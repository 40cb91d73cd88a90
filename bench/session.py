"""``python -m bench session``: everything a GPU window should measure, in one command sized to the window.

    python -m bench session [--budget SECONDS] [--sections a,b,...] [--smoke]

Sections (``SECTIONS``, in order of value) run one measuring process each (``bench/session_run.py``), rows appended as
they finish; ``--budget`` is split by the estimates (``GPU_COSTS``; docs/gpu-window.md gives their sources and
arithmetic), whole sections dropped from the end to fit, again before each starts. ``--smoke``: the same plumbing on a
CPU at tiny shapes.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.report import new_out_dir
from bench.session_run import append_rows, run_points, stub

__all__ = ["ALWAYS", "DROP_ORDER", "GPU_COSTS", "SECTIONS", "SMOKE_COSTS", "Costs", "SessionRun", "add_options",
           "candidates_for", "command", "estimate", "plan_budget", "point_bounds", "points"]

SECTIONS = ("checks", "tournament", "divergence", "keptset", "w4", "configs", "compile")
ALWAYS = ("checks", "tournament")  # never dropped: a short budget cuts their points instead (the deadline)
DROP_ORDER = tuple(reversed([s for s in SECTIONS if s not in ALWAYS]))  # whole sections drop from the end
WORKLOAD_ORDER = ("W1", "W1-lp", "W2", "W2-lp", "W3")
# the log-prob workloads first: they decide the configurations of the log-prob kernels (at H=4096 and 896); W3 the
# forward-only ones; W1's one-pass loss (fastrl-fused only) the kernels only it runs (sm90_exp_stats)
CONFIG_ORDER = ("W1-lp", "W2-lp", "W3", "W1")
LOSS_PROVIDERS = ("fastrl-fused", "fastrl")  # policy_loss (the one-pass op); fused_logprobs + the loss math (two-pass)
QUICK_CHECK = {False: "temperature", True: "temperature-rows"}  # smoke -> the one case of a quick check
DIVERGENCE_IMPLS = ("triton-hybrid", "triton-sm90")  # triton-fused's fused_divergence runs the hybrid's kernels
BUILTIN = "triton-hybrid"  # fastrl.ops.backend.builtin_choice on a CUDA install with float32-out cuBLAS
DEFAULT_BUDGET = {"cuda": 480.0, "smoke": 240.0}


@dataclass(frozen=True)
class Costs:
    """Seconds a section is expected to take (docs/gpu-window.md says where the GPU numbers come from)."""
    process: float  # start a measuring process: imports, CUDA context
    trl_import: float
    check_case: float  # one float64 check of one implementation, its share of compiling included
    jit_config: float  # compiling one implementation's kernels at one more configuration
    point: dict = field(default_factory=dict)  # workload -> one point (steps + overhead)
    references: float = 0.0  # float64 loss references of a W1-W3 process
    keptset_point: float = 0.0
    divergence_point: float = 0.0
    divergence_jit: float = 0.0  # compiling one implementation's divergence kernels
    compile_eager: float = 0.0
    compile_variant: float = 0.0
    w4_point: float = 0.0
    grace: float = 20.0  # a process killed this long after its deadline
    watchdog_floor: float = 30.0  # a point is killed past watchdog_factor x its estimate + this
    watchdog_factor: float = 4.0


GPU_COSTS = Costs(process=7, trl_import=12, check_case=2.5, jit_config=8,
                  point={"W1": 1.5, "W1-lp": 1.5, "W2": 0.65, "W2-lp": 0.65, "W3": 0.6}, references=2 + 3,
                  keptset_point=2.2, divergence_point=1.25, divergence_jit=9, compile_eager=2, compile_variant=47,
                  w4_point=35)
# a 2-core CPU, Triton interpreted, at load average 7-10; the watchdog's floor is wide: a loaded machine stretches an
# interpreted point many times over
SMOKE_COSTS = Costs(process=3, trl_import=5, check_case=1.5, jit_config=0.5,
                    point={w: 0.5 for w in WORKLOAD_ORDER}, references=0.3, keptset_point=1.7, divergence_point=1.5,
                    compile_eager=4, compile_variant=6, w4_point=12, watchdog_floor=150)


def run_w4(pts: list[dict], deadline: float, run) -> list[dict]:
    """The W4 section's rows: ``bench.w4.session_rows`` (imported here, when the section runs)."""
    from bench import w4

    return w4.session_rows(pts, deadline, run)


def cuda_implementations() -> list[str]:
    """Every concrete backend that runs the Triton kernels (on CUDA; interpreted in a smoke run)."""
    from fastrl.ops.backend import CONCRETE, is_triton

    return [n for n in CONCRETE if is_triton(n)]


def candidates_for(kernels, smoke: bool) -> list[str]:
    """The launch configurations to force on an implementation whose kernels are ``kernels``: every kernel's own
    candidates (``fastrl.kernels.tuning.candidates``), in order, each once (smoke: the first two, same plumbing)."""
    from fastrl.kernels.tuning import candidates

    out = list(dict.fromkeys(str(c) for k in sorted(kernels) for c in candidates(k)))
    return out[:2] if smoke else out


def _lmhead_points(section: str, smoke: bool, impls: list[str], tunable: dict, builtin: str) -> list[tuple]:
    """(workload, provider, implementation, config, probe) of W1-W3; in configs, each workload's candidates come after
    the built-in choice and each implementation at its default (what bench/defaults.py judges them by)."""
    out = []
    for wl in WORKLOAD_ORDER if section == "tournament" else CONFIG_ORDER[:2] if smoke else CONFIG_ORDER:
        loss = wl in ("W1", "W2")
        if section == "tournament":
            out += [(wl, p, None, None, None) for p in ("cublas", "trl")]
            out += [(wl, p, i, "default", None) for i in impls for p in (LOSS_PROVIDERS if loss else ("fastrl",))]
            continue
        provs = ("fastrl-fused",) if loss else ("fastrl",)
        defaults = ([builtin] if builtin in impls and builtin not in tunable else []) + list(tunable)
        out += [(wl, p, i, "default", None) for i in defaults for p in provs]
        probe = None if wl.endswith("-lp") else "W1-lp"
        out += [(wl, p, i, c, probe) for i, cands in tunable.items() for c in cands for p in provs]
    return out


def points(section: str, *, smoke: bool, device: str, impls: list[str], tunable: dict,
           builtin: str = BUILTIN, quick_checks: bool = False) -> list[dict]:
    """The points of one section, in the order they run. ``tunable``: implementation -> the configurations to force
    on it (``candidates_for`` its kernels). ``quick_checks``: one check per implementation (which kernels it runs)."""
    if section == "checks":
        from bench.session_checks import CASES, SMOKE_CASES

        cases = [c.name for c in (SMOKE_CASES if smoke else CASES) if not quick_checks or c.name == QUICK_CHECK[smoke]]
        out = [{"workload": c, "provider": "fastrl", "implementation": i, **({"quick": True} if quick_checks else {})}
               for i in impls for c in cases]
    elif section in ("tournament", "configs"):
        keys = ("workload", "provider", "implementation", "config", "probe")
        out = [{k: v for k, v in zip(keys, t) if v is not None}
               for t in _lmhead_points(section, smoke, impls, tunable, builtin)]
    elif section == "keptset":
        from bench import keptset

        out = [{"workload": f"keptset-{name}", "provider": prov,
                "spec": {**dict(shape=name, N=N, H=H, V=512 if smoke else keptset.V_FULL, K=64, dtype=dtype), **pt}}
               for name, N, H, dtype in (keptset.SMOKE_SHAPES if smoke else keptset.GPU_SHAPES)
               for prov, pt in keptset.session_points(smoke)]
    elif section == "divergence":
        from bench import divergence

        whos = [("fastrl", {"implementation": i}) for i in impls if i in DIVERGENCE_IMPLS]
        whos += [("trl", {}), ("liger", {})]
        out = [{"workload": wl.name, "provider": p, **impl, "spec": asdict(wl)}
               for wl in divergence.workloads(device, smoke=smoke) for p, impl in whos]
    elif section == "compile":
        variants = ("fastrl-eager", "fastrl-compile") + (("fastrl-compile-ro",) if device == "cuda" else ())
        out = [{"workload": "compile-step", "provider": v} for v in variants]
    elif section == "w4":
        out = [{"workload": "W4", "provider": p} for p in ("trl", "fastrl")]
    else:
        raise ValueError(f"unknown section {section!r}; one of {', '.join(SECTIONS)}")
    return [{"section": section, "smoke": smoke, **p, "id": f"{section}/{i}/{p['workload']}/{p['provider']}/"
             f"{p.get('implementation', '')}/{p.get('config', '')}"} for i, p in enumerate(out)]


def estimate(section: str, c: Costs, pts: list[dict]) -> float:
    """Seconds this section should take (``Costs``), from its points; each section starts its own process."""
    n, impls = len(pts), len({p.get("implementation") for p in pts} - {None})
    forced = len({(p["implementation"], p["config"]) for p in pts if p.get("config", "default") != "default"})
    steps = sum(c.point.get(p["workload"], 0.0) for p in pts)
    return {"checks": c.process + n * c.check_case,
            "tournament": c.process + c.trl_import + c.references + steps,
            "configs": c.process + c.references + forced * c.jit_config + steps,
            "keptset": c.process + n * c.keptset_point,
            "divergence": c.process + c.trl_import + n * c.divergence_point + impls * c.divergence_jit,
            "compile": c.process + c.compile_eager + (n - 1) * c.compile_variant,
            "w4": n * c.w4_point}[section]


def point_bounds(section: str, c: Costs, pts: list[dict]) -> dict[str, float]:
    """The watchdog: seconds each point may run (``watchdog_factor`` x its estimate, a first point's compiling
    included, + ``watchdog_floor``); ``"start"``: the seconds a process may take to begin its first point."""
    seen: set = set()
    out = {"start": c.watchdog_factor * (c.process + c.trl_import) + c.watchdog_floor}
    for p in pts:
        key = (p.get("implementation"), p.get("config"))
        first = key not in seen
        seen.add(key)
        jit = c.jit_config if first else 0.0
        est = {"checks": c.check_case + jit, "keptset": c.keptset_point, "compile": c.compile_eager + c.compile_variant,
               "w4": c.w4_point, "divergence": c.divergence_point + (c.divergence_jit if first else 0.0)}.get(
            section, c.point.get(p["workload"], 0.0) + c.references + jit)  # tournament, configs
        out[p["id"]] = c.watchdog_factor * est + c.watchdog_floor
    return out


def plan_budget(budget: float, estimates: dict[str, float], wanted: list[str]) -> tuple[list[str], list[tuple]]:
    """(the sections kept, in SECTIONS order; [(section, why)] dropped): whole sections dropped from the end
    (DROP_ORDER) until the estimates fit ``budget`` (the caller's budget less a process's grace), except the first
    section after the checks and the tournament, which runs what fits of it."""
    kept = [s for s in SECTIONS if s in wanted]
    dropped = []
    first = next((s for s in kept if s not in ALWAYS), None)  # runs in part rather than not at all
    for s in DROP_ORDER:
        total = sum(estimates[k] for k in kept)
        if total <= budget:
            break
        if s in kept and s != first:
            kept.remove(s)
            dropped.append((s, f"~{estimates[s]:.0f} s would not fit: {total:.0f} s estimated, budget {budget:.0f} s"))
    return kept, dropped


def add_options(ap) -> None:
    ap.add_argument("--budget", type=float, help="seconds for the whole session (default 480 on a GPU, 240 with "
                                                 "--smoke); whole sections are dropped, last first, to fit")
    ap.add_argument("--sections", help=f"comma list of {', '.join(SECTIONS)} (default all; the checks run first "
                                       "whenever tournament or configs are named)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU (kernels interpreted): the plumbing")
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    ap.add_argument("--out", help="results folder (default: a new folder outside the repository)")
    ap.add_argument("--name", default="session", help="file name stem (default session: <out>/session.json)")


def _wanted(spec: str | None) -> tuple[list[str], bool]:
    """(the sections, in SECTIONS order; quick checks: one case per implementation, to learn which kernels it runs)."""
    names = [s.strip() for s in (spec or ",".join(SECTIONS)).split(",") if s.strip()]
    bad = [s for s in names if s not in SECTIONS]
    if bad:
        raise SystemExit(f"--sections: unknown {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    quick = "checks" not in names and bool({"tournament", "configs"} & set(names))
    return [s for s in SECTIONS if s in names or (quick and s == "checks")], quick


class SessionRun:
    """One ``bench session`` run: its plan, its rows file and its ``session.json``, rewritten after every section
    (a run cut at any moment leaves every finished row in the rows file and every finished section in the JSON)."""

    def __init__(self, args, device: str, con, env: dict):
        self.args, self.device, self.con, self.env = args, device, con, env
        self.smoke = bool(args.smoke)
        self.interpret, self.quiet = device == "cpu", False  # a smoke run interprets the kernels; rows echoed
        self.costs = SMOKE_COSTS if self.smoke else GPU_COSTS
        self.budget = args.budget or DEFAULT_BUDGET["smoke" if self.smoke else "cuda"]
        self.out = Path(args.out) if args.out else new_out_dir(env["device_slug"], "session-smoke" if self.smoke
                                                               else "session")
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows_path = self.out / f"{args.name}.rows.jsonl"  # next to the JSON: what a cut call still returns
        self.rows_path.write_text("")
        self.work = Path(tempfile.mkdtemp(prefix="fastrl-session-"))  # the processes' specs and stderr
        self.t_start = time.time()
        self.end = self.t_start + self.budget
        self.impls, self.builtin, self.tunable = cuda_implementations(), BUILTIN, {}
        if device == "cuda":
            import torch

            from fastrl.ops.backend import builtin_choice

            self.builtin = builtin_choice(torch.device("cuda"))
        self.wanted, self.quick_checks = _wanted(args.sections)
        self.rows, self.est, self.pending, self.done, self.dropped = [], {}, [], [], []

    def say(self, text: str) -> None:
        self.con.print(text)

    def points(self, section: str) -> list[dict]:
        return points(section, smoke=self.smoke, device=self.device, impls=self.impls, tunable=self.tunable,
                      builtin=self.builtin, quick_checks=self.quick_checks)

    def estimates(self) -> dict[str, float]:
        return {s: estimate(s, self.costs, self.points(s)) for s in SECTIONS}

    def left(self) -> float:
        return self.end - time.time() - self.costs.grace

    def drop(self, section: str, why: str) -> None:
        self.dropped.append((section, why))
        self.say(f"[yellow]dropped {section}: {why}; run it later with --sections {section}[/yellow]")

    def next_section(self) -> str | None:
        """The next section to start, after dropping from the end the sections that no longer fit in the time left;
        the first of them runs what fits of it while any time is left."""
        while self.pending and self.pending[-1] not in ALWAYS and (len(self.pending) > 1 or self.left() <= 0) \
                and sum(self.est[s] for s in self.pending) > self.left():
            s = self.pending.pop()
            self.drop(s, f"~{self.est[s]:.0f} s would not fit in the {max(self.left(), 0):.0f} s left (sections "
                         f"still to start: ~{sum(self.est[k] for k in self.pending + [s]):.0f} s)")
        return self.pending.pop(0) if self.pending else None

    def run_section(self, section: str) -> list[dict]:
        deadline = self.end - self.costs.grace
        self.say(f"[bold]{section}[/bold] (~{self.est.get(section, 0):.0f} s, {max(self.left(), 0):.0f} s left)")
        pts = self.points(section)
        try:
            rows = run_w4(pts, deadline, self) if section == "w4" else run_points(
                section, pts, deadline, self, point_bounds(section, self.costs, pts))
        except Exception as e:  # noqa: BLE001 - the session goes on; the section's rows say why
            rows = [stub(p, "error", f"the section failed in the session itself: {type(e).__name__}: {e}"[:300])
                    for p in pts]
            append_rows(self.rows_path, rows)
        self.rows += rows
        self.done.append(section)
        self.write(partial=True)
        return rows

    def write(self, partial: bool, con=None) -> dict:
        from bench import report
        from bench.session_report import add_ratios, targets

        rows = [dict(r) for r in self.rows]
        add_ratios(rows)
        payload = {"command": "session", "argv": getattr(self.args, "argv", []), "env": self.env,
                   "budget_s": self.budget, "elapsed_s": time.time() - self.t_start, "smoke": self.smoke,
                   "partial": partial,
                   "checks": "none" if "checks" not in self.wanted else "quick" if self.quick_checks else "full",
                   "sections_run": list(self.done),
                   "dropped": [{"section": s, "reason": why} for s, why in self.dropped],
                   "estimates_s": dict(self.est), "implementations": self.impls, "builtin": self.builtin,
                   "tunable": self.tunable, "targets": targets(rows, con, smoke=self.smoke), "rows": rows}
        path = self.out / f"{self.args.name}.json"
        tmp = path.with_name(path.name + ".part")
        report.write_json(tmp, payload)
        os.replace(tmp, path)  # a cut never leaves half a JSON
        return payload

    def plan(self) -> None:
        """The checks first and alone (which implementations take launch configurations decides the rest), then the
        plan of the rest in the time left: whole sections dropped from the end until the estimates fit."""
        self.est = self.estimates()  # before the checks say which implementations take configurations
        append_rows(self.rows_path, [{"plan": {"budget_s": self.budget, "wanted": self.wanted, "estimates_s": self.est,
                                               "implementations": self.impls}}])
        if "checks" in self.wanted:
            self.run_section("checks")
            served = {}  # the kernels of the log-prob and loss ops (not fused_divergence's: no W1-W3 runs them)
            for r in self.rows:
                if r["section"] == "checks" and r.get("configs_served") and r.get("kind") in ("logprob", "loss"):
                    served.setdefault(r["implementation"], set()).update(r["configs_served"])
            self.tunable = {i: candidates_for(served[i], self.smoke) for i in self.impls if i in served}
        self.est = self.estimates()
        self.pending, dropped = plan_budget(self.left(), self.est, [s for s in self.wanted if s != "checks"])
        self.say("plan: " + ", ".join(f"{s} ~{self.est[s]:.0f} s" for s in self.pending)
                 + f" in {max(self.left(), 0):.0f} s; launch configurations to force: "
                 + ("; ".join(f"{i}: {len(c)}" for i, c in self.tunable.items()) or "none"))
        for s, why in dropped:
            self.drop(s, why)


def command(args, device: str, con) -> int:
    import torch

    from bench import report
    from bench.provenance import provenance
    from bench.session_report import print_summary
    from fastrl.kernels.tuning import device_family

    if device != "cuda" and not args.smoke:
        con.print("[red]`python -m bench session` measures on a GPU; add --smoke to run its plumbing on a CPU[/red]")
        return 2
    env = {**report.environment(device), **provenance(), "family": device_family(torch.device(device))}
    run = SessionRun(args, device, con, env)
    con.print(f"[bold]fastrl bench session[/bold]{' (smoke)' if run.smoke else ''} on {env['device']} "
              f"({env['family']}): torch {env['torch']}, triton {env['triton']}, driver {env['driver']}, fastrl "
              f"{env['fastrl_commit'][:10]} ({'clean' if env['tree_clean'] else 'NOT a clean tree'}); "
              f"implementations {', '.join(run.impls)}; budget {run.budget:.0f} s; rows as they finish: "
              f"{run.rows_path}")
    run.plan()
    while (section := run.next_section()) is not None:
        run.run_section(section)
    con.print()
    print_summary(con, [dict(r) for r in run.rows],
                  f"session{' (smoke)' if run.smoke else ''} on {env['device']} | torch {env['torch']} | "
                  f"triton {env['triton']} | fastrl {env['fastrl_commit'][:10]} | ms: median of "
                  f"{'1' if run.smoke else '6'} timed steps")
    payload = run.write(partial=False, con=con)
    con.print(f"wrote {run.out / (args.name + '.json')}  ({payload['elapsed_s']:.0f} s of a {run.budget:.0f} s "
              f"budget)" + (f"; dropped: {', '.join(s for s, _ in run.dropped)}" if run.dropped else ""))
    return 1 if run.smoke and any(r.get("status") in ("error", "timeout") for r in payload["rows"]) else 0
