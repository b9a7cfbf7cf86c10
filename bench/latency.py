"""How much latency ctxproxy adds over talking to the upstream directly.

Why: a proxy on every agent request must cost next to nothing; the goal is ≤ 1 ms added for a small request and
≤ 4 ms for a 630 KB history (the 60-round workload of ``tests/workloads.py``), on a 2-core machine. The peers
(``shared/bench/README.md`` beside the repository) were measured the same way (median, added over direct, a fake
upstream on loopback) on their shared ``conversation-60.json``: ``--conversation`` takes that file, so these
numbers sit beside theirs.

How: ``bench/fake_upstream.py`` (pure ASGI, uvloop + httptools, fixed answer) runs as one process and the real
``ctxproxy serve`` (journal in a temporary data dir) as another, both on 127.0.0.1. One keep-alive
``httpx.Client`` per target POSTs ``/v1/chat/completions``; each iteration sends one direct and one proxied
request, alternating which goes first, so drifts of the machine hit both sides alike. Per workload: warm-up, then
``--requests`` timed pairs (``perf_counter_ns``, from send to the last body byte; for the streamed workload to
the first body byte). Reported: median and p90 of each side, added = median(proxied) - median(direct), and the
median of the per-pair differences. Nothing leaves 127.0.0.1; only the two processes started here are stopped.

``--proxy floor-raw|floor-httpx|floor-fastapi|floor-aiohttp|floor-own`` puts a bare hop (``bench/floor_proxy.py``)
in ctxproxy's place: what any Python proxy with that stack costs, to tell ctxproxy's own cost from the hop's.
``bench/profile_proxy.py`` shows where ctxproxy's time goes.

``--method peers`` (or ``both``) also measures the peers' way (``bench/latency_peers.py``): after the 60-request
replay, every request carries new text at its end, so no cache of whole requests answers it. ``--peers
PEERS/README.md`` prints the peers' figures, read from their README at run time, beside ours. ``--baseline SRC``
runs a second ctxproxy from another source tree (``git archive REV proxy store config | tar -x -C SRC``) in the
same run, each round through both, and reports each proxy's CPU time per request: on a busy machine the wall
times of two runs differ by more than a change is worth, the ratio of one run and the CPU time much less.
``--peer NAME=COMMAND`` (``bench/peer_proxies.py``) runs another proxy the same way, beside ctxproxy in each
round, so "ahead of every peer" is judged on this machine, not against figures from the peers' own.

Run: ``.venv/bin/python bench/latency.py --requests 200 --markdown`` (``--check``: exit 1 when a goal is missed;
``--conversation PEERS/conversation-60.json``: the peers' workload)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import latency_peers
from peer_proxies import free_port, parse_peer, peer_proxies, wait_answering

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.real.upstream import stop
from tests.workloads import conversation as generated

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DEFAULT_JSON = BENCH / "results" / "latency.json"
WARMUP = 10
CHAT_PATH = "/v1/chat/completions"
HEADERS = {"content-type": "application/json", "authorization": "Bearer sk-bench"}
PROXIES = ("ctxproxy", "floor-raw", "floor-httpx", "floor-fastapi", "floor-aiohttp", "floor-own")


@dataclass(frozen=True)
class Workload:
    name: str
    body: bytes
    stream: bool
    goal_ms: float | None
    what: str


@dataclass(frozen=True)
class Targets:
    direct: str
    proxied: str
    proxy_pid: int


Timer = Callable[[httpx.Client, str, bytes], int]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = _command_line(argv)
    chosen = workloads(args.no_stream or args.proxy != "ctxproxy", args.conversation)
    peers = latency_peers.peers_figures(args.peers) if args.peers else None
    with tempfile.TemporaryDirectory(prefix="ctxproxy-bench-") as tmp, \
            servers(Path(tmp), args.proxy_env, args.proxy) as targets, \
            baseline_proxy(Path(tmp), targets, args) as baseline, \
            peer_proxies(args.peer, targets.direct, Path(tmp), _stop) as beside:
        others = ({"baseline": baseline} if baseline else {}) | beside
        new_text, results, identical = _measure(targets, others, args, chosen)
    report = _report(command, args.proxy, args.requests, results) | {
        "new_text": new_text, "identical": identical, "baseline": args.baseline and str(args.baseline),
        "peers": peers, "peers_beside": {peer.name: peer.command for peer in args.peer}}
    out: Path = args.json or (DEFAULT_JSON if args.proxy == "ctxproxy" else DEFAULT_JSON.with_stem(
        f"latency-{args.proxy}"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"command: {command}")
    if new_text or identical:
        print(latency_peers.markdown([*new_text, *identical], results, peers))
    elif results:
        print(_markdown(report) if args.markdown else _summary(report))
    print(f"results: {_rel(out)}")
    return 1 if args.check and any(r["meets_goal"] is False for r in results) else 0


def _measure(targets: Targets, others: dict[str, tuple[str, int]], args: argparse.Namespace,
             chosen: list[Workload]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """New-text rows (peers' method), identical-body results (this script's method) and, beside a baseline
    proxy or peers (``others``: ``{name: (url, pid)}``), identical-body rows measured like the new-text ones (every
    target in each round)."""
    new_text = _run_peers_method(targets, args, others) if args.method != "identical" else []
    if args.method == "peers":
        return new_text, [], []
    if not others:
        return new_text, [_run_workload(targets, w, args.requests) for w in chosen], []
    identical = [row for w in chosen if not w.stream
                 for row in latency_peers.measure(targets.direct, _proxies(targets, others), f"identical {w.name}",
                                                  args.requests, 0, lambda i, b=w.body: b)]
    return new_text, [], identical


def _proxies(targets: Targets, others: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
    return {"ctxproxy": (targets.proxied, targets.proxy_pid), **others}


def _run_peers_method(targets: Targets, args: argparse.Namespace,
                      others: dict[str, tuple[str, int]]) -> list[dict[str, Any]]:
    """The peers' method: the 60-request replay, then new-text small and large requests (``latency_peers``)."""
    conversation = json.loads(args.conversation.read_text()) if args.conversation else generated(rounds=60)
    proxies = _proxies(targets, others)
    for url, _ in proxies.values():
        latency_peers.replay(url, conversation)
    return [row for kind in ("small", "large")
            for row in latency_peers.measure(targets.direct, proxies, kind, args.new_text_requests, 0,
                                             lambda i, k=kind: latency_peers.nonce_body(conversation, k, i))]


