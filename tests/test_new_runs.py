"""Placing a new run of an opening (every request of the peers' benchmark is one): what it reads, kept or asked."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ctxproxy.store import IncomingRequest, Journal, JournalWriter
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
