"""``ctxproxy replay`` measures what the server sends: the same conversation, fed request by request to
``proxy.commands.replay`` and to a running server in front of the same recording upstream, gives byte-identical upstream
bodies.

The upstream is ``proxy.commands.recording.RecordedUpstream`` served by real uvicorn on loopback: it answers each
request with the recording's next assistant message and a ``usage`` counted by the proxy's tokenizer, and keeps every
body. The server is a real ``ctxproxy serve`` process for the generated runs (``tests/transcripts.py``: native and every
text protocol; ``tests/workloads.py``'s long workload), and the app over real uvicorn in this process for the recorded
corpus (``CTXPROXY_TRAJECTORIES``, as ``tests/test_corpus.py``: a process per file would be slow). Replay runs first on
a data dir that is then removed and given to the server: paths the proxy writes into what the model reads (the mirror's)
are the same in both.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from ctxproxy.config import load_settings
from ctxproxy.proxy.commands.cli import main
from ctxproxy.proxy.commands.recording import LAST_ANSWER, RecordedUpstream
from ctxproxy.proxy.commands.replay import ReplayStep, agent_requests, replay, request_body, summarize
from ctxproxy.proxy.core.tokens import MessageCounter
from ctxproxy.proxy.edge.app import create_app
from tests.fakes import serve_in_thread
from tests.transcripts import FORMATS, transcript
from tests.workloads import conversation, trajectories_dir

pytestmark = pytest.mark.e2e
CTXPROXY = str(Path(sys.executable).with_name("ctxproxy"))
COUNTER = MessageCounter()
WINDOW = 4096
"""The smallest window the suite replays at: spills, elisions, folds, the offer, the reminder and the mirror."""

Server = Callable[[str, Path], contextlib.AbstractContextManager[str]]


def replayed(conv: dict[str, Any], data: Path, window: int = WINDOW) -> tuple[list[ReplayStep], list[bytes]]:
    upstream = RecordedUpstream(COUNTER)
    steps = list(replay(conv, load_settings(env={}), window, COUNTER, workdir=data, upstream=upstream))
    return steps, [s.body for s in upstream.sent]


def served(conv: dict[str, Any], data: Path, server: Server) -> list[bytes]:
    """The same requests, in the same order, to a server on ``data`` in front of the recording."""
    messages, upstream = conv["messages"], RecordedUpstream(COUNTER)
    with serve_in_thread(upstream) as direct, server(direct + "/v1", data) as proxy, \
            httpx.Client(base_url=proxy, timeout=120) as client:
        for end in agent_requests(messages):
            upstream.answer = messages[end] if end < len(messages) else LAST_ANSWER
            answer = client.post("/v1/chat/completions", content=orjson.dumps(request_body(conv, end)),
                                 headers={"content-type": "application/json"})
            assert answer.status_code == 200 or answer.json()["error"]["code"] == "context_length_exceeded", answer.text
    return [s.body for s in upstream.sent]


@contextlib.contextmanager
def ctxproxy_serve(upstream: str, data: Path) -> Iterator[str]:
    """A real ``ctxproxy serve`` process, configured as a replay configures the app."""
    port = _free_port()
    env = {**os.environ, "CTXPROXY_CTX_WINDOW": str(WINDOW)}
    log = (data.parent / f"{data.name}.serve.log").open("wb")
    process = subprocess.Popen([CTXPROXY, "serve", "--upstream", upstream, "--port", str(port), "--data-dir",
                                str(data)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(f"http://127.0.0.1:{port}/healthz", process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()


@contextlib.contextmanager
def app_over_uvicorn(upstream: str, data: Path) -> Iterator[str]:
    """The app over real uvicorn in this process, configured as ``ctxproxy serve`` above."""
    settings = load_settings(env={"CTXPROXY_UPSTREAM": upstream, "CTXPROXY_DATA_DIR": str(data),
                                  "CTXPROXY_CTX_WINDOW": str(WINDOW)})
    with serve_in_thread(create_app(settings)) as url:
        yield url


def assert_replay_sends_what_the_server_sends(conv: dict[str, Any], tmp_path: Path, server: Server) -> None:
    data = tmp_path / "data"
    steps, replay_bodies = replayed(conv, data)
    shutil.rmtree(data)
    server_bodies = served(conv, data, server)
    assert len(replay_bodies) == len(server_bodies) == sum(not s.refused for s in steps)
    for n, (ours, theirs) in enumerate(zip(replay_bodies, server_bodies, strict=True)):
        assert ours == theirs, f"upstream request {n} differs"


@pytest.mark.parametrize("fmt", FORMATS)
def test_replay_sends_byte_for_byte_what_ctxproxy_serve_sends_on_a_generated_run(fmt: str, tmp_path: Path) -> None:
    assert_replay_sends_what_the_server_sends(transcript(fmt).conversation, tmp_path, ctxproxy_serve)


def test_replay_sends_byte_for_byte_what_ctxproxy_serve_sends_on_the_long_workload(tmp_path: Path) -> None:
    assert_replay_sends_what_the_server_sends(conversation(rounds=30), tmp_path, ctxproxy_serve)


CORPUS = trajectories_dir()
FILES = sorted(p for p in CORPUS.glob("*.json") if p.name != "manifest.json") if CORPUS and CORPUS.is_dir() else []


@pytest.mark.skipif(not FILES, reason="CTXPROXY_TRAJECTORIES is not set: the recorded trajectories are not replayed")
@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_replay_sends_byte_for_byte_what_the_server_sends_on_a_recorded_run(path: Path, tmp_path: Path) -> None:
    conv = json.loads(path.read_text())
    conv.pop("_source", None)
    assert_replay_sends_what_the_server_sends(conv, tmp_path, app_over_uvicorn)


def test_the_replay_exercises_what_the_old_core_replay_left_out(tmp_path: Path) -> None:
    """The native run at 5k through the server's path: the context tools offered, read_overflow listed once a
    result is cut, a reminder or the mirror paragraph among the proxy's own lines, calibration from the answers.
    (At 4k the whole set is never offered: its schemas would take a quarter of the budget.)"""
    steps, bodies = replayed(transcript("native").conversation, tmp_path / "data", window=5120)
    tools = [{t["function"]["name"] for t in orjson.loads(b).get("tools") or []} for b in bodies]
    assert any("read_overflow" in names and "context_drop" not in names for names in tools)
    assert any("context_drop" in names for names in tools)
    assert any(s.tokens_notices for s in steps)
    assert summarize(steps).violations == 0 and not any(s.over_window for s in steps)


def test_ctxproxy_replay_prints_the_report_and_its_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(transcript("native").conversation))
    assert main(["replay", str(path), "--window", "4096", "--data-dir", str(tmp_path / "unused")]) == 0
    assert "over the window" in capsys.readouterr().out
    assert main(["replay", str(path), "--window", "4096", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["window"] == 4096 and report["summary"]["requests"] == len(report["steps"]) == 14
    assert {"tokens_notices", "over_window", "decisions", "newest_lost", "unrestorable"} <= set(report["steps"][0])
    assert not (tmp_path / "unused").exists()  # a replay writes only in its own temporary directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(url: str, process: subprocess.Popen[bytes], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"ctxproxy serve exited with {process.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise AssertionError("ctxproxy serve did not start")
