"""The chat engine's answers → Anthropic Messages: a whole message, its usage, and errors in Anthropic's shape.

A chat completion's ``message`` becomes content blocks: ``reasoning_content`` (what llama.cpp and vLLM call a
model's thinking) a ``thinking`` block with an empty signature, the text a ``text`` block, each tool call a
``tool_use`` block whose ``input`` is the parsed arguments. ``finish_reason`` maps to ``stop_reason``; usage maps
``prompt_tokens`` → ``input_tokens`` (less what the upstream read from its cache, which Anthropic counts apart as
``cache_read_input_tokens``) and ``completion_tokens`` → ``output_tokens``.

Errors: ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's type for the status
(``ERROR_TYPES``); the OpenAI envelope's message is kept word for word.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from starlette.responses import Response

from ctxproxy.proxy.errors import CtxError

__all__ = ["CARRIER", "ERROR_KINDS", "ERROR_TYPES", "error_body", "error_response", "message_of", "stop_of",
           "stop_reason", "tool_input", "usage_of"]

CARRIER = "ctxproxy_anthropic"
"""The key on chat values (message, choice, usage, chunk) carrying what a native upstream said that chat cannot."""

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               504: "timeout_error", 529: "overloaded_error"}
"""Anthropic's error type for an HTTP status (https://docs.anthropic.com/en/api/errors); others: ``api_error``."""
ERROR_KINDS = frozenset({*ERROR_TYPES.values(), "api_error", "billing_error"})
"""Every error type Anthropic names: one an upstream sent is passed on as it came."""
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
         "content_filter": "refusal"}


def error_body(status: int, message: str) -> bytes:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def error_response(exc: CtxError) -> Response:
    headers = {"connection": "close"} if exc.close_connection else None
    return Response(error_body(exc.status, exc.message), exc.status, headers=headers, media_type="application/json")


def envelope_message(content: bytes) -> str:
    """The message of an OpenAI error envelope (or of any JSON error), else the body as text."""
    try:
        parsed = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace")[:2000] or "The upstream answered with an empty error."
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):
        return error
    return content.decode("utf-8", "replace")[:2000]


def stop_reason(finish: str | None) -> str | None:
    return _STOP.get(finish, "end_turn") if finish else None


def tool_input(arguments: str | None) -> Any:
    """A call's arguments as the ``input`` object; text that is not a JSON object is kept under ``"arguments"``
    (the agent sees what the model wrote rather than an empty call)."""
    try:
        parsed = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": arguments}


def usage_of(usage: dict[str, Any] | None) -> dict[str, int]:
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt - cached, "output_tokens": int(usage.get("completion_tokens") or 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message_of(completion: dict[str, Any], model: str | None, stops: Sequence[str] = ()) -> dict[str, Any]:
    """A chat completion as an Anthropic message (a native upstream's own blocks, usage and stop where carried);
    ``stops``: the request's ``stop_sequences``."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    usage = completion.get("usage") or {}
    return {"id": _message_id(completion.get("id")), "type": "message", "role": "assistant",
            "model": model or completion.get("model"), "content": _content(message),
            **stop_of(choice.get("finish_reason") or "stop", choice.get(CARRIER), choice.get("stop_reason"), stops),
            "usage": usage.get(CARRIER) or usage_of(usage)}


def _content(message: dict[str, Any]) -> list[dict[str, Any]]:
    carried = message.get(CARRIER)
    if isinstance(carried, list):  # a native answer's blocks, less the context calls the engine took out
        kept = {c.get("id") for c in message.get("tool_calls") or []}
        return [b for b in carried if b.get("type") != "tool_use" or b.get("id") in kept]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                        "input": tool_input(function.get("arguments"))})
    return content


def stop_of(finish: str, carried: Any, matched: Any = None, stops: Sequence[str] = ()) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence``: a native upstream's own, unless the engine changed the answer's kind
    (its context calls taken out, the finish is no longer a tool call). A chat upstream that names the stop string
    that ended the answer (vLLM's ``stop_reason``), one of the request's ``stops``, gives ``stop_sequence``."""
    mapped = stop_reason(finish)
    if isinstance(carried, dict) and (carried.get("stop_reason") == "tool_use") == (mapped == "tool_use"):
        return {"stop_reason": carried.get("stop_reason"), "stop_sequence": carried.get("stop_sequence")}
    if mapped == "end_turn" and isinstance(matched, str) and matched in stops:
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": mapped, "stop_sequence": None}


def _message_id(chat_id: Any) -> str:
    if isinstance(chat_id, str) and chat_id:
        return chat_id if chat_id.startswith("msg_") else f"msg_{chat_id}"
    return "msg_ctxproxy"
