"""The OpenAI chat shapes ctxproxy reads, declared once. They are validated only at the HTTP edge (``proxy.edge.body``).

Only the keys the proxy looks at are declared; every other key of a request is passed upstream as it came.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

__all__ = ["ChatBody", "ChatMessage", "FunctionCall", "ToolCall", "Usage"]


class FunctionCall(TypedDict):
    name: str
    arguments: NotRequired[str]


class ToolCall(TypedDict):
    id: str
    type: NotRequired[str]
    function: FunctionCall


class ChatMessage(TypedDict):
    role: str
    content: NotRequired[str | list[Any] | None]
    name: NotRequired[str]
    tool_calls: NotRequired[list[ToolCall]]
    tool_call_id: NotRequired[str]


class ChatBody(TypedDict):
    messages: list[ChatMessage]
    model: NotRequired[str]
    stream: NotRequired[bool]
    tools: NotRequired[list[Any]]


class Usage(TypedDict, total=False):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
