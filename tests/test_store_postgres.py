"""The journal in PostgreSQL (``--store postgresql://...``): what only it has, beyond the store suite run on both.

Several processes share one database: placement is serialised per session across connections (an advisory
lock), a prune by one is noticed by the others (``data_version``), each writer thread has its own connection, and a
database that cannot be used is one clear message naming the URL without its password.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from ctxproxy.config import load_settings
from ctxproxy.proxy.core import canonical_json, content_hash
from ctxproxy.proxy.errors import StorageFull, storage_error
from ctxproxy.store import (
    ForwardRecord,
    Journal,
    JournalUnavailable,
    JournalWriter,
    OverflowBody,
    ResponseRecord,
    open_journal,
)
from ctxproxy.store.failures import explain
from ctxproxy.store.locks import AdvisoryLocks
from ctxproxy.store.migrate import applied, pg_ddl
from ctxproxy.store.migrations import STEPS
from ctxproxy.store.sql import lock_key, pg_sql, redacted
from tests.conftest import app_client, chat
from tests.fakes import FakeUpstream
from tests.postgres import PostgresServer
from tests.test_journal import incoming, record, run


@pytest.fixture
def journal(postgres_url: str) -> Iterator[Journal]:
    journal = Journal(postgres_url)
    yield journal
    journal.close()


def test_the_proxy_journals_into_postgresql(postgres_url: str, tmp_path: Path, fake: FakeUpstream) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_STORE": postgres_url,
                                  "CTXPROXY_UPSTREAM": "http://upstream.test/v1"})
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        first = client.post("/v1/chat/completions", json=chat("hello"))
        second = client.post("/v1/chat/completions", json=chat("hello", "hi", "more"))
    assert first.status_code == second.status_code == 200
    assert first.headers["x-ctx-session"] == second.headers["x-ctx-session"]
    assert not (tmp_path / "data" / "journal.db").exists()  # nothing in the data dir: the journal is the database
    journal = Journal(postgres_url)
    (session,) = journal.sessions()
    assert session["requests"] == 2 and [r["outcome"] for r in journal.session_journal(session["id"])] == ["ok"] * 2
    journal.close()


def test_connections_placing_one_opening_at_once_never_interleave(postgres_url: str) -> None:
    """Eight replicas receive the first request of the same opening at the same moment: each places it after the
    previous one committed (the advisory lock), so each sees the others' sessions and opens its own (a parallel
    run: the others' requests are unanswered), rather than two creating the same session and one failing."""
    journals = [Journal(postgres_url) for _ in range(8)]
    start, placed, failed = threading.Barrier(len(journals)), [], []

    def place(journal: Journal) -> None:
        start.wait()
        try:
            placed.append(journal.record_request(incoming(run(0)[0])).session_id)
        except psycopg.Error as exc:
            failed.append(exc)

    threads = [threading.Thread(target=place, args=(j,)) for j in journals]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for j in journals:
        j.close()
    assert failed == [] and len(set(placed)) == len(journals)


def test_a_prune_by_another_process_is_noticed_by_each_writer(postgres_url: str) -> None:
    other = Journal(postgres_url)
    writer = JournalWriter(Journal(postgres_url))

    async def go() -> None:
        await writer.call(record, incoming(run(1)[-1]))
        before = writer.generation
        other.prune("9999")  # another process removes every session
        await writer.call(Journal.sessions)
        assert writer.generation == before + 1

    asyncio.run(go())
    writer.close()
    other.close()


def test_writer_threads_each_have_their_own_connection_and_all_are_closed(postgres_url: str) -> None:
    journal = Journal(postgres_url)
    writer = JournalWriter(journal)
    hold = threading.Barrier(4)

    def held(j: Journal) -> int:
        hold.wait(timeout=10)  # four calls at once: four threads, four journals
        return id(j.conn)

    async def go() -> set[int]:
        return set(await asyncio.gather(*(writer.call(held) for _ in range(4))))

    connections = asyncio.run(go())
    writer.close()
    assert len(connections) == 4 and id(journal.conn) in connections
    assert journal.conn.raw.closed  # type: ignore[attr-defined]


def test_an_answer_to_a_request_of_another_connection_is_seen_at_once(postgres_url: str) -> None:
    """Replica A journals a request, replica B its answer, A the next request: it continues the session."""
    a, b = Journal(postgres_url), Journal(postgres_url)
    steps = run(2)
    first = a.record_request(incoming(steps[0], n=0))
    b.record_response(ResponseRecord(first.request_id, 0, "ok", 200, "{}", None, 1.0, 2.0, "t"))
    second = a.record_request(incoming(steps[1], n=1))
    assert second.session_id == first.session_id and not second.forked
    a.close()
    b.close()


