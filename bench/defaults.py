"""``python -m bench defaults [PATH...]``: ``kernels/_defaults.py`` (read by ``fastrl.ops.backend.choose_triton`` and
``fastrl.kernels.tuning.config_for``) from committed GPU session results; ``--check`` exits 1 when it is stale. The
rules: docs/gpu-window.md, "From results to defaults". A row is crowned only within the memory ceiling: its extra
memory at most TRL's on the same workload in the same run (``fastrl.ops.budget.ceiling`` where TRL did not run);
the fastest rows refused for memory are listed in the table (REFUSED).
"""

from __future__ import annotations

import math
import pprint
from pathlib import Path

from bench.report import median_ms as _ms
from bench.report import session_files

__all__ = ["build", "render", "add_options", "command", "TABLE_PATH", "MARGIN"]

REPO_ROOT = Path(__file__).resolve().parent.parent
TABLE_PATH = REPO_ROOT / "kernels" / "_defaults.py"
LMHEAD = ("tournament", "configs")  # the sections whose rows ran a known configuration
KINDS = (("loss", "fastrl-fused"), ("logprob", "fastrl"), ("forward", "fastrl"))  # kind, the provider that decides it
MARGIN = 0.03  # a winner's median must be at most (1 - MARGIN) x the built-in's, same process: 6 timed steps are noisy
BUILTIN = "triton-hybrid"  # rows written before sessions recorded `builtin`: CUDA with float32-out cuBLAS
# the rows that decide a kernel's configuration: the first (kind, provider) in which it ran
KERNEL_DECIDERS = (("logprob", "fastrl"), ("forward", "fastrl"), ("loss", "fastrl-fused"), ("loss", "fastrl"))


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


def _usable(data: dict, allow_dirty: bool) -> str | None:
    """Why a session file cannot set defaults, or None."""
    env = data.get("env", {})
    if data.get("command") != "session":
        return "not a `bench session` file"
    if data.get("smoke") or env.get("device_type") != "cuda":
        return "not a GPU measurement (smoke run or CPU)"
    if not env.get("family"):
        return "no GPU family recorded"
    if env.get("tree_clean") is not True and not allow_dirty:
        return "measured a tree with uncommitted changes (or of unknown provenance); --allow-dirty takes it"
    return None


def _h_ranges(hs) -> dict[int, tuple]:
    """Each measured H -> [h_min, h_max): bounds at the geometric middle between neighbours, the ends open."""
    hs = sorted(set(hs))
    cuts = [math.ceil(math.sqrt(a * b)) for a, b in zip(hs, hs[1:])]
    return {h: (cuts[i - 1] if i else None, cuts[i] if i < len(cuts) else None) for i, h in enumerate(hs)}


def _config(r: dict) -> str:
    return r.get("config") or "default"


def _label(r: dict) -> str:
    return r["implementation"] + ("" if _config(r) == "default" else f" [{_config(r)}]")


def _evidence(win: dict, base: dict, what: str) -> str | None:
    """``what`` and the margin where ``win`` beat ``base`` by MARGIN in the same process (rows without a pid count
    as the same), else None."""
    same = win.get("pid") is None or base.get("pid") is None or win["pid"] == base["pid"]
    if not same or _ms(win) > (1 - MARGIN) * _ms(base):
        return None
    return (f"{what}: {_label(win)} {_ms(win):.2f} ms against {_label(base)} {_ms(base):.2f} ms "
            f"({_ms(win) / _ms(base):.3f}x)")


def _lm_rows(rows: list[dict], passed: dict[str, bool]) -> list[dict]:
    return [r for r in rows if r.get("section") in LMHEAD and r.get("status") == "ok" and r.get("total_ms")
            and r.get("implementation") and passed.get(r["implementation"]) is True]


