"""The live mirror is written only while it is of use and only when what it shows changed.

Before, ``LIVE_CONTEXT.json`` was rewritten, read back and hashed on every request while the mirror was on (9% of
the samples of a 600-round run), and written even with the context tools off, when no edit of it could ever be
committed. A draft of the model's is still never overwritten: a changed file is noticed by its size and times.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.config import load_settings
from ctxproxy.proxy.core import message_hash
from ctxproxy.proxy.core.identity import content_text
from ctxproxy.proxy.engine import mirror_file
from ctxproxy.proxy.engine.context import SessionContext
from ctxproxy.proxy.engine.mirror_file import rewrite_in_place
from ctxproxy.proxy.tools import mirror as mirror_module
from ctxproxy.proxy.tools.mirror import CLOSE, appended_document, mirror_document
from ctxproxy.store import (
    ForwardRecord,
    Journal,
    JournalWriter,
    SessionState,
    StateChange,
    record_forward_and_state,
    record_session_state,
    session_state,
)
from ctxproxy.store.session_state import MIRROR_SEPARATOR
from tests.conftest import app_client
from tests.fakes import CountingUpstream
from tests.test_journal import incoming

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
    mirror = tmp_path / "ws" / "LIVE_CONTEXT.json"
    sent = _send(tmp_path, [_body(13)] * 3, between=lambda i: os.utime(mirror, ns=(OLD, OLD)))
    assert all(PARAGRAPH in s for s in sent)  # on for every request, as before
    assert mirror.stat().st_mtime_ns == OLD  # touched, not changed: the same projection is not written again


def test_the_mirror_is_rewritten_when_the_projection_changed(tmp_path: Path) -> None:
    mirror = tmp_path / "ws" / "LIVE_CONTEXT.json"
    first, second = _body(13), _body(14)
    _send(tmp_path, [first, second], between=lambda i: os.utime(mirror, ns=(OLD, OLD)))
    shown = [e["id"] for e in json.loads(mirror.read_text())["messages"]]
    assert mirror.stat().st_mtime_ns != OLD and "tool:call_14" in shown


def test_a_draft_of_the_model_is_still_never_overwritten(tmp_path: Path) -> None:
    mirror = tmp_path / "ws" / "LIVE_CONTEXT.json"

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
    assert not (tmp_path / "ws" / "LIVE_CONTEXT.json").exists()


def test_the_journal_keeps_each_mirror_entry_once_and_gives_the_text_back(store_location: Path | str) -> None:
    """Each version of a growing mirror is journaled (a restart judges a pending draft against it), as pieces
    stored once: the journal holds about one copy of the last version, not the sum of every version."""
    journal = Journal(store_location)
    try:
        recorded = journal.record_request(incoming([{"role": "user", "content": "task"}]))
        msgs = _body(40, 500)["messages"]
        ids = [f"m{i}" for i in range(len(msgs))]
        texts = [mirror_document(recorded.session_id, n // 30, ids[:n], msgs[:n]) for n in range(len(msgs) + 1)]
        for text in texts:
            state = SessionState(mirror="LIVE_CONTEXT.json", mirror_text=text)
            record_session_state(journal, recorded.session_id, recorded.request_id, state, "2026-01-01T00:00:00")
            assert session_state(journal, recorded.session_id).mirror_text == text
        stored = journal.conn.execute("SELECT SUM(chars) FROM blobs WHERE kind = 'mirror'").fetchone()[0]
        assert stored <= 1.5 * len(texts[-1]), (stored, len(texts[-1]), sum(map(len, texts)))
        off = SessionState(mirror=None, mirror_text=None)
        record_session_state(journal, recorded.session_id, recorded.request_id, off, "2026-01-01T00:00:01")
        assert session_state(journal, recorded.session_id) == off
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

        state = SessionState(offered_turn="user:1", mirror="m", mirror_text=mirror_document(
            recorded.session_id, 0, ["m0"], [{"role": "user", "content": "task"}]))
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
        text = (tmp_path / "ws" / "LIVE_CONTEXT.json").read_text(encoding="utf-8")
        assert session_state(journal, session_id).mirror_text == text
    finally:
        journal.close()


def test_the_mirror_is_the_json_the_stdlib_writes_indented_by_two() -> None:
    msgs = _body(6, 40)["messages"] + [{"role": "user", "content": "é\n\"quoted\"\ttab\u2028\x00"}]
    ids = [f"m{i}" for i in range(len(msgs))]
    for n in [0, 1, 4, len(msgs)]:
        whole = json.dumps({"session": "s", "revision": n, "messages": [
            {"id": mid, **{k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "tool_calls")}}
            for mid, m in zip(ids[:n], msgs[:n], strict=True)]}, indent=2, ensure_ascii=False)
        assert mirror_document("s", n, ids[:n], msgs[:n]) == whole


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
    text = mirror_document("s", revision, ids, messages)
    text.encode()  # no lone surrogate in the file
    expected = {"session": "s", "revision": revision, "messages": [
        {"id": mid, "role": "tool", "tool_call_id": m["tool_call_id"], "content": m["content"]}
        for mid, m in zip(ids, messages, strict=True)]}
    assert json.loads(text) == json.loads(json.dumps(expected))
    assert text.count(MIRROR_SEPARATOR) == max(len(ids) - 1, 0)
    assert text.endswith("\n    }" + CLOSE) == bool(ids)
    cache: dict[tuple[str, str], str] = {}
    hashes = [f"h{i}" for i in ids]
    assert mirror_document("s", revision, ids, messages, hashes, cache) == text  # written whole, cut for the cache
    assert mirror_document("s", revision, ids, messages, hashes, cache) == text  # joined from the cache


def test_a_mirror_rewritten_shorter_in_place_is_exactly_its_new_text(tmp_path: Path) -> None:
    """Issue #13: the mirror is written over its last version in place (no truncation first); a shorter version
    leaves nothing of the longer one behind, and a missing file (or folder) is created."""
    path = tmp_path / "ws" / "LIVE_CONTEXT.json"
    for text in ["é" * 5000, "x" * 10, "ü" * 300]:
        rewrite_in_place(path, text)
        assert path.read_text() == text


def test_the_entries_a_draft_is_judged_against_are_read_back_from_the_mirror_written(tmp_path: Path) -> None:
    """Issue #13: the written entries (identity -> text) are no longer built on every write of a long session's
    mirror, only when a commit asks: read back from the document, they are what the messages written said."""
    messages = _body(3)["messages"]
    ids = [f"m{i}" for i in range(len(messages))]
    document = mirror_document("s", 0, ids, messages)
    ctx = SessionContext(decisions=[], mirror_document=document, mirror_written=True)
    assert ctx.written_entries() == {mid: content_text(m.get("content")) for mid, m in zip(ids, messages,
                                                                                            strict=True)}
    assert SessionContext(decisions=[], mirror_document=document).written_entries() == {}  # committed: none


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
    cache: dict[tuple[str, str], str] = {}
    before = mirror_document("s", revision, ids[:kept], messages[:kept], hashes[:kept], cache)
    grown = appended_document(before, ids[kept:], messages[kept:], hashes[kept:], cache)
    assert grown == mirror_document("s", revision, ids, messages)
    assert mirror_document("s", revision, ids, messages, hashes, cache) == grown  # from the cache alone
    assert set(cache) == set(zip(ids, hashes, strict=True))


_VERSION = st.lists(st.tuples(st.integers(0, 5), _MESSAGE), max_size=7)


@given(_VERSION, _VERSION, st.integers(0, 7), st.integers(0, 7), _VERSION, st.integers(0, 2))
def test_a_mirror_assembled_from_cached_entries_is_the_text_written_whole(before: list[tuple[int, dict[str, Any]]],
                                                                        changed: list[tuple[int, dict[str, Any]]],
                                                                        at: int, dropped: int,
                                                                        added: list[tuple[int, dict[str, Any]]],
                                                                        revision: int) -> None:
    """Issue #13: a version that changes some entries (a fold, an elision pass) and adds some at the end writes
    those and joins the others' text from the cache the last version left; byte for byte the whole text, whatever
    was changed, dropped, added or repeated where, and the cache holds the current entries only."""
    def written(version: list[tuple[int, dict[str, Any]]], cache: dict[tuple[str, str], str] | None) -> str:
        return mirror_document("s", revision, [f"m{k}" for k, _ in version], [m for _, m in version],
                               [message_hash(m) for _, m in version], cache)

    at = min(at, len(before))
    after = [*before[:at], *changed, *before[at + dropped:], *added]
    cache: dict[tuple[str, str], str] = {}
    assert written(before, cache) == written(before, None)
    assert written(after, cache) == written(after, None)
    assert set(cache) == {(f"m{k}", message_hash(m)) for k, m in after}


def test_the_mirror_and_the_journal_cut_it_at_the_same_separator() -> None:
    """The core cannot import the store, nor the store the core: the one layout is written down twice."""
    assert mirror_module._BETWEEN == MIRROR_SEPARATOR


def test_a_mirror_that_only_grew_is_journaled_as_its_new_entries(store_location: Path | str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #13: a mirror that gained entries since the text last journaled lists only them, on the previous list
    (no reading back, splitting and hashing of every entry); any other change, or a ``previous`` that is not the
    journal's last, is journaled whole as before, and every version reads back as it was."""
    journal = Journal(store_location)
    try:
        recorded = journal.record_request(incoming([{"role": "user", "content": "task"}]))
        msgs = _body(12, 700)["messages"]
        ids = [f"m{i}" for i in range(len(msgs))]
        grow = [mirror_document(recorded.session_id, 0, ids[:n], msgs[:n]) for n in range(4, len(msgs) + 1)]
        other = mirror_document(recorded.session_id, 1, ids, msgs)  # a revision: the head changed
        hashed: list[bytes] = []
        counting = SimpleNamespace(sha256=lambda b: (hashed.append(b), hashlib.sha256(b))[1])
        monkeypatch.setattr(session_state_module, "hashlib", counting)
        previous = None
        for text in [*grow, other, grow[3], grow[5]]:
            state = SessionState(mirror="LIVE_CONTEXT.json", mirror_text=text)
            record_session_state(journal, recorded.session_id, recorded.request_id, state, "2026-01-01T00:00:00",
                                 previous=None if previous is None else SessionState(mirror_text=previous))
            assert session_state(journal, recorded.session_id).mirror_text == text
            previous = text
        added = [len(json.loads(a)) for (a,) in journal.conn.execute(
            "SELECT l.added FROM session_state s JOIN message_lists l ON l.id = s.mirror_list ORDER BY s.id")]
        assert added[1:len(grow)] == [2] * (len(grow) - 1)  # one new entry and the closing piece, each time
        whole = 2 * len(grow[0].split(MIRROR_SEPARATOR)) + 3 * len(msgs) + 6  # the first, the revision and two more
        assert len(hashed) <= whole + len(grow), (len(hashed), whole)  # not every piece of every version
        stale = SessionState(mirror_text=grow[0])  # not what the journal last kept: journaled whole
        record_session_state(journal, recorded.session_id, recorded.request_id,
                             SessionState(mirror="LIVE_CONTEXT.json", mirror_text=grow[6]), "2026", previous=stale)
        assert session_state(journal, recorded.session_id).mirror_text == grow[6]
    finally:
        journal.close()


