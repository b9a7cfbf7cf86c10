"""The journal: content-addressed, delta-encoded, append-only, and the session chain that tells runs apart."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxproxy.proxy.core import canonical_json, content_hash, fingerprint
from ctxproxy.proxy.upstream.endpoint import redact
from ctxproxy.store import (
    ForwardRecord,
    IncomingRequest,
    Journal,
    OverflowBody,
    RecordedRequest,
    ResponseRecord,
    keep_response,
    kept_response,
    placement,
)
from ctxproxy.store.migrate import applied
from ctxproxy.store.migrations import STEPS


def incoming(messages: Sequence[dict[str, Any]], session: str | None = None, n: int = 0,
             headers: dict[str, str | None] | None = None) -> IncomingRequest:
    bodies = [canonical_json(m) for m in messages]
    params = canonical_json({"model": "m"})
    return IncomingRequest(f"2026-01-01T00:00:{n:02d}", "/v1/chat/completions", "m", False, session,
                           fingerprint(messages), [content_hash(b) for b in bodies], bodies, content_hash(params),
                           params, headers or {}, 100)


def record(journal: Journal, req: IncomingRequest) -> RecordedRequest:
    """Journal a request and its answer, as the proxy does before the next request of a run can exist."""
    rec = journal.record_request(req)
    journal.record_response(ResponseRecord(rec.request_id, 0, "ok", 200, "{}", None, 1.0, 2.0, req.received_at))
    return rec


def run(n_rounds: int, opening: str = "fix the bug", result: str = "output") -> list[list[dict[str, Any]]]:
    """The requests an agent sends: each carries the whole history so far."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": opening}]
    out = [list(msgs)]
    for k in range(n_rounds):
        msgs += [{"role": "assistant", "content": None,
                  "tool_calls": [{"id": f"c{k}", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": f"c{k}", "content": f"{result} {k}"}]
        out.append(list(msgs))
    return out


@pytest.fixture
def journal(store_location: Path | str) -> Iterator[Journal]:
    """On SQLite, then on PostgreSQL."""
    journal = Journal(store_location)
    yield journal
    journal.close()


def test_a_growing_run_is_one_session(journal: Journal) -> None:
    ids = {record(journal, incoming(msgs, n=i)).session_id for i, msgs in enumerate(run(5))}
    assert len(ids) == 1
    (row,) = journal.sessions()
    assert row["requests"] == 6 and row["messages"] == 12


def test_messages_are_stored_once_and_lists_only_add_the_new(journal: Journal) -> None:
    requests = run(30)
    for i, msgs in enumerate(requests):
        recorded = record(journal, incoming(msgs, n=i))
        assert recorded.new_messages == 2
    blobs = journal.conn.execute("SELECT COUNT(*) FROM blobs WHERE kind = 'message'").fetchone()[0]
    added = journal.conn.execute("SELECT SUM(json_array_length(added)) FROM message_lists").fetchone()[0]
    assert blobs == len(requests[-1]) == added  # O(total messages), not O(rounds²)


def test_a_request_rebuilds_byte_for_byte(journal: Journal) -> None:
    requests = run(4)
    recorded = [record(journal, incoming(m, n=i)) for i, m in enumerate(requests)]
    for rec, msgs in zip(recorded, requests, strict=True):
        assert journal.request(rec.request_id)["messages"] == msgs  # type: ignore[index]


def test_a_second_run_with_the_same_opening_becomes_a_child(journal: Journal) -> None:
    first = [record(journal, incoming(m, n=i)) for i, m in enumerate(run(3))]
    second = record(journal, incoming(run(3, result="other")[1], n=10))
    assert second.session_id != first[0].session_id
    assert second.forked and second.parent_id == first[0].session_id
    child = journal.session(second.session_id)
    assert child is not None and child["shared_len"] == 3  # system, user, the identical first call


def test_an_agent_that_edits_its_history_forks(journal: Journal) -> None:
    requests = run(3)
    for i, m in enumerate(requests):
        record(journal, incoming(m, n=i))
    edited = [dict(m) for m in requests[-1]]
    edited[3] = {"role": "tool", "tool_call_id": "c0", "content": "trimmed by the agent"}
    rec = record(journal, incoming(edited, n=9))
    assert rec.forked and rec.new_messages == len(edited) - 3
    assert journal.request(rec.request_id)["messages"] == edited  # type: ignore[index]


def test_a_retry_of_the_same_request_stays_in_the_session(journal: Journal) -> None:
    msgs = run(2)[-1]
    a = record(journal, incoming(msgs, n=1))
    b = record(journal, incoming(msgs, n=2))
    assert a.session_id == b.session_id and b.new_messages == 0


def test_runs_in_parallel_with_the_same_opening_get_their_own_sessions(journal: Journal) -> None:
    opening = run(0)[0]
    sessions = {journal.record_request(incoming(opening, n=i)).session_id for i in range(4)}  # none answered yet
    assert len(sessions) == 4


def test_two_runs_replaying_the_same_first_steps_never_swap_sessions(journal: Journal) -> None:
    a_steps, b_steps = run(4, result="same"), run(4, result="same")
    a = [record(journal, incoming(m, n=i)).session_id for i, m in enumerate(a_steps[:3])]
    b = [record(journal, incoming(m, n=10 + i)).session_id for i, m in enumerate(b_steps[:3])]
    assert len(set(a)) == 1 and set(b).isdisjoint(a) and len(set(b)) == 1


def test_a_new_run_skips_the_ids_that_sessions_named_so_hold(journal: Journal) -> None:
    opening = run(0)[0]
    stem = f"s-{fingerprint(opening)[:12]}"
    first = journal.record_request(incoming(opening, n=1))  # not answered yet: the next run is a parallel one
    taken = record(journal, incoming(run(1, opening="other task")[-1], session=f"{stem}-2", n=2))
    third = journal.record_request(incoming(opening, n=3))  # a parallel run: the next free number
    assert (first.session_id, taken.session_id, third.session_id) == (stem, f"{stem}-2", f"{stem}-3")
    assert journal.session(f"{stem}-2")["named"] and third.parent_id == stem  # type: ignore[index]


def test_a_named_session_wins_over_the_fingerprint(journal: Journal) -> None:
    a = record(journal, incoming(run(1)[-1], session="agent-7"))
    b = record(journal, incoming(run(1, opening="other task")[-1], session="agent-7", n=1))
    assert a.session_id == b.session_id == "agent-7"
    assert not b.forked


def test_credentials_are_never_stored(tmp_path: Path) -> None:
    raw_headers = [(b"Authorization", b"Bearer sk-secret-1"), (b"x-api-key", b"k-secret-2"),
                   (b"Cookie", b"sid=secret-3"), (b"User-Agent", b"OpenAI/Python")]
    journal = Journal(tmp_path / "j.db")
    rec = journal.record_request(incoming(run(0)[0], headers=redact(raw_headers)))
    journal.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert b"secret" not in raw
    row = Journal(tmp_path / "j.db").request(rec.request_id)
    assert row is not None
    assert row["headers"] == {"authorization": None, "x-api-key": None, "cookie": None, "user-agent": "OpenAI/Python"}


def test_responses_keep_usage_and_timings(journal: Journal) -> None:
    rec = journal.record_request(incoming(run(0)[0]))
    journal.record_response(ResponseRecord(rec.request_id, 0, "ok", 200, "{}", {"prompt_tokens": 12,
                                           "completion_tokens": 3}, 1.5, 9.0, "2026-01-01T00:00:01"))
    (entry,) = journal.session_journal(rec.session_id)
    assert (entry["prompt_tokens"], entry["completion_tokens"], entry["ttfb_ms"]) == (12, 3, 1.5)
    assert journal.sessions()[0]["last_prompt_tokens"] == 12


def test_a_usage_orjson_refuses_is_kept_whole(journal: Journal) -> None:
    """Usage is written by orjson, which refuses an integer past 64 bits (one a stdlib parse of an answer keeps):
    the stdlib writes that one, and the row and its usage are kept."""
    rec = journal.record_request(incoming(run(0)[0]))
    usage = {"prompt_tokens": 12, "extra": {"huge": 2 ** 70}}
    journal.record_response(ResponseRecord(rec.request_id, 0, "ok", 200, "{}", usage, 1.5, 9.0, "2026-01-01T00:00:01"))
    (stored,) = journal.conn.execute("SELECT usage FROM responses").fetchone()
    assert json.loads(stored) == usage and journal.session_journal(rec.session_id)[0]["prompt_tokens"] == 12


def test_migrating_twice_is_a_noop(store_location: Path | str) -> None:
    Journal(store_location).close()
    journal = Journal(store_location)
    assert applied(journal.conn) == [name for name, _ in STEPS] == [
        "m001_journal", "m002_decisions_and_overflow", "m003_context_ops", "m004_request_turns",
        "m005_session_state", "m006_prefix_index", "m007_overflow_spans_and_mirror_lists",
        "m008_kept_responses", "m009_postgres", "m010_session_claims", "m011_postgres_foreign_key_indexes",
        "m012_request_instances", "m013_decisions_by_reference_and_list_runs",
            "m014_sessions_by_opening", "m015_mirrors_as_what_they_show"]
    journal.close()


def test_a_journal_written_before_the_runner_opens_without_running_a_step_again(tmp_path: Path) -> None:
    """tests/fixtures/journal_sqlite_utils.sql: a journal main's code wrote (its steps recorded by sqlite-utils'
    Migrations in ``_sqlite_migrations``): a run of 4 requests with a cut. Running m001 again would fail (its
    tables exist); the names are carried over with their times, and the run goes on where it was."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.executescript((Path(__file__).parent / "fixtures" / "journal_sqlite_utils.sql").read_text())
    conn.close()
    journal = Journal(path)
    legacy = journal.conn.execute("SELECT name, applied_at FROM _sqlite_migrations ORDER BY id").fetchall()
    carried = journal.conn.execute("SELECT name, applied_at FROM schema_migrations ORDER BY id").fetchall()
    assert carried[:8] == legacy and applied(journal.conn) == [name for name, _ in STEPS]
    (session,) = journal.sessions()
    assert session["requests"] == 4 and journal.overflow_body("oid-1", session["id"])["body"] == "the cut body"  # type: ignore[index]
    rec = record(journal, incoming(run(4)[-1], n=9))
    assert rec.session_id == session["id"] and not rec.forked and rec.new_messages == 2
    journal.close()


def test_in_memory_journal_writes_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    journal = Journal(None)
    journal.record_request(incoming(run(1)[-1]))
    assert list(tmp_path.iterdir()) == []


def test_the_journal_file_is_in_wal_mode(tmp_path: Path) -> None:
    assert Journal(tmp_path / "j.db").conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# Each step of a history: extend it by some messages, or cut it back (an edit) and extend.
steps = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(steps)
def test_any_sequence_of_extensions_and_edits_rebuilds_exactly(plan: list[tuple[int, int]]) -> None:
    journal = Journal(None)
    history: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    serial = 0
    for cut, grow in plan:
        history = history[: max(2, len(history) - cut)]
        for _ in range(grow):
            serial += 1
            history.append({"role": "user" if serial % 2 else "assistant", "content": f"m{serial}"})
        rec = journal.record_request(incoming(history, n=serial % 60))
        row = journal.request(rec.request_id)
        assert row is not None and row["messages"] == history
        assert json.loads(json.dumps(row["messages"])) == history


def test_a_kept_response_is_read_back_and_kept_once(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    items = [{"type": "message", "role": "user", "content": "héllo"}]
    keep_response(journal, "resp_1", items, "2026-01-01T00:00:00")
    keep_response(journal, "resp_1", [], "2026-01-01T00:00:01")
    assert kept_response(journal, "resp_1") == items
    assert kept_response(journal, "resp_2") is None


def test_a_prune_removes_the_kept_responses_made_before_its_cutoff(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    keep_response(journal, "resp_old", [], "2026-01-01T00:00:00")
    keep_response(journal, "resp_new", [], "2026-03-01T00:00:00")
    journal.prune("2026-02-01T00:00:00")
    assert kept_response(journal, "resp_old") is None and kept_response(journal, "resp_new") == []


# --- the inspector's reads (store.inspect) -------------------------------------------------------------------------

def test_the_inspector_reads_what_went_upstream_and_what_was_cut(journal: Journal) -> None:
    requests = run(3, result="x" * 50)
    recorded = [record(journal, incoming(msgs, n=i)) for i, msgs in enumerate(requests)]
    for rec, req in zip(recorded[:3], requests[:3], strict=True):
        journal.record_forward(ForwardRecord(rec.request_id, 0, rec.session_id, "2026-01-01T00:01:00",
                                             incoming(req).params_hash, verbatim=True, estimate=10, k=1.0))
    last, stub = recorded[3], {"role": "tool", "tool_call_id": "c0", "content": "[overflow id=abc]"}
    sent = [*requests[3][:3], stub, *requests[3][4:]]
    bodies = [canonical_json(m) for m in sent]
    decision = {"kind": "spill", "target": "tool:c0", "message_hash": "h", "replacement": "[overflow id=abc]",
                "overflow_id": "abc", "until": "", "count": 0, "source": "auto"}
    journal.record_forward(ForwardRecord(last.request_id, 0, last.session_id, "2026-01-01T00:01:00",
                                         incoming(requests[3]).params_hash, verbatim=False, length=len(sent),
                                         base_list_id=recorded[2].list_id, base_len=3,
                                         added_hashes=[content_hash(b) for b in bodies[3:]],
                                         added_bodies=bodies[3:], decisions=[decision],
                                         overflow=[OverflowBody("abc", "x" * 50 + " 0", "sh", "c0")]))
    journal.record_context_op({"session_id": last.session_id, "request_id": last.request_id, "round": 1,
                               "op": "status", "ok": True, "arguments": "{}", "result": "ok", "handles": ["c0"],
                               "tokens_freed": 0, "overflow_ids": [], "created_at": "2026-01-01T00:01:01"})

    forward = journal.forward(last.request_id)
    assert forward is not None and forward["body"]["messages"] == sent and forward["body"]["model"] == "m"
    assert forward["attempts"] == [0] and not forward["verbatim"]
    assert journal.forward(last.request_id, attempt=1) is None
    rounds = journal.session_rounds(last.session_id)
    assert [r["request_id"] for r in rounds] == [r.request_id for r in recorded]
    assert [len(r["hashes"]) for r in rounds] == [2, 4, 6, 8] and rounds[3]["sent_hashes"][3] != rounds[3]["hashes"][3]
    assert journal.session_rounds(last.session_id, tail=1)[0]["sent_hashes"] == rounds[3]["sent_hashes"]
    (cut,) = journal.session_cuts(last.session_id)
    assert (cut["kind"], cut["overflow_id"], cut["tool"], cut["bytes"], cut["request_id"]) == (
        "spill", "abc", "sh", 52, last.request_id)
    (op,) = journal.session_ops(last.session_id)
    assert op["ok"] is True and op["handles"] == ["c0"]
    child = record(journal, incoming([*requests[2][:3], {"role": "user", "content": "another way"}], n=9))
    assert journal.session_children() == {last.session_id: [child.session_id]}


def test_cuts_are_counted_per_request_by_kind(journal: Journal) -> None:
    req = incoming(run(1)[0])
    first = record(journal, req)
    spill = {"kind": "spill", "target": "tool:a", "message_hash": "h", "replacement": "stub", "overflow_id": "o",
             "until": "", "count": 0, "source": "auto"}
    journal.record_forward(ForwardRecord(first.request_id, 0, first.session_id, "2026-01-01T00:00:01", req.params_hash,
                                         verbatim=True, decisions=[spill, spill | {"target": "tool:b"},
                                                                   spill | {"kind": "elide", "target": "tool:c"}]))
    assert journal.cuts_by_request(first.session_id) == {first.request_id: {"elide": 1, "spill": 2}}
    assert journal.cuts_by_request("s-none") == {}


def test_nul_and_every_other_character_are_kept_exactly(journal: Journal) -> None:
    """A tool result may hold NUL (a binary file printed): PostgreSQL's text cannot, so it crosses escaped
    (``store.pgtext``), and what is read back is what was written, the escape character itself included."""
    odd = "bin\x00ary \ue000 \ue0000 \ue0001 \ue000\ue000 \x00\x00 é"
    rec = record(journal, incoming([{"role": "user", "content": odd}]))
    cut = {"kind": "spill", "target": "tool:c0", "message_hash": odd, "replacement": f"[cut {odd}]",
           "overflow_id": "o1", "until": "", "count": 0, "source": "auto"}
    journal.add_decisions(rec.session_id, [cut], "t", overflow=[OverflowBody("o1", odd, "sh", "c0")])
    journal.record_context_op({"session_id": rec.session_id, "request_id": rec.request_id, "round": 1, "op": "note",
                               "ok": True, "arguments": odd, "result": odd, "handles": [odd], "tokens_freed": 0,
                               "overflow_ids": [], "created_at": "t"})
    body = journal.overflow_body("o1", rec.session_id)
    assert body is not None and body["body"] == odd and body["bytes"] == len(odd.encode())
    assert journal.decisions(rec.session_id)[0]["replacement"] == f"[cut {odd}]"
    (op,) = journal.session_ops(rec.session_id)
    assert op["result"] == op["arguments"] == odd and op["handles"] == [odd]
    assert journal.head_messages(rec.session_id) == [{"role": "user", "content": odd}]


def test_a_read_after_the_request_that_fails_leaves_the_request_journaled(journal: Journal) -> None:
    """``record_request_and_read``: the request row is committed first; a failed read gives None (the caller reads
    again), never a lost row."""
    def failing(_: Journal, __: RecordedRequest) -> None:
        raise journal.conn.OperationalError("no such table: nowhere")

    rec, read = journal.record_request_and_read(incoming(run(1)[1]), failing)
    assert read is None and journal.request(rec.request_id) is not None


def test_interrupted_sessions_are_kept_for_a_bounded_number_of_openings(journal: Journal,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "OPENINGS_KEPT", 2)
    first = {}
    for opening in ("a", "b", "c"):
        first[opening] = record(journal, incoming(run(1, opening=opening)[0]))
        journal.record_request(incoming(run(1, opening=opening)[1], n=1))  # in flight when the proxy dies
    journal.mark_interrupted("2026-01-02T00:00:00")
    for n, opening in enumerate(("a", "b", "c")):  # "c" pushes "a" out
        retry = [*run(0, opening=opening)[0], {"role": "user", "content": f"again {n}"}]
        rec = record(journal, incoming(retry, n=2 + n))
        assert rec.session_id == first[opening].session_id and len(journal.interrupted) <= 2
