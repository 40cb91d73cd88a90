"""``python -m bench divergence``: a student's LM head against a teacher's, forward + backward, beta 0 / 0.5 / 1
(issue 21), and the policy loss's exact reference KL against k3 (issue 26); what each row measures:
docs/benchmarks.md, "python -m bench divergence" (options: --help)."""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from dataclasses import asdict, fields, replace

import torch

from bench import measure, report
from bench.lmhead import add_ratios
from bench.providers import Op
from bench.workloads import Workload, flops

BETAS = (0.0, 0.5, 1.0)
KL_PROVIDERS = ("k3", "exact")  # the policy loss's KL term (workload KL-exact)
PROVIDERS = ("fastrl", "fastrl-kept64", "trl", "liger", "torch") + KL_PROVIDERS
KEPT_K = 64
KEPT_TARGET = 0.15  # issue 26 (CPU): the divergence over a disjoint K=64 support, against the full one's time
EXACT_KL_TARGET = 1.5  # issue 26 (CPU): the loss with the exact KL, against the loss with k3 (interleaved steps)
CPU_TARGETS = (0.7, 0.5)  # issue 21: fastrl against TRL, (max time ratio, max extra-memory ratio) by device
GPU_TARGETS = (0.8, None)
REFERENCES = ("trl", "torch", "fastrl", "k3")  # every row's ratios against these rows of its workload


def workloads(device: str, quick: bool = False, smoke: bool = False, betas=BETAS) -> list[Workload]:
    n = 512 if quick else 1024
    base = (Workload("D-smoke", "divergence", 64, 32, 1000, "float32", note="plumbing only", Ht=48) if smoke else
            Workload("D", "divergence", 16384, 896, 151936, "bfloat16", Ht=1536,
                     note="student Qwen2.5-0.5B head, teacher Qwen2.5-1.5B head") if device == "cuda" else
            Workload("D", "divergence", n, 256, 65536, "float32", Ht=384,
                     note=f"CPU-scaled: issue 21's CPU shape (N=2048) at N={n}"))
    return [replace(base, name=f"{base.name}-b{b:g}", beta=float(b)) for b in betas]


def kl_workloads(device: str, quick: bool = False, smoke: bool = False) -> list[Workload]:
    """KL-exact: examples/exact_kl_cost.py's shape on a CPU, W2's head on CUDA."""
    n, h, v, dtype, note = ((64, 32, 1000, "float32", "plumbing only") if smoke else
                            (16384, 896, 151936, "bfloat16", "W2 head, 64 x 256 tokens") if device == "cuda" else
                            (1024 if quick else 2048, 512, 32768, "float32", f"{4 if quick else 8} x 256 tokens"))
    return [Workload("KL-exact-smoke" if smoke else "KL-exact", "exact-kl", n, h, v, dtype, note=note, Ht=h,
                     beta=0.04)]


def providers_for(wl: Workload, chosen: list[str]) -> list[str]:
    """Those of ``chosen`` that apply to ``wl`` (KL-exact: k3 / exact; otherwise the divergences)."""
    return [p for p in chosen if (p in KL_PROVIDERS) == (wl.kind == "exact-kl")]


def provider_unavailable(name: str, device: str) -> str | None:
    need = {"trl": "trl", "liger": "liger_kernel"}.get(name)
    if need and importlib.util.find_spec(need) is None:
        return f"not available: `import {need}` fails (not installed)"
    if name == "liger" and device != "cuda":
        return "not available on cpu: a Triton kernel that needs CUDA"
    return None


def make_inputs(wl: Workload, device: torch.device, seed: int) -> dict:
    """Random heads whose logits have unit scale, the teacher's a little sharper; a disjoint kept set of K ids per
    token (runs of one permutation of the vocabulary). KL-exact: B x 256 tokens, old and reference log-probs the
    policy's and the reference head's own."""
    import fastrl

    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(getattr(torch, wl.dtype))

    x = {"hidden": randn(wl.N, wl.H).requires_grad_(), "weight": randn(wl.V, wl.H, scale=wl.H**-0.5).requires_grad_(),
         "teacher_hidden": randn(wl.N, wl.Ht), "teacher_weight": randn(wl.V, wl.Ht, scale=1.5 * wl.Ht**-0.5),
         "mask": torch.ones(wl.N, dtype=torch.long, device=device)}
    if wl.kind == "divergence":
        perm = torch.randperm(wl.V, generator=g, device=device)
        k = min(KEPT_K, wl.V)
        ids = perm[torch.arange(wl.N * k, device=device) % wl.V].view(wl.N, k)
        return {**x, "support": fastrl.KeptSet.from_padded(ids, wl.V)}
    B, T = wl.N // min(256, wl.N), min(256, wl.N)
    x["hidden"] = x["hidden"].detach()[: B * T].view(B, T, wl.H).requires_grad_()
    x["teacher_hidden"] = x["teacher_hidden"][: B * T].view(B, T, wl.Ht)
    x["targets"] = torch.randint(0, wl.V, (B, T), generator=g, device=device)
    x["mask"] = torch.ones(B, T, dtype=torch.bool, device=device)
    x["advantages"] = randn(B)
    with torch.no_grad():
        for key, h, w in (("old", "hidden", "weight"), ("ref", "teacher_hidden", "teacher_weight")):
            x[key] = fastrl.fused_logprobs(x[h], x[w], x["targets"], with_entropy=False)[0]
    return x


