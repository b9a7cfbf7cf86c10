"""The journal in PostgreSQL (``--store postgresql://...``): what only it has, beyond the store suite run on both.

Several processes share one database: placement is serialised per session across connections (an advisory
lock), a prune by one is noticed by the others (``data_version``), each writer thread has its own connection, and a
database that cannot be used is one clear message naming the URL without its password.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from ctxproxy.config import load_settings
from ctxproxy.store import Journal, JournalUnavailable, JournalWriter, ResponseRecord, open_journal
from ctxproxy.store.migrate import pg_ddl
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
