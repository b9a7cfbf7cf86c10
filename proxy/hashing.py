"""Message identities for the journal at the cost of the new messages only.

An agent's request repeats the previous request's history and adds a few messages. Serialising and hashing the
whole history (about 1.5 ms at 630 KB) on every request would make the proxy's cost grow with the session, so
the last history seen per conversation is kept in memory: while a message equals (``==``) the one at the same
position last time, its canonical body and hash are reused; only the rest is serialised and hashed.

``==`` on decoded JSON treats ``1`` and ``1.0`` (and ``true`` and ``1``) as equal although their canonical JSON
differs; a history that changes only that way keeps the earlier identity. Agents do not do this, and the
journal then records the earlier, equal value.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.rewrite import canonical_json, content_hash

__all__ = ["HashedMessages", "MessageHasher"]


@dataclass(frozen=True)
class HashedMessages:
    messages: Sequence[Any]
    bodies: list[bytes]
    hashes: list[str]


class MessageHasher:
    """Canonical bodies and hashes of a message list, reusing the previous list's for its unchanged prefix.

    The last list of at most ``conversations`` conversations is kept, and of at most ``max_bytes`` of canonical
    bodies in all (the decoded messages cost about as much again): 60 conversations of 1 MB once kept ~100 MB
    here for good, incognito ones included, whatever their journal forgot."""

    def __init__(self, conversations: int = 64, max_bytes: int = 32 * 1024 * 1024) -> None:
        self._last: OrderedDict[str, HashedMessages] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._capacity, self._max_bytes, self._bytes = conversations, max_bytes, 0

    def hash(self, key: str, messages: Sequence[Any]) -> HashedMessages:
        previous = self._last.pop(key, None)
        self._bytes -= self._sizes.pop(key, 0)
        same = _common_prefix(previous.messages, messages) if previous else 0
        bodies = previous.bodies[:same] if previous else []
        hashes = previous.hashes[:same] if previous else []
        for message in messages[same:]:
            body = canonical_json(message)
            bodies.append(body)
            hashes.append(content_hash(body))
        result = HashedMessages(messages, bodies, hashes)
        self._keep(key, result)
        return result

    def _keep(self, key: str, hashed: HashedMessages) -> None:
        size = sum(len(b) for b in hashed.bodies)
        self._last[key], self._sizes[key] = hashed, size
        self._bytes += size
        while self._last and (len(self._last) > self._capacity or self._bytes > self._max_bytes):
            oldest, _ = self._last.popitem(last=False)
            self._bytes -= self._sizes.pop(oldest)


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), n)
