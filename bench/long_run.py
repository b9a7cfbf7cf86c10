"""A 600-round agent run through the real proxy: what each request costs, what the journal keeps, what the GPU does.

Why: the latency bench times one body many times; a long session is where costs that grow with the history show
(a fold that re-serialises everything folded before, a file rewritten on every request, a journal that grows with
the square of the session). Per window (32k and 128k by default) this replays ``tests/workloads.py``'s
``conversation(rounds=600)`` — each request the history through the newest tool result, as an agent sends it —
through a fresh ``ctxproxy serve`` process, each request also sent directly to the upstream, interleaved (the
order alternates), and reports:

- the added latency per request (proxied − direct, same body): median, p99, max, and how many requests took more
  than twice the median (goal: none); which those are (``request_kinds``: a fold, a spill, an elision, the
  mirror's notice, a rebuilt prefix) and whether the proxy's own CPU for them (``/proc/PID/task/*/schedstat``)
  was over twice its median too, or the request waited (the machine's noise);
- the journal's size on disk (the SQLite file and its WAL, after the proxy stopped) against the raw history (the
  last request's messages, compact JSON; goal ≤ 2×), and how much of it is fold bodies stored as blobs;
- the proxy's resident memory when idle (before the first chat) and after the run (goal ≤ idle + 40 MB);
- the GPU seconds of the run's upstream request trace (each forward's characters, and those repeating the
  previous forward from its start) from the shared H200 cost model: ``gpu_seconds.py`` in the folder
  ``--gpu-model DIR`` or ``CTXPROXY_GPU_MODEL`` names (the peers' ``bench/gpu/``, not part of the repository);
  without it that column is left out, and the report says so.

The upstream is ``fake_upstream.py``'s fixed answer without ``usage`` (its constant ``prompt_tokens`` would
calibrate the proxy's token estimate to the clamp), in its own process. ``--source DIR`` runs the proxy from
another checkout (``git archive main | tar -x -C DIR``) to measure the code before a change with the same bench.
``--twins`` (two proxies of each tree side by side) and ``--passes N`` (the whole run N times, one after the other)
tell the proxy's own cost of each request from the machine's waits: the least of its runs (``twin_runs``).

Run: ``.venv/bin/python bench/long_run.py --markdown --gpu-model PEERS/gpu``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import fake_upstream  # noqa: E402
import harness  # noqa: E402
import latency  # noqa: E402
from gpu_model import GPU_ENV, default_model, gpu_seconds, missing_note  # noqa: E402

from ctxproxy.store.deltas import rebuild  # noqa: E402
from tests.workloads import conversation  # noqa: E402

WINDOWS = (32768, 131072)
WARM_UP = {"model": "bench",
           "messages": [{"role": "user", "content": "A chat before the run, in a session of its own"}]}
"""Sent to each proxy before the run, as a proxy that has been running would have served one: a process's first
chat costs 2-3 ms more than the next (SQLite's statements prepared, the interpreter's first pass over the paths),
which is the start's cost (``bench/footprint.py``: exec to the answer of a chat sent at ready), not the session's.
Its session's rows are left out of everything read from the journal (``RUN_REQUESTS``)."""

RUN_REQUESTS = ("SELECT id FROM requests WHERE session_id != (SELECT session_id FROM requests ORDER BY id LIMIT 1)"
                " ORDER BY id")
"""The run's requests in the journal: all but the warm-up's session (the first request's)."""

NO_USAGE = json.dumps({k: v for k, v in json.loads(fake_upstream.COMPLETION).items() if k != "usage"},
                      separators=(",", ":")).encode()


# --- the upstream -------------------------------------------------------------------------------------------------
UPSTREAM_MS_ENV = "LONG_RUN_UPSTREAM_MS"
"""How long the upstream takes to answer a chat (``--upstream-ms``), handed to its process."""


