"""What ``python -m bench session`` prints and decides: ratios within the run, the targets, the summary table.

Ratios are taken against a row of the same session (and, for W1-W3, of the same process): TRL's at the same
workload, the cuBLAS floor's, the full-vocabulary head's (kept sets), fastrl's eager step (compile). Targets
(issue 33): the fastest fastrl row at each of W1 <= 0.75x TRL's time, W1-lp <= 0.95x (log-probs for an arbitrary
loss recompute the logits in the backward on every design that stores nothing: ``python -m bench roofline``),
W2 <= 0.85x, W2-lp <= 0.9x, W3 <= 0.95x, among the implementations that passed the float64 checks (and in any
launch configuration: the defaults follow the fastest, ``python -m bench defaults``); the divergence <= 0.8x at
each beta and implementation; the GRPOTrainer step (W4) <= 0.95x; memory no worse than main 8f83654 measured on
the H200 (W1 two pass 0.18x TRL's extra memory, one pass
0.83x); the kept-set head at K=64 <= 0.15x the full head's time (Zipf sets, W1 and W2 shapes).
"""

from __future__ import annotations

__all__ = ["add_ratios", "checks_passed", "targets", "print_summary", "TIME_TARGETS", "MEM_TARGETS"]

LMHEAD = ("tournament", "configs", "autotune")
TIME_TARGETS = (("W1", 0.75), ("W1-lp", 0.95), ("W2", 0.85), ("W2-lp", 0.9), ("W3", 0.95))
# (workload, provider, path, max extra memory vs TRL): main 8f83654 on the H200, 513 / 2887 MB and 2387 / 2887 MB
MEM_TARGETS = (("W1", "fastrl", "two pass", 0.18), ("W1", "fastrl-fused", "one pass", 0.83))
DIVERGENCE_TARGET = 0.8
KEPT_TARGET = 0.15
W4_TARGET = 0.95


def _ok(r: dict) -> bool:
    return r.get("status") == "ok" and bool(r.get("total_ms"))


def _ms(r: dict) -> float:
    return r["total_ms"]["median"]


def _versus(rows: list[dict], sections: tuple, ref_provider: str, ref_section: str | None, name: str) -> None:
    """``time_vs_<name>`` / ``mem_vs_<name>`` of every ok row of ``sections`` against the ``ref_provider`` row of the
    same workload (in ``ref_section`` when given)."""
    ref = {r["workload"]: r for r in rows if r.get("provider") == ref_provider and _ok(r)
           and r["section"] == (ref_section or r["section"]) and r["section"] in sections}
    for r in rows:
        b = ref.get(r.get("workload"))
        if r["section"] not in sections or not _ok(r) or b is None or r is b:
            continue
        r[f"time_vs_{name}"] = _ms(r) / _ms(b)
        if r.get("extra_mb") is not None and b.get("extra_mb"):
            r[f"mem_vs_{name}"] = r["extra_mb"] / b["extra_mb"]


def add_ratios(rows: list[dict]) -> None:
    _versus(rows, LMHEAD, "trl", "tournament", "trl")
    floor = {r["workload"]: r for r in rows if r.get("provider") == "cublas" and _ok(r)}
    for r in rows:
        if r["section"] in LMHEAD and _ok(r) and r["workload"] in floor and r.get("provider") != "cublas":
            r["floor_fraction"] = _ms(floor[r["workload"]]) / _ms(r)
        if r.get("flops") and _ok(r):
            r["tflops"] = r["flops"] / (_ms(r) * 1e-3) / 1e12
    _versus(rows, ("divergence",), "trl", None, "trl")
    _versus(rows, ("keptset",), "full", None, "full")
    _versus(rows, ("compile",), "fastrl-eager", None, "eager")
    _versus(rows, ("w4",), "trl", None, "trl")


def checks_passed(rows: list[dict]) -> dict[str, bool]:
    """implementation -> whether every float64 check of it ran and passed in this session."""
    out: dict[str, bool] = {}
    for r in rows:
        if r["section"] == "checks" and r.get("status") != "n/a":  # n/a: a shape the implementation refuses
            impl = r.get("implementation")
            out[impl] = out.get(impl, True) and r.get("status") == "ok" and bool(r.get("pass"))
    return out


def _label(r: dict) -> str:
    path = {"fastrl-fused": "one pass", "fastrl": "two pass" if r.get("kind") == "loss" else ""}.get(r["provider"], "")
    cfg = r.get("config") or "default"
    return f"{r.get('implementation') or r['provider']}" + (f" ({path})" if path else "") + \
        ("" if cfg == "default" else f" [{cfg}]")


def _fastest(rows: list[dict], workload: str, passed: dict, providers=None) -> dict | None:
    cands = [r for r in rows if r["section"] in LMHEAD and r["workload"] == workload and _ok(r) and "time_vs_trl" in r
             and r["provider"].startswith("fastrl") and (providers is None or r["provider"] in providers)
             and passed.get(r.get("implementation"), not passed)]  # no checks ran: every implementation counts
    return min(cands, key=_ms) if cands else None


