"""The prefix index (``store.prefixes``): placement finds a fork's parent and shared length without rebuilding lists.

The reference is the chain walk placement did before the index: every candidate head rebuilt from its delta chain
and compared message by message. On random histories (runs sharing an opening, edits, parallel runs, named
sessions, unanswered requests) the index must choose exactly what the walk chose.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ctxproxy.proxy.engine.context import read_new_session
from ctxproxy.store import IncomingRequest, Journal, RecordedRequest, ResponseRecord, prefix_digest
from ctxproxy.store.ancestry import _ANCESTRY
from ctxproxy.store.placement import Head, Placement, _closest, _continued, _new_ids
from ctxproxy.store.prefixes import PrefixDigests
from ctxproxy.store.recovery import ANSWERED
from ctxproxy.store.sql import SqliteConnection
from ctxproxy.store.writer import JournalWriter
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


class ScanAll(Journal):
    """Placement of a fingerprinted request as it was before it read only what it needs: every session of the
    opening, each with its last request's state, compared in Python, and a fork delta-encoded on its parent's list."""

    def _place(self, req: IncomingRequest, digests: PrefixDigests) -> Placement:
        if req.session_name is not None:
            return super()._place(req, digests)
        rows = self.conn.execute(
            "SELECT h.id, h.head_list_id, h.head_len, h.head_digest, h.updated_at,"
            f" NOT {ANSWERED.format(request='h.last')},"
            " EXISTS (SELECT 1 FROM responses p WHERE p.request_id = h.last AND p.outcome = 'interrupted')"
            " FROM (SELECT s.*, (SELECT MAX(r.id) FROM requests r WHERE r.session_id = s.id) AS last"
            "       FROM sessions s WHERE s.fingerprint = ?) h ORDER BY h.updated_at, h.id", [req.fingerprint]
        ).fetchall()
        candidates = [Head(*row[:6]) for row in rows]
        answered = [a for row in rows if row[6] for a in self._last_answered(row[0])]
        head = _continued(candidates, digests, answered)
        if head is not None:
            return Placement(head, head.list_id, head.length, False, None)
        parent, shared = _closest(candidates[-8:], lambda head, at_least: self._common_with(head, digests, at_least))
        placed = self._open(req, _new_ids(req.fingerprint, len(candidates)), parent, shared, req.fingerprint)
        base = parent.list_id if parent and shared else None
        return replace(placed, base_list_id=base)

    def _last_answered(self, session_id: str) -> list[Head]:
        row = self.conn.execute(
            "SELECT r.list_id, r.received_at, l.length FROM requests r JOIN message_lists l ON l.id = r.list_id"
            f" WHERE r.session_id = ? AND {ANSWERED.format(request='r.id')} AND NOT EXISTS (SELECT 1 FROM"
            " responses p WHERE p.request_id = r.id AND p.outcome = 'interrupted') ORDER BY r.id DESC LIMIT 1",
            [session_id]).fetchone()
        if row is None:
            return []
        digest = PrefixDigests(self.message_hashes(int(row[0]))).at(int(row[2]))
        return [Head(session_id, int(row[0]), int(row[2]), digest, row[1])]


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


# As ``steps``, and whether the proxy dies after the step (requests in flight are marked interrupted at its start).
crashing = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.lists(st.integers(0, 2), max_size=4),
                              st.booleans(), st.integers(0, 4)), min_size=1, max_size=30)


@settings(max_examples=120, deadline=None)
@given(crashing)
def test_placement_reading_only_what_it_needs_places_every_request_where_scanning_every_session_did(
        plan: list[tuple[int, int, list[int], bool, int]]) -> None:
    journal, scan = Journal(None), ScanAll(None)
    opening: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    histories = [list(opening) for _ in range(4)]
    for serial, (which, cut, grow, answered, crash) in enumerate(plan):
        history = histories[which][: max(2, len(histories[which]) - cut)]
        history += [{"role": "assistant" if (len(history) + k) % 2 else "user", "content": f"m{g}"}
                    for k, g in enumerate(grow)]
        histories[which] = history
        req = incoming(history, n=serial % 60)
        got, expected = journal.record_request(req), scan.record_request(req)
        assert _placed(got) == _placed(expected)
        assert journal.request(got.request_id)["messages"] == history  # type: ignore[index]
        if answered:
            _answer(journal, got)
            _answer(scan, expected)
        if crash == 0:
            assert journal.mark_interrupted("t") == scan.mark_interrupted("t")


def _new_runs(journal: Journal, opening: list[dict[str, Any]], start: int, count: int) -> RecordedRequest:
    """``count`` new runs of the opening, each its own first step (the peers' benchmark: new text each time)."""
    rec = None
    for i in range(start, start + count):
        rec = journal.record_request(incoming([*opening, {"role": "user", "content": f"continue {i}"}], n=i % 60))
        _answer(journal, rec)
    assert rec is not None
    return rec


def test_new_runs_of_one_opening_cost_no_more_statements_as_they_accumulate(tmp_path: Path) -> None:
    """Each new run forks the last ones; a fork of a fork was delta-encoded on its parent's list and inherited
    its parent's ancestors, so each lookup below the fork point (and each read of its decisions) walked one hop
    more per eight runs."""
    journal = Journal(tmp_path / "j.db")
    opening = _long_run(journal, 30)[0]
    counts = []
    for start, count in ((0, 10), (10, 80)):
        _new_runs(journal, opening, start, count - 1)
        statements = _statements(journal)
        rec = _new_runs(journal, opening, start + count - 1, 1)
        journal.decision_chain(rec.session_id)
        assert isinstance(journal.conn, SqliteConnection)
        journal.conn.raw.set_trace_callback(None)
        counts.append(len(statements))
        assert rec.forked and rec.seen == 2
    assert counts[1] <= counts[0]


def test_placing_a_new_run_reads_no_more_of_the_opening_as_its_sessions_accumulate() -> None:
    """Every request of the peers' benchmark opens a session of one opening. Placement's reads of the opening (its
    8 most recent sessions, its heads' lengths, its heads of a digest) sorted or visited every session of it: the
    SQLite instructions they ran grew with each new run (40-fold from the 10th to the 300th); each is a search
    of an index now. The count of the opening's sessions (a new id) still visits the index: it is left out."""
    journal = Journal(None)
    opening = _long_run(journal, 10)[0]
    _new_runs(journal, opening, 0, 9)
    tenth = _placement_steps(journal, opening, 9)
    _new_runs(journal, opening, 10, 290)
    assert _placement_steps(journal, opening, 300) <= 1.5 * tenth


def test_a_new_run_looks_up_no_prefix_of_a_recent_run_it_cannot_share_more_with() -> None:
    """The 8 recent runs a new run may fork are 3-message heads it shares 2 messages with: once one is found to
    share 2, the others cannot share more (the whole of each is not shared: its digest is not the request's), and
    nothing of them is looked up: only the first one's search is (two digests, each a lookup of the prefix index
    and one down the list it is delta-encoded on); 12 lookups before, two more for each other recent run."""
    journal = Journal(None)
    opening = _long_run(journal, 10)[0]
    _new_runs(journal, opening, 0, 20)
    statements = _statements(journal)
    rec = _new_runs(journal, opening, 20, 1)
    assert isinstance(journal.conn, SqliteConnection)
    journal.conn.raw.set_trace_callback(None)
    assert rec.forked
    assert len([s for s in statements if "p.digest" in s and "FROM message_lists l" in s]) <= 4


def test_new_runs_among_longer_runs_read_the_prefix_index_rows_they_read_before_from_memory(tmp_path: Path) -> None:
    """The peers' benchmark: short new runs of an opening between long ones, each placed among the 8 recent runs,
    probes the same few positions of the same heads as the run before it. The rows are kept (``_digest_row``):
    14 lookups a new run before, 4 now; the run is placed as before (the walk and the full scan agree above)."""
    journal = Journal(tmp_path / "j.db")
    long = _long_run(journal, 20)[-1]
    for i in range(8):
        _answer(journal, journal.record_request(incoming([*long, {"role": "user", "content": f"long {i}"}], n=i)))
        _new_runs(journal, long[:2], i, 1)
    statements = _statements(journal)
    rec = _new_runs(journal, long[:2], 100, 1)
    assert rec.forked and rec.seen == 2
    assert _probes(statements) <= 4


def test_removing_lists_forgets_the_prefix_index_rows_kept(tmp_path: Path) -> None:
    """A prune removes lists, whose ids a new list may take again: nothing read of them is kept."""
    journal = Journal(tmp_path / "j.db")
    opening = _long_run(journal, 5)[0]
    _new_runs(journal, opening, 0, 3)
    assert journal.digest_rows
    journal.prune("9999")
    assert journal.digest_rows == {}
    _new_runs(journal, opening, 3, 3)
    assert journal.digest_rows


def test_another_process_writing_forgets_the_prefix_index_rows_kept(tmp_path: Path) -> None:
    ours, theirs = Journal(tmp_path / "j.db"), Journal(tmp_path / "j.db")
    opening = _long_run(ours, 5)[0]
    _new_runs(ours, opening, 0, 3)
    writer = JournalWriter(ours)
    try:
        asyncio.run(writer.call(Journal.sessions))
        assert ours.digest_rows
        _new_runs(theirs, opening, 3, 1)
        asyncio.run(writer.call(Journal.sessions))
    finally:
        writer.close()
    assert ours.digest_rows == {}


def _placement_steps(journal: Journal, opening: list[dict[str, Any]], n: int) -> int:
    """The SQLite VM instructions that placing the ``n``th new run of ``opening`` spent reading the opening's
    sessions by their fingerprint (its count aside)."""
    assert isinstance(journal.conn, SqliteConnection)
    raw, steps, current = journal.conn.raw, [0], [""]

    def counted() -> int:
        steps[0] += "fingerprint" in current[0] and "FROM sessions" in current[0] and "COUNT(*)" not in current[0]
        return 0

    raw.set_trace_callback(lambda statement: current.__setitem__(0, statement))
    raw.set_progress_handler(counted, 1)
    try:
        _new_runs(journal, opening, n, 1)
    finally:
        raw.set_progress_handler(None, 1)
        raw.set_trace_callback(None)
    return steps[0]


def test_a_request_another_process_marked_interrupted_is_continued_from_its_last_answer(tmp_path: Path) -> None:
    """The opening's interrupted sessions are read once and kept; a server started on the same journal (it
    marks what was in flight) must make this one read them again."""
    steps = run(3)
    journal = Journal(tmp_path / "j.db")
    writer = JournalWriter(journal)

    async def steps_of_a_run() -> tuple[RecordedRequest, RecordedRequest]:
        first = await writer.call(Journal.record_request, incoming(steps[1], n=0))
        _answer(journal, first)
        await writer.call(Journal.record_request, incoming(steps[2], n=1))  # in flight when the other one starts
        other = Journal(tmp_path / "j.db")
        other.mark_interrupted("2026-01-02T00:00:00")
        other.close()
        retry = [*steps[1], {"role": "user", "content": "the server went away; try something else"}]
        return first, await writer.call(Journal.record_request, incoming(retry, n=2))

    first, after = asyncio.run(steps_of_a_run())
    writer.close()
    assert after.session_id == first.session_id and not after.forked


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


def _probes(statements: list[str]) -> int:
    """Lookups of the prefix index (``store.prefixes._DIGEST_AT``) among ``statements``."""
    return len([s for s in statements if "p.digest" in s and "FROM message_lists l" in s])


def test_a_fork_that_replaces_the_last_message_is_placed_with_one_lookup(tmp_path: Path) -> None:
    """An edited retry, or the peers' benchmark's new text at the end: everything before the last message is
    shared, which the search checks first (a binary search over the 300 messages took 8 lookups)."""
    journal = Journal(tmp_path / "j.db")
    requests = _long_run(journal, 150)
    replaced = [*requests[-1][:-1], {"role": "user", "content": "something else"}]
    statements = _statements(journal)
    rec = journal.record_request(incoming(replaced, n=1))
    assert rec.forked and rec.seen == len(replaced) - 1
    assert _probes(statements) == 1


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


def _read_ancestry(journal: Journal, session_id: str) -> list[tuple[str, int | None]]:
    return [(str(s), u) for s, u in journal.conn.execute(_ANCESTRY, [session_id]).fetchall()]


def test_the_ancestries_a_journal_keeps_are_the_ones_it_would_read(tmp_path: Path) -> None:
    """Runs forking runs beyond the 64 sessions the recursive statement reads, decisions here and there, named
    sessions and a prune: every session's kept ancestry is the statement's, and after the prune it is read again."""
    journal = Journal(tmp_path / "j.db")
    opening = _long_run(journal, 5)[0]
    cut = {"kind": "spill", "target": "tool:call_0", "message_hash": "h", "replacement": "stub", "overflow_id": "",
           "until": "", "count": 0, "source": "auto"}
    opened, shared = [], list(opening)
    for i in range(80):  # each shares one message more with the last than any other run: it forks the last
        shared.append({"role": "user", "content": f"step {i}"})
        rec = journal.record_request(incoming([*shared, {"role": "user", "content": f"try {i}"}], n=i))
        _answer(journal, rec)
        opened.append(rec.session_id)
        if i % 9 == 0:
            journal.add_decisions(rec.session_id, [cut | {"target": f"tool:call_{i}"}], "t")
    named = journal.record_request(incoming(opening, session="named"))
    assert set(journal.ancestries) >= {*opened, named.session_id}
    assert max(len(chain) for chain in journal.ancestries.values()) == 64
    for session_id in journal.ancestries:
        assert journal._ancestry(session_id) == _read_ancestry(journal, session_id), session_id
    journal.prune("2026-01-01T00:00:30")
    assert not journal.ancestries


def test_a_new_run_s_read_back_walks_no_ancestry_when_its_parent_was_opened_here(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    opening = _long_run(journal, 5)[0]
    _new_runs(journal, opening, 0, 3)
    statements = _statements(journal)
    rec, saved = journal.record_request_and_read(incoming([*opening, {"role": "user", "content": "x"}], n=9),
                                                 read_new_session("m", named=False), True)
    assert rec.forked and saved is not None
    assert not [s for s in statements if "WITH RECURSIVE up" in s]


def _shares(shared: dict[str, int], below: int, asked: list[str]) -> Callable[[Head, int], int]:
    """``common_with`` as the prefix index answers it: the messages shared when more than ``at_least``, else any
    figure no more than ``at_least`` (the search stops there); each head asked is recorded."""
    def common_with(head: Head, at_least: int) -> int:
        asked.append(head.id)
        return shared[head.id] if shared[head.id] > at_least else max(0, at_least - below)
    return common_with


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), min_size=0, max_size=8), st.integers(0, 3))
def test_a_fork_s_parent_is_the_first_of_the_heads_sharing_the_most(heads: list[tuple[int, int]], below: int) -> None:
    """Whichever order the heads are searched in, the parent is the earliest head of those sharing the most
    messages (a head shares no more than its length), as when each was searched in turn."""
    candidates = [Head(f"s{i}", i, length, "d", "t") for i, (length, _) in enumerate(heads)]
    shared = {f"s{i}": min(length, common) for i, (length, common) in enumerate(heads)}
    asked: list[str] = []
    parent, most = _closest(candidates, _shares(shared, below, asked))
    assert sorted(asked) == sorted(shared)  # each head asked once
    if not candidates:
        assert (parent, most) == (None, 0)
        return
    assert most == max(shared.values()) and parent == next(h for h in candidates if shared[h.id] == most)
