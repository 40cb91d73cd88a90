"""W5 (bench/README.md): the longest completion whose GRPO step fits a memory budget, per architecture and trainer
configuration; each point a W4 point (``bench.w4``) with fastrl's memory options, the lengths searched (``plan_for``:
the shapes and budgets per device and mode)."""

from __future__ import annotations

from dataclasses import asdict, replace

from bench import report
from bench.w4 import (CSV_COLUMNS, GIB, QWEN25_05B, Config, Plan, W4Shape, add_ratios, command, measure_point,
                      point_row, print_points)

__all__ = ["CONFIGS", "CSV_COLUMNS", "plan_for", "longest_fit", "run", "summarize", "targets", "print_tables", "cli"]

# Qwen2.5-1.5B (its config.json): tied embeddings, rope theta 1e6
QWEN25_15B = dict(vocab=151936, hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, tie_embeddings=True)
ARCHS = {"0.5B": QWEN25_05B, "1.5B": QWEN25_15B}
# CPU-scaled: width / 7-8, depth / 6 (24 : 28 -> 4 : 5), head dim 64, intermediate / hidden as in Qwen2.5 (4864/896,
# 8960/1536), a 16384-token vocabulary: a step at a few thousand tokens takes seconds
CPU_ARCHS = {
    "0.5B": dict(vocab=16384, hidden=128, layers=4, heads=2, kv_heads=1, intermediate=704, tie_embeddings=True),
    "1.5B": dict(vocab=16384, hidden=192, layers=5, heads=3, kv_heads=1, intermediate=1120, tie_embeddings=True),
}
NO_OFFLOADING = ("activation offloading moves activations from the accelerator to host memory; on CPU they are there "
                 "already")
TILES = 8  # tiled_mlp of the tiled configs (the "MLP tiled over 8 sequence chunks")
CONFIGS = (
    Config("trl", "trl"),
    Config("fastrl", "fastrl"),
    Config("fastrl+offload", "fastrl", activation_offloading=True),
    Config("fastrl+tiled", "fastrl", tiled_mlp=TILES),
    Config("fastrl+both", "fastrl", activation_offloading=True, tiled_mlp=TILES),
)


def _shapes(device: str, archs) -> dict:
    """Each architecture's shape and the grid of completion lengths searched."""
    if device.startswith("cuda"):
        grid = (4096, 8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072)
        return {a: W4Shape(f"W5-{a}", **ARCHS[a], dtype="bfloat16", completions=8, prompt_len=128, lengths=grid,
                           note=f"Qwen2.5-{a} architecture, random init, bf16, 8 completions per step") for a in archs}
    return {a: W4Shape(f"W5-{a}-cpu", **CPU_ARCHS[a], dtype="float32", completions=2, prompt_len=32,
                       lengths=(256, 512, 1024, 1536, 2048, 3072, 4096, 6144),
                       note=f"CPU-scaled Qwen2.5-{a} architecture (H={CPU_ARCHS[a]['hidden']}, "
                            f"I={CPU_ARCHS[a]['intermediate']}, {CPU_ARCHS[a]['layers']} layers, V=16384), float32, "
                            "2 completions per step") for a in archs}


def plan_for(device: str, mode: str) -> Plan:
    """W5 for this device and mode ("smoke", "quick", "full")."""
    cuda = device.startswith("cuda")
    if mode == "smoke":
        s = W4Shape("W5-smoke", 512, 32, 1, 2, 1, 128, False, "float32", completions=2, prompt_len=8, lengths=(32, 64),
                    note="smoke test: tiny model, numbers mean nothing")
        cfgs = tuple(replace(c, tiled_mlp=2) if c.tiled_mlp else c for c in CONFIGS)
        return Plan(device, mode, {"smoke": s}, (64.0,), "total" if cuda else "extra", cfgs,
                    headline="fastrl+both" if cuda else "fastrl+tiled", timeout_s=300)
    shapes = _shapes(device, ("0.5B",) if mode == "quick" else ("0.5B", "1.5B"))
    if cuda:
        # warm-up at 2048 tokens compiles and autotunes the Triton kernels (keyed on H and V) without doubling a
        # long step's time; two timed steps
        return Plan(device, mode, shapes, (24 * GIB,) if mode == "quick" else (24 * GIB, 80 * GIB), "total",
                    CONFIGS, reps=2, warmup=1, warmup_len=2048, timeout_s=1200)
    # 280 MB of extra RSS: between the grid points where the two architectures' plain and tiled steps cross it
    return Plan(device, mode, shapes, (280.0,), "extra", CONFIGS, headline="fastrl+tiled", timeout_s=900)


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


