"""The import graph of ``rlaxkit`` and ``sim``, read from the source (AST), for the layout
tests (``tests/test_layout.py``).

A module's imports are every ``import`` and ``from ... import`` it runs, at the top or
inside a function, resolved to the project's modules; ``from pkg import name`` is an edge
to ``pkg.name`` where that is a module, else to ``pkg``. Imports under ``if
TYPE_CHECKING:`` are kept apart: they shape the layering, not what runs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlaxkit", "sim")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


@dataclass
class Imports:
    """A module's imports of the project's modules, and of everything else (top names)."""

    runs: set[str] = field(default_factory=set)
    typing_only: set[str] = field(default_factory=set)
    external: set[str] = field(default_factory=set)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(tree: ast.AST, typing_only: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.body:
                yield child, True
                yield from _walk(child, True)
            for child in node.orelse:
                yield child, typing_only
                yield from _walk(child, typing_only)
            continue
        yield node, typing_only
        yield from _walk(node, typing_only)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> Imports:
    found = Imports()
    is_package = path.name == "__init__.py"
    for node, typing_only in _walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                child = f"{source}.{alias.name}"
                targets.append(child if child in modules else source)
        for target in targets:
            if target.split(".")[0] not in PACKAGES:
                found.external.add(target.split(".")[0])
                continue
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                (found.typing_only if typing_only else found.runs).add(target)
    return found


def import_graph() -> dict[str, Imports]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


if __name__ == "__main__":
    graph = import_graph()
    runs = {name: imports.runs for name, imports in graph.items()}
    for component in cycles(runs):
        print(len(component), component)
    both = {name: imports.runs | imports.typing_only for name, imports in graph.items()}
    print("with typing-only imports:")
    for component in cycles(both):
        print(len(component), component)
