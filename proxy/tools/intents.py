"""A context tool call, validated into an intent: what the model asked for, before anything is applied.

Handlers never see the conversation (the first seed): a call's arguments become a frozen intent here, or a
``ToolError`` whose message goes back to the model as the call's result so it can fix the call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Ctx", "Drop", "Intent", "Note", "Pin", "ReadOverflow", "Status", "ToolError", "Unpin", "parse_call"]

NOTE_LIMIT = 4000
SNIPPET_MIN = 12


class ToolError(ValueError):
    """A call the proxy cannot carry out as given; the message says what to change."""


@dataclass(frozen=True)
class Status:
    top: int = 8


@dataclass(frozen=True)
class Pin:
    handles: tuple[str, ...] = ()
    snippet: str | None = None


@dataclass(frozen=True)
class Unpin:
    handles: tuple[str, ...] = ()
    snippet: str | None = None
    all: bool = False


@dataclass(frozen=True)
class Drop:
    handles: tuple[str, ...]


@dataclass(frozen=True)
class Note:
    handles: tuple[str, ...]
    note: str


@dataclass(frozen=True)
class ReadOverflow:
    id: str
    offset: int = 0
    limit: int = 4000
    grep: str | None = None


@dataclass(frozen=True)
class Ctx:
    """The second seed's ``ctx``: ``status``, ``clear`` (a selection narrowed by masks) or ``commit``."""

    action: str
    call_ids: tuple[str, ...] = ()
    before: str | None = None
    keep_last: int | None = None
    tool: str | None = None


Intent = Status | Pin | Unpin | Drop | Note | ReadOverflow | Ctx


def parse_call(name: str, arguments: str | dict[str, Any] | None) -> Intent:
    args = _arguments(arguments)
    if name == "context_status":
        return Status(_int(args, "top", 8, 1, 30))
    if name == "context_pin":
        return Pin(*_target(args))
    if name == "context_unpin":
        every = args.get("all", False)
        if not isinstance(every, bool):
            raise ToolError("`all` must be true or false.")
        handles, snippet = _target(args, required=not every)
        return Unpin(handles, snippet, every)
    if name == "context_drop":
        return Drop(_handles(args, required=True))
    if name == "context_note":
        note = args.get("note")
        if not isinstance(note, str) or not note.strip() or len(note) > NOTE_LIMIT:
            raise ToolError(f"`note` must be your text, 1 to {NOTE_LIMIT} characters.")
        return Note(_handles(args, required=True), note)
    if name == "read_overflow":
        return _read_overflow(args)
    if name == "ctx":
        return _ctx(args)
    raise ToolError(f"Unknown context tool {name!r}.")


def _arguments(arguments: str | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ToolError(f"The arguments are not valid JSON ({exc.msg}); send a JSON object.") from None
    if not isinstance(parsed, dict):
        raise ToolError("The arguments must be a JSON object.")
    return parsed


def _handles(args: dict[str, Any], required: bool) -> tuple[str, ...]:
    handles = args.get("handles", [])
    if isinstance(handles, str):
        handles = [handles]
    if not isinstance(handles, list) or not all(isinstance(h, str) and h for h in handles):
        raise ToolError("`handles` must be a list of handles, e.g. [\"call_7\"].")
    if required and not handles:
        raise ToolError("Name at least one result in `handles`.")
    return tuple(dict.fromkeys(handles))


def _target(args: dict[str, Any], required: bool = True) -> tuple[tuple[str, ...], str | None]:
    handles = _handles(args, required=False)
    snippet = args.get("snippet")
    if snippet is not None and (not isinstance(snippet, str) or len(snippet) < SNIPPET_MIN):
        raise ToolError(f"`snippet` must be at least {SNIPPET_MIN} characters of one message.")
    if required and not handles and not snippet:
        raise ToolError("Give `handles` or a `snippet`.")
    return handles, snippet


def _int(args: dict[str, Any], key: str, default: int, lo: int, hi: int | None = None) -> int:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"{lo}–{hi}" if hi is not None else f"≥ {lo}"
        raise ToolError(f"`{key}` must be a whole number {bound}.")
    return value


def _ctx(args: dict[str, Any]) -> Ctx:
    action = args.get("action", "commit")  # an empty object means commit
    if action not in ("status", "clear", "commit"):
        raise ToolError("`action` must be status, clear or commit.")
    before, tool = args.get("before"), args.get("tool")
    if (before is not None and not isinstance(before, str)) or (tool is not None and not isinstance(tool, str)):
        raise ToolError("`before` and `tool` must be strings.")
    keep_last = _int(args, "keep_last", 0, 0) if "keep_last" in args else None
    call_ids = _handles({"handles": args.get("call_ids", [])}, required=False)
    return Ctx(action, call_ids, before, keep_last, tool)


def _read_overflow(args: dict[str, Any]) -> ReadOverflow:
    oid = args.get("id")
    if not isinstance(oid, str) or not oid:
        raise ToolError("`id` must be the id of an [overflow id=...] stub.")
    grep = args.get("grep")
    if grep is not None and not isinstance(grep, str):
        raise ToolError("`grep` must be a regular expression.")
    return ReadOverflow(oid.strip(), _int(args, "offset", 0, 0), _int(args, "limit", 4000, 1, 20000), grep or None)
