"""Session state is rebuilt from the journal: a restart or an eviction between any two requests changes nothing.

Each scripted run (native, fenced, streamed, the live mirror) uses the context tools: an offer that must hold for
the rest of its turn after usage falls again, a context-tool call the proxy executes (its confirmation pending for
the next request), the reminder at the soft ceiling, the mirror paragraph and a draft that waits for its commit.
The run is replayed with the proxy restarted (a fresh app on the same data dir) or the session evicted from its
working cache before request ``cut`` (crowded out of a cache of one by another session; dropped, for an incognito
run): every upstream request must be byte for byte the uninterrupted run's.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import load_settings
from ctxproxy.proxy.engine.context import SessionContexts
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.store import (
    CalibrationInForce,
    ForwardRecord,
    IncomingRequest,
    Journal,
    ResponseRecord,
    calibration_in_force,
)
from tests.conftest import app_client
from tests.fakes import FakeUpstream, Reply, completion, stream_chunks, stream_tool_answer, tool_answer
from tests.test_journal import incoming, run

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]
ENV = {"CTXPROXY_UPSTREAM": "http://u.test/v1", "CTXPROXY_CTX_WINDOW": "16384", "CTXPROXY_SPILL_CHARS": "100000",
       "CTXPROXY_SOFT_CEILING_PCT": "0.5", "CTXPROXY_OFFER_ROUND": "0"}


@dataclass
class Step:
    """One client request: its body, the model's scripted answers, and what the agent does before sending it."""

    body: dict[str, Any]
    replies: list[Reply] = field(default_factory=list)
    before: Callable[[Path], None] | None = None


@dataclass
class Scenario:
    env: dict[str, str]
    steps: list[Step]


def _round(k: int, text: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{k}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": f"call_{k}", "content": text}]


def _native(stream: bool) -> Scenario:
    """About 1000 tokens a result: offered from 45% of the budget, reminded at 50%; the model drops six results
    (usage falls back under the offer line: the offer holds by its turn alone), then a new turn opens."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                  {"role": "user", "content": "Fix the bug."}]
    steps = []
    for k in range(1, 11):
        msgs = msgs + _round(k, f"{k % 10}" * 3000)
        replies = []
        if k == 8:
            drop = ("context_drop", {"handles": [f"call_{i}" for i in range(1, 7)]})
            replies = [Reply(sse=stream_tool_answer(drop)) if stream else Reply(body=tool_answer(drop)),
                       Reply(sse=stream_chunks("dropped")) if stream else Reply(body=completion("dropped"))]
        steps.append(Step({"model": "m", "tools": TOOLS, "messages": msgs, "stream": stream}, replies))
    msgs = [*msgs, {"role": "assistant", "content": "done"}, {"role": "user", "content": "Now the tests."}]
    steps.append(Step({"model": "m", "tools": TOOLS, "messages": msgs, "stream": stream}))
    return Scenario(ENV, steps)


def _block(tool: str, **args: Any) -> str:
    return "```context\n" + json.dumps({"tool": tool, **args}) + "\n```\n"


def _fenced() -> Scenario:
    """The text protocol: offered by the person's phrase, a context block dropping a result (its confirmation
    pending), then the offer held by usage, and the reminder."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Reply with one ```bash``` block."},
                                  {"role": "user", "content": "Fix the test."}]
    steps = []
    for k in range(1, 12):
        output = f"{k % 10}" * 3000
        msgs = [*msgs, {"role": "assistant", "content": f"Step {k}.\n```bash\npytest -k step{k}\n```"},
                {"role": "user", "content": f"<returncode>0</returncode>\n<output>\n{output}\n</output>"}]
        replies = []
        if k == 7:
            replies = [Reply(body=completion("Tidying.\n" + _block("context_drop", handles=["r1.1", "r2.1"]))),
                       Reply(body=completion("Go on.\n```bash\nls\n```"))]
        steps.append(Step({"model": "m", "messages": msgs}, replies))
    msgs = [*msgs, {"role": "assistant", "content": "done"},
            {"role": "user", "content": "Please free up your context, then go on."}]
    steps.append(Step({"model": "m", "messages": msgs}))
    return Scenario(ENV | {"CTXPROXY_ROUTE": "fenced"}, steps)


