"""Rule replay without a full sort (fastrl.ops.rules): exactly ``apply_rule``'s kept sets, by construction.

* ``_top_k`` (no sort) against the stable-sort definition, with many exact ties;
* top_p after top_k sorts the survivors only (``_sort_desc``'s bound), bit for bit the full sort's result;
* ``_select_top_k`` (vocabulary blocks, a running top-(k+1)) against ``apply_rule`` for every bounded rule, with
  many exact ties, ``-inf`` entries and min_tokens, at random block widths;
* ``replay_rule`` end to end on logits that are exact (small integers), where ties are everywhere: the same
  KeptSet as ``apply_rule`` on float64 logits; the tie rows go through ``apply_rule`` itself, the others never;
* structure, not time: a top-k rule sorts no row and holds one tile; top_p after top_k sorts no row either.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import fastrl
from fastrl import SamplerRule as SR
from fastrl.ops import budget, rules
from fastrl.ops.rules import apply_rule
from fastrl.reference import rule_mask_reference

CPU = torch.device("cpu")


def tied_logits(n, V, seed, dtype=torch.float32):
    """Rows with many exact ties: small multiples of 1/4, a row all equal, a row a third -inf, a row one finite."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randint(-4, 5, (n, V), generator=g).to(dtype) * 0.25)
    z[0] = 1.0
    z[1, ::3] = -math.inf
    z[2] = -math.inf
    z[2, V // 2] = 0.5
    if n > 4:
        z[4] = torch.randn(V, generator=g, dtype=dtype)  # no ties
    return z


def test_top_k_equals_the_stable_sort_definition():
    for seed, V in itertools.product(range(6), (7, 64, 301)):
        z = tied_logits(6, V, seed)
        for k in (1, 2, 5, 64, 400):
            vals, order = torch.sort(z, dim=-1, descending=True, stable=True)  # value desc, id asc
            first = (torch.arange(V) < min(k, V)) & (vals > -math.inf)
            want_index = torch.zeros_like(first).scatter_(1, order, first)
            kth = vals[:, min(k, V) - 1 : min(k, V)]
            want_keep = (z >= kth) & (z > -math.inf)
            assert torch.equal(rules._top_k(z, k, "index"), want_index), (seed, V, k)
            assert torch.equal(rules._top_k(z, k, "keep"), want_keep), (seed, V, k)


def test_bounded_sort_is_the_full_sort():
    z = tied_logits(6, 300, 0)
    for k in (1, 3, 20):
        zk = z.masked_fill(~rules._top_k(z, k, "index"), -math.inf)  # at most k finite per row, ties among them
        bound = rules._finite_bound(zk > -math.inf)
        assert bound * 8 <= 300
        vals_b, ids_b = rules._sort_desc(zk, bound)
        vals, ids = torch.sort(zk, dim=-1, descending=True, stable=True)
        assert torch.equal(vals_b, vals)
        finite = vals[:, :bound] > -math.inf  # the order among -inf entries is unspecified (none of them is kept)
        assert torch.equal(ids_b[finite], ids[:, :bound][finite])


RULES = [SR(top_k=k, top_p=p, min_p=mp, ties=ties, order=order, min_tokens=mt, stop_token_ids=(0, 3) if mt else ())
         for k, p, mp, ties, order, mt in itertools.product((0, 1, 3, 8), (1.0, 0.9, 0.3), (0.0, 0.2),
                                                           ("keep", "index"), ("vllm", "transformers"), (0, 2))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_top_p_after_top_k_sorts_the_survivors_only_bit_for_bit(dtype, monkeypatch):
    """apply_rule with the bounded sort equals apply_rule with the whole row sorted (the definition before)."""
    zs = [tied_logits(6, V, seed, dtype) for seed, V in ((0, 97), (1, 256), (2, 301))]
    zs.append(torch.randn(6, 300, generator=torch.Generator().manual_seed(3), dtype=dtype))
    pos = torch.arange(6)
    got = [[apply_rule(z, r, pos) for r in RULES] for z in zs]
    monkeypatch.setattr(rules, "_finite_bound", lambda keep: None)  # the whole row sorted
    for z, row in zip(zs, got):
        for r, g in zip(RULES, row):
            assert torch.equal(g, apply_rule(z, r, pos)), r


def _as_mask(rows, ids, vals, n, V, z):
    """The kept (row, id, logit) triples as a mask, after checking their order and that each logit is the row's own
    value at that id in ``z`` (what the kept-set engine then takes instead of computing it)."""
    key = rows * (V + 1) + ids
    assert bool((key[1:] > key[:-1]).all()), "pairs not in row-major, ascending-id order"
    assert torch.equal(vals, z[rows, ids]), "a kept logit is not the row's value at that id"
    m = torch.zeros(n, V, dtype=torch.bool)
    m[rows, ids] = True
    return m


def test_select_top_k_equals_apply_rule():
    g = torch.Generator().manual_seed(0)
    bounded = [r for r in RULES if rules._bounded(r)] + [SR(top_k=64), SR(top_k=64, ties="index", min_p=0.3)]
    assert any(r.min_p for r in bounded) and any(r.min_tokens for r in bounded)
    for seed, V in ((0, 70), (1, 200), (2, 333)):
        z = tied_logits(7, V, seed)
        pos = torch.arange(7)
        for r in bounded:
            cols = int(torch.randint(1, V + 1, (1,), generator=g))
            got = rules._select_top_k(lambda v0, v1: z[:, v0:v1].clone(), lambda rr: z.index_select(0, rr),
                                      7, V, cols, r, pos, CPU)
            assert torch.equal(_as_mask(*got, 7, V, z), apply_rule(z, r, pos)), (r, V, cols)


def _exact_inputs(B, T, H, V, seed):
    """Hidden states and weights of small integers: every logit is an integer, the same whatever the summation
    order (float32 or float64, any GEMM), and exact ties are common (a third of the ids have a twin row)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-3, 4, (B, T, H), generator=g).float()
    w = torch.randint(-20, 21, (V, H), generator=g).float()
    w[-(V // 3) :] = w[: V // 3].clone()
    t = torch.randint(0, V, (B, T), generator=g)
    t[0, -2:] = -100
    return h, w, t


@pytest.mark.parametrize("rule", [SR(top_k=5), SR(top_k=5, ties="index"), SR(top_k=3, min_p=0.5, ties="index"),
                                  SR(top_k=4, order="transformers", min_tokens=3, stop_token_ids=(1, 7)),
                                  SR(top_k=6, top_p=0.8), SR(top_k=6, top_p=0.8, ties="index", order="transformers")],
                         ids=lambda r: f"k{r.top_k}-p{r.top_p}-mp{r.min_p}-{r.ties}-{r.order}-mt{r.min_tokens}")
def test_replay_rule_is_apply_rule_on_exact_logits(rule, monkeypatch):
    B, T, H, V = 3, 9, 12, 97
    h, w, t = _exact_inputs(B, T, H, V, 0)
    # 4-token chunks, 20-column blocks: chunk and block seams everywhere
    monkeypatch.setitem(budget.BUDGETS, "rule", {"cpu": budget.TileBudget(elems=4 * 20, live=4, rows=4)})
    kept, want_out = rule_mask_reference(h, w, t, rule, dtype=torch.float64)
    calls = []
    real = rules.apply_rule
    monkeypatch.setattr(rules, "apply_rule", lambda z, r, p=None: calls.append(z.shape[0]) or real(z, r, p))
    ks, outside = fastrl.replay_rule(h, w, t, rule)
    got = torch.zeros(B * T, V, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(B * T), ks.sizes())
    got[rows, ks.ids] = True
    assert torch.equal(got, kept.reshape(B * T, V))
    assert torch.equal(outside, want_out)
    if rules._bounded(rule):  # rows with a tie at the k-th value, and only those, go to apply_rule
        assert 0 < sum(calls) < (t != -100).sum(), calls


def test_replay_rule_bounded_path_without_ties_calls_no_apply_rule(monkeypatch):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(20, 16, generator=g), torch.randn(500, 16, generator=g)
    t = torch.randint(0, 500, (20,), generator=g)
    monkeypatch.setitem(budget.BUDGETS, "rule", {"cpu": budget.TileBudget(elems=8 * 64, live=4, rows=8)})
    monkeypatch.setattr(rules, "apply_rule", lambda *a: pytest.fail("a tie-free row reached apply_rule"))
    ks, outside = fastrl.replay_rule(h, w, t, SR(top_k=16))
    z = h.double() @ w.double().T
    top = torch.topk(z, 16).indices.sort(dim=-1).values
    assert torch.equal(ks.sizes(), 16 + outside.long())
    for i in range(20):
        want = sorted(set(top[i].tolist()) | {int(t[i])})
        assert ks[i : i + 1].ids.tolist() == want


class _Sorts(TorchDispatchMode):
    """The widths of every sort / topk input (inside replay_rule, which runs no custom op)."""

    def __init__(self):
        super().__init__()
        self.sorts, self.topks = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in ("aten.sort", "aten.argsort"):
            self.sorts.append(tuple(args[0].shape))
        elif name == "aten.topk":
            self.topks.append((tuple(args[0].shape), args[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rule", [SR(top_k=64), SR(top_k=64, ties="index", min_p=0.1),
                                  SR(top_k=64, top_p=0.9), SR(top_k=64, top_p=0.9, min_p=0.1, order="transformers")],
                         ids=["top_k", "top_k-index-min_p", "top_k-top_p", "top_k-top_p-min_p-transformers"])
def test_no_row_is_sorted(rule, monkeypatch):
    """What the issue asked: rules with top_k select (over vocabulary blocks, never a whole row), and top_p after
    top_k sorts its survivors only."""
    N, H, V = 40, 16, 4096
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    # 8-token chunks of 1024-column blocks
    monkeypatch.setitem(budget.BUDGETS, "rule", {"cpu": budget.TileBudget(elems=8 * 1024, live=4, rows=8)})
    with _Sorts() as rec:
        fastrl.replay_rule(h, w, t, rule)
    assert all(s[-1] < V for s in rec.sorts), rec.sorts
    # topk with k + 1 over vocabulary blocks, then over the small buffer (transformers' min_p: a topk of 1)
    assert rec.topks and all(shape[-1] <= 1024 and k <= 65 or k == 1 for shape, k in rec.topks), rec.topks


def test_bounded_replay_holds_one_tile():
    """A top-k replay's peak allocation is one rule tile plus O(N k) (the sort path held the tile, the sort's values
    and its int64 ids: four tiles)."""
    N, H, V = 512, 64, 32768
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) / 8
    t = torch.randint(0, V, (N,), generator=g)
    rule = SR(top_k=64)
    fastrl.replay_rule(h, w, t, rule)  # warm
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fastrl.replay_rule(h, w, t, rule)
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    tile = budget.tile_budget("rule").elems * 4
    small = 64 * N * 65 * 8  # buffers of N x (k + 1) values and ids, their merges, the CSR output
    assert tile <= peak <= tile + small, (peak / 2**20, tile / 2**20)


def _short_rows(V=256, seed=0):
    """Rows whose rules keep different numbers of ids, id 0 among them: the bounded sort pads the short rows."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(6, V, generator=g, dtype=torch.float64)
    z[0, 0] = z[0].max() + 4.0  # id 0 dominates: min_p keeps it (nearly) alone
    z[1, 0] = z[1].max() + 0.1  # id 0 first, the rest of the top 5 close behind
    z[2] = -math.inf  # two finite entries, id 0 one of them
    z[2, 0], z[2, 7] = 1.0, 0.5
    z[3, 10:20] = z[3].max() + 1.0  # ten ids tied first: ties="keep" keeps all ten past top_k=5
    z[4, 0] = z[4].topk(2).values[1] - 1e-3  # id 0 the third largest
    return z


@pytest.mark.parametrize("order", ["vllm", "transformers"])
@pytest.mark.parametrize("ties", ["keep", "index"])
def test_a_rows_set_does_not_depend_on_the_other_rows(order, ties, monkeypatch):
    """Found by the vLLM end-to-end test: in a batch whose rows kept different numbers of ids after top_k, top_p
    sorted the survivors packed into a rectangle, and the padding's id (0) was written back over id 0's flag."""
    z = _short_rows()
    rule_set = [SR(top_k=5, top_p=0.97, min_p=0.1, order=order, ties=ties),
                SR(top_k=5, top_p=0.9, order=order, ties=ties), SR(top_k=5, top_p=0.5, order=order, ties=ties)]
    got = {r: apply_rule(z, r) for r in rule_set}
    for r, m in got.items():
        for i in range(z.shape[0]):
            assert torch.equal(m[i], apply_rule(z[i : i + 1], r)[0]), (r, i)
        assert bool(m[:3, 0].all()), (r, m[:3, 0])  # id 0 is the top id of rows 0-2: always kept
    monkeypatch.setattr(rules, "_finite_bound", lambda keep: None)  # the definition: whole rows sorted
    for r, m in got.items():
        assert torch.equal(m, apply_rule(z, r)), r


def test_select_top_k_rows_with_fewer_finite_logits_than_k(monkeypatch):
    """A row with fewer than k + 1 finite logits: the running buffer holds padding (-inf at a block's first id)
    next to a real entry at that id; the stages past top_k must see the real value. Against the definition (whole
    rows sorted)."""
    V, cols = 64, 16
    z = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    z[1] = -math.inf
    z[1, [16, 32, 40]] = torch.tensor([0.3, 0.2, 0.1])  # at two blocks' first ids
    z[2] = -math.inf
    z[2, 48] = 1.0
    rule_set = (SR(top_k=3, top_p=0.9), SR(top_k=3, top_p=0.99, order="transformers"), SR(top_k=5, top_p=0.99),
                SR(top_k=3))
    got = [_as_mask(*rules._select_top_k(lambda v0, v1: z[:, v0:v1].clone(), lambda rr: z.index_select(0, rr), 3, V,
                                         cols, r, None, CPU), 3, V, z) for r in rule_set]
    assert bool(got[0][1, [16, 32, 40]].all()) and bool(got[0][2, 48])
    monkeypatch.setattr(rules, "_finite_bound", lambda keep: None)
    for r, m in zip(rule_set, got):
        assert torch.equal(m, apply_rule(z, r)), r


@pytest.mark.parametrize("order", ["vllm", "transformers"])
def test_stages_after_top_k_see_a_real_entry_next_to_padding_with_its_id(order):
    """The running buffer of a row with few finite logits can hold padding (-inf) with the id of a real entry; the
    tile the stages past top_k get must hold the real value (a plain scatter let the padding win)."""
    top_v = torch.tensor([[0.3, 0.1, -math.inf]])
    top_i = torch.tensor([[16, 5, 16]])
    keep = torch.tensor([[True, True, False]])
    rows, ids, vals = rules._finish_after_top_k(top_v, top_i, keep, None, SR(top_k=2, top_p=0.99, order=order), 64,
                                                8)
    assert rows.tolist() == [0, 0] and ids.tolist() == [5, 16] and vals.tolist() == top_v[0, [1, 0]].tolist()


def test_every_rule_keeps_a_rows_set_whatever_the_batch():
    """Batch independence over the whole rule grid (min_tokens too), on rows with ties, -inf entries and uneven
    numbers of survivors."""
    zs = [(_short_rows(V=200, seed=1).float(), torch.arange(6)), (tied_logits(7, 200, 5), torch.arange(7))]
    for z, pos in zs:
        for r in RULES:
            m = apply_rule(z, r, pos)
            for i in range(z.shape[0]):
                assert torch.equal(m[i], apply_rule(z[i : i + 1], r, pos[i : i + 1])[0]), (r, i)


def _floor_rows(V, k, seed):
    """Rows for the segment floor: tied_logits' (a constant row, -inf thirds, one finite entry, small multiples of
    1/4), smooth rows, and a row whose k largest (5.0, in k distinct segments) stand above a constant rest: the
    floor is the rest's value, the buffer holds exactly the k fives, and the floor's padding lies past them."""
    z = torch.cat([tied_logits(6, V, seed), torch.randn(3, V, generator=torch.Generator().manual_seed(seed))])
    five = torch.zeros(1, V)
    five[0, torch.arange(k) * rules._SEG + 3] = 5.0
    return torch.cat([z, five])


@pytest.mark.parametrize("cols", [2500, 1111, 700])
def test_select_top_k_segment_floor_equals_apply_rule(cols, monkeypatch):
    """Blocks of at least c = k + 1 whole segments: the first takes its floor from its segment maxima, not from a
    topk of the block (no topk of a block's width runs), and every later block adds only its entries above the
    floor. The kept sets are apply_rule's; only rows with a tie at the k-th value are recomputed whole."""
    V = 2500
    widths, asked = [], []
    real_topk = torch.topk

    def topk(x, k, *args, **kwargs):
        if not asked and k > 1:  # the running top-(k+1)'s, not apply_rule's on the rows recomputed whole nor
            widths.append(x.shape[-1])  # transformers' min_p's top-1 on whole rows of top_k's survivors
        return real_topk(x, k, *args, **kwargs)

    for r in (SR(top_k=3), SR(top_k=5, ties="index"), SR(top_k=20, top_p=0.9), SR(top_k=20, min_p=0.2),
              SR(top_k=4, order="transformers", top_p=0.7, min_p=0.1)):
        z = _floor_rows(V, r.top_k, r.top_k)
        n = z.shape[0]

        def full_rows(rr, z=z):
            asked.extend(rr.tolist())
            return z.index_select(0, rr)

        widths.clear(), asked.clear()
        monkeypatch.setattr(torch, "topk", topk)
        got = rules._select_top_k(lambda v0, v1, z=z: z[:, v0:v1].clone(), full_rows, n, V, cols, r, None, CPU)
        monkeypatch.setattr(torch, "topk", real_topk)
        assert torch.equal(_as_mask(*got, n, V, z), apply_rule(z, r)), (r, cols)
        assert max(widths) < cols // 2, (r, cols, widths)  # segment maxima and buffers, never a block
        assert 0 in asked and n - 1 not in asked and 4 not in asked, (r, asked)  # constant row: tie; fives: none


def test_running_top_holds_the_c_largest_with_their_multiplicity():
    """_running_top's buffer against a sort of the row: the c largest values exactly (ties and -inf included), at
    block widths that take the segment floor, the per-block topk, or both."""
    V = 3000
    z = torch.cat([tied_logits(6, V, 7), torch.randn(2, V, generator=torch.Generator().manual_seed(7))])
    for c, cols in itertools.product((1, 4, 30), (V, 1500, 977, 100, 31)):
        top_v, top_i = rules._running_top(((v0, z[:, v0 : v0 + cols].clone()) for v0 in range(0, V, cols)), c)
        want = torch.sort(z, dim=-1, descending=True).values[:, :c]
        assert torch.equal(top_v, want), (c, cols)
        real = top_v > want[:, -1:]  # entries above the c-th value: their ids are exact
        assert torch.equal(z.gather(1, top_i)[real], top_v[real]), (c, cols)
