"""``bench/long_run.py``'s account of the slow requests of a long run: what each request did (its kind) and the
proxy's own CPU for it, so a request over twice the median is told apart as the proxy's work or the machine's wait
(issue #13)."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from ctxproxy.config import load_settings
from ctxproxy.proxy.observe.logs import request_line
from tests.benches import bench_module
from tests.conftest import app_client
from tests.fakes import FakeUpstream
from tests.test_mirror_writes import _body, _send

ROOT = Path(__file__).resolve().parent.parent


def _long_run() -> ModuleType:
    return bench_module("long_run")


def test_a_slow_request_is_told_apart_as_the_proxy_s_work_or_a_wait() -> None:
    added = [1.0, 1.0, 1.0, 5.0, 5.0, 1.0]
    cpu = [1.0, 1.0, 1.0, 4.0, 1.0, 1.0]  # the fourth worked, the fifth waited
    kinds = ["plain", "plain", "spill", "fold", "plain", "plain"]
    handled = [0.5, 0.5, 0.5, 3.0, 0.5, 0.5]  # the fourth's time went in the proxy's handling, the fifth's outside it
    report = _long_run().spread(added, cpu, kinds, handled)
    assert report["slow_with_cpu_over_2x"] == 1 and report["cpu_over_2x_median"] == 1
    assert report["slow_by_kind"] == {"fold": 1, "plain": 1}
    assert report["handled_median_ms"] == 0.5 and report["slow_with_handled_over_2x"] == 1
    assert _long_run().spread(added, cpu, kinds, [])["slow_with_handled_over_2x"] is None  # a log it cannot read


def test_the_proxy_s_own_time_per_request_is_read_from_its_log(tmp_path: Path) -> None:
    """The lines ``proxy.observe.logs.request_line`` writes, after the startup line, a warm-up chat and a refusal
    (a 400 has no total): the run's requests are the last chats told of, in order."""
    def line(total: float, session: str = "s-run", added: float | None = 1.0) -> str:
        return request_line({"session": session, "route": "POST /v1/chat/completions", "status": 200,
                             "outcome": "ok", "tokens_in": 10, "tokens_out": 10, "cuts": {"spill": 1},
                             "retries": 0, "rounds": 0, "added_ms": added, "total_ms": total})
    log = tmp_path / "proxy.log"
    log.write_text("\n".join(["ctxproxy: upstream http://127.0.0.1:1/v1, window 32000 tokens", line(9.0, "s-warm"),
                              "refused POST /v1/chat/completions 400 invalid_request: `messages` must be ...",
                              line(2.5), line(12.4, added=8.25), line(3.0, added=None)]) + "\n")
    long_run = _long_run()
    assert long_run.handled_ms(log, 3) == [2.5, 12.4, 3.0]
    assert long_run.sent_ms(log, 3) == [1.0, 8.2, 0.0]  # as the line rounds it; never sent: none of it
    assert long_run.handled_ms(log, 5) == [] == long_run.sent_ms(log, 5)  # not this run's log, or its format


def test_each_request_s_kind_is_read_from_the_journal(tmp_path: Path) -> None:
    """Eight protected results of ~1000 tokens in a 16k window: the first request elides and turns the mirror on,
    so its forward ends with the proxy's notice, which the next forward does not repeat at that place. The bench's
    warm-up chat, sent first in a session of its own, is not one of the run's."""
    long_run = _long_run()
    _send(tmp_path, [long_run.WARM_UP, _body(13), _body(14)])
    journal = tmp_path / "data" / "journal.db"
    assert long_run.request_kinds(journal) == ["elide", "notice"]
    assert len(long_run.trace(journal)) == 2


def test_a_process_s_cpu_is_read_across_its_threads() -> None:
    """The running thread's ``schedstat`` is brought up to date only at a scheduler tick or a switch (every 4 ms
    at 250 Hz), so a few milliseconds of work can read as none: 50 ms of CPU (``process_time``, exact) must read
    as at least 30."""
    long_run = _long_run()
    before, start = long_run.cpu_ns(os.getpid()), time.process_time()
    while time.process_time() - start < 0.05:
        sum(range(10_000))
    assert long_run.cpu_ns(os.getpid()) - before >= 30_000_000


