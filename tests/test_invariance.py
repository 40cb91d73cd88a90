"""Reproducibility (issue 47): batch invariance and deterministic gradients.

Batch invariance: a token's log-prob, entropy, per-token loss terms, KL terms and divergence are bitwise equal
(``torch.equal``) whether it is scored alone or inside batches of 7, 64 and 1000 rows, shuffled, with half of the
other rows masked, under memory budgets that give one chunk and many, and under each kept-set plan. The torch
backend is invariant by default; the Triton backends in the batch-invariant mode (``fastrl.set_batch_invariant``).

Deterministic gradients: two backward runs under ``torch.use_deterministic_algorithms(True)`` give bitwise-equal
hidden-state and weight gradients on every path.

CPU: the torch backend and the Triton kernels under the interpreter (small H and V, the kernels' real block sizes);
on a CUDA machine (``bench/gpu_session.sh``) the same tests run on CUDA tensors with the compiled kernels.
"""

from __future__ import annotations

import contextlib
import os

# cuBLAS under torch.use_deterministic_algorithms(True) needs a fixed workspace configuration (PyTorch raises at the
# call otherwise); set before this file's first test (an earlier CUDA test file of the same run may already have
# created cuBLAS's workspace, but PyTorch's check reads the variable at each call)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

import fastrl  # noqa: E402
from fastrl.losses.arithmetic import kl_estimate  # noqa: E402
from fastrl.ops import budget  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
DEVICE = torch.device("cuda" if CUDA else "cpu")
SM90 = CUDA and torch.cuda.get_device_capability()[0] >= 9

# implementations by name ("impl", not "backend": conftest skips any "backend" starting with "triton" on a GPU
# machine, where these run on CUDA tensors instead)
IMPLS = ["torch", "triton-hybrid", "triton-fused", "triton-sm90"]
H = 64  # a multiple of 8: TMA rows for sm90 in every dtype
V = {"torch": 2600, "triton": 300}  # torch: two VOCAB_TILE tiles and a ragged one; interpreter: two kernel blocks
BATCHES = (1, 7, 64, 1000)
# the interpreter's cost follows the rows (padded to whole 128-row blocks on the hybrid): its largest batch is 300
# rows (the kernels compute each row block on its own, so 300 rows already span three blocks and a ragged one)
INTERP_BATCHES = (1, 7, 64, 300)
PROBES = 3  # token rows followed through every batch


def _skip_unless_runs(impl: str) -> None:
    if impl == "torch":
        return
    if not (INTERPRET or CUDA):
        pytest.skip("the Triton kernels need TRITON_INTERPRET=1 on a CPU-only machine")
    if impl == "triton-sm90" and CUDA and not SM90:
        pytest.skip("triton-sm90 needs compute capability 9.0 or newer")


def _vocab(impl: str) -> int:
    return V["torch"] if impl == "torch" or CUDA else V["triton"]


def _batches(impl: str) -> tuple[int, ...]:
    return BATCHES if impl == "torch" or CUDA else INTERP_BATCHES


def _few_batches(impl: str) -> tuple[int, ...]:
    """The batches of the paths whose interpreted kernels are slowest (two heads, or three plans): 7 and 300 rows."""
    return _batches(impl)[1:] if impl == "torch" or CUDA else (7, 300)


def _grad_rows(impl: str) -> int:
    return 256 if impl == "torch" or CUDA else 64


@contextlib.contextmanager
def _mode(invariant: bool = True, memory: int | None = None):
    prev_inv = fastrl.set_batch_invariant(invariant)
    prev_mem = budget.set_memory_budget(memory) if memory is not None else budget.get_memory_budget()
    try:
        yield
    finally:
        fastrl.set_batch_invariant(prev_inv)
        budget.set_memory_budget(prev_mem)


