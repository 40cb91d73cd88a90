"""Heads sharded over the vocabulary (tensor parallelism): every op on a DTensor ``Shard(0)`` head against the
unsharded op, on 2 and 4 gloo processes (CPU).

One launch per process count runs every check (``_worker``: the same random inputs on every rank, the head distributed
with ``distribute_tensor``) and writes each rank's errors to a JSON file; the tests below read them. float64: equal
to the unsharded op within 1e-12; float32: no further from the float64 truth than the unsharded float32 op plus
the tolerance of ``tests/test_logprobs.py``. Gradients: hidden states, each rank's shard of the weight and bias
(against the rows of the full gradient). Uneven shards (V not divisible by P) and, on 4 ranks, an empty one (V < P).
What runs: ``fused_logprobs`` (torch backend, and Triton under the interpreter), over a ``KeptSet`` (tokens whose
ids all sit on one shard next to ones spread over all) and over ``SamplerRule`` s replayed across the shards (ties
across shards included); ``policy_loss`` for several loss types, the k1/k2/k3 estimators and the exact KL with a
sharded reference head, over a KeptSet and a rule; ``fused_divergence`` for beta 0, 1 and 0.4 with the student, the
teacher or both sharded. Bytes sent: every collective the ops call is counted; per token they are the same at two
vocabularies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny import end_worker  # noqa: E402

pytestmark = pytest.mark.distributed

TOL32 = dict(out=1e-6, grad=1e-6)  # tests/test_logprobs.py's float32 row
EXACT64 = 1e-12


# ------------------------------------------------------------------------------------------------ worker side


def _err(a, b) -> float:
    if a is None and b is None:
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


class ByteCounter:
    """Counts the bytes each collective of ``torch.distributed`` sends from this rank while ``on``."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "broadcast", "all_to_all", "all_to_all_single", "send", "isend", "gather", "scatter")

    def __init__(self):
        import torch.distributed as dist

        self.on, self.bytes, self.calls = False, 0, []
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            if self.on:
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                n = t.numel() * t.element_size() if t is not None else -1
                self.bytes += n
                self.calls.append(name)
            return fn(*args, **kwargs)

        return counted


def _inputs(N, H, V, dtype, bias, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * (scale / H**0.5)).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::5] = -100
    return hidden, weight, b, targets


def _distribute(mesh, weight, bias):
    from torch.distributed.tensor import Shard, distribute_tensor

    w = distribute_tensor(weight.detach().clone(), mesh, [Shard(0)]).requires_grad_()
    b = None if bias is None else distribute_tensor(bias.detach().clone(), mesh, [Shard(0)]).requires_grad_()
    return w, b


def _grads(out_fn, hidden, weight, bias, seed):
    """(outputs, grad hidden, grad weight, grad bias) of sum(outputs * fixed random weights)."""
    h = hidden.detach().clone().requires_grad_()
    outs = out_fn(h, weight, bias)
    g = torch.Generator().manual_seed(seed + 1)
    loss = sum((o * torch.randn(o.shape, generator=g).to(o.dtype)).sum() for o in outs if o is not None)
    params = [p for p in (h, weight, bias) if p is not None]
    grads = torch.autograd.grad(loss, params)
    gh, gw = grads[0], grads[1]
    gb = grads[2] if bias is not None else None
    return [o.detach() for o in outs if o is not None], gh, gw, gb


def _local(g):
    return g.to_local() if hasattr(g, "to_local") else g


def _compare(res, name, fast, ref, truth, dtype, rows):
    """fast = sharded, ref = unsharded (same dtype), truth = unsharded float64; rows: this rank's slice of W."""
    out_f, gh_f, gw_f, gb_f = fast
    out_r, gh_r, gw_r, gb_r = ref
    out_t, gh_t, gw_t, gb_t = truth
    gw_f, gb_f = _local(gw_f), None if gb_f is None else _local(gb_f)
    pairs = [("out%d" % i, f, r, t) for i, (f, r, t) in enumerate(zip(out_f, out_r, out_t))]
    pairs += [("grad_hidden", gh_f, gh_r, gh_t), ("grad_weight", gw_f, gw_r[rows], gw_t[rows])]
    if gb_f is not None:
        pairs.append(("grad_bias", gb_f, gb_r[rows], gb_t[rows]))
    for key, f, r, t in pairs:
        if dtype == torch.float64:
            res[f"{name}/{key}"] = {"kind": "exact", "err": _err(f, r)}
        else:
            grad = key.startswith("grad")
            e_f = _rel(f, t) if grad else _err(f, t)
            e_r = _rel(r, t) if grad else _err(r, t)
            res[f"{name}/{key}"] = {"kind": "grad" if grad else "out", "err": e_f, "unsharded": e_r}