class Compared(str):
    """A mirror's text that notes the prefixes it is asked whether it starts with."""

    asked: list[str]

    def startswith(self, prefix: Any, *where: Any) -> bool:
        self.asked.append(prefix)
        return super().startswith(prefix, *where)


def test_a_mirror_the_proxy_grew_is_journaled_without_comparing_its_start(store_location: Path | str) -> None:
    """``extends``: the caller made the mirror by adding entries to the one last journaled (``SessionContext``
    knows it wrote it so), and its start (~300 000 characters at 128k) is not compared again; the journal lists
    the same new entries on the previous list as when it compares, and the text reads back as it was."""
    journal = Journal(store_location)
    try:
        recorded = journal.record_request(incoming([{"role": "user", "content": "task"}]))
        msgs = _body(8, 700)["messages"]
        ids = [f"m{i}" for i in range(len(msgs))]
        first, grown = (mirror_document(recorded.session_id, 0, ids[:n], msgs[:n]) for n in (4, 6))
        record_session_state(journal, recorded.session_id, recorded.request_id, SessionState(mirror_text=first), "0")
        text = Compared(grown)
        text.asked = []
        record_session_state(journal, recorded.session_id, recorded.request_id, SessionState(mirror_text=text), "1",
                             previous=SessionState(mirror_text=first), extends=True)
        assert text.asked == [MIRROR_SEPARATOR]  # where the new entries start, nothing before it
        assert session_state(journal, recorded.session_id).mirror_text == grown
        (added,) = journal.conn.execute("SELECT l.added FROM session_state s JOIN message_lists l"
                                        " ON l.id = s.mirror_list ORDER BY s.id DESC LIMIT 1").fetchone()
        assert len(json.loads(added)) == 3  # two new entries and the closing piece
    finally:
        journal.close()


