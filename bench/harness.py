"""Replay agent runs through the running proxy to a fake or a real model server; report what reached the upstream.

Why: the other scripts each measure one thing in one process. This one runs the product as users run it: the real
``ctxproxy serve`` (its own process, uvicorn on 127.0.0.1, journal in a temporary data dir) in front of either

- ``fake``: ``tests.fakes.CountingUpstream`` on real uvicorn in this process, a fast server that counts every
  prompt (cl100k plus the template's per-message cost) and refuses any over its window, as llama.cpp does; or
- ``llama``: a real llama.cpp server (SmolLM2-135M via llama-cpp-python, ``n_ctx`` 8192, built by
  ``scripts/real-model``), reached through a recording tap (``Tap``) so what the proxy sent can be read back.

Workloads (each a fresh proxy and session):

- ``fits``: 12 rounds of short results that fit llama's ``n_ctx`` raw: prompt-processing time with and without
  the proxy when nothing needs cutting;
- ``conversation-60``: the 60-round, 630 KB workload of ``tests/workloads.py`` (``--conversation FILE`` takes the
  peers' shared ``conversation-60.json`` instead); ``conversation-600``: the same generator, 600 rounds;
- ``trajectories``: every native recorded trajectory in the directory ``CTXPROXY_TRAJECTORIES`` names, each
  request its history so far (left out, and said so, when it is not set).

Raw (the agent alone): against the fake upstream, the requests whose own count exceeds the window; against
llama.cpp, every request is also sent directly to a fresh server (unless ``--no-raw``), so its refusals and its
prompt-processing time are the server's own.

Reported per workload: requests, refused through the proxy and raw, upstream requests over the window (the
upstream's own count), broken pairs (a tool call without its result or a result without its call in what was
sent), changed text (the invariants of ``proxy.core.violations``), tokens sent vs raw (cl100k), prefix reuse
(characters of leading messages and tools identical to the previous upstream request's, over all characters sent,
as in ``shared/bench/README.md``), time per request (for llama.cpp with ``max_tokens`` 1, its prompt processing)
and the proxy process's peak resident memory (VmHWM). ``--latency`` adds ``bench/latency.py``'s added-latency
table (median, p90; small, 630 KB, streamed time to first byte). ``--charts DIR`` draws per-request tokens raw vs
sent and per-request prefix reuse (needs the ``bench`` extra: matplotlib).

Run: ``.venv/bin/python bench/harness.py --upstream fake --latency --markdown --charts docs/img``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import latency  # noqa: E402
from rewrite import load_conversation  # noqa: E402

from ctxproxy.proxy.core import violations  # noqa: E402
from ctxproxy.proxy.core.invariants import broken_pairs as pairs_broken  # noqa: E402
from ctxproxy.proxy.core.tokens import MessageCounter  # noqa: E402
from tests.fakes import CountingUpstream, Reply, lifespan, receive_body, serve_in_thread  # noqa: E402
from tests.real.upstream import agent_history, llama_server  # noqa: E402
from tests.workloads import TRAJECTORIES_ENV, conversation, trajectories_dir  # noqa: E402

WINDOWS = {"fake": 32768, "llama": 8192}
"""The fake's window is the peers' (shared/bench/README.md). llama.cpp's is SmolLM2's trained context: the
workloads' system prompt, task and tool schemas alone take about 2,000 tokens, too many for a 2,048 window."""
WORKLOADS = ("fits", "conversation-60", "conversation-600", "trajectories")
COUNTER = MessageCounter()


@dataclass
class Sent:
    """One request the upstream received: its body and the status it answered."""

    body: dict[str, Any]
    status: int


@dataclass
class Run:
    """One workload through one path (proxy or raw): per client request, what came back and what went upstream."""

    statuses: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    last_sent: list[dict[str, Any] | None] = field(default_factory=list)
    """The last upstream body of each client request (after any retry), None when nothing went upstream."""
    last_index: list[int | None] = field(default_factory=list)
    """Where that body is among all the upstream requests (retries and probes included)."""


