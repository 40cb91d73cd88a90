"""``python -m bench divergence``: the divergence between a student's and a teacher's LM head (issue 21).

    python -m bench divergence             # CUDA: N=16384, student H=896 (Qwen2.5-0.5B), teacher H=1536 (1.5B),
                                           #       V=151936, bf16; CPU: N=1024, H=256, teacher 384, V=65536, float32
    python -m bench divergence --quick     # CPU: N=512 (the same widths and vocabulary)
    python -m bench divergence --beta 0.5 --providers fastrl,trl

Per beta in {0, 0.5, 1} (forward KL, TRL's generalized JSD, reverse KL), forward + backward of the mean per-token
divergence over N tokens (gradients to the student's hidden states and head; the teacher is frozen):

* ``fastrl``: ``fastrl.fused_divergence`` (its default backend on the device);
* ``trl``: TRL 1.16's ``ChunkedDivergenceFunction`` as its ``DistillationTrainer`` calls it
  (``_chunked_divergence_loss``: float32 tiles of 4096 x 32768 per model, a float32 [V, H] gradient buffer);
* ``liger``: Liger-Kernel's ``LigerFusedLinearJSD`` (Triton: CUDA only);
* ``torch``: materialised PyTorch at the input dtype (both models' [N, V] logits, log-softmax, the formula):
  ``fastrl.reference.divergence_reference``, what a plain trainer would write;
* ``fastrl-kept64``: ``fastrl.fused_divergence(support=)`` with a disjoint kept set of K=64 ids per token (the
  vocabulary split among the tokens: the worst case for the kept-set engine's union GEMMs), against ``fastrl``'s
  full divergence in the same run (issue 26's target: <= 0.15x its time on the CPU). FLOPs: ``2 |U| (H + H_t)``
  per token forward and ``4 |U| H`` backward, ``|U|`` the ids of the token's engine unit (2048 on a CPU here).

And the exact reference KL of the policy loss (workload ``KL-exact``: ``fastrl.policy_loss``, dapo, beta 0.04,
B x 256 tokens, the reference as wide as the policy, forward + backward): ``k3`` (the reference's log-probs given:
the one-pass loss, 6NHV) against ``exact`` (the reference's hidden states and head given: the KL computed in the
one-pass chunks, 6NHV + 2N H_ref V); issue 26's target: ``exact`` <= 1.5x ``k3``'s time on the CPU, judged on the
``exact`` row's ``interleaved`` ratio (k3 and exact steps alternately in one process, after its own measurement: the
median of the adjacent pairs' ratios; two processes run one after the other see different loads on a shared
machine).

Each measurement runs in a fresh process (``bench.session_run.run_fresh``, kind "divergence"); time is the median of the
repetitions (CPU: wall time; CUDA: ``do_bench``), memory the peak extra RSS (CPU) or peak allocated minus inputs
and outputs (CUDA), as for the other workloads (``bench/measure.py``). Error: against float64 on the first
tokens: the per-token divergence (where the provider returns it) and the gradient of the loss w.r.t. those
tokens' hidden states. FLOPs (written out): the KLs ``2N(H+H_t)V`` forward; the JSD twice that (a statistics pass
before the divergence pass); the backward ``2N(H+H_t)V`` (both heads recomputed) plus ``4NHV`` (the student's
two gradient GEMMs). Materialised torch skips the recomputation.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import asdict, dataclass, replace

import torch

__all__ = ["DivWorkload", "workloads", "kl_workloads", "PROVIDERS", "run_point", "run", "print_table", "CPU_TARGETS"]

BETAS = (0.0, 0.5, 1.0)
DIVERGENCE_PROVIDERS = ("fastrl", "fastrl-kept64", "trl", "liger", "torch")
KL_PROVIDERS = ("k3", "exact")  # the policy loss's KL term (workload KL-exact)
PROVIDERS = DIVERGENCE_PROVIDERS + KL_PROVIDERS
KEPT_K = 64
# issue 26's targets, as ratios in the same run: the divergence over a disjoint K=64 support against the full one,
# and the loss with the exact KL against the loss with k3
KEPT_TARGET = 0.15
EXACT_KL_TARGET = 1.5
# issue 21's targets, as ratios against TRL in the same run: device -> (max time ratio, max extra-memory ratio)
CPU_TARGETS = (0.7, 0.5)
GPU_TARGETS = (0.8, None)


@dataclass(frozen=True)
class DivWorkload:
    name: str
    N: int
    H: int  # student hidden width
    Ht: int  # teacher hidden width
    V: int
    beta: float
    dtype: str
    note: str = ""
    kind: str = "divergence"  # or "exact-kl": the policy loss with k3 vs the exact KL (beta is the loss's)

    def flops(self) -> dict[str, float]:
        """FLOPs fastrl's and TRL's chunked paths run (module docstring); for KL-exact, the exact provider's."""
        if self.kind == "exact-kl":  # one-pass loss 6NHV, the reference's tile 2N H_t V
            fwd = 2.0 * self.N * (self.H + self.Ht) * self.V
            return {"fwd": fwd, "bwd": 4.0 * self.N * self.H * self.V, "total": fwd + 4.0 * self.N * self.H * self.V}
        both = 2.0 * self.N * (self.H + self.Ht) * self.V
        fwd = both * (2 if 0.0 < self.beta < 1.0 else 1)
        bwd = both + 4.0 * self.N * self.H * self.V
        return {"fwd": fwd, "bwd": bwd, "total": fwd + bwd}


