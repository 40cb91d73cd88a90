"""``python -m bench keptset``: the LM head over a kept set (``support=KeptSet``) against the full vocabulary.

Per point, in a fresh process: ``fastrl.fused_logprobs`` forward + backward (loss ``sum(logp) + 0.01 *
sum(entropy)``, C1's) with ``support=`` a KeptSet of K ids per token, and the same call without a support
(the full-vocabulary path A, 8NHV) on the same inputs; and, at K=64, ``support=SamplerRule(top_k=64)`` (the rule
replayed on the model's own logits: one more full forward pass, then the kept path). The kept-set engine's plans
(issue 34: ``KeptSet.describe_plan()``; each row records the plan it ran and the logits it computes per token) and the
loss (issue 26), at K=64:

* ``kept``: eager, the plan the engine chooses (the per-row plan on these sets: they share few ids); with
  ``plan_kind: union`` union tiles (``KeptSet.with_overlap(True)``: the host plan);
* ``nosync``: ``fused_logprobs(support=, host_sync=False)``, what ``torch.compile`` and CUDA graphs run (no host
  read): the per-row plan; with ``plan_kind: union`` the fixed union plan (provisioned from shapes);
* ``loss`` / ``loss-kept``: ``fastrl.policy_loss`` (dapo, beta 0.04 with k3, entropy 0.01; the sequences are
  4 x N/4 tokens) without a support (the one-pass vocabulary path, 6NHV) and with the KeptSet (the one-pass op on
  the kept-set engine: no longer the two-pass path).

Time and extra peak memory (CPU: peak RSS over the RSS after the inputs; CUDA: ``max_memory_allocated`` over what the
inputs hold), and the ratio against the matching full-vocabulary row (``full``, or ``loss`` for ``loss-kept``)
measured in the same run.

Kept sets (the ids, the sampled target among them):
* ``zipf``: K distinct ids per token drawn from a Zipf(1.1) law over the vocabulary (frequent tokens recur from
  position to position, as in real samples: neighbouring tokens' sets overlap);
* ``uniform``: K ids uniformly at random: disjoint sets, the worst case for the union GEMM (the per-row plan's
  common case).

Shapes: CPU N=1024, H=512, V=151936, float32 (C1-like; 85 s on a quiet 2-core machine with ``--threads 1`` before
the fixed-plan, loss and rule-replay rows, and 14 min once on a 2-core machine shared with other jobs; ``--quick``
with the fixed-plan and loss rows, before the replay rows, took 114 s on a nearly idle one); CUDA W1 (N=16384,
H=4096) and W2 (H=896), V=151936, bf16.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench import report
from bench.session_run import run_fresh

KS = (20, 64, 512)
KINDS = ("zipf", "uniform")
V_FULL = 151936
CPU_SHAPES = [("C1-kept", 1024, 512, "float32")]
GPU_SHAPES = [("W1-kept", 16384, 4096, "bfloat16"), ("W2-kept", 16384, 896, "bfloat16")]
SMOKE_SHAPES = [("smoke-kept", 64, 32, "float32")]


def make_sets(N: int, V: int, K: int, kind: str, device: torch.device, seed: int = 0, rows: int = 256):
    """(KeptSet, targets [N]): K distinct ids per token, the target one of them.

    Drawn on ``device`` in blocks of ``rows`` tokens with the Gumbel top-K trick (the K largest of ``log p + Gumbel
    noise`` are K draws without replacement from p): one pass over a [rows, V] block instead of one multinomial call
    per token, which at W1's 16384 tokens took longer on the host than the measurement itself.
    """
    import fastrl

    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "zipf":
        logp = torch.arange(1, V + 1, device=device, dtype=torch.float32).log_().mul_(-1.1)
        logp = logp[torch.randperm(V, generator=g, device=device)]  # which ids are frequent
    else:
        logp = torch.zeros(V, device=device)
    ids = torch.empty(N, K, dtype=torch.int64, device=device)
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        u = torch.rand(r1 - r0, V, generator=g, device=device).clamp_(min=1e-20)
        ids[r0:r1] = (logp - u.log_().neg_().log_()).topk(K, dim=1).indices
    pick = torch.randint(0, K, (N,), generator=g, device=device)
    targets = ids[torch.arange(N, device=device), pick]
    return fastrl.KeptSet.from_padded(ids, V), targets


# ---------------------------------------------------------------------------------------------------------------
# One point, in this (fresh) process
# ---------------------------------------------------------------------------------------------------------------

def run_point(spec: dict) -> dict:
    import fastrl
    from bench import measure

    dev = torch.device(spec["device"])
    N, H, V, K = spec["N"], spec["H"], spec["V"], spec["K"]
    dt = getattr(torch, spec["dtype"])
    g = torch.Generator(device=dev).manual_seed(1)
    hidden = torch.randn(N, H, generator=g, device=dev).to(dt).requires_grad_()
    weight = (torch.randn(V, H, generator=g, device=dev) * H ** -0.5).to(dt).requires_grad_()
    ks, targets = make_sets(N, V, K, spec["sets"], dev)
    mode = spec["mode"]
    backend = spec.get("backend")
    res = {}
    if mode in RULE_MODES:
        step = rule_step(spec, hidden, weight, targets)
    elif mode.startswith("loss"):
        step = _loss_step(spec, hidden, weight, targets, ks if mode == "loss-kept" else None)
    else:
        # plan_kind "union": union tiles (KeptSet.with_overlap(True)); else the engine's choice
        support = None if mode == "full" else ks.with_overlap(True if spec.get("plan_kind") == "union" else None)
        sync = False if mode == "nosync" else None

        def step():
            logp, ent = fastrl.fused_logprobs(hidden, weight, targets, support=support, backend=backend,
                                              host_sync=sync)
            torch.autograd.grad(logp.sum() + 0.01 * ent.sum(), [hidden, weight])

        if support is not None:  # the plan the engine runs, and the logits it computes per token
            choice = support.describe_plan(host_sync=sync is None)
            res.update(plan=choice.kind, logits_per_token=choice.per_token(), plan_text=str(choice))

    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for _ in range(spec["warmup"]):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = measure.event_times(step, spec["reps"])  # each after an L2 flush, as do_bench times
        res["peak_extra_mb"] = (torch.cuda.max_memory_allocated() - base) / measure.MB
        res["device_name"] = torch.cuda.get_device_name(dev)
    else:
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        for _ in range(spec["warmup"]):
            step()
        import gc

        gc.collect()
        rss0 = measure.rss_mb()
        measure.reset_peak()
        times = []
        for _ in range(spec["reps"]):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        res["peak_extra_mb"] = max(0.0, measure.peak_rss_mb() - rss0)
    res["ms"] = statistics.median(times)
    res["ms_all"] = times
    sizes = ks.sizes()
    res["kept_mean"] = float(sizes.float().mean())
    from fastrl.ops import kept as kept_mod
    from fastrl.ops.budget import tile_budget

    b = tile_budget("kept", dev)
    plan = kept_mod.chunk_plan(ks, V, b.elems, b.cap)
    unions = [torch.unique(ks[c0:c1].ids).numel() for c0, c1 in plan]
    # work of the union GEMMs against the full vocabulary's, per pass: sum(rows * |U|) / (N * V)
    res["union_work_vs_full"] = sum((c1 - c0) * u for (c0, c1), u in zip(plan, unions)) / (N * V)
    res["chunks"] = len(plan)
    res["union_mean"] = statistics.mean(unions)
    return res


def _loss_step(spec: dict, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, support):
    """One forward + backward of the policy loss over 4 sequences of N/4 tokens (with the support, if any)."""
    import fastrl

    N = hidden.shape[0]
    B = 4 if N % 4 == 0 else 1
    T = N // B
    g = torch.Generator().manual_seed(2)
    h, t = hidden.view(B, T, -1), targets.view(B, T)
    mask = torch.ones(B, T, dtype=torch.bool, device=h.device)
    adv = torch.randn(B, generator=g).to(h.device)
    with torch.no_grad():
        old, _ = fastrl.fused_logprobs(h, weight, t, support=support, with_entropy=False)
    ref = old - 0.1 * torch.rand(B, T, generator=g).to(h.device)
    config = fastrl.PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)

    def step():
        loss, _ = fastrl.policy_loss(h, weight, t, adv, mask, config=config, old_logprobs=old, ref_logprobs=ref,
                                     support=support, backend=spec.get("backend"))
        torch.autograd.grad(loss, [hidden, weight])
    return step


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------

def points(device: str, smoke: bool, quick: bool) -> list[dict]:
    shapes = SMOKE_SHAPES if smoke else (GPU_SHAPES if device == "cuda" else CPU_SHAPES)
    V = 512 if smoke else V_FULL
    out = []
    for name, N, H, dtype in shapes:
        base = dict(shape=name, N=N, H=H, V=V, dtype=dtype, device=device)
        out.append({**base, "mode": "full", "K": KS[0], "sets": "zipf"})
        for K in ((20,) if smoke else (KS[:2] if quick else KS)):
            for kind in KINDS:
                out.append({**base, "mode": "kept", "K": K, "sets": kind})
        out.extend(rule_points(base, smoke))
        k = 64 if not smoke else 20
        for kind in KINDS:  # the plans at K=64: union tiles in eager, and both plans without host reads
            out.append({**base, "mode": "kept", "K": k, "sets": kind, "plan_kind": "union"})
            out.append({**base, "mode": "nosync", "K": k, "sets": kind})
            out.append({**base, "mode": "nosync", "K": k, "sets": kind, "plan_kind": "union"})
        out.append({**base, "mode": "loss", "K": k, "sets": "zipf"})
        for kind in KINDS:
            out.append({**base, "mode": "loss-kept", "K": k, "sets": kind})
    return out


KEPT_MODES = ("kept", "nosync")  # eager and without host reads; a point's "plan_kind": "union" forces union tiles
KEPT_TARGET = 0.08  # issue 34: K=64, disjoint and Zipf sets, both plans, fwd + bwd time against the full path's
RULE_TARGET = 0.25  # issue 34: support=SamplerRule(top_k=64), fwd + bwd, at <= 1.1x the full path's memory
BASE_MODE = {"loss-kept": "loss", "loss": "loss"}  # each row's ratio is against the full-vocabulary row of its kind


def session_points(smoke: bool) -> list[tuple[str, dict]]:
    """The GPU session's keptset section (bench/session.py), K=64: (provider, the point's mode, sets and plan).
    ``kept`` is the engine's eager choice (the per-row plan on these sets: each row records the plan it ran); a full
    session adds the per-row plan without host reads (``nosync``, what CUDA graphs run) and the host union plan
    (issue 34). A smoke run checks the plumbing on the first three."""
    out = [("full", dict(mode="full", sets="zipf"))] + [(f"kept-{s}", dict(mode="kept", sets=s)) for s in KINDS]
    if not smoke:
        out += [(f"rows-nosync-{s}", dict(mode="nosync", sets=s)) for s in KINDS]
        out += [(f"union-{s}", dict(mode="kept", sets=s, plan_kind="union")) for s in KINDS]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Rule replay rows (issue 26 item 2)
# ---------------------------------------------------------------------------------------------------------------

# mode -> the rule (SamplerRule kwargs, top_k = the point's K) and whether the point is replay_rule alone
RULE_MODES = {
    "rule": ({}, False),  # support=SamplerRule(top_k=K): replay, then the kept path, forward + backward
    "replay": ({}, True),  # replay_rule alone (no gradient): the selection's own cost
    "rule-p": ({"top_p": 0.95}, False),  # top_k then top_p: top_p sorts the top-k survivors only
}


def rule_points(base: dict, smoke: bool) -> list[dict]:
    """The rule rows of one shape: top_k=64 (20 in a smoke run) as a support, replayed alone, and with top_p."""
    return [{**base, "mode": m, "K": 20 if smoke else 64, "sets": "zipf"} for m in RULE_MODES]


def rule_targets(rows: list[dict], con) -> None:
    """The rule-replay target (issue 34, was 0.3x in issue 26): support=SamplerRule(top_k=64) <= 0.25x the full
    path's time, <= 1.1x its memory (a CPU target; printed on any device)."""
    for r in rows:
        if r["mode"] == "rule" and r["K"] == 64 and "time_vs_full" in r and r.get("mem_vs_full") is not None:
            ok = r["time_vs_full"] <= RULE_TARGET and r["mem_vs_full"] <= 1.1
            con.print(f"target top_k=64 rule fwd+bwd <= {RULE_TARGET}x full time, <= 1.1x its memory ({r['shape']}): "
                      f"{r['time_vs_full']:.3f}x, {r['mem_vs_full']:.2f}x "
                      + ("[green]PASS[/green]" if ok else "[red]FAIL[/red]"))