def _logprob_cases(res, mesh, world, rank, counter):
    import fastrl
    from fastrl.ops.sharded import chunk_range

    cases = [  # (N, H, V, dtype, bias, tf, backend, entropy)
        (23, 16, 61, torch.float64, True, {}, "torch", True),
        (23, 16, 64, torch.float64, False, dict(temperature=0.7, logit_scale=1.3, softcap=4.0), "torch", True),
        (23, 16, 61, torch.float64, True, {}, "torch", False),
        (23, 16, 61, torch.float32, True, dict(temperature=0.7), "torch", True),
        (17, 16, 37, torch.float32, True, dict(softcap=3.0), "triton-fused", True),
        (9, 8, 3, torch.float64, True, {}, "torch", True),  # V < P on 4 ranks: an empty shard
    ]
    for i, (N, H, V, dt, bias, tf, backend, ent) in enumerate(cases):
        hidden, weight, b, targets = _inputs(N, H, V, dt, bias, seed=10 + i)
        w_dt, b_dt = _distribute(mesh, weight, b)
        v0, v1 = chunk_range(V, world, rank)

        def run(h, w, bb, be=backend):
            return fastrl.fused_logprobs(h, w, targets, bias=bb, with_entropy=ent, backend=be, **tf)

        truth = _grads(lambda h, w, bb: run(h, w, bb, "torch"), hidden.double(), weight.double().requires_grad_(),
                       None if b is None else b.double().requires_grad_(), i)
        ref = _grads(run, hidden, weight.clone().requires_grad_(), None if b is None else b.clone().requires_grad_(), i)
        counter.on = True
        fast = _grads(run, hidden, w_dt, b_dt, i)
        counter.on = False
        _compare(res, f"logprobs{i}-V{V}-{dt}-{backend}", fast, ref, truth, dt, slice(v0, v1))
    # bytes per token: the same at V=61 and V=610 (N, H fixed); nothing but all-reduces
    sent = {}
    for V in (61, 610):
        hidden, weight, b, targets = _inputs(40, 16, V, torch.float32, True, seed=3)
        w_dt, b_dt = _distribute(mesh, weight, b)
        h = hidden.clone().requires_grad_()
        counter.bytes, counter.calls, counter.on = 0, [], True
        lp, en = fastrl.fused_logprobs(h, w_dt, targets, bias=b_dt)
        fwd = counter.bytes
        (lp.sum() + en.sum()).backward()
        counter.on = False
        sent[V] = {"forward": fwd, "backward": counter.bytes - fwd, "calls": sorted(set(counter.calls)),
                   "tokens": int((targets != -100).sum()), "H": 16}
    res["bytes"] = sent


