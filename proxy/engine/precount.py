"""A request's newest tool results counted on a thread while the request is journaled.

Why: tiktoken takes ~0.15 ms a KB on this project's machine, and a result below the spill threshold is counted by
the projection, on the request's path: at 128k a 10 KB result is ~1 ms of a 4.5 ms request, and the requests that
fold are the ones a large result pushed over the budget (issue #13: no request above twice the median). Between
the parse and the projection the request is journaled, its session locked and its context loaded; tiktoken lets
go of the GIL while it encodes, so the count runs beside them, on the other core, and the projection finds it in
the counter's cache (``MessageCounter`` is shared with the worker threads already).

Only what the projection would count as it came: a tool result not counted yet, from ``PRECOUNT_CHARS`` up to
the spill threshold of the window known now (a result that spills is never counted, its stub is), not binary.
Nothing when the window or the tokenizer is not there yet. A count is keyed by the message's hash, so counting it
here can only save time, never change a figure; the request waits for it (``counted``) before it projects, so no
result is counted twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ctxproxy.proxy.core.budget import MIN_CUT_CHARS
from ctxproxy.proxy.core.stubs import looks_binary
from ctxproxy.proxy.wire import ChatBody, ChatMessage

if TYPE_CHECKING:
    from ctxproxy.proxy.core.tokens import MessageCounter
    from ctxproxy.proxy.engine.state import AppState

__all__ = ["PRECOUNT_CHARS", "TAIL", "counted", "precount"]

PRECOUNT_CHARS = 2048
"""A result this long (~0.3 ms of counting here) is counted on a thread; a shorter one costs about what the hop
does."""

TAIL = 8
"""The last messages looked at: a request's new results are at its end."""


def precount(app: AppState, body: ChatBody, hashes: Sequence[str]) -> asyncio.Future[None] | None:
    """Start counting the request's new, unspilled large results on a thread; None if there is none to count."""
    messages = body["messages"]
    tail = range(len(messages) - min(TAIL, len(messages), len(hashes)), len(messages))
    long = [i for i in tail if _long_result(messages[i])]
    spill = _spill_chars(app, body.get("model")) if long and app.warmup.done else None
    if spill is None:
        return None
    counter = app.counter
    chosen = [(messages[i], hashes[i]) for i in long
              if _counted_as_it_came(messages[i], spill) and counter.cached(hashes[i]) is None]
    if not chosen:
        return None
    return asyncio.get_running_loop().run_in_executor(None, _count, counter, chosen)


async def counted(pending: asyncio.Future[None] | None) -> None:
    """Once the counts started by ``precount`` are in the cache (a failure among them is the projection's to
    meet again: it counts the message itself)."""
    if pending is not None:
        await asyncio.wait([pending])


def _spill_chars(app: AppState, model: str | None) -> int | None:
    """The spill threshold of ``model``'s window as planning will take it, if that window is known without asking."""
    window = app.settings.for_model(model).ctx_window or app.windows.known(model)
    if window is None:
        return None
    window = min(window, app.contexts.window_limits.get(model, window))
    return app.budget(model, window).spill_chars


def _long_result(message: Any) -> bool:
    """A tool result whose text is ``PRECOUNT_CHARS`` long or more."""
    return (isinstance(message, dict) and message.get("role") == "tool" and isinstance(message.get("content"), str)
            and len(message["content"]) >= PRECOUNT_CHARS)


def _counted_as_it_came(message: ChatMessage, spill: int) -> bool:
    """A long result the projection will count whole: one ``proxy.core.project._should_spill`` keeps."""
    content = message["content"]
    assert isinstance(content, str)  # ``_long_result``
    return len(content) < MIN_CUT_CHARS or (len(content) < spill and not looks_binary(content))


def _count(counter: MessageCounter, chosen: list[tuple[ChatMessage, str]]) -> None:
    try:
        for message, key in chosen:
            counter.count(message, key)
    except Exception:  # the projection counts the message itself, and meets the failure there
        pass