def test_a_mirror_that_only_grows_is_written_at_its_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #13: rounds too short to cut, after the mirror turned on, only add entries: the file is written whole
    once and then only where it grew, and is at every step exactly the document (the JSON as ``json.dumps``
    lays it out) showing every message."""
    whole: list[Path] = []
    real = mirror_file.rewrite_in_place
    monkeypatch.setattr(mirror_file, "rewrite_in_place", lambda path, text: (whole.append(path), real(path, text)))
    mirror = tmp_path / "ws" / "LIVE_CONTEXT.json"
    first = _body(13)
    bodies = [first]
    for k in range(14, 17):
        msgs = [*bodies[-1]["messages"], {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": f"short {k}"}]
        bodies.append({**first, "messages": msgs})
    extends: list[tuple[bool, bool]] = []
    record_mirror = session_state_module._record_mirror  # every way a mirror is journaled goes through it
    monkeypatch.setattr(session_state_module, "_record_mirror",
                        lambda *args: (extends.append(args[4]), record_mirror(*args))[1])
    shown: list[list[str]] = []
    sent = _send(tmp_path, bodies, between=lambda i: shown.append(_ids(mirror)))
    shown.append(_ids(mirror))
    assert all(PARAGRAPH in s for s in sent) and len(whole) == 1
    assert extends == [False] + [True] * 3  # grown, said so: not compared again
    assert [len(ids) for ids in shown] == [len(b["messages"]) for b in bodies]
    text = mirror.read_text(encoding="utf-8")
    assert json.dumps(json.loads(text), indent=2, ensure_ascii=False) == text


def _ids(mirror: Path) -> list[str]:
    return [e["id"] for e in json.loads(mirror.read_text(encoding="utf-8"))["messages"]]


class Counted(str):
    """A mirror's text that notes how often its separators are counted."""

    counts: int = 0

    def count(self, *args: Any) -> int:
        type(self).counts += 1
        return super().count(*args)


