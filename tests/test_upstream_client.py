"""The proxy's own HTTP/1.1 client (proxy/upstream/connection.py, pool.py, transport.py) against real servers on
127.0.0.1: small asyncio servers that answer byte for byte as scripted, well or badly, and the scripted fake
upstream under uvicorn. Nothing is simulated but the servers' misbehaviour."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
import shutil
import socket
import ssl
import struct
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import httptools
import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.proxy.engine.forward import read_whole
from ctxproxy.proxy.upstream.connection import Connection, Stage
from ctxproxy.proxy.upstream.endpoint import Upstream
from ctxproxy.proxy.upstream.loop import VIA_HEADER
from ctxproxy.proxy.upstream.transport import Http1Transport, _serialised
from tests.fakes import FakeUpstream, serve_in_thread

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TIMEOUT = {"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 5.0}


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(scenario, 30))


class Raw:
    """A raw HTTP/1.1 server on 127.0.0.1: ``handler`` serves each connection; the requests' raw bytes are kept."""

    def __init__(self, make: Callable[[Raw], Handler]) -> None:
        self.handler = make(self)
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.closed = asyncio.Event()
        """Set when a connection's client closed it (the server read EOF)."""

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """The next request's head (body read too, by its Content-Length); None at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed.set()
            return None
        length = next((int(line[15:]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")),
                      0)
        self.heads.append(head)
        self.bodies.append(await reader.readexactly(length))
        return head

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def serving(self, tls: ssl.SSLContext | None = None) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=tls)
        port = server.sockets[0].getsockname()[1]
        async with server:
            yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
            server.close()


def ok(body: bytes = b"ok", extra: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return version + b" 200 OK\r\ncontent-length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body


def answering(*answers: bytes, then_close: bool = False) -> Callable[[Raw], Handler]:
    """A handler that answers the server's n-th request with ``answers[n]`` (the last one repeats)."""
    def make(raw: Raw) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await raw.read_request(reader) is not None:
                writer.write(answers[min(len(raw.heads), len(answers)) - 1])
                await writer.drain()
                if then_close:
                    return
        return handler
    return make


async def send(transport: httpx.AsyncBaseTransport, url: str, method: str = "POST", path: str = "/v1/chat/completions",
               timeout: dict[str, float] | None = None, **kwargs: Any) -> tuple[httpx.Response, bytes]:
    request = httpx.Request(method, url + path, extensions={"timeout": timeout or TIMEOUT}, **kwargs)
    response = await transport.handle_async_request(request)
    try:
        return response, b"".join([chunk async for chunk in response.aiter_raw()])  # as the proxy relays it
    finally:
        await response.aclose()


# --- what goes on the wire ------------------------------------------------------------------------------------


def test_the_request_goes_out_as_given_and_nothing_is_added() -> None:
    async def scenario() -> None:
        raw = Raw(answering(ok()))
        async with raw.serving() as url:
            transport = Http1Transport()
            headers = [("X-Mixed-Case", "A"), ("authorization", "Bearer k"), ("x-twice", "1"), ("x-twice", "2")]
            await send(transport, url, path="/v1/chat/completions?q=%2F", headers=headers, content=b"abc")
            await transport.aclose()
        port = url.rsplit(":", 1)[1].encode()
        assert raw.heads == [b"POST /v1/chat/completions?q=%2F HTTP/1.1\r\nHost: 127.0.0.1:" + port + b"\r\n"
                             b"X-Mixed-Case: A\r\nauthorization: Bearer k\r\nx-twice: 1\r\nx-twice: 2\r\n"
                             b"Content-Length: 3\r\n\r\n"]
        assert raw.bodies == [b"abc"]

    run(scenario())


