"""The body edge with the prefix parse: a body that repeats a recent one is checked and refused as a whole one is."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient
from starlette.requests import ClientDisconnect, Request

from ctxproxy.proxy.core.prefix import Prefixes
from ctxproxy.proxy.edge.body import parse_chat_body, read_body
from ctxproxy.proxy.errors import BadRequest, PayloadTooLarge, RequestTimeout
from tests.fakes import FakeUpstream

HISTORY = [{"role": "user", "content": "task"}] + [
    {"role": "assistant" if i % 2 else "tool", "content": f"{i} " + "x" * 2000, **({} if i % 2 else
                                                                                   {"tool_call_id": f"c{i}"})}
    for i in range(1, 41)]


def body(messages: list[Any], **fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages, **fields})


def test_a_bad_new_message_is_named_by_its_place_in_the_whole_body() -> None:
    prefixes = Prefixes()
    parse_chat_body(body(HISTORY), prefixes)
    with pytest.raises(BadRequest) as refused:
        parse_chat_body(body([*HISTORY, {"content": "no role"}]), prefixes)
    assert refused.value.param == f"messages[{len(HISTORY)}].role"


def test_a_refused_body_is_not_kept_and_a_stdlib_body_is_parsed_whole() -> None:
    prefixes = Prefixes()
    parse_chat_body(body(HISTORY), prefixes)
    kept = prefixes.retained_bytes
    with pytest.raises(BadRequest):
        parse_chat_body(body([*HISTORY, {"role": 3}]), prefixes)
    assert prefixes.retained_bytes == kept
    lone = body(HISTORY)[:-2] + b',{"role":"user","content":"\\ud83d"}]}'  # only the stdlib takes it
    parsed = parse_chat_body(lone, prefixes)
    assert parsed["messages"][-1]["content"] == "\ufffd" and prefixes.retained_bytes == kept


def test_the_next_request_is_parsed_from_the_last_one(client: TestClient, fake: FakeUpstream) -> None:
    first = client.post("/v1/chat/completions", content=body(HISTORY))
    assert first.status_code == 200
    prefixes: Prefixes = client.app.state.ctx.hasher.prefixes  # type: ignore[attr-defined]
    raw = body([*HISTORY, {"role": "assistant", "content": "next"}, {"role": "user", "content": "more"}])
    reused = prefixes.loads(raw)
    assert reused is not None and reused.count == len(HISTORY) and reused.body == orjson.loads(raw)
    second = client.post("/v1/chat/completions", content=raw)
    assert second.status_code == 200 and fake.last_chat.json()["messages"][-1]["content"] == "more"


def test_nothing_downstream_changes_the_message_objects_the_next_request_reuses(client: TestClient) -> None:
    """The kept bodies' objects are handed to later requests as they are: serving a request (projection, the
    journal, the forward) must leave them as parsed."""
    messages = list(HISTORY)
    for i in range(4):
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"n{i}", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"n{i}", "content": f"result {i} " + "y" * 3000}]
        assert client.post("/v1/chat/completions", content=body(messages, stream=i % 2 == 1)).status_code == 200
    prefixes: Prefixes = client.app.state.ctx.hasher.prefixes  # type: ignore[attr-defined]
    kept = [entry for lists in prefixes._entries.values() for entry in lists]
    assert kept and all(entry.top == orjson.loads(bytes(entry.raw)) for entry in kept)


def _request(messages: list[dict[str, Any]], wait: asyncio.Event | None = None) -> Request:
    """A request whose ``receive`` gives ``messages`` in turn, then (``wait``) waits for the event."""
    pending = list(messages)

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        assert wait is not None
        await wait.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def _piece(body: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


def test_a_body_is_read_from_receive_with_its_limit_and_a_disconnect_as_starlette_reads_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_body`` reads the ASGI messages itself (``request.stream()`` is an async generator asyncio registers,
    under anyio's cancel scope: ~20 µs a request), and says what Starlette's stream says."""
    monkeypatch.setattr(Request, "stream", None)
    pieces = [_piece(b'{"a"'), _piece(b""), _piece(b": 1}", more=False)]
    assert asyncio.run(read_body(_request(pieces), 100, timeout=5)) == b'{"a": 1}'
    with pytest.raises(PayloadTooLarge):
        asyncio.run(read_body(_request([_piece(b"x" * 60), _piece(b"x" * 60, more=False)]), 100, timeout=5))
    with pytest.raises(ClientDisconnect):
        asyncio.run(read_body(_request([_piece(b"x"), {"type": "http.disconnect"}]), 100, timeout=5))


def test_a_body_late_is_a_408_and_a_cancellation_from_outside_stays_one() -> None:
    async def late() -> None:
        await read_body(_request([_piece(b"{")], asyncio.Event()), 100, timeout=0.05)

    with pytest.raises(RequestTimeout, match=re.escape("within 0.05 seconds (1 bytes came)")):
        asyncio.run(late())

    async def cancelled() -> None:
        with pytest.raises(TimeoutError):  # asyncio's own: the outer timeout's cancellation, not the 408
            async with asyncio.timeout(0.01):
                await read_body(_request([], asyncio.Event()), 100, timeout=0.05)
        await asyncio.sleep(0.1)  # the read's timer went with it: nothing cancels this task later

    asyncio.run(cancelled())


def chunked(raw: bytes, size: int) -> Iterator[bytes]:
    for at in range(0, len(raw), size):
        yield raw[at:at + size]


def test_bodies_sent_in_pieces_go_upstream_as_they_came(roomy_client: TestClient, fake: FakeUpstream) -> None:
    """Through the app: a session, a fork of it and its next request, each sent in 1 000-byte pieces and held
    as spans of the kept bodies, reach the upstream byte for byte (unchanged: the window holds them)."""
    fork = [*HISTORY[:30], {"role": "user", "content": "edited"}, *HISTORY[31:]]
    more = [{"role": "assistant", "content": "next"}, {"role": "user", "content": "more"}]
    bodies = [body(messages) for messages in (HISTORY, fork, [*HISTORY, *more])]
    for raw in bodies:
        assert roomy_client.post("/v1/chat/completions", content=chunked(raw, 1000)).status_code == 200
        assert fake.last_chat.body == raw
    prefixes: Prefixes = roomy_client.app.state.ctx.hasher.prefixes  # type: ignore[attr-defined]
    spans = [len(entry.raw.spans) for lists in prefixes._entries.values() for entry in lists]
    assert spans == [2, 2]  # the next request and the fork: each the first body's bytes, then its own
