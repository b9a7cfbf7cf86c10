"""How many SQL statements the journal runs per request: a new-text fork (the peers' method) and a continuation.

Why: a small request's journal work is a few dozen microseconds a statement on this machine, and the latency it
adds moves less than the machine's noise between two runs, so a cut statement cannot be seen end to end. The
count can: this replays the 60-round workload through the app in this process (``httpx.ASGITransport``, the fixed
answer of ``bench/long_run_steps.py``'s upstream), counts the statements each request sends to SQLite (an
``executemany`` of no rows sends none) and prints them per request, most frequent first.

Run: ``.venv/bin/python bench/statements.py [--conversation PEERS/conversation-60.json] [--show]``
(``PYTHONPATH=OTHER`` counts another tree's; ``bench/`` itself is this one's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx

import ctxproxy.store.sql as sql  # first: PYTHONPATH's tree, not this one's
from ctxproxy.config import load_settings
from ctxproxy.proxy.edge.app import create_app

BENCH = Path(__file__).resolve().parent
sys.path.insert(1, str(BENCH.parent))
sys.path.insert(1, str(BENCH))

import latency_peers  # noqa: E402
from long_run_steps import _upstream  # noqa: E402

from tests.workloads import conversation as generated  # noqa: E402

TIMED = 50
"""Requests counted per workload, after the warm-up."""


class Counted:
    """The statements the SQLite connections run while ``on``, by their first 100 characters."""

    def __init__(self) -> None:
        self.on = False
        self.statements: Counter[str] = Counter()
        execute, executemany = sql.SqliteConnection.execute, sql.SqliteConnection.executemany

        def counted_execute(conn: Any, statement: str, params: Sequence[Any] = ()) -> Any:
            if self.on:
                self.statements[" ".join(statement.split())[:100]] += 1
            return execute(conn, statement, params)

        def counted_executemany(conn: Any, statement: str, rows: Iterable[Sequence[Any]]) -> None:
            rows = list(rows)
            if self.on and rows:
                self.statements["(many) " + " ".join(statement.split())[:93]] += 1
            executemany(conn, statement, rows)

        sql.SqliteConnection.execute = counted_execute  # type: ignore[method-assign]
        sql.SqliteConnection.executemany = counted_executemany  # type: ignore[method-assign]

    def take(self) -> Counter[str]:
        taken, self.statements = self.statements, Counter()
        return taken


async def count(conversation: dict[str, Any], counted: Counted) -> dict[str, Counter[str]]:
    """The statements of ``TIMED`` continuations (the replay's rounds 11-60) and ``TIMED`` new-text forks."""
    replay = latency_peers.replay_bodies(conversation)
    forks = [latency_peers.nonce_body(conversation, "small", i) for i in range(20 + TIMED)]
    with tempfile.TemporaryDirectory(prefix="ctxproxy-statements-") as data:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": data, "CTXPROXY_UPSTREAM": "http://upstream.test/v1",
                                      "CTXPROXY_LOG_LEVEL": "warning"})
        app = create_app(settings, upstream_transport=httpx.ASGITransport(app=_upstream))
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://proxy.test") as client:
            async def send(bodies: list[bytes], counting: bool) -> None:
                counted.on = counting
                for body in bodies:
                    answer = await client.post(latency_peers.CHAT_PATH, content=body, headers=latency_peers.HEADERS)
                    if answer.status_code != 200:
                        raise RuntimeError(f"the proxy answered {answer.status_code}: {answer.text[:300]}")
                counted.on = False

            await send(replay[:10], False)
            await send(replay[10:10 + TIMED], True)
            continuation = counted.take()
            await send(replay[10 + TIMED:] + forks[:20], False)
            await send(forks[20:], True)
            return {"continuation (the replay's rounds 11-60)": continuation,
                    "new-text fork (the peers' small request)": counted.take()}


def report(results: dict[str, Counter[str]], show: bool) -> str:
    lines = [f"SQL statements per request (ctxproxy from {sql.__file__.rsplit('/store/', 1)[0]})", ""]
    for name, statements in results.items():
        lines.append(f"{name}: {sum(statements.values()) / TIMED:.2f}")
        if show:
            lines += [f"  {n / TIMED:5.2f}  {text}" for text, n in statements.most_common()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--conversation", type=Path, help="the workload (default: tests/workloads.py's 60 rounds)")
    parser.add_argument("--show", action="store_true", help="each statement's count too")
    args = parser.parse_args(argv)
    conversation = json.loads(args.conversation.read_text()) if args.conversation else generated(rounds=60)
    print(report(asyncio.run(count(conversation, Counted())), args.show))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
