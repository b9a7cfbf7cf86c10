"""A body compared with the kept ones as its pieces arrive: the same bytes, the same match, nothing it repeats
copied; and ``Pieces``, the bytes it is held as, behaves as the ``bytes`` it stands for."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st

import ctxproxy.proxy.core.arrival as arrival_module
from ctxproxy.proxy.core.arrival import Arrival
from ctxproxy.proxy.core.pieces import Pieces
from ctxproxy.proxy.core.prefix import Match, Prefixes
from ctxproxy.proxy.edge.body import parse_chat_body
from tests.test_prefix import EDITS, STYLES, apply, encode, message

spans = st.lists(st.tuples(st.binary(max_size=24), st.integers(0, 24), st.integers(0, 24)), max_size=6)


def pieces_of(parts: list[tuple[bytes, int, int]]) -> tuple[Pieces, bytes]:
    cut = [(data, min(a, b, len(data)), min(max(a, b), len(data))) for data, a, b in parts]
    return Pieces(cut), b"".join(data[a:b] for data, a, b in cut)


@given(spans, st.integers(-2, 80), st.integers(-2, 80), st.sampled_from([b"a", b"\x00", b"{"]))
def test_pieces_read_as_the_bytes_they_stand_for(parts: list[tuple[bytes, int, int]], lo: int, hi: int,
                                                 byte: bytes) -> None:
    raw, whole = pieces_of(parts)
    assert len(raw) == len(whole) and bytes(raw) == whole
    assert raw[lo:hi] == whole[lo:hi] and raw[max(lo, 0):] == whole[max(lo, 0):]
    assert [raw[i] for i in range(len(whole))] == list(whole)
    assert raw.count(byte, max(lo, 0)) == whole.count(byte, max(lo, 0))
    assert bytes(raw.cut(max(lo, 0), max(hi, 0))) == whole[max(lo, 0):max(hi, 0)]


@given(spans, spans, st.integers(0, 60))
def test_pieces_agree_where_their_bytes_do(a: list[tuple[bytes, int, int]], b: list[tuple[bytes, int, int]],
                                           at: int) -> None:
    (left, x), (right, y) = pieces_of(a), pieces_of(b)
    n = left.common_prefix(right)
    assert x[:n] == y[:n] and (n == min(len(x), len(y)) or x[n] != y[n])
    agreed = left.agreeing(memoryview(y), at)
    assert x[at:at + agreed] == y[:agreed] and (agreed == min(len(y), max(len(x) - at, 0))
                                                 or x[at + agreed] != y[agreed])


def history(n: int, size: int = 40) -> list[dict[str, Any]]:
    return [{"role": "assistant" if i % 2 else "user", "content": f'{i} \\"quoted\\" [x] {{y}}, ' * size}
            for i in range(n)]


def arrive(prefixes: Prefixes, raw: bytes, sizes: list[int]) -> tuple[Pieces, Match | None]:
    arrival, at = Arrival(prefixes), 0
    for size in sizes:
        if at < len(raw):
            arrival.feed(raw[at:at + size])
            at += size
    if at < len(raw):
        arrival.feed(raw[at:])
    return arrival.finish()


def same_match(got: Match | None, expected: Match | None) -> bool:
    if got is None or expected is None:
        return got is expected
    return got.kept is expected.kept and got.shared == expected.shared and got.compared == expected.compared


@examples(max_examples=150)
@given(st.lists(message, min_size=1, max_size=8), STYLES, st.lists(EDITS, max_size=8),
       st.lists(st.integers(1, 40), max_size=30))
def test_a_body_read_in_pieces_is_its_bytes_and_matched_as_a_whole_one(
        messages: list[dict[str, Any]], style: str, edits: list[tuple[Any, ...]], sizes: list[int]) -> None:
    """Whatever the pieces, the bytes are the body's and the match is ``Prefixes.match``'s (kept body, shared
    length, every candidate's shared length); the body parsed from them is a full parse's, and is kept."""
    prefixes = Prefixes(min_bytes=0, window=16, key_bytes=4)
    body: dict[str, Any] = {"model": "m", "messages": messages}
    for edit in [("append", []), *edits]:
        body, style, data = apply(body, style, edit)
        raw = data if data is not None else encode(body, style)
        expected = prefixes.match(raw)
        pieces, match = arrive(prefixes, raw, sizes)
        assert bytes(pieces) == raw and same_match(match, expected)
        reused = prefixes.loads(pieces, match)
        try:
            full = orjson.loads(raw)
        except orjson.JSONDecodeError:
            assert reused is None
            continue
        if reused is not None:
            assert reused.body == full
        parsed = reused.body if reused is not None else full
        if isinstance(parsed, dict) and isinstance(parsed.get("messages"), list) and parsed["messages"] \
                and all(isinstance(m, dict) for m in parsed["messages"]):
            prefixes.keep(pieces, parsed, reused)
            assert all(orjson.loads(bytes(k.raw)) == k.top for lists in prefixes._entries.values() for k in lists)


class LookedUp(Prefixes):
    """Prefixes that count the bodies the kept ones were looked up for."""

    looked_up = 0

    def candidates(self, head: bytes) -> list[Any]:
        self.looked_up += 1
        return super().candidates(head)


@examples(max_examples=100)
@given(st.lists(message, min_size=1, max_size=6), st.lists(EDITS, max_size=6), st.integers(0, 600),
       st.lists(st.integers(1, 40), max_size=30))
def test_a_body_below_the_kept_size_is_never_compared(messages: list[dict[str, Any]], edits: list[tuple[Any, ...]],
                                                      min_bytes: int, sizes: list[int]) -> None:
    """Below ``min_bytes`` a body is parsed whole whatever it shares (``Prefixes.match``: None), so the kept
    bodies are not even looked up for it; from there on it is matched as a whole one would be."""
    prefixes = LookedUp(min_bytes=min_bytes, window=16, key_bytes=4)
    body: dict[str, Any] = {"model": "m", "messages": messages}
    for edit in [("append", []), *edits]:
        body, _, data = apply(body, "compact", edit)
        raw = data if data is not None else encode(body, "compact")
        expected = prefixes.match(raw)
        before = prefixes.looked_up
        pieces, match = arrive(prefixes, raw, sizes)
        assert bytes(pieces) == raw and same_match(match, expected)
        assert (prefixes.looked_up > before) == (len(raw) >= min_bytes)
        if expected is None and data is None:
            prefixes.keep(pieces, orjson.loads(raw), None)


def test_what_a_fork_repeats_is_the_kept_body_s_bytes_not_a_copy() -> None:
    prefixes = Prefixes(min_bytes=0)
    messages = history(60)
    raw = orjson.dumps({"model": "m", "messages": messages})
    parse_chat_body(raw, prefixes)
    fork = orjson.dumps({"model": "m", "messages": [*messages[:50], {"role": "user", "content": "fork"},
                                                    *messages[51:]]})
    pieces, match = arrive(prefixes, fork, [4096] * 1000)
    assert match is not None and bytes(pieces) == fork
    assert pieces.spans[0][0] is raw and pieces.ends[0] == match.shared  # the kept body's own object
    assert sum(end - start for data, start, end in pieces.spans[1:]) == len(fork) - match.shared
    assert parse_chat_body(pieces, prefixes, match) == orjson.loads(fork)


def growing(prefixes: Prefixes, rounds: int) -> Iterator[tuple[int, bytes, Pieces, Match | None, list[bytes]]]:
    """A session's bodies, each the one before and a message more, arriving in 3 KB pieces, each parsed as it is
    kept: (its number, its bytes, its pieces, its match, the objects it is held in that were neither sent nor
    held before: joined for it)."""
    messages = history(30)
    known: dict[int, bytes] = {}  # every object a body was held in so far (kept alive: ids stay theirs)
    for n in range(rounds):
        messages = [*messages, {"role": "assistant" if n % 2 else "user", "content": f"round {n} " * 30}]
        raw = orjson.dumps({"model": "m", "messages": messages})
        sent = [raw[at:at + 3000] for at in range(0, len(raw), 3000)]
        arrival = Arrival(prefixes)
        for piece in sent:
            arrival.feed(piece)
        pieces, match = arrival.finish()
        assert bytes(pieces) == raw and parse_chat_body(pieces, prefixes, match) == orjson.loads(raw)
        known.update((id(piece), piece) for piece in sent)
        new = [data for data, _, _ in pieces.spans if id(data) not in known]
        known.update((id(data), data) for data in new)
        yield n, raw, pieces, match, new


def test_a_growing_session_s_bodies_stay_few_spans_and_whole() -> None:
    """Each next request adds a span or two, and the last ones merge as a binary counter carries: a kept body
    stays a few spans, never thousands of small pieces, and the bytes joined over the session are a few times its
    size, not a body's size every request."""
    prefixes = Prefixes(min_bytes=0)
    joined, last = 0, b""
    for n, raw, pieces, match, new in growing(prefixes, 200):
        assert len(pieces.spans) <= 12 and (n == 0 or match is not None)
        joined, last = joined + sum(map(len, new)), raw
    [[kept]] = prefixes._entries.values()
    assert bytes(kept.raw) == last and prefixes.retained_bytes == kept.raw.weight() < 2 * len(last)
    assert joined < 8 * len(last)  # every body joined: 100 times


def test_spans_are_merged_up_to_the_bound_and_no_further(monkeypatch: pytest.MonkeyPatch) -> None:
    """The carry that reached a long session's top span copied the whole body into fresh memory (page faults on
    a few MB, the same requests slow in every run): merged spans stay within ``MERGE_BYTES``, and the spans of
    a body stay about its size over half the bound, plus the few still merging."""
    monkeypatch.setattr(arrival_module, "MERGE_BYTES", 16_000)
    largest, size = 0, 0
    for n, raw, pieces, _, new in growing(Prefixes(min_bytes=0), 300):
        assert len(pieces.spans) <= len(raw) // 8_000 + 12
        largest = max([largest, *(map(len, new) if n else ())])  # the first body is joined whole
        size = len(raw)
    assert 8_000 < largest <= 16_000 < size // 4


def test_kept_bodies_are_bounded_by_the_objects_they_keep_alive() -> None:
    prefixes = Prefixes(max_bytes=300_000, min_bytes=0)
    messages = history(20)
    for i in range(30):
        raw = orjson.dumps({"model": f"m{i % 3}", "messages": [*messages, {"role": "user", "content": str(i)}]})
        pieces, match = arrive(prefixes, raw, [5000] * 100)
        parse_chat_body(pieces, prefixes, match)
    kept = {id(data): len(data) for lists in prefixes._entries.values() for k in lists for data, _, _ in k.raw.spans}
    assert sum(kept.values()) <= prefixes.retained_bytes <= 300_000
