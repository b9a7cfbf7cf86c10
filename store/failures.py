"""When the journal cannot be used: what happened, to which file or database, and what the operator can do about it.

SQLite says "database or disk is full", "unable to open database file" or "database disk image is malformed",
without the path or a way out; psycopg says "connection refused" or "password authentication failed" for a host,
not for the journal. ``explain`` turns any error the journal raised (``sqlite3.Error``, ``psycopg.Error``, or the
``OSError`` of creating a file's directory) into a ``JournalUnavailable`` whose message names the file (or the
``postgresql://`` URL, without its password) and the fix;
``open_journal`` opens a journal for a server (checked whole and writable) or for a reader, raising only that.
The proxy renders it (``store.writer``), the CLI prints it: never a traceback.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from ctxproxy.store.journal import Journal
from ctxproxy.store.sql import Location, is_postgres, redacted

__all__ = ["JournalUnavailable", "explain", "open_journal", "storage_errors", "unavailable"]

Kind = Literal["full", "read_only", "corrupt", "unavailable", "unreachable", "refused", "missing"]

_CODES: dict[int, Kind] = {sqlite3.SQLITE_FULL: "full", sqlite3.SQLITE_READONLY: "read_only",
                           sqlite3.SQLITE_CORRUPT: "corrupt", sqlite3.SQLITE_NOTADB: "corrupt"}
_ERRNOS: dict[int, Kind] = {errno.ENOSPC: "full", errno.EDQUOT: "full", errno.EROFS: "read_only",
                            errno.EACCES: "read_only", errno.EPERM: "read_only"}


class JournalUnavailable(Exception):
    """The journal at ``location`` cannot be used: ``kind`` says how, the message what to do. ``path``: its SQLite
    file (None in memory or on PostgreSQL)."""

    def __init__(self, kind: Kind, location: Location, message: str) -> None:
        super().__init__(message)
        self.kind, self.location, self.message = kind, location, message
        self.path = location if isinstance(location, Path) else None


def explain(exc: BaseException, location: Location) -> JournalUnavailable:
    """The operator's version of a storage error raised while using the journal at ``location``."""
    if isinstance(exc, JournalUnavailable):
        return exc
    detail = " ".join((str(exc) or type(exc).__name__).split())
    if is_postgres(location):
        return unavailable(_pg_kind(exc), location, detail)
    return unavailable(_kind(exc, _path(location)), location, detail)


def unavailable(kind: Kind, location: Location, detail: str) -> JournalUnavailable:
    if is_postgres(location):
        url = redacted(str(location))
        return JournalUnavailable(kind, location, f"The journal at {url} {_PG_WHAT[kind].format(detail=detail)}")
    path = _path(location)
    where = f"The journal at {path}" if path else "The in-memory journal"
    return JournalUnavailable(kind, path, f"{where} {_WHAT[kind].format(detail=detail, files=_files(path))}")


def _path(location: Location) -> Path | None:
    return None if location is None else Path(location)


_WHAT: dict[Kind, str] = {
    "full": "could not be written: the disk is full ({detail}). Nothing was forwarded unjournaled. Free space on "
            "that disk (or point data_dir elsewhere and restart); ctxproxy recovers by itself once there is room.",
    "read_only": "cannot be written ({detail}): the file or its directory is read-only for this user (even a "
                 "reader needs to write, SQLite's WAL mode keeps its index in a -shm file beside it). Make {files} "
                 "and their directory writable by the user running ctxproxy, or set data_dir to a writable "
                 "directory.",
    "corrupt": "is corrupt ({detail}). Stop ctxproxy, then restore {files} from a backup, or move them aside "
               "(ctxproxy starts a new, empty journal where none is) and keep them to recover what you can "
               "(sqlite3 FILE .recover).",
    "unavailable": "failed ({detail}). Check that the disk holding {files} is reachable and has room, and that "
                   "no other program holds the file locked.",
}


