"""What the app holds for its lifetime: settings, the upstream, the journals, the session locks, the tokenizer.

Built by the lifespan (``proxy.edge.app``) and reached by handlers as ``request.app.state.ctx``.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import importlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from ctxproxy.config import Settings
from ctxproxy.proxy.core.identity import canonical_json
from ctxproxy.proxy.engine.heavy import Offload
from ctxproxy.proxy.errors import StorageError, storage_error
from ctxproxy.proxy.observe.events import EventBus
from ctxproxy.proxy.observe.metrics import Metrics
from ctxproxy.proxy.tools.blocks import NOTE
from ctxproxy.proxy.tools.schemas import CONTEXT_TOOLS, READ_TOOL
from ctxproxy.store import JournalWriter, LocalLocks, LockUnavailable, MemoryJournal, SessionLocking

if TYPE_CHECKING:
    import httpx

    from ctxproxy.proxy.core.budget import Budget
    from ctxproxy.proxy.core.tokens import MessageCounter
    from ctxproxy.proxy.engine.context import SessionContexts
    from ctxproxy.proxy.engine.hashing import MessageHasher
    from ctxproxy.proxy.upstream.endpoint import Upstream
    from ctxproxy.proxy.upstream.window import WindowDetector

__all__ = ["AppState", "SessionLocks", "Warmup", "give_back_freed_memory", "one_malloc_arena"]

BUDGETS_KEPT = 256
"""(model, window) budgets ``AppState.budget`` keeps; beyond, it starts afresh."""


class Warmup:
    """What the first chat needs beyond a started server, loaded on a thread of its own: the modules the app names
    (the request engine and the fronts: ``proxy.edge.app.WARM``), the text protocols' presets (8-9 ms of regular
    expressions), then the message counter, whose tokenizer (tiktoken's cl100k) takes about 0.15 s and 25 MB.

    The lifespan starts it and the server takes requests at once (issue #13: start to ready). Nothing counts with
    a stand-in meanwhile: a chat that arrives first awaits it (``ready``), so every count is the tokenizer's own,
    cached counts included, and no budget is judged by an estimate. A thread that reaches ``counter`` first waits
    for the load. A tokenizer that cannot load gives the character estimate, as before
    (``proxy.core.tokens.load_encoding``).
    """

    def __init__(self, future: Future[MessageCounter]) -> None:
        self._future = future
        self._counter: MessageCounter | None = None

    @classmethod
    def start(cls, modules: Sequence[str] = ()) -> Warmup:
        """A warm-up under way on a daemon thread: ``modules`` imported, then the counter loaded."""
        future: Future[MessageCounter] = Future()
        threading.Thread(target=_warm, args=(future, modules), name="ctxproxy-warmup", daemon=True).start()
        return cls(future)

    @property
    def counter(self) -> MessageCounter:
        """The counter, once loaded: asked several times a request, the future's ``result`` takes its lock each time."""
        counter = self._counter
        if counter is None:
            counter = self._counter = self._future.result()
        return counter

    @property
    def done(self) -> bool:
        return self._future.done()

    async def ready(self) -> None:
        """Returns once the counter is there; at once after the first time."""
        if not self._future.done():
            await asyncio.wrap_future(self._future)


def _warm(future: Future[MessageCounter], modules: Sequence[str]) -> None:
    try:
        from ctxproxy.proxy.core.fenced import builtin_presets
        from ctxproxy.proxy.core.tokens import MessageCounter

        for module in modules:  # whoever needs one first meanwhile waits for this import to finish, not twice
            importlib.import_module(module)
        builtin_presets()  # the text protocols' expressions, compiled here rather than on the first chat's path
        counter = MessageCounter()
        give_back_freed_memory()
        freeze_what_started()
        future.set_result(counter)
    except BaseException as exc:  # a module that fails to import fails the chats that need it, with its error
        future.set_exception(exc)


M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter for the most arenas its ``malloc`` keeps (``MALLOC_ARENA_MAX``)."""


def one_malloc_arena() -> None:
    """Have every thread of this process allocate from glibc's main arena (elsewhere nothing).

    glibc gives each new thread that allocates its own arena: the warm-up thread, which loads the tokenizer, and
    the worker threads keep theirs, with what was freed in them, after they are done (2.2 MB idle, issue #13).
    The proxy's threads run Python and so hold the GIL for most of their allocations: one arena costs no
    contention that matters. Call it before any thread starts: a thread keeps the arena it already has.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return
    mallopt(M_ARENA_MAX, 1)


def freeze_what_started() -> None:
    """Leave what the start made (the modules, the app, the tokenizer's tables) out of the cyclic garbage
    collector's passes from now on (``gc.freeze``): it lives as long as the process, and each full collection
    walked it all, ~69 000 objects and the references they hold, to find nothing. Such a collection comes once or
    twice in a 600-round run, on whichever request's path: 10-12 ms of it (30 ms in process); the request's own
    objects alone take 1.2 ms (issue #13: no request above 2× the median). Reference counting still frees what the
    start made and drops; only cycles among it would stay. Once a process: a later app in it (tests start many)
    would freeze the garbage the earlier ones left."""
    if not gc.get_freeze_count():
        gc.freeze()


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

    The backend is the store's (``store.locks``): this process's own for SQLite, PostgreSQL's advisory locks, which
    hold across replicas, for a PostgreSQL store. A lock server that cannot be reached refuses the request (503):
    a request never runs without its lock.
    """

    def __init__(self, backend: SessionLocking | None = None) -> None:
        self._backend = backend if backend is not None else LocalLocks()  # one with no lock held is falsy

    async def acquire(self, session_id: str) -> None:
        try:
            await self._backend.acquire(session_id)
        except LockUnavailable as exc:
            raise StorageError(str(exc)) from exc

    def release(self, session_id: str) -> None:
        self._backend.release(session_id)

    def close(self) -> None:
        self._backend.close()

    def __len__(self) -> int:
        return len(self._backend)


Built = TypeVar("Built")


class BuiltOnFirstUse(Generic[Built]):
    """An attribute built from its instance the first time it is read (under a lock: the operator API reads from
    worker threads; reentrant, as one part is built from another), then an instance attribute like any other.

    Its module is imported then, not when the server starts: the first chat reads it after the warm-up has imported
    the engine and the upstream client (``Warmup``), so it is there already (issue #13: start to ready).
    Not ``functools.cached_property``: from Python 3.12 it takes no lock, and two threads could each build one.
    """

    _lock = threading.RLock()

    def __init__(self, make: Callable[[Any], Built]) -> None:
        self._make = make
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> BuiltOnFirstUse[Built]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> Built: ...

    def __get__(self, instance: object | None, owner: type | None = None) -> Built | BuiltOnFirstUse[Built]:
        if instance is None:  # read on the class (``inspect``, documentation tools): the descriptor itself
            return self
        with self._lock:
            built: Built | None = instance.__dict__.get(self._name)
            if built is None:
                built = instance.__dict__[self._name] = self._make(instance)
        return built


def _new_hasher(state: AppState) -> MessageHasher:
    from ctxproxy.proxy.engine.hashing import MessageHasher

    return MessageHasher()


def _new_contexts(state: AppState) -> SessionContexts:
    from ctxproxy.proxy.engine.context import SessionContexts

    return SessionContexts()


def _new_upstream(state: AppState) -> Upstream:
    """httpx and the proxy's client on it take ~25 ms to import: neither is needed to take connections."""
    from ctxproxy.proxy.upstream.endpoint import Upstream
    from ctxproxy.proxy.upstream.transport import Http1Transport

    settings = state.settings
    return Upstream(settings.upstream, state.transport or Http1Transport(), settings.upstream_connect_timeout,
                    settings.upstream_timeout)


def _new_windows(state: AppState) -> WindowDetector:
    from ctxproxy.proxy.upstream.window import WindowDetector

    return WindowDetector(state.upstream, ctx_window=0)  # a configured window is applied per model, in planning


@dataclass
class AppState:
    settings: Settings
    journal: JournalWriter
    transport: httpx.AsyncBaseTransport | None = None
    """What the upstream is reached through; None: ``proxy.upstream.transport.Http1Transport``."""
    locks: SessionLocks = field(default_factory=SessionLocks)
    warmup: Warmup = field(default_factory=Warmup.start)
    events: EventBus = field(default_factory=EventBus)
    metrics: Metrics = field(default_factory=Metrics)
    offload: Offload = field(default_factory=Offload)
    own_headers: frozenset[str] = frozenset()
    _fixed: dict[str, tuple[MessageCounter, int]] = field(default_factory=dict)
    _budgets: dict[tuple[str | None, int], Budget] = field(default_factory=dict)
    _incognito: JournalWriter | None = None
    _incognito_lock: threading.Lock = field(default_factory=threading.Lock)
    hasher = BuiltOnFirstUse(_new_hasher)
    """Message identities and the prefixes of the lists seen (``proxy.engine.hashing``)."""
    contexts = BuiltOnFirstUse(_new_contexts)
    """Each session's cuts, state and calibration, loaded from the journal when needed (``proxy.engine.context``)."""
    upstream = BuiltOnFirstUse(_new_upstream)
    """The upstream endpoint and its connection pool (``proxy.upstream.endpoint``)."""
    windows = BuiltOnFirstUse(_new_windows)
    """Each model's context window, asked of the upstream once (``proxy.upstream.window``)."""

    async def close_upstream(self) -> None:
        """Close the upstream's connections, if it was ever asked for."""
        upstream = self.__dict__.get("upstream")
        if upstream is not None:
            await upstream.aclose()

    @property
    def incognito_journal(self) -> JournalWriter:
        """The in-memory journal of incognito requests, opened when first asked for: its SQLite database and
        migrations took 9 ms of every start, and most servers never see such a request."""
        with self._incognito_lock:  # the operator API's threads ask too
            if self._incognito is None:
                self._incognito = JournalWriter(MemoryJournal(self.settings.incognito_max_bytes,
                                                              self.settings.incognito_max_age), storage_error)
            return self._incognito

    def close_incognito(self) -> None:
        """Close the in-memory journal, if it was opened (the lifespan closes the one it opened)."""
        if self._incognito is not None:
            self._incognito.close()

    @property
    def counter(self) -> MessageCounter:
        """Token counts of messages, cached by identity (waits for the tokenizer the first time: ``Warmup``)."""
        return self.warmup.counter

    def context_tools_tokens(self) -> int:
        """What the context tools' schemas cost when offered (counted once)."""
        return self._fixed_tokens("tools", lambda: canonical_json(list(CONTEXT_TOOLS)).decode())

    def fenced_note_tokens(self) -> int:
        """What the fenced route's note with the context blocks' syntax costs (its stand-in for the schemas)."""
        return self._fixed_tokens("note", lambda: NOTE)

    def read_tool_tokens(self) -> int:
        """What ``read_overflow``'s schema costs, listed alone once the session holds a stub."""
        return self._fixed_tokens("read", lambda: canonical_json([READ_TOOL]).decode())

    def _fixed_tokens(self, name: str, text: Callable[[], str]) -> int:
        """Tokens of a text of the proxy's own, counted once per counter: every request of a session with a stub,
        or on the fenced route, asks (the schema of ``read_overflow`` was 6% of a small request's time)."""
        counter = self.counter
        cached = self._fixed.get(name)
        if cached is None or cached[0] is not counter:
            cached = self._fixed[name] = (counter, counter.count_text(text()))
        return cached[1]

    def budget(self, model: str | None, window: int) -> Budget:
        """The budget of ``model``'s settings on a window of ``window`` tokens, worked out once per model and window
        (the settings never change; building it was 1.5% of a small request's time)."""
        key = (model, window)
        budget = self._budgets.get(key)
        if budget is None:
            if len(self._budgets) >= BUDGETS_KEPT:
                self._budgets.clear()
            from ctxproxy.proxy.engine.budgets import budget_for

            budget = self._budgets[key] = budget_for(self.settings.for_model(model), window)
        return budget

    def journal_for(self, incognito: bool) -> JournalWriter:
        if not (incognito or self.settings.incognito):
            return self.journal
        journal = self.incognito_journal.journal
        while isinstance(journal, MemoryJournal) and journal.forgotten:  # its bound forgot them: so does the proxy
            self.contexts.drop(self.incognito_journal, journal.forgotten.popleft())
        return self.incognito_journal
