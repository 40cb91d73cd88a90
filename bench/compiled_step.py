"""``python -m bench compile``: one training step with fastrl inside ``torch.compile``, against the same step eager and
against ``torch.compile`` of the materialised reference.

The step: a model body (one residual MLP block with RMSNorm, H -> 4H -> H, standing in for a transformer) turns
input activations ``x [B, T, H]`` into hidden states; the LM head and the GRPO loss (dapo, beta 0.04 with k3 KL,
entropy bonus 0.01, as W1) turn them into a loss: that is the compiled function; its backward (compiled by
AOTAutograd for the compiled variants); one SGD update of every parameter (outside the
compiled region, in place, so the compiled step sees the same tensors each time). Variants (``--variants``):

* ``fastrl-eager``: ``fastrl.policy_loss`` (one-pass path) in an eager step;
* ``fastrl-nosync``: the same, eager, with ``host_sync=False``: the path compiled steps take (rows outside the
  mask computed, not dropped), to tell its cost from the compiler's;
* ``fastrl-compile``: the same step under ``torch.compile(fullgraph=True)``: fastrl's ops are single nodes
  (``torch.ops.fastrl.*``), the body and the loss arithmetic around them are compiled;
* ``reference-compile``: the step with the materialised reference (``fastrl.reference``: full ``[N, V]``
  logits in the input dtype, log-softmax, the same loss arithmetic) under ``torch.compile`` -- what a user gets
  by compiling the textbook loss;
* ``reference-eager``: that step eager;
* CUDA only: ``fastrl-compile-ro`` and ``reference-compile-ro``, ``mode="reduce-overhead"`` (CUDA graphs: the
  no-sync path lets fastrl's ops be captured; ``static`` shapes).

Reported per variant: the median step time over ``--reps`` timed steps after ``--warmup`` untimed ones (the first
untimed step includes compilation, reported separately as ``first_step_s``), the loss of the first step (the same
for every variant, up to float32 rounding: printed so a wrong compiled graph shows), and on CUDA the peak memory
above the inputs. FLOPs per step, written out: LM head 6NHV (one pass: forward GEMM, grad_h, grad_W; the
materialised reference also 6NHV) + body 2 * 3 * (2 * N * H * 4H) = 48NH^2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

__all__ = ["VARIANTS", "main", "run"]

VARIANTS = ("fastrl-eager", "fastrl-nosync", "fastrl-compile", "reference-eager", "reference-compile")
CUDA_VARIANTS = VARIANTS + ("fastrl-compile-ro", "reference-compile-ro")
SHAPES = {  # (B, T, H, V, dtype)
    "cpu": (4, 512, 512, 32768, torch.float32),  # N = 2048 tokens (C1's H and V)
    "cuda": (8, 2048, 4096, 151936, torch.bfloat16),  # N = 16384 tokens: W1's shapes
}


class Body(torch.nn.Module):
    """One residual MLP block with RMSNorm: a stand-in for the transformer body in front of the LM head."""

    def __init__(self, H: int):
        super().__init__()
        self.norm = torch.nn.RMSNorm(H)
        self.up = torch.nn.Linear(H, 4 * H, bias=False)
        self.down = torch.nn.Linear(4 * H, H, bias=False)

    def forward(self, x):  # [B, T, H] -> [B, T, H]
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _config():
    from fastrl import PolicyLossConfig

    return PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01, temperature=0.9)


def _step_fn(kind: str, body: Body, head: torch.nn.Linear, config, host_sync=None):
    import fastrl
    from fastrl.reference import logprobs_reference, policy_loss_from_logprobs

    def fastrl_step(x, targets, adv, mask, old, ref):
        hidden = body(x)
        loss, metrics = fastrl.policy_loss(hidden, head.weight, targets, adv, mask, config=config, old_logprobs=old,
                                           ref_logprobs=ref, check_finite=False, host_sync=host_sync)
        return loss, metrics["kl"]

    def reference_step(x, targets, adv, mask, old, ref):
        hidden = body(x)
        B, T, H = hidden.shape
        logp, ent = logprobs_reference(hidden.reshape(B * T, H), head.weight, targets.reshape(-1),
                                       temperature=config.temperature)
        loss, metrics = policy_loss_from_logprobs(logp.view(B, T), ent.view(B, T), adv, mask, config=config,
                                                  old_logprobs=old, ref_logprobs=ref)
        return loss, metrics["kl"]

    return fastrl_step if kind == "fastrl" else reference_step


def _inputs(B, T, H, V, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, T, H, generator=g).to(device=device, dtype=dtype)
    targets = torch.randint(0, V, (B, T), generator=g).to(device)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(device)  # completions of different lengths
    # old / ref log-probs near what a random head gives (about -log V): ratios and k3 stay O(1)
    old = (-torch.log(torch.tensor(float(V))) + 0.1 * torch.randn(B, T, generator=g)).to(device)
    ref = old + 0.05 * torch.randn(B, T, generator=g).to(device)
    adv = torch.randn(B, generator=g).to(device)
    return x, targets, adv, mask, old, ref


def _measure(variant: str, shape, device: str, reps: int, warmup: int, compile_backend: str | None = None) -> dict:
    B, T, H, V, dtype = shape
    torch.manual_seed(0)
    body = Body(H).to(device=device, dtype=dtype)
    head = torch.nn.Linear(H, V, bias=False).to(device=device, dtype=dtype)
    torch.nn.init.normal_(head.weight, std=H ** -0.5)
    params = list(body.parameters()) + list(head.parameters())
    kind = variant.split("-")[0]
    fn = _step_fn(kind, body, head, _config(), host_sync=False if variant == "fastrl-nosync" else None)
    if "compile" in variant:
        mode = "reduce-overhead" if variant.endswith("-ro") else None
        backend = {"backend": compile_backend} if compile_backend else {}
        fn = torch.compile(fn, fullgraph=(kind == "fastrl"), mode=mode, dynamic=False, **backend)
    inputs = _inputs(B, T, H, V, dtype, device)

    def step():
        for p in params:
            p.grad = None
        loss, kl = fn(*inputs)
        loss.backward()  # (AOTAutograd's compiled backward for the compiled variants)
        with torch.no_grad():
            for p in params:
                p.sub_(1e-4 * p.grad)  # an SGD update in place: the compiled step sees the same parameters
        return loss, kl

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    loss, kl = step()
    sync()
    first = time.perf_counter() - t0
    first_loss = float(loss.detach())
    for _ in range(max(0, warmup - 1)):
        step()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    N = B * T
    flops = 6 * N * H * V + 48 * N * H * H
    ms = 1e3 * statistics.median(times)
    row = {"variant": variant, "B": B, "T": T, "H": H, "V": V, "dtype": str(dtype).replace("torch.", ""),
           "ms": ms, "ms_min": 1e3 * min(times), "ms_max": 1e3 * max(times), "first_step_s": first, "first_loss": first_loss,
           "tflops": flops / (ms * 1e-3) / 1e12, "reps": reps}
    if device == "cuda":
        row["peak_extra_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


def run(device: str, variants, reps: int, warmup: int, shape=None, compile_backend: str | None = None) -> list[dict]:
    """``compile_backend``: torch.compile's backend (default inductor; ``"aot_eager"`` traces without generating
    code: the plumbing only)."""
    shape = shape or SHAPES[device]
    rows = []
    for v in variants:
        torch._dynamo.reset()
        try:
            rows.append(_measure(v, shape, device, reps, warmup, compile_backend))
        except Exception as e:  # report and go on: one variant failing must not hide the others
            rows.append({"variant": v, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _each_in_a_process(device: str, variants, reps: int, warmup: int, shape) -> tuple[list, list]:
    """(specs, results): each variant in a fresh process on the benchmarks' harness (``bench.session_run``)."""
    from bench.session_run import run_fresh

    specs = [{"kind": "compile", "variant": v, "device": device, "reps": reps, "warmup": warmup,
              "shape": list(shape[:4]) if shape else None} for v in variants]
    return specs, run_fresh(specs, device, 3600)


