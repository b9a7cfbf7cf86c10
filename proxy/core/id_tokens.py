"""Counting text that holds 64-hex ids (stubs, markers) by parts, with the same result as tiktoken's cl100k count.

Why: every marker an elision pass writes names its overflow id three times, and an id is about 30 tokens of
letters and digits that byte-pair merges slowly: a third to a half of a marker's tokenising, and a fold pass at
600 rounds writes twenty markers (issue #13). The ids are counted here from their pre-tokens instead.

Why it is exact: cl100k's encoder first splits text with its pattern (``CL100K_PATTERN``) and merges each piece
on its own, so a count is the sum of its pieces' counts. No piece of that pattern runs from a letter or digit
into ``=`` or ``/``, nor from a hex digit into one of ``_AFTER`` (a letter run, a digit group and a contraction end
on a letter or digit; the punctuation piece may not start with one). So an id preceded by a letter or digit and
``=`` or ``/``, and followed by one of ``_AFTER`` or the end, is cut from its text at piece boundaries: the count
is the text before it, the id, and the text after it, each counted alone. Inside ``=`` + id the pieces are the
runs of letters (the first with the ``=`` before it) and the digits in threes from the start of each run (every
number below 1000 is one cl100k token), or the ``=`` alone when the id opens with a digit; each letter run's count
is cached (few are long).
``tests/test_id_tokens.py`` checks it against the tokenizer on generated text. Only cl100k's pattern is trusted:
any other encoding is counted whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["CL100K_PATTERN", "IdCounter"]

CL100K_PATTERN = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"
                  r"\s++$|\s*[\r\n]|\s+(?!\S)|\s")
"""tiktoken's pre-tokenising pattern of cl100k_base, the one the boundaries above were read from."""

_AFTER = " .])},\n"
"""What may follow an id that is cut out (kept in step with ``_ID``)."""
_ID = re.compile(r"[=/](?<=[A-Za-z0-9][=/])[0-9a-f]{64}(?=[ .\])},\n]|\Z)")
"""An id cut from its text: ``=`` or ``/`` after a letter or digit (matched first: the search skips ahead to
them), 64 hex digits, then one of ``_AFTER`` or the end."""
_NO_DIGITS = str.maketrans("0123456789", " " * 10)
_NO_LETTERS = str.maketrans("abcdef", " " * 6)
_KEPT = 8192


class IdCounter:
    """``count(text)``: ``whole(text)`` (the tokenizer's count), with each id in it counted from its pieces."""

    def __init__(self, whole: Callable[[str], int]) -> None:
        self.whole = whole
        self._pieces: dict[str, int] = {}
        self._ids: dict[str, tuple[int, str]] = {}

    def count(self, text: str) -> int:
        tokens, start = 0, 0
        for match in _ID.finditer(text):
            if match.start() > start:
                tokens += self.whole(text[start:match.start()])
            tokens += self.id_tokens(text[match.start()], text[match.start() + 1:match.end()])
            start = match.end()
        return tokens + self.whole(text[start:]) if start < len(text) else tokens

    def id_tokens(self, prefix: str, hex_id: str) -> int:
        """Tokens of ``prefix`` (``=`` or ``/``) followed by a 64-hex id, counted alone: the id's own pieces, the
        prefix joined to its leading letters (or alone before a digit). The id's part is kept: a marker names its
        id three times."""
        known = self._ids.get(hex_id)
        if known is None:
            if len(self._ids) >= _KEPT:
                self._ids.clear()
            known = self._ids[hex_id] = self._hex_tokens(hex_id)
        tokens, lead = known
        if not lead:
            return tokens + self._piece(prefix)
        return tokens - self._piece(lead) + self._piece(prefix + lead)

    def _hex_tokens(self, hex_id: str) -> tuple[int, str]:
        """The id's tokens alone (each letter run one piece, each digit run in threes) and its leading letters."""
        letters = hex_id.translate(_NO_DIGITS).split()
        tokens = sum((len(run) + 2) // 3 for run in hex_id.translate(_NO_LETTERS).split())
        tokens += sum(map(self._piece, letters))
        return tokens, letters[0] if hex_id[0].isalpha() else ""

    def _piece(self, piece: str) -> int:
        known = self._pieces.get(piece)
        if known is None:
            if len(self._pieces) >= _KEPT:
                self._pieces.clear()
            known = self._pieces[piece] = self.whole(piece)
        return known
