"""The proxy's fixed cost: time from exec to ready, resident memory idle, and memory after repeated load runs.

Why: a proxy that sits in front of every agent should start in a blink and hold little memory when nothing
happens, and what it holds under load must level off, not grow run after run (issue #13: goals start to ready
≤ 0.3 s, idle RSS ≤ 70 MB, ≤ 300 MB and flat after ``bench/load.py``'s 250 sessions, run after run).

How: ``bench/fake_upstream.py`` runs in its own process; ``ctxproxy serve`` (as a user's install runs it:
``bench/harness.py``'s ``AS_INSTALLED``) is started against it once to create a journal in a temporary data dir, then
``--starts`` times more on that journal (a restart). Each start is timed from just before ``exec`` to the first ``GET
/healthz`` answered 200 (polled every 2 ms); the CPU time it spent until then is read (user + system,
``/proc/PID/stat``: what a busy machine changes least), and its resident set (``VmRSS`` of ``/proc/PID/status``) at
ready, ``--settle`` seconds later with no request (idle: what the server loads on its warm-up thread after ready, the
request engine and the tokenizer, has loaded by then), and after one small chat request. Medians over the restarts.
``--starts`` more starts send a chat the moment ``/healthz`` answers: exec to that chat's answer is what a client
that starts the proxy and uses it at once sees (the chat waits for the warm-up). ``import
ctxproxy.proxy.commands.cli`` and ``import ctxproxy.proxy.edge.app`` are timed the same way, each in a fresh
interpreter, and as many starts of the server the proxy is built on with nothing else in it (``FLOOR``): what no
proxy on Starlette and uvicorn starts faster than, on this machine. Then ``bench/load.py``'s agents run
``--waves`` times (``--sessions`` new agent runs of ``--rounds`` rounds each, no pause) through one more proxy, against
``bench/load.py``'s fake upstream minus its record of every body (``ForgetfulUpstream``); the proxy's RSS is read when
it is idle before, and ``--rest`` seconds after each run. Flat means the later runs add next to nothing. ``bench/load.py
--waves N`` runs the same agents with all of its checks.

Run: ``.venv/bin/python bench/footprint.py --markdown`` (``--waves 0``: start and idle only; ``--starts 0``: load only)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
import latency  # noqa: E402
import load  # noqa: E402

SMALL_CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def start_once(upstream: str, data: Path, settle: float, env: list[str]) -> dict[str, float]:
    """One ``ctxproxy serve``: seconds from exec to /healthz 200, its CPU time then, its RSS at ready, idle and
    after one chat."""
    proc, port, started = _spawn_proxy(upstream, data, env)
    try:
        ready = _wait_healthz(proc, f"http://127.0.0.1:{port}/healthz") - started
        at_ready, cpu = harness.rss_mb(proc.pid, "VmRSS"), load.proc_stats(proc.pid)["cpu_s"]
        time.sleep(settle)
        idle = harness.rss_mb(proc.pid, "VmRSS")
        chat = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=SMALL_CHAT, timeout=30)
        chat.raise_for_status()
        return {"ready_s": ready, "cpu_at_ready_s": cpu, "rss_at_ready_mb": at_ready, "rss_idle_mb": idle,
                "rss_after_chat_mb": harness.rss_mb(proc.pid, "VmRSS")}
    finally:
        latency._stop(proc)


FLOOR = ("import sys; sys.modules.update(dict.fromkeys(('pandas', 'numpy', 'rich', 'pygments'), None))\n"
         "import uvicorn\n"
         "from starlette.applications import Starlette\n"
         "from starlette.responses import Response\n"
         "from starlette.routing import Route\n"
         "async def healthz(request): return Response('ok')\n"
         "uvicorn.run(Starlette(routes=[Route('/healthz', healthz)]), host='127.0.0.1', port=int(sys.argv[1]),"
         " loop='uvloop', http='httptools', log_level='warning')")
"""The floor of start to ready on this machine: the server the proxy is built on (Starlette under uvicorn, with
uvloop and httptools, as ``proxy.edge.serving`` runs it) with one route and nothing else, in the same interpreter."""


def floor_once(env: list[str]) -> float:
    """Seconds from exec to /healthz 200 of ``FLOOR``."""
    port = latency.free_port()
    with tempfile.TemporaryDirectory(prefix="ctxproxy-floor-") as tmp:
        started = time.perf_counter()
        proc = latency._spawn([sys.executable, "-P", "-c", FLOOR, str(port)], Path(tmp) / "floor.log",
                              latency._proxy_environ(env))
        try:
            return _wait_healthz(proc, f"http://127.0.0.1:{port}/healthz") - started
        finally:
            latency._stop(proc)


def first_answer_once(upstream: str, data: Path, env: list[str]) -> float:
    """Seconds from exec to the answer of a chat sent the moment /healthz first answers (it waits for the
    warm-up: what a client that starts the proxy and talks to it at once sees)."""
    proc, port, started = _spawn_proxy(upstream, data, env)
    try:
        _wait_healthz(proc, f"http://127.0.0.1:{port}/healthz")
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=SMALL_CHAT, timeout=30).raise_for_status()
        return time.perf_counter() - started
    finally:
        latency._stop(proc)


def _spawn_proxy(upstream: str, data: Path, env: list[str]) -> tuple[subprocess.Popen[bytes], int, float]:
    port = latency.free_port()
    # -P: the checkout the proxy runs is the one PYTHONPATH names (--proxy-env), not the current directory, which
    # `-c` would put first on sys.path (so --proxy-env PYTHONPATH=BASE ran this checkout's code)
    command = [sys.executable, "-P", "-c", harness.AS_INSTALLED, "serve", "--upstream", upstream + "/v1",
               "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data)]
    environ = latency._proxy_environ(env)
    started = time.perf_counter()
    return latency._spawn(command, data.parent / "proxy.log", environ), port, started


def _wait_healthz(proc: subprocess.Popen[bytes], url: str, timeout: float = 30.0) -> float:
    """The ``perf_counter`` time of the first 200 from ``url``."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"ctxproxy serve exited with {proc.returncode}")
            try:
                if client.get(url).status_code == 200:
                    return time.perf_counter()
            except httpx.TransportError:
                pass
            time.sleep(0.002)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


