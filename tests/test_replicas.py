"""Replicas: several proxies on one store serve any request of any session, as one proxy would.

Two apps in this process, each with its own journal connection, session cache and locks, share one journal file;
one session's requests alternate between them. SQLite's own notice that another connection wrote
(``JournalWriter.generation``, ``PRAGMA data_version``) is switched off, as it is on PostgreSQL, where there is no
such thing: what keeps each app from acting on what it remembers of the session from before the other's requests
is the claim its request makes under the session's lock (``store.claims``). Every upstream request must be byte
for byte what one app sends for the same run: the scripted runs of ``tests.test_session_state`` (offers,
reminders, confirmations, the mirror and its draft) and one with folds, spills, pins, a drop, a note, a
``read_overflow`` and the calibration learning from every answer.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import load_settings
from ctxproxy.store import Journal, JournalWriter, claim
from ctxproxy.store.openings import OpeningsMixin
from tests.conftest import app_client, session_mirror
from tests.fakes import FakeUpstream, Reply, completion, tool_answer
from tests.test_journal import incoming
from tests.test_session_state import ENV, SCENARIOS, TOOLS, Scenario, Step, _round

Scripted = Reply | Callable[[FakeUpstream], Reply]


def _tools() -> Scenario:
    """A 4k window: the history is spilled, elided and folded as it grows; the model pins a result, drops two,
    reads one of them back, writes a note over another and unpins; each answer's usage moves the calibration."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                  {"role": "user", "content": "Fix the bug."}]
    script: dict[int, list[Scripted]] = {
        3: [Reply(body=tool_answer(("context_pin", {"handles": ["call_2"]}))), Reply(body=completion("pinned"))],
        6: [Reply(body=tool_answer(("context_drop", {"handles": ["call_4", "call_5"]}))),
            Reply(body=completion("dropped"))],
        7: [_read_back, Reply(body=completion("read"))],
        10: [Reply(body=tool_answer(("context_note", {"handles": ["call_8"], "note": "call_8: nothing useful"}))),
             Reply(body=completion("noted"))],
        13: [Reply(body=tool_answer(("context_unpin", {"all": True}))), Reply(body=completion("unpinned"))],
    }
    steps = []
    for k in range(1, 19):
        msgs = msgs + _round(k, f"line {k} of output {k % 7}\n" * 60)
        steps.append(Step({"model": "m", "tools": TOOLS, "messages": msgs}, script.get(k, [])))  # type: ignore[arg-type]
    return Scenario(ENV | {"CTXPROXY_CTX_WINDOW": "4096", "CTXPROXY_SPILL_CHARS": "1200",
                           "CTXPROXY_OFFER_ROUND": "0"}, steps)


def _read_back(fake: FakeUpstream) -> Reply:
    """The model reads back the first result cut from what it was last sent."""
    stub = re.search(r"overflow id=([0-9a-f]{64})", fake.last_chat.body.decode())
    assert stub is not None
    return Reply(body=tool_answer(("read_overflow", {"id": stub.group(1), "limit": 500})))


RUNS: dict[str, Callable[[], Scenario]] = {**SCENARIOS, "tools": _tools}


def _run(root: Path, scenario: Scenario, apps: int, pattern: Callable[[int], int], store: str = "") -> list[bytes]:
    """Every upstream chat request of the run, request ``i`` served by app ``pattern(i)`` of ``apps`` apps
    sharing one data dir (one journal file, one mirror directory) or, with ``store``, one PostgreSQL database."""
    shutil.rmtree(root, ignore_errors=True)
    env = scenario.env | {"CTXPROXY_DATA_DIR": str(root / "data"), "CTXPROXY_MIRROR_DIR": str(root / "ws"),
                          "CTXPROXY_STORE": store}
    fake = FakeUpstream()
    with ExitStack() as stack:
        clients = [stack.enter_context(app_client(load_settings(env=env), httpx.ASGITransport(app=fake)))
                   for _ in range(apps)]
        for i, step in enumerate(scenario.steps):
            if step.before is not None:
                step.before(root / "ws")
            _script(fake, step.replies)
            answer = clients[pattern(i) % apps].post("/v1/chat/completions", json=step.body)
            assert answer.status_code == 200, answer.text
    return [r.body for r in fake.chats]


