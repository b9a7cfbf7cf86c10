"""What reading a long session back from its journal costs, each journal read by the code that wrote it.

Why: the journal stores some texts by reference since ``m013`` (a decision names the forwarded message its
replacement is the content of; a list names runs of its base), so a read that used to take them from one row now
looks them up. A session is read back whole when a process loads it (a restart, an eviction from the working cache,
a replica taking the session over): its decisions and working state (``proxy.engine.context._read_back``). Also
timed: ``Journal.decisions`` alone (the operator's API, ``ctxproxy replay``), the mirror's state, and the rebuild of
the session's last forward list (``ctxproxy show``, ``inspect``). "first": the process has read none of the
session's texts yet (``store.replaced`` emptied before each read); "again": it read them before (a replica loading
a session it served earlier).

The journals come from ``bench/long_run.py --keep DIR`` (``SOURCE-WINDOW.db``); each is copied and read in a
process run from its SOURCE checkout (``PYTHONPATH``), median of ``--repeat`` reads after one warm-up.

    .venv/bin/python bench/long_run.py --source /tmp/before --source /tmp/after --keep /tmp/journals
    .venv/bin/python bench/journal_reads.py --journal /tmp/journals/before-131072.db=/tmp/before \\
        --journal /tmp/journals/after-131072.db=/tmp/after
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

READER = """
import json, statistics, sys, time
from ctxproxy.proxy.engine.context import _read_back
from ctxproxy.store import Journal, session_state

journal = Journal(sys.argv[1])
(session,) = [r[0] for r in journal.conn.execute("SELECT id FROM sessions")]
last = journal.conn.execute("SELECT list_id FROM forwards ORDER BY id DESC LIMIT 1").fetchone()[0]
def first(read):
    def cold():
        if hasattr(journal, "replaced_texts"):  # what this process read before (store.replaced), forgotten
            journal.replaced_texts.clear()
        return read()
    return cold

load = lambda: _read_back(journal, session, None, None)
decisions = lambda: journal.decisions(session)
reads = {"load, first": first(load), "load, again": load, "decisions, first": first(decisions),
         "decisions, again": decisions, "session state": lambda: session_state(journal, session),
         "last forward list": lambda: journal.message_hashes(last)}
out = {"decisions read": len(journal.decisions(session))}
for name, read in reads.items():
    read()
    times = []
    for _ in range(int(sys.argv[2])):
        t0 = time.perf_counter()
        read()
        times.append(time.perf_counter() - t0)
    out[name] = round(statistics.median(times) * 1000, 2)
print(json.dumps(out))
"""


def read(journal: Path, source: Path, repeat: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "journal.db"
        shutil.copy(journal, copy)
        if Path(f"{journal}-wal").exists():
            shutil.copy(f"{journal}-wal", f"{copy}-wal")
        done = subprocess.run([sys.executable, "-c", READER, str(copy), str(repeat)], check=True, capture_output=True,
                              text=True, cwd=source, env={**os.environ, "PYTHONPATH": str(source)})
    result: dict[str, float] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--journal", action="append", required=True, help="JOURNAL=SOURCE (repeat)")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args(argv)
    rows = []
    for spec in args.journal:
        journal, _, source = spec.partition("=")
        rows.append((Path(journal).name, read(Path(journal), Path(source).resolve(), args.repeat)))
    keys = list(rows[0][1])
    print("| journal | " + " | ".join(f"{k} (ms)" if k != "decisions read" else k for k in keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, result in rows:
        print(f"| {name} | " + " | ".join(str(result[k]) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
