"""One measuring process of the benchmarks: ``python -m bench.session_points SPEC.json`` (``bench/session_run.py``).

It measures the spec's points in order, appending ``{"begin": id, "t": epoch}`` to the rows file before each point and
its row after it; a point past the deadline is ``skipped``. ``FASTRL_SESSION_FAULT`` (tests only: ``hang:TEXT`` /
``crash:TEXT``, ``;``-separated) makes every point whose id contains TEXT hang or kill this process.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from bench import measure, providers
from bench import workloads as W
from bench.providers import Op
from bench.session_checks import run_check, served_configs
from bench.session_run import RESTART, append_rows

__all__ = ["lmhead_workloads", "main", "run_spec", "PRUNE"]

PRUNE = 1.3  # a candidate configuration this much slower than the default at its H's log-prob workload stops there


def lmhead_workloads(smoke: bool) -> dict[str, W.Workload]:
    """W1, W1-lp, W2, W2-lp, W3; smoke: 32 tokens in float32, V=512, two H (64, 32: the defaults table's H ranges)."""
    return {wl.name: replace(W.tiny(wl), name=wl.name, N=32, batch=min(wl.batch, 2), H=64 if wl.H == 4096 else 32)
            if smoke else wl for wl in W.gpu_workloads() if wl.name in ("W1", "W1-lp", "W2", "W2-lp", "W3")}


def floor_op(wl: W.Workload, device: torch.device) -> Op:
    """cuBLAS alone on the workload's GEMMs: ``y = h W^T`` (2NHV), and for a gradient workload ``G W`` and ``G^T h``
    (4NHV more) with a random ``G`` [N, V]: the time no LM-head implementation can beat at that shape."""
    def prepare(inp):
        g = torch.Generator(device=device).manual_seed(7)
        dt = getattr(torch, wl.dtype)
        st = {"h": torch.randn(wl.N, wl.H, generator=g, device=device).to(dt),
              "w": torch.randn(wl.V, wl.H, generator=g, device=device).to(dt), "wrt": ()}
        if wl.kind != "forward":
            st["g"] = torch.randn(wl.N, wl.V, generator=g, device=device).to(dt)
        return st

    def forward(st):
        y = st["h"] @ st["w"].T
        out = (y, st["g"] @ st["w"], st["g"].T @ st["h"]) if "g" in st else y
        return {"loss": None, "logp": None, "entropy": None, "out": out}
    return Op(forward, prepare, needs_grad=False, has_entropy=False, path="forward",
              notes=["cuBLAS GEMMs alone: " + ("2NHV" if wl.kind == "forward" else "6NHV")])


class LMHead:
    """The inputs of the current workload (rebuilt when the workload changes: W1's are 4 GB on a GPU) and the float64
    references of each workload (kept: a few numbers per token)."""

    def __init__(self, device: torch.device, smoke: bool):
        self.device, self.smoke = device, smoke
        self.wls = lmhead_workloads(smoke)
        self.n_sets = 1 if smoke else 3
        self.rows = 16 if smoke else 256
        self._name, self._sets = None, []
        self._loss_ref: dict[str, tuple[float, torch.Tensor]] = {}

    def inputs(self, wl: W.Workload) -> list:
        if self._name != wl.name:
            self._sets = []  # free the last workload's first
            self._sets = [providers.make_inputs(wl, self.device, 1234 + i) for i in range(self.n_sets)]
            self._name = wl.name
        return self._sets

    def loss_reference(self, wl: W.Workload, inp) -> tuple[float, torch.Tensor]:
        """(loss, d loss / d hidden of the first rows) in float64 on input set 0: the per-token log-probs and
        entropies in row chunks (never all [N, V] float64 logits at once), the first rows under autograd."""
        if wl.name not in self._loss_ref:
            from fastrl.reference import logprobs_reference, policy_loss_from_logprobs

            h, t, w64 = inp.hidden.detach().reshape(-1, wl.H), inp.targets.reshape(-1), inp.weight.detach().double()
            first = h[:self.rows].double().requires_grad_()
            with torch.enable_grad():
                parts = [logprobs_reference(first, w64, t[:self.rows])]
                with torch.no_grad():
                    parts += [logprobs_reference(h[c:c + 1024].double(), w64, t[c:c + 1024])
                              for c in range(self.rows, h.shape[0], 1024)]
                logp, ent = (torch.cat(x).view(wl.batch, wl.T) for x in zip(*parts))
                loss, _ = policy_loss_from_logprobs(
                    logp, ent, inp.advantages.double(), inp.mask, config=providers.loss_config(),
                    old_logprobs=inp.old_logprobs.double(), ref_logprobs=inp.ref_logprobs.double())
                (g,) = torch.autograd.grad(loss, first)
            self._loss_ref[wl.name] = (float(loss), g.detach())
        return self._loss_ref[wl.name]

    def error(self, op: Op, wl: W.Workload, inp, kept: dict) -> dict:
        """Max abs error against float64: log-prob, entropy and grad_h of the first rows; for a loss, the loss value
        and grad_h of the first rows (the loss couples every token, so its reference covers all of them)."""
        if wl.kind != "loss":
            acc = measure.accuracy(op, wl, inp, kept, self.rows)
            return {k.removesuffix("_max_abs_err"): v for k, v in acc.items() if k.endswith("_max_abs_err")}
        if "loss" not in kept:
            return {}
        loss64, g64 = self.loss_reference(wl, inp)
        err = {"loss": abs(kept["loss"] - loss64)}
        if "grad_h" in kept:
            err["grad_h"] = (kept["grad_h"].double() - g64[: kept["grad_h"].shape[0]]).abs().max().item()
        return err


def _build(provider: str, wl: W.Workload, device: torch.device, options: dict, make_sets) -> tuple | dict:
    """(the provider's op on ``wl`` (``cublas``: the GEMM floor), its input sets, their prepared states), or the row of
    why not: not available here, or a peer's own refusal (``n/a``)."""
    if provider == "cublas":
        op = floor_op(wl, device)
        return op, [None], [op.prepare(None)]
    prov = providers.get(provider)
    why = prov.unavailable(wl, device.type)  # e.g. TRL's wheel not carried: a row that says so
    if why is not None:
        return {"status": why[0], "reason": why[1]}
    try:
        op, sets = prov.build(wl, device, options), make_sets()
        return op, sets, [op.prepare(s) for s in sets]
    except providers.ProviderUnavailable as e:
        return {"status": "skipped", "reason": str(e)}
    except Exception as e:
        if prov.is_refusal(e):
            return _refused(e)
        raise


def _lmhead_point(p: dict, lm: LMHead, times: dict) -> dict:
    from fastrl.kernels import tuning
    from fastrl.ops.backend import builtin_choice, resolve_backend

    wl = lm.wls[p["workload"]]
    impl, config, probe = p.get("implementation"), p.get("config", "default"), p.get("probe")
    # a candidate's time at the probe (its H's log-prob workload) against its implementation's default there
    base, mine = times.get((impl, "default", probe, "fastrl")), times.get((impl, config, probe, "fastrl"))
    if probe and config != "default" and base and mine and mine >= PRUNE * base:
        return {"status": "pruned", "reason": f"{mine / base:.2f}x the default configuration's time at {probe} "
                                              f"(pruned at {PRUNE}x)"}
    if p.get("memory_budget"):  # the budget section: this process's every fastrl path sized by it
        from fastrl.ops.budget import set_memory_budget

        set_memory_budget(p["memory_budget"])
    built = _build(p["provider"], wl, lm.device, {"fastrl_backend": impl} if impl else {}, lambda: lm.inputs(wl))
    if isinstance(built, dict):
        return built
    op, sets, states = built
    tuning.reset_served()
    cuda = lm.device.type == "cuda"
    with contextlib.nullcontext() if config == "default" else tuning.forced_config(config):
        m, kept = measure.measure_op(op, states, lm.device, 6 if cuda else 1, 2 if cuda else 0, lm.rows, True)
    times[(impl, config, p["workload"], p["provider"])] = m["total_ms"]["median"]
    # auto: what backend="triton" / "auto" picks for this work here (the row that stands for today's default); builtin:
    # what a measured winner must beat (bench/defaults.py)
    return {"status": "ok", "auto": resolve_backend(lm.device, "triton", kind=wl.kind, H=wl.H,
                                                    dtype=getattr(torch, wl.dtype)),
            "builtin": builtin_choice(lm.device), "path": op.path, "notes": "; ".join(op.notes),
            "total_ms": m["total_ms"], "extra_mb": m["peak_extra_mb"], "configs_served": served_configs(),
            "flops": W.flops(wl, "total"), "error": {} if sets[0] is None else lm.error(op, wl, sets[0], kept)}


def _profile_point(p: dict, lm: LMHead) -> dict:
    """Where a step's time goes: torch.profiler over 3 steps (smoke: 1) after 2 untimed ones; the costliest kernels
    (their device time per step; CPU ops in a smoke run) in the row, ``total_ms`` their sum per step."""
    from torch.profiler import ProfilerActivity, profile

    wl, cuda, steps = lm.wls[p["workload"]], lm.device.type == "cuda", 1 if lm.smoke else 3
    built = _build(p["provider"], wl, lm.device, {}, lambda: lm.inputs(wl))
    if isinstance(built, dict):
        return built
    op, _, states = built

    def step(i: int) -> None:
        st = states[i % len(states)]
        out = op.forward(st)
        if op.needs_grad:
            torch.autograd.grad(out["loss"], st["wrt"])

    for i in range(2):
        step(i)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            step(i)
        if cuda:
            torch.cuda.synchronize()
    def cost(e) -> float:  # us over the profiled steps; on CUDA the kernels' own, not the ops' that launched them
        return e.self_cpu_time_total if not cuda else e.self_device_time_total if e.device_type.name == "CUDA" else 0

    events = sorted((e for e in prof.key_averages() if cost(e) > 0), key=cost, reverse=True)
    kernels = [{"name": e.key[:160], "ms": cost(e) / 1e3 / steps, "calls": e.count / steps} for e in events]
    ms = sum(k["ms"] for k in kernels)
    return {"status": "ok", "total_ms": {"median": ms, "min": ms, "max": ms, "n": steps}, "extra_mb": None,
            "kernels": kernels[:12], "kernels_other_ms": sum(k["ms"] for k in kernels[12:]), "path": op.path}


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def _run(p: dict, device: torch.device, lm: LMHead, times: dict) -> dict:
    """One point's row by its section: a float64 check, a W1-W3 point, a point of keptset, divergence or compile (their
    ``run_point`` at the session's repetitions), or a point of another command (``run_spec``)."""
    section, smoke, impl = p["section"], p["smoke"], p.get("implementation")
    reps = {"reps": 1 if smoke else 6, "warmup": 0 if smoke else 2, "device": device.type, "threads": 0}
    if section == "checks":
        return run_check(p, device)
    if section in ("tournament", "configs", "budget"):
        return _lmhead_point(p, lm, times)
    if section == "profile":
        return _profile_point(p, lm)
    if section == "point":
        return run_spec(p["spec"])
    if section == "w4":  # W4 at 4096 tokens (smoke: its tiny model), a point as `python -m bench w4` runs it
        from bench import w4

        (s,) = w4.plan_for(device.type, "smoke" if smoke else "full").shapes.values()
        res = w4.run_point(w4.point_spec(s, p["provider"], s.lengths[0], device.type, reps=1 if smoke else 3))
        return {**res, "workload": f"W4-{s.lengths[0]}", "total_ms": res.get("step_ms"),
                "extra_mb": res.get("peak_extra_mb"), "tokens": s.completions * s.lengths[0]}
    if section == "keptset":
        res = run_spec({**p["spec"], **reps, "kind": "keptset"})
        ms, extra = res.pop("ms_all"), res.pop("peak_extra_mb")
        return {**res, "total_ms": measure.summarize(ms), "extra_mb": extra}
    if section == "divergence":
        res = run_spec({"kind": "divergence", "workload": p["spec"], "provider": p["provider"], **reps,
                        "n_sets": 1 if smoke else 2, "seed": 1234, "options": {"fastrl_backend": impl} if impl else {},
                        "total_only": True, "accuracy_rows": 16 if smoke else 256})
        err = {k.removesuffix("_max_abs_err"): res[k] for k in ("div_max_abs_err", "grad_h_max_abs_err") if k in res}
        return res if res.get("status") != "ok" else {"status": "ok", "total_ms": res["total_ms"], "error": err,
                                                      "extra_mb": res["peak_extra_mb"], "loss_value": res["loss_value"]}
    return run_spec({"kind": "compile", "variant": p["provider"], "device": device.type, "smoke": smoke,
                     "reps": 1 if smoke else 5, "warmup": 1 if smoke else 2})  # compile


RUN_POINT = {"w4": ("bench.w4", "run_point"), "w5": ("bench.w4", "run_point"), "compile": ("bench.compiled_step",
             "run_point"), "divergence": ("bench.divergence", "run_point"), "keptset": ("bench.keptset", "run_point"),
             "gap": ("bench.gap", "run_config")}


def run_spec(spec: dict) -> dict:
    """One point of another command: ``RUN_POINT[spec["kind"]]``, else a provider on a workload (``run``, ``c1``)."""
    if spec.get("kind") not in RUN_POINT:
        return _provider_point(spec)
    module, fn = RUN_POINT[spec["kind"]]
    res = getattr(importlib.import_module(module), fn)(spec)
    return {"status": "ok", **res} if spec["kind"] in ("keptset", "gap") else res


def _provider_point(spec: dict) -> dict:
    """A provider on a workload (``bench.providers``): timing, memory, the error against float64; a peer's declared
    refusal of the input is ``n/a``, not an error."""
    wl, device, t_start = W.Workload.from_dict(spec["workload"]), torch.device(spec["device"]), time.perf_counter()
    rows = min(spec.get("accuracy_rows", 256), wl.N)
    if device.type == "cpu" and spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    prov = providers.get(spec["provider"])
    built = _build(spec["provider"], wl, device, spec.get("options", {}),
                   lambda: [providers.make_inputs(wl, device, spec["seed"] + i) for i in range(spec["n_sets"])])
    if isinstance(built, dict):
        return built
    op, sets, states = built
    try:
        m, kept = measure.measure_op(op, states, device, spec["reps"], spec["warmup"], rows)
    except Exception as e:  # noqa: BLE001 - any failure becomes a row that says why
        if prov.is_refusal(e):
            return _refused(e)
        status = "skipped" if prov.compile_fails_skip and _is_compile_error(e) else "error"
        what = f"torch.compile failed on {device.type}" if status == "skipped" else "failed"
        return {"status": status, "reason": f"{what}: {_first_line(e)}", "traceback": traceback.format_exc(limit=4)}
    res = {"status": "ok", "reason": "", "notes": "; ".join(op.notes), "path": op.path, **m}
    if kept.get("loss") is not None:
        res["loss_value"] = kept["loss"]
    try:
        res.update(measure.accuracy(op, wl, sets[0], kept, rows))
    except Exception as e:  # noqa: BLE001
        res["accuracy_error"] = _first_line(e)
    return {**res, "flops_useful": W.flops(wl, "total"), "worker_s": time.perf_counter() - t_start}


def _refused(e: BaseException) -> dict:
    """A peer's own refusal of this input (dtype, shape): not applicable, not an error."""
    return {"status": "n/a", "reason": f"refused this input: {_first_line(e)}"}


def _is_compile_error(e: BaseException) -> bool:
    mods = {type(x).__module__ for x in (e, e.__cause__, e.__context__) if x is not None}
    return any(m.startswith(("torch._dynamo", "torch._inductor")) for m in mods) or "inductor" in str(e).lower()


def _echo(row: dict) -> None:
    what = " ".join(str(row[k]) for k in ("section", "workload", "provider", "implementation", "config")
                    if row.get(k) not in (None, "", "default"))
    t, extra = row.get("total_ms"), row.get("extra_mb")
    if row["status"] == "ok" and t:
        print(f"  {what}: {t['median']:.2f} ms [{t['min']:.2f}-{t['max']:.2f}]"
              + (f", {extra:.0f} MB extra" if extra is not None else ""), flush=True)
    else:
        verdict = "" if row.get("pass", True) else " FAILED"
        print(f"  {what}: {row['status']}{verdict} {row.get('reason', '')}"[:300], flush=True)


def _cuda_usable() -> bool:
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return True
    except Exception:  # noqa: BLE001 - an illegal address or a launch failure poisons the context for good
        return False


def _inject_fault(point_id: str) -> None:
    """Tests only: hang in, or die at, the points ``FASTRL_SESSION_FAULT`` names (see the module docstring)."""
    for kind, _, text in (item.partition(":") for item in os.environ.get("FASTRL_SESSION_FAULT", "").split(";")):
        if text and text in point_id and kind == "hang":
            time.sleep(3600)
        elif text and text in point_id and kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)