@contextlib.contextmanager
def baseline_proxy(tmp: Path, targets: Targets, args: argparse.Namespace) -> Iterator[tuple[str, int] | None]:
    """With ``--baseline SRC``: a second ctxproxy, the code under SRC first on its PYTHONPATH, in front of the
    same fake upstream (its own journal), to compare two versions in one run; stopped (by PID) on exit."""
    if args.baseline is None:
        yield None
        return
    port = free_port()
    src = args.baseline.absolute()
    env = _proxy_environ(args.proxy_env) | {"PYTHONPATH": str(src)}
    command = _proxy_command("ctxproxy", f"{targets.direct}/v1", port, tmp / "baseline")
    proc = _spawn([sys.executable, "-c", _cli_of(src), *command[1:]], tmp / "base.log", env)
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}/healthz", tmp / "base.log")
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        _stop(proc)


def _cli_of(src: Path) -> str:
    """The source tree's own command line: ``ctxproxy.proxy.commands.cli`` since the relayout of issue #12,
    ``proxy.cli`` before it (the console script would import the installed one, not SRC's)."""
    module = "ctxproxy.proxy.commands.cli" if (src / "ctxproxy").is_dir() else "proxy.cli"
    return (f"import sys; sys.path.insert(0, {str(src)!r}); sys.argv[0] = 'ctxproxy'; "  # before the cwd's tree
            f"from {module} import main; sys.exit(main())")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=200, help="timed requests per side and workload (200)")
    parser.add_argument("--json", type=Path, help=f"results file (default {_rel(DEFAULT_JSON)}; "
                        "latency-<proxy>.json beside it for a floor proxy)")
    parser.add_argument("--markdown", action="store_true", help="print the results as a Markdown table")
    parser.add_argument("--check", action="store_true", help="exit 1 when a workload misses its goal")
    parser.add_argument("--no-stream", action="store_true", help="skip the streamed time-to-first-byte workload")
    parser.add_argument("--proxy", choices=PROXIES, default="ctxproxy",
                        help="what sits in the middle: ctxproxy, or a bare hop of bench/floor_proxy.py to compare")
    parser.add_argument("--conversation", type=Path, help="the 630 KB request's history from this file, e.g. the "
                        "peers' PEERS/conversation-60.json (default: generated by tests/workloads.py)")
    parser.add_argument("--method", choices=("identical", "peers", "both"), default="identical",
                        help="identical: one body resent (default); peers: the peers' method, new text each request "
                        "after the 60-request replay (bench/latency_peers.py); both: peers', then identical")
    parser.add_argument("--new-text-requests", type=int, default=30,
                        help="timed new-text requests per side and size with --method peers|both (30, as the peers)")
    parser.add_argument("--peers", type=Path, metavar="README", help="the peers' README (e.g. PEERS/README.md): "
                        "their added-latency figures are printed beside ours")
    parser.add_argument("--baseline", type=Path, metavar="SRC", help="also measure a second ctxproxy running "
                        "the code under SRC (a checkout or `git archive` of proxy/ store/ config/), same run")
    parser.add_argument("--peer", action="append", default=[], type=parse_peer, metavar="NAME=COMMAND",
                        help="also measure another proxy, same run (bench/peer_proxies.py: {port}, {upstream}, "
                        "{upstream_root}, {data} filled in; repeatable)")
    parser.add_argument("--proxy-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the proxy, e.g. CTXPROXY_LOG_LEVEL=warning (repeatable)")
    return parser


