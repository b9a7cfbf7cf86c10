"""Folds store each original once: a fold names the messages it stands for, its body is rebuilt from the journal.

Before, every fold stored its whole span as an overflow blob, and every later fold (which extends the earlier one
from the same start) the longer span again: the journal grew with the square of the session. Now a fold is a
``overflow_spans`` row; restoring it gives the same bytes, under the same id, as the blob did.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ctxproxy.config import load_settings
from ctxproxy.proxy.core import Rules, canonical_json, fold_body, folds, message_hash
from ctxproxy.proxy.core.invariants import broken_pairs
from ctxproxy.proxy.core.project import project
from ctxproxy.proxy.core.state import FoldSum, sha256_text
from ctxproxy.proxy.core.stubs import fold_stub, fold_stub_of
from ctxproxy.store import Journal, OverflowBody
from ctxproxy.store.journal import IncomingRequest
from tests.conftest import app_client
from tests.fakes import FakeUpstream, Reply, completion, tool_answer
from tests.test_project import CharCounter, budget, history, prefixes

_FOLD = re.compile(r"^\[folded id=([0-9a-f]{64}) messages=(\d+) bytes=(\d+) ")


def _requests(rounds: int) -> list[dict[str, Any]]:
    """An agent's requests, the history through each tool result: results of ~1.5 KB, each its own text."""
    messages = history([f"line {k} of output {k % 7}\n" * 70 for k in range(rounds)])
    return [{"model": "fake-model", "messages": messages[:end]} for end in range(4, len(messages) + 1, 2)]


def _replay(tmp_path: Path, rounds: int, read_fold: bool = False,
            **extra: str) -> tuple[FakeUpstream, list[dict[str, Any]], Path]:
    """Each request of the run, then (``read_fold``) the model reads the newest fold back with ``read_overflow``."""
    fake = FakeUpstream()
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "4096", **extra})
    requests = _requests(rounds)
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        for body in requests:
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        if read_fold:
            fold_id = _folds(fake)[-1][0]
            fake.enqueue(Reply(body=tool_answer(("read_overflow", {"id": fold_id, "limit": 20_000}))))
            fake.enqueue(Reply(body=completion("read it")))
            assert client.post("/v1/chat/completions", json=requests[-1]).status_code == 200
    return fake, requests, tmp_path / "journal.db"


def _folds(fake: FakeUpstream) -> list[tuple[str, int, int]]:
    """(id, messages, bytes) of each distinct fold stub the upstream was sent, in order."""
    found: dict[str, tuple[str, int, int]] = {}
    for got in fake.chats:
        for m in got.json()["messages"]:
            match = _FOLD.match(m["content"]) if isinstance(m.get("content"), str) else None
            if match:
                found.setdefault(match.group(1), (match.group(1), int(match.group(2)), int(match.group(3))))
    return list(found.values())


def _stored_per_history_byte(tmp_path: Path, rounds: int) -> tuple[float, int, int]:
    """The journal's blob characters per character of the final history, the folds made, the cut blobs stored."""
    fake, requests, path = _replay(tmp_path, rounds)
    history = sum(len(canonical_json(m)) for m in requests[-1]["messages"])
    with sqlite3.connect(path) as db:
        stored = db.execute("SELECT COALESCE(SUM(chars), 0) FROM blobs").fetchone()[0]
        cut_blobs = db.execute("SELECT COUNT(*) FROM overflow").fetchone()[0]
    return stored / history, len(_folds(fake)), cut_blobs


def test_the_journal_grows_with_the_history_not_with_the_folds(tmp_path: Path) -> None:
    """Twice the rounds, twice the journal: before, each fold stored its whole span again (each extends the last),
    and the journal grew with the square of the session."""
    short, _, _ = _stored_per_history_byte(tmp_path / "30", 30)
    ratio, folds, cut_blobs = _stored_per_history_byte(tmp_path / "60", 60)
    assert folds >= 5
    # The history's bodies and the projected stubs: each original once, however many folds and elisions there were.
    assert ratio <= 2.0 and ratio <= short * 1.1, (short, ratio)
    assert cut_blobs == 0  # folds and results cut whole are named by their place in a request, not stored again