def _script(fake: FakeUpstream, replies: list[Any]) -> None:
    for reply in replies:
        fake.enqueue(reply(fake) if callable(reply) else reply)


@pytest.fixture(autouse=True)
def no_data_version(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """PostgreSQL has no ``data_version``: the per-session claim alone must keep the apps right. Nor does a journal
    on PostgreSQL keep its openings' head digests (``store.openings``), which only ``data_version`` keeps right."""
    monkeypatch.setattr(JournalWriter, "_notice_other_writers", lambda *_: None)
    monkeypatch.setattr(OpeningsMixin, "may_be_heads", lambda *_: True)
    yield


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for every run: the mirror's path is in the bytes sent, so it must not vary."""
    return tmp_path_factory.mktemp("replicas") / "run"


_ONE: dict[tuple[Path, str], list[bytes]] = {}


def _one_app(root: Path, name: str) -> list[bytes]:
    if (root, name) not in _ONE:
        _ONE[root, name] = _run(root, RUNS[name](), 1, lambda i: 0)
    return _ONE[root, name]


PATTERNS: dict[str, Callable[[int], int]] = {"alternate": lambda i: i, "pairs": lambda i: i // 2,
                                             "one-then-other": lambda i: int(i >= 5)}


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("name", list(RUNS))
def test_two_apps_on_one_journal_send_what_one_app_sends(root: Path, name: str, pattern: str) -> None:
    assert _run(root, RUNS[name](), 2, PATTERNS[pattern]) == _one_app(root, name)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_apps_on_one_postgresql_database_send_what_one_app_sends(root: Path, name: str,
                                                                    postgres_url: str) -> None:
    """The same, the journal in PostgreSQL: the apps' locks are its advisory locks (``store.locks``)."""
    assert _run(root, RUNS[name](), 2, PATTERNS["alternate"], postgres_url) == _one_app(root, name)


def test_the_tools_run_exercises_what_it_is_meant_to(root: Path) -> None:
    sent = b"\n".join(_run(root, _tools(), 1, lambda i: 0)).decode()
    for marker in ("[folded id=", "[overflow id=", "call_8: nothing useful", "Applied since your last request",
                   "line 4 of output 4"):
        assert marker in sent, marker
    conn = sqlite3.connect(root / "data" / "journal.db")
    try:
        ratios = {k for (k,) in conn.execute("SELECT k FROM forwards WHERE k IS NOT NULL")}
    finally:
        conn.close()
    assert len(ratios) > 2  # the calibration in force changed along the run


def test_an_operators_pin_on_one_app_is_honoured_by_the_other(tmp_path: Path) -> None:
    """An operator's change is made outside a request: it clears the claim, so every app reads the session back."""
    env = ENV | {"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_CTX_WINDOW": "4096",
                 "CTXPROXY_SPILL_CHARS": "1200"}
    fake = FakeUpstream()
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                  {"role": "user", "content": "Fix the bug."}]
    with ExitStack() as stack:
        a, b = (stack.enter_context(app_client(load_settings(env=env), httpx.ASGITransport(app=fake)))
                for _ in range(2))
        for k in range(1, 4):
            msgs = msgs + _round(k, f"line {k} of output\n" * 90)
            session = _ok(b, {"model": "m", "messages": msgs}).headers["x-ctx-session"]
        assert fake.last_chat.body.decode().count("line 1 of output") < 90  # call_1's result was cut
        assert a.post(f"/ctx/sessions/{session}/pins", json={"handle": "call_1"}).status_code == 201
        for k in range(4, 6):
            msgs = msgs + _round(k, f"line {k} of output\n" * 90)
            _ok(b, {"model": "m", "messages": msgs})
            assert fake.last_chat.body.decode().count("line 1 of output") == 90  # pinned: whole, whatever app


def _ok(client: TestClient, body: dict[str, Any], session: str | None = None) -> httpx.Response:
    answer = client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session} if session else {})
    assert answer.status_code == 200, answer.text
    return answer


