"""Native mode's upstream: each forward encoded back into ``/v1/responses``, each answer decoded into chat.

``ResponsesUpstream`` is the ``UpstreamCodec`` (``proxy.engine.forward``) the Responses front hands the engine when
the model's ``responses_upstream`` is ``native``. The engine plans and cuts the chat body as always; each forward
is rebuilt on the client's own body: every field ctxproxy does not own goes up as the client sent it (``include``,
``reasoning``, ``text``, built-in tools, ``prompt_cache_key`` …), and every message the projection left unchanged
goes up as the very input items it was decoded from (reasoning items with their ``encrypted_content`` included,
byte for byte). A message the proxy changed (a stub, a spill) or added (a notice, a context round) is encoded
afresh. ``previous_response_id`` is not sent: the front expanded it, so the upstream gets the whole conversation.

The answers reach the engine as chat (``ChatFromResponses`` for a stream). What chat cannot say travels beside it:
the answer's reasoning items, whole, as ``CARRIER`` (a message key in a completion, a named SSE event in a
stream, which the engine's stream filter passes untouched), and the front's encoders give them back to the agent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection
from typing import Any

import httpx
import orjson

from ctxproxy.proxy.edge.fronts.responses.decode import NAMESPACE_SEPARATOR, decode_messages, namespaced
from ctxproxy.proxy.edge.fronts.responses.encode import CARRIER
from ctxproxy.proxy.edge.fronts.responses.events import CARRIER_EVENT, parsed_event

__all__ = ["ChatFromResponses", "ResponsesUpstream", "chat_completion", "fresh_items", "responses_tool"]

Item = dict[str, Any]
_FINISH = {"max_output_tokens": "length", "content_filter": "content_filter"}
MIN_OUTPUT_TOKENS = 16
"""The Responses API refuses a ``max_output_tokens`` below 16 (the engine's probe asks for one token)."""


def _key(message: dict[str, Any]) -> bytes:
    return orjson.dumps(message, option=orjson.OPT_SORT_KEYS)


class ResponsesUpstream:
    """Forwards in the Responses API, built on the client's ``original`` body and its (expanded) input items."""

    path = "/v1/responses"

    def __init__(self, original: dict[str, Any], items: list[Item], query: str) -> None:
        self.original, self.query = original, query
        messages, groups = decode_messages(items, native=True)
        self.groups: dict[bytes, list[Item]] = {}
        for message, group in zip(messages, groups, strict=True):
            self.groups.setdefault(_key(message), group)
        tools = original.get("tools") if isinstance(original.get("tools"), list) else []
        self.namespaces = {t["name"] for t in tools or [] if isinstance(t, dict) and t.get("type") == "namespace"}
        self.tool_names = {t.get("name") for t in tools or [] if isinstance(t, dict)} | {
            f"{t['name']}{NAMESPACE_SEPARATOR}{n.get('name')}" for t in tools or [] if isinstance(t, dict)
            and t.get("type") == "namespace" for n in t.get("tools") or [] if isinstance(n, dict)}

    def request(self, body: bytes) -> bytes:
        chat = orjson.loads(body)
        out = {k: v for k, v in self.original.items() if k != "previous_response_id"}
        messages = chat["messages"]
        if messages and isinstance(self.original.get("instructions"), str) and messages[0] == {
                "role": "system", "content": self.original["instructions"]}:
            messages = messages[1:]  # the instructions, which stay a field of their own
        out["input"] = [item for message in messages for item in self._items(message)]
        added = [responses_tool(t) for t in chat.get("tools") or [] if t.get("function", {}).get("name") not in
                 self.tool_names]
        if added:
            out["tools"] = [*(self.original.get("tools") or []), *added]
        out["stream"] = bool(chat.get("stream"))
        if isinstance(chat.get("max_tokens"), int):
            out["max_output_tokens"] = max(MIN_OUTPUT_TOKENS, chat["max_tokens"])
        return orjson.dumps(out)

    def _items(self, message: dict[str, Any]) -> list[Item]:
        kept = self.groups.get(_key(message))
        return kept if kept is not None else fresh_items(message, self.namespaces)

    def response(self, answer: httpx.Response) -> httpx.Response:
        headers = [(k, v) for k, v in answer.headers.raw if k.lower() not in (b"content-length", b"content-encoding")]
        streamed = answer.headers.get("content-type", "").startswith("text/event-stream")
        return httpx.Response(answer.status_code, headers=headers,
                              stream=_Translated(answer, streamed, self.namespaces))


def fresh_items(message: dict[str, Any], namespaces: set[str]) -> list[Item]:
    """A chat message the proxy made or changed, as Responses input items."""
    role, content = message.get("role"), message.get("content")
    if role == "tool":
        return [{"type": "function_call_output", "call_id": message.get("tool_call_id"), "output": _text(content)}]
    if role != "assistant":
        return [{"type": "message", "role": role, "content": _text(content)}]
    items: list[Item] = []
    if content:
        items.append({"type": "message", "role": "assistant",
                      "content": [{"type": "output_text", "text": _text(content), "annotations": []}]})
    for call in message.get("tool_calls") or []:
        name = call["function"]["name"]
        item = {"type": "function_call", "call_id": call["id"], "name": name,
                "arguments": call["function"].get("arguments") or "{}"}
        split = namespaced(name, namespaces)
        if split is not None:
            item |= {"namespace": split[0], "name": split[1]}
        items.append(item)
    return items


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def responses_tool(tool: dict[str, Any]) -> Item:
    """A chat tool definition as a Responses function tool."""
    function = tool.get("function") or {}
    return {"type": "function", **{k: function[k] for k in ("name", "description", "parameters", "strict")
                                   if k in function}}


class _Translated(httpx.AsyncByteStream):
    def __init__(self, answer: httpx.Response, streamed: bool, namespaces: set[str]) -> None:
        self.answer, self.streamed, self.namespaces = answer, streamed, namespaces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.streamed and self.answer.status_code == 200:
            translator = ChatFromResponses(self.namespaces)
            async for chunk in self.answer.aiter_raw():
                if out := translator.feed(chunk):
                    yield out
            return
        content = b"".join([chunk async for chunk in self.answer.aiter_raw()])
        if self.answer.status_code != 200:
            yield content  # the Responses API's errors are the OpenAI envelope the engine reads
            return
        yield orjson.dumps(chat_completion(orjson.loads(content), self.namespaces))

    async def aclose(self) -> None:
        await self.answer.aclose()


def chat_completion(response: dict[str, Any], namespaces: Collection[str] = ()) -> dict[str, Any]:
    """A Responses ``response`` object as a chat completion, its reasoning items carried whole."""
    output = [i for i in response.get("output") or [] if isinstance(i, dict)]
    text = "".join(str(p.get("text", "")) for i in output if i.get("type") == "message"
                   for p in i.get("content") or [] if isinstance(p, dict) and p.get("type") == "output_text")
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    refusal = "".join(str(p.get("refusal", "")) for i in output if i.get("type") == "message"
                      for p in i.get("content") or [] if isinstance(p, dict) and p.get("type") == "refusal")
    if refusal:
        message["refusal"] = refusal  # chat's word for it: the front encodes it back as a refusal part
    calls = [_call(i, namespaces) for i in output if i.get("type") == "function_call"]
    if calls:
        message["tool_calls"] = calls
    carried = [i for i in output if i.get("type") not in ("message", "function_call")]
    if carried:
        message[CARRIER] = carried
    return {"id": response.get("id"), "object": "chat.completion", "model": response.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": _finish(response, bool(calls))}],
            "usage": _usage(response.get("usage"))}


def _call(item: Item, namespaces: Collection[str]) -> dict[str, Any]:
    name = str(item.get("name") or "")
    if item.get("namespace") in namespaces:
        name = f"{item['namespace']}{NAMESPACE_SEPARATOR}{name}"
    return {"id": item.get("call_id"), "type": "function",
            "function": {"name": name, "arguments": item.get("arguments") or ""}}


def _finish(response: dict[str, Any], called: bool) -> str:
    if response.get("status") == "incomplete":
        return _FINISH.get(str((response.get("incomplete_details") or {}).get("reason")), "length")
    return "tool_calls" if called else "stop"


def _usage(usage: Any) -> dict[str, Any] | None:
    """Responses usage as chat's, each detail kept: the cached input and the reasoning output (Codex shows it)."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": int(usage.get("total_tokens") or prompt + completion),
            "prompt_tokens_details": {"cached_tokens": (usage.get("input_tokens_details") or {}).get(
                "cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": (usage.get("output_tokens_details") or {}).get(
                "reasoning_tokens", 0)}}


class ChatFromResponses:
    """A Responses event stream, fed in any pieces, as the chat SSE stream the engine reads."""

    def __init__(self, namespaces: set[str]) -> None:
        self.namespaces = namespaces
        self.pending = b""
        self.calls: dict[str, int] = {}
        """Each function call's item id → its chat tool-call index."""

    def feed(self, chunk: bytes) -> bytes:
        self.pending += chunk.replace(b"\r\n", b"\n")
        out = b""
        while b"\n\n" in self.pending:
            block, self.pending = self.pending.split(b"\n\n", 1)
            event = parsed_event(block)[1]
            if isinstance(event, dict):
                out += self._event(event)
        return out

    def _event(self, event: dict[str, Any]) -> bytes:
        kind = event.get("type")
        if kind in ("response.output_text.delta", "response.refusal.delta"):
            return _chunk({"content" if kind == "response.output_text.delta" else "refusal": event.get("delta") or ""})
        if kind == "response.output_item.added" and (event.get("item") or {}).get("type") == "function_call":
            item = event["item"]
            self.calls[str(item.get("id"))] = index = len(self.calls)
            call = _call(item, self.namespaces)
            return _chunk({"tool_calls": [{"index": index, **call, "function": {**call["function"],
                                                                                 "arguments": ""}}]})
        if kind == "response.function_call_arguments.delta":
            index = self.calls.get(str(event.get("item_id")), 0)
            return _chunk({"tool_calls": [{"index": index, "function": {"arguments": event.get("delta") or ""}}]})
        if kind == "response.output_item.done" and (event.get("item") or {}).get("type") not in (
                "message", "function_call", None):
            return b"event: " + CARRIER_EVENT + b"\ndata: " + orjson.dumps(event["item"]) + b"\n\n"
        if kind in ("response.completed", "response.incomplete"):
            response = event.get("response") or {}
            finish = _chunk({}, _finish(response, bool(self.calls)))
            usage = b"data: " + orjson.dumps({"object": "chat.completion.chunk", "choices": [],
                                              "usage": _usage(response.get("usage"))}) + b"\n\n"
            return finish + usage + b"data: [DONE]\n\n"
        if kind in ("response.failed", "error"):
            error = (event.get("response") or {}).get("error") or event
            return b"data: " + orjson.dumps({"error": {"message": error.get("message"), "type": "upstream_error",
                                                       "code": error.get("code")}}) + b"\n\n"
        return b""


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"
