"""``python -m bench roofline``: FLOPs and HBM bytes of every implementation per GPU workload, the time they imply at
700 TFLOP/s and 4.3 TB/s, and the measured time where a committed ``session.json`` has one. No GPU, nothing timed; the
model, its conventions and the targets on paper: docs/roofline.md.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

import torch

from bench.report import session_files
from bench.session_report import ROW_TARGETS, TIME_TARGETS

from fastrl.kernels.kept_rows import DEFAULT_CONFIGS as KEPT_CONFIGS
from fastrl.ops import hybrid
from fastrl.ops.budget import grad_columns, one_pass_rows, tile_budget

__all__ = ["WORKLOADS", "IMPLEMENTATIONS", "TARGETS", "MEMORY", "ENGINE_ENTRY_BYTES", "model", "targets", "measured",
           "kept_rows_bytes"]

TFLOPS = 700e12  # bf16 GEMM rate, FLOP/s
HBM = 4.3e12  # bytes/s
S = 2  # bytes per bf16 element
MEMORY = 80 << 30  # device memory the sm90 tile rule sizes for (an H100's; an H200's 141 GiB gives the same counts
# at W1 and W2: fastrl.ops.budget's table)


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # "loss" (one-pass capable GRPO loss), "logprob" (path A), "forward" (path C), "divergence"
    N: int
    H: int
    V: int
    H_teacher: int = 0  # divergence only
    K: int = 0  # kept set only: ids per token


WORKLOADS = (
    Shape("W1", "loss", 16384, 4096, 151936),
    Shape("W1-lp", "logprob", 16384, 4096, 151936),
    Shape("W2", "loss", 16384, 896, 151936),
    Shape("W2-lp", "logprob", 16384, 896, 151936),
    Shape("W3", "forward", 16384, 4096, 151936),
    Shape("divergence", "divergence", 16384, 896, 151936, H_teacher=1536),
    Shape("kept", "kept", 16384, 4096, 151936, K=64),  # fused_logprobs forward + backward over K=64 ids per token
)

# implementation -> (what it is, names it may carry in a results file)
IMPLEMENTATIONS = {
    "floor": ("cuBLAS bf16 GEMMs alone (2NHV per pass, no elementwise work)", ("floor", "cublas", "cublas-floor")),
    "trl": ("TRL 1.16: cuBLAS tiles of 4096 x 32768 (bf16 logits; float32 for the divergence), float32 grad "
            "accumulators", ("trl",)),
    "hybrid": ("fastrl triton-hybrid (the default): cuBLAS float32 logits tiles + Triton folds",
               ("triton-hybrid", "fastrl")),
    "fused": ("fastrl triton-fused: tl.dot tiles consumed in registers, G through HBM",
              ("triton-fused", "fastrl-fused")),
    "sm90": ("fastrl triton-sm90 (new): persistent TMA kernels; one pass on bf16 scaled exps; tiles sized by the "
             "device's memory (--memory-gib)", ("triton-sm90", "fastrl-sm90")),
    "sm90-nomem": ("the same where the device's memory is unknown (the budget's safe default: sm90 before the rule)",
                   ()),
    "union": ("fastrl's kept-set engine (built): union GEMMs per unit of rows (host plan, cap 8192 ids), disjoint "
              "sets (the worst case)", ("kept", "fastrl-kept")),
    "gather": ("fastrl's kept-set engine, per-row plan (built: fastrl.ops.kept_rows, fastrl.kernels.kept_rows; the "
               "default for disjoint sets, host_sync=False and torch.compile): each token gathers its K rows of W, "
               "again for grad_h; grad_W by a sorted segment reduction into a float32 buffer over the kept ids, cast "
               "and scattered into the bf16 gradient", ("kept-gather",)),
    "atomics": ("a fully fused backward (Cut Cross-Entropy's design): both gradient GEMMs in the tile kernel, "
                "float32 atomics", ("cce",)),
}


def _chunks(N: int, V: int) -> int:
    """One-pass chunks: the ``one-pass`` CUDA tile budget in 128-row blocks (memory unknown)."""
    return math.ceil(N / max(128, tile_budget("one-pass", "cuda").elems // V // 128 * 128))


def _slices(N: int, V: int) -> int:
    """Two-pass vocabulary slices: ``fastrl.ops.hybrid.tile_columns`` over min(N, its MAX_ROWS) rows."""
    return math.ceil(V / hybrid.tile_columns(min(N, hybrid.MAX_ROWS), V))


def _sm90_chunks(w: Shape, memory: int | None) -> int:
    """sm90 one-pass chunks (bf16 scaled exps within 1/16 of ``memory``)."""
    return math.ceil(w.N / one_pass_rows(w.V, w.H, w.N, torch.bfloat16, total_memory=memory))


def _sm90_slices(N: int, V: int, memory: int | None) -> int:
    """sm90 path A backward slices (bf16 G within 1/128 of ``memory``)."""
    return math.ceil(V / grad_columns(min(N, 1 << 14), V, torch.bfloat16, total_memory=memory))


def _kept(w: Shape, impl: str) -> tuple[float, float, str] | None:
    N, H, K = w.N, w.H, w.K
    if impl == "union":  # disjoint sets: cap // K rows per unit, |U| = cap ids; kept.entry_logits / entry_backward
        cap = tile_budget("kept", "cuda").cap
        units, rows = math.ceil(N / (cap // K)), cap // K
        u_w, u_tile = cap * H, rows * cap
        fwd = 3 * u_w * S + 4 * u_tile * 4  # gather W[U] (r + w), GEMM reads it; tile w, bias/transform r + w, read
        # backward: zero + scatter the tile, G to bf16, gather again, GEMM reads; [|U|, H] float32 written, read by the
        # index_add into the float32 buffer over the kept ids, which is read and written
        bwd = 3 * u_tile * 4 + u_tile * S + 3 * u_w * S + u_w * 4 * 4
        how = f"{units} units of {rows} rows x {cap} ids, gathers + fp32 dW rows"
        # once: that buffer (_WeightSlots, every id kept at least once on these sets) zeroed, then cast and scattered
        return 6.0 * N * cap * H, units * (fwd + bwd) + sum(_slot_bytes(min(w.V, N * K), H).values()), how
    if impl == "gather":  # the per-row plan as it runs on CUDA: kept_rows_bytes
        parts = kept_rows_bytes(w)
        slots = min(w.V, N * K)
        how = (f"2 gathers of N K H bf16 rows, sorted segment sums into [{slots}, H] slots, "
               f"{parts['grad_W segment rows'] / sum(parts.values()):.0%} of the bytes")
        return 6.0 * N * K * H, sum(parts.values()), how
    return None


# The kept-set engine's torch work per kept entry outside the per-row kernels, forward + backward, bytes read and
# written: held to a recount of every aten op's tensors by tests/test_roofline.py.
ENGINE_ENTRY_BYTES = 920


def kept_rows_bytes(w: Shape) -> dict[str, float]:
    """HBM bytes of ``fused_logprobs(support=KeptSet)`` forward + backward on the per-row plan as it runs on CUDA (bf16
    head, no bias, segment-sum dW), beyond one read of hidden and W, by part (docs/roofline.md, "The kept set")."""
    N, H, V, K = w.N, w.H, w.V, w.K
    E = N * K  # kept entries, every set K wide
    slots = min(V, E)  # _WeightSlots without a host read: min(V, nnz) float32 rows
    fwd, bwd, seg = (KEPT_CONFIGS[k] for k in ("kept_logits", "kept_backward", "kept_segment_dw"))
    h_slices = math.ceil(H / bwd.block_h)  # backward programs per token, each reading the token's ids and G
    # segment_dw_kernel: a block of seg.block_n sorted entries writes each key it starts once, its last one's tail
    # summed by its owner: at most one row more per block than distinct keys
    segments = min(E, slots + math.ceil(E / seg.block_n))
    return {
        "forward gather": E * H * S,  # logits_kernel: K rows of W per token
        # the forward reads h once per block of ids, the backward once more: all but one read are extra
        "hidden re-reads": math.ceil(K / fwd.block_v) * N * H * S,
        "logits y": E * (8 + 4),  # the kernel reads the padded ids, writes float32 y (read back: ENGINE_ENTRY_BYTES)
        "backward gather": E * H * S,  # backward_kernel: grad_h from the same rows
        "ids, G per H slice": h_slices * E * (8 + 4),
        "grad_h float32": N * H * 4 * 2,  # written by the kernel, read by the cast to bf16
        # dW without atomics: the stable sort of the keys (rows masked, keys sorted, order, searchsorted's ends),
        # then per H slice each entry's key, order and G, its hidden row read again, each segment's row read + written
        "grad_W sort": E * 8 * 8,
        "grad_W sorted keys per H slice": math.ceil(H / seg.block_h) * E * (8 + 8 + 4),
        "grad_W hidden re-read": E * H * S,
        "grad_W segment rows": segments * H * 4 * 2,
        **_slot_bytes(slots, H),
        "engine per entry": E * ENGINE_ENTRY_BYTES,
    }


def _slot_bytes(slots: int, H: int) -> dict[str, float]:
    """The kept-set engine's float32 weight-gradient buffer of ``slots`` rows (``_WeightSlots``), both plans."""
    return {
        "grad_W buffer zeroed": slots * H * 4,
        # _WeightSlots.scatter: buffer read, bf16 copy written and read, index_add_ reads + writes the gradient's rows
        # (its zeroing is the output's one write)
        "grad_W scatter to bf16": slots * H * (4 + S + S + 2 * S),
    }


