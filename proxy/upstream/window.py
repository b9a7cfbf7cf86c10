"""The model's physical context window: from settings, or asked of the upstream once per model (DESIGN.md §3).

Why: every budget threshold is capped by the window, and ``ctx_window = auto`` (stored as 0) must work with
whatever server is behind the proxy without the user looking the number up.

How, in order (the first usable answer wins):

1. ``GET <base>/models`` — vLLM lists ``max_model_len`` per model; ``context_length`` and ``meta.n_ctx`` are
   accepted too. The entry whose ``id`` is the requested model wins; if the model is not listed (or is None) and
   exactly one entry carries a window, that one is used.
2. ``GET <root>/props``, root being the base without its trailing ``/v1`` — llama.cpp's ``llama-server`` reports
   ``default_generation_settings.n_ctx`` (older builds: a top-level ``n_ctx``).
3. Otherwise 131072 (``source="default"``). llama-cpp-python's server lands here: it reports no window anywhere.

A transport error, a non-200 answer, bad JSON or a missing field is not an error, only a reason to try the next
source. The requests carry no client headers (so no credentials: an upstream that wants a key answers 401 and the
default is used) and ask for an uncompressed body. Each model is detected once; the answer, the default included,
is cached so a dead upstream is not asked on every request; ``forget`` lets a later caller ask again. Concurrent
callers for the same model wait on one per-model lock, so they cause a single detection.

One exception (issue #11): when no source answered at all — the connection failed or timed out, or the answer was
a 5xx, as a model server gives while it is still loading (llama.cpp's 503) — the default is used for now but not
kept: the upstream is asked again on a later request, after a backoff that doubles from ``RETRY_FIRST`` to
``RETRY_MAX`` seconds, so a proxy started before its model server learns the real window once that is up.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ctxproxy.proxy.errors import CtxError
from ctxproxy.proxy.upstream.endpoint import Upstream

__all__ = ["DEFAULT_WINDOW", "DETECT_TIMEOUT", "RETRY_FIRST", "RETRY_MAX", "Window", "WindowDetector",
           "props_window", "vllm_window"]

DEFAULT_WINDOW = 131072
DETECT_TIMEOUT = 10.0  # seconds, connect and read: a server that is up answers these in milliseconds
RETRY_FIRST, RETRY_MAX = 1.0, 60.0  # seconds before an upstream that could not answer is asked again
_HEADERS = [(b"accept-encoding", b"identity")]
_MODEL_FIELDS = (("max_model_len",), ("context_length",), ("meta", "n_ctx"))


@dataclass(frozen=True)
class Window:
    tokens: int
    source: str  # "settings", "vllm /models", "llama.cpp /props" or "default"


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _field(data: Any, path: tuple[str, ...]) -> int | None:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return _positive(data)


def _entry_window(entry: Any) -> int | None:
    for path in _MODEL_FIELDS:
        if (tokens := _field(entry, path)) is not None:
            return tokens
    return None


def vllm_window(answer: Any, model: str | None) -> int | None:
    """The window in a ``/models`` answer: the requested model's entry, else the only entry that has one."""
    entries = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(entries, list):
        return None
    entries = [e for e in entries if isinstance(e, dict)]
    if mine := [e for e in entries if model is not None and e.get("id") == model]:
        return _entry_window(mine[0])
    windows = [w for w in map(_entry_window, entries) if w is not None]
    return windows[0] if len(windows) == 1 else None


def props_window(answer: Any) -> int | None:
    """The window in a llama.cpp ``/props`` answer (``default_generation_settings.n_ctx``, or old ``n_ctx``)."""
    return _field(answer, ("default_generation_settings", "n_ctx")) or _field(answer, ("n_ctx",))


_NOT_READY = object()
"""What ``_get_json`` returns when the upstream could not answer: unreachable, timed out, or a 5xx."""


async def _get_json(upstream: Upstream, path: str) -> Any:
    """``GET`` ``path`` and its JSON; None for an answer without one (status, body); ``_NOT_READY`` for none."""
    try:
        response = await upstream.send("GET", path, "", list(_HEADERS), b"")
        try:
            body = await response.aread()
        finally:
            await response.aclose()
    except (CtxError, httpx.HTTPError):
        return _NOT_READY
    if response.status_code >= 500:
        return _NOT_READY
    try:
        return json.loads(body) if response.status_code == 200 else None
    except ValueError:  # bad JSON or bad UTF-8
        return None


class WindowDetector:
    """``window_for(model)``: the configured window, or the upstream's answer, detected once per model (asked again,
    with backoff, while the upstream could not answer)."""

    def __init__(self, upstream: Upstream, ctx_window: int, timeout: float = DETECT_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._configured = ctx_window
        base = upstream.base.rstrip("/")
        self._api = Upstream(base, upstream.transport, timeout, timeout)
        self._root = Upstream(base.removesuffix("/v1"), upstream.transport, timeout, timeout)
        self._cache: dict[str | None, Window] = {}
        self._locks: dict[str | None, asyncio.Lock] = {}
        self._clock = clock
        self._retry: dict[str | None, tuple[float, float]] = {}
        """Models whose cached answer is the default because the upstream could not answer: (when, next delay)."""

    async def window_for(self, model: str | None) -> Window:
        if self._configured:
            return Window(self._configured, "settings")
        if (known := self._cache.get(model)) is not None and not self._due(model):
            return known
        async with self._locks.setdefault(model, asyncio.Lock()):
            if (known := self._cache.get(model)) is None or self._due(model):  # not done by the lock's last holder
                known = self._cache[model] = await self._detect(model)
            return known

    def forget(self, model: str | None) -> None:
        """Drop the cached answer for ``model``; the next caller detects again."""
        self._cache.pop(model, None)
        self._retry.pop(model, None)

    def _due(self, model: str | None) -> bool:
        """Is the cached default, used while the upstream could not answer, due to be asked again?"""
        retry = self._retry.get(model)
        return retry is not None and self._clock() >= retry[0]

    async def _detect(self, model: str | None) -> Window:
        models = await _get_json(self._api, "/models")
        if (tokens := vllm_window(models, model)) is not None:
            return self._found(model, Window(tokens, "vllm /models"))
        props = await _get_json(self._root, "/props")
        if (tokens := props_window(props)) is not None:
            return self._found(model, Window(tokens, "llama.cpp /props"))
        if models is _NOT_READY and props is _NOT_READY:
            delay = self._retry[model][1] if model in self._retry else RETRY_FIRST
            self._retry[model] = (self._clock() + delay, min(delay * 2, RETRY_MAX))
            return Window(DEFAULT_WINDOW, "default")
        return self._found(model, Window(DEFAULT_WINDOW, "default"))

    def _found(self, model: str | None, window: Window) -> Window:
        self._retry.pop(model, None)
        return window