def run(plan: Plan, con) -> list[dict]:
    """Every (architecture, budget, config): ``longest_fit`` over the grid, one fresh process per point, each point
    measured once for every budget; the hint is the config's answer at the next smaller budget, else the best of
    the configs before it (most memory first). A point that fails does not fit. The headline config is also
    measured at stock TRL's longest length, for the time ratio. Returns the rows."""
    from rich.markup import escape

    cache: dict[tuple, dict] = {}

    def point(arch: str, c: Config, i: int) -> dict:
        key = (arch, c.name, plan.shapes[arch].lengths[i])
        if key not in cache:
            cache[key] = measure_point(plan, "w5", arch, c, key[2], con)
        return cache[key]

    def fits(arch: str, c: Config, i: int, b: float) -> bool:
        r = point(arch, c, i)
        return r["status"] == "ok" and r["fits"][f"{b:.0f}"]

    rows_na: list[dict] = []
    for arch, s in plan.shapes.items():
        runnable = [c for c in plan.configs if plan.device.startswith("cuda") or not c.activation_offloading]
        for c in plan.configs:
            if c not in runnable:
                rows_na.append(point_row("w5", s, arch, c, None, "n/a", NO_OFFLOADING))
                con.print(f"[dim]{s.name:>12} {c.name:<15} n/a: {escape(NO_OFFLOADING)}[/dim]")
        answer: dict[tuple, int] = {}  # (config, budget) -> grid index of the longest fit (-1: none)
        for b in sorted(plan.budgets_mb):
            best = -1
            for c in runnable:
                smaller = [answer[(c.name, x)] for x in plan.budgets_mb if x < b and (c.name, x) in answer]
                answer[(c.name, b)] = longest_fit(lambda i: fits(arch, c, i, b), len(s.lengths),
                                                  max(smaller) if smaller else best)
                best = max(best, answer[(c.name, b)])
            trl, head = answer.get(("trl", b), -1), answer.get((plan.headline, b), -1)
            if trl >= 0 and head >= 0:
                point(arch, next(c for c in runnable if c.name == plan.headline), min(trl, head))
    order = {c.name: k for k, c in enumerate(plan.configs)}
    rows = sorted(list(cache.values()) + rows_na,
                  key=lambda r: (list(plan.shapes).index(r["arch"]), order[r["config"]], r["completion_len"] or 0))
    add_ratios(rows)
    return rows


def summarize(plan: Plan, rows: list[dict]) -> dict:
    """Per architecture and budget: the longest fitting completion per config, and the headline config vs TRL."""
    out = {}
    for arch, s in plan.shapes.items():
        out[arch] = {}
        for b in plan.budgets_mb:
            longest, at_top = {}, {}
            for c in plan.configs:
                pts = [r for r in rows if r["arch"] == arch and r["config"] == c.name]
                if pts and pts[0]["status"] == "n/a":
                    longest[c.name] = "n/a"
                    continue
                fit = [r["completion_len"] for r in pts if r["status"] == "ok" and r[f"peak_{plan.budget_on}_mb"] <= b]
                longest[c.name] = max(fit) if fit else None
                at_top[c.name] = bool(fit) and max(fit) == max(s.lengths)
            e = out[arch][f"{b:.0f}"] = {"budget_mb": b, "longest": longest, "fits_largest_length_tried": at_top}
            p, t, h = longest.get("fastrl"), longest.get("trl"), longest.get(plan.headline)
            if isinstance(p, int) and isinstance(h, int):
                e["length_ratio_vs_fastrl"] = h / p
            if isinstance(t, int) and isinstance(h, int):
                e["length_ratio"] = h / t
                L = min(t, h)  # the longest length both fit (run() measures the headline config there)
                at = {r["config"]: r for r in rows if r["arch"] == arch and r["completion_len"] == L
                      and r["status"] == "ok" and r["config"] in ("trl", plan.headline)}
                if len(at) == 2:
                    e["time_ratio_at"] = L
                    e["time_ratio"] = at[plan.headline]["step_ms"]["median"] / at["trl"]["step_ms"]["median"]
    return out


def targets(plan: Plan, summary: dict) -> dict:
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


def _x(v, f: str = ".2f") -> str:
    return "" if v is None else f"{v:{f}}x"


def print_tables(con, plan: Plan, rows: list[dict], summary: dict, tgt: dict, title: str) -> None:
    """The points, then per architecture and budget the longest fit per config and the headline's ratios, then the
    targets' verdicts."""
    print_points(con, rows, title, plan, by=("arch", "config"))
    h = plan.headline
    for arch, per in summary.items():  # '>=': fits the longest length of the grid, the limit is higher
        for key, e in per.items():
            longest = ", ".join(f"{n} " + {"n/a": "n/a", None: "none"}.get(v, (">=" if top else "") + str(v))
                                for n, v in e["longest"].items() for top in [e["fits_largest_length_tried"].get(n)])
            named = (("length_ratio", "trl's length"), ("length_ratio_vs_fastrl", "fastrl's length"),
                     ("time_ratio", "trl's step time"))
            ratios = [f"{_x(e[k])} {what}" for k, what in named if k in e]
            at = f" (at {e['time_ratio_at']} tokens)" if "time_ratio" in e else ""
            con.print(f"W5 {arch}, longest completion within {float(key):.0f} MB ({plan.budget_on} step memory): "
                      f"{longest}" + (f"; {h}: {', '.join(ratios)}{at}" if ratios else ""))
    if not tgt.get("evaluated"):
        con.print(f"[yellow]no targets evaluated: {tgt.get('why')}[/yellow]")
    for c in tgt.get("checks", []):
        where = f"target {c['arch']} @ {c['budget_mb'] / GIB:.0f} GiB: {h}"
        bound = " (a lower bound)" if c.get("lower_bound") else ""
        report.judge(con, [(f"{where} length vs trl's{bound}", c.get("length_ratio"), 3, "", True),
                           (f"{where} step time vs trl's", c.get("time_ratio"), 1.1)])


def _report(plan: Plan, rows: list[dict], con, title: str, elapsed: float) -> dict:
    """W5's tables and its JSON's fields: the plan, the summary, the targets, every row."""
    summary = summarize(plan, rows)
    tgt = targets(plan, summary)
    print_tables(con, plan, rows, summary, tgt, title)
    return {"plan": asdict(plan), "summary": summary, "targets": tgt, "rows": rows}



def cli(args, device: str, con) -> int:
    """``python -m bench w5`` (``bench/__main__.py`` parses the shared options and W5's)."""
    return command("w5", args, device, con, plan_for(device, report.mode(args)), run, _report,
                   archs=_shapes(device, ARCHS))
