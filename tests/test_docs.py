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
def test_snippet_runs_as_printed(page, line, code, tmp_path, monkeypatch, capsys):
    """Each snippet is the whole program: no name is supplied, nothing is prepended. The front page's snippets print
    only their own result lines (no trainer's log dictionaries) and leave nothing in the working directory."""
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)  # snippets that train write their output_dir here
    exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "__main__"})
    if page == "README.md":
        out = capsys.readouterr().out
        assert "{'" not in out and "train_runtime" not in out, out
        assert not list(tmp_path.iterdir()), f"{page}:{line} left {[p.name for p in tmp_path.iterdir()]} behind"
        if "GRPOTrainer(" in code:  # the trainer swap: one line per training step, nothing else
            assert out.strip(), "the trainer swap printed nothing"
            assert all(re.fullmatch(r"step \d+: reward [\d.]+  loss \S+  grad norm [\d.]+", ln)
                       for ln in out.strip().splitlines()), out


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


# ---------------------------------------------------------------------------------------------------------------
# What a newcomer reads: no internal wording, installs that work as printed, figures from their files
# ---------------------------------------------------------------------------------------------------------------

USER_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# wording that describes how a measurement was organised, not what it measured, and test counts that go stale
INTERNAL = [r"\blent machine\b", r"\bwhere that session measured\b", r"\bits GPU test asks\b",
            r"\bits printed output\b", r"\b\d+ passed\b"]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_user_pages_have_no_internal_wording_or_test_counts(page):
    bad = [f"{page.name}:{n}: {line.strip()[:100]}" for n, line in enumerate(page.read_text().splitlines(), 1)
           if any(re.search(pattern, line, flags=re.I) for pattern in INTERNAL)]
    assert not bad, bad


def _install_commands(page: Path) -> list[list[str]]:
    """The pip commands of each fenced bash block of ``page`` (and, on the front page and the install page, of each
    inline code span), in order, split at ``&&``."""
    text = page.read_text()
    groups = [block for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)]
    if page.name in ("README.md", "install.md"):
        groups += re.findall(r"`([^`\n]*pip install[^`\n]*)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    out = []
    for group in groups:
        lines = [ln.split("#", 1)[0] for ln in group.splitlines()]
        out.append([c.strip() for ln in lines for c in ln.split("&&") if c.strip().startswith("pip install")])
    return out


def _installs_fastrl(command: str) -> bool:
    return bool(re.search(r"pip install (-e|--editable) ['\"]?\.(\[|['\"\s]|$)|fastrl-kernels", command))


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_torch_is_installed_before_fastrl_in_every_printed_install(page):
    """An extra installed without a torch already there pulls the index's default torch (a CUDA build with GBs of
    NVIDIA wheels on Linux), the docs extra included: every printed install of fastrl comes after torch's."""
    for commands in _install_commands(page):
        for i, command in enumerate(commands):
            if _installs_fastrl(command):
                assert any(c.startswith("pip install torch==") for c in commands[:i]), (page.name, commands)


def test_the_install_pages_install_from_a_checkout_while_not_on_the_index():
    for page in (REPO / "README.md", REPO / "docs" / "install.md"):
        commands = [c for group in _install_commands(page) for c in group]
        assert commands and not [c for c in commands if "fastrl-kernels" in c], (page.name, commands)
        assert 'pip install -e ".[docs]"' in " ".join(c for group in _install_commands(REPO / "docs" / "install.md")
                                                     for c in group)
    text = (REPO / "docs" / "install.md").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in text  # the CPU build, named
    assert re.search(r"^site/$", (REPO / ".gitignore").read_text(), flags=re.M)  # mkdocs build's output


def test_the_instruments_check_what_they_should():
    assert _installs_fastrl('pip install -e ".[docs]"') and _installs_fastrl("pip install -e .")
    assert _installs_fastrl('pip install "fastrl-kernels[trl]"') and not _installs_fastrl("pip install torch==2.13.0")
    assert re.search(INTERNAL[-1], "ran (1934 passed, 388 skipped)")


# the README's GPU table: (workload cell start -> session workload), (what-ran cell -> provider, implementation)
_GPU_WORKLOADS = {"W1 GRPO loss": "W1", "W2 GRPO loss": "W2", "W3 forward-only": "W3",
                  "distillation divergence, beta 0.5": "D-b0.5", "W4 `GRPOTrainer` step, 8 x 4096": "W4-4096"}


def _gpu_provider(label: str) -> tuple[str, str | None]:
    if "TRL" in label:
        return "trl", None
    if label.startswith("Liger"):
        return "liger", None
    if label == "`fastrl.GRPOTrainer`":
        return "fastrl", None
    impl = re.match(r"fastrl `([\w-]+)`(, (one|two) pass)?$", label)
    assert impl, label
    return ("fastrl-fused" if impl.group(3) == "one" else "fastrl"), impl.group(1)


def test_readme_gpu_figures_are_those_of_the_cited_session_files():
    """Every row of the README's GPU table (time, memory and both ratios against TRL) is a row of the session files
    of the results folder it links, as rounded."""
    import json

    text = (REPO / "README.md").read_text()
    m = re.search(r"\]\((bench/results/nvidia-h200/[^/)]+)/README\.md\)", text)
    assert m, "README.md links no H200 results folder next to its GPU table"
    rows = {}
    for name in ("session.rows.jsonl", "session-rest.rows.jsonl"):
        for line in (REPO / m.group(1) / name).read_text().splitlines():
            r = json.loads(line)
            if r.get("status") == "ok" and "total_ms" in r and "extra_mb" in r:
                rows.setdefault((r["workload"], r["provider"], r.get("implementation")), r)
    table = re.findall(r"^\|\s*([^|]*?)\s*\|\s*([^|]+?)\s*\|\s*([\d.]+) ms\s*\|\s*\**([\d.]+)x\**\s*\|"
                       r"\s*(\d+) MB\s*\|\s*\**([\d.]+)x\**\s*\|$", text[m.end():], flags=re.M)
    assert len(table) >= 15, table
    workload = None
    for cell, label, ms, ratio, mb, mem_ratio in table:
        if cell.strip():
            workload = next(w for start, w in _GPU_WORKLOADS.items() if cell.startswith(start))
        provider, impl = _gpu_provider(label.strip())
        r, trl = rows[(workload, provider, impl)], rows[(workload, "trl", None)]
        t, t_trl = r["total_ms"]["median"], trl["total_ms"]["median"]
        got = (float(ms), float(ratio), int(mb), float(mem_ratio))
        want = (round(t, 1), round(t / t_trl, 2), round(r["extra_mb"]), round(r["extra_mb"] / trl["extra_mb"], 2))
        assert got == want, (workload, label, got, want)