def test_a_cut_result_restores_the_same_bytes_from_its_message(tmp_path: Path) -> None:
    _, requests, path = _replay(tmp_path, 60)
    contents = {m["content"] for m in requests[-1]["messages"] if m["role"] == "tool"}
    journal = Journal(path)
    try:
        session = journal.sessions()[0]["id"]
        cuts = [d for d in journal.decisions(session) if d["kind"] in ("spill", "elide")]
        assert len(cuts) >= 10
        for d in cuts:
            row = journal.overflow_body(d["overflow_id"], session)
            assert row is not None and row["body"] in contents and sha256_text(row["body"]) == d["overflow_id"]
            assert row["tool"] == "sh" and row["call_id"].startswith("call_")
    finally:
        journal.close()


def test_a_fold_restores_the_same_bytes_under_the_same_id(tmp_path: Path) -> None:
    fake, requests, path = _replay(tmp_path, 60)
    messages = requests[-1]["messages"]
    journal = Journal(path)
    try:
        session = journal.sessions()[0]["id"]
        for overflow_id, count, nbytes in _folds(fake):
            row = journal.overflow_body(overflow_id, session)
            assert row is not None and row["tool"] == "fold" and row["bytes"] == nbytes
            # What the fold blob held before: the canonical JSON array of the folded messages, whose sha256 is id.
            assert row["body"] == canonical_json(messages[2:2 + count]).decode()
            assert sha256_text(row["body"]) == overflow_id and len(row["body"].encode()) == nbytes
        assert journal.overflow_body(_folds(fake)[0][0], "another-session") is None  # scoped to its session
    finally:
        journal.close()


def test_each_fold_id_and_size_are_those_of_the_whole_span_it_stands_for() -> None:
    """The running digest (only the newly folded messages hashed) gives exactly the id and size that serialising
    the whole span gave, on a resumed state and on a recomputed one."""
    msgs = history(["short output " * 10] * 120)
    rules, decisions, state = Rules(budget(4096, spill_chars=100_000)), [], None
    spans = []
    for end in range(4, len(msgs) + 1, 2):
        request = msgs[:end]
        hashes = [message_hash(m) for m in request]
        p = project(request, hashes, decisions, rules, CharCounter(), state)
        again = project(request, hashes, decisions, rules, CharCounter())  # recomputed: the digest starts afresh
        assert [(w.overflow_id, w.size) for w in again.writes] == [(w.overflow_id, w.size) for w in p.writes]
        decisions, state = decisions + list(p.new), p.state
        for w in (w for w in p.writes if w.part == "messages"):
            assert w.span is not None and w.body == ""
            body = fold_body(request, w.span)
            assert (w.overflow_id, w.size) == (sha256_text(body), len(body.encode()))
            spans.append(w.span)
    assert len(spans) >= 3 and len({start for start, _ in spans}) == 1  # later folds extend the first


def test_a_fold_blob_journaled_before_the_change_is_still_read(store_location: Path | str) -> None:
    journal = Journal(store_location)
    try:
        body = canonical_json([{"role": "user", "content": "old"}]).decode()
        request = IncomingRequest("2026-01-01T00:00:00", "/v1/chat/completions", "m", False, None, "f", ["h"],
                                  [b"{}"], "p", b"{}", {}, 2)
        recorded = journal.record_request(request)
        journal.add_decisions(recorded.session_id, [], "2026-01-01T00:00:00", recorded.request_id,
                              [OverflowBody(sha256_text(body), body, "fold", "")])
        row = journal.overflow_body(sha256_text(body), recorded.session_id)
        assert row is not None and row["body"] == body and row["tool"] == "fold"
    finally:
        journal.close()



def test_a_folds_out_file_holds_the_body_its_stub_names(tmp_path: Path) -> None:
    """With ``overflow_dir`` set, every cut body is also a file: a fold's is assembled from the request's messages."""
    fake, requests, _ = _replay(tmp_path, 30, CTXPROXY_OVERFLOW_DIR=str(tmp_path / "out"))
    folds = _folds(fake)
    assert folds
    for overflow_id, count, nbytes in folds:
        text = (tmp_path / "out" / f"{overflow_id}.out").read_text()
        assert text == canonical_json(requests[-1]["messages"][2:2 + count]).decode() and len(text.encode()) == nbytes