def model(w: Shape, impl: str, memory: int | None = MEMORY) -> tuple[float, float, str] | None:
    """(FLOPs, bytes beyond one read of the inputs, how) of ``impl`` on ``w``; None when it has no such path.
    ``memory``: the device memory the sm90 tiles are sized for (None: unknown, the budget's safe default)."""
    N, H, V = w.N, w.H, w.V
    nv, nhv = float(N) * V, float(N) * H * V
    grad_w_rmw = V * H * 4 * 2  # one read + write of a float32 [V, H] accumulator
    grad_h_rmw = N * H * 4 * 2
    trl_acc = math.ceil(N / 4096) * grad_w_rmw + math.ceil(V / 32768) * grad_h_rmw  # TRL's fp32 accumulators per tile
    if w.kind == "kept":
        return _kept(w, impl)
    if impl in ("union", "gather"):
        return None
    if impl == "sm90-nomem":
        m = model(w, "sm90", None)
        return None if m is None or w.kind in ("forward", "divergence") else m
    if w.kind == "divergence":
        Ht = w.H_teacher
        both = 2.0 * N * (H + Ht) * V  # one pass over both heads' logits
        fl = 3 * both + 4 * nhv
        # TRL: stats pass, JSD pass, backward pass; float32 tiles of both heads each time
        trl = nv * (2 * 8 + 2 * 8 + (8 + 8 + 4 + 4 + 2 + 4)) + trl_acc
        hyb = nv * (2 * 8 + 2 * 8 + (8 + 8 + 2 + 4)) + _slices(N, V) * grad_h_rmw  # fused runs the hybrid kernels
        why = "3 passes x both float32 tiles, G bf16 in place"
        return {"floor": (both + 4 * nhv, 0.0, "student + teacher forward, student's two gradient GEMMs"),
                "trl": (fl, trl, "3 passes x both float32 tiles, G float32 -> bf16, fp32 accumulators"),
                # both heads' tiles in registers in all three passes; only the student's G is stored
                "sm90": (fl, nv * S * 3 + _slices(N, V) * grad_h_rmw, "3 passes, both tiles in registers"),
                "hybrid": (fl, hyb, why), "fused": (fl, hyb, "runs the hybrid kernels: " + why)}.get(impl)
    if w.kind == "forward":
        return {"floor": (2 * nhv, 0.0, "one GEMM"), "trl": (2 * nhv, nv * 2 * S, "bf16 tile written + read"),
                "hybrid": (2 * nhv, nv * 8, "float32 tile written + read"),
                "fused": (2 * nhv, 0.0, "statistics in registers"),
                "sm90": (2 * nhv, 0.0, "statistics in registers (persistent, TMA, split vocabulary)")}.get(impl)
    # path A (two passes): the forward's tile, then the backward's tile, G and the two gradient GEMMs' reads
    two_pass_acc = _slices(N, V) * grad_h_rmw  # grad_h accumulated in float32 over the vocabulary slices
    g_bytes = nv * S * 3  # G written once, read by each of the two GEMMs
    tiles = math.ceil(N / 128) * math.ceil(V / 256)
    c = _sm90_slices(N, V, memory)
    out = {
        "floor": (6 * nhv, 0.0, "forward + two gradient GEMMs"),
        # fwd tile w+r; bwd tile w, r, G w, two GEMM reads
        "trl": (8 * nhv, nv * S * (2 + 5) + trl_acc, "path A, bf16 tiles (logits rounded), fp32 accumulators"),
        "atomics": (8 * nhv, tiles * (128 + 256) * H * 4 * 2, "fp32 atomics of [128, H] and [256, H] per 128x256 tile"),
        "hybrid": (8 * nhv, nv * (8 + 8) + g_bytes + two_pass_acc, "path A, float32 tiles in both passes"),
        "fused": (8 * nhv, g_bytes + two_pass_acc, "path A, no logits stored; G through HBM"),
        "sm90": (8 * nhv, g_bytes + c * grad_h_rmw, f"path A, no logits stored; G through HBM in {c} slices"),
    }
    if w.kind == "loss":  # one pass (path B) where the design has one
        c = _sm90_chunks(w, memory)
        # fp32 tile w, fold r, grad r + G w, two GEMM reads
        out["hybrid"] = (6 * nhv, nv * (4 + 4 + 4 + S + 2 * S) + _chunks(N, V) * grad_w_rmw,
                         "one pass, float32 tile, fp32 grad_W per chunk")
        # bf16 scaled exps w, r + G w in place, two GEMM reads; one chunk: grad_W is one GEMM written once (an output,
        # like path A's slices), else a float32 accumulator per chunk
        out["sm90"] = (6 * nhv, nv * S * (1 + 2 + 2) + (0 if c == 1 else c * grad_w_rmw),
                       f"one pass, bf16 scaled exps, {c} chunk(s)"
                       + (": grad_W written once" if c == 1 else ", fp32 grad_W per chunk"))
    return out.get(impl)


