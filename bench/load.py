"""Many agents at once through the real proxy: does every row survive, and does every session stay its own?

Why: a proxy in front of every agent is shared by all of them. Under load it must journal every request and its
answer (rows lost: 0) and must never let one session's messages reach another's upstream request, journal or
answer (cross-session leaks: 0), while costing little latency over talking to the upstream directly.

How: a recording fake upstream (``bench/fake_upstream.py``'s helpers, its own process: answers every chat with a
tool call derived from the session's marker, streamed or not, and keeps every body it received) and the real
``ctxproxy serve`` (``bench/harness.py``'s ``proxy_process``, journal in a temporary data dir), both on 127.0.0.1.
``--sessions`` agent runs start at once, each ``--rounds`` rounds: a task, then per round the answer's tool call
and a tool result of varying size, so the history grows. Every message a session adds carries its marker
(``⟦s0042⟧``). Half are named (``X-Session-Id``), half found by fingerprint; a third stream; one in 25 is
incognito. Each round is also sent directly to the fake, alternately before and after the proxied request, so
each pair meets the same load: added latency = proxied - direct, per pair. Bounded: ``--deadline`` seconds for
the whole run (sessions stop between rounds after it), ``--timeout`` per request.

Checked afterwards, through the proxy's own ``/ctx`` API and the fake's record:

- rows lost: requests sent (not incognito) that have no request row, or whose row has no response row;
- journal mismatches: a request row whose stored messages differ from what its client sent, a client session
  spread over several journal sessions, or a journal session that is not a client's (forks, incognito on disk);
- upstream mismatches: per session, the bodies the fake received through the proxy differ from what the client
  sent, in order (nothing here is big enough to be cut, so each is the client's own messages and tools);
- replay mismatches: per session, its last upstream request differs from the last one a fresh proxy sends when the
  session is replayed alone (its requests one by one, no other session in flight);
- cross-session leaks: an upstream body, a stored request or an answer carrying another session's marker.

Run: ``.venv/bin/python bench/load.py --sessions 250 --rounds 6 --markdown`` (exit 1 when a check fails)

Scale-out (issue #16): ``--store URL`` gives every proxy process that store (``CTXPROXY_STORE``; ``--postgres
auto`` starts a throwaway PostgreSQL server, ``bench/postgres.py``), and ``--replicas N`` starts N ``ctxproxy
serve`` processes on it. The driver itself alternates each session's requests round-robin over them (round n of
session i goes to replica (i + n) mod N) rather than through a balancer process: a balancer would add its own
hop and CPU on the two shared cores to the latency measured, and a global round-robin between concurrent sessions
need not alternate any one session's requests, while this way every session meets every replica. The checks read
the journal through the last replica, and the replay runs through one fresh process on SQLite.

``--think S`` pauses each agent S seconds between rounds on average (below saturation, the added latency is the
proxy's own); ``--waves N`` runs N sets of new sessions one after the other through the same proxy, its memory
read after each (does it level off?).

One file of about 550 lines, over the 400 of STYLE §9 on purpose: the fake (``--serve-fake``), the agents, the
checks and the report belong to this one measurement, and ``tests/test_load.py`` runs the same checks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import uvicorn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import fake_upstream as fast  # noqa: E402
import harness  # noqa: E402
import latency  # noqa: E402
import postgres as pg  # noqa: E402

CHAT = "/v1/chat/completions"
DIRECT = "/direct"
"""Direct requests reach the fake under this prefix, so it files them apart from what the proxy forwarded."""
REPLAY = "/replay"
"""The fresh proxy that replays each session alone reaches the fake under this prefix."""
RECEIVED = "/_load/received"
MARKER = re.compile(r"⟦(s\d{4})⟧")
Client = aiohttp.ClientSession
SYSTEM = "You are a careful coding agent. Use the tools; keep answers short."
TOOLS = [{"type": "function", "function": {"name": name, "description": what, "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}
    for name, what in (("bash", "Run a shell command."), ("read_file", "Read a file."))]


# --- the recording fake upstream (its own process: --serve-fake) --------------------------------------------------
class RecordingUpstream:
    """``fake_upstream.app``'s speed with an agent's answer: a tool call naming the session's marker and round."""

    def __init__(self) -> None:
        self.received: list[dict[str, str]] = []

    async def __call__(self, scope: fast.Scope, receive: fast.Receive, send: fast.Send) -> None:
        if scope["type"] == "lifespan":
            await fast.lifespan(receive, send)
            return
        body = await fast.read_body(receive)
        path = scope["path"]
        if path == RECEIVED:
            await fast.send_bytes(send, 200, json.dumps(self.received).encode())
        elif path.endswith("/chat/completions"):
            via = next((p[1:] for p in (DIRECT, REPLAY) if path.startswith(p)), "proxy")
            self.received.append({"via": via, "body": body.decode()})
            request = json.loads(body)
            call = answer_call(request["messages"])
            if request.get("stream"):
                await send_sse(send, call)
            else:
                await fast.send_bytes(send, 200, completion(call))
        else:
            await fast.send_bytes(send, 200, fast.MODELS)


