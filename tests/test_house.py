"""House rules, read from the source's syntax trees (nothing of the project is imported; the file takes ~1 s).

Each test lists every offender in its failure message; the last tests run each checker on a tiny fake tree, once
with an offender (it must be reported) and once without (nothing reported), so no rule passes by being blind.

1. **Short functions.** No function or method in ``fastrl/`` or ``bench/`` is over 80 lines, counted from its
   ``def`` line to its last line (decorators not counted, comments and blank lines counted) minus the lines of its
   docstring. A nested function counts in its parent's lines and is also checked on its own. In ``kernels/``
   (installed as ``fastrl.kernels``) the rule is the same except for ``@triton.jit`` functions: one Triton kernel
   may have to hold a long body, in commented sections.
2. **No private names across modules** (``fastrl/``, ``kernels/``, ``bench/``). A name that starts with ``_``
   (not a ``__dunder__``) belongs to the module that defines it: no other module imports it
   (``from x import _name``, relative or not) or reads it off an imported project module (``x._name``,
   ``fastrl.ops.x._name``). A package's ``__init__`` and a sibling module are other modules too. A module whose
   own name starts with ``_`` (``fastrl/ops/_checks.py``) is private to its package: modules of that package
   (and of its sub-packages) import it and its public names; no module outside the package does.
3. **Imports run downward.** Every ``import`` counts, at module level or inside a function (only ``importlib``
   calls with a string are not seen). An import names the module it imports: ``from p import n`` names ``p.n``
   when that is a module of the project and ``p`` otherwise; the parent packages a dotted import runs first are
   not counted. (a) No cycle among the modules of ``fastrl`` (``kernels/`` included). (b) The layers, top first:
   ``bench`` > ``fastrl/__init__.py``, ``fastrl/demo.py``, ``fastrl/reference.py``, ``fastrl/testing.py``,
   ``fastrl/testing_vllm.py`` > ``fastrl/trainers`` > ``fastrl/losses`` > ``fastrl/ops`` > ``kernels`` >
   ``fastrl/_extras.py`` and ``fastrl/_options.py`` (leaves that import nothing of the project); no module imports
   a module of a higher layer.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# source folder -> the dotted package it installs as (pyproject.toml: kernels/ installs as fastrl.kernels)
PACKAGES = {"fastrl": "fastrl", "kernels": "fastrl.kernels", "bench": "bench"}
MAX_LINES = 80
# the layers, by dotted prefix (the longest prefix that matches decides); a higher number is a higher layer
LAYERS = {
    "bench": 6,
    "fastrl": 5,  # fastrl/__init__.py, demo.py, reference.py, testing.py, testing_vllm.py
    "fastrl.trainers": 4,
    "fastrl.losses": 3,
    "fastrl.ops": 2,
    "fastrl.kernels": 1,
    "fastrl._extras": 0,
    "fastrl._options": 0,  # the option checks shared by PolicyLossConfig and GRPOConfig: a leaf too
}
EXEMPT_PACKAGE = "fastrl.kernels"  # where @triton.jit functions may be long


@dataclass(frozen=True)
class Module:
    name: str  # dotted: fastrl.ops.linear_logprob, fastrl.kernels.tuning, bench.session
    path: str  # relative to the root, for messages
    is_package: bool  # an __init__.py
    tree: ast.Module

    @property
    def package(self) -> str:
        """The package relative imports and private modules are resolved against."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


