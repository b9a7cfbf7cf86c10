"""A Responses request decoded into the internal chat body (translated mode: the upstream speaks chat completions).

The Responses input is a list of items; chat completions wants messages. Items map one to one, except that an
assistant's function calls join the assistant message before them (chat carries calls inside a message), and
``instructions`` become the first system message. What a chat upstream cannot be given is refused with a 400 that
names the field and the fix, never dropped: built-in tools (``web_search``, ``file_search``…), file inputs,
``item_reference`` items. Reasoning items are the client's state: their text (if any: the reasoning items this
front produces carry it) rides on the next assistant message as ``reasoning_content``, what llama.cpp and vLLM
read back; an ``encrypted_content`` is another provider's sealed state, which no chat server can read, so it goes
no further than the proxy, and the items themselves stay as the client sent them in the conversation the proxy
keeps for ``previous_response_id`` (``proxy.edge.fronts.responses.front``).

Namespace tools (Codex's ``{"type": "namespace", "tools": [...]}``) are flattened: each nested function is offered
as ``<namespace>__<name>``, and ``encode`` splits a call to such a name back into ``namespace`` and ``name``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ctxproxy.proxy.errors import BadRequest

__all__ = ["NAMESPACE_SEPARATOR", "chat_tools", "decode_messages", "decode_request", "input_items", "namespaced"]

NAMESPACE_SEPARATOR = "__"
Item = dict[str, Any]
Message = dict[str, Any]


def namespaced(name: str, namespaces: Collection[str]) -> tuple[str, str] | None:
    """A flattened ``<namespace>__<name>`` split back at the longest namespace the request offered, or None. Codex
    names its MCP servers' namespaces ``mcp__<server>``: split at the first ``__``, ``mcp__server__echo`` named no
    namespace offered, and the call came back as a function no tool list had."""
    found = [ns for ns in namespaces if name.startswith(ns + NAMESPACE_SEPARATOR) and len(name) > len(ns) + 2]
    if not found:
        return None
    namespace = max(found, key=len)
    return namespace, name[len(namespace) + len(NAMESPACE_SEPARATOR):]

_KINDS = frozenset({"message", "function_call", "function_call_output", "reasoning"})
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "stream", "seed", "stop")
"""Fields whose meaning and name are the same in both protocols."""
_FRONT_ONLY = frozenset({
    "input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "reasoning", "store", "include",
    "previous_response_id", "prompt_cache_key", "metadata", "client_metadata", "truncation", "service_tier",
    "safety_identifier", "prompt_cache_retention", "stream_options",
})
"""Fields the front reads or that concern the Responses service itself (storage, caching, metadata). Any other
field is refused: ``conversation`` and ``background`` (state and jobs the proxy does not keep), ``prompt``
templates, ``max_tool_calls``… would change the answer if honoured, so they must not be ignored."""


def input_items(body: dict[str, Any]) -> list[Item]:
    """The request's ``input`` as a list of items (a bare string is one user message)."""
    given = body.get("input")
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if not isinstance(given, list):
        raise BadRequest("`input` must be a string or an array of input items.", param="input")
    return given


def decode_request(body: dict[str, Any], items: list[Item], native: bool = False) -> dict[str, Any]:
    """The chat body for ``body`` whose (expanded) input is ``items``. ``native``: the upstream speaks Responses
    itself, so what chat cannot say is carried by the front (``proxy.edge.fronts.responses.native``), not refused."""
    if not native:
        _refuse_unknown(body)
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if k in body}
    messages = decode_messages(items, native)[0]
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat["messages"] = messages
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"], native)
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"], native)
    if isinstance(body.get("max_output_tokens"), int):
        chat["max_tokens"] = body["max_output_tokens"]
    if not native:
        chat |= _text_format(body.get("text")) | _reasoning(body.get("reasoning"))
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def _refuse_unknown(body: dict[str, Any]) -> None:
    for key in body:
        if key not in _FRONT_ONLY and key not in _PASSED:
            raise BadRequest(f"`{key}` is not a Responses field ctxproxy can translate for a chat-completions "
                             "upstream; nothing was forwarded. Leave it out.", param=key)


def decode_messages(items: list[Item], native: bool = False) -> tuple[list[Message], list[list[Item]]]:
    """The chat messages of ``items``, and for each the input items it was made of (native mode sends those
    back as they came while the message is unchanged)."""
    built = _Built(native)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"`input[{i}]` must be an input item object.", param=f"input[{i}]")
        built.add(i, item)
    if built.pending and built.groups:  # items chat has no word for, last (Codex's apply_patch call and its
        built.groups[-1] += built.pending  # output): they go with the last message, not wait for one to come
    return built.messages, built.groups


