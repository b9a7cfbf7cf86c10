"""When the journal cannot be used: what happened, to which file, and what the operator can do about it.

SQLite says "database or disk is full", "unable to open database file" or "database disk image is malformed",
without the path or a way out. ``explain`` turns any error the journal raised (``sqlite3.Error`` or the
``OSError`` of creating its directory) into a ``JournalUnavailable`` whose message names the file and the fix;
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

__all__ = ["JournalUnavailable", "explain", "open_journal", "storage_errors", "unavailable"]

Kind = Literal["full", "read_only", "corrupt", "unavailable"]

_CODES: dict[int, Kind] = {sqlite3.SQLITE_FULL: "full", sqlite3.SQLITE_READONLY: "read_only",
                           sqlite3.SQLITE_CORRUPT: "corrupt", sqlite3.SQLITE_NOTADB: "corrupt"}
_ERRNOS: dict[int, Kind] = {errno.ENOSPC: "full", errno.EDQUOT: "full", errno.EROFS: "read_only",
                            errno.EACCES: "read_only", errno.EPERM: "read_only"}


class JournalUnavailable(Exception):
    """The journal at ``path`` cannot be used: ``kind`` says how, the message what to do."""

    def __init__(self, kind: Kind, path: Path | None, message: str) -> None:
        super().__init__(message)
        self.kind, self.path, self.message = kind, path, message


def explain(exc: BaseException, path: Path | None) -> JournalUnavailable:
    """The operator's version of a storage error raised while using the journal at ``path``."""
    if isinstance(exc, JournalUnavailable):
        return exc
    return unavailable(_kind(exc, path), path, str(exc) or type(exc).__name__)


def unavailable(kind: Kind, path: Path | None, detail: str) -> JournalUnavailable:
    where = f"The journal at {path}" if path else "The in-memory journal"
    return JournalUnavailable(kind, path, f"{where} {_WHAT[kind].format(detail=detail, files=_files(path))}")


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


def open_journal(path: Path, sync: str = "normal", *, check: bool = False) -> Journal:
    """The journal at ``path``, or ``JournalUnavailable``. ``check`` (a server starting): the file is whole
    (``PRAGMA quick_check``) and writable. A reader (the CLI) only opens it."""
    try:
        journal = Journal(path, sync)
    except (sqlite3.Error, OSError) as exc:  # OSError: creating its directory
        raise explain(exc, path) from None
    try:
        if check:
            with storage_errors(path):
                _check(journal)
    except JournalUnavailable:
        journal.close()
        raise
    return journal


@contextmanager
def storage_errors(path: Path | None) -> Iterator[None]:
    """Within: any error of SQLite leaves as ``JournalUnavailable``."""
    try:
        yield
    except sqlite3.Error as exc:
        raise explain(exc, path) from None


def _check(journal: Journal) -> None:
    problems = journal.integrity_problems()
    if problems:
        first = problems[0].replace("\n", "; ")
        raise unavailable("corrupt", journal.path, f"PRAGMA quick_check: {first}")
    journal.probe_write()