def _policy_cases(res, mesh, world, rank):
    import fastrl
    from fastrl.ops.sharded import chunk_range

    B, T, H, V = 3, 6, 16, 61
    cfgs = [
        ("dapo-k3", dict(loss_type="dapo", beta=0.04, kl_estimator="k3", entropy_coef=0.01)),
        ("grpo-k1", dict(loss_type="grpo", beta=0.1, kl_estimator="k1")),
        ("bnpo-k2", dict(loss_type="bnpo", beta=0.1, kl_estimator="k2")),
        ("cispo", dict(loss_type="cispo")),
        ("gspo", dict(loss_type="grpo", importance_sampling_level="sequence")),
        ("dr_grpo-exact", dict(loss_type="dr_grpo", beta=0.05, kl_estimator="exact", max_completion_length=6)),
    ]
    for j, (name, kw) in enumerate(cfgs):
        for dt in (torch.float64, torch.float32):
            g = torch.Generator().manual_seed(100 + j)
            hidden = torch.randn(B, T, H, generator=g).to(dt)
            weight = (torch.randn(V, H, generator=g) * 0.7).to(dt)
            bias = torch.randn(V, generator=g).to(dt)
            targets = torch.randint(0, V, (B, T), generator=g)
            mask = torch.ones(B, T, dtype=torch.bool)
            mask[0, 4:] = False
            adv = torch.randn(B, generator=g).to(dt)
            old = (-torch.rand(B, T, generator=g) * 3).to(dt)
            extra = {}
            if kw.get("kl_estimator") == "exact":
                ref_h = torch.randn(B, T, 12, generator=g).to(dt)
                ref_w = (torch.randn(V, 12, generator=g) * 0.7).to(dt)
                extra = dict(ref_hidden=ref_h, ref_weight=ref_w)
            elif kw.get("beta"):
                extra = dict(ref_logprobs=(-torch.rand(B, T, generator=g) * 3).to(dt))
            config = fastrl.PolicyLossConfig(**kw)
            v0, v1 = chunk_range(V, world, rank)

            def run(h, w, bb, ex=extra):
                loss, metrics = fastrl.policy_loss(h, w, targets, adv, mask, config=config, old_logprobs=old,
                                                   bias=bb, **ex)
                run.metrics = metrics
                return (loss,)

            def sharded_extra():
                if "ref_weight" not in extra:
                    return extra
                from torch.distributed.tensor import Shard, distribute_tensor
                return dict(extra, ref_weight=distribute_tensor(extra["ref_weight"], mesh, [Shard(0)]))

            dd = lambda t: None if t is None else t.double()  # noqa: E731
            truth = _grads(lambda h, w, bb: run(h, w, bb, {k: dd(v) for k, v in extra.items()}), hidden.double(),
                           weight.double().requires_grad_(), bias.double().requires_grad_(), 0)
            m_truth = {k: v.item() for k, v in run.metrics.items()}
            ref = _grads(run, hidden, weight.clone().requires_grad_(), bias.clone().requires_grad_(), 0)
            m_ref = {k: v.item() for k, v in run.metrics.items()}
            w_dt, b_dt = _distribute(mesh, weight, bias)
            fast = _grads(lambda h, w, bb: run(h, w, bb, sharded_extra()), hidden, w_dt, b_dt, 0)
            m_fast = {k: v.item() for k, v in run.metrics.items()}
            key = f"policy-{name}-{dt}"
            _compare(res, key, fast, ref, truth, dt, slice(v0, v1))
            scale = {k: max(1.0, abs(m_truth[k])) for k in m_truth}  # relative for the large ones (ratio var)
            res[f"{key}/metrics"] = {
                "kind": "exact" if dt == torch.float64 else "out",
                "err": max(abs(m_fast[k] - (m_ref if dt == torch.float64 else m_truth)[k]) / scale[k] for k in m_ref),
                "unsharded": max(abs(m_ref[k] - m_truth[k]) / scale[k] for k in m_ref)}


