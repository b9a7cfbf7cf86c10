"""A throwaway PostgreSQL server for the benches (``bench/load.py --postgres auto``): its own cluster in a
temporary directory, on 127.0.0.1 and a free port, stopped and deleted after.

Why its own: a measurement must not share a server with anyone else's databases, and must start from an empty one.
Why not the tests' (``tests/postgres.py``): that one turns durability off (``fsync``, ``synchronous_commit``)
because a test database is thrown away; a measurement keeps the server's defaults, what a team would run: every
commit is flushed to disk before it returns.
The server refuses to run as root, so when the bench runs as root the cluster belongs to the ``postgres`` user
(Debian's package creates it) and every server command runs through ``runuser``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import latency

BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
"""Debian's layout: the server's binaries are not on PATH; the newest version installed wins."""


def binary(name: str) -> str:
    for folder in BIN_DIRS:
        if (folder / name).is_file():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: install PostgreSQL (Debian: apt-get install postgresql)")
    return found


def _as_owner(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@contextmanager
def throwaway_postgres(max_connections: int = 200) -> Iterator[str]:
    """A fresh cluster; yields its URL (trust authentication, loopback only). Stopped by its data dir after."""
    with tempfile.TemporaryDirectory(prefix="ctxproxy-pg-") as tmp:
        data, port = Path(tmp) / "data", latency.free_port()
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(tmp, owner.pw_uid, owner.pw_gid)
        subprocess.run(_as_owner([binary("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                                  "--no-sync", "-E", "UTF8"]), check=True, capture_output=True, timeout=120)
        options = f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 -c max_connections={max_connections}"
        subprocess.run(_as_owner([binary("pg_ctl"), "start", "-w", "-D", str(data), "-o", options,
                                  "-l", f"{tmp}/server.log"]), check=True, capture_output=True, timeout=120)
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run(_as_owner([binary("pg_ctl"), "stop", "-m", "fast", "-w", "-D", str(data)]),
                           capture_output=True, timeout=120)