def workloads(device: str, quick: bool = False, smoke: bool = False, betas=BETAS) -> list[DivWorkload]:
    if smoke:
        base = DivWorkload("D-smoke", 64, 32, 48, 1000, 0.0, "float32", note="plumbing only")
    elif device == "cuda":
        base = DivWorkload("D", 16384, 896, 1536, 151936, 0.0, "bfloat16",
                           note="student Qwen2.5-0.5B head, teacher Qwen2.5-1.5B head")
    else:
        n = 512 if quick else 1024
        base = DivWorkload("D", n, 256, 384, 65536, 0.0, "float32",
                           note=f"CPU-scaled: issue 21's CPU shape (N=2048) at N={n}")
    return [replace(base, name=f"{base.name}-b{b:g}", beta=float(b)) for b in betas]


def kl_workloads(device: str, quick: bool = False, smoke: bool = False) -> list[DivWorkload]:
    """The exact-KL loss workload: examples/exact_kl_cost.py's shape on a CPU (B=8 x 256 tokens, H = H_ref = 512,
    V=32768; --quick B=4), W2's head on CUDA."""
    if smoke:
        return [DivWorkload("KL-exact-smoke", 64, 32, 32, 1000, 0.04, "float32", note="plumbing only",
                            kind="exact-kl")]
    if device == "cuda":
        return [DivWorkload("KL-exact", 16384, 896, 896, 151936, 0.04, "bfloat16", note="W2 head, 64 x 256 tokens",
                            kind="exact-kl")]
    n = 1024 if quick else 2048
    return [DivWorkload("KL-exact", n, 512, 512, 32768, 0.04, "float32", note=f"{n // 256} x 256 tokens",
                        kind="exact-kl")]


def providers_for(wl: DivWorkload, chosen: list[str]) -> list[str]:
    """The providers that apply to ``wl`` among ``chosen`` (KL-exact: k3 / exact; otherwise the divergences)."""
    return [p for p in chosen if (p in KL_PROVIDERS) == (wl.kind == "exact-kl")]


def provider_unavailable(name: str, device: str) -> str | None:
    need = {"trl": "trl", "liger": "liger_kernel"}.get(name)
    if need and importlib.util.find_spec(need) is None:
        return f"not available: `import {need}` fails (not installed)"
    if name == "liger" and device != "cuda":
        return "not available on cpu: a Triton kernel that needs CUDA"
    return None


# ---------------------------------------------------------------------------------------------------------------
# One measurement (in the worker process)
# ---------------------------------------------------------------------------------------------------------------


