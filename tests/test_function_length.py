"""Functions stay short enough to read at once (the library-shape issue): at most
``LIMIT`` lines of code, not counting the docstring, unless the line of the ``def`` (or
the one above it) says why with a ``# long: <reason>`` comment."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fedpers", "clients", "strategies", "simulations", "docker")
LIMIT = 60


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the function's last line, less its docstring's."""
    assert node.end_lineno is not None
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        assert first.end_lineno is not None
        lines -= first.end_lineno - first.lineno + 1
    return lines


def too_long(source: str, limit: int = LIMIT) -> list[tuple[str, int, int]]:
    """(name, line, code lines) of every function over ``limit`` without a reason."""
    text = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        near = text[max(first - 2, 0) : node.lineno]
        if code_lines(node) > limit and not any("# long:" in line for line in near):
            found.append((node.name, node.lineno, code_lines(node)))
    return found


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_is_over_the_limit_without_a_reason(path: Path) -> None:
    assert too_long(path.read_text()) == []


def test_the_check_counts_code_not_docstrings_and_reads_reasons() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT - 1))  # def + body = LIMIT
    docstring = '    """' + "\n" * 30 + '    """\n'
    assert too_long(f"def f():\n{docstring}{body}\n") == []
    assert too_long(f"def f():\n{body}\n    return 0\n") == [("f", 1, LIMIT + 1)]
    assert too_long(f"# long: one table\ndef f():\n{body}\n    return 0\n") == []
