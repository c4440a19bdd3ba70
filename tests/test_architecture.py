"""The architecture as tests: modules import only downward, without cycles (function-level
imports included), and the check catalog agrees with the check modules and the docs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: layer of each module (prefix match, longest wins); a module may import its own layer or lower
LAYERS: dict[str, int] = {
    # base: exceptions and the one compat module for private torch imports
    "equiv._compat": 0, "equiv.errors": 0, "equiv._explain": 0,
    "equiv._values": 0,
    # contract: what a user declares (spec, settings, schedules, targets, inputs, the catalog)
    "equiv._args": 1, "equiv.strategies": 1, "equiv._catalog": 1, "equiv._settings": 1,
    "equiv._options": 1, "equiv._schedule": 1, "equiv._targets": 1, "equiv.spec": 1,
    "equiv._contracts": 1, "equiv._watchdog": 0,
    "equiv.modules": 1,
    # engine: examples, comparison, modes, recorder, memory, variants, reports, execution core
    "equiv.examples": 2, "equiv.compare": 2, "equiv.numerics": 2, "equiv.modes": 2,
    "equiv.timeline": 2, "equiv.memory": 2, "equiv.variants": 2, "equiv.report": 2,
    "equiv.roles": 2,
    "equiv.execution": 2,
    # checks: one module per catalog row
    "equiv.checks": 3,
    # runner
    "equiv.pipeline": 4, "equiv.run": 4, "equiv._watchdog": 4, "equiv._assert": 4,
    "equiv._roots": 4,
    # results, CLI, pytest, the public package
    "equiv._results": 5, "equiv._html": 5, "equiv._bench": 5, "equiv._loader": 5, "equiv._lab": 5,
    "equiv._reports": 5, "equiv._workers": 5,
    "equiv.cli": 5, "equiv.pytest": 5, "equiv.__main__": 5, "equiv": 5,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    if parts[0] == "strategies":
        parts = ["equiv", "strategies"] + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    files = list((ROOT / "equiv").rglob("*.py")) + list((ROOT / "strategies").rglob("*.py"))
    return {_module_name(p): p for p in files}


def _placed(name: str, key: str) -> bool:
    # "equiv" names the package's __init__ only: every other module is placed explicitly
    return name == key or (key != "equiv" and name.startswith(key + "."))


def _layer(name: str) -> int:
    return LAYERS[max((k for k in LAYERS if _placed(name, k)), key=len)]


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test)


def imports_of(name: str, source: str) -> set[str]:
    """equiv modules imported anywhere in ``source`` (function level too; not under
    ``if TYPE_CHECKING:``, which never runs)."""
    package = name if source.lstrip().startswith('"""') and name.endswith("strategies") else name
    out: set[str] = set()
    tree = ast.parse(source)
    skipped = {id(n) for t in ast.walk(tree) if _type_checking(t) for n in ast.walk(t)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package if _is_package(name) else package.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rsplit(".", 1)[0]
                base = f"{pkg}.{base}" if base else pkg
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    known = _modules()
    return {m for m in out if m in known and m != name}


def _is_package(name: str) -> bool:
    return _modules()[name].name == "__init__.py"


def _graph() -> dict[str, set[str]]:
    return {n: imports_of(n, p.read_text()) for n, p in _modules().items()}


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
            for a, deps in sorted(graph.items()) for b in sorted(deps)
            if _layer(b) > _layer(a) and not (a.startswith(b + ".") and b == "equiv")]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles (a package importing its own submodules through ``__init__`` excepted
    where the submodule does not import it back)."""
    found, state = [], {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            if d == "equiv":
                continue  # every submodule's parent package: Python imports it first anyway
            if state.get(d) == 1:
                found.append(path[path.index(d):] + [d] if d in path else [n, d])
            elif d not in state:
                visit(d, path + [d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return found


def test_every_module_has_a_layer():
    """A new module must be placed in a layer here before it lands."""
    unplaced = [n for n in _modules() if not any(_placed(n, k) for k in LAYERS)]
    assert not unplaced


def test_modules_import_only_downward():
    assert upward_edges(_graph()) == []


def test_no_import_cycles():
    assert cycles(_graph()) == []


def test_check_modules_never_import_each_other():
    graph = _graph()
    bad = [(a, b) for a, deps in graph.items() if a.startswith("equiv.checks.")
           for b in deps if b.startswith("equiv.checks.")]
    assert bad == []


def test_the_layering_test_can_fail():
    """An injected upward import (the engine importing a check) and a cycle are caught."""
    graph = _graph()
    graph["equiv.execution.record"] = graph["equiv.execution.record"] | {"equiv.checks.forward"}
    assert upward_edges(graph) == [
        "equiv.execution.record (layer 2) imports equiv.checks.forward (layer 3)"]
    graph["equiv.checks.forward"] = graph["equiv.checks.forward"] | {"equiv.execution.record"}
    assert cycles(graph)
    src = "def f():\n    from equiv.checks import forward\n"
    assert "equiv.checks.forward" in imports_of("equiv.execution.record", src)


def test_catalog_rows_match_check_modules_and_failure_classes():
    from equiv import _catalog, pipeline
    from equiv.errors import EquivalenceFailure

    for row in _catalog.CATALOG:
        module = pipeline._MODULES[row.name]
        assert module.__name__ == f"equiv.checks.{row.module}" and callable(module.run)
        assert issubclass(row.failure, EquivalenceFailure)
    files = {p.stem for p in (ROOT / "equiv" / "checks").glob("*.py")} - {"__init__"}
    assert files == {r.module for r in _catalog.CATALOG}


def test_docs_check_table_is_the_catalog():
    from equiv._catalog import CATALOG

    text = (ROOT / "docs" / "reference.md").read_text()
    text = text[text.index("## Checks"):]
    text = text[:text.index("\n## ", 1)]
    rows = re.findall(r"^\| `([\w-]+)` \| `(\w+)` \| ([\w, ]+) \|", text, re.M)
    assert rows == [(r.name, r.failure.__name__, ", ".join(r.modes)) for r in CATALOG]
    costly = {name for name, line in re.findall(r"^\| `([\w-]+)` (.*)$", text, re.M)
              if "**costly**" in line}
    assert costly == {r.name for r in CATALOG if r.costly}


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_function_longer_than_80_lines(name):
    tree = ast.parse(_modules()[name].read_text())
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 80]
    assert long == []


def test_report_schema_lists_every_catalog_check():
    from equiv._catalog import CHECK_NAMES

    text = (ROOT / "docs" / "report-schema.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `check` |"))
    assert re.findall(r"`([\w-]+)`", row.split("(", 1)[1].split(";")[0]) == list(CHECK_NAMES)
