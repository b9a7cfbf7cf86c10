"""Placing a new run of an opening (every request of the peers' benchmark is one): what it reads, kept or asked."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ctxproxy.store import IncomingRequest, Journal, JournalWriter, ResponseRecord
from tests.test_journal import incoming, record


def test_an_opening_s_sessions_are_counted_once_and_again_after_any_are_removed(tmp_path: Path) -> None:
    """A new session's id counts its opening's sessions (``s-<fingerprint>-<n>``): counted once, then kept; after
    a prune, here or by another process, counted again, so the next id is the one a journal that never kept the
    count gives."""
    journal, statements = Journal(tmp_path / "j.db"), []
    journal.conn.raw.set_trace_callback(statements.append)  # type: ignore[attr-defined]
    opening = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix the bug"}]

    def new_run(i: int) -> IncomingRequest:
        return incoming([*opening, {"role": "user", "content": f"continue {i}"}], n=i)

    ids = [record(journal, new_run(i)).session_id for i in range(4)]
    stem = ids[0]
    assert ids == [stem, f"{stem}-2", f"{stem}-3", f"{stem}-4"]
    assert len([s for s in statements if "COUNT(*) FROM sessions" in s]) == 1
    journal.prune("9999")
    assert record(journal, new_run(4)).session_id == stem
    writer = JournalWriter(journal)

    async def after_another_process_prunes() -> str:
        assert (await writer.call(Journal.record_request, new_run(5))).session_id == f"{stem}-2"
        other = Journal(tmp_path / "j.db")
        other.prune("9999")
        other.close()
        return (await writer.call(Journal.record_request, new_run(6))).session_id

    try:
        assert asyncio.run(after_another_process_prunes()) == stem
    finally:
        writer.close()



def test_a_new_run_looks_among_the_heads_only_for_a_digest_a_head_may_have(tmp_path: Path) -> None:
    """No prefix of a new run is a session's head: with the opening's head digests kept (``store.openings``), they
    are not looked up. A run's next step, whose prefix is its head, is, and continues it. Heads that moved on stay
    kept until the set outgrows twice what was read (plus 64), when it is read again."""
    journal, statements = Journal(tmp_path / "j.db"), []
    journal.conn.raw.set_trace_callback(statements.append)  # type: ignore[attr-defined]
    opening = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix the bug"}]
    runs = [record(journal, incoming([*opening, {"role": "user", "content": f"run {i}"}], n=i)) for i in range(40)]

    def seen(part: str) -> int:
        return sum(part in s for s in statements)

    assert seen("head_digest IN") == 0 and seen("DISTINCT head_digest") == 1 and all(r.created for r in runs)
    history = [*opening, {"role": "user", "content": "run 39"}]
    for j in range(30):
        history += [{"role": "assistant", "content": f"a{j}"}, {"role": "user", "content": f"u{j}"}]
        assert record(journal, incoming(history, n=40 + j)).session_id == runs[-1].session_id
    assert seen("head_digest IN") == 30
    # read with none kept (bound 64); 40 runs and 25 steps later past it: read again (40 heads, bound 144), and the
    # 26th step and the 4 after it move the run on
    assert seen("DISTINCT head_digest") == 2
    kept, bound = journal.head_digests[incoming(history).fingerprint]
    assert (len(kept), bound) == (45, 144)



def test_a_head_another_process_wrote_is_found_by_the_journal_that_kept_the_opening_s_heads(tmp_path: Path) -> None:
    """Another process opened a run of an opening this journal kept the heads of (its writer sees the commit in
    ``data_version`` and drops what it kept): the run's next step, placed here, continues it."""
    opening = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix the bug"}]
    here, other = JournalWriter(Journal(tmp_path / "j.db")), Journal(tmp_path / "j.db")
    run_a, run_b = ([*opening, {"role": "user", "content": name}] for name in ("a", "b"))

    async def step_here(messages: list[dict[str, str]], n: int) -> str:
        rec = await here.call(Journal.record_request, incoming(messages, n=n))
        answer = ResponseRecord(rec.request_id, 0, "ok", 200, "{}", None, 1.0, 2.0, "t")
        await here.call(Journal.record_response, answer)
        return rec.session_id

    async def runs() -> tuple[str, str]:
        await step_here(run_a, 0)  # here reads the opening's heads
        opened = record(other, incoming(run_b, n=1)).session_id
        return opened, await step_here([*run_b, {"role": "assistant", "content": "ok"},
                                        {"role": "user", "content": "go on"}], 2)

    try:
        opened, continued = asyncio.run(runs())
    finally:
        here.close()
        other.close()
    assert continued == opened