# (workload, the ratio a design must reach, the baseline it is a ratio of): the session's targets (one table); kept's
# baseline: the same call over the whole vocabulary, the fastest fastrl design at W1-lp
_ROW = {section: limit for section, _, _, _, limit, _ in ROW_TARGETS}
TARGETS = tuple((wl, limit, "trl") for wl, limit in TIME_TARGETS) + (
    ("divergence", _ROW["divergence"], "trl"), ("kept", _ROW["keptset"], "full head"))
_BUILT = ("hybrid", "fused", "sm90", "sm90-nomem", "union", "gather")  # fastrl designs that exist as code
_NOT_DESIGNS = ("floor", "trl")


def implied_ms(w: Shape, impl: str, memory: int | None = MEMORY) -> float | None:
    m = model(w, impl, memory)
    return None if m is None else (m[0] / TFLOPS + m[1] / HBM) * 1e3


def _workload(name: str) -> Shape:
    return next(w for w in WORKLOADS if w.name == name)


def _full_head_ms(memory: int | None) -> float:
    """The kept target's baseline: the fastest built fastrl design of the same call over the whole vocabulary."""
    w = _workload("W1-lp")
    return min(implied_ms(w, i, memory) for i in _BUILT if model(w, i, memory) is not None)


def _gib(memory: int | None) -> str:
    return "memory unknown" if memory is None else f"{memory / (1 << 30):g} GiB"


