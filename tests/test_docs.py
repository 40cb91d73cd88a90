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
# The Python snippets of README.md and docs/*.md, each run exactly as printed, in an empty namespace
# ---------------------------------------------------------------------------------------------------------------

SNIPPET_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def snippets(page: Path) -> list[tuple[int, str]]:
    """(first line number, code) of every ```python block of ``page``."""
    out, lines = [], page.read_text().splitlines()
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


# each distinct snippet once (a page may repeat the front page's), named by where it first appears
ALL_SNIPPETS = list({code: (page.relative_to(REPO).as_posix(), line, code) for page in reversed(SNIPPET_PAGES)
                     for line, code in reversed(snippets(page))}.values())[::-1]


def test_the_pages_have_their_snippets():
    readme = snippets(REPO / "README.md")
    assert len(readme) >= 3  # the trainer swap and the functions, on the front page
    assert len(ALL_SNIPPETS) >= 10, [(p, n) for p, n, _ in ALL_SNIPPETS]


@pytest.mark.parametrize("page,line,code", ALL_SNIPPETS, ids=[f"{p}:{n}" for p, n, _ in ALL_SNIPPETS])
def test_snippet_runs_as_printed(page, line, code, tmp_path, monkeypatch):
    """Each snippet is the whole program: no name is supplied, nothing is prepended."""
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)  # snippets that train write their output_dir here
    exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "__main__"})


def test_a_cpu_trainer_example_states_its_precision():
    """TRL's bf16=True default stays on with use_cpu=True (bf16 autocast on the CPU): every example that builds a
    trainer config for the CPU says bf16=False."""
    for page, line, code in ALL_SNIPPETS:
        for call in re.findall(r"(?:GRPOConfig|PPOConfig|DistillationConfig)\((.*?)\)\n", code, flags=re.S):
            if "use_cpu" in call:
                assert '"bf16": False' in code or "bf16=False" in call, f"{page}:{line}: {call[:80]}"


# ---------------------------------------------------------------------------------------------------------------
# The front page and the site
# ---------------------------------------------------------------------------------------------------------------

HEX = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")  # a commit hash
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+|\bthe issue(?:'s)?\b")


def test_readme_is_a_front_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    # its two opening commands: the main job, and the test command CI runs as the README's
    first = re.search(r"^```bash\n(.*?)^```", text, flags=re.S | re.M).group(1)
    commands = [line for line in first.splitlines() if line and not line.startswith("#")]
    assert commands[0].endswith("python -m fastrl.demo") and commands[1].endswith("python -m pytest -q"), commands
    ci = (REPO / ".ci" / "run").read_text()
    assert "\n# The README's test command" in ci and "\npython -m pytest -q\n" in ci


def test_no_issue_numbers_or_commit_hashes_in_the_prose():
    """Users read these pages: provenance belongs in the result files (link targets may name their folders)."""
    bad = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = re.sub(r"\]\([^)]*\)", "]", _prose(page.read_text()))
        for n, line in enumerate(text.splitlines(), 1):
            if HEX.search(line) or ISSUE.search(line):
                bad.append(f"{page.name}: {line.strip()[:100]}")
    assert not bad, bad


# pages other branches are writing: listed in mkdocs.yml's nav as comments until they are merged
PENDING_PAGES = ("gpu-window.md", "roofline.md", "kept-set-costs.md", "vllm-support.md")


def test_the_site_lists_every_page():
    config = (REPO / "mkdocs.yml").read_text()
    nav = config[config.index("\nnav:"):]
    listed = set(re.findall(r"^\s+-(?:[^:\n]*:)?\s*([\w.-]+\.md)\s*$", nav, flags=re.M))
    commented = set(re.findall(r"^\s+#\s*-[^:\n]*:\s*([\w.-]+\.md)\s*$", nav, flags=re.M))
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages <= listed | {"index.md"}, pages - listed
    assert listed <= pages | {"index.md"}, listed - pages  # a listed page that does not exist fails the build
    for name in PENDING_PAGES:
        assert name in listed | commented, name


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
