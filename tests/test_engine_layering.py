"""The turn engine's layering, read from the import graph (issue #12): no import cycle in ``proxy``, the byte
relay never calls back up into the engine or the edge, and the engine's deciding modules do no I/O."""

from __future__ import annotations

import ast
from pathlib import Path

from ctxproxy import proxy

PACKAGE = Path(proxy.__file__).parent
DECIDING = ("ctxproxy.proxy.engine.turn", "ctxproxy.proxy.engine.policy", "ctxproxy.proxy.engine.replies")
IO = ("httpx", "starlette", "anyio", "asyncio", "sqlite3", "ctxproxy.store", "ctxproxy.config",
      "ctxproxy.proxy.engine.state", "ctxproxy.proxy.engine.planning")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (a function-level or TYPE_CHECKING import counts too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the modules along it; [] if there is none (depth-first, three colours)."""
    colour: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        colour[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if colour.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in colour and (found := visit(nxt)):
                return found
        colour[node] = 2
        path.pop()
        return []

    return next((found for node in sorted(graph) if node not in colour and (found := visit(node))), [])


def test_proxy_has_no_import_cycle() -> None:
    """``relay`` used to import ``chat`` (for its ``Exchange``) while ``chat`` imported ``relay``."""
    assert _cycle(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_byte_relay_never_calls_back_up() -> None:
    graph = _graph()
    for module in ("ctxproxy.proxy.upstream.relay", "ctxproxy.proxy.upstream.streaming"):
        up = {m for m in graph[module] if m.startswith(("ctxproxy.proxy.engine", "ctxproxy.proxy.edge.chat"))}
        assert not up, f"{module} imports {up}"


def test_the_engines_deciding_modules_do_no_io() -> None:
    modules = _modules()
    for module in DECIDING:
        io = {m for m in _imports(modules[module]) if m.startswith(IO)}
        assert not io, f"{module} imports {io}"