def targets(memory: int | None = MEMORY) -> list[dict]:
    """Per target: the fastest modelled fastrl design, its FLOPs, bytes and implied time, the baseline's implied time,
    the ratio (computed), whether it meets the target on paper, and whether the design is built."""
    out = []
    for name, goal, base in TARGETS:
        w = _workload(name)
        base_ms = implied_ms(w, "trl", memory) if base == "trl" else _full_head_ms(memory)
        designs = [i for i in IMPLEMENTATIONS if i not in _NOT_DESIGNS and model(w, i, memory) is not None]
        best = min(designs, key=lambda i: implied_ms(w, i, memory))
        fl, by, _ = model(w, best, memory)
        ms = implied_ms(w, best, memory)
        tied = [i for i in designs if i != best and model(w, i, memory)[:2] == (fl, by)]  # the same FLOPs and bytes
        out.append(dict(target=name, goal=goal, baseline=base, baseline_ms=base_ms, design=best, tied=tied,
                        built=best in _BUILT, tflop=fl / 1e12, gb=by / 1e9, implied_ms=ms, ratio=ms / base_ms,
                        met=ms / base_ms <= goal))
    return out


def measured(root: str) -> dict[tuple[str, str], float]:
    """(workload, implementation) -> the best median ms over the committed session results under ``root``."""
    out: dict[tuple[str, str], float] = {}
    alias = {a: impl for impl, (_, names) in IMPLEMENTATIONS.items() for a in names}
    for _, data in session_files([root]):  # bench/README's unpack path <device>/<date>-<commit>/session*.json
        for r in data.get("rows") or []:
            if r.get("status", "ok") != "ok" or r.get("section") in ("profile", "budget"):  # not the default's time
                continue
            key, ms = _kept_row(r) if r.get("workload") == KEPT_SESSION_WORKLOAD else (None, None)
            if key is None:
                impl = alias.get(str(r.get("implementation", ""))) or alias.get(str(r.get("provider", "")))
                key = (str(r.get("workload")), impl) if impl else None
                t = r.get("total_ms")
                ms = t.get("median") if isinstance(t, dict) else t
            if key and isinstance(ms, (int, float)):
                out[key] = min(out.get(key, math.inf), float(ms))
    return out


