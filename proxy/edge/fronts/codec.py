"""The seam every non-chat front plugs into: a codec at the edge, the chat engine behind it.

ctxproxy's internal model is the OpenAI chat-completions body: the journal, sessions, budget, projection, stubs
and context tools all read and write chat messages (``proxy.edge.chat`` → ``proxy.engine``). A front for another
protocol (Anthropic Messages, OpenAI Responses …) is a *codec*: it decodes the client's request into a chat body,
the engine runs exactly as for a chat client, and the front encodes the engine's answer back, buffered or
streamed. The engine never learns which protocol the agent spoke.

How a front plugs in:

1. Implement ``Front`` (and an ``Encoder`` per request): ``decode`` turns the raw request into a ``Decoded``: the
   chat body (``messages``, ``tools``, ``stream`` …), the session key the protocol names (a header such as
   ``X-Claude-Code-Session-Id``), and anything the front wants back when it encodes (``Decoded.context``: the
   client's model name, its original body …). Refuse what cannot be mapped with a ``CtxError`` (a 400 that says
   what and why); never drop content silently. Data with no chat equivalent that must travel back byte for byte
   (signatures, opaque reasoning items) is the front's to carry, e.g. in ``context`` or as extra keys on a
   message that its own encoder reads back.
2. ``encoder(decoded)`` returns the object that turns the engine's answer into the protocol: ``whole`` gets a
   buffered answer (the chat completion JSON, or an error in the OpenAI envelope with its status) and returns the
   protocol's body; ``feed`` gets the chat SSE stream in arbitrary pieces (``data:`` chunks, ``: comment`` lines
   the engine sends while context tools run, a final ``[DONE]``) and returns the protocol's SSE bytes; ``close``
   (async: it may look something up, such as the prompt's projected size when the upstream sent no usage) ends
   the stream with the protocol's closing events. A stream is only ever encoded for a 200 ``text/event-stream``
   answer; everything else (errors included) goes through ``whole``.
3. ``error(exc)`` renders a ``CtxError`` raised before the engine answered (bad body, loop, too large …) in the
   protocol's own error shape.
4. Native upstreams: when the upstream speaks the client's protocol itself (api.anthropic.com, an OpenAI
   Responses endpoint), set ``Decoded.upstream`` to an ``UpstreamCodec`` (``proxy.engine.forward``): the engine
   still plans and cuts the chat body, and each forward is encoded back into the protocol (``request``: the
   client's fields kept byte for byte, its path and query) and its answer decoded into chat (``response``) for
   the engine to read; the front's ``Encoder`` then turns that chat answer into the protocol again (carry what
   chat cannot say, such as signatures, in extra keys the encoder reads back). Without it (translated mode) the
   chat body goes to the upstream's ``/chat/completions``.
5. Route it: ``Route("/v1/<path>", lambda request: serve(request, MyFront(...)), methods=["POST"])`` in
   ``proxy.edge.app``.

``serve`` reads the body (within ``max_body_bytes``), decodes it, builds the inner request the chat edge expects
(the decoded body, the session header set from ``Decoded.session`` unless the client set it itself; the path stays
the client's, so the journal says which protocol was spoken) and wraps the engine's response in ``EncodedResponse``.
Translated, the forwards go to ``/v1/chat/completions`` without the client's query. The context tools' calls are
taken out of the chat stream by the engine before the encoder sees it, so the agent reads one coherent answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from ctxproxy.proxy.edge.body import read_body
from ctxproxy.proxy.edge.chat import chat_completions
from ctxproxy.proxy.engine.forward import UPSTREAM_CODEC, UpstreamCodec
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.errors import BadRequest, CtxError
from ctxproxy.proxy.observe.logs import note_refusal

__all__ = ["CHAT_PATH", "ChatUpstream", "Decoded", "EncodedResponse", "Encoder", "Front", "json_object", "serve"]

CHAT_PATH = "/v1/chat/completions"
"""Where a translated forward goes: the upstream's chat route."""


@dataclass(frozen=True)
class Decoded:
    """A client request in the internal model."""

    body: dict[str, Any]
    """The chat-completions body the engine runs."""
    session: str | None = None
    """The session key the protocol names, used when the client sends no ``session_header`` of its own."""
    context: dict[str, Any] = field(default_factory=dict)
    """The front's own data for its encoder (never read by the seam)."""
    upstream: UpstreamCodec | None = None
    """Native mode: how each forward speaks the upstream's protocol; None: chat completions upstream."""


class Encoder(Protocol):
    """One request's answer, from the chat engine's shape to the protocol's."""

    async def whole(self, status: int, content: bytes) -> tuple[int, bytes]:
        """A buffered answer or an error (the OpenAI envelope): the protocol's status and JSON body."""
        ...

    def feed(self, chunk: bytes) -> bytes:
        """Some bytes of the chat SSE stream (any split): the protocol's SSE bytes they make, possibly none."""
        ...

    async def close(self) -> bytes:
        """The stream ended (after ``[DONE]``, or cut short): the protocol's closing events, if not sent yet."""
        ...


