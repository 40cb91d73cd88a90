"""The float64 checks of ``python -m bench session``: each Triton implementation, compiled, against ground truth, by
the test-suite's rule (``check_against_float64``; bench/README.md says what it is); large cases check their first and
last 128 rows only (no [N, V] float64 tensor). An implementation that fails cannot become a default
(``bench/defaults.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["CASES", "SMOKE_CASES", "TOLERANCES", "DIV_TOLERANCES", "LOGP_CAP", "LOSS_TOLERANCE", "run_check",
           "served_configs"]

# tests/test_logprobs.py's table (tests/test_bench_session.py checks that the two agree)
TOLERANCES = {
    torch.float32: dict(out=1e-6, grad=1e-6),
    torch.bfloat16: dict(out=1e-5, grad=2**-8),
    torch.float16: dict(out=1e-5, grad=2**-10),
}
# tests/test_divergence.py's (checked likewise): float32's doubled; 2-byte inputs get twice the gradient tolerance in
# _check_divergence
DIV_TOLERANCES = {**TOLERANCES, torch.float32: dict(out=2e-6, grad=2e-6)}
LOGP_CAP = 1e-3  # nats, 2-byte inputs (tests/test_logprobs.py)
LOSS_TOLERANCE = (1e-4, 2**-7)  # loss relative to 1 + |loss|, gradients relative (tests/test_cuda_kernels.py)


@dataclass(frozen=True)
class Case:
    name: str
    N: int  # tokens (loss: B * T)
    H: int
    V: int
    dtype: str
    bias: bool = False
    tf: dict = field(default_factory=dict)  # temperature / softcap / logit_scale
    rows: int = 0  # 0: every row and every gradient in float64; else the first and last `rows` rows, grad_h only
    loss: bool = False  # the one-pass policy loss (B = 4) with padding instead of log-probs
    divergence: int = 0  # the teacher's hidden width: fused_divergence (JSD, beta 0.5) instead of log-probs


CASES = (
    Case("awkward-bias", 47, 31, 123, "bfloat16", bias=True),
    Case("qwen0.5b-fp16", 300, 896, 32000, "float16"),
    Case("temperature", 300, 896, 32000, "bfloat16", tf={"temperature": 0.7}),
    Case("softcap-scale", 300, 256, 5000, "bfloat16", tf={"softcap": 30.0, "logit_scale": 0.5}),
    Case("W1-rows", 1030, 4096, 151936, "bfloat16"),
    Case("V262144", 1030, 4096, 262144, "bfloat16", rows=128),
    Case("int64-offsets", 14200, 256, 151936, "bfloat16", rows=128),  # 14200 * 151936 > 2^31
    Case("loss-dapo-padding", 2048, 896, 151936, "bfloat16", loss=True),
    Case("bias-896", 300, 896, 32000, "bfloat16", bias=True),
    Case("float32", 300, 896, 32000, "float32"),
    Case("divergence-jsd", 300, 896, 32000, "bfloat16", divergence=1536),
)
SMOKE_CASES = (
    Case("awkward-bias", 47, 31, 123, "bfloat16", bias=True),
    Case("temperature-rows", 48, 32, 1000, "bfloat16", tf={"temperature": 0.7}, rows=8),
    Case("loss-dapo-padding", 32, 32, 512, "bfloat16", loss=True),
    Case("float32-bias", 40, 32, 300, "float32", bias=True),
    Case("divergence-jsd", 40, 32, 300, "float32", divergence=48),
)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return _max_err(a, b) / max(b.double().abs().max().item(), 1e-30)


def _inputs(c: Case, device: torch.device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: V=262144 x 4096 takes seconds on a host
    dt = getattr(torch, c.dtype)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device).mul_(scale)

    hidden = randn(c.N, c.H).to(dt).requires_grad_()
    weight = randn(c.V, c.H, scale=3.0 / c.H**0.5).to(dt).requires_grad_()
    bias = randn(c.V).to(dt).requires_grad_() if c.bias else None
    targets = torch.randint(0, c.V, (c.N,), generator=g, device=device)
    a, w = randn(c.N), randn(c.N)  # per-token weights of logp and entropy in the checked loss
    return hidden, weight, bias, targets, a, w


def _versus_torch(tol: dict, *checks) -> tuple[dict, list[str]]:
    """Each (name, fastrl's, float64's, PyTorch's at the input dtype): fastrl's error against float64 no worse than
    PyTorch's own plus the dtype's tolerance; outputs by max abs error, gradients (``grad_*``) relative."""
    err, fails = {}, []
    for name, fast, ref, plain in checks:
        grad = name.startswith("grad")
        dist = _rel_err if grad else _max_err
        mine, torch_err, limit = dist(fast, ref), dist(plain, ref), tol["grad" if grad else "out"]
        err[name], err[f"{name}_torch"] = mine, torch_err
        if mine > torch_err + limit:
            fails.append(f"{'divergence' if name == 'div' else name} {mine:.2e}{' (relative)' if grad else ''} > "
                         f"PyTorch's {torch_err:.2e} + {limit:.0e}")
    return err, fails


def _check_logprobs(c: Case, impl: str, device: torch.device) -> tuple[dict, list[str]]:
    import fastrl
    from fastrl.reference import logprobs_reference

    hidden, weight, bias, targets, a, w = _inputs(c, device)
    params = [p for p in (hidden, weight, bias) if p is not None]
    logp, ent = fastrl.fused_logprobs(hidden, weight, targets, bias=bias, backend=impl, **c.tf)
    grads = torch.autograd.grad((a * logp).sum() + (w * ent).sum(), params)
    rows = (torch.arange(c.N, device=device) if not c.rows
            else torch.cat([torch.arange(c.rows), torch.arange(c.N - c.rows, c.N)]).to(device))

    def reference(dtype):  # the checked rows' values and gradients: every parameter's (all rows), else hidden's
        h = hidden.detach()[rows].to(dtype or hidden.dtype).requires_grad_()
        others = [p.detach().to(dtype or p.dtype).requires_grad_(not c.rows) for p in params[1:]]
        wt, b = others[0], (others[1] if bias is not None else None)
        lp, en = logprobs_reference(h, wt, targets[rows], bias=b, dtype=dtype, **c.tf)
        wrt = [h] + ([] if c.rows else others)
        return lp, en, *torch.autograd.grad((a[rows] * lp).sum() + (w[rows] * en).sum(), wrt)

    mine = [logp[rows], ent[rows], grads[0][rows]] + ([] if c.rows else list(grads[1:]))
    names = ("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias")
    err, fails = _versus_torch(TOLERANCES[getattr(torch, c.dtype)],
                               *zip(names, mine, reference(torch.float64), reference(None)))
    if c.dtype != "float32" and err["logp"] >= LOGP_CAP:
        fails.append(f"logp {err['logp']:.2e} nats from float64 (limit {LOGP_CAP:.0e})")
    return err, fails


def _check_loss(c: Case, impl: str, device: torch.device) -> tuple[dict, list[str]]:
    import fastrl
    from bench.providers import loss_config
    from fastrl.reference import logprobs_reference, policy_loss_from_logprobs

    B, T = 4, c.N // 4
    hidden, weight, _, targets, _, _ = _inputs(c, device)
    hidden, targets = hidden.detach().view(B, T, c.H).requires_grad_(), targets.view(B, T)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(device)
    adv = torch.randn(B, generator=g).to(device)
    old = (-torch.rand(B, T, generator=g) * 8 - 4).to(device)
    ref = old + 0.1 * torch.randn(B, T, generator=g).to(device)
    config = loss_config()
    loss, _ = fastrl.policy_loss(hidden, weight, targets, adv, mask, config=config, old_logprobs=old, ref_logprobs=ref,
                                 backend=impl)
    gh, gw = torch.autograd.grad(loss, [hidden, weight])
    h64, w64 = (x.detach().double().requires_grad_() for x in (hidden, weight))
    lp, en = logprobs_reference(h64, w64, torch.where(mask, targets, -100))
    loss64, _ = policy_loss_from_logprobs(lp, en, adv.double(), mask, config=config, old_logprobs=old.double(),
                                          ref_logprobs=ref.double())
    g64 = torch.autograd.grad(loss64, [h64, w64])
    err = {"loss": abs(loss.item() - loss64.item()), "grad_hidden": _rel_err(gh, g64[0]),
           "grad_weight": _rel_err(gw, g64[1])}
    fails = []
    if err["loss"] > LOSS_TOLERANCE[0] * (1 + abs(loss64.item())):
        fails.append(f"loss {loss.item():.6f} vs float64 {loss64.item():.6f}")
    fails += [f"{k} {err[k]:.2e} (relative) >= {LOSS_TOLERANCE[1]:.1e}" for k in ("grad_hidden", "grad_weight")
              if err[k] >= LOSS_TOLERANCE[1]]
    if not torch.equal(gh[~mask], torch.zeros_like(gh[~mask])):
        fails.append("a padded token has a nonzero hidden-state gradient")
    return err, fails


def _check_divergence(c: Case, impl: str, device: torch.device) -> tuple[dict, list[str]]:
    """The JSD at beta 0.5 per token and d(sum of it)/d(student hidden), by ``_versus_torch``."""
    import fastrl
    from fastrl.reference import divergence_reference

    hidden, weight, _, _, _, _ = _inputs(c, device)
    g = torch.Generator(device=device).manual_seed(1)
    dt = getattr(torch, c.dtype)
    th = torch.randn(c.N, c.divergence, generator=g, device=device).to(dt)
    tw = (torch.randn(c.V, c.divergence, generator=g, device=device) * (3.0 / c.divergence**0.5)).to(dt)
    div = fastrl.fused_divergence(hidden, weight, th, tw, beta=0.5, backend=impl)
    (gh,) = torch.autograd.grad(div.sum(), [hidden])

    def reference(dtype):
        h = hidden.detach().to(dtype or dt).requires_grad_()
        d, _ = divergence_reference(h, weight.detach().to(dtype or dt), th.to(dtype or dt), tw.to(dtype or dt),
                                    beta=0.5, dtype=dtype)
        return d.detach(), torch.autograd.grad(d.sum(), [h])[0]

    tol = dict(DIV_TOLERANCES[dt])
    if dt != torch.float32:  # the Triton backends feed a 2-byte G to the gradient GEMMs: one more rounding
        tol["grad"] *= 2
    return _versus_torch(tol, *zip(("div", "grad_hidden"), (div, gh), reference(torch.float64), reference(None)))


def served_configs() -> dict:
    """What each kernel launched since ``tuning.reset_served()`` ran at: {kernel: {config, source, use_tma}}."""
    from fastrl.kernels import tuning

    return {k: {"config": str(c), "source": s, "use_tma": t} for k, (c, s, t) in sorted(tuning.served().items())}


def run_check(p: dict, device: torch.device) -> dict:
    """One implementation at one case: the row of ``bench/session_points.py`` (``pass`` and, if not, why)."""
    from fastrl.kernels import tuning

    c = next(x for x in (SMOKE_CASES if p["smoke"] else CASES) if x.name == p["workload"])
    dt = getattr(torch, c.dtype)
    if p["implementation"] == "triton-sm90":  # refused by design with a ValueError: not a failure
        from fastrl.ops.sm90 import supports_width

        for what, width in (("H", c.H), ("the teacher's H", c.divergence)):
            if width and not supports_width(width, dt):
                return {"status": "n/a", "reason": f"triton-sm90 refuses {what}={width} in {c.dtype} (TMA needs "
                                                   "16-byte rows)"}
    tuning.reset_served()
    kind, check = ("loss", _check_loss) if c.loss else ("divergence", _check_divergence) if c.divergence \
        else ("logprob", _check_logprobs)
    err, fails = check(c, p["implementation"], device)
    return {"status": "ok", "pass": not fails, "reason": "; ".join(fails), "error": err,
            "configs_served": served_configs(), "kind": kind, "N": c.N, "H": c.H, "V": c.V, "dtype": c.dtype,
            "bias": c.bias, "transform": c.tf, "rows_checked": 2 * c.rows if c.rows else c.N}