def test_the_requests_of_each_kind_are_told_with_their_cpu_and_their_own_outliers() -> None:
    run = {"source": "/tmp/tree", "window": 32768, "cpu_median_ms": 2.0, "kinds": ["plain", "fold", "plain", "fold"],
           "added_ms": [1.0, 6.0, 3.0, 8.0], "cpu_ms": [1.0, 5.0, 2.0, 3.0]}
    lines = _long_run().by_kind([run])
    assert lines[2:] == ["| tree | 32k | plain | 2 | 2.00 | 1.50 | 0 |", "| tree | 32k | fold | 2 | 7.00 | 4.00 | 1 |"]


def test_twins_keep_what_both_took_long_for_as_the_proxy_s_own() -> None:
    """Request 3 was slow in both runs of the tree (the proxy's work), request 4 in one only (a wait): the less of
    the two is each request's own cost, and only request 3 is over twice its median."""
    kinds = ["plain", "plain", "spill", "fold", "plain", "plain"]
    first = {"source": "/tmp/tree", "window": 32768, "added_ms": [1.0, 1.0, 1.0, 6.0, 7.0, 1.0],
             "added_median_ms": 1.0, "over_2x_median": 2, "kinds": kinds}
    second = {**first, "added_ms": [1.2, 0.9, 1.1, 5.0, 1.0, 1.0], "over_2x_median": 1}
    [twin] = _long_run().twin_runs([first, second])
    assert twin["own_slow"] == [3] and twin["own_slow_ms"] == [5.0] and twin["own_slow_by_kind"] == {"fold": 1}
    assert twin["over_2x_each"] == [2, 1] and twin["over_2x_all"] == 1 and twin["own_median_ms"] == 1.0
    assert "own_handled_median_ms" not in twin  # no handling read from the logs


def test_passes_and_twins_of_a_tree_are_one_account_each_request_the_least_of_its_runs() -> None:
    """Two trees, two passes of twins: the runs come window by window, pass by pass, each pass's twins side by
    side. Each tree's four runs are one account: request 2 was slow in three of them (a wait that met both twins
    of a pass, and one twin of the other), request 4 in all four (the proxy's own)."""
    kinds = ["plain"] * 6

    def run(source: str, added: list[float]) -> dict[str, object]:
        return {"source": source, "window": 32768, "added_ms": added, "added_median_ms": 1.0, "kinds": kinds,
                "over_2x_median": sum(a > 2 for a in added)}
    a = [run("/t/a", [1.0, 1.0, 5.0, 1.0, 5.0, 1.0]), run("/t/a", [1.0, 1.1, 6.0, 1.0, 4.0, 1.0]),
         run("/t/a", [1.0, 1.0, 1.2, 0.9, 6.0, 1.0]), run("/t/a", [1.1, 1.0, 5.0, 1.0, 4.5, 1.0])]
    b = [run("/t/b", [1.0] * 6) for _ in range(4)]
    runs = [a[0], a[1], b[0], b[1], a[2], a[3], b[2], b[3]]  # pass 1's twins of each tree, then pass 2's
    first, second = _long_run().twin_runs(runs)
    assert (first["source"], first["runs"], second["source"], second["runs"]) == ("/t/a", 4, "/t/b", 4)
    assert first["own_slow"] == [4] and first["own_slow_ms"] == [4.0] and first["over_2x_all"] == 1
    assert first["over_2x_each"] == [2, 2, 1, 2] and second["own_over_2x_median"] == 0
    assert _long_run().twin_runs([a[0], b[0]]) == []  # one run of each tree: nothing to take the least of


@pytest.mark.e2e
def test_passes_run_the_whole_replay_again_with_fresh_proxies(tmp_path: Path) -> None:
    """``--passes 2`` through the real CLI: a short run twice, one after the other, each with a proxy (and a
    journal) of its own, and one account of the two in the report, each request's least."""
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "long_run.py"), "--rounds", "12", "--windows", "16000",
                    "--passes", "2", "--json", str(out), "--keep", str(tmp_path / "kept")],
                   capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(out.read_text())
    first, second = report["runs"]
    assert first["window"] == second["window"] == 16000 and first["requests"] == second["requests"] == 12
    [both] = report["twins"]
    assert both["runs"] == 2 and len(both["over_2x_each"]) == 2
    # the median of each request's least is no more than either run's median, up to the report's rounding to 0.01
    assert both["own_median_ms"] <= min(first["added_median_ms"], second["added_median_ms"]) + 0.01 + 1e-9
    kept = sorted(p.relative_to(tmp_path / "kept").parts[0] for p in (tmp_path / "kept").rglob("*.db"))
    assert kept == ["pass-0", "pass-1"]  # each pass's journal, apart


