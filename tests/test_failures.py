"""Storage failures say which file and what to do: a corrupt or read-only journal at start, a full disk or a
broken file while serving, and the CLI's reading commands on any of them (issue #10, item 7)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from ctxproxy.config import load_settings
from ctxproxy.proxy.errors import StorageError, StorageFull, storage_error
from ctxproxy.store import Journal, JournalUnavailable, JournalWriter, open_journal
from tests.conftest import app_client, chat
from tests.fakes import FakeUpstream, receive_body
from tests.test_journal import incoming, record, run

CTXPROXY = str(Path(sys.executable).with_name("ctxproxy"))
PAGE = 4096


def _journal_with_rows(data: Path, rounds: int = 40) -> Path:
    path = data / "journal.db"
    journal = Journal(path)
    for i, messages in enumerate(run(rounds, result="x" * 400)):
        record(journal, incoming(messages, n=i % 60))
    journal.close()  # the last connection's close checkpoints the WAL into the file
    return path


def _corrupt(path: Path, from_page: int, pages: int) -> None:
    """Garbage over ``pages`` pages from ``from_page`` (0-based): a bad sector, a torn copy."""
    with path.open("r+b") as f:
        f.seek(from_page * PAGE)
        f.write(b"\xa5" * (pages * PAGE))


def _ctxproxy(*args: str, data: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXPROXY_")}
    return subprocess.run([CTXPROXY, *args, "--data-dir", str(data)], env=env, capture_output=True, text=True,
                          timeout=60)


def _refused(result: subprocess.CompletedProcess[str], path: Path, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert str(path) in result.stderr and all(w in result.stderr for w in words), result.stderr


def test_serve_refuses_a_journal_with_a_corrupt_page_naming_it_and_the_fix(tmp_path: Path) -> None:
    path = _journal_with_rows(tmp_path)
    _corrupt(path, from_page=path.stat().st_size // PAGE // 2, pages=1)
    _refused(_ctxproxy("serve", "--port", "9", data=tmp_path), path, "corrupt", "backup", "move them aside")


def test_the_app_refuses_to_start_on_a_corrupt_journal(tmp_path: Path) -> None:
    path = _journal_with_rows(tmp_path)
    _corrupt(path, from_page=path.stat().st_size // PAGE // 2, pages=1)
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1"})
    with pytest.raises(JournalUnavailable, match="is corrupt"), \
            app_client(settings, httpx.ASGITransport(app=FakeUpstream())):
        pass


def test_quick_check_finds_a_corrupt_page_that_opening_does_not_touch(tmp_path: Path) -> None:
    path = _journal_with_rows(tmp_path)
    pristine = path.read_bytes()
    for page in range(len(pristine) // PAGE - 1, 1, -1):  # the last pages hold data, not the schema
        path.write_bytes(pristine)
        _corrupt(path, from_page=page, pages=1)
        with contextlib.suppress(JournalUnavailable):
            open_journal(path).close()  # opens: the damage is where only a query (or the check) would look
            break
    with pytest.raises(JournalUnavailable, match="quick_check") as caught:
        open_journal(path, check=True)
    assert caught.value.kind == "corrupt" and str(path) in str(caught.value)


@pytest.mark.parametrize("command", [["sessions"], ["show", "s-1"], ["scorecard"], ["serve", "--port", "9"]])
def test_a_file_that_is_not_a_journal_is_one_clear_line(tmp_path: Path, command: list[str]) -> None:
    path = tmp_path / "journal.db"
    path.write_bytes(os.urandom(8 * PAGE))
    _refused(_ctxproxy(*command, data=tmp_path), path, "corrupt")


@contextlib.contextmanager
def read_only(target: Path) -> Iterator[None]:
    """``target`` (a directory and its files, or one file) read-only for this process: a read-only bind mount for
    root (whom modes do not stop), the modes otherwise."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [target, *(target.iterdir() if target.is_dir() else [])]}
        for p in modes:
            p.chmod(0o555 if p.is_dir() else 0o444)
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    mounted = subprocess.run(f"mount --bind {target} {target} && mount -o remount,ro,bind {target}",
                             shell=True, capture_output=True, check=False)
    if mounted.returncode:
        pytest.skip(f"cannot mount read-only: {mounted.stderr.decode().strip()}")
    try:
        yield
    finally:
        _unmount(target)


def _unmount(directory: Path) -> None:
    for _ in range(50):  # busy while a process we started still closes its files
        if subprocess.run(["umount", str(directory)], capture_output=True, check=False).returncode == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"could not unmount {directory}")


@pytest.mark.parametrize("command", [["sessions"], ["scorecard"], ["serve", "--port", "9"]])
def test_a_read_only_data_dir_is_one_clear_line(tmp_path: Path, command: list[str]) -> None:
    data = tmp_path / "data"
    path = _journal_with_rows(data, rounds=2)
    with read_only(data):
        _refused(_ctxproxy(*command, data=data), path, "read-only", "writable")


def test_a_read_only_journal_file_is_refused_at_start_not_at_the_first_request(tmp_path: Path) -> None:
    path = _journal_with_rows(tmp_path, rounds=2)
    with read_only(path):
        _refused(_ctxproxy("serve", "--port", "9", data=tmp_path), path, "read-only", "writable")


