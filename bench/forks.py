"""What a request that does not extend its session costs after a long one: a new run, a fork, the next request.

Why: placing a request that continues no session (a new run with the same opening, an edited earlier message)
used to walk the delta chains of up to eight sessions and reload every decision they inherited: 56 ms added at
32k and 71 ms at 128k after a 600-round session (issue 13). The goal is ≤ 5 ms added for both, at both windows.

How: ``bench/fake_upstream.py`` (fixed answer) runs as one process and the real ``ctxproxy serve`` (journal in a
temporary data dir, ``CTXPROXY_CTX_WINDOW`` 32768 or 131072) as another per window and per source tree
(``--tree``: ``before=DIR`` runs the proxy from another checkout, e.g. ``git archive main``, beside this one, so
both are measured in one run on the same machine state). Each proxy is first fed the 600-round run of
``tests/workloads.py`` (one request per tool result, as ``bench/harness.py`` replays it). Then, per trial, each
of three requests is sent once directly and once through the proxy (the order alternating), the trials of all
proxies interleaved:

- ``new run``: the same system prompt and task, then a first round of its own (new text each trial);
- ``fork``: the whole long history with one earlier result edited (new text each trial): a fork of the session;
- ``next``: the long session's next round (the run goes on, one round further each trial).

``--journal`` also times, per tree, the journal's own part of each kind in a fresh process (``record_request``: the
session's placement and the list's journaling) on a copy of that proxy's journal, which a loaded machine blurs less.

Reported: median added latency (median proxied − median direct) per request kind, window and tree; the fake's
answer has ``usage.prompt_tokens`` 42, which the proxy's calibration clamps to k = 0.5 (the budget doubles: the
long run is still cut at both windows); and the median CPU the proxy process spent per request, all threads, from
its start to the next request the proxy got (``/proc/PID/task/*/schedstat``): a busy machine adds waiting to the
latency, not CPU. Nothing leaves 127.0.0.1; only the processes started here are stopped.

Run: ``.venv/bin/python bench/forks.py --trials 15 --tree before=/tmp/ctxproxy-main --tree after=. --journal``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import latency  # noqa: E402
from long_run import cpu_ns  # noqa: E402

from tests.workloads import conversation  # noqa: E402

WINDOWS = (32768, 131072)
KINDS = ("new run", "fork", "next")
AS_INSTALLED = ("import sys; sys.modules.update(dict.fromkeys(('pandas', 'numpy'), None)); "
                "from {cli} import main; sys.exit(main())")
"""``ctxproxy`` as a user's install runs it (``bench/harness.py``): sqlite-utils would import pandas if present.
``{cli}``: the tree's command line, ``ctxproxy.proxy.commands.cli`` (``proxy.cli`` before the relayout)."""


def _cli_of(tree: str) -> str:
    return "ctxproxy.proxy.commands.cli" if (Path(tree) / "ctxproxy").is_dir() else "proxy.cli"


@dataclass
class Proxy:
    tree: str
    window: int
    url: str
    history: list[dict[str, Any]]
    """The long session's messages so far (grows by a round with each ``next`` trial)."""
    samples: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: {k: [] for k in KINDS})
    """Per kind: (direct ns, proxied ns) of each trial."""
    pid: int = 0
    cpu: dict[str, list[int]] = field(default_factory=lambda: {k: [] for k in KINDS})
    """Per kind: the proxy's CPU ns from each timed request's start to the next request it got (all its threads:
    what it did after answering included), which a busy machine blurs less than the latency."""
    open: tuple[str, int] | None = None
    """The kind and the CPU at the start of the request being measured, if any."""

    def mark(self, kind: str | None) -> None:
        """A request of ``kind`` (None: nothing, the end) is about to reach this proxy: the last one's CPU ends."""
        now = cpu_ns(self.pid) if self.pid else 0
        if self.open is not None:
            self.cpu[self.open[0]].append(now - self.open[1])
        self.open = None if kind is None else (kind, now)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.journal_of:
        print(json.dumps(_time_journal(args.journal_of, args.trials)))
        return 0
    trees = [_tree(t) for t in args.tree] or [("this", str(ROOT))]
    run = conversation(rounds=args.rounds)
    base = {"model": "bench", "tools": run["tools"]}
    with tempfile.TemporaryDirectory(prefix="ctxproxy-forks-") as tmp, \
            _servers(Path(tmp), trees, args.windows) as (direct, proxies):
        for proxy in proxies:
            started = time.monotonic()
            _feed(proxy, run["messages"], base)
            print(f"{proxy.tree} {proxy.window}: {args.rounds} rounds fed in {time.monotonic() - started:.0f} s",
                  file=sys.stderr)
        _trials(direct, proxies, base, args.trials)
        steps = {f"{p.tree} {p.window // 1024}k": _journal_steps(Path(tmp), p, trees, args.trials)
                 for p in proxies} if args.journal else {}
    report = _report(proxies, args, base) | {"journal_ms": steps}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"command: {report['command']}")
    print(_markdown(report))
    for name, medians in steps.items():
        print(f"journal, {name}: " + ", ".join(f"{kind} {ms:.3f} ms" for kind, ms in medians.items()))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=15, help="timed trials per request kind (15)")
    parser.add_argument("--rounds", type=int, default=600, help="rounds of the long session (600)")
    parser.add_argument("--windows", type=int, nargs="+", default=list(WINDOWS), help="ctx_window values")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="run a proxy from this source tree (repeatable; default: this checkout)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--journal", action="store_true", help="also time record_request in process, per tree")
    parser.add_argument("--journal-of", type=Path, help=argparse.SUPPRESS)  # the child process of --journal
    return parser


