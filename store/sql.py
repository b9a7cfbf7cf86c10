"""The journal's connection: one narrow, typed seam over SQLite (``sqlite3``) and PostgreSQL (psycopg 3).

The store's SQL is written once, portably: ``?`` placeholders, ``INSERT ... ON CONFLICT DO NOTHING``, ``RETURNING
id``, ``IS NOT DISTINCT FROM``, ``CAST(SUM(...) AS BIGINT)`` (PostgreSQL sums integers as NUMERIC). PostgreSQL's
connection rewrites the placeholders to psycopg's ``%s`` once per string (cached). How the engines are driven
differs here: opening (SQLite's pragmas), transactions (``with conn:`` commits or rolls back on both; nested blocks
join the outer one), the per-session lock ``record_request`` takes, the foreign-key check a prune defers, what a
storage error is (``errors``). What they hold differs where it is used (``conn.dialect``): the DDL rewritten for
PostgreSQL (``store.migrate``), how another writer is noticed (``store.retention``), placement's SQLite caches.

psycopg is imported only when a ``postgresql://`` location is opened: a SQLite install needs nothing more.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Connection", "Cursor", "Location", "PostgresConnection", "SqliteConnection", "connect", "is_postgres",
           "lock_key", "redacted"]

Location = Path | str | None
"""Where a journal lives: a SQLite file, a ``postgresql://`` URL, or None (SQLite in memory)."""

Dialect = Literal["sqlite", "postgresql"]


class Cursor(Protocol):
    """What both drivers' cursors give the store."""

    @property
    def rowcount(self) -> int: ...
    @property
    def description(self) -> Any: ...
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def fetchmany(self, size: int = ...) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


def is_postgres(location: Location) -> bool:
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