def _inputs(wl: DivWorkload, device: torch.device, seed: int) -> dict:
    """Random heads whose logits have unit scale, the teacher a little sharper than the student; a disjoint kept set
    of K ids per token (a random permutation of the vocabulary cut among the tokens; ids repeat only when N K > V).
    KL-exact: a [B, 256] batch for the policy loss, the reference a small perturbation of the policy."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, wl.dtype)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

    x = {
        "hidden": randn(wl.N, wl.H).requires_grad_(),
        "weight": randn(wl.V, wl.H, scale=wl.H**-0.5).requires_grad_(),
        "teacher_hidden": randn(wl.N, wl.Ht),
        "teacher_weight": randn(wl.V, wl.Ht, scale=1.5 * wl.Ht**-0.5),
        "mask": torch.ones(wl.N, dtype=torch.long, device=device),
    }
    if wl.kind == "exact-kl":
        import fastrl

        T = min(256, wl.N)
        B = wl.N // T
        x["hidden"] = x["hidden"].detach()[: B * T].view(B, T, wl.H).requires_grad_()
        x["teacher_hidden"] = x["teacher_hidden"][: B * T].view(B, T, wl.Ht)
        x["targets"] = torch.randint(0, wl.V, (B, T), generator=g, device=device)
        x["mask"] = torch.ones(B, T, dtype=torch.bool, device=device)
        x["advantages"] = randn(B)
        with torch.no_grad():
            x["old"], _ = fastrl.fused_logprobs(x["hidden"], x["weight"], x["targets"], with_entropy=False)
            x["ref"], _ = fastrl.fused_logprobs(x["teacher_hidden"], x["teacher_weight"], x["targets"],
                                                with_entropy=False)
        return x
    import fastrl

    # consecutive runs of one permutation (cyclic): K distinct ids per token, disjoint between tokens while N K <= V
    k = min(KEPT_K, wl.V)
    perm = torch.randperm(wl.V, generator=g, device=device)
    x["support"] = fastrl.KeptSet.from_padded(perm[torch.arange(wl.N * k, device=device) % wl.V].view(wl.N, k), wl.V)
    return x


def _op(wl: DivWorkload, provider: str, opts: dict):
    """(forward(state) -> {"loss", "div"}, notes): the timed forward of one provider."""
    from bench.providers import Op

    beta = wl.beta
    if provider in ("fastrl", "fastrl-kept64"):
        import fastrl

        backend = opts.get("fastrl_backend")
        kept = provider == "fastrl-kept64"

        def fwd(st):
            div = fastrl.fused_divergence(st["hidden"], st["weight"], st["teacher_hidden"], st["teacher_weight"],
                                          beta=beta, mask=st["mask"], backend=backend,
                                          support=st["support"] if kept else None)
            return {"loss": div.sum() / st["mask"].sum(), "div": div}
    elif provider in KL_PROVIDERS:
        import fastrl

        config = fastrl.PolicyLossConfig(loss_type="dapo", beta=wl.beta, kl_estimator=provider)

        def fwd(st):
            extra = (dict(ref_logprobs=st["ref"]) if provider == "k3" else
                     dict(ref_hidden=st["teacher_hidden"], ref_weight=st["teacher_weight"]))
            loss, metrics = fastrl.policy_loss(st["hidden"], st["weight"], st["targets"], st["advantages"],
                                               st["mask"], config=config, old_logprobs=st["old"],
                                               backend=opts.get("fastrl_backend"), **extra)
            return {"loss": loss, "div": None}
    elif provider == "trl":
        from trl.trainer.distillation_trainer import _chunked_divergence_loss

        def fwd(st):
            loss, _, _ = _chunked_divergence_loss(st["hidden"], st["teacher_hidden"], st["weight"],
                                                  st["teacher_weight"], st["mask"], beta)
            return {"loss": loss, "div": None}
    elif provider == "liger":
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=beta)

        def fwd(st):
            return {"loss": jsd(st["hidden"], st["weight"], st["teacher_hidden"], st["teacher_weight"], None),
                    "div": None}
    elif provider == "torch":
        from fastrl.reference import divergence_reference

        def fwd(st):
            div, _ = divergence_reference(st["hidden"], st["weight"], st["teacher_hidden"], st["teacher_weight"],
                                          beta=beta, mask=st["mask"])
            return {"loss": div.sum() / st["mask"].sum(), "div": div}
    else:
        raise ValueError(f"unknown divergence provider {provider!r}; one of {PROVIDERS}")

    def forward(st):
        out = fwd(st)
        # the measuring code keeps "logp" rows for the accuracy check: the per-token divergence plays that part
        return {"loss": out["loss"], "logp": out["div"], "entropy": None}

    def prepare(inp):
        return {**inp, "wrt": (inp["hidden"], inp["weight"])}

    return Op(forward, prepare, needs_grad=True, has_entropy=False, path="divergence", notes=[])


def _accuracy(wl: DivWorkload, provider: str, inp: dict, kept: dict, rows: int) -> dict:
    """Errors against float64 on the first ``rows`` tokens: per-token divergence and d(loss)/d(hidden) there (over
    the support for fastrl-kept64). KL-exact rows: none here (tests/test_exact_kl.py checks the loss against
    float64)."""
    from fastrl.reference import divergence_reference

    if wl.kind == "exact-kl":
        return {}
    support = inp["support"][:rows] if provider == "fastrl-kept64" else None
    h64 = inp["hidden"].detach()[:rows].double().requires_grad_()
    with torch.enable_grad():
        div, _ = divergence_reference(h64, inp["weight"].detach().double(), inp["teacher_hidden"][:rows].double(),
                                      inp["teacher_weight"].double(), beta=wl.beta, support=support)
        (gh,) = torch.autograd.grad(div.sum() / wl.N, h64)
    out = {"accuracy_rows": rows, "grad_h_max_abs_err": (kept["grad_h"].double() - gh).abs().max().item(),
           "grad_h_max_abs": gh.abs().max().item()}
    if "logp" in kept:
        out["div_max_abs_err"] = (kept["logp"].double() - div.detach()).abs().max().item()
    return out


def run_point(spec: dict) -> dict:
    """One (workload, provider) in this fresh process (``bench.session_points.run_spec``, kind "divergence")."""
    from bench import measure

    wl = DivWorkload(**spec["workload"])
    device = torch.device(spec["device"])
    if device.type == "cpu" and spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    why = provider_unavailable(spec["provider"], device.type)
    if why:
        return {"status": "skipped", "reason": why}
    op = _op(wl, spec["provider"], spec.get("options", {}))
    sets = [_inputs(wl, device, spec["seed"] + i) for i in range(spec["n_sets"])]
    states = [op.prepare(s) for s in sets]
    rows = min(spec.get("accuracy_rows", 64), wl.N)
    t0 = time.perf_counter()
    if device.type == "cuda":
        m, kept = measure.measure_cuda(op, states, spec["reps"], spec["warmup"], rows, rep_ms=spec.get("rep_ms", 2000),
                                       total_only=spec.get("total_only", False))
    else:
        m, kept = measure.measure_cpu(op, states, spec["reps"], spec["warmup"], rows)
    res = {"status": "ok", "reason": "", **m, "loss_value": kept.get("loss"), "measure_s": time.perf_counter() - t0}
    res.update(_accuracy(wl, spec["provider"], sets[0], kept, rows))
    if spec["provider"] == "exact":
        res["interleaved"] = _interleaved(wl, spec, sets[0], device)
    return res


def _interleaved(wl: DivWorkload, spec: dict, inp: dict, device: torch.device) -> dict:
    """k3 and exact steps alternately in this process, after the measurement (so its memory is not affected): on a
    shared machine the load moves between two processes run one after the other, and within one process a
    neighbour's job can slow a few steps, so the exact / k3 ratio is the median of the ratios of adjacent pairs."""
    import statistics

    ops = {p: _op(wl, p, spec.get("options", {})) for p in KL_PROVIDERS}
    states = {p: ops[p].prepare(inp) for p in KL_PROVIDERS}
    times: dict[str, list[float]] = {p: [] for p in KL_PROVIDERS}
    for _ in range(max(5, spec["reps"])):
        for p in KL_PROVIDERS:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = ops[p].forward(states[p])
            torch.autograd.grad(out["loss"], states[p]["wrt"])
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[p].append((time.perf_counter() - t0) * 1e3)
    med = {p: statistics.median(t) for p, t in times.items()}
    ratio = statistics.median(e / k for e, k in zip(times["exact"], times["k3"]))
    return {"k3_ms": med["k3"], "exact_ms": med["exact"], "ratio": ratio, "reps": len(times["k3"]),
            "k3_all_ms": times["k3"], "exact_all_ms": times["exact"]}


