"""What the journal costs on each backend: one request and its answer journaled, and a prune, SQLite vs PostgreSQL.

The store alone, in process, no HTTP: ``record_request`` then ``record_response`` for each round of a run of
``--rounds`` tool rounds (the session's next request, the usual case), median per round; then a prune of
``--sessions`` such runs of 40 rounds. PostgreSQL is a throwaway local cluster (``tests/postgres.py``: durability
off, as a test cluster) unless ``--store`` names one. Each figure is the median of ``--repeat`` runs.

    .venv/bin/python bench/store_backends.py [--rounds 300] [--sessions 50] [--repeat 3] [--store postgresql://...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ctxproxy.store import Journal, ResponseRecord
from tests.postgres import PostgresServer, start
from tests.test_journal import incoming, run


def per_round(journal: Journal, rounds: int) -> float:
    """Median ms to journal one round (its request, then its answer)."""
    times = []
    for i, messages in enumerate(run(rounds, result="x" * 200)):
        request = incoming(messages, n=i % 60)
        t0 = time.perf_counter()
        recorded = journal.record_request(request)
        journal.record_response(ResponseRecord(recorded.request_id, 0, "ok", 200, "{}", None, 1.0, 2.0, "t"))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def prune(journal: Journal, sessions: int) -> float:
    """Seconds to prune ``sessions`` runs of 40 rounds, every one."""
    for s in range(sessions):
        for i, messages in enumerate(run(40, opening=f"task {s}", result="y" * 100)):
            recorded = journal.record_request(incoming(messages, n=i % 60))
            journal.record_response(ResponseRecord(recorded.request_id, 0, "ok", 200, "{}", None, 1.0, 2.0, "t"))
    t0 = time.perf_counter()
    journal.prune("9999")
    return time.perf_counter() - t0


def measure(fresh: Callable[[], Journal], args: argparse.Namespace) -> tuple[float, float]:
    rounds, prunes = [], []
    for _ in range(args.repeat):
        for out, how in ((rounds, lambda j: per_round(j, args.rounds)), (prunes, lambda j: prune(j, args.sessions))):
            journal = fresh()
            try:
                out.append(how(journal))
            finally:
                journal.close()
    return statistics.median(rounds), statistics.median(prunes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--store", default="", help="a PostgreSQL server's URL (a user that may create databases)")
    args = parser.parse_args()
    server = PostgresServer(args.store) if args.store else start()
    if isinstance(server, str):
        raise SystemExit(server)
    databases: list[str] = []

    def database() -> Journal:
        databases.append(server.database())
        return Journal(databases[-1])

    try:
        with tempfile.TemporaryDirectory() as tmp:
            files = iter(range(1_000))
            lite = measure(lambda: Journal(Path(tmp) / f"{next(files)}.db"), args)
            pg = measure(database, args)
    finally:
        for url in databases:
            server.drop(url)
        server.stop()
    print(f"{'backend':<12} {'ms per round':>13} {'prune s':>9}   ({args.rounds} rounds; prune of {args.sessions} x 41"
          " requests)")
    for name, (ms, seconds) in (("SQLite", lite), ("PostgreSQL", pg)):
        print(f"{name:<12} {ms:>13.3f} {seconds:>9.2f}")


if __name__ == "__main__":
    main()
