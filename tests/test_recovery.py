"""Restart recovery: requests a crash left in flight are marked interrupted, and the clients' retries continue
their sessions instead of forking them (issue #10, item 5)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from ctxproxy.store import Journal, ResponseRecord
from tests.fakes import FakeUpstream, receive_body, serve_in_thread
from tests.real.upstream import stop
from tests.test_journal import incoming, record, run

CTXPROXY = str(Path(sys.executable).with_name("ctxproxy"))
SESSIONS = 10


class HoldingUpstream(FakeUpstream):
    """The fake upstream, except that a chat whose body says ``hold`` is not answered until ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()
        self.held = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        body = await receive_body(receive)
        if b"hold" in body and not self.released.is_set():
            self.held += 1
            while not self.released.is_set():
                await asyncio.sleep(0.01)

        async def replay() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        await super().__call__(scope, replay, send)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(upstream: str, data: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    with log.open("ab") as out:
        process = subprocess.Popen([CTXPROXY, "serve", "--upstream", upstream, "--port", str(port), "--data-dir",
                                    str(data)], stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                return process, base
        except httpx.TransportError:
            time.sleep(0.05)
    stop(process)
    raise AssertionError(f"ctxproxy serve did not start: {log.read_text()}")


@pytest.fixture
def upstream() -> Iterator[tuple[HoldingUpstream, str]]:
    fake = HoldingUpstream()
    with serve_in_thread(fake) as url:
        try:
            yield fake, url + "/v1"
        finally:
            fake.released.set()


def _history(i: int, second: bool) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"task {i}"}]
    if second:
        messages += [{"role": "assistant", "content": f"echo: task {i}"}, {"role": "user", "content": "hold on"}]
    return messages


def _post(base: str, messages: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=60)


def _try_post(base: str, messages: list[dict[str, Any]]) -> int:
    try:
        return _post(base, messages).status_code
    except httpx.TransportError:
        return 0  # the proxy was killed under the request


@pytest.mark.e2e
def test_a_sigkill_mid_request_is_marked_interrupted_and_the_retries_continue_their_sessions(
        tmp_path: Path, upstream: tuple[HoldingUpstream, str]) -> None:
    fake, url = upstream
    data, log = tmp_path / "data", tmp_path / "serve.log"
    process, base = _serve(url, data, log)
    try:
        sessions = [_post(base, _history(i, second=False)).headers["x-ctx-session"] for i in range(SESSIONS)]
        with ThreadPoolExecutor(SESSIONS) as pool:
            lost = [pool.submit(_try_post, base, _history(i, second=True)) for i in range(SESSIONS)]
            deadline = time.monotonic() + 30
            while fake.held < SESSIONS and time.monotonic() < deadline:
                time.sleep(0.02)
            assert fake.held == SESSIONS
            process.kill()  # SIGKILL, by the PID this test started
            process.wait(timeout=10)
            assert [f.result() for f in lost] == [0] * SESSIONS
        fake.released.set()
        process, base = _serve(url, data, log)
        outcomes = _last_outcomes(data)
        assert sorted(outcomes.values()).count("interrupted") == SESSIONS
        retried = [_post(base, _history(i, second=True)) for i in range(SESSIONS)]
        assert [r.status_code for r in retried] == [200] * SESSIONS
        assert [r.headers["x-ctx-session"] for r in retried] == sessions  # 0 forks
        listed = httpx.get(base + "/ctx/sessions", timeout=10).json()["sessions"]
        assert len(listed) == SESSIONS and all(s["parent_id"] is None for s in listed)
    finally:
        stop(process)


def _last_outcomes(data: Path) -> dict[int, str]:
    journal = Journal(data / "journal.db")
    try:
        rows = [journal.request(r + 1) for r in range(2 * SESSIONS)]
        return {row["id"]: row["responses"][-1]["outcome"] for row in rows if row is not None}
    finally:
        journal.close()


@pytest.fixture
def journal(store_location: Path | str) -> Iterator[Journal]:
    """On SQLite, then on PostgreSQL."""
    journal = Journal(store_location)
    yield journal
    journal.close()


def _answer(journal: Journal, request_id: int, attempt: int, outcome: str) -> None:
    journal.record_response(ResponseRecord(request_id, attempt, outcome, 200, "{}", None, 1.0, 2.0, "t"))


def test_only_requests_without_a_final_answer_are_marked(journal: Journal) -> None:
    steps = run(3)
    answered = record(journal, incoming(steps[0], n=0))
    in_rounds = journal.record_request(incoming(steps[1], n=1))
    _answer(journal, in_rounds.request_id, 0, "context_round")  # the proxy was between its own rounds
    unanswered = journal.record_request(incoming(steps[2], n=2))
    assert journal.mark_interrupted("2026-01-02T00:00:00") == 2
    assert journal.mark_interrupted("2026-01-02T00:00:01") == 0  # marked once
    final = {r: journal.request(r)["responses"][-1] for r in (in_rounds.request_id, unanswered.request_id)}  # type: ignore[index]
    assert [(f["attempt"], f["outcome"]) for f in final.values()] == [(1, "interrupted"), (0, "interrupted")]
    assert len(journal.request(answered.request_id)["responses"]) == 1  # type: ignore[index]


def test_a_retry_of_an_interrupted_request_continues_its_session(journal: Journal) -> None:
    steps = run(3)
    first = record(journal, incoming(steps[0], n=0))
    journal.record_request(incoming(steps[1], n=1))  # the proxy dies here
    journal.mark_interrupted("2026-01-02T00:00:00")
    retry = record(journal, incoming(steps[1], n=2))
    assert retry.session_id == first.session_id and not retry.forked and retry.new_messages == 0


def test_a_next_step_from_the_last_answered_history_continues_its_session(journal: Journal) -> None:
    steps = run(3)
    first = record(journal, incoming(steps[1], n=0))
    journal.record_request(incoming(steps[2], n=1))  # the proxy dies here; the agent then takes another step
    journal.mark_interrupted("2026-01-02T00:00:00")
    other = [*steps[1], {"role": "user", "content": "the server went away; try something else"}]
    after = record(journal, incoming(other, n=2))
    assert after.session_id == first.session_id and not after.forked and after.new_messages == 1
    assert journal.request(after.request_id)["messages"] == other  # type: ignore[index]


def test_a_request_in_context_rounds_is_still_in_flight_for_a_parallel_run(journal: Journal) -> None:
    opening = run(0)[0]
    first = journal.record_request(incoming(opening, n=0))
    _answer(journal, first.request_id, 0, "context_round")
    second = journal.record_request(incoming(opening, n=1))
    assert second.session_id != first.session_id
