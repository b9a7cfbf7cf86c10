"""Recognising an upstream's "the prompt is too long" answer, whatever the server.

- llama.cpp ``llama-server``: 400 ``{"error": {"type": "exceed_context_size_error", "n_prompt_tokens": N, ...}}``;
- OpenAI, vLLM, llama-cpp-python: 400 with ``context_length_exceeded`` or "maximum context length … you
  requested N tokens" / "your messages resulted in N tokens";
- llama.cpp streaming: 200 with an empty body (the error only reaches the server's log). The relay sees that as
  a stream that ends before its first byte (``proxy.edge.chat``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

__all__ = ["Overflow", "detect_overflow"]

_MARKERS = ("exceed_context_size_error", "context_length_exceeded", "maximum context length",
            "exceeds the available context size")
# Prompt tokens only: "you requested 5000 tokens (3000 in the messages, 2000 in the completion)" is 3000.
_TOKENS = (re.compile(r"(\d+) in the messages"), re.compile(r"(\d+) tokens in the messages"),
           re.compile(r"resulted in (\d+) tokens"), re.compile(r"has (\d+) input tokens"),
           re.compile(r"prompt \((\d+) tokens\)"), re.compile(r"requested (\d+) tokens"))
_LIMIT = re.compile(r"maximum context length is (\d+)")


@dataclass(frozen=True)
class Overflow:
    prompt_tokens: int | None
    """How many tokens the upstream counted in the prompt, when it said so."""
    message: str
    limit: int | None = None
    """The upstream's window, when it said so (llama.cpp ``n_ctx``, "maximum context length is N")."""


def detect_overflow(status: int, body: bytes) -> Overflow | None:
    if status not in (400, 413, 422, 500) or not body:
        return None
    text = body.decode("utf-8", "replace")
    lowered = text.lower()
    if not any(marker in lowered for marker in _MARKERS):
        return None
    return Overflow(_prompt_tokens(body, text), _message(body) or text[:300], _limit(body, text))


def _limit(body: bytes, text: str) -> int | None:
    n_ctx = _error_object(body).get("n_ctx")
    if isinstance(n_ctx, int) and n_ctx > 0:
        return n_ctx
    match = _LIMIT.search(text)
    return int(match.group(1)) if match else None


def _prompt_tokens(body: bytes, text: str) -> int | None:
    counted = _error_object(body).get("n_prompt_tokens")
    if isinstance(counted, int):
        return counted
    for pattern in _TOKENS:
        match = pattern.search(text)
        if match:
            return int(match.group(1))
    return None


def _message(body: bytes) -> str:
    message = _error_object(body).get("message")
    return message if isinstance(message, str) else ""


def _error_object(body: bytes) -> dict[str, object]:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return error if isinstance(error, dict) else {}
