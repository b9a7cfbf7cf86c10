"""aiohttp as the upstream transport imports it: once, with the CA store it never reads let go (issue #13).

aiohttp's connector module builds two TLS contexts when it is imported, and both load the system's CA bundle (144
certificates here): the verifying one, for ``https`` upstreams, and the one for ``ssl=False``, which verifies
nothing and so never reads its store. The second is replaced, right after the import (before the engine and the
tokenizer are loaded over the memory it frees), by the same context without that store: 0.6 MB less idle RSS,
and a connection made with it behaves the same. The verifying one is left as it is.

``proxy.engine.state.Warmup`` imports this module on its thread; ``proxy.upstream.transport`` imports it too (a
request that comes first waits for the same import).
"""

from __future__ import annotations

import ssl

import aiohttp
import aiohttp.connector

__all__ = ["aiohttp", "unverified_context"]


def unverified_context() -> ssl.SSLContext:
    """aiohttp's context for ``ssl=False`` (``aiohttp.connector._make_ssl_context(False)``), without the CA store
    that ``CERT_NONE`` never consults."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.options |= ssl.OP_NO_SSLv2 | ssl.OP_NO_SSLv3 | ssl.OP_NO_COMPRESSION
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(("http/1.1",))
    return context


if isinstance(getattr(aiohttp.connector, "_SSL_CONTEXT_UNVERIFIED", None), ssl.SSLContext):  # aiohttp ≥ 3.10
    aiohttp.connector._SSL_CONTEXT_UNVERIFIED = unverified_context()
