"""W5 (DESIGN.md): the longest completion whose GRPO step fits a memory budget, per trainer and memory options.

    python -m bench w5                  # CUDA: Qwen2.5-0.5B and 1.5B architectures, bf16, 8 completions,
                                        #       budgets 24 GiB and 80 GiB (peak allocated during the step)
                                        # CPU:  CPU-scaled architectures, float32, 2 completions, budget 280 MB
                                        #       (the step's extra peak RSS); 22 points, 25 min on a shared
                                        #       2-core machine at load average 7-10 (less when quiet)
    python -m bench w5 --quick          # CUDA: 0.5B at 24 GiB only; CPU: the 0.5B-scaled architecture only
    python -m bench w5 --workload 1.5B --budget-mb 81920 --lengths 16384,32768,65536
    python -m bench w5 --workload 0.5B --budget-mb 24576 --providers trl,fastrl+both --out DIR   # a slice

Trainers and options ("configs"): stock ``trl.GRPOTrainer``; ``fastrl.GRPOTrainer`` plain, with
``activation_offloading=True``, with ``tiled_mlp=8``, and with both. Each (architecture, config) walks up a grid
of completion lengths, one point per fresh process (``bench.w4.run_point``: one training step, ``compute_loss``
+ backward on random completions, activation checkpointing on, TRL's default loss; fastrl's step runs in its
offloading context as ``GRPOTrainer.training_step`` does), and stops at the first length whose step exceeds the
largest budget or runs out of memory. The longest completion that fits a budget is the longest grid length whose
step stayed within it; "fits the largest length tried" means the true limit is higher.

Memory: CUDA, ``torch.cuda.max_memory_allocated()`` during the step, in total: model weights, their gradients
and the step's activations, i.e. what a card of that size must hold (optimizer states and the CUDA caching
allocator's slack not included). CPU: the step's extra peak RSS (``VmHWM`` minus the RSS before the step; the
process's ~1 GB of libraries is not the model's). On CPU activation offloading has nothing to move
(activations already live in host memory), so its configs are rows saying so.

The CPU variant is scaled down: the two architectures keep Qwen2.5's ratios where it matters (intermediate /
hidden 5.5 and 5.8, two layer counts in the ratio 24 : 28 -> 4 : 5, head dim 64) but are 1/7-1/8 as wide, with
a 16384-token vocabulary and 2 completions, so a step at a few thousand tokens takes seconds. Its numbers show
the mechanism, not the GPU's numbers.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, replace

from bench.w4 import GIB, QWEN25_05B, W4Shape, csv_and_pyplot, point_spec, spawn_points

__all__ = ["Config", "W5Plan", "CONFIGS", "plan_for", "longest_fit", "run", "summarize", "print_tables", "write_files",
           "cli"]

# Qwen2.5-1.5B (its config.json): tied embeddings, rope theta 1e6
QWEN25_15B = dict(vocab=151936, hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, tie_embeddings=True)
ARCHS = {"0.5B": QWEN25_05B, "1.5B": QWEN25_15B}
# CPU-scaled: width / 7-8, depth / 6, head dim 64, intermediate / hidden as in Qwen2.5 (4864/896, 8960/1536)
CPU_ARCHS = {
    "0.5B": dict(vocab=16384, hidden=128, layers=4, heads=2, kv_heads=1, intermediate=704, tie_embeddings=True),
    "1.5B": dict(vocab=16384, hidden=192, layers=5, heads=3, kv_heads=1, intermediate=1120, tie_embeddings=True),
}
TILES = 8  # tiled_mlp of the tiled configs (the "MLP tiled over 8 sequence chunks")


@dataclass(frozen=True)
class Config:
    name: str
    trainer: str  # "trl" | "fastrl"
    activation_offloading: bool = False
    tiled_mlp: int = 0

    def options(self) -> dict:
        return {"activation_offloading": self.activation_offloading, "tiled_mlp": self.tiled_mlp}


CONFIGS = (
    Config("trl", "trl"),
    Config("fastrl", "fastrl"),
    Config("fastrl+offload", "fastrl", activation_offloading=True),
    Config("fastrl+tiled", "fastrl", tiled_mlp=TILES),
    Config("fastrl+both", "fastrl", activation_offloading=True, tiled_mlp=TILES),
)


@dataclass
class W5Plan:
    device: str
    mode: str
    shapes: dict  # arch name -> W4Shape (its lengths: the grid walked up)
    budgets_mb: tuple
    budget_on: str  # "total" (CUDA) | "extra" (CPU)
    configs: tuple = CONFIGS
    headline: str = "fastrl+both"  # the fastrl config the summary compares with stock TRL
    reps: int = 1
    warmup: int = 1
    warmup_len: int = 0  # 0: bench.w4's default
    timeout_s: int = 900
    threads: int = 0
    extra_options: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shapes"] = {k: v.to_dict() for k, v in self.shapes.items()}
        d["configs"] = [asdict(c) for c in self.configs]
        return d


def _shape(name: str, arch: dict, **kw) -> W4Shape:
    return W4Shape(name=name, **arch, **kw)


def plan_for(device: str, mode: str) -> W5Plan:
    """W5 for this device and mode ("smoke", "quick", "full")."""
    if mode == "smoke":
        arch = dict(vocab=512, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=128, tie_embeddings=False)
        s = _shape("W5-smoke", arch, dtype="float32", completions=2, prompt_len=8, lengths=(32, 64), budget_mb=0.0,
                   note="smoke test: tiny model, numbers mean nothing")
        cfgs = tuple(replace(c, tiled_mlp=2) if c.tiled_mlp else c for c in CONFIGS)
        return W5Plan(device, mode, {"smoke": s}, (64.0,), "extra" if device == "cpu" else "total", cfgs,
                      headline="fastrl+tiled" if device == "cpu" else "fastrl+both", timeout_s=300)
    if device.startswith("cuda"):
        grid = (4096, 8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072)
        archs = ("0.5B",) if mode == "quick" else ("0.5B", "1.5B")
        shapes = {a: _shape(f"W5-{a}", ARCHS[a], dtype="bfloat16", completions=8, prompt_len=128, lengths=grid,
                            budget_mb=0.0, note=f"Qwen2.5-{a} architecture, random init, bf16, 8 completions per step")
                  for a in archs}
        budgets = (24 * GIB,) if mode == "quick" else (24 * GIB, 80 * GIB)
        # warm-up at 2048 tokens compiles and autotunes the Triton kernels (keyed on H and V) without doubling a
        # long step's time; two timed steps
        return W5Plan(device, mode, shapes, budgets, "total", reps=2, warmup=1, warmup_len=2048, timeout_s=1200)
    grid = (256, 512, 1024, 1536, 2048, 3072, 4096, 6144)
    archs = ("0.5B",) if mode == "quick" else ("0.5B", "1.5B")
    shapes = {a: _shape(f"W5-{a}-cpu", CPU_ARCHS[a], dtype="float32", completions=2, prompt_len=32, lengths=grid,
                        budget_mb=0.0,
                        note=f"CPU-scaled Qwen2.5-{a} architecture (H={CPU_ARCHS[a]['hidden']}, "
                             f"I={CPU_ARCHS[a]['intermediate']}, {CPU_ARCHS[a]['layers']} layers, V=16384), "
                             "float32, 2 completions per step")
              for a in archs}
    # 280 MB of extra RSS: between the grid points where the two architectures' plain and tiled steps cross it
    return W5Plan(device, mode, shapes, (280.0,), "extra", headline="fastrl+tiled", timeout_s=900)


def with_overrides(plan: W5Plan, *, archs: str | None, lengths: str | None, budget_mb: float | None,
                   reps: int | None, warmup: int | None, timeout_s: int | None, threads: int = 0,
                   options: dict | None = None, configs: str | None = None) -> W5Plan:
    if configs:
        want = [c.strip() for c in configs.split(",") if c.strip()]
        known = {c.name: c for c in plan.configs}
        unknown = [c for c in want if c not in known]
        if unknown:
            raise ValueError(f"w5 --providers: unknown configuration {unknown}; expected a comma list of {list(known)}")
        plan = replace(plan, configs=tuple(c for c in plan.configs if c.name in want))
    if archs:
        want = [a.strip() for a in archs.split(",") if a.strip()]
        table = ARCHS if plan.device.startswith("cuda") else CPU_ARCHS
        unknown = [a for a in want if a not in table]
        if unknown:
            raise ValueError(f"w5 --workload: unknown architecture {unknown}; expected a comma list of {list(table)}")
        if plan.mode == "smoke":
            raise ValueError("w5 --workload: --smoke runs one tiny model; leave --workload out")
        base = plan_for(plan.device, "full")
        plan = replace(plan, shapes={a: base.shapes[a] for a in want})
    if lengths:
        grid = tuple(sorted({int(x) for x in lengths.split(",") if x.strip()}))
        plan = replace(plan, shapes={a: replace(s, lengths=grid) for a, s in plan.shapes.items()})
    if budget_mb:
        plan = replace(plan, budgets_mb=(float(budget_mb),))
    for name, value in (("reps", reps), ("warmup", warmup), ("timeout_s", timeout_s)):
        if value is not None:
            plan = replace(plan, **{name: value})
    return replace(plan, threads=threads, extra_options=dict(options or {}))


# ---------------------------------------------------------------------------------------------------
# The walk, in the parent
# ---------------------------------------------------------------------------------------------------

def _memory(row: dict, plan: W5Plan) -> float | None:
    return row.get("peak_total_mb" if plan.budget_on == "total" else "peak_extra_mb")


def _row(s: W4Shape, arch: str, c: Config, L, status: str, reason: str = "") -> dict:
    return {"workload": s.name, "group": "w5", "kind": "trainer", "arch": arch, "config": c.name, "provider": c.trainer,
            "activation_offloading": c.activation_offloading, "tiled_mlp": c.tiled_mlp, "status": status,
            "reason": reason, "completion_len": L, "completions": s.completions,
            "tokens": s.completions * L if L else None, "prompt_len": s.prompt_len, "V": s.vocab, "H": s.hidden,
            "intermediate": s.intermediate, "layers": s.layers, "dtype": s.dtype, "workload_note": s.note}


def _unavailable(c: Config, device: str) -> str | None:
    if c.activation_offloading and not device.startswith("cuda"):
        return "activation offloading moves activations from the accelerator to host memory; on CPU they are there already"
    return None


def longest_fit(fits, n: int, hint: int = -1) -> int:
    """The largest ``i < n`` with ``fits(i)`` (-1: none), for ``fits`` true up to some index and false after.

    ``hint`` is tried first; then a galloping search up from the largest known fit (1, 2, 4, ... steps) and a
    bisection of the last gap. Each ``fits(i)`` is called at most once.
    """
    lo, hi = -1, n
    if 0 <= hint < n:
        if fits(hint):
            lo = hint
        else:
            hi = hint
    step = 1
    while lo + step < hi:  # gallop: short, cheap points first, few long ones
        if not fits(lo + step):
            hi = lo + step
            break
        lo, step = lo + step, 2 * step
    while hi - lo > 1:  # bisect the last gap
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def run(plan: W5Plan, con) -> list[dict]:
    """Every (architecture, budget, config): a search over the grid, one fresh process per point; returns the rows.

    Memory grows with the completion length, so the longest fitting length is found by a galloping search over
    the grid (lengths 1, 2, 4, ... grid steps above the last fit, then bisection: about 2 log2(grid) points per
    config, the long ones few), starting from a length likely to fit: the same config's answer at the next
    smaller budget, or the best answer of the configs before it (they go from most to least memory), checked
    first. A point that runs out of memory or fails does not fit. Points are measured once and shared by every
    budget. Then the headline config is measured at stock TRL's longest length too, for the time ratio.
    """
    from rich.markup import escape

    cache: dict[tuple, dict] = {}

    def point(arch: str, c: Config, i: int) -> dict:
        s = plan.shapes[arch]
        L = s.lengths[i]
        key = (arch, c.name, L)
        if key in cache:
            return cache[key]
        spec = point_spec(s, c.trainer, L, plan.device, reps=plan.reps, warmup=plan.warmup, threads=plan.threads,
                          options={**plan.extra_options, **c.options()}, kind="w5", warmup_len=plan.warmup_len or None)
        t0 = time.perf_counter()
        (res,) = spawn_points([spec], plan.timeout_s)
        row = _row(s, arch, c, L, res.get("status", "error"), res.get("reason", ""))
        row.update({k: v for k, v in res.items() if k not in ("status", "reason")})
        row["process_s"], row["loadavg"] = time.perf_counter() - t0, os.getloadavg()[0]
        if row["status"] == "ok" and c.trainer == "fastrl" and (
                row.get("tiled_mlp") != c.tiled_mlp or row.get("activation_offloading") != c.activation_offloading):
            row["status"], row["reason"] = "error", (
                f"the worker ran tiled_mlp={row.get('tiled_mlp')}, offloading={row.get('activation_offloading')}, "
                f"not what {c.name} asks for")
        if row["status"] == "ok":
            mem = _memory(row, plan)
            row["fits"] = {f"{b:.0f}": mem <= b for b in plan.budgets_mb}
            con.print(f"{s.name:>12} {c.name:<15} {L:>7} tokens {row['step_ms']['median'] / 1e3:8.2f} s "
                      f"{row['peak_extra_mb']:9.1f} MB extra {row['peak_total_mb']:9.1f} MB total")
        else:
            style = "red" if row["status"] == "error" else "dim"
            con.print(f"[{style}]{s.name:>12} {c.name:<15} {L:>7} tokens {row['status']}: "
                      f"{escape(row['reason'])}[/{style}]")
        cache[key] = row
        return row

    def fits(arch, c, i, b) -> bool:
        r = point(arch, c, i)
        return r["status"] == "ok" and _memory(r, plan) <= b

    rows_na: list[dict] = []
    for arch, s in plan.shapes.items():
        con.print(f"[bold]{s.name}[/bold]: {s.note}; V={s.vocab} H={s.hidden} I={s.intermediate} layers={s.layers}, "
                  f"{s.completions} completions x {', '.join(map(str, s.lengths))} tokens (+{s.prompt_len} prompt); "
                  "budgets " + ", ".join(f"{b:.0f} MB" for b in plan.budgets_mb) + f" ({plan.budget_on} step memory)")
        runnable = []
        for c in plan.configs:
            why = _unavailable(c, plan.device)
            if why:
                rows_na.append(_row(s, arch, c, None, "n/a", why))
                con.print(f"[dim]{s.name:>12} {c.name:<15} n/a: {escape(why)}[/dim]")
            else:
                runnable.append(c)
        answer: dict[tuple, int] = {}  # (config, budget) -> grid index of the longest fit (-1: none)
        for b in sorted(plan.budgets_mb):
            best = -1
            for c in runnable:
                smaller = [answer[(c.name, x)] for x in plan.budgets_mb if x < b and (c.name, x) in answer]
                hint = max(smaller) if smaller else best
                lo = longest_fit(lambda i: fits(arch, c, i, b), len(s.lengths), hint)
                answer[(c.name, b)] = lo
                best = max(best, lo)
            trl, head = answer.get(("trl", b), -1), answer.get((plan.headline, b), -1)
            if trl >= 0 and head >= 0:
                point(arch, next(c for c in runnable if c.name == plan.headline), min(trl, head))
    order = {c.name: k for k, c in enumerate(plan.configs)}
    archs = list(plan.shapes)
    rows = sorted(list(cache.values()) + rows_na,
                  key=lambda r: (archs.index(r["arch"]), order[r["config"]], r["completion_len"] or 0))
    return rows


def summarize(plan: W5Plan, rows: list[dict]) -> dict:
    """Per architecture and budget: the longest fitting completion per config, and the headline config vs TRL."""
    out = {}
    for arch, s in plan.shapes.items():
        per_budget = {}
        for b in plan.budgets_mb:
            longest, at_top = {}, {}
            for c in plan.configs:
                pts = [r for r in rows if r["arch"] == arch and r["config"] == c.name]
                if pts and pts[0]["status"] == "n/a":
                    longest[c.name] = "n/a"
                    continue
                fit = [r["completion_len"] for r in pts if r["status"] == "ok" and _memory(r, plan) <= b]
                longest[c.name] = max(fit) if fit else None
                at_top[c.name] = bool(fit) and max(fit) == max(s.lengths)
            entry = {"budget_mb": b, "longest": longest, "fits_largest_length_tried": at_top}
            p, h = longest.get("fastrl"), longest.get(plan.headline)
            if isinstance(p, int) and isinstance(h, int):
                entry["length_ratio_vs_fastrl"] = h / p
            t = longest.get("trl")
            if isinstance(t, int) and isinstance(h, int):
                entry["length_ratio"] = h / t
                L = min(t, h)  # the longest length both fit (run() measures the headline config there)
                at = {r["config"]: r for r in rows if r["arch"] == arch and r["completion_len"] == L
                      and r["status"] == "ok" and r["config"] in ("trl", plan.headline)}
                if len(at) == 2:
                    entry["time_ratio_at"] = L
                    entry["time_ratio"] = at[plan.headline]["step_ms"]["median"] / at["trl"]["step_ms"]["median"]
            per_budget[f"{b:.0f}"] = entry
        out[arch] = per_budget
    return out


def targets(plan: W5Plan, summary: dict) -> dict:
    """The issue's GPU targets: headline fits >= 3x TRL's length at <= 1.1x its step time (24 GiB: both
    architectures; 80 GiB: 1.5B). Only evaluated on CUDA at the default budgets."""
    if not plan.device.startswith("cuda"):
        return {"evaluated": False, "why": "the targets are for an H100; the CPU variant is scaled down"}
    out = {"evaluated": True, "checks": []}
    for arch, budget in (("0.5B", 24 * GIB), ("1.5B", 24 * GIB), ("1.5B", 80 * GIB)):
        e = summary.get(arch, {}).get(f"{budget:.0f}")
        if e is None:
            out["checks"].append({"arch": arch, "budget_mb": budget, "evaluated": False, "why": "not measured"})
            continue
        lr, tr = e.get("length_ratio"), e.get("time_ratio")
        out["checks"].append({"arch": arch, "budget_mb": budget, "evaluated": lr is not None, "length_ratio": lr,
                              "time_ratio": tr, "pass": lr is not None and tr is not None and lr >= 3 and tr <= 1.1,
                              "lower_bound": bool(e["fits_largest_length_tried"].get(plan.headline))})
    return out


def print_tables(con, plan: W5Plan, rows: list[dict], summary: dict, tgt: dict, title: str) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=title, header_style="bold")
    for col in ("arch", "config", "completion", "step s", "extra MB", "total MB",
                *[f"fits {b:.0f} MB" for b in plan.budgets_mb], "notes"):
        t.add_column(col, justify="left" if col in ("arch", "config", "notes") else "right", overflow="fold")
    last = None
    for r in rows:
        key = (r["arch"], r["config"])
        if last is not None and key != last:
            t.add_section()
        last = key
        if r["status"] != "ok":
            style = "red" if r["status"] == "error" else "yellow"
            t.add_row(r["arch"], r["config"], str(r["completion_len"] or ""), "", "", "",
                      *["no" if r["status"] == "oom" else "" for _ in plan.budgets_mb],
                      f"[{style}]{r['status']}: {escape(r['reason'])}[/{style}]")
            continue
        t.add_row(r["arch"], r["config"], f"{r['completions']} x {r['completion_len']}",
                  f"{r['step_ms']['median'] / 1e3:.2f}", f"{r['peak_extra_mb']:.0f}", f"{r['peak_total_mb']:.0f}",
                  *["yes" if r["fits"][f"{b:.0f}"] else "no" for b in plan.budgets_mb],
                  escape(f"path {r.get('path', '?')}; loss {r.get('loss_value', float('nan')):+.5f}"))
    con.print(t)

    st = Table(title=f"W5: longest completion whose step fits the budget ({plan.budget_on} step memory; "
                     f"'>=': fits the longest grid length, the limit is higher)", header_style="bold")
    names = [c.name for c in plan.configs]
    for col in ("arch", "budget", *names, f"{plan.headline} / trl length", f"{plan.headline} / fastrl length",
                f"{plan.headline} / trl time (at length)"):
        st.add_column(col, justify="left" if col == "arch" else "right")
    for arch, per in summary.items():
        for key, e in per.items():
            cells = []
            for n in names:
                v = e["longest"].get(n)
                cells.append("n/a" if v == "n/a" else "none" if v is None else
                             (">=" if e["fits_largest_length_tried"].get(n) else "") + str(v))
            lr, tr, lp = e.get("length_ratio"), e.get("time_ratio"), e.get("length_ratio_vs_fastrl")
            st.add_row(arch, f"{float(key):.0f} MB", *cells, "" if lr is None else f"{lr:.2f}x",
                       "" if lp is None else f"{lp:.2f}x",
                       "" if tr is None else f"{tr:.2f}x (at {e['time_ratio_at']})")
    con.print(st)
    if tgt.get("evaluated"):
        for c in tgt["checks"]:
            if not c["evaluated"]:
                con.print(f"[red]target {c['arch']} @ {c['budget_mb'] / GIB:.0f} GiB: not evaluated[/red]")
                continue
            verdict = "[green]PASS[/green]" if c["pass"] else "[red]FAIL[/red]"
            con.print(f"target {c['arch']} @ {c['budget_mb'] / GIB:.0f} GiB: {plan.headline} fits "
                      f"{c['length_ratio']:.2f}x trl's length (>= 3x{', a lower bound' if c['lower_bound'] else ''}) "
                      f"at {c['time_ratio']:.2f}x its step time (<= 1.1x): {verdict}")
    else:
        con.print(f"[yellow]no targets evaluated: {tgt.get('why')}[/yellow]")


CSV_COLUMNS = ["workload", "arch", "config", "provider", "activation_offloading", "tiled_mlp", "status", "reason",
               "completion_len", "completions", "tokens", "prompt_len", "V", "H", "intermediate", "layers", "dtype",
               "step_ms_median", "step_ms_min", "step_ms_max", "step_ms_n", "peak_extra_mb", "peak_total_mb",
               "baseline_mb", "loss_value", "path", "activation_checkpointing", "model_params", "device", "torch",
               "driver"]


def write_files(out_dir, prefix: str, plan: W5Plan, rows: list[dict], env: dict, plots: bool = True) -> list:
    """``<prefix>.csv`` and ``<prefix>.png`` (step memory against completion length, one panel per architecture)."""
    from pathlib import Path

    from bench import report

    written, plt = csv_and_pyplot(out_dir, prefix, rows, env, CSV_COLUMNS, plots)
    if plt is None:
        return written
    archs = list(plan.shapes)
    fig, axes = plt.subplots(1, len(archs), figsize=(6.5 * len(archs), 4.8), squeeze=False)
    what = "peak allocated during the step (weights + grads + activations), MB" if plan.budget_on == "total" \
        else "extra peak RSS of the step, MB"
    for ax, arch in zip(axes[0], archs):
        s = plan.shapes[arch]
        for c in plan.configs:
            pts = [r for r in rows if r["arch"] == arch and r["config"] == c.name and r["status"] == "ok"]
            if pts:
                line, = ax.plot([r["completion_len"] for r in pts], [_memory(r, plan) for r in pts], marker="o",
                                label=c.name)
                for r in rows:
                    if r["arch"] == arch and r["config"] == c.name and r["status"] == "oom":
                        ax.plot([r["completion_len"]], [max(plan.budgets_mb)], marker="x", color=line.get_color())
        for b in plan.budgets_mb:
            ax.axhline(b, ls="--", color="gray", lw=1)
            ax.text(min(s.lengths), b, f" budget {b:.0f} MB", va="bottom", fontsize=7, color="gray")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"completion tokens ({s.completions} completions per step)")
        ax.set_ylabel(what)
        ax.set_title(f"{s.name}: H={s.hidden} I={s.intermediate} layers={s.layers} V={s.vocab} {s.dtype}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"W5: one GRPO training step's memory against completion length (x: out of memory)\n"
                 f"{env['device']} | torch {env['torch']}", fontsize=9)
    report.save_figure(plt, fig, Path(out_dir) / f"{prefix}.png", written)
    return written


def cli(args, device: str, con) -> int:
    """``python -m bench w5`` (``bench/__main__.py`` parses the shared options): its own search and files."""
    from bench import report

    env = report.environment(device)
    out_dir = report.out_dir(args, env["device_slug"], args.command)
    prefix, mode = report.prefix("w5", args), report.mode(args)
    options = {"fastrl_backend": args.fastrl_backend} if args.fastrl_backend else {}
    try:
        plan = with_overrides(plan_for(device, mode), archs=args.workload, lengths=args.lengths,
                              budget_mb=args.budget_mb, reps=args.reps, warmup=args.warmup, timeout_s=args.timeout,
                              threads=args.threads, options=options, configs=args.providers)
    except ValueError as e:
        con.print(f"[red]{e}[/red]")
        return 2
    con.print(f"[bold]fastrl bench w5[/bold] ({mode}) on {env['device']}: torch {env['torch']}, triton "
              f"{env['triton']}, driver {env['driver']}; architectures {', '.join(plan.shapes)}, configs "
              f"{', '.join(c.name for c in plan.configs)}; each point in a fresh process")
    if device == "cpu" and mode != "smoke":
        con.print("[yellow]CPU-scaled W5 (see each shape's note); the GPU W5 is `python -m bench w5` on CUDA[/yellow]")
    t0 = time.perf_counter()
    rows = run(plan, con)
    summary = summarize(plan, rows)
    tgt = targets(plan, summary)
    elapsed = time.perf_counter() - t0
    payload = {"command": "w5", "mode": mode, "argv": list(getattr(args, "argv", []) or []), "env": env,
               "plan": plan.to_dict(), "elapsed_s": elapsed, "summary": summary, "targets": tgt, "rows": rows}
    title = (f"W5 ({mode}): one GRPO training step per point | {env['device']} | torch {env['torch']} | driver "
             f"{env['driver']} | step s: {'median of ' + str(plan.reps) if plan.reps > 1 else 'one'} timed step"
             f"{'s' if plan.reps > 1 else ''} after a warm-up")
    con.print()
    print_tables(con, plan, rows, summary, tgt, title)
    written = write_files(out_dir, prefix, plan, rows, env, plots=not args.no_plots)
    report.save_results(con, out_dir / f"{prefix}.json", payload, elapsed, written)
    return 1 if args.smoke and any(r["status"] == "error" for r in rows) else 0

