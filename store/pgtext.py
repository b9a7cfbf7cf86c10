"""PostgreSQL's text cannot hold NUL; the journal's text can: every string crosses the connection escaped.

A tool result may carry NUL characters (a binary file printed, a terminal's output): SQLite stores them in TEXT
like any other, PostgreSQL refuses the whole statement ("text fields cannot contain NUL"), which would fail the
request. So on PostgreSQL every string parameter is written with NUL as ``ESC 0`` and ``ESC`` itself as ``ESC 1``
(``ESC``: U+E000, a private-use character), and every text value read is turned back: the store above sees, and
hashes, exactly the string it wrote, whatever it holds. Nothing in SQL looks inside a cut body, so the escaped
form never reaches a comparison that matters; the JSON the store does look into (message lists, message bodies) is
ASCII-escaped JSON, which holds neither character raw.

Only ``store.sql.PostgresConnection`` imports this (and psycopg with it).
"""

from __future__ import annotations

import re
from typing import Any

from psycopg.types.string import StrDumperUnknown, TextLoader

__all__ = ["decode", "encode", "register"]

ESC = "\ue000"
_ESCAPED = re.compile(ESC + "[01]")


def encode(text: str) -> str:
    if "\x00" not in text and ESC not in text:
        return text
    return text.replace(ESC, ESC + "1").replace("\x00", ESC + "0")


def decode(text: str) -> str:
    if ESC not in text:
        return text
    return _ESCAPED.sub(lambda m: "\x00" if m.group(0)[1] == "0" else ESC, text)


class _Dumper(StrDumperUnknown):
    def dump(self, obj: str) -> Any:
        return super().dump(encode(obj))


class _Loader(TextLoader):
    def load(self, data: Any) -> Any:
        value = super().load(data)
        return decode(value) if isinstance(value, str) else value


def register(connection: Any) -> None:
    """Escape the strings ``connection`` writes, unescape the text it reads."""
    connection.adapters.register_dumper(str, _Dumper)
    connection.adapters.register_loader("text", _Loader)
