"""Timing, peak memory and accuracy of one op on CPU or CUDA, and the one step timer keptset, compile and W4 share.

What each figure means: bench/README.md, "How it is measured".
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import resource
import statistics
import time

import torch

from bench.providers import Op
from bench.workloads import ENTROPY_COEF, Workload

__all__ = ["measure_op", "measure_cpu", "measure_cuda", "accuracy", "summarize", "event_times", "wall_ms", "time_steps"]

MB = 1024.0 * 1024.0


def summarize(samples_ms: list[float]) -> dict:
    """Median with its spread: min, max and the inter-quartile range."""
    if not samples_ms:
        return {}
    xs = sorted(samples_ms)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q25": q[0], "q75": q[2], "n": len(xs)}


def rss_mb() -> float:
    """Resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def peak_rss_mb() -> float:
    """This address space's peak RSS since the last reset (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024.0  # kB


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False if that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so the RSS baseline is live data only."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def wall_ms(fn, cuda: bool = False) -> tuple[float, object]:
    """One call ``fn()``: (its wall time in ms, what it returned), the device synchronised before and after on CUDA."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, out


def _fresh_peak(cuda: bool) -> float:
    """MB held now (CUDA: allocated; CPU: RSS of a trimmed heap), the peak mark reset to it."""
    gc.collect()
    if not cuda:
        trim()
        reset_peak()
        return rss_mb()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / MB


def _l2_flusher():
    """A call that evicts the L2 cache, as ``triton.testing.do_bench`` does before each timed call."""
    from triton import runtime

    cache = runtime.driver.active.get_empty_cache_for_benchmark()
    return lambda: runtime.driver.active.clear_cache(cache)


def time_steps(step, reps: int, warmup: int, cuda: bool, before=None) -> dict:
    """The benchmarks' one step timer (keptset, compile, W4): ``warmup`` untimed calls of ``step``, then ``reps`` timed
    ones, each after ``before()`` (untimed: e.g. gradients set to None) on a fresh peak-memory mark (CUDA: allocated,
    after an L2 flush; CPU: RSS). Wall time between device synchronisations. Returns {"ms": each timed step's,
    "first_ms" / "first_out": the first call's time (compiling, autotuning) and result, "outs": the timed calls'
    results, "extra_mb": the largest peak over what was held as its step began, "peak_mb", "base_mb"}."""
    first = [wall_ms(step, cuda) for _ in range(warmup)][:1]  # the steps return small things (a loss, None)
    flush = _l2_flusher() if cuda else (lambda: None)
    ms, outs, peaks, bases = [], [], [], []
    for _ in range(reps):
        if before is not None:
            before()
        bases.append(_fresh_peak(cuda))
        flush()
        t, out = wall_ms(step, cuda)
        ms.append(t)
        outs.append(out)
        peaks.append(torch.cuda.max_memory_allocated() / MB if cuda else peak_rss_mb())
    first_ms, first_out = first[0] if first else (ms[0], outs[0])
    return {"ms": ms, "outs": outs, "first_ms": first_ms, "first_out": first_out, "peak_mb": max(peaks),
            "base_mb": min(bases), "extra_mb": max(0.0, max(p - b for p, b in zip(peaks, bases)))}


def _step(op: Op, st: dict):
    out = op.forward(st)
    return out, torch.autograd.grad(out["loss"], st["wrt"]) if op.needs_grad else None


def _keep(out: dict, grads, rows: int) -> dict:
    """The first ``rows`` tokens of an op's outputs, copied (for the accuracy check after timing)."""
    kept = {k: out[k].detach().reshape(-1)[:rows].clone() for k in ("logp", "entropy") if out.get(k) is not None}
    if out.get("loss") is not None:
        kept["loss"] = float(out["loss"].detach())
    if grads is not None:
        kept["grad_h"] = grads[0].detach().reshape(-1, grads[0].shape[-1])[:rows].clone()
    return kept


def _cpu_step(op: Op, st: dict):
    """One step measured on a trimmed heap and a reset peak: (figures, outputs, gradients)."""
    trim()
    base, reset = rss_mb(), reset_peak()
    t0 = time.perf_counter()
    out = op.forward(st)
    t1, peak_f = time.perf_counter(), peak_rss_mb()
    grads = torch.autograd.grad(out["loss"], st["wrt"]) if op.needs_grad else None
    t2, peak_t = time.perf_counter(), peak_rss_mb()
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    m = dict(fwd=(t1 - t0) * 1e3, bwd=(t2 - t1) * 1e3, tot=(t2 - t0) * 1e3, fwd_mb=peak_f - base, tot_mb=peak_t - base,
             base=base, ru=ru - base, reset=reset)
    return m, out, grads


