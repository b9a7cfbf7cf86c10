"""A PostgreSQL server for the tests: one throwaway cluster per test session, one fresh database per test.

``CTXPROXY_TEST_POSTGRES`` names a server to use instead (a ``postgresql://`` URL of a database whose user may
create databases); ``skip`` skips the PostgreSQL tests. Otherwise the cluster is made with the local ``initdb``
(``scripts/test-deps`` installs Debian's ``postgresql`` package): in a temporary directory, run as the
``postgres`` user when the tests run as root (the server refuses root), listening on 127.0.0.1 on a free port and
on a socket in that directory only, with durability off (a test database is thrown away). It is stopped by its
PID at the end of the session. Without PostgreSQL the PostgreSQL tests fail, saying what to install: the store
suite runs on both backends in ``make test``.

Each test's database is a copy of one migrated once (``CREATE DATABASE ... TEMPLATE``: a file copy, ~10 ms), so a
test starts from the schema without running the migrations again.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from ctxproxy.store import Journal

__all__ = ["PostgresServer", "start"]

TEMPLATE = "ctxproxy_template"


class PostgresServer:
    """A server the tests may create databases on; ``url`` names its maintenance database."""

    def __init__(self, url: str, process: subprocess.Popen[bytes] | None = None, root: Path | None = None) -> None:
        self.url, self.process, self.root = url, process, root
        self._serial = itertools.count()
        self._admin("DROP DATABASE IF EXISTS " + TEMPLATE)
        self._admin("CREATE DATABASE " + TEMPLATE)
        Journal(self.url_of(TEMPLATE)).close()  # migrated once; each test's database is a copy of it

    def url_of(self, database: str) -> str:
        base, _, _ = self.url.rpartition("/")
        return f"{base}/{database}"

    def database(self) -> str:
        """A fresh, migrated database of its own: its URL."""
        name = f"ctxproxy_test_{os.getpid()}_{next(self._serial)}"
        self._admin(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
        return self.url_of(name)

    def empty_database(self) -> str:
        """A fresh database with nothing in it (for the migrations' own tests)."""
        name = f"ctxproxy_empty_{os.getpid()}_{next(self._serial)}"
        self._admin(f"CREATE DATABASE {name}")
        return self.url_of(name)

    def drop(self, url: str) -> None:
        self._admin(f"DROP DATABASE IF EXISTS {url.rpartition('/')[2]} WITH (FORCE)")

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGINT)  # PostgreSQL's fast shutdown
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def _admin(self, sql: str) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql)


def start() -> PostgresServer | str:
    """The session's server, or why there is none (the caller fails the PostgreSQL tests with it, or skips them
    when ``CTXPROXY_TEST_POSTGRES=skip``)."""
    given = os.environ.get("CTXPROXY_TEST_POSTGRES", "")
    if given and given != "skip":
        return PostgresServer(given)
    bin_dir = _bin_dir()
    if bin_dir is None:
        return ("PostgreSQL is not installed (no initdb on PATH or in /usr/lib/postgresql/*/bin): run "
                "scripts/test-deps as root, or install Debian's `postgresql` package, or point "
                "CTXPROXY_TEST_POSTGRES at a server (postgresql://USER@HOST:PORT/postgres)")
    return _cluster(bin_dir)


def _bin_dir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return versions[-1].parent if versions else None


def _cluster(bin_dir: Path) -> PostgresServer:
    root = Path(tempfile.mkdtemp(prefix="ctxproxy-pg-"))
    user = "postgres" if os.getuid() == 0 else None
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    subprocess.run([bin_dir / "initdb", "-D", root / "data", "-U", "postgres", "--auth=trust", "-E", "UTF8",
                    "--no-sync", "--no-instructions"], check=True, capture_output=True, user=user, cwd=root)
    port = _free_port()
    with (root / "server.log").open("wb") as log:
        process = subprocess.Popen(
            [bin_dir / "postgres", "-D", root / "data", "-p", str(port), "-k", root, "-c",
             "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off", "-c",
             "full_page_writes=off", "-c", "max_connections=200"],
            stdout=subprocess.DEVNULL, stderr=log, user=user, cwd=root)
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    _wait_ready(url, process, root)
    return PostgresServer(url, process, root)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, process: subprocess.Popen[bytes], root: Path) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            psycopg.connect(url, connect_timeout=2).close()
            return
        except psycopg.OperationalError as exc:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                log = (root / "server.log").read_text()[-2000:]
                raise RuntimeError(f"the test PostgreSQL did not start: {log}") from exc
            time.sleep(0.1)
