"""``python -m bench compile``: one training step (an MLP body, the LM head and W1's GRPO loss, backward, SGD) with
fastrl inside ``torch.compile``, against the same step eager and the materialised reference, each variant in a fresh
process; the variants and what is measured: docs/benchmarks.md#python--m-bench-compile (options: --help)."""

from __future__ import annotations

import os
import statistics

import torch

from bench import measure
from bench.report import pick

__all__ = ["VARIANTS", "run", "run_point", "add_options", "parse_args", "command"]

VARIANTS = ("fastrl-eager", "fastrl-nosync", "fastrl-compile", "reference-eager", "reference-compile")
CUDA_VARIANTS = VARIANTS + ("fastrl-compile-ro", "reference-compile-ro")
SHAPES = {  # (B, T, H, V, dtype)
    "cpu": (4, 512, 512, 32768, torch.float32),  # N = 2048 tokens (C1's H and V)
    "cuda": (8, 2048, 4096, 151936, torch.bfloat16),  # N = 16384 tokens: W1's shapes
}


def _step_fn(kind: str, body: torch.nn.ModuleDict, head: torch.nn.Linear, host_sync=None, masked=None):
    import fastrl
    from fastrl.reference import logprobs_reference, policy_loss_from_logprobs

    config = fastrl.PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01, temperature=0.9)

    def step(x, targets, adv, mask, old, ref):
        hidden = (body.norm(x) if masked is not None  # --masked: the head and loss alone (and a norm)
                  else x + body.down(torch.nn.functional.gelu(body.up(body.norm(x)))))  # [B, T, H] -> [B, T, H]
        if kind == "fastrl":
            loss, metrics = fastrl.policy_loss(hidden, head.weight, targets, adv, mask, config=config,
                                               old_logprobs=old, ref_logprobs=ref, check_finite=False,
                                               host_sync=host_sync)
        else:
            B, T, H = hidden.shape
            logp, ent = logprobs_reference(hidden.reshape(B * T, H), head.weight, targets.reshape(-1),
                                           temperature=config.temperature)
            loss, metrics = policy_loss_from_logprobs(logp.view(B, T), ent.view(B, T), adv, mask, config=config,
                                                      old_logprobs=old, ref_logprobs=ref)
        return loss, metrics["kl"]

    return step


def _inputs(B, T, H, V, dtype, device, seed=0, masked=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, T, H, generator=g).to(device=device, dtype=dtype)
    targets = torch.randint(0, V, (B, T), generator=g).to(device)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(device)  # completions of different lengths
    if masked is not None:  # --masked F: the last round(F T) tokens of every sequence are padding
        mask = (torch.arange(T)[None, :] < T - round(masked * T)).expand(B, T).to(device)
    # old / ref log-probs near what a random head gives (about -log V): ratios and k3 stay O(1)
    old = (-torch.log(torch.tensor(float(V))) + 0.1 * torch.randn(B, T, generator=g)).to(device)
    ref = old + 0.05 * torch.randn(B, T, generator=g).to(device)
    adv = torch.randn(B, generator=g).to(device)
    return x, targets, adv, mask, old, ref


def _measure(variant: str, shape, device: str, reps: int, warmup: int, compile_backend: str | None = None,
             masked=None) -> dict:
    B, T, H, V, dtype = shape
    torch.manual_seed(0)
    # the model body: one residual MLP block with RMSNorm, a stand-in for the transformer in front of the LM head
    body = torch.nn.ModuleDict({"norm": torch.nn.RMSNorm(H), "up": torch.nn.Linear(H, 4 * H, bias=False),
                                "down": torch.nn.Linear(4 * H, H, bias=False)}).to(device=device, dtype=dtype)
    head = torch.nn.Linear(H, V, bias=False).to(device=device, dtype=dtype)
    torch.nn.init.normal_(head.weight, std=H ** -0.5)
    params = list(body.parameters()) + list(head.parameters())
    kind = variant.split("-")[0]
    fn = _step_fn(kind, body, head, host_sync=False if variant == "fastrl-nosync" else None, masked=masked)
    if "compile" in variant:
        mode = "reduce-overhead" if variant.endswith("-ro") else None
        backend = {"backend": compile_backend} if compile_backend else {}
        fn = torch.compile(fn, fullgraph=(kind == "fastrl"), mode=mode, dynamic=False, **backend)
    inputs = _inputs(B, T, H, V, dtype, device, masked=masked)

    def clear():
        for p in params:
            p.grad = None

    def step(inputs=inputs):
        clear()
        loss, _ = fn(*inputs)
        loss.backward()  # (AOTAutograd's compiled backward for the compiled variants)
        with torch.no_grad():
            for p in (p for p in params if p.grad is not None):  # (--masked: the MLP is not in the step)
                p.sub_(1e-4 * p.grad)  # an SGD update in place: the compiled step sees the same parameters
        return float(loss.detach())

    # the first step compiles: reported apart (first_step_s)
    t = measure.time_steps(step, reps, max(1, warmup), device == "cuda", before=clear)
    # FLOPs per step: LM head 6NHV (forward GEMM, grad_h, grad_W) + body 2 * 3 * (2 * N * H * 4H) = 48NH^2
    flops = 6 * B * T * H * V + 48 * B * T * H * H
    flops = flops if masked is None else 6 * B * (T - round(masked * T)) * H * V  # --masked: the head's, live rows
    ms = measure.summarize(t["ms"])
    row = {"variant": variant, "shape": [B, T, H, V], "dtype": str(dtype).replace("torch.", ""), "total_ms": ms,
           "first_step_s": t["first_ms"] / 1e3, "loss_value": t["first_out"], "masked": masked,
           "tflops": flops / (ms["median"] * 1e-3) / 1e12, "extra_mb": t["extra_mb"] if device == "cuda" else None}
    if masked:  # each masked step beside an unmasked one, in this process: their ratio survives a shared machine's load
        plain = _inputs(B, T, H, V, dtype, device, masked=0.0)
        ratios = sorted(measure.time_steps(step, 1, 0, device == "cuda")["ms"][0]
                        / measure.time_steps(lambda: step(plain), 1, 1, device == "cuda")["ms"][0] for _ in range(reps))
        row.update(ratio=statistics.median(ratios), ratio_min=ratios[0], ratio_max=ratios[-1])
    return row


