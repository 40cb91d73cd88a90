"""Workloads (docs/design.md: W1-W3, C1), the token / vocabulary / hidden-size sweeps, and their cost model.

A workload is a shape, a dtype and a kind of work: ``logprob`` (path A: per-token log-prob and entropy, forward +
backward of ``sum(logp) + 0.01 * sum(entropy)``), ``loss`` (W1's GRPO policy loss, forward + backward), ``forward``
(path C: log-probs, no gradient), or ``bench divergence``'s ``divergence`` (a student's head against a teacher's of
width ``Ht`` at ``beta``) and ``exact-kl`` (the policy loss with k3 against the exact KL to a reference head).
CPU runs scale the GPU workloads down by fixed factors, each saying so in its note.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

__all__ = ["Workload", "KINDS", "C1", "C1_LOSS", "gpu_workloads", "cpu_workloads", "smoke_workloads", "select", "flops",
           "bytes_moved", "tiny"]

KINDS = ("logprob", "loss", "forward", "divergence", "exact-kl")
ENTROPY_COEF = 0.01  # weight of the entropy term in the logprob workloads' loss and in the GRPO loss


@dataclass(frozen=True)
class Workload:
    name: str  # "W1", "C1", "tokens-4096", ...
    kind: str  # one of KINDS
    N: int  # tokens (B * T for loss workloads)
    H: int  # hidden size
    V: int  # vocabulary
    dtype: str  # "bfloat16" | "float32"
    batch: int = 1  # sequences B (loss workloads: hidden is [B, T, H] with T = N // B)
    group: str = "core"  # "core" | "sweep-tokens" | "sweep-vocab" | "sweep-hidden" | "sweep-loss-h4096" | ...
    note: str = ""  # what this is, and how it was scaled from the GPU definition
    frozen_head: bool = False  # the LM head needs no gradient (LoRA): only hidden's gradient is computed
    Ht: int = 0  # divergence / exact-kl: the teacher's (reference's) hidden width
    beta: float = 0.0  # divergence: the JSD's beta; exact-kl: the loss's KL weight

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload kind must be one of {KINDS}, got {self.kind!r}")
        if (self.N <= 0 or self.H <= 0 or self.V <= 0 or self.N % self.batch):
            raise ValueError(f"{self.name}: need N, H, V > 0 and N divisible by batch, got {self}")

    @property
    def T(self) -> int:
        return self.N // self.batch

    @property
    def sweep_value(self) -> int:
        """The swept variable of a sweep workload (tokens, vocabulary or hidden size)."""
        return {"sweep-vocab": self.V, "sweep-hidden": self.H}.get(self.group, self.N)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Workload":
        return Workload(**d)


# Cost model (bench/README.md): throughput is reported on the useful FLOPs, so a path that recomputes the logits pays
# for it in TFLOP/s; ``flops_executed`` records what it really ran.

def flops(wl: Workload, phase: str) -> float:
    """Useful FLOPs of one phase: 'fwd' 2NHV, 'bwd' 4NHV, 'total' 6NHV (forward-only: 2NHV total; a frozen head
    has no weight-gradient GEMM: 'bwd' 2NHV, 'total' 4NHV)."""
    nhv = float(wl.N) * wl.H * wl.V
    if wl.kind in ("divergence", "exact-kl"):  # the chunked paths' (docs/benchmarks.md); exact-kl: the exact provider's
        div, both = wl.kind == "divergence", 2.0 * wl.N * (wl.H + wl.Ht) * wl.V
        fwd = both * (2 if div and 0.0 < wl.beta < 1.0 else 1)
        return {"fwd": fwd, "bwd": 4 * nhv + both * div, "total": fwd + 4 * nhv + both * div}[phase]
    bwd = 0.0 if wl.kind == "forward" else 2 * nhv if wl.frozen_head else 4 * nhv
    return {"fwd": 2 * nhv, "bwd": bwd, "total": 2 * nhv + bwd}[phase]


def flops_executed(wl: Workload, path: str) -> float:
    """FLOPs a provider actually runs: the useful ones, plus 2NHV for a two-pass path's recomputed logits."""
    return flops(wl, "total") + (2.0 * wl.N * wl.H * wl.V if path == "two-pass" and wl.kind != "forward" else 0.0)


