"""Other context-managing proxies, run beside ctxproxy in one latency run (``bench/latency.py --peer``).

Why: the peers' README gives each peer's added latency as measured on its authors' machine, and this machine kind
moves by a factor of two from one day to the next (a direct small request took 0.44 ms one day, 0.88 another).
"Ahead of every peer" can only be judged by measuring the peers in the same run: the same requests, in the same
rounds, in front of the same fake upstream, in an order that rotates.

A peer is ``NAME=COMMAND``: a command line (split like a shell's) with ``{port}`` (where it must listen),
``{upstream}`` (the fake upstream's ``/v1`` base), ``{upstream_root}`` (the same without ``/v1``) and ``{data}``
(a fresh folder, also its ``HOME``, so it writes nothing outside the run's temporary folder) filled in. Settings a
peer reads from its environment go in front with ``env``. It is ready when it answers any HTTP request on its
port; it is stopped by its PID. The peers install from PyPI into a virtualenv of their own (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class Peer:
    name: str
    command: str


def parse_peer(text: str) -> Peer:
    """``NAME=COMMAND`` (argparse's ``type``)."""
    name, sep, command = text.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise ValueError(f"a peer is NAME=COMMAND, not {text!r}")
    return Peer(name.strip(), command.strip())


def peer_argv(peer: Peer, port: int, upstream_root: str, data: Path) -> list[str]:
    """The peer's command line, its placeholders filled in."""
    return shlex.split(peer.command.format(port=port, upstream=f"{upstream_root}/v1", upstream_root=upstream_root,
                                           data=data))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def peer_proxies(peers: list[Peer], upstream_root: str, tmp: Path,
                 stop: Callable[[subprocess.Popen[bytes]], None]) -> Iterator[dict[str, tuple[str, int]]]:
    """Each peer started in front of ``upstream_root`` (``{name: (url, pid)}``), stopped by ``stop`` on exit."""
    started: list[subprocess.Popen[bytes]] = []
    out: dict[str, tuple[str, int]] = {}
    try:
        for peer in peers:
            port, data = free_port(), tmp / f"peer-{peer.name}"
            data.mkdir(parents=True)
            log = tmp / f"peer-{peer.name}.log"
            with log.open("wb") as sink:
                started.append(subprocess.Popen(peer_argv(peer, port, upstream_root, data), stdin=subprocess.DEVNULL,
                                                stdout=sink, stderr=subprocess.STDOUT,
                                                env=os.environ | {"HOME": str(data)}))
            url = f"http://127.0.0.1:{port}"
            wait_answering(started[-1], url + "/", log)
            out[peer.name] = (url, started[-1].pid)
        yield out
    finally:
        for proc in reversed(started):
            stop(proc)


def wait_answering(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 30.0,
                   ready: Callable[[int], bool] = lambda status: True) -> None:
    """Until ``url`` answers with a status ``ready`` accepts (any, by default: a peer need not have a health
    route), or the process ends."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.TransportError):
                if ready(client.get(url).status_code):
                    return
            time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s:\n{log.read_text()[-2000:]}")
