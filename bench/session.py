"""``python -m bench session [--budget SECONDS] [--sections a,b,...] [--smoke]``: everything a GPU window should
measure, in sections of decreasing value, each in measuring processes of its own (``bench/session_run.py``), whole
sections dropped from the end to fit the budget (docs/gpu-window.md: the plan, its estimates, cuts and faults).
``--smoke``: the same plumbing on a CPU at tiny shapes."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.report import out_dir, pick
from bench.session_run import append_rows, run_points, stub

__all__ = ["ALWAYS", "DROP_ORDER", "GPU_COSTS", "SECTIONS", "SMOKE_COSTS", "Costs", "SessionRun", "add_options",
           "candidates_for", "command", "estimate", "fit", "point_bounds", "points"]

# what users feel first (the trainer step), then the rows the targets need, then what explains them
SECTIONS = ("w4", "checks", "tournament", "divergence", "keptset", "profile", "budget", "compile", "configs")
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
BUDGET = 0.0625  # the budget section: FASTRL_MEMORY_BUDGET's opt-in speed (1/16 of the device), beside the ceiling's
PROFILED = (("W1", "fastrl-fused"), ("W1-lp", "fastrl"), ("W2", "fastrl-fused"))  # the profile section, with TRL's


@dataclass(frozen=True)
class Costs:
    """Seconds (docs/gpu-window.md gives the GPU numbers' sources): ``setup`` a section's process before its first
    point; ``point`` one point, looked up by its workload, then its provider, then its section; ``compile`` a
    section's compiling per implementation (configs: per forced configuration); ``jit`` the watchdog's allowance for
    an implementation's first point where its section counts no compiling."""
    setup: dict
    point: dict
    compile: dict
    jit: float
    grace: float = 20.0  # a process is killed this long after its deadline
    watchdog: tuple = (4.0, 30.0)  # a point is killed past factor x its estimate + floor


# a process starts in 7, TRL's imports add 12, the float64 loss references 5
GPU_COSTS = Costs(setup={"checks": 7, "tournament": 7 + 12 + 5, "divergence": 7 + 12, "keptset": 7, "w4": 0,
                         "configs": 7 + 5, "compile": 7, "profile": 7 + 12, "budget": 7 + 5},
                  point={"checks": 2.5, "divergence": 1.25, "keptset": 2.2, "w4": 35, "compile": 47, "fastrl-eager": 2,
                         "fastrl-nosync": 2,
                         "W1": 1.5, "W1-lp": 1.5, "W2": 0.65, "W2-lp": 0.65, "W3": 0.6},
                  compile={"divergence": 9, "configs": 8}, jit=8)
# a 2-core CPU, Triton interpreted, at load average 7-10; the watchdog's floor is wide: a loaded machine stretches an
# interpreted point many times over
SMOKE_COSTS = Costs(setup={"checks": 3, "tournament": 3 + 5 + 0.3, "divergence": 3 + 5, "keptset": 3, "w4": 0,
                           "configs": 3 + 0.3, "compile": 3, "profile": 3 + 5, "budget": 3 + 0.3},
                    point={"checks": 1.5, "divergence": 1.5, "keptset": 1.7, "w4": 12, "compile": 6, "fastrl-eager": 4,
                           "fastrl-nosync": 4,
                           **{w: 0.5 for w in WORKLOAD_ORDER}},
                    compile={"configs": 0.5}, jit=0.5, watchdog=(4.0, 150.0))


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


def _lmhead_points(section: str, smoke: bool, impls: list[str], tunable: dict, builtin: str) -> list[dict]:
    """W1-W3's points; in configs, each workload's candidates come after the built-in choice and each implementation
    at its default (what bench/defaults.py judges them by), a candidate's probe the workload that may prune it."""
    out = []
    for wl in WORKLOAD_ORDER if section == "tournament" else CONFIG_ORDER[:2] if smoke else CONFIG_ORDER:
        provs = (LOSS_PROVIDERS if section == "tournament" else LOSS_PROVIDERS[:1]) if wl in ("W1", "W2") \
            else ("fastrl",)
        if section == "tournament":
            out += [dict(workload=wl, provider=p) for p in ("cublas", "trl")]
            out += [dict(workload=wl, provider=p, implementation=i, config="default") for i in impls for p in provs]
            continue
        defaults = ([builtin] if builtin in impls and builtin not in tunable else []) + list(tunable)
        out += [dict(workload=wl, provider=p, implementation=i, config="default") for i in defaults for p in provs]
        probe = {} if wl.endswith("-lp") else {"probe": "W1-lp"}
        out += [dict(workload=wl, provider=p, implementation=i, config=c, **probe)
                for i, cands in tunable.items() for c in cands for p in provs]
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
        out = _lmhead_points(section, smoke, impls, tunable, builtin)
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
    elif section == "compile":  # eager, without host reads, compiled, CUDA graphs
        variants = ("fastrl-eager", "fastrl-nosync", "fastrl-compile") + (("fastrl-compile-ro",) if device == "cuda"
                                                                          else ())
        out = [{"workload": "compile-step", "provider": v} for v in variants]
    elif section == "profile":  # torch.profiler's per-kernel split of the default path and of TRL's
        out = [{"workload": wl, "provider": p} for wl, prov in PROFILED for p in (prov, "trl")]
    elif section == "budget":  # the default path (backend auto) with the memory budget raised: opt-in speed rows
        out = [{"workload": wl, "provider": p, "memory_budget": BUDGET} for wl in WORKLOAD_ORDER
               for p in (LOSS_PROVIDERS if wl in ("W1", "W2") else ("fastrl",))]
    elif section == "w4":
        out = [{"workload": "W4", "provider": p} for p in ("trl", "fastrl")]
    else:
        raise ValueError(f"unknown section {section!r}; one of {', '.join(SECTIONS)}")
    return [{"section": section, "smoke": smoke, **p, "id": f"{section}/{i}/{p['workload']}/{p['provider']}/"
             f"{p.get('implementation', '')}/{p.get('config', '')}"} for i, p in enumerate(out)]


def _cost(c: Costs, section: str, p: dict) -> float:
    return next((c.point[k] for k in (p["workload"], p["provider"], section) if k in c.point), 0.0)


def estimate(section: str, c: Costs, pts: list[dict]) -> float:
    """Seconds this section should take: its process's setup, its points, and its compiling per implementation
    (configs: per forced configuration)."""
    compiled = {(p["implementation"], p.get("config")) for p in pts
                if p.get("implementation") and p.get("config") != "default"}
    return c.setup[section] + sum(_cost(c, section, p) for p in pts) + c.compile.get(section, 0.0) * len(compiled)


def point_bounds(section: str, c: Costs, pts: list[dict]) -> dict[str, float]:
    """The watchdog: seconds each point may run (factor x its estimate, an implementation's first point at each
    configuration counting its compiling, + floor); ``"start"``: the seconds a process may take to begin its first
    point."""
    factor, floor = c.watchdog
    seen: set = set()
    out = {"start": factor * c.setup[section] + floor}
    for p in pts:
        key = (p.get("implementation"), p.get("config"))
        jit = c.compile.get(section, c.jit) if key[0] and key not in seen else 0.0
        seen.add(key)
        out[p["id"]] = factor * (_cost(c, section, p) + jit) + floor
    return out


def fit(sections: list[str], est: dict[str, float], left: float) -> tuple[list[str], list[tuple]]:
    """(the sections kept, [(section, why)] dropped): whole sections dropped from the end (DROP_ORDER) until the
    estimates fit in ``left`` seconds; never the checks and the tournament, and never the first other section while
    any time is left (it runs what fits of it)."""
    kept, dropped = list(sections), []
    first = next((s for s in kept if s not in ALWAYS), None) if left > 0 else None
    while (total := sum(est[s] for s in kept)) > left:
        s = next((s for s in reversed(kept) if s not in ALWAYS and s != first), None)
        if s is None:
            break
        kept.remove(s)
        dropped.append((s, f"~{est[s]:.0f} s would not fit in the {max(left, 0):.0f} s left ({total:.0f} s "
                           "estimated)"))
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
    names = pick("--sections", spec, SECTIONS)
    quick = "checks" not in names and bool({"tournament", "configs"} & set(names))
    return [s for s in SECTIONS if s in names or (quick and s == "checks")], quick


class SessionRun:
    """One ``bench session`` run: its plan, its rows file and its ``session.json``, rewritten after every section
    (a run cut at any moment leaves every finished row in the rows file and every finished section in the JSON)."""

    def __init__(self, args, device: str, con, env: dict):
        self.args, self.device, self.con, self.env, self.smoke = args, device, con, env, bool(args.smoke)
        self.interpret, self.quiet = device == "cpu", False  # a smoke run interprets the kernels; rows echoed
        self.costs = SMOKE_COSTS if self.smoke else GPU_COSTS
        self.budget = args.budget or DEFAULT_BUDGET["smoke" if self.smoke else "cuda"]
        self.out = out_dir(args, env["device_slug"], "session")
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

    def estimates(self) -> dict[str, float]:
        return {s: estimate(s, self.costs, self.points(s)) for s in SECTIONS}

    def points(self, section: str) -> list[dict]:
        return points(section, smoke=self.smoke, device=self.device, impls=self.impls, tunable=self.tunable,
                      builtin=self.builtin, quick_checks=self.quick_checks)

    def left(self) -> float:
        return self.end - time.time() - self.costs.grace

    def drop_late(self) -> None:
        """Drop from the end the sections still to start that no longer fit in the time left (``fit``), saying why."""
        self.pending, dropped = fit(self.pending, self.est, self.left())
        for s, why in dropped:
            self.dropped.append((s, why))
            self.say(f"[yellow]dropped {s}: {why}; run it later with --sections {s}[/yellow]")

    def next_section(self) -> str | None:
        self.drop_late()
        return self.pending.pop(0) if self.pending else None

    def run_section(self, section: str) -> list[dict]:
        deadline = self.end - self.costs.grace
        self.say(f"[bold]{section}[/bold] (~{self.est.get(section, 0):.0f} s, {max(self.left(), 0):.0f} s left)")
        pts = self.points(section)
        try:
            rows = run_points(section, pts, deadline, self, point_bounds(section, self.costs, pts))
        except Exception as e:  # noqa: BLE001 - the session goes on; the section's rows say why
            rows = [stub(p, "error", f"the section failed in the session itself: {type(e).__name__}: {e}"[:300])
                    for p in pts]
            append_rows(self.rows_path, rows)
        self.rows += rows
        self.done.append(section)
        if section == "checks":
            self.after_checks()
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
        report.write_json(path.with_name(path.name + ".part"), payload)
        os.replace(path.with_name(path.name + ".part"), path)  # a cut never leaves half a JSON
        return payload

    def plan(self) -> None:
        """The sections in ``SECTIONS`` order in the time left; the configs section's estimate is redone once the
        checks have said which kernels each implementation runs (``after_checks``)."""
        self.est = self.estimates()
        append_rows(self.rows_path, [{"plan": {"budget_s": self.budget, "wanted": self.wanted, "estimates_s": self.est,
                                               "implementations": self.impls}}])
        self.pending = list(self.wanted)
        self.drop_late()
        self.say("plan: " + ", ".join(f"{s} ~{self.est[s]:.0f} s" for s in self.pending)
                 + f" in {max(self.left(), 0):.0f} s")

    def after_checks(self) -> None:
        """Which launch configurations to force on each implementation: its kernels' candidates, the kernels read from
        its check rows (the log-prob and loss ops': no W1-W3 runs fused_divergence's)."""
        served = {}
        for r in self.rows:
            if r["section"] == "checks" and r.get("configs_served") and r.get("kind") in ("logprob", "loss"):
                served.setdefault(r["implementation"], set()).update(r["configs_served"])
        self.tunable = {i: candidates_for(served[i], self.smoke) for i in self.impls if i in served}
        self.est = self.estimates()
        self.say("launch configurations to force: " + ("; ".join(f"{i}: {len(c)}" for i, c in self.tunable.items())
                                                        or "none"))


def command(args, device: str, con) -> int:
    import torch

    from bench import report
    from bench.session_report import print_summary
    from fastrl.kernels.tuning import device_family

    if device != "cuda" and not args.smoke:
        con.print("[red]`python -m bench session` measures on a GPU; add --smoke to run its plumbing on a CPU[/red]")
        return 2
    env = {**report.environment(device), "family": device_family(torch.device(device))}  # environment: provenance
    run = SessionRun(args, device, con, env)
    smoke = " (smoke)" if run.smoke else ""
    con.print(f"[bold]fastrl bench session[/bold]{smoke} on {env['device']} ({env['family']}): torch {env['torch']}, "
              f"triton {env['triton']}, driver {env['driver']}, fastrl {env['fastrl_commit'][:10]} "
              f"({'clean' if env['tree_clean'] else 'NOT a clean tree'}); implementations {', '.join(run.impls)}; "
              f"budget {run.budget:.0f} s; rows as they finish: {run.rows_path}")
    run.plan()
    while (section := run.next_section()) is not None:
        run.run_section(section)
    con.print()
    print_summary(con, [dict(r) for r in run.rows], f"session{smoke} on {env['device']} | torch {env['torch']} | "
                  f"triton {env['triton']} | fastrl {env['fastrl_commit'][:10]} | ms: median of "
                  f"{'1' if run.smoke else '6'} timed steps")
    payload = run.write(partial=False, con=con)
    con.print(f"wrote {run.out / (args.name + '.json')}  ({payload['elapsed_s']:.0f} s of a {run.budget:.0f} s "
              f"budget)" + (f"; dropped: {', '.join(s for s, _ in run.dropped)}" if run.dropped else ""))
    return 1 if run.smoke and any(r.get("status") in ("error", "timeout") for r in payload["rows"]) else 0
