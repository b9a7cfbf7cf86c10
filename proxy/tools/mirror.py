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
from typing import Any, Protocol, cast

import orjson

from ctxproxy.proxy.core.arguments import ArgumentCut, args_target
from ctxproxy.proxy.core.decisions import Decision, OverflowWrite
from ctxproxy.proxy.core.identity import content_text
from ctxproxy.proxy.core.state import Rules, sha256_text
from ctxproxy.proxy.core.stubs import full_output, stub_line

__all__ = ["CLOSE", "ENTRIES_KEPT", "PARAGRAPH", "Entries", "MirrorPlaces", "Revision", "appended_document",
           "cache_entries", "folder_name", "maintenance_rounds", "mirror_document", "mirror_path", "rendered", "revise",
           "same_mirror", "written_entries"]

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
    """Where a session's LIVE_CONTEXT.json goes: its own folder under ``mirror_dir`` (the agent's workspace) or the
    data dir. One file for every session let a session take another's mirror for its model's draft, and commit it."""
    root = Path(settings.mirror_dir) if settings.mirror_dir else settings.data_path / "mirror"
    return root / folder_name(session_id) / "LIVE_CONTEXT.json"


def folder_name(session_id: str) -> str:
    """A session's folder: its id when a plain lowercase name (the proxy's own ids are), else a digest. A client
    names its session (``X-Session-Id``): ``../../x`` or an absolute path must not lead outside the folder, nor
    two names a case-insensitive disk takes for one share it."""
    return session_id if re.fullmatch(r"[a-z0-9][a-z0-9._@-]{0,127}", session_id) else "n-" + sha256_text(
        session_id)[:32]


Entries = dict[str, tuple[str, bytes]]
"""A mirror's entries as written, by message hash: the identity each was shown as and its UTF-8 text. Keyed by the
hash alone, a lookup hashes one string the journal already hashed, not a new (identity, hash) pair: joining a fold
pass's ~630 entries at 128k took 0.15 ms that way, 0.5 on the request that turns the mirror on (issue #13). A hash
shown under two identities (a message repeated word for word) keeps one of them; the other is written again."""

ENTRIES_KEPT = 3
"""The cache is cut back to the entries of the version just written once it holds this many times as many."""


def mirror_document(session: str, revision: int, ids: Sequence[str], messages: Sequence[dict[str, Any]],
                    hashes: Sequence[str] = (), cache: Entries | None = None) -> bytearray:
    """The projection as the model sees it, one entry per message, each with the identity a revision keys on:
    ``{"session", "revision", "messages"}`` as JSON indented by two spaces (``_json``), in UTF-8: the file's bytes,
    in the buffer a mirror that grows is extended in (``appended_document``), joined there: not copied into one.

    With the messages' ``hashes``, ``cache`` keeps each entry's text (``Entries``) from one version to the next: a
    version that changes a few dozen of ~600 entries (a fold pass) writes those and joins the rest. It gains the
    new entries and is cut back to the current ones past ``ENTRIES_KEPT`` times their number. One that is mostly
    new (the request that turns the mirror on, when nothing was rendered ahead) is written whole by orjson, in one
    call, and cut into its entries for the cache. Bytes, not text: a mirror holds non-ASCII text, and joining ~600
    pieces of it as ``str`` then encoding the result for the file, with a Python loop over the entries, took
    0.7 ms of a fold pass at 128k; 0.1 now (issue #13). Joined as bytes, then copied to grow, a ~330 KB mirror
    took 0.08 ms more, 0.3 when its pages were new (the request that turns it on)."""
    if cache is None or len(hashes) != len(ids):
        return bytearray(_json({"session": session, "revision": revision, "messages": _entries(ids, messages)}))
    pieces = _cached(cache, ids, hashes)
    new = [i for i, piece in enumerate(pieces) if piece is None]
    if 2 * len(new) > len(ids) or not ids:
        text = _json({"session": session, "revision": revision, "messages": _entries(ids, messages)})
        _keep(cache, ids, hashes, _inner_pieces(text) if ids else [], range(len(ids)))
        return bytearray(text)
    if new:
        written = _written([ids[i] for i in new], [messages[i] for i in new])
        for i, piece in zip(new, _inner_pieces(written, whole=False), strict=True):
            pieces[i] = piece
    joined = cast(list[bytes], pieces)
    _keep(cache, ids, hashes, joined, new)
    head = _json({"session": session, "revision": revision, "messages": []})[: -len(b"[]\n}")] + b"[\n"
    return _between(joined, head + _ENTRY_START, _ENTRY_END + CLOSE)


def _cached(cache: Entries, ids: Sequence[str], hashes: Sequence[str]) -> list[bytes | None]:
    """Each entry's text as the cache holds it for its hash, if shown there under the same identity."""
    return [None if found is None or found[0] != mid else found[1]
            for found, mid in zip(map(cache.get, hashes), ids, strict=True)]


def _keep(cache: Entries, ids: Sequence[str], hashes: Sequence[str], pieces: Sequence[bytes],
          new: Sequence[int]) -> None:
    """The version just written kept in ``cache``: its ``new`` entries added, or, once the cache holds
    ``ENTRIES_KEPT`` times its entries, all of them and nothing else."""
    if len(cache) + len(new) > ENTRIES_KEPT * len(ids):
        cache.clear()
        new = range(len(ids))
    cache.update((hashes[i], (ids[i], pieces[i])) for i in new)


