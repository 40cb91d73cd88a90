"""``python -m bench keptset``: ``fused_logprobs`` and ``policy_loss`` forward + backward over kept sets
(``support=KeptSet`` with both plans of the engine, ``support=SamplerRule``) against the full vocabulary on the same
inputs, one point per fresh process (issues 26 and 34); what each row measures: docs/benchmarks.md,
"python -m bench keptset"."""

from __future__ import annotations

import statistics
import time

import torch

from bench import measure, report

KS = (20, 64, 512)
KINDS = ("zipf", "uniform")
V_FULL = 151936
CPU_SHAPES = [("C1-kept", 1024, 512, "float32")]
GPU_SHAPES = [("W1-kept", 16384, 4096, "bfloat16"), ("W2-kept", 16384, 896, "bfloat16")]
SMOKE_SHAPES = [("smoke-kept", 64, 32, "float32")]
KEPT_MODES = ("kept", "nosync")  # eager and without host reads; a point's "plan_kind": "union" forces union tiles
# mode -> the SamplerRule's other arguments (top_k is the point's K) and whether the point times replay_rule alone
RULE_MODES = {"rule": ({}, False), "replay": ({}, True), "rule-p": ({"top_p": 0.95}, False)}
KEPT_TARGET = 0.08  # issue 34: K=64, disjoint and Zipf sets, both plans, fwd + bwd time against the full path's
RULE_TARGET = 0.25  # issue 34: support=SamplerRule(top_k=64), fwd + bwd, at <= 1.1x the full path's memory
RAGGED_TARGET = 0.03  # issue 44: sampler-like ragged sets (make_sets "ragged", at most 128 ids), fwd + bwd


def make_sets(N: int, V: int, K: int, kind: str, device: torch.device, seed: int = 0, rows: int = 256):
    """(KeptSet, targets [N]): K distinct ids per token (``zipf`` or ``uniform``; ``ragged``: Zipf ids, sizes as a
    sampler keeps, issue 44: ~45% one id, median 2, mean ~8, p99 ~82, at most K), the target one of them; Gumbel
    top-K over blocks of ``rows`` tokens on the device (one multinomial call per token is slower than the point)."""
    import fastrl

    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    logp = torch.zeros(V, device=device)
    if kind != "uniform":
        logp = torch.arange(1, V + 1, device=device, dtype=torch.float32).log_().mul_(-1.1)
        logp = logp[torch.randperm(V, generator=g, device=device)]  # which ids are frequent
    ids = torch.empty(N, K, dtype=torch.int64, device=device)
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        u = torch.rand(r1 - r0, V, generator=g, device=device).clamp_(min=1e-20)
        ids[r0:r1] = (logp - u.log_().neg_().log_()).topk(K, dim=1).indices
    sizes = torch.full((N,), K, device=device)
    if kind == "ragged":  # lognormal sizes with the measured masks' mean, median and p99, then 45% set to 1
        sizes = (torch.randn(N, generator=g, device=device) * 1.19 + 1.91).exp_().ceil_().clamp_(2, K).long()
        sizes[torch.rand(N, generator=g, device=device) < 0.45] = 1
        ids[torch.arange(K, device=device) >= sizes[:, None]] = -1
    pick = (torch.rand(N, generator=g, device=device) * sizes).long()
    return fastrl.KeptSet.from_padded(ids, V), ids[torch.arange(N, device=device), pick]


def build(spec: dict) -> tuple:
    """(the point's step, what it records: the plan a kept-set row runs, its kept set) on random inputs."""
    dev, N, H, V = torch.device(spec["device"]), spec["N"], spec["H"], spec["V"]
    g = torch.Generator(device=dev).manual_seed(1)
    hidden = torch.randn(N, H, generator=g, device=dev).to(getattr(torch, spec["dtype"])).requires_grad_()
    weight = (torch.randn(V, H, generator=g, device=dev) * H ** -0.5).to(hidden.dtype).requires_grad_()
    ks, targets = make_sets(N, V, spec["K"], spec["sets"], dev)
    res = {}
    return _step(spec, hidden, weight, targets, ks, res), res, ks


def run_point(spec: dict) -> dict:
    """The point's step (``ms``: the median of ``ms_all``), its extra peak memory (``measure.time_steps``), the plan
    it ran and the union GEMMs' work against the full vocabulary's (docs/benchmarks.md)."""
    from fastrl.ops.kept import capacity, chunk_plan

    (step, res, ks), dev, N, V = build(spec), torch.device(spec["device"]), spec["N"], spec["V"]
    if dev.type == "cuda":
        res["device_name"] = torch.cuda.get_device_name(dev)
    elif spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    t = measure.time_steps(step, spec["reps"], spec["warmup"], dev.type == "cuda")
    times, res["peak_extra_mb"] = t["ms"], t["extra_mb"]
    plan = chunk_plan(ks, V, *capacity(dev))  # the host union plan's chunks (the engine's capacity rule)
    unions = [torch.unique(ks[c0:c1].ids).numel() for c0, c1 in plan]
    # union_work_vs_full: the union GEMMs' work against the full vocabulary's, per pass (sum(rows * |U|) / (N V))
    res.update(ms=statistics.median(times), ms_all=times, kept_mean=float(ks.sizes().float().mean()),
               union_work_vs_full=sum((c1 - c0) * u for (c0, c1), u in zip(plan, unions)) / (N * V),
               chunks=len(plan), union_mean=statistics.mean(unions))
    return res


