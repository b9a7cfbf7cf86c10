"""The proxy's log: one line per chat request at info, a startup line, and JSON lines when asked."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient
from starlette.types import Message, Receive, Scope, Send

from ctxproxy.config import load_settings
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.proxy.observe.logs import JsonFormatter, request_line
from tests.conftest import app_client
from tests.fakes import FakeUpstream
from tests.test_metrics import with_result

CTXPROXY = str(Path(sys.executable).with_name("ctxproxy"))


def test_each_request_is_one_info_line_with_its_figures(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "32768", "CTXPROXY_SPILL_CHARS": "2000"})
    output = "\n".join(f"line {i}: all is well" for i in range(1500))
    with caplog.at_level(logging.INFO, logger="ctxproxy"), \
            app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as c:
        answer = c.post("/v1/chat/completions", json={"model": "m", "messages": with_result(output)})
    [line] = [r for r in caplog.records if getattr(r, "ctx", {}).get("event") == "request"]
    fields = line.ctx  # type: ignore[attr-defined]
    assert line.levelno == logging.INFO and fields["status"] == 200
    assert fields["session"] == answer.headers["x-ctx-session"]
    assert fields["route"] == "POST /v1/chat/completions" and fields["cuts"] == {"spill": 1}
    assert fields["tokens_in"] > fields["tokens_out"] > 0 and fields["retries"] == 0 and fields["added_ms"] > 0
    text = line.getMessage()
    assert f"session {fields['session']} POST /v1/chat/completions 200 ok" in text and "cuts spill 1" in text
    assert f"tokens {fields['tokens_in']} → {fields['tokens_out']} upstream" in text


@pytest.mark.parametrize("stream", [False, True])
def test_the_request_s_line_is_written_once_its_answer_has_left(tmp_path: Path, stream: bool) -> None:
    """The answer is journaled before its end reaches the client (``Exchange.answer``), but the line waits until
    the end is sent: formatting and writing it was on the path of every answer."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "32768"})
    events: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "ctx", {}).get("event") == "request":
                events.append("line")

    app = create_app(settings, upstream_transport=httpx.ASGITransport(app=FakeUpstream()))

    async def recorded(scope: Scope, receive: Receive, send: Send) -> None:
        async def sent(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                events.append("sent")
        await app(scope, receive, sent)

    handler, logger = Lines(), logging.getLogger("ctxproxy")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with TestClient(recorded) as client:
            answer = client.post("/v1/chat/completions", json={"model": "m", "stream": stream,
                                                               "messages": [{"role": "user", "content": "hi"}]})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert answer.status_code == 200 and events == ["sent", "line"]


def test_the_tokens_of_a_small_request_are_the_agents_not_the_proxys_tools(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The context tools' schemas are budgeted before they are offered, but neither the agent sent them nor do they
    go upstream until they are: a "hi" read "tokens 740 → 740 upstream"."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "32768"})
    with caplog.at_level(logging.INFO, logger="ctxproxy"), \
            app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as c:
        c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    [line] = [r for r in caplog.records if getattr(r, "ctx", {}).get("event") == "request"]
    assert 0 < line.ctx["tokens_in"] == line.ctx["tokens_out"] < 20  # type: ignore[attr-defined]


def test_a_refused_request_has_its_line_too(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "4096"})
    body = {"model": "m", "messages": [{"role": "system", "content": "rule; " * 5000}]}
    with caplog.at_level(logging.INFO, logger="ctxproxy"), \
            app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as c:
        c.post("/v1/chat/completions", json=body)
    [line] = [r.getMessage() for r in caplog.records if getattr(r, "ctx", {}).get("event") == "request"]
    assert " 400 context_too_large, not forwarded" in line


@pytest.mark.parametrize(("path", "body", "code"), [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": 7, "content": "x"}]}, "invalid_request"),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
     None),
])
def test_a_request_refused_before_it_has_a_session_has_its_line_and_is_counted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, path: str, body: dict[str, object], code: str | None) -> None:
    """A body the edge refuses never reaches a session: it used to leave no line and no count at all."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1"})
    with caplog.at_level(logging.INFO, logger="ctxproxy"), \
            app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as c:
        answer = c.post(path, json=body)
        metrics = c.get("/metrics").text
    assert answer.status_code == 400
    [line] = [r for r in caplog.records if getattr(r, "ctx", {}).get("event") == "refused"]
    assert line.ctx["route"] == f"POST {path}" and line.ctx["status"] == 400  # type: ignore[attr-defined]
    assert code is None or line.ctx["code"] == code  # type: ignore[attr-defined]
    assert line.getMessage().startswith(f"refused POST {path} 400")
    assert 'ctxproxy_requests_total{outcome="refused"} 1.0' in metrics


def test_the_json_format_puts_every_figure_in_a_field() -> None:
    fields = {"event": "request", "session": "s", "route": "POST /v1/chat/completions", "status": 502,
              "outcome": "unreachable", "tokens_in": 10, "tokens_out": 8, "cuts": {}, "retries": 1, "rounds": 0,
              "added_ms": 1.5, "total_ms": 9.0}
    record = logging.LogRecord("ctxproxy", logging.INFO, __file__, 1, request_line(fields), None, None)
    record.ctx = fields
    out = json.loads(JsonFormatter().format(record))
    assert out["level"] == "info" and out["status"] == 502 and out["retries"] == 1
    assert out["message"].startswith("session s POST /v1/chat/completions 502 unreachable")


def test_startup_prints_the_upstream_the_data_dir_and_the_window_as_json(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")} | {
        "CTXPROXY_LOG_FORMAT": "json", "CTXPROXY_DATA_DIR": str(tmp_path)}
    server = subprocess.Popen([CTXPROXY, "serve", "--port", "0", "--upstream", "http://127.0.0.1:9/v1"], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        line = next(line for line in server.stderr if '"startup"' in line)
    finally:
        server.terminate()
        server.communicate(timeout=20)  # reads and closes the pipe
    start = json.loads(line)
    assert start["upstream"] == "http://127.0.0.1:9/v1" and start["data_dir"] == str(tmp_path)
    assert start["window"] is None and "detected from the upstream" in start["message"]
