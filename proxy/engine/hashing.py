"""Message identities for the journal at the cost of the new messages only.

An agent's request repeats the previous request's history and adds a few messages. Serialising and hashing the
whole history (about 1.5 ms at 630 KB) on every request would make the proxy's cost grow with the session, so
the last histories seen per conversation are kept in memory: while a message equals (``==``) the one at the same
position in the kept history that shares the most with it, its hash is reused; only the rest is serialised and
hashed.

``==`` on decoded JSON treats ``1`` and ``1.0`` (and ``true`` and ``1``) as equal although their canonical JSON
differs; a history that changes only that way keeps the earlier identity. Agents do not do this, and the
journal then records the earlier, equal value.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from ctxproxy.proxy.core import canonical_json, content_hash
from ctxproxy.proxy.core.prefix import Prefixes

__all__ = ["Bodies", "HashedMessages", "MessageHasher", "common_start"]


@dataclass(frozen=True)
class HashedMessages:
    messages: Sequence[Any]
    bodies: Sequence[bytes]
    """The canonical bodies (``Bodies``: those of the messages hashed for this request; the others serialised again
    if asked for, which the request path does not do). Empty in a kept list."""
    hashes: list[str]
    ends: array[int] = field(default_factory=lambda: array("q"))
    """The bodies' cumulative lengths in bytes: ``ends[-1]`` is their total."""
    users: array[int] = field(default_factory=lambda: array("q"))
    """The indices of the messages whose role is ``user``, found in the new messages only (an agent's session has
    one, its task, 1 000 messages back: walking back to it cost 0.6 ms a request at 600 rounds)."""

    @property
    def size(self) -> int:
        """The bodies' total length in bytes."""
        return self.ends[-1] if self.ends else 0


class Bodies(Sequence[bytes]):
    """A list's canonical bodies: from ``start`` on those serialised to hash it, before that serialised on demand.

    The kept lists used to keep every body: 6.7 MB after 600 rounds, each body made during another request, among
    that request's short-lived blocks, so that they pinned about 55 MB of freed memory (RSS). What the request path
    reads is the new messages' bodies (the journal has the others); the fold files of ``overflow_dir`` are the one
    reader of earlier ones.
    """

    def __init__(self, messages: Sequence[Any], start: int, tail: list[bytes]) -> None:
        self._messages, self._start, self._tail = messages, start, tail

    def __len__(self) -> int:
        return len(self._messages)

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = range(len(self))[index]  # negative indices, and IndexError past the end
        return self._tail[i - self._start] if i >= self._start else canonical_json(self._messages[i])


class MessageHasher:
    """Canonical bodies and hashes of a message list, reusing a previous list's hashes for its unchanged prefix.

    It keeps, per conversation (an opening, or a named session), the last list and up to ``per_conversation - 1``
    earlier ones the last did not extend: a new run with the same opening sent between two requests of a long
    session, or a fork, would otherwise make the next of them serialise and hash its whole history again (about
    2.5 ms per MB). At most ``conversations`` conversations, oldest dropped first, and no more than ``max_bytes``
    of histories (by their canonical size) besides the newest conversation's lists: a 50 MB request would otherwise
    stay in memory until 64 other conversations had come by, and 60 incognito conversations of
    1 MB kept ~100 MB here for good, whatever their journal forgot. Safe to share between the event loop and the
    worker that hashes large requests (``proxy.engine.heavy``).
    """

    def __init__(self, conversations: int = 64, max_bytes: int = 32 << 20, per_conversation: int = 3) -> None:
        self.prefixes = Prefixes(max_bytes)
        """The last request bodies, so that the next ones parse only their new bytes and hand this hasher the
        same message objects for their unchanged history (compared by identity, in C)."""
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
        hashes = kept[best].hashes[:same] if best is not None else []
        ends = kept[best].ends[:same] if best is not None else array("q")
        users = kept[best].users[:bisect_left(kept[best].users, same)] if best is not None else array("q")
        users.extend(i for i in range(same, len(messages)) if _role(messages[i]) == "user")
        tail = [canonical_json(message) for message in messages[same:]]
        total = ends[-1] if ends else 0
        for body in tail:
            hashes.append(content_hash(body))
            total += len(body)
            ends.append(total)
        result = HashedMessages(messages, Bodies(messages, same, tail), hashes, ends, users)
        earlier = [entry for entry, n in zip(kept, shared, strict=True) if n < len(entry.messages)]  # not extended
        kept_now = HashedMessages(messages, (), hashes, ends, users)  # built directly: ``replace`` took 3 µs
        self._keep(key, [kept_now, *earlier][: self._per_conversation])
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


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


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
            n = common_start(entry.messages, messages)
        else:
            common = common_start(best.hashes, entry.hashes)  # hashes: compared in C, 64 characters each
            n = min(common, most) if common != most else most + common_start(entry.messages[most:],
                                                                                 messages[most:])
        shared.append(n)
        if best is None or n > most:
            best, most = entry, n
    return shared


_CHUNK = 64
"""Messages compared at once in C, by slices: where two lists part, only that slice is walked in Python."""


def common_start(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many items ``a`` and ``b`` share from the start. A slice that differs is walked by a plain loop: a
    generator there cost more than the comparisons of a new run's three messages (3 µs a list, three lists a
    small request)."""
    n = min(len(a), len(b))
    for start in range(0, n, _CHUNK):
        end = min(start + _CHUNK, n)
        if a[start:end] != b[start:end]:
            for i in range(start, end):
                if a[i] != b[i]:
                    return i
    return n