def collect(root: pathlib.Path, packages: dict[str, str] = PACKAGES) -> dict[str, Module]:
    """Every ``.py`` file under the source folders, parsed, by dotted module name."""
    modules = {}
    for folder, dotted in packages.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((dotted, *(parts[:-1] if is_package else parts)))
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            modules[name] = Module(name, str(path.relative_to(root)), is_package, tree)
    return modules


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# ------------------------------------------------------------------------------------------------------------------
# rule 1: short functions
# ------------------------------------------------------------------------------------------------------------------


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _is_triton_jit(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(_dotted(d) in ("triton.jit", "jit") for d in fn.decorator_list)


def function_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the function's last line, less its docstring's lines."""
    lines = fn.end_lineno - fn.lineno + 1
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def long_functions(modules: dict[str, Module], limit: int = MAX_LINES) -> list[str]:
    found = []
    for module in modules.values():
        exempt_jit = _inside(module.name, EXEMPT_PACKAGE)

        def visit(node, qualname):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{qualname}{child.name}"
                    n = function_lines(child)
                    if n > limit and not (exempt_jit and _is_triton_jit(child)):
                        found.append(f"{module.path}:{child.lineno} {name}: {n} lines")
                    visit(child, f"{name}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{qualname}{child.name}.")
                else:
                    visit(child, qualname)

        visit(module.tree, "")
    return found


# ------------------------------------------------------------------------------------------------------------------
# imports: what each import statement names
# ------------------------------------------------------------------------------------------------------------------


def _project(name: str, modules: dict[str, Module]) -> bool:
    return any(_inside(name, dotted) for dotted in set(PACKAGES.values()) | set(modules))


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@dataclass(frozen=True)
class Imported:
    """One module or name an import statement brings in."""

    target: str  # the project module it names, for the import graph
    used: str  # ``import a.b``: "a.b"; ``from p import n``: "p.n" (a module or a name of module p)
    is_module: bool  # ``used`` is a module (not a name defined in one)
    alias: str  # the local name bound (``import a.b`` binds ``a``)
    bound: str  # what the alias stands for: "a" for ``import a.b``, ``used`` otherwise
    lineno: int


def imports(module: Module, modules: dict[str, Module]) -> list[Imported]:
    """Every import of a project module in ``module``, at any depth (functions, ``try``, ``if``)."""
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _project(a.name, modules):
                    target = a.name
                    while target not in modules and "." in target:
                        target = target.rpartition(".")[0]
                    alias, bound = (a.asname, a.name) if a.asname else (a.name.partition(".")[0],) * 2
                    found.append(Imported(target, a.name, True, alias, bound, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            owner = _absolute(module, node)
            if not _project(owner, modules):
                continue
            for a in node.names:
                used = f"{owner}.{a.name}"
                is_module = used in modules
                target = used if is_module else owner
                found.append(Imported(target, used, is_module, a.asname or a.name, used, node.lineno))
    return found


# ------------------------------------------------------------------------------------------------------------------
# rule 2: no private names across modules
# ------------------------------------------------------------------------------------------------------------------


def _private_module_use(module: Module, used: str) -> bool:
    """``used`` (a dotted module) is, or is inside, a private module of a package ``module`` is not in."""
    parts = used.split(".")
    return any(_is_private(p) and not _inside(module.package, ".".join(parts[:i])) for i, p in enumerate(parts))


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything else (calls, subscripts)."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return [node.id, *reversed(attrs)] if isinstance(node, ast.Name) else None


def private_uses(modules: dict[str, Module]) -> list[str]:
    """One line per offending statement (from-imports) or per private name read (with every line that reads it).

    Aliases are resolved file-wide: a name bound by an import anywhere in the file counts everywhere in it.
    """
    found = []
    for module in modules.values():
        bound = {}  # local name -> the dotted project name it stands for
        names = {}  # (line, owner) -> the private names one from-import takes from owner
        for imp in imports(module, modules):
            where = f"{module.path}:{imp.lineno} {module.name}"
            bound[imp.alias] = imp.bound
            owner, _, name = imp.used.rpartition(".")
            if imp.is_module:
                if _private_module_use(module, imp.used):
                    found.append(f"{where} imports {imp.used}, a private module of another package")
            elif _is_private(name) and owner != module.name:
                names.setdefault((imp.lineno, owner), []).append(name)
            elif _private_module_use(module, owner):
                found.append(f"{where} imports {owner}, a private module of another package")
        for (line, owner), private in names.items():
            found.append(f"{module.path}:{line} {module.name} imports {owner}'s private names {', '.join(private)}")
        reads = {}  # (owner, name) -> lines
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
                continue
            chain = _chain(node)
            if not chain or chain[0] not in bound:
                continue
            owner = ".".join([bound[chain[0]], *chain[1:-1]])
            used = f"{owner}.{node.attr}"
            if used in modules:
                if _private_module_use(module, used):
                    found.append(f"{module.path}:{node.lineno} {module.name} reads {used}, a private module of "
                                 "another package")
            elif owner in modules and owner != module.name:
                reads.setdefault((owner, node.attr), set()).add(node.lineno)
        for (owner, name), lines in reads.items():
            at = ",".join(map(str, sorted(lines)))
            found.append(f"{module.path}:{at} {module.name} reads {owner}'s private name {name}")
    return sorted(set(found))


# ------------------------------------------------------------------------------------------------------------------
# rule 3: imports run downward
# ------------------------------------------------------------------------------------------------------------------


def import_graph(modules: dict[str, Module], within: str | None = "fastrl") -> dict[str, dict[str, list[int]]]:
    """module -> {module it imports: the lines that import it}, for the modules inside ``within`` (None: all)."""
    graph = {}
    for module in modules.values():
        if within and not _inside(module.name, within):
            continue
        edges = graph.setdefault(module.name, {})
        for imp in imports(module, modules):
            if imp.target != module.name and imp.target in modules and (not within or _inside(imp.target, within)):
                edges.setdefault(imp.target, []).append(imp.lineno)
    return graph


def _lines(lines: list[int]) -> str:
    return ",".join(map(str, sorted(set(lines))))


def cycles(modules: dict[str, Module]) -> list[str]:
    """Each strongly connected group of modules (Tarjan), with the imports that close it: fastrl, its kernels and
    bench alike."""
    graph = import_graph(modules, within=None)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def strongconnect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    found = []
    for group in sorted(groups):
        inner = [
            f"{modules[a].path}:{_lines(n)} -> {b}" for a in group for b, n in sorted(graph[a].items()) if b in group
        ]
        found.append("cycle among " + ", ".join(group) + ": " + "; ".join(inner))
    return found


def layer(name: str) -> int:
    return LAYERS[max((p for p in LAYERS if _inside(name, p)), key=len)]


def upward_imports(modules: dict[str, Module]) -> list[str]:
    found = []
    for name, edges in import_graph(modules, within=None).items():
        if not any(_inside(name, p) for p in LAYERS):
            continue
        for target, lines in sorted(edges.items()):
            if any(_inside(target, p) for p in LAYERS) and layer(target) > layer(name):
                found.append(f"{modules[name].path}:{_lines(lines)} {name} (layer {layer(name)}) imports {target} "
                             f"(layer {layer(target)})")
    return found


# ------------------------------------------------------------------------------------------------------------------
# the rules on this repository
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo() -> dict[str, Module]:
    modules = collect(ROOT)
    assert "fastrl.losses.policy" in modules and "fastrl.kernels.persistent_stats" in modules and "bench" in modules
    return modules


def _report(found: list[str], rule: str) -> str:
    return f"{len(found)} {rule}:\n  " + "\n  ".join(found)


def test_no_long_functions(repo):
    found = long_functions(repo)
    assert not found, _report(found, f"functions over {MAX_LINES} lines (docstrings not counted)")


def test_no_private_names_across_modules(repo):
    found = private_uses(repo)
    assert not found, _report(found, "uses of another module's private names")


def test_no_import_cycles(repo):
    found = cycles(repo)
    assert not found, _report(found, "import cycles (fastrl, its kernels, bench)")


def test_imports_run_downward(repo):
    found = upward_imports(repo)
    assert not found, _report(found, "imports of a higher layer")


# ------------------------------------------------------------------------------------------------------------------
# each checker on a tiny fake tree: it finds the offender, and finds nothing where there is none
# ------------------------------------------------------------------------------------------------------------------

_BODY = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))  # def line + 80 lines = 81


FAKE = {
    "long function": (
        long_functions,
        {"fastrl/ops/a.py": f"def f():\n{_BODY}\n"},
        {"fastrl/ops/a.py": f'def f():\n    """One\n    two.\n    """\n{_BODY[: _BODY.rindex(chr(10))]}\n'},
        "f: 81 lines",
    ),
    "long method": (
        long_functions,
        {"bench/b.py": f"class C:\n    def m(self):\n{textwrap.indent(_BODY, '    ')}\n"},
        {"bench/b.py": f"class C:\n    @staticmethod\n    def m():\n{textwrap.indent(_BODY[:-14], '    ')}\n"},
        "C.m: 81 lines",
    ),
    "long function in kernels, not a Triton kernel": (
        long_functions,
        {"kernels/k.py": f"import triton\n\ndef launch():\n{_BODY}\n"},
        {"kernels/k.py": f"import triton\n\n@triton.jit\ndef kernel():\n{_BODY}\n"},
        "launch: 81 lines",
    ),
    "from-import of a private name": (
        private_uses,
        {"fastrl/ops/a.py": "_X = 1\n", "fastrl/losses/b.py": "from fastrl.ops.a import _X\n"},
        {"fastrl/ops/a.py": "_X = 1\nX = _X\n", "fastrl/losses/b.py": "from fastrl.ops.a import X\n"},
        "fastrl.losses.b imports fastrl.ops.a's private names _X",
    ),
    "relative import of a sibling's private name": (
        private_uses,
        {"fastrl/ops/__init__.py": "from .a import _X\n", "fastrl/ops/a.py": "_X = 1\n"},
        {"fastrl/ops/__init__.py": "from .a import X\n", "fastrl/ops/a.py": "X = 1\n"},
        "fastrl.ops imports fastrl.ops.a's private names _X",
    ),
    "private attribute of an imported module": (
        private_uses,
        {"fastrl/ops/a.py": "_X = 1\n", "fastrl/losses/b.py": "def f():\n    import fastrl.ops.a as a\n    return a._X\n"},
        {"fastrl/ops/a.py": "X = 1\n", "fastrl/losses/b.py": "def f():\n    import fastrl.ops.a as a\n    return a.X\n"},
        "fastrl.losses.b reads fastrl.ops.a's private name _X",
    ),
    "private attribute down a dotted import": (
        private_uses,
        {"fastrl/ops/a.py": "_X = 1\n", "bench/b.py": "import fastrl.ops.a\nY = fastrl.ops.a._X\n"},
        {"fastrl/ops/a.py": "X = 1\n", "bench/b.py": "import fastrl.ops.a\nY = fastrl.ops.a.X\n"},
        "bench.b reads fastrl.ops.a's private name _X",
    ),
    "private module from another package": (
        private_uses,
        {"fastrl/ops/_checks.py": "def check(): pass\n", "fastrl/losses/b.py": "from fastrl.ops._checks import check\n"},
        {"fastrl/ops/_checks.py": "def check(): pass\n", "fastrl/ops/b.py": "from fastrl.ops._checks import check\n"},
        "fastrl.losses.b imports fastrl.ops._checks, a private module of another package",
    ),
    "private module imported by name from another package": (
        private_uses,
        {"kernels/_defaults.py": "X = 1\n", "fastrl/ops/b.py": "from fastrl.kernels import _defaults\n"},
        {"kernels/_defaults.py": "X = 1\n", "kernels/b.py": "from . import _defaults\n"},
        "fastrl.ops.b imports fastrl.kernels._defaults, a private module of another package",
    ),
    "module-level cycle": (
        cycles,
        {"fastrl/ops/a.py": "from fastrl.ops.b import Y\n", "fastrl/ops/b.py": "from fastrl.ops import a\n"},
        {"fastrl/ops/a.py": "from fastrl.ops.b import Y\n", "fastrl/ops/b.py": "Y = 1\n"},
        "cycle among fastrl.ops.a, fastrl.ops.b",
    ),
    "cycle through a function-level import and a package __init__": (
        cycles,
        {"fastrl/ops/__init__.py": "from .a import f\n", "fastrl/ops/a.py": "def f():\n    from fastrl.ops import g\n"},
        {"fastrl/ops/__init__.py": "from .a import f\n", "fastrl/ops/a.py": "def f():\n    from fastrl.ops import b\n",
         "fastrl/ops/b.py": ""},
        "cycle among fastrl.ops, fastrl.ops.a",
    ),
    "ops imports losses": (
        upward_imports,
        {"fastrl/losses/a.py": "", "fastrl/ops/b.py": "def f():\n    import fastrl.losses.a\n"},
        {"fastrl/losses/a.py": "import fastrl.ops.b\n", "fastrl/ops/b.py": ""},
        "fastrl.ops.b (layer 2) imports fastrl.losses.a (layer 3)",
    ),
    "kernels import ops": (
        upward_imports,
        {"fastrl/ops/a.py": "", "kernels/k.py": "from fastrl.ops.a import X\n"},
        {"fastrl/ops/a.py": "from fastrl.kernels.k import X\n", "kernels/k.py": "X = 1\n"},
        "fastrl.kernels.k (layer 1) imports fastrl.ops.a (layer 2)",
    ),
    "trainers import the top package": (
        upward_imports,
        {"fastrl/__init__.py": "", "fastrl/trainers/t.py": "from fastrl import policy_loss\n"},
        {"fastrl/__init__.py": "", "fastrl/trainers/t.py": "from fastrl.losses.policy import policy_loss\n",
         "fastrl/losses/policy.py": ""},
        "fastrl.trainers.t (layer 4) imports fastrl (layer 5)",
    ),
    "the library imports bench": (
        upward_imports,
        {"bench/__init__.py": "", "bench/w.py": "", "fastrl/demo.py": "from bench import w\n"},
        {"bench/__init__.py": "", "bench/w.py": "from fastrl import demo\n", "fastrl/demo.py": ""},
        "fastrl.demo (layer 5) imports bench.w (layer 6)",
    ),
}


def _fake_tree(tmp_path: pathlib.Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in PACKAGES:
        (tmp_path / folder).mkdir(exist_ok=True)
    return collect(tmp_path)


@pytest.mark.parametrize("case", list(FAKE))
def test_checker_finds_the_offender(case, tmp_path):
    check, bad, good, expected = FAKE[case]
    found = check(_fake_tree(tmp_path / "bad", bad))
    assert len(found) == 1 and expected in found[0], f"{case}: expected one finding with {expected!r}, got {found}"
    assert check(_fake_tree(tmp_path / "good", good)) == [], f"{case}: the clean tree was reported"