def _tree(spec: str) -> tuple[str, str]:
    name, _, path = spec.partition("=")
    if not path or not any((Path(path) / "proxy" / cli).is_file() for cli in ("cli.py", "commands/cli.py")):
        sys.exit(f"--tree {spec}: expected NAME=DIR, DIR a ctxproxy source tree")
    return name, str(Path(path).resolve())


@contextlib.contextmanager
def _servers(tmp: Path, trees: list[tuple[str, str]], windows: list[int]) -> Iterator[tuple[str, list[Proxy]]]:
    """The fake upstream and one proxy per (tree, window), each its own process; all stopped by PID on exit."""
    procs: list[Any] = []
    try:
        port = latency.free_port()
        procs.append(latency._spawn([sys.executable, str(BENCH / "fake_upstream.py"), "--port", str(port)],
                                    tmp / "fake.log", os.environ.copy()))
        latency._wait_ready(procs[-1], f"http://127.0.0.1:{port}/v1/models", tmp / "fake.log")
        proxies = []
        for name, tree in trees:
            for window in windows:
                proxies.append(_proxy(procs, tmp, f"http://127.0.0.1:{port}/v1", name, tree, window))
        yield f"http://127.0.0.1:{port}", proxies
    finally:
        for proc in reversed(procs):
            latency._stop(proc)


def _proxy(procs: list[Any], tmp: Path, upstream: str, name: str, tree: str, window: int) -> Proxy:
    port, log = latency.free_port(), tmp / f"proxy-{name}-{window}.log"
    command = [sys.executable, "-c", AS_INSTALLED.format(cli=_cli_of(tree)), "serve", "--upstream", upstream,
               "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp / f"data-{name}-{window}")]
    env = latency._proxy_environ([f"CTXPROXY_CTX_WINDOW={window}", "CTXPROXY_LOG_LEVEL=warning",
                                  f"PYTHONPATH={tree}"])
    with log.open("wb") as out:  # run from the tree: ``python -c`` puts the working directory first on the path
        procs.append(subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      env=env, cwd=tree))
    latency._wait_ready(procs[-1], f"http://127.0.0.1:{port}/healthz", log)
    return Proxy(name, window, f"http://127.0.0.1:{port}", [], pid=procs[-1].pid)


def _post(client: httpx.Client, body: bytes) -> int:
    return latency.time_whole(client, latency.CHAT_PATH, body)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _feed(proxy: Proxy, messages: list[dict[str, Any]], base: dict[str, Any]) -> None:
    """The long run, one request per tool result, each answered by the fake."""
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "tool"]
    with httpx.Client(base_url=proxy.url, timeout=120.0) as client:
        for end in ends:
            _post(client, _dumps(base | {"messages": messages[:end]}))
    proxy.history = list(messages[:ends[-1]])