def rule_step(spec: dict, hidden, weight, targets):
    """One measured step of a rule row: ``fused_logprobs(support=rule)`` forward + backward, or ``replay_rule``."""
    import fastrl

    kw, replay_only = RULE_MODES[spec["mode"]]
    rule = fastrl.SamplerRule(top_k=spec["K"], **kw)
    backend = spec.get("backend")

    def step():
        if replay_only:
            fastrl.replay_rule(hidden.detach(), weight.detach(), targets, rule, backend=backend)
            return
        logp, ent = fastrl.fused_logprobs(hidden, weight, targets, support=rule, backend=backend)
        torch.autograd.grad(logp.sum() + 0.01 * ent.sum(), [hidden, weight])

    return step


def _path(p: dict) -> str:
    """A row's label: its mode, ``/union`` where the point forces union tiles."""
    return p["mode"] + ("/union" if p.get("plan_kind") == "union" else "")


def cli(args, device: str, con) -> int:
    """``python -m bench keptset`` (also run at the end of ``python -m bench gpu``): its own points and files."""
    env = report.environment(device)
    out_dir, prefix = report.out_dir(args, env["device_slug"], args.command), report.prefix("keptset", args)
    cuda = device == "cuda"
    reps = args.reps or (1 if args.smoke else (10 if cuda else 3))
    warmup = args.warmup if args.warmup is not None else (0 if args.smoke else (2 if cuda else 1))
    t0 = time.perf_counter()
    pts = points(device, args.smoke, args.quick)
    # the full-vocabulary rows: fewer repetitions on a CPU
    specs = [{**p, "kind": "keptset", "device": device, "reps": reps if p["mode"] not in ("full", "loss") or cuda
              else max(1, min(reps, 2)), "warmup": warmup, "threads": args.threads, "backend": args.fastrl_backend}
             for p in pts]

    def echo(spec: dict, res: dict) -> None:
        what = f"{spec['shape']} {_path(spec):<12} K={spec['K']:<3} {spec['sets']:<7}"
        con.print(f"{what}: " + (f"{res['ms']:.1f} ms, +{res['peak_extra_mb']:.0f} MB" if "ms" in res
                                 else f"[red]{res.get('reason')}[/red]"))

    results = run_fresh(specs, device, args.timeout or 1200, on_result=echo)
    rows = [{**p, **res, "status": res.get("status", "ok")} for p, res in zip(pts, results)]
    for r in rows:  # ratios against the full-vocabulary path of the same shape and kind (log-probs, or the loss)
        base_mode = BASE_MODE.get(r["mode"], "full")
        full = next((x for x in rows if x["shape"] == r["shape"] and x["mode"] == base_mode and "ms" in x), None)
        if full and "ms" in r:
            r["time_vs_full"] = r["ms"] / full["ms"]
            r["mem_vs_full"] = r["peak_extra_mb"] / full["peak_extra_mb"] if full["peak_extra_mb"] > 0 else None
        host = next((x for x in rows if x["shape"] == r["shape"] and x["mode"] == "kept" and x["K"] == r["K"]
                     and x["sets"] == r["sets"] and x.get("plan_kind") == r.get("plan_kind") and "ms" in x), None)
        if r["mode"] == "nosync" and host and "ms" in r:  # without host reads, against eager (the same kind of plan)
            r["time_vs_host_plan"] = r["ms"] / host["ms"]
    elapsed = time.perf_counter() - t0
    con.print()
    con.print(f"keptset on {env['device']} | torch {env['torch']} | fwd+bwd of fused_logprobs, "
              f"loss sum(logp) + 0.01 sum(H) | ms: median of {reps} (full path: of {min(reps, 2) if not cuda else reps})")
    con.print(f"{'shape':<11}{'path':<13}{'K':>5} {'sets':<8}{'ms':>10}{'x full':>8}{'extra MB':>10}{'x full':>8}"
              f"{'plan':>12}{'logits/tok':>11}")
    for r in rows:
        if "ms" not in r:
            continue
        tv, mv = r.get("time_vs_full"), r.get("mem_vs_full")
        kept_rows = KEPT_MODES + ("loss-kept",)
        con.print(f"{r['shape']:<11}{_path(r):<13}{r['K'] if r['mode'] not in ('full', 'loss') else '-':>5} "
                  f"{r['sets'] if r['mode'] in kept_rows else '-':<8}{r['ms']:>10.1f}{tv:>8.3f}"
                  f"{r['peak_extra_mb']:>10.0f}"
                  f"{(mv if mv is not None else float('nan')):>8.3f}"
                  + (f"{r['plan']:>12}{r['logits_per_token']:>11.0f}" if "plan" in r else ""))
    target = [r for r in rows if r["mode"] in KEPT_MODES and r["K"] == 64 and "time_vs_full" in r]
    for r in target:
        verdict = "[green]PASS[/green]" if r["time_vs_full"] <= KEPT_TARGET else "[red]FAIL[/red]"
        con.print(f"target K=64 fwd+bwd <= {KEPT_TARGET}x full ({r['shape']}, {r['mode']}: {r['plan']}, {r['sets']} "
                  f"sets): {r['time_vs_full']:.3f}x {verdict}")
    rule_targets(rows, con)
    for r in rows:
        if r["mode"] == "nosync" and "time_vs_host_plan" in r:
            con.print(f"{r['plan']} (host_sync=False) K={r['K']}, {r['sets']} sets: {r['time_vs_host_plan']:.2f}x the "
                      f"eager choice's time, {r['time_vs_full']:.3f}x the full path's")
        if r["mode"] == "loss-kept" and "time_vs_full" in r:
            con.print(f"policy_loss over a K={r['K']} KeptSet ({r['sets']} sets): {r['time_vs_full']:.3f}x the full "
                      "vocabulary loss's time (one pass each)")
    report.save_results(con, out_dir / f"{prefix}.json", {"command": "keptset", "argv": getattr(args, "argv", []),
                                                          "env": env, "elapsed_s": elapsed, "rows": rows}, elapsed)
    return 1 if args.smoke and any(r["status"] != "ok" for r in rows) else 0
