"""The prefix index (``store.prefixes``): placement finds a fork's parent and shared length without rebuilding lists.

The reference is the chain walk placement did before the index: every candidate head rebuilt from its delta chain
and compared message by message. On random histories (runs sharing an opening, edits, parallel runs, named
sessions, unanswered requests) the index must choose exactly what the walk chose.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ctxproxy.store import Journal, RecordedRequest, ResponseRecord, prefix_digest
from ctxproxy.store.placement import Head
from ctxproxy.store.prefixes import PrefixDigests
from ctxproxy.store.sql import SqliteConnection
from tests.test_journal import incoming, run


class ChainWalk(Journal):
    """Placement as it was: each candidate head rebuilt from its delta chain."""

    def _common_with(self, head: Head, digests: PrefixDigests, at_least: int = 0) -> int:
        hashes = digests.hashes
        if head.length <= len(hashes) and prefix_digest(hashes[: head.length]) == head.digest:
            return head.length
        stored = self.message_hashes(head.list_id) if head.list_id is not None else []
        return next((i for i, (a, b) in enumerate(zip(stored, hashes, strict=False)) if a != b),
                    min(len(stored), len(hashes)))


def _answer(journal: Journal, rec: RecordedRequest) -> None:
    journal.record_response(ResponseRecord(rec.request_id, 0, "ok", 200, "{}", None, 1.0, 2.0, "t"))


def _placed(rec: RecordedRequest) -> tuple[Any, ...]:
    return rec.session_id, rec.parent_id, rec.forked, rec.new_messages, rec.seen, rec.list_id


# A step: which of four runs moves, how many messages it takes back (an edit), how many it adds (from a small
# alphabet, so runs often share prefixes), whether its request is answered, whether it names its session.
steps = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.lists(st.integers(0, 2), min_size=0, max_size=4),
                           st.booleans(), st.integers(0, 9)), min_size=1, max_size=30)


@settings(max_examples=120, deadline=None)
@given(steps)
def test_the_index_places_every_request_where_the_chain_walk_did(plan: list[tuple[int, int, list[int], bool,
                                                                                 int]]) -> None:
    index, walk = Journal(None), ChainWalk(None)
    opening: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    histories = [list(opening) for _ in range(4)]
    for serial, (which, cut, grow, answered, named) in enumerate(plan):
        history = histories[which][: max(2, len(histories[which]) - cut)]
        history += [{"role": "assistant" if (len(history) + k) % 2 else "user", "content": f"m{g}"}
                    for k, g in enumerate(grow)]
        histories[which] = history
        req = incoming(history, session="named" if named == 0 else None, n=serial % 60)
        got, expected = index.record_request(req), walk.record_request(req)
        assert _placed(got) == _placed(expected)
        if answered:
            _answer(index, got)
            _answer(walk, expected)


def _statements(journal: Journal) -> list[str]:
    seen: list[str] = []
    assert isinstance(journal.conn, SqliteConnection)
    journal.conn.raw.set_trace_callback(seen.append)
    return seen


def _long_run(journal: Journal, rounds: int) -> list[list[dict[str, Any]]]:
    requests = run(rounds, result="x" * 50)
    for n, messages in enumerate(requests):
        rec = journal.record_request(incoming(messages, n=n % 60))
        _answer(journal, rec)
    return requests


def test_a_fork_after_a_long_run_rebuilds_no_list(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    requests = _long_run(journal, 150)
    edited = [dict(m) for m in requests[-1]]
    edited[-41] = edited[-41] | {"content": "edited"}
    statements = _statements(journal)
    rec = journal.record_request(incoming(edited, n=1))
    assert rec.forked and rec.seen == len(edited) - 41
    assert not [s for s in statements if "added FROM message_lists" in s]  # no delta chain walked
    assert len([s for s in statements if s.lstrip().startswith("SELECT")]) < 20  # a binary search, not a walk
    row = journal.request(rec.request_id)
    assert row is not None and row["messages"] == edited


def test_a_new_run_after_a_long_one_is_placed_without_rebuilding_it(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    requests = _long_run(journal, 150)
    statements = _statements(journal)
    rec = journal.record_request(incoming([*requests[1][:2], {"role": "assistant", "content": "other"}], n=2))
    assert rec.forked and rec.seen == 2
    assert not [s for s in statements if "added FROM message_lists" in s]


def _unindex(location: Path | str) -> None:
    """Make the journal at ``location`` what a journal written before the index was: no m006, no index."""
    journal = Journal(location)
    with journal.conn:
        journal.conn.execute("DROP TABLE prefixes")
        journal.conn.execute("ALTER TABLE message_lists DROP COLUMN segment")
        journal.conn.execute("DELETE FROM schema_migrations WHERE name = 'm006_prefix_index'")
    journal.close()


def _index_of(journal: Journal) -> tuple[list[Any], list[Any]]:
    return (journal.conn.execute("SELECT segment, length, digest FROM prefixes ORDER BY 1, 2").fetchall(),
            journal.conn.execute("SELECT id, segment FROM message_lists ORDER BY id").fetchall())


def _runs_with_forks(journal: Journal) -> Sequence[list[dict[str, Any]]]:
    first, second = run(12), run(12, opening="fix the bug", result="other")
    for n, messages in enumerate([*first, *second[5:], first[-1][:9] + second[-1][9:12]]):
        _answer(journal, journal.record_request(incoming(messages, n=n % 60)))
    return first


def test_an_old_journal_is_indexed_when_opened(tmp_path: Path, store_location: Path | str) -> None:
    journal = Journal(store_location)
    first = _runs_with_forks(journal)
    built = _index_of(journal)
    journal.close()
    _unindex(store_location)
    migrated = Journal(store_location)
    assert _index_of(migrated) == built  # the migration indexes exactly what journaling would have
    edited = [*first[-1][:7], {"role": "user", "content": "changed"}]
    rec, expected = migrated.record_request(incoming(edited, n=5)), _fresh_walk(tmp_path)
    assert _placed(rec)[:5] == expected
    migrated.close()


def _fresh_walk(tmp_path: Path) -> tuple[Any, ...]:
    walk = ChainWalk(tmp_path / "walk.db")
    first = _runs_with_forks(walk)
    edited = [*first[-1][:7], {"role": "user", "content": "changed"}]
    return _placed(walk.record_request(incoming(edited, n=5)))[:5]


def test_a_pruned_session_takes_its_index_with_it(store_location: Path | str) -> None:
    journal = Journal(store_location)
    _long_run(journal, 5)
    assert journal.conn.execute("SELECT COUNT(*) FROM prefixes").fetchone()[0] == 12
    journal.prune("9999")
    assert journal.conn.execute("SELECT COUNT(*) FROM prefixes").fetchone()[0] == 0
    journal.close()


def test_prefix_digests_match_the_heads_digest() -> None:
    hashes = ["a", "bb", "é", "d" * 64]
    digests = PrefixDigests(hashes)
    assert [digests.at(n) for n in (3, 1, 4, 0, 2)] == [prefix_digest(hashes[:n]) for n in (3, 1, 4, 0, 2)]
    assert list(digests.run(1, 4)) == [(n, prefix_digest(hashes[:n])) for n in (2, 3, 4)]


def test_lists_the_index_does_not_cover_are_rebuilt_from_their_chain(tmp_path: Path) -> None:
    """Robustness: a list without a segment, or a segment missing a row, is compared the old way, exactly."""
    expected = _fresh_walk(tmp_path)
    for damage in ("UPDATE message_lists SET segment = NULL", "DELETE FROM prefixes WHERE length > 4"):
        journal = Journal(tmp_path / f"{len(damage)}.db")
        first = _runs_with_forks(journal)
        with journal.conn:
            journal.conn.execute(damage)
        edited = [*first[-1][:7], {"role": "user", "content": "changed"}]
        assert _placed(journal.record_request(incoming(edited, n=5)))[:5] == expected
