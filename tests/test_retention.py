"""Retention: ``prune`` removes idle sessions and what only they referred to, never what a remaining session
still needs (issue #10: "a restored stub still restores after a prune")."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxproxy.config import load_settings
from ctxproxy.proxy.commands.cli import main
from ctxproxy.store import Journal, OverflowBody, SessionState, record_session_state, session_state
from tests.conftest import app_client
from tests.fakes import FakeUpstream
from tests.test_journal import incoming, record, run

CUT = {"kind": "spill", "target": "tool:c0", "message_hash": "", "replacement": "[overflow]", "until": "", "count": 0,
       "source": "auto"}


@pytest.fixture
def journal(store_location: Path | str) -> Iterator[Journal]:
    """On SQLite, then on PostgreSQL."""
    journal = Journal(store_location)
    yield journal
    journal.close()


def _cut(journal: Journal, session: str, body: str, at: str) -> str:
    oid = f"oid-{abs(hash(body))}"
    journal.add_decisions(session, [CUT | {"overflow_id": oid}], at, overflow=[OverflowBody(oid, body, "sh", "c0")])
    return oid


def _runs(journal: Journal) -> dict[str, Any]:
    """An old run with its own cut and one shared with a new run; an old parent whose forked child is new."""
    old = [record(journal, incoming(m, n=i)) for i, m in enumerate(run(2, opening="old task"))][-1].session_id
    parent = [record(journal, incoming(m, n=10 + i)) for i, m in enumerate(run(2, opening="forked task"))]
    inherited = _cut(journal, parent[-1].session_id, "the parent's cut body", "2026-01-01T00:00:12")
    edited = [*run(1, opening="forked task")[1][:3], {"role": "tool", "tool_call_id": "c0", "content": "edited"}]
    child = record(journal, incoming(edited, n=40))
    assert child.forked and child.parent_id == parent[-1].session_id
    new = record(journal, incoming(run(1, opening="new task")[-1], n=41)).session_id
    shared = _cut(journal, old, "a body both runs cut", "2026-01-01T00:00:05")
    assert _cut(journal, new, "a body both runs cut", "2026-01-01T00:00:41") == shared
    return {"old": old, "old_only": _cut(journal, old, "only the old run cut this", "2026-01-01T00:00:05"),
            "parent": parent[-1].session_id, "child": child.session_id, "inherited": inherited, "new": new,
            "shared": shared, "kept_requests": [child.request_id, parent[0].request_id]}


def test_prune_removes_idle_sessions_and_only_what_nothing_else_refers_to(journal: Journal) -> None:
    ids = _runs(journal)
    kept = {r: journal.request(r) for r in ids["kept_requests"]}
    report = journal.prune("2026-01-01T00:00:30")
    assert report.sessions == [ids["old"]] and report.kept_for_children == 1 and report.requests == 3
    assert report.lists == 3
    assert {s["id"] for s in journal.sessions()} == {ids["parent"], ids["child"], ids["new"]}
    assert journal.overflow_body(ids["old_only"]) is None and report.blobs >= 1
    assert journal.overflow_body(ids["shared"], ids["new"])["body"] == "a body both runs cut"  # type: ignore[index]
    restored = journal.overflow_body(ids["inherited"], ids["child"])  # the child restores its parent's cut
    assert restored is not None and restored["body"] == "the parent's cut body"
    assert [d["overflow_id"] for d in journal.decisions(ids["child"])] == [ids["inherited"]]
    assert {r: journal.request(r) for r in ids["kept_requests"]} == kept  # rebuilt byte for byte
    assert journal.integrity_problems() == []
    journal.conn.check_foreign_keys()


def test_a_dry_run_reports_exactly_what_a_prune_removes_and_changes_nothing(journal: Journal) -> None:
    _runs(journal)
    counts = ("SELECT (SELECT COUNT(*) FROM blobs), (SELECT COUNT(*) FROM message_lists),"
              " (SELECT COUNT(*) FROM requests)")
    before = journal.conn.execute(counts).fetchone()
    dry = journal.prune("2026-01-01T00:00:30", dry_run=True)
    assert journal.conn.execute(counts).fetchone() == before
    real = journal.prune("2026-01-01T00:00:30")
    assert (dry.sessions, dry.requests, dry.lists, dry.blobs, dry.blob_chars) == \
        (real.sessions, real.requests, real.lists, real.blobs, real.blob_chars) and dry.dry_run and not real.dry_run
    after = journal.conn.execute(counts).fetchone()
    assert before[0] - after[0] == real.blobs and before[2] - after[2] == real.requests


def test_prune_removes_the_working_state_of_what_it_removes_and_keeps_the_rest(journal: Journal) -> None:
    ids = _runs(journal)
    mirror = {"old": '{"messages": [{"id": "a", "content": "old"}]}', "new": '{"messages": []}'}
    for name in ("old", "new"):
        request = journal.session_journal(ids[name])[-1]["request_id"]
        record_session_state(journal, ids[name], request, SessionState("user:t", None, ("applied",), f"/{name}",
                                                                      mirror[name]), "2026-01-01T00:00:50")
    journal.prune("2026-01-01T00:00:30")
    assert session_state(journal, ids["old"]) == SessionState()
    assert session_state(journal, ids["new"]) == SessionState("user:t", None, ("applied",), "/new", mirror["new"])
    mirrors = [r[0] for r in journal.conn.execute("SELECT body FROM blobs WHERE kind = 'mirror' AND chars > 0")]
    assert mirrors == [mirror["new"]]  # the pruned session's mirror went; the kept one's pieces stayed
    journal.conn.check_foreign_keys()


def test_pruning_everything_then_vacuum_leaves_an_empty_working_journal(journal: Journal) -> None:
    _runs(journal)
    report = journal.prune("2027-01-01T00:00:00")
    journal.vacuum()
    assert len(report.sessions) == 4 and journal.sessions() == [] and report.lists > 0
    assert journal.conn.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == 0
    record(journal, incoming(run(1)[-1], n=1))  # and it takes requests again


def _spilling_messages(opening: str) -> list[dict[str, Any]]:
    big = f"{opening}: line of output\n" * 2000
    return [{"role": "system", "content": "sys"}, {"role": "user", "content": opening},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": big}]


def _spilling(client: Any, opening: str) -> tuple[str, str]:
    """A request whose tool result spills on arrival: its session and the stub's overflow id."""
    messages = _spilling_messages(opening)
    answer = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert answer.status_code == 200
    journal = Journal(Path(client.app_state_dir) / "journal.db")
    try:
        (oid,) = [d["overflow_id"] for d in journal.decisions(answer.headers["x-ctx-session"])]
    finally:
        journal.close()
    return answer.headers["x-ctx-session"], oid