def test_the_upstream_endpoint_sends_the_headers_httpx_would_add_and_no_others() -> None:
    """``Upstream.send`` builds its request from ``stream=`` and adds Host and Content-Length itself, where and
    when httpx's ``content=`` would (Host first, the length last, ``0`` only for a method that carries a body)."""
    async def scenario() -> None:
        raw = Raw(answering(ok()))
        async with raw.serving() as url:
            upstream = Upstream(url + "/v1", Http1Transport(), 5.0, 5.0)
            for method, path, query, body in (("POST", "/v1/chat/completions", "a=1", b"{}"),
                                              ("GET", "/v1/models", "", b""), ("POST", "/v1/files", "", b"")):
                answer = await upstream.send(method, path, query, [(b"Content-Type", b"application/json")], body)
                assert await answer.aread() == b"ok"
                await answer.aclose()
            await upstream.aclose()
        host = b"Host: " + url.removeprefix("http://").encode() + b"\r\n"
        headers = b"Content-Type: application/json\r\n" + VIA_HEADER.encode() + b": " + upstream.instance.encode()
        assert raw.heads == [b"POST /v1/chat/completions?a=1 HTTP/1.1\r\n" + host + headers + b"\r\n"
                             b"Content-Length: 2\r\n\r\n",
                             b"GET /v1/models HTTP/1.1\r\n" + host + headers + b"\r\n\r\n",
                             b"POST /v1/files HTTP/1.1\r\n" + host + headers + b"\r\nContent-Length: 0\r\n\r\n"]
        assert raw.bodies == [b"{}", b"", b""]

    run(scenario())


TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.!#$%&'*+^`|~",
                min_size=1, max_size=20).filter(lambda name: name.lower() not in ("host", "content-length",
                                                                                  "transfer-encoding", "connection"))
VALUE = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)


@given(headers=st.lists(st.tuples(TOKEN, VALUE), max_size=12), body=st.binary(max_size=300),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]), path=st.sampled_from(["/", "/v1/x?a=1&b=%2F"]))
def test_any_request_head_reads_back_as_it_was_given(headers: list[tuple[str, str]], body: bytes, method: str,
                                                     path: str) -> None:
    """What the transport writes, read by httptools' request parser (uvicorn's): the method, the target, each
    header in its order and case, then Host, if it was not given, and the body's length."""
    request = httpx.Request(method, "http://upstream.test:8080" + path, headers=headers, content=body)
    head, sent, _ = asyncio.run(_serialised(request))
    seen: dict[str, Any] = {"headers": [], "body": b""}

    class Events:
        def on_url(self, url: bytes) -> None:
            seen["url"] = seen.get("url", b"") + url

        def on_header(self, name: bytes, value: bytes) -> None:
            seen["headers"].append((name.decode(), value.decode()))

        def on_body(self, chunk: bytes) -> None:
            seen["body"] += chunk

    parser = httptools.HttpRequestParser(Events())
    parser.feed_data(head + sent)
    assert (parser.get_method().decode(), seen["url"].decode()) == (method, path)
    assert seen["headers"] == [(k.decode(), v.decode()) for k, v in request.headers.raw]
    assert seen["headers"][0] == ("Host", "upstream.test:8080") and seen["body"] == sent == body


def test_a_streamed_request_body_goes_whole_with_its_length() -> None:
    async def parts() -> AsyncIterator[bytes]:
        for part in (b"ab", b"", b"cde"):
            yield part

    async def scenario() -> None:
        raw = Raw(answering(ok()))
        async with raw.serving() as url:
            transport = Http1Transport()
            await send(transport, url, content=parts())
            await transport.aclose()
        assert b"content-length: 5\r\n" in raw.heads[0].lower() and b"transfer-encoding" not in raw.heads[0].lower()
        assert raw.bodies == [b"abcde"]

    run(scenario())


def test_a_header_holding_a_line_break_is_refused_before_anything_is_sent() -> None:
    async def scenario() -> None:
        raw = Raw(answering(ok()))
        async with raw.serving() as url:
            transport = Http1Transport()
            with pytest.raises(httpx.LocalProtocolError, match="line break"):
                await send(transport, url, headers=[("x-a", "1\r\nx-smuggled: 2")])
            await transport.aclose()
        assert raw.heads == []

    run(scenario())