def bytes_moved(wl: Workload) -> dict[str, float]:
    """Lower bounds on memory traffic: inputs + outputs for a fused path, plus the logits for a materialising one."""
    s = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}[wl.dtype]
    io = (wl.N * wl.H + wl.V * wl.H) * s  # read h and W
    if wl.kind != "forward":
        io *= 2  # and write grad_h, grad_W of the same sizes
    logits = float(wl.N) * wl.V * s * (1 if wl.kind == "forward" else 2)  # logits (+ their gradient)
    return {"bytes_inputs_outputs": float(io), "bytes_logits": logits}


# GPU shapes (docs/design.md). Loss workloads split 16384 tokens into 16 sequences of 1024.
_W1 = Workload("W1", "loss", 16384, 4096, 151936, "bfloat16", batch=16,
               note="GRPO loss dapo, beta 0.04 k3 KL, entropy 0.01; fwd+bwd")
_W2 = Workload("W2", "loss", 16384, 896, 151936, "bfloat16", batch=16, note="as W1, Qwen2.5-0.5B head")
_W1_LP = replace(_W1, name="W1-lp", kind="logprob", note="W1 shapes, log-prob + entropy fwd+bwd (path A)")
_W2_LP = replace(_W2, name="W2-lp", kind="logprob", note="W2 shapes, log-prob + entropy fwd+bwd (path A)")
_W3 = Workload("W3", "forward", 16384, 4096, 151936, "bfloat16", note="forward-only log-probs (path C)")
_W1_FROZEN = replace(_W1, name="W1-frozen", frozen_head=True,
                     note="W1 with a frozen LM head (LoRA): gradient w.r.t. hidden only")
SWEEP_LOSS_TOKENS = (2048, 4096, 8192, 16384)
C1 = Workload("C1", "logprob", 4096, 512, 32768, "float32",
              note="CPU: log-prob + entropy fwd+bwd, loss sum(logp) + 0.01 sum(entropy)")
C1_LOSS = Workload("C1-loss", "loss", 4096, 512, 32768, "float32", batch=16,
                   note="CPU: C1 shapes, GRPO loss dapo, beta 0.04 k3 KL, entropy 0.01 (as W1); fwd+bwd")

SWEEP_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_VOCAB = (32000, 128256, 151936)  # Llama-2, Llama-3, Qwen2.5
SWEEP_HIDDEN = (896, 2048, 4096)  # Qwen2.5-0.5B, Llama-3.2-1B, Llama-3-8B


def _sweeps(n_base: int, h_base: int, v_base: int, dtype: str, tokens, vocab, hidden, note: str) -> list[Workload]:
    out = [Workload(f"tokens-{n}", "logprob", n, h_base, v_base, dtype, group="sweep-tokens", note=note)
           for n in tokens]
    out += [Workload(f"vocab-{v}", "logprob", n_base, h_base, v, dtype, group="sweep-vocab", note=note)
            for v in vocab]
    out += [Workload(f"hidden-{h}", "logprob", n_base, h, v_base, dtype, group="sweep-hidden", note=note)
            for h in hidden]
    return out


def gpu_workloads() -> list[Workload]:
    """Everything at the GPU sizes of docs/design.md: W1-W3, W1 with a frozen head, W1 and W2 as GRPO losses over
    1024-token sequences at 2k-16k tokens, and the three log-prob sweeps (bf16)."""
    loss_sweeps = [replace(base, name=f"{base.name}-{n}", N=n, batch=n // 1024, group=f"sweep-loss-h{base.H}",
                           note=f"{base.note}; {n // 1024} sequences of 1024 tokens")
                   for base in (_W1, _W2) for n in SWEEP_LOSS_TOKENS]
    sweeps = _sweeps(16384, 4096, 151936, "bfloat16", SWEEP_TOKENS, SWEEP_VOCAB, SWEEP_HIDDEN,
                     note="log-prob + entropy fwd+bwd")
    return [_W1, _W1_LP, _W2, _W2_LP, _W3, _W1_FROZEN] + loss_sweeps + sweeps


