"""How the context tools name what they act on: a session's view, and the handles the model writes.

A handle is ``r<round>.<i>`` (one body of a text-protocol results message), ``r<round>`` (every body of that
round), ``m<8 hex>`` (a whole results message by its content hash), a native result's ``tool_call_id`` or its
identity (``tool:<id>[#n]``); ``units_named`` resolves one to ``Unit``s or says why it names none. The other
functions read a unit's body, identity and state in the view. Pure, like ``proxy.tools.apply`` that uses them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ctxproxy.proxy.core.fenced import text_of
from ctxproxy.proxy.core.identity import content_text
from ctxproxy.proxy.core.project import PASTE
from ctxproxy.proxy.core.segments import segment_target
from ctxproxy.proxy.core.state import Counter, Rules, State

__all__ = ["Unit", "View", "call_of", "current_text", "handle_of", "is_cut", "message_text", "result_units",
           "snippet_index", "unit_body", "unit_cut", "unit_target", "units_named"]


@dataclass(frozen=True)
class View:
    messages: Sequence[dict[str, Any]]
    state: State
    rules: Rules
    counter: Counter
    max_pins: int
    approval_pattern: str
    model_pins: int
    mirror: str = ""
    """Where the live mirror (LIVE_CONTEXT.json) is or would be written, for ``ctx status``."""
    revision: int = 0
    """The last mirror revision accepted (0: none yet)."""


@dataclass(frozen=True)
class Unit:
    """What a handle names: message ``i``, or result body ``k`` of a text-protocol results message (or paste)."""

    handle: str
    i: int
    k: int | None = None


_ROUND = re.compile(r"^r(\d+)(?:\.(\d+))?$")
_MESSAGE = re.compile(r"^m([0-9a-f]{8})$")


def units_named(view: View, handle: str) -> list[Unit] | str:
    """The units a handle names, or why it names none. ``r<round>.<i>``, ``r<round>`` (every result of the round),
    or a native result's tool_call_id (or identity)."""
    match = _ROUND.match(handle)
    if match:
        wanted = int(match.group(1))
        found = [(i, r) for i, r in view.state.fenced.items()
                 if r.round == wanted and r.command != PASTE and i < len(view.messages)]
        if not found:
            return f"{handle}: no text-protocol round {match.group(1)} in your context"
        i, result = found[-1]
        if match.group(2) is None:
            return [Unit(f"r{result.round}.{k + 1}", i, k) for k in range(len(result.segments))]
        k = int(match.group(2)) - 1
        return [Unit(handle, i, k)] if 0 <= k < len(result.segments) else f"{handle}: round {result.round} has " \
            f"{len(result.segments)} result(s)"
    whole = _MESSAGE.match(handle)
    if whole:  # m<8 hex>: a whole results message (every result body in it), by its content hash
        hits = [i for i, r in view.state.fenced.items() if view.state.hashes[i].startswith(whole.group(1))
                and r.command != PASTE and i < len(view.messages)]
        if len(hits) != 1:
            return f"{handle}: names {len(hits)} results messages; use r<round>.<i>"
        result = view.state.fenced[hits[0]]
        return [Unit(f"r{result.round}.{k + 1}", hits[0], k) for k in range(len(result.segments))]
    index = _index(view, handle)
    return [Unit(handle, index)] if index is not None else f"{handle}: no result with this handle in your context"


def _index(view: View, handle: str) -> int | None:
    """The newest result named ``handle`` (its tool_call_id, or its identity ``tool:<id>[#n]``)."""
    state = view.state
    if handle in state.ids:
        i = len(state.ids) - 1 - state.ids[::-1].index(handle)
        return i if i < len(view.messages) else None
    for i in reversed(state.tool_indices):
        if view.messages[i].get("tool_call_id") == handle:
            return i
    return None


def snippet_index(view: View, snippet: str) -> int | str:
    hits = [i for i, m in enumerate(view.messages)
            if m.get("role") not in ("system", "developer") and snippet in message_text(m)]
    return hits[0] if len(hits) == 1 else f"the snippet appears in {len(hits)} messages; it must name exactly one"


def message_text(message: dict[str, Any]) -> str:
    return content_text(message.get("content"))


def current_text(view: View, i: int) -> str:
    out = view.state.out[i]
    return message_text(out) if out is not None else ""


def is_cut(view: View, i: int) -> bool:
    """Result ``i`` goes out changed: spilled, elided, dropped, noted or folded."""
    return view.state.out[i] is None or view.state.out_hashes[i] != view.state.hashes[i]


def unit_body(view: View, unit: Unit) -> str:
    if unit.k is None:
        return message_text(view.messages[unit.i])
    segment = view.state.fenced[unit.i].segments[unit.k]  # offsets into the text the presets read
    return (text_of(view.messages[unit.i].get("content")) or "")[segment.start:segment.end]


def unit_target(view: View, unit: Unit) -> str:
    mid = view.state.ids[unit.i]
    return mid if unit.k is None else segment_target(mid, unit.k)


def unit_cut(view: View, unit: Unit) -> bool:
    if unit.k is None or view.state.out[unit.i] is None:
        return is_cut(view, unit.i)
    decided = view.state.decided.get(unit_target(view, unit))
    return decided is not None and decided.message_hash == view.state.hashes[unit.i]


def call_of(view: View, unit: Unit) -> tuple[str, str]:
    """(tool, call id) as the stub names them."""
    if unit.k is None:
        call_id = str(view.messages[unit.i].get("tool_call_id"))
        return view.state.result_calls.get(unit.i, ("?", ""))[0], call_id
    result = view.state.fenced[unit.i]
    if result.command == PASTE:
        return PASTE, f"paste.{result.round}"
    return result.command or "fenced", f"r{result.round}.{unit.k + 1}"


def result_units(view: View) -> list[Unit]:
    """Every tool result in context, in order: native results and the bodies of text-protocol rounds."""
    units = [Unit(str(view.messages[i].get("tool_call_id")), i) for i in view.state.tool_indices
             if i < len(view.messages)]
    for i, result in view.state.fenced.items():
        if result.command != PASTE and i < len(view.messages):
            units += [Unit(f"r{result.round}.{k + 1}", i, k) for k in range(len(result.segments))]
    return sorted(units, key=lambda u: (u.i, u.k or 0))


def handle_of(view: View, i: int) -> str:
    """The result's tool_call_id, or its identity (``tool:call_0#1``) when the id names more than one result."""
    mid = view.state.ids[i]
    return mid if "#" in mid or view.state.seen.get(mid, 1) > 1 else str(view.messages[i].get("tool_call_id"))