def test_the_answer_comes_as_it_was_sent_compressed_and_with_repeated_headers() -> None:
    packed = gzip.compress(b'{"a": 1}')
    answer = (b"HTTP/1.1 201 Made It\r\nContent-Encoding: gzip\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n"
              b"content-length: " + str(len(packed)).encode() + b"\r\n\r\n" + packed)

    async def scenario() -> None:
        raw = Raw(answering(answer))
        async with raw.serving() as url:
            transport = Http1Transport()
            response, body = await send(transport, url, method="GET", path="/v1/models")
            await transport.aclose()
        assert (response.status_code, response.reason_phrase, response.http_version) == (201, "Made It", "HTTP/1.1")
        assert body == packed and response.headers.get_list("set-cookie") == ["a=1", "b=2"]
        assert response.headers.raw[0] == (b"Content-Encoding", b"gzip")

    run(scenario())


@pytest.mark.parametrize(("answer", "read"), [
    (ok(b'{"a": 1}'), b'{"a": 1}'),  # whole with its head: taken as it came
    (ok(gzip.compress(b'{"a": 1}'), b"Content-Encoding: gzip\r\n"), b'{"a": 1}'),  # whole, but encoded: decoded
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n{\"a\": 1}\r\n0\r\n\r\n", b'{"a": 1}'),  # as it comes
], ids=["whole", "whole-gzip", "chunked"])
def test_an_answer_read_whole_is_its_decoded_body_and_its_connection_goes_back(answer: bytes, read: bytes) -> None:
    async def scenario() -> None:
        raw = Raw(answering(answer))
        async with raw.serving() as url:
            transport = Http1Transport()
            for _ in range(2):
                request = httpx.Request("POST", url + "/v1/chat/completions", extensions={"timeout": TIMEOUT})
                assert await read_whole(await transport.handle_async_request(request)) == read
            await transport.aclose()
        assert len(raw.heads) == 2 and raw.connections == 1  # read to the end and closed: the connection reused

    run(scenario())


# --- framing ----------------------------------------------------------------------------------------------------


def test_bodies_by_length_chunked_and_until_close_and_none_where_there_is_none() -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: x-sum\r\n\r\n"
               b"5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nx-sum: 11\r\n\r\n")
    cases = [
        (ok(b"by length"), "POST", b"by length", 1),
        (chunked, "POST", b"hello world", 1),
        (b"HTTP/1.1 204 No Content\r\n\r\n", "POST", b"", 1),
        (b"HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n", "GET", b"", 1),
        (ok(b"123456789").replace(b"\r\n\r\n123456789", b"\r\n\r\n"), "HEAD", b"", 1),
        (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + ok(b"after the hint"), "POST", b"after the hint", 1),
    ]

    async def scenario() -> None:
        for answer, method, expected, _ in cases:
            raw = Raw(answering(answer))
            async with raw.serving() as url:
                transport = Http1Transport()
                for _ in range(2):  # the same connection serves the second: the first answer was framed right
                    response, body = await send(transport, url, method=method)
                    assert body == expected, answer
                    assert "x-sum" not in response.headers and "link" not in response.headers
                await transport.aclose()
            assert raw.connections == 1, answer

    run(scenario())


def _chunked(body: bytes, sizes: list[int], extension: bool, trailer: bool) -> bytes:
    out, at, i = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"], 0, 0
    while at < len(body):
        size = sizes[i % len(sizes)] if sizes else len(body)
        piece, at, i = body[at:at + size], at + size, i + 1
        out.append(f"{len(piece):x}".encode() + (b";ext=1" if extension else b"") + b"\r\n" + piece + b"\r\n")
    out.append(b"0\r\n" + (b"x-trailer: 1\r\n" if trailer else b"") + b"\r\n")
    return b"".join(out)


@given(body=st.binary(max_size=3000), sizes=st.lists(st.integers(1, 400), max_size=6), extension=st.booleans(),
       trailer=st.booleans(), chunked=st.booleans(), cuts=st.lists(st.integers(0, 4000), max_size=12))
