"""A chat conversation as a Responses client would have sent it: for replays over the Responses front.

``ctxproxy replay --protocol responses`` (``proxy.commands.replay``) sends each of a recorded conversation's requests to
``/v1/responses``: the messages as input items (``native.fresh_items``, the encoding the native mode uses for what
the proxy adds), the tools as Responses function tools. The conversation is first made what the Responses
protocol can say (``as_spoken``: an assistant's empty text and a ``tool_calls`` without text are one and the
same there), so the requests the replay compares are those the Responses client would have sent.
"""

from __future__ import annotations

from typing import Any

from ctxproxy.proxy.edge.fronts.responses.decode import chat_tools, decode_messages
from ctxproxy.proxy.edge.fronts.responses.native import fresh_items, responses_tool

__all__ = ["as_spoken", "responses_body"]


def responses_body(chat: dict[str, Any]) -> dict[str, Any]:
    """The Responses request a client sends for the chat request ``chat`` (``model``, ``messages``, ``tools``)."""
    body: dict[str, Any] = {"model": chat.get("model"),
                            "input": [item for m in chat["messages"] for item in fresh_items(m, set())]}
    if chat.get("tools"):
        body["tools"] = [responses_tool(t) for t in chat["tools"]]
    return body


def as_spoken(conversation: dict[str, Any]) -> dict[str, Any]:
    """``conversation`` as the Responses protocol can carry it: its messages and tools through the codec once."""
    body = responses_body(conversation)
    spoken = {**conversation, "messages": decode_messages(body["input"])[0]}
    if body.get("tools"):
        spoken["tools"] = chat_tools(body["tools"])
    return spoken