KEPT_SESSION_WORKLOAD = "keptset-W1-kept"  # bench session's keptset rows at the kept shape (bench/keptset.py)


def _kept_row(r: dict) -> tuple[tuple[str, str] | None, float | None]:
    """A session keptset row at the kept shape as (("kept", design), ms): disjoint sets (the model's case), by the
    plan the row ran (``rows``: the per-row plan, "gather"; ``union-*``: "union")."""
    plan = str(r.get("plan", ""))
    impl = "gather" if plan == "rows" else "union" if plan.startswith("union") else None
    if r.get("sets") != "uniform" or impl is None:
        return None, None
    return ("kept", impl), r.get("ms")


def add_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                    help="folder whose */session.json and */*/session.json hold measured times (default bench/results)")
    ap.add_argument("--memory-gib", type=float, default=MEMORY / (1 << 30),
                    help="device memory the sm90 tiles are sized for, GiB (default 80; 0: unknown, the safe default)")


def print_columns(table: list[tuple[str, ...]]) -> None:
    """Rows of strings in left-aligned columns; the first row is the header, underlined."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * wd for wd in widths))


def command(args, con=None) -> int:
    """``python -m bench roofline``: the model's table, then the targets (arithmetic only: no GPU, no provider)."""
    memory = int(args.memory_gib * (1 << 30)) or None
    got = measured(args.results)
    table = [("workload", "implementation", "TFLOP", "GB moved", "ms @700TF", "ms @4.3TB/s", "implied ms",
              "measured ms", "how")]
    for w, impl in ((w, i) for w in WORKLOADS for i in IMPLEMENTATIONS if model(w, i, memory) is not None):
        fl, by, how = model(w, impl, memory)
        t_f, t_b, ms = fl / TFLOPS * 1e3, by / HBM * 1e3, got.get((w.name, impl))
        table.append((w.name, impl, f"{fl / 1e12:.1f}", f"{by / 1e9:.1f}", f"{t_f:.1f}", f"{t_b:.1f}",
                      f"{t_f + t_b:.1f}", "not measured" if ms is None else f"{ms:.1f}", how))
    print("Roofline model (no GPU, nothing timed): implied ms = FLOPs / 700 TFLOP/s + bytes / 4.3 TB/s; "
          f"sm90 tiles for {_gib(memory)}.")
    for name, (what, _) in IMPLEMENTATIONS.items():
        print(f"  {name:8s} {what}")
    print()
    print_columns(table)
    table = [("target", "goal", "design", "built", "TFLOP", "GB moved", "implied ms", "baseline ms", "ratio",
              "on paper")]
    table += [(r["target"], f"<= {r['goal']:g}x", "=".join([r["design"]] + r["tied"]),
               "yes" if r["built"] else "no (paper)", f"{r['tflop']:.2f}", f"{r['gb']:.1f}", f"{r['implied_ms']:.1f}",
               f"{r['baseline_ms']:.1f} ({r['baseline']})", f"{r['ratio']:.3f}x", "met" if r["met"] else "NOT met")
              for r in targets(memory)]
    print("\nTargets (issue 33): the fastest modelled fastrl design per target, its ratio computed from the rows above")
    print_columns(table)
    return 0