def test_a_mirror_another_app_wrote_since_is_rewritten_here_not_taken_for_a_draft(root: Path) -> None:
    """Replicas each with a disk of their own: the file here still holds what this app wrote before the other
    wrote a newer mirror. Read back, it is rewritten from the journaled text, not taken for the model's draft (a
    draft waits, and the mirror would not be written again): the file and the bytes sent are one app's."""
    assert _mirror_run(root, apps=2) == _mirror_run(root, apps=1)


def _mirror_run(root: Path, apps: int) -> tuple[list[bytes], str]:
    scenario = SCENARIOS["mirror"]()
    bodies = [scenario.steps[0].body]  # then large results: each request shows a new mirror
    for k in range(14, 17):
        bodies.append({**bodies[-1], "messages": bodies[-1]["messages"] + _round(k, f"{k % 10}" * 3000)})
    env = scenario.env | {"CTXPROXY_DATA_DIR": str(root / "data"), "CTXPROXY_MIRROR_DIR": str(root / "ws")}
    shutil.rmtree(root, ignore_errors=True)
    fake, mirror = FakeUpstream(), session_mirror(root / "ws", bodies[0]["messages"])
    with ExitStack() as stack:
        clients = [stack.enter_context(app_client(load_settings(env=env), httpx.ASGITransport(app=fake)))
                   for _ in range(apps)]
        _ok(clients[0], bodies[0])
        written_by_a = mirror.read_text()
        _ok(clients[-1], bodies[1])  # with two apps, the other writes a newer mirror "on its own disk"
        if apps == 2:
            assert mirror.read_text() != written_by_a
            mirror.write_text(written_by_a)  # the first app's disk: what it wrote, still
        for body in bodies[2:]:
            _ok(clients[0], body)
        return [r.body for r in fake.chats], mirror.read_text()


def test_a_new_session_on_another_app_starts_from_the_calibration_the_first_learnt(tmp_path: Path) -> None:
    """A new session starts from the model's latest calibration, whichever session taught it: read from the
    store, so the app that serves it need not be the one that learnt it."""
    assert _calibration_run(tmp_path / "two", apps=2) == _calibration_run(tmp_path / "one", apps=1)


def _calibration_run(root: Path, apps: int) -> list[float]:
    env = ENV | {"CTXPROXY_DATA_DIR": str(root), "CTXPROXY_CTX_WINDOW": "4096", "CTXPROXY_SPILL_CHARS": "100000"}
    fake = FakeUpstream()
    with ExitStack() as stack:
        clients = [stack.enter_context(app_client(load_settings(env=env), httpx.ASGITransport(app=fake)))
                   for _ in range(apps)]
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                      {"role": "user", "content": "Fix the bug."}]
        for k in range(1, 4):
            msgs = msgs + _round(k, f"line {k} of output\n" * 40)
            _ok(clients[0], {"model": "m", "messages": msgs})
        _ok(clients[-1], {"model": "m", "messages": [{"role": "system", "content": "Another agent."},
                                                     {"role": "user", "content": "Start over."}]})
    conn = sqlite3.connect(root / "journal.db")
    try:
        ratios = [float(k) for (k,) in conn.execute("SELECT k FROM forwards ORDER BY request_id, attempt")]
    finally:
        conn.close()
    assert len(set(ratios)) > 1  # it learnt something
    return ratios


class _Overlaps(FakeUpstream):
    """Counts the chat requests it holds at once (each app calls it from its own thread and event loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.most = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            await super().__call__(scope, receive, send)
            return
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.now -= 1


def test_two_apps_on_postgresql_handle_one_sessions_requests_one_at_a_time(postgres_url: str, tmp_path: Path) -> None:
    """Requests of one session sent to both apps at once: the second waits for the first's session lock, held in
    PostgreSQL; another session's request goes through meanwhile."""
    env = ENV | {"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_STORE": postgres_url}
    fake = _Overlaps()
    for _ in range(4):
        fake.enqueue(Reply(body=completion("slow"), delay=0.4))
    body = {"model": "m", "messages": [{"role": "user", "content": "Fix the bug."}]}
    with ExitStack() as stack:
        apps = [stack.enter_context(app_client(load_settings(env=env), httpx.ASGITransport(app=fake)))
                for _ in range(2)]

        def send(app: int, session: str) -> int:
            return apps[app].post("/v1/chat/completions", json=body, headers={"X-Session-Id": session}).status_code

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(send, [0, 1], ["one", "one"])) == [200, 200]
        assert fake.most == 1
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(send, [0, 1], ["one", "two"])) == [200, 200]
        assert fake.most == 2  # two sessions: side by side


