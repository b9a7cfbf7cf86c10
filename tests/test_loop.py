"""A proxy whose upstream leads back to itself answers 508 ``proxy_loop`` at once (issue #10 item 11: it recursed
for 15 s into 212 nested sessions and a 502 carrying hundreds of ``date`` headers)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from starlette.datastructures import Headers

from ctxproxy.config import load_settings
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.proxy.errors import ProxyLoop
from ctxproxy.proxy.upstream.loop import MAX_HOPS, onward, refuse_loop
from ctxproxy.store import Journal
from tests.fakes import FakeUpstream

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@contextmanager
def proxy_to_itself(tmp_path: Path) -> Iterator[str]:
    """A real proxy on loopback whose upstream is its own address (the socket is bound first to know it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": url + "/v1",
                                  "CTXPROXY_UPSTREAM_TIMEOUT": "3"})
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.mark.e2e
@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/chat/completions", BODY), ("POST", "/v1/chat/completions", BODY | {"stream": True}),
    ("GET", "/v1/models", None)])
def test_an_upstream_that_is_the_proxy_itself_is_a_508_proxy_loop(
        tmp_path: Path, method: str, path: str, body: dict[str, object] | None) -> None:
    with proxy_to_itself(tmp_path) as url:
        response = httpx.request(method, url + path, json=body, timeout=30)
    assert response.status_code == 508, response.text
    error = response.json()["error"]
    assert error["code"] == "proxy_loop" and "--upstream" in error["message"]
    assert [k.lower() for k, _ in response.headers.raw].count(b"date") == 1
    if path.endswith("completions"):  # the outer request is journaled with the loop's answer; the inner never was
        db = Journal(tmp_path / "journal.db").conn
        assert db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0] == 1
        assert db.execute("SELECT status FROM responses").fetchall() == [(508,)]


def test_a_client_naming_too_many_hops_is_refused_before_anything_is_journaled(
        client: TestClient, fake: FakeUpstream) -> None:
    chain = ", ".join(f"p{i}" for i in range(MAX_HOPS))
    response = client.post("/v1/chat/completions", json=BODY, headers={"X-Ctx-Via": chain})
    assert response.status_code == 508 and response.json()["error"]["code"] == "proxy_loop"
    assert fake.chats == []
    assert client.post("/v1/chat/completions", json=BODY, headers={"X-Ctx-Via": "p1, p2"}).status_code == 200
    assert fake.last_chat.headers["x-ctx-via"].startswith("p1, p2, ")


def test_the_chain_grows_by_this_instance_and_refuses_it() -> None:
    assert onward("", "me") == (b"x-ctx-via", b"me") and onward("a, b", "me") == (b"x-ctx-via", b"a, b, me")
    refuse_loop(Headers({"x-ctx-via": "a, b"}), "me")
    with pytest.raises(ProxyLoop):
        refuse_loop(Headers({"x-ctx-via": "a,me"}), "me")
