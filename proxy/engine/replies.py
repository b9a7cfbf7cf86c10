"""Pure policy over a buffered answer and the request: what the model called, what the agent is told.

No I/O: an answer's bytes in, values out. The context calls of a native answer (``strip_calls``) or a
text-protocol one (``context`` blocks), the engine's ``Answered`` event built from them, the usage figure, and
``/compact``'s report to the agent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import orjson

from ctxproxy.proxy.engine.turn import Answered
from ctxproxy.proxy.tools.blocks import extract_blocks, has_command
from ctxproxy.proxy.tools.offer import split_calls
from ctxproxy.proxy.wire import ChatBody

__all__ = ["answered", "compact_request", "compaction_report", "strip_calls", "usage_of", "with_report"]


def answered(content: bytes, fenced: bool, agent_tools: frozenset[str],
             parsed: dict[str, Any] | None = None) -> tuple[Answered, bytes]:
    """The engine's event for a buffered answer, and the answer as the agent gets it (without context calls).
    ``parsed``: ``content`` as the caller parsed it already, not parsed again."""
    if fenced:
        answer, calls, said = _fenced_calls(content)
        acts = bool(calls) and has_command(_message(answer).get("content") or "")
        event = Answered(tuple(calls), acts, said, fenced=True)
    else:
        answer, calls = _context_calls(content, agent_tools, parsed)
        acts = bool(calls) and bool(_message(answer).get("tool_calls"))
        event = Answered(tuple(calls), acts, _message(answer).get("content") if calls else None)
    return event, orjson.dumps(answer) if calls else content


def _context_calls(content: bytes, agent_tools: frozenset[str],
                   parsed: dict[str, Any] | None) -> tuple[dict[str, Any], list[Any]]:
    if parsed is not None:
        return strip_calls(parsed, agent_tools)
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {}, []
    return strip_calls(answer, agent_tools)


def strip_calls(answer: dict[str, Any], agent_tools: frozenset[str]) -> tuple[dict[str, Any], list[Any]]:
    """The answer without its context-tool calls (the agent never sees them), and those calls."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0].get("message"), dict):
        return answer, []
    message = choices[0]["message"]
    split = split_calls(message, shadowed=agent_tools)
    if not split.context:
        return answer, []
    kept = {**message, "tool_calls": split.agent} if split.agent else \
        {k: v for k, v in message.items() if k != "tool_calls"} | {"content": message.get("content") or ""}
    first = {**choices[0], "message": kept}
    if not split.agent:
        first["finish_reason"] = "stop"
    return {**answer, "choices": [first, *choices[1:]]}, split.context


def _fenced_calls(content: bytes) -> tuple[dict[str, Any], list[Any], str]:
    """A text-protocol answer: without its context blocks, their calls, and the text as the model wrote it."""
    try:
        answer = orjson.loads(content)
        message = answer["choices"][0]["message"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return {}, [], ""
    said = message.get("content") if isinstance(message.get("content"), str) else ""
    text, calls = extract_blocks(said)
    if not calls:
        return answer, [], said
    kept = {**message, "content": text}
    return {**answer, "choices": [{**answer["choices"][0], "message": kept}, *answer["choices"][1:]]}, calls, said


def _message(answer: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = answer["choices"][0]["message"]
    return message


def usage_of(content: bytes) -> dict[str, object] | None:
    try:
        usage = orjson.loads(content).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def compact_request(body: ChatBody) -> str | None:
    """The person's ``/compact [instruction]``, if their latest message is one: the instruction ("" without)."""
    last = body["messages"][-1]
    content = last.get("content")
    if last.get("role") != "user" or not isinstance(content, str) or not content.strip().startswith("/compact"):
        return None
    rest = content.strip()[len("/compact"):]
    return rest.strip() if not rest or rest[0].isspace() else None


def compaction_report(events: Sequence[dict[str, Any]]) -> str:
    """What /compact did, for the agent: the model's context ops over this request, summed."""
    ops = [e for e in events if e["ok"] and e["op"] in ("drop", "note", "clear")]
    freed = sum(e["tokens_freed"] for e in ops)
    kinds = ", ".join(f"{op} x{n}" for op, n in sorted(Counter(e["op"] for e in ops).items())) or "nothing cut"
    return f"[ctxproxy] Context compacted: about {freed} tokens freed ({kinds}); everything cut is restorable."


def with_report(content: bytes, report: str) -> bytes:
    """A buffered answer with the /compact report as the first words of its message."""
    try:
        answer = orjson.loads(content)
        message = answer["choices"][0]["message"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return content
    said = message.get("content") if isinstance(message.get("content"), str) else ""
    message["content"] = report + (f"\n{said}" if said else "")
    return orjson.dumps(answer)
