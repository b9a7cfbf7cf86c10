"""bench/load.py's checks, so the load bench cannot rot: a short run through the real proxy finds no lost row and
no leak, and each check does fail on what it is there to catch."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.benches import bench_module

load = bench_module("load")


@pytest.mark.e2e
def test_twenty_concurrent_sessions_lose_no_row_and_leak_nothing() -> None:
    report = load.run(sessions=20, rounds=3, deadline=60, timeout=30)
    assert report["requests"] == 60 and report["errors"] == 0, report["error_detail"]
    assert report["rows_lost"] == 0
    assert report["cross_session_leaks"] == 0
    assert report["upstream_mismatches"] == report["journal_mismatches"] == report["replay_mismatches"] == 0
    assert report["split_sessions"] == report["extra_journal_sessions"] == report["incognito_on_disk"] == 0
    assert report["ok"] and "| rows lost | **0** |" in load.markdown(report)


def _session(index: int, sent: list[list[dict[str, Any]]]) -> Any:
    session = load.Session(index, named=True, stream=False, incognito=False)
    session.sent = sent
    return session


def _messages(marker: str, *texts: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "s"}, *({"role": "user", "content": f"⟦{marker}⟧ {t}"} for t in texts)]


def test_the_upstream_check_counts_a_foreign_marker_and_a_changed_body() -> None:
    mine, other = _messages("s0000", "a"), _messages("s0001", "b")
    mixed = [*mine, other[1]]
    received = [{"via": "proxy", "body": json.dumps({"messages": m})} for m in (mine, mixed, other[:1] + other[1:])]
    received.append({"via": "direct", "body": json.dumps({"messages": mixed})})  # the baseline is not checked
    found = load.check_upstream([_session(0, [mine]), _session(1, [_messages("s0001", "changed")])], received)
    assert found == {"upstream_leaks": 1, "upstream_mismatches": 1, "upstream_requests": 3}


def test_the_journal_check_counts_a_lost_row_a_changed_message_and_a_stray_session(client: TestClient) -> None:
    sent = _messages("s0000", "a")
    for name, messages in (("load-s0000", sent), ("load-s0001", _messages("s0001", "b")), ("stray", sent)):
        answer = client.post("/v1/chat/completions", json={"model": "m", "messages": messages},
                             headers={"x-session-id": name})
        assert answer.status_code == 200
    lost = _session(0, [sent, [*sent, {"role": "user", "content": "⟦s0000⟧ again"}]])
    lost.resolved = ["load-s0000", "load-s0000"]  # answered twice, journaled once
    changed = _session(1, [_messages("s0001", "not what was journaled")])
    changed.resolved = ["load-s0001"]
    found = load._journal_state(client, [lost, changed])
    assert (found["rows_lost"], found["journal_mismatches"], found["extra_journal_sessions"]) == (1, 1, 1)


def test_the_replay_check_counts_a_session_whose_replay_sent_something_else() -> None:
    same, differs, unreplayed = (_messages(f"s000{i}", "a") for i in range(3))
    received = [{"via": via, "body": json.dumps({"messages": m})}
                for via, m in (("proxy", same), ("replay", same), ("proxy", differs), ("proxy", unreplayed),
                               ("replay", [*differs, {"role": "user", "content": "⟦s0001⟧ more"}]))]
    assert load.check_replay([_session(i, []) for i in range(3)], received) == 2


@pytest.mark.e2e
def test_two_replicas_on_postgres_lose_no_row_and_leak_nothing(postgres_url: str) -> None:
    """Issue #16: the same checks with every session's requests alternating between two ``ctxproxy serve``
    processes on one PostgreSQL database, and the replay through one process on SQLite."""
    report = load.run(sessions=20, rounds=3, deadline=60, timeout=30, store=postgres_url, replica_count=2)
    assert report["requests"] == 60 and report["errors"] == 0, report["error_detail"]
    assert report["rows_lost"] == 0 and report["cross_session_leaks"] == 0
    assert report["upstream_mismatches"] == report["replay_mismatches"] == 0
    assert report["extra_journal_sessions"] == report["incognito_on_disk"] == 0
    assert (report["store"], report["replicas"]) == ("postgresql", 2)
    assert "| store × proxy processes | postgresql × 2 (each session's requests alternate" in load.markdown(report)