@example(body=b"\r\n0\r\n\r\n", sizes=[1], extension=True, trailer=True, chunked=True, cuts=[1, 60, 61, 62])
def test_any_split_of_an_answer_into_socket_reads_gives_the_same_bytes(body: bytes, sizes: list[int],
                                                                       extension: bool, trailer: bool,
                                                                       chunked: bool, cuts: list[int]) -> None:
    """A real connection (on a socket pair) fed the answer's bytes as the loop would, cut anywhere; what has come
    of the body is taken after each read, as a streaming caller does."""
    wire = _chunked(body, sizes, extension, trailer) if chunked else ok(body)
    edges = sorted({0, len(wire), *(cut % (len(wire) + 1) for cut in cuts)})

    async def scenario() -> None:
        left, right = socket.socketpair()
        _, connection = await asyncio.get_running_loop().create_connection(
            lambda: Connection(("http", "upstream.test", 80), lambda _: None), sock=left)
        connection.send(httpx.Request("GET", "http://upstream.test/"), b"GET / HTTP/1.1\r\n\r\n", b"", False)
        got = bytearray()
        for start, end in itertools.pairwise(edges):
            connection.data_received(wire[start:end])
            if connection.answer is not None and connection.answer.stage is not Stage.HEAD:
                got += connection.take()
        assert connection.answer is not None and connection.answer.stage is Stage.DONE
        assert got == body and connection.reusable
        connection.close()
        right.close()

    asyncio.run(scenario())


def test_a_body_without_length_runs_until_the_upstream_closes_and_the_connection_is_not_reused() -> None:
    async def scenario() -> None:
        raw = Raw(answering(b"HTTP/1.1 200 OK\r\n\r\nuntil the end", then_close=True))
        async with raw.serving() as url:
            transport = Http1Transport()
            for _ in range(2):
                assert (await send(transport, url))[1] == b"until the end"
            await transport.aclose()
        assert raw.connections == 2

    run(scenario())


@pytest.mark.parametrize(("answer", "reused"), [
    (ok(extra=b"Connection: close\r\n"), False),
    (ok(version=b"HTTP/1.0"), False),
    (ok(extra=b"Connection: keep-alive\r\n", version=b"HTTP/1.0"), True),
    (ok(), True),
])
def test_a_connection_is_reused_unless_either_side_says_close(answer: bytes, reused: bool) -> None:
    async def scenario() -> None:
        raw = Raw(answering(answer))
        async with raw.serving() as url:
            transport = Http1Transport()
            for _ in range(2):
                assert (await send(transport, url))[1] == b"ok"
            assert (await send(transport, url, headers={"Connection": "close"}))[1] == b"ok"
            assert (await send(transport, url))[1] == b"ok"
            await transport.aclose()
        assert raw.connections == (2 if reused else 4)

    run(scenario())


@pytest.mark.parametrize(("answer", "method"), [(ok() + b"HTTP/1.1 200 OK\r\n", "POST"),
                                               (ok(extra=b"Connection: close\r\n") + b"junk", "POST"),
                                               (ok().replace(b"\r\n\r\nok", b"\r\n\r\n") + b"ok", "HEAD")])
def test_bytes_beyond_the_answer_mean_the_connection_is_not_used_again(answer: bytes, method: str) -> None:
    """A server that sends more than its answer (a body after a HEAD answer, a stray line) leaves the connection's
    framing in doubt: the answer stands, the next request goes on a new connection."""
    async def scenario() -> None:
        raw = Raw(answering(answer))
        async with raw.serving() as url:
            transport = Http1Transport()
            for _ in range(2):
                response, body = await send(transport, url, method=method)
                assert response.status_code == 200 and body == (b"" if method == "HEAD" else b"ok")
                await asyncio.sleep(0.05)
            await transport.aclose()
        assert raw.connections == 2

    run(scenario())


def test_at_the_limit_an_idle_connection_to_another_upstream_is_closed_to_make_room() -> None:
    async def scenario() -> None:
        first, second = Raw(answering(ok(b"first"))), Raw(answering(ok(b"second")))
        async with first.serving() as one, second.serving() as two:
            transport = Http1Transport(max_connections=1)
            assert (await send(transport, one))[1] == b"first"
            assert (await send(transport, two, timeout=TIMEOUT | {"pool": 0.2}))[1] == b"second"
            await asyncio.wait_for(first.closed.wait(), 5)
            await transport.aclose()

    run(scenario())