def test_an_unreachable_server_is_one_clear_message_without_the_password(postgres_server: PostgresServer) -> None:
    url = "postgresql://ctx:hunter2@127.0.0.1:1/journal"
    with pytest.raises(JournalUnavailable) as caught:
        open_journal(url, check=True)
    assert caught.value.kind == "unreachable" and "hunter2" not in caught.value.message
    assert "postgresql://ctx:***@127.0.0.1:1/journal" in caught.value.message and "pg_hba.conf" in caught.value.message


def test_a_missing_database_is_named_with_the_fix(postgres_server: PostgresServer) -> None:
    url = postgres_server.url_of("no_such_journal")
    with pytest.raises(JournalUnavailable) as caught:
        open_journal(url)
    assert caught.value.kind == "missing" and "createdb" in caught.value.message and url in caught.value.message


def test_a_read_only_server_is_refused_at_start(postgres_url: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {postgres_url.rpartition('/')[2]} SET default_transaction_read_only = on")
    with pytest.raises(JournalUnavailable) as caught:
        open_journal(postgres_url, check=True)
    assert caught.value.kind == "read_only" and "primary" in caught.value.message


def test_the_serve_command_names_a_store_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ctxproxy.proxy.commands.cli import main

    code = main(["sessions", "--data-dir", str(tmp_path), "--store", "postgresql://u:secret@127.0.0.1:1/j"])
    err = capsys.readouterr().err
    assert code == 2 and "postgresql://u:***@127.0.0.1:1/j" in err and "secret" not in err


def test_the_ddl_and_the_placeholders_translate_as_written() -> None:
    assert pg_ddl("id INTEGER PRIMARY KEY,\n n INTEGER NOT NULL, k REAL, b BLOB\n) WITHOUT ROWID;") == (
        "id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,\n n BIGINT NOT NULL, k DOUBLE PRECISION,"
        " b BYTEA\n);")
    assert pg_sql("SELECT '?', x FROM t WHERE a = ? AND b LIKE '5%' -- why?\n AND c = ?") == (
        "SELECT '?', x FROM t WHERE a = %s AND b LIKE '5%%' -- why?\n AND c = %s")
    assert redacted("postgresql://u:p@h:5432/d") == "postgresql://u:***@h:5432/d"
    assert redacted("postgresql://u@h/d") == "postgresql://u@h/d"
    assert lock_key("s") == lock_key("s") != lock_key("t") and -2 ** 63 <= lock_key("s") < 2 ** 63


def test_the_startup_line_names_the_database_without_its_password(tmp_path: Path) -> None:
    from ctxproxy.proxy.observe.logs import startup_line

    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_STORE": "postgresql://u:pw@db/j"})
    text, fields = startup_line(settings)
    assert "journal postgresql://u:***@db/j" in text and fields["store"] == "postgresql://u:***@db/j"
    assert "u:pw@" not in text


def _drop_connections(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
                      " AND pid <> pg_backend_pid()")


def test_a_connection_the_server_dropped_is_opened_again(postgres_url: str) -> None:
    """A connection that died (the server restarted, a failover, an idle timeout) fails the statement that meets
    it; the next one runs on a new connection. Behind the writer nobody sees it: its check for another process's
    prune, which runs first, meets the dead connection."""
    journal = Journal(postgres_url)
    first = record(journal, incoming(run(0)[0]))
    _drop_connections(postgres_url)
    with pytest.raises(psycopg.OperationalError):
        journal.sessions()
    assert record(journal, incoming(run(1)[1], n=1)).session_id == first.session_id
    writer = JournalWriter(journal)

    async def go() -> None:
        await writer.call(Journal.sessions)
        _drop_connections(postgres_url)
        assert (await writer.call(record, incoming(run(2)[2], n=2))).session_id == first.session_id

    asyncio.run(go())
    writer.close()


def test_a_full_disk_on_the_server_is_storage_full() -> None:
    """PostgreSQL's disk_full (SQLSTATE 53100) while serving is a 507, as SQLite's full disk is."""
    problem = explain(psycopg.errors.DiskFull("could not extend file: No space left on device"),
                      "postgresql://u:pw@db/j")
    assert problem.kind == "full" and isinstance(storage_error(problem), StorageFull)
    assert "postgresql://u:***@db/j" in problem.message and "pw@" not in problem.message


def _journal_a_day(journal: Journal) -> dict[str, Any]:
    """Two runs of one opening (a fork), answers with usage, a projected forward with a cut, a context op, an
    unanswered request: then every read the operator surface makes."""
    requests = run(4, result="x" * 50)
    recorded = []
    for i, msgs in enumerate(requests):
        rec = journal.record_request(incoming(msgs, n=i))
        journal.record_response(ResponseRecord(rec.request_id, 0, "ok", 200, "{}", {"prompt_tokens": 100 + i,
                                               "completion_tokens": 7}, 1.5, 9.25, f"2026-01-01T00:00:{i:02d}"))
        recorded.append(rec)
    last, stub = recorded[-1], {"role": "tool", "tool_call_id": "c0", "content": "[overflow id=abc]"}
    sent = [*requests[-1][:3], stub, *requests[-1][4:]]
    bodies = [canonical_json(m) for m in sent]
    decision = {"kind": "spill", "target": "tool:c0", "message_hash": "h", "replacement": "[overflow id=abc]",
                "overflow_id": "abc", "until": "", "count": 0, "source": "auto"}
    journal.record_forward(ForwardRecord(last.request_id, 0, last.session_id, "2026-01-01T00:01:00",
                                         incoming(requests[-1]).params_hash, verbatim=False, length=len(sent),
                                         base_list_id=recorded[2].list_id, base_len=3,
                                         added_hashes=[content_hash(b) for b in bodies[3:]], added_bodies=bodies[3:],
                                         decisions=[decision], overflow=[OverflowBody("abc", "x" * 50, "sh", "c0")],
                                         estimate=90, k=1.1, samples=2))
    journal.record_context_op({"session_id": last.session_id, "request_id": last.request_id, "round": 1,
                               "op": "pin", "ok": True, "arguments": "{}", "result": "ok", "handles": ["c0"],
                               "tokens_freed": 3, "overflow_ids": ["abc"], "created_at": "2026-01-01T00:01:01"})
    fork = journal.record_request(incoming([*requests[2][:3], {"role": "user", "content": "other"}], n=30))
    sid = last.session_id
    return {"sessions": journal.sessions(), "session": journal.session(sid), "journal": journal.session_journal(sid),
            "request": journal.request(last.request_id), "forward": journal.forward(last.request_id),
            "rounds": journal.session_rounds(sid), "cuts": journal.session_cuts(sid), "ops": journal.session_ops(sid),
            "by_request": journal.cuts_by_request(sid), "scorecard": journal.scorecard(),
            "decisions": journal.decisions(fork.session_id), "samples": journal.calibration_samples(sid, "m"),
            "body": journal.overflow_body("abc", sid), "head": journal.head_messages(fork.session_id),
            "children": journal.session_children(), "dry_prune": journal.prune("2026-01-01T00:00:03", dry_run=True),
            "interrupted": journal.mark_interrupted("2026-01-02T00:00:00"), "fork": fork}


def test_every_read_gives_the_same_answer_on_both_backends(tmp_path: Path, postgres_url: str) -> None:
    """Same calls, same answers, value for value and type for type: SQLite and PostgreSQL are one store."""
    lite, pg = Journal(tmp_path / "j.db"), Journal(postgres_url)
    expected, got = _journal_a_day(lite), _journal_a_day(pg)
    lite.close()
    pg.close()
    assert got["scorecard"] and got["decisions"] and got["samples"] and got["interrupted"] == 1
    # the process that journaled the request: recorded on a shared store only (``store.liveness``)
    assert (expected["request"].pop("instance"), got["request"].pop("instance")) == (None, pg.instance)
    for key, value in expected.items():
        assert got[key] == value, key
        assert json.dumps(got[key], default=repr) == json.dumps(value, default=repr), key  # no Decimal, no bool


def test_the_reading_commands_and_prune_work_on_the_database(postgres_url: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ctxproxy.proxy.commands.cli import main

    journal = Journal(postgres_url)
    session = record(journal, incoming(run(1)[-1])).session_id
    journal.close()
    store = ["--data-dir", str(tmp_path), "--store", postgres_url]
    assert main(["sessions", "--json", *store]) == 0
    assert json.loads(capsys.readouterr().out)["sessions"][0]["id"] == session
    assert main(["show", session, *store]) == 0 and main(["scorecard", *store]) == 0
    assert main(["prune", "--older-than", "1d", "--vacuum", *store]) == 0
    assert f"{session}\nRemoved 1 sessions" in capsys.readouterr().out
    assert not (tmp_path / "journal.db").exists()


def test_replicas_starting_together_on_a_new_database_apply_each_step_once(postgres_server: PostgresServer) -> None:
    url = postgres_server.empty_database()
    start, opened, failed = threading.Barrier(4), [], []

    def open_it() -> None:
        start.wait()
        try:
            opened.append(Journal(url))
        except psycopg.Error as exc:
            failed.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == [] and len(opened) == 4
    assert applied(opened[0].conn) == [name for name, _ in STEPS]  # each once: the names are unique
    for journal in opened:
        journal.close()
    postgres_server.drop(url)


def test_the_doctor_checks_the_journals_database(postgres_url: str, tmp_path: Path) -> None:
    from ctxproxy.proxy.commands.doctor import run_checks

    def check(store: str) -> Any:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_STORE": store,
                                      "CTXPROXY_UPSTREAM": "http://127.0.0.1:1/v1"})
        return next(c for c in run_checks(settings) if c.name == "journal database")

    assert check(postgres_url).ok
    refused = check("postgresql://u:pw@127.0.0.1:1/j")
    assert not refused.ok and "postgresql://u:***@127.0.0.1:1/j cannot be reached" in refused.detail


