"""Parsing a chat body at the cost of its new bytes: the unchanged prefix is recognised in the raw bytes.

An agent's request repeats, byte for byte, what its previous request sent and appends a few KB; a fork repeats
all of it but one message. Parsing the whole body (``orjson.loads``: ~8 ms for the 6.5 MB of a 600-round
session) on every request made each one cost what its history weighs. So ``Prefixes`` keeps the last few bodies
(raw bytes, the parsed top-level object, the byte offsets of some of the ``messages`` array's element ends) and,
for a new body, finds the longest kept body it shares a prefix with (``startswith`` on memoryview slices: C
``memcmp``, ~0.2 ms for 6.5 MB), the last element end at or before where they part (a ``cut``), and the same bytes
after the array. The new body is then the kept one's first ``count`` messages (the SAME objects, so later steps
compare them by identity), then the elements between the cut and the array's end, parsed alone, with the kept
top-level fields around them.

Why it is exact: the bytes up to the cut are the kept body's, so a parser is in the same state there (inside the
``messages`` array, after an element); the new bytes parse as a sequence of values at the same depth
(``[[`` + middle + ``]]``: orjson's depth limit counts as in the body); and the bytes from the array's ``]`` on
are the kept body's, which closed the array and the object. The array's position in a kept body is checked once
(its head and tail parse, around an empty array, to the body's keys with ``messages`` empty, so a duplicate
``messages`` key cannot mislead it). Anything unexpected answers None and the caller parses the whole body.

A body's bytes are ``Pieces``: what it repeats of a kept body are that body's, not a copy (``proxy.core.arrival``);
a kept body is weighed by the objects it keeps alive, whole.

Element ends are found lazily and remembered: walking back from a known end (or the array's ``]``) to where a
new body parts, token by token (strings skipped whole by a regex over reversed bytes): 4 KB first, as a next request
parts in its last bytes (64 KB cost it 0.1-0.2 ms), twice that after a window that found none.
"""

from __future__ import annotations

import re
import threading
import weakref
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from ctxproxy.proxy.core.pieces import Pieces, agreeing

__all__ = ["MIN_BYTES", "Match", "Prefixes", "Reused"]

MIN_BYTES = 32 << 10
"""Bodies below this size are parsed whole and not kept: orjson parses 32 KB in ~40 µs."""

_KEY_BYTES = 2048
"""A body is looked up by its first bytes: the model, the system prompt, the opening of the conversation."""

_WS = b" \t\n\r"
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},]', re.DOTALL)
"""A JSON string (skipped whole) or a structural byte, reading forward."""
_ODD = rb'\\(?:\\\\)*(?!\\)'
_BACKWARD = re.compile(rb'"[^"]*(?:"(?=' + _ODD + rb')[^"]*)*"(?!' + _ODD + rb')|[\[\]{},"]')
"""The same over reversed bytes: a ``"`` followed (preceded, in the body) by an odd run of backslashes is escaped,
and cannot end a string; a lone ``"`` is a string cut by the window."""
_WINDOW, _FIRST_WALK = 64 << 10, 4 << 10
_MAX_BACKSLASHES = 4096


@dataclass(eq=False)
class _Kept:
    raw: Pieces
    """The body's bytes: a span of an earlier body's and its own, as they came (``proxy.core.arrival``)."""
    top: dict[str, Any]
    """The parsed body: its ``messages`` and other fields are reused as they are."""
    open: int
    """Offset of the ``messages`` array's ``[``."""
    tail: int
    """Bytes from the array's ``]`` to the end of the body."""
    offsets: list[int] = field(default_factory=list)
    """Known element ends, ascending: ``raw[:offsets[i]]`` holds ``counts[i]`` whole messages."""
    counts: list[int] = field(default_factory=list)
    window: int = _WINDOW
    """The bytes read back at first when looking for the array's end, or for element ends (``_FIRST_WALK`` at most)."""
    shared_with: weakref.WeakKeyDictionary[_Kept, int] = field(default_factory=weakref.WeakKeyDictionary)
    """How many leading bytes this body shares with older kept ones, as found when it came: a new body compared
    with this one need not read those again (``_shared``)."""

    @property
    def close(self) -> int:
        return len(self.raw) - self.tail

    def remember(self, cuts: list[tuple[int, int]]) -> None:
        for offset, count in cuts:
            i = bisect_right(self.offsets, offset)
            if not (i and self.offsets[i - 1] == offset):
                self.offsets.insert(i, offset)
                self.counts.insert(i, count)


