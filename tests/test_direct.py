"""The chat route served without Starlette's stack (``proxy.edge.direct``), answering as the stack answered."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ctxproxy.proxy.edge import chat as chat_module
from ctxproxy.proxy.edge.direct import serve_directly
from ctxproxy.proxy.errors import BadRequest, CtxError
from tests.conftest import chat
from tests.test_errors import assert_envelope


def test_a_chat_request_does_not_go_through_starlette_s_router(client: TestClient,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def routed(*args: object) -> None:
        raise AssertionError("routed by Starlette")

    monkeypatch.setattr(Route, "handle", routed)
    answer = client.post("/v1/chat/completions", json=chat("hi"))
    assert answer.status_code == 200 and answer.headers["x-ctx-session"]
    assert client.get("/v1/chat/completions").status_code != 200  # any other method: Starlette's, routed


def test_errors_before_the_session_and_unexpected_ones_answer_in_the_envelope(client: TestClient,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    assert_envelope(client.post("/v1/chat/completions", content=b"{not json"), 400, "invalid_request_error")
    counted = client.app.state.ctx.metrics.exposition()  # type: ignore[attr-defined]
    assert b'outcome="refused"' in counted  # the refusal was noted (``_refused``), as behind the router

    def broken(*args: object) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(chat_module, "incoming_request", broken)
    error = assert_envelope(client.post("/v1/chat/completions", json=chat("hi")), 500, "server_error")
    assert error["code"] == "internal_error"


class _Sent:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)


async def _nothing() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _rendered(request: Request, exc: Exception) -> Response:
    return Response(type(exc).__name__.encode(), 418)


_HANDLERS = {CtxError: _rendered, HTTPException: _rendered, Exception: _rendered}
_SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}


def _served(endpoint: Any) -> tuple[_Sent, BaseException | None]:
    sent, raised = _Sent(), None
    try:
        asyncio.run(serve_directly(endpoint, _HANDLERS, dict(_SCOPE), _nothing, sent))
    except Exception as exc:
        raised = exc
    return sent, raised


def test_an_error_is_rendered_by_its_class_s_handler_and_an_unexpected_one_raised_again_after() -> None:
    async def refused(request: Request) -> Response:
        raise BadRequest("no")

    async def bug(request: Request) -> Response:
        raise ValueError("bug")

    sent, raised = _served(refused)
    assert raised is None and sent.messages[0]["status"] == 418 and sent.messages[1]["body"] == b"BadRequest"
    sent, raised = _served(bug)
    assert isinstance(raised, ValueError) and sent.messages[1]["body"] == b"ValueError"


def test_nothing_is_rendered_once_the_response_has_begun() -> None:
    class Breaks(Response):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            raise BadRequest("too late")

    async def begins(request: Request) -> Response:
        return Breaks()

    sent, raised = _served(begins)
    assert [m["type"] for m in sent.messages] == ["http.response.start"]
    assert isinstance(raised, RuntimeError) and isinstance(raised.__cause__, BadRequest)  # as Starlette raises it
