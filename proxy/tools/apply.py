"""Applying a context tool's intent to a session: pure, like the projection it changes.

``apply_intent(intent, view)`` returns the decisions to journal, the bodies that go to the overflow store, the
result the model reads ("what actually happened": handles acted on, tokens freed, refusals and why) and the
``context_op`` event. The view is the session as the model last saw it: the incoming messages and the state the
last projection left. ``read_overflow`` needs a stored body: the runner fetches it and calls ``render_overflow``.

Refused, with the reason in the result (the first seed): a pinned item (unpin first); a result that is already a
stub; by ``context_drop``, a result that carries a pending approval id (``context_note`` keeps those ids in its
``Preserved (compaction-safe):`` block instead). Model pins are capped per session and say ``[model] ``; the
operator's pins are neither counted nor removed by ``unpin all``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.rewrite.decisions import Decision, OverflowWrite
from proxy.rewrite.identity import content_text
from proxy.rewrite.state import Counter, Rules, State, sha256_text
from proxy.rewrite.stubs import stub_line
from proxy.tools.intents import Drop, Intent, Note, Pin, Status, Unpin

__all__ = ["Outcome", "View", "apply_intent", "render_overflow"]

_STUB = re.compile(r"\[(?:overflow|folded) id=([0-9a-f]{64})")
_URL = re.compile(r"https?://[^\s\"'<>)\]]+")
_PATH = re.compile(r"(?<![\w/.-])(?:/|\./|\w[\w.-]*/)[\w./-]*\.\w{1,8}\b")
_KEPT = 20


@dataclass(frozen=True)
class View:
    messages: Sequence[dict[str, Any]]
    state: State
    rules: Rules
    counter: Counter
    max_pins: int
    approval_pattern: str
    model_pins: int


@dataclass(frozen=True)
class Outcome:
    op: str
    text: str
    ok: bool
    handles: tuple[str, ...] = ()
    tokens_freed: int = 0
    decisions: tuple[Decision, ...] = ()
    writes: tuple[OverflowWrite, ...] = field(default_factory=tuple)

    @property
    def overflow_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(w.overflow_id for w in self.writes))


def apply_intent(intent: Intent, view: View) -> Outcome:
    if isinstance(intent, Status):
        return Outcome("status", status_text(view, intent.top), True)
    if isinstance(intent, Pin):
        return _pin(intent, view)
    if isinstance(intent, Unpin):
        return _unpin(intent, view)
    if isinstance(intent, Drop):
        return _drop(intent, view)
    if isinstance(intent, Note):
        return _note(intent, view)
    raise TypeError(f"read_overflow is served by the runner, not applied: {intent!r}")


# --- handles -----------------------------------------------------------------------------------------------------
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


def _snippet_index(view: View, snippet: str) -> int | str:
    hits = [i for i, m in enumerate(view.messages)
            if m.get("role") not in ("system", "developer") and snippet in _text(m)]
    return hits[0] if len(hits) == 1 else f"the snippet appears in {len(hits)} messages; it must name exactly one"


def _text(message: dict[str, Any]) -> str:
    return content_text(message.get("content"))


def _current(view: View, i: int) -> str:
    out = view.state.out[i]
    return _text(out) if out is not None else ""


def _is_cut(view: View, i: int) -> bool:
    """Result ``i`` goes out changed: spilled, elided, dropped, noted or folded."""
    return view.state.out[i] is None or view.state.out_hashes[i] != view.state.hashes[i]


# --- pins --------------------------------------------------------------------------------------------------------
def _pin(intent: Pin, view: View) -> Outcome:
    targets, refused = _targets(view, intent.handles, intent.snippet, any_role=True)
    decisions, acted = [], []
    room = view.max_pins - view.model_pins
    for handle, i in targets:
        mid = view.state.ids[i]
        if mid in view.state.pins:
            refused.append(f"{handle}: already pinned")
        elif _is_cut(view, i):
            refused.append(f"{handle}: already cut (a stub or a note); read_overflow restores it")
        elif room <= 0:
            refused.append(f"{handle}: you hold {view.max_pins} pins, the most allowed; unpin one first")
        else:
            room -= 1
            excerpt = "[model] " + " ".join(_text(view.messages[i]).split())[:80]
            decisions.append(Decision("pin", mid, replacement=excerpt, source="model"))
            acted.append(handle)
    return _outcome("pin", acted, refused, decisions=decisions,
                    extra=f"Model pins: {view.model_pins + len(acted)}/{view.max_pins}.")


def _unpin(intent: Unpin, view: View) -> Outcome:
    pins = view.state.pins
    if intent.all:
        mine = [mid for mid, source in pins.items() if source == "model"]
        decisions = [Decision("unpin", mid, source="model") for mid in mine]
        return _outcome("unpin", mine, [], decisions=decisions, extra="Operator pins were left in place.")
    targets, refused = _targets(view, intent.handles, intent.snippet, any_role=True)
    decisions, acted = [], []
    for handle, i in targets:
        mid = view.state.ids[i]
        if pins.get(mid) == "model":
            decisions.append(Decision("unpin", mid, source="model"))
            acted.append(handle)
        else:
            refused.append(f"{handle}: {'pinned by the operator' if mid in pins else 'not pinned'}")
    return _outcome("unpin", acted, refused, decisions=decisions)


def _targets(view: View, handles: Sequence[str], snippet: str | None,
             any_role: bool = False) -> tuple[list[tuple[str, int]], list[str]]:
    targets, refused = [], []
    for handle in handles:
        i = _index(view, handle)
        if i is None:
            refused.append(f"{handle}: no result with this handle in your context")
        else:
            targets.append((handle, i))
    if snippet:
        found = _snippet_index(view, snippet)
        if isinstance(found, str):
            refused.append(f"snippet: {found}")
        elif any_role or view.messages[found].get("role") == "tool":
            targets.append((f"snippet:{snippet[:20]}", found))
    return targets, refused


# --- drop and note -----------------------------------------------------------------------------------------------
def _cuttable(view: View, handle: str, i: int, drop: bool) -> str | None:
    """Why result ``i`` may not be cut by the model, or None."""
    if view.messages[i].get("role") != "tool":
        return f"{handle}: only tool results can be cut; the dialogue is never touched"
    if view.state.ids[i] in view.state.pins:
        return f"{handle}: pinned; unpin it first"
    if _is_cut(view, i):
        return f"{handle}: already a stub"
    if drop and re.search(view.approval_pattern, _text(view.messages[i]), flags=re.I):
        return f"{handle}: carries a pending approval id; use context_note to keep it"
    return None


def _drop(intent: Drop, view: View) -> Outcome:
    targets, refused = _targets(view, intent.handles, None)
    decisions, writes, acted, freed = [], [], [], 0
    for handle, i in targets:
        reason = _cuttable(view, handle, i, drop=True)
        if reason:
            refused.append(reason)
            continue
        body = _text(view.messages[i])
        stub = _stub(view, i, body) + "\nDropped by you (context_drop). " + _restore(view, sha256_text(body))
        decisions.append(Decision("drop", view.state.ids[i], view.state.hashes[i], stub, sha256_text(body),
                                  source="model"))
        writes.append(_write(view, i, body))
        acted.append(handle)
        freed += _freed(view, i, stub)
    return _outcome("drop", acted, refused, freed, decisions, writes)


def _note(intent: Note, view: View) -> Outcome:
    targets, refused = _targets(view, intent.handles, None)
    chosen = []
    for handle, i in targets:
        reason = _cuttable(view, handle, i, drop=False)
        if reason:
            refused.append(reason)
        else:
            chosen.append((handle, i))
    if not chosen:
        return _outcome("note", [], refused)
    bodies = [_text(view.messages[i]) for _, i in chosen]
    first_handle = chosen[0][0]
    lines = [intent.note.strip(), ""] + [_stub(view, i, b) for (_, i), b in zip(chosen, bodies, strict=True)]
    lines += _preserved(bodies, view.approval_pattern)
    texts = ["\n".join(lines)] + [f"{_stub(view, i, b)}\nSummarized in your note on {first_handle}. "
                                  f"{_restore(view, sha256_text(b))}" for (_, i), b in zip(chosen[1:], bodies[1:],
                                                                                         strict=True)]
    decisions = [Decision("note", view.state.ids[i], view.state.hashes[i], text, sha256_text(body), source="model")
                 for (_, i), text, body in zip(chosen, texts, bodies, strict=True)]
    freed = sum(_freed(view, i, text) for (_, i), text in zip(chosen, texts, strict=True))
    writes = [_write(view, i, b) for (_, i), b in zip(chosen, bodies, strict=True)]
    return _outcome("note", [h for h, _ in chosen], refused, freed, decisions, writes,
                    extra=f"The note now stands in the place of {first_handle}.")


def _preserved(bodies: Sequence[str], approval_pattern: str) -> list[str]:
    """Approval ids, sources and identifiers found in the originals, kept verbatim in the note."""
    found: dict[str, None] = {}
    for body in bodies:
        for pattern in (re.compile(approval_pattern, re.I), _URL, _PATH):
            for match in pattern.finditer(body):
                found.setdefault(match.group(0))
    kept = list(found)[:_KEPT]
    return ["", "Preserved (compaction-safe):", *(f"- {item}" for item in kept)] if kept else []


def _stub(view: View, i: int, body: str) -> str:
    call_id = str(view.messages[i].get("tool_call_id"))
    tool = view.state.result_calls.get(i, ("?", ""))[0]
    return stub_line(sha256_text(body), tool, len(body.encode()), call_id, view.rules.storage)


def _restore(view: View, overflow_id: str) -> str:
    return f"The original is {'intact' if view.rules.storage == 'disk' else 'in memory only'}: " \
           f"read_overflow id={overflow_id}."


def _write(view: View, i: int, body: str) -> OverflowWrite:
    call_id = str(view.messages[i].get("tool_call_id"))
    return OverflowWrite(sha256_text(body), body, view.state.result_calls.get(i, ("?", ""))[0], call_id)


def _freed(view: View, i: int, replacement: str) -> int:
    return max(0, view.state.counts[i] - view.counter.count({**view.messages[i], "content": replacement}))


def _outcome(op: str, acted: Sequence[str], refused: Sequence[str], freed: int = 0,
             decisions: Sequence[Decision] = (), writes: Sequence[OverflowWrite] = (), extra: str = "") -> Outcome:
    parts = [f"{op}: applied to {', '.join(acted)}." if acted else f"{op}: nothing applied."]
    if freed:
        parts.append(f"About {freed} tokens freed.")
    if refused:
        parts.append("Refused: " + "; ".join(refused) + ".")
    if extra:
        parts.append(extra)
    return Outcome(op, " ".join(parts), bool(acted), tuple(acted), freed, tuple(decisions), tuple(writes))


# --- status and read_overflow ------------------------------------------------------------------------------------
def status_text(view: View, top: int) -> str:
    state, rules = view.state, view.rules
    used = rules.scaled(state.total + rules.tools_tokens)
    lines = [f"Context: about {used} of {rules.budget.window} tokens ({100 * used // rules.budget.window}%); "
             f"budget {rules.budget.budget}, cuts stop at {rules.budget.target}."]
    whole = [(state.counts[i], i) for i in state.tool_indices if not _is_cut(view, i)]
    lines.append("Largest results in context (handle: tokens):")
    largest = [f"- {_handle(view, i)}: {n}" for n, i in sorted(whole, reverse=True)[:top]]
    lines += largest or ["- none"]
    pinned = [f"- {mid} ({source})" for mid, source in sorted(state.pins.items())]
    lines += ["Pinned:", *(pinned or ["- none"])]
    cut = [(_handle(view, i), m.group(1)) for i in state.tool_indices if (m := _STUB.search(_current(view, i)))]
    lines += ["Cut, restorable with read_overflow (handle: id):", *([f"- {h}: {oid}" for h, oid in cut] or ["- none"])]
    lines.append(f"Model pins: {view.model_pins}/{view.max_pins}.")
    return "\n".join(lines)


def _handle(view: View, i: int) -> str:
    """The result's tool_call_id, or its identity (``tool:call_0#1``) when the id names more than one result."""
    mid = view.state.ids[i]
    return mid if "#" in mid or view.state.seen.get(mid, 1) > 1 else str(view.messages[i].get("tool_call_id"))


def render_overflow(body: str, offset: int, limit: int, grep: str | None) -> str:
    """A page of a stored body, or its lines matching ``grep`` (numbered), with how to read on."""
    if grep:
        try:
            pattern = re.compile(grep)
        except re.error as exc:
            return f"read_overflow: `grep` is not a valid regular expression ({exc})."
        hits = [f"{n}: {line}" for n, line in enumerate(body.splitlines(), start=1) if pattern.search(line)]
        if not hits:
            return f"read_overflow: no line matches {grep!r}."
        body = "\n".join(hits)  # then paged like any body: offset and limit count characters of the matches
    if offset >= len(body) and body:
        return f"read_overflow: offset {offset} is past the end ({len(body)} characters)."
    page = body[offset:offset + limit]
    rest = len(body) - offset - len(page)
    tail = f"\n[… {rest} more characters: read_overflow with offset={offset + len(page)}]" if rest > 0 else ""
    return page + tail
