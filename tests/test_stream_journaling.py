"""When an answer is journaled (``Exchange.answer``), seen from the client's side of the ASGI interface, one message
at a time: before the client has the end of it, whichever front and whether streamed or not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import Settings
from ctxproxy.store import Journal
from tests.conftest import chat


def test_a_streamed_answer_is_journaled_before_the_client_reads_its_done(client: TestClient,
                                                                         settings: Settings) -> None:
    """Found by bench/load.py: an agent sends its next request as soon as it reads ``data: [DONE]``; the answer was
    journaled only after the response ended, so under load the next request of an unnamed session found its
    session's head unanswered, took it for a parallel run and forked a ``-2`` child (3 or 4 of the 4 streamed
    unnamed sessions of a 20-session run). Here the app is paused at the moment it sends ``[DONE]``: the row
    must exist."""
    seen: list[list[Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and b"data: [DONE]" in message.get("body", b""):
            seen.append(_answers(settings.data_path / "journal.db"))

    client.portal.call(_call, client.app, json.dumps(chat("hello", stream=True)).encode(), send)  # type: ignore[union-attr]
    assert len(seen) == 1
    assert [row["outcome"] for row in seen[0]] == ["ok"]


def _anthropic(stream: bool) -> dict[str, Any]:
    return {"model": "fake-model", "max_tokens": 100, "stream": stream,
            "messages": [{"role": "user", "content": "hello"}]}


def _responses(stream: bool) -> dict[str, Any]:
    return {"model": "fake-model", "input": "hello", "stream": stream}


ENDS = [  # the route, its body, and the bytes that tell the client the answer is over
    ("/v1/chat/completions", chat("hello"), b""),
    ("/v1/messages", _anthropic(False), b""),
    ("/v1/messages", _anthropic(True), b"event: message_stop"),
    ("/v1/responses", _responses(False), b""),
    ("/v1/responses", _responses(True), b"event: response.completed"),
]


@pytest.mark.parametrize(("path", "body", "end"), ENDS, ids=["chat", "messages", "messages-stream", "responses",
                                                             "responses-stream"])
def test_every_front_journals_the_answer_before_the_client_has_its_end(
        client: TestClient, settings: Settings, path: str, body: dict[str, Any], end: bytes) -> None:
    """Found by bench/load.py over two replicas: a buffered answer was journaled after its body had gone out, so an
    agent's next request, round-robined to the other replica, found the head unanswered and forked the session
    (``store.placement`` continues only from an answered head). Paused at the message that ends the answer (the
    body's last bytes, or the protocol's closing event), the answer row must already exist."""
    seen: list[list[Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body":
            return
        chunk = message.get("body", b"")
        if end in chunk if end else not message.get("more_body", False):
            seen.append(_answers(settings.data_path / "journal.db"))

    client.portal.call(_call, client.app, json.dumps(body).encode(), send, path)  # type: ignore[union-attr]
    assert len(seen) == 1
    assert [row["outcome"] for row in seen[0]] == ["ok"]


async def _call(app: Any, body: bytes, send: Any, path: str = "/v1/chat/completions") -> None:
    """One POST to the chat route, straight through the ASGI interface."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await anyio.sleep_forever()  # the client stays connected until the response is over
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 4141)}
    await app(scope, receive, send)


def _answers(path: Path) -> list[Any]:
    journal = Journal(path)
    try:
        request = journal.request(1)
        return list(request["responses"]) if request else []
    finally:
        journal.close()
