"""The prefix index: how many leading messages a request shares with a journaled message list, without rebuilding it.

Placement asks, for a request that extends no session (a new run with the same opening, an edited retry, a fork),
how many leading messages it shares with each candidate session's head. Rebuilding a head from its delta chain
costs one row per request of the session (5.4 ms at 600 rounds, for each of up to 8 candidates). Instead, every
request's message list records the digest of each of its prefixes (``prefix_digest`` of its first n hashes) that
its base did not already record, in ``prefixes``, so the lookup is a binary search of a few indexed SELECTs.

Rows are kept per *segment*, not per list: a list that extends its base whole (the usual next request of a session)
joins its base's segment and adds rows for its new positions only, so a session of R rounds and M messages costs
M rows, whatever R. A list that keeps only part of its base (a fork, an edit) opens a segment of its own, whose
rows start after the part it shares; below that, its digests are its base's. A segment never holds two different
messages at one position: a list joins only while its base is the segment's longest list (a second list extending
the same base, e.g. a parallel run, opens its own segment).

Only request lists are indexed (placement never looks at a forward's list, and a request list's base is always a
request list). A list without a segment (none should remain after ``m006``) is rebuilt from its chain.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right, insort
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import Any

from ctxproxy.store.sql import Connection

__all__ = ["DigestRows", "PrefixDigests", "common_prefix", "holder", "index_list", "index_new_list", "joined_segment",
           "list_digest"]


class PrefixDigests:
    """The digests of a request's prefixes (``prefix_digest(hashes[:n])``), computed on demand.

    Each digest continues the hash state of the nearest shorter prefix already computed, so any set of lookups
    (a binary search, the heads' lengths) costs one pass over the hashes' bytes, in C, plus a few calls each.
    """

    def __init__(self, hashes: Sequence[str]) -> None:
        self.hashes = hashes
        joined = "".join(hashes)
        self._bytes = joined.encode()
        hexed = joined.isascii() and (not hashes or set(map(len, hashes)) == {64})
        self._offsets = None if hexed else [0, *accumulate(len(h.encode()) for h in hashes)]
        self._states = {0: hashlib.sha256()}
        self._known = [0]
        self._digests: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.hashes)

    def at(self, n: int) -> str:
        digest = self._digests.get(n)
        if digest is None:
            digest = self._digests[n] = self._state(n).hexdigest()
        return digest

    def run(self, start: int, end: int) -> Iterator[tuple[int, str]]:
        """(n, digest) for every n in (start, end], in one pass."""
        state = self._state(start).copy()
        for n in range(start + 1, end + 1):
            state.update(self.hashes[n - 1].encode())
            yield n, state.copy().hexdigest()

    def _state(self, n: int) -> hashlib._Hash:
        state = self._states.get(n)
        if state is None:
            below = self._known[bisect_right(self._known, n) - 1]
            state = self._states[below].copy()
            state.update(self._bytes[self._offset(below):self._offset(n)])
            self._states[n] = state
            insort(self._known, n)
        return state

    def _offset(self, n: int) -> int:
        """Where the n-th hash starts in the joined bytes: 64 × n for the proxy's (sha256 in hex)."""
        return 64 * n if self._offsets is None else self._offsets[n]


def joined_segment(conn: Connection, base_id: int | None, base_len: int) -> int | None:
    """The segment a new list joins: its base's, when the list continues the base from its segment's end (a
    session's next request); None when it starts one of its own (a fork, a new run)."""
    if base_id is None or not base_len:
        return None
    row = conn.execute("SELECT l.segment, l.length, (SELECT MAX(p.length) FROM prefixes p"
                       " WHERE p.segment = l.segment) FROM message_lists l WHERE l.id = ?", [base_id]).fetchone()
    return int(row[0]) if row is not None and row[0] is not None and base_len == row[1] == row[2] else None


def index_list(conn: Connection, list_id: int, digests: PrefixDigests, base_id: int | None,
               base_len: int) -> None:
    """Record the prefixes of request list ``list_id`` (its hashes: ``digests``) that its base did not, the list
    written without its segment (``index_new_list`` for one written with it)."""
    joined = joined_segment(conn, base_id, base_len)
    if joined is not None:  # one of its own is set by ``index_new_list``
        conn.execute("UPDATE message_lists SET segment = ? WHERE id = ?", [joined, list_id])
    index_new_list(conn, list_id, digests, base_len, joined)


def index_new_list(conn: Connection, list_id: int, digests: PrefixDigests, base_len: int,
                   joined: int | None) -> None:
    """``index_list`` of a list inserted with the segment it joins (``joined_segment``): only one that starts its
    own is given it after (every request of a session joined its base's with an ``UPDATE`` of its own, issue #13)."""
    segment = list_id if joined is None else joined
    if joined is None:
        conn.execute("UPDATE message_lists SET segment = ? WHERE id = ?", [list_id, list_id])
    conn.executemany("INSERT INTO prefixes (segment, length, digest) VALUES (?, ?, ?)",
                     [(segment, n, d) for n, d in digests.run(base_len, len(digests))])


DigestRows = dict[tuple[int, int], tuple[Any, ...]]
"""``_DIGEST_AT``'s rows a journal keeps, by (list, n) (``list_digest``'s ``known``)."""


def list_digest(conn: Connection, list_id: int, n: int, rebuild: Callable[[int], list[str]],
                known: DigestRows | None = None) -> str:
    """``prefix_digest`` of the first ``n`` messages of request list ``list_id`` (n ≤ its length): one indexed
    SELECT, or one per fork below it. ``rebuild``: the journal's chain walk, for a list the index does not cover.
    ``known``: the rows read before, kept (``_digest_row``)."""
    current: int | None = list_id
    while n and current is not None:
        row = _digest_row(conn, current, n, known)
        if row is None:
            return PrefixDigests(rebuild(current)).at(n)
        base_id, base_len, digest = row
        if n > base_len:
            return str(digest) if digest is not None else PrefixDigests(rebuild(current)).at(n)
        current = base_id
    return hashlib.sha256(b"").hexdigest()


def holder(conn: Connection, list_id: int, n: int, known: DigestRows | None = None) -> int:
    """The list that holds the first ``n`` messages of request list ``list_id`` in its own segment: ``list_id``
    itself, or the base its segment took them from, and so on down. A fork is delta-encoded against it rather than
    against its parent's list: each new run of an opening would otherwise add one hop to every later lookup
    below its fork point (runs forking runs that forked, 100 deep after 800 new runs). Each step reads the row
    ``list_digest`` reads at ``n`` (``known``: kept from the search that found ``n``, two statements of a fork)."""
    current = list_id
    while True:
        row = _digest_row(conn, current, n, known)
        if row is None or row[0] is None or n > row[1]:
            return current
        current = int(row[0])


def _digest_row(conn: Connection, list_id: int, n: int, known: DigestRows | None) -> tuple[Any, ...] | None:
    """``_DIGEST_AT`` of (n, list), from ``known`` when read before. A row, once there, never changes: a list's
    segment is set in the transaction that writes it, and a segment's digest at n is never rewritten (lists join a
    segment only past its last position). Only removing lists (a prune, the incognito bound) or another process
    can make one stale: the journal forgets them then (``forget_digests``). The rows kept are the ones a search
    reads again: every new run of an opening probes the same few positions of the same recent heads (a new run of
    the peers' benchmark: 14 statements, then 2)."""
    key = (list_id, n)
    row = known.get(key) if known is not None else None
    if row is None:
        row = conn.execute(_DIGEST_AT, [n, list_id]).fetchone()
        if known is not None and row is not None and (row[2] is not None or n <= row[1]):  # else rebuilt, not kept
            if len(known) >= DIGEST_ROWS_KEPT:
                known.pop(next(iter(known)))
            known[key] = tuple(row)
    return row


DIGEST_ROWS_KEPT = 8192
"""``_digest_row``'s rows a journal keeps at most (~1 MB); beyond, the one read first is read again."""


_DIGEST_AT = """
SELECT r.base_id, r.base_len, p.digest
  FROM message_lists l JOIN message_lists r ON r.id = l.segment
  LEFT JOIN prefixes p ON p.segment = r.id AND p.length = ?
 WHERE l.id = ?
"""
"""A list's segment's first list (its base and the length it shares with it), and the segment's digest at n."""


def common_prefix(conn: Connection, list_id: int, length: int, digests: PrefixDigests,
                  rebuild: Callable[[int], list[str]], at_least: int = 0, known: DigestRows | None = None) -> int:
    """How many leading messages list ``list_id`` (``length`` of them) shares with the request, or ``at_least``
    when it is no more than that (the caller only wants a longer one). Sharing n messages implies sharing every
    shorter prefix, so a binary search over n finds it, each probe one ``list_digest``. A request that reaches
    the list's end is probed there first: a fork that replaces its last message (an edited retry, the peers'
    benchmark's new text at the end) shares everything before it, one probe where the search took 8 at 300
    messages; any other such fork pays one more. A shorter request (a new run) is searched as before."""
    lo, hi = at_least, min(length, len(digests))

    def shares(n: int) -> bool:
        return list_digest(conn, list_id, n, rebuild, known) == digests.at(n)

    if hi <= lo:
        return lo
    if length <= len(digests):
        if shares(hi):
            return hi
        hi -= 1
    if hi <= lo or not shares(lo + 1):
        return lo
    lo += 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if shares(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