def run(device: str, variants, reps: int, warmup: int, shape=None, compile_backend: str | None = None,
        masked=None) -> list[dict]:
    """``compile_backend``: torch.compile's backend (default inductor; ``"aot_eager"`` traces without generating
    code: the plumbing only)."""
    shape = shape or SHAPES[device]
    rows = []
    for v in variants:
        torch._dynamo.reset()
        try:
            rows.append(_measure(v, shape, device, reps, warmup, compile_backend, masked))
        except Exception as e:  # report and go on: one variant failing must not hide the others
            rows.append({"variant": v, "error": f"{type(e).__name__}: {str(e)[:400]}"})
    return rows


def run_point(spec: dict) -> dict:
    """One variant in this fresh process (``bench.session_points.run_spec``, kind "compile"; ``"smoke"``: tiny shapes,
    traced by aot_eager without inductor's code generation, a minute on two cores: tests/test_compile.py compiles
    fastrl with inductor)."""
    device = spec["device"]
    dtype = torch.float32 if spec.get("smoke") else SHAPES[device][4]
    shape = (*spec["shape"], dtype) if spec.get("shape") else (2, 32, 32, 512, dtype) if spec.get("smoke") else None
    (row,) = run(device, [spec["variant"]], spec["reps"], spec["warmup"], shape,
                 compile_backend="aot_eager" if spec.get("smoke") else None, masked=spec.get("masked"))
    return {"status": "error", "reason": row["error"], **row} if "error" in row else {"status": "ok", **row}


def add_options(ap) -> None:
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    ap.add_argument("--variants", help=f"comma list of {', '.join(CUDA_VARIANTS)} (default: all for the device)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first, compilation included (default 2)")
    ap.add_argument("--shape", help="B,T,H,V (default: CPU 4,512,512,32768 float32; CUDA W1 8,2048,4096,151936 bf16)")
    ap.add_argument("--out", help="results folder (default: a new folder outside the repository)")
    ap.add_argument("--masked", type=float, help="the head and loss alone, the last F of every sequence padding; "
                    "each step then beside an unmasked one (their time ratio)")


def parse_args(args, device: str) -> tuple[list[str], list[int] | None]:
    """``--variants`` (each one this device runs) and ``--shape`` (B,T,H,V: four positive integers); a clear
    ``SystemExit`` otherwise, before any process starts (an unknown name used to run as the reference)."""
    variants = pick("--variants", args.variants, CUDA_VARIANTS if device == "cuda" else VARIANTS)
    if not args.shape:
        return variants, None
    parts = args.shape.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"--shape: expected B,T,H,V (four positive integers, e.g. 4,512,512,32768); got "
                         f"{args.shape!r}")
    return variants, [int(p) for p in parts]


def command(args, device: str, con=None) -> int:
    """Measure each variant in a fresh process (``bench.session_run.run_fresh``), print the table, write
    ``compile.json``."""
    from pathlib import Path

    from bench import report
    from bench.session_run import run_fresh

    variants, shape = parse_args(args, device)
    env = report.environment(device)
    specs = [{"kind": "compile", "variant": v, "device": device, "reps": args.reps, "warmup": args.warmup,
              "shape": shape, "masked": args.masked} for v in variants]
    rows = [res if res.get("status") == "ok" else {"variant": spec["variant"], "error": res.get("reason")}
            for spec, res in zip(specs, run_fresh(specs, device, 3600))]
    out = Path(args.out) if args.out else report.new_out_dir(env["device_slug"], "compile")
    eager = next((r["total_ms"]["median"] for r in rows if r.get("variant") == "fastrl-eager" and "total_ms" in r),
                 None)
    print(f"\ncompiled training step on {env['device']} | torch {env['torch']} | median of {args.reps} steps after "
          f"{args.warmup} untimed")
    print(f"{'variant':22s} {'ms':>10s} {'vs fastrl-eager':>16s} {'first step s':>13s} {'loss':>12s}")
    for r in rows:
        ms = r["total_ms"]["median"] if "total_ms" in r else None
        if "ratio" in r:
            print(f"{r['variant']}: masked / unmasked {r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})")
        print(f"{r['variant']:22s} {ms:10.1f} {f'{ms / eager:.2f}x' if eager else '-':>16s} {r['first_step_s']:13.1f} "
              f"{r['loss_value']:12.6f}" if ms else f"{r['variant']:22s} error: {r['error']}")
    # on a CPU, OMP_WAIT_POLICY=PASSIVE keeps inductor's OpenMP threads from spinning (docs/compile.md): recorded
    omp = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    report.write_json(out / "compile.json", {"command": "compile", "env": {**env, **omp}, "args": vars(args),
                                             "rows": rows, "doc": "bench/compiled_step.py"})
    print(f"wrote {out / 'compile.json'}")
    return 0 if all("total_ms" in r for r in rows) else 1
