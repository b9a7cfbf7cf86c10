"""The ``ctxproxy`` command as an operator meets it: ``show`` in rounds and cuts, ``sessions --json`` in the API's
shape, a closed pipe, a malformed replay file, an unknown variable, a port in use, ``--help`` and ``doctor``."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ctxproxy.config import load_settings
from ctxproxy.config.settings import unknown_environment
from ctxproxy.proxy.commands.cli import main
from ctxproxy.store import failures
from tests.conftest import app_client
from tests.fakes import FakeUpstream, serve_in_thread
from tests.test_metrics import with_result

CTXPROXY = str(Path(sys.executable).with_name("ctxproxy"))


@pytest.fixture
def journaled(tmp_path: Path) -> Iterator[tuple[Path, str, Any]]:
    """A data dir with one session of two rounds, the first of which spilled a long result; and its API listing."""
    data = tmp_path / "data"
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(data), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "32768", "CTXPROXY_SPILL_CHARS": "2000"})
    first = with_result("\n".join(f"line {i}: all is well" for i in range(1500)))
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as c:
        answer = c.post("/v1/chat/completions", json={"model": "m", "messages": first})
        then = [*first, {"role": "assistant", "content": "read"}, {"role": "user", "content": "go on"}]
        c.post("/v1/chat/completions", json={"model": "m", "messages": then})
        listing = c.get("/ctx/sessions").json()
    yield data, answer.headers["x-ctx-session"], listing


def test_show_speaks_in_rounds_and_cuts(journaled: tuple[Path, str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    data, session, _ = journaled
    assert main(["show", session, "--data-dir", str(data)]) == 0
    out = capsys.readouterr().out
    assert f"Session {session}, model m" in out and "In all: 2 rounds, 6 messages now, 1 cuts" in out
    heading, _, first, second = out.split("\n\n")[1].splitlines()
    assert heading.split()[:2] == ["round", "when"] and "cuts" in heading and "request_id" not in out
    assert first.split()[0] == "1" and "spill 1" in first and first.rstrip().split()[-3] == "ok"
    assert second.split()[0] == "2" and "+2 = 6" in second
    assert main(["show", session, "--data-dir", str(data), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["journal"]
    assert [(r["round"], r["cuts"]) for r in rows] == [(1, {"spill": 1}), (2, {})]


def test_sessions_json_has_the_shape_of_the_api(journaled: tuple[Path, str, Any],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    data, _, listing = journaled
    assert main(["sessions", "--data-dir", str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == listing


def test_sessions_into_a_closed_pipe_ends_quietly(journaled: tuple[Path, str, Any]) -> None:
    data, _, _ = journaled
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")}
    reader = subprocess.Popen([CTXPROXY, "sessions", "--data-dir", str(data)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    assert reader.stdout is not None
    reader.stdout.close()  # `| head -0`: the reader is gone before the first line
    _, err = reader.communicate(timeout=60)
    assert err.decode() == "" and reader.returncode == 0


@pytest.mark.parametrize(("content", "said"), [
    ("[1, 2]", "the file holds a JSON list"),
    ('{"conversation": []}', '"messages" is missing'),
    ('{"messages": [{"role": "user", "content": "hi"}, {"content": "no role"}]}', "messages[1] has role None"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": {}}', '"tools" is a JSON dict'),
])
def test_replay_of_a_malformed_file_says_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       content: str, said: str) -> None:
    path = tmp_path / "run.json"
    path.write_text(content)
    assert main(["replay", str(path), "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a conversation" in err and said in err


def test_an_unknown_ctxproxy_variable_is_warned_about(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CTXPROXY_UPSTREEM", "http://elsewhere/v1")
    monkeypatch.setenv("CTXPROXY_TRAJECTORIES", "/corpus")  # the test suite's own: not a setting, not a typo
    main(["sessions", "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "CTXPROXY_UPSTREEM is not a setting" in err and "did you mean CTXPROXY_UPSTREAM?" in err
    assert "TRAJECTORIES" not in err
    assert unknown_environment({"CTXPROXY_CTX_WINDOW": "4096", "PATH": "/bin"}) == []


def test_a_port_in_use_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--port", str(port), "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and f"port {port} on 127.0.0.1 is already in use" in err


def test_serve_reads_the_journal_whole_once_a_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``PRAGMA quick_check`` reads the whole file (7.5 ms for 11 MB): ``ctxproxy serve`` checks
    the journal before the server starts, and the server's start does not check it again."""
    checked: list[object] = []
    real = failures._check
    monkeypatch.setattr(failures, "_check", lambda journal: (checked.append(journal.location), real(journal))[1])
    started: list[bool] = []

    async def start_and_stop(app: Any) -> None:
        async with app.router.lifespan_context(app):
            started.append(True)

    monkeypatch.setattr(uvicorn, "run", lambda app, **options: asyncio.run(start_and_stop(app)))
    assert main(["serve", "--port", "0", "--data-dir", str(tmp_path), "--upstream", "http://127.0.0.1:9/v1"]) == 0
    assert started == [True] and len(checked) == 1


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "``" not in out and "CTXPROXY_<KEY>" in out


async def _models(request: Request) -> JSONResponse:
    return JSONResponse({"data": [{"id": "m"}]})  # no window anywhere, as llama-cpp-python's server


async def _chat(request: Request) -> JSONResponse:
    return JSONResponse({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})


def test_doctor_checks_the_chat_route_and_warns_of_an_unknown_window(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    server = Starlette(routes=[Route("/v1/models", _models), Route("/v1/chat/completions", _chat, methods=["POST"])])
    with serve_in_thread(server) as url:
        without_v1 = main(["doctor", "--upstream", url, "--data-dir", str(tmp_path)])
        said = capsys.readouterr().out
        right = main(["doctor", "--upstream", url + "/v1", "--model", "m", "--data-dir", str(tmp_path)])
        fine = capsys.readouterr().out
    assert without_v1 == 1 and f"FAIL  chat route: {url}/chat/completions answered 404" in said
    assert "ending in /v1" in said
    assert right == 0 and "ok    chat route" in fine
    assert "warn  window detected" in fine and "Set ctx_window (CTXPROXY_CTX_WINDOW)" in fine
