"""A chat-completions answer encoded as a Responses ``response`` object (translated mode), and the pieces of one.

The streamed encoder (``proxy.edge.fronts.responses.events``) builds the same items and the same closing object, so a
client reading either way gets the same response. A chat answer's reasoning (``reasoning_content``) becomes a
``reasoning`` item, its text a ``message`` item, each tool call a ``function_call`` item (a flattened namespace
name split back, ``proxy.edge.fronts.responses.decode``); ``finish_reason: length`` makes the response ``incomplete``.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ctxproxy.proxy.edge.fronts.responses.decode import namespaced

__all__ = [
    "CARRIER", "Frame", "encode_completion", "function_call_item", "message_item", "reasoning_item", "responses_usage",
    "status_of",
]

Item = dict[str, Any]
CARRIER = "ctxproxy_output_items"
"""Native mode: the upstream's own output items chat has no word for (reasoning with its ``encrypted_content``),
carried on the chat message to be given back whole (``proxy.edge.fronts.responses.native``)."""
_ECHOED = ("instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p",
           "max_output_tokens", "previous_response_id", "store", "metadata", "text", "reasoning", "truncation",
           "prompt_cache_key", "user")
"""Request fields a Response object reports back as the request set them."""


@dataclass(frozen=True)
class Frame:
    """What a response object says about its request: its id, time, model and the request's echoed fields."""

    id: str
    created_at: int
    model: str
    echo: dict[str, Any] = field(default_factory=dict)
    namespaces: frozenset[str] = frozenset()
    """The tool namespaces the request offered (a call to ``ns__name`` is split back into them)."""

    @classmethod
    def of(cls, body: dict[str, Any]) -> Frame:
        echo = {k: body[k] for k in _ECHOED if k in body}
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        namespaces = frozenset(t["name"] for t in tools or [] if isinstance(t, dict) and t.get("type") == "namespace"
                               and isinstance(t.get("name"), str))
        return cls("resp_" + secrets.token_hex(16), int(time.time()), str(body.get("model") or ""), echo, namespaces)

    def item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{self.id[5:]}{index:03d}"

    def response(self, status: str, output: list[Item], usage: dict[str, Any] | None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        defaults: dict[str, Any] = {"instructions": None, "tools": [], "tool_choice": "auto",
                                    "parallel_tool_calls": True, "metadata": {}, "text": {"format": {"type": "text"}},
                                    "truncation": "disabled"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                **defaults, **self.echo}


def encode_completion(frame: Frame, completion: dict[str, Any]) -> dict[str, Any]:
    """The Response object for a (whole) chat completion."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output: list[Item] = list(message.get(CARRIER) or [])
    if not output and isinstance(message.get("reasoning_content"), str) and message["reasoning_content"]:
        output.append(reasoning_item(frame, len(output), message["reasoning_content"]))
    text = message.get("content")
    if isinstance(text, str) and text:
        output.append(message_item(frame, len(output), text))
    if isinstance(message.get("refusal"), str) and message["refusal"]:
        output.append(message_item(frame, len(output), message["refusal"], refusal=True))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        output.append(function_call_item(frame, len(output), call.get("id") or "", function.get("name") or "",
                                         function.get("arguments") or ""))
    status, incomplete = status_of(choice.get("finish_reason"))
    return frame.response(status, output, responses_usage(completion.get("usage")), incomplete)


def status_of(finish_reason: Any) -> tuple[str, str | None]:
    """The response's status and incomplete reason for a chat finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "content_filter":
        return "incomplete", "content_filter"
    return "completed", None


def message_item(frame: Frame, index: int, text: str, status: str = "completed", refusal: bool = False) -> Item:
    """An assistant message: its text, or the model's refusal (chat's ``message.refusal``) as a refusal part."""
    part = {"type": "refusal", "refusal": text} if refusal else {"type": "output_text", "text": text,
                                                                  "annotations": []}
    return {"id": frame.item_id("msg", index), "type": "message", "role": "assistant", "status": status,
            "content": [part]}


def reasoning_item(frame: Frame, index: int, text: str) -> Item:
    return {"id": frame.item_id("rs", index), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(frame: Frame, index: int, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> Item:
    item: Item = {"id": frame.item_id("fc", index), "type": "function_call", "status": status, "call_id": call_id,
                  "name": name, "arguments": arguments}
    split = namespaced(name, frame.namespaces)
    if split is not None:
        item |= {"name": split[1], "namespace": split[0]}
    return item


def responses_usage(usage: Any) -> dict[str, Any] | None:
    """Chat usage (``prompt_tokens``…) as Responses usage (``input_tokens``…)."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
    cached = _int((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    reasoning = _int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens"))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": _int(usage.get("total_tokens")) or prompt + completion}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