def _config_wins(lm: list[dict]) -> dict[tuple, dict]:
    """(implementation, H, dtype, kernel) -> {config, use_tma, evidence} where a candidate beat the built-in
    configuration, None where this session measured both and none did."""
    out = {}
    for impl, H, dtype in sorted({(r["implementation"], r["H"], r["dtype"]) for r in lm}):
        mine = [r for r in lm if (r["implementation"], r["H"], r["dtype"]) == (impl, H, dtype)]
        for kernel in sorted({k for r in mine for k in r.get("configs_served") or {}}):
            for kind, provider in KERNEL_DECIDERS:
                rows = [r for r in mine if (r["kind"], r["provider"]) == (kind, provider)
                        and kernel in (r.get("configs_served") or {})]
                if rows:
                    break
            base = next((r for r in rows if _config(r) == "default"), None)
            win = min((r for r in rows if _config(r) != "default"), key=_ms, default=None)
            if base is None or win is None:
                continue  # no built-in row to beat, or no candidate: this session did not decide the kernel
            served = win["configs_served"][kernel]
            why = _evidence(win, base, f"{kernel} at {win['workload']}")
            same = served["config"] == base["configs_served"][kernel]["config"]
            # None: measured, and the built-in configuration stays
            out[(impl, H, dtype, kernel)] = None if same or why is None else {
                "config": served["config"], "use_tma": served["use_tma"], "evidence": why}
    return out


def _installed(r: dict, wins: dict) -> bool:
    """Whether the row ran each of its kernels at the configuration the table will give it: a candidate's row where
    that candidate won for every kernel it served, a default row where none of its kernels changes."""
    for kernel, s in (r.get("configs_served") or {}).items():
        won = wins.get((r["implementation"], r["H"], r["dtype"], kernel))
        if not (s["config"] == won["config"] if won is not None else _config(r) == "default"):
            return False
    return True


def _ceiling_mib(r: dict, trl: dict) -> float | None:
    """The memory a row may hold (MiB): TRL's extra memory on its workload in the same process, else the ceiling's
    formula on its shape (``fastrl.ops.budget.ceiling``); None when neither is known."""
    same = trl.get((r["workload"], r.get("pid")), trl.get((r["workload"], None)))
    if same is not None:
        return same
    if not all(r.get(k) for k in ("N", "V", "H")):
        return None
    import torch

    from fastrl.ops.budget import ceiling

    grads = r["kind"] != "forward"
    return ceiling(r["N"], r["V"], r["H"], getattr(torch, r["dtype"]), grads, grads) / 2**20


def _fits(r: dict, trl: dict) -> bool:
    """Whether the row's measured extra memory is within its ceiling (1 MiB of allocator slack)."""
    cap = _ceiling_mib(r, trl)
    return r.get("extra_mb") is not None and cap is not None and r["extra_mb"] <= cap + 1.0


def _memory(r: dict, trl: dict) -> str:
    cap = _ceiling_mib(r, trl)
    return f"{r.get('extra_mb', float('nan')):.0f} MiB (ceiling {cap:.0f})" if cap is not None else "memory unknown"


def _choice_wins(lm: list[dict], wins: dict, trl: dict, refused: list) -> dict[tuple, dict]:
    """(kind, H, dtype) -> {implementation, evidence} where the fastest installable row within the memory ceiling
    beat the built-in choice, None where this session measured the built-in choice and nothing beat it. The rows
    faster than the winner but over the ceiling go to ``refused``."""
    out = {}
    for kind, provider in KINDS:
        for H, dtype in sorted({(r["H"], r["dtype"]) for r in lm if r["kind"] == kind}):
            mine = sorted((r for r in lm if (r["kind"], r["provider"], r["H"], r["dtype"]) == (kind, provider, H, dtype)
                           and _installed(r, wins)), key=_ms)
            builtin = mine[0].get("builtin", BUILTIN) if mine else None
            base = next((r for r in mine if r["implementation"] == builtin), None)
            if base is None:
                continue  # no built-in row to beat: this session did not decide the key
            within = [r for r in mine if _fits(r, trl)]
            win = within[0] if within else base
            refused += [{"kind": kind, "dtype": dtype, "H": H, "workload": r["workload"], "implementation": _label(r),
                         "ms": round(_ms(r), 2), "memory": _memory(r, trl)}
                        for r in mine if _ms(r) < _ms(win) and not _fits(r, trl) and r is not base]
            why = None if win["implementation"] == builtin else _evidence(win, base, win["workload"])
            # None: measured, and the built-in choice stays
            out[(kind, H, dtype)] = None if why is None else {
                "implementation": win["implementation"],
                "evidence": f"{why}; memory {_memory(win, trl)}, built-in {_memory(base, trl)}"}
    return out