def _pruning_times(rows_path: str) -> dict:
    """A restarted process: the configs rows of the last one still decide pruning."""
    path = Path(rows_path)  # a fresh command's rows file begins with its first point
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return {(r.get("implementation"), r.get("config"), r["workload"], r["provider"]): r["total_ms"]["median"]
            for r in rows if r.get("status") == "ok" and "total_ms" in r and r.get("section") == "configs"}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    device, rows_path = torch.device(spec["device"]), spec["rows"]
    lm = LMHead(device, spec["smoke"])
    times = _pruning_times(rows_path)
    for p in spec["points"]:
        row = {k: p[k] for k in ("id", "section", "workload", "provider", "implementation", "config") if k in p}
        wl = lm.wls.get(p.get("workload", ""))
        if wl is not None and p["section"] in ("tournament", "configs", "budget", "profile"):
            row.update(kind=wl.kind, N=wl.N, H=wl.H, V=wl.V, dtype=wl.dtype)
        left = spec["deadline"] - time.time()
        append_rows(rows_path, [{"begin": p["id"], "t": time.time()}])
        t0 = time.perf_counter()
        if left <= 0:
            row.update(status="skipped", reason="the section's time ran out (--budget)")
        else:
            _inject_fault(p["id"])
            try:
                row.update(_run(p, device, lm, times))
            except Exception as e:  # noqa: BLE001 - a row that says why; the next point still runs
                row.update(status="error", reason=_first_line(e), traceback=traceback.format_exc(limit=6))
        # a sticky CUDA error fails every later launch: this process stops, the parent starts a fresh one
        crashed = left > 0 and device.type == "cuda" and not _cuda_usable()
        if crashed:
            row.update(reason=row.get("reason", "") + " (the CUDA context is broken: this process stops here)",
                       crashed=True)
        row.update(point_s=time.perf_counter() - t0, pid=os.getpid())
        append_rows(rows_path, [row])
        _echo(row)
        if crashed:
            os._exit(RESTART)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
