"""Message hashing reuses the previous history's identities, and never gives a changed message an old one."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ctxproxy.proxy.core import canonical_json, content_hash
from ctxproxy.proxy.engine.hashing import MessageHasher, common_start

message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                                 "content": st.one_of(st.none(), st.text(max_size=20))})


@given(st.lists(st.lists(message, max_size=8), min_size=1, max_size=6))
def test_hashes_always_equal_a_fresh_computation(histories: list[list[dict[str, Any]]]) -> None:
    hasher = MessageHasher(conversations=2)
    for history in histories:
        got = hasher.hash("k", history)
        assert got.hashes == [content_hash(canonical_json(m)) for m in history]
        assert list(got.bodies) == [canonical_json(m) for m in history]
        assert got.bodies[-1:] == [canonical_json(m) for m in history[-1:]]
        assert list(got.users) == [i for i, m in enumerate(history) if m["role"] == "user"]


def test_an_unchanged_prefix_is_not_serialised_again() -> None:
    hasher = MessageHasher()
    first = hasher.hash("k", [{"role": "user", "content": "a"}])
    second = hasher.hash("k", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert second.hashes[0] is first.hashes[0]  # reused, not serialised and hashed again


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
    assert all(a is b for a, b in zip(again.hashes[:250], long.hashes[:250], strict=True))  # reused, not redone
    assert again.hashes == [content_hash(canonical_json(m)) for m in forked]
    following = hasher.hash("opening", [*_history(301)])  # the long session goes on after its fork
    assert following.hashes[300 - 1] is long.hashes[300 - 1]


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
        assert common_start(base, other) == cut
        assert common_start(base, other[:-1]) == min(cut, 5)
    assert common_start([], base) == 0


class Compared(dict[str, Any]):
    """A message that counts how often it is compared with another."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        Compared.comparisons += 1
        return dict.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]


def test_the_kept_lists_are_compared_message_by_message_only_where_their_hashes_cannot_tell() -> None:
    """A fork between requests of a long session: of the three lists kept, the one it shares most with is compared
    message by message; the others' shares follow from their hashes (each walk was ~0.7 ms at 600 rounds)."""
    hasher = MessageHasher()
    hasher.hash("opening", _history(300))
    hasher.hash("opening", [*_history(300)[:200], {"role": "tool", "content": "an earlier fork"}])
    hasher.hash("opening", _history(2, tag="new run "))
    forked = [Compared(m) for m in [*_history(302)[:280], {"role": "tool", "content": "edited"}]]
    Compared.comparisons = 0
    again = hasher.hash("opening", forked)
    assert again.hashes == [content_hash(canonical_json(m)) for m in forked]
    assert Compared.comparisons <= 280 + 2 * 64  # to where it parts from the long run (once), not once per list


def test_a_kept_list_holds_no_bodies_and_a_request_gets_its_new_ones_as_made() -> None:
    """Each body kept was made during another request and pinned the freed memory around it (~55 MB of RSS after
    600 rounds for 6.7 MB of bodies): a kept list holds the messages and hashes only."""
    hasher = MessageHasher()
    history = _history(10)
    hasher.hash("k", history[:-1])
    got = hasher.hash("k", history)
    assert all(not entry.bodies for entries in hasher._last.values() for entry in entries)
    assert got.bodies[len(history) - 1] is got.bodies[-1]  # the new message's body: the one just hashed
    assert got.bodies[0] == canonical_json(history[0]) and got.size == sum(map(len, got.bodies))
