"""Token counts of the messages a projection changed, cached by their content like the agent's own.

Why: the core counts an incoming message under its content hash, so a history it has seen costs nothing; but a
message it cut (a spill stub, an elided result, a fold stub, a shortened call) is counted with ``key=None`` and so
went through the tokenizer again on every request that recomputes the projection — a fork, an edited retry, the
peers' benchmark with new text at the end — which was 60% of such a 630 KB request. The count of a message is a
pure function of its canonical JSON, so keying it by that JSON's sha256 gives the same number as counting it.
"""

from __future__ import annotations

from typing import Any

from proxy.rewrite.identity import message_hash
from proxy.rewrite.tokens import MessageCounter

__all__ = ["IdentifiedCounter"]


class IdentifiedCounter:
    """``counter`` with every count cached: under the caller's key, else under the message's content hash."""

    def __init__(self, counter: MessageCounter) -> None:
        self.counter = counter

    def count(self, message: dict[str, Any], key: str | None = None) -> int:
        return self.counter.count(message, key if key is not None else f"cut:{message_hash(message)}")