def _round(n: int, text: str) -> list[dict[str, Any]]:
    call = {"id": f"bench_{n}", "type": "function",
            "function": {"name": "run_shell", "arguments": json.dumps({"command": f"echo {text}"})}}
    return [{"role": "assistant", "content": f"Checking {text}.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"bench_{n}", "content": f"{text}\n" * 40}]


def _bodies(proxy: Proxy, base: dict[str, Any], trial: int) -> dict[str, bytes]:
    tag = f"{proxy.tree}-{proxy.window}-{trial}"
    history = proxy.history
    edited = list(history)
    at = max(i for i, m in enumerate(history) if m["role"] == "tool" and i < len(history) - 20)
    edited[at] = edited[at] | {"content": f"edited in trial {tag}\n" + str(edited[at]["content"])}
    proxy.history = history + _round(100_000 + trial, f"next {tag}")
    return {"new run": _dumps(base | {"messages": history[:2] + _round(trial, f"new run {tag}")}),
            "fork": _dumps(base | {"messages": edited}),
            "next": _dumps(base | {"messages": proxy.history})}


def _trials(direct: str, proxies: list[Proxy], base: dict[str, Any], trials: int) -> None:
    with httpx.Client(base_url=direct, timeout=120.0) as d:
        clients = {p.url: httpx.Client(base_url=p.url, timeout=120.0) for p in proxies}
        try:
            for trial in range(trials + 1):  # trial 0 warms every kind up, not counted
                for proxy in proxies:
                    for kind, body in _bodies(proxy, base, trial).items():
                        pair = _pair(d, clients[proxy.url], body, proxied_first=(trial + len(kind)) % 2 == 1,
                                     before_proxied=lambda p=proxy, k=kind if trial else None: p.mark(k))
                        if trial:
                            proxy.samples[kind].append(pair)
            time.sleep(0.2)  # what the last requests' answers left to do
            for proxy in proxies:
                proxy.mark(None)
        finally:
            for client in clients.values():
                client.close()


def _pair(direct: httpx.Client, proxied: httpx.Client, body: bytes, proxied_first: bool,
          before_proxied: Callable[[], None] = lambda: None) -> tuple[int, int]:
    if proxied_first:
        before_proxied()
        p = _post(proxied, body)
        return _post(direct, body), p
    d = _post(direct, body)
    before_proxied()
    return d, _post(proxied, body)


def _journal_steps(tmp: Path, proxy: Proxy, trees: list[tuple[str, str]], trials: int) -> dict[str, float]:
    """``_time_journal`` in a process of its own, the proxy's tree first on its path, on a copy of its journal."""
    copy = tmp / f"copy-{proxy.tree}-{proxy.window}.db"
    source = sqlite3.connect(tmp / f"data-{proxy.tree}-{proxy.window}" / "journal.db")
    with contextlib.closing(sqlite3.connect(copy)) as target:
        source.backup(target)
    source.close()
    env = latency._proxy_environ([f"PYTHONPATH={dict(trees)[proxy.tree]}"])
    out = subprocess.run([sys.executable, __file__, "--journal-of", str(copy), "--trials", str(trials)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return {k: float(v) for k, v in json.loads(out).items()}


def _time_journal(db: Path, trials: int) -> dict[str, float]:
    """Median ms of ``Journal.record_request`` for each kind, on the long session of the journal at ``db``."""
    sys.path.insert(0, os.environ["PYTHONPATH"])  # the tree under test, before this checkout
    from ctxproxy.proxy.core import canonical_json, content_hash, fingerprint
    from ctxproxy.store import IncomingRequest, Journal, ResponseRecord

    journal = Journal(db)
    long = journal.conn.execute("SELECT id FROM sessions ORDER BY requests DESC LIMIT 1").fetchone()[0]
    proxy = Proxy("journal", 0, "", journal.head_messages(long))
    params = canonical_json({"model": "bench"})
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for trial in range(trials):
        for kind, body in _bodies(proxy, {}, 1000 + trial).items():
            messages = json.loads(body)["messages"]
            bodies = [canonical_json(m) for m in messages]
            req = IncomingRequest(f"2030-01-01T00:{trial:02d}:00", latency.CHAT_PATH, "bench", False, None,
                                  fingerprint(messages), [content_hash(b) for b in bodies], bodies,
                                  content_hash(params), params, {}, len(body))
            start = time.perf_counter_ns()
            rec = journal.record_request(req)
            times[kind].append(time.perf_counter_ns() - start)
            journal.record_response(ResponseRecord(rec.request_id, 0, "ok", 200, "{}", None, 1.0, 1.0, "t"))
    return {k: _ms(statistics.median(v)) for k, v in times.items()}


def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def _report(proxies: list[Proxy], args: argparse.Namespace, base: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for p in proxies:
        for kind, pairs in p.samples.items():
            direct, proxied = [d for d, _ in pairs], [x for _, x in pairs]
            rows.append({"tree": p.tree, "window": p.window, "kind": kind,
                         "direct_ms": _ms(statistics.median(direct)), "proxied_ms": _ms(statistics.median(proxied)),
                         "added_ms": _ms(statistics.median(proxied) - statistics.median(direct)),
                         "pair_diff_ms": _ms(statistics.median(b - a for a, b in pairs)),
                         "proxy_cpu_ms": _ms(statistics.median(p.cpu[kind])) if p.cpu[kind] else None})
    command = shlex.join([latency._rel(Path(sys.executable)), latency._rel(Path(__file__)), *sys.argv[1:]])
    return {"command": command, "rounds": args.rounds, "trials": args.trials, "cpus": os.cpu_count(),
            "results": rows}


def _markdown(report: dict[str, Any]) -> str:
    lines = [f"{report['rounds']} rounds, {report['trials']} trials per kind, {report['cpus']} CPUs; ms, medians.",
             "", "| tree | window | request | direct | proxied | added | median pair diff | proxy CPU |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['tree']} | {r['window'] // 1024}k | {r['kind']} | {r['direct_ms']:.2f} | {r['proxied_ms']:.2f}"
              f" | **{r['added_ms']:.2f}** | {r['pair_diff_ms']:.2f} | {r['proxy_cpu_ms'] or 0:.2f} |"
              for r in report["results"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