@dataclass(frozen=True)
class Match:
    """A kept body and how many leading bytes a new one shares with it (up to the kept array's end at most): the
    new body's bytes from there on are what its parse costs."""

    kept: _Kept
    shared: int
    compared: dict[_Kept, int] = field(default_factory=dict)
    """Every candidate's shared length with the new body."""


@dataclass(frozen=True)
class Reused:
    """A body parsed from a kept one: ``body`` equals ``orjson.loads(raw)``; its first ``count`` messages are the
    kept body's objects (already validated when it was kept)."""

    body: dict[str, Any]
    count: int
    kept: _Kept
    cut: int
    compared: dict[_Kept, int]


class Prefixes:
    """The last bodies seen, at most ``max_bytes`` of them (oldest dropped first), ``per_key`` per opening.

    Safe to share between the event loop and the workers that parse large bodies: the index is locked; a kept
    body's element ends only grow, under the lock.
    """

    def __init__(self, max_bytes: int = 32 << 20, per_key: int = 3, min_bytes: int = MIN_BYTES,
                 window: int = _WINDOW, key_bytes: int = _KEY_BYTES) -> None:
        self._window, self.key_bytes = window, key_bytes
        self._entries: OrderedDict[int, list[_Kept]] = OrderedDict()
        self._max_bytes, self._per_key, self.min_bytes, self._bytes = max_bytes, per_key, min_bytes, 0
        self._lock = threading.Lock()

    @property
    def retained_bytes(self) -> int:
        return self._bytes

    def candidates(self, head: bytes) -> list[_Kept]:
        """The kept bodies that open with ``head`` (a body's first ``key_bytes``), the newest first."""
        with self._lock:
            return list(self._entries.get(hash(head[:self.key_bytes]), ()))

    def match(self, raw: bytes | Pieces) -> Match | None:
        """The kept body ``raw`` shares the most with (bytes compared only: ~0.3 ms for 6.5 MB), or None."""
        raw = _pieces(raw)
        if len(raw) < self.min_bytes:
            return None
        best, shared, compared = None, -1, {}
        for kept in self.candidates(raw[:self.key_bytes]):  # the newest first
            n = compared[kept] = _shared(raw, kept, best, shared)
            if n > shared and _fits(raw, kept, n):
                best, shared = kept, n
        return self.matched(raw, compared)

    def matched(self, raw: Pieces, compared: dict[_Kept, int]) -> Match | None:
        """What ``match`` finds, from the shared lengths already known of every candidate (newest first)."""
        if len(raw) < self.min_bytes:
            return None
        best, shared = None, -1
        for kept, n in compared.items():
            if n > shared and _fits(raw, kept, n):
                best, shared = kept, n
        return None if best is None else Match(best, min(shared, len(raw) - best.tail), compared)

    def loads(self, raw: bytes | Pieces, match: Match | None = None) -> Reused | None:
        """``raw`` parsed from the kept body it shares the most with (``match``, if already found), or None:
        parse it whole."""
        raw = _pieces(raw)
        match = match or self.match(raw)
        return None if match is None else _splice(raw, match, self._lock)

    def messages_as_came(self, raw: bytes | Pieces, body: Mapping[str, object]) -> bytes | None:
        """``body``'s ``messages`` array as ``raw`` holds it, if ``body`` is kept (what it was parsed from)."""
        kept = next((k for k in self.candidates(_pieces(raw)[:self.key_bytes]) if k.top is body), None)
        return None if kept is None else kept.raw.take(kept.open, kept.close + 1)

    def keep(self, raw: bytes | Pieces, body: dict[str, Any], reused: Reused | None) -> None:
        """Remember a validated body for the next ones (``reused``: what ``loads`` made of it, if anything)."""
        if len(raw) < self.min_bytes:
            return
        raw = _pieces(raw)
        kept = _derived(raw, body, reused) if reused is not None else _located(bytes(raw), body, self._window)
        if kept is None:
            return
        key = hash(raw[:self.key_bytes])
        with self._lock:
            lists = self._entries.pop(key, [])
            self._bytes -= sum(entry.raw.weight() for entry in lists)  # before the extended one goes: it was counted
            if reused is not None and reused.count == len(reused.kept.top["messages"]):
                lists = [entry for entry in lists if entry is not reused.kept]  # extended: the new one covers it
            lists = [kept, *lists][: self._per_key]
            self._entries[key] = lists
            self._bytes += sum(entry.raw.weight() for entry in lists)
            while len(self._entries) > 1 and self._bytes > self._max_bytes:
                self._bytes -= sum(entry.raw.weight() for entry in self._entries.popitem(last=False)[1])


