"""Who computes each workload: fastrl's paths and the tools people would pick instead (bench/README.md, "Providers").

``PROVIDERS`` is the table; a provider's ``build`` makes, in the measuring process, an ``Op``: ``prepare(inputs)``
(untimed), ``forward(state)`` -> ``{"loss", "logp", "entropy"}``, and the measuring code's
``torch.autograd.grad(loss, state["wrt"])``, so every backward is timed the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from bench.workloads import ENTROPY_COEF, Workload

__all__ = ["Inputs", "Op", "Provider", "PROVIDERS", "get", "make_inputs", "ProviderUnavailable"]

# TRL 1.16 calls ChunkedLogProbFunction with 32768 vocabulary columns per tile
# (trl/trainer/utils.py: _CHUNKED_LOGPROB_CHUNK_SIZE) and 4096 tokens per tile (its TOKEN_CHUNK_SIZE).
TRL_CHUNK_SIZE = 32768
# GRPO loss settings shared by every loss provider (W1 in docs/design.md: dapo, beta 0.04 with k3 KL, entropy)
LOSS_TYPE = "dapo"
BETA = 0.04
KL_ESTIMATOR = "k3"
EPSILON = 0.2
USE_BIAS_CORRECTION_KL = True  # TRL 1.16's default (GRPOConfig.use_bias_correction_kl); Liger's is False


class ProviderUnavailable(RuntimeError):
    """Raised while building an op: the provider cannot run here; the message says why."""


@dataclass
class Inputs:
    hidden: torch.Tensor  # [N, H], or [B, T, H] for loss workloads
    weight: torch.Tensor  # [V, H]
    targets: torch.Tensor  # [N] or [B, T] int64
    advantages: torch.Tensor | None = None  # [B] float32
    mask: torch.Tensor | None = None  # [B, T] int64 completion mask
    old_logprobs: torch.Tensor | None = None  # [B, T] float32
    ref_logprobs: torch.Tensor | None = None  # [B, T] float32


def make_inputs(wl: Workload, device: torch.device, seed: int) -> Inputs:
    """Random inputs for one workload, never zero, reproducible from ``seed``: logits ``h W^T`` have unit scale, as
    an LM head's roughly do. Drawn on the device itself (a W1 weight is 622M numbers: seconds on a CPU)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, wl.dtype)
    grad = wl.kind in ("logprob", "loss")
    lead = (wl.batch, wl.T) if wl.kind == "loss" else (wl.N,)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device).mul_(scale)

    hidden = randn(*lead, wl.H).to(dt).requires_grad_(grad)
    weight = randn(wl.V, wl.H, scale=wl.H ** -0.5).to(dt).requires_grad_(grad and not wl.frozen_head)
    targets = torch.randint(0, wl.V, lead, generator=g, device=device)
    inp = Inputs(hidden, weight, targets)
    if wl.kind == "loss":
        B, T = lead
        # completions of T/2..T tokens, right-padded, as a GRPO batch looks after generation
        lengths = torch.randint(T // 2, T + 1, (B,), generator=g, device=device)
        inp.mask = (torch.arange(T, device=device)[None, :] < lengths[:, None]).to(torch.int64)
        inp.advantages = randn(B)
        # old / reference log-probs near what a random head gives (about -log V), so ratios and k3 stay O(1)
        inp.old_logprobs = randn(B, T, scale=0.5).add_(-math.log(wl.V))
        inp.ref_logprobs = inp.old_logprobs + randn(B, T, scale=0.1)
    return inp


@dataclass
class Op:
    """What the measuring code runs: ``forward(prepare(inputs))``, then autograd on ``state['wrt']``."""

    forward: Callable[[dict], dict]
    prepare: Callable[[Inputs], dict]
    needs_grad: bool
    has_entropy: bool = True  # the op's loss / outputs include the entropy (accuracy compares like with like)
    path: str = "materialised"  # cost model: "materialised" | "one-pass" | "two-pass" | "forward"
    notes: list[str] = field(default_factory=list)


def _wrt(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the backward differentiates: the inputs that need a gradient (a frozen head's weight does not)."""
    return tuple(t for t in tensors if t.requires_grad)


def _default_prepare(inp: Inputs) -> dict:
    return {"inp": inp, "wrt": _wrt(inp.hidden, inp.weight)}


def _logprob_loss(logp: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
    """The logprob workloads' scalar: ``sum(logp) + 0.01 * sum(entropy)`` (C1's definition)."""
    return logp.sum() if entropy is None else logp.sum() + ENTROPY_COEF * entropy.sum()


def _need(module: str, name: str):
    """``module.name``, or ProviderUnavailable naming the import that failed (TRL or Liger may be absent)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ProviderUnavailable(f"not available: cannot import {module}.{name} ({e})") from e


def _out(loss=None, logp=None, entropy=None) -> dict:
    return {"loss": loss, "logp": logp, "entropy": entropy}


def loss_config():
    """The one PolicyLossConfig every loss provider uses (W1/W2 of docs/design.md)."""
    from fastrl import PolicyLossConfig

    return PolicyLossConfig(loss_type=LOSS_TYPE, beta=BETA, kl_estimator=KL_ESTIMATOR, entropy_coef=ENTROPY_COEF,
                            epsilon_low=EPSILON, epsilon_high=EPSILON, use_bias_correction_kl=USE_BIAS_CORRECTION_KL)


def _token_op(wl: Workload, logprobs: Callable, notes: list[str], has_entropy: bool = True) -> Op:
    """The op of a provider of per-token log-probs, ``logprobs(inputs, with_entropy) -> (logp, entropy | None)``:
    logprob workloads take ``sum(logp) + 0.01 sum(entropy)``, loss workloads TRL 1.16's loss math on them (as
    fastrl.reference defines it)."""
    if wl.kind == "forward":
        return Op(lambda st: _out(None, logprobs(st["inp"], False)[0], None), _default_prepare, needs_grad=False,
                  has_entropy=False, path="forward", notes=notes)
    from fastrl.reference import policy_loss_from_logprobs

    cfg = loss_config() if wl.kind == "loss" else None

    def fwd(st):
        i = st["inp"]
        logp, ent = logprobs(i, True)
        if cfg is None:
            return _out(_logprob_loss(logp, ent), logp, ent)
        loss, _metrics = policy_loss_from_logprobs(logp, ent, i.advantages, i.mask, config=cfg,
                                                   old_logprobs=i.old_logprobs, ref_logprobs=i.ref_logprobs)
        return _out(loss, logp, ent)
    return Op(fwd, _default_prepare, needs_grad=True, has_entropy=has_entropy, path="two-pass", notes=notes)


def _build_fastrl(wl: Workload, device: torch.device, opts: dict, fused: bool = False) -> Op:
    """fastrl's log-probs (then the reference loss math on a loss workload), or ``fused``: ``fastrl.policy_loss``."""
    import fastrl

    from fastrl.ops.backend import resolve_backend

    backend = opts.get("fastrl_backend")  # None: fastrl's own choice (triton on CUDA, torch on CPU)
    on = f"{resolve_backend(device, backend)} backend"
    if not fused:
        def logprobs(i, with_entropy):
            return fastrl.fused_logprobs(i.hidden, i.weight, i.targets, with_entropy=with_entropy, backend=backend)
        path = {"logprob": "path A", "forward": "path C", "loss": "path A log-probs + reference loss math"}[wl.kind]
        return _token_op(wl, logprobs, [path, on])
    cfg = loss_config()

    def fwd(st):
        i = st["inp"]
        return _out(fastrl.policy_loss(i.hidden, i.weight, i.targets, i.advantages, i.mask, config=cfg,
                                       old_logprobs=i.old_logprobs, ref_logprobs=i.ref_logprobs, backend=backend)[0])
    return Op(fwd, _default_prepare, needs_grad=True, path="one-pass", notes=["fused loss", on])


def _build_torch(wl: Workload, device: torch.device, opts: dict, compile_: bool = False) -> Op:
    """The materialised computations in the input dtype, as plain functions (so torch.compile can take them)."""
    from fastrl.reference import logits_reference, logprobs_reference, policy_loss_from_logprobs

    def logprob(h, w, t):  # [N,H], [V,H], [N] -> scalar, logp, entropy
        logp, ent = logprobs_reference(h, w, t)
        return _logprob_loss(logp, ent), logp, ent

    def forward(h, w, t):  # what a trainer writes for reference log-probs: log_softmax + gather, no entropy
        z = logits_reference(h, w)
        return torch.log_softmax(z, dim=-1).gather(-1, t[:, None]).squeeze(-1)

    def loss(h, w, t, adv, mask, old, ref, cfg):
        logp, ent = logprobs_reference(h, w, t)
        loss, _ = policy_loss_from_logprobs(logp, ent, adv, mask, config=cfg, old_logprobs=old, ref_logprobs=ref)
        return loss, logp, ent

    fn = {"logprob": logprob, "forward": forward, "loss": loss}[wl.kind]
    notes = ["materialised logits, input dtype"] + (["torch.compile(dynamic=False)"] if compile_ else [])
    fn = torch.compile(fn, dynamic=False) if compile_ else fn
    if wl.kind == "forward":
        return Op(lambda st: _out(None, fn(st["inp"].hidden, st["inp"].weight, st["inp"].targets), None),
                  _default_prepare, needs_grad=False, has_entropy=False, path="forward", notes=notes)
    loss_args = (loss_config(),) if wl.kind == "loss" else None

    def fwd(st):
        i = st["inp"]
        extra = () if loss_args is None else (i.advantages, i.mask, i.old_logprobs, i.ref_logprobs, *loss_args)
        return _out(*fn(i.hidden, i.weight, i.targets, *extra))
    return Op(fwd, _default_prepare, needs_grad=True, notes=notes + (["reference loss math"] if loss_args else []))


def _build_trl(wl: Workload, device: torch.device, opts: dict) -> Op:
    ChunkedLogProbFunction = _need("trl.kernels.chunked_logprob", "ChunkedLogProbFunction")
    # On Triton devices TRL scores only the completion tokens (hidden_states[mask]) and scatters back
    compact = device.type in ("cuda", "xpu")

    def chunked(h, w, t, outputs):
        # ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
        #                              final_logit_softcapping, logit_scale, outputs), as add_fused_lm_head calls it
        return ChunkedLogProbFunction.apply(h, w, None, t, 1.0, TRL_CHUNK_SIZE, None, 1.0, outputs)

    def logprobs(i, with_entropy):
        outputs = ("log_probs", "entropy") if with_entropy else ("log_probs",)
        if wl.kind != "loss":
            out = chunked(i.hidden, i.weight, i.targets, outputs)
            return out[0], out[1] if with_entropy else None
        m = i.mask.bool()
        if compact:
            logp, ent, *_ = chunked(i.hidden[m], i.weight, i.targets[m], outputs)
            return tuple(x.new_zeros(m.shape).masked_scatter(m, x) for x in (logp, ent))
        logp, ent, *_ = chunked(i.hidden.reshape(-1, i.hidden.shape[-1]), i.weight, i.targets.reshape(-1), outputs)
        return tuple(x.view(m.shape).masked_fill(~m, 0) for x in (logp, ent))
    return _token_op(wl, logprobs, ["ChunkedLogProbFunction, chunk 4096 x 32768"]
                     + (["TRL loss math (reference)"] if wl.kind == "loss" else []))


def _build_liger_fused(wl: Workload, device: torch.device, opts: dict) -> Op:
    LigerFusedLinearGRPOLoss = _need("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss")
    compiled = opts.get("liger_compiled", True)
    loss_fn = LigerFusedLinearGRPOLoss(beta=BETA, compiled=compiled, use_ref_model=True, epsilon_low=EPSILON,
                                       epsilon_high=EPSILON, loss_type=LOSS_TYPE,
                                       use_bias_correction_kl=USE_BIAS_CORRECTION_KL)

    def fwd(st):
        i = st["inp"]
        return _out(loss_fn(i.hidden, i.weight, i.targets, i.mask, i.advantages, ref_per_token_logps=i.ref_logprobs,
                            old_per_token_logps=i.old_logprobs)[0])
    notes = ["LigerFusedLinearGRPOLoss, no entropy term", f"compiled={compiled}"]
    return Op(fwd, _default_prepare, needs_grad=True, has_entropy=False, path="one-pass", notes=notes)


def _build_liger_triton(wl: Workload, device: torch.device, opts: dict) -> Op:
    triton_grpo_loss = _need("liger_kernel.transformers.grpo_loss", "triton_grpo_loss")

    def prepare(inp: Inputs) -> dict:
        # triton_grpo_loss takes logits [B, T+1, V] and drops the last position, as a causal LM's output has one
        # more position than completion tokens: append one hidden row per sequence (outside the timed region)
        h = torch.cat([inp.hidden.detach(), inp.hidden.detach()[:, -1:]], dim=1).requires_grad_(True)
        return {"inp": inp, "h_pad": h, "wrt": _wrt(h, inp.weight)}

    def fwd(st):
        i = st["inp"]
        logits = torch.matmul(st["h_pad"], i.weight.T)  # [B, T+1, V] materialised, input dtype
        loss, _metrics = triton_grpo_loss(logits, i.old_logprobs, i.ref_logprobs, i.targets, i.advantages, i.mask,
                                          temperature=1.0, beta=BETA, eps_low=EPSILON, eps_high=EPSILON, inplace=True,
                                          loss_type=LOSS_TYPE, reduce=True,
                                          use_bias_correction_kl=USE_BIAS_CORRECTION_KL)
        return _out(loss)
    return Op(fwd, prepare, needs_grad=True, has_entropy=False, path="materialised",
              notes=["triton_grpo_loss on materialised logits, inplace, no entropy term"])


def _build_cce(wl: Workload, device: torch.device, opts: dict) -> Op:
    linear_cross_entropy = _need("cut_cross_entropy", "linear_cross_entropy")

    def logprobs(i, with_entropy):  # reduction="none" gives -logp per token; CCE has no entropy
        return -linear_cross_entropy(i.hidden, i.weight, i.targets, reduction="none"), None
    return _token_op(wl, logprobs, ["linear_cross_entropy, log-prob only (no entropy)", "default gradient filtering"],
                     has_entropy=False)


@dataclass
class Provider:
    """A row of PROVIDERS: what it computes (``kinds``), what it needs to run, and what it refuses by design."""

    name: str
    label: str
    kinds: tuple[str, ...]  # workload kinds it computes
    build: Callable[[Workload, torch.device, dict], Op]  # in the measuring process
    not_for: str = ""  # why it does not compute the other kinds
    needs: tuple[str, ...] = ()  # importable modules it needs
    cuda_only: str = ""  # non-empty: why it cannot run off CUDA
    half_backward: str = ""  # non-empty: whose backward takes bf16 / fp16 only (a float32 one is refused)
    compile_fails_skip: bool = False  # a failure while compiling is a "skipped" row, not an "error"
    # its own errors that mean "this input is not supported": a measurement raising one is an "n/a" row quoting it
    refusal_messages: tuple[str, ...] = ()

    def refuses(self, wl: Workload) -> str | None:
        """Why it refuses this input by design (decided in the parent, before any process starts), or None."""
        if self.half_backward and wl.kind != "forward" and wl.dtype not in ("bfloat16", "float16"):
            return f"refuses {wl.dtype} with a backward: {self.half_backward}'s backward takes bf16 or fp16 only"
        return None

    def unavailable(self, wl: Workload, device: str) -> tuple[str, str] | None:
        """``("n/a", why)``: not this kind of work, or an input it refuses (a property of the peer, so reported first);
        ``("skipped", why)``: it cannot run here; None: it runs."""
        if wl.kind not in self.kinds:
            return ("n/a", self.not_for or f"does not compute {wl.kind} workloads")
        if why := self.refuses(wl):
            return ("n/a", why)
        missing = [m for m in self.needs if importlib.util.find_spec(m) is None]
        if missing:
            return ("skipped", f"not available: `import {missing[0]}` fails (not installed)")
        if self.cuda_only and not device.startswith("cuda"):
            return ("skipped", f"not available on {device}: {self.cuda_only}")
        return None

    def is_refusal(self, exc: BaseException) -> bool:
        """Whether ``exc`` (or an exception it was raised from) is one of this peer's declared refusals."""
        seen = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            if any(m in str(exc) for m in self.refusal_messages):
                return True
            exc = exc.__cause__ or exc.__context__
        return False


_ALL = ("logprob", "forward", "loss")
_LOSS_ONLY = "returns a GRPO loss only, not per-token log-probs or entropy"

PROVIDERS: dict[str, Provider] = {p.name: p for p in [
    Provider("fastrl", "fastrl (path A fwd+bwd / path C fwd; backend auto)", _ALL, _build_fastrl),
    Provider("fastrl-fused", "fastrl.policy_loss (fused loss)", ("loss",),
             lambda wl, d, o: _build_fastrl(wl, d, o, fused=True),
             not_for="fastrl.policy_loss is the loss workloads' fused path"),
    Provider("fastrl-tfused", "fastrl, backend triton-fused (tl.dot kernels, no stored logit)", _ALL,
             lambda wl, d, o: _build_fastrl(wl, d, {**o, "fastrl_backend": "triton-fused"}), needs=("triton",),
             cuda_only="compiled Triton kernels (the CPU tests run them interpreted)"),
    Provider("torch", "materialised torch eager (input dtype)", _ALL, _build_torch),
    Provider("torch-compile", "torch.compile of the materialised reference", _ALL,
             lambda wl, d, o: _build_torch(wl, d, o, compile_=True), compile_fails_skip=True),
    Provider("trl", "TRL 1.16 ChunkedLogProbFunction", _ALL, _build_trl, needs=("trl",)),
    Provider("liger-fused", "Liger 0.8.5 LigerFusedLinearGRPOLoss", ("loss",), _build_liger_fused,
             not_for=_LOSS_ONLY, needs=("liger_kernel",)),
    Provider("liger-triton", "Liger 0.8.5 triton_grpo_loss on materialised logits", ("loss",), _build_liger_triton,
             not_for=_LOSS_ONLY, needs=("liger_kernel", "triton"), cuda_only="a Triton kernel that needs CUDA"),
    Provider("cce", "Cut Cross-Entropy linear_cross_entropy", ("logprob", "forward"), _build_cce,
             not_for="computes cross-entropy only: no entropy, no GRPO loss", needs=("cut_cross_entropy",),
             cuda_only="its Triton kernels need CUDA", half_backward="Cut Cross-Entropy",
             refusal_messages=("Backwards requires embeddings to be bf16 or fp16",
                               "Backwards requires classifier to be bf16 or fp16")),
]}


def get(name: str) -> Provider:
    try:
        return PROVIDERS[name]
    except KeyError:
        raise ValueError(f"unknown provider {name!r}; known: {', '.join(PROVIDERS)}") from None


def select(spec: str | None) -> list[Provider]:
    """Providers named in a comma list (default: all)."""
    from bench.report import pick

    return [PROVIDERS[n] for n in pick("--providers", spec, PROVIDERS)]