def answer_call(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The tool call the fake answers: named by the first user message's marker and the round (results so far)."""
    first = next((m for m in messages if m.get("role") == "user"), {})
    found = MARKER.search(str(first.get("content")))
    marker = found.group(1) if found else "none"
    n = sum(m.get("role") == "tool" for m in messages)
    return {"id": f"call_{marker}_{n}", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"cmd": f"cat f{n}.txt  # ⟦{marker}⟧"},
                                                                      ensure_ascii=False)}}


def completion(call: dict[str, Any]) -> bytes:
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return json.dumps(fast._BASE | {"object": "chat.completion", "usage": fast._USAGE, "choices": [
        {"index": 0, "message": message, "finish_reason": "tool_calls"}]}).encode()


async def send_sse(send: fast.Send, call: dict[str, Any]) -> None:
    """The call as OpenAI streams it: id and name first, the arguments in two pieces, then the finish."""
    args = call["function"]["arguments"]
    head = {"index": 0, "id": call["id"], "type": "function", "function": {"name": "bash", "arguments": ""}}
    deltas = [{"role": "assistant", "content": None, "tool_calls": [head]},
              {"tool_calls": [{"index": 0, "function": {"arguments": args[:10]}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": args[10:]}}]}, {}]
    await send({"type": "http.response.start", "status": 200, "headers": fast._SSE_HEADERS})
    for i, delta in enumerate(deltas):
        chunk = fast._BASE | {"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "finish_reason": "tool_calls" if i == len(deltas) - 1 else None}]}
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def serve_fake(port: int) -> None:
    uvicorn.run(RecordingUpstream(), host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                access_log=False, log_level="warning", server_header=False, date_header=False)


@contextmanager
def fake_process(tmp: Path) -> Iterator[tuple[str, int]]:
    """The recording fake in its own process; (base URL without /v1, PID); stopped by PID after."""
    port = latency.free_port()
    proc = latency._spawn([sys.executable, __file__, "--serve-fake", str(port)], tmp / "fake.log", os.environ.copy())
    try:
        latency._wait_ready(proc, f"http://127.0.0.1:{port}/v1/models", tmp / "fake.log")
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        latency._stop(proc)


# --- the agents ---------------------------------------------------------------------------------------------------
@dataclass
class Session:
    """One agent run: how it talks to the proxy, what it sent (per round) and what it saw."""

    index: int
    named: bool
    stream: bool
    incognito: bool
    sent: list[list[dict[str, Any]]] = field(default_factory=list)
    resolved: list[str] = field(default_factory=list)
    """The X-Ctx-Session the proxy answered each round with."""
    errors: list[str] = field(default_factory=list)
    answer_leaks: int = 0

    @property
    def marker(self) -> str:
        return f"s{self.index:04d}"

    @property
    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", "authorization": f"Bearer sk-load-{self.index}"}
        if self.named:
            headers["x-session-id"] = f"load-{self.marker}"
        if self.incognito:
            headers["x-ctx-incognito"] = "1"
        return headers


def sessions_for(count: int, start: int = 0) -> list[Session]:
    """Half named, half by fingerprint; every third streamed; one in 25 incognito."""
    return [Session(i, named=i % 2 == 0, stream=i % 3 == 1, incognito=i % 25 == 3) for i in range(start, start + count)]


def tool_result(session: Session, call: dict[str, Any], n: int) -> dict[str, Any]:
    """A result of 200 to ~3,000 characters, different per session and round; the marker first and last."""
    lines = [f"⟦{session.marker}⟧ $ cat f{n}.txt"]
    lines += [f"{session.marker}:{n}:{k} " + "lorem ipsum dolor " * (1 + (session.index * 7 + n * 13 + k) % 4)
              for k in range(3 + (session.index * 31 + n * 17) % 40)]
    return {"role": "tool", "tool_call_id": call["id"], "content": "\n".join([*lines, f"⟦{session.marker}⟧ exit 0"])}


@dataclass
class Load:
    """What the run measured, shared by all agents."""

    deadline: float
    think: float = 0.0
    """Seconds an agent pauses between rounds, on average (its model and its tools at work); 0: none."""
    sessions: int = 1
    pairs_ns: list[tuple[int, int]] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0
    stopped_early: int = 0
    done: bool = False
    peak_fds: int = 0
    peak_rss_mb: float = 0.0


async def run_session(session: Session, rounds: int, proxies: list[Client], direct: Client, load: Load) -> None:
    """One agent's rounds; round ``n`` goes to replica ``(index + n) % len(proxies)``: with two replicas every
    session alternates between them, as behind a balancer without session affinity."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {
        "role": "user", "content": f"⟦{session.marker}⟧ Task {session.index}: find why the tests of module "
                                   f"m{session.index} fail, fix it, and run them."}]
    await asyncio.sleep(load.think * session.index / load.sessions)  # paced runs start spread over one pause
    for n in range(rounds):
        if n:
            await asyncio.sleep(load.think * (0.5 + (session.index * 37 + n * 11) % 100 / 100))
        if time.monotonic() > load.deadline:
            load.stopped_early += 1
            return
        body = body_of(session, messages)
        session.sent.append(messages)  # never changed after: each round builds a new list
        try:
            call = await one_pair(session, body, proxies[(session.index + n) % len(proxies)], direct, load,
                                  direct_first=(session.index + n) % 2 == 0)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            session.errors.append(f"round {n}: {type(exc).__name__}: {exc}"[:300])
            return
        messages = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                    tool_result(session, call, n)]


def body_of(session: Session, messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": "fake-model", "messages": messages, "tools": TOOLS, "stream": session.stream},
                      separators=(",", ":"), ensure_ascii=False).encode()


async def replay(sessions: list[Session], proxy: str) -> None:
    """Each session alone, round after round, through a fresh proxy: what a single-session replay sends upstream."""
    async with client(proxy, 1, 60.0) as fresh:
        for session in sessions:
            for messages in session.sent:
                async with fresh.post(CHAT, data=body_of(session, messages), headers=session.headers) as answer:
                    await answer.read()


async def one_pair(session: Session, body: bytes, proxy: Client, direct: Client, load: Load,
                   direct_first: bool) -> dict[str, Any]:
    """The same request direct and through the proxy, back to back; the proxied answer's tool call."""
    d_ns = (await timed(direct, DIRECT + CHAT, body, session, None))[0] if direct_first else 0
    load.in_flight += 1
    load.peak_in_flight = max(load.peak_in_flight, load.in_flight)
    try:
        p_ns, call = await timed(proxy, CHAT, body, session, session.headers)
    finally:
        load.in_flight -= 1
    d_ns = d_ns or (await timed(direct, DIRECT + CHAT, body, session, None))[0]
    load.pairs_ns.append((d_ns, p_ns))
    if call["id"] != f"call_{session.marker}_{len(session.sent) - 1}" or set(MARKER.findall(json.dumps(
            call, ensure_ascii=False))) != {session.marker}:
        session.answer_leaks += 1
    return call


async def timed(client: Client, path: str, body: bytes, session: Session,
                headers: dict[str, str] | None) -> tuple[int, dict[str, Any]]:
    """Send, read the whole answer; (nanoseconds, the answer's tool call). Proxied: note the session it landed in
    (the proxy names it on errors too)."""
    start = time.perf_counter_ns()
    async with client.post(path, data=body, headers=headers or {"content-type": "application/json"}) as response:
        text = await response.text()
    elapsed = time.perf_counter_ns() - start
    if headers is not None and "x-ctx-session" in response.headers:
        session.resolved.append(response.headers["x-ctx-session"])
    if response.status != 200:
        raise ValueError(f"{path} answered {response.status}: {text[:200]}")
    return elapsed, (streamed_call(text) if session.stream else
                     json.loads(text)["choices"][0]["message"]["tool_calls"][0])


def streamed_call(text: str) -> dict[str, Any]:
    """The tool call a stream carried, put together from its deltas; the stream must end with [DONE]."""
    if not text.rstrip().endswith("data: [DONE]"):
        raise ValueError(f"the stream did not end with [DONE]: {text[-200:]!r}")
    call: dict[str, Any] = {"function": {"arguments": ""}}
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            for part in choice.get("delta", {}).get("tool_calls") or []:
                call |= {k: part[k] for k in ("id", "type") if k in part}
                call["function"]["name"] = part.get("function", {}).get("name") or call["function"].get("name")
                call["function"]["arguments"] += part.get("function", {}).get("arguments") or ""
    return call


async def drive(sessions: list[Session], rounds: int, proxies: list[str], direct: str, deadline: float,
                timeout: float, pids: list[int], think: float = 0.0) -> tuple[Load, float]:
    """All sessions at once, the proxies' memory and fds sampled meanwhile; (what was measured, seconds from the
    first request to the last answer)."""
    load = Load(time.monotonic() + deadline, think, len(sessions))
    async with contextlib.AsyncExitStack() as stack:
        p = [await stack.enter_async_context(client(proxy, len(sessions), timeout)) for proxy in proxies]
        d = await stack.enter_async_context(client(direct, len(sessions), timeout))
        started = time.perf_counter()

        async def agents() -> None:
            await asyncio.gather(*(run_session(s, rounds, p, d, load) for s in sessions))
            load.done = True

        await asyncio.gather(agents(), sample(pids, load))
        return load, time.perf_counter() - started


async def sample(pids: list[int], load: Load) -> None:
    """The proxies' open fds and resident memory (summed over replicas), every quarter second while the agents
    run."""
    while not load.done:
        now = procs_stats(pids)
        load.peak_fds = max(load.peak_fds, int(now["fds"]))
        load.peak_rss_mb = max(load.peak_rss_mb, now["rss_mb"])
        await asyncio.sleep(0.25)


def client(base: str, sessions: int, timeout: float) -> Client:
    """aiohttp, not httpx: the driver shares the machine's two cores with the proxy, and aiohttp's HTTP stack costs
    about a third of httpx's per request (proxy/upstream/transport.py); a connection per session."""
    return aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=sessions + 10),
                                 timeout=aiohttp.ClientTimeout(total=timeout))


# --- the checks ---------------------------------------------------------------------------------------------------
def markers_in(value: Any) -> set[str]:
    return set(MARKER.findall(json.dumps(value, ensure_ascii=False)))


def check_upstream(sessions: list[Session], received: list[dict[str, str]]) -> dict[str, int]:
    """Every body the proxy forwarded carries one session's markers, and per session they are its client's, in order."""
    by_marker: dict[str, list[list[dict[str, Any]]]] = defaultdict(list)
    leaks = 0
    for r in received:
        if r["via"] != "proxy":
            continue
        body = json.loads(r["body"])
        found = markers_in(body)
        leaks += len(found) != 1
        if len(found) == 1:
            by_marker[found.pop()].append(body["messages"])
    mismatched = sum(by_marker.get(s.marker, []) not in (s.sent, s.sent[:-1] if s.errors else s.sent)
                     for s in sessions)  # a request that failed may not have reached the upstream
    return {"upstream_leaks": leaks, "upstream_mismatches": mismatched,
            "upstream_requests": sum(r["via"] == "proxy" for r in received)}


def check_replay(sessions: list[Session], received: list[dict[str, str]]) -> int:
    """Sessions whose last upstream request under load differs from the last one of their replay alone."""
    last: dict[tuple[str, str], Any] = {}
    for r in received:
        if r["via"] != "direct":
            body = json.loads(r["body"])
            last[r["via"], next(iter(markers_in(body["messages"][:2])), "")] = body
    return sum(last.get(("proxy", s.marker)) != last.get(("replay", s.marker), "missing")
               for s in sessions if not s.errors)


def check_journal(base: str, sessions: list[Session], settle: float = 10.0) -> dict[str, Any]:
    """Rows and stored messages, read back through ``/ctx``. Streamed answers are journaled as their stream ends:
    rows still missing are looked for again until ``settle`` seconds have passed."""
    deadline = time.monotonic() + settle
    with httpx.Client(base_url=base, timeout=60) as client:
        while True:
            found = _journal_state(client, sessions)
            if found["rows_lost"] == 0 or time.monotonic() > deadline:
                return found
            time.sleep(0.2)


def _journal_state(client: httpx.Client, sessions: list[Session]) -> dict[str, Any]:
    listed = {row["id"] for row in client.get("/ctx/sessions").json()["sessions"]}
    lost = leaks = mismatched = split = 0
    expected: set[str] = set()
    for s in sessions:
        ids = set(s.resolved)
        split += len(ids) > 1
        if s.incognito:
            continue
        expected |= ids
        sent = s.sent[: len(s.resolved)]  # a request that got no answer at all may have no row
        rows = [r for i in ids if i in listed for r in _entries(client, i)]
        lost += max(0, len(sent) - len(rows)) + sum(r["outcome"] is None for r in rows)
        for row, messages in zip(rows, sent, strict=False):
            stored = client.get(f"/ctx/requests/{row['request_id']}").json()["messages"]
            mismatched += stored != messages
            leaks += markers_in(stored) != {s.marker}
    incognito = {i for s in sessions if s.incognito for i in s.resolved}
    return {"rows_lost": lost, "journal_leaks": leaks, "journal_mismatches": mismatched, "split_sessions": split,
            "extra_journal_sessions": len(listed - expected), "incognito_on_disk": len(listed & incognito)}


def _entries(client: httpx.Client, session_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = client.get(f"/ctx/sessions/{session_id}/journal", params={"limit": 1000}).json()[
        "entries"]
    return rows


# --- the run ------------------------------------------------------------------------------------------------------
def proc_stats(pid: int) -> dict[str, float]:
    """Resident memory now and at peak, open file descriptors, CPU seconds so far (user + system, all threads)."""
    ticks = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]
    return {"rss_mb": round(harness.rss_mb(pid, "VmRSS"), 1), "peak_rss_mb": round(harness.rss_mb(pid), 1),
            "fds": len(os.listdir(f"/proc/{pid}/fd")), "cpu_s": sum(map(int, ticks)) / os.sysconf("SC_CLK_TCK")}


def procs_stats(pids: list[int]) -> dict[str, float]:
    """``proc_stats`` summed over the replicas: what the proxy tier as a whole holds and spends."""
    each = [proc_stats(pid) for pid in pids]
    return {key: round(sum(s[key] for s in each), 2) for key in each[0]}


@contextmanager
def replicas(fake: str, tmp: Path, env: list[str], count: int) -> Iterator[list[tuple[str, int]]]:
    """``count`` ``ctxproxy serve`` processes, each with its own data dir, sharing whatever store ``env`` names;
    [(base URL, PID)]; all stopped by PID after."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(harness.proxy_process(fake, tmp, env)) for _ in range(count)]


def run(sessions: int, rounds: int, deadline: float = 600.0, timeout: float = 60.0,
        proxy_env: list[str] | None = None, think: float = 0.0, waves: int = 1, store: str | None = None,
        replica_count: int = 1) -> dict[str, Any]:
    """Start the fake and ``replica_count`` proxies (sharing ``store``: a PostgreSQL URL; None: each its own
    SQLite journal, so only one makes sense), drive the agents (``waves`` times ``sessions`` new ones, one wave
    after the other), check; every number of the report. The checks read the journal through the last replica,
    and the replay runs through one fresh proxy on a fresh SQLite journal: a session served by several replicas
    on PostgreSQL must send upstream what one process on the default store sends."""
    assert sessions * waves <= 10_000, "markers have four digits"
    env = [*(proxy_env or []), *([f"CTXPROXY_STORE={store}"] if store else [])]
    with tempfile.TemporaryDirectory(prefix="ctxproxy-load-") as tmp, fake_process(Path(tmp)) as (fake, fake_pid), \
            replicas(fake, Path(tmp), env, replica_count) as proxies:
        urls, pids = [url for url, _ in proxies], [pid for _, pid in proxies]
        before, fake_before, driver_cpu = procs_stats(pids), proc_stats(fake_pid), time.process_time()
        agents, load, seconds, rss = _waves(sessions, waves, rounds, urls, fake, deadline, timeout, pids, think)
        after = procs_stats(pids) | {"peak_fds": load.peak_fds, "sampled_peak_rss_mb": load.peak_rss_mb}
        cpu = {"proxy": after["cpu_s"] - before["cpu_s"], "fake": proc_stats(fake_pid)["cpu_s"] - fake_before["cpu_s"],
               "driver": time.process_time() - driver_cpu}
        journal = check_journal(urls[-1], agents)
        with harness.proxy_process(fake + REPLAY, Path(tmp), proxy_env or []) as (fresh, _):
            asyncio.run(replay(agents, fresh))
        received = httpx.get(fake + RECEIVED, timeout=60).json()
    checks = check_upstream(agents, received) | journal | {"cpu_s": {k: round(v, 1) for k, v in cpu.items()},
                                                          "replay_mismatches": check_replay(agents, received)}
    return summarize(agents, load, seconds, before, after, checks) | {
        "rounds": rounds, "think_s": think, "waves": waves, "rss_mb_after_each_wave": rss,
        "store": store_kind(store), "replicas": replica_count}


def store_kind(store: str | None) -> str:
    """What the report says of the store: its scheme only (a URL may carry a password)."""
    return store.partition(":")[0] if store else "sqlite"


def _waves(sessions: int, waves: int, rounds: int, proxies: list[str], fake: str, deadline: float, timeout: float,
           pids: list[int], think: float) -> tuple[list[Session], Load, float, list[float]]:
    """Every wave's agents, what was measured over all waves, their seconds, the proxy's RSS after each."""
    agents: list[Session] = []
    total, seconds, rss = Load(0.0), 0.0, []
    for wave in range(waves):
        agents += sessions_for(sessions, wave * sessions)
        load, took = asyncio.run(drive(agents[-sessions:], rounds, proxies, fake, deadline, timeout, pids, think))
        total.pairs_ns += load.pairs_ns
        total.stopped_early += load.stopped_early
        total.peak_in_flight = max(total.peak_in_flight, load.peak_in_flight)
        total.peak_fds, total.peak_rss_mb = max(total.peak_fds, load.peak_fds), max(total.peak_rss_mb, load.peak_rss_mb)
        seconds += took
        rss.append(procs_stats(pids)["rss_mb"])
    return agents, total, seconds, rss


def _ms(ns: float) -> float:
    return round(ns / 1e6, 2)


def _pct(values: list[int], p: int) -> float:
    return _ms(statistics.quantiles(values, n=100, method="inclusive")[p - 1]) if len(values) > 1 else _ms(
        values[0] if values else 0)


def summarize(agents: list[Session], load: Load, seconds: float, before: dict[str, float],
              after: dict[str, float], checks: dict[str, Any]) -> dict[str, Any]:
    direct, proxied = [d for d, _ in load.pairs_ns], [p for _, p in load.pairs_ns]
    added = [p - d for d, p in load.pairs_ns]
    errors = [f"{s.marker}: {e}" for s in agents for e in s.errors]
    report = {
        "sessions": len(agents), "named": sum(s.named for s in agents), "streamed": sum(s.stream for s in agents),
        "incognito": sum(s.incognito for s in agents), "requests": len(load.pairs_ns),
        "errors": len(errors), "error_detail": errors[:20], "stopped_by_deadline": load.stopped_early,
        "peak_in_flight": load.peak_in_flight, "seconds": round(seconds, 2),
        "throughput_rps": round(len(load.pairs_ns) / seconds, 1) if seconds else 0.0,
        "direct_p50_ms": _pct(direct, 50), "direct_p99_ms": _pct(direct, 99),
        "proxied_p50_ms": _pct(proxied, 50), "proxied_p99_ms": _pct(proxied, 99),
        "added_p50_ms": _pct(added, 50), "added_p99_ms": _pct(added, 99),
        "answer_leaks": sum(s.answer_leaks for s in agents),
        "proxy_before": before, "proxy_after": after, **checks,
    }
    report["proxy_cpu_ms_per_request"] = round(checks["cpu_s"]["proxy"] * 1000 / max(1, len(load.pairs_ns)), 2)
    report["cross_session_leaks"] = report["upstream_leaks"] + report["journal_leaks"] + report["answer_leaks"]
    report["ok"] = not any(report[k] for k in FAILURES)
    return report


FAILURES = ("errors", "rows_lost", "cross_session_leaks", "journal_mismatches", "upstream_mismatches",
            "replay_mismatches", "split_sessions", "extra_journal_sessions", "incognito_on_disk")


def markdown(r: dict[str, Any]) -> str:
    b, a = r["proxy_before"], r["proxy_after"]
    rows = [
        ("store × proxy processes", f"{r['store']} × {r['replicas']}" + (
            " (each session's requests alternate between them)" if r["replicas"] > 1 else "")),
        ("sessions (named / fingerprint / streamed / incognito)",
         f"{r['sessions']} ({r['named']} / {r['sessions'] - r['named']} / {r['streamed']} / {r['incognito']})"),
        ("requests through the proxy (+ as many direct)",
         f"{r['requests']} ({r['waves']} wave(s), {r['rounds']} rounds a session, {r['think_s']:g} s pause between "
         f"rounds; peak {r['peak_in_flight']} in flight)"),
        ("errors (non-200, broken streams)", r["errors"]),
        ("rows lost", f"**{r['rows_lost']}**"),
        ("cross-session leaks (upstream / journal / answers)",
         f"**{r['cross_session_leaks']}** ({r['upstream_leaks']} / {r['journal_leaks']} / {r['answer_leaks']})"),
        ("sessions whose upstream bodies ≠ what the client sent", r["upstream_mismatches"]),
        ("stored requests ≠ what the client sent", r["journal_mismatches"]),
        ("sessions whose last upstream request ≠ their replay's, alone in a fresh proxy", r["replay_mismatches"]),
        ("split / extra journal sessions / incognito on disk",
         f"{r['split_sessions']} / {r['extra_journal_sessions']} / {r['incognito_on_disk']}"),
        ("throughput through the proxy", f"{r['throughput_rps']} req/s ({r['seconds']} s)"),
        ("direct p50 / p99", f"{r['direct_p50_ms']} / {r['direct_p99_ms']} ms"),
        ("proxied p50 / p99", f"{r['proxied_p50_ms']} / {r['proxied_p99_ms']} ms"),
        ("added (proxied − direct, per pair) p50 / p99", f"**{r['added_p50_ms']} / {r['added_p99_ms']} ms**"),
        ("proxy RSS before → after each wave (peak; all processes)",
         f"{b['rss_mb']} → {' → '.join(map(str, r['rss_mb_after_each_wave']))} MB ({a['peak_rss_mb']} MB)"),
        ("proxy open fds before → peak → after", f"{b['fds']} → {a['peak_fds']} → {a['fds']}"),
        ("CPU seconds: proxy / fake upstream / load driver", "{proxy} / {fake} / {driver}".format(**r["cpu_s"])),
        ("proxy CPU per request (all processes)", f"{r['proxy_cpu_ms_per_request']} ms"),
    ]
    return "\n".join(["| measure | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in rows)])


@contextmanager
def store_for(url: str | None, postgres: str | None) -> Iterator[str | None]:
    """The store URL to give every proxy: the one given, a throwaway PostgreSQL server's, or None (SQLite)."""
    if url == "auto" or postgres == "auto":
        with pg.throwaway_postgres() as started:
            yield started
    else:
        yield url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sessions", type=int, default=250, help="concurrent agent runs (250)")
    parser.add_argument("--rounds", type=int, default=6, help="requests per agent run (6)")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds; no new round starts after (600)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request (60)")
    parser.add_argument("--waves", type=int, default=1,
                        help="run the sessions this many times, new ones each time, through the same proxy (1)")
    parser.add_argument("--think", type=float, default=0.0,
                        help="seconds an agent pauses between rounds, on average (0: as fast as answered)")
    parser.add_argument("--markdown", action="store_true", help="print the report as a Markdown table")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--proxy-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--store", metavar="URL",
                        help="the store every proxy process uses (CTXPROXY_STORE), e.g. postgresql://…; "
                             "'auto' (= --postgres auto): a throwaway PostgreSQL server (default: SQLite)")
    parser.add_argument("--postgres", choices=["auto"], help="start a throwaway PostgreSQL server for the run")
    parser.add_argument("--replicas", type=int, default=1,
                        help="proxy processes sharing the store; each session's requests alternate between them (1)")
    parser.add_argument("--serve-fake", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replicas > 1 and not (args.store or args.postgres):
        parser.error("--replicas above 1 needs a shared store (--store URL or --postgres auto): on SQLite each "
                     "process keeps its own journal in its own data dir")
    if args.serve_fake:
        serve_fake(args.serve_fake)
        return 0
    with store_for(args.store, args.postgres) as store:
        report = run(args.sessions, args.rounds, args.deadline, args.timeout, args.proxy_env, args.think, args.waves,
                     store, args.replicas)
    report["command"] = shlex.join(["python", "bench/load.py", *(sys.argv[1:] if argv is None else argv)])
    report["load_average"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report) if args.markdown else json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