def _step(spec: dict, hidden, weight, targets, ks, res: dict):
    """The measured step of the point's mode (docs/benchmarks.md); a kept-set row records in ``res`` the plan it runs
    and its logits per token."""
    import fastrl

    mode, backend, sync = spec["mode"], spec.get("backend"), False if spec["mode"] == "nosync" else None
    support = None if mode in ("full", "loss") else ks.with_overlap(True if spec.get("plan_kind") == "union" else None)
    if mode in RULE_MODES:
        kw, replay_only = RULE_MODES[mode]
        support = fastrl.SamplerRule(top_k=spec["K"], **kw)
        if replay_only:
            return lambda: fastrl.replay_rule(hidden.detach(), weight.detach(), targets, support, backend=backend)
    elif mode in KEPT_MODES:
        choice = support.describe_plan(host_sync=sync is None)
        res.update(plan=choice.kind, logits_per_token=choice.per_token(), plan_text=str(choice))
    if not mode.startswith("loss"):
        def logprob_step():
            logp, ent = fastrl.fused_logprobs(hidden, weight, targets, support=support, backend=backend,
                                              host_sync=sync)
            torch.autograd.grad(logp.sum() + 0.01 * ent.sum(), [hidden, weight])

        return logprob_step
    B = 4 if len(targets) % 4 == 0 else 1  # the policy loss over 4 sequences of N/4 tokens
    g = torch.Generator().manual_seed(2)
    h, t = hidden.view(B, -1, hidden.shape[-1]), targets.view(B, -1)
    mask, adv = torch.ones_like(t, dtype=torch.bool), torch.randn(B, generator=g).to(h.device)
    with torch.no_grad():
        old = fastrl.fused_logprobs(h, weight, t, support=support, with_entropy=False)[0]
    ref = old - 0.1 * torch.rand(t.shape, generator=g).to(h.device)
    config = fastrl.PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)

    def loss_step():
        loss, _ = fastrl.policy_loss(h, weight, t, adv, mask, config=config, old_logprobs=old, ref_logprobs=ref,
                                     support=support, backend=backend)
        torch.autograd.grad(loss, [hidden, weight])

    return loss_step


def points(device: str, smoke: bool, quick: bool) -> list[dict]:
    """Per shape: the full path, K in KS x both kinds of sets, the rule rows, both plans (eager and without host reads,
    the engine's choice and union tiles) on both kinds at K=64, and the policy loss without and with a support."""
    shapes = SMOKE_SHAPES if smoke else (GPU_SHAPES if device == "cuda" else CPU_SHAPES)
    k = 20 if smoke else 64
    plans = [("kept", {"plan_kind": "union"}), ("nosync", {}), ("nosync", {"plan_kind": "union"})]
    pts = [dict(mode="full", K=KS[0], sets="zipf")]
    pts += [dict(mode="kept", K=K, sets=s) for K in ((20,) if smoke else (KS[:2] if quick else KS)) for s in KINDS]
    pts += [dict(mode=m, K=k, sets="zipf") for m in RULE_MODES]
    pts += [dict(mode=m, K=k, sets=s, **kw) for s in KINDS for m, kw in plans]
    pts += [dict(mode=m, K=2 * k, sets="ragged") for m in KEPT_MODES]
    pts += [dict(mode="loss", K=k, sets="zipf")] + [dict(mode="loss-kept", K=k, sets=s) for s in KINDS]
    return [{"shape": name, "N": N, "H": H, "V": 512 if smoke else V_FULL, "dtype": dtype, "device": device, **p}
            for name, N, H, dtype in shapes for p in pts]


def session_points(smoke: bool) -> list[tuple[str, dict]]:
    """The session's keptset section, K=64: (provider, the point's mode, sets and plan); smoke: the first three."""
    out = [("full", dict(mode="full", sets="zipf"))] + [(f"kept-{s}", dict(mode="kept", sets=s)) for s in KINDS]
    if not smoke:
        out += [(f"rows-nosync-{s}", dict(mode="nosync", sets=s)) for s in KINDS]
        out += [(f"union-{s}", dict(mode="kept", sets=s, plan_kind="union")) for s in KINDS]
        out += [(f"{m}-ragged", dict(mode=m, sets="ragged", K=128)) for m in KEPT_MODES]
    return out


