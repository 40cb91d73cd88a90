"""``python -m bench defaults bench/results/``: the measured defaults table, from committed GPU session results.

Reads every ``session*.json`` under the given folders (``python -m bench session``: a GPU run, not a smoke run, of a
clean tree) and writes ``kernels/_defaults.py`` (installed as ``fastrl.kernels._defaults``), which
``fastrl.ops.backend.choose_triton`` and ``fastrl.kernels.tuning.config_for`` read:

* ``CHOICES``: per GPU family (``sm90``: H100 and H200), kind of work, dtype and H range, the implementation whose
  row was fastest in the family's newest session: ``loss`` from ``policy_loss`` (W1, W2), ``logprob`` from
  ``fused_logprobs`` with gradients (W1-lp, W2-lp), ``forward`` from it without (W3); in any launch configuration;
* ``CONFIGS``: per family, implementation, dtype and H range, the launch configuration of each kernel in that
  implementation's fastest log-prob row (forward rows where it has none): the kernels run there in full;

each entry naming the session file and the evidence. Only implementations that passed every float64 check of
the same session can be chosen; a family, kind, dtype or H with no entry keeps the built-in choice. H ranges:
each measured H covers up to the geometric middle between it and the next measured H (896 and 4096: below and
from 1916). ``--check`` exits 1 when the committed file differs from what the results give (CI can run it).
"""

from __future__ import annotations

import json
import math
import pprint
import sys
from pathlib import Path

__all__ = ["find_sessions", "build", "render", "main", "TABLE_PATH"]

REPO_ROOT = Path(__file__).resolve().parent.parent
TABLE_PATH = REPO_ROOT / "kernels" / "_defaults.py"
LMHEAD = ("tournament", "configs", "autotune")
KINDS = (("loss", "fastrl-fused"), ("logprob", "fastrl"), ("forward", "fastrl"))  # kind, the provider that decides it


def find_sessions(paths: list[Path]) -> list[Path]:
    out = []
    for p in paths:
        out += sorted(p.rglob("session*.json")) if p.is_dir() else [p]
    return out


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


def _h_ranges(hs: list[int]) -> dict[int, tuple]:
    """Each measured H -> [h_min, h_max): bounds at the geometric middle between neighbours, the ends open."""
    hs = sorted(set(hs))
    cuts = [math.ceil(math.sqrt(a * b)) for a, b in zip(hs, hs[1:])]
    return {h: (cuts[i - 1] if i else None, cuts[i] if i < len(cuts) else None) for i, h in enumerate(hs)}


def _label(r: dict) -> str:
    cfg = r.get("config") or "default"
    return f"{r['implementation']}" + ("" if cfg == "default" else f" [{cfg}]")


def _entries(rows: list[dict], family: str, run: str) -> tuple[list[dict], list[dict]]:
    from bench.session_report import checks_passed

    passed = checks_passed(rows)
    lm = [r for r in rows if r.get("section") in LMHEAD and r.get("status") == "ok" and r.get("total_ms")
          and r.get("implementation") and passed.get(r["implementation"]) is True]
    trl = {r["workload"]: r["total_ms"]["median"] for r in rows
           if r.get("section") == "tournament" and r.get("provider") == "trl" and r.get("status") == "ok"}
    ranges = _h_ranges([r["H"] for r in lm])
    choices, configs = [], []
    for kind, provider in KINDS:
        for (H, dtype) in sorted({(r["H"], r["dtype"]) for r in lm if r["kind"] == kind}):
            key = (kind, provider, H, dtype)
            mine = sorted((r for r in lm if (r["kind"], r["provider"], r["H"], r["dtype"]) == key),
                          key=lambda r: r["total_ms"]["median"])
            if not mine:
                continue
            win = mine[0]
            other = next((r for r in mine if r["implementation"] != win["implementation"]), None)
            ms = win["total_ms"]["median"]
            vs = f" = {ms / trl[win['workload']]:.2f}x TRL" if win["workload"] in trl else ""
            evidence = f"{win['workload']}: {_label(win)} {ms:.2f} ms{vs}" + (
                f"; best other implementation {_label(other)} {other['total_ms']['median']:.2f} ms" if other else "")
            lo, hi = ranges[H]
            choices.append({"family": family, "kind": kind, "dtype": dtype, "h_min": lo, "h_max": hi,
                            "implementation": win["implementation"], "run": run, "evidence": evidence})
    for impl in sorted({r["implementation"] for r in lm}):
        for (H, dtype) in sorted({(r["H"], r["dtype"]) for r in lm if r["implementation"] == impl}):
            for kind in ("logprob", "forward"):
                mine = sorted((r for r in lm if (r["implementation"], r["kind"], r["provider"], r["H"], r["dtype"])
                               == (impl, kind, "fastrl", H, dtype) and r.get("configs_served")),
                              key=lambda r: r["total_ms"]["median"])
                if mine:
                    break
            if not mine:
                continue  # its kernels take no launch configuration (the hybrid's cuBLAS + folds)
            win = mine[0]
            lo, hi = ranges[H]
            for tma in sorted({s["use_tma"] for s in win["configs_served"].values()}):
                configs.append({
                    "family": family, "implementation": impl, "dtype": dtype, "h_min": lo, "h_max": hi, "use_tma": tma,
                    "configs": {k: s["config"] for k, s in win["configs_served"].items() if s["use_tma"] == tma},
                    "run": run, "evidence": f"{win['workload']}: {_label(win)} {win['total_ms']['median']:.2f} ms, "
                                            f"fastest of its {len(mine)} {win['workload']} rows"})
    return choices, configs