class Tap:
    """Between the proxy and a real server: records each chat body it forwards and the status it got back."""

    def __init__(self, target: str) -> None:
        self.target, self.sent = target, []
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send, on_shutdown=self.client.aclose)
            return
        body = await receive_body(receive)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")]
        request = self.client.build_request(scope["method"], self.target + scope["path"], content=body,
                                            headers=headers)
        answer = await self.client.send(request, stream=True)
        if scope["path"].endswith("/chat/completions"):
            self.sent.append(Sent(json.loads(body), answer.status_code))
        drop = (b"content-length", b"transfer-encoding", b"connection")
        try:
            await send({"type": "http.response.start", "status": answer.status_code,
                        "headers": [(k, v) for k, v in answer.headers.raw if k.lower() not in drop]})
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await answer.aclose()


# --- workloads ----------------------------------------------------------------------------------------------------
def requests_of(conversation: dict[str, Any]) -> list[dict[str, Any]]:
    """The agent's requests: the history through each tool result (or each non-assistant turn for fenced runs)."""
    messages, tools = conversation["messages"], conversation.get("tools")
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "tool" and
            (i + 1 == len(messages) or messages[i + 1]["role"] != "tool")]
    extra = {"tools": tools} if tools else {}
    return [{"model": "bench", "messages": messages[:end], **extra} for end in ends]


def workload(name: str, sixty: Path | None = None) -> list[list[dict[str, Any]]]:
    """The request sequences of a workload: one list per agent run. ``sixty``: conversation-60 from this file."""
    if name == "fits":  # short results: the whole run stays under llama's n_ctx raw, so nothing need be cut
        history = agent_history(12, lines=6)
        return [[{"model": "bench", "messages": history[: 2 + 2 * (i + 1)]} for i in range(12)]]
    if name == "conversation-60":
        return [requests_of(load_conversation(sixty))]
    if name == "conversation-600":
        return [requests_of(conversation(rounds=600))]
    corpus = trajectories_dir()
    paths = sorted(corpus.glob("*.native.json")) if corpus else []
    return [requests_of(json.loads(p.read_text())) for p in paths]


# --- servers ------------------------------------------------------------------------------------------------------
class ReportingUpstream(CountingUpstream):
    """The counting fake, reporting its window as vLLM does (``max_model_len``), so the proxy detects it."""

    def _echo(self, got: Any) -> Any:
        if got.path.endswith("/models"):
            return Reply(body={"object": "list", "data": [{"id": "bench", "object": "model",
                                                           "max_model_len": self.window}]})
        return super()._echo(got)


@contextlib.contextmanager
def upstream(kind: str, tmp: Path) -> Iterator[tuple[str, Any]]:
    """(base URL without /v1, the object recording what it received)."""
    if kind == "fake":
        fake = ReportingUpstream(window=WINDOWS["fake"])
        with serve_in_thread(fake) as base:
            yield base, fake
        return
    with llama_server(WINDOWS["llama"], tmp / "llama.log") as llama:
        tap = Tap(llama)
        with serve_in_thread(tap) as base:
            yield base, tap


AS_INSTALLED = ("import sys; sys.modules.update(dict.fromkeys(('pandas', 'numpy', 'rich', 'pygments'), None)); "
                "from ctxproxy.proxy.commands.cli import main; sys.exit(main())")
"""``ctxproxy`` as a user's install runs it. The test venv also holds pandas and numpy (mini-swe-agent needs them),
and sqlite-utils imports them when they are there, which would add about 120 MB to the memory measured; and rich
and pygments (the test tools'), which httpx imports for its command line when they are there (40 ms, 4 MB).
None of the four is in the closure of ctxproxy's own dependencies."""