def measure_cpu(op: Op, states: list[dict], reps: int, warmup: int, keep_rows: int) -> dict:
    rss_inputs = rss_mb()
    first, steps, kept = {"tot": None, "tot_mb": None}, [], {}
    with torch.set_grad_enabled(op.needs_grad):
        for i in range(warmup):
            if i == 0:  # the fresh process's first step: what lazy imports and first-call set-up cost a user
                first = _cpu_step(op, states[0])[0]
            else:
                _step(op, states[i % len(states)])
        for r in range(reps):
            m, out, grads = _cpu_step(op, states[r % len(states)])
            steps.append(m)
            kept = kept if r else _keep(out, grads, keep_rows)
            del out, grads
    reset_ok = all(m["reset"] for m in steps)
    return {
        "fwd_ms": summarize([m["fwd"] for m in steps]),
        "bwd_ms": summarize([m["bwd"] for m in steps] if op.needs_grad else []),
        "total_ms": summarize([m["tot"] for m in steps]),
        # the largest of the repetitions' peaks: memory is a limit, not an average
        "peak_extra_fwd_mb": max(m["fwd_mb"] for m in steps),
        "peak_extra_mb": max(m["tot_mb"] for m in steps),
        "rss_after_inputs_mb": rss_inputs,
        "first_step_ms": first["tot"],  # not in the statistics: a first call's lazy imports show here
        "first_step_extra_mb": first["tot_mb"],
        "rss_baseline_mb": statistics.median(m["base"] for m in steps),
        "ru_maxrss_extra_mb": max(m["ru"] for m in steps),  # floored by the image the process was forked from
        "peak_reset": reset_ok,
        "memory_method": "peak RSS (VmHWM = getrusage's own-image peak) minus RSS before the call, reset per repetition"
        if reset_ok else "peak RSS since process start minus RSS before the call (could not reset the peak)",
    }, kept


def _nbytes(*objs) -> int:
    return sum(o.numel() * o.element_size() if isinstance(o, torch.Tensor) else
               _nbytes(*o.values()) if isinstance(o, dict) else
               _nbytes(*o) if isinstance(o, (list, tuple)) else 0 for o in objs)


def event_times(fn, reps: int, setup=None) -> list[float]:
    """``reps`` calls of ``fn``, each timed with CUDA events after an L2 flush (ms); ``setup``: an untimed call before
    each flush, whose results ``fn`` takes as its arguments."""
    flush, out = _l2_flusher(), []
    for _ in range(max(1, reps)):
        args = setup() if setup else ()
        flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
        del args
    return out


def measure_cuda(op: Op, states: list[dict], reps: int, warmup: int, keep_rows: int, total_only: bool = False) -> dict:
    """``reps`` forward + backward steps, each between CUDA events after an L2 flush (``event_times``), then the forward
    alone and the backward alone (an untimed forward before each); ``total_only``: the first only (a whole tournament
    in one short GPU window)."""
    dev = torch.device("cuda")
    with torch.set_grad_enabled(op.needs_grad):
        for i in range(max(1, warmup)):  # compile, autotune, allocator warm-up (results dropped at once)
            _step(op, states[i % len(states)])
        torch.cuda.synchronize()
        # memory first, on a clean peak: inputs are allocated already, outputs are subtracted
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = op.forward(states[0])
        torch.cuda.synchronize()
        peak_f = torch.cuda.max_memory_allocated(dev) - base - _nbytes(out)
        grads = torch.autograd.grad(out["loss"], states[0]["wrt"]) if op.needs_grad else None
        torch.cuda.synchronize()
        peak_t = torch.cuda.max_memory_allocated(dev) - base - _nbytes(out, grads)
        kept = _keep(out, grads, keep_rows)
        del out, grads

        cycle = itertools.cycle(states)
        total = summarize(event_times(lambda: _step(op, next(cycle)), reps))  # without a backward: the forward
        res = {"fwd_ms": {} if total_only else total, "bwd_ms": {}, "total_ms": total}
        if op.needs_grad and not total_only:
            def untimed_forward():
                st = next(cycle)
                return st, op.forward(st)
            res["fwd_ms"] = summarize(event_times(lambda: op.forward(next(cycle)), reps))
            res["bwd_ms"] = summarize(event_times(lambda st, out: torch.autograd.grad(out["loss"], st["wrt"]), reps,
                                                  setup=untimed_forward))
    res.update(peak_extra_fwd_mb=peak_f / MB, peak_extra_mb=peak_t / MB, inputs_mb=base / MB,
               memory_method="torch.cuda.max_memory_allocated() minus inputs and outputs")
    return res, kept


def measure_op(op: Op, states: list, device: torch.device, reps: int, warmup: int, rows: int,
               total_only: bool = False) -> tuple[dict, dict]:
    """(figures, the first ``rows`` tokens' outputs): ``measure_cuda`` on CUDA, ``measure_cpu`` elsewhere."""
    if device.type == "cuda":
        return measure_cuda(op, states, reps, warmup, rows, total_only)
    return measure_cpu(op, states, reps, warmup, rows)


def accuracy(op: Op, wl: Workload, inp, kept: dict, rows: int) -> dict:
    """Max abs error of log-prob, entropy and grad_h on the first ``rows`` tokens against float64 (each token's
    outputs, and its grad_h under a loss summed over tokens, depend on its own row only)."""
    if wl.kind not in ("logprob", "forward") or "logp" not in kept:
        return {}
    from fastrl.reference import logprobs_reference

    h64 = inp.hidden.detach().reshape(-1, wl.H)[:rows].to(torch.float64).requires_grad_(wl.kind == "logprob")
    w64 = inp.weight.detach().to(torch.float64)
    t = inp.targets.reshape(-1)[:rows]
    with torch.enable_grad():
        logp, ent = logprobs_reference(h64, w64, t)
        err = {"logp_max_abs_err": (kept["logp"].double() - logp.detach()).abs().max().item()}
        if "entropy" in kept:
            err["entropy_max_abs_err"] = (kept["entropy"].double() - ent.detach()).abs().max().item()
        if "grad_h" in kept:
            loss = logp.sum() + (ENTROPY_COEF * ent.sum() if op.has_entropy else 0.0)
            (gh,) = torch.autograd.grad(loss, h64)
            err["grad_h_max_abs_err"] = (kept["grad_h"].double() - gh).abs().max().item()
    err["accuracy_rows"] = rows
    return err