def _edit_mirror(ws: Path) -> None:
    """The agent's own edit tool removes two results from the mirror: a draft, kept until ``ctx commit``."""
    [path] = ws.glob("*/LIVE_CONTEXT.json")  # the scenario's one session
    draft = json.loads(path.read_text())
    draft["messages"] = [e for e in draft["messages"] if e.get("tool_call_id") not in ("call_8", "call_9")]
    path.write_text(json.dumps(draft))


def _mirror() -> Scenario:
    """Eight newest results protected, each about 1000 tokens: elision cannot reach the target, the mirror is
    written, the agent edits it (a draft that waits), the model commits, the confirmation follows."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                  {"role": "user", "content": "Fix the bug."}]
    for k in range(1, 14):
        msgs = msgs + _round(k, f"{k % 10}" * 3000)
    steps = [Step({"model": "m", "tools": TOOLS, "messages": msgs})]
    msgs = msgs + _round(14, "small")
    steps.append(Step({"model": "m", "tools": TOOLS, "messages": msgs}, before=_edit_mirror))
    msgs = msgs + _round(15, "small")
    steps.append(Step({"model": "m", "tools": TOOLS, "messages": msgs},
                      [Reply(body=tool_answer(("ctx", {"action": "commit"}))), Reply(body=completion("ok"))]))
    for k in (16, 17):
        msgs = msgs + _round(k, "small")
        steps.append(Step({"model": "m", "tools": TOOLS, "messages": msgs}))
    return Scenario(ENV | {"CTXPROXY_KEEP_RESULTS": "8", "CTXPROXY_SOFT_CEILING_PCT": "0.85"}, steps)


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "native": lambda: _native(stream=False), "streamed": lambda: _native(stream=True), "fenced": _fenced,
    "mirror": _mirror}


def _run(root: Path, scenario: Scenario, cut: int | None, how: str, store: str = "") -> list[bytes]:
    """Every upstream chat request of the run, with the proxy restarted or the session evicted before ``cut``:
    ``restart`` (a fresh app on the same data dir), ``evict`` (dropped from the working cache), ``crowd-out``
    (another session's request pushes it out of a cache of one), ``incognito`` (dropped; an incognito run, whose
    journal is in memory). ``store``: the journal's PostgreSQL URL ("": SQLite in the data dir)."""
    shutil.rmtree(root, ignore_errors=True)
    env = scenario.env | {"CTXPROXY_DATA_DIR": str(root / "data"), "CTXPROXY_MIRROR_DIR": str(root / "ws"),
                          "CTXPROXY_STORE": store}
    headers = {"X-Ctx-Incognito": "1"} if how == "incognito" else {}
    fake = FakeUpstream()
    clients = _clients(load_settings(env=env), fake)
    client = next(clients)
    state: AppState = client.app.state.ctx  # type: ignore[attr-defined]
    state.contexts = SessionContexts(capacity=1) if how == "crowd-out" else state.contexts
    session, other = "", None
    for i, step in enumerate(scenario.steps):
        if i == cut and how == "restart":
            client = next(clients)
        elif i == cut and how == "crowd-out":
            other = len(fake.chats)
            assert client.post("/v1/chat/completions", json={"model": "m", "messages": [
                {"role": "user", "content": "Another session."}]}).status_code == 200
        elif i == cut:
            state.contexts.drop(state.journal_for(how == "incognito"), session)
        if step.before is not None:
            step.before(root / "ws")
        for reply in step.replies:
            fake.enqueue(reply)
        answer = client.post("/v1/chat/completions", json=step.body, headers=headers)
        assert answer.status_code == 200, answer.text
        session = answer.headers["x-ctx-session"]
    clients.close()
    return [r.body for i, r in enumerate(fake.chats) if i != other]


def _clients(settings: Any, fake: FakeUpstream) -> Iterator[TestClient]:
    """A fresh app on the same data dir each time the next one is asked for (the one before is shut down)."""
    while True:
        with app_client(settings, httpx.ASGITransport(app=fake)) as client:
            yield client


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for every run of the module: the mirror's path is in the bytes sent, so it must not vary."""
    return tmp_path_factory.mktemp("state") / "run"


_BASELINES: dict[tuple[Path, str, bool], list[bytes]] = {}


