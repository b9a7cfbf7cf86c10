"""``bench/peer_proxies.py``: the peers run beside ctxproxy in one latency run, each from its command template, kept
inside the run's temporary folder and stopped by PID (issue #13: "ahead of every peer" judged on this machine)."""

from __future__ import annotations

import shlex
import socket
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


_NODELAY_PROBE = ("import socket, socketserver, sys\n"
                  "class Probe(socketserver.StreamRequestHandler):\n"
                  "    def handle(self):\n"
                  "        on = self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)\n"
                  "        self.wfile.write(b'1' if on else b'0')\n"
                  "with socketserver.TCPServer(('127.0.0.1', 0), Probe) as server:\n"
                  "    print(server.server_address[1], flush=True)\n"
                  "    server.handle_request()\n")
"""A standard-library socket server that tells its one client whether Nagle's algorithm is off on its socket."""


@pytest.mark.parametrize("nodelay", [True, False])
def test_bench_nodelay_turns_nagle_off_on_a_stdlib_servers_connections(nodelay: bool) -> None:
    """``bench/nodelay`` on a peer's PYTHONPATH (``--peer "NAME=env PYTHONPATH=bench/nodelay COMMAND"``): the
    connections its socket servers accept have ``TCP_NODELAY`` set, so an answer's head and body written apart do
    not wait for a kept-alive client's delayed ACK (ctxkeeper: ~40 ms a request); without it, they do not."""
    env = {"PATH": "/usr/bin:/bin", **({"PYTHONPATH": str(ROOT / "bench" / "nodelay")} if nodelay else {})}
    with subprocess.Popen([sys.executable, "-c", _NODELAY_PROBE], stdout=subprocess.PIPE, env=env) as server:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            answer = client.recv(1)
        assert server.wait(timeout=10) == 0
    assert answer == (b"1" if nodelay else b"0")
