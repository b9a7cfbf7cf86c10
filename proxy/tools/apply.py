"""Applying a context tool's intent to a session: pure, like the projection it changes.

``apply_intent(intent, view)`` returns the decisions to journal, the bodies that go to the overflow store, the
result the model reads ("what actually happened": handles acted on, tokens freed, refusals and why) and the
``context_op`` event. The view is the session as the model last saw it: the incoming messages and the state the
last projection left (``proxy.tools.handles`` resolves the handles it names). ``read_overflow`` needs a stored
body: the runner fetches it and calls ``render_overflow``.

Refused, with the reason in the result (the first seed): a pinned item (unpin first); a result that is already a
stub; by ``context_drop``, a result that carries a pending approval id (``context_note`` keeps those ids in its
``Preserved (compaction-safe):`` block instead). Model pins are capped per session and say ``[model] ``; the
operator's pins are neither counted nor removed by ``unpin all``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ctxproxy.proxy.core.budget import MIN_CUT_CHARS
from ctxproxy.proxy.core.decisions import Decision, OverflowWrite
from ctxproxy.proxy.core.state import sha256_text
from ctxproxy.proxy.core.stubs import full_output, program, stub_line
from ctxproxy.proxy.tools.handles import (
    Unit,
    View,
    call_of,
    current_text,
    handle_of,
    is_cut,
    message_text,
    result_units,
    snippet_index,
    unit_body,
    unit_cut,
    unit_target,
    units_named,
)
from ctxproxy.proxy.tools.intents import Ctx, Drop, Intent, Note, Pin, Status, Unpin

__all__ = ["Outcome", "View", "apply_intent", "render_overflow"]

_STUB = re.compile(r"\[(?:overflow|folded) id=([0-9a-f]{64})")
_URL = re.compile(r"https?://[^\s\"'<>)\]]+")
_PATH = re.compile(r"(?<![\w/.-])(?:/|\./|\w[\w.-]*/)[\w./-]*\.\w{1,8}\b")
_KEPT = 20


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
    if isinstance(intent, Ctx):
        return _ctx(intent, view)
    raise TypeError(f"read_overflow is served by the runner, not applied: {intent!r}")


# --- pins --------------------------------------------------------------------------------------------------------
def _pin(intent: Pin, view: View) -> Outcome:
    targets, refused = _targets(view, intent.handles, intent.snippet, any_role=True)
    decisions, acted = [], []
    room = view.max_pins - view.model_pins
    for unit in targets:
        handle, i, mid = unit.handle, unit.i, view.state.ids[unit.i]
        if mid in view.state.pins:
            refused.append(f"{handle}: already pinned")
        elif (unit_cut(view, unit) or (unit.k is not None and is_cut(view, i))) \
                and view.messages[i].get("role") != "assistant":  # a call's cut arguments: the pin restores them
            refused.append(f"{handle}: already cut (a stub or a note); read_overflow restores it")
        elif room <= 0:
            refused.append(f"{handle}: you hold {view.max_pins} pins, the most allowed; unpin one first")
        else:
            room -= 1
            excerpt = "[model] " + " ".join(message_text(view.messages[i]).split())[:80]
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
    for unit in targets:
        handle, mid = unit.handle, view.state.ids[unit.i]
        if pins.get(mid) == "model":
            decisions.append(Decision("unpin", mid, source="model"))
            acted.append(handle)
        else:
            refused.append(f"{handle}: {'pinned by the operator' if mid in pins else 'not pinned'}")
    return _outcome("unpin", acted, refused, decisions=decisions)


def _targets(view: View, handles: Sequence[str], snippet: str | None,
             any_role: bool = False) -> tuple[list[Unit], list[str]]:
    targets: list[Unit] = []
    refused: list[str] = []
    for handle in handles:
        found = units_named(view, handle)
        if isinstance(found, str):
            refused.append(found)
        else:
            targets += found
    if snippet:
        index = snippet_index(view, snippet)
        if isinstance(index, str):
            refused.append(f"snippet: {index}")
        elif any_role or view.messages[index].get("role") == "tool":
            targets.append(Unit(f"snippet:{snippet[:20]}", index))
    return targets, refused


# --- drop and note -----------------------------------------------------------------------------------------------
def _cuttable(view: View, unit: Unit, drop: bool) -> str | None:
    """Why ``unit`` may not be cut by the model, or None."""
    if unit.k is None and view.messages[unit.i].get("role") != "tool":
        return f"{unit.handle}: only tool results can be cut; the dialogue is never touched"
    if view.state.ids[unit.i] in view.state.pins:
        cover = "; a pin covers the whole round's message" if unit.k is not None else ""
        return f"{unit.handle}: pinned; unpin it first{cover}"
    if unit_cut(view, unit) or view.state.out[unit.i] is None:
        return f"{unit.handle}: already a stub"
    if drop and re.search(view.approval_pattern, unit_body(view, unit), flags=re.I):
        return f"{unit.handle}: carries a pending approval id; use context_note to keep it"
    if drop and len(unit_body(view, unit)) < MIN_CUT_CHARS:
        return f"{unit.handle}: under {MIN_CUT_CHARS} characters, its stub would not be smaller"
    return None


def _drop(intent: Drop, view: View) -> Outcome:
    targets, refused = _targets(view, intent.handles, None)
    decisions, writes, acted, freed = [], [], [], 0
    for unit in targets:
        reason = _cuttable(view, unit, drop=True)
        if reason:
            refused.append(reason)
            continue
        body = unit_body(view, unit)
        stub = _stub(view, unit, body) + "\nDropped by you (context_drop). " + _restore(view, sha256_text(body))
        decisions.append(Decision("drop", unit_target(view, unit), view.state.hashes[unit.i], stub, sha256_text(body),
                                  source="model"))
        writes.append(_write(view, unit, body))
        acted.append(unit.handle)
        freed += _freed(view, unit, body, stub)
    return _outcome("drop", acted, refused, freed, decisions, writes)


def _note(intent: Note, view: View) -> Outcome:
    targets, refused = _targets(view, intent.handles, None)
    chosen = []
    for unit in targets:
        reason = _cuttable(view, unit, drop=False)
        if reason:
            refused.append(reason)
        else:
            chosen.append(unit)
    if not chosen:
        return _outcome("note", [], refused)
    bodies = [unit_body(view, unit) for unit in chosen]
    first = chosen[0].handle
    lines = [intent.note.strip(), ""] + [_stub(view, u, b) for u, b in zip(chosen, bodies, strict=True)]
    lines += _preserved(bodies, view.approval_pattern)
    texts = ["\n".join(lines)] + [f"{_stub(view, u, b)}\nSummarized in your note on {first}. "
                                  f"{_restore(view, sha256_text(b))}" for u, b in zip(chosen[1:], bodies[1:],
                                                                                     strict=True)]
    decisions = [Decision("note", unit_target(view, u), view.state.hashes[u.i], text, sha256_text(body), source="model")
                 for u, text, body in zip(chosen, texts, bodies, strict=True)]
    freed = sum(_freed(view, u, b, text) for u, b, text in zip(chosen, bodies, texts, strict=True))
    writes = [_write(view, u, b) for u, b in zip(chosen, bodies, strict=True)]
    return _outcome("note", [u.handle for u in chosen], refused, freed, decisions, writes,
                    extra=f"The note now stands in the place of {first}.")


def _ctx(intent: Ctx, view: View) -> Outcome:
    if intent.action == "status":  # the second seed: the mirror's path, the budget, the target, the last revision
        accepted = f"revision {view.revision}" if view.revision else "none yet"
        mirror = f"{view.mirror} (last accepted {accepted}; it is written when the automatic cuts cannot reach the " \
                 "target)" if view.mirror else "none (this session is incognito: nothing of it is written to disk)"
        return Outcome("status", status_text(view, 8) + f"\nMirror: {mirror}.", True)
    if intent.action == "commit":
        raise TypeError("ctx commit reads the mirror file: the runner serves it (proxy.tools.mirror)")
    return _clear(intent, view)



def _clear(intent: Ctx, view: View) -> Outcome:
    """Select by ``call_ids`` or ``before``, and the masks narrow that selection: ``tool`` keeps that tool's
    results, ``keep_last`` spares the newest of them. Without a selection the masks select by themselves (the
    second seed's ``{"action": "clear", "keep_last": 3, "tool": "read"}``: every ``read`` result but the last
    three). Results already cut are skipped; if none is left, there is nothing to clear."""
    every = result_units(view)
    if not intent.call_ids and intent.before is None and not intent.tool and intent.keep_last is None:
        return Outcome("clear", "ctx clear: nothing selected. Name call_ids, before, tool or keep_last.", False)
    chosen = [u for u in every if u.handle in intent.call_ids or view.state.ids[u.i] in intent.call_ids]
    if intent.before is not None:
        cut_off = next((u for u in every if intent.before in (u.handle, view.state.ids[u.i])), None)
        chosen += [u for u in every if cut_off is not None and (u.i, u.k or 0) < (cut_off.i, cut_off.k or 0)]
    if not intent.call_ids and intent.before is None:
        chosen = list(every)  # the masks alone: they select from every result
    chosen = sorted(dict.fromkeys(chosen), key=lambda u: (u.i, u.k or 0))
    if intent.tool:
        chosen = [u for u in chosen if program(call_of(view, u)[0]) == intent.tool]
    if intent.keep_last:
        chosen = chosen[: max(0, len(chosen) - intent.keep_last)]
    chosen = [u for u in dict.fromkeys(chosen) if not unit_cut(view, u) and view.state.out[u.i] is not None]
    if not chosen:
        return Outcome("clear", "ctx clear: nothing to clear (the selection is already cut, or empty).", False)
    outcome = _drop(Drop(tuple(u.handle for u in chosen)), view)
    text = outcome.text.replace("drop:", "clear:", 1).replace("Dropped by you (context_drop)", "Cleared by you")
    decisions = tuple(Decision("drop", d.target, d.message_hash, d.replacement.replace(
        "Dropped by you (context_drop)", "Cleared by you (ctx clear)"), d.overflow_id, source="model")
        for d in outcome.decisions)
    return Outcome("clear", text, outcome.ok, outcome.handles, outcome.tokens_freed, decisions, outcome.writes)


def _preserved(bodies: Sequence[str], approval_pattern: str) -> list[str]:
    """Approval ids, sources and identifiers found in the originals, kept verbatim in the note."""
    found: dict[str, None] = {}
    for body in bodies:
        for pattern in (re.compile(approval_pattern, re.I), _URL, _PATH):
            for match in pattern.finditer(body):
                found.setdefault(match.group(0))
    kept = list(found)[:_KEPT]
    return ["", "Preserved (compaction-safe):", *(f"- {item}" for item in kept)] if kept else []


def _stub(view: View, unit: Unit, body: str) -> str:
    tool, call_id, oid = *call_of(view, unit), sha256_text(body)
    return "\n".join([stub_line(oid, tool, len(body.encode()), call_id, view.rules.storage),
                      *full_output(oid, view.rules.storage, view.rules.overflow_dir)])


def _restore(view: View, overflow_id: str) -> str:
    return f"The original is {'intact' if view.rules.storage == 'disk' else 'in memory only'}: " \
           f"read_overflow id={overflow_id}."


def _write(view: View, unit: Unit, body: str) -> OverflowWrite:
    tool, call_id = call_of(view, unit)
    return OverflowWrite(sha256_text(body), body, tool, call_id)


def _freed(view: View, unit: Unit, body: str, replacement: str) -> int:
    if unit.k is None:
        return max(0, view.state.counts[unit.i] - view.counter.count({**view.messages[unit.i], "content": replacement}))
    return max(0, view.counter.count({"role": "user", "content": body}) -
               view.counter.count({"role": "user", "content": replacement}))


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
    whole = [(state.counts[i], handle_of(view, i)) for i in state.tool_indices if not is_cut(view, i)]
    cut = [(handle_of(view, i), m.group(1)) for i in state.tool_indices if (m := _STUB.search(current_text(view, i)))]
    for unit in result_units(view):
        if unit.k is not None:
            if unit_cut(view, unit):
                decided = state.decided[unit_target(view, unit)]
                cut.append((unit.handle, decided.overflow_id))
            else:
                body = unit_body(view, unit)
                whole.append((view.counter.count({"role": "user", "content": body}), unit.handle))
    lines.append("Largest results in context (handle: tokens):")
    largest = [f"- {handle}: {n}" for n, handle in sorted(whole, reverse=True)[:top]]
    lines += largest or ["- none"]
    pinned = [f"- {mid} ({source})" for mid, source in sorted(state.pins.items())]
    lines += ["Pinned:", *(pinned or ["- none"])]
    lines += ["Cut, restorable with read_overflow (handle: id):", *([f"- {h}: {oid}" for h, oid in cut] or ["- none"])]
    lines.append(f"Model pins: {view.model_pins}/{view.max_pins}.")
    return "\n".join(lines)


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