def test_a_mirror_grown_from_the_list_last_inserted_is_not_recounted(store_location: Path | str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal keeps, per session, the mirror list it inserted last with its text and chain depth: the next
    version grown from that very text is listed on it without counting the text's separators or walking the chain
    (0.3-0.5 ms a request at 128k); the lists are laid out as those journaled without it (a session of each, in
    the same journal), past the chain's 64-list cap."""
    lists, whole_paths = [], []
    insert = session_state_module._insert_mirror_list  # the path of a mirror not grown from the last one
    monkeypatch.setattr(session_state_module, "_insert_mirror_list",
                        lambda *a: (whole_paths.append(len(lists)), insert(*a))[1])
    for forget in (False, True):
        journal = Journal(store_location)
        try:
            recorded = journal.record_request(incoming([{"role": "user", "content": "task"}]))
            msgs = _body(40, 60)["messages"]
            ids = [f"m{i}" for i in range(len(msgs))]
            texts = [Counted(mirror_document(recorded.session_id, 0, ids[:n], msgs[:n])) for n in range(2, len(msgs))]
            Counted.counts, previous = 0, None
            for text in texts:
                if forget:
                    journal.grown_mirrors.clear()
                record_session_state(journal, recorded.session_id, recorded.request_id,
                                     SessionState(mirror_text=text), "0",
                                     previous=None if previous is None else SessionState(mirror_text=previous),
                                     extends=previous is not None)
                assert session_state(journal, recorded.session_id).mirror_text == text
                previous = text
            assert (Counted.counts == 0) != forget
            lists.append([(whole, base_len, len(json.loads(added)), length) for whole, base_len, added, length in
                          journal.conn.execute(
                              "SELECT l.base_id IS NULL, l.base_len, l.added, l.length FROM session_state s JOIN"
                              " message_lists l ON l.id = s.mirror_list WHERE s.session_id = ? ORDER BY s.id",
                              [recorded.session_id]).fetchall()])
        finally:
            journal.close()
    assert lists[0] == lists[1] and len(lists[0]) > 64 and sum(whole for whole, *_ in lists[0]) >= 2
    assert whole_paths.count(0) == whole_paths.count(1) == 2  # the first list and the 65th, each stored whole


def _lists(journal: Journal, session_id: str) -> list[list[str]]:
    """Each journaled mirror list of the session, as its hashes (read along its chain)."""
    return [session_state_module._mirror_hashes(journal, list_id)[0] for (list_id,) in journal.conn.execute(
        "SELECT mirror_list FROM session_state WHERE session_id = ? ORDER BY id", [session_id])]


@given(st.lists(st.lists(_MESSAGE, min_size=1, max_size=6), min_size=1, max_size=4), st.integers(0, 2))
def test_a_mirror_journaled_version_after_version_reads_back_as_written(versions: list[list[dict[str, Any]]],
                                                                        revision: int) -> None:
    """Each version (entries kept, changed, dropped, a revision's new head) is journaled as its text split at the
    separator, delta-encoded on the one before, and reads back as it was written."""
    journal = Journal(":memory:")
    try:
        session = journal.record_request(incoming([{"role": "user", "content": "task"}])).session_id
        previous = None
        for n, messages in enumerate(versions):
            text = mirror_document(session, revision + n % 2, [f"m{i}" for i in range(len(messages))], messages)
            record_session_state(journal, session, 1, SessionState(mirror_text=text), str(n), previous=previous)
            assert session_state(journal, session).mirror_text == text
            previous = SessionState(mirror_text=text)
        assert len(_lists(journal, session)) == len(versions)
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
        hashes = session_state_module._offer_pieces(journal, pieces)
        list_id, _ = session_state_module._insert_mirror_list(journal, None, [], 0, hashes)
        journal.conn.execute("INSERT INTO session_state (session_id, request_id, confirmations, mirror, mirror_list,"
                             " created_at) VALUES (?, 1, '[]', 'm', ?, '0')", [session, list_id])
        assert len(pieces) == len(msgs) + 1
        assert session_state(journal, session).mirror_text == earlier
    finally:
        journal.close()


def test_a_mirror_rewritten_whole_is_compared_with_the_list_this_connection_inserted(
        store_location: Path | str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #13: a mirror rewritten whole (a fold changed an early entry) is delta-encoded on the session's last
    list, whose hashes this connection kept when it inserted it: its chain is not read back (0.3-0.6 ms at 128k).
    The lists are those journaled with the chain read, and each version reads back as it was."""
    reads: list[int] = []
    chain_of, record = session_state_module._mirror_hashes, session_state_module._record_mirror
    recording = []
    monkeypatch.setattr(session_state_module, "_mirror_hashes",
                        lambda j, i: (recording and reads.append(i), chain_of(j, i))[1])
    monkeypatch.setattr(session_state_module, "_record_mirror",
                        lambda *a: (recording.append(1), record(*a), recording.clear())[1])
    lists = []
    for forget in (False, True):
        journal = Journal(store_location)
        try:
            session = journal.record_request(incoming([{"role": "user", "content": "task"}])).session_id
            msgs = _body(10, 400)["messages"]
            ids = [f"m{i}" for i in range(len(msgs))]
            versions = [mirror_document("s", 0, ids[:n], msgs[:n]) for n in range(4, len(msgs))]
            versions += [mirror_document("s", 0, ids[:n], [{**msgs[0], "content": f"folded {n}"}, *msgs[1:n]])
                         for n in range(len(msgs) - 3, len(msgs))]
            reads.clear()
            previous = None
            for text in versions:
                if forget:
                    journal.grown_mirrors.clear()
                record_session_state(journal, session, 1, SessionState(mirror_text=text), "0",
                                     previous=None if previous is None else SessionState(mirror_text=previous))
                assert session_state(journal, session).mirror_text == text
                previous = text
            assert len(reads) == (3 if forget else 0), reads  # the three versions rewritten whole
            lists.append(journal.conn.execute(
                "SELECT l.base_id IS NULL, l.base_len, l.added, l.length FROM session_state s JOIN message_lists l"
                " ON l.id = s.mirror_list WHERE s.session_id = ? ORDER BY s.id", [session]).fetchall())
        finally:
            journal.close()
    assert lists[0] == lists[1]


@given(st.lists(st.text(st.sampled_from(" {},\n]x"), max_size=16), min_size=1, max_size=5), st.text(max_size=8))
def test_any_text_laid_out_like_a_mirror_reads_back_as_it(inners: list[str], head: str) -> None:
    """Whatever the entries hold (here, the separator itself, braces, newlines), a text the journal cuts at the
    separator reads back exactly, whole or grown from the one before."""
    entries = ["    {\n" + inner + "\n    }" for inner in inners]
    journal = Journal(":memory:")
    try:
        recorded = journal.record_request(incoming([{"role": "user", "content": "task"}]))
        previous = None
        for n in range(1, len(entries) + 1):
            text = head + ',\n  "messages": [\n' + ",\n".join(entries[:n]) + CLOSE
            record_session_state(journal, recorded.session_id, recorded.request_id, SessionState(mirror_text=text),
                                 "0", previous=previous)
            assert session_state(journal, recorded.session_id).mirror_text == text
            previous = SessionState(mirror_text=text)
    finally:
        journal.close()
