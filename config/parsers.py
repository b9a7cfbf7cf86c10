"""Value parsers for settings: one small function per kind of value.

Every setting arrives either typed (from TOML) or as a string (from the environment or a flag). A parser takes
either form and returns the typed value, or raises ``ValueError`` with a hint the caller turns into a startup
error naming the key and the value. Parsing happens once, at start; nothing here runs on the request path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "Parser",
    "Secret",
    "parse_bool",
    "parse_choice",
    "parse_float",
    "parse_int",
    "parse_optional_secret",
    "parse_presets",
    "parse_regex",
    "parse_store",
    "parse_str",
    "parse_str_list",
    "parse_url",
    "parse_window",
]

Parser = Callable[[Any], Any]


class Secret:
    """A string that never shows itself in a repr, a log line or an error (starlette's ``Secret``)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def __repr__(self) -> str:
        return "Secret('**********')"

    def __str__(self) -> str:
        return self._value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError("expected true or false (also 1/0, yes/no, on/off)")


def parse_int(lo: int = 0, hi: int | None = None) -> Parser:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError("expected a whole number")
        try:
            number = int(value.replace("_", "")) if isinstance(value, str) else value
        except ValueError:
            raise ValueError("expected a whole number, e.g. 32768") from None
        if number < lo or (hi is not None and number > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise ValueError(f"expected a number {bound}")
        return number

    return parse


def parse_float(lo: float, hi: float) -> Parser:
    def parse(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError("expected a number")
        try:
            number = float(value)
        except ValueError:
            raise ValueError("expected a number, e.g. 0.45") from None
        if not lo <= number <= hi:
            raise ValueError(f"expected a number between {lo} and {hi}")
        return number

    return parse


def parse_window(value: Any) -> int:
    """``auto`` (stored as 0: ask the upstream) or a window of at least 512 tokens."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return 0
    if value == 0:
        return 0
    try:
        return parse_int(512)(value)  # type: ignore[no-any-return]
    except ValueError:
        raise ValueError('expected "auto" or a number of tokens of at least 512, e.g. 32768') from None


def parse_str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


def parse_choice(*choices: str) -> Parser:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or value.strip().lower() not in choices:
            raise ValueError("expected one of: " + ", ".join(choices))
        return value.strip().lower()

    return parse


def parse_url(value: Any) -> str:
    text = parse_str(value).strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("expected an http(s) URL such as http://127.0.0.1:8080/v1")
    return text


def parse_store(value: Any) -> str:
    """"" (SQLite in the data dir) or a PostgreSQL URL."""
    text = parse_str(value).strip()
    if text and not text.startswith(("postgresql://", "postgres://")):
        raise ValueError('expected "" (SQLite at <data_dir>/journal.db) or a postgresql://user:password@host:port/'
                         "database URL")
    return text


def parse_regex(value: Any) -> str:
    text = parse_str(value)
    try:
        re.compile(text)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression ({exc})") from None
    return text


def parse_str_list(value: Any) -> tuple[str, ...]:
    """A TOML array of strings, or from the environment a JSON array or a comma-separated list."""
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else [p.strip() for p in text.split(",") if p.strip()]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError('expected a list of strings, e.g. ["free up your context"]')
    return tuple(value)


def parse_presets(value: Any) -> tuple[tuple[str, str], ...]:
    """Text-protocol presets: ``[{name = "mine", pattern = "…(?P<body>…)…"}]`` in TOML (or that list as JSON).
    The pattern must match a whole results message and name the result ``body``."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    if not isinstance(value, list | tuple):
        raise ValueError('expected a list of tables, e.g. [{name = "mine", pattern = "(?P<body>.*)\\n<<END"}]')
    presets = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(
                item.get("pattern"), str):
            raise ValueError("each preset needs a `name` and a `pattern` (strings)")
        try:
            compiled = re.compile(item["pattern"])
        except re.error as exc:
            raise ValueError(f"preset {item['name']!r}: not a valid regular expression ({exc})") from None
        if "body" not in compiled.groupindex:
            raise ValueError(f"preset {item['name']!r}: the pattern needs a named group (?P<body>...)")
        presets.append((item["name"], item["pattern"]))
    return tuple(presets)


def parse_optional_secret(value: Any) -> Secret | None:
    """Unset (``None`` or ``""``), or a token; one of only whitespace is refused: a client's ``Bearer   `` header
    would match it, and it guards nothing."""
    if value is None or value == "":
        return None
    text = parse_str(value)
    if not text.strip():
        raise ValueError("a token of only whitespace guards nothing; set a real token (e.g. `openssl rand -hex 32`) "
                         "or leave it unset")
    return Secret(text)