async def _upstream_app(scope: Any, receive: Any, send: Any) -> None:
    """``fake_upstream.app`` answering chats without ``usage``, after ``--upstream-ms`` (0: at once, the peers'
    method)."""
    if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].endswith("/chat/completions"):
        await fake_upstream.read_body(receive)
        delay = float(os.environ.get(UPSTREAM_MS_ENV) or 0) / 1000
        if delay:
            await asyncio.sleep(delay)
        await fake_upstream.send_bytes(send, 200, NO_USAGE)
        return
    await fake_upstream.app(scope, receive, send)


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(_upstream_app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning", server_header=False, date_header=False)


@contextlib.contextmanager
def upstream(tmp: Path) -> Iterator[str]:
    """The fake upstream in its own process; its base URL (without /v1)."""
    port = latency.free_port()
    proc = latency._spawn([sys.executable, __file__, "--serve-upstream", str(port)], tmp / "upstream.log",
                          os.environ.copy())
    try:
        latency._wait_ready(proc, f"http://127.0.0.1:{port}/v1/models", tmp / "upstream.log")
        yield f"http://127.0.0.1:{port}"
    finally:
        latency._stop(proc)


# --- one run ------------------------------------------------------------------------------------------------------
def bodies(rounds: int) -> list[bytes]:
    """The agent's requests, serialised once: the history through each tool result."""
    return [orjson.dumps(body) for body in harness.requests_of(conversation(rounds=rounds))]


def replay(directs: list[str], proxies: list[tuple[str, int]],
           requests: list[bytes]) -> tuple[list[list[int]], list[list[int]]]:
    """Per request, [each direct ns, then each proxy's ns]: the same body to each, in an order that rotates; and
    per request, each proxy's CPU ns (all its threads) from just before the request to just before the next one,
    so what a request leaves to do after its answer (a journal write, a collection, a trim) counts too."""
    clients = [httpx.Client(base_url=url, timeout=600) for url in (*directs, *(url for url, _ in proxies))]
    pids = [pid for _, pid in proxies]
    rows, cpu, before = [], [], []
    try:
        for client in clients:
            open_wide(client, max(map(len, requests)))
        before = [cpu_ns(pid) for pid in pids]
        for i, body in enumerate(requests):
            times = [0] * len(clients)
            for k in range(len(clients)):
                j = (i + k) % len(clients)
                times[j] = latency.time_whole(clients[j], latency.CHAT_PATH, body)
            rows.append(times)
            now = [cpu_ns(pid) for pid in pids]
            cpu.append([b - a for a, b in zip(before, now, strict=True)])
            before = now
    finally:
        for client in clients:
            client.close()
    return rows, cpu


def open_wide(client: httpx.Client, size: int) -> int:
    """One untimed request of ``size`` bytes on the client's connection before the run, which every target reads
    whole: the upstream answers it, a proxy refuses it (its messages are not a list), nothing is journaled.

    Why: the first body on a kept-alive connection larger than any before it waited for the connection's buffers
    to grow. The upstream's took ~4 ms more for each new largest body from ~5.2 MB on (3.7 → 7.0 ms at 5.2 MB, 4.2
    → 8.0 at 6.1 MB, a run of 200 growing bodies; sent in reverse after, or after one 6.5 MB body, no step), and
    the run's bodies grow every request, so the direct times of its last fifth doubled and their added latency
    fell to ~1 ms: a fifth of the run far below the median, the median pulled down with it."""
    filler = b'{"model":"bench","messages":"' + b"x" * max(0, size - 32) + b'"}'
    status = client.post(latency.CHAT_PATH, content=filler, headers=latency.HEADERS).status_code
    if status not in (200, 400):
        raise RuntimeError(f"the request that opens the connection wide was answered {status}")
    return status


def cpu_ns(pid: int) -> int:
    """The CPU time a process's threads have run so far (``/proc/PID/task/*/schedstat``'s first field), in ns: a
    request's CPU is the machine-independent half of its latency (a busy machine adds waiting, not CPU)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total


@contextlib.contextmanager
def proxy_process(upstream_base: str, tmp: Path, window: int,
                  source: Path) -> Iterator[tuple[str, int, Path, Path]]:
    """``harness.proxy_process``, run from ``source`` (its working directory and PYTHONPATH): URL, PID, data dir,
    and the file its log goes to."""
    port, data = latency.free_port(), tmp / f"data-{time.monotonic_ns()}"
    command = [sys.executable, "-c", harness.AS_INSTALLED, "serve", "--upstream", upstream_base + "/v1",
               "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data)]
    env = latency._proxy_environ([f"CTXPROXY_CTX_WINDOW={window}", f"PYTHONPATH={source}"])
    log_path = tmp / f"proxy-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=source)
    try:
        latency._wait_ready(proc, f"http://127.0.0.1:{port}/healthz", log_path)
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)  # the upstream's connection
        harness.wait_warm(f"http://127.0.0.1:{port}")
        httpx.post(f"http://127.0.0.1:{port}{latency.CHAT_PATH}", json=WARM_UP, timeout=30).raise_for_status()
        yield f"http://127.0.0.1:{port}", proc.pid, data, log_path
    finally:
        latency._stop(proc)


def run_window(window: int, requests: list[bytes], tmp: Path, sources: list[Path], keep: Path | None = None,
               twins: bool = False) -> list[dict[str, Any]]:
    """One run per source, side by side: each request goes direct and to every source's proxy in turn. ``twins``:
    two proxies of each source and two direct sends of each request (``twin_runs``)."""
    history = len(orjson.dumps(orjson.loads(requests[-1])["messages"]))
    copies = 2 if twins else 1
    with upstream(tmp) as base, contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(proxy_process(base, tmp, window, source))
                   for source in sources for _ in range(copies)]
        idle = [harness.rss_mb(pid, "VmRSS") for _, pid, _, _ in proxies]
        started = time.monotonic()
        rows, cpu = replay([base] * copies, [(url, pid) for url, pid, _, _ in proxies], requests)
        seconds = time.monotonic() - started
        after = [harness.rss_mb(pid, "VmRSS") for _, pid, _, _ in proxies]
    direct = [min(row[:copies]) for row in rows]
    runs = []
    for k, (source, (_, _, data, log_path)) in enumerate(zip([s for s in sources for _ in range(copies)], proxies,
                                                  strict=True)):
        added = [(row[copies + k] - d) / 1e6 for row, d in zip(rows, direct, strict=True)]
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for suffix in ("", "-wal"):
                if (data / f"journal.db{suffix}").exists():
                    twin = f"-{k % copies}" if twins else ""
                    shutil.copy(data / f"journal.db{suffix}", keep / f"{source.name}-{window}{twin}.db{suffix}")
        runs.append({"source": str(source), "window": window, "requests": len(requests), "seconds": round(seconds, 1),
                     **added_latency(added, fold_requests(data / "journal.db")), **journal_size(data, history),
                     **spread(added, [c[k] / 1e6 for c in cpu], request_kinds(data / "journal.db"),
                              handled_ms(log_path, len(requests))),
                     "sent_ms": sent_ms(log_path, len(requests)),
                     "idle_rss_mb": round(idle[k], 1), "after_rss_mb": round(after[k], 1),
                     "rss_growth_mb": round(after[k] - idle[k], 1), "trace": trace(data / "journal.db")})
    return runs


def twin_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each source's runs of one window (``--twins``: two side by side; ``--passes``: one after the other; or both)
    as one: a request's own cost is the least of its added latencies, each against the less of its run's two
    direct times.

    Why: on a machine of two cores shared by the bench's client, the upstream and the proxies, a request waits
    now and then for a core, and a wait only adds time. Proxies of the same tree do the same work for each
    request, so what all took long for is the proxy's own; what one of them alone did is the machine's (in ten
    runs of twins, 0-7 of each twin's 4-17 requests over twice the median were over in both). Twins side by side
    share the machine's moment: a stall of a few milliseconds (another process, a sync) and each twin's work after
    its answer (a spilled result counted on a thread) meet both. Passes are minutes apart."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["source"], run["window"]), []).append(run)
    return [_least_of(group) for group in groups.values() if len(group) > 1]


def _least_of(group: list[dict[str, Any]]) -> dict[str, Any]:
    first = group[0]
    own = [min(added) for added in zip(*(r["added_ms"] for r in group), strict=True)]
    median = statistics.median(own)
    slow = [i for i, x in enumerate(own) if x > 2 * median]
    by_kind: dict[str, int] = {}
    for i in slow:
        by_kind[first["kinds"][i]] = by_kind.get(first["kinds"][i], 0) + 1
    every = [i for i in range(len(own)) if all(r["added_ms"][i] > 2 * r["added_median_ms"] for r in group)]
    return {"source": first["source"], "window": first["window"], "runs": len(group),
            "own_median_ms": round(median, 2), "own_max_ms": round(max(own), 2), "own_over_2x_median": len(slow),
            "own_slow": slow[:20], "own_slow_ms": [round(own[i], 2) for i in slow[:20]], "own_slow_by_kind": by_kind,
            "over_2x_each": [r["over_2x_median"] for r in group], "over_2x_all": len(every), **own_handling(group)}


def own_handling(group: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' handling (``handled_ms``) the same way: each request's the least of the runs'; its median, which
    requests took over twice it, and the fold passes' median and most. With the logs' ``sent_ms``, the fold passes'
    own time to the upstream and after it (the answer, and what it waited for: the mirror's file), each the least
    of the runs', beside all requests' medians. Nothing when a log could not be read."""
    if not all(r.get("handled_ms") for r in group):
        return {}
    own = [min(handled) for handled in zip(*(r["handled_ms"] for r in group), strict=True)]
    median = statistics.median(own)
    folds = [i for i, kind in enumerate(group[0]["kinds"]) if "fold" in kind.split("+")]
    out = {"own_handled_median_ms": round(median, 2), "own_handled_slow": [i for i, x in enumerate(own)
                                                                           if x > 2 * median][:20],
           "fold_handled_median_ms": round(statistics.median(own[i] for i in folds), 2) if folds else None,
           "fold_handled_max_ms": round(max(own[i] for i in folds), 2) if folds else None}
    if all(r.get("sent_ms") for r in group) and folds:
        sent = [min(times) for times in zip(*(r["sent_ms"] for r in group), strict=True)]
        after = [min(times) for times in zip(*([h - s for h, s in zip(r["handled_ms"], r["sent_ms"], strict=True)]
                                                for r in group), strict=True)]
        out |= {"own_sent_median_ms": round(statistics.median(sent), 2),
                "own_after_median_ms": round(statistics.median(after), 2),
                "fold_sent_median_ms": round(statistics.median(sent[i] for i in folds), 2),
                "fold_after_median_ms": round(statistics.median(after[i] for i in folds), 2)}
    return out


def added_latency(added: list[float], folds: list[int]) -> dict[str, Any]:
    """The added latency's spread, and the requests that folded against their neighbours (the ten before and
    after, folds left out): the body grows from a few KB to 6.7 MB, so the cost of a request is judged beside
    those of about its size."""
    median = statistics.median(added)
    p99 = statistics.quantiles(added, n=100, method="inclusive")[98]
    slow = [i for i, a in enumerate(added) if a > 2 * median]
    local = [a / _neighbours(added, i, set(folds)) for i, a in enumerate(added)]
    fold_ratios = [local[i] for i in folds]
    return {"added_median_ms": round(median, 2), "added_p99_ms": round(p99, 2), "added_max_ms": round(max(added), 2),
            "over_2x_median": len(slow), "over_2x_median_requests": slow[:20],
            "over_2x_neighbours": sum(r > 2 for r in local), "folds": len(folds),
            "fold_vs_neighbours_median": round(statistics.median(fold_ratios), 2) if folds else None,
            "fold_vs_neighbours_max": round(max(fold_ratios), 2) if folds else None,
            "added_ms": [round(a, 2) for a in added], "fold_requests": folds}


def spread(added: list[float], cpu: list[float], kinds: list[str], handled: list[float]) -> dict[str, Any]:
    """Which requests are over twice the median, and why: each one's kind (``request_kinds``), whether its own
    CPU was over twice the median CPU too (the proxy's work) or not (it waited: the machine's noise), and whether
    the proxy's handling of it (``handled_ms``: from its parsed body to its answer's end) was over twice its
    median, or the time went before or after it (reading and parsing the body, the answer on its way back, a
    wait for a core)."""
    median, cpu_median = statistics.median(added), statistics.median(cpu)
    handled_median = statistics.median(handled) if handled else 0.0
    slow = [i for i, a in enumerate(added) if a > 2 * median]
    by_kind: dict[str, int] = {}
    for i in slow:
        by_kind[kinds[i]] = by_kind.get(kinds[i], 0) + 1
    return {"cpu_median_ms": round(cpu_median, 2), "cpu_max_ms": round(max(cpu), 2),
            "cpu_over_2x_median": sum(c > 2 * cpu_median for c in cpu),
            "slow_with_cpu_over_2x": sum(cpu[i] > 2 * cpu_median for i in slow), "slow_by_kind": by_kind,
            "handled_median_ms": round(handled_median, 2) if handled else None,
            "slow_with_handled_over_2x": sum(handled[i] > 2 * handled_median for i in slow) if handled else None,
            "handled_ms": handled,
            "cpu_ms": [round(c, 2) for c in cpu], "kinds": kinds}


_REQUEST_LINE = re.compile(r"POST /v1/chat/completions \d{3} .*, added ([\d.]+|-)(?: ms)?, total ([\d.]+) ms$")
"""A chat's line in the proxy's log (``proxy.observe.logs.request_line``): its ``added`` (from the parsed body to
the upstream's request sent) and its ``total``, the proxy's own time."""


def handled_ms(log: Path, requests: int) -> list[float]:
    """The proxy's own time for each of the run's ``requests`` (the last chats its log tells of: the warm-up
    chat comes before them), from its log's request lines: from the parsed body to the answer's end. Empty when
    the log does not tell of that many (another log format)."""
    return _logged(log, requests, 2)


def sent_ms(log: Path, requests: int) -> list[float]:
    """Of the same lines, each request's ``added``: the proxy's own time until its forward was sent upstream (what
    it did before; the rest of ``handled_ms`` is the upstream's answer and what the proxy waited for after it, the
    mirror's file among them). Empty as ``handled_ms``."""
    return _logged(log, requests, 1)


def _logged(log: Path, requests: int, group: int) -> list[float]:
    values = [float(m.group(group)) if m.group(group) != "-" else 0.0
              for line in log.read_text(errors="replace").splitlines() if (m := _REQUEST_LINE.search(line))]
    return values[-requests:] if len(values) >= requests else []


def request_kinds(journal: Path) -> list[str]:
    """Per request of the run, what its projection did beside extending the last forward: the kinds of the
    decisions it made (spill, elide, fold); ``notice`` when its forward repeats the previous one but for that one's
    last message (the proxy's note to the model at the end: the context no longer fits by the automatic rules, so
    the mirror is on), ``rebuilt`` when it changed an earlier message; ``plain`` for none of these."""
    with contextlib.closing(sqlite3.connect(journal)) as db:
        ids = [r[0] for r in db.execute(RUN_REQUESTS)]
        made: dict[int, set[str]] = {}
        for request_id, kind in db.execute("SELECT request_id, kind FROM decisions WHERE request_id IS NOT NULL"):
            made.setdefault(request_id, set()).add(kind)
        forwards = dict(db.execute("SELECT request_id, list_id FROM forwards WHERE attempt = 0"))
        lists = {rid: _hashes(db, forwards[rid]) for rid in ids if rid in forwards}
    out, previous = [], None
    for rid in ids:
        hashes = lists.get(rid, [])
        labels = sorted(made.get(rid, set()))
        if previous:
            first = next((i for i, (a, b) in enumerate(zip(previous, hashes, strict=False)) if a != b), len(previous))
            labels += ["notice"] if first == len(previous) - 1 else ["rebuilt"] if first < len(previous) else []
        out.append("+".join(labels) or "plain")
        previous = hashes
    return out


def _neighbours(added: list[float], i: int, skip: set[int]) -> float:
    around = [added[j] for j in range(max(0, i - 10), min(len(added), i + 11)) if j != i and j not in skip]
    return max(statistics.median(around), 1e-3) if around else max(added[i], 1e-3)


def fold_requests(journal: Path) -> list[int]:
    """The positions (in the run) of the requests whose projection folded."""
    with contextlib.closing(sqlite3.connect(journal)) as db:
        ids = [r[0] for r in db.execute(RUN_REQUESTS)]
        folded = {r[0] for r in db.execute("SELECT request_id FROM decisions WHERE kind = 'fold'")}
    return [i for i, request_id in enumerate(ids) if request_id in folded]


def journal_size(data: Path, history: int) -> dict[str, Any]:
    """The journal on disk after the proxy stopped, and the fold bodies stored as blobs (the old way)."""
    files = [data / "journal.db", data / "journal.db-wal"]
    size = sum(f.stat().st_size for f in files if f.exists())
    with contextlib.closing(sqlite3.connect(data / "journal.db")) as db:
        folds = db.execute("SELECT COALESCE(SUM(b.chars), 0) FROM overflow o JOIN blobs b ON b.hash = o.id"
                           " WHERE o.tool = 'fold'").fetchone()[0]
        kinds = dict(db.execute("SELECT kind, SUM(chars) FROM blobs GROUP BY kind"))
    return {"history_bytes": history, "journal_bytes": size, "journal_ratio": round(size / history, 2),
            "fold_blob_bytes": folds, "blob_chars_by_kind": kinds, "breakdown": breakdown(data / "journal.db")}


def breakdown(journal: Path) -> dict[str, int]:
    """What the journal's bytes are: each table's and index's pages (SQLite's ``dbstat``, after a checkpoint), the
    message lists' ``added`` text by whose list it is, and the text of decisions and blobs by kind."""
    with contextlib.closing(sqlite3.connect(journal)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        out = {f"pages {name}": size for name, size in db.execute(
            "SELECT name, SUM(pgsize) FROM dbstat GROUP BY name HAVING SUM(pgsize) >= 100000 ORDER BY 2 DESC")}
        for label, ids in [("request", "SELECT list_id FROM requests"),
                           ("forward", "SELECT list_id FROM forwards EXCEPT SELECT list_id FROM requests"),
                           ("mirror", "SELECT mirror_list FROM session_state")]:
            out[f"lists {label}"] = db.execute(f"SELECT COALESCE(SUM(LENGTH(added)), 0) FROM message_lists"
                                               f" WHERE id IN ({ids})").fetchone()[0]
        for kind, chars in db.execute("SELECT kind, SUM(LENGTH(replacement)) FROM decisions GROUP BY kind"):
            out[f"decisions {kind} text"] = chars
        for kind, chars in db.execute("SELECT kind, SUM(chars) FROM blobs GROUP BY kind"):
            out[f"blobs {kind}"] = chars
    return out


def trace(journal: Path) -> list[dict[str, int]]:
    """Each forward upstream, in order: its characters (messages' canonical JSON and the tool list) and those that
    repeat the previous forward from its start, as ``gpu_seconds.py`` reads them."""
    with contextlib.closing(sqlite3.connect(journal)) as db:
        chars = dict(db.execute("SELECT hash, chars FROM blobs WHERE kind = 'message'"))
        rows = db.execute("SELECT f.list_id, b.body FROM forwards f JOIN blobs b ON b.hash = f.params_hash"
                          f" WHERE f.request_id IN ({RUN_REQUESTS}) ORDER BY f.request_id, f.attempt").fetchall()
        lists = {lid: _hashes(db, lid) for lid in {r[0] for r in rows}}
    out, previous, previous_tools = [], [], None
    for list_id, params in rows:
        hashes, tools = lists[list_id], json.loads(params).get("tools")
        tool_chars = len(json.dumps(tools, separators=(",", ":"))) if tools else 0
        same = 0
        if tools == previous_tools:
            same = next((i for i, (a, b) in enumerate(zip(previous, hashes, strict=False)) if a != b),
                        min(len(previous), len(hashes)))
        total = sum(chars[h] for h in hashes) + tool_chars
        reused = sum(chars[h] for h in hashes[:same]) + (tool_chars if previous else 0) if same else 0
        out.append({"chars": total, "reused_chars": reused})
        previous, previous_tools = hashes, tools
    return out


def _hashes(db: sqlite3.Connection, list_id: int) -> list[str]:
    pieces, current = [], list_id
    while current is not None:
        base_id, base_len, added = db.execute("SELECT base_id, base_len, added FROM message_lists WHERE id = ?",
                                              [current]).fetchone()
        pieces.append((base_len, added))
        current = base_id
    hashes: list[str] = []
    for base_len, added in reversed(pieces):
        hashes = rebuild(hashes, base_len, added)  # a list may name runs of its base's hashes (migration m013)
    return hashes


# --- the report ---------------------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    lines = ["| source | window | requests | added median / p99 / max (ms) | > 2× median | > 2× neighbours |"
             " fold requests: n, vs neighbours median / max | journal / history (MB) | of it fold blobs (MB) |"
             " RSS idle → after (MB) | GPU s (tokens processed) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        gpu = r.get("gpu")
        gpu_cell = f"{gpu['total_s']} ({gpu['tokens_processed'] / 1000:.0f}k)" if gpu else "—"
        lines.append(f"| {Path(r['source']).name} | {r['window'] // 1024}k | {r['requests']} | "
                     f"{r['added_median_ms']} / {r['added_p99_ms']} / {r['added_max_ms']} | {r['over_2x_median']} | "
                     f"{r['over_2x_neighbours']} | {r['folds']}, {r['fold_vs_neighbours_median']}× / "
                     f"{r['fold_vs_neighbours_max']}× | {r['journal_bytes'] / 1e6:.1f} / "
                     f"{r['history_bytes'] / 1e6:.1f} ({r['journal_ratio']}×) | {r['fold_blob_bytes'] / 1e6:.1f} | "
                     f"{r['idle_rss_mb']} → {r['after_rss_mb']} | {gpu_cell} |")
    if report["gpu_note"]:
        lines.append(f"\n{report['gpu_note']}")
    lines += ["", "| source | window | proxy CPU per request, median / max (ms) | > 2× median CPU |"
              " > 2× median added: of them > 2× median CPU | proxy's handling, median (ms): of the > 2× added, > 2× it"
              " | > 2× median added, by kind |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {Path(r['source']).name} | {r['window'] // 1024}k | {r['cpu_median_ms']} / {r['cpu_max_ms']} | "
              f"{r['cpu_over_2x_median']} | {r['over_2x_median']}: {r['slow_with_cpu_over_2x']} | "
              f"{r['handled_median_ms'] if r['handled_median_ms'] is not None else '—'}: "
              f"{r['slow_with_handled_over_2x'] if r['slow_with_handled_over_2x'] is not None else '—'} | "
              + ", ".join(f"{k} {n}" for k, n in sorted(r["slow_by_kind"].items(), key=lambda kv: -kv[1])) + " |"
              for r in report["runs"]]
    lines += ["", *by_kind(report["runs"])]
    if report.get("twins"):
        lines += ["", *twins_table(report["twins"])]
    if report.get("breakdown"):
        runs = report["runs"]
        keys = list(dict.fromkeys(k for r in runs for k in r["breakdown"]))
        lines += ["", "| journal bytes (MB) | " + " | ".join(
            f"{Path(r['source']).name} {r['window'] // 1024}k" for r in runs) + " |", "|---|" + "---:|" * len(runs)]
        lines += [f"| {k} | " + " | ".join(f"{r['breakdown'].get(k, 0) / 1e6:.2f}" for r in runs) + " |" for k in keys]
    return "\n".join(lines)


def twins_table(twins: list[dict[str, Any]]) -> list[str]:
    lines = ["| source | window | runs | own added (the least of its runs), median / max (ms) |"
             " > 2× median: each run / all |"
             " own > 2× own median | of them, by kind (ms) | own handling, median (ms): over 2× it |"
             " fold passes' own handling, median / max (ms) | to the upstream / after it, median (ms): all, fold"
             " passes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t in twins:
        slow = ", ".join(f"{i} {ms}" for i, ms in zip(t["own_slow"], t["own_slow_ms"], strict=True))
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(t["own_slow_by_kind"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {Path(t['source']).name} | {t['window'] // 1024}k | {t['runs']} |"
                     f" {t['own_median_ms']} / {t['own_max_ms']} |"
                     f" {' / '.join(map(str, t['over_2x_each']))} / {t['over_2x_all']} | {t['own_over_2x_median']} |"
                     f" {kinds}{'; ' + slow if slow else ''} | {_handling_cells(t)} |")
    return lines


def _handling_cells(t: dict[str, Any]) -> str:
    if "own_handled_median_ms" not in t:
        return "— | — | —"
    slow = ", ".join(map(str, t["own_handled_slow"]))
    split = (f"{t['own_sent_median_ms']} / {t['own_after_median_ms']}; {t['fold_sent_median_ms']} / "
             f"{t['fold_after_median_ms']}" if "own_sent_median_ms" in t else "—")
    return (f"{t['own_handled_median_ms']}: {len(t['own_handled_slow'])}{' (' + slow + ')' if slow else ''} | "
            f"{t['fold_handled_median_ms']} / {t['fold_handled_max_ms']} | {split}")


def by_kind(runs: list[dict[str, Any]]) -> list[str]:
    """Per run, per kind of request (``request_kinds``): how many, their median added latency and proxy CPU, and
    how many of them took over twice the run's median CPU: the proxy's own outliers, apart from the machine's."""
    lines = ["| source | window | kind | requests | added, median (ms) | CPU, median (ms) | > 2× median CPU |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in runs:
        rows: dict[str, list[tuple[float, float]]] = {}
        for kind, added, cpu in zip(r["kinds"], r["added_ms"], r["cpu_ms"], strict=True):
            rows.setdefault(kind, []).append((added, cpu))
        for kind, pairs in sorted(rows.items(), key=lambda kv: -len(kv[1])):
            slow = sum(cpu > 2 * r["cpu_median_ms"] for _, cpu in pairs)
            added, cpu = statistics.median(a for a, _ in pairs), statistics.median(c for _, c in pairs)
            lines.append(f"| {Path(r['source']).name} | {r['window'] // 1024}k | {kind} | {len(pairs)} | "
                         f"{added:.2f} | {cpu:.2f} | {slow} |")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--windows", default=",".join(map(str, WINDOWS)), help="comma-separated token windows")
    parser.add_argument("--gpu-model", type=Path, default=default_model(),
                        help=f"the folder of the shared gpu_seconds.py (or {GPU_ENV})")
    parser.add_argument("--source", type=Path, action="append", help="a checkout to run the proxy from (repeat to "
                        "run several side by side, same requests, interleaved); default: this one")
    parser.add_argument("--json", type=Path, help="write the raw numbers here")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--breakdown", action="store_true", help="with --markdown: the journal's bytes by table")
    parser.add_argument("--keep", type=Path, help="copy each run's journal here (SOURCE-WINDOW.db; with --twins "
                        "SOURCE-WINDOW-0.db and -1.db; with --passes, in pass-N/), for bench/journal_reads.py")
    parser.add_argument("--twins", action="store_true", help="run each source twice side by side, and each request "
                        "direct twice: a request's own cost is the less of the two (twin_runs)")
    parser.add_argument("--passes", type=int, default=1, help="run each window this many times, one after the "
                        "other, each with fresh proxies: a request's own cost is the least of its runs (twin_runs)")
    parser.add_argument("--upstream-ms", type=float, default=0.0, help="the upstream answers each chat after this "
                        "long (a model's time to its answer; 0, the default, is the peers' method: at once)")
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    return parser


PER_REQUEST = ("added_ms", "fold_requests", "cpu_ms", "kinds", "handled_ms", "sent_ms")
"""A run's lists of one value per request: in ``--json``'s file, not in the summary printed."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers it started (their finally blocks)
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return 0
    os.environ[UPSTREAM_MS_ENV] = str(args.upstream_ms)  # the upstream's process inherits it
    requests = bodies(args.rounds)
    note = missing_note(args.gpu_model)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for window in (int(w) for w in args.windows.split(",")):
            for n in range(args.passes):
                folder = Path(tmp) / str(window) / str(n)
                folder.mkdir(parents=True)
                keep = args.keep / f"pass-{n}" if args.keep and args.passes > 1 else args.keep
                for run in run_window(window, requests, folder, [p.resolve() for p in args.source or [ROOT]], keep,
                                      args.twins):
                    run["gpu"] = gpu_seconds(args.gpu_model, run.pop("trace"), folder)
                    runs.append(run)
                print(f"  {window}: {len(requests)} requests in {runs[-1]['seconds']} s", file=sys.stderr)
    report = {"command": " ".join(["bench/long_run.py", *(argv if argv is not None else sys.argv[1:])]),
              "rounds": args.rounds, "gpu_note": note, "runs": runs, "breakdown": args.breakdown,
              "twins": twin_runs(runs)}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(markdown(report) if args.markdown else json.dumps({**report, "runs": [
        {k: v for k, v in r.items() if k not in PER_REQUEST} for r in runs]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