def _pieces(raw: bytes | Pieces) -> Pieces:
    return raw if isinstance(raw, Pieces) else Pieces.of(raw)


def _fits(raw: Pieces, kept: _Kept, shared: int) -> bool:
    """Whether ``raw`` parses from ``kept``: they share more than the array's head, and the bytes after the array."""
    return shared > kept.open and len(raw) - kept.tail > kept.open \
        and raw[len(raw) - kept.tail:] == kept.raw[kept.close:]


def common_prefix(a: bytes, b: bytes, start: int = 0) -> int:
    """How many leading bytes ``a`` and ``b`` share, knowing they share ``start`` (``pieces.agreeing``)."""
    n = min(len(a), len(b))
    return n if start >= n else start + agreeing(a, start, memoryview(b)[start:n])


def _shared(raw: Pieces, kept: _Kept, best: _Kept | None, most: int) -> int:
    """``common_prefix(raw, kept.raw)``, from what ``best`` (newer, ``raw`` shares ``most`` bytes with it) is known
    to share with ``kept``: if they part before ``most``, ``raw`` parts from ``kept`` there too; if after, at
    ``most``; only if at ``most`` are bytes compared, from there on. A fork sent between the requests of a long
    session is compared with two or three 6.5 MB bodies."""
    known = best.shared_with.get(kept) if best is not None else None
    if known is None:
        return raw.common_prefix(kept.raw)
    return min(known, most) if known != most else raw.common_prefix(kept.raw, most)


def _splice(raw: Pieces, match: Match, lock: threading.Lock) -> Reused | None:
    """The body from the kept one's messages up to the last element end at or before the shared bytes' end and
    the new elements after it."""
    kept = match.kept
    cut = _cut(kept, match.shared, lock)
    if cut is None:
        return None
    offset, count = cut
    middle = raw[offset:len(raw) - kept.tail].lstrip(_WS)
    if count and middle:
        if middle[:1] != b",":
            return None
        middle = middle[1:]
        if not middle.strip(_WS):
            return None  # a trailing comma
    try:
        added = orjson.loads(b"[[" + middle + b"]]")[0]
    except orjson.JSONDecodeError:
        return None
    messages = kept.top["messages"][:count] + added
    body = {key: messages if key == "messages" else value for key, value in kept.top.items()}
    return Reused(body, count, kept, offset, match.compared)


def _cut(kept: _Kept, limit: int, lock: threading.Lock) -> tuple[int, int] | None:
    """The last element end at or before ``limit`` (and how many messages precede it), walking back from the
    nearest known one above it (or the array's ``]``) when the known ones leave a gap."""
    total = len(kept.top["messages"])
    with lock:
        i = bisect_right(kept.offsets, limit)
        below = (kept.offsets[i - 1], kept.counts[i - 1]) if i else (kept.open + 1, 0)
        above = (kept.offsets[i], kept.counts[i]) if i < len(kept.offsets) else (kept.close, total + 1)
    if above[1] - below[1] <= 1:
        return below  # no element ends between them
    found = _walk_back(kept, above[0], min(above[1], total), limit)
    if not found or found[-1][0] > limit:
        return None  # not an array of objects after all (a kept body always is): parsed whole
    with lock:
        kept.remember(found)
    return found[-1]


def _walk_back(kept: _Kept, start: int, count: int, limit: int) -> list[tuple[int, int]] | None:
    """Element ends from ``start`` (an element end holding ``count`` messages, or the array's ``]``) back to
    the first at or before ``limit``, a window at a time, each going on from the last end the one before found
    (twice as long when that one found none); None where the bytes are not what a kept body's array should be."""
    found: list[tuple[int, int]] = []
    window = min(kept.window, _FIRST_WALK)
    while True:
        lo = _no_backslash_at(kept.raw, max(kept.open, start - window), kept.open)
        scanned = None if lo is None else _scan_back(kept.raw, lo, start, count, limit, kept.open)
        if scanned is None:
            return None
        cuts, done = scanned
        found += cuts[1:] if found and cuts and cuts[0] == found[-1] else cuts
        if done:
            return found
        if lo is not None and lo <= kept.open:
            return None  # the whole array read and no end found: not what a kept body holds
        if found and found[-1][0] < start:
            start, count = found[-1]
        else:
            window *= 2


