"""The live mirror (the second seed): the projection as ``LIVE_CONTEXT.json``, edited by the model, committed.

When auto-elision alone cannot bring a request under the target, the proxy writes what the model sees as a JSON
file and tells it that it manages its context: it edits the file with its own tools — it may remove or shorten
tool results, nothing else — and calls ``ctx`` with ``{"action": "commit"}``. ``revise`` validates the draft
against the projection (a removed or changed user block, system message or assistant text is refused with the
reason; a call and its result go together) and turns it into decisions: each removed result becomes a stub, each
shortened one keeps the model's text and a stub line, all restorable. Pure: the runner reads and writes the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from ctxproxy.proxy.core.arguments import ArgumentCut, args_target
from ctxproxy.proxy.core.decisions import Decision, OverflowWrite
from ctxproxy.proxy.core.identity import content_text
from ctxproxy.proxy.core.state import Rules, sha256_text
from ctxproxy.proxy.core.stubs import full_output, stub_line

__all__ = ["CLOSE", "PARAGRAPH", "MirrorPlaces", "Revision", "appended_document", "indented", "maintenance_rounds",
           "mirror_document", "mirror_path", "revise"]

_FILE_TOOL = re.compile(r"read|view|open|cat|edit|write|create|patch|replace|insert", re.I)
_SHELL_TOOL = re.compile(r"bash|shell|run|exec|terminal|command|python", re.I)

PARAGRAPH = ("[ctxproxy] You manage your context: it no longer fits by the automatic rules alone. What you see is "
             "mirrored in {path}. Before you cut anything, write the decisions you have made so far as a note "
             "starting with DECIDED: (context_note): the rules protect the dialogue, not your memory. Then edit "
             "the file with your own tools — remove or shorten tool results (entries with role \"tool\"); leave "
             "every other entry as it is — and call ctx with {{\"action\": \"commit\"}}. The confirmation comes "
             "as the next system line.")


class MirrorPlaces(Protocol):
    """What ``mirror_path`` reads of the settings (``config.Settings`` has both): the core does not import config."""

    @property
    def mirror_dir(self) -> str: ...

    @property
    def data_path(self) -> Path: ...


def mirror_path(settings: MirrorPlaces, session_id: str) -> Path:
    """Where a session's LIVE_CONTEXT.json goes: under ``mirror_dir`` (the agent's workspace) or the data dir."""
    folder = Path(settings.mirror_dir) if settings.mirror_dir else settings.data_path / "mirror" / session_id
    return folder / "LIVE_CONTEXT.json"


def mirror_document(session: str, revision: int, ids: Sequence[str], messages: Sequence[dict[str, Any]],
                    hashes: Sequence[str] = (), cache: dict[tuple[str, str], str] | None = None) -> str:
    """The projection as the model sees it, one entry per message, each with the identity a revision keys on:
    ``json.dumps(..., indent=1, ensure_ascii=False)`` of ``{"session", "revision", "messages"}``, assembled from each
    entry's own text. With the messages' ``hashes``, ``cache`` keeps those texts by (identity, hash) from one version
    to the next (left holding the current entries only), so a mirror that grows by a round serialises that round."""
    if not ids:
        return json.dumps({"session": session, "revision": revision, "messages": []}, indent=1, ensure_ascii=False)
    known = cache if cache is not None and hashes else {}
    texts, kept = [], {}
    for mid, message, digest in zip(ids, messages, hashes or [""] * len(ids), strict=True):
        key = (mid, digest)
        text = known.get(key) or _entry_text(mid, message)
        kept[key] = text
        texts.append(text)
    if cache is not None and hashes:
        cache.clear()
        cache.update(kept)
    head = json.dumps({"session": session, "revision": revision}, indent=1, ensure_ascii=False)[:-2]
    return head + ',\n "messages": [\n' + ",\n".join(texts) + CLOSE


CLOSE = "\n ]\n}"
"""How a mirror with entries ends: after its last entry, before any that a later version appends."""


def appended_document(document: str, ids: Sequence[str], messages: Sequence[dict[str, Any]], hashes: Sequence[str],
                      cache: dict[tuple[str, str], str]) -> str:
    """``document`` (a ``mirror_document`` with at least one entry) with entries for ``messages`` after its last:
    the text ``mirror_document`` gives for the whole list, built from the new entries alone. A mirror that grows by
    a round each request costs that round, not the whole projection again (issue #13). ``cache`` gains them.

    The new entries are appended to the slice in place (CPython resizes a string only this frame holds, and a
    large one's memory is remapped, not copied): joined into a new string with the slice, the document was copied
    twice, into freshly mapped pages each time, 0.6-2.3 ms of every request that grew the mirror at 128k."""
    texts = []
    for mid, message, digest in zip(ids, messages, hashes, strict=True):
        text = cache.get((mid, digest)) or _entry_text(mid, message)
        cache[(mid, digest)] = text
        texts.append(text)
    grown = document[: len(document) - len(CLOSE)]
    grown += "".join([*(",\n" + text for text in texts), CLOSE])  # in place: the slice is this frame's alone
    return grown


def _entry_text(mid: str, message: dict[str, Any]) -> str:
    """One entry as it stands in the document: two spaces in, its inner lines too (JSON strings hold no newline)."""
    entry = {"id": mid, **{k: v for k, v in message.items() if k in ("role", "content", "tool_call_id", "tool_calls")}}
    return "  " + indented(entry, margin=2)


def indented(value: Any, margin: int = 0) -> str:
    """``json.dumps(value, indent=1, ensure_ascii=False)``, each line after the first ``margin`` spaces further in.

    Written a level at a time, each string whole by orjson (what the stdlib writes for it, faster): a mirror is
    mostly the text of its strings, and no pass goes over that text again. The stdlib's own encoder cannot use its C
    code with an indent (a mirror turned on at 128k took 26 ms to write that way); orjson's indented text, its
    indent halved by a regular expression over all of it, took 6.0 ms for the 631 entries (303 KB) of the request
    that turns the mirror on at 128k, this 5.1 (issue #13: that request is the slowest of a long run). Floats, and
    the strings orjson refuses (lone surrogates), are written by the stdlib, alone."""
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, dict):
        if not value:
            return "{}"
        inner = "\n" + " " * (margin + 1)
        return "{" + ",".join([inner + _key(k) + ": " + indented(v, margin + 1) for k, v in value.items()]) + (
            "\n" + " " * margin + "}")
    if isinstance(value, list | tuple):
        if not value:
            return "[]"
        inner = "\n" + " " * (margin + 1)
        return "[" + ",".join([inner + indented(v, margin + 1) for v in value]) + "\n" + " " * margin + "]"
    return "null" if value is None else json.dumps(value)  # a number or a bool; anything else, refused as there


def _string(text: str) -> str:
    try:
        return orjson.dumps(text).decode()
    except orjson.JSONEncodeError:  # a lone surrogate
        return json.dumps(text, ensure_ascii=False)


def _key(key: Any) -> str:
    """A key as the stdlib writes it: a string as itself, a number, bool or None as its text, quoted."""
    return _string(key) if isinstance(key, str) else json.dumps({key: 0})[1:-4]


@dataclass(frozen=True)
class Revision:
    ok: bool
    text: str
    decisions: tuple[Decision, ...] = ()
    writes: tuple[OverflowWrite, ...] = ()


def revise(draft_text: str, ids: Sequence[str], hashes: Sequence[str], originals: Sequence[dict[str, Any]],
           current: Sequence[dict[str, Any] | None], rules: Rules, written: Mapping[str, str],
           tools: Mapping[str, str]) -> Revision:
    """The draft's cuts as decisions, or the reason it is refused (nothing is applied then). ``written``: each
    entry's text as the mirror gave it (identity → text); the draft is judged against that, not against what the
    projection became since, and messages newer than the mirror are not the draft's business. ``tools``: the tool
    each result answers (identity → name), for its stub."""
    try:
        draft = {e["id"]: e for e in json.loads(draft_text)["messages"] if isinstance(e, dict) and "id" in e}
    except (ValueError, KeyError, TypeError) as exc:
        return Revision(False, f"ctx commit: the mirror is not the JSON the proxy wrote ({exc}). Nothing applied.")
    unknown = sorted(set(draft) - set(ids))
    if unknown:
        return Revision(False, f"ctx commit: refused, the draft names messages that are not in your context: "
                               f"{', '.join(unknown[:5])}. Nothing applied.")
    decisions: list[Decision] = []
    writes: list[OverflowWrite] = []
    problems: list[str] = []
    for mid, message_hash, original, now in zip(ids, hashes, originals, current, strict=True):
        if now is None or mid not in written:
            continue  # folded, or newer than the mirror
        judged = _one(mid, message_hash, original, now, written[mid], draft.get(mid), rules, tools.get(mid, "?"))
        problems += [judged.problem] if judged.problem else []
        decisions += judged.decisions
        writes += judged.writes
    if problems:
        return Revision(False, "ctx commit: refused, nothing applied: " + "; ".join(problems[:5]) +
                        ". Only tool results and the string values of call arguments may be removed or shortened; "
                        "restore the rest and commit again.")
    if not decisions:
        return Revision(True, "ctx commit: the draft cuts nothing; nothing to apply.")
    calls = sum(">args:" in d.target for d in decisions)
    also = f" and the arguments of {calls} call(s)" if calls else ""
    return Revision(True, f"ctx commit: applied, {len(decisions) - calls} tool result(s){also} cut.",
                    tuple(decisions),
                    tuple(writes))


def maintenance_rounds(messages: Sequence[dict[str, Any]], spans: Sequence[tuple[int, int]],
                       filename: str) -> list[tuple[int, int]]:
    """The rounds that only read or edited the mirror with the agent's file tools: an assistant message with no
    text whose every call is a file tool naming ``filename``, and its results. A shell edit of the same file is
    not mirror maintenance (the second seed): it stays."""
    found = []
    for start, end in spans:
        message = messages[start]
        calls = message.get("tool_calls") or []
        if not calls or content_text(message.get("content")).strip():
            continue
        names = [str((c.get("function") or {}).get("name", "")) for c in calls]
        arguments = [str((c.get("function") or {}).get("arguments", "")) for c in calls]
        if all(_FILE_TOOL.search(n) and not _SHELL_TOOL.search(n) and filename in a for n, a in zip(names, arguments,
                                                                                                    strict=True)):
            found.append((start, end))
    return found


@dataclass(frozen=True)
class _Judged:
    """What the draft does to one message: why it is refused, or the decisions and bodies it makes."""

    problem: str | None = None
    decisions: tuple[Decision, ...] = ()
    writes: tuple[OverflowWrite, ...] = ()


def _one(mid: str, message_hash: str, original: dict[str, Any], now: dict[str, Any], given: str,
         entry: dict[str, Any] | None, rules: Rules, tool: str) -> _Judged:
    role = now.get("role")
    after = None if entry is None else content_text(entry.get("content"))
    if role != "tool":
        if entry is None:
            return _Judged(f"the {role} message {mid} was removed")
        if after != given:
            return _Judged(f"the {role} message {mid} was changed")
        drafted = entry.get("tool_calls", now.get("tool_calls"))
        if drafted != now.get("tool_calls"):
            return _arguments_edit(mid, message_hash, original, now, drafted, rules)
        return _Judged()
    if after == given:
        return _Judged()
    if after is not None and len(after) >= len(given):
        return _Judged(f"the tool result {mid} was made longer, not cut")
    body, call_id = content_text(original.get("content")), str(original.get("tool_call_id"))
    kept = f"\n{after}" if after else ""
    text = _cut_text(sha256_text(body), tool, body, call_id, rules, "Cut by you in the mirror.") + kept
    decision = Decision("drop", mid, message_hash, text, sha256_text(body), source="model")
    return _Judged(None, (decision,), (OverflowWrite(sha256_text(body), body, tool, call_id),))


def _cut_text(oid: str, tool: str, body: str, call_id: str, rules: Rules, what: str) -> str:
    return "\n".join([stub_line(oid, tool, len(body.encode()), call_id, rules.storage),
                      f"{what} The original is restorable: read_overflow id={oid}.",
                      *full_output(oid, rules.storage, rules.overflow_dir)])


def _arguments_edit(mid: str, message_hash: str, original: dict[str, Any], now: dict[str, Any], drafted: Any,
                    rules: Rules) -> _Judged:
    """Calls whose arguments the draft shortened: each shortened string value keeps the model's text and a stub
    (its original restorable); the call's id, name and every other value stay. Anything else is refused."""
    calls, given = drafted if isinstance(drafted, list) else [], now.get("tool_calls") or []
    agent = {c.get("id"): c for c in original.get("tool_calls") or []}
    if len(calls) != len(given) or any(not isinstance(d, dict) or _frame(d) != _frame(g)
                                       for d, g in zip(calls, given, strict=False)):
        return _Judged(f"the calls of {mid} were changed (only their arguments may be shortened)")
    decisions: list[Decision] = []
    writes: list[OverflowWrite] = []
    for draft, shown in zip(calls, given, strict=True):
        before, after = shown["function"].get("arguments"), draft["function"].get("arguments")
        if after == before:
            continue
        call_id, name = str(shown.get("id")), str(shown["function"].get("name"))
        if before != (agent.get(shown.get("id")) or {}).get("function", {}).get("arguments"):
            return _Judged(f"the arguments of call {call_id} are already cut")
        cut = _shortened(str(before), after, name, call_id, rules)
        if isinstance(cut, str):
            return _Judged(f"call {call_id}: {cut}")
        decisions.append(Decision("drop", args_target(mid, call_id), message_hash, cut.arguments,
                                  cut.writes[0].overflow_id, source="model"))
        writes += cut.writes
    return _Judged(None, tuple(decisions), tuple(writes))


def _frame(call: dict[str, Any]) -> tuple[Any, ...]:
    function = call.get("function")
    function = function if isinstance(function, dict) else {}
    return call.get("id"), call.get("type"), function.get("name"), tuple(sorted(function))


def _shortened(before: str, after: Any, tool: str, call_id: str, rules: Rules) -> ArgumentCut | str:
    """The model's shortened arguments with a stub after each value it shortened, or why they are refused."""
    try:
        old, new = json.loads(before), json.loads(after) if isinstance(after, str) else None
    except json.JSONDecodeError:
        return "the arguments must stay valid JSON"
    writes: list[OverflowWrite] = []

    def merge(was: Any, now: Any, key: str) -> Any:
        if isinstance(was, str) and isinstance(now, str) and len(now) < len(was):
            oid = sha256_text(was)
            writes.append(OverflowWrite(oid, was, tool, call_id))
            stub = _cut_text(oid, tool, was, call_id, rules, f"Argument `{key}` shortened by you in the mirror.")
            return f"{now}\n{stub}" if now.strip() else stub
        if isinstance(was, dict) and isinstance(now, dict) and was.keys() == now.keys():
            return {k: merge(was[k], now[k], str(k)) for k in was}
        if isinstance(was, list) and isinstance(now, list) and len(was) == len(now):
            return [merge(w, n, key) for w, n in zip(was, now, strict=True)]
        if was != now:
            raise ValueError(key)
        return was

    try:
        merged = merge(old, new, "")
    except ValueError as exc:
        return f"only string values of the arguments may be shortened (`{exc}` was changed otherwise)"
    if not writes:
        return "the arguments were changed, not shortened"
    return ArgumentCut(json.dumps(merged, ensure_ascii=False), tuple(writes))
