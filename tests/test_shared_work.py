"""A request that does not extend its session redoes none of the work the proxy already did for its history.

A fork (or a new run with the same opening) is projected from the decisions, not from a previous state: the
stubs those decisions put in place must not be counted again (their counts are cached by identity), and the
decisions it inherits are read once per ancestor and shared, not reloaded for every fork.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ctxproxy.proxy.core.decisions import Decision
from ctxproxy.proxy.core.identity import message_hash
from ctxproxy.proxy.core.project import project
from ctxproxy.proxy.core.state import Rules
from ctxproxy.proxy.core.tokens import MessageCounter
from ctxproxy.proxy.engine.context import SessionContexts
from ctxproxy.store import Journal, JournalWriter
from tests.test_journal import incoming, record
from tests.test_project import budget, history


class CountingText:
    """A text counter (4 characters a token) that says how many texts it was asked to count."""

    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def count(self, text: str) -> int:
        self.calls += 1
        return len(text) // 4


def test_a_projection_from_the_decisions_counts_no_stub_twice() -> None:
    messages = history([f"result {k}\n" * 400 for k in range(12)])
    hashes = [message_hash(m) for m in messages]
    text = CountingText()
    counter = MessageCounter(text)
    rules = Rules(budget(window=4096))
    first = project(messages, hashes, [], rules, counter)
    assert first.report.spilled + first.report.elided >= 12  # stubs stand in for the results
    text.calls = 0
    again = project(messages, hashes, list(first.new), rules, counter)  # a fork: from the decisions, no state
    assert again.messages == first.messages
    assert text.calls == 0


def _pins(journal: Journal, session: str, targets: range) -> None:
    journal.insert_decisions(session, None, [{"kind": "pin", "target": f"tool:c{k}", "message_hash": "",
                                              "replacement": "", "overflow_id": "", "until": "", "count": 0,
                                              "source": "operator"} for k in targets], "t")


def _journal_with_forks(tmp_path: Path) -> tuple[Journal, str, list[str]]:
    """A session with 5 decisions, two runs forked from it, then 3 more decisions and a third run."""
    journal = Journal(tmp_path / "j.db")
    opening: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    parent = record(journal, incoming([*opening, {"role": "assistant", "content": "a"}], n=1)).session_id
    _pins(journal, parent, range(5))
    forks = [record(journal, incoming([*opening, {"role": "assistant", "content": f"b{k}"}], n=2 + k)).session_id
             for k in range(2)]
    _pins(journal, parent, range(5, 8))
    forks.append(record(journal, incoming([*opening, {"role": "assistant", "content": "b3"}], n=5)).session_id)
    return journal, parent, forks


def test_forks_share_the_decisions_they_inherit(tmp_path: Path) -> None:
    journal, parent, forks = _journal_with_forks(tmp_path)
    ancestors, own = journal.decision_chain(forks[0])
    assert [sid for sid, _ in ancestors] == [parent] and own == []
    assert journal.decisions(forks[0]) == [row for _, row in journal.decisions_upto(parent, ancestors[0][1])] != []
    first, again, sibling, later, reloaded = asyncio.run(_loads(journal, parent, forks))
    assert len(first) == 5 and first == again == sibling == reloaded
    assert len(later) == 8 and later[:5] == first
    assert first is not again  # each context owns its list...
    assert all(a is b is c is d for a, b, c, d in zip(first, again, sibling, later, strict=False))  # ...read once
    assert not any(a is b for a, b in zip(first, reloaded, strict=True))  # until the parent is forgotten


async def _loads(journal: Journal, parent: str, forks: list[str]) -> list[list[Decision]]:
    writer, contexts = JournalWriter(journal), SessionContexts()
    try:
        first = (await contexts.get(writer, forks[0], "m")).decisions
        contexts.drop(writer, forks[0])  # the fork's own context goes; what it inherited stays shared
        again = (await contexts.get(writer, forks[0], "m")).decisions
        sibling = (await contexts.get(writer, forks[1], "m")).decisions
        later = (await contexts.get(writer, forks[2], "m")).decisions  # forked after 3 more: reads those only
        contexts.drop(writer, parent)
        contexts.drop(writer, forks[0])
        return [first, again, sibling, later, (await contexts.get(writer, forks[0], "m")).decisions]
    finally:
        writer.close()


def test_a_fork_of_a_session_without_decisions_inherits_none_it_makes_later(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    opening: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    parent = record(journal, incoming([*opening, {"role": "assistant", "content": "a"}], n=1)).session_id
    fork = record(journal, incoming([*opening, {"role": "assistant", "content": "b"}], n=2)).session_id
    _pins(journal, parent, range(3))
    assert journal.decision_chain(fork)[0] == [(parent, 0)]
    assert journal.decisions(fork) == []
    contexts = asyncio.run(_context_decisions(journal, fork))
    assert contexts == []


async def _context_decisions(journal: Journal, session: str) -> list[Decision]:
    writer = JournalWriter(journal)
    try:
        return (await SessionContexts().get(writer, session, "m")).decisions
    finally:
        writer.close()