def _baseline(root: Path, name: str, incognito: bool = False) -> list[bytes]:
    if (root, name, incognito) not in _BASELINES:
        _BASELINES[root, name, incognito] = _run(root, SCENARIOS[name](), None, "incognito" if incognito else "")
    return _BASELINES[root, name, incognito]


def _what_it_exercises(sent: list[bytes]) -> str:
    text = b"\n".join(sent).decode()
    return " ".join(sorted(w for w, marker in [
        ("offered", '"name":"context_drop"'), ("fenced-offered", "```context"), ("reminded", "nearly full"),
        ("confirmed", "Applied since your last request"), ("mirror", "You manage your context")] if marker in text))


CUTS = [(name, cut) for name in SCENARIOS for cut in range(1, len(SCENARIOS[name]().steps))]


@pytest.mark.parametrize("how", ["restart", "crowd-out"])
@pytest.mark.parametrize(("name", "cut"), CUTS)
def test_a_restart_or_eviction_between_any_two_requests_changes_no_upstream_byte(
        root: Path, name: str, cut: int, how: str) -> None:
    expected = _baseline(root, name)
    assert _run(root, SCENARIOS[name](), cut, how) == expected


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_restart_on_postgresql_sends_what_sqlite_sent(root: Path, name: str, postgres_url: str) -> None:
    """The offer, the reminder, the confirmations and the mirror come back from PostgreSQL as from SQLite: a
    replica taking a session over mid-run sends the same bytes."""
    cut = len(SCENARIOS[name]().steps) // 2
    assert _run(root, SCENARIOS[name](), cut, "restart", store=postgres_url) == _baseline(root, name)


@pytest.mark.parametrize(("name", "cut"), [(name, cut) for name, cut in CUTS if name != "mirror"])
def test_an_incognito_session_evicted_between_any_two_requests_resumes_from_its_memory_journal(
        root: Path, name: str, cut: int) -> None:
    """An incognito session's state lives in the in-memory journal (no mirror there: it would write a file)."""
    assert _run(root, SCENARIOS[name](), cut, "incognito") == _baseline(root, name, incognito=True)


@pytest.mark.parametrize(("name", "exercised"), [
    ("native", "confirmed offered reminded"), ("streamed", "confirmed offered reminded"),
    ("fenced", "confirmed fenced-offered reminded"), ("mirror", "confirmed mirror offered")])
def test_the_scripted_runs_exercise_the_state_they_are_meant_to(root: Path, name: str, exercised: str) -> None:
    assert _what_it_exercises(_baseline(root, name)) == exercised


def _forward(journal: Journal, req: IncomingRequest, k: float, samples: int | None, estimate: int | None,
             outcome: str, prompt: int) -> None:
    rec = journal.record_request(req)
    journal.record_response(
        ResponseRecord(rec.request_id, 0, outcome, 200, "{}", {"prompt_tokens": prompt}, 1.0, 2.0, req.received_at),
        ForwardRecord(rec.request_id, 0, rec.session_id, req.received_at, req.params_hash, verbatim=True,
                      estimate=estimate, k=k, samples=samples))


def test_the_calibration_in_force_is_the_latest_forwards_and_what_only_an_agents_answer_taught(
        store_location: Path | str) -> None:
    journal = Journal(store_location)
    steps = run(3)
    _forward(journal, incoming(steps[0], "s", n=1), 1.0, None, 100, "ok", 120)  # journaled before the count was
    assert calibration_in_force(journal, "s", "m") is None
    _forward(journal, incoming(steps[1], "s", n=2), 1.2, 1, 100, "ok", 150)
    assert calibration_in_force(journal, "s", "m") == CalibrationInForce(1.2, 1, (100, 150))
    _forward(journal, incoming(steps[2], "s", n=3), 1.35, 2, 100, "context_round", 150)  # not learnt from, live
    assert calibration_in_force(journal, "s", "m") == CalibrationInForce(1.35, 2, None)
    _forward(journal, incoming(steps[3], "s", n=4), 1.35, 2, None, "ok", 150)  # a splice: no estimate
    assert calibration_in_force(journal, "s", "m") == CalibrationInForce(1.35, 2, None)
    assert calibration_in_force(journal, "s", "other-model") is None
    journal.close()