def _divergence_cases(res, mesh, world, rank):
    import fastrl
    from torch.distributed.tensor import Shard, distribute_tensor

    from fastrl.ops.sharded import chunk_range

    N, H, Ht, V = 19, 16, 12, 61
    for beta in (0.0, 1.0, 0.4):
        for layout in ("both", "student", "teacher"):
            for dt in (torch.float64, torch.float32):
                g = torch.Generator().manual_seed(int(beta * 10) + 7)
                hidden = torch.randn(N, H, generator=g).to(dt)
                weight = (torch.randn(V, H, generator=g) * 0.8).to(dt)
                bias = torch.randn(V, generator=g).to(dt)
                th = torch.randn(N, Ht, generator=g).to(dt)
                tw = (torch.randn(V, Ht, generator=g) * 0.8).to(dt)
                mask = torch.ones(N, dtype=torch.bool)
                mask[3::4] = False
                tf = dict(temperature=0.8, softcap=5.0, teacher_logit_scale=1.2)
                v0, v1 = chunk_range(V, world, rank)

                def run(h, w, bb, t_w=tw, t_h=th):
                    return fastrl.fused_divergence(h, w, t_h, t_w, beta=beta, bias=bb, mask=mask, with_entropy=True,
                                                   **tf)

                truth = _grads(lambda h, w, bb: run(h, w, bb, tw.double(), th.double()), hidden.double(),
                               weight.double().requires_grad_(), bias.double().requires_grad_(), 5)
                ref = _grads(run, hidden, weight.clone().requires_grad_(), bias.clone().requires_grad_(), 5)
                tw_s = distribute_tensor(tw, mesh, [Shard(0)]) if layout in ("both", "teacher") else tw
                if layout == "teacher":  # the student replicated: its full gradient on every rank
                    fast = _grads(lambda h, w, bb: run(h, w, bb, tw_s), hidden, weight.clone().requires_grad_(),
                                  bias.clone().requires_grad_(), 5)
                    rows = slice(None)
                else:
                    w_dt, b_dt = _distribute(mesh, weight, bias)
                    fast = _grads(lambda h, w, bb: run(h, w, bb, tw_s), hidden, w_dt, b_dt, 5)
                    rows = slice(v0, v1)
                _compare(res, f"divergence-b{beta}-{layout}-{dt}", fast, ref, truth, dt, rows)


def _kept_sets(N, V, seed, world):
    """Random kept sets holding each target; every 3rd token keeps ids of shard 0 only (its target moved there)."""
    import fastrl
    from fastrl.ops.sharded import chunk_range

    g = torch.Generator().manual_seed(seed)
    first = chunk_range(V, world, 0)[1]
    targets, lists = [], []
    for n in range(N):
        if n % 3 == 0:
            ids = torch.randperm(first, generator=g)[: 1 + n % 4].tolist()
        else:
            ids = torch.randperm(V, generator=g)[: 1 + n % 9].tolist()
        lists.append(ids)
        targets.append(ids[n % len(ids)])
    targets = torch.tensor(targets)
    targets[7::7] = -100
    return fastrl.KeptSet.from_lists(lists, V), targets


def _kept_cases(res, mesh, world, rank):
    import fastrl
    from fastrl.ops.sharded import chunk_range

    N, H, V = 29, 16, 61
    for dt in (torch.float64, torch.float32):
        ks, targets = _kept_sets(N, V, seed=4, world=world)
        hidden, weight, b, _ = _inputs(N, H, V, dt, True, seed=21)
        v0, v1 = chunk_range(V, world, rank)

        def run(h, w, bb):
            return fastrl.fused_logprobs(h, w, targets, bias=bb, support=ks, temperature=0.9, softcap=6.0,
                                         return_kept_mass=True)

        truth = _grads(run, hidden.double(), weight.double().requires_grad_(), b.double().requires_grad_(), 2)
        ref = _grads(run, hidden, weight.clone().requires_grad_(), b.clone().requires_grad_(), 2)
        w_dt, b_dt = _distribute(mesh, weight, b)
        fast = _grads(run, hidden, w_dt, b_dt, 2)
        _compare(res, f"kept-{dt}", fast, ref, truth, dt, slice(v0, v1))
    # the policy loss over the same support (two passes on the shards)
    B, T = 1, N
    config = fastrl.PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)
    hidden, weight, b, _ = _inputs(N, H, V, torch.float64, True, seed=22)
    mask = (targets != -100).reshape(B, T)
    tg = torch.where(mask, targets.reshape(B, T), 0)
    ref_lp = -torch.rand(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(5))  # same on every rank

    def loss(h, w, bb):
        out, metrics = fastrl.policy_loss(h.reshape(B, T, H), w, tg, torch.ones(B, dtype=torch.float64), mask,
                                          config=config, bias=bb, support=ks, ref_logprobs=ref_lp)
        loss.metrics = {k: v.item() for k, v in metrics.items()}
        return (out,)

    ref = _grads(loss, hidden, weight.clone().requires_grad_(), b.clone().requires_grad_(), 3)
    m_ref = loss.metrics
    w_dt, b_dt = _distribute(mesh, weight, b)
    fast = _grads(loss, hidden, w_dt, b_dt, 3)
    _compare(res, "kept-policy", fast, ref, ref, torch.float64, slice(*chunk_range(V, world, rank)))
    res["kept-policy/metrics"] = {"kind": "exact", "err": max(abs(loss.metrics[k] - m_ref[k]) for k in m_ref)}
    res["kept-policy/metric-names"] = {"kind": "exact", "err": float(sorted(m_ref) != sorted(loss.metrics))}


