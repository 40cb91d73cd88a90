"""Transformers-order rules on logits with exact ties, at ``top_p < 1``, against transformers' own warpers.

``test_supports.py`` compares ``apply_rule(order="transformers")`` with ``TopKLogitsWarper`` / ``TopPLogitsWarper`` /
``MinPLogitsWarper`` exactly on tied logits only at ``top_p == 1``: where the top-p cut falls inside a group of
equal logits, transformers keeps some of the group in ``torch.sort``'s order, which no rule reproduces. What holds
whatever that order is, and is checked here row by row (V=64, 40 rows of logits rounded to integers, so many ties):

* outside the tie group at the cut (the ids whose logit equals the smallest one transformers keeps),
  ``ties="keep"`` (the default) keeps exactly the ids transformers keeps; inside it, the whole group;
* ``ties="index"`` keeps a subset of that; where top-p alone cuts (no top-k, whose ties transformers keeps whole),
  it keeps what transformers keeps outside the group and, inside it, as many ids as transformers (the cut depends on
  the sorted values alone), the lowest ids first.
"""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl.ops.rules import apply_rule
from test_supports import _logit_tiles, _transformers_mask

SR = fastrl.SamplerRule


# (top_k, top_p, min_p, whether some row's top-p cut splits a tie group on these tiles: then the rules differ)
CASES = [(0, 0.9, 0.0, True), (0, 0.7, 0.0, True), (0, 0.5, 0.2, True), (64, 0.95, 0.0, True), (10, 0.8, 0.05, True),
         (3, 0.3, 0.0, True), (0, 0.6, 0.5, False)]


@pytest.mark.parametrize("top_k,top_p,min_p,splits", CASES)
def test_transformers_order_ties_at_top_p_below_one(top_k, top_p, min_p, splits):
    _, ties = _logit_tiles()
    rule = dict(top_k=top_k, top_p=top_p, min_p=min_p, order="transformers")
    theirs = _transformers_mask(ties, SR(**rule))
    keep = apply_rule(ties, SR(**rule, ties="keep"))
    index = apply_rule(ties, SR(**rule, ties="index"))
    split = 0  # rows whose cut falls inside a tie group (where the two tie rules differ)
    for i in range(ties.shape[0]):
        z, t = ties[i], theirs[i]
        group = z == z[t].min()  # the tie group at the cut
        assert torch.equal(keep[i][~group], t[~group]), \
            f"row {i}: ties='keep' keeps an id outside the tie group at the cut differently from transformers"
        assert bool(keep[i][group].all()), f"row {i}: ties='keep' must keep the whole tie group at the cut"
        assert not bool((index[i] & ~keep[i]).any()), f"row {i}: ties='index' keeps an id ties='keep' drops"
        n = int(t[group].sum())
        split += n < int(group.sum())
        if top_k in (0, z.numel()):  # the cut is top-p's alone: "index" takes transformers' count, lowest ids
            assert torch.equal(index[i][~group], t[~group]), f"row {i}: ties='index' outside the tie group"
            ids = group.nonzero().squeeze(1)
            assert int(index[i][group].sum()) == n and bool(index[i][ids[:n]].all()), \
                f"row {i}: ties='index' keeps {index[i][group].nonzero().squeeze(1).tolist()} of the tie group " \
                f"{ids.tolist()} at the cut, transformers {n} of them"
    assert (split > 0) == splits, f"{split} rows split a tie group at the cut (the tiles changed?)"