def build_op(wl: Workload, provider: str, opts: dict) -> Op:
    """One provider's timed forward: the loss, and the per-token divergence where it returns one (as ``logp``, so the
    measuring code keeps it for its error); gradients to the student's hidden states and head."""
    import fastrl
    from fastrl.reference import divergence_reference

    beta, backend = wl.beta, opts.get("fastrl_backend")
    if provider == "trl":
        from trl.trainer.distillation_trainer import _chunked_divergence_loss
    elif provider == "liger":
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=beta)
    elif provider in KL_PROVIDERS:
        config = fastrl.PolicyLossConfig(loss_type="dapo", beta=beta, kl_estimator=provider)
    elif provider not in ("fastrl", "fastrl-kept64", "torch"):
        raise ValueError(f"unknown divergence provider {provider!r}; one of {PROVIDERS}")

    def forward(st):
        h, w, th, tw, div = st["hidden"], st["weight"], st["teacher_hidden"], st["teacher_weight"], None
        if provider == "trl":
            loss = _chunked_divergence_loss(h, th, w, tw, st["mask"], beta)[0]
        elif provider == "liger":
            loss = jsd(h, w, th, tw, None)
        elif provider in KL_PROVIDERS:
            ref = dict(ref_logprobs=st["ref"]) if provider == "k3" else dict(ref_hidden=th, ref_weight=tw)
            loss = fastrl.policy_loss(h, w, st["targets"], st["advantages"], st["mask"], config=config,
                                      old_logprobs=st["old"], backend=backend, **ref)[0]
        else:
            div = (divergence_reference(h, w, th, tw, beta=beta, mask=st["mask"])[0] if provider == "torch" else
                   fastrl.fused_divergence(h, w, th, tw, beta=beta, mask=st["mask"], backend=backend,
                                           support=st["support"] if provider == "fastrl-kept64" else None))
            loss = div.sum() / st["mask"].sum()
        return {"loss": loss, "logp": div, "entropy": None}

    return Op(forward, lambda inp: {**inp, "wrt": (inp["hidden"], inp["weight"])}, needs_grad=True,
              has_entropy=False, path="divergence")


def _accuracy(wl: Workload, provider: str, inp: dict, kept: dict, rows: int) -> dict:
    """Errors against float64 on the first ``rows`` tokens: the per-token divergence and d(loss)/d(hidden), over the
    support for fastrl-kept64 (KL-exact: none here; tests/test_exact_kl.py checks the loss)."""
    from fastrl.reference import divergence_reference

    if wl.kind == "exact-kl":
        return {}
    h64 = inp["hidden"].detach()[:rows].double().requires_grad_()
    with torch.enable_grad():
        div, _ = divergence_reference(h64, inp["weight"].detach().double(), inp["teacher_hidden"][:rows].double(),
                                      inp["teacher_weight"].double(), beta=wl.beta,
                                      support=inp["support"][:rows] if provider == "fastrl-kept64" else None)
        (gh,) = torch.autograd.grad(div.sum() / wl.N, h64)
    out = {"accuracy_rows": rows, "grad_h_max_abs_err": (kept["grad_h"].double() - gh).abs().max().item(),
           "grad_h_max_abs": gh.abs().max().item()}
    if "logp" in kept:
        out["div_max_abs_err"] = (kept["logp"].double() - div.detach()).abs().max().item()
    return out


def run_point(spec: dict) -> dict:
    """One (workload, provider) in this process: time and memory as ``bench.measure`` measures every op, errors
    against float64, and for ``exact`` the interleaved steps."""
    load0 = os.getloadavg()[0]
    wl, device = Workload.from_dict(spec["workload"]), torch.device(spec["device"])
    if device.type == "cpu" and spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    why = provider_unavailable(spec["provider"], device.type)
    if why:
        return {"status": "skipped", "reason": why}
    op = build_op(wl, spec["provider"], spec.get("options", {}))
    sets = [make_inputs(wl, device, spec["seed"] + i) for i in range(spec["n_sets"])]
    states = [op.prepare(s) for s in sets]
    rows = min(spec.get("accuracy_rows", 64), wl.N)
    t0 = time.perf_counter()
    m, kept = measure.measure_op(op, states, device, spec["reps"], spec["warmup"], rows, spec.get("total_only", False))
    res = {"status": "ok", "reason": "", **m, "loss_value": kept.get("loss"), "measure_s": time.perf_counter() - t0}
    res.update(_accuracy(wl, spec["provider"], sets[0], kept, rows))
    if spec["provider"] == "exact":
        res["interleaved"] = _interleaved(wl, spec, sets[0], device)
    return {**res, "loadavg": [load0, os.getloadavg()[0]]}