@contextlib.contextmanager
def proxy_process(upstream_base: str, tmp: Path, env: list[str]) -> Iterator[tuple[str, int]]:
    """The real ``ctxproxy serve`` in its own process; (base URL, PID); stopped by PID after."""
    port, data = latency.free_port(), tmp / f"data-{time.monotonic_ns()}"
    command = [sys.executable, "-c", AS_INSTALLED, "serve", "--upstream", upstream_base + "/v1",
               "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data)]
    proc = latency._spawn(command, tmp / "proxy.log", latency._proxy_environ(env))
    try:
        latency._wait_ready(proc, f"http://127.0.0.1:{port}/healthz", tmp / "proxy.log")
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)  # the upstream's connection
        wait_warm(f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        latency._stop(proc)


def wait_warm(base: str) -> None:
    """Returns once the proxy at ``base`` has loaded what its first chat needs (``proxy.engine.state.Warmup``: the
    request engine, the tokenizer): an engine route waits for it, and ``count_tokens`` journals and forwards nothing.
    ``/v1/models`` (a passthrough) does not wait: ``bench/long_run.py``'s second proxy, started just before the run,
    answered its first chat 180-320 ms late, and its idle RSS was read before the tokenizer had loaded."""
    httpx.post(base + "/v1/messages/count_tokens", json={"model": "bench", "messages": [
        {"role": "user", "content": "warm"}]}, timeout=30).raise_for_status()


def rss_mb(pid: int, field: str = "VmHWM") -> float:
    """The process's peak (VmHWM) or current (VmRSS) resident memory."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":"))) / 1024


def sent_bodies(recorder: Any) -> list[Sent]:
    if isinstance(recorder, Tap):
        return recorder.sent
    return [Sent(r.json(), 200 if c <= recorder.window else 400) for r, c in zip(recorder.chats, recorder.counts,
                                                                                  strict=True)]


def _received(recorder: Any) -> int:
    return len(recorder.sent if isinstance(recorder, Tap) else recorder.chats)


def replay(base: str, runs: list[list[dict[str, Any]]], recorder: Any, extra: dict[str, Any]) -> Run:
    out = Run()
    with httpx.Client(base_url=base, timeout=600) as client:
        for bodies in runs:
            for body in bodies:
                before = _received(recorder)
                started = time.perf_counter()
                answer = client.post("/v1/chat/completions", json=body | extra)
                out.seconds.append(time.perf_counter() - started)
                out.statuses.append(answer.status_code)
                after = _received(recorder)
                last = after - 1 if after > before else None
                out.last_index.append(last)
                out.last_sent.append(None if last is None else (
                    recorder.sent[last].body if isinstance(recorder, Tap) else recorder.chats[last].json()))
    return out


# --- measures -----------------------------------------------------------------------------------------------------
def tokens(body: dict[str, Any], by_identity: dict[int, int] | None = None) -> int:
    """cl100k tokens of a request as the fake upstream counts them. ``by_identity`` caches per message object:
    the raw requests of one run share their message objects (request k+1 is request k plus two messages)."""
    if by_identity is None:
        return sum(COUNTER.count(m) for m in body["messages"]) + COUNTER.count_tools(body.get("tools"))
    total = COUNTER.count_tools(body.get("tools"))
    for m in body["messages"]:
        if id(m) not in by_identity:
            by_identity[id(m)] = COUNTER.count(m)
        total += by_identity[id(m)]
    return total


def broken_pairs(sent: list[dict[str, Any]], received: list[dict[str, Any]]) -> int:
    """Tool calls without their result plus results without their call (``proxy.core.invariants``' walk, which
    follows reused ids) in what was sent, beyond those already in the agent's own request."""
    return max(0, sum(pairs_broken(sent).values()) - sum(pairs_broken(received).values()))


def reuse_per_request(sent: list[Sent]) -> list[tuple[int, int]]:
    """(characters reusable from the previous answered upstream request's prefix, characters sent) per upstream
    request. The tool list counts as reused only when it is the previous one's (servers render it first), and a
    refused request leaves nothing cached."""
    rows: list[tuple[int, int]] = []
    previous: list[str] = []
    previous_tools: Any = None
    for s in sent:
        encoded = [json.dumps(m, ensure_ascii=False) for m in s.body["messages"]]
        tools = len(json.dumps(s.body.get("tools"), ensure_ascii=False)) if s.body.get("tools") else 0
        same_tools = bool(previous) and s.body.get("tools") == previous_tools
        same = next((i for i, (a, b) in enumerate(zip(previous, encoded, strict=False)) if a != b),
                    min(len(previous), len(encoded))) if same_tools else 0
        rows.append((sum(map(len, encoded[:same])) + (tools if same_tools else 0), sum(map(len, encoded)) + tools))
        if s.status == 200:
            previous, previous_tools = encoded, s.body.get("tools")
    return rows


def _own(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What was sent, without the proxy's own notices to the model (additions, not changes)."""
    return [m for m in messages if not str(m.get("content") or "").startswith("[ctxproxy]")]


def _spilled_paste(violation: str, received: list[dict[str, Any]]) -> bool:
    """A person's message of ``paste_chars`` (20,000) or more that changed: its paste went to overflow, a cut the
    proxy makes by design and restores on request, not changed text. The index is the agent's request's."""
    found = re.match(r"message (\d+) \(user\) changed", violation)
    return bool(found) and len(str(received[int(found.group(1))].get("content"))) >= 20_000


def summarize(name: str, runs: list[list[dict[str, Any]]], proxied: Run, sent: list[Sent], raw: Run | None,
              window: int, memory: tuple[float, float]) -> dict[str, Any]:
    requests = [b for bodies in runs for b in bodies]
    cache: dict[int, int] = {}
    raw_tokens = [tokens(b, cache) for b in requests]
    reuse = reuse_per_request(sent)
    answered = [s for s, st in zip(proxied.seconds, proxied.statuses, strict=True) if st == 200]
    changed = [f"request {n}: {v}" for n, (req, body) in enumerate(zip(requests, proxied.last_sent, strict=True))
               if body is not None for v in violations(req["messages"], _own(body["messages"]))
               if not _spilled_paste(v, req["messages"])]
    return {
        "workload": name, "requests": len(requests), "window": window,
        "refused_proxy": sum(s != 200 for s in proxied.statuses),
        "refused_raw": sum(s != 200 for s in raw.statuses) if raw else sum(t > window for t in raw_tokens),
        "upstream_requests": len(sent), "upstream_over_window": sum(s.status == 400 for s in sent),
        "broken_pairs": sum(broken_pairs(_own(body["messages"]), req["messages"])
                            for req, body in zip(requests, proxied.last_sent, strict=True) if body is not None),
        "changed_text": len(changed), "changed_detail": changed[:20],
        "tokens_raw": sum(raw_tokens),
        "tokens_sent": sum(tokens(b) for b in proxied.last_sent if b is not None),
        "reuse": round(sum(r for r, _ in reuse) / max(1, sum(t for _, t in reuse)), 4),
        "uncached_chars": sum(t - r for r, t in reuse),
        "seconds_total": round(sum(answered), 2),
        "seconds_raw_total": round(sum(s for s, st in zip(raw.seconds, raw.statuses, strict=True) if st == 200), 2)
        if raw else None,
        "median_ms": round(statistics.median(answered) * 1000, 1) if answered else None,
        "idle_rss_mb": round(memory[0], 1), "peak_rss_mb": round(memory[1], 1),
        "chars_sent": sum(t for _, t in reuse),
        "per_request": {"tokens_raw": raw_tokens,
                        "tokens_sent": [tokens(b) if b else 0 for b in proxied.last_sent],
                        "reuse": [round(reuse[i][0] / reuse[i][1], 4) if i is not None and reuse[i][1] else 0
                                  for i in proxied.last_index]},
    }


def run_workload(kind: str, name: str, tmp: Path, with_raw: bool, env: list[str],
                 sixty: Path | None = None) -> dict[str, Any]:
    runs, extra = workload(name, sixty), ({"max_tokens": 1, "temperature": 0} if kind == "llama" else {})
    with upstream(kind, tmp) as (base, recorder):
        with proxy_process(base, tmp, env) as (proxy, pid):
            idle = rss_mb(pid, "VmRSS")
            proxied = replay(proxy, runs, recorder, extra)
            peak = (idle, rss_mb(pid))
        sent = list(sent_bodies(recorder))
    raw = None
    if with_raw and kind == "llama":
        with upstream(kind, tmp) as (base, recorder):  # a fresh server: its prompt cache starts cold, as above
            raw = replay(base, runs, recorder, extra)
    print(f"  {kind} {name}: {len(proxied.statuses)} requests, {sum(proxied.seconds):.1f} s", file=sys.stderr)
    return summarize(name, runs, proxied, sent, raw, WINDOWS[kind], peak)


# --- output -------------------------------------------------------------------------------------------------------
def markdown(kind: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"| workload ({kind}, window {rows[0]['window']}) | requests | refused raw | refused via proxy "
             "| upstream over window | broken pairs | changed text | tokens raw | tokens sent | prefix reuse "
             "| chars sent | uncached chars | time via proxy (s) | time raw, answered (s) "
             "| proxy RSS idle → peak (MB) |",
             "|---|" + "---:|" * 14]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['requests']} | {_na(r['refused_raw'])} | {r['refused_proxy']} "
                     f"| {r['upstream_over_window']} | {r['broken_pairs']} | {r['changed_text']} "
                     f"| {r['tokens_raw']:,} | {r['tokens_sent']:,} | {r['reuse']:.1%} | {r['chars_sent']:,} "
                     f"| {r['uncached_chars']:,} | {r['seconds_total']} | {_na(r['seconds_raw_total'])} "
                     f"| {r['idle_rss_mb']} → {r['peak_rss_mb']} |")
    return "\n".join(lines)


