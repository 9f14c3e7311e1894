"""Modules and functions stay small enough to read whole: no module of the core or the Airflow provider over
MAX_MODULE_LINES lines, no function over MAX_FUNCTION_LINES (methods and nested functions included, each counted
whole). The registry's Alembic migrations are history, not code anyone reshapes, and are left out."""

from __future__ import annotations

import ast
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
ROOTS = (CHECKOUT / "include", CHECKOUT / "plugins")
MIGRATIONS = CHECKOUT / "include" / "changeover" / "registry" / "migrations"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(path for root in ROOTS for path in root.rglob("*.py") if MIGRATIONS not in path.parents)


def oversized(name: str, source: str, max_module: int = MAX_MODULE_LINES,
              max_function: int = MAX_FUNCTION_LINES) -> list[str]:
    """The module, if it is longer than max_module lines, and each function (def or async def, at any depth) longer
    than max_function, from its `def` line to its last, as `name:line: function (lines)`."""
    found = []
    lines = len(source.splitlines())
    if lines > max_module:
        found.append(f"{name}: {lines} lines, over {max_module}")
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > max_function:
                found.append(f"{name}:{node.lineno}: {node.name} ({length} lines, over {max_function})")
    return found


def test_the_checker_finds_long_modules_and_functions_at_any_depth() -> None:
    source = (
        "def short():\n"
        "    return 1\n"
        "\n"
        "\n"
        "class Holder:\n"
        "    def method(self):\n"
        "        def nested():\n"
        "            a = 1\n"
        "            return a\n"
        "        return nested\n"
        "\n"
        "    async def waits(self):\n"
        "        a = 1\n"
        "        return a\n"
    )
    assert oversized("m.py", source) == []
    assert oversized("m.py", source, max_module=14, max_function=5) == []
    assert sorted(oversized("m.py", source, max_module=13, max_function=2)) == [
        "m.py: 14 lines, over 13",
        "m.py:12: waits (3 lines, over 2)",
        "m.py:6: method (5 lines, over 2)",
        "m.py:7: nested (3 lines, over 2)",
    ]


def test_no_module_or_function_is_too_long() -> None:
    modules = _modules()
    assert MIGRATIONS.is_dir() and all(any(root in path.parents for path in modules) for root in ROOTS)
    found = [hit for path in modules for hit in oversized(str(path.relative_to(CHECKOUT)), path.read_text())]
    assert not found, "split these (modules by role, functions by extracting helpers):\n" + "\n".join(found)