def test_twins_handling_is_the_less_of_the_two_and_folds_are_told_apart() -> None:
    """Request 3 (a fold) was handled slowly by both proxies, request 4 by one only."""
    kinds = ["plain", "plain", "spill", "elide+fold", "plain", "plain"]
    first = {"handled_ms": [1.0, 1.0, 1.0, 6.0, 7.0, 1.0], "kinds": kinds}
    second = {"handled_ms": [1.2, 0.9, 1.1, 5.0, 1.0, 1.0], "kinds": kinds}
    own = _long_run().own_handling([first, second])
    assert own == {"own_handled_median_ms": 1.0, "own_handled_slow": [3], "fold_handled_median_ms": 5.0,
                   "fold_handled_max_ms": 5.0}
    assert _long_run().own_handling([first, {**second, "handled_ms": []}]) == {}
    sent = {**first, "sent_ms": [0.5, 0.5, 0.5, 2.0, 0.5, 0.5]}  # the fold's: 2 ms before the upstream
    split = _long_run().own_handling([sent, {**second, "sent_ms": [0.6, 0.5, 0.5, 3.0, 0.5, 0.5]}])
    assert split["fold_sent_median_ms"] == 2.0 and split["fold_after_median_ms"] == 2.0  # 5.0 - 3.0 (6.0 - 2.0)
    assert split["own_sent_median_ms"] == 0.5 and split["own_after_median_ms"] == 0.5


def test_the_wide_opening_request_is_refused_by_the_proxy_and_journals_nothing(tmp_path: Path) -> None:
    """``open_wide``'s body is read whole by the proxy and refused (its messages are not a list): no request row, so
    the run's session is the journal's first but the warm-up's."""
    fake = FakeUpstream()
    settings = load_settings(env={"CTXPROXY_UPSTREAM": "http://u.test/v1", "CTXPROXY_DATA_DIR": str(tmp_path)})
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        assert _long_run().open_wide(client, 200_000) == 400
    with contextlib.closing(sqlite3.connect(tmp_path / "journal.db")) as db:
        assert db.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 0
    assert fake.chats == []


def test_the_steps_of_a_long_run_are_timed_per_request_in_process() -> None:
    """``bench/long_run_steps.py``: the run replayed through the app in its own process, each step's time per
    request; at 32k the mirror turns on within 200 rounds and grows, so its steps are timed too, and no step of a
    request took longer than the request."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "long_run_steps.py"), "--window", "32000",
                          "--rounds", "200", "--requests", ",".join(map(str, range(200)))],
                         capture_output=True, text=True, timeout=300, check=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    labels = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(labels, (cell.strip() for cell in line.strip("|").split("|")), strict=True)) for line in lines[1:]]
    requests = [row for row in rows if row["request"].isdigit()]
    assert len(requests) == 200
    assert all(float(row["fitting"]) > 0 and float(row["project"]) > 0 for row in requests)
    first = next(i for i, row in enumerate(requests) if float(row["mirror journaled"]) > 0)
    assert first > 20 and float(requests[first]["mirror rendered whole"]) > 0  # off at first, then turned on
    assert sum(float(row["mirror grown"]) > 0 for row in requests[first:]) > 20  # and grown
    assert all(float(row[label]) <= float(row["total"]) for row in requests for label in labels[2:])


def test_a_small_fork_and_a_continuation_stay_within_their_statements() -> None:
    """``bench/statements.py``: the statements the journal runs per request, counted in process on the generated
    60-round workload. The budget is this tree's count (issue #13: 22 a new-text fork and 21.1 a continuation
    before, each a few dozen microseconds): a statement added to either path fails here, to be counted again on
    purpose. Each statement is listed with ``--show``."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "statements.py"), "--show"],
                         capture_output=True, text=True, timeout=300, check=True)
    counts = {line.split(":")[0]: float(line.rsplit(":", 1)[1]) for line in run.stdout.splitlines()
              if line and not line.startswith((" ", "SQL"))}
    fork, continuation = "new-text fork (the peers' small request)", "continuation (the replay's rounds 11-60)"
    assert set(counts) == {fork, continuation}, run.stdout
    assert counts[fork] <= 16 and counts[continuation] <= 18.6, run.stdout
    assert "INSERT INTO requests" in run.stdout and "UPDATE message_lists SET segment" not in run.stdout.split(
        "new-text fork")[0]  # a continuation joins its base's segment in its list's own insert