def test_an_answer_handed_in_before_the_next_request_is_journaled_before_it(postgres_url: str) -> None:
    """The writer's threads run calls side by side; the answer to a session's request, handed in before the
    session's next request (a non-streamed answer is journaled after the client has it), is committed before that
    request is placed, else the next request finds its head unanswered and forks a parallel run. The answer is
    held back here by a lock on its table, taken by another connection."""
    writer = JournalWriter(Journal(postgres_url))
    steps = run(1)

    async def go() -> None:
        first = await writer.call(Journal.record_request, incoming(steps[0], n=0))
        with psycopg.connect(postgres_url) as blocker:
            blocker.execute("LOCK TABLE responses IN SHARE MODE")  # inserts wait, reads do not
            async with asyncio.TaskGroup() as tasks:
                answer = tasks.create_task(writer.call(Journal.record_response, ResponseRecord(
                    first.request_id, 0, "ok", 200, "{}", None, 1.0, 2.0, "t")))
                await asyncio.sleep(0.2)
                following = tasks.create_task(writer.call(Journal.record_request, incoming(steps[1], n=1)))
                await asyncio.sleep(0.3)
                blocker.rollback()
        answer.result()
        placed = following.result()
        assert placed.session_id == first.session_id and not placed.forked

    asyncio.run(go())
    writer.close()