def redacted(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def lock_key(name: str) -> int:
    """A signed 64-bit key for ``name`` (a session's name or fingerprint): what PostgreSQL's advisory locks take."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


class Connection(ABC):
    """One connection to the journal's database. ``with conn:`` is a transaction (nested: joins the outer one)."""

    dialect: Dialect
    Error: type[Exception]
    """The driver's base error: what a storage failure is raised as (``store.failures`` explains it)."""
    IntegrityError: type[Exception]
    OperationalError: type[Exception]
    """A failure of the database rather than of the statement (no room, no server, a lock that timed out)."""

    def __init__(self) -> None:
        self._depth = 0

    @abstractmethod
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor: ...

    @abstractmethod
    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    @abstractmethod
    def script(self, ddl: str) -> None:
        """Several statements (no parameters), inside the caller's transaction."""

    @abstractmethod
    def tables(self) -> set[str]: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def _begin(self, exclusive: bool, lock: str | None) -> None:
        """Start the transaction, holding ``lock`` when given."""

    @abstractmethod
    def _end(self, commit: bool) -> None: ...

    def insert(self, sql: str, params: Sequence[Any]) -> int:
        """An ``INSERT`` into a table with an ``id`` key; returns the new row's id."""
        return int(self.execute(sql + " RETURNING id", params).fetchone()[0])

    @contextmanager
    def transaction(self, lock: str | None = None, exclusive: bool = False) -> Iterator[None]:
        """One transaction. ``lock`` (a session's name or fingerprint): no other process places a request of the
        same session until it ends (SQLite: its write lock, taken at once; PostgreSQL: an advisory lock).
        ``exclusive``: SQLite's write lock taken at once (PostgreSQL's rows are locked as they are written)."""
        self._open(exclusive, lock)
        try:
            yield
        except BaseException:
            self._close(commit=False)
            raise
        self._close(commit=True)

    def unchecked_foreign_keys(self) -> Any:
        """Around a bulk delete: foreign keys checked once, at the end (``check_foreign_keys``), not per row."""
        return _nothing()

    @abstractmethod
    def check_foreign_keys(self) -> None:
        """Raise ``IntegrityError`` when a row refers to a missing one."""

    @abstractmethod
    def _lock(self, name: str) -> None:
        """Hold ``name``'s lock until the transaction ends."""

    def begin_if_free(self) -> bool:
        """Begin a transaction if it will not wait for another connection (SQLite's below); ``end`` ends it."""
        return False

    def rest_without_waits(self) -> None:
        """From now on a statement does not wait for another connection's lock unless inside ``waiting`` (SQLite's
        below; elsewhere nothing changes)."""
        return None

    def waiting(self) -> Any:
        """Around calls that may wait for another connection's lock, on a connection ``rest_without_waits``."""
        return _nothing()

    def check_held(self) -> None:
        """Raise if the transaction ``begin_if_free`` began has ended under it (SQLite's below)."""
        return None

    def end(self, commit: bool) -> None:
        """End the transaction ``begin_if_free`` began, if a failed commit has not ended it already; committing one
        that ended under it raises (``check_held``): what it did after was not one transaction."""
        if commit and self._depth:
            self.check_held()
        if self._depth:
            self._close(commit)

    def _open(self, exclusive: bool, lock: str | None = None) -> None:
        if self._depth == 0:
            self._begin(exclusive, lock)
        elif lock is not None:
            self._lock(lock)
        self._depth += 1

    def _close(self, commit: bool) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._end(commit)

    def __enter__(self) -> Connection:
        self._open(exclusive=False)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._close(commit=kind is None)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class SqliteConnection(Connection):
    """A SQLite file in WAL mode (``path``), or a database in memory (``path`` None). Autocommit outside ``with``."""

    dialect: Dialect = "sqlite"
    Error = sqlite3.Error
    IntegrityError = sqlite3.IntegrityError
    OperationalError = sqlite3.OperationalError

    def __init__(self, path: Path | None, sync: str = "normal") -> None:
        super().__init__()
        if path is None:
            self.raw = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
            self.raw.execute("PRAGMA auto_vacuum=INCREMENTAL")  # before any table: lets store.memory free pages
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.raw = sqlite3.connect(str(path), check_same_thread=False, timeout=10, isolation_level=None)
            self.raw.execute("PRAGMA journal_mode=WAL")
        self.raw.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
        self.raw.execute("PRAGMA foreign_keys=ON")
        self._waits_ms = int(self.raw.execute("PRAGMA busy_timeout").fetchone()[0])
        """How long a statement waits for another connection's write lock (``timeout`` above)."""
        self._rests_waiting = True
        """Whether a statement waits ``_waits_ms`` outside ``waiting`` (until ``rest_without_waits``)."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        return self.raw.execute(sql, params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        rows = rows if isinstance(rows, list) else list(rows)
        if rows:  # as on PostgreSQL: none, no statement (most requests' cut bodies, a forward that adds nothing)
            self.raw.executemany(sql, rows)

    def script(self, ddl: str) -> None:
        for statement in _statements(ddl):
            self.raw.execute(statement)

    def tables(self) -> set[str]:
        return {r[0] for r in self.raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    def close(self) -> None:
        self.raw.close()

    def unchecked_foreign_keys(self) -> Any:
        return self._foreign_keys_off()

    @contextmanager
    def _foreign_keys_off(self) -> Iterator[None]:
        self.raw.execute("PRAGMA foreign_keys = OFF")  # outside a transaction: inside one it is a no-op
        try:
            yield
        finally:
            self.raw.execute("PRAGMA foreign_keys = ON")

    def check_foreign_keys(self) -> None:
        dangling = self.raw.execute("PRAGMA foreign_key_check").fetchmany(3)
        if dangling:
            raise sqlite3.IntegrityError(f"rows would refer to removed ones: {dangling}")

    def _lock(self, name: str) -> None:
        """The write lock, taken by ``BEGIN IMMEDIATE``, serialises every writer of the file already."""

    def check_held(self) -> None:
        """Some failures (an I/O error, a full disk or no memory, in some statements) make SQLite roll back the whole
        transaction, and the statements after it run on their own: caught and not raised, such a failure would let
        ``end`` commit nothing and report success."""
        if self._depth and not self.raw.in_transaction:
            self._depth = 0
            raise sqlite3.OperationalError("SQLite rolled the transaction back after a failure")

    def begin_if_free(self) -> bool:
        """Begin a transaction holding the write lock if no other connection holds it now, without waiting for it
        (the busy timeout lifted for that one statement, unless the connection rests without it); ``end`` ends it.
        False: the lock is held elsewhere (a ``ctxproxy prune``), or the file cannot be written; nothing was
        begun."""
        if self._rests_waiting:
            self.raw.execute("PRAGMA busy_timeout = 0")
        try:
            self._open(exclusive=True)
        except sqlite3.Error:
            return False
        finally:
            if self._rests_waiting:
                self.raw.execute(f"PRAGMA busy_timeout = {self._waits_ms}")
        return True

    def rest_without_waits(self) -> None:
        """The busy timeout lifted but inside ``waiting``: for a connection whose transactions mostly begin with
        ``begin_if_free`` (``store.writer``'s on a file), which set it to 0 and back around each ``BEGIN``: two
        statements of each transaction, four of a small chat request (issue #13). Once the write lock is held, no
        statement of the transaction waits for another connection in WAL mode: readers never block it, and a
        commit's own checkpoint skips what a reader holds."""
        self.raw.execute("PRAGMA busy_timeout = 0")
        self._rests_waiting = False

    @contextmanager
    def waiting(self) -> Iterator[None]:
        if self._rests_waiting:
            yield
            return
        self.raw.execute(f"PRAGMA busy_timeout = {self._waits_ms}")
        try:
            yield
        finally:
            self.raw.execute("PRAGMA busy_timeout = 0")

    def _begin(self, exclusive: bool, lock: str | None) -> None:
        self.raw.execute("BEGIN IMMEDIATE" if exclusive or lock is not None else "BEGIN")

    def _end(self, commit: bool) -> None:
        if commit:
            self.raw.commit()
        else:
            self.raw.rollback()


def _statements(ddl: str) -> Iterator[str]:
    """The statements of a script, split where SQLite says one is complete (a ``;`` in a comment is not an end)."""
    pending = ""
    for line in ddl.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            yield pending
            pending = ""
    if pending.strip() and not all(s.strip().startswith("--") or not s.strip() for s in pending.splitlines()):
        yield pending


@functools.lru_cache(maxsize=4096)
def pg_sql(sql: str) -> str:
    """``sql`` with psycopg's placeholders: each ``?`` outside a string literal or a comment becomes ``%s``, and
    every literal ``%`` is doubled (psycopg reads ``%`` as the start of a placeholder)."""
    return _TOKENS.sub(_pg_token, sql)


_TOKENS = re.compile(r"'(?:[^']|'')*'|--[^\n]*|\?|%")


def _pg_token(match: re.Match[str]) -> str:
    token = match.group(0)
    if token == "?":
        return "%s"
    return token.replace("%", "%%")


class PostgresConnection(Connection):
    """A PostgreSQL database (``url``), through psycopg 3, in autocommit outside ``with`` (a read takes no
    transaction and holds nothing). A connection the server dropped is opened again before the next statement."""

    dialect: Dialect = "postgresql"

    def __init__(self, url: str) -> None:
        super().__init__()
        import psycopg  # only a PostgreSQL journal needs the driver (the `postgresql` extra)

        self._psycopg = psycopg
        self.Error = psycopg.Error
        self.IntegrityError = psycopg.IntegrityError
        self.OperationalError = psycopg.OperationalError
        self.url = url
        self.raw = self._connect()

    def _connect(self) -> Any:
        from ctxproxy.store.pgtext import register

        raw = self._psycopg.connect(self.url, autocommit=True)
        register(raw)
        return raw

    def _live(self) -> Any:
        if (self.raw.closed or self.raw.broken) and self._depth == 0:
            self.raw.close()
            self.raw = self._connect()
        return self.raw

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        cursor: Cursor = self._live().execute(pg_sql(sql), list(params))
        return cursor

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        rows = list(rows)
        if rows:
            with self._live().cursor() as cursor:
                cursor.executemany(pg_sql(sql), rows)

    def script(self, ddl: str) -> None:
        self._live().execute(ddl)

    def tables(self) -> set[str]:
        return {r[0] for r in self.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()")}

    def close(self) -> None:
        self.raw.close()

    def check_foreign_keys(self) -> None:
        """PostgreSQL checked each statement's rows."""

    def _lock(self, name: str) -> None:
        self.execute("SELECT pg_advisory_xact_lock(?)", [lock_key(name)])

    def _begin(self, exclusive: bool, lock: str | None) -> None:
        """``BEGIN``, and the lock in the same round trip (a request's transaction starts with both)."""
        locked = "" if lock is None else f"; SELECT pg_advisory_xact_lock({lock_key(lock)})"
        self._live().execute("BEGIN" + locked)

    def _end(self, commit: bool) -> None:
        if not commit and (self.raw.closed or self.raw.broken):
            return  # the server dropped the connection: nothing of the transaction stays, and the error that ends
                    # it is the one to report
        self.raw.execute("COMMIT" if commit else "ROLLBACK")


def connect(location: Location, sync: str = "normal") -> Connection:
    """The connection for ``location`` (see ``Location``)."""
    if is_postgres(location):
        return PostgresConnection(str(location))
    return SqliteConnection(None if location is None else Path(location), sync)
