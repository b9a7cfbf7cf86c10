"""The code's shape, held by a test: no function above 60 lines, no class above 150, no module above 400 (STYLE.md
§9), in the shipped packages.

ruff holds the cyclomatic complexity (C901 at 10, ``pyproject.toml``) and import-linter the layering
(``[tool.importlinter]``); lengths have no ruff rule, so this scan of the syntax trees holds them. A function's
length runs from its ``def`` to its last line, docstring included; nested functions count inside their parent and
on their own. ``store/migrations.py`` is exempt: a migration is a schema written out once and never edited, whose
column comments are the schema's documentation. tests/ and bench/ are not scanned: a table-driven test or a
benchmark's report may be long on purpose (ruff's complexity rule still covers them).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proxy", "store", "config")
MAX_FUNCTION = 60
MAX_CLASS = 150
MAX_MODULE = 400
EXEMPT = {"store/migrations.py"}

TEMPORARY: dict[str, set[str]] = {}
"""Offenders let through for now, by path and name (none today): an entry that no longer names an offender fails
the test, so a stale one cannot linger."""


def too_long(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """Each function or class of ``tree`` above its limit, as (name, lines); the module itself as ``<module>``."""
    lines = max((node.end_lineno or node.lineno for node in tree.body), default=0)
    if lines > MAX_MODULE:
        yield "<module>", lines
    for node in ast.walk(tree):
        limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                yield node.name, lines


def offenders() -> dict[str, dict[str, int]]:
    found: dict[str, dict[str, int]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name not in EXEMPT and (long := dict(too_long(ast.parse(path.read_text(), name)))):
                found[name] = long
    return found


def test_no_function_is_above_60_lines_no_class_above_150_and_no_module_above_400() -> None:
    unexpected = {path: {name: lines for name, lines in long.items() if name not in TEMPORARY.get(path, set())}
                  for path, long in offenders().items()}
    assert {path: long for path, long in unexpected.items() if long} == {}


def test_every_temporary_exception_still_names_an_offender() -> None:
    found = offenders()
    stale = {path: names - set(found.get(path, {})) for path, names in TEMPORARY.items()}
    assert {path: names for path, names in stale.items() if names} == {}


def test_the_scan_sees_a_long_function_a_long_class_and_a_long_module() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    source = f"def f():\n{body}\n\nclass C:\n" + "\n".join(f"    y{i} = {i}" for i in range(MAX_CLASS))
    assert dict(too_long(ast.parse(source))) == {"f": MAX_FUNCTION + 1, "C": MAX_CLASS + 1}
    padded = source + "\n" * (MAX_MODULE - source.count("\n")) + "z = 0\n"
    assert dict(too_long(ast.parse(padded)))["<module>"] == MAX_MODULE + 1


def test_the_exemption_and_the_scan_cover_real_files() -> None:
    assert all((ROOT / name).is_file() for name in EXEMPT | set(TEMPORARY))
    scanned = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    assert len(scanned) > 50 and any(p.parent.name == "core" for p in scanned)
