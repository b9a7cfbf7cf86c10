"""A guard against a proxy whose upstream leads back to itself (``--upstream`` pointing at the proxy, or two
proxies pointing at each other).

Every request the proxy sends upstream carries ``X-Ctx-Via``: the chain of proxy instances it has passed, each
a random id drawn when the proxy starts, this one's last (like HTTP's ``Via``, RFC 9110 §7.6.3, but ours: a
client's own ``X-Ctx-*`` headers never go upstream, so the chain is only what proxies wrote). A request that
arrives carrying this instance's id, or ``MAX_HOPS`` ids, is refused with 508 ``proxy_loop`` before anything is
read or journaled; the proxy that sent it relays that answer to its client, so a loop costs one round trip
instead of recursing until something times out.
"""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers

from ctxproxy.proxy.errors import ProxyLoop

__all__ = ["MAX_HOPS", "VIA_HEADER", "new_instance", "onward", "refuse_loop"]

VIA_HEADER = "x-ctx-via"
MAX_HOPS = 8
"""Proxies a request may pass in a row, this one included: more is a loop through proxies that restarted."""


def new_instance() -> str:
    return secrets.token_hex(6)


def refuse_loop(headers: Headers, instance: str) -> None:
    chain = _chain(headers.get(VIA_HEADER, ""))
    if instance in chain:
        raise ProxyLoop(f"This request has already passed through this ctxproxy ({VIA_HEADER}: "
                        f"{', '.join(chain)}): its upstream leads back to itself. Point --upstream (CTXPROXY_UPSTREAM) "
                        "at the model server, not at the proxy.")
    if len(chain) >= MAX_HOPS:
        raise ProxyLoop(f"This request has passed {len(chain)} proxies already ({VIA_HEADER}); at most {MAX_HOPS} "
                        "may be chained. Check each proxy's --upstream for a loop.")


def onward(incoming: str, instance: str) -> tuple[bytes, bytes]:
    """The header for a request this instance sends upstream on behalf of one that came with ``incoming``."""
    return VIA_HEADER.encode(), ", ".join([*_chain(incoming), instance]).encode("latin-1")


def _chain(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]