def _command_line(argv: list[str] | None) -> str:
    script = _rel(Path(sys.argv[0]).absolute()) if argv is None else _rel(Path(__file__))
    return shlex.join([_rel(Path(sys.executable)), script, *(sys.argv[1:] if argv is None else argv)])


def _rel(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it (symlinks kept), else absolute."""
    path = path.absolute()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


# --- workloads ----------------------------------------------------------------------------------------------------
def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def workloads(no_stream: bool, conversation_file: Path | None = None) -> list[Workload]:
    small = {"model": "fake-model", "messages": [
        {"role": "system", "content": "You are a careful coding agent. Answer briefly."},
        {"role": "user", "content": "List the files under src/ and tell me which one defines the HTTP routes."}]}
    if conversation_file is not None and not conversation_file.is_file():
        sys.exit(f"{conversation_file} not found: --conversation takes a chat body's JSON file")
    conversation = json.loads(conversation_file.read_text()) if conversation_file else generated(rounds=60)
    large = {"model": conversation["model"], "tools": conversation["tools"], "messages": conversation["messages"]}
    source = conversation_file.name if conversation_file else "tests/workloads.py, 60 rounds"
    out = [
        Workload("small", _dumps(small), False, 1.0, "system + user message, whole answer"),
        Workload("630 KB", _dumps(large), False, 4.0, f"{source}, {len(large['messages'])} messages"),
    ]
    if not no_stream:
        out.append(Workload("small, stream TTFB", _dumps(small | {"stream": True}), True, None,
                            "stream:true, time to the first body byte"))
    return out


# --- processes ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def servers(tmp: Path, proxy_env: list[str], proxy: str = "ctxproxy") -> Iterator[Targets]:
    """The fake upstream and the proxy in front of it, each its own process; both stopped (by PID) on exit."""
    fake_port, proxy_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_spawn([sys.executable, str(BENCH / "fake_upstream.py"), "--port", str(fake_port)],
                            tmp / "fake.log", os.environ.copy()))
        _wait_ready(procs[-1], f"http://127.0.0.1:{fake_port}/v1/models", tmp / "fake.log")
        procs.append(_spawn(_proxy_command(proxy, f"http://127.0.0.1:{fake_port}/v1", proxy_port, tmp),
                            tmp / "proxy.log", _proxy_environ(proxy_env)))
        _wait_ready(procs[-1], f"http://127.0.0.1:{proxy_port}/healthz", tmp / "proxy.log")
        yield Targets(f"http://127.0.0.1:{fake_port}", f"http://127.0.0.1:{proxy_port}", procs[-1].pid)
    finally:
        for proc in reversed(procs):
            _stop(proc)


def _proxy_command(proxy: str, upstream: str, port: int, tmp: Path) -> list[str]:
    if proxy != "ctxproxy":
        return [sys.executable, str(BENCH / "floor_proxy.py"), "--mode", proxy.removeprefix("floor-"),
                "--upstream", upstream, "--port", str(port)]
    beside = Path(sys.executable).parent / "ctxproxy"
    if not beside.exists():
        sys.exit("ctxproxy is not installed beside this Python: run `make .venv/bin/ctxproxy`, use .venv/bin/python")
    return [str(beside), "serve", "--upstream", upstream, "--host", "127.0.0.1", "--port", str(port),
            "--data-dir", str(tmp / "data")]


def _proxy_environ(extra: list[str]) -> dict[str, str]:
    """This environment without CTXPROXY_* (a developer's settings must not skew the numbers), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")}
    for item in extra:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def _spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 30.0) -> None:
    """Until ``url`` answers 200, or the process ends (``peer_proxies.wait_answering``)."""
    wait_answering(proc, url, log, timeout, ready=lambda status: status == 200)


_stop = stop  # the real-server tests' helper: terminate, then kill after 10 s


# --- measuring ----------------------------------------------------------------------------------------------------
def time_whole(client: httpx.Client, url: str, body: bytes) -> int:
    start = time.perf_counter_ns()
    response = client.post(url, content=body, headers=HEADERS)
    elapsed = time.perf_counter_ns() - start
    _check(response, url)
    return elapsed


def time_first_byte(client: httpx.Client, url: str, body: bytes) -> int:
    start = time.perf_counter_ns()
    with client.stream("POST", url, content=body, headers=HEADERS) as response:
        chunks = response.iter_raw()
        first = next(chunks, b"")
        elapsed = time.perf_counter_ns() - start
        rest = first + b"".join(chunks)
    _check(response, url)
    if not first or not rest.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"{url}: the stream did not end with [DONE]: {rest[-200:]!r}")
    return elapsed


