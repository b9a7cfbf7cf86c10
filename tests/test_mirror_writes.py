"""The live mirror is written only while it is of use and only when what it shows changed.

Before, ``LIVE_CONTEXT.json`` was rewritten, read back and hashed on every request while the mirror was on (9% of
the samples of a 600-round run), and written even with the context tools off, when no edit of it could ever be
committed. A draft of the model's is still never overwritten: a changed file is noticed by its size and times.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.config import load_settings
from ctxproxy.proxy.core import Rules, canonical_json, message_hash
from ctxproxy.proxy.core.identity import content_text
from ctxproxy.proxy.core.project import project
from ctxproxy.proxy.engine import forward as forward_module
from ctxproxy.proxy.engine import mirror_file
from ctxproxy.proxy.engine.context import SessionContext
from ctxproxy.proxy.engine.mirror_file import rewrite_in_place
from ctxproxy.proxy.errors import StorageFull
from ctxproxy.proxy.tools import mirror as mirror_module
from ctxproxy.proxy.tools.mirror import (
    CLOSE,
    ENTRIES_KEPT,
    Entries,
    appended_document,
    mirror_document,
    rendered,
    same_mirror,
)
from ctxproxy.store import (
    ForwardRecord,
    Journal,
    JournalWriter,
    MirrorShown,
    SessionState,
    StateChange,
    record_forward_and_state,
    record_session_state,
    session_state,
)
from ctxproxy.store.session_state import MIRROR_SEPARATOR
from tests.conftest import app_client, session_mirror
from tests.fakes import CountingUpstream
from tests.test_journal import incoming
from tests.test_project import CharCounter, budget, history, prefixes, run

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]
PARAGRAPH = "You manage your context"
session_state_module = importlib.import_module("ctxproxy.store.session_state")  # not the function of that name
OLD = 10**9
"""A file time long past: a file the proxy writes again gets the current time."""


def _body(rounds: int, size: int = 3000) -> dict[str, Any]:
    """Eight newest results protected, each about 1000 tokens: elision cannot reach the target (the mirror's case)."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                  {"role": "user", "content": "Fix the bug."}]
    for k in range(1, rounds + 1):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": f"{k % 10}" * size}]
    return {"model": "m", "tools": TOOLS, "messages": msgs}


def _settings(tmp_path: Path, **extra: str) -> Any:
    return load_settings(env={"CTXPROXY_UPSTREAM": "http://u.test/v1", "CTXPROXY_CTX_WINDOW": "16384",
                              "CTXPROXY_SPILL_CHARS": "100000", "CTXPROXY_KEEP_RESULTS": "8",
                              "CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_MIRROR_DIR": str(tmp_path / "ws"),
                              **extra})


def _send(tmp_path: Path, bodies: list[dict[str, Any]], between: Any = None, **extra: str) -> list[str]:
    """Each request's upstream body, as text; ``between(i)`` runs before request ``i`` (from the second on)."""
    fake = CountingUpstream(window=16384)  # answers with the real prompt size: the calibration stays near 1
    with app_client(_settings(tmp_path, **extra), httpx.ASGITransport(app=fake)) as client:
        for i, body in enumerate(bodies):
            if i and between is not None:
                between(i)
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    return [got.body.decode() for got in fake.chats]


def test_the_mirror_is_not_rewritten_when_what_it_shows_is_unchanged(tmp_path: Path) -> None:
    mirror = session_mirror(tmp_path / "ws", _body(1)["messages"])
    sent = _send(tmp_path, [_body(13)] * 3, between=lambda i: os.utime(mirror, ns=(OLD, OLD)))
    assert all(PARAGRAPH in s for s in sent)  # on for every request, as before
    assert mirror.stat().st_mtime_ns == OLD  # touched, not changed: the same projection is not written again


def test_the_mirror_is_rewritten_when_the_projection_changed(tmp_path: Path) -> None:
    mirror = session_mirror(tmp_path / "ws", _body(1)["messages"])
    first, second = _body(13), _body(14)
    _send(tmp_path, [first, second], between=lambda i: os.utime(mirror, ns=(OLD, OLD)))
    shown = [e["id"] for e in json.loads(mirror.read_text())["messages"]]
    assert mirror.stat().st_mtime_ns != OLD and "tool:call_14" in shown


def test_a_draft_of_the_model_is_still_never_overwritten(tmp_path: Path) -> None:
    mirror = session_mirror(tmp_path / "ws", _body(1)["messages"])

    def edit(_: int) -> None:
        draft = json.loads(mirror.read_text())
        draft["messages"] = [e for e in draft["messages"] if e.get("tool_call_id") != "call_9"]
        mirror.write_text(json.dumps(draft))

    _send(tmp_path, [_body(13), _body(14)], between=edit)
    shown = [e["id"] for e in json.loads(mirror.read_text())["messages"]]
    assert "tool:call_9" not in shown and "tool:call_14" not in shown  # the draft as the model left it


def test_without_the_context_tools_no_mirror_is_written_nor_announced(tmp_path: Path) -> None:
    sent = _send(tmp_path, [_body(13, 3600), _body(14, 3600)], CTXPROXY_TOOLS_ENABLED="off")
    assert not any(PARAGRAPH in s for s in sent)
    assert not (session_mirror(tmp_path / "ws", _body(1)["messages"])).exists()


def test_the_journal_keeps_what_the_mirror_shows_and_gives_the_text_back(store_location: Path | str) -> None:
    """Each version of a growing mirror is journaled (a restart judges a pending draft against it) as what it
    shows: the hashes of messages the journal holds and their identities. Rendered from that, it is the text
    written, up to the order of keys; the journal holds no text of its own."""
    journal = Journal(store_location)
    try:
        msgs = _body(40, 500)["messages"]
        req = incoming(msgs)
        recorded = journal.record_request(req)
        ids = [f"m{i}" for i in range(len(msgs))]
        for n in range(len(msgs) + 1):
            text = mirror_document(recorded.session_id, n // 30, ids[:n], msgs[:n])
            shown = MirrorShown(n // 30, tuple(ids[:n]), tuple(req.hashes[:n]))
            state = SessionState(mirror="LIVE_CONTEXT.json", mirror_shown=shown)
            record_session_state(journal, recorded.session_id, recorded.request_id, state, "2026-01-01T00:00:00")
            back = session_state(journal, recorded.session_id).mirror_shown
            assert back == shown and back is not None
            again = rendered(recorded.session_id, back.revision, back.ids, back.hashes, back.bodies)
            assert again is not None and same_mirror(text, again)
        assert journal.conn.execute("SELECT COUNT(*) FROM blobs WHERE kind = 'mirror'").fetchone()[0] == 0
        off = SessionState(mirror=None)
        record_session_state(journal, recorded.session_id, recorded.request_id, off, "2026-01-01T00:00:01")
        assert session_state(journal, recorded.session_id) == off
    finally:
        journal.close()


def test_a_mirror_whose_message_the_journal_lacks_renders_as_none() -> None:
    assert rendered("s", 0, ["m0"], ["h0"], {}) is None
    assert rendered("s", 0, ["m0"], ["h0"], {"h0": b'{"role":"user","content":"x"}'}) == mirror_document(
        "s", 0, ["m0"], [{"role": "user", "content": "x"}])


def test_a_file_is_judged_against_a_mirror_rendered_from_the_journal_as_json(tmp_path: Path) -> None:
    """After a restart the mirror is rendered from the journal, its messages' keys sorted: the file written before,
    keys as the agent sent them, is that mirror (not a draft, and taken as the text written); an edited one is a
    draft."""
    messages = [{"role": "tool", "tool_call_id": "c1", "content": "out"}, {"role": "user", "content": "go"}]
    ids = ["tool:c1", "user:1"]
    written = mirror_document("s", 0, ids, messages)
    path = tmp_path / "LIVE_CONTEXT.json"
    for edit, draft in [(written, False), (written.replace(b'"out"', b'"cut"'), True), (b"{not json", True)]:
        path.write_bytes(edit)
        ctx = SessionContext(decisions=[], mirror_written=True, mirror_exact=False, mirror_stat=(0, 0, 0, 0),
                             mirror_document=bytearray(mirror_document("s", 0, ids, [orjson.loads(canonical_json(m))
                                                                                     for m in messages])))
        assert ctx.mirror_document != written
        assert mirror_file._draft_pending(ctx, path, mirror_file._stat(path)) is draft
        assert ctx.mirror_exact is not draft and (draft or ctx.mirror_document == written)


def test_a_mirror_read_back_as_text_is_journaled_whole_until_written_again(tmp_path: Path) -> None:
    """A session resumed from a journal kept before mirrors were journaled as what they show keeps its text: a
    change of its state journals that text (one blob), so the draft it may have is still judged against it."""
    journal = Journal(tmp_path / "j.db")
    try:
        session = journal.record_request(incoming([{"role": "user", "content": "task"}])).session_id
        text = mirror_document(session, 0, ["m0"], [{"role": "user", "content": "task"}]).decode()
        ctx = SessionContext(decisions=[])
        ctx.resume(SessionState(mirror="m", mirror_text=text), session)
        ctx.offered_turn = "user:1"
        state = ctx.working_state()
        assert state.mirror_text == text and state.mirror_shown is None and ctx.mirror_written
        record_session_state(journal, session, 1, state, "0")
        assert session_state(journal, session) == state
    finally:
        journal.close()


def test_a_forward_and_the_working_state_it_left_are_journaled_together(store_location: Path | str) -> None:
    """Issue #13: a forward with new cuts and the state its request changed are one transaction (one commit, one
    trip to the writer thread): both are there after it, and a state that cannot be written leaves no forward."""
    journal = Journal(store_location)
    try:
        req = incoming([{"role": "user", "content": "task"}])
        recorded = journal.record_request(req)

        def forward(attempt: int) -> ForwardRecord:
            return ForwardRecord(recorded.request_id, attempt, recorded.session_id, "2026-01-01T00:00:01",
                                 req.params_hash, verbatim=True, estimate=10, k=1.0)

        state = SessionState(offered_turn="user:1", mirror="m", mirror_shown=MirrorShown(0, ("m0",),
                                                                                          tuple(req.hashes)))
        unwritable = SessionState(confirmations=(object(),))  # type: ignore[arg-type]  # not JSON: the write fails
        with pytest.raises(TypeError):
            record_forward_and_state(journal, forward(0), StateChange(recorded.session_id, recorded.request_id,
                                                                   unwritable, "1"))
        assert journal.conn.execute("SELECT COUNT(*) FROM forwards").fetchone()[0] == 0
        list_id = record_forward_and_state(journal, forward(0), StateChange(recorded.session_id, recorded.request_id,
                                                                       state, "1"))
        assert journal.conn.execute("SELECT list_id FROM forwards").fetchall() == [(list_id,)]
        assert session_state(journal, recorded.session_id) == state
        assert record_forward_and_state(journal, forward(1), None) == list_id  # no change: the forward alone
        assert session_state(journal, recorded.session_id) == state
    finally:
        journal.close()


def test_a_request_that_cuts_and_grows_the_mirror_journals_both_in_one_call(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #13: each request after the mirror turned on cuts and grows it; its forward row and its working state go
    to the journal's thread in one call, never two, and the state read back is what the mirror file shows."""
    calls: list[list[str]] = [[]]  # the start's and the first request's, then one list a request
    call = JournalWriter.call

    async def noting(self: JournalWriter, method: Any, *args: Any, **where: bool) -> Any:
        calls[-1].append(method.__name__ if method is not record_forward_and_state or args[1] is None else "both")
        return await call(self, method, *args, **where)

    monkeypatch.setattr(JournalWriter, "call", noting)
    _send(tmp_path, [_body(13), _body(14), _body(15)], between=lambda i: calls.append([]))
    assert len(calls) == 3 and all("both" in c and "record_session_state" not in c for c in calls[1:]), calls
    journal = Journal(tmp_path / "data" / "journal.db")
    try:
        (session_id,) = journal.conn.execute("SELECT id FROM sessions").fetchone()
        text = (session_mirror(tmp_path / "ws", _body(1)["messages"])).read_text(encoding="utf-8")
        shown = session_state(journal, session_id).mirror_shown
        assert shown is not None
        again = rendered(session_id, shown.revision, shown.ids, shown.hashes, shown.bodies)
        assert again is not None and same_mirror(text, again)
    finally:
        journal.close()


def test_the_mirror_is_the_json_the_stdlib_writes_indented_by_two() -> None:
    msgs = _body(6, 40)["messages"] + [{"role": "user", "content": "é\n\"quoted\"\ttab\u2028\x00"}]
    ids = [f"m{i}" for i in range(len(msgs))]
    for n in [0, 1, 4, len(msgs)]:
        whole = json.dumps({"session": "s", "revision": n, "messages": [
            {"id": mid, **{k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "tool_calls")}}
            for mid, m in zip(ids[:n], msgs[:n], strict=True)]}, indent=2, ensure_ascii=False)
        assert mirror_document("s", n, ids[:n], msgs[:n]) == whole.encode()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8")) | st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    | st.dictionaries(st.integers(0, 3), inner, min_size=1, max_size=2), max_leaves=20)


@given(st.lists(JSON_VALUES, max_size=4), st.integers(0, 3))
@example([[[[[["deep", {"er": [1, {"and": "é\u2028\x00"}]}]]]]]], 0)
@example(["\ud800", 2**70, {1: "key"}], 1)
def test_a_mirror_holds_its_entries_whatever_they_hold_cut_at_the_journals_separator(contents: list[Any],
                                                                                    revision: int) -> None:
    """Written by orjson in one call (issue #13: the request that turns the mirror on at 128k), by the stdlib where
    orjson refuses (lone surrogates, integers past 64 bits, keys that are not strings): the file is UTF-8, reads
    back as its entries (keys as JSON makes them), and the journal's separator falls between its entries only."""
    messages = [{"role": "tool", "tool_call_id": f"c{i}", "content": c, "extra": 1} for i, c in enumerate(contents)]
    ids = [f"m{i}" for i in range(len(messages))]
    text = mirror_document("s", revision, ids, messages).decode()  # UTF-8: no lone surrogate in the file
    expected = {"session": "s", "revision": revision, "messages": [
        {"id": mid, "role": "tool", "tool_call_id": m["tool_call_id"], "content": m["content"]}
        for mid, m in zip(ids, messages, strict=True)]}
    assert json.loads(text) == json.loads(json.dumps(expected))
    assert text.count(MIRROR_SEPARATOR) == max(len(ids) - 1, 0)
    assert text.endswith("\n    }" + CLOSE.decode()) == bool(ids)
    cache: Entries = {}
    hashes = [f"h{i}" for i in ids]
    data = text.encode()
    assert mirror_document("s", revision, ids, messages, hashes, cache) == data  # written whole, cut for the cache
    assert mirror_document("s", revision, ids, messages, hashes, cache) == data  # joined from the cache


def test_a_mirror_rewritten_shorter_in_place_is_exactly_its_new_text(tmp_path: Path) -> None:
    """Issue #13: the mirror is written over its last version in place (no truncation first); a shorter version
    leaves nothing of the longer one behind, and a missing file (or folder) is created."""
    path = session_mirror(tmp_path / "ws", _body(1)["messages"])
    for text in ["é" * 5000, "x" * 10, "ü" * 300]:
        rewrite_in_place(path, text.encode())
        assert path.read_text() == text


def test_the_entries_a_draft_is_judged_against_are_read_back_from_the_mirror_written(tmp_path: Path) -> None:
    """Issue #13: the written entries (identity -> text) are no longer built on every write of a long session's
    mirror, only when a commit asks: read back from the document, they are what the messages written said."""
    messages = _body(3)["messages"]
    ids = [f"m{i}" for i in range(len(messages))]
    document = mirror_document("s", 0, ids, messages)
    ctx = SessionContext(decisions=[], mirror_document=bytearray(document), mirror_written=True)
    assert ctx.written_entries() == {mid: content_text(m.get("content")) for mid, m in zip(ids, messages,
                                                                                            strict=True)}
    assert SessionContext(decisions=[], mirror_document=bytearray(document)).written_entries() == {}  # committed


_TEXT = st.text(st.characters(codec="utf-8"), max_size=30)
_MESSAGE = st.one_of(st.builds(lambda c: {"role": "user", "content": c}, _TEXT),
                     st.builds(lambda c: {"role": "tool", "tool_call_id": "c1", "content": c}, _TEXT))


@given(st.lists(_MESSAGE, min_size=1, max_size=8), st.integers(1, 8), st.integers(0, 3))
def test_a_mirror_extended_by_new_entries_is_the_text_written_whole(messages: list[dict[str, Any]], kept: int,
                                                                     revision: int) -> None:
    """Issue #13: a mirror that only grew is built from its new entries, and is byte for byte the whole one."""
    kept = min(kept, len(messages))
    ids = [f"m{i}" for i in range(len(messages))]
    hashes = [message_hash(m) for m in messages]
    cache: Entries = {}
    before = mirror_document("s", revision, ids[:kept], messages[:kept], hashes[:kept], cache)
    grown = bytearray(before)
    tail = appended_document(grown, ids[kept:], messages[kept:], hashes[kept:], cache)
    assert grown == mirror_document("s", revision, ids, messages)
    assert grown == before[: len(before) - len(CLOSE)] + tail  # the tail: what the file gets where CLOSE was
    assert mirror_document("s", revision, ids, messages, hashes, cache) == grown  # from the cache alone
    assert set(cache) == set(hashes)


_VERSION = st.lists(st.tuples(st.integers(0, 5), _MESSAGE), max_size=7)


@given(_VERSION, _VERSION, st.integers(0, 7), st.integers(0, 7), _VERSION, st.integers(0, 2))
@example([(0, {"role": "user", "content": ""}), (0, {"role": "user", "content": "0"})], [], 1, 1,
         [(0, {"role": "user", "content": ""})], 0)  # every entry cached, one of the cache's no longer shown
def test_a_mirror_assembled_from_cached_entries_is_the_text_written_whole(before: list[tuple[int, dict[str, Any]]],
                                                                        changed: list[tuple[int, dict[str, Any]]],
                                                                        at: int, dropped: int,
                                                                        added: list[tuple[int, dict[str, Any]]],
                                                                        revision: int) -> None:
    """Issue #13: a version that changes some entries (a fold, an elision pass) and adds some at the end writes
    those and joins the others' text from the cache the last version left; byte for byte the whole text, whatever
    was changed, dropped, added or repeated where, and the cache holds the current entries only."""
    def written(version: list[tuple[int, dict[str, Any]]], cache: Entries | None) -> bytes:
        return mirror_document("s", revision, [f"m{k}" for k, _ in version], [m for _, m in version],
                               [message_hash(m) for _, m in version], cache)

    at = min(at, len(before))
    after = [*before[:at], *changed, *before[at + dropped:], *added]
    cache: Entries = {}
    assert written(before, cache) == written(before, None)
    assert written(after, cache) == written(after, None)
    shown_as: dict[str, set[str]] = {}
    for k, m in after:
        shown_as.setdefault(message_hash(m), set()).add(f"m{k}")
    assert all(cache[h][0] in mids for h, mids in shown_as.items())
    assert len(cache) <= ENTRIES_KEPT * len(after)


def test_the_mirror_and_the_journal_cut_it_at_the_same_separator() -> None:
    """The core cannot import the store, nor the store the core: the one layout is written down twice."""
    assert MIRROR_SEPARATOR.encode() == mirror_module._BETWEEN


def test_a_mirror_that_only_grows_is_written_at_its_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #13: rounds too short to cut, after the mirror turned on, only add entries: the file is written whole
    once and then only where it grew, and is at every step exactly the document (the JSON as ``json.dumps``
    lays it out) showing every message."""
    whole: list[Path] = []
    real = mirror_file.rewrite_in_place
    monkeypatch.setattr(mirror_file, "rewrite_in_place", lambda path, text: (whole.append(path), real(path, text)))
    mirror = session_mirror(tmp_path / "ws", _body(1)["messages"])
    first = _body(13)
    bodies = [first]
    for k in range(14, 17):
        msgs = [*bodies[-1]["messages"], {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": f"short {k}"}]
        bodies.append({**first, "messages": msgs})
    shown: list[list[str]] = []
    sent = _send(tmp_path, bodies, between=lambda i: shown.append(_ids(mirror)))
    shown.append(_ids(mirror))
    assert all(PARAGRAPH in s for s in sent) and len(whole) == 1
    assert [len(ids) for ids in shown] == [len(b["messages"]) for b in bodies]
    text = mirror.read_text(encoding="utf-8")
    assert json.dumps(json.loads(text), indent=2, ensure_ascii=False) == text


def _ids(mirror: Path) -> list[str]:
    return [e["id"] for e in json.loads(mirror.read_text(encoding="utf-8"))["messages"]]


_SHOWN = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=12)


@given(st.lists(_SHOWN, min_size=1, max_size=6), st.integers(0, 2))
def test_what_a_mirror_shows_journaled_version_after_version_reads_back_as_it(versions: list[list[tuple[int, int]]],
                                                                             revision: int) -> None:
    """Each version (entries kept, changed, dropped, added, repeated) is journaled as two lists delta-encoded on
    the last version's, and reads back as it was; the lists are the same whether this connection kept the last
    ones or read them back along their chains (it does not read them when it kept them)."""
    layouts = []
    for forget in (False, True):
        journal = Journal(":memory:")
        try:
            session = journal.record_request(incoming([{"role": "user", "content": "task"}])).session_id
            chains: list[int] = []
            with pytest.MonkeyPatch.context() as patch:
                chain = session_state_module.chain
                patch.setattr(session_state_module, "chain",
                              lambda c, i, seen=chains, read=chain: (seen.append(i), read(c, i))[1])
                for n, version in enumerate(versions):
                    if forget:
                        journal.shown_mirrors.clear()
                    shown = MirrorShown(revision + n % 2, tuple(f"m{i}" for i, _ in version),
                                        tuple(f"h{h}" for _, h in version))
                    record_session_state(journal, session, 1, SessionState(mirror_shown=shown), str(n))
                    assert len(chains) == (2 if forget and n else 0)  # the last version's two lists, read back
                    chains.clear()
                    assert session_state(journal, session).mirror_shown == shown
                    chains.clear()
            layouts.append(journal.conn.execute(
                "SELECT l.base_id IS NULL, l.base_len, l.added, l.length FROM session_state s JOIN message_lists l"
                " ON l.id IN (s.mirror_list, s.mirror_ids) WHERE s.session_id = ? ORDER BY l.id", [session]).fetchall())
        finally:
            journal.close()
    assert layouts[0] == layouts[1]


def test_a_mirror_list_is_stored_whole_past_its_chain_s_cap(tmp_path: Path) -> None:
    """A read rebuilds a list along at most 64 rows: the 65th version of a growing mirror is stored whole."""
    journal = Journal(tmp_path / "j.db")
    try:
        session = journal.record_request(incoming([{"role": "user", "content": "task"}])).session_id
        for n in range(1, 70):
            shown = MirrorShown(0, tuple(f"m{i}" for i in range(n)), tuple(f"h{i}" for i in range(n)))
            record_session_state(journal, session, 1, SessionState(mirror_shown=shown), str(n))
            assert session_state(journal, session).mirror_shown == shown
        whole = [n for n, (base,) in enumerate(journal.conn.execute(
            "SELECT l.base_id FROM session_state s JOIN message_lists l ON l.id = s.mirror_list ORDER BY s.id"))
                 if base is None]
        assert whole == [0, 64]
    finally:
        journal.close()


def test_a_mirror_journaled_before_its_indent_was_two_spaces_reads_back_as_written(tmp_path: Path) -> None:
    """A journal kept by an earlier ctxproxy holds mirrors indented by one space, cut at that layout's separator:
    read back after the upgrade, such a mirror is the text that earlier version wrote (so the file it left is not
    taken for the model's draft)."""
    journal = Journal(tmp_path / "j.db")
    try:
        session = journal.record_request(incoming([{"role": "user", "content": "task"}])).session_id
        msgs = _body(4, 50)["messages"]
        earlier = json.dumps({"session": session, "revision": 0, "messages": [
            {"id": f"m{i}", **m} for i, m in enumerate(msgs)]}, indent=1, ensure_ascii=False)
        tail = "\n  }\n ]\n}"
        pieces = [*earlier[: -len(tail)].split("\n  },\n  {\n"), tail]
        hashes = [hashlib.sha256(p.encode()).hexdigest() for p in pieces]  # as that version stored them
        journal.conn.executemany("INSERT INTO blobs (hash, kind, body, chars) VALUES (?, 'mirror', ?, ?) ON CONFLICT"
                                 " DO NOTHING", [(h, p, len(p)) for h, p in zip(hashes, pieces, strict=True)])
        list_id, _ = session_state_module._insert_mirror_list(journal, None, [], 0, hashes)
        journal.conn.execute("INSERT INTO session_state (session_id, request_id, confirmations, mirror, mirror_list,"
                             " created_at) VALUES (?, 1, '[]', 'm', ?, '0')", [session, list_id])
        assert len(pieces) == len(msgs) + 1
        assert session_state(journal, session).mirror_text == earlier
    finally:
        journal.close()


def test_a_mirror_that_cannot_be_written_costs_no_answer_and_is_written_at_the_next_request(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The mirror's folder cannot be made (a file holds its name): the request is still answered, the failure is
    logged, and the next request writes the mirror whole once it can."""
    blocker = tmp_path / "ws"
    blocker.write_text("not a folder")
    sent = _send(tmp_path, [_body(13), _body(13)], between=lambda i: blocker.unlink())
    assert all(PARAGRAPH in s for s in sent)
    assert "could not write the live mirror" in caplog.text
    assert len(_ids(session_mirror(tmp_path / "ws", _body(1)["messages"]))) == len(_body(13)["messages"])


def test_the_mirror_is_written_while_the_request_is_upstream_and_before_its_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #13: the file the model is told of is written after the request has gone upstream (it reads it only
    once it has answered), and the answer waits for it: at the client, the file is whole."""
    events: list[str] = []
    real = mirror_file.rewrite_in_place

    def slow_write(path: Path, data: bytes) -> None:
        events.append("write begins")
        real(path, data)
        events.append("written")

    class Watching(CountingUpstream):
        def _echo(self, got: Any) -> Any:
            events.append("upstream")
            return super()._echo(got)

    monkeypatch.setattr(mirror_file, "rewrite_in_place", slow_write)
    fake = Watching(window=16384)
    with app_client(_settings(tmp_path), httpx.ASGITransport(app=fake)) as client:
        assert client.post("/v1/chat/completions", json=_body(13)).status_code == 200
        events.append("answered")
        text = (session_mirror(tmp_path / "ws", _body(1)["messages"])).read_text(encoding="utf-8")
    assert events.index("upstream") < events.index("written") < events.index("answered")
    assert [e["id"] for e in json.loads(text)["messages"]][-1] == "tool:call_13"


def test_a_forwards_cuts_are_journaled_while_it_is_upstream_and_before_its_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #13: what the projection decided (its cuts, the list sent) is journaled once the request has gone
    upstream, the upstream's own time hiding it, and the answer waits for it: at the client, the journal holds the
    forward and its decisions. The request itself was journaled before anything went upstream."""
    events: list[str] = []
    real_forward, real_request = SessionContext.journal_forward, Journal.record_request

    async def watched_forward(self: SessionContext, *args: Any) -> int:
        events.append("forward journal begins")
        list_id = await real_forward(self, *args)
        events.append("forward journaled")
        return list_id

    def watched_request(self: Journal, *args: Any, **kwargs: Any) -> Any:
        recorded = real_request(self, *args, **kwargs)
        events.append("request journaled")
        return recorded

    class Watching(CountingUpstream):
        def _echo(self, got: Any) -> Any:
            events.append("upstream")
            return super()._echo(got)

    monkeypatch.setattr(SessionContext, "journal_forward", watched_forward)
    monkeypatch.setattr(Journal, "record_request", watched_request)
    with app_client(_settings(tmp_path), httpx.ASGITransport(app=Watching(window=16384))) as client:
        answer = client.post("/v1/chat/completions", json=_body(13))
        events.append("answered")
        journal = client.app.state.ctx.journal.journal  # type: ignore[attr-defined]
        decided = journal.conn.execute("SELECT count(*) FROM decisions WHERE session_id = ?",
                                       [answer.headers["x-ctx-session"]]).fetchone()
    assert answer.status_code == 200 and decided[0] > 0
    assert events == ["request journaled", "upstream", "forward journal begins", "forward journaled", "answered"]


def test_a_forward_cancelled_meanwhile_still_waits_for_its_mirror_to_be_written() -> None:
    """The client went away while the request was upstream: the mirror's write (under the session's lock) ends
    before the cancellation goes on, so the lock is never let go with the session's mirror half written."""
    done: list[str] = []

    async def write() -> None:
        await asyncio.sleep(0.05)
        done.append("written")

    async def forward() -> None:
        async with forward_module._alongside(write):
            await asyncio.sleep(10)

    async def cancel_it() -> None:
        task = asyncio.get_running_loop().create_task(forward())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        done.append("cancelled")

    asyncio.run(cancel_it())
    assert done == ["written", "cancelled"]


def test_a_mirror_whose_forward_the_journal_refuses_is_written_by_the_next_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request that turns the mirror on decides what it shows, then the journal refuses its forward (its disk
    full) while the request is upstream: the client gets the refusal, not the answer, and no file is written. The
    next request writes the mirror whole, though it shows the same messages: it is not taken for written."""
    real_journal = SessionContext.journal_forward
    refuse = [True]

    async def full(self: SessionContext, *args: Any) -> int:
        if refuse:
            refuse.pop()
            raise StorageFull("the journal's disk is full")
        return await real_journal(self, *args)

    monkeypatch.setattr(SessionContext, "journal_forward", full)
    fake = CountingUpstream(window=16384)
    mirror = session_mirror(tmp_path / "ws", _body(1)["messages"])
    with app_client(_settings(tmp_path), httpx.ASGITransport(app=fake)) as client:
        assert client.post("/v1/chat/completions", json=_body(13)).status_code == 507
        assert len(fake.counts) == 1 and not mirror.exists()
        assert client.post("/v1/chat/completions", json=_body(13)).status_code == 200
    assert len(fake.counts) == 2
    assert _ids(mirror)[-1] == "tool:call_13"


def test_the_entries_of_a_mirror_not_on_yet_are_rendered_ahead_and_joined_when_it_turns_on() -> None:
    """Issue #13: while the projection is over its target and the mirror is off, its entries are rendered ahead,
    ``PRIMED_ENTRIES`` a request, so the request that turns it on (a cut pass already) joins them instead of
    writing the whole mirror; the bytes are those written whole."""
    msgs = history([f"line {k}\n" + "r" * 3000 for k in range(60)])
    p = project(msgs, [message_hash(m) for m in msgs], [], Rules(budget(8192, spill_chars=100_000)), CharCounter())
    ctx = SessionContext(decisions=[])
    mirror_file._prime_entries(ctx, p)
    assert 0 < len(ctx.mirror_entries) <= mirror_file.PRIMED_ENTRIES
    while ctx.mirror_primed < len(p.state.ids):
        mirror_file._prime_entries(ctx, p)
    ids = [mid for mid, out in zip(p.state.ids, p.state.out, strict=True) if out is not None]
    shown, hashes = p.messages[: len(ids)], p.hashes[: len(ids)]
    assert all(ctx.mirror_entries[h][0] == mid for mid, h in zip(ids, hashes, strict=True))
    assert mirror_document("s", 0, ids, shown, hashes, ctx.mirror_entries) == mirror_document("s", 0, ids, shown)


def test_the_markers_counted_ahead_have_their_entries_rendered_ahead_too() -> None:
    """The pass that turns the mirror on elides many results at once (312 at 128k after 600 rounds, half its
    entries): their entries, as the markers will show them, are rendered ahead with the markers' counts, so that
    pass joins them instead of rendering them; the bytes are those written whole."""
    rules = Rules(budget(8192, spill_chars=100_000))
    ctx = SessionContext(decisions=[])
    decisions: list[Any] = []
    state, marked = None, set()
    for messages in prefixes(history(["r" * 3000] * 20)):
        p = run(messages, rules, decisions, state)
        if p.report.elided:
            break
        decisions, state = decisions + list(p.new), p.state
        marked |= {(p.state.ids[i], h) for i, _, h in p.state.marked_ahead}
        if p.report.scaled > p.report.target:
            mirror_file._prime_entries(ctx, p)
    ids = [mid for mid, out in zip(p.state.ids, p.state.out, strict=True) if out is not None]
    shown, hashes = p.messages[: len(ids)], p.hashes[: len(ids)]
    targets = {d.target for d in p.new if d.kind == "elide"}
    elided = {(mid, h) for mid, h in zip(ids, hashes, strict=True) if mid in targets}
    assert elided & marked and all(ctx.mirror_entries.get(h, ("",))[0] == mid for mid, h in marked)
    assert mirror_document("s", 0, ids, shown, hashes, ctx.mirror_entries) == mirror_document("s", 0, ids, shown)
