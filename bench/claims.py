"""What the replicas' staleness check costs: the claim each request makes on its session (``store.claims``).

The 60-round workload is replayed through the app in process (SQLite journal, a fake upstream behind httpx's
ASGI transport), request by request, as an agent sends it; each request's added latency is the proxy's own
``added_ms`` (from its arrival to the first byte upstream). Then, on the journal that run left, the claim is timed
alone: the SQL itself (no thread hop), and as a request makes it (``writer.call``: a hop to the journal's thread),
beside an empty hop for scale. ``--runs`` replays repeat the whole; medians of medians are printed.

    PYTHONPATH=. python bench/claims.py --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from ctxproxy.config import load_settings
from ctxproxy.store import Journal, JournalWriter, claim
from tests.conftest import app_client
from tests.fakes import FakeUpstream
from tests.workloads import conversation


class _Added(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.ms: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields: dict[str, Any] = getattr(record, "ctx", {})
        if fields.get("event") == "request" and fields.get("added_ms") is not None:
            self.ms.append(float(fields["added_ms"]))


def replay(root: Path, rounds: int) -> tuple[float, str, int]:
    """Median added ms of the replay; the session and its last request id (for the claim's timing)."""
    work = conversation(rounds)
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(root), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "32768"})
    added = _Added()
    logger = logging.getLogger("ctxproxy")
    logger.addHandler(added)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as client:
            for end in range(3, len(work["messages"]) + 1, 2):
                answer = client.post("/v1/chat/completions", json={**work, "messages": work["messages"][:end]})
                assert answer.status_code == 200, answer.text
            session = answer.headers["x-ctx-session"]
    finally:
        logger.removeHandler(added)
    return statistics.median(added.ms[5:]), session, len(added.ms)


def time_claims(path: Path, session: str, n: int) -> tuple[float, float, float]:
    """Median µs of: the claim's SQL alone, the claim as a request makes it, an empty hop to the journal's thread."""
    journal = Journal(path)
    direct = []
    for i in range(n):
        start = time.perf_counter()
        claim(journal, session, 1_000_000 + i)
        direct.append(time.perf_counter() - start)
    writer = JournalWriter(Journal(path))

    async def hops() -> tuple[list[float], list[float]]:
        claimed, empty = [], []
        for i in range(n):
            start = time.perf_counter()
            await writer.call(claim, session, 2_000_000 + i)
            claimed.append(time.perf_counter() - start)
            start = time.perf_counter()
            await writer.call(_nothing)
            empty.append(time.perf_counter() - start)
        return claimed, empty

    claimed, empty = asyncio.run(hops())
    writer.close()
    journal.close()
    return tuple(statistics.median(x) * 1e6 for x in (direct, claimed, empty))  # type: ignore[return-value]


def _nothing(journal: Journal) -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--claims", type=int, default=2000)
    args = parser.parse_args()
    rows = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            added_ms, session, requests = replay(Path(tmp), args.rounds)
            direct, hop_claim, hop = time_claims(Path(tmp) / "journal.db", session, args.claims)
        rows.append((added_ms, direct, hop_claim, hop))
        print(f"requests {requests}: added median {added_ms:.3f} ms; claim SQL {direct:.1f} µs, claim as a request "
              f"makes it {hop_claim:.1f} µs, empty hop {hop:.1f} µs")
    added_ms, direct, hop_claim, hop = (statistics.median(r[i] for r in rows) for i in range(4))
    print(f"\nmedian of {args.runs} runs: added {added_ms:.3f} ms a request; the claim {hop_claim:.1f} µs "
          f"({direct:.1f} µs of SQL, {hop:.1f} µs an empty hop): {hop_claim / 10 / added_ms:.1f} % of the added "
          f"latency")


if __name__ == "__main__":
    main()
