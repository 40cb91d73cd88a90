"""``python -m bench roofline``: bytes moved and FLOPs of every implementation per GPU workload, and the time implied.

No GPU and nothing timed: a model written out below, per implementation, of what each one computes (FLOPs, counting
recomputed logits) and what it moves through HBM beyond reading its inputs once (logits or exp tiles written and read
back, ``G`` written and read by the gradient GEMMs, float32 accumulators read and written again, atomics). The
implied time is ``FLOPs / 700 TFLOP/s + bytes / 4.3 TB/s`` (a bf16 GEMM's measured rate on an H100/H200, and an
H200's copy bandwidth): the elementwise passes run as separate kernels or epilogues after the GEMM tiles, so the two
add up rather than overlap (Triton on sm_90 does not warp-specialise: see docs/gpu-map.md). A measured time is printed
where a committed results file (``bench/results/*/session.json``, written by ``python -m bench session``) has one
for that workload and implementation; otherwise "not measured".

Conventions: every token is live (W1's completion mask leaves ~75%: the model scales linearly); bf16 inputs (2-byte
tiles and ``G``); "one pass" chunks as ``fastrl.losses.one_pass`` sizes them (a 1 GiB float32 tile: 1664 tokens at
V = 151936), "two pass" vocabulary slices as ``fastrl.ops.hybrid`` does (4096 columns at 16384 tokens).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from dataclasses import dataclass

__all__ = ["WORKLOADS", "IMPLEMENTATIONS", "model", "measured", "main"]

TFLOPS = 700e12  # bf16 GEMM rate, FLOP/s
HBM = 4.3e12  # bytes/s
S = 2  # bytes per bf16 element


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # "loss" (one-pass capable GRPO loss), "logprob" (path A), "forward" (path C), "divergence"
    N: int
    H: int
    V: int
    H_teacher: int = 0  # divergence only


WORKLOADS = (
    Shape("W1", "loss", 16384, 4096, 151936),
    Shape("W1-lp", "logprob", 16384, 4096, 151936),
    Shape("W2", "loss", 16384, 896, 151936),
    Shape("W2-lp", "logprob", 16384, 896, 151936),
    Shape("W3", "forward", 16384, 4096, 151936),
    Shape("divergence", "divergence", 16384, 896, 151936, H_teacher=1536),
)

# implementation -> (what it is, names it may carry in a results file)
IMPLEMENTATIONS = {
    "floor": ("cuBLAS bf16 GEMMs alone (2NHV per pass, no elementwise work)", ("floor", "cublas", "cublas-floor")),
    "trl": ("TRL 1.16: cuBLAS tiles of 4096 x 32768 (bf16 logits; float32 for the divergence), float32 grad "
            "accumulators", ("trl",)),
    "hybrid": ("fastrl triton-hybrid (the default): cuBLAS float32 logits tiles + Triton folds", ("triton-hybrid",
                                                                                                  "fastrl")),
    "fused": ("fastrl triton-fused: tl.dot tiles consumed in registers, G through HBM", ("triton-fused",
                                                                                          "fastrl-fused")),
    "sm90": ("fastrl triton-sm90 (new): persistent TMA kernels; one pass on bf16 scaled exps",
             ("triton-sm90", "fastrl-sm90")),
    "atomics": ("a fully fused backward (Cut Cross-Entropy's design): both gradient GEMMs in the tile kernel, "
                "float32 atomics", ("cce",)),
}


def _chunks(N: int, V: int) -> int:
    """One-pass chunks: a 2^28-element float32 tile, whole 128-row blocks (fastrl.losses.one_pass)."""
    rows = max(128, (1 << 28) // V // 128 * 128)
    return math.ceil(N / rows)


def _slices(N: int, V: int) -> int:
    """Two-pass vocabulary slices: a 2^26-element tile over min(N, 16384) rows, whole 256 columns (ops.hybrid)."""
    cols = max(256, (1 << 26) // min(N, 1 << 14) // 256 * 256)
    return math.ceil(V / cols)


def model(w: Shape, impl: str) -> tuple[float, float, str] | None:
    """(FLOPs, bytes beyond one read of the inputs, how) of ``impl`` on ``w``; None when it has no such path."""
    N, H, V = w.N, w.H, w.V
    nv, nhv = float(N) * V, float(N) * H * V
    grad_w_rmw = V * H * 4 * 2  # one read + write of a float32 [V, H] accumulator
    grad_h_rmw = N * H * 4 * 2
    if w.kind == "divergence":
        Ht = w.H_teacher
        both = 2.0 * N * (H + Ht) * V  # one pass over both heads' logits
        if impl == "floor":
            return both + 4 * nhv, 0.0, "student + teacher forward, student's two gradient GEMMs"
        if impl == "trl":  # stats pass, JSD pass, backward pass; float32 tiles of both heads each time
            b = nv * (2 * 8 + 2 * 8 + (8 + 8 + 4 + 4 + 2 + 4)) + math.ceil(N / 4096) * grad_w_rmw \
                + math.ceil(V / 32768) * grad_h_rmw
            return 3 * both + 4 * nhv, b, "3 passes x both float32 tiles, G float32 -> bf16, fp32 accumulators"
        if impl == "sm90":  # both heads' tiles in registers in all three passes; only the student's G is stored
            return 3 * both + 4 * nhv, nv * S * 3 + _slices(N, V) * grad_h_rmw, "3 passes, both tiles in registers"
        if impl in ("hybrid", "fused"):  # fused runs the hybrid divergence kernels
            b = nv * (2 * 8 + 2 * 8 + (8 + 8 + 2 + 4)) + _slices(N, V) * grad_h_rmw
            why = "3 passes x both float32 tiles, G bf16 in place"
            return 3 * both + 4 * nhv, b, why if impl == "hybrid" else "runs the hybrid kernels: " + why
        return None
    if w.kind == "forward":
        if impl == "floor":
            return 2 * nhv, 0.0, "one GEMM"
        return {"trl": (2 * nhv, nv * 2 * S, "bf16 tile written + read"),
                "hybrid": (2 * nhv, nv * 8, "float32 tile written + read"),
                "fused": (2 * nhv, 0.0, "statistics in registers"),
                "sm90": (2 * nhv, 0.0, "statistics in registers (persistent, TMA, split vocabulary)")}.get(impl)
    if impl == "floor":
        return 6 * nhv, 0.0, "forward + two gradient GEMMs"
    trl_acc = math.ceil(N / 4096) * grad_w_rmw + math.ceil(V / 32768) * grad_h_rmw
    if impl == "trl":  # path A: fwd tile w+r; bwd tile w, r, G w, two GEMM reads
        return 8 * nhv, nv * S * (2 + 5) + trl_acc, "path A, bf16 tiles (logits rounded), fp32 accumulators"
    two_pass_acc = _slices(N, V) * grad_h_rmw  # grad_h accumulated in float32 over the vocabulary slices
    g_bytes = nv * S * 3  # G written once, read by each of the two GEMMs
    if impl == "atomics":
        tiles = math.ceil(N / 128) * math.ceil(V / 256)
        return 8 * nhv, tiles * (128 + 256) * H * 4 * 2, "fp32 atomics of [128, H] and [256, H] per 128x256 tile"
    if w.kind == "loss" and impl in ("hybrid", "sm90"):  # one pass (path B)
        acc = _chunks(N, V) * grad_w_rmw
        if impl == "hybrid":  # fp32 tile w, fold r, grad r + G w (in place), two GEMM reads
            return 6 * nhv, nv * (4 + 4 + 4 + S + 2 * S) + acc, "one pass, float32 tile, fp32 grad_W per chunk"
        return 6 * nhv, nv * S * (1 + 2 + 2) + acc, "one pass, bf16 scaled exps (w, r + G w in place, 2 GEMM r)"
    if impl == "hybrid":  # path A: fwd fp32 tile w + r; bwd fp32 tile w + r, G w, two GEMM reads
        return 8 * nhv, nv * (8 + 8) + g_bytes + two_pass_acc, "path A, float32 tiles in both passes"
    if impl in ("fused", "sm90"):
        return 8 * nhv, g_bytes + two_pass_acc, "path A, no logits stored; G through HBM"
    return None


def measured(root: str) -> dict[tuple[str, str], float]:
    """(workload, implementation) -> the best median ms over the committed session results under ``root``."""
    out: dict[tuple[str, str], float] = {}
    alias = {a: impl for impl, (_, names) in IMPLEMENTATIONS.items() for a in names}
    for path in sorted(glob.glob(os.path.join(root, "*", "session.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        rows = data.get("rows", data) if isinstance(data, dict) else data
        for r in rows if isinstance(rows, list) else []:
            if not isinstance(r, dict) or r.get("status", "ok") != "ok":
                continue
            impl = alias.get(str(r.get("implementation", ""))) or alias.get(str(r.get("provider", "")))
            ms = (r.get("total_ms") or {}).get("median") if isinstance(r.get("total_ms"), dict) else r.get("total_ms")
            if impl and isinstance(ms, (int, float)):
                key = (str(r.get("workload")), impl)
                out[key] = min(out.get(key, math.inf), float(ms))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench roofline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                    help="folder whose */session.json hold measured times (default bench/results)")
    args = ap.parse_args(argv)
    got = measured(args.results)
    head = ("workload", "implementation", "TFLOP", "GB moved", "ms @700TF", "ms @4.3TB/s", "implied ms", "measured ms",
            "how")
    table = [head]
    for w in WORKLOADS:
        for impl in IMPLEMENTATIONS:
            m = model(w, impl)
            if m is None:
                continue
            fl, by, how = m
            t_f, t_b = fl / TFLOPS * 1e3, by / HBM * 1e3
            ms = got.get((w.name, impl))
            table.append((w.name, impl, f"{fl / 1e12:.1f}", f"{by / 1e9:.1f}", f"{t_f:.1f}", f"{t_b:.1f}",
                          f"{t_f + t_b:.1f}", "not measured" if ms is None else f"{ms:.1f}", how))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    print("Roofline model (no GPU, nothing timed): implied ms = FLOPs / 700 TFLOP/s + bytes / 4.3 TB/s.")
    for name, (what, _) in IMPLEMENTATIONS.items():
        print(f"  {name:8s} {what}")
    print()
    for i, row in enumerate(table):
        print("  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * wd for wd in widths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
