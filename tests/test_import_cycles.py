"""No import cycles inside the ramstream package, read from the sources with `ast` (nothing is
imported, so this runs without the native library).

Every import of a ramstream module counts, at the top of a file or inside a function (a lazy
import only hides a cycle until the function runs): relative imports are resolved; ``from pkg
import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``. Edges to the
top-level package ``ramstream`` are ignored (its __init__ re-exports everything, so every module
would otherwise close a cycle through it), and so are imports under ``if TYPE_CHECKING:`` (never
run). The strongly connected components of the graph are the cycles; each is listed with its
edges and the lines that make them.

options.py and blocks.py are leaves: they import nothing from the package, so any module can
validate an option or find the block stack without importing planner/, quant/ or weights/.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest


def _root() -> Path:
    """The folder holding the ramstream package: the source tree's python/ when the tests run from a
    checkout, else the installed package's parent (the wheel check runs the tests without sources)."""
    src = Path(__file__).resolve().parents[1] / "python"
    if (src / "ramstream" / "options.py").is_file():
        return src
    import importlib.util

    spec = importlib.util.find_spec("ramstream")
    return Path(spec.origin).resolve().parents[1]


ROOT = _root()
PACKAGE = "ramstream"
LEAVES = ("ramstream.options", "ramstream.blocks")


def _modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """{dotted module name: path} for every .py under root/package (a package is its __init__)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING` (any module prefix)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """The Import / ImportFrom nodes of a tree, at any depth, except in `if TYPE_CHECKING:` bodies
    (their else branches do run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The module a dotted name lives in: itself, or its longest prefix that is a module."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(module: str, is_pkg: bool, node: ast.stmt, mods: dict[str, Path]) -> list[str]:
    """The package modules an import statement in `module` imports."""
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")
            if not is_pkg:  # a module's `.` is its package; a package's `.` is itself
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            base_name = ".".join(base + ([node.module] if node.module else []))
        else:
            base_name = node.module or ""
        for a in node.names:
            sub = f"{base_name}.{a.name}"
            names.append(sub if a.name != "*" and sub in mods else base_name)
    out = []
    for name in names:
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            owner = _owner(name, mods)
            if owner is not None:
                out.append(owner)
    return out


def import_graph(
    mods: dict[str, Path], rel_to: Path = ROOT.parent
) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """({module: modules it imports}, {(module, imported): ["path:line", ...] in line order, paths
    relative to `rel_to`}), edges to the top-level package and to the module itself left out."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    where: dict[tuple[str, str], list[str]] = {}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_pkg = path.name == "__init__.py"
        for node in sorted(_imports(tree), key=lambda n: n.lineno):
            for target in _targets(module, is_pkg, node, mods):
                if target in (PACKAGE, module):
                    continue
                edges[module].add(target)
                lines = where.setdefault((module, target), [])
                line = f"{path.relative_to(rel_to)}:{node.lineno}"
                if line not in lines:
                    lines.append(line)
    return edges, where


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative: no recursion
    limit), each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def describe(cycles: list[list[str]], edges, where) -> str:
    lines = []
    for comp in cycles:
        members = set(comp)
        lines.append(f"cycle of {len(comp)} modules: {', '.join(comp)}")
        for m in comp:
            for t in sorted(edges[m] & members):
                lines.append(f"    {m} -> {t}  ({', '.join(where[(m, t)])})")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    assert "ramstream.options" in mods and "ramstream.wrap" in mods, sorted(mods)[:10]
    edges, where = import_graph(mods)
    return mods, edges, where


def test_no_import_cycles(graph):
    _, edges, where = graph
    cycles = strongly_connected(edges)
    assert not cycles, "import cycles inside the ramstream package:\n" + describe(cycles, edges, where)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_nothing_from_the_package(graph, leaf):
    mods, _, _ = graph
    assert leaf in mods, f"{leaf} is missing"
    path = mods[leaf]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [
        f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}"
        for node in _imports(tree)
        if _targets(leaf, path.name == "__init__.py", node, mods)
    ]
    listed = "\n".join(found)
    assert not found, f"{leaf} must import nothing from the package (a leaf); it imports:\n{listed}"


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The resolver on a synthetic package: relative and absolute imports, `from pkg import
    submodule` vs a name, imports inside functions, TYPE_CHECKING skipped (its else kept), the
    top-level package ignored; and a cycle found with the lines that make it."""
    files = {
        "ramstream/__init__.py": "from .a import f\n",
        "ramstream/a.py": "import torch\nfrom .sub import helper\nfrom . import b\n",
        "ramstream/b.py": """
            from typing import TYPE_CHECKING
            import ramstream
            if TYPE_CHECKING:
                from .a import f
            else:
                from ramstream.sub.inner import g
            def late():
                from .sub import inner
        """,
        "ramstream/sub/__init__.py": "from ..b import late\n",
        "ramstream/sub/helper.py": "",
        "ramstream/sub/inner.py": "from .. import b as _b\n",
    }
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    mods = _modules(tmp_path)
    edges, where = import_graph(mods, tmp_path)
    assert edges == {
        "ramstream": {"ramstream.a"},
        "ramstream.a": {"ramstream.sub.helper", "ramstream.b"},
        "ramstream.b": {"ramstream.sub.inner"},
        "ramstream.sub": {"ramstream.b"},
        "ramstream.sub.helper": set(),
        "ramstream.sub.inner": {"ramstream.b"},
    }
    assert strongly_connected(edges) == [["ramstream.b", "ramstream.sub.inner"]]
    text = describe(strongly_connected(edges), edges, where)
    assert "ramstream.b -> ramstream.sub.inner  (ramstream/b.py:7, ramstream/b.py:9)" in text, text