def _interleaved(wl: Workload, spec: dict, inp: dict, device: torch.device) -> dict:
    """k3 and exact steps alternately: the ratio judged is the median of the adjacent pairs' (a shared machine's load
    moves from process to process and from step to step)."""
    ops = {p: build_op(wl, p, spec.get("options", {})) for p in KL_PROVIDERS}
    states = {p: ops[p].prepare(inp) for p in KL_PROVIDERS}
    times: dict[str, list[float]] = {p: [] for p in KL_PROVIDERS}

    def step(p: str) -> None:
        torch.autograd.grad(ops[p].forward(states[p])["loss"], states[p]["wrt"])

    for _ in range(max(5, spec["reps"])):
        for p in KL_PROVIDERS:
            times[p].append(measure.wall_ms(lambda: step(p), device.type == "cuda")[0])
    return {"k3_ms": statistics.median(times["k3"]), "exact_ms": statistics.median(times["exact"]),
            "ratio": statistics.median(e / k for e, k in zip(times["exact"], times["k3"])), "reps": len(times["k3"]),
            "k3_all_ms": times["k3"], "exact_all_ms": times["exact"]}


def targets(rows: list[dict], device: str, console=None) -> dict:
    """Issue 21's targets (fastrl against TRL), issue 26's (fastrl-kept64 against fastrl, exact against k3 on the
    interleaved steps), by ``report.judge``; printed when ``console`` is given."""
    t_trl, m_trl = CPU_TARGETS if device == "cpu" else GPU_TARGETS
    bounds = {"fastrl": ("trl", t_trl, m_trl), "fastrl-kept64": ("fastrl", KEPT_TARGET, None),
              "exact": ("k3", EXACT_KL_TARGET, None)}
    checks = []
    for r in (r for r in rows if r["provider"] in bounds):
        ref, t_max, m_max = bounds[r["provider"]]
        what = f"{r['workload']}: {r['provider']}"
        checks.append((f"{what} time vs {ref}'s", r["interleaved"]["ratio"] if "interleaved" in r
                       else r.get(f"time_vs_{ref}"), t_max))
        checks += [(f"{what} extra memory vs {ref}'s", r.get(f"mem_vs_{ref}"), m_max)] if m_max is not None else []
    return report.judge(console, checks)


def cli(args, device: str, con) -> int:
    """``python -m bench divergence``: every (workload, provider) in a fresh process, a line each as it finishes;
    the summary with ratios against ``REFERENCES``, the targets; writes ``divergence.json``."""
    betas = BETAS if not getattr(args, "beta", None) else tuple(float(b) for b in args.beta.split(","))
    wls = workloads(device, quick=args.quick, smoke=args.smoke, betas=betas)
    if args.tokens:
        wls = [replace(w, N=args.tokens, note=f"{w.note}; N set by --tokens") for w in wls]
    provs = report.pick("--providers", args.providers, PROVIDERS)
    wls += kl_workloads(device, quick=args.quick, smoke=args.smoke) if set(provs) & set(KL_PROVIDERS) else []
    cuda, env = device == "cuda", report.environment(device)
    reps = args.reps or (1 if args.smoke else 20 if cuda else 2)
    warmup = args.warmup if args.warmup is not None else (0 if args.smoke else 1)
    con.print(f"[bold]fastrl bench divergence[/bold] on {env['device']}: torch {env['torch']}, trl {env['trl']}, "
              f"liger {env['liger_kernel']}; {len(wls)} workloads x {len(provs)} providers, each in a fresh process")
    t0 = time.perf_counter()
    phases = ("fwd", "bwd", "total")
    rows = [{"workload": wl.name, "provider": p, **asdict(wl), "flops": {k: flops(wl, k) for k in phases}}
            for wl in wls for p in providers_for(wl, provs)]
    for r in rows:  # a provider that cannot run here needs no process to say so
        why = provider_unavailable(r["provider"], device)
        r.update({"status": "skipped", "reason": why} if why else {})
    todo = [r for r in rows if "status" not in r]
    specs = [{"kind": "divergence", "workload": {f.name: r[f.name] for f in fields(Workload)}, "device": device,
              "provider": r["provider"], "reps": reps, "warmup": warmup, "n_sets": 1 if args.smoke else 2,
              "seed": 1234, "threads": args.threads,
              "options": {"fastrl_backend": args.fastrl_backend} if args.fastrl_backend else {},
              "accuracy_rows": 64 if device == "cpu" else 256} for r in todo]
    report.run_points(specs, todo, device, args.timeout or (1200 if cuda else 900), con)
    add_ratios(rows, REFERENCES)
    con.print()
    report.print_table(con, rows, f"divergence ({report.mode(args)}) on {env['device']} | torch {env['torch']} | ms: "
                       f"median of {reps} runs")
    tg = targets(rows, device, con) if not args.smoke else {}
    name = report.prefix("divergence", args) + (f"-n{args.tokens}.json" if args.tokens else ".json")
    report.save_results(con, report.out_dir(args, env["device_slug"], "divergence") / name, "divergence", args, env,
                        t0, {"reps": reps, "warmup": warmup, "targets": tg, "rows": rows})
    return 1 if args.smoke and any(r.get("status") == "error" for r in rows) else 0
