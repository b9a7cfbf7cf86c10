"""Slow and too many clients (issue #10, item 6), over real uvicorn on loopback with the proxy's own protocol.

The defect: 2000 connections with half-sent headers stayed open (fds 69 → 2069). Now a request's headers must be
complete within ``client_header_timeout``, its body within ``client_body_timeout`` (408), and connections beyond
``max_connections`` are answered 503 and closed.
"""

from __future__ import annotations

import os
import selectors
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxproxy.config import Settings, load_settings
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.proxy.edge.serving import HeldPieces, uvicorn_options
from tests.conftest import chat
from tests.fakes import FakeUpstream, Reply, completion, serve_in_thread

pytestmark = pytest.mark.e2e


def settings_with(tmp_path: Path, **env: str) -> Settings:
    return load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                              **{f"CTXPROXY_{k.upper()}": v for k, v in env.items()}})


@contextmanager
def proxy(settings: Settings, fake: FakeUpstream | None = None) -> Iterator[tuple[str, int]]:
    app = create_app(settings, upstream_transport=httpx.ASGITransport(app=fake or FakeUpstream()))
    with serve_in_thread(app, **uvicorn_options(settings)) as url:
        yield url, int(url.rsplit(":", 1)[1])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def connect(port: int, send: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    if send:
        sock.sendall(send)
    return sock


def read_until_closed(socks: list[socket.socket], seconds: float) -> dict[socket.socket, bytes]:
    """What each socket received until the server closed it; sockets still open after ``seconds`` are left out."""
    got = {s: b"" for s in socks}
    selector = selectors.DefaultSelector()
    for s in socks:
        selector.register(s, selectors.EVENT_READ)
    closed: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + seconds
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=0.2):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:  # the server closed with our late bytes unread: a reset, after its answer
                chunk = b""
            got[sock] += chunk
            if not chunk:
                selector.unregister(sock)
                closed[sock] = got[sock]
    selector.close()
    return closed


HALF_SENT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"


def held_connection(port: int) -> socket.socket:
    """A connection the server has surely taken (it answered a request on it), now holding half a request."""
    sock = connect(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    got = b""
    while not got.endswith(b"}"):
        chunk = sock.recv(65536)
        assert chunk, f"the server closed a connection it should hold: {got!r}"
        got += chunk
    sock.sendall(HALF_SENT)
    return sock


def test_connections_with_half_sent_headers_are_closed_and_their_fds_freed(tmp_path: Path) -> None:
    with proxy(settings_with(tmp_path, client_header_timeout="1")) as (url, port):
        baseline = open_fds()
        half = [connect(port, HALF_SENT) for _ in range(200)]
        silent = [connect(port) for _ in range(20)]
        try:
            closed = read_until_closed(half + silent, seconds=30)
        finally:
            remaining = open_fds()
            for s in half + silent:
                s.close()
        assert len(closed) == len(half) + len(silent), "connections the proxy kept open past the header timeout"
        assert all(closed[s].startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in closed[s] for s in half)
        assert all(closed[s] == b"" for s in silent)  # nothing begun: closed without a word, as keep-alive does
        assert remaining <= baseline + len(half + silent) + 5  # the server's sides were released before ours
        assert open_fds() <= baseline + 5
        assert httpx.get(url + "/healthz").status_code == 200


def test_the_header_deadline_never_cuts_a_request_in_progress_or_a_kept_alive_connection(tmp_path: Path) -> None:
    fake = FakeUpstream()
    fake.enqueue(Reply(body=completion("slow but fine"), delay=2.0))  # four header timeouts long
    with proxy(settings_with(tmp_path, client_header_timeout="0.5"), fake) as (url, _), httpx.Client() as client:
        slow = client.post(url + "/v1/chat/completions", json=chat("hi"))
        assert slow.status_code == 200 and slow.json()["choices"][0]["message"]["content"] == "slow but fine"
        again = client.post(url + "/v1/chat/completions", json=chat("hi", "slow but fine", "more"))
        assert again.status_code == 200  # on the same connection, kept alive


def test_a_body_that_trickles_gets_a_408_and_nothing_is_journaled(tmp_path: Path) -> None:
    settings = settings_with(tmp_path, client_body_timeout="1")
    fake = FakeUpstream()
    with proxy(settings, fake) as (url, port):
        sock = connect(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{")
        try:
            with selectors.DefaultSelector() as ready:
                ready.register(sock, selectors.EVENT_READ)
                for _ in range(100):  # one byte every 0.1 s: never idle, never done
                    sock.sendall(b" ")
                    if ready.select(timeout=0.1):
                        break
        except (BrokenPipeError, ConnectionResetError):
            pass  # the 408 came and the server closed between two bytes: its answer is still ours to read
        try:
            got = read_until_closed([sock], seconds=5).get(sock, b"")
        finally:
            sock.close()
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert b'"request_timeout"' in got and b"client_body_timeout" in got
        assert b"connection: close" in got.lower()
        assert fake.chats == [] and httpx.get(url + "/ctx/sessions").json()["sessions"] == []


def test_connections_beyond_the_cap_are_answered_503_and_closed(tmp_path: Path) -> None:
    with proxy(settings_with(tmp_path, max_connections="5")) as (url, port):
        held = [held_connection(port) for _ in range(5)]
        extra = connect(port)
        closed = read_until_closed([extra], seconds=10)
        for s in [*held, extra]:
            s.close()
        assert extra in closed, "a connection beyond max_connections was kept open"
        assert closed[extra].startswith(b"HTTP/1.1 503 ") and b"max_connections" in closed[extra]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)  # the held connections are still being released
        assert httpx.get(url + "/healthz").status_code == 200


async def echo_pieces(scope: Any, receive: Any, send: Any) -> None:
    """An app that answers with the body it received and how many pieces it came in."""
    if scope["type"] != "http":
        return
    pieces, more = [], True
    while more:
        message = await receive()
        pieces.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(pieces)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"x-pieces", str(len(pieces)).encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def test_a_body_in_many_pieces_reaches_the_app_as_sent(tmp_path: Path) -> None:
    """The protocol hands the app httptools' pieces as they came (``HeldPieces``): the bytes are the body's, in
    order, however they were cut, and a piece of none at all (an empty body) is an empty body."""
    settings = settings_with(tmp_path)
    raw = bytes(range(256)) * 12_000  # 3 MB, every piece distinct from its neighbours
    with serve_in_thread(echo_pieces, **uvicorn_options(settings)) as url, httpx.Client(timeout=30) as client:
        sent = client.post(url, content=(raw[at:at + 70_001] for at in range(0, len(raw), 70_001)))
        assert sent.content == raw and int(sent.headers["x-pieces"]) > 1
        assert client.post(url, content=b"").content == b""


def test_held_pieces_hand_one_piece_over_as_it_came_and_several_joined() -> None:
    held = HeldPieces()
    held += b"first"
    assert bytes(held) is held.pieces[0] and len(held) == 5
    held += b", second"
    assert bytes(held) == b"first, second" and len(held) == 13
