"""Documentation links: every relative link in README.md, bench/README.md and docs/*.md points at a file that
exists, and every #anchor at a heading of that file (GitHub's heading slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def links(page: Path) -> list[str]:
    return LINK.findall(_prose(page.read_text()))


def slugs(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file: lower case, punctuation dropped, spaces to hyphens,
    -1, -2, ... on repeats."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_docs_exist_and_are_linked():
    for name in ("design.md", "gpu-map.md"):
        assert (REPO / "docs" / name).is_file(), name
    readme = links(REPO / "README.md")
    assert any(t.startswith("docs/design.md") for t in readme) and any(t.startswith("docs/gpu-map.md") for t in readme)
    assert any(t.startswith("../docs/design.md") for t in links(REPO / "bench" / "README.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    checked, bad = 0, []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        checked += 1
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in slugs(dest)):
            bad.append(f"{target}: no heading with the anchor #{anchor} in {dest.name}")
    assert not bad, f"{page.relative_to(REPO)}: " + "; ".join(bad)
    if page.parent.name == "docs" or page.name == "README.md" and page.parent == REPO:
        assert checked > 0, "no relative link checked: is the link pattern still right?"


def test_no_links_to_internal_notes():
    for page in PAGES:
        text = page.read_text()
        assert "DESIGN.md" not in text and "/work/shared" not in text, page


def test_slugs_follow_github():
    assert slugs(REPO / "docs" / "design.md") >= {"the-math", "three-execution-paths-and-what-they-cost", "workloads"}


@pytest.mark.parametrize("name", ["fused_logprobs", "policy_loss"])
def test_docstring_examples_run(name, capsys):
    import inspect
    import textwrap

    import fastrl

    doc = inspect.getdoc(getattr(fastrl, name))
    assert "Example::" in doc and "Args:" in doc and "Returns:" in doc
    code = textwrap.dedent(doc.split("Example::", 1)[1])
    exec(compile(code, f"<{name} docstring>", "exec"), {})


# ---------------------------------------------------------------------------------------------------------------
# README.md's Python snippets, each run
# ---------------------------------------------------------------------------------------------------------------

# Snippets written as fragments over tensors a reader already has (named in the prose around them): run with those
# names given (``_given``), built with fastrl.testing. Keyed by the snippet's first line. Every other snippet runs as
# written, in an empty namespace.
FRAGMENTS = ("div = fastrl.fused_divergence(", 'config = fastrl.PolicyLossConfig(loss_type="dapo", beta=0.04, kl_estimator',
             "# the ids each token was sampled from")


def readme_snippets() -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block of README.md."""
    out, lines = [], (REPO / "README.md").read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            out.append((i + 2, "\n".join(lines[i + 1 : j])))
            i = j
        i += 1
    return out


def _given() -> dict:
    """What the fragment snippets take as given: a policy's hidden states and head (the quickstart's names), a student
    and a wider teacher, a reference model, kept sets holding each target."""
    import torch

    import fastrl
    from fastrl.testing import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer(256)
    ids = tok(["w1 w2 w3 w4 w5 w6", "w7 w8 w9 w10 w11 w12"], return_tensors="pt").input_ids  # [2, 6]
    policy, student, teacher = (tiny_model(256, h, seed=s) for h, s in ((32, 0), (32, 1), (48, 2)))
    hidden = policy.model(ids).last_hidden_state[:, :-1]  # [2, 5, 32]
    targets = ids[:, 1:]
    mask = torch.ones_like(targets, dtype=torch.bool)
    with torch.no_grad():
        old = fastrl.fused_logprobs(hidden, policy.lm_head.weight, targets, with_entropy=False)[0]
        teacher_hidden = teacher.model(ids).last_hidden_state[:, :-1]
    kept_ids = [sorted({int(t), *range(3, 3 + 7)}) for t in targets.reshape(-1)]  # each token's target among 8 ids
    return dict(
        fastrl=fastrl, torch=torch, hidden=hidden, lm_head=policy.lm_head, weight=policy.lm_head.weight,
        completion_ids=targets, targets=targets, ids=targets, advantages=torch.tensor([1.0, -0.5]),
        adv=torch.tensor([1.0, -0.5]), completion_mask=mask, mask=mask, old=old,
        config=fastrl.PolicyLossConfig(loss_type="dapo"), student=student, teacher=teacher,
        student_hidden=student.model(ids).last_hidden_state[:, :-1], teacher_hidden=teacher_hidden,
        ref_hidden=teacher_hidden, ref_lm_head=teacher.lm_head, ids_per_token=kept_ids, vocab_size=256,
    )


def test_readme_has_its_snippets():
    snippets = readme_snippets()
    assert len(snippets) >= 8
    firsts = [code.splitlines()[0] for _, code in snippets]
    for prefix in FRAGMENTS:  # a fragment that no longer exists should leave this list
        assert sum(f.startswith(prefix) for f in firsts) == 1, prefix


@pytest.mark.parametrize("line,code", readme_snippets(), ids=lambda v: f"README.md:{v}" if isinstance(v, int) else "")
def test_readme_snippet_runs(line, code, tmp_path, monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)  # snippets that train write their output_dir here
    fragment = code.splitlines()[0].startswith(FRAGMENTS)
    namespace = _given() if fragment else {}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)


# the README's C1 table: provider label (its start) -> the provider in c1.json, per workload
_C1_LABELS = {
    ("C1", "fastrl `fused_logprobs`"): "fastrl", ("C1-loss", "fastrl `fused_logprobs`"): "fastrl",
    ("C1-loss", "fastrl `policy_loss`"): "fastrl-fused", ("C1", "PyTorch"): "torch", ("C1-loss", "PyTorch"): "torch",
    ("C1", "TRL"): "trl", ("C1-loss", "TRL"): "trl", ("C1-loss", "Liger"): "liger-fused",
}


def test_readme_c1_figures_are_those_of_the_cited_result_file():
    """The README's C1 table is the committed `bench c1` result it names, figure for figure (bench/README.md: re-run
    and commit the file whenever the plain path changes, then copy its figures)."""
    import json

    text = (REPO / "README.md").read_text()
    m = re.search(r"`python -m bench c1`\s*\(`(bench/results/[^`]+/c1\.json)`", text)
    assert m, "README.md names no bench c1 result file next to its C1 table"
    rows = {(r["workload"], r["provider"]): r for r in json.loads((REPO / m.group(1)).read_text())["rows"]
            if r.get("status") == "ok"}
    table = re.findall(r"^\| (C1|C1-loss) \| ([^|]+) \| (\d+) \| (\d+) MB \| ([\d.]+)x \|", text[m.end():], flags=re.M)
    assert len(table) >= 6, table
    for wl, label, ms, mb, ratio in table:
        prov = next(p for (w, start), p in _C1_LABELS.items() if w == wl and label.startswith(start))
        r = rows[(wl, prov)]
        assert (int(ms), int(mb), float(ratio)) == (
            round(r["total_ms"]["median"]), round(r["peak_extra_mb"]), round(r["time_vs_torch"], 2)), (wl, label)