@pytest.mark.parametrize(("error", "kind", "words"), [
    (psycopg.OperationalError('connection failed: FATAL:  password authentication failed for user "ctx"'), "refused",
     "pg_hba.conf"),
    (psycopg.OperationalError('connection failed: FATAL:  no pg_hba.conf entry for host "10.0.0.7"'), "refused",
     "~/.pgpass"),
    (psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction"), "read_only",
     "primary"),
    (psycopg.errors.DataCorrupted("invalid page in block 7"), "corrupt", "pg_restore"),
    (psycopg.errors.UndefinedTable('relation "x" does not exist'), "unavailable", "its log"),
])
def test_each_postgresql_failure_names_its_fix(error: Exception, kind: str, words: str) -> None:
    """By SQLSTATE when the server sent one; by libpq's words for a connection that never opened (none)."""
    problem = explain(error, "postgresql://ctx:hunter2@db:5432/journal")
    assert problem.kind == kind and words in problem.message and "hunter2" not in problem.message


def _resend_after(postgres_url: str, hold_liveness: bool) -> tuple[str, str, list[str]]:
    """A fingerprint session's request journaled by another process, left unanswered, then sent again here: the
    two sessions, and the unanswered request's outcomes. ``hold_liveness``: that process still lives."""
    messages = run(2)
    other, here = Journal(postgres_url), Journal(postgres_url)
    other.instance = "another-replica"  # its liveness lock: held below, or free (the process is gone)
    holder = AdvisoryLocks(postgres_url, instance="another-replica")
    try:
        if hold_liveness:
            holder.start()
        session = record(other, incoming(messages[1], n=1)).session_id
        cut = other.record_request(incoming(messages[2], n=2))  # the request the process never answered
        resent = here.record_request(incoming(messages[2], n=3))  # the agent sends it again, to this replica
        outcomes = [str(r["outcome"]) for r in (here.request(cut.request_id) or {"responses": []})["responses"]]
    finally:
        holder.close()
        other.close()
        here.close()
    return session, resent.session_id, outcomes


def test_the_resend_of_a_dead_replicas_request_continues_its_session(postgres_url: str) -> None:
    """A replica SIGKILLed mid-request leaves its request unanswered, and the session's head looks in flight: the
    agent's resend, matched by fingerprint, was taken for a parallel run and forked into ``-2``. Its process no
    longer holds its liveness lock (``store.liveness``): placement journals the request ``interrupted`` and the
    resend continues the session."""
    session, resent, outcomes = _resend_after(postgres_url, hold_liveness=False)
    assert resent == session
    assert outcomes == ["interrupted"]


def test_the_same_request_while_its_replica_lives_is_a_parallel_run(postgres_url: str) -> None:
    """The other process lives (it holds its liveness lock): its request is in flight, and the same messages sent
    meanwhile are another run of the agent, in a session of their own, as before."""
    session, resent, outcomes = _resend_after(postgres_url, hold_liveness=True)
    assert resent == f"{session}-2"
    assert outcomes == []
