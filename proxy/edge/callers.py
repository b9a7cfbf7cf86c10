"""Who is calling and what they may reach: the session a request names, the credential that scopes it, whether it
is incognito; and the bearer tokens that guard the operator surface.

Headers arrive as bytes. Starlette decodes them as latin-1 (RFC 9110 §5.5 allows only that much), so a session id
a client sends in UTF-8 would be stored as mojibake: the session header is read from the raw bytes as UTF-8 and
echoed back (``X-Ctx-Session``) as the same bytes.

Sessions (``session_scope``). By default ("global") a session name is a name the client chooses, and anyone who
sends it joins that session, as before: several tools or sub-agents with different keys may share one named
session, a rotated key does not split a session in two, and on loopback the proxy serves one person. With
"credential", every session id (named or not) is namespaced by a digest of the caller's credential headers, so
a caller naming ``alice`` with another key gets a session of its own. The digest is a 16-hex prefix of a sha256:
enough to keep namespaces apart, nothing from which a key could be read back.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.requests import Request

from ctxproxy.config import Secret, Settings
from ctxproxy.proxy.errors import BadRequest, Unauthorized

__all__ = [
    "ADMIN_COOKIE", "MAX_SESSION_ID_CHARS", "admin_admitted", "bearer_matches", "incognito_requested",
    "requested_session", "require_admin", "require_metrics", "scoped_fingerprint",
]

MAX_SESSION_ID_CHARS = 128
"""A session id longer than this is refused (400): ids are shown in tables and headers, and are an index key."""
CREDENTIAL_HEADERS = (b"authorization", b"x-api-key", b"api-key")
"""The headers whose values identify a caller: OpenAI's bearer key, Anthropic's and Azure's key headers."""
ADMIN_COOKIE = "ctxproxy_admin"
"""The cookie the inspector page signs in with (``proxy.edge.ui``): the admin token itself, scoped to ``/ctx``."""
_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})


def incognito_requested(request: Request) -> bool:
    """``X-Ctx-Incognito``, parsed strictly: a value that is neither on nor off must not quietly mean "write it to
    disk" (``yes`` once did)."""
    value = request.headers.get("x-ctx-incognito")
    if value is None:
        return False
    word = value.strip().lower()
    if word in _ON | _OFF:
        return word in _ON
    raise BadRequest(f"Header X-Ctx-Incognito: {value!r} is neither on (1, true, yes, on) nor off (0, false, no, "
                     "off); nothing was journaled or forwarded. Send one of those values.",
                     param="X-Ctx-Incognito", code="invalid_header")


def requested_session(request: Request, settings: Settings) -> str | None:
    """The session the client names in the session header, as UTF-8 text of at most ``MAX_SESSION_ID_CHARS``,
    namespaced by the caller's credential when ``session_scope = "credential"``; None when it names none."""
    header = settings.session_header
    raw = _raw_header(request.headers.raw, header.lower().encode("latin-1"))
    if not raw:
        return None
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(f"Header {header} is not valid UTF-8. Send the session id as UTF-8 text.",
                         param=header, code="invalid_header") from None
    if len(name) > MAX_SESSION_ID_CHARS:
        raise BadRequest(f"Header {header} is {len(name)} characters long; a session id may have at most "
                         f"{MAX_SESSION_ID_CHARS}. Use a shorter name (or a hash of yours).",
                         param=header, code="invalid_header")
    if settings.session_scope == "credential":
        return f"{name}@{credential_tag(request.headers.raw)}"
    return name


def scoped_fingerprint(fingerprint: str, request: Request, settings: Settings) -> str:
    """An unnamed session's fingerprint, namespaced like a named one under ``session_scope = "credential"``."""
    if settings.session_scope != "credential":
        return fingerprint
    return hashlib.sha256(f"{credential_tag(request.headers.raw)}:{fingerprint}".encode()).hexdigest()


def credential_tag(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """``k-`` and 16 hex digits of the sha256 of the caller's credential headers (all of them, in order); a
    caller without any gets the tag of the empty credential, so it too cannot borrow another's namespace."""
    digest = hashlib.sha256()
    for name, value in headers:
        if name.lower() in CREDENTIAL_HEADERS:
            digest.update(name.lower() + b"\0" + value + b"\0")
    return "k-" + digest.hexdigest()[:16]


def bearer_matches(request: Request, *tokens: Secret | None) -> bool:
    """Whether ``Authorization: Bearer <t>`` names one of the set ``tokens`` (compared in constant time)."""
    given = _raw_header(request.headers.raw, b"authorization") or b""
    return any(token is not None and hmac.compare_digest(given, f"Bearer {token}".encode())
               for token in tokens)


def require_admin(request: Request, settings: Settings) -> None:
    """With an admin token set, the operator surface (``/ctx/*``, its OpenAPI schema) needs it: as a bearer token,
    or as the inspector page's cookie (``ADMIN_COOKIE``, set by its sign-in form; HttpOnly, SameSite=Strict, so
    another site's page cannot send it)."""
    if settings.admin_token is not None and not admin_admitted(request, settings.admin_token):
        raise Unauthorized("This operator endpoint needs `Authorization: Bearer <admin_token>` "
                           "(CTXPROXY_ADMIN_TOKEN), or the inspector's sign-in at /ctx/ui.")


def admin_admitted(request: Request, token: Secret) -> bool:
    """Whether the request carries the admin token, as a bearer token or in the inspector's cookie."""
    cookie = request.cookies.get(ADMIN_COOKIE, "").encode()
    return bearer_matches(request, token) or hmac.compare_digest(cookie, str(token).encode())


def require_metrics(request: Request, settings: Settings) -> None:
    """``/metrics`` is open only while neither token is set; a scraper may get ``metrics_token`` alone."""
    tokens = (settings.metrics_token, settings.admin_token)
    if any(t is not None for t in tokens) and not bearer_matches(request, *tokens):
        raise Unauthorized("/metrics needs `Authorization: Bearer <metrics_token>` (CTXPROXY_METRICS_TOKEN) or "
                           "the admin token.", code="invalid_metrics_token")


def _raw_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((value for key, value in headers if key.lower() == name), None)