def build(paths: list[Path], allow_dirty: bool = False) -> dict:
    """The table from the session files under ``paths``: per family, the newest usable session decides."""
    runs, newest = [], {}
    for f in find_sessions(paths):
        data = json.loads(f.read_text())
        why = _usable(data, allow_dirty)
        env = data.get("env", {})
        run = {"run": _rel(f), "device": env.get("device"), "family": env.get("family"),
               "commit": env.get("fastrl_commit"), "tree_clean": env.get("tree_clean"), "created": env.get("created")}
        runs.append((run, data, why))
        if why is None and (env["family"] not in newest or env["created"] > newest[env["family"]][0]["created"]):
            newest[env["family"]] = (run, data)
    table = {"RUNS": [], "CHOICES": [], "CONFIGS": []}
    for run, data, why in runs:
        chosen = why is None and newest[run["family"]][0] is run
        if why is None and not chosen:
            why = f"superseded by the newer {newest[run['family']][0]['run']}"
        table["RUNS"].append({**run, "used": chosen, "why": why or ""})
        if chosen:
            c, k = _entries(data["rows"], run["family"], run["run"])
            table["CHOICES"] += c
            table["CONFIGS"] += k
    return table


_HEADER = '''"""Defaults measured on GPUs: generated by ``python -m bench defaults bench/results/``; do not edit by hand.

Read by ``fastrl.ops.backend.choose_triton`` (CHOICES: which implementation ``backend="auto"`` runs) and
``fastrl.kernels.tuning.config_for`` (CONFIGS: which launch configuration a kernel gets). A family, kind, H range
or dtype without an entry keeps the built-in choice. Each entry names the session file that chose it.
"""
'''
_COMMENTS = {
    "RUNS": "# the committed session files read; a family's newest run decides its entries",
    "CHOICES": "# implementation per (family, kind, dtype, H range): h_min <= H < h_max, None = unbounded",
    "CONFIGS": '# launch configuration per (family, implementation, dtype, H range, TMA): kernel -> "BNxBVxBH wW sS"',
}


def render(table: dict) -> str:
    """The module text: the header, then RUNS, CHOICES and CONFIGS as tuples of dicts."""
    parts = [_HEADER]
    for name in ("RUNS", "CHOICES", "CONFIGS"):
        items = table[name]
        lines = ("    " + pprint.pformat(x, width=112, sort_dicts=False).replace("\n", "\n    ") + ",\n" for x in items)
        body = "(\n" + "".join(lines) + ")" if items else "()"
        parts.append(f"{_COMMENTS[name]}\n{name} = {body}\n")
    return "\n".join(parts)


def main(argv: list[str], con=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench defaults", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(ap)
    return command(ap.parse_args(argv), con)


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
    out = Path(args.out)
    if args.check:
        same = out.is_file() and out.read_text() == text
        say(f"{out}: " + ("up to date" if same else "DIFFERS from what the results give: run python -m bench defaults"))
        return 0 if same else 1
    out.write_text(text)
    say(f"wrote {out}: {len(table['CHOICES'])} choices, {len(table['CONFIGS'])} configurations from "
        f"{sum(r['used'] for r in table['RUNS'])} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
