"""Peak memory and time of one on-policy distillation step: stock ``trl.DistillationTrainer`` vs fastrl's, on CPU.

    python examples/distillation_step.py                          # V=65536, student H=64, teacher H=96, 4 x 256 tokens
    python examples/distillation_step.py --vocab 151936 --beta 0 --json out.json

Random-init Qwen2 student and teacher (1 layer each, their own hidden widths, one vocabulary; heads scaled so the
distributions are peaked, as trained models' are). Each trainer runs in a fresh process: ``compute_loss`` +
``backward`` on a fixed batch of completions (generation excluded; both bodies and the divergence included),
float32, one warm-up step and then ``--reps`` timed steps; memory is the peak resident memory during the steps
above what the process held just before them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time


def measure(which: str, a) -> dict:
    import torch

    from fastrl.testing import tiny_model, tiny_tokenizer

    torch.set_num_threads(a.threads)
    if which == "trl":
        from trl import DistillationConfig, DistillationTrainer
    else:
        from fastrl import DistillationConfig, DistillationTrainer
    from datasets import Dataset

    models = []
    for hidden, seed in ((a.hidden, 0), (a.teacher_hidden, 1)):
        m = tiny_model(a.vocab, hidden, 1, seed=seed, heads=4, kv_heads=2)
        with torch.no_grad():
            m.lm_head.weight.mul_(30.0)  # peaked distributions (random init gives near-uniform ones)
        models.append(m)
    tok = tiny_tokenizer(a.vocab)
    args = DistillationConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none",
                              per_device_train_batch_size=a.batch, max_completion_length=a.completion_len,
                              beta=a.beta, save_strategy="no", disable_tqdm=True)
    trainer = DistillationTrainer(model=models[0], teacher_model=models[1], args=args, processing_class=tok,
                                  train_dataset=Dataset.from_dict({"prompt": ["w1 w2"] * a.batch}))
    g = torch.Generator().manual_seed(0)
    B, P, C = a.batch, 16, a.completion_len
    inputs = dict(prompt_ids=torch.randint(3, a.vocab, (B, P), generator=g),
                  prompt_mask=torch.ones(B, P, dtype=torch.int64),
                  completion_ids=torch.randint(3, a.vocab, (B, C), generator=g),
                  completion_mask=torch.ones(B, C, dtype=torch.int64), num_items_in_batch=torch.tensor(B * C))
    trainer.model.train()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(1 + a.reps):
        trainer.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = trainer.compute_loss(trainer.model, dict(inputs))
        loss.backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    timed = sorted(times[1:])
    return dict(which=which, loss=loss.item(), seconds=timed[len(timed) // 2], peak_extra_mb=(peak - before) / 1024)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--teacher-hidden", type=int, default=96)
    p.add_argument("--batch", type=int, default=4, help="completions per step")
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the raw measurements here")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._worker:
        print("MEASURE " + json.dumps(measure(a._worker, a)))
        return
    import torch
    import trl

    print(f"# V={a.vocab}, student H={a.hidden}, teacher H={a.teacher_hidden}, {a.batch} x {a.completion_len} "
          f"completion tokens, beta={a.beta}, float32, CPU ({platform.processor() or platform.machine()}, "
          f"{a.threads} thread{'s' if a.threads > 1 else ''}), torch {torch.__version__}, trl {trl.__version__}")
    print("| trainer | peak extra MB | s per step | loss |\n|---|---:|---:|---:|")
    rows = []
    for which in ("trl", "fastrl"):
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--_worker", which]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": str(a.threads)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("MEASURE ")), None)
        if line is None:
            print(f"| {which} | failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]} | | |")
            continue
        r = json.loads(line[len("MEASURE "):])
        rows.append(r)
        print(f"| {which} | {r['peak_extra_mb']:.0f} | {r['seconds']:.2f} | {r['loss']:.6f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(a).items() if k != "_worker"}, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
