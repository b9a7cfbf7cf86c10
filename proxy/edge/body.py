"""The HTTP edge: read a request body within the size limit and validate the fields the proxy relies on.

Only the keys ctxproxy reads are checked (``proxy.wire``); everything else passes upstream untouched. Each error
names the offending field in ``param`` (``messages[3].role``) so a client can fix its request. A body is also
refused when the proxy could not write it again (the journal and a rewritten forward re-serialise it): nested
deeper than ``MAX_DEPTH``, or holding an integer beyond 64 bits. Every refusal happens before anything is
journaled or forwarded.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any, NoReturn, cast

import orjson
from starlette.requests import ClientDisconnect, Request

from ctxproxy.proxy.core.arrival import Arrival
from ctxproxy.proxy.core.pieces import Pieces
from ctxproxy.proxy.core.prefix import Match, Prefixes
from ctxproxy.proxy.errors import BadRequest, PayloadTooLarge, RequestTimeout
from ctxproxy.proxy.wire import ChatBody

__all__ = ["MAX_DEPTH", "parse_chat_body", "read_body", "read_chat_body", "refuse_unwritable"]

_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_DEPTH = 254
"""Levels of nesting a body may have: what orjson writes (it parses 1024, and the stdlib fallback recurses), so the
journal and a rewritten forward can serialise every accepted body. Real requests nest ~10 deep (a tool's schema)."""
_INT_RANGE = (-(2 ** 63), 2 ** 64 - 1)
"""The integers orjson can write (the stdlib fallback parses any)."""


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The whole body, refusing (413) as soon as it is known to exceed ``limit`` bytes, and (408) when it has
    not all arrived within ``timeout`` seconds (a client trickling its body would hold a connection forever)."""
    chunks: list[bytes] = []
    await _read(request, limit, timeout, chunks.append)
    return b"".join(chunks)


async def read_chat_body(request: Request, limit: int, timeout: float | None,
                         prefixes: Prefixes) -> tuple[Pieces, Match | None]:
    """``read_body``'s body, compared with the kept ones as it arrives (``proxy.core.arrival``): what it repeats
    of one is that one's bytes, never copied; and the kept body it is to be parsed from, if any."""
    arrival = Arrival(prefixes)
    await _read(request, limit, timeout, arrival.feed)
    return arrival.finish()


async def _read(request: Request, limit: int, timeout: float | None, take: Callable[[bytes], None]) -> None:
    """The body's pieces to ``take`` as they arrive, within ``limit`` and ``timeout`` (``read_body``).

    Read from the ASGI ``receive`` under a timer of the loop's, not through Starlette's ``request.stream()`` (an
    async generator asyncio registers) under anyio's ``move_on_after`` (a cancel scope): the two cost ~20 µs of
    every request, whose small body has nearly always arrived with its head."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    task, expired = asyncio.current_task(), []
    assert task is not None
    timer = None if timeout is None else asyncio.get_running_loop().call_later(
        timeout, lambda: expired.append(task.cancel()))
    received = [0]
    try:
        await _receive_body(request, take, limit, received)
    except asyncio.CancelledError:
        if expired and task.uncancel() == 0:  # cancelled by the timer alone, not (also) from outside
            raise _too_slow(timeout, received[0]) from None
        raise
    finally:
        if timer is not None:
            timer.cancel()


async def _receive_body(request: Request, take: Callable[[bytes], None], limit: int, received: list[int]) -> None:
    """The body's pieces to ``take``, as ``request.stream()`` reads them (a client gone: ``ClientDisconnect``);
    ``received[0]``: the bytes that came so far."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        received[0] += len(chunk)
        if received[0] > limit:
            raise _too_large(received[0], limit)
        if chunk:
            take(chunk)
        if not message.get("more_body", False):
            return


def _too_slow(timeout: float | None, total: int) -> RequestTimeout:
    return RequestTimeout(f"The request body did not arrive within {timeout:g} seconds ({total} bytes came). "
                          "Send it at once, or raise client_body_timeout (CTXPROXY_CLIENT_BODY_TIMEOUT).")


def _too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body of {size} bytes or more exceeds the limit of {limit} bytes. "
                           "Raise max_body_bytes (CTXPROXY_MAX_BODY_BYTES) if such requests are expected.")


def parse_chat_body(raw: bytes | Pieces, prefixes: Prefixes | None = None, match: Match | None = None) -> ChatBody:
    """The validated body. Whether it can be written again is checked here only when the stdlib parsed it (it
    takes any integer); what orjson parsed can only be nested too deep to write, which the caller learns when it
    serialises the body's new parts for the journal, before anything is journaled (``refuse_unwritable``).

    With ``prefixes``, a body that repeats a recent one's bytes is parsed from it (``proxy.core.prefix``): only
    its new messages are parsed and validated, the others are the recent body's, validated when it came
    (``match``: the recent body, when the caller looked it up already)."""
    reused = prefixes.loads(raw, match) if prefixes is not None else None
    if reused is not None:
        body, exact = reused.body, True
    else:
        raw = bytes(raw)  # parsed whole: joined once, and kept so
        body, exact = _loads(raw)
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object with a `messages` array.", code="invalid_json")
    _expect(body, "model", str, "a string")
    _expect(body, "stream", bool, "true or false")
    if not exact:
        _check_writable(body)
    _expect(body, "tools", list, "an array of tool definitions")
    for i, tool in enumerate(body.get("tools") or []):
        _check_tool(i, tool)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty array of chat messages.", param="messages")
    for i in range(reused.count if reused is not None else 0, len(messages)):
        _check_message(i, messages[i])
    if prefixes is not None and exact:
        prefixes.keep(raw, body, reused)
    return cast(ChatBody, body)


