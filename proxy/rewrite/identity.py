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

__all__ = ["canonical_json", "content_hash", "fingerprint", "message_hash"]

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
