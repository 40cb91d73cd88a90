"""MkDocs hooks (mkdocs.yml): README.md becomes the site's front page, and links to repository files outside docs/
(result files, bench/README.md) stay links.

The pages are written to be read in the repository too (GitHub renders README.md and docs/*.md), so their links
are relative to where they sit there: README.md links ``docs/x.md`` and ``bench/results/...``; a docs page links
``x.md`` and ``../bench/results/...``. In the site README.md is ``index.md``, docs/x.md is ``x.md``, and every
other repository file a page links (transitively) is copied into the site at its repository path; each link is
rewritten to where its target sits in the site. A link to a file that does not exist is left as written, so
MkDocs' strict link validation fails the build on it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

REPO = Path(__file__).resolve().parent
DOCS = REPO / "docs"
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)(#[^)\s]*)?(\))")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _source(src_uri: str) -> Path:
    """The repository file a site page comes from."""
    if src_uri == "index.md":
        return REPO / "README.md"
    return DOCS / src_uri if (DOCS / src_uri).exists() else REPO / src_uri


def _site_path(path: Path) -> str | None:
    """Where a repository file sits in the site (None: nowhere, it does not exist)."""
    if not path.is_file() or not path.is_relative_to(REPO):
        return None
    if path == REPO / "README.md":
        return "index.md"
    return (path.relative_to(DOCS) if path.is_relative_to(DOCS) else path.relative_to(REPO)).as_posix()


def _targets(text: str, page_dir: Path) -> list[tuple[str, Path]]:
    """(target as written, resolved repository path) of each relative link outside code blocks."""
    out = []
    for m in LINK.finditer(FENCE.sub("", text)):
        if not re.match(r"^[a-z][a-z0-9+.-]*:", m.group(2)):
            out.append((m.group(2), (page_dir / m.group(2)).resolve()))
    return out


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "index.md", content=(REPO / "README.md").read_text()))
    todo = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    seen = set(todo)
    while todo:  # every repository file outside docs/ that a page links, and what those link in turn
        page = todo.pop()
        for _, path in _targets(page.read_text(), page.parent):
            rel = _site_path(path)
            if rel is None or path in seen or path.is_relative_to(DOCS) or rel == "index.md":
                continue
            seen.add(path)
            files.append(File(rel, src_dir=str(REPO), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"], inclusion=InclusionLevel.NOT_IN_NAV))
            if path.suffix == ".md":
                todo.append(path)
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    source = _source(page.file.src_uri)
    here = os.path.dirname(page.file.src_uri)
    moved = {}
    for target, path in _targets(markdown, source.parent):
        rel = _site_path(path)
        if rel is not None:
            moved[target] = os.path.relpath(rel, here or ".")

    def relink(m: re.Match) -> str:
        return m.group(1) + moved.get(m.group(2), m.group(2)) + (m.group(3) or "") + m.group(4)

    parts, last = [], 0
    for fence in FENCE.finditer(markdown):  # links inside code blocks are text
        parts.append(LINK.sub(relink, markdown[last:fence.start()]))
        parts.append(fence.group(0))
        last = fence.end()
    parts.append(LINK.sub(relink, markdown[last:]))
    return "".join(parts)