class _Built:
    """Messages under construction: an assistant's calls join it, reasoning waits for the next assistant."""

    def __init__(self, native: bool) -> None:
        self.native = native
        self.messages: list[Message] = []
        self.groups: list[list[Item]] = []
        self.reasoning: list[str] = []
        self.pending: list[Item] = []

    def add(self, i: int, item: Item) -> None:
        kind = item.get("type", "message")
        if kind == "reasoning" or (self.native and kind not in _KINDS):
            self.reasoning += _reasoning_text(item) if kind == "reasoning" else []
            self.pending.append(item)
        elif kind == "function_call":
            self._assistant().setdefault("tool_calls", []).append(_tool_call(i, item))
            self.groups[-1].append(item)
        elif kind == "function_call_output":
            self._append(_tool_result(i, item, self.native), item)
        elif kind == "message":
            message = _message(i, item, self.native)
            if message["role"] == "assistant":
                _attach(message, self.reasoning)
            self._append(message, item)
        else:
            raise BadRequest(f"`input[{i}].type` is {kind!r}, which a chat-completions upstream cannot take "
                             "(ctxproxy translates message, function_call, function_call_output and reasoning "
                             "items). Send the history as those items.", param=f"input[{i}].type")

    def _append(self, message: Message, item: Item) -> None:
        self.messages.append(message)
        self.groups.append([*self.pending, item])
        self.pending = []

    def _assistant(self) -> Message:
        """The assistant message a function call joins: the previous one if it has no tool results after it."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            if self.pending:
                self.groups[-1] += self.pending
                self.pending = []
            _attach(self.messages[-1], self.reasoning)  # reasoning between its text and the call is its own
            return self.messages[-1]
        message: Message = {"role": "assistant", "content": None}
        _attach(message, self.reasoning)
        self.messages.append(message)
        self.groups.append(self.pending)
        self.pending = []
        return message


def _attach(message: Message, reasoning: list[str]) -> None:
    """The reasoning read since the last assistant message, on ``message`` (after any it carries already)."""
    if reasoning:
        message["reasoning_content"] = "\n\n".join([*filter(None, [message.get("reasoning_content")]), *reasoning])
        reasoning.clear()


def _reasoning_text(item: Item) -> list[str]:
    """The reasoning's own text if the item carries it, else its summary (an encrypted item has neither)."""
    for key in ("content", "summary"):
        texts = [p["text"] for p in item.get(key) or [] if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if texts:
            return ["\n\n".join(texts)]
    return []


def _message(i: int, item: Item, native: bool = False) -> Message:
    role = _ROLES.get(item.get("role", ""))
    if role is None:
        raise BadRequest(f"`input[{i}].role` must be user, assistant, system or developer.", param=f"input[{i}].role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise BadRequest(f"`input[{i}].content` must be a string or an array of content parts.",
                         param=f"input[{i}].content")
    parts = [_part(f"input[{i}].content[{j}]", part, native) for j, part in enumerate(content)]
    if all(p["type"] == "text" for p in parts) and (role != "user" or len(parts) == 1):
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _part(where: str, part: Any, native: bool = False) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        image = {"url": part["image_url"]} | ({"detail": part["detail"]} if part.get("detail") else {})
        return {"type": "image_url", "image_url": image}
    if native:  # the item goes upstream as it came; the engine sees a placeholder of the right kind
        return {"type": "text", "text": f"[{kind}]"}
    raise BadRequest(f"`{where}` ({kind!r}) cannot be sent to a chat-completions upstream: ctxproxy translates "
                     "input_text, output_text, refusal and input_image parts (an image by URL or data URL).",
                     param=where)


def _tool_call(i: int, item: Item) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
        raise BadRequest(f"`input[{i}]` (function_call) needs a string `call_id` and `name`.", param=f"input[{i}]")
    name = item["name"]
    if isinstance(item.get("namespace"), str) and item["namespace"]:
        name = f"{item['namespace']}{NAMESPACE_SEPARATOR}{name}"
    arguments = item.get("arguments")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else "{}"}}


def _tool_result(i: int, item: Item, native: bool = False) -> Message:
    if not isinstance(item.get("call_id"), str):
        raise BadRequest(f"`input[{i}].call_id` must name the function call this output answers.",
                         param=f"input[{i}].call_id")
    output = item.get("output")
    if isinstance(output, list):
        parts = [_part(f"input[{i}].output[{j}]", p, native) for j, p in enumerate(output)]
        output = "".join(p["text"] for p in parts) if all(p["type"] == "text" for p in parts) else parts
    elif not isinstance(output, str):
        raise BadRequest(f"`input[{i}].output` must be a string or an array of content parts.",
                         param=f"input[{i}].output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def chat_tools(tools: Any, native: bool = False) -> list[dict[str, Any]]:
    """Responses tool definitions as chat tools; namespaces flattened, built-in tools refused (native mode: left
    to the upstream, which runs them)."""
    if not isinstance(tools, list):
        raise BadRequest("`tools` must be an array of tool definitions.", param="tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append(_function(f"tools[{i}]", tool, ""))
        elif kind == "namespace" and isinstance(tool.get("name"), str) and isinstance(tool.get("tools"), list):
            prefix = tool["name"] + NAMESPACE_SEPARATOR
            out += [_function(f"tools[{i}].tools[{j}]", t, prefix) for j, t in enumerate(tool["tools"])]
        elif not native:
            raise BadRequest(f"`tools[{i}]` is a {kind!r} tool, which a chat-completions upstream cannot run; "
                             "nothing was forwarded. Offer function tools only (Codex CLI: "
                             "`-c web_search=disabled`).", param=f"tools[{i}].type")
    return out


def _function(where: str, tool: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise BadRequest(f"`{where}` must be a function tool with a string `name`.", param=where)
    function = {"name": prefix + tool["name"]}
    function |= {k: tool[k] for k in ("description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any, native: bool = False) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice in ("auto", "none", "required") or native:
        return choice
    raise BadRequest("`tool_choice` must be auto, none, required or {\"type\": \"function\", \"name\": …} for a "
                     "chat-completions upstream.", param="tool_choice")


def _text_format(text: Any) -> dict[str, Any]:
    form = text.get("format") if isinstance(text, dict) else None
    if not isinstance(form, dict) or form.get("type") in (None, "text"):
        return {}
    if form.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if form.get("type") == "json_schema":
        schema = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise BadRequest(f"`text.format.type` {form.get('type')!r} has no chat-completions equivalent.",
                     param="text.format.type")


def _reasoning(reasoning: Any) -> dict[str, Any]:
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    return {"reasoning_effort": effort} if isinstance(effort, str) else {}