def _trl_memory(rows: list[dict]) -> dict[tuple, float]:
    """(workload, pid) and (workload, None) -> TRL's extra memory (MiB) in this session."""
    out = {}
    for r in rows:
        if r.get("provider") == "trl" and r.get("status") == "ok" and r.get("extra_mb") is not None:
            out[(r["workload"], r.get("pid"))] = out[(r["workload"], None)] = r["extra_mb"]
    return out


def _checks_by_commit(runs: list[tuple]) -> dict[tuple, dict[str, bool]]:
    """(family, commit) -> implementation -> passed: every float64 check row of that commit on that family (the
    second call of a window checks one case per implementation, the first all of them) passed, and some session ran
    the full set (``"checks": "full"``; files older than that field count as full)."""
    from bench.session_report import checks_passed

    merged: dict[tuple, dict[str, bool]] = {}
    full: dict[tuple, set] = {}
    for run, data in runs:
        key = (run["family"], run["commit"])
        mine = checks_passed(data["rows"])
        group = merged.setdefault(key, {})
        for impl, ok in mine.items():
            group[impl] = group.get(impl, True) and ok
        if data.get("checks", "full") == "full":
            full.setdefault(key, set()).update(mine)
    return {key: {i: ok and i in full.get(key, set()) for i, ok in group.items()} for key, group in merged.items()}


def build(paths: list[Path], allow_dirty: bool = False) -> dict:
    """The table from the session files under ``paths``: every usable session of a family, oldest first, each
    entry from the newest session that decided its key."""
    runs = []
    for f, data in session_files(paths):
        env = data.get("env", {})
        run = {"run": _rel(f), "device": env.get("device"), "family": env.get("family"),
               "commit": env.get("fastrl_commit"), "tree_clean": env.get("tree_clean"), "created": env.get("created")}
        runs.append((run, data, _usable(data, allow_dirty)))
    choices, configs, measured_h, refused = {}, {}, {}, {}
    passed = _checks_by_commit([(run, data) for run, data, why in runs if why is None])
    runs = [(run, data, why if why is not None or any(passed[(run["family"], run["commit"])].values()) else
             "no implementation passed the full float64 checks at this commit on this family")
            for run, data, why in runs]
    for run, data, why in sorted(runs, key=lambda x: str(x[0]["created"])):
        if why is not None:
            continue
        fam, lm = run["family"], _lm_rows(data["rows"], passed[(run["family"], run["commit"])])
        measured_h.setdefault(fam, set()).update(r["H"] for r in lm)
        wins, over = _config_wins(lm), []
        decided_choices = _choice_wins(lm, wins, _trl_memory(data["rows"]), over)
        for found, decided in ((choices, decided_choices), (configs, wins)):
            for k, v in decided.items():  # a newer session's verdict on a key replaces an older one's, win or not
                found[(fam, *k)] = v if v is None else {**v, "run": run["run"]}
        for e in over:  # the newest session's refusals per key, like its verdicts
            refused[(fam, e["kind"], e["H"], e["dtype"])] = []
        for e in over:
            refused[(fam, e["kind"], e["H"], e["dtype"])].append({"family": fam, **e, "run": run["run"]})
    table = _table(runs, {k: v for k, v in choices.items() if v is not None},
                   {k: v for k, v in configs.items() if v is not None}, measured_h)
    table["REFUSED"] = [e for k in sorted(refused, key=str) for e in refused[k]]
    return table


