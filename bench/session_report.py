"""What ``python -m bench session`` prints and decides: ratios within the run, the targets (issue 33), the summary.

Ratios are against a row of the same session (W1-W3: of the same process). A W1-W3 target is judged on the fastest
fastrl row among the implementations that passed the float64 checks, in any launch configuration; docs/benchmarks.md
says what each ratio means.
"""

from __future__ import annotations

from bench import report
from bench.report import median_ms as _ms

__all__ = ["add_ratios", "checks_passed", "targets", "print_summary", "TIME_TARGETS", "MEM_TARGETS"]

LMHEAD = ("tournament", "configs")
TIME_TARGETS = (("W1", 0.75), ("W1-lp", 0.95), ("W2", 0.85), ("W2-lp", 0.9), ("W3", 0.95))
# (workload, provider, path, max extra memory vs TRL): main 8f83654 on the H200, 513 / 2887 MB and 2387 / 2887 MB
MEM_TARGETS = (("W1", "fastrl", "two pass", 0.18), ("W1", "fastrl-fused", "one pass", 0.83))
# one target per row: (section, provider, target name, ratio, limit, what it judges); the divergence at each beta and
# implementation, the GRPOTrainer step, the kept-set head at K=64 (Zipf sets, W1 and W2 shapes)
ROW_TARGETS = (
    ("divergence", "fastrl", "divergence {workload} time vs TRL{impl}", "trl", 0.8, "fused_divergence{impl}"),
    ("w4", "fastrl", "{workload} step time vs TRL", "trl", 0.95, "GRPOTrainer step"),
    ("keptset", "kept-zipf", "{workload} K=64 time vs the full head", "full", 0.15, "kept set (Zipf ids)"),
)
# (sections, the reference provider in the first of them, the ratios' suffix): time_vs_<suffix>, mem_vs_<suffix>
RATIOS = ((LMHEAD, "trl", "trl"), (("divergence",), "trl", "trl"), (("keptset",), "full", "full"),
          (("compile",), "fastrl-eager", "eager"), (("w4",), "trl", "trl"), (("profile",), "trl", "trl"),
          (("tournament", "budget"), "trl", "trl"))  # the budget's rows against the tournament's TRL rows


def _ok(r: dict) -> bool:
    return r.get("status") == "ok" and bool(r.get("total_ms"))


def add_ratios(rows: list[dict]) -> None:
    """``time_vs_<ref>`` / ``mem_vs_<ref>`` of each ok row against its reference row (the same workload, provider
    ``ref``), ``floor_fraction`` against the cuBLAS floor and ``tflops``."""
    for sections, ref, name in RATIOS:
        report.add_ratios(rows, name, lambda r: r.get("provider") == ref and r["section"] == sections[0],
                          mb="extra_mb", where=lambda r: r["section"] in sections)
    floor = {r["workload"]: r for r in rows if r.get("provider") == "cublas" and _ok(r)}
    for r in filter(_ok, rows):
        if r["section"] in LMHEAD and r["workload"] in floor and r.get("provider") != "cublas":
            r["floor_fraction"] = _ms(floor[r["workload"]]) / _ms(r)
        if r.get("flops"):
            r["tflops"] = r["flops"] / (_ms(r) * 1e-3) / 1e12


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


def _auto_today(rows: list[dict], wl: str) -> str | None:
    """What ``backend='auto'`` picks today at ``wl``, its tournament row's ratio (the one-pass loss first)."""
    mine = [r for r in rows if r["section"] == "tournament" and r["workload"] == wl and _ok(r)
            and r.get("implementation") == r.get("auto") and "time_vs_trl" in r]
    r = next((r for r in mine if r["provider"] == "fastrl-fused"), mine[0] if mine else None)
    return f"{wl}: backend='auto' today: {_label(r)} {r['time_vs_trl']:.2f}x TRL's time" if r else None


def targets(rows: list[dict], con=None, smoke: bool = False) -> dict:
    """Each target (``report.judge``): the row it is judged on, its value, PASS / FAIL, or why it was not evaluated."""
    passed = checks_passed(rows)

    def check(name: str, best: dict | None, ratio: str, limit: float, what: str = "") -> tuple:
        return name, best and best.get(ratio), limit, what or (_label(best) if best else "no row")

    checks = []
    for wl, limit in TIME_TARGETS:
        best = _fastest(rows, wl, passed)
        checks.append(check(f"{wl} time vs TRL", best, "time_vs_trl", limit, "" if best else "no fastrl or TRL row"))
    for wl, prov, path, limit in MEM_TARGETS:
        checks.append(check(f"{wl} {path} extra memory vs TRL", _fastest(rows, wl, passed, (prov,)), "mem_vs_trl",
                            limit))
    for r in rows:
        for section, prov, name, ref, limit, what in ROW_TARGETS:
            if r["section"] == section and r["provider"] == prov:
                impl = f" ({r['implementation']})" if r.get("implementation") else ""
                checks.append(check(name.format(workload=r["workload"], impl=impl), r, f"time_vs_{ref}", limit,
                                    what.format(impl=impl) if f"time_vs_{ref}" in r else f"no {prov} or {ref} row"))
    out = report.judge(con, checks)
    if con is not None:
        for line in filter(None, (_auto_today(rows, wl) for wl, _ in TIME_TARGETS)):
            con.print(line)
        for impl, ok in passed.items():
            con.print(f"float64 checks, {impl}: " + ("[green]PASS[/green]" if ok else
                                                     "[red]FAIL[/red] (it cannot become a default)"))
        if smoke:
            con.print("[yellow](smoke run: tiny shapes, interpreted kernels: these verdicts check the plumbing and "
                      "mean nothing)[/yellow]")
    return out


def print_summary(con, rows: list[dict], title: str) -> None:
    """Every ok row but the checks, the configs as the best candidate per (workload, implementation, provider); then
    the failures and skips, one line each."""
    from rich.markup import escape
    from rich.table import Table

    tab = Table(title=title, title_justify="left")
    for c in ("section", "workload", "who", "ms [min-max]", "x TRL", "% floor", "extra MB", "x TRL mem", "error"):
        tab.add_column(c, justify="left" if c in ("section", "workload", "who", "error") else "right")
    best: dict[tuple, dict] = {}
    for r in (r for r in rows if r["section"] == "configs" and _ok(r)):
        key = (r["workload"], r.get("implementation"), r["provider"])
        best[key] = min(best.get(key, r), r, key=_ms)
    for r in [r for r in rows if r["section"] not in ("configs", "checks") and _ok(r)] + list(best.values()):
        t, x = r["total_ms"], r.get("time_vs_trl") or r.get("time_vs_full") or r.get("time_vs_eager")
        err = ", ".join(f"{k} {v:.1e}" for k, v in (r.get("error") or {}).items() if not k.endswith("_torch"))
        tab.add_row(r["section"], r["workload"], escape(_label(r)),
                    f"{t['median']:.2f} [{t['min']:.2f}-{t['max']:.2f}]", f"{x:.2f}x" if x else "",
                    f"{100 * r['floor_fraction']:.0f}" if "floor_fraction" in r else "",
                    f"{r['extra_mb']:.0f}" if r.get("extra_mb") is not None else "",
                    f"{r['mem_vs_trl']:.2f}x" if r.get("mem_vs_trl") is not None else "", err)
    con.print(tab)
    for r in rows:
        if not r.get("pass", False) if r["section"] == "checks" else not _ok(r):
            con.print(f"[dim]{r['section']} {r.get('workload', '')} {escape(_label(r))}: {r.get('status')} "
                      f"{escape(str(r.get('reason', '')))[:200]}[/dim]")