_PG_WHAT: dict[Kind, str] = {
    "full": "could not be written: the database server's disk is full ({detail}). Nothing was forwarded "
            "unjournaled. Free space on the server's data disk; ctxproxy recovers by itself once there is room.",
    "read_only": "cannot be written ({detail}): the server is read-only (a standby, or default_transaction_read_only) "
                 "or the user may not write these tables. Point --store at the primary, or grant the user the "
                 "rights to create and write tables in that database.",
    "corrupt": "reports corrupt data ({detail}). Stop ctxproxy and restore the database from a backup (pg_dump / "
               "pg_restore, or the server's base backup and WAL).",
    "unreachable": "cannot be reached ({detail}). Check that PostgreSQL runs at that host and port and accepts "
                   "connections from this machine (listen_addresses, pg_hba.conf), then start ctxproxy again.",
    "refused": "refused the login ({detail}). Check the user and password in the URL (or PGPASSWORD, ~/.pgpass) and "
               "that pg_hba.conf lets that user connect.",
    "missing": "names a database that does not exist ({detail}). Create it (createdb -O USER NAME) or fix the "
               "database name in --store / CTXPROXY_STORE.",
    "unavailable": "failed ({detail}). Check that the database server is running and reachable, and its log.",
}

_SQLSTATES: dict[str, Kind] = {"53100": "full", "25006": "read_only", "42501": "read_only", "XX001": "corrupt",
                               "XX002": "corrupt", "28P01": "refused", "28000": "refused", "3D000": "missing"}
_PG_MESSAGES: list[tuple[str, Kind]] = [("password authentication failed", "refused"),
                                        ("no pg_hba.conf entry", "refused"), ("does not exist", "missing"),
                                        ("no space left on device", "full"), ("could not extend file", "full")]


def _pg_kind(exc: BaseException) -> Kind:
    """A psycopg error's kind: by its SQLSTATE, or (a connection that never opened has none) by libpq's words."""
    code = getattr(exc, "sqlstate", None)
    if code is not None:
        return _SQLSTATES.get(code, "unavailable")
    text = str(exc).lower()
    kind = next((k for words, k in _PG_MESSAGES if words in text), None)
    if kind is not None:
        return kind
    return "unreachable" if type(exc).__name__ == "OperationalError" else "unavailable"


def _files(path: Path | None) -> str:
    return f"{path} (and its -wal and -shm files)" if path else "it"


def _kind(exc: BaseException, path: Path | None) -> Kind:
    if isinstance(exc, OSError) and exc.errno in _ERRNOS:
        return _ERRNOS[exc.errno]
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF  # the primary code; extended codes add high bits
    if code in _CODES:
        return _CODES[code]
    if code == sqlite3.SQLITE_CANTOPEN and path is not None and not _writable(path.parent):
        return "read_only"  # SQLite cannot create the file, or the -wal and -shm files WAL mode needs beside it
    return "unavailable"


def _writable(directory: Path) -> bool:
    try:
        return not os.statvfs(directory).f_flag & os.ST_RDONLY and os.access(directory, os.W_OK)
    except OSError:
        return False


def open_journal(location: Path | str, sync: str = "normal", *, check: bool = False) -> Journal:
    """The journal at ``location`` (a SQLite file, or a ``postgresql://`` URL), or ``JournalUnavailable``.
    ``check`` (a server starting): it is whole (SQLite: ``PRAGMA quick_check``) and writable. A reader (the CLI)
    only opens it."""
    try:
        journal = Journal(location, sync)
    except ImportError as exc:
        raise unavailable("unavailable", location, f"{exc}; a PostgreSQL journal needs psycopg: pip install "
                                                   "'ctxproxy[postgresql]'") from None
    except Exception as exc:  # the driver's error; OSError: creating a file's directory
        if not isinstance(exc, (OSError, *_driver_errors(location))):
            raise
        raise explain(exc, location) from None
    try:
        if check:
            with storage_errors(location):
                _check(journal)
    except JournalUnavailable:
        journal.close()
        raise
    return journal


@contextmanager
def storage_errors(location: Location) -> Iterator[None]:
    """Within: any error of the journal's database leaves as ``JournalUnavailable``."""
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, _driver_errors(location)):
            raise
        raise explain(exc, location) from None


def _driver_errors(location: Location) -> tuple[type[Exception], ...]:
    if is_postgres(location):
        import psycopg  # opened already: the driver is there

        return (psycopg.Error,)
    return (sqlite3.Error,)


def _check(journal: Journal) -> None:
    problems = journal.integrity_problems()
    if problems:
        first = problems[0].replace("\n", "; ")
        raise unavailable("corrupt", journal.location, f"PRAGMA quick_check: {first}")
    journal.probe_write()