def _check(response: httpx.Response, url: str) -> None:
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:500]}")


def _run_workload(targets: Targets, workload: Workload, requests: int) -> dict[str, Any]:
    timer: Timer = time_first_byte if workload.stream else time_whole
    direct: list[int] = []
    proxied: list[int] = []
    with httpx.Client(base_url=targets.direct, timeout=30.0) as d, \
            httpx.Client(base_url=targets.proxied, timeout=30.0) as p:
        for i in range(WARMUP + requests):
            pair = _one_pair(timer, d, p, workload.body, proxied_first=i % 2 == 1)
            if i >= WARMUP:
                direct.append(pair[0])
                proxied.append(pair[1])
    return _summarize(workload, direct, proxied)


def _one_pair(timer: Timer, direct: httpx.Client, proxied: httpx.Client, body: bytes,
              proxied_first: bool) -> tuple[int, int]:
    if proxied_first:
        p = timer(proxied, CHAT_PATH, body)
        return timer(direct, CHAT_PATH, body), p
    d = timer(direct, CHAT_PATH, body)
    return d, timer(proxied, CHAT_PATH, body)


# --- reporting ----------------------------------------------------------------------------------------------------
def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)


def _stats(samples: list[int]) -> dict[str, float]:
    p90 = statistics.quantiles(samples, n=10, method="inclusive")[8] if len(samples) > 1 else samples[0]
    return {"median_ms": _ms(statistics.median(samples)), "p90_ms": _ms(p90),
            "min_ms": _ms(min(samples)), "mean_ms": _ms(statistics.fmean(samples))}


def _summarize(workload: Workload, direct: list[int], proxied: list[int]) -> dict[str, Any]:
    d, p = _stats(direct), _stats(proxied)
    added = round(p["median_ms"] - d["median_ms"], 3)
    pairs = [b - a for a, b in zip(direct, proxied, strict=True)]
    return {
        "workload": workload.name, "what": workload.what, "body_bytes": len(workload.body),
        "stream": workload.stream, "direct": d, "proxied": p, "added_ms": added,
        "pair_diff_median_ms": _ms(statistics.median(pairs)),
        "pair_diff_p90_ms": _ms(statistics.quantiles(pairs, n=10, method="inclusive")[8]),
        "goal_ms": workload.goal_ms,
        "meets_goal": None if workload.goal_ms is None else added <= workload.goal_ms,
        "samples_ms": {"direct": [_ms(x) for x in direct], "proxied": [_ms(x) for x in proxied]},
    }


def _report(command: str, proxy: str, requests: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "benchmark": "latency added by a proxy over a direct request (fake upstream on loopback)",
        "proxy": proxy,
        "command": command,
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "processor": _cpu_model()},
        "requests_per_side": requests, "warmup_per_side": WARMUP,
        "results": results,
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['proxy']}: {report['requests_per_side']} timed requests per side after "
        f"{report['warmup_per_side']} warm-up, "
        f"{report['machine']['cpus']} CPUs, Python {report['machine']['python']}; ms.",
        "",
        "| workload | body | direct median / p90 | proxied median / p90 | added (median) | median pair diff | goal |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        d, p = r["direct"], r["proxied"]
        goal = "-" if r["goal_ms"] is None else f"≤ {r['goal_ms']:g} {'✅' if r['meets_goal'] else '❌'}"
        lines.append(f"| {r['workload']} | {_size(r['body_bytes'])} | {d['median_ms']:.3f} / {d['p90_ms']:.3f} | "
                     f"{p['median_ms']:.3f} / {p['p90_ms']:.3f} | **{r['added_ms']:.3f}** | "
                     f"{r['pair_diff_median_ms']:.3f} | {goal} |")
    return "\n".join(lines)


def _summary(report: dict[str, Any]) -> str:
    return "\n".join(
        f"{r['workload']:>20}: direct {r['direct']['median_ms']:.3f} ms, proxied {r['proxied']['median_ms']:.3f} ms,"
        f" added {r['added_ms']:.3f} ms (pairs {r['pair_diff_median_ms']:.3f})"
        + ("" if r["goal_ms"] is None else f", goal ≤ {r['goal_ms']:g}: {'met' if r['meets_goal'] else 'MISSED'}")
        for r in report["results"])


def _size(n: int) -> str:
    return f"{n} B" if n < 10_000 else f"{n / 1000:.0f} KB"


if __name__ == "__main__":
    sys.exit(main())