def test_a_request_whose_process_died_holding_the_lock_is_marked_interrupted_by_the_next_holder(
        tmp_path: Path) -> None:
    """A process took the session's lock (its claim is journaled) and died before the answer: the next request to
    hold the lock, on any process, gives it its final ``interrupted`` row, as a restart would."""
    env = ENV | {"CTXPROXY_DATA_DIR": str(tmp_path)}
    body = {"model": "m", "messages": [{"role": "user", "content": "Fix the bug."}]}
    fake = FakeUpstream()
    with app_client(load_settings(env=env), httpx.ASGITransport(app=fake)) as client:
        _ok(client, {**body})
        journal = Journal(tmp_path / "journal.db")  # the process that dies: it records, claims, and is gone
        try:
            dead = journal.record_request(incoming(body["messages"], "named", n=1))
            claim(journal, "named", dead.request_id)
        finally:
            journal.close()
        _ok(client, {**body, "messages": [*body["messages"], {"role": "assistant", "content": "ok"},
                                           {"role": "user", "content": "Go on."}]}, session="named")
    conn = sqlite3.connect(tmp_path / "journal.db")
    try:
        rows = conn.execute("SELECT outcome, status FROM responses WHERE request_id = ?", [dead.request_id]).fetchall()
    finally:
        conn.close()
    assert rows == [("interrupted", 0)]


def test_a_replica_starting_on_postgresql_leaves_the_others_requests_in_flight_alone(
        postgres_url: str, tmp_path: Path) -> None:
    """A restart marks what a crash left in flight; on a shared store another replica's requests in flight are
    not that: a replica starting meanwhile leaves them, and their answers are journaled as they come."""
    env = ENV | {"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_STORE": postgres_url}
    fake = FakeUpstream()
    fake.enqueue(Reply(body=completion("slow"), delay=1.0))
    body = {"model": "m", "messages": [{"role": "user", "content": "Fix the bug."}]}
    with app_client(load_settings(env=env), httpx.ASGITransport(app=fake)) as first, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(first.post, "/v1/chat/completions", json=body)
        while not fake.chats:  # the request is upstream
            time.sleep(0.01)
        with app_client(load_settings(env=env), httpx.ASGITransport(app=fake)):
            pass  # another replica starts (and stops)
        assert answer.result().status_code == 200
    import psycopg  # the postgresql extra's

    with psycopg.connect(postgres_url) as conn:
        outcomes = [r[0] for r in conn.execute("SELECT outcome FROM responses ORDER BY id")]
    assert outcomes == ["ok"]


@pytest.mark.parametrize("incognito", [False, True])
def test_a_kept_response_chains_on_another_app_unless_incognito(tmp_path: Path, incognito: bool) -> None:
    """The Responses API's kept responses are in the store: a ``previous_response_id`` made on one replica resolves
    on another. An incognito one lives in its process's memory: another replica does not know it, and says so."""
    env = ENV | {"CTXPROXY_DATA_DIR": str(tmp_path)}
    headers = {"X-Ctx-Incognito": "1"} if incognito else {}
    fake = FakeUpstream()
    with ExitStack() as stack:
        a, b = (stack.enter_context(app_client(load_settings(env=env), httpx.ASGITransport(app=fake)))
                for _ in range(2))
        fake.enqueue(Reply(body=completion("Paris.")))
        first = a.post("/v1/responses", json={"model": "m", "input": "Capital of France?"}, headers=headers).json()
        fake.enqueue(Reply(body=completion("About 2 million.")))
        second = b.post("/v1/responses", json={"model": "m", "input": "Population?",
                                               "previous_response_id": first["id"]}, headers=headers)
    if incognito:
        assert second.status_code == 400 and second.json()["error"]["code"] == "previous_response_not_found"
        assert "replica" in second.json()["error"]["message"]
        return
    assert second.status_code == 200, second.text
    assert [m["content"] for m in fake.last_chat.json()["messages"]] == [
        "Capital of France?", "Paris.", "Population?"]
