"""The journal stores each text once: a decision names the forwarded message its replacement is the content of, and
a forward list or a mirror names the runs of its base it repeats after an early change (migration ``m013``), and
a mirror is journaled as the messages it shows (``m015``).

Each is read back exactly as before: the decisions, every forward list, what the mirror shows, and a journal written by
the code before (its rows are read as they are, never rewritten).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxproxy.proxy.engine.hashing import canonical_json, content_hash
from ctxproxy.store import ForwardRecord, Journal, MirrorShown, SessionState, record_session_state, session_state
from ctxproxy.store.deltas import RUNS_FROM, rebuild, runs
from ctxproxy.store.memory import MemoryJournal
from tests.conftest import app_client
from tests.fakes import CountingUpstream
from tests.test_journal import incoming, record, run
from tests.test_rewriting import requests_of, settings_for
from tests.workloads import conversation

hashes = st.lists(st.sampled_from([f"h{i}" for i in range(12)]), max_size=40)


@settings(max_examples=200, deadline=None)
@given(hashes, st.integers(0, 40), hashes)
def test_runs_rebuild_any_list_exactly(base: list[str], same: int, added: list[str]) -> None:
    same = min(same, len(base))
    assert rebuild(base, same, json.dumps(runs(base, added))) == base[:same] + added
    assert rebuild(base, same, json.dumps(added)) == base[:same] + added  # a list written before m013


def _forward(journal: Journal, rec: Any, attempt: int, sent: list[str], base: tuple[int, list[str]] | None,
             bodies: dict[str, bytes], decisions: tuple[dict[str, Any], ...] = ()) -> int:
    base_id, base_hashes = base or (rec.list_id, [])
    same = next((i for i, (a, b) in enumerate(zip(base_hashes, sent, strict=False)) if a != b),
                min(len(base_hashes), len(sent)))
    return journal.record_forward(ForwardRecord(
        rec.request_id, attempt, rec.session_id, "2026-01-01T00:00:00", content_hash(canonical_json({"model": "m"})),
        verbatim=False, length=len(sent), base_list_id=base_id, base_len=same, added_hashes=sent[same:],
        added_bodies=[bodies.get(h) for h in sent[same:]], decisions=decisions, base_hashes=base_hashes))


def test_a_forward_after_an_early_change_names_the_rest_of_its_base(store_location: Path | str) -> None:
    """A fold near the start of a 40-round history: the second forward re-adds none of the 78 messages after it."""
    journal = Journal(store_location)
    req = incoming(run(40)[-1])
    rec = record(journal, req)
    stub = canonical_json({"role": "user", "content": "[folded]"})
    first = list(req.hashes)
    first_id = _forward(journal, rec, 1, first, None, {})
    second = [*first[:2], content_hash(stub), *first[5:]]
    second_id = _forward(journal, rec, 2, second, (first_id, first), {content_hash(stub): stub})
    (added,) = journal.conn.execute("SELECT added FROM message_lists WHERE id = ?", [second_id]).fetchone()
    assert json.loads(added) == [content_hash(stub), [5, len(first) - 5]]
    assert journal.message_hashes(second_id) == second and journal.message_hashes(first_id) == first
    journal.close()


def test_a_decision_naming_its_forwarded_message_is_stored_once_and_read_back(store_location: Path | str) -> None:
    journal = Journal(store_location)
    req = incoming(run(3)[-1])
    rec = record(journal, req)
    text = "[overflow id=abc tool=sh bytes=9 call_id=c1 storage=disk]\nSpilled: é \u2028 \"quoted\"\n"
    stub = canonical_json({"role": "tool", "tool_call_id": "c1", "content": text})
    decision = {"kind": "spill", "target": "tool:c1", "message_hash": req.hashes[5], "replacement": text,
                "overflow_id": "abc", "until": "", "count": 0, "source": "auto"}
    sent = [*req.hashes[:5], content_hash(stub), *req.hashes[6:]]
    _forward(journal, rec, 1, sent, None, {content_hash(stub): stub},
             ({**decision, "replaced_by": content_hash(stub)}, {**decision, "target": "tool:c2"}))
    stored = journal.conn.execute("SELECT replacement, replaced_by FROM decisions ORDER BY id").fetchall()
    assert [tuple(r) for r in stored] == [("", content_hash(stub)), (text, None)]
    assert journal.decisions(rec.session_id) == [decision, {**decision, "target": "tool:c2"}]
    journal.close()


def _spilled_run(journal: Journal, session: str | None = None, texts: int = 3) -> Any:
    """A request whose forward replaced ``texts`` results with stubs, each decision naming its stub's message."""
    req = incoming(run(texts)[-1], session=session)
    rec = record(journal, req)
    sent, bodies, decisions = list(req.hashes), {}, []
    for k in range(texts):
        text = f"[overflow id=o{k} tool=sh bytes=9 call_id=c{k} storage=disk] {session}"
        stub = canonical_json({"role": "tool", "tool_call_id": f"c{k}", "content": text})
        sent[3 + 2 * k], bodies[content_hash(stub)] = content_hash(stub), stub
        decisions.append({"kind": "spill", "target": f"tool:c{k}", "message_hash": req.hashes[3 + 2 * k],
                          "replacement": text, "overflow_id": f"o{k}", "until": "", "count": 0, "source": "auto",
                          "replaced_by": content_hash(stub)})
    _forward(journal, rec, 1, sent, None, bodies, tuple(decisions))
    return rec


