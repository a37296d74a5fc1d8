"""Every Python snippet of docs/extending.md shows its imports and runs.

The snippets are read in order as one module (the doc builds Ditto's module over two of
them): every name a snippet uses is bound by an import or definition of it or of an
earlier snippet, or is a builtin (``symtable``'s free names, function bodies included);
then each runs, with the registrations of the family and the extension's function
captured instead of performed (fedpers registers those already), and what they define
is compared with the code they quote."""

from __future__ import annotations

import builtins
import re
import symtable
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from fedpers import algorithms, families

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "extending.md"
EXAMPLE = ROOT / "examples" / "server_momentum"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def _names(code: str) -> tuple[set[str], set[str]]:
    """(names bound at module level, names used but not bound in their own scope)."""
    table = symtable.symtable(code, "<snippet>", "exec")
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    used: set[str] = set()

    def walk(scope: symtable.SymbolTable) -> None:
        for symbol in scope.get_symbols():
            module = str(scope.get_type()).lower().endswith("module")
            if symbol.is_referenced() and (
                (module and symbol.get_name() not in bound) or (not module and symbol.is_global())
            ):
                used.add(symbol.get_name())
        for child in scope.get_children():
            walk(child)

    walk(table)
    return bound, used


def test_the_doc_has_its_snippets() -> None:
    assert len(snippets()) == 5


def test_every_snippet_shows_its_imports() -> None:
    bound: set[str] = set(dir(builtins))
    missing = {}
    for index, code in enumerate(snippets()):
        own, used = _names(code)
        bound |= own
        if used - bound:
            missing[index] = sorted(used - bound)
    assert missing == {}


def test_every_snippet_runs_and_matches_the_code_it_quotes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fedpers.data import sources

    algorithms.names()  # the table loaded (with the real register) before it is patched
    captured: dict[str, list[Any]] = {"family": [], "row": [], "dataset": [], "model": []}
    monkeypatch.setattr(families, "register", lambda spec: captured["family"].append(spec) or spec)
    monkeypatch.setattr(algorithms, "register", captured["row"].append)
    monkeypatch.setattr(sources, "register_dataset", lambda *a, **k: captured["dataset"].append(a))
    import fedpers.models as models

    monkeypatch.setattr(models, "register_model", lambda *a, **k: captured["model"].append(a))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    module = types.ModuleType("extending_doc")  # dataclasses look their module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    # The example's module, imported by the last snippet while register_dataset and
    # register_model are stubs, must not outlive the test (it would keep the stubs).
    monkeypatch.delitem(sys.modules, "fedpers_server_momentum", raising=False)
    try:
        for code in snippets():
            exec(compile(code, str(DOC), "exec"), namespace)
        _check(namespace, captured)
    finally:
        sys.modules.pop("fedpers_server_momentum", None)


def _check(namespace: dict[str, Any], captured: dict[str, list[Any]]) -> None:
    from fedpers.algorithms.ditto import DittoSettings

    (row,) = namespace["ROWS"]
    real = algorithms.get("fedbabu")
    for field in ("name", "family", "shared", "phases", "final_test", "paper"):
        assert getattr(row, field) == getattr(real, field), field
    assert namespace["DittoSettings"]().ditto_lambda == DittoSettings().ditto_lambda
    assert callable(namespace["fit"])
    (family,) = captured["family"]
    assert family.name == families.LINEAR
    assert [q.name for q in family.queries] == [
        q.name for q in families.get(families.LINEAR).queries
    ]
    namespace["register"]()
    assert [r.name for r in captured["row"]] == ["fedavgm-example"]
    assert [d[0] for d in captured["dataset"]] == ["blobs"]
    assert [m[0] for m in captured["model"]] == ["blobs-mlp"]