# ---------------------------------------------------------------------------------------------------------------
# The run (in the parent)
# ---------------------------------------------------------------------------------------------------------------


def run(wls: list[DivWorkload], providers: list[str], device: str, *, reps: int, warmup: int, n_sets: int,
        timeout_s: int, threads: int = 0, options: dict | None = None, rep_ms: int = 2000, console=None,
        rows_log: str | None = None) -> list[dict]:
    """Every (workload, provider), one fresh process each (``bench.session_run.run_fresh``); rows with time / memory
    ratios against TRL."""
    import json
    import os

    from bench.session_run import run_fresh

    rows = []
    for wl in wls:
        for p in providers_for(wl, providers):
            row = {"workload": wl.name, "provider": p, **asdict(wl), "flops": wl.flops()}
            why = provider_unavailable(p, device)
            if why:
                row.update(status="skipped", reason=why)
            else:
                load0 = os.getloadavg()[0]
                spec = {"kind": "divergence", "workload": asdict(wl), "provider": p, "device": device, "reps": reps,
                        "warmup": warmup, "n_sets": n_sets, "seed": 1234, "threads": threads,
                        "options": options or {}, "rep_ms": rep_ms, "accuracy_rows": 64 if device == "cpu" else 256}
                row.update(run_fresh([spec], device, timeout_s)[0])
                row["loadavg"] = [load0, os.getloadavg()[0]]
            rows.append(row)
            if rows_log:
                with open(rows_log, "a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
            if console is not None:
                console.print(_one_line(row))
    _ratios(rows)
    return rows


def _ratios(rows: list[dict]) -> None:
    from bench.lmhead import add_ratios

    add_ratios(rows, ("trl", "torch", "fastrl", "k3"))


def _one_line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"[dim]{r['workload']:>10} {r['provider']:<13} {r.get('status')}: {r.get('reason', '')}[/dim]"
    t = r["total_ms"]
    err = f"  |d div| {r['div_max_abs_err']:.1e}" if "div_max_abs_err" in r else ""
    gerr = f"  |d grad_h| {r['grad_h_max_abs_err']:.1e}" if "grad_h_max_abs_err" in r else ""
    return (f"{r['workload']:>10} {r['provider']:<13} {t['median']:10.1f} ms [{t['min']:.1f}-{t['max']:.1f}]  "
            f"{r['peak_extra_mb']:9.1f} MB{gerr}{err}")


def targets(rows: list[dict], device: str, console=None) -> dict:
    """Issue 21's targets for fastrl, per workload: time (and on CPU extra memory) as ratios of TRL's; issue 26's
    (CPU): the divergence over a disjoint K=64 support <= 0.15x the full one, the exact-KL loss <= 1.5x k3's."""
    t_max, m_max = CPU_TARGETS if device == "cpu" else GPU_TARGETS
    out = {}
    for r in rows:
        for prov, ref, bound in (("fastrl-kept64", "fastrl", KEPT_TARGET), ("exact", "k3", EXACT_KL_TARGET)):
            if r["provider"] != prov:
                continue
            # the exact KL: the ratio of the interleaved steps in one process (robust to a shared machine's load)
            ratio = r["interleaved"]["ratio"] if "interleaved" in r else r.get(f"time_vs_{ref}")
            out[f"{r['workload']}/{prov}"] = {f"time_vs_{ref}": ratio, "time_target": bound,
                                              "time_pass": ratio is not None and ratio <= bound}
            if console is not None and ratio is not None:
                verdict = "[green]PASS[/green]" if ratio <= bound else "[red]FAIL[/red]"
                console.print(f"{r['workload']}: {prov} time {ratio:.3f}x {ref}'s (target <= {bound}x): {verdict}")
        if r["provider"] != "fastrl":
            continue
        t, m = r.get("time_vs_trl"), r.get("mem_vs_trl")
        res = {"time_vs_trl": t, "time_target": t_max, "time_pass": t is not None and t <= t_max}
        if m_max is not None:
            res.update(mem_vs_trl=m, mem_target=m_max, mem_pass=m is not None and m <= m_max)
        out[r["workload"]] = res
        if console is not None:
            if t is None:
                console.print(f"[yellow]{r['workload']}: fastrl vs trl not evaluated (a row did not run)[/yellow]")
                continue
            ok = res["time_pass"] and res.get("mem_pass", True)
            mem = f", extra memory {m:.3f}x (target <= {m_max}x)" if m_max is not None and m is not None else ""
            console.print(f"{r['workload']}: fastrl time {t:.2f}x TRL's (target <= {t_max}x){mem}: "
                          + ("[green]PASS[/green]" if ok else "[red]FAIL[/red]"))
    return out


def print_table(con, rows: list[dict], title: str) -> None:
    from rich.table import Table

    tab = Table(title=title, title_justify="left")
    for c in ("workload", "beta", "provider", "fwd ms", "bwd ms", "total ms", "extra MB", "vs TRL time", "vs TRL mem",
              "vs fastrl / k3 time", "|d div| f64", "|d grad_h| f64 (rel)", "note"):
        tab.add_column(c, justify="left" if c in ("workload", "provider", "note") else "right")
    for r in rows:
        if r.get("status") != "ok":
            tab.add_row(r["workload"], f"{r['beta']:g}", r["provider"], *[""] * 9, f"{r.get('status')}: "
                        f"{r.get('reason', '')}"[:80])
            continue

        def ms(k):
            return f"{r[k]['median']:.0f}" if r.get(k) else ""

        rel = r["grad_h_max_abs_err"] / max(r["grad_h_max_abs"], 1e-30) if "grad_h_max_abs_err" in r else None
        own = r.get("time_vs_fastrl") if r["provider"] == "fastrl-kept64" else (
            r["interleaved"]["ratio"] if "interleaved" in r else r.get("time_vs_k3"))
        tab.add_row(r["workload"], f"{r['beta']:g}", r["provider"], ms("fwd_ms"), ms("bwd_ms"), ms("total_ms"),
                    f"{r['peak_extra_mb']:.0f}", f"{r['time_vs_trl']:.2f}x" if "time_vs_trl" in r else "",
                    f"{r['mem_vs_trl']:.3f}x" if "mem_vs_trl" in r else "",
                    f"{own:.3f}x" if own is not None and r["provider"] in ("fastrl-kept64", "exact") else "",
                    f"{r['div_max_abs_err']:.1e}" if "div_max_abs_err" in r else "",
                    f"{rel:.1e}" if rel is not None else "", r.get("note", "")[:40] if r.get("kind") == "exact-kl"
                    else "")
    con.print(tab)


def cli(args, device: str, con) -> int:
    """The `divergence` command (bench/__main__.py)."""
    from bench import report

    betas = BETAS if not getattr(args, "beta", None) else tuple(float(b) for b in args.beta.split(","))
    wls = workloads(device, quick=args.quick, smoke=args.smoke, betas=betas)
    tokens = getattr(args, "tokens", None)
    if tokens:
        wls = [replace(w, N=tokens, note=f"{w.note}; N set by --tokens") for w in wls]
    provs = [p.strip() for p in (args.providers or ",".join(PROVIDERS)).split(",") if p.strip()]
    bad = [p for p in provs if p not in PROVIDERS]
    if bad:
        con.print(f"[red]unknown divergence provider(s) {bad}; choose from {', '.join(PROVIDERS)}[/red]")
        return 2
    if any(p in KL_PROVIDERS for p in provs):
        wls = wls + kl_workloads(device, quick=args.quick, smoke=args.smoke)
    cuda = device == "cuda"
    reps = args.reps or (1 if args.smoke else 3 if cuda else 2)
    warmup = args.warmup if args.warmup is not None else (0 if args.smoke else 1)
    env = report.environment(device)
    out_dir = report.out_dir(args, env["device_slug"], "divergence")
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = report.prefix("divergence", args) + (f"-n{tokens}" if tokens else "")
    log = out_dir / f"{prefix}.rows.jsonl"
    log.unlink(missing_ok=True)
    con.print(f"[bold]fastrl bench divergence[/bold] on {env['device']}: torch {env['torch']}, trl {env['trl']}, "
              f"liger {env['liger_kernel']}; {len(wls)} workloads x {len(provs)} providers, each in a fresh process")
    t0 = time.perf_counter()
    options = {"fastrl_backend": args.fastrl_backend} if args.fastrl_backend else {}
    rows = run(wls, provs, device, reps=reps, warmup=warmup, n_sets=1 if args.smoke else 2,
               timeout_s=args.timeout or (1200 if cuda else 900), threads=args.threads, options=options,
               rep_ms=50 if args.smoke else 2000, console=con, rows_log=str(log))
    con.print()
    print_table(con, rows, f"divergence ({report.mode(args)}) on "
                           f"{env['device']} | torch {env['torch']} | ms: median of {reps} runs")
    tg = targets(rows, device, con) if not args.smoke else {}
    payload = {"command": "divergence", "argv": getattr(args, "argv", []), "env": env, "elapsed_s":
               time.perf_counter() - t0, "reps": reps, "warmup": warmup, "targets": tg, "rows": rows}
    report.save_results(con, out_dir / f"{prefix}.json", payload, payload["elapsed_s"])
    log.unlink(missing_ok=True)
    return 1 if args.smoke and any(r.get("status") == "error" for r in rows) else 0