def _no_backslash_at(raw: bytes | Pieces, lo: int, floor: int) -> int | None:
    """``lo`` moved back past a run of backslashes, so that a window from it sees each run of escapes whole."""
    for _ in range(_MAX_BACKSLASHES):
        if lo <= floor or raw[lo] != 0x5C:
            return lo
        lo -= 1
    return None


def _scan_back(raw: Pieces, lo: int, hi: int, count: int, limit: int,
               open_at: int) -> tuple[list[tuple[int, int]], bool] | None:
    """The element ends in ``raw[lo:hi]``, last first, down to the first at or before ``limit`` (then True), or
    as far as the window holds whole tokens (then False); None when the bytes are not an array of objects."""
    window = raw[lo:hi][::-1]
    cuts: list[tuple[int, int]] = []
    depth = 0
    for token in _BACKWARD.finditer(window):
        at, kind = hi - token.end(), token.group()
        if kind == b'"' or (at == lo and lo > open_at):
            return cuts, False  # a string or token cut by the window: the next one goes on from the last end
        if kind in (b"}", b"]"):
            if depth == 0:
                cuts.append((at + 1, count))
                if at + 1 <= limit:
                    return cuts, True
                count -= 1
            depth += 1
        elif kind in (b"{", b"["):
            depth -= 1
            if depth < 0:
                return ([*cuts, (at + 1, 0)], True) if at == open_at and count == 0 else None
        elif depth == 0 and kind != b",":
            return None  # a string among the elements: not an array of messages
    return (cuts, False) if lo > open_at else None


def _located(raw: bytes, body: dict[str, Any], window: int) -> _Kept | None:
    """A fully parsed body's ``messages`` array found in its bytes (the head and tail scanned, then checked)."""
    keys = list(body)
    if "messages" not in body:
        return None
    position = keys.index("messages")
    open_at = _open_of(raw, position)
    close = _close_of(raw, len(keys) - 1 - position, window)
    if open_at is None or close is None or close <= open_at:
        return None
    try:
        around = orjson.loads(raw[:open_at] + b"[]" + raw[close + 1:])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(around, dict) or around.get("messages") != [] or list(around) != keys:
        return None
    return _Kept(Pieces.of(raw), body, open_at, len(raw) - close, window=window)


def _open_of(raw: bytes, pairs_before: int) -> int | None:
    """The offset of the ``[`` that opens the value of the top-level pair after ``pairs_before`` pairs."""
    depth, commas = 0, 0
    for token in _TOKEN.finditer(raw):
        kind = token.group()
        if kind in (b"{", b"["):
            if depth == 1 and commas == pairs_before:
                return token.start() if kind == b"[" else None
            depth += 1
        elif kind in (b"}", b"]"):
            depth -= 1
            if depth <= 0:
                return None
        elif kind == b"," and depth == 1:
            commas += 1
    return None


def _close_of(raw: bytes, pairs_after: int, window: int) -> int | None:
    """The offset of the ``]`` that closes the value of the top-level pair followed by ``pairs_after`` pairs."""
    for size in (window, window << 4, len(raw)):
        lo = _no_backslash_at(raw, max(0, len(raw) - size), 0)
        if lo is None:
            return None
        found = _close_in(raw, lo, pairs_after)
        if found is not None or lo == 0:
            return found
    return None


def _close_in(raw: bytes, lo: int, pairs_after: int) -> int | None:
    hi = len(raw)
    reversed_tail = raw[lo:hi][::-1]
    depth, commas = 0, 0
    for token in _BACKWARD.finditer(reversed_tail):
        kind = token.group()
        if kind == b'"' or (token.end() == len(reversed_tail) and lo > 0):
            return None
        if kind in (b"}", b"]"):
            if depth == 1 and commas == pairs_after:
                return hi - token.end() if kind == b"]" else None
            depth += 1
        elif kind in (b"{", b"["):
            depth -= 1
            if depth <= 0:
                return None
        elif kind == b"," and depth == 1:
            commas += 1
    return None


def _derived(raw: Pieces, body: dict[str, Any], reused: Reused) -> _Kept:
    """The kept entry of a body spliced from ``reused.kept``: same head and tail, the element ends below the
    cut, and the new array's end."""
    kept = reused.kept
    entry = _Kept(raw, body, kept.open, kept.tail, window=kept.window)
    entry.shared_with.update(reused.compared)
    i = bisect_right(kept.offsets, reused.cut)
    entry.offsets, entry.counts = kept.offsets[:i], kept.counts[:i]
    return entry
