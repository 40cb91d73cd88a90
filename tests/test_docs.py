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
