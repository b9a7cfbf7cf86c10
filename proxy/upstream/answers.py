"""The upstream's answer, checked where the proxy reads it: what a broken model server sends is a clear 502.

The proxy reads an answer's ``choices`` (its message and tool calls, to take the context tools' calls out) and
its ``usage``. An answer whose shape there is not OpenAI's (``choices: ["x"]``, a tool call ``index`` of ``"z"``,
``usage`` a string) is refused with ``UpstreamMalformed`` naming the field, instead of failing somewhere inside
the proxy. The rest of an answer is the upstream's business and passes as it came. Odd figures inside a
well-formed ``usage`` (negative, fractional) are not refused: ``usage_figure`` makes them "unknown".

``parse_completion`` takes a whole buffered answer, ``parse_chunk`` one streamed ``data:`` event. All are pure.
"""

from __future__ import annotations

from typing import Any

import orjson

from ctxproxy.proxy.errors import UpstreamMalformed

__all__ = ["check_chunk", "check_completion", "parse_chunk", "parse_completion", "usage_figure"]

_FIGURE_MAX = 2 ** 53
"""Token counts above this are nonsense (and would not survive a float or SQLite's 64-bit integers)."""


def parse_completion(content: bytes) -> dict[str, Any]:
    """A buffered 2xx answer as JSON, checked; ``UpstreamMalformed`` if it is not one the proxy can read."""
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError:
        raise UpstreamMalformed(f"The upstream answered 2xx with a body that is not JSON: {_excerpt(content)}. "
                                "Check that --upstream points at an OpenAI-compatible /v1 endpoint.") from None
    check_completion(answer, content)
    return answer  # type: ignore[no-any-return]  # check_completion proved it a dict


def check_completion(answer: Any, content: bytes = b"") -> None:
    problem = _completion_problem(answer)
    if problem is not None:
        raise _malformed(problem, content or _dump(answer))


def parse_chunk(payload: bytes) -> Any:
    """One streamed ``data:`` payload (not ``[DONE]``) as JSON, checked: every OpenAI client parses each one, so
    one that is not JSON would break the client's stream where the proxy can still end it cleanly."""
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise _malformed("a streamed `data:` event is not JSON", payload) from None
    check_chunk(chunk, payload)
    return chunk


def check_chunk(chunk: Any, raw: bytes = b"") -> None:
    """One streamed event; a non-object payload is not read by the proxy and is left alone."""
    if not isinstance(chunk, dict):
        return
    problem = _usage_problem(chunk) or _choices_problem(chunk, "delta")
    if problem is not None:
        raise _malformed(problem, raw or _dump(chunk))


def usage_figure(usage: Any, key: str) -> int | None:
    """``usage[key]`` if it is a plausible token count, else None (unknown)."""
    value = usage.get(key) if isinstance(usage, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _FIGURE_MAX:
        return value
    return None


def _completion_problem(answer: Any) -> str | None:
    if not isinstance(answer, dict):
        return f"the answer is a JSON {type(answer).__name__}, not an object"
    return _usage_problem(answer) or _choices_problem(answer, "message")


def _usage_problem(answer: dict[str, Any]) -> str | None:
    usage = answer.get("usage")
    return None if usage is None or isinstance(usage, dict) else f"`usage` is a {type(usage).__name__}"


def _choices_problem(answer: dict[str, Any], part: str) -> str | None:
    choices = answer.get("choices")
    if choices is None:
        return None
    if not isinstance(choices, list):
        return f"`choices` is a {type(choices).__name__}, not an array"
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict):
            return f"`choices[{i}]` is a {type(choice).__name__}, not an object"
        inner = choice.get(part)
        if inner is None:
            continue
        if not isinstance(inner, dict):
            return f"`choices[{i}].{part}` is a {type(inner).__name__}, not an object"
        problem = _calls_problem(inner.get("tool_calls"), f"choices[{i}].{part}.tool_calls", streamed=part == "delta")
        if problem is not None:
            return problem
    return None


def _calls_problem(calls: Any, where: str, streamed: bool) -> str | None:
    if calls is None:
        return None
    if not isinstance(calls, list):
        return f"`{where}` is a {type(calls).__name__}, not an array"
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            return f"`{where}[{j}]` is a {type(call).__name__}, not an object"
        index = call.get("index")
        if streamed and index is not None and (not isinstance(index, int) or isinstance(index, bool) or index < 0):
            return f"`{where}[{j}].index` is {_show(index)}, not a non-negative integer"
        function = call.get("function")
        if function is not None and not isinstance(function, dict):
            return f"`{where}[{j}].function` is a {type(function).__name__}, not an object"
        for key in ("name", "arguments"):
            value = (function or {}).get(key)
            if value is not None and not isinstance(value, str):
                return f"`{where}[{j}].function.{key}` is a {type(value).__name__}, not a string"
        if call.get("id") is not None and not isinstance(call["id"], str):
            return f"`{where}[{j}].id` is a {type(call['id']).__name__}, not a string"
    return None


def _malformed(problem: str, content: bytes) -> UpstreamMalformed:
    return UpstreamMalformed(f"The upstream's answer is not one ctxproxy can read: {problem}. It began: "
                             f"{_excerpt(content)}. See the model server's log; this is not the client's fault.")


def _show(value: Any) -> str:
    return _excerpt(_dump(value), 40)


def _dump(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return repr(value).encode()


def _excerpt(content: bytes, limit: int = 200) -> str:
    text = content[:limit].decode("utf-8", "replace")
    return repr(text + ("…" if len(content) > limit else ""))
