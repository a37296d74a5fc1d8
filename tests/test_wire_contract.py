"""The wire contract is declared once, in fedpers/protocol.py.

Every name that crosses the wire (record, array, config and metric keys, message
types) must be imported from ``fedpers.protocol`` on both sides: a quoted key under
``strategies/`` or ``clients/`` is a second declaration that can drift.
"""

from __future__ import annotations

import ast
import pkgutil
import re
from enum import Enum
from pathlib import Path

import pytest

from fedpers import algorithms, families, protocol

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("strategies", "clients")
RECORD_TYPES = {"ArrayRecord", "ConfigRecord", "MetricRecord", "RecordDict"}
# Subscripts of these are records (or what a record holds); others (a summary dict, a
# file's payload) are not on the wire.
RECORD_LIKE = re.compile(r"(record|records|metrics|config|arrays|content|state)$", re.I)
# Calls whose string arguments are seed purposes, not wire names.
SEED_CALLS = {"generator", "int_seed", "rng", "samples"}


def _declared() -> set[str]:
    """Every string value ``fedpers.protocol`` declares (constants and enum members), and
    every name a registered family puts on the wire (``FamilySpec.wire``) and its queries'
    message types."""
    values: set[str] = set()
    for value in vars(protocol).values():
        if isinstance(value, str) and not isinstance(value, Enum):
            values.add(value)
        elif isinstance(value, type) and issubclass(value, Enum):
            values.update(str(member.value) for member in value)
    for family in families.all_families():
        values.update(family.wire)
        values.update(protocol.query_type(query.name) for query in family.queries)
    for spec in algorithms.all_specs():
        values.update(spec.wire)
    return values


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that are docstrings."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _not_wire_strings(tree: ast.AST) -> set[int]:
    """ids of string constants that are not wire names: messages for people (exceptions,
    log calls) and seed purposes."""
    found = set()
    for node in ast.walk(tree):
        inside: ast.AST | None = None
        if isinstance(node, ast.Raise) and node.exc is not None:
            inside = node.exc
        elif (isinstance(node, ast.Call) and _call_name(node) in SEED_CALLS) or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"debug", "info", "warning", "error", "exception"}
        ):
            inside = node
        if inside is not None:
            found.update(id(n) for n in ast.walk(inside) if isinstance(n, ast.Constant))
    return found


def violations(source: str) -> list[tuple[int, str]]:
    """(line, why) of every wire name written as a literal in ``source``."""
    tree = ast.parse(source)
    skip = _docstrings(tree) | _not_wire_strings(tree)
    declared = _declared()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and RECORD_LIKE.search(ast.unparse(node.value)):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                found.append((node.lineno, f"record key {key.value!r} as a literal"))
        elif isinstance(node, ast.Call) and _call_name(node) in RECORD_TYPES:
            for arg in node.args:
                if isinstance(arg, ast.Dict):
                    for k in arg.keys:
                        if isinstance(k, ast.Constant) and isinstance(k.value, str):
                            found.append((k.lineno, f"{_call_name(node)} key {k.value!r}"))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in skip
            and node.value in declared
        ):
            found.append((node.lineno, f"{node.value!r} repeats a name of fedpers.protocol"))
    return found


@pytest.mark.parametrize(
    "path",
    sorted(p.relative_to(ROOT) for package in PACKAGES for p in (ROOT / package).rglob("*.py")),
    ids=str,
)
def test_no_wire_name_is_written_as_a_literal(path: Path) -> None:
    # Prepare / Execute
    found = violations((ROOT / path).read_text())
    # Assert
    assert found == [], f"{path}: " + "; ".join(f"line {line}: {why}" for line, why in found)


def test_the_check_finds_what_it_looks_for() -> None:
    # Prepare: each line breaks the contract one way
    source = (
        "x = reply.content['arrays']\n"
        "r = ConfigRecord({'neighbours': [1]})\n"
        "key = 'num-examples'\n"
        "pilots = arrays['pilots.3'] if 'transported' else None\n"
        'def f():\n    """num-examples in a docstring is fine."""\n'
        "    raise ValueError('num-examples in an error is fine')\n"
    )
    # Execute
    found = violations(source)
    # Assert
    assert sorted({line for line, _ in found}) == [1, 2, 3, 4]  # 4: a family's name


HUBS = (
    "fedpers/config.py",
    "fedpers/protocol.py",
    "clients/client_app.py",
    "strategies/server_app.py",
)


@pytest.mark.parametrize("hub", HUBS)
def test_the_shared_hubs_name_no_family(hub: str) -> None:
    # The hubs look families up in the registry (fedpers.families); a family named here
    # would make a new family edit a shared file.
    text = (ROOT / hub).read_text().lower()
    named = [word for word in ("sheaf", "gmm", "mixture", "linear") if word in text]
    assert named == [], f"{hub} names {named}"


# Shared modules below the hubs: they may know data sets (the synthetic mixtures are one)
# but no family; a family's data protocol or fault targets are its FamilySpec's.
SHARED = ("fedpers/data/client.py", "clients/faults.py")
# a family's own modules: its family module, its math (fedpers.<family math>), its clients
FAMILY_MODULES = {
    *(f"fedpers.families.{m.name}" for m in pkgutil.iter_modules(families.__path__)),
    "fedpers.sheaf",
    "fedpers.gmm",
    "fedpers.linear",
}


def family_imports(source: str) -> list[str]:
    """The modules of a family (its family module, math or client) that ``source``
    imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [n for n in names if n in FAMILY_MODULES]
    return sorted(set(found))


def family_identifiers(source: str) -> list[str]:
    """Names in the code of ``source`` (not its docstrings or comments, which may say
    whose protocol a thing is) that name a family's knowledge."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        name = (
            getattr(node, "id", None)
            or getattr(node, "attr", None)
            or getattr(node, "arg", None)
            or (getattr(node, "name", None) if not isinstance(node, ast.alias) else None)
        )
        if isinstance(name, str) and re.search("sheaf|gmm|fedem", name, re.I):
            found.add(name)
    return sorted(found)


@pytest.mark.parametrize("module", SHARED)
def test_shared_modules_import_no_family(module: str) -> None:
    text = (ROOT / module).read_text()
    assert family_imports(text) == []
    assert family_identifiers(text) == []


def test_the_family_import_check_finds_them() -> None:
    source = (
        "from fedpers.families import mixture as m\n"
        "from fedpers.families.sheaf import NAME\n"
        "import fedpers.gmm\n"
        "from fedpers.cohort import Cohort\n"
        "from fedpers.families import FamilySpec\n"
    )
    assert family_imports(source) == [
        "fedpers.families.mixture",
        "fedpers.families.sheaf",
        "fedpers.gmm",
    ]
    assert family_identifiers('"""FedGMM\'s."""\nx = sheaf_family.PILOTS\n') == ["sheaf_family"]
