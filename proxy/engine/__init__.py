"""The turn engine: one client request, from its admission to its journaled answer.

``turn`` decides (sans-I/O: events in, commands out); ``driver`` performs the commands, the same for a buffered
answer (``buffered``) and a streamed one (``stream``); ``forward`` makes one round trip upstream fit (plan,
overflow, retry, probe); ``exchange`` is the request's ledger and the one place its answer is journaled;
``replies`` is pure policy over a buffered answer. The HTTP edge (``proxy.chat``) calls ``drive``; nothing here
calls back into the edge, and the byte-level relay (``proxy.relay``, ``proxy.streaming``) calls nothing here.
"""

from proxy.engine.driver import drive
from proxy.engine.exchange import SESSION_RESPONSE_HEADER, Exchange, now
from proxy.engine.replies import compact_request

__all__ = ["SESSION_RESPONSE_HEADER", "Exchange", "compact_request", "drive", "now"]