# --- failures -----------------------------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("url", [f"http://127.0.0.1:{closed_port()}", "http://nothing-here.invalid"])
def test_an_upstream_that_cannot_be_reached_is_a_connect_error(url: str) -> None:
    async def scenario() -> None:
        transport = Http1Transport()
        with pytest.raises(httpx.ConnectError):
            await send(transport, url)
        assert transport.pool.tls is None

    run(scenario())


def test_a_connection_the_upstream_never_accepts_is_a_connect_timeout() -> None:
    async def scenario() -> None:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)
            port = listener.getsockname()[1]
            queued = []
            for _ in range(4):  # fill the accept queue: further handshakes are not answered
                client = socket.socket()
                client.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    client.connect(("127.0.0.1", port))
                queued.append(client)
            await asyncio.sleep(0.05)
            try:
                with pytest.raises(httpx.ConnectTimeout):
                    await send(Http1Transport(), f"http://127.0.0.1:{port}", timeout=TIMEOUT | {"connect": 0.3})
            finally:
                for client in queued:
                    client.close()

    run(scenario())


def test_an_answer_that_is_not_http_is_a_remote_protocol_error() -> None:
    async def scenario() -> None:
        raw = Raw(answering(b"HTTX/1.1 200 OK\r\n\r\n"))
        async with raw.serving() as url:
            with pytest.raises(httpx.RemoteProtocolError, match="not HTTP"):
                await send(Http1Transport(), url)

    run(scenario())


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset, not a FIN (SO_LINGER 0)."""
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@pytest.mark.parametrize("reset", [False, True])
def test_a_connection_lost_in_the_middle_of_the_body_is_a_read_error(reset: bool) -> None:
    def make(raw: Raw) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await raw.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
            await writer.drain()
            await asyncio.sleep(0.1)
            _reset(writer) if reset else writer.close()
        return handler

    async def scenario() -> None:
        raw = Raw(make)
        async with raw.serving() as url:
            transport = Http1Transport()
            request = httpx.Request("POST", url + "/v1/chat/completions", extensions={"timeout": TIMEOUT})
            response = await transport.handle_async_request(request)
            assert response.status_code == 200
            with pytest.raises(httpx.ReadError, match="middle of the answer's body"):
                await response.aread()
            await response.aclose()
            assert transport.pool._count == 0

    run(scenario())


def _slow(answer: bytes, pause: float, first: int = 0) -> Callable[[Raw], Handler]:
    """Sends ``answer[:first]`` at once, then the rest byte by byte, ``pause`` s apart."""
    def make(raw: Raw) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await raw.read_request(reader)
            writer.write(answer[:first])
            for i in range(first, len(answer)):
                await asyncio.sleep(pause)
                writer.write(answer[i:i + 1])
                await writer.drain()
            await reader.read()
        return handler
    return make


def test_a_slow_answer_is_no_timeout_while_bytes_keep_coming() -> None:
    async def scenario() -> None:
        raw = Raw(_slow(ok(b"0123456789"), 0.03))
        async with raw.serving() as url:
            timeout = TIMEOUT | {"read": 0.5}
            started = asyncio.get_running_loop().time()
            assert (await send(Http1Transport(), url, timeout=timeout))[1] == b"0123456789"
            assert asyncio.get_running_loop().time() - started > 0.5  # longer than the timeout, all told

    run(scenario())


@pytest.mark.parametrize("where", ["head", "body"])
def test_silence_longer_than_the_read_timeout_is_a_read_timeout(where: str) -> None:
    answer = ok(b"01")

    async def scenario() -> None:
        raw = Raw(_slow(answer, 1.0, first=len(answer) - 1 if where == "body" else 5))
        async with raw.serving() as url:
            transport = Http1Transport()
            timeout = TIMEOUT | {"read": 0.2}
            with pytest.raises(httpx.ReadTimeout):
                await send(transport, url, timeout=timeout)
            assert transport.pool._count == 0  # the connection is closed, not pooled

    run(scenario())


def test_at_the_connection_limit_a_request_waits_for_a_free_one_up_to_the_pool_timeout() -> None:
    async def scenario() -> None:
        raw = Raw(answering(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab", ok(b"cd")))
        async with raw.serving() as url:
            transport = Http1Transport(max_connections=1)
            held = await transport.handle_async_request(
                httpx.Request("GET", url + "/a", extensions={"timeout": TIMEOUT}))  # its body never ends
            with pytest.raises(httpx.PoolTimeout):
                await send(transport, url, timeout=TIMEOUT | {"pool": 0.2})
            async with asyncio.TaskGroup() as group:
                waiting = group.create_task(send(transport, url))
                await asyncio.sleep(0.05)
                assert not waiting.done()
                await held.aclose()  # its body was not read to the end: closed, which frees the room
            assert waiting.result()[1] == b"cd"
            await transport.aclose()
        assert raw.connections == 2

    run(scenario())


# --- the replay of a chat on a reused connection ------------------------------------------------------------------


def _drops_second_request(raw: Raw) -> Handler:
    """Answers a connection's first request; closes the connection, unanswered, when the second arrives."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await raw.read_request(reader)
        writer.write(ok(b"fresh"))
        await raw.read_request(reader)
    return handler


