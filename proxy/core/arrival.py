"""A request body compared with the kept bodies as its pieces arrive, so that what it repeats is never copied.

Why: after a 600-round session a fork's or a next request's 6.5 MB body repeated a kept body's bytes all but its
last few KB (or 20 messages), yet it was joined whole from uvicorn's 64 KB pieces into fresh memory (3–5 ms of
page faults per request in the proxy's profile, issue #13) and then compared whole with the kept bodies
(``Prefixes.match``). ``Arrival`` does the comparison piece by piece instead, as they come: while a piece is
what some kept body holds at that offset, it is dropped, and the body's first bytes are that kept body's
(``Pieces``, nothing copied); only the pieces from where the last candidate parts are kept, as they came.

The shared lengths found are exactly ``Prefixes.match``'s (each candidate's common prefix with the body), so the
body is matched, parsed and kept as before; a kept body newer than another and known to share ``m`` bytes with
it (``_Kept.shared_with``) tells where the body parts from the older one without reading it, as in ``match``.
"""

from __future__ import annotations

from ctxproxy.proxy.core.pieces import Pieces, Span
from ctxproxy.proxy.core.prefix import Match, Prefixes, _Kept

__all__ = ["MERGE_BYTES", "Arrival"]


class Arrival:
    """One body, fed piece by piece (``feed``), then its bytes and its match (``finish``)."""

    def __init__(self, prefixes: Prefixes) -> None:
        self._prefixes = prefixes
        self._size = 0
        self._pending: list[bytes] | None = []
        """The first pieces, until they hold the ``key_bytes`` the candidates are looked up by, and as many as a
        body must have to be matched at all (``min_bytes``): a smaller one is never compared."""
        self._pending_size = 0
        self._look_at = max(prefixes.key_bytes, prefixes.min_bytes)
        self._candidates: list[_Kept] = []
        self._alive: list[_Kept] = []
        """The candidates every byte so far agrees with, the newest first."""
        self._parted: dict[_Kept, int] = {}
        self._lead: _Kept | None = None
        """The last candidate to part: its first ``_covered`` bytes are the body's."""
        self._covered = 0
        self._own: list[Span] = []

    def feed(self, piece: bytes) -> None:
        if self._pending is not None:
            self._pending.append(piece)
            self._pending_size += len(piece)
            if self._pending_size >= self._look_at:
                self._look_up()
            return
        self._compare(piece)

    def finish(self) -> tuple[Pieces, Match | None]:
        """The body's bytes, and the kept body it is to be parsed from (as ``Prefixes.match`` finds it), if any.
        A body below ``min_bytes`` was never compared: ``match`` would not parse it from a kept one either (the
        3 KB request of the peers' benchmark was compared with the 630 KB history's kept bodies, which open with
        the same tools: ~0.2 ms of its path for a match that could not be used)."""
        if self._pending is not None and self._pending_size < self._prefixes.min_bytes:
            pending = self._pending
            return Pieces.of(pending[0] if len(pending) == 1 else b"".join(pending)), None
        if self._pending is not None:
            self._look_up()
        head = self._lead.raw.cut(0, self._covered) if self._lead is not None else Pieces(())
        raw = _compact(Pieces([*head.spans, *self._own]), self._covered)
        compared = {kept: self._parted.get(kept, self._size) for kept in self._candidates}
        return raw, self._prefixes.matched(raw, compared)

    def _look_up(self) -> None:
        pending, self._pending = self._pending or [], None
        self._candidates = self._alive = self._prefixes.candidates(b"".join(pending)[:self._prefixes.key_bytes])
        for piece in pending:
            self._compare(piece)

    def _compare(self, piece: bytes) -> None:
        at, self._size = self._size, self._size + len(piece)
        if not self._alive:
            self._own.append((piece, 0, len(piece)))
            return
        view, agreed = memoryview(piece), dict[_Kept, int]()
        for kept in self._alive:
            agreed[kept] = _agreed(kept, view, at, agreed)
        longest = max(agreed.values())
        self._parted.update({kept: at + n for kept, n in agreed.items() if n < len(piece)})
        self._lead = max(self._alive, key=agreed.__getitem__)  # the newest among the longest
        self._covered = at + longest
        self._alive = [kept for kept in self._alive if agreed[kept] == len(piece)]
        if longest < len(piece):
            self._own.append((piece, longest, len(piece)))


def _agreed(kept: _Kept, view: memoryview, at: int, known: dict[_Kept, int]) -> int:
    """How many leading bytes of the piece ``view`` (at offset ``at``) ``kept`` holds there. A newer candidate
    compared already, and known to share ``m`` bytes with ``kept``, tells it unless the body parts from it at
    ``m`` exactly; then only the bytes from there on are read."""
    for newer, n in known.items():
        shared = newer.shared_with.get(kept)
        if shared is not None:
            rel = min(max(shared - at, 0), len(view))
            if n != rel or rel == len(view):
                return min(n, rel)
            return rel + kept.raw.agreeing(view[rel:], at + rel)
    return kept.raw.agreeing(view, at)


MERGE_BYTES = 1 << 20
"""The largest span two spans are merged into (``_compact``)."""


def _compact(raw: Pieces, covered: int) -> Pieces:
    """A body mostly its own (``covered``: the bytes a kept body stood in for) joined once, as a body read whole
    was; otherwise its last two spans joined while the last weighs more than half the one before it, up to
    ``MERGE_BYTES``. A session's next requests each add a small span, and spans merge as a binary counter's bits
    carry: a few spans, halving in size, and each byte copied a few times over the session (600 rounds of 10 KB: 5
    times), not every request. Without the bound, the carry that reached the top span copied the whole body into
    fresh memory: 1.4, 2.9, 5.6 and 7.4 MB at requests 130, 204, 319 and 488 of the 600-round run, 340-1,800 page
    faults each (~1.8 µs a page here), the same requests over twice the median in run after run (issue #13). Spans
    of a MiB at most: the 600-round run's 6.7 MB body is 10 spans (13 at most on the way), found by bisection."""
    if len(raw) - covered > covered and len(raw.spans) > 1:
        return Pieces.of(bytes(raw))
    spans = list(raw.spans)
    while len(spans) > 1 and 2 * _size(spans[-1]) > _size(spans[-2]) \
            and _size(spans[-2]) + _size(spans[-1]) <= MERGE_BYTES:
        last = Pieces(spans[-2:]).take(0, _size(spans[-2]) + _size(spans[-1]))
        spans[-2:] = [(last, 0, len(last))]
    return raw if len(spans) == len(raw.spans) else Pieces(spans)


def _size(span: Span) -> int:
    return span[2] - span[1]
