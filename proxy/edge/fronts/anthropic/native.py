"""Native mode: the upstream speaks ``/v1/messages``; the engine's chat body is encoded back into the client's.

Decoding for a native upstream refuses nothing: every block the chat model has no word for (thinking and its
signature, documents, server tools' blocks) rides in the chat message as a part of its own, counted by its
JSON, and every chat message made from the client's message ``i`` carries ``CARRIER: i`` (a system prompt:
``-1``). Encoding a forward back starts from the client's own body (every field ctxproxy does not own, in its
order: ``thinking``, ``metadata``, ``context_management``, ``output_config`` …), and rebuilds ``messages``
from the projected chat messages: a client message whose chat messages are exactly what it decodes to goes
back as the client sent it, byte for byte (``cache_control`` and signatures included); one the proxy cut
keeps every block it did not touch and the keys of those it did (a stubbed ``tool_result`` keeps its
``cache_control``); the proxy's own messages (notices, the context tools' rounds) become user text and
tool_result blocks, and assistant tool_use blocks. Tools: the client's, as sent, then the context tools.

A follow-up round that splices the model's context-tool calls has no thinking block before them (the engine
keeps only their text): with ``thinking`` on, Anthropic refuses such a turn, so that internal round is asked
with thinking off (the agent's own turns keep theirs).
"""

from __future__ import annotations

from typing import Any

import orjson

from ctxproxy.proxy.edge.fronts.anthropic.decode import image_part, to_chat
from ctxproxy.proxy.edge.fronts.anthropic.encode import CARRIER
from ctxproxy.proxy.edge.fronts.anthropic.rebuild import fresh, rebuilt

__all__ = ["CARRIER", "native_body", "native_chat"]

Message = dict[str, Any]


def native_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body the engine runs for a native upstream (``CARRIER`` on every message)."""
    chat: dict[str, Any] = {"model": body.get("model"), "messages": []}
    if body.get("system") is not None:
        chat["messages"].append({"role": "system", "content": _text(body["system"]), CARRIER: -1})
    for i, message in enumerate(body.get("messages") or []):
        chat["messages"] += decode_message(message, i)
    chat |= {key: body[key] for key in ("max_tokens", "temperature", "top_p", "top_k", "stream") if key in body}
    if body.get("tools"):
        chat["tools"] = [_tool(tool) for tool in body["tools"]]
    return chat


def decode_message(message: Any, i: int) -> list[Message]:
    if not isinstance(message, dict):
        return [{"role": "user", "content": orjson.dumps(message).decode(), CARRIER: i}]
    role, content = message.get("role"), message.get("content")
    if not isinstance(content, list):
        out = [{"role": role, "content": content if isinstance(content, str) else _text(content)}]
    elif role == "assistant":
        out = [_assistant(content)]
    else:
        out = _user(content)
    return [{**m, CARRIER: i} for m in out]


def _text(system: Any) -> str:
    if isinstance(system, str):
        return system
    blocks = system if isinstance(system, list) else []
    return "\n\n".join(str(b.get("text", "")) for b in blocks if isinstance(b, dict))


def _parts(blocks: list[Any]) -> str | list[Any] | None:
    """Blocks as chat content: one string when all are text, else parts (text, image_url, others as they are)."""
    if not blocks:
        return None
    if all(isinstance(b, dict) and b.get("type") == "text" for b in blocks):
        return "".join(str(b.get("text", "")) for b in blocks) if len(blocks) == 1 else [
            {"type": "text", "text": str(b.get("text", ""))} for b in blocks]
    return [_part(b) for b in blocks]


def _part(block: Any) -> Any:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
        return {"type": "text", "text": str(block.get("text", ""))}
    if kind == "image" and (block.get("source") or {}).get("type") in ("base64", "url"):
        return image_part(block)
    return block


def _assistant(blocks: list[Any]) -> Message:
    calls = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
    message: Message = {"role": "assistant", "content": _parts([b for b in blocks if b not in calls])}
    if calls:
        message["tool_calls"] = [{"id": b.get("id"), "type": "function", "function": {
            "name": b.get("name"), "arguments": orjson.dumps(b.get("input") or {}).decode()}} for b in calls]
    return message


def _user(blocks: list[Any]) -> list[Message]:
    results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
    out: list[Message] = [{"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": _result(b)}
                          for b in results]
    rest = [b for b in blocks if b not in results]
    if rest:
        out.append({"role": "user", "content": _parts(rest)})
    return out


def _result(block: Message) -> Any:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    return _parts(content if isinstance(content, list) else [content]) or ""


def _tool(tool: Any) -> dict[str, Any]:
    if isinstance(tool, dict) and tool.get("type") in (None, "custom"):
        translated: dict[str, Any] = to_chat({"messages": [{"role": "user", "content": "-"}], "tools": [tool]})
        return dict(translated["tools"][0])
    name = tool.get("name") or tool.get("type") if isinstance(tool, dict) else str(tool)
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def native_body(chat: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
    """The Anthropic body for a projected chat body, built on the client's ``original`` body."""
    out = dict(original)
    messages = chat.get("messages") or []
    lead = next((n for n, m in enumerate(messages) if m.get("role") != "system" or m.get(CARRIER, -1) != -1),
                len(messages))
    system = _system(messages[:lead], original)
    if system is not None:
        out["system"] = system
    out["messages"], fresh_calls = _messages(messages[lead:], original.get("messages") or [])
    out |= _parameters(chat, original)
    tools = _tools(chat.get("tools") or [], original.get("tools") or [])
    if tools:
        out["tools"] = tools
    if fresh_calls and "thinking" in out:
        del out["thinking"]  # the spliced context round has no thinking block: Anthropic would refuse it
        _drop_thinking_edits(out)
    return out


