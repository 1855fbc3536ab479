"""The layers of docs/architecture.md, read from the sources (tests/test_import_cycles.py's import
graph: every import at any depth, nothing imported): the planner decides and imports no mechanism;
the mechanisms (engine/, weights/, activations/, quant/) import neither the runtime that applies
plans nor any planner module (its thresholds included: they decide nothing); the session
(runtime/session.py) is the only writer of the plan history."""

from __future__ import annotations

import ast

import pytest

from test_import_cycles import ROOT, _modules, import_graph

MECHANISMS = ("ramstream.engine", "ramstream.weights", "ramstream.activations", "ramstream.quant")
# planner modules that measure the machine or read files (the hardware profile, the CLI): they may
# call the mechanisms that measure; every other planner module is pure arithmetic
PLANNER_IO = {
    "ramstream.planner.measure",
    "ramstream.planner.profile",
    "ramstream.planner.cli_plan",
    "ramstream.planner.cli_pipeline",
}
# what the planner's pure modules may import besides the planner: the leaves
PLANNER_MAY_IMPORT = ("ramstream.planner", "ramstream.options", "ramstream.blocks")


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    edges, where = import_graph(mods)
    return mods, edges, where


def _violations(edges, where, sources, allowed) -> list[str]:
    out = []
    for m in sorted(sources):
        for t in sorted(edges[m]):
            if not allowed(t):
                out.append(f"{m} -> {t}  ({', '.join(where[(m, t)])})")
    return out


def test_the_planners_decisions_import_no_mechanism(graph):
    mods, edges, where = graph
    pure = [m for m in mods if _under(m, "ramstream.planner") and m not in PLANNER_IO]
    assert "ramstream.planner.inflight" in pure and "ramstream.planner.levers" in pure
    bad = _violations(edges, where, pure, lambda t: any(_under(t, p) for p in PLANNER_MAY_IMPORT))
    assert not bad, "planner modules that decide must import only the planner and the leaves:\n" + "\n".join(
        bad
    )


def _mechanisms(mods) -> list[str]:
    mech = [m for m in mods if any(_under(m, p) for p in MECHANISMS)]
    assert "ramstream.engine.layout" in mech and "ramstream.activations.recompute" in mech
    assert "ramstream.weights.setup" in mech and "ramstream.quant.model" in mech
    return mech


def test_mechanisms_never_import_the_runtime(graph):
    mods, edges, where = graph
    bad = _violations(edges, where, _mechanisms(mods), lambda t: not _under(t, "ramstream.runtime"))
    assert not bad, "mechanisms must not import the runtime that applies plans:\n" + "\n".join(bad)


def test_mechanisms_import_no_planner_module_they_decide_nothing(graph):
    """Thresholds and "auto" are resolved in the planner only (planner/rules.py, wrap_rules.py,
    quantize.py, host_fit.py); the runtime counts the live model for them and hands the mechanisms
    explicit block indices, placements and formats. A mechanism that imports any planner module
    (rules.py included, lazily inside a function included) is deciding something."""
    mods, edges, where = graph
    bad = _violations(edges, where, _mechanisms(mods), lambda t: not _under(t, "ramstream.planner"))
    assert not bad, "mechanisms must not import the planner (its rules included):\n" + "\n".join(bad)