def _with_ratios(rows: list[dict]) -> None:
    """Each row's time and memory against its shape's full-vocabulary row (log-probs or loss) and, without host reads,
    its time against the eager row of the same plan kind."""
    def ms(r: dict):
        return r.get("ms")

    def full(r: dict) -> tuple:
        return r["shape"], r["mode"].startswith("loss")

    report.add_ratios(rows, "full", lambda r: r["mode"] in ("full", "loss"), key=full, ms=ms)
    report.add_ratios(rows, "host_plan", lambda r: r["mode"] == "kept", where=lambda r: r["mode"] == "nosync", ms=ms,
                      key=lambda r: (r["shape"], r["K"], r["sets"], r.get("plan_kind")))


def targets(rows: list[dict], con) -> dict:
    """Issue 34's targets at K=64: both plans (eager and without host reads) <= KEPT_TARGET x the full path's time;
    support=SamplerRule(top_k=64) <= RULE_TARGET x its time at <= 1.1x its memory; issue 44's ragged sets <=
    RAGGED_TARGET x its time (CPU targets, printed anywhere)."""
    checks = [(f"{r['shape']} ragged {r['provider']} ({r['plan']}) time vs full", r["time_vs_full"], RAGGED_TARGET)
              for r in rows if r["sets"] == "ragged" and "time_vs_full" in r]
    for r in (r for r in rows if r["K"] == 64 and "time_vs_full" in r):
        what = f"{r['shape']} K=64 {r['provider']}"
        if r["mode"] in KEPT_MODES:
            checks.append((f"{what} ({r['plan']}, {r['sets']} sets) time vs full", r["time_vs_full"], KEPT_TARGET))
        if r["mode"] == "rule":
            checks += [(f"{what} (top_k=64) time vs full", r["time_vs_full"], RULE_TARGET),
                       (f"{what} (top_k=64) extra memory vs full", r.get("mem_vs_full"), 1.1)]
    return report.judge(con, checks)


COLUMNS = (("shape", "left", report.cell("workload", "")), ("path", "left", report.cell("provider", "")),
           ("K", "right", lambda r: "-" if r["mode"] in ("full", "loss") else str(r["K"])),
           ("sets", "left", lambda r: r["sets"] if r["mode"] in KEPT_MODES + ("loss-kept",) else "-"),
           ("ms", "right", report.cell("ms", ".1f")), ("x full", "right", report.cell("time_vs_full", ".3f")),
           ("extra MB", "right", report.cell("peak_extra_mb", ".0f")),
           ("m/full", "right", report.cell("mem_vs_full", ".3f")),
           ("x eager", "right", report.cell("time_vs_host_plan", ".2f")), ("plan", "left", report.cell("plan", "")),
           ("logits/tok", "right", report.cell("logits_per_token", ".0f")))
LEGEND = ("fwd+bwd of fused_logprobs, loss sum(logp) + 0.01 sum(H) (loss rows: policy_loss); x full, m/full: time and "
          "extra memory against the full path; x eager: against the eager row of the same plan kind")


def cli(args, device: str, con) -> int:
    """``python -m bench keptset``: a line per point as it finishes, the summary, the targets; writes
    ``keptset.json``."""
    env, cuda = report.environment(device), device == "cuda"
    out = report.out_dir(args, env["device_slug"], args.command) / f"{report.prefix('keptset', args)}.json"
    reps = args.reps or (1 if args.smoke else (10 if cuda else 3))
    full_reps = reps if cuda else max(1, min(reps, 2))  # the full-vocabulary rows: fewer repetitions on a CPU
    warmup = args.warmup if args.warmup is not None else (0 if args.smoke else (2 if cuda else 1))
    t0 = time.perf_counter()
    pts = points(device, args.smoke, args.quick)
    specs = [{**p, "kind": "keptset", "reps": full_reps if p["mode"] in ("full", "loss") else reps, "warmup": warmup,
              "threads": args.threads, "backend": args.fastrl_backend} for p in pts]
    rows = [{"workload": p["shape"], "provider": p["mode"] + ("/union" if p.get("plan_kind") else ""), **p}
            for p in pts]
    report.run_points(specs, rows, device, args.timeout or 1200, con,
                      who=lambda r: f"{r['shape']:<11}{r['provider']:<13}{r['K']:>5} {r['sets']:<8}")
    _with_ratios(rows)
    con.print()
    report.print_table(con, rows, f"keptset on {env['device']} | torch {env['torch']} | ms: median of {reps} (full "
                       f"path: of {full_reps})", COLUMNS, LEGEND)
    targets(rows, con)
    report.save_results(con, out, "keptset", args, env, t0, {"rows": rows})
    return 1 if args.smoke and any(r.get("status") != "ok" for r in rows) else 0