def test_the_model_reads_a_fold_back_as_it_was(tmp_path: Path) -> None:
    """``read_overflow`` on a fold's id answers with the folded messages' JSON, as when the fold was a blob."""
    fake, requests, _ = _replay(tmp_path, 60, read_fold=True)
    _, count, nbytes = _folds(fake)[-1]
    page = next(m["content"] for m in reversed(fake.chats[-1].json()["messages"])
                if str(m.get("tool_call_id", "")).startswith("ctx_"))
    body = canonical_json(requests[-1]["messages"][2:2 + count]).decode()
    assert len(body.encode()) == nbytes and len(body) > 20_000
    assert page.startswith(body[:20_000]) and page.endswith(f"[… {len(body) - 20_000} more characters: "
                                                            "read_overflow with offset=20000]")


_message = st.one_of(
    st.builds(lambda cid, name: {"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}}]},
        st.sampled_from(["c1", "c2", "c3"]), st.sampled_from(["sh", "read_file"])),
    st.builds(lambda cid, text: {"role": "tool", "tool_call_id": cid, "content": text},
              st.sampled_from(["c1", "c2", "c3", "stray"]), st.text(max_size=20)),
    st.builds(lambda text: {"role": "user", "content": text}, st.text(max_size=20)),
    st.builds(lambda: {"role": "assistant", "content": "thinking"}))


@given(st.lists(_message, max_size=30), st.lists(st.integers(0, 30), max_size=4))
def test_a_fold_sum_grown_in_steps_knows_what_one_walk_over_its_span_finds(messages: list[dict[str, Any]],
                                                                           cuts: list[int]) -> None:
    """A fold that extends the last one hashes, tallies and walks only the messages it adds (issue #13): whatever
    the steps, its body's digest, its ``message_hash``, its stub and its pairing are those of the whole span."""
    hashes = [message_hash(m) for m in messages]
    run = FoldSum.empty(0)
    for end in [*sorted(min(c, len(messages)) for c in cuts), len(messages)]:
        run = run.extend((messages[i], canonical_json(messages[i]), hashes[i]) for i in range(run.end, end))
    assert run.end == len(messages)
    assert run.closed() == (sha256_text(fold_body(messages, (0, len(messages)))), len(fold_body(messages, (0, len(
        messages))).encode()))
    assert run.message_hash() == sha256_text("".join(hashes))
    assert run.pairs.broken() == broken_pairs(messages)
    assert fold_stub_of("f" * 64, len(messages), run.roles, run.tools, 9, "disk") == fold_stub("f" * 64, messages, 9,
                                                                                               "disk")


def _folded_session(sizes: list[int], window: int) -> tuple[list[Any], list[list[Any]]]:
    """A session's decisions, and each request's projected messages."""
    rules = Rules(budget(window))
    decisions: list[Any] = []
    sent, state = [], None
    for messages in prefixes(history([f"{k} " + "r" * n for k, n in enumerate(sizes)])):
        p = project(messages, [message_hash(m) for m in messages], decisions, rules, CharCounter(), state)
        decisions += p.new
        state, _ = p.state, sent.append(p.messages)
    return decisions, sent


@given(st.lists(st.integers(200, 3000), min_size=12, max_size=40), st.sampled_from([4096, 8192]))
def test_a_fold_pass_that_walks_on_from_the_standing_fold_decides_what_a_walk_from_the_start_does(
        sizes: list[int], window: int) -> None:
    """Each fold after the first extends the standing one: its walk starts after it, its messages' counts taken
    off at once (``folds._past_last_fold``), and decides the same folds, with the same stubs, as the walk over
    every span from the first."""
    walked_on = _folded_session(sizes, window)
    with pytest.MonkeyPatch.context() as from_the_start:
        from_the_start.setattr(folds, "_past_last_fold", lambda state, spans, start: (0, start, state.total))
        assert _folded_session(sizes, window) == walked_on


def test_the_sessions_above_fold_more_than_once() -> None:
    """The property above reaches the walk on from a standing fold: this one folds four times or more."""
    decisions, _ = _folded_session([1500] * 40, 4096)
    assert sum(d.kind == "fold" for d in decisions) >= 4