@pytest.mark.parametrize(("method", "path", "replayed"), [
    ("POST", "/v1/chat/completions", True), ("POST", "/v1/messages", True), ("GET", "/v1/models", True),
    ("DELETE", "/v1/files/f", True), ("POST", "/v1/files", False), ("PATCH", "/v1/chat/completions", False)])
def test_a_chat_sent_on_a_reused_connection_that_was_dropped_unanswered_is_sent_once_more(method: str, path: str,
                                                                                         replayed: bool) -> None:
    """As the other idempotent methods (RFC 9112 §9.3.1; aiohttp, the client before, did it for those too)."""
    async def scenario() -> None:
        raw = Raw(_drops_second_request)
        async with raw.serving() as url:
            transport = Http1Transport()
            assert (await send(transport, url, method, path))[1] == b"fresh"
            if replayed:
                assert (await send(transport, url, method, path))[1] == b"fresh"
            else:
                with pytest.raises(httpx.RemoteProtocolError, match="without answering"):
                    await send(transport, url, method, path)
            await transport.aclose()
        assert (len(raw.heads), raw.connections) == ((3, 2) if replayed else (2, 1))

    run(scenario())


def test_a_chat_is_not_sent_again_when_its_connection_was_new_or_the_answer_had_begun() -> None:
    def make(raw: Raw) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await raw.read_request(reader)
            if raw.connections == 2:
                writer.write(b"HTTP/1.1 200")  # one byte of answer is enough
                await writer.drain()
        return handler

    async def scenario() -> None:
        raw = Raw(make)
        async with raw.serving() as url:
            transport = Http1Transport()
            with pytest.raises(httpx.RemoteProtocolError, match="without answering"):
                await send(transport, url)
            with pytest.raises(httpx.RemoteProtocolError, match="in the middle of the answer's head"):
                await send(transport, url)
        assert len(raw.heads) == 2

    run(scenario())


# --- streaming, the pool's life -----------------------------------------------------------------------------------


def test_a_streamed_answer_reaches_the_caller_event_by_event() -> None:
    """The second event is only sent once the caller has the first: nothing waits for more bytes to come."""
    seen = asyncio.Event()

    def make(raw: Raw) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await raw.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"d\r\ndata: first\n\n\r\n")
            await asyncio.wait_for(seen.wait(), 5)
            writer.write(b"e\r\ndata: second\n\n\r\n0\r\n\r\n")
            await reader.read()
        return handler

    async def scenario() -> None:
        raw = Raw(make)
        async with raw.serving() as url:
            transport = Http1Transport()
            response = await transport.handle_async_request(
                httpx.Request("POST", url + "/v1/chat/completions", extensions={"timeout": TIMEOUT}))
            chunks = []
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                seen.set()
            assert chunks == [b"data: first\n\n", b"data: second\n\n"]
            await transport.aclose()

    run(scenario())


