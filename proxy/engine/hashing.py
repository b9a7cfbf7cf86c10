"""Message identities for the journal at the cost of the new messages only.

An agent's request repeats the previous request's history and adds a few messages. Serialising and hashing the
whole history (about 1.5 ms at 630 KB) on every request would make the proxy's cost grow with the session, so
the last histories seen per conversation are kept in memory: while a message equals (``==``) the one at the same
position in the kept history that shares the most with it, its canonical body and hash are reused; only the rest is
serialised and hashed.

``==`` on decoded JSON treats ``1`` and ``1.0`` (and ``true`` and ``1``) as equal although their canonical JSON
differs; a history that changes only that way keeps the earlier identity. Agents do not do this, and the
journal then records the earlier, equal value.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ctxproxy.proxy.core import canonical_json, content_hash

__all__ = ["HashedMessages", "MessageHasher"]


@dataclass(frozen=True)
class HashedMessages:
    messages: Sequence[Any]
    bodies: list[bytes]
    hashes: list[str]
    size: int = 0
    """The bodies' total length in bytes."""


class MessageHasher:
    """Canonical bodies and hashes of a message list, reusing a previous list's for its unchanged prefix.

    It keeps, per conversation (an opening, or a named session), the last list and up to ``per_conversation - 1``
    earlier ones the last did not extend: a new run with the same opening sent between two requests of a long
    session, or a fork, would otherwise make the next of them serialise and hash its whole history again (about
    2.5 ms per MB). At most ``conversations`` conversations, oldest dropped first, and no more than ``max_bytes``
    of canonical bodies besides the newest conversation's lists: a 50 MB request would otherwise stay in memory
    (twice: parsed and serialised) until 64 other conversations had come by, and 60 incognito conversations of
    1 MB kept ~100 MB here for good, whatever their journal forgot. Safe to share between the event loop and the
    worker that hashes large requests (``proxy.engine.heavy``).
    """

    def __init__(self, conversations: int = 64, max_bytes: int = 32 << 20, per_conversation: int = 3) -> None:
        self._last: OrderedDict[str, list[HashedMessages]] = OrderedDict()
        self._capacity = conversations
        self._max_bytes = max_bytes
        self._per_conversation = per_conversation
        self._bytes = 0
        self._lock = threading.Lock()

    def hash(self, key: str, messages: Sequence[Any]) -> HashedMessages:
        with self._lock:
            kept = self._last.pop(key, [])
            self._bytes -= sum(entry.size for entry in kept)
        shared = _shared(kept, messages)
        best = max(range(len(kept)), key=shared.__getitem__, default=None)
        same = shared[best] if best is not None else 0
        bodies = kept[best].bodies[:same] if best is not None else []
        hashes = kept[best].hashes[:same] if best is not None else []
        for message in messages[same:]:
            body = canonical_json(message)
            bodies.append(body)
            hashes.append(content_hash(body))
        result = HashedMessages(messages, bodies, hashes, sum(map(len, bodies)))
        earlier = [entry for entry, n in zip(kept, shared, strict=True) if n < len(entry.messages)]  # not extended
        self._keep(key, [result, *earlier][: self._per_conversation])
        return result

    def _keep(self, key: str, lists: list[HashedMessages]) -> None:
        with self._lock:
            self._last[key] = lists
            self._bytes += sum(entry.size for entry in lists)
            while len(self._last) > 1 and (len(self._last) > self._capacity or self._bytes > self._max_bytes):
                self._bytes -= sum(entry.size for entry in self._last.popitem(last=False)[1])

    @property
    def retained_bytes(self) -> int:
        """The canonical bodies kept for reuse, in bytes."""
        return self._bytes


def _shared(kept: Sequence[HashedMessages], messages: Sequence[Any]) -> list[int]:
    """How many leading messages each kept list shares with ``messages``, comparing messages (``==``) only where
    the kept lists' hashes cannot tell: against the best list so far, a list that parts from it before the
    ``messages`` do shares exactly as much as it has in common with it, and one that parts later shares what the
    best shares. A fork sent between the requests of a long session kept three 6 MB lists, and comparing each
    message by message cost about 0.7 ms per list."""
    shared: list[int] = []
    best, most = None, 0
    for entry in kept:
        if best is None:
            n = _common_prefix(entry.messages, messages)
        else:
            common = _common_prefix(best.hashes, entry.hashes)  # hashes: compared in C, 64 characters each
            n = min(common, most) if common != most else most + _common_prefix(entry.messages[most:],
                                                                                 messages[most:])
        shared.append(n)
        if best is None or n > most:
            best, most = entry, n
    return shared


_CHUNK = 64
"""Messages compared at once in C, by slices: where two lists part, only that slice is walked in Python."""


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    for start in range(0, n, _CHUNK):
        end = min(start + _CHUNK, n)
        if a[start:end] != b[start:end]:
            return next(i for i in range(start, end) if a[i] != b[i])
    return n