class Front(Protocol):
    """A protocol ctxproxy speaks to agents, as a codec around the chat engine."""

    async def decode(self, raw: bytes, request: Request) -> Decoded: ...
    def encoder(self, decoded: Decoded) -> Encoder: ...
    def error(self, exc: CtxError) -> Response: ...


def json_object(raw: bytes, expected: str) -> dict[str, Any]:
    """A front's request body as a JSON object, or a 400 naming what it should hold (``expected``); the chat edge's
    parser, with its limits on depth and integers, comes after on the decoded body."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(f"The request body must be a JSON object with {expected}.", code="invalid_json")
    return body


async def serve(request: Request, front: Front) -> Response:
    """Decode, run the chat engine on the decoded body, encode its answer; errors in the front's shape."""
    state: AppState = request.app.state.ctx
    try:
        raw = await read_body(request, state.settings.max_body_bytes, state.settings.client_body_timeout)
        decoded = await front.decode(raw, request)
        inner = _inner_request(request, orjson.dumps(decoded.body), decoded.session, state.settings.session_header)
        inner.scope[UPSTREAM_CODEC] = decoded.upstream or ChatUpstream()
        return EncodedResponse(await chat_completions(inner), front.encoder(decoded))
    except CtxError as exc:  # before a session: the engine renders its own failures (``proxy.edge.chat``)
        note_refusal(state.metrics, f"{request.method} {request.url.path}", exc.status, exc.code, exc.message)
        return front.error(exc)


def _inner_request(request: Request, body: bytes, session: str | None, session_header: str) -> Request:
    """The request the chat edge reads: the decoded body on the chat path, the client's headers otherwise."""
    own = session_header.lower().encode("latin-1")
    headers = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"content-length"]
    if session and not any(k.lower() == own for k, _ in headers):
        headers.append((own, session.encode("utf-8")))
    headers.append((b"content-length", str(len(body)).encode()))
    scope: Scope = {**request.scope, "headers": headers}
    return Request(scope, _body_then(body, request.receive))


def _body_then(body: bytes, receive: Receive) -> Receive:
    """An ASGI ``receive`` that gives ``body`` once, then the client's own (its disconnect)."""
    sent = False

    async def inner() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return inner


class ChatUpstream:
    """Translated mode's ``UpstreamCodec``: the chat body to the upstream's chat route, the answer as it comes."""

    path, query = CHAT_PATH, ""

    def request(self, body: bytes) -> bytes:
        return body

    def response(self, answer: httpx.Response) -> httpx.Response:
        return answer


class EncodedResponse(Response):
    """The engine's response, sent through an ``Encoder``: a 200 event stream piece by piece, the rest whole."""

    def __init__(self, inner: Response, encoder: Encoder) -> None:
        self.inner, self.encoder = inner, encoder
        self.status_code, self.raw_headers, self.background = inner.status_code, inner.raw_headers, None
        self._start: Message | None = None
        self._streamed = False
        self._held: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def encoding(message: Message) -> None:
            if message["type"] == "http.response.start":
                await self._started(message, send)
            elif message["type"] == "http.response.body":
                await self._body(message, send)
            else:
                await send(message)

        await self.inner(scope, receive, encoding)

    async def _started(self, message: Message, send: Send) -> None:
        self._start = message
        content_type = dict((k.lower(), v) for k, v in message.get("headers", [])).get(b"content-type", b"")
        self._streamed = message["status"] == 200 and content_type.startswith(b"text/event-stream")
        if self._streamed:
            await send({**message, "headers": _headers(message, b"text/event-stream; charset=utf-8", None)})

    async def _body(self, message: Message, send: Send) -> None:
        chunk, more = message.get("body", b""), message.get("more_body", False)
        if self._streamed:
            out = self.encoder.feed(chunk) + (b"" if more else await self.encoder.close())
            if out or not more:
                await send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self._held.append(chunk)
        if more:
            return
        assert self._start is not None
        status, content = await self.encoder.whole(self._start["status"], b"".join(self._held))
        headers = _headers(self._start, b"application/json", len(content))
        await send({**self._start, "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content, "more_body": False})


def _headers(start: Message, content_type: bytes, length: int | None) -> list[tuple[bytes, bytes]]:
    """The engine's response headers with the encoded body's type and length."""
    drop = {b"content-type", b"content-length", b"content-encoding"}
    out = [(k, v) for k, v in start.get("headers", []) if k.lower() not in drop]
    out.append((b"content-type", content_type))
    if length is not None:
        out.append((b"content-length", str(length).encode()))
    return out
