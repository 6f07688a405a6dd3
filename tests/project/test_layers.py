"""The package's floors (README "Layout"): a module imports only from its own floor or the floors below it, and
no modules import each other in a circle. Read from the source (every import statement, at the top of a module
or inside a function), so a lazy import that runs up a floor counts too.

KNOWN_UPWARD and KNOWN_CIRCLES are what is left to untangle (issue 28); the test fails on any new one and on
any known one that is gone (then take it off the list)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sao_core", "pipelines", "components")

#: floors from the top (index 0) down; a module belongs to the first prefix that matches it
FLOORS = [
    ("sao_core.cli", "sao_core.demo"),
    ("sao_core.sim",),
    ("pipelines",),
    ("components",),
    ("sao_core.kfp",),
    ("sao_core.cluster",),
    ("sao_core.learner",),
    ("sao_core.eval",),
    ("sao_core.rollout",),
    ("sao_core.envs",),
    ("sao_core.sandbox",),
    ("sao_core.training",),
    ("sao_core.objectives",),
    ("sao_core.models",),
    ("sao_core.reporting",),
    ("sao_core.data",),
    ("sao_core.storage", "sao_core.config", "sao_core.images", "sao_core"),
]

#: (importing module, imported module) still running up a floor
KNOWN_UPWARD: set[tuple[str, str]] = set()
#: circles of modules still to break, each as its sorted members
KNOWN_CIRCLES: set[tuple[str, ...]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node, except those under `if TYPE_CHECKING:` (imports for type hints only, never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (a `from package import name` naming a submodule counts as
    importing that submodule)."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        edges[name] = found
    return edges


def _floor(module: str) -> int:
    for index, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is on no floor: add it to FLOORS (and to README 'Layout')")


def _circles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Strongly connected groups of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.add(tuple(sorted(group)))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_from_a_floor_above_its_own():
    edges = _imports(_modules())
    # A package's __init__ re-exporting its own submodules is not an import across floors.
    upward = {(src, dst) for src, targets in edges.items() for dst in targets if _floor(dst) < _floor(src)}
    assert upward - KNOWN_UPWARD == set(), "imports that run up a floor: " + ", ".join(
        f"{s} -> {d}" for s, d in sorted(upward - KNOWN_UPWARD))
    assert KNOWN_UPWARD - upward == set(), f"fixed, take off KNOWN_UPWARD: {sorted(KNOWN_UPWARD - upward)}"


def test_no_modules_import_each_other_in_a_circle():
    circles = _circles(_imports(_modules()))
    assert circles - KNOWN_CIRCLES == set(), f"import circles: {sorted(circles - KNOWN_CIRCLES)}"
    assert KNOWN_CIRCLES - circles == set(), f"broken, take off KNOWN_CIRCLES: {sorted(KNOWN_CIRCLES - circles)}"


def test_the_checker_sees_an_upward_import_and_a_circle():
    """The two checks on a planted graph: a model module importing the learner, and a two-module circle."""
    planted = {"sao_core.models.loading": {"sao_core.learner.loop"}, "sao_core.learner.loop": {"sao_core.models"},
               "sao_core.eval.run": {"sao_core.eval.report"}, "sao_core.eval.report": {"sao_core.eval.run"}}
    upward = {(s, d) for s, ts in planted.items() for d in ts if _floor(d) < _floor(s)}
    assert upward == {("sao_core.models.loading", "sao_core.learner.loop")}
    assert _circles(planted) == {("sao_core.eval.report", "sao_core.eval.run")}
