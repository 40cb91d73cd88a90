"""What the exact reference KL costs next to TRL's k3 estimate, in one process: ``fastrl.policy_loss`` forward +
backward with ``kl_estimator="k3"`` (the reference's log-probs given) and with ``"exact"`` (the reference's hidden
states and head given), on the same random inputs. CPU by default; on CUDA pass ``--device cuda``.

    python examples/exact_kl_cost.py [--device cpu|cuda] [--threads 1]

A quick look only (medians of 3, one after the other): the measured figure, each variant in a fresh process with
its memory and a results file, is ``python -m bench divergence --providers k3,exact`` (workload KL-exact, the same
shape on a CPU).
"""

from __future__ import annotations

import argparse
import time

import torch

import fastrl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shape", default="8,256,512,32768", help="B,T,H,V")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T, H, V = (int(x) for x in args.shape.split(","))
    dev = torch.device(args.device)
    hidden = torch.randn(B, T, H, device=dev, requires_grad=True)
    weight = (torch.randn(V, H, device=dev) * 0.05).requires_grad_()
    ref_hidden, ref_weight = torch.randn(B, T, H, device=dev), torch.randn(V, H, device=dev) * 0.05
    targets = torch.randint(0, V, (B, T), device=dev)
    mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    advantages = torch.randn(B, device=dev)
    with torch.no_grad():
        old, _ = fastrl.fused_logprobs(hidden, weight, targets, with_entropy=False)
        ref, _ = fastrl.fused_logprobs(ref_hidden, ref_weight, targets, with_entropy=False)

    def median_seconds(estimator: str) -> tuple[float, float]:
        config = fastrl.PolicyLossConfig(loss_type="dapo", beta=0.04, kl_estimator=estimator)
        extra = dict(ref_logprobs=ref) if estimator != "exact" else dict(ref_hidden=ref_hidden, ref_weight=ref_weight)
        times, kl = [], 0.0
        for _ in range(3):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss, metrics = fastrl.policy_loss(hidden, weight, targets, advantages, mask, config=config,
                                               old_logprobs=old, **extra)
            loss.backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            kl = float(metrics["kl"])
            hidden.grad = weight.grad = None
        return sorted(times)[1], kl

    k3, kl_k3 = median_seconds("k3")
    exact, kl_exact = median_seconds("exact")
    print(f"{args.device}, B={B} T={T} H={H} V={V}, dapo beta 0.04, fwd+bwd, median of 3")
    print(f"k3:    {k3:7.2f} s   kl {kl_k3:.4f} (sampled-token estimate)")
    print(f"exact: {exact:7.2f} s   kl {kl_exact:.4f} (whole vocabulary)   {exact / k3:.2f}x k3's time")


if __name__ == "__main__":
    main()
