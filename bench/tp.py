"""``python -m bench tp``: log-probs + entropy (forward + backward) of a head sharded over the vocabulary on P CPU
processes (gloo): fastrl on the shard (``fastrl.ops.sharded``) against transformers' TP plan for the head
(``colwise_gather_output``: each rank's ``[N, V/P]`` logits all-gathered into ``[N, V]``, then ``log_softmax``), and
fastrl unsharded in one process. Per rank: median wall time, peak extra RSS (sampled every 2 ms, minus RSS before the
steps). FLOPs per rank: 8NHV/P (fastrl, path A), 6NHV/P (gather); bytes sent per rank, float32: 16N forward + 4NH
backward (fastrl), 4NV(P-1)/P forward + 4NH backward (gather)."""

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from bench import report
from bench.measure import rss_mb
from bench.session_run import append_rows

METHODS = ("fastrl-sharded", "gather-logits", "fastrl-1proc")


def add_options(ap) -> None:
    for flag, default, what in (("--tokens", 1024, "N (4096: the gathered logits outgrow a 23 GB host at P=2)"),
                                ("--hidden", 512, "H"), ("--vocab", 151936, "V"), ("--procs", 2, "P"),
                                ("--reps", 2, "timed repetitions after one warm-up")):
        ap.add_argument(flag, type=int, default=default, help=f"{what} (default {default})")
    ap.add_argument("--out", default="bench/results/cpu-amd-epyc-2c/tp.json", help="results file")


def _step(method: str, h, w, t, mesh):
    import fastrl
    if method != "gather-logits":
        lp, en = fastrl.fused_logprobs(h, w, t)  # a Shard(0) DTensor head: fastrl.ops.sharded
    else:  # transformers' colwise_gather_output: local logits, all-gathered over the vocabulary, then log_softmax
        from torch.distributed.tensor import DTensor, Shard
        local = h @ w.to_local().T  # [N, V/P]
        logits = DTensor.from_local(local, mesh, [Shard(1)], shape=(h.shape[0], w.shape[0]),
                                    stride=(w.shape[0], 1)).full_tensor()  # [N, V] on every rank (uneven: padded)
        logp_all = torch.log_softmax(logits, dim=1)
        lp, en = logp_all.gather(1, t[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(1)
    (lp.sum() + 0.01 * en.sum()).backward()


def worker(method: str, N: int, H: int, V: int, reps: int, out: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    if not (single := method == "fastrl-1proc"):
        dist.init_process_group("gloo")
    g, mesh = torch.Generator().manual_seed(0), None
    h = torch.randn(N, H, generator=g).requires_grad_()
    w, t = torch.randn(V, H, generator=g) / H**0.5, torch.randint(0, V, (N,), generator=g)
    if not single:
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = dist.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        w = distribute_tensor(w, mesh, [Shard(0)])
    w.requires_grad_()
    before, times, peak, done = rss_mb(), [], [0.0], threading.Event()

    def sample():  # RSS every 2 ms while the steps run (torch releases the GIL inside its ops)
        while not done.wait(0.002):
            peak[0] = max(peak[0], rss_mb())

    threading.Thread(target=sample, daemon=True).start()
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        _step(method, h, w, t, mesh)
        h.grad = w.grad = None
        times.append(time.perf_counter() - t0)
    done.set()
    append_rows(Path(out), [dict(method=method, rank=0 if single else dist.get_rank(),
                                 seconds=statistics.median(times[1:]), peak_extra_mb=max(peak[0], rss_mb()) - before)])


def command(args, device, con) -> int:
    N, H, V, P = args.tokens, args.hidden, args.vocab, args.procs
    rows_file = Path(args.out).with_suffix(".rows.jsonl")
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    rows_file.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FASTRL_BACKEND": "torch"}
    torchrun = ["-m", "torch.distributed.run", f"--nproc_per_node={P}", f"--master_port={36500 + os.getpid() % 999}"]
    for m in METHODS:  # a fresh process (group) per method: its own peak memory
        subprocess.run([sys.executable, *([] if m == "fastrl-1proc" else torchrun), "-m", "bench.tp", m,
                        *(str(x) for x in (N, H, V, args.reps, rows_file))], env=env, check=True)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    worst = lambda m, k: max(r[k] for r in rows if r["method"] == m)  # noqa: E731 (the slowest / heaviest rank)
    summary = {m: dict(seconds=worst(m, "seconds"), peak_extra_mb=worst(m, "peak_extra_mb")) for m in METHODS}
    report.write_json(Path(args.out), dict(N=N, H=H, V=V, P=P, env=report.environment("cpu"), rows=rows,
                                           per_rank=summary))
    for m, s in summary.items():
        con.print(f"{m:16s} {s['seconds']:8.2f} s  {s['peak_extra_mb']:9.1f} MB peak extra (worst rank)")
    return 0


if __name__ == "__main__":
    worker(sys.argv[1], *(int(a) for a in sys.argv[2:6]), sys.argv[6])
