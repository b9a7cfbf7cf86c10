"""The proxy's own log: one line per chat request at info, a startup line, and the format (text or JSON).

The ``ctxproxy`` logger gets its own handler on stderr (uvicorn configures only its own loggers): without it the
info lines went nowhere and the warnings reached stderr only through Python's last-resort handler. Each request's
line carries its figures as ``record.ctx`` too, so ``log_format = "json"`` prints them as fields (one JSON object a
line, for a log shipper) where the text format prints a sentence.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ctxproxy.config import Settings
from ctxproxy.store.sql import redacted

if TYPE_CHECKING:
    from ctxproxy.proxy.observe.metrics import Metrics

__all__ = ["JsonFormatter", "configure_logging", "log", "note_refusal", "refused_line", "request_line", "startup_line"]

log = logging.getLogger("ctxproxy")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and the record's ``ctx`` fields if it has them."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                               "level": record.levelname.lower(), "logger": record.name,
                               "message": record.getMessage()}
        out |= getattr(record, "ctx", {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(settings: Settings) -> logging.Handler:
    """Give the ``ctxproxy`` logger a stderr handler in the configured format and level (``serve`` calls it)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json"
                         else logging.Formatter("%(levelname)s:     %(message)s"))  # uvicorn's own layout
    for old in [h for h in log.handlers if getattr(h, "ctxproxy", False)]:
        log.removeHandler(old)
    handler.ctxproxy = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(settings.log_level.upper())
    log.propagate = False
    return handler


def startup_line(settings: Settings) -> tuple[str, dict[str, Any]]:
    """What the operator needs to know first: where requests go, where the journal is (the data dir, or the
    PostgreSQL URL without its password), the window."""
    window = (f"{settings.ctx_window} tokens (ctx_window)" if settings.ctx_window
              else "detected from the upstream per model (else 131072; set ctx_window to fix it)")
    store = redacted(settings.store) if settings.store else None  # a password never reaches a log
    fields = {"event": "startup", "upstream": settings.upstream, "data_dir": str(settings.data_path),
              "store": store, "window": settings.ctx_window or None}
    journal = f", journal {store}" if store else ""
    return f"ctxproxy: upstream {settings.upstream}, data dir {settings.data_path}{journal}, window {window}", fields


def request_line(fields: Mapping[str, Any]) -> str:
    """The text of a request's line: ``session 2f1c… POST /v1/chat/completions 200 ok, tokens 7395 → 3100 upstream,
    cuts spill 2, retries 0, rounds 0, added 3.1 ms, total 812.4 ms``."""
    cuts = ", ".join(f"{k} {v}" for k, v in fields["cuts"].items()) or "none"
    tokens = (f"tokens {fields['tokens_in']} → {fields['tokens_out']} upstream" if fields["tokens_in"] is not None
              else "not forwarded")
    added = "-" if fields["added_ms"] is None else f"{fields['added_ms']:.1f} ms"
    return (f"session {fields['session']} {fields['route']} {fields['status']} {fields['outcome']}, {tokens}, "
            f"cuts {cuts}, retries {fields['retries']}, rounds {fields['rounds']}, added {added}, "
            f"total {fields['total_ms']:.1f} ms")


def note_refusal(metrics: Metrics, route: str, status: int, code: str | None, message: str) -> None:
    """A request refused before it had a session: its line at info, and ``ctxproxy_requests_total`` counts it
    (outcome ``refused``) like any answered one."""
    text, fields = refused_line(route, status, code, message)
    log.info(text, extra={"ctx": fields})
    metrics.answered("refused", None)


def refused_line(route: str, status: int, code: str | None, message: str) -> tuple[str, dict[str, Any]]:
    """A request refused before it had a session (a body that is not valid, too large, the loop guard): it gets
    its line too, without the figures only a session's requests have."""
    fields = {"event": "refused", "route": route, "status": status, "code": code}
    return f"refused {route} {status} {code or 'error'}: {message[:300]}", fields
