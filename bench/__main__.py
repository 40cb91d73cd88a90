"""``python -m bench [COMMAND] [options]``: the benchmark CLI (bench/README.md says what each command measures).

    python -m bench --quick              CPU-sized workloads and sweeps, a few minutes on 2 cores
    python -m bench                      everything for this device (GPU sizes on CUDA, CPU sizes otherwise)
    python -m bench COMMAND --help       that command's options (the commands are listed below)

Results go to --out (default: a new folder under $FASTRL_BENCH_OUT or the system's temporary folder).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench import divergence, lmhead, report
from bench import providers as P

# Options, as (flag, argparse keywords) by group; each command takes its groups (or a module's add_options)
RUN = (  # every measuring command
    ("--quick", {"action": "store_true", "help": "smaller shapes and fewer points (CPU: a few minutes)"}),
    ("--smoke", {"action": "store_true", "help": "tiny shapes, one repetition: checks the plumbing only"}),
    ("--out", {"help": "results folder (default: a new one under $FASTRL_BENCH_OUT or the system's temporary folder)"}),
    ("--device", {"choices": ("cpu", "cuda"), "help": "default: cuda when available"}),
    ("--reps", {"type": int, "help": "timed repetitions per measurement on CPU (default 3; smoke 1)"}),
    ("--warmup", {"type": int, "help": "untimed steps before timing (default 1; smoke 0)"}),
    ("--timeout", {"type": int, "help": "seconds per measuring process"}),
    ("--threads", {"type": int, "default": 0, "help": "CPU threads per worker (default: torch's)"}),
    ("--fastrl-backend", {"choices": ("triton", "triton-hybrid", "triton-fused", "torch"), "help": "force it"}),
    ("--no-plots", {"action": "store_true", "help": "write JSON and CSV only"}),
)
WORKLOADS = (  # the commands that measure workloads x providers
    ("--workload", {"help": "comma list: names (W1, C1, tokens-4096), 'W1' also picks W1-lp; groups core, sweeps, "
                            "sweep-tokens, sweep-vocab, sweep-hidden (W4: `python -m bench w4`)"}),
    ("--providers", {"help": f"comma list of {', '.join(P.PROVIDERS)} (default: all; c1: {lmhead.C1_PROVIDERS})"}),
    ("--sets", {"type": int, "help": "input sets rotated through the repetitions (CPU 2, CUDA 3)"}),
)
W4_OPTIONS = (
    ("--lengths", {"help": "comma list of completion lengths (W5: to search; default: by device and mode)"}),
    ("--budget-mb", {"type": float, "help": "step-memory budget in MB for 'longest that fits' (W5 on CUDA: 24 and "
                                            "80 GiB)"}),
)
W5_OPTIONS = (
    ("--workload", {"help": "W5: comma list of architectures (0.5B,1.5B; default both)"}),
    ("--providers", {"help": "W5: comma list of configurations: trl, fastrl, fastrl+offload, fastrl+tiled, "
                             "fastrl+both (default all)"}),
) + W4_OPTIONS
DIVERGENCE = (
    ("--beta", {"help": "comma list of betas (default 0,0.5,1)"}),
    ("--tokens", {"type": int, "help": "tokens N (default: by device; results go to divergence-nN.json)"}),
    ("--providers", {"help": f"comma list of {', '.join(divergence.PROVIDERS)} (default all)"}),
)
SASS = (  # here: bench/sass.py refuses to import under TRITON_INTERPRET
    ("--arch", {"type": int, "default": 90, "help": "compute capability x 10 (default 90: H100 / H200)"}),
    ("--only", {"help": "only kernels whose name contains this"}),
)
TARGETS = (("paths", {"nargs": "+", "help": "session*.json files or folders holding them"}),)
# what a command that does not take a measuring option reads for it
_UNSET = {flag.lstrip("-").replace("-", "_"): kw.get("default", False if kw.get("action") == "store_true" else None)
          for flag, kw in RUN + WORKLOADS + W4_OPTIONS}


@dataclass(frozen=True)
class Command:
    name: str
    summary: str  # its line in `python -m bench --help`, and the head of `python -m bench NAME --help`
    options: tuple  # option groups: (flag, keywords) tuples, or a function that adds its own
    run: Callable[[argparse.Namespace, str, object], int]  # (args, device, console) -> exit status


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", title="commands", metavar="COMMAND",
                            help="what to measure (default: run); `python -m bench COMMAND --help` lists its options")
    for c in COMMANDS.values():
        sp = sub.add_parser(c.name, help=c.summary, description=f"{c.summary}; bench/README.md says more.")
        for group in c.options:
            if callable(group):
                group(sp)
            else:
                for flag, kw in group:
                    sp.add_argument(flag, **kw)
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
    for name, unset in _UNSET.items():
        setattr(args, name, getattr(args, name, unset))
    return args


def _targets_command(args, device: str, con) -> int:
    """The session's targets over the session files of several calls (e.g. bench/gpu_session.sh's), ratios within
    each file."""
    from bench.session_report import add_ratios, targets

    files, missing = report.session_files(args.paths), [p for p in args.paths if not Path(p).exists()]
    if missing or not files:
        con.print(f"[red]no session*.json at {', '.join(missing or args.paths)}[/red]")
        return 2
    for f, data in files:
        add_ratios(data["rows"])
        env = data["env"]
        con.print(f"[bold]{f}[/bold] ({env.get('device')}, fastrl {str(env.get('fastrl_commit'))[:10]})")
        targets(data["rows"], con, smoke=data.get("smoke", False))
    return 0


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


# A new command: an option function for what only it takes, a handler (args, device, console) -> exit status, and a
# Command below; `python -m bench NAME --help` and the command list follow. bench/README.md says what each measures.
_MEASURE = (RUN, WORKLOADS)
COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("run", "every workload for this device (the default command: `python -m bench --quick` is `run --quick`)",
            _MEASURE, lmhead.cli),
    Command("c1", "C1 and C1-loss on CPU against the CPU targets (time and extra peak memory vs torch)", _MEASURE,
            lmhead.cli),
    Command("w4", "W4: one GRPOTrainer step, stock TRL vs fastrl, per completion length", (RUN, W4_OPTIONS),
            _lazy("w4", "cli")),
    Command("w5", "W5: the longest completion whose GRPO step fits a memory budget, per trainer and option set",
            (RUN, W5_OPTIONS), _lazy("w5", "cli")),
    Command("keptset", "the LM head over a kept set (K = 20, 64, 512) vs the full vocabulary", (RUN,),
            _lazy("keptset", "cli")),
    Command("divergence", "student vs teacher head: fused_divergence vs TRL, LigerFusedLinearJSD and torch, beta "
            "0/0.5/1", (RUN, DIVERGENCE), divergence.cli),
    Command("gap", "the vLLM-trainer log-prob gap: TRL, fastrl, fastrl + vLLM float32 head; replay off and on (needs "
            "vLLM: the python `bash .ci/vllm-env.sh` prints)", (RUN, _lazy("gap", "add_options")),
            _lazy("gap", "command")),
    Command("compile", "a training step with fastrl inside torch.compile vs eager vs the compiled reference",
            (_lazy("compiled_step", "add_options"),), _lazy("compiled_step", "command")),
    Command("targets", "the session's targets over the session files of several calls", (TARGETS,),
            _targets_command),
    Command("session", "everything a GPU window measures, in one command sized to a time budget",
            (_lazy("session", "add_options"),), _lazy("session", "command")),
    Command("defaults", "the measured defaults table (kernels/_defaults.py) from committed session results",
            (_lazy("defaults", "add_options"),), _lazy("defaults", "command", device=False)),
    Command("sass", "compile every kernel for sm_90 without a GPU; fail on spills or missing HGMMA", (SASS,),
            _lazy("sass", "command", device=False)),
    Command("tp", "a head sharded over the vocabulary on CPU processes: fastrl vs gathering the logits (per rank)",
            (_lazy("tp", "add_options"),), _lazy("tp", "command")),
    Command("roofline", "the FLOPs and HBM bytes of every implementation per workload, and the time they imply at "
            "700 TFLOP/s and 4.3 TB/s", (_lazy("roofline", "add_options"),),
            _lazy("roofline", "command", device=False)),
)}

if __name__ == "__main__":
    sys.exit(main())