def run_point(spec: dict) -> dict:
    """One variant in this fresh process (``bench.session_points.run_spec``, kind "compile")."""
    device = spec["device"]
    shape = (*spec["shape"], SHAPES[device][4]) if spec.get("shape") else None
    (row,) = run(device, [spec["variant"]], spec["reps"], spec["warmup"], shape)
    return {"status": "error", "reason": row["error"], **row} if "error" in row else {"status": "ok", **row}


def add_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    ap.add_argument("--variants", help=f"comma list of {', '.join(CUDA_VARIANTS)} (default: all for the device)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first, compilation included (default 2)")
    ap.add_argument("--shape", help="B,T,H,V (default: CPU 4,512,512,32768 float32; CUDA W1 8,2048,4096,151936 bf16)")
    ap.add_argument("--out", help="results folder (default: a new folder outside the repository)")


def command(args, device: str, con=None) -> int:
    """Measure, print the table, write ``compile.json``."""
    from pathlib import Path

    from bench import report

    variants = args.variants.split(",") if args.variants else (CUDA_VARIANTS if device == "cuda" else VARIANTS)
    shape = None
    if args.shape:
        B, T, H, V = (int(s) for s in args.shape.split(","))
        shape = (B, T, H, V, SHAPES[device][4])
    env = report.environment(device)
    rows = [{"variant": spec["variant"], "error": res.get("reason")} if res.get("status") != "ok" else res
            for spec, res in zip(*_each_in_a_process(device, variants, args.reps, args.warmup, shape))]
    out = Path(args.out) if args.out else report.new_out_dir(env["device_slug"], "compile")
    eager = next((r["ms"] for r in rows if r.get("variant") == "fastrl-eager" and "ms" in r), None)
    print(f"\ncompiled training step on {env['device']} | torch {env['torch']} | median of {args.reps} steps after "
          f"{args.warmup} untimed")
    print(f"{'variant':22s} {'ms':>10s} {'vs fastrl-eager':>16s} {'first step s':>13s} {'loss':>12s}")
    for r in rows:
        if "ms" not in r:
            print(f"{r['variant']:22s} error: {r['error']}")
            continue
        ratio = f"{r['ms'] / eager:.2f}x" if eager else "-"
        print(f"{r['variant']:22s} {r['ms']:10.1f} {ratio:>16s} {r['first_step_s']:13.1f} {r['first_loss']:12.6f}")
    # On a CPU, inductor's OpenMP kernels spin-wait after each call by default and then compete with the ATen ops
    # fastrl's op runs (measured on 2 cores: the compiled step ~2x slower than aot_eager); OMP_WAIT_POLICY=PASSIVE,
    # set before the process starts, removes that. Recorded with the results.
    omp = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    report.write_json(out / "compile.json", {"command": "compile", "env": {**env, **omp}, "args": vars(args),
                                             "rows": rows, "doc": "bench/compiled_step.py"})
    print(f"wrote {out / 'compile.json'}")
    return 0 if all("ms" in r for r in rows) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compiled_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(ap)
    args = ap.parse_args(argv)
    return command(args, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


if __name__ == "__main__":
    raise SystemExit(main())
