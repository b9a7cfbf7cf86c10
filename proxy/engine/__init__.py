"""The turn engine: one client request, from its admission to its journaled answer.

``turn`` decides (sans-I/O: events in, commands out); ``driver`` performs the commands, the same for a buffered
answer (``buffered``) and a streamed one (``stream``); ``planning`` decides what goes upstream (window, budget,
projection, journal) and ``forward`` makes one round trip fit (overflow, retry, probe); ``exchange`` is the
request's ledger and the one place its answer is journaled;
``replies`` and ``policy`` are pure policy (over a buffered answer; the offer rule, the notices, the payload).
The HTTP edge (``proxy.edge.chat``) calls ``drive``; nothing here calls back into the edge, and the byte-level relay
(``proxy.upstream.relay``, ``proxy.upstream.streaming``) calls nothing here.

It imports none of its modules here: import the module you need.
"""