def _na(value: Any) -> str:
    return "–" if value is None else str(value)


def charts(kind: str, rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for r in rows:
        if not r["workload"].startswith("conversation"):
            continue  # trajectories: many runs end to end; fits: nothing to cut
        per = r["per_request"]
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        x = range(1, len(per["tokens_raw"]) + 1)
        top.plot(x, per["tokens_raw"], label="raw history (what the agent sends)")
        top.plot(x, per["tokens_sent"], label="sent upstream by ctxproxy")
        top.axhline(r["window"], color="grey", linestyle="--", label=f"window ({r['window']:,})")
        top.set_ylabel("tokens (cl100k)")
        top.set_yscale("log")
        top.legend(fontsize=8)
        top.set_title(f"{r['workload']} through ctxproxy ({kind} upstream)")
        bottom.plot(range(1, len(per["reuse"]) + 1), [v * 100 for v in per["reuse"]], color="tab:green")
        bottom.set_ylabel("prefix reused from previous request (%)")
        bottom.set_xlabel("request")
        bottom.set_ylim(0, 105)
        fig.tight_layout()
        path = out / f"{kind}-{r['workload']}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", choices=("fake", "llama"), default="fake")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {WORKLOADS}")
    parser.add_argument("--no-raw", action="store_true", help="skip sending each request directly too")
    parser.add_argument("--latency", action="store_true", help="add bench/latency.py's table (fake upstream)")
    parser.add_argument("--requests", type=int, default=100, help="timed pairs per latency workload (100)")
    parser.add_argument("--charts", type=Path, help="write PNG charts into this directory")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--proxy-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--conversation", type=Path, help="conversation-60 (and the latency table's 630 KB request) "
                        "from this file, e.g. the peers' PEERS/conversation-60.json (default: generated)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: still stop the servers it started
    env = args.proxy_env + (["CTXPROXY_NULL_CONTENT=empty"] if args.upstream == "llama" else [])
    print("command:", shlex.join(["python", *sys.argv]))
    report: dict[str, Any] = {"upstream": args.upstream, "workloads": []}
    rows = report["workloads"]
    with tempfile.TemporaryDirectory(prefix="ctxproxy-harness-") as tmp:
        for name in args.workloads.split(","):
            if name == "trajectories" and trajectories_dir() is None:
                print(f"  trajectories: left out, {TRAJECTORIES_ENV} is not set", file=sys.stderr)
                continue
            rows.append(run_workload(args.upstream, name, Path(tmp), not args.no_raw, env, args.conversation))
            _save(args.json, report)  # a long llama.cpp run keeps what it measured if stopped
    if args.latency:
        report["latency"] = latency_table(args.requests, args.conversation)
        _save(args.json, report)
    print(markdown(args.upstream, rows) if args.markdown else
          json.dumps([{k: v for k, v in r.items() if k != "per_request"} for r in rows], indent=1))
    if args.latency:
        print()
        print(latency._markdown(report["latency"]))
    for path in charts(args.upstream, rows, args.charts) if args.charts else []:
        print(f"chart: {path}")


def _save(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")


def latency_table(requests: int, conversation_file: Path | None = None) -> dict[str, Any]:
    """bench/latency.py's measurement (ctxproxy vs direct against its fast fake upstream), in this report."""
    with tempfile.TemporaryDirectory(prefix="ctxproxy-bench-") as tmp, latency.servers(Path(tmp), []) as targets:
        chosen = latency.workloads(False, conversation_file)
        results = [latency._run_workload(targets, w, requests) for w in chosen]
    return latency._report("bench/harness.py --latency", "ctxproxy", requests, results)


if __name__ == "__main__":
    main()