def test_a_large_answer_read_slowly_arrives_whole() -> None:
    body = bytes(range(256)) * 16_384  # 4 MB: more than the pool holds for a reader that lags

    async def scenario() -> None:
        raw = Raw(answering(ok(body)))
        async with raw.serving() as url:
            transport = Http1Transport()
            response = await transport.handle_async_request(
                httpx.Request("GET", url + "/big", extensions={"timeout": TIMEOUT}))
            got = bytearray()
            async for chunk in response.aiter_raw():
                got += chunk
                await asyncio.sleep(0.001)
            assert got == body
            assert (await send(transport, url, method="GET"))[1] == body  # read to the end: reused
            await transport.aclose()
        assert raw.connections == 1

    run(scenario())


def test_a_cancelled_request_closes_its_connection() -> None:
    def make(raw: Raw) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await raw.read_request(reader)
            await raw.read_request(reader)  # EOF: the client closed the connection
        return handler

    async def scenario() -> None:
        raw = Raw(make)
        async with raw.serving() as url:
            transport = Http1Transport()
            async with asyncio.TaskGroup() as group:
                task = group.create_task(send(transport, url))
                while not raw.heads:
                    await asyncio.sleep(0.01)
                task.cancel()
            assert task.cancelled()
            await asyncio.wait_for(raw.closed.wait(), 5)
            assert transport.pool._count == 0

    run(scenario())


def test_idle_connections_expire_and_aclose_closes_the_rest() -> None:
    async def scenario() -> None:
        raw = Raw(answering(ok()))
        async with raw.serving() as url:
            transport = Http1Transport(keepalive_seconds=0.2)
            await send(transport, url)
            await asyncio.wait_for(raw.closed.wait(), 5)  # closed by the pool once idle for 0.2 s
            assert transport.pool._count == 0
            raw.closed.clear()
            await send(transport, url)
            await send(transport, url)
            assert raw.connections == 2  # the second request reused the new connection
            await transport.aclose()
            await asyncio.wait_for(raw.closed.wait(), 5)

    run(scenario())


def test_a_kept_alive_connection_the_upstream_closed_while_idle_is_not_used_again() -> None:
    async def scenario() -> None:
        raw = Raw(answering(ok(), then_close=True))
        async with raw.serving() as url:
            transport = Http1Transport()
            for _ in range(3):
                assert (await send(transport, url, path="/v1/files"))[1] == b"ok"  # never replayed: not needed
                await asyncio.sleep(0.05)
            await transport.aclose()
        assert raw.connections == 3

    run(scenario())


def test_the_fake_upstream_under_uvicorn_streams_and_answers_through_the_transport() -> None:
    async def scenario(url: str) -> None:
        transport = Http1Transport()
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
        response, content = await send(transport, url, path="/v1/chat/completions", content=body,
                                       headers={"content-type": "application/json"})
        assert response.status_code == 200 and content.endswith(b"data: [DONE]\n\n")
        response, content = await send(transport, url, method="GET", path="/v1/models")
        assert b"fake-model" in content
        await transport.aclose()

    with serve_in_thread(FakeUpstream()) as url:
        run(scenario(url))


# --- TLS ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_an_https_upstream_is_verified_with_a_context_built_on_first_use(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    served = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    served.load_cert_chain(cert, key)

    async def scenario() -> None:
        raw = Raw(answering(ok(b"secret")))
        async with raw.serving(served) as url:
            untrusting = Http1Transport()
            assert untrusting.pool.tls is None
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await send(untrusting, url)  # self-signed: not among the system's CAs
            assert untrusting.pool.tls is not None and untrusting.pool.tls.verify_mode == ssl.CERT_REQUIRED
            trusting = Http1Transport(tls=lambda: ssl.create_default_context(cafile=cert))
            for _ in range(2):
                assert (await send(trusting, url))[1] == b"secret"
            await trusting.aclose()
        assert (raw.connections, len(raw.heads)) == (1, 2)  # the refused handshake never reached the handler

    run(scenario())
