"""What the app holds for its lifetime: settings, the upstream, the journals, the session locks, the tokenizer.

Built by the lifespan (``proxy.edge.app``) and reached by handlers as ``request.app.state.ctx``.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import threading
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from ctxproxy.config import Settings
from ctxproxy.proxy.core import canonical_json
from ctxproxy.proxy.core.tokens import MessageCounter
from ctxproxy.proxy.engine.context import SessionContexts
from ctxproxy.proxy.engine.hashing import MessageHasher
from ctxproxy.proxy.engine.heavy import Offload
from ctxproxy.proxy.observe.events import EventBus
from ctxproxy.proxy.observe.metrics import Metrics
from ctxproxy.proxy.tools.blocks import NOTE
from ctxproxy.proxy.tools.schemas import CONTEXT_TOOLS, READ_TOOL
from ctxproxy.proxy.upstream.endpoint import Upstream
from ctxproxy.proxy.upstream.window import WindowDetector
from ctxproxy.store import JournalWriter, MemoryJournal

__all__ = ["AppState", "SessionLocks", "Warmup", "give_back_freed_memory"]


class Warmup:
    """What the first chat needs beyond a started server, loaded on a thread of its own: the modules the app names
    (the request engine, the aiohttp wire: ``proxy.edge.app.WARM``), then the message counter, whose tokenizer
    (tiktoken's cl100k) takes about 0.15 s and 25 MB.

    The lifespan starts it and the server takes requests at once (issue #13: start to ready). Nothing counts with
    a stand-in meanwhile: a chat that arrives first awaits it (``ready``), so every count is the tokenizer's own,
    cached counts included, and no budget is judged by an estimate. A thread that reaches ``counter`` first waits
    for the load. A tokenizer that cannot load gives the character estimate, as before
    (``proxy.core.tokens.load_encoding``).
    """

    def __init__(self, future: Future[MessageCounter]) -> None:
        self._future = future

    @classmethod
    def start(cls, modules: Sequence[str] = ()) -> Warmup:
        """A warm-up under way on a daemon thread: ``modules`` imported, then the counter loaded."""
        future: Future[MessageCounter] = Future()
        threading.Thread(target=_warm, args=(future, modules), name="ctxproxy-warmup", daemon=True).start()
        return cls(future)

    @property
    def counter(self) -> MessageCounter:
        return self._future.result()

    @property
    def done(self) -> bool:
        return self._future.done()

    async def ready(self) -> None:
        """Returns once the counter is there; at once after the first time."""
        if not self._future.done():
            await asyncio.wrap_future(self._future)


def _warm(future: Future[MessageCounter], modules: Sequence[str]) -> None:
    try:
        for module in modules:  # whoever needs one first meanwhile waits for this import to finish, not twice
            importlib.import_module(module)
        counter = MessageCounter()
        give_back_freed_memory()
        future.set_result(counter)
    except BaseException as exc:  # a module that fails to import fails the chats that need it, with its error
        future.set_exception(exc)


def give_back_freed_memory() -> None:
    """Hand the memory the C allocator holds free back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    glibc keeps what a thread freed in that thread's arena for reuse, and gives back only what lies at the top of
    a heap: the tokenizer's load leaves a few MB that way (its file, parsed, and the Python copy of its ranks), a
    burst of large requests far more (``proxy.edge.app``'s ``_trim_when_quiet``).
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return
    trim(0)


class SessionLocks:
    """One lock per session, so a session's requests are handled one at a time; different sessions run freely.

    A lock lives only while some request holds or waits for it: the table never grows with old sessions.
    """

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: defaultdict[str, int] = defaultdict(int)

    async def acquire(self, session_id: str) -> None:
        lock = self._locks.setdefault(session_id, asyncio.Lock())
        self._users[session_id] += 1
        try:
            await lock.acquire()
        except BaseException:
            self._forget(session_id)
            raise

    def release(self, session_id: str) -> None:
        self._locks[session_id].release()
        self._forget(session_id)

    def _forget(self, session_id: str) -> None:
        self._users[session_id] -= 1
        if self._users[session_id] == 0:
            del self._users[session_id]
            del self._locks[session_id]

    def __len__(self) -> int:
        return len(self._locks)


@dataclass
class AppState:
    settings: Settings
    upstream: Upstream
    journal: JournalWriter
    incognito_journal: JournalWriter
    windows: WindowDetector
    locks: SessionLocks = field(default_factory=SessionLocks)
    hasher: MessageHasher = field(default_factory=MessageHasher)
    warmup: Warmup = field(default_factory=Warmup.start)
    contexts: SessionContexts = field(default_factory=SessionContexts)
    events: EventBus = field(default_factory=EventBus)
    metrics: Metrics = field(default_factory=Metrics)
    offload: Offload = field(default_factory=Offload)
    own_headers: frozenset[str] = frozenset()
    _context_tools_tokens: int | None = None

    @property
    def counter(self) -> MessageCounter:
        """Token counts of messages, cached by identity (waits for the tokenizer the first time: ``Warmup``)."""
        return self.warmup.counter

    def context_tools_tokens(self) -> int:
        """What the context tools' schemas cost when offered (counted once)."""
        if self._context_tools_tokens is None:
            self._context_tools_tokens = self.counter.count_text(canonical_json(list(CONTEXT_TOOLS)).decode())
        return self._context_tools_tokens

    def fenced_note_tokens(self) -> int:
        """What the fenced route's note with the context blocks' syntax costs (its stand-in for the schemas)."""
        return self.counter.count_text(NOTE)

    def read_tool_tokens(self) -> int:
        """What ``read_overflow``'s schema costs, listed alone once the session holds a stub."""
        return self.counter.count_text(canonical_json([READ_TOOL]).decode())

    def journal_for(self, incognito: bool) -> JournalWriter:
        if not (incognito or self.settings.incognito):
            return self.journal
        journal = self.incognito_journal.journal
        while isinstance(journal, MemoryJournal) and journal.forgotten:  # its bound forgot them: so does the proxy
            self.contexts.drop(self.incognito_journal, journal.forgotten.popleft())
        return self.incognito_journal
