"""The core's import graph has no cycle: every import statement of ``fedpers/`` counted
(at module level, under ``TYPE_CHECKING`` and inside functions), a module of the core
never reaches itself. The families and the algorithm table plug into the configuration
(it finds them by name, as it finds installed extensions); the torch side of a family's
update is named by its ``FamilySpec.update``, not imported by the family module.

The same holds for the three folders beside the core (``strategies``, ``clients``,
``simulations``), each counted with the core."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {
    "strategies": "fedpers.strategies",
    "clients": "fedpers.clients",
    "simulations": "fedpers.simulations",
}


def module_names(folder: str) -> dict[str, Path]:
    """Each module of ``folder`` (``fedpers`` or one beside it) by its import name."""
    prefix = FOLDERS.get(folder, "fedpers")
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([prefix, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            # a name that is a submodule imports the submodule, not its package
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("folder", ["fedpers", *FOLDERS])
def test_no_import_cycle(folder: str) -> None:
    modules = module_names("fedpers") | module_names(folder)
    graph = {name: imports(name, path, set(modules)) for name, path in modules.items()}
    assert cycles(graph) == []


def test_the_check_finds_a_cycle_through_a_function_and_type_checking(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    path = tmp_path / "z.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fedpers.x import Y\n"
        "def f():\n    import fedpers.y\n"
    )
    known = {"fedpers.x", "fedpers.y", "fedpers.z"}
    assert imports("fedpers.z", path, known) == {"fedpers.x", "fedpers.y"}
