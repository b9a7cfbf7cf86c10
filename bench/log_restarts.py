"""How large the SQLite journal's write-ahead log grows under commits that never pause: does it start afresh?

Why: a passive checkpoint copies the log back into the file beside the writer, but the log starts again from its
beginning only at a commit whose transaction began after a copy that left nothing behind. Requests sent back to
back (a long session's, hundreds a second) left every checkpoint behind, and the log grew to the backstop, whose
checkpoint then ran on a request's path (``store/checkpoints.py``). SQLite keeps a log file at the largest size it
reached, so that size, against the database file's, says how long the log went without starting afresh: about one
checkpoint's worth of commits when it starts afresh at each, a multiple of it when it sometimes does not.

How: ``tests/test_checkpoints.burst`` (a request with 8 KB of new text journaled every 2 ms for a
second, each poking a ``Checkpointer`` that runs every 0.05 s), ``--runs`` times, each on a new journal in a
temporary folder; printed per run: requests, checkpoints, how many times the log started afresh (its header's
checkpoint sequence number, ``tests/test_checkpoints.log_restarts``), the log's largest size, the file's, and their
ratio.

Run: ``.venv/bin/python bench/log_restarts.py --runs 12`` (``PYTHONPATH=OTHER``: another tree's checkpointer)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from ctxproxy.store.checkpoints import Checkpointer  # first: PYTHONPATH's tree, not this one's

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from tests.test_checkpoints import burst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=12)
    args = parser.parse_args(argv)
    print(f"checkpointer from {Path(sys.modules[Checkpointer.__module__].__file__ or '?').parent.parent}")
    print("| run | requests | checkpoints | the log started afresh | largest log (MB) | file (MB) | log / file |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="ctxproxy-log-") as folder:
            n, checkpoints, log, file, restarts = burst(Path(folder))
        ratios.append(log / file)
        print(f"| {run + 1} | {n} | {checkpoints} | {restarts} | {log / 1e6:.2f} | {file / 1e6:.2f} "
              f"| {log / file:.2f} |")
    print(f"\nlog / file: median {statistics.median(ratios):.2f}, {min(ratios):.2f}–{max(ratios):.2f}; "
          f"at 0.75 or more in {sum(r >= 0.75 for r in ratios)} of {len(ratios)} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