def test_ctxproxy_prune_while_serving_keeps_the_stubs_of_the_remaining_sessions_restorable(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(data), "CTXPROXY_UPSTREAM": "http://u.test/v1"})
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as client:
        client.app_state_dir = str(data)  # type: ignore[attr-defined]
        old, old_oid = _spilling(client, "an old task")
        time.sleep(4)  # the old session is then idle for longer than the 2 s the prune asks for
        new, new_oid = _spilling(client, "a new task")
        assert main(["prune", "--older-than", "2s", "--dry-run", "--data-dir", str(data)]) == 0
        assert capsys.readouterr().out.startswith(f"{old}\nWould remove 1 sessions")
        assert client.get(f"/ctx/overflow/{old_oid}").status_code == 200  # a dry run changes nothing
        assert main(["prune", "--older-than", "2s", "--json", "--data-dir", str(data)]) == 0
        assert json.loads(capsys.readouterr().out)["sessions"] == [old]
        assert client.get(f"/ctx/sessions/{new}/overflow/{new_oid}").content.startswith(b"a new task: line")
        assert client.get(f"/ctx/overflow/{new_oid}").status_code == 200
        assert client.get(f"/ctx/overflow/{old_oid}").status_code == 404
        assert client.get(f"/ctx/sessions/{old}").status_code == 404
    assert main(["sessions", "--json", "--data-dir", str(data)]) == 0
    assert [s["id"] for s in json.loads(capsys.readouterr().out)["sessions"]] == [new]


def test_a_session_pruned_while_serving_starts_anew_when_its_client_comes_back(tmp_path: Path) -> None:
    data = tmp_path / "data"
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(data), "CTXPROXY_UPSTREAM": "http://u.test/v1"})
    fake = FakeUpstream()
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        client.app_state_dir = str(data)  # type: ignore[attr-defined]
        session, _ = _spilling(client, "a task")
        assert main(["prune", "--older-than", "0s", "--data-dir", str(data)]) == 0
        more = [*_spilling_messages("a task"), {"role": "assistant", "content": "done"},
                {"role": "user", "content": "and then?"}]
        again = client.post("/v1/chat/completions", json={"model": "m", "messages": more})
        assert again.status_code == 200, again.text
        assert again.headers["x-ctx-session"] == session  # the same id, a new session: its history went
        stubs = [m["content"] for m in fake.last_chat.json()["messages"] if "[overflow id=" in (m["content"] or "")]
        assert stubs  # what the proxy remembered of the pruned session is not used: every stub restores
        for stub in stubs:
            oid = stub.split("[overflow id=")[1].split()[0]
            assert client.get(f"/ctx/sessions/{session}/overflow/{oid}").status_code == 200


@pytest.mark.parametrize("duration", ["30", "d", "1 d", "3y", "1.5h"])
def test_a_duration_that_is_not_one_is_refused(duration: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["prune", "--older-than", duration])
    assert exited.value.code == 2 and "not a duration" in capsys.readouterr().err
