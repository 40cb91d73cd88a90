"""Peak memory and time of one GRPO training step at long completions: stock TRL vs fastrl, on CPU.

    python examples/long_completions.py                       # V=151936, H=256, 2 completions of 1k-4k tokens
    python examples/long_completions.py --lengths 1024 2048 --budget-mb 1024 --json out.json

A small model body (1 Qwen2 layer, hidden 256) with a real vocabulary (151936), so the LM head dominates, as it
does for long completions. Each point is one training step (``compute_loss`` + ``backward`` on a fixed batch:
generation excluded) of ``trl.GRPOTrainer`` or ``fastrl.GRPOTrainer`` in a fresh process, float32; memory is the
peak resident memory during the step above what the process held just before it (see ``fastrl.demo``).

The table ends with the longest measured completion length whose step fits in ``--budget-mb`` of memory.
Attention is PyTorch's SDPA (transformers' default), so the body's memory grows linearly with the length.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

from fastrl.demo import run_measurement


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--batch", type=int, default=2, help="completions per step")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 3072, 4096])
    p.add_argument("--budget-mb", type=float, default=2048.0, help="step-memory budget for 'longest that fits'")
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--json", default=None, help="also write the raw measurements here")
    a = p.parse_args(argv)

    import torch
    import trl

    print(f"# V={a.vocab} H={a.hidden} layers={a.layers}, {a.batch} completions per step, float32, CPU "
          f"({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), torch "
          f"{torch.__version__}, trl {trl.__version__}, loss {a.loss_type}")
    print("| completion tokens | TRL peak MB | fastrl peak MB | ratio | TRL s | fastrl s | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for L in a.lengths:
        res = {}
        for which in ("trl", "fastrl"):
            res[which] = run_measurement(which, vocab=a.vocab, hidden=a.hidden, layers=a.layers, batch=a.batch,
                                         prompt_len=a.prompt_len, completion_len=L, loss_type=a.loss_type)
        rows.append((L, res))
        t, f = res["trl"], res["fastrl"]
        if "error" in t or "error" in f:
            print(f"| {L} | {t.get('peak_extra_mb', 'failed')} | {f.get('peak_extra_mb', 'failed')} | | | | |")
            for r in (t, f):
                if "error" in r:
                    print(f"<!-- {r['which']} failed: {r['error'][-300:]!r} -->", file=sys.stderr)
            continue
        print(f"| {L} | {t['peak_extra_mb']:.0f} | {f['peak_extra_mb']:.0f} | "
              f"{t['peak_extra_mb'] / max(f['peak_extra_mb'], 1e-9):.1f}x | {t['seconds']:.1f} | {f['seconds']:.1f} | "
              f"{t['seconds'] / f['seconds']:.2f}x |", flush=True)

    print(f"\nLongest completion length within a {a.budget_mb:.0f} MB step-memory budget ({a.batch} completions):")
    for which in ("trl", "fastrl"):
        pts = [(L, r[which]["peak_extra_mb"]) for L, r in rows if "error" not in r[which]]
        fits = [L for L, m in pts if m <= a.budget_mb]
        print(f"  {which:>6}: {max(fits) if fits else 'none of the lengths tried'}"
              + (f" (the longest tried, {max(a.lengths)}, fits)" if fits and max(fits) == max(a.lengths) else ""))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "rows": [{"completion_len": L, **r} for L, r in rows]}, fh, indent=1)


if __name__ == "__main__":
    main()
