"""Message hashing reuses the previous history's identities, and never gives a changed message an old one."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ctxproxy.proxy.core import canonical_json, content_hash
from ctxproxy.proxy.engine.hashing import MessageHasher, _common_prefix

message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                                 "content": st.one_of(st.none(), st.text(max_size=20))})


@given(st.lists(st.lists(message, max_size=8), min_size=1, max_size=6))
def test_hashes_always_equal_a_fresh_computation(histories: list[list[dict[str, Any]]]) -> None:
    hasher = MessageHasher(conversations=2)
    for history in histories:
        got = hasher.hash("k", history)
        assert got.hashes == [content_hash(canonical_json(m)) for m in history]
        assert got.bodies == [canonical_json(m) for m in history]


def test_an_unchanged_prefix_is_not_serialised_again() -> None:
    hasher = MessageHasher()
    first = hasher.hash("k", [{"role": "user", "content": "a"}])
    second = hasher.hash("k", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert second.bodies[0] is first.bodies[0]  # reused, not re-serialised


def test_the_cache_is_bounded() -> None:
    hasher = MessageHasher(conversations=3)
    for i in range(10):
        hasher.hash(str(i), [{"role": "user", "content": str(i)}])
    assert len(hasher._last) == 3


def test_the_cache_is_bounded_in_bytes_too() -> None:
    """60 conversations of 1 MB once stayed cached (~100 MB) for good: the bodies kept are bounded in bytes."""
    hasher = MessageHasher(conversations=64, max_bytes=300_000)
    for i in range(60):
        hasher.hash(f"run-{i}", [{"role": "tool", "content": f"{i} " + "x" * 100_000}])
    assert len(hasher._last) == 2 and hasher._bytes <= 300_000
    assert set(hasher._last) == {"run-58", "run-59"}  # the most recent are kept
    hasher.hash("huge", [{"role": "tool", "content": "y" * 400_000}])  # alone above the bound: kept alone
    assert list(hasher._last) == ["huge"]


def test_the_cache_keeps_at_most_max_bytes_besides_the_newest_list() -> None:
    hasher = MessageHasher(conversations=64, max_bytes=10_000)
    hasher.hash("big", [{"role": "user", "content": "x" * 50_000}])
    assert hasher.retained_bytes > 50_000  # the newest list is kept, whatever its size
    for i in range(3):
        hasher.hash(str(i), [{"role": "user", "content": str(i) * 1000}])
    assert "big" not in hasher._last and len(hasher._last) == 3
    assert hasher.retained_bytes == sum(e.size for lists in hasher._last.values() for e in lists) <= 10_000


def _history(rounds: int, tag: str = "") -> list[dict[str, Any]]:
    opening = [{"role": "system", "content": "agent"}, {"role": "user", "content": "task"}]
    return opening + [{"role": "tool", "content": f"{tag}result {i} " + "x" * 200} for i in range(rounds)]


def test_a_new_run_between_two_requests_of_a_long_one_does_not_make_it_hash_its_history_again() -> None:
    """A new run with the same opening (or a fork) came between two requests of a long session: the next request
    of that session used to find only the new run's short history under the opening, and hash its whole one."""
    hasher = MessageHasher()
    long = hasher.hash("opening", _history(300))
    hasher.hash("opening", _history(2, tag="new run "))  # another run of the same agent, same opening
    forked = [*_history(300)[:250], {"role": "tool", "content": "edited"}]  # a fork of the long one
    again = hasher.hash("opening", forked)
    assert all(a is b for a, b in zip(again.bodies[:250], long.bodies[:250], strict=True))  # reused, not redone
    assert again.hashes == [content_hash(canonical_json(m)) for m in forked]
    following = hasher.hash("opening", [*_history(301)])  # the long session goes on after its fork
    assert following.bodies[300 - 1] is long.bodies[300 - 1]


def test_a_conversation_keeps_a_few_lists_and_drops_those_it_extended() -> None:
    hasher = MessageHasher(per_conversation=2)
    for rounds in range(1, 6):  # each extends the last: one list kept
        hasher.hash("k", _history(rounds))
    assert len(hasher._last["k"]) == 1
    for tag in ("a", "b", "c"):  # three different runs: the two newest kept
        hasher.hash("k", _history(3, tag=tag))
    assert [lists.messages[-1]["content"][:1] for lists in hasher._last["k"]] == ["c", "b"]


def test_the_shared_prefix_is_found_wherever_the_lists_part() -> None:
    """The history with a new last message (the peers' benchmark) is compared in C; any other parting point too."""
    base = [{"role": "user", "content": str(i)} for i in range(6)]
    for cut in range(7):
        other = [*base[:cut], *({"role": "user", "content": f"new {i}"} for i in range(cut, 6))]
        assert _common_prefix(base, other) == cut
        assert _common_prefix(base, other[:-1]) == min(cut, 5)
    assert _common_prefix([], base) == 0