def test_the_texts_read_back_are_kept_for_the_next_load_within_their_bound(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    rec = _spilled_run(journal)
    first = journal.decisions(rec.session_id)
    assert len(journal.replaced_texts) == 3
    journal.replaced_texts.clear()
    journal.replaced_texts.max_chars = len(first[0]["replacement"]) * 2
    assert journal.decisions(rec.session_id) == first and len(journal.replaced_texts) == 2  # the oldest went
    with journal.conn:
        journal.conn.execute("DELETE FROM blobs WHERE kind = 'message' AND body LIKE '%[overflow id=%'")
    journal.replaced_texts.max_chars = 10**6
    kept = journal.decisions_upto(rec.session_id, None, after=int(journal.conn.execute(
        "SELECT MIN(id) FROM decisions").fetchone()[0]))
    assert [row for _, row in kept] == first[1:]  # the texts it kept, not looked up again (they are gone)
    journal.close()


def test_a_prune_and_a_forgotten_incognito_session_leave_no_text_kept(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    rec = _spilled_run(journal)
    journal.decisions(rec.session_id)
    journal.prune("2000-01-01T00:00:00")
    assert len(journal.replaced_texts) == 0
    journal.close()
    memory = MemoryJournal(10**9, 0.0)
    rec = _spilled_run(memory, session="private")
    memory.decisions(rec.session_id)
    assert len(memory.replaced_texts) == 3
    memory.keep_within_bound()
    assert list(memory.forgotten) == [rec.session_id] and len(memory.replaced_texts) == 0


def _shown(journal: Journal, rounds: int) -> tuple[Any, MirrorShown]:
    """A journaled request of ``rounds`` rounds, and a mirror showing its messages (their bodies journaled)."""
    req = incoming(run(rounds)[-1])
    return record(journal, req), MirrorShown(0, tuple(f"m{i}" for i in range(len(req.hashes))), tuple(req.hashes))


def _last_added(journal: Journal, column: str) -> list[Any]:
    (added,) = journal.conn.execute(f"SELECT l.added FROM session_state s JOIN message_lists l ON l.id = s.{column}"
                                    " ORDER BY s.id DESC LIMIT 1").fetchone()
    return list(json.loads(added))


def test_a_mirror_changed_early_names_the_later_entries_of_the_one_before(store_location: Path | str) -> None:
    """Issue #13: a mirror is journaled as what it shows, its messages' hashes and identities: a version with an
    early entry changed and one added names the rest as a run of the one before, and reads back as it was."""
    journal = Journal(store_location)
    rec, shown = _shown(journal, 15)
    changed = MirrorShown(0, (*shown.ids, "new"), (shown.hashes[0], shown.hashes[5], *shown.hashes[2:],
                                                     shown.hashes[1]))
    for k, version in enumerate([shown, changed]):
        record_session_state(journal, rec.session_id, rec.request_id, SessionState(mirror="m", mirror_shown=version),
                             f"2026-01-01T00:00:0{k}")
    assert len(_last_added(journal, "mirror_list")) == 3  # the changed hash, a run of the 29 after, the new one
    assert _last_added(journal, "mirror_ids") == ["new"]  # the identities only grew
    back = session_state(journal, rec.session_id).mirror_shown
    assert back == changed and back is not None
    assert set(back.bodies) == set(shown.hashes) and all(content_hash(b) == h for h, b in back.bodies.items())
    journal.close()


def test_a_mirror_stores_no_text_of_its_own(tmp_path: Path) -> None:
    """Issue #13: the request that turns the mirror on at 128k stored its ~600 entries as blobs, hashed, each time
    a version changed them (2.5-5.8 ms); now nothing but two lists, and the body of a message it shows that no
    forward stores, once."""
    journal = Journal(tmp_path / "journal.db")
    rec, shown = _shown(journal, 30)
    blobs = journal.conn.execute("SELECT COUNT(*) FROM blobs").fetchone()[0]
    record_session_state(journal, rec.session_id, rec.request_id, SessionState(mirror="m", mirror_shown=shown), "0")
    assert journal.conn.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == blobs
    unsent = canonical_json({"role": "assistant", "content": ""})
    filled = MirrorShown(0, (*shown.ids, "filled"), (*shown.hashes, content_hash(unsent)),
                         {content_hash(unsent): unsent})
    record_session_state(journal, rec.session_id, rec.request_id, SessionState(mirror="m", mirror_shown=filled), "1")
    assert journal.conn.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == blobs + 1
    back = session_state(journal, rec.session_id).mirror_shown
    assert back == filled and back is not None and back.bodies[content_hash(unsent)] == unsent
    journal.close()


def test_a_projection_journals_each_stub_once_and_a_restart_sends_the_same_bytes(tmp_path: Path) -> None:
    """Through the app: every spill's and elision's decision names its forwarded message, the text is not in the
    decisions table, and a new process over the journal continues the run byte for byte."""
    settings_ = settings_for(tmp_path, CTXPROXY_CTX_WINDOW="16384")
    first, second = CountingUpstream(window=16384), CountingUpstream(window=16384)
    bodies = list(requests_of(conversation(rounds=30)))
    with app_client(settings_, httpx.ASGITransport(app=first)) as c:
        for body in bodies[:25]:
            c.post("/v1/chat/completions", json=body)
    with app_client(settings_, httpx.ASGITransport(app=second)) as c:
        c.post("/v1/chat/completions", json=bodies[25])
    before, after = first.last_chat.json()["messages"], second.last_chat.json()["messages"]
    assert after[: len(before)] == before
    with sqlite3.connect(tmp_path / "data" / "journal.db") as db:
        rows = db.execute("SELECT d.kind, d.replacement, json_extract(b.body, '$.content') FROM decisions d"
                          " LEFT JOIN blobs b ON b.hash = d.replaced_by WHERE d.kind IN ('spill', 'elide')").fetchall()
    db.close()
    assert rows and all(replacement == "" and content.startswith("[overflow id=") for _, replacement, content in rows)
    assert {content for _, _, content in rows} <= _sent_contents(first) | _sent_contents(second)


def _sent_contents(upstream: CountingUpstream) -> set[str]:
    return {m["content"] for chat in upstream.chats for m in chat.json()["messages"] if isinstance(m["content"], str)}


def test_a_journal_written_before_reads_its_decisions_and_lists_as_they_are(tmp_path: Path) -> None:
    """tests/fixtures/journal_sqlite_utils.sql (older code's journal): its decisions keep their text, its lists
    their plain arrays; opening it rewrites neither."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.executescript((Path(__file__).parent / "fixtures" / "journal_sqlite_utils.sql").read_text())
        raw_decisions = conn.execute("SELECT replacement FROM decisions ORDER BY id").fetchall()
        raw_lists = conn.execute("SELECT id, base_id, base_len, added FROM message_lists ORDER BY id").fetchall()
    conn.close()
    journal = Journal(path)
    (session,) = journal.sessions()
    assert raw_decisions and [d["replacement"] for d in journal.decisions(session["id"])] == [
        r[0] for r in raw_decisions]
    assert journal.conn.execute("SELECT id, base_id, base_len, added FROM message_lists ORDER BY id"
                                ).fetchall() == raw_lists
    for list_id, base_id, base_len, added in raw_lists:
        base = [] if base_id is None else journal.message_hashes(base_id)
        assert journal.message_hashes(list_id) == base[:base_len] + json.loads(added)
    journal.close()


def _greedy_runs_of(base: list[str], added: list[str], out: list[str | list[int]]) -> bool:
    """Whether ``out`` is ``added`` written as the greedy walk writes it: each hash that stands in ``base`` starts a
    run at its first place there, as long as base and added agree; a run of two or more is ``[start, count]``, one
    of one the hash itself."""
    k = 0
    for item in out:
        first = base.index(added[k]) if added[k] in base else None
        count = 1
        while first is not None and k + count < len(added) and first + count < len(base) \
                and base[first + count] == added[k + count]:
            count += 1
        if item != ([first, count] if first is not None and count > 1 else added[k]):
            return False
        k += count
    return k == len(added)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([f"h{i}" for i in range(6)]), max_size=120), st.data())
def test_runs_are_the_ones_a_walk_hash_by_hash_finds(base: list[str], data: st.DataObject) -> None:
    """The stored text does not change: the same runs, at the same places, as the walk a hash at a time (long
    stretches of the base, shifted, cut, repeated, among hashes of its own)."""
    pieces = data.draw(st.lists(st.one_of(
        st.tuples(st.integers(0, max(len(base) - 1, 0)), st.integers(0, 60)).map(lambda r: base[r[0]:r[0] + r[1]]),
        st.lists(st.sampled_from(["h0", "h5", "x1", "x2"]), max_size=5)), max_size=8))
    added = [h for piece in pieces for h in piece]
    found = runs(base, added)
    assert found == added if len(added) < RUNS_FROM or not base else _greedy_runs_of(base, added, found)