def _data(Vn: int, n_rows: int = 1000, Ht: int = 48):
    g = torch.Generator().manual_seed(47)
    d = dict(
        h=torch.randn(n_rows, H, generator=g), w=torch.randn(Vn, H, generator=g) * 0.3,
        t=torch.randint(0, Vn, (n_rows,), generator=g), ref=-torch.rand(n_rows, generator=g) * 4,
        ht=torch.randn(n_rows, Ht, generator=g), wt=torch.randn(Vn, Ht, generator=g) * 0.3,
    )
    return {k: v.to(DEVICE) for k, v in d.items()}


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [n] of the 1000-row pool: the probes where they fit, shuffled; live [n] bool: the probes and half of the
    others; where each probe sits [min(n, PROBES)])."""
    g = torch.Generator().manual_seed(seed)
    k = min(n, PROBES)
    others = PROBES + torch.randperm(1000 - PROBES, generator=g)[: n - k]
    rows = torch.cat([torch.arange(k), others])[torch.randperm(n, generator=g)]
    live = (rows < PROBES) | (torch.rand(n, generator=g) < 0.5)
    where = torch.stack([(rows == p).nonzero()[0, 0] for p in range(k)])
    return rows.to(DEVICE), live.to(DEVICE), where.to(DEVICE)


def _assert_same(name: str, got: torch.Tensor, want: torch.Tensor, context: str) -> None:
    if not torch.equal(got, want):
        got, want = got.reshape(-1), want.reshape(-1)
        bad = (got != want).nonzero()[0].tolist()
        raise AssertionError(f"{name} not bitwise equal {context} at probe {bad}: got {got.tolist()}, "
                             f"alone {want.tolist()} (diff {(got - want).abs().max().item():.3g})")


def _alone(fn, n_probes: int = PROBES) -> list[tuple[torch.Tensor, ...]]:
    """Each probe scored in a batch of its own: fn(rows [1], live [1]) -> tuple of [1] tensors."""
    one = torch.ones(1, dtype=torch.bool, device=DEVICE)
    outs = [fn(torch.tensor([p], device=DEVICE), one) for p in range(n_probes)]
    return [torch.cat(parts) for parts in zip(*outs)]


def _check_batches(names, fn, batches=BATCHES, context: str = "") -> None:
    alone = _alone(fn)
    for n in batches:
        rows, live, where = _batch(n, seed=n)
        outs = fn(rows, live)
        for name, got, want in zip(names, outs, alone):
            _assert_same(name, got[where], want[: where.numel()], f"in a batch of {n}{context}")


# ---------------------------------------------------------------------------------------------------------
# batch invariance
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_logprobs_batch_invariant(impl):
    """fused_logprobs (+ entropy), full softmax; and the k3 KL against a reference built on them."""
    _skip_unless_runs(impl)
    d = _data(_vocab(impl))

    def fn(rows, live):
        t = torch.where(live, d["t"][rows], -100)
        lp, ent = fastrl.fused_logprobs(d["h"][rows], d["w"], t, backend=impl)
        return lp, ent, kl_estimate(lp, d["ref"][rows])

    with _mode():
        _check_batches(("log-prob", "entropy", "k3 KL"), fn, batches=_batches(impl))


@pytest.mark.parametrize("impl", ["torch", "triton-sm90"])
def test_logprobs_no_sync_batch_invariant(impl):
    """The no-sync path (``host_sync=False``, as under torch.compile): masked rows are computed with zeroed hidden
    states instead of being dropped, so a probe shares its tiles with them; still the same bits."""
    _skip_unless_runs(impl)
    d = _data(_vocab(impl))

    def fn(rows, live):
        t = torch.where(live, d["t"][rows], -100)
        return fastrl.fused_logprobs(d["h"][rows], d["w"], t, backend=impl, host_sync=False)

    with _mode():
        _check_batches(("log-prob", "entropy"), fn, batches=_batches(impl)[1:])


def test_logprobs_invariant_under_budgets_and_chunks():
    """The torch backend's tiles never follow the budget or the vocab chunk of the caller's budget."""
    d = _data(V["torch"])

    def fn(rows, live):
        t = torch.where(live, d["t"][rows], -100)
        return fastrl.fused_logprobs(d["h"][rows], d["w"], t, backend="torch")

    for memory in (1 << 20, 1 << 30):
        with _mode(memory=memory):
            _check_batches(("log-prob", "entropy"), fn, batches=(7, 1000), context=f" at a {memory}-byte budget")


@pytest.mark.parametrize("impl", ["torch", "triton-hybrid", "triton-sm90"])
def test_policy_loss_terms_batch_invariant(impl):
    """policy_loss's per-token log-probs (the one-pass engine: one chunk, many chunks, a small byte budget) are those
    of fused_logprobs alone (torch: bitwise path A's), and so are its per-token k3 KL terms."""
    _skip_unless_runs(impl)
    d = _data(_vocab(impl))
    cfg = fastrl.PolicyLossConfig(loss_type="dapo", beta=0.04)

    def loss_fn(chunk_tokens=None):
        def fn(rows, live):
            n = rows.numel()
            h = d["h"][rows].clone().requires_grad_(True)
            _, _, lp = fastrl.policy_loss(
                h[None], d["w"], d["t"][rows][None], torch.ones(1, device=DEVICE), live[None], config=cfg,
                ref_logprobs=d["ref"][rows][None], backend=impl, chunk_tokens=chunk_tokens, return_logprobs=True)
            lp = lp.reshape(n)
            return lp, kl_estimate(lp, d["ref"][rows])
        return fn

    with _mode():
        alone = _alone(lambda rows, live: fastrl.fused_logprobs(d["h"][rows], d["w"], d["t"][rows], backend=impl))
        lp1, kl1 = _alone(loss_fn())  # a batch of 1 is one chunk whatever the chunk size or budget
    # one chunk, chunks of 16 tokens, and (torch) the chunks a 1 MiB budget allows
    settings = ((None, None), (16, None), (None, 1 << 20)) if impl == "torch" else ((None, None), (16, None))
    for chunk_tokens, memory in settings:
        with _mode(memory=memory):
            for n in (7, _batches(impl)[-1]):
                rows, live, where = _batch(n, seed=n + 1)
                lp, kl = loss_fn(chunk_tokens)(rows, live)
                ctx = f" in a batch of {n} (chunk_tokens={chunk_tokens}, budget={memory})"
                if impl == "torch":  # the one-pass statistics are path A's, bitwise
                    _assert_same("policy_loss log-prob vs fused_logprobs", lp[where], alone[0][: where.numel()], ctx)
                _assert_same("policy_loss log-prob", lp[where], lp1[: where.numel()], ctx)
                _assert_same("k3 KL term", kl[where], kl1[: where.numel()], ctx)


def test_exact_kl_term_batch_invariant():
    """The exact KL inside the one-pass chunks (torch backend): with one live token and the others computed but
    masked (host_sync=False: no compaction, so they share its chunk), the ``kl`` metric is that token's KL; the same
    alone, in batches of 7, 64 and 1000, in one chunk or chunks of 16."""
    d = _data(V["torch"])
    cfg = fastrl.PolicyLossConfig(loss_type="dapo", beta=0.04, kl_estimator="exact")
    g = torch.Generator().manual_seed(3)
    ref_h, ref_w = torch.randn(1000, H, generator=g).to(DEVICE), (torch.randn(V["torch"], H, generator=g) * 0.3).to(DEVICE)

    def kl_of(rows, live_row, chunk_tokens):
        n = rows.numel()
        live = torch.zeros(1, n, dtype=torch.bool, device=DEVICE)
        live[0, live_row] = True
        h = d["h"][rows].clone().requires_grad_(True)
        _, metrics = fastrl.policy_loss(
            h[None], d["w"], d["t"][rows][None], torch.ones(1, device=DEVICE), live, config=cfg,
            ref_hidden=ref_h[rows][None], ref_weight=ref_w, backend="torch",
            chunk_tokens=chunk_tokens, host_sync=False)
        return metrics["kl"]

    with _mode():
        alone = [kl_of(torch.tensor([p], device=DEVICE), 0, None) for p in range(PROBES)]
        for chunk_tokens in (None, 16):
            for n in (7, 64, 1000):
                rows, _, where = _batch(n, seed=n + 2)
                for p in range(min(n, PROBES)):
                    _assert_same("exact KL", kl_of(rows, int(where[p]), chunk_tokens), alone[p],
                                 f"in a batch of {n} (chunk_tokens={chunk_tokens})")


@pytest.mark.parametrize("impl", ["torch", "triton", "triton-sm90"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergence_batch_invariant(impl, beta):
    _skip_unless_runs(impl)
    if impl != "torch" and not CUDA and beta != 0.5:
        pytest.skip("under the interpreter only beta=0.5 (its statistics pass and the JSD pass cover the KLs' kernels)")
    d = _data(_vocab(impl))

    def fn(rows, live):
        return fastrl.fused_divergence(d["h"][rows], d["w"], d["ht"][rows], d["wt"], beta=beta, mask=live,
                                       with_entropy=True, backend=impl)

    with _mode():
        _check_batches(("divergence", "entropy"), fn, batches=_few_batches(impl))


def _kept_sets(Vn: int, K: int = 8, pool: int = 40):
    """Per row of the 1000-row pool: K ids from a small shared pool (neighbours overlap: union plans are real),
    the row's target among them."""
    g = torch.Generator().manual_seed(5)
    base = torch.randperm(Vn, generator=g)[:pool]
    ids = torch.stack([base[torch.randperm(pool, generator=g)[:K]] for _ in range(1000)])
    return ids


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_kept_plans_batch_invariant(impl):
    """A KeptSet's log-prob and entropy: the same in every batch and under each plan (host union, fixed union,
    per-row)."""
    _skip_unless_runs(impl)
    Vn = _vocab(impl)
    d = _data(Vn)
    ids = _kept_sets(Vn).to(DEVICE)
    t = ids[:, 0].clone()  # the target is kept
    plans = {"host union": (True, True), "fixed union": (True, False), "per-row": (False, True)}
    results = {}
    for plan, (overlap, sync) in plans.items():
        def fn(rows, live):
            ks = fastrl.KeptSet.from_padded(ids[rows], Vn)
            ks = fastrl.KeptSet(ks.ids, ks.offsets, Vn, overlap=overlap, width=ids.shape[1])
            tt = torch.where(live, t[rows], -100)
            return fastrl.fused_logprobs(d["h"][rows], d["w"], tt, support=ks, backend=impl, host_sync=sync)
        with _mode():
            _check_batches(("kept log-prob", "kept entropy"), fn, batches=_few_batches(impl),
                           context=f" ({plan} plan)")
            results[plan] = _alone(fn)
    for plan, got in results.items():
        for name, g, w in zip(("kept log-prob", "kept entropy"), got, results["per-row"]):
            _assert_same(name, g, w, f"under the {plan} plan against the per-row plan")


# ---------------------------------------------------------------------------------------------------------
# deterministic gradients
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _deterministic():
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev)


def _grads_twice(run) -> None:
    """run() -> (loss, leaves); two runs' leaf gradients bitwise equal."""
    got = []
    with _deterministic():
        for _ in range(2):
            loss, leaves = run()
            loss.backward()
            got.append([x.grad.clone() for x in leaves])
    for i, (a, b) in enumerate(zip(*got)):
        assert torch.equal(a, b), f"gradient {i} differs between two runs: max diff {(a - b).abs().max().item():.3g}"


def _leaves(d, n: int, names=("h", "w")):
    return [d[k][:n].clone().requires_grad_(True) if k in ("h", "ht") else d[k].clone().requires_grad_(True)
            for k in names]


@pytest.mark.parametrize("impl", IMPLS)
def test_logprob_gradients_deterministic(impl):
    _skip_unless_runs(impl)
    d = _data(_vocab(impl))

    n = _grad_rows(impl)

    def run():
        h, w = _leaves(d, n)
        lp, ent = fastrl.fused_logprobs(h, w, d["t"][:n], backend=impl)
        return (lp * d["ref"][:n]).sum() + ent.sum() * 0.1, (h, w)

    _grads_twice(run)


@pytest.mark.parametrize("impl", ["torch", "triton-hybrid", "triton-sm90"])
def test_policy_loss_gradients_deterministic(impl):
    _skip_unless_runs(impl)
    d = _data(_vocab(impl))
    cfg = fastrl.PolicyLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01)

    n = _grad_rows(impl)
    T = n // 4

    def run():
        h, w = _leaves(d, n)
        adv = torch.linspace(-1, 1, 4, device=DEVICE)
        loss, _ = fastrl.policy_loss(h.view(4, T, H), w, d["t"][:n].view(4, T), adv,
                                     torch.ones(4, T, dtype=torch.bool, device=DEVICE), config=cfg,
                                     ref_logprobs=d["ref"][:n].view(4, T), backend=impl, chunk_tokens=3 * n // 8)
        return loss, (h, w)

    _grads_twice(run)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_divergence_gradients_deterministic(impl):
    _skip_unless_runs(impl)
    d = _data(_vocab(impl))

    n = _grad_rows(impl)

    def run():
        h, w = _leaves(d, n)
        div = fastrl.fused_divergence(h, w, d["ht"][:n], d["wt"], beta=0.5, backend=impl)
        return div.sum(), (h, w)

    _grads_twice(run)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("overlap", [True, False], ids=["union", "per-row"])
def test_kept_gradients_deterministic(impl, overlap):
    _skip_unless_runs(impl)
    Vn = _vocab(impl)
    d = _data(Vn)
    n = _grad_rows(impl)
    ids = _kept_sets(Vn)[:n].to(DEVICE)

    def run():
        h, w = _leaves(d, n)
        ks = fastrl.KeptSet.from_padded(ids, Vn)
        ks = fastrl.KeptSet(ks.ids, ks.offsets, Vn, overlap=overlap, width=ids.shape[1])
        lp, ent = fastrl.fused_logprobs(h, w, ids[:, 0], support=ks, backend=impl)
        return (lp * d["ref"][:n]).sum() + ent.sum() * 0.1, (h, w)

    _grads_twice(run)


# ---------------------------------------------------------------------------------------------------------
# the switch
# ---------------------------------------------------------------------------------------------------------


def test_set_batch_invariant_api():
    from fastrl.ops import config

    assert fastrl.set_batch_invariant is config.set_batch_invariant and "set_batch_invariant" in fastrl.__all__
    prev = fastrl.set_batch_invariant(True)
    try:
        assert fastrl.get_batch_invariant() and config.invariant_splits() == config.INVARIANT_SPLITS
        assert fastrl.set_batch_invariant(False) is True and config.invariant_splits() is None
        with pytest.raises(TypeError, match="set_batch_invariant takes a bool, got int"):
            fastrl.set_batch_invariant(1)
        with pytest.raises(ValueError, match="FASTRL_BATCH_INVARIANT must be 0/1"):
            config._parse_flag("maybe")
        assert config._parse_flag("on") and not config._parse_flag("")
    finally:
        fastrl.set_batch_invariant(prev)
