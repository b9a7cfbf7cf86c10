"""The inspector page at ``/ctx/ui`` and the operator API's docs at ``/ctx/docs``: files shipped in the package.

No build step: ``proxy/edge/ui/`` holds plain HTML, JS and CSS (the chart is inline SVG drawn by the page's own script),
served as they are; every byte of data comes from the operator API (``proxy.edge.admin``, ``proxy.edge.inspect``) under
the same guard. A browser cannot send a bearer token on a page load, so with an admin token set the page first shows a
sign-in form: the token it posts is checked and kept in an HttpOnly, SameSite=Strict cookie scoped to ``/ctx``
(``proxy.edge.callers.ADMIN_COOKIE``), which the operator API accepts like the bearer token.
"""

from __future__ import annotations

import hmac
from importlib.resources import files
from urllib.parse import parse_qs

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from ctxproxy.proxy.edge.callers import ADMIN_COOKIE, admin_admitted
from ctxproxy.proxy.engine.state import AppState
from ctxproxy.proxy.errors import NotFound

__all__ = ["router"]

router = APIRouter()  # mounted at /ctx by proxy.app
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".html": "text/html; charset=utf-8"}
_HEADERS = {"cache-control": "no-cache", "x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
            "content-security-policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                       "script-src 'self'; frame-ancestors 'none'"}


def _file(name: str) -> bytes:
    return files("ctxproxy.proxy.edge").joinpath("ui", name).read_bytes()


def _page(request: Request, name: str) -> Response:
    """A page of the inspector, or the sign-in form while an admin token is set and not given."""
    state: AppState = request.app.state.ctx
    token = state.settings.admin_token
    if token is not None and not admin_admitted(request, token):
        return HTMLResponse(_file("signin.html"), status_code=401, headers=_HEADERS)
    return HTMLResponse(_file(name), headers=_HEADERS)


@router.get("/ui", include_in_schema=False)
async def inspector(request: Request) -> Response:
    return _page(request, "index.html")


@router.get("/docs", include_in_schema=False)
async def docs(request: Request) -> Response:
    """The operator API's reference, drawn from ``/ctx/openapi.json`` by a script shipped here (no CDN)."""
    return _page(request, "docs.html")


@router.get("/ui/static/{name}", include_in_schema=False)
async def static(name: str) -> Response:
    """The page's script and style sheet: public files of the package, no data in them."""
    suffix = name[name.rfind("."):] if "." in name else ""
    if suffix not in _TYPES or "/" in name or name.startswith("."):
        raise NotFound(f"No file {name!r} in the inspector.")
    try:
        body = _file(name)
    except FileNotFoundError:
        raise NotFound(f"No file {name!r} in the inspector.") from None
    return Response(body, media_type=_TYPES[suffix], headers=_HEADERS)


@router.post("/ui/signin", include_in_schema=False)
async def signin(request: Request) -> Response:
    """The sign-in form's post: a right token sets the cookie and goes to the page; a wrong one shows the form."""
    state: AppState = request.app.state.ctx
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    given = (form.get("token") or [""])[0]
    token = state.settings.admin_token
    if token is None:
        return RedirectResponse("/ctx/ui", status_code=303)
    if not hmac.compare_digest(given.encode(), str(token).encode()):
        return HTMLResponse(_file("signin.html"), status_code=401, headers=_HEADERS)
    answer = RedirectResponse("/ctx/ui", status_code=303)
    answer.set_cookie(ADMIN_COOKIE, given, path="/ctx", httponly=True, samesite="strict",
                      secure=request.url.scheme == "https")
    return answer