@contextlib.contextmanager
def small_disk(directory: Path, size: str = "2m") -> Iterator[Path]:
    """A real file system of ``size`` at ``directory`` (tmpfs: root only)."""
    directory.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                             capture_output=True, check=False)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        _unmount(directory)


def _fill(path: Path) -> None:
    """Write ``path`` until the disk has not one page left."""
    with path.open("wb", buffering=0) as f:
        for chunk in (1 << 16, 1 << 12):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


def test_a_full_disk_is_507_storage_full_and_the_proxy_recovers_once_there_is_room(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "4m") as disk:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(disk / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1"})
        fake = FakeUpstream()
        with app_client(settings, httpx.ASGITransport(app=fake)) as client:
            assert client.post("/v1/chat/completions", json=chat("hello")).status_code == 200
            log = (disk / "data" / "journal.db-wal").stat().st_size
            _fill(disk / "filler")
            # larger than the whole log: a checkpoint that reset it (on an idle machine, often before this) leaves
            # its pages to be written over, and only a request that outgrows them needs the disk
            big = "a fresh paste:\n\n" + os.urandom(log // 2 + 32_768).hex() + "\n\nThat is all."  # cut to overflow
            full = client.post("/v1/chat/completions", json=chat(big))
            assert full.status_code == 507, full.text
            error = full.json()["error"]
            assert error["code"] == "storage_full" and str(disk / "data" / "journal.db") in error["message"]
            assert len(fake.chats) == 1  # nothing forwarded unjournaled
            assert client.get("/healthz").status_code == 200
            (disk / "filler").unlink()
            again = client.post("/v1/chat/completions", json=chat(big))
            assert again.status_code == 200, again.text
            assert client.get("/ctx/sessions").json()["sessions"]


class FillingUpstream(FakeUpstream):
    """The fake upstream, except that a chat saying ``fill the disk`` fills it before the answer: the request's
    row is written, its answer's row cannot be."""

    def __init__(self, filler: Path) -> None:
        super().__init__()
        self.filler = filler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await receive_body(receive) if scope["type"] == "http" else b""
        if b"fill the disk" in body:
            _fill(self.filler)

        async def replay() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        await super().__call__(scope, replay if scope["type"] == "http" else receive, send)


def test_an_answer_the_full_disk_kept_out_is_journaled_once_there_is_room_and_the_session_continues(
        tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk") as disk:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(disk / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1"})
        with app_client(settings, httpx.ASGITransport(app=FillingUpstream(disk / "filler"))) as client:
            first = client.post("/v1/chat/completions", json=chat("please fill the disk " + "x" * 30_000))
            assert first.status_code == 200, first.text  # journaled before the body leaves, yet the body still goes out
            assert first.json()["choices"][0]["message"]["content"]
            (disk / "filler").unlink()
            second = client.post("/v1/chat/completions", json=chat("please fill the disk " + "x" * 30_000,
                                                                    "echo: done", "and now?"))
            assert second.status_code == 200, second.text
            assert second.headers["x-ctx-session"] == first.headers["x-ctx-session"]  # continued, not forked
        journal = Journal(disk / "data" / "journal.db")
        answered = journal.request(1)
        journal.close()
        assert answered is not None and [r["outcome"] for r in answered["responses"]] == ["ok"]


def test_a_journal_call_that_hits_a_full_database_raises_storage_full(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    pages = journal.conn.execute("PRAGMA page_count").fetchone()[0]
    journal.conn.execute(f"PRAGMA max_page_count = {pages + 2}")  # SQLite's own SQLITE_FULL, no root needed
    writer = JournalWriter(journal, storage_error)
    with pytest.raises(StorageFull, match=str(tmp_path / "journal.db")) as caught:
        asyncio.run(writer.call(Journal.record_request, incoming(run(40, result="y" * 2000)[-1])))
    assert caught.value.status == 507
    writer.close()


def test_a_page_that_breaks_while_serving_is_503_storage_error_naming_the_file(tmp_path: Path) -> None:
    path = _journal_with_rows(tmp_path)
    journal = open_journal(path)  # opened and read before the damage: its cache holds the schema only
    _corrupt(path, from_page=2, pages=path.stat().st_size // PAGE - 2)
    writer = JournalWriter(journal, storage_error)
    with pytest.raises(StorageError, match="corrupt") as caught:
        asyncio.run(writer.call(Journal.sessions))
    assert caught.value.status == 503 and caught.value.code == "storage_error" and str(path) in caught.value.message
    writer.close()


def test_the_writer_alone_raises_the_stores_own_error_and_names_no_http_status(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    pages = journal.conn.execute("PRAGMA page_count").fetchone()[0]
    journal.conn.execute(f"PRAGMA max_page_count = {pages + 2}")
    writer = JournalWriter(journal)  # the store's default: its own error, the proxy's mapping is the proxy's
    with pytest.raises(JournalUnavailable, match=str(tmp_path / "journal.db")) as caught:
        asyncio.run(writer.call(Journal.record_request, incoming(run(40, result="y" * 2000)[-1])))
    assert caught.value.kind == "full" and not isinstance(caught.value, StorageFull)
    writer.close()