def cache_entries(cache: Entries, ids: Sequence[str], messages: Sequence[dict[str, Any]],
                  hashes: Sequence[str]) -> bytes:
    """The entries of ``messages`` (shown as ``ids``, with their ``hashes``) rendered into ``cache``, ahead of a
    mirror that will show them (``mirror_document`` then joins them) or as a mirror grows; returns them joined."""
    if not ids:
        return b""
    written = _written(ids, messages)
    cache.update(zip(hashes, zip(ids, _inner_pieces(written, whole=False), strict=True), strict=True))
    return written


def rendered(session: str, revision: int, ids: Sequence[str], hashes: Sequence[str],
             bodies: Mapping[str, bytes]) -> bytearray | None:
    """The mirror that showed the messages of ``hashes`` (their canonical ``bodies``, by hash) as ``ids``: what the
    journal keeps of it, rendered; None when a body is missing. Their keys are sorted where the file has them as
    the agent sent them: the same JSON, not always the same text (``same_mirror``)."""
    if any(h not in bodies for h in hashes):
        return None
    return mirror_document(session, revision, ids, [orjson.loads(bodies[h]) for h in hashes])


def same_mirror(text: str | bytes | bytearray, document: str | bytes | bytearray) -> bool:
    """Whether ``text`` (a file) is ``document`` as JSON: a mirror rendered from the journal is the one written
    up to the order of keys."""
    try:
        return bool(json.loads(text) == json.loads(document))
    except ValueError:
        return False


def written_entries(document: bytes | bytearray) -> dict[str, str]:
    """A mirror's entries as it gave them (identity → text), read back from its bytes: what a draft is judged
    against."""
    return {str(e["id"]): content_text(e.get("content")) for e in json.loads(document)["messages"]}


CLOSE = b"\n  ]\n}"
"""How a mirror with entries ends: after its last entry, before any that a later version appends."""
_APPENDED_OPEN = b'{\n  "messages": [\n'
"""How ``_json({"messages": [...]})`` begins: what lies after it, up to ``CLOSE``, is its entries at the depth a
mirror holds them."""
_BETWEEN = b"\n    },\n    {\n"
"""What lies between two entries of a mirror (``store.session_state.MIRROR_SEPARATOR``): the JSON of a string holds
no newline, and whatever an entry holds lies deeper in, so this is found nowhere else."""
_ENTRY_START, _ENTRY_END = b"    {\n", b"\n    }"


def appended_document(document: bytearray, ids: Sequence[str], messages: Sequence[dict[str, Any]],
                      hashes: Sequence[str] = (), cache: Entries | None = None) -> bytes:
    """``document`` (a ``mirror_document`` with at least one entry) given entries for ``messages`` after its last,
    in place: the bytes ``mirror_document`` gives for the whole list, built from the new entries alone. Returns
    its tail from where ``CLOSE`` began: what the file gets at that offset. A mirror that grows by a round each
    request costs that round, not the whole projection again (issue #13); grown in place, the document is not
    copied either. ``cache`` gains them."""
    if not ids:
        return bytes(CLOSE)
    written = (cache_entries(cache, ids, messages, hashes) if cache is not None and len(hashes) == len(ids)
               else _written(ids, messages))
    tail = b",\n" + written + CLOSE
    document[len(document) - len(CLOSE):] = tail
    return tail


def _written(ids: Sequence[str], messages: Sequence[dict[str, Any]]) -> bytes:
    """The entries of ``messages`` as a mirror holds them, joined, in one call of orjson's."""
    text = _json({"messages": _entries(ids, messages)})
    return text[len(_APPENDED_OPEN): len(text) - len(CLOSE)]


def _inner_pieces(text: bytes, whole: bool = True) -> list[bytes]:
    """What lies inside each entry's braces, of a ``mirror_document`` with entries (``whole``) or of entries as
    ``_written`` joins them."""
    start = text.find(_APPENDED_OPEN[1:]) + len(_APPENDED_OPEN) - 1 if whole else 0  # after '"messages": [\n'
    end = len(text) - len(CLOSE) if whole else len(text)
    return text[start + len(_ENTRY_START): end - len(_ENTRY_END)].split(_BETWEEN)


def _between(pieces: list[bytes], first: bytes, last: bytes) -> bytearray:
    """The pieces joined by ``_BETWEEN``, ``first`` before the first and ``last`` after the last: one copy."""
    if len(pieces) == 1:
        return bytearray(first + pieces[0] + last)
    return bytearray(_BETWEEN).join([first + pieces[0], *pieces[1:-1], pieces[-1] + last])


_FIELDS = frozenset(("role", "content", "tool_call_id", "tool_calls"))
"""What of a message its entry shows, after its identity."""


def _entries(ids: Sequence[str], messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message as its entry: its identity, then its fields ``_FIELDS`` names, in its order. A message with
    no other field (most) is copied whole, not field by field: half the time of building them (issue #13)."""
    only_shown = _FIELDS.issuperset  # over the dict's keys, without a view of them: 15% of building them
    return [{"id": mid, **message} if only_shown(message) else
            {"id": mid, **{k: v for k, v in message.items() if k in _FIELDS}}
            for mid, message in zip(ids, messages, strict=True)]


def _json(value: Any) -> bytes:
    """``value`` as JSON indented by two spaces, UTF-8: orjson's, or the stdlib's where orjson refuses (a lone
    surrogate, an integer past 64 bits, a key that is not a string), laid out the same; that one in ASCII, so the
    file is UTF-8 whatever the strings hold."""
    try:
        return orjson.dumps(value, option=orjson.OPT_INDENT_2)
    except orjson.JSONEncodeError:
        return json.dumps(value, indent=2).encode()


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
        if not all(isinstance(mid, str) for mid in draft):
            raise TypeError("an entry's id is not a string")
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
