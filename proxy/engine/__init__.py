"""The turn engine: one client request, from its admission to its journaled answer.

``turn`` decides (sans-I/O: events in, commands out); ``driver`` performs the commands, the same for a buffered
answer (``buffered``) and a streamed one (``stream``); ``forward`` makes one round trip upstream fit (plan,
overflow, retry, probe); ``exchange`` is the request's ledger and the one place its answer is journaled;
``replies`` and ``policy`` are pure policy (over a buffered answer; the offer rule, the notices, the payload).
The HTTP edge (``proxy.chat``) calls ``drive``; nothing here calls back into the edge, and the byte-level relay
(``proxy.relay``, ``proxy.streaming``) calls nothing here.

It imports none of its modules here: ``proxy.planning`` uses ``policy`` while ``forward`` uses ``proxy.planning``,
so a package that loaded its driver on import would make a cycle. Import the module you need.
"""