BYTECODE_CACHED = ["PYTHONDONTWRITEBYTECODE="]
"""The environment of a start as an installed proxy's: its modules' bytecode compiled once, then reused (pip
compiles a wheel's when it installs it; a checkout's is written next to its sources, git-ignored, on the first
import). With ``PYTHONDONTWRITEBYTECODE``, which this project's machines set, every start compiled all ~17,000
lines of the proxy from source: 0.2-0.3 s of a start. (``PYTHONPYCACHEPREFIX`` would keep the tree clean, but
it also hides the installed libraries' bytecode: a first start of 6 s.)"""


def import_seconds(module: str, env: list[str]) -> float:
    """Seconds a fresh interpreter spends importing ``module`` (as installed: without pandas and numpy)."""
    code = (harness.AS_INSTALLED.split("from ctxproxy.proxy.commands.cli")[0] +
            f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True,
                         env=latency._proxy_environ(env), cwd=BENCH.parent)
    return float(out.stdout)


def starts(count: int, settle: float, env: list[str]) -> dict[str, Any]:
    """Medians (and all values) over ``count`` restarts on one journal against one fake upstream, after a first
    start that creates the journal; then as many starts answering a chat at once."""
    with tempfile.TemporaryDirectory(prefix="ctxproxy-footprint-") as tmp:
        port, data = latency.free_port(), Path(tmp) / "data"
        env = [*env, *BYTECODE_CACHED]
        fake = latency._spawn([sys.executable, str(BENCH / "fake_upstream.py"), "--port", str(port)],
                              Path(tmp) / "fake.log", latency._proxy_environ([]))
        try:
            latency._wait_ready(fake, f"http://127.0.0.1:{port}/v1/models", Path(tmp) / "fake.log")
            first, *runs = [start_once(f"http://127.0.0.1:{port}", data, settle, env) for _ in range(count + 1)]
            answers = [first_answer_once(f"http://127.0.0.1:{port}", data, env) for _ in range(count)]
            floors = [floor_once(env) for _ in range(count)]
        finally:
            latency._stop(fake)
        imports = {m: [import_seconds(m, env) for _ in range(count)]
                   for m in ("ctxproxy.proxy.commands.cli", "ctxproxy.proxy.edge.app")}
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    out |= {f"import_{m}_s": round(statistics.median(v), 3) for m, v in imports.items()}
    out |= {"first_ready_s": round(first["ready_s"], 3), "first_answer_s": round(statistics.median(answers), 3),
            "floor_ready_s": round(statistics.median(floors), 3)}
    return out | {"starts": count, "settle_s": settle, "all": [first, *runs], "answers": answers, "floors": floors}


class ForgetfulUpstream(load.RecordingUpstream):
    """``bench/load.py``'s fake (a tool call per answer, streamed or not) without its record of every body, which
    a long run would grow to gigabytes (250 sessions × 68 rounds: about 7 GB)."""

    @property
    def received(self) -> list[dict[str, str]]:
        return []

    @received.setter
    def received(self, value: list[dict[str, str]]) -> None:
        pass