def _rule_names() -> set[str]:
    """The thresholds planner/rules.py defines (its module-level UPPER_CASE names)."""
    tree = ast.parse((ROOT / "ramstream" / "planner" / "rules.py").read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names |= {t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()}
    return names


def test_no_mechanism_names_a_threshold(graph):
    """Not through a re-export either: no mechanism's source names a constant of planner/rules.py."""
    mods, _, _ = graph
    rules = _rule_names()
    assert {"LORA_LIKE", "STREAM_SHARE", "RECOMPUTE_FULL_FT", "HOST_RAM_SHARE", "GRAD_INFLIGHT_MAX"} <= rules
    bad = []
    for m in _mechanisms(mods):
        tree = ast.parse(mods[m].read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            name = (
                node.id if isinstance(node, ast.Name)
                else node.attr if isinstance(node, ast.Attribute)
                else node.name if isinstance(node, ast.alias)
                else None
            )  # fmt: skip
            if name in rules:
                bad.append(f"{mods[m].relative_to(ROOT.parent)}:{node.lineno}: {name}")
    assert not bad, "mechanisms must not use the planner's thresholds:\n" + "\n".join(bad)


SESSION = "ramstream.runtime.session"  # the plan history's only writer
WRITES = ("append", "extend", "record", "insert")


def _name(node) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _history_writes(path) -> list[int]:
    """Lines that append to, extend, insert into or record into something named *history*
    (plan_history, self.history, ...) or into a name bound to one (h = opt.plan_history)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and "history" in ast.unparse(node.value)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in WRITES:
            continue
        name = _name(node.func.value)
        if ("history" in name and name != "recent_history") or name in aliases:
            out.append(node.lineno)
    return sorted(out)


def test_only_the_session_writes_the_plan_history(graph):
    """The deciders (runtime/optimizer_split.py, refiner.py, watchdog.py, keep.py, tokens.py's
    StepCheck) return or hand over entries; only runtime/session.py records them."""
    mods, _, _ = graph
    outside = {m: lines for m, path in mods.items() if m != SESSION and (lines := _history_writes(path))}
    listed = "\n".join(f"{mods[m].relative_to(ROOT.parent)}: lines {lines}" for m, lines in outside.items())
    assert not outside, f"the plan history is written only by {SESSION}:\n" + listed
    assert _history_writes(mods[SESSION])  # the check sees the session's own writes


def test_the_history_check_sees_every_way_of_writing(tmp_path):
    f = tmp_path / "m.py"
    for line in ("opt.plan_history.record(e)", "self.history.append(e)", "h = self.opt.plan_history\nh.record(e)",
                 "history.extend([e])", "self._session.history.insert(0, e)"):  # fmt: skip
        f.write_text(line + "\n")
        assert _history_writes(f), line
    f.write_text("self.recent.append(e)\nev.record(stream)\nself.actions.append(e)\n")
    assert _history_writes(f) == []


def test_the_plan_history_is_a_record_not_a_list():
    """An optimizer's plan history takes entries through record() only (a dict with a "change");
    it reads as a sequence and compares equal to the list of its entries."""
    import torch

    import ramstream
    from ramstream.runtime.history import PlanHistory

    opt = ramstream.OffloadAdamW(torch.nn.Linear(4, 4).parameters(), lr=1e-3, device="cpu")
    h = opt.plan_history
    assert isinstance(h, PlanHistory) and not hasattr(h, "append") and len(h) == 0
    entry = h.record({"step": 3, "change": "x"})
    assert h == [entry] and h[-1] is entry and list(h) == [entry]
    with pytest.raises(TypeError, match="'change' string"):
        h.record({"step": 4})
    with pytest.raises(TypeError, match="'change' string"):
        h.record(["change", "x"])
    assert len(h) == 1
    opt.close()


def _from_imports(graph_mods):
    """(module, line, imported module, name) for every `from X import name` of a ramstream module, at
    any depth (a lazy import inside a function runs only on its path: a GPU-only one never in CI)."""
    from test_import_cycles import _imports

    for module, path in graph_mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_pkg = path.name == "__init__.py"
        for node in _imports(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = module.split(".")
                if not is_pkg:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "ramstream" or not target.startswith("ramstream."):
                continue
            for a in node.names:
                yield module, node.lineno, target, a.name


def test_every_import_inside_the_package_resolves(graph):
    """Every `from ramstream.x import name` in the package names something x has: a module moved or a
    name removed breaks no lazy import on a path CI does not run."""
    import importlib

    mods, _, _ = graph
    bad = []
    for module, line, target, name in _from_imports(mods):
        if name == "*":
            continue
        try:
            m = importlib.import_module(target)
        except ImportError as e:
            bad.append(f"{mods[module].relative_to(ROOT.parent)}:{line}: {target} ({e})")
            continue
        if not hasattr(m, name) and f"{target}.{name}" not in mods:
            bad.append(f"{mods[module].relative_to(ROOT.parent)}:{line}: {target} has no {name}")
    assert not bad, "imports that do not resolve:\n" + "\n".join(bad)
