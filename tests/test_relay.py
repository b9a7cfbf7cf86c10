"""The intercepting stream's guard: once its 200 has left, whatever breaks ends it with an error event and
``[DONE]`` and sets the journaled outcome (issue #10 item 3), instead of cutting the connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from ctxproxy.proxy.errors import UpstreamMalformed
from ctxproxy.proxy.upstream.relay import StreamRecord, guarded


async def breaking(exc: BaseException) -> AsyncIterator[bytes]:
    yield b"data: {}\n\n"
    raise exc


def relayed(exc: BaseException) -> tuple[list[bytes], StreamRecord]:
    record = StreamRecord(httpx.Response(200))

    async def collect() -> list[bytes]:
        return [out async for out in guarded(breaking(exc), record)]

    return asyncio.run(collect()), record


@pytest.mark.parametrize(("exc", "outcome", "code"), [
    (UpstreamMalformed("bad chunk"), "upstream_malformed", "upstream_malformed"),
    (httpx.ReadError("reset"), "upstream_error", "upstream_stream_error"),
    (httpx.ReadTimeout("slow"), "timeout", "upstream_stream_error"),
    (RuntimeError("a bug in the proxy"), "error", "internal_error"),
])
def test_whatever_breaks_a_stream_ends_it_with_an_error_event_and_done(
        exc: BaseException, outcome: str, code: str) -> None:
    out, record = relayed(exc)
    first, last = out[0], b"".join(out[1:])
    assert first == b"data: {}\n\n" and last.endswith(b"\n\ndata: [DONE]\n\n")
    error = orjson.loads(last.split(b"\n\n")[0].removeprefix(b"data: "))["error"]
    assert error["code"] == code and set(error) == {"message", "type", "param", "code"}
    assert record.outcome == outcome


def test_a_cancelled_stream_is_not_mistaken_for_a_failure() -> None:
    """A client that goes away cancels the stream: the cancellation goes on, nothing more is sent, and the outcome
    stays a disconnect."""
    with pytest.raises(asyncio.CancelledError):
        relayed(asyncio.CancelledError())