def _loads(raw: bytes) -> tuple[Any, bool]:
    """orjson (then True); or, for JSON that only the stdlib accepts (a lone surrogate escape such as
    ``"\\ud83d"``, which a JavaScript agent emits when it cuts a string mid-emoji), the stdlib with those
    surrogates made U+FFFD (then False), so every later step (hashing, the journal, a rewritten body) can encode
    the text. The body itself still goes upstream as it came when nothing is rewritten."""
    try:
        return orjson.loads(raw), True
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc):
            raise _too_deep("the body") from None
        try:
            return _without_surrogates(json.loads(raw)), False
        except RecursionError:
            raise _too_deep("the body") from None
        except ValueError:
            raise BadRequest(f"Request body is not valid JSON: {exc}", code="invalid_json") from None


def _without_surrogates(value: Any) -> Any:
    """``value`` with lone surrogates made U+FFFD, in strings and keys alike."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_without_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_without_surrogates(k): _without_surrogates(v) for k, v in value.items()}
    return value


def _check_writable(body: dict[str, Any]) -> None:
    """Refuse what the proxy could not serialise again, naming where it is. orjson tells whether (in C, ~10 ms for
    200 000 messages); only then is the body walked, iteratively, to say where."""
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        refuse_unwritable(body)


def refuse_unwritable(body: dict[str, Any]) -> NoReturn:
    """The 400 for a body orjson could not serialise: where it nests too deep or holds too large an integer."""
    _find_unwritable(body)
    raise BadRequest("The request body cannot be serialised again.", code="invalid_json") from None


def _find_unwritable(body: dict[str, Any]) -> None:
    stack: list[tuple[Any, str, int]] = [(v, k, 2) for k, v in body.items()]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict | list) and depth > MAX_DEPTH:
            raise _too_deep(f"`{path}`", path)
        if isinstance(value, dict):
            stack += [(v, f"{path}.{k}", depth + 1) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
        elif isinstance(value, int) and not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise BadRequest(f"`{path}` is an integer beyond 64 bits, which ctxproxy cannot store or forward "
                             "exactly. Send it as a string or a float.", param=path)


def _too_deep(where: str, param: str | None = None) -> BadRequest:
    return BadRequest(f"{where} nests JSON deeper than {MAX_DEPTH} levels; no chat request needs that. Flatten it.",
                      param=param, code="invalid_json" if param is None else None)


def _expect(obj: dict[str, Any], key: str, kind: type, what: str, where: str = "") -> None:
    if key in obj and obj[key] is not None and not isinstance(obj[key], kind):
        raise BadRequest(f"`{where}{key}` must be {what}, got {type(obj[key]).__name__}.", param=f"{where}{key}")


def _check_tool(i: int, tool: Any) -> None:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise BadRequest(f"`{where}` must be an object such as {{\"type\": \"function\", \"function\": {{...}}}}.",
                         param=where)
    _expect(tool, "type", str, "a string such as \"function\"", f"{where}.")
    if "function" in tool:
        function = tool["function"]
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"`{where}.function` must be an object with a string `name`.",
                             param=f"{where}.function.name" if isinstance(function, dict) else f"{where}.function")


def _check_message(i: int, message: Any) -> None:
    where = f"messages[{i}]."
    if not isinstance(message, dict):
        raise BadRequest(f"`messages[{i}]` must be an object with a `role`.", param=f"messages[{i}]")
    if not isinstance(message.get("role"), str):
        raise BadRequest(f"`{where}role` must be a string such as \"user\".", param=f"{where}role")
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise BadRequest(f"`{where}content` must be a string, an array of parts or null.", param=f"{where}content")
    for j, part in enumerate(content if isinstance(content, list) else []):
        _check_part(f"{where}content[{j}]", part)
    if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise BadRequest(f"`{where}tool_call_id` must name the call this tool message answers.",
                         param=f"{where}tool_call_id")
    _expect(message, "tool_calls", list, "an array of tool calls", where)
    for j, call in enumerate(message.get("tool_calls") or []):
        _check_tool_call(f"{where}tool_calls[{j}]", call)


def _check_part(where: str, part: Any) -> None:
    if isinstance(part, str):
        return  # not OpenAI's shape, but some clients send bare strings and the upstream may take them
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise BadRequest(f"`{where}` must be a content part: an object with a string `type` such as \"text\".",
                         param=f"{where}.type" if isinstance(part, dict) else where)


def _check_tool_call(where: str, call: Any) -> None:
    if not isinstance(call, dict) or not isinstance(call.get("id"), str):
        raise BadRequest(f"`{where}.id` must be a string.", param=f"{where}.id")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"`{where}.function.name` must be a string.", param=f"{where}.function.name")