def targets(rows: list[dict], con=None, smoke: bool = False) -> dict:
    """Each target: the row it is judged on, its value, PASS / FAIL, or why it was not evaluated."""
    passed = checks_passed(rows)
    out = {}

    def report(name: str, value, limit: float, what: str, extra: str = "") -> None:
        res = {"value": value, "target": limit, "pass": value is not None and value <= limit, "row": what}
        out[name] = res
        if con is None:
            return
        if value is None:
            con.print(f"[yellow]{name}: not evaluated ({what}); target <= {limit:.2f}x[/yellow]")
        else:
            verdict = "[green]PASS[/green]" if res["pass"] else "[red]FAIL[/red]"
            con.print(f"{name}: {what} {value:.2f}x (target <= {limit:.2f}x): {verdict}{extra}")

    for wl, limit in TIME_TARGETS:
        best = _fastest(rows, wl, passed)
        default = next((r for r in rows if r["section"] == "tournament" and r["workload"] == wl and _ok(r)
                        and r.get("implementation") == r.get("auto") and r["provider"] == "fastrl-fused"
                        and "time_vs_trl" in r), None) or next(
            (r for r in rows if r["section"] == "tournament" and r["workload"] == wl and _ok(r)
             and r.get("implementation") == r.get("auto") and "time_vs_trl" in r), None)
        extra = f"; backend='auto' today: {_label(default)} {default['time_vs_trl']:.2f}x" if default else ""
        report(f"{wl} time vs TRL", best and best["time_vs_trl"], limit,
               _label(best) if best else "no fastrl or TRL row", extra)
    for wl, prov, path, limit in MEM_TARGETS:
        best = _fastest(rows, wl, passed, providers=(prov,))
        value = best.get("mem_vs_trl") if best else None
        report(f"{wl} {path} extra memory vs TRL", value, limit, _label(best) if best else "no row")
    for r in rows:
        if r["section"] == "divergence" and r["provider"] == "fastrl":
            impl = f" ({r['implementation']})" if r.get("implementation") else ""
            report(f"divergence {r['workload']} time vs TRL{impl}", r.get("time_vs_trl"), DIVERGENCE_TARGET,
                   f"fused_divergence{impl}" if "time_vs_trl" in r else "no fastrl or TRL row")
        if r["section"] == "w4" and r["provider"] == "fastrl":
            report(f"{r['workload']} step time vs TRL", r.get("time_vs_trl"), W4_TARGET,
                   "GRPOTrainer step" if "time_vs_trl" in r else "no fastrl or TRL row")
        if r["section"] == "keptset" and r["provider"] == "kept-zipf":
            report(f"{r['workload']} K=64 time vs the full head", r.get("time_vs_full"), KEPT_TARGET,
                   "kept set (Zipf ids)" if "time_vs_full" in r else "no kept or full row")
    for impl, ok in passed.items():
        if con is not None:
            con.print(f"float64 checks, {impl}: " + ("[green]PASS[/green]" if ok else "[red]FAIL[/red] (it cannot "
                                                                                      "become a default)"))
    if smoke and con is not None:
        con.print("[yellow](smoke run: tiny shapes, interpreted kernels: these verdicts check the plumbing and mean "
                  "nothing)[/yellow]")
    return out


def print_summary(con, rows: list[dict], title: str) -> None:
    """W1-W3: every tournament row, and per (workload, implementation, provider) the best candidate configuration
    and autotune; then the other sections' rows; failures and skips last, one line each."""
    from rich.markup import escape
    from rich.table import Table

    tab = Table(title=title, title_justify="left")
    for c in ("section", "workload", "who", "ms [min-max]", "x TRL", "% floor", "extra MB", "x TRL mem", "error"):
        tab.add_column(c, justify="left" if c in ("section", "workload", "who", "error") else "right")
    best: dict[tuple, dict] = {}
    for r in rows:
        if r["section"] in ("configs",) and _ok(r):
            key = (r["workload"], r.get("implementation"), r["provider"])
            if key not in best or _ms(r) < _ms(best[key]):
                best[key] = r
    shown = [r for r in rows if r["section"] != "configs" and r["section"] != "checks"] + list(best.values())
    for r in shown:
        if not _ok(r):
            continue
        t = r["total_ms"]
        err = ", ".join(f"{k} {v:.1e}" for k, v in (r.get("error") or {}).items() if not k.endswith("_torch"))
        tab.add_row(r["section"], r["workload"], escape(_label(r)),
                    f"{t['median']:.2f} [{t['min']:.2f}-{t['max']:.2f}]",
                    _x(r.get("time_vs_trl") or r.get("time_vs_full") or r.get("time_vs_eager")),
                    f"{100 * r['floor_fraction']:.0f}" if "floor_fraction" in r else "",
                    f"{r['extra_mb']:.0f}" if r.get("extra_mb") is not None else "", _x(r.get("mem_vs_trl")), err)
    con.print(tab)
    for r in rows:
        if not _ok(r) and r["section"] != "checks" or (r["section"] == "checks" and not r.get("pass", False)):
            con.print(f"[dim]{r['section']} {r.get('workload', '')} {escape(_label(r))}: {r.get('status')} "
                      f"{escape(str(r.get('reason', '')))[:200]}[/dim]")


def _x(v) -> str:
    return f"{v:.2f}x" if v is not None else ""
