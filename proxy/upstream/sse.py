"""Reading server-sent events after the fact: the ``usage`` of a streamed answer, for the journal.

The relay itself never parses: it forwards bytes as they arrive. These helpers run once the stream has ended.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import orjson

__all__ = ["data_events", "last_usage", "sse_lines"]

_LINE_END = re.compile(r"\r\n|\r|\n")
"""SSE's only line terminators. ``str.splitlines`` also breaks on U+0085, U+2028 and others, which JSON carries
unescaped inside a string: a payload holding one would be cut in two."""


def sse_lines(text: str) -> list[str]:
    """The lines of an event stream, split where the SSE grammar splits them and nowhere else."""
    return _LINE_END.split(text)


def data_events(text: str) -> Iterator[Any]:
    """The JSON payload of each ``data:`` line, skipping ``[DONE]``, comments and anything unparseable."""
    for line in sse_lines(text):
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == "[DONE]":
            continue
        try:
            yield orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue


def last_usage(text: str) -> dict[str, Any] | None:
    """The last non-null ``usage`` object among the events (sent with ``stream_options.include_usage``)."""
    usage = None
    for event in data_events(text):
        if isinstance(event, dict) and isinstance(event.get("usage"), dict):
            usage = event["usage"]
    return usage
