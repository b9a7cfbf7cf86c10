"""Anthropic Messages request → the internal chat body (translated mode: for an upstream that speaks only chat).

What maps: ``system`` (a string or text blocks) → a system message; ``messages`` (``role: "system"`` entries too)
→ chat messages; text and image blocks → chat content parts; ``tool_use`` → ``tool_calls``; ``tool_result`` →
``tool`` messages (placed where chat wants them: right after the assistant's calls, before the user's text);
``tools`` → function tools; ``tool_choice``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``stop_sequences``, ``metadata.user_id`` → their chat equivalents.

What is left out on purpose (hints for Anthropic's own servers that change no content a chat model reads):
``cache_control``, ``thinking`` and ``output_config`` (a chat server has its own reasoning settings),
``context_management`` (ctxproxy manages the context), ``service_tier``; an assistant's ``thinking`` and
``redacted_thinking`` blocks (their signatures prove them to Anthropic only; a chat model does not read its
past reasoning). ``TRANSLATED_HINTS`` lists the top-level ones.

Images in a tool result (a screenshot, an image file read) follow the tool messages in a user message, the
result's text saying so (a chat tool message carries text only). A tool result's ``is_error`` becomes an
``Error:`` prefix.

What is refused (400, nothing forwarded): any other block type (``document``, server tools' blocks …), server
tools (a tool with a ``type``), MCP servers and containers, unknown top-level fields.
"""

from __future__ import annotations

from typing import Any

import orjson

from ctxproxy.proxy.errors import BadRequest

__all__ = ["TRANSLATED_HINTS", "image_part", "to_chat"]

TRANSLATED_HINTS = frozenset({"thinking", "output_config", "context_management", "service_tier", "metadata"})
"""Top-level fields a chat upstream has no use for; ``metadata.user_id`` alone is kept (as ``user``)."""
_MAPPED = frozenset({"model", "messages", "system", "max_tokens", "stream", "tools", "tool_choice", "temperature",
                     "top_p", "top_k", "stop_sequences"})
_DROPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body for an Anthropic Messages body (already checked to be an object with ``messages``)."""
    unknown = sorted(set(body) - _MAPPED - TRANSLATED_HINTS)
    if unknown:
        raise _refuse(f"field {unknown[0]!r}", unknown[0])
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body)}
    chat |= _parameters(body)
    if body.get("tools"):
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(body["tools"])]
    if "tool_choice" in body:
        chat |= _tool_choice(body["tool_choice"])
    return chat


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {key: body[key] for key in ("max_tokens", "temperature", "top_p", "top_k") if key in body}
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    user = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    if isinstance(user, str):
        out["user"] = user
    if body.get("stream"):
        out |= {"stream": True, "stream_options": {"include_usage": True}}  # usage feeds message_delta
    return out


def _refuse(what: str, param: str) -> BadRequest:
    return BadRequest(f"ctxproxy cannot translate {what} to the chat-completions upstream, and will not drop it. "
                      "Remove it, or point this model at an upstream that speaks /v1/messages (anthropic_upstream "
                      '= "native").', param=param, code="untranslatable")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _system_text(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty array of messages.", param="messages")
    for i, message in enumerate(messages):
        out += _message(message, f"messages[{i}]")
    return out


def _system_text(system: Any, where: str) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise BadRequest(f"`{where}` must be a string or an array of text blocks.", param=where)
    texts = []
    for j, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _refuse(f"a non-text block in {where}", f"{where}[{j}]")
        texts.append(str(block.get("text", "")))
    return "\n\n".join(texts)


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
        raise BadRequest(f"`{where}` must be an object whose role is user or assistant.", param=f"{where}.role")
    role, content = message["role"], message.get("content")
    if role == "system":
        return [{"role": "system", "content": _system_text(content, f"{where}.content")}]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"`{where}.content` must be a string or an array of blocks.", param=f"{where}.content")
    return _assistant(content, where) if role == "assistant" else _user(content, where)


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": orjson.dumps(block.get("input") or {}).decode()}})
        elif kind not in _DROPPED_BLOCKS:
            raise _refuse(f"a {kind!r} block", f"{where}.content[{j}]")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Tool results become tool messages, in order, ahead of the user's own parts (chat wants them there); the
    images a result returned (a screenshot, an image file read) open the user message after them."""
    results: list[dict[str, Any]] = []
    returned: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "tool_result":
            text, images = _result(block, at)
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
            returned += images
        elif kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image":
            parts.append(image_part(block, at))
        else:
            raise _refuse(f"a {kind!r} block", at)
    parts = returned + parts
    if parts:
        one_text = len(parts) == 1 and parts[0]["type"] == "text"
        results.append({"role": "user", "content": parts[0]["text"] if one_text else parts})
    return results


def _result(block: dict[str, Any], where: str) -> tuple[str, list[dict[str, Any]]]:
    """A tool result's text, and its images as chat parts (a tool message carries text only)."""
    content = block.get("content")
    pieces: list[str] = []
    images: list[dict[str, Any]] = []
    for j, part in enumerate([content] if content is None or isinstance(content, str | dict) else content):
        kind = part.get("type") if isinstance(part, dict) else None
        if part is None or isinstance(part, str):
            pieces.append(part or "")
        elif kind == "text":
            pieces.append(str(part.get("text", "")))
        elif kind == "image":
            images.append(image_part(part, f"{where}.content[{j}]"))
        else:
            raise _refuse(f"a {kind!r} block inside a tool_result", f"{where}.content[{j}]")
    if images:
        pieces.append(f"[{len(images)} image(s) returned by this tool follow in the next user message]")
    text = "\n".join(pieces)
    return (f"Error: {text}" if block.get("is_error") and not text.startswith("Error") else text), images


def image_part(block: dict[str, Any], where: str = "image") -> dict[str, Any]:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    elif source.get("type") == "url":
        url = str(source.get("url", ""))
    else:
        raise _refuse(f"an image whose source is {source.get('type')!r}", f"{where}.source")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or "name" not in tool:
        raise BadRequest(f"`tools[{i}]` must be an object with a name.", param=f"tools[{i}]")
    if tool.get("type") not in (None, "custom"):
        raise _refuse(f"the server tool {tool.get('type')!r}", f"tools[{i}].type")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    mapped: dict[str, Any] = {}
    if kind in ("auto", "none"):
        mapped["tool_choice"] = kind
    elif kind == "any":
        mapped["tool_choice"] = "required"
    elif kind == "tool":
        mapped["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        raise BadRequest(f"`tool_choice` type {kind!r} is not auto, any, tool or none.", param="tool_choice")
    if choice.get("disable_parallel_tool_use"):
        mapped["parallel_tool_calls"] = False
    return mapped
