"""``bench/peer_proxies.py``: the peers run beside ctxproxy in one latency run, each from its command template, kept
inside the run's temporary folder and stopped by PID (issue #13: "ahead of every peer" judged on this machine)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from peer_proxies import Peer, parse_peer, peer_argv, peer_proxies  # noqa: E402

from tests.real.upstream import stop  # noqa: E402

_SERVER = ("import os, pathlib, sys, http.server as h; pathlib.Path(os.environ['HOME'], 'home').write_text("
           "os.environ['HOME']); h.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), h.BaseHTTPRequestHandler)"
           ".serve_forever()")
"""A peer: answers every request (501, it has no handlers) and notes where its HOME was."""


def test_a_peer_is_a_name_and_a_command_whose_places_are_filled_in(tmp_path: Path) -> None:
    peer = parse_peer("slow one = run --up {upstream} --root {upstream_root} --port {port} --dir '{data}/a b'")
    assert peer == Peer("slow one", "run --up {upstream} --root {upstream_root} --port {port} --dir '{data}/a b'")
    assert peer_argv(peer, 4242, "http://127.0.0.1:9", tmp_path) == [
        "run", "--up", "http://127.0.0.1:9/v1", "--root", "http://127.0.0.1:9", "--port", "4242", "--dir",
        f"{tmp_path}/a b"]


@pytest.mark.parametrize("text", ["no-command", "=cmd", "name=", " = "])
def test_a_peer_without_a_name_or_a_command_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="NAME=COMMAND"):
        parse_peer(text)


def test_a_peer_runs_in_its_own_folder_answers_and_is_stopped_by_its_pid(tmp_path: Path) -> None:
    peer = Peer("http", f"{shlex.quote(sys.executable)} -c {shlex.quote(_SERVER)} {{port}}")
    stopped: list[subprocess.Popen[bytes]] = []

    def stopping(proc: subprocess.Popen[bytes]) -> None:
        stopped.append(proc)
        stop(proc)

    with peer_proxies([peer], "http://127.0.0.1:9", tmp_path, stopping) as running:
        url, pid = running["http"]
        assert httpx.get(url + "/anything").status_code == 501
        assert (tmp_path / "peer-http" / "home").read_text() == str(tmp_path / "peer-http")
    assert [proc.pid for proc in stopped] == [pid] and stopped[0].poll() is not None


def test_a_peer_that_exits_before_it_answers_fails_the_run_with_its_log(tmp_path: Path) -> None:
    peer = Peer("broken", f"{shlex.quote(sys.executable)} -c \"print('no upstream given'); raise SystemExit(3)\"")
    with pytest.raises(RuntimeError, match="exited with 3:\nno upstream given"), \
            peer_proxies([peer], "http://127.0.0.1:9", tmp_path, stop):
        pass