def waves(sessions: int, rounds: int, count: int, rest: float, env: list[str]) -> dict[str, Any]:
    """``count`` runs of ``bench/load.py``'s agents (``sessions`` new ones each, ``rounds`` rounds, no pause)
    through one proxy: its RSS before, ``rest`` seconds after each run, and its peak."""
    assert sessions * count <= 10_000, "load.py's markers have four digits"
    with tempfile.TemporaryDirectory(prefix="ctxproxy-footprint-") as tmp:
        port = latency.free_port()
        fake = latency._spawn([sys.executable, __file__, "--serve-fake", str(port)], Path(tmp) / "fake.log",
                              latency._proxy_environ([]))
        try:
            base = f"http://127.0.0.1:{port}"
            latency._wait_ready(fake, base + "/v1/models", Path(tmp) / "fake.log")
            with harness.proxy_process(base, Path(tmp), env) as (proxy, pid):
                time.sleep(rest)  # idle: the warm-up done
                before, after, requests, errors = harness.rss_mb(pid, "VmRSS"), [], 0, 0
                for wave in range(count):
                    agents = load.sessions_for(sessions, wave * sessions)
                    measured, _ = asyncio.run(load.drive(agents, rounds, [proxy], base, 3600, 120, [pid]))
                    requests += len(measured.pairs_ns)
                    errors += sum(len(a.errors) for a in agents)
                    time.sleep(rest)
                    after.append(round(harness.rss_mb(pid, "VmRSS"), 1))
                peak = harness.rss_mb(pid)
        finally:
            latency._stop(fake)
    return {"sessions": sessions, "rounds": rounds, "waves": count, "rest_s": rest, "requests": requests,
            "errors": errors,
            "ok": errors == 0, "rss_before_mb": round(before, 1), "rss_after_each_wave_mb": after,
            "peak_rss_mb": round(peak, 1)}


def markdown(report: dict[str, Any]) -> str:
    rows = []
    if "start" in report:
        s = report["start"]
        rows += [("start to ready (exec → /healthz 200), median of restarts", f"**{s['ready_s']:.3f} s**"),
                 ("… the first start, which creates the journal (and the bytecode, if not there yet)",
                  f"{s['first_ready_s']:.3f} s"),
                 ("exec → the answer to a chat sent at ready (waits for the warm-up), median",
                  f"{s['first_answer_s']:.3f} s"),
                 ("… the floor: Starlette under uvicorn with one route and nothing else (`FLOOR`), median",
                  f"{s['floor_ready_s']:.3f} s"),
                 ("CPU time the process spent until ready (user + system), median", f"{s['cpu_at_ready_s']:.2f} s"),
                 ("`import proxy.commands.cli` / `import proxy.edge.app`, median",
                  f"{s['import_ctxproxy.proxy.commands.cli_s']:.3f} / {s['import_ctxproxy.proxy.edge.app_s']:.3f} s"),
                 ("RSS at ready", f"{s['rss_at_ready_mb']:.1f} MB"),
                 (f"RSS idle ({s['settle_s']:g} s after ready, no request)", f"**{s['rss_idle_mb']:.1f} MB**"),
                 ("RSS after one small chat", f"{s['rss_after_chat_mb']:.1f} MB")]
    if "load" in report:
        w = report["load"]
        rows.append((f"RSS before → {w['rest_s']:g} s after each of {w['waves']} load runs ({w['sessions']} new "
                     f"sessions × {w['rounds']} rounds each; {w['requests']} requests, {w['errors']} errors)",
                     f"{w['rss_before_mb']} → " + " → ".join(f"{v}" for v in w["rss_after_each_wave_mb"])
                     + f" MB (peak {w['peak_rss_mb']})"))
    return "\n".join(["| measure | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--starts", type=int, default=7, help="starts to take the medians of (7)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after ready before idle RSS (2)")
    parser.add_argument("--waves", type=int, default=3, help="load runs through one proxy; 0: none (3)")
    parser.add_argument("--rest", type=float, default=7.0,
                        help="seconds after each load run before its RSS (7: the proxy trims when quiet every 5)")
    parser.add_argument("--sessions", type=int, default=250, help="agent runs per load run (250)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per agent run (6)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--proxy-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--serve-fake", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_fake:
        uvicorn.run(ForgetfulUpstream(), host="127.0.0.1", port=args.serve_fake, loop="uvloop", http="httptools",
                    access_log=False, log_level="warning")
        return 0
    report: dict[str, Any] = {"start": starts(args.starts, args.settle, args.proxy_env)} if args.starts else {}
    if args.waves:
        report["load"] = waves(args.sessions, args.rounds, args.waves, args.rest, args.proxy_env)
    report["command"] = shlex.join(["python", "bench/footprint.py", *(sys.argv[1:] if argv is None else argv)])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report) if args.markdown else json.dumps(report, indent=1))
    return 0 if report.get("load", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