def _table(runs, choices: dict, configs: dict, measured_h: dict) -> dict:
    table = {"RUNS": [], "CHOICES": [], "CONFIGS": []}
    used = {v["run"] for v in list(choices.values()) + list(configs.values())}
    for run, _, why in runs:
        if why is None and run["run"] not in used:
            why = "no implementation or configuration beat the built-in one here (or a newer run decided it)"
        table["RUNS"].append({**run, "used": why is None, "why": why or ""})
    ranges = {fam: _h_ranges(hs) for fam, hs in measured_h.items()}
    for (fam, kind, H, dtype), v in sorted(choices.items(), key=str):
        lo, hi = ranges[fam][H]
        table["CHOICES"].append({"family": fam, "kind": kind, "dtype": dtype, "h_min": lo, "h_max": hi,
                                 "implementation": v["implementation"], "run": v["run"], "evidence": v["evidence"]})
    groups: dict[tuple, dict] = {}
    for (fam, impl, H, dtype, kernel), v in sorted(configs.items(), key=str):
        lo, hi = ranges[fam][H]
        g = groups.setdefault((fam, impl, dtype, H, v["use_tma"], v["run"]), {
            "family": fam, "implementation": impl, "dtype": dtype, "h_min": lo, "h_max": hi, "use_tma": v["use_tma"],
            "configs": {}, "run": v["run"], "evidence": []})
        g["configs"][kernel] = v["config"]
        g["evidence"].append(v["evidence"])
    table["CONFIGS"] = [{**g, "evidence": "; ".join(g["evidence"])} for g in groups.values()]
    return table


_HEADER = '''"""Defaults measured on GPUs: generated by ``python -m bench defaults bench/results/``; do not edit by hand.

Read by ``fastrl.ops.backend.choose_triton`` (CHOICES: which implementation ``backend="auto"`` runs) and
``fastrl.kernels.tuning.config_for`` (CONFIGS: which launch configuration a kernel gets). A family, kind, H range
or dtype without an entry keeps the built-in choice. Each entry names the session file that chose it.
"""
'''
_COMMENTS = {
    "RUNS": "# the committed session files read; each entry comes from the newest run that decided its key",
    "CHOICES": "# implementation per (family, kind, dtype, H range): h_min <= H < h_max, None = unbounded",
    "CONFIGS": '# launch configuration per (family, implementation, dtype, H range, TMA): kernel -> "BNxBVxBH wW sS"',
    "REFUSED": "# rows faster than the choice but over the memory ceiling (extra memory above TRL's on the same work)",
}


def render(table: dict) -> str:
    """The module text: the header, then RUNS, CHOICES and CONFIGS as tuples of dicts."""
    parts = [_HEADER]
    for name in ("RUNS", "CHOICES", "CONFIGS", "REFUSED"):
        items = table.get(name, ())
        lines = ("    " + pprint.pformat(x, width=112, sort_dicts=False).replace("\n", "\n    ") + ",\n" for x in items)
        body = "(\n" + "".join(lines) + ")" if items else "()"
        parts.append(f"{_COMMENTS[name]}\n{name} = {body}\n")
    return "\n".join(parts)


def add_options(ap) -> None:
    ap.add_argument("paths", nargs="*", default=[str(REPO_ROOT / "bench" / "results")],
                    help="session files or folders holding them (default bench/results)")
    ap.add_argument("--out", default=str(TABLE_PATH), help="the module to write (default kernels/_defaults.py)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out differs from the results")
    ap.add_argument("--allow-dirty", action="store_true", help="also runs of a tree with uncommitted changes")


def command(args, con=None) -> int:
    say = con.print if con is not None else print
    table = build([Path(p) for p in args.paths], allow_dirty=args.allow_dirty)
    text = render(table)
    for r in table["RUNS"]:
        say(f"{r['run']}: " + ("used" if r["used"] else f"not used ({r['why']})"))
    for e in table["CHOICES"]:
        say(f"{e['family']} {e['kind']:<8} {e['dtype']} H in [{e['h_min']}, {e['h_max']}): {e['implementation']}  "
            f"({e['evidence']})")
    for e in table.get("REFUSED", ()):
        say(f"{e['family']} {e['kind']:<8} {e['dtype']} H={e['H']}: not {e['implementation']} at {e['workload']} "
            f"({e['ms']} ms, {e['memory']}: over the memory ceiling)")
    out = Path(args.out)
    if args.check:
        same = out.is_file() and out.read_text() == text
        say(f"{out}: " + ("up to date" if same else "DIFFERS from what the results give: run python -m bench defaults"))
        return 0 if same else 1
    out.write_text(text)
    say(f"wrote {out}: {len(table['CHOICES'])} choices, {len(table['CONFIGS'])} configurations from "
        f"{sum(r['used'] for r in table['RUNS'])} run(s)")
    return 0

