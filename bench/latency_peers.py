"""The peers' latency method (``shared/bench/README.md``), reproduced, so ctxproxy's figures sit beside theirs.

Why a second method: ``bench/latency.py`` resends one identical body, which a proxy that remembers what it has
seen answers from its caches. The peers measured every request with new text at its end: after the 60-request
replay of the workload in the same proxy process, 30 small requests (system prompt and task, then a new user
message ``continue (nonce small-<i>)``) and 30 large ones (all 122 messages, then ``continue (nonce large-<i>)``),
each with the workload's tools and ``max_tokens`` 512, no session header, after 3 (small) or 2 (large) warm-up
requests; median time, minus the same requests sent directly to the fake upstream. One keep-alive client per
target; each pair sends the same body direct and proxied, alternating which goes first.

The peers' own figures are read at run time from their README (``--peers PATH``; the repository does not ship
them): the table's last column, ``added ms small / 630 KB``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

CHAT_PATH = "/v1/chat/completions"
HEADERS = {"content-type": "application/json", "authorization": "Bearer sk-bench"}
WARMUP = {"small": 3, "large": 2}


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def replay_bodies(conversation: dict[str, Any]) -> list[bytes]:
    """Request k carries the history through result k (system, task, then k rounds of call + result)."""
    messages = conversation["messages"]
    rounds = (len(messages) - 2) // 2
    return [_dumps({"model": conversation["model"], "tools": conversation["tools"], "max_tokens": 512,
                    "messages": messages[:2 + 2 * k]}) for k in range(1, rounds + 1)]


def nonce_body(conversation: dict[str, Any], kind: str, i: int) -> bytes:
    """The ``i``-th request of ``kind`` (small: system + task; large: everything), plus its new user message."""
    messages = conversation["messages"]
    head = messages[:2] if kind == "small" else messages
    return _dumps({"model": conversation["model"], "tools": conversation["tools"], "max_tokens": 512,
                   "messages": [*head, {"role": "user", "content": f"continue (nonce {kind}-{i})"}]})


def _post(client: httpx.Client, body: bytes) -> int:
    start = time.perf_counter_ns()
    response = client.post(CHAT_PATH, content=body, headers=HEADERS)
    elapsed = time.perf_counter_ns() - start
    if response.status_code != 200:
        raise RuntimeError(f"{client.base_url} answered {response.status_code}: {response.text[:500]}")
    return elapsed


def replay(proxied: str, conversation: dict[str, Any]) -> None:
    """The 60-request replay through the proxy, as the peers ran it before timing."""
    with httpx.Client(base_url=proxied, timeout=60.0) as client:
        for body in replay_bodies(conversation):
            _post(client, body)


def measure(direct: str, proxies: dict[str, tuple[str, int]], kind: str, requests: int, start: int,
            body_of: Callable[[int], bytes]) -> list[dict[str, Any]]:
    """``requests`` timed rounds (after the peers' warm-up) of new-text bodies ``body_of(start + i)``: each goes
    direct and through every proxy (``name: (url, pid)``), in an order that rotates with ``i``. One summary per
    proxy, with the CPU time its process spent per timed request (all threads): on a busy machine wall times
    swing by milliseconds, CPU time much less."""
    urls = [direct, *(url for url, _ in proxies.values())]
    times: list[list[int]] = [[] for _ in urls]
    clients = [httpx.Client(base_url=url, timeout=60.0) for url in urls]
    warmup = WARMUP.get(kind, 10)
    try:
        for i in range(warmup + requests):
            if i == warmup:
                cpu = {name: cpu_seconds(pid) for name, (_, pid) in proxies.items()}
            body = body_of(start + i)
            elapsed = {t: _post(clients[t], body) for t in [(i + j) % len(urls) for j in range(len(urls))]}
            for t, ns in elapsed.items():
                times[t] += [ns] if i >= warmup else []
        spent = {name: cpu_seconds(pid) - cpu[name] for name, (_, pid) in proxies.items()}
    finally:
        for client in clients:
            client.close()
    return [summary(kind, len(body_of(start)), times[0], t) | {
        "proxy": name, "cpu_ms_per_request": round(spent[name] * 1000 / requests, 3)}
        for name, t in zip(proxies, times[1:], strict=True)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(kind: str, size: int, direct: list[int], proxied: list[int]) -> dict[str, Any]:
    d, p = statistics.median(direct) / 1e6, statistics.median(proxied) / 1e6
    pairs = [(b - a) / 1e6 for a, b in zip(direct, proxied, strict=True)]
    return {"kind": kind, "body_bytes": size, "requests": len(direct), "direct_median_ms": round(d, 3),
            "proxied_median_ms": round(p, 3), "added_ms": round(p - d, 3),
            "pair_diff_median_ms": round(statistics.median(pairs), 3),
            "samples_ms": {"direct": [round(x / 1e6, 3) for x in direct],
                           "proxied": [round(x / 1e6, 3) for x in proxied]}}


# --- the peers' figures -------------------------------------------------------------------------------------------
_ADDED = re.compile(r"added ms small / 630 KB", re.IGNORECASE)


def peers_figures(readme: Path) -> dict[str, tuple[str, str]]:
    """``{proxy: (small, large)}`` from the README's table, as written there (``1.2``, ``23–47``)."""
    rows = readme.read_text().splitlines()
    header = next((i for i, line in enumerate(rows) if line.startswith("|") and _ADDED.search(line)), None)
    if header is None:
        raise ValueError(f"{readme}: no table with an `added ms small / 630 KB` column")
    out: dict[str, tuple[str, str]] = {}
    for line in rows[header + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        small, _, large = cells[-1].partition("/")
        if large:
            out[cells[0]] = (small.strip(), large.strip())
    return out


def markdown(rows: list[dict[str, Any]], identical: list[dict[str, Any]],
             peers: dict[str, tuple[str, str]] | None) -> str:
    """Our rows (``measure``'s, new text or identical) and ``bench/latency.py``'s identical-body results, then
    the peers' figures from their README."""
    lines = ["| method | proxy | request | body | direct median | proxied median | added (median) | median pair diff "
             "| proxy CPU / request |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        method = "identical body resent" if r["kind"].startswith("identical") else "new text each time (peers')"
        lines.append(f"| {method} | {r['proxy']} | {r['kind'].removeprefix('identical ')} | "
                     f"{r['body_bytes'] / 1000:.0f} KB | {r['direct_median_ms']:.3f} | {r['proxied_median_ms']:.3f} | "
                     f"**{r['added_ms']:.3f}** | {r['pair_diff_median_ms']:.3f} | {r['cpu_ms_per_request']:.2f} |")
    for r in identical:
        lines.append(f"| identical body resent | ctxproxy | {r['workload']} | {r['body_bytes'] / 1000:.0f} KB | "
                     f"{r['direct']['median_ms']:.3f} | {r['proxied']['median_ms']:.3f} | "
                     f"**{r['added_ms']:.3f}** | {r['pair_diff_median_ms']:.3f} | - |")
    if peers:
        lines += ["", "Peers (their README, same method; added ms):", "",
                  "| proxy | small | 630 KB |", "|---|---:|---:|"]
        lines += [f"| {name} | {small} | {large} |" for name, (small, large) in peers.items()]
    return "\n".join(lines)
