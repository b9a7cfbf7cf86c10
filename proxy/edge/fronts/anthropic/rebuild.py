"""Native mode: a client message the proxy changed (a stub, a note), or a message of the proxy's own, as blocks.

Untouched blocks keep every byte; a changed ``tool_result`` keeps its keys (``cache_control``, ``is_error``)
with the new content; a changed assistant turn keeps its thinking blocks and the keys of its tool_use blocks.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ctxproxy.proxy.edge.fronts.anthropic.encode import tool_input

__all__ = ["blocks_of", "fresh", "rebuilt"]

Message = dict[str, Any]
_DATA_URL = re.compile(r"data:([^;,]+);base64,(.*)", re.S)


def blocks_of(content: Any) -> list[Any]:
    """Chat content (a string, parts) as Anthropic blocks; parts that are blocks already stay as they are."""
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [_block(part) for part in content]


def _block(part: Any) -> Any:
    if not isinstance(part, dict) or part.get("type") != "image_url":
        return part
    url = str((part.get("image_url") or {}).get("url", ""))
    match = _DATA_URL.fullmatch(url)
    if match:
        return {"type": "image", "source": {"type": "base64", "media_type": match[1], "data": match[2]}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def fresh(message: Message) -> Message:
    """A message the proxy added: a notice (user text), a spliced context round (tool_use, tool_result)."""
    role, content = message.get("role"), message.get("content")
    if role == "tool":
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": message.get("tool_call_id"),
                                             "content": _result_content(content)}]}
    if role == "assistant":
        return {"role": "assistant", "content": blocks_of(content) + [_tool_use(c, None) for c in
                                                                      message.get("tool_calls") or []]}
    return {"role": "user", "content": blocks_of(content) or [{"type": "text", "text": ""}]}


def _result_content(content: Any) -> Any:
    return content if isinstance(content, str) else blocks_of(content)


def _tool_use(call: dict[str, Any], original: dict[str, Any] | None) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if original is not None:
        same = arguments == orjson.dumps(original.get("input") or {}).decode()
        return original if same else {**original, "input": tool_input(arguments)}
    return {"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": tool_input(arguments)}


def rebuilt(group: list[Message], original: dict[str, Any], expected: list[Message]) -> Message:
    """The client's message ``original`` after the proxy changed some of the chat messages it decoded to."""
    if original.get("role") == "assistant" and group[0].get("role") == "assistant":
        return _assistant(group[0], original, expected[0])
    if not isinstance(original.get("content"), list):
        content = group[0].get("content")
        return {**original, "content": content if isinstance(content, str) else blocks_of(content)}
    return _user(group, original, expected)


def _assistant(message: Message, original: dict[str, Any], expected: Message) -> Message:
    blocks = [b for b in original.get("content") or [] if isinstance(b, dict)]
    uses = {b.get("id"): b for b in blocks if b.get("type") == "tool_use"}
    if message.get("content") == expected.get("content"):
        head = [b for b in blocks if b.get("type") != "tool_use"]
    else:
        head = [b for b in blocks if b.get("type") in ("thinking", "redacted_thinking")]
        head += [b for b in blocks_of(message.get("content")) if b not in head]
    calls = [_tool_use(c, uses.get(c.get("id"))) for c in message.get("tool_calls") or []]
    return {**original, "content": head + calls}


def _user(group: list[Message], original: dict[str, Any], expected: list[Message]) -> Message:
    blocks = [b for b in original["content"] if isinstance(b, dict)]
    results = {b.get("tool_use_id"): b for b in blocks if b.get("type") == "tool_result"}
    was = {m.get("tool_call_id"): m.get("content") for m in expected if m.get("role") == "tool"}
    out: list[Any] = []
    for message in group:
        if message.get("role") == "tool":
            key, content = message.get("tool_call_id"), message.get("content")
            block = results.get(key) or {"type": "tool_result", "tool_use_id": key}
            out.append(block if content == was.get(key) and key in results else
                       {**block, "content": _result_content(content)})
        elif message.get("content") == next((m.get("content") for m in expected if m.get("role") != "tool"), None):
            out += [b for b in original["content"] if not (isinstance(b, dict) and b.get("type") == "tool_result")]
        else:
            out += _keeping_keys(blocks_of(message.get("content")), [
                b for b in original["content"] if not (isinstance(b, dict) and b.get("type") == "tool_result")])
    return {**original, "content": out}


def _keeping_keys(new: list[Any], old: list[Any]) -> list[Any]:
    """Changed blocks that keep their place keep the keys they had (``cache_control``), the rest as they are."""
    if len(new) != len(old):
        return new
    return [n if not (isinstance(n, dict) and isinstance(o, dict) and n.get("type") == o.get("type"))
            else {**o, **n} for n, o in zip(new, old, strict=True)]
