"""Does one large request stall everybody else? ``/healthz`` and a small chat, idle vs while a large one runs.

Why: the proxy serves every agent from one event loop. Work that scales with a request's size (parsing, hashing,
token counting, projecting) done on that loop freezes every other client for as long as it runs: a 50 MB user
message once held ``/healthz`` for 112 s and the process at 3.7 GB (issue #10). This bench shows the freeze, or
its absence, as a ratio measured in one run.

How: ``bench/fake_upstream.py`` and the real ``ctxproxy serve`` run as their own processes on 127.0.0.1
(``bench/latency.py``'s ``servers``). First, idle: ``--probes`` rounds of one ``GET /healthz`` and one small
non-streamed chat, each on its own keep-alive connection. Then, per case, the large request is sent on a third
connection while the same probes repeat, back to back, until it is answered. Reported per case: the large
request's status and time to answer; each probe's median / p90 / max idle and during, and the ratio of the
medians and of the maxima; the proxy's resident set before, its peak (``VmHWM``) and after.

Cases (``--cases``): ``x`` — one user message of ``--mb`` MB of ``x`` (too large for any window: the answer is a
400 ``context_length_exceeded``); ``eq`` — 8 MB of ``=``; ``tiny`` — 200 000 two-character messages (refused by
``max_messages`` unless ``--proxy-env CTXPROXY_MAX_MESSAGES=…`` raises it).

Run: ``.venv/bin/python bench/stall.py --markdown`` (``--json FILE`` keeps the raw numbers)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency import HEADERS, _command_line, _rel, servers

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "stall.json"
SMALL = json.dumps({"model": "fake-model", "messages": [
    {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say ok."}]}).encode()


@dataclass
class Probes:
    healthz: list[float] = field(default_factory=list)
    chat: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    """Probes answered with an error (a stalled proxy's pooled upstream connection can go stale meanwhile)."""


def large_body(case: str, mb: int) -> bytes:
    if case == "x":
        messages = [{"role": "user", "content": "x" * (mb * 1_000_000)}]
    elif case == "eq":
        messages = [{"role": "user", "content": "=" * 8_000_000}]
    else:
        messages = [{"role": "user", "content": "hi"}] * 200_000
    return json.dumps({"model": "fake-model", "messages": messages}, separators=(",", ":")).encode()


def probe_round(health: httpx.Client, chat: httpx.Client, into: Probes) -> None:
    start = time.perf_counter()
    answer = health.get("/healthz")
    into.healthz.append((time.perf_counter() - start) * 1000)
    start = time.perf_counter()
    reply = chat.post("/v1/chat/completions", content=SMALL, headers=HEADERS)
    into.chat.append((time.perf_counter() - start) * 1000)
    for name, response in (("healthz", answer), ("chat", reply)):
        if response.status_code != 200:
            into.failed.append(f"{name} {response.status_code}: {response.text[:200]}")


def rss_kb(pid: int) -> dict[str, int]:
    """The process's resident set now (VmRSS) and at its peak (VmHWM), in kB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "peak_kb": int(fields["VmHWM"].split()[0])}


def run_case(base: str, pid: int, case: str, mb: int, idle: Probes) -> dict[str, Any]:
    body = large_body(case, mb)
    before = rss_kb(pid)
    result: dict[str, Any] = {}

    def send() -> None:
        start = time.perf_counter()
        with httpx.Client(base_url=base, timeout=600.0) as client:
            answer = client.post("/v1/chat/completions", content=body, headers=HEADERS)
        result.update(status=answer.status_code, seconds=round(time.perf_counter() - start, 3),
                      code=(answer.json().get("error") or {}).get("code") if answer.status_code >= 400 else None)

    during = Probes()
    sender = threading.Thread(target=send)
    with httpx.Client(base_url=base, timeout=600.0) as health, httpx.Client(base_url=base, timeout=600.0) as chat:
        sender.start()
        while sender.is_alive():
            probe_round(health, chat, during)
    sender.join()
    after = rss_kb(pid)
    return {"case": case, "body_bytes": len(body), **result, "rss_before_mb": before["rss_kb"] // 1024,
            "rss_peak_mb": after["peak_kb"] // 1024, "rss_after_mb": after["rss_kb"] // 1024,
            "healthz": compare(idle.healthz, during.healthz), "chat": compare(idle.chat, during.chat),
            "failed_probes": during.failed}


def stats(samples: list[float]) -> dict[str, float]:
    p90 = statistics.quantiles(samples, n=10, method="inclusive")[8] if len(samples) > 1 else samples[0]
    return {"n": len(samples), "median_ms": round(statistics.median(samples), 3), "p90_ms": round(p90, 3),
            "max_ms": round(max(samples), 3)}


def compare(idle: list[float], during: list[float]) -> dict[str, Any]:
    a, b = stats(idle), stats(during)
    return {"idle": a, "during": b, "median_ratio": round(b["median_ms"] / a["median_ms"], 2),
            "max_ratio": round(b["max_ms"] / a["max_ms"], 2)}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = _command_line(argv)
    with tempfile.TemporaryDirectory(prefix="ctxproxy-stall-") as tmp, \
            servers(Path(tmp), args.proxy_env) as targets:
        idle = Probes()
        with httpx.Client(base_url=targets.proxied, timeout=60.0) as health, \
                httpx.Client(base_url=targets.proxied, timeout=60.0) as chat:
            for _ in range(args.probes):
                probe_round(health, chat, idle)
        if idle.failed:
            sys.exit(f"the idle proxy failed a probe: {idle.failed[0]}")
        idle = Probes(idle.healthz[args.probes // 5:], idle.chat[args.probes // 5:])  # the first fifth warms up
        results = [run_case(targets.proxied, targets.proxy_pid, case, args.mb, idle) for case in args.cases]
    report = {"benchmark": "latency of /healthz and a small chat, idle vs during one large request",
              "command": command, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"command: {command}")
    print(markdown(results) if args.markdown else json.dumps(results, indent=2))
    print(f"results: {_rel(args.json)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=int, default=50, help="size of the `x` case's message in MB (50)")
    parser.add_argument("--cases", nargs="+", choices=("x", "eq", "tiny"), default=["x", "eq", "tiny"])
    parser.add_argument("--probes", type=int, default=100, help="idle probe rounds (100; the first fifth warm up)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file ({_rel(DEFAULT_JSON)})")
    parser.add_argument("--markdown", action="store_true", help="print the results as a Markdown table")
    parser.add_argument("--proxy-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the proxy, e.g. CTXPROXY_MAX_MESSAGES=250000 (repeatable)")
    return parser


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| case | body | answer | time to answer | probe | idle median / max | during median / p90 / max "
             "| ratio median / max | RSS before / peak / after |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    failures = []
    for r in results:
        answer = f"{r['status']}" + (f" `{r['code']}`" if r.get("code") else "")
        for probe in ("healthz", "chat"):
            c = r[probe]
            i, d = c["idle"], c["during"]
            lines.append(f"| {r['case']} | {r['body_bytes'] / 1e6:.1f} MB | {answer} | {r['seconds']:.2f} s | "
                         f"{probe} (n={d['n']}) | {i['median_ms']:.2f} / {i['max_ms']:.2f} ms | "
                         f"{d['median_ms']:.2f} / {d['p90_ms']:.2f} / {d['max_ms']:.2f} ms | "
                         f"{c['median_ratio']:.1f}× / {c['max_ratio']:.1f}× | "
                         f"{r['rss_before_mb']} / {r['rss_peak_mb']} / {r['rss_after_mb']} MB |")
        failures += [f"{r['case']}: {failure}" for failure in r["failed_probes"]]
    return "\n".join([*lines, f"\nprobes that failed: {len(failures)}", *failures[:5]] if failures else lines)


if __name__ == "__main__":
    sys.exit(main())