def _drop_thinking_edits(body: dict[str, Any]) -> None:
    """``context_management`` once ``thinking`` is off: Claude Code asks for a ``clear_thinking_*`` edit on every
    request, which Anthropic refuses without thinking (400: "strategy requires `thinking` to be enabled"). The
    other edits stay; with none left, the field goes."""
    management = body.get("context_management")
    if not isinstance(management, dict) or not isinstance(management.get("edits"), list):
        return
    edits = [e for e in management["edits"] if not (isinstance(e, dict) and str(e.get("type", "")).startswith(
        "clear_thinking"))]
    if edits or len(management) > 1:
        body["context_management"] = {**management, "edits": edits}
    else:
        del body["context_management"]


def _parameters(chat: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
    """What the engine owns: ``stream`` and ``max_tokens`` (its probe asks one token, unstreamed)."""
    changed: dict[str, Any] = {k: chat[k] for k in ("model", "max_tokens") if k in chat and chat[k] != original.get(k)}
    if bool(chat.get("stream")) != bool(original.get("stream")):
        changed["stream"] = bool(chat.get("stream"))
    return changed


def _system(lead: list[Message], original: dict[str, Any]) -> Any:
    if not lead:
        return None
    blocks: list[Any] = []
    for message in lead:
        if message.get(CARRIER) == -1 and message.get("content") == _text(original.get("system")):
            if len(lead) == 1:
                return original["system"]
            given = original["system"]
            blocks += given if isinstance(given, list) else [{"type": "text", "text": given}]
        else:
            blocks.append({"type": "text", "text": _text_of(message.get("content"))})
    return blocks


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(str(p.get("text", "")) for p in content or [] if isinstance(p, dict))


def _tools(chat_tools: list[Any], original: list[Any]) -> list[Any]:
    """The client's tools as it sent them, then those the proxy added (its context tools)."""
    named = {(_tool(t).get("function") or {}).get("name") for t in original}
    added = [t["function"] for t in chat_tools if (t.get("function") or {}).get("name") not in named]
    return list(original) + [{"name": f["name"], "description": f.get("description", ""),
                              "input_schema": f.get("parameters") or {"type": "object"}} for f in added]


def _messages(messages: list[Message], originals: list[Any]) -> tuple[list[Any], bool]:
    """The Anthropic messages, and whether a fresh assistant turn calls tools (a spliced context round)."""
    out: list[Any] = []
    fresh_calls, mine = False, -1  # mine: where the latest of the proxy's own messages is in ``out``
    n = 0
    while n < len(messages):
        i = messages[n].get(CARRIER)
        group = [messages[n]]
        while i is not None and n + len(group) < len(messages) and messages[n + len(group)].get(CARRIER) == i:
            group.append(messages[n + len(group)])
        n += len(group)
        if i is None or not 0 <= i < len(originals):
            fresh_calls = fresh_calls or bool(group[0].get("tool_calls"))
            _merge(out, fresh(group[0]), mine == len(out) - 1)
            mine = len(out) - 1
        else:
            expected = decode_message(originals[i], i)
            out.append(originals[i] if group == expected else rebuilt(group, originals[i], expected))
    return out, fresh_calls


def _merge(out: list[Any], message: Message, after_mine: bool) -> None:
    """A message of the proxy's own: joined to the one before when that is the proxy's too and has the same role
    (the context tools' results of one round in one user turn). Never to the client's: its message would change
    for this request only, and a prompt cache would lose it on the next; Anthropic joins consecutive user turns."""
    if after_mine and out[-1].get("role") == message["role"]:
        before = out[-1]
        blocks = before.get("content")
        blocks = [{"type": "text", "text": blocks}] if isinstance(blocks, str) else list(blocks or [])
        out[-1] = {**before, "content": blocks + message["content"]}
    else:
        out.append(message)
