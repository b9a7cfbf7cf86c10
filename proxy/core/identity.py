"""Identities of messages and sessions, by content.

A message's identity is the sha256 of its canonical JSON (sorted keys, no whitespace: changing the canonical form
changes every hash, so it never changes). A session's fingerprint is taken from its opening — the first system
and the first user message — which every request of a run repeats.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

__all__ = [
    "canonical_json", "content_hash", "content_text", "fingerprint", "identity_base", "message_hash", "message_ids",
    "next_identity",
]

_SYSTEM_ROLES = ("system", "developer")


def canonical_json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def content_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def message_hash(message: Mapping[str, Any]) -> str:
    return content_hash(canonical_json(message))


def fingerprint(messages: Sequence[Mapping[str, Any]]) -> str:
    """sha256 of the first system and the first user message's content (either may be absent)."""
    system = next((m.get("content") for m in messages if m.get("role") in _SYSTEM_ROLES), None)
    user = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    return content_hash(canonical_json([system, user]))


def content_text(content: Any) -> str:
    """A message content's text: the string, or the text parts of a list of parts."""
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def identity_base(message: Mapping[str, Any], message_hash: str) -> str:
    """A tool result is known by the call it answers; any other message by its role and content hash."""
    if message.get("role") == "tool" and isinstance(message.get("tool_call_id"), str):
        return f"tool:{message['tool_call_id']}"
    return f"{message.get('role')}:{message_hash[:16]}"


def next_identity(base: str, seen: dict[str, int]) -> str:
    """``base`` for its first occurrence, ``base#n`` for the n-th repeat (agents reuse tool_call_ids)."""
    n = seen.get(base, 0)
    seen[base] = n + 1
    return base if n == 0 else f"{base}#{n}"


def message_ids(messages: Sequence[Mapping[str, Any]], hashes: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    return [next_identity(identity_base(m, h), seen) for m, h in zip(messages, hashes, strict=True)]
