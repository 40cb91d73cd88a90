"""Measure one provider on one workload in this (fresh) process: ``python -m bench.worker SPEC.json RESULT.json``.

The parent (``bench.runner``) writes SPEC (workload, provider, device, repetitions, options) and reads
RESULT: timings, peak memory, accuracy, or the reason the provider could not run. A W4 or W5 spec (``"kind": "w4"``,
``"w5"``) is one GRPOTrainer step instead (``bench.w4.run_point``). Everything a provider
imports or allocates dies with this process.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from bench import measure, providers
from bench.providers import Op, ProviderUnavailable
from bench.workloads import Workload, flops

__all__ = ["run_spec", "matmul_op"]


def matmul_op(wl: Workload, device: torch.device) -> Op:
    """The floor: one plain ``[N, H] @ [H, V]`` GEMM in the workload's dtype (2NHV FLOPs, like a forward)."""
    def prepare(inp):
        g = torch.Generator(device="cpu").manual_seed(0)
        dt = getattr(torch, wl.dtype)
        a = torch.randn(wl.N, wl.H, generator=g).to(device=device, dtype=dt)
        b = torch.randn(wl.H, wl.V, generator=g).to(device=device, dtype=dt)
        return {"a": a, "b": b, "wrt": ()}

    def forward(st):
        return {"loss": None, "logp": None, "entropy": None, "out": st["a"] @ st["b"]}
    return Op(forward, prepare, needs_grad=False, has_entropy=False, path="forward", notes=["plain GEMM"])


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def run_spec(spec: dict) -> dict:
    wl = Workload.from_dict(spec["workload"])
    name = spec["provider"]
    device = torch.device(spec["device"])
    reps, warmup, n_sets = spec["reps"], spec["warmup"], spec["n_sets"]
    rows = min(spec.get("accuracy_rows", 256), wl.N)
    res: dict = {"status": "ok", "reason": ""}
    t_start = time.perf_counter()
    if device.type == "cpu" and spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))

    if name == "matmul":
        op = matmul_op(wl, device)
        states = [op.prepare(None)]
        prov = None
    else:
        prov = providers.get(name)
        try:
            op = prov.build(wl, device, spec.get("options", {}))
            sets = [providers.make_inputs(wl, device, spec["seed"] + i) for i in range(n_sets)]
            states = [op.prepare(s) for s in sets]
        except ProviderUnavailable as e:
            return {"status": "skipped", "reason": str(e)}
        except Exception as e:
            if prov.is_refusal(e):
                return _refused(e)
            raise
    res["notes"] = "; ".join(op.notes)
    res["path"] = op.path

    try:
        if device.type == "cuda":
            m, kept = measure.measure_cuda(op, states, reps, warmup, rows, rep_ms=spec.get("rep_ms", 2000))
        else:
            m, kept = measure.measure_cpu(op, states, reps, warmup, rows)
    except Exception as e:  # noqa: BLE001 - any failure becomes a row that says why
        if prov is not None and prov.is_refusal(e):
            return _refused(e)
        status = "skipped" if prov is not None and prov.compile_fails_skip and _is_compile_error(e) else "error"
        what = f"torch.compile failed on {device.type}" if status == "skipped" else "failed"
        tb = traceback.format_exc(limit=4)
        return {"status": status, "reason": f"{what}: {_first_line(e)}", "traceback": tb}
    res.update(m)
    if kept.get("loss") is not None:
        res["loss_value"] = kept["loss"]
    if prov is not None and spec.get("accuracy", True):
        try:
            res.update(measure.accuracy(op, wl, sets[0], kept, rows))
        except Exception as e:  # noqa: BLE001
            res["accuracy_error"] = _first_line(e)
    res["flops_useful"] = flops(wl, "total")
    res["worker_s"] = time.perf_counter() - t_start
    return res


def _refused(e: BaseException) -> dict:
    """A peer's own refusal of this input (dtype, shape): not applicable, not an error."""
    return {"status": "n/a", "reason": f"refused this input: {_first_line(e)}"}


def _is_compile_error(e: BaseException) -> bool:
    mods = {type(x).__module__ for x in (e, e.__cause__, e.__context__) if x is not None}
    return any(m.startswith(("torch._dynamo", "torch._inductor")) for m in mods) or "inductor" in str(e).lower()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m bench.worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        if spec.get("kind") in ("w4", "w5"):  # a W4 / W5 point: one trainer step (bench/w4.py)
            from bench.w4 import run_point

            res = run_point(spec)
        elif spec.get("kind") == "divergence":  # student vs teacher heads (bench/divergence.py)
            from bench.divergence import run_point as run_divergence

            res = run_divergence(spec)
        else:
            res = run_spec(spec)
    except Exception as e:  # noqa: BLE001
        res = {"status": "error", "reason": _first_line(e), "traceback": traceback.format_exc(limit=6)}
    res["pid"] = os.getpid()
    with open(argv[1], "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