def _rule_cases(res, mesh, world, rank):
    """Rules replayed across shards (top_k with top_p / min_p, both orders, both tie rules, min_tokens) against the
    unsharded replay; ties across shards from duplicated weight rows (row j and row j + V/2 equal)."""
    import fastrl
    from fastrl.ops.sharded import chunk_range

    B, T, H, V = 3, 9, 16, 60
    rules = {
        "topk-vllm": fastrl.SamplerRule(top_k=5),
        "topk-topp-minp-transformers": fastrl.SamplerRule(top_k=8, top_p=0.7, min_p=0.02, order="transformers"),
        "topk-topp-vllm": fastrl.SamplerRule(top_k=12, top_p=0.8, min_p=0.01),
        "ties-index": fastrl.SamplerRule(top_k=3, ties="index"),
        "ties-keep": fastrl.SamplerRule(top_k=3),
        "min-tokens": fastrl.SamplerRule(top_k=6, min_tokens=4, stop_token_ids=(1, 2, 45)),
    }
    for j, (name, rule) in enumerate(rules.items()):
        g = torch.Generator().manual_seed(60 + j)
        hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
        weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.6
        if name.startswith("ties"):
            weight[V // 2:] = weight[: V // 2]  # every logit tied with one on the other shard
        b = None if name.startswith("ties") else torch.randn(V, generator=g, dtype=torch.float64)
        targets = torch.randint(0, V, (B, T), generator=g)
        targets[1, 7:] = -100
        v0, v1 = chunk_range(V, world, rank)

        def run(h, w, bb):
            return fastrl.fused_logprobs(h, w, targets, bias=bb, support=rule, temperature=0.8, return_kept_mass=True)

        ref = _grads(run, hidden, weight.clone().requires_grad_(), None if b is None else b.clone().requires_grad_(),
                     j)
        w_dt, b_dt = _distribute(mesh, weight, b)
        fast = _grads(run, hidden, w_dt, b_dt, j)
        _compare(res, f"rule-{name}", fast, ref, ref, torch.float64, slice(v0, v1))
    # the policy loss over a rule: loss, gradients and the sampling/* metrics
    rule, config = rules["topk-topp-vllm"], fastrl.PolicyLossConfig(loss_type="grpo", entropy_coef=0.01)
    mask = targets != -100

    def loss(h, w, bb):
        out, metrics = fastrl.policy_loss(h, w, torch.where(mask, targets, 0), torch.ones(B, dtype=torch.float64),
                                          mask, config=config, bias=bb, support=rule)
        loss.metrics = {k: v.item() for k, v in metrics.items()}
        return (out,)

    ref = _grads(loss, hidden, weight.clone().requires_grad_(), b.clone().requires_grad_(), 9)
    m_ref = loss.metrics
    w_dt, b_dt = _distribute(mesh, weight, b)
    fast = _grads(loss, hidden, w_dt, b_dt, 9)
    _compare(res, "rule-policy", fast, ref, ref, torch.float64, slice(*chunk_range(V, world, rank)))
    res["rule-policy/metrics"] = {"kind": "exact", "err": max(abs(loss.metrics[k] - m_ref[k]) for k in m_ref)
                                  + float(sorted(m_ref) != sorted(loss.metrics))}
    refusals = {  # each refused with a ValueError that names what is not supported
        "host_sync": (lambda: fastrl.fused_logprobs(hidden, w_dt, targets, host_sync=False), "eager only"),
        "divergence-support": (lambda: fastrl.fused_divergence(
            hidden, w_dt, hidden, weight, support=fastrl.KeptSet.from_lists([[0]] * (B * T), V)), "support="),
    }
    for key, (call, words) in refusals.items():
        try:
            call()
            res[f"rule-refused/{key}"] = {"kind": "exact", "err": 1.0}
        except ValueError as e:
            res[f"rule-refused/{key}"] = {"kind": "exact", "err": float(words not in str(e))}
    try:  # top_p alone: refused by name
        fastrl.fused_logprobs(hidden, w_dt, targets, support=fastrl.SamplerRule(top_p=0.9))
        res["rule-refused/top_p-alone"] = {"kind": "exact", "err": 1.0}
    except ValueError as e:
        res["rule-refused/top_p-alone"] = {"kind": "exact", "err": float("without top_k" not in str(e))}


def _worker(suite: str, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counter = ByteCounter()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    res: dict = {}
    _logprob_cases(res, mesh, world, rank, counter)
    _kept_cases(res, mesh, world, rank)
    _rule_cases(res, mesh, world, rank)
    if suite == "two":
        _policy_cases(res, mesh, world, rank)
        _divergence_cases(res, mesh, world, rank)
    (out / f"{suite}-{rank}.json").write_text(json.dumps(res))
    end_worker()


# ------------------------------------------------------------------------------------------------- test side


def _launch(nproc: int, suite: str, tmp: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"),
           "FASTRL_BACKEND": ""}
    env.pop("FASTRL_BACKEND")
    port = 33500 + os.getpid() % 1000 + nproc
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           str(Path(__file__).resolve()), "--worker", suite, str(tmp)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((tmp / f"{suite}-{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _launch(2, "two", tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch(4, "four", tmp_path_factory.mktemp("tp4"))


def _check(results: list[dict], prefix: str) -> int:
    n = 0
    for rank, res in enumerate(results):
        for key, r in res.items():
            if not key.startswith(prefix) or key == "bytes":
                continue
            n += 1
            if r["kind"] == "exact":
                assert r["err"] <= EXACT64, f"rank {rank} {key}: sharded vs unsharded float64 differ by {r['err']:.3e}"
            else:
                tol = TOL32[r["kind"]]
                assert r["err"] <= r["unsharded"] + tol, (
                    f"rank {rank} {key}: sharded float32 error {r['err']:.3e} vs float64 exceeds the unsharded "
                    f"op's {r['unsharded']:.3e} + {tol:.0e}")
    return n


def test_logprobs_two_ranks(two):
    assert _check(two, "logprobs") >= 6 * 2 * 4


def test_logprobs_four_ranks_uneven_and_empty_shard(four):
    assert _check(four, "logprobs") >= 6 * 4 * 4


@pytest.mark.parametrize("fixture", ["two", "four"])
def test_kept_set_ids_on_one_shard_and_across(fixture, request):
    assert _check(request.getfixturevalue(fixture), "kept-") >= 2 * (2 * 6 + 4)


@pytest.mark.parametrize("fixture", ["two", "four"])
def test_rules_replayed_across_shards(fixture, request):
    assert _check(request.getfixturevalue(fixture), "rule-") >= 2 * (6 * 6 - 2 + 5 + 3)  # the ties cases: no bias


def test_policy_loss_two_ranks(two):
    assert _check(two, "policy-") >= 6 * 2 * 2 * 5


def test_divergence_two_ranks(two):
    assert _check(two, "divergence-") >= 3 * 3 * 2 * 2 * 5


@pytest.mark.parametrize("fixture", ["two", "four"])
def test_bytes_per_token_independent_of_vocabulary(fixture, request):
    for rank, res in enumerate(request.getfixturevalue(fixture)):
        small, large = res["bytes"]["61"], res["bytes"]["610"]
        assert small["calls"] == ["all_reduce"], f"rank {rank}: collectives {small['calls']}"
        for k in ("forward", "backward"):
            assert small[k] == large[k], f"rank {rank} {k}: {small[k]} bytes at V=61, {large[k]} at V=610"
        n, H = small["tokens"], small["H"]
        assert small["forward"] <= 4 * 4 * n, f"rank {rank}: forward sent {small['forward']} bytes for {n} tokens"
        assert small["backward"] <= 4 * H * n, f"rank {rank}: backward sent {small['backward']} bytes"


if __name__ == "__main__" and "--worker" in sys.argv:
    i = sys.argv.index("--worker")
    _worker(sys.argv[i + 1], Path(sys.argv[i + 2]))