def _scaled(wl: Workload, fn: int, fh: int, fv: int, batch: int) -> Workload:
    """``wl`` with N/fn, H/fh, V/fv (multiples of 8) in float32, and a note saying so."""
    def r8(x: float) -> int:
        return max(8, int(round(x / 8)) * 8)
    return replace(wl, N=r8(wl.N / fn), H=r8(wl.H / fh), V=r8(wl.V / fv), dtype="float32", batch=batch,
                   note=f"{wl.note}; scaled down for CPU from N={wl.N} H={wl.H} V={wl.V} {wl.dtype} "
                        f"(N/{fn} H/{fh} V/{fv}, float32)")


def cpu_workloads(quick: bool) -> list[Workload]:
    """C1, C1-loss and CPU-sized versions of W1-W3 and the sweeps (quick: smaller still, three points per sweep)."""
    fn, fh, fv = (32, 16, 8) if quick else (4, 8, 4)
    core = [_scaled(w, fn, fh, fv, batch=4 if quick else 8) for w in (_W1, _W2, _W3)]
    if quick:
        c1 = [replace(C1, name="C1-quick", N=1024, note=C1.note + "; quick: N=1024 instead of 4096")]
        sweep = _sweeps(512, 128, 8192, "float32", (128, 512, 2048), (2048, 8192, 32768), (64, 128, 512),
                        note="log-prob + entropy fwd+bwd; CPU quick sizes, not the GPU sweep's")
    else:
        c1 = [C1, C1_LOSS]
        sweep = _sweeps(2048, 512, 32768, "float32", (512, 1024, 2048, 4096, 8192), (8000, 32768, 38000),
                        (112, 256, 512), note="log-prob + entropy fwd+bwd; CPU sizes, not the GPU sweep's")
    return c1 + core + sweep


def smoke_workloads() -> list[Workload]:
    """Tiny shapes for CI: every kind once, and a two-point token sweep so a plot is drawn. C1-loss-smoke has
    W1-smoke's shape, so it is measured once (a "same_as" row): it checks that c1's loss workload is wired up."""
    sweep = [replace(tiny(C1), name=f"tokens-{n}", N=n, group="sweep-tokens") for n in (64, 256)]
    return [tiny(w) for w in (C1, _W1, C1_LOSS, _W3)] + sweep


def _matches(wl: Workload, key: str) -> bool:
    name = wl.name.lower()
    return (key in (name, name.removesuffix("-smoke"), wl.group) or (key.endswith("*") and name.startswith(key[:-1]))
            or (key == "sweeps" and wl.group.startswith("sweep")) or (name.split("-")[0] == key and wl.group == "core"))


def select(workloads: list[Workload], spec: str | None) -> list[Workload]:
    """Filter by a comma list of names, name prefixes ending in '*', or groups ('core', 'sweep-tokens', 'sweeps')."""
    if not spec:
        return workloads
    keys = [k.strip().lower() for k in spec.split(",") if k.strip()]
    out = [wl for wl in workloads if any(_matches(wl, k) for k in keys)]
    if not out:
        names = ", ".join(w.name for w in workloads)
        raise SystemExit(f"--workload {spec!r} matches none of: {names} (or groups core, sweeps, sweep-tokens, ...)")
    return out


def tiny(wl: Workload) -> Workload:
    """A smoke-test version of any workload: same name and kind (suffix '-smoke'), tiny float32 shapes."""
    return replace(wl, name=f"{wl.name}-smoke", N=128, H=32, V=512, dtype="float32", batch=min(wl.batch, 4),
                   note="smoke test: tiny shapes, numbers mean nothing")
