"""Cutting the large arguments of old tool calls (the second seed: "tool results and call arguments may be removed").

An agent that writes files sends the whole body as a call argument (``write_file``'s ``content``, an edit's
``new_string``): after a few rounds those bodies are most of the context, and no result cut can reach them. An
argument cut replaces each large string value inside a call's JSON arguments by a stub — the same first line as
every other stub, restorable with ``read_overflow`` — and leaves everything else of the call as it was: its id,
its name, its other arguments, and arguments that stay valid JSON (the big string's place holds the stub text).

A decision names the assistant message and the call (``args_target``); its ``replacement`` is the call's whole
new arguments string, so it is re-applied byte for byte. The stored body of each stub is the original string
value. Arguments that are not a JSON object are never cut. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ctxproxy.proxy.core.budget import MIN_CUT_CHARS
from ctxproxy.proxy.core.decisions import OverflowWrite
from ctxproxy.proxy.core.state import sha256_text
from ctxproxy.proxy.core.stubs import argument_stub

__all__ = ["ArgumentCut", "args_target", "cut_arguments", "with_arguments"]


@dataclass(frozen=True)
class ArgumentCut:
    arguments: str
    """The call's new arguments (JSON), each cut value holding its stub."""
    writes: tuple[OverflowWrite, ...]


def args_target(mid: str, call_id: str) -> str:
    """A decision's target for the arguments of call ``call_id`` in assistant message ``mid``."""
    return f"{mid}>args:{call_id}"


def cut_arguments(arguments: str, tool: str, call_id: str, storage: str,
                  overflow_dir: str = "") -> ArgumentCut | None:
    """Every string value of at least ``MIN_CUT_CHARS`` characters replaced by its stub; None when there is none,
    the arguments are not a JSON object, or the result would not be shorter."""
    writes: list[OverflowWrite] = []

    def cut(key: str, value: str) -> str:
        if len(value) < MIN_CUT_CHARS:
            return value
        stub = argument_stub(sha256_text(value), tool, call_id, storage, value, key, overflow_dir)
        if len(stub) >= len(value):
            return value
        writes.append(OverflowWrite(sha256_text(value), value, tool, call_id))
        return stub

    if len(arguments) < MIN_CUT_CHARS:
        return None  # decoding never lengthens a JSON text: no value in it is long enough to cut
    parsed = _object(arguments)
    if parsed is None:
        return None
    walked = _walk(parsed, "", cut)
    if not writes:
        return None
    new = json.dumps(walked, ensure_ascii=False)
    return ArgumentCut(new, tuple(writes)) if len(new) < len(arguments) else None


def with_arguments(message: dict[str, Any], replaced: dict[str, str]) -> dict[str, Any]:
    """``message`` with the arguments of the calls in ``replaced`` (call id → arguments) swapped in."""
    calls = [{**c, "function": {**c["function"], "arguments": replaced[c.get("id")]}}
             if c.get("id") in replaced and isinstance(c.get("function"), dict) else c
             for c in message.get("tool_calls") or []]
    return {**message, "tool_calls": calls}


def _object(arguments: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return None
    return parsed if isinstance(parsed, dict) else None


def _walk(value: Any, key: str, cut: Callable[[str, str], str]) -> Any:
    """``value`` with each string leaf passed through ``cut`` (with its key, or its parent's inside a list)."""
    if isinstance(value, str):
        return cut(key, value)
    if isinstance(value, dict):
        return {k: _walk(v, str(k), cut) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, key, cut) for v in value]
    return value
