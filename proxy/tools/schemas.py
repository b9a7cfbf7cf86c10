"""The context tools the proxy offers the model, as OpenAI function schemas (DESIGN.md §5, the first seed).

Built once, at import, as constants: the tool list a model sees must be byte-identical from request to request,
or the upstream's prefix cache (which covers the tool definitions) is lost. Descriptions are short: they are
paid for on every request of a turn in which the tools are offered.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONTEXT_TOOLS", "READ_TOOL", "TOOL_NAMES"]

_HANDLES = {"type": "array", "items": {"type": "string"},
            "description": "Handles of results you have read: a tool result's tool_call_id (e.g. call_7)."}


def _function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


CONTEXT_TOOLS: tuple[dict[str, Any], ...] = (
    _function("context_status", "Show how full your context is: used/window tokens, the largest results still in "
              "context with their handles, pins, and spilled results with their overflow ids.",
              {"top": {"type": "integer", "minimum": 1, "maximum": 30, "description": "How many largest results."}},
              []),
    _function("context_pin", "Keep results (or the one message containing `snippet`) whole: never spilled, elided "
              "or folded.", {"handles": _HANDLES, "snippet": {"type": "string", "minLength": 12}}, []),
    _function("context_unpin", "Remove your pins: by handle, by snippet, or all of them.",
              {"handles": _HANDLES, "snippet": {"type": "string", "minLength": 12}, "all": {"type": "boolean"}}, []),
    _function("context_drop", "Move results you no longer need out of context; each leaves a one-line stub and "
              "stays restorable with read_overflow.", {"handles": _HANDLES}, ["handles"]),
    _function("context_note", "Replace results by your own note (what you still need from them, at most 4000 "
              "characters); the originals stay restorable.",
              {"handles": _HANDLES, "note": {"type": "string", "maxLength": 4000}}, ["handles", "note"]),
    _function("read_overflow", "Read content that was cut from your context, by the id in its [overflow id=...] "
              "stub: a page at a time, or the lines matching a regular expression.",
              {"id": {"type": "string"}, "offset": {"type": "integer", "minimum": 0},
               "limit": {"type": "integer", "minimum": 1, "maximum": 20000}, "grep": {"type": "string"}}, ["id"]),
    _function("ctx", "status: your context's budget, the mirror and what you cleared. clear: cut tool results — "
              "those in call_ids, or every one before `before`; tool and keep_last narrow that selection, or "
              "select by themselves (tool=read, keep_last=3: every read result but the last three).",
              {"action": {"type": "string", "enum": ["status", "clear", "commit"]},
               "call_ids": {"type": "array", "items": {"type": "string"}}, "before": {"type": "string"},
               "keep_last": {"type": "integer", "minimum": 0}, "tool": {"type": "string"}}, []),
)

TOOL_NAMES = frozenset(tool["function"]["name"] for tool in CONTEXT_TOOLS)

READ_TOOL = next(tool for tool in CONTEXT_TOOLS if tool["function"]["name"] == "read_overflow")
"""Listed alone from a session's first stub on, when the others are not offered: the way back is always there."""
