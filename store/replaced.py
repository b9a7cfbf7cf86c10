"""The replacement texts decisions hold by reference (``m013``), read back and kept by the hash that names them.

A decision whose replacement is the whole content of a forwarded message names that message; reading it back
looks the message up and decodes its content: ~5 ms more than reading the text from the decision's own row for
the 929 decisions of a 600-round session. A session is read back whole each time a process loads it (a restart,
an eviction, and on a shared store every request a replica takes over from another), and its decisions only grow:
so the texts are kept here, by hash (content-addressed: a hash always names the same text), least recently used
first out beyond ``MAX_CHARS``. A reload then looks up only the texts it has not read before. The strings are the
ones the loaded decisions hold, not copies. Per ``Journal`` (one thread's connection); emptied by a prune and by the
incognito journal's forgetting, so a text removed from the journal is not kept here either.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import orjson

from ctxproxy.store.sql import Connection

__all__ = ["MAX_CHARS", "ReplacedTexts"]

MAX_CHARS = 4_000_000
"""About two 600-round sessions' texts (1.8 MB at 128k)."""


class ReplacedTexts:
    def __init__(self, max_chars: int = MAX_CHARS) -> None:
        self.max_chars = max_chars
        self._texts: OrderedDict[str, str] = OrderedDict()
        self._chars = 0

    def read(self, conn: Connection, hashes: Iterable[str]) -> dict[str, str]:
        """The content of each message of ``hashes`` (forwarded messages whose content is a string)."""
        found: dict[str, str] = {}
        missing = []
        for digest in dict.fromkeys(hashes):
            text = self._texts.get(digest)
            if text is None:
                missing.append(digest)
            else:
                self._texts.move_to_end(digest)
                found[digest] = text
        for start in range(0, len(missing), 500):
            chunk = missing[start:start + 500]
            bodies = dict(conn.execute(f"SELECT hash, body FROM blobs WHERE hash IN ({','.join('?' * len(chunk))})",
                                       chunk).fetchall())
            for digest in chunk:  # kept in the order asked: the decisions' (the newest last out)
                if digest in bodies:
                    found[digest] = self._keep(digest, orjson.loads(bodies[digest])["content"])
        return found

    def __len__(self) -> int:
        return len(self._texts)

    def clear(self) -> None:
        self._texts.clear()
        self._chars = 0

    def _keep(self, digest: str, text: str) -> str:
        self._texts[digest] = text
        self._chars += len(text)
        while self._chars > self.max_chars and self._texts:
            self._chars -= len(self._texts.popitem(last=False)[1])
        return text
