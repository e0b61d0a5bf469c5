"""The layout's promises, read from the code's own imports (every import statement, those inside
functions and under TYPE_CHECKING included): no import circle in core, between modules or
between packages; a contract root that imports no subpackage and at most 16 loose modules at
the root; no core module that imports a plugin and no plugin that imports another; no module
that imports another module's private names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"


def core_modules() -> dict[str, Path]:
    """Core's modules by the name they install as (core/ is the ``alignzoo`` package)."""
    modules = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = list(path.relative_to(CORE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(["alignzoo", *parts])] = path
    return modules


def imports_of(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported from, name imported or None, line) for every import in ``path``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(base, alias.name, node.lineno) for alias in node.names]
    return found


def resolve(target: str, imported: str | None, modules: dict[str, Path]) -> str | None:
    """The core module an import loads (``from pkg import module`` names the module)."""
    candidate = f"{target}.{imported}" if imported else target
    if candidate in modules:
        return candidate
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def import_graph() -> dict[str, set[str]]:
    modules = core_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, imported, _ in imports_of(name, path):
            if not target.startswith("alignzoo") or target.startswith("alignzoo.plugins"):
                continue
            module = resolve(target, imported, modules)
            if module is not None and module != name:
                graph[name].add(module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_reader_finds_a_circle_and_resolves_relative_imports(tmp_path: Path) -> None:
    # The premise of the tests below: a circle through a lazy import is seen.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    source = tmp_path / "m.py"
    source.write_text(
        "from . import sibling\nfrom .pkg import _hidden\n\ndef f():\n    import x.y\n"
    )
    assert imports_of("alignzoo.engine.m", source) == [
        ("alignzoo.engine", "sibling", 1),
        ("alignzoo.engine.pkg", "_hidden", 2),
        ("x.y", None, 5),
    ]


def test_core_has_no_import_circle() -> None:
    graph = import_graph()
    # premise: the lazy package's TYPE_CHECKING imports are edges, so a circle through it counts
    assert "alignzoo.labeling" in graph["alignzoo.engine.modes.base"]
    assert "alignzoo.labeling.orchestrator" in graph["alignzoo.labeling"]
    assert cycles(graph) == []


def test_core_never_imports_a_plugin_module() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for name, path in core_modules().items()
        for target, _, line in imports_of(name, path)
        if target.startswith("alignzoo.plugins")
    ]
    assert offenders == []


@pytest.mark.parametrize("tree", ["core", "plugins"])
def test_no_module_imports_another_modules_private_names(tree: str) -> None:
    modules = core_modules()
    offenders = []
    for path in sorted((ROOT / tree).rglob("*.py")):
        name = "alignzoo." + ".".join(path.relative_to(ROOT / tree).with_suffix("").parts)
        if tree == "plugins":
            name = "alignzoo.plugins." + name.removeprefix("alignzoo.")
        for target, imported, line in imports_of(name.removesuffix(".__init__"), path):
            private = (
                imported is not None and imported.startswith("_") and not imported.startswith("__")
            )
            if private and target.startswith("alignzoo") and f"{target}.{imported}" not in modules:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{imported}")
    assert offenders == []


def test_the_architecture_pages_tree_names_every_module_and_no_missing_one() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    tree = page.split("## The tree", 1)[1].split("```", 2)[1]
    named = set(re.findall(r"\b([a-z_]+\.py)\b", tree))
    files = {p.name for base in ("core", "plugins") for p in (ROOT / base).rglob("*.py")} - {
        "__init__.py",
        "__main__.py",
    }
    assert sorted(files - named) == [], "modules the tree does not show"
    elsewhere = {p.name for p in [*ROOT.glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]}
    elsewhere |= {"__init__.py"}
    example = {"file.py"}  # "file.py:name", the form of a user's callable
    assert sorted(named - files - elsewhere - example) == [], "named files that do not exist"


CONTRACT = ("hookspecs", "types", "plugin", "batch", "ops", "errors")
"""The contract root: what a plugin is written against, which imports no subpackage."""
MAX_LOOSE_MODULES = 16


def package_of(module: str) -> str:
    """The package a core module belongs to: ``alignzoo.<sub>`` for a subpackage's module, the
    module itself for one loose at the root."""
    parts = module.split(".")
    if len(parts) > 1 and (CORE / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def package_graph() -> dict[str, dict[str, list[str]]]:
    """Package -> the packages it imports -> the module edges that make each import (a module
    of the root is its own node)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, targets in import_graph().items():
        mine = package_of(module)
        edges = graph.setdefault(mine, {})
        for target in sorted(targets):
            theirs = package_of(target)
            if theirs != mine:
                edges.setdefault(theirs, []).append(f"{module} -> {target}")
    return graph


def test_the_package_reader_finds_a_circle_between_packages() -> None:
    # The premise of the test below: modules that do not form a circle, whose packages do.
    assert package_of("alignzoo.engine.modes.base") == "alignzoo.engine"
    assert package_of("alignzoo.types") == "alignzoo.types"
    modules = {"p.a": {"q.b"}, "q.b": set(), "q.c": {"p.d"}, "p.d": set()}
    packages = {
        pkg: {t.split(".")[0] for m, ts in modules.items() if m.startswith(pkg) for t in ts} - {pkg}
        for pkg in ("p", "q")
    }
    assert cycles(modules) == []
    assert cycles(packages) == [["p", "q"]]


def test_core_has_no_import_circle_between_packages() -> None:
    graph = package_graph()
    # premise: the subpackages are nodes and the layers' edges are seen
    assert "alignzoo.config" in graph["alignzoo.engine"]
    found = cycles({pkg: set(edges) for pkg, edges in graph.items()})
    named = [
        " <-> ".join(circle)
        + ": "
        + "; ".join(edge for a in circle for b in circle if b in graph[a] for edge in graph[a][b])
        for circle in found
    ]
    assert named == [], "package circles"


@pytest.mark.parametrize("module", CONTRACT)
def test_the_contract_root_imports_no_subpackage(module: str) -> None:
    graph = import_graph()
    reached = sorted(
        target for target in graph[f"alignzoo.{module}"] if package_of(target) != target
    )
    assert reached == [], f"alignzoo.{module} imports a subpackage"


def test_the_root_holds_at_most_16_loose_modules() -> None:
    loose = sorted(
        p.name for p in CORE.glob("*.py") if p.name not in {"__init__.py", "__main__.py"}
    )
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def test_a_built_in_plugin_imports_no_other_plugin() -> None:
    """A plugin module imports the package (core), never another plugin; its own private
    helper module (``_name.py`` beside it, imported by it alone) is part of it."""
    plugins = ROOT / "plugins"
    names = {
        "alignzoo.plugins."
        + ".".join(p.relative_to(plugins).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(plugins.rglob("*.py"))
    }
    users: dict[str, set[str]] = {}
    for name, path in names.items():
        if path.name == "__init__.py":
            continue
        for target, imported, _ in imports_of(name, path):
            if target.startswith("alignzoo.plugins"):
                module = f"{target}.{imported}" if f"{target}.{imported}" in names else target
                users.setdefault(module, set()).add(name)
    offenders = sorted(
        f"{', '.join(sorted(importers))} import {module}"
        for module, importers in users.items()
        if not module.rpartition(".")[2].startswith("_") or len(importers) > 1
    )
    assert offenders == []
