"""The exact text put where content was cut (DESIGN.md §4). Byte-stable: same input, same bytes, always.

Every stub opens with one machine-readable line and says where the original is and how to get it back::

    [overflow id=<sha256> tool=<name> bytes=<n> call_id=<id> storage=<disk|memory-only (incognito)>]

That first line is one grammar for every cut — spills, elisions, drops, clears, mirror cuts, argument cuts — and
parses as key=value (``parse_stub``): ``tool`` and ``call_id`` are bare tokens, or JSON-quoted when they hold a
space, a quote, ``=`` or ``]``; a text-protocol command line is reduced to its program (``pytest -k x`` →
``pytest``: the elision line shows the command). ``storage`` runs to the closing bracket. Extra lines follow it.

A spill keeps a head/tail preview (the result was too big to keep, not too old); an elision keeps one preview
line and the tool's command tail; a fold stands for whole rounds.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["STUB_LINE", "argument_stub", "elision_marker", "fold_stub", "fold_stub_of", "full_output", "looks_binary",
           "parse_stub", "program", "spill_stub", "stub_line"]

_LINE = 100
_ODD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffd]")
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_COMMAND_KEYS = ("command", "cmd", "path", "file", "pattern", "query", "url")


_BARE = re.compile(r'[^\s"\]=\\]+')
_TOKEN = r'"(?:[^"\\]|\\.)*"|[^\s"\]=\\]+'
STUB_LINE = re.compile(rf"\[overflow id=(?P<id>[0-9a-f]{{64}}) tool=(?P<tool>{_TOKEN}) bytes=(?P<bytes>\d+) "
                       rf"call_id=(?P<call_id>{_TOKEN}) storage=(?P<storage>disk|memory-only \(incognito\))\]")
"""The first line of every stub (one grammar): ``parse_stub`` reads it back."""


def stub_line(overflow_id: str, tool: str, nbytes: int, call_id: str, storage: str) -> str:
    return f"[overflow id={overflow_id} tool={_token(program(tool))} bytes={nbytes} call_id={_token(call_id)} " \
           f"storage={storage}]"


def program(tool: str) -> str:
    """A tool's name; a command line (``cd /repo && pytest -x``) reduced to its program (``cd``)."""
    words = tool.split()
    return words[0].rsplit("/", 1)[-1] or words[0] if len(words) > 1 else tool


def _token(value: str) -> str:
    return value if _BARE.fullmatch(value) else json.dumps(value)  # ASCII: no line separator inside


def parse_stub(line: str) -> dict[str, str] | None:
    """The fields of a stub's first line (quoted values unquoted), or None when it is not one."""
    match = STUB_LINE.fullmatch(line)
    if match is None:
        return None
    fields = match.groupdict()
    return {k: json.loads(v) if v.startswith('"') else v for k, v in fields.items()}


def _intact(overflow_id: str, storage: str) -> str:
    where = ("in memory only (incognito: lost when ctxproxy stops, or forgets the session to stay within "
             "incognito_max_bytes / incognito_max_age)") if storage != "disk" else "intact"
    return f"The original is {where}: read_overflow id={overflow_id} returns it (offset, limit, grep)."


def full_output(overflow_id: str, storage: str, overflow_dir: str) -> list[str]:
    """The ``[full output: <path>]`` line (the second seed) when cut bodies are also written as files the agent
    can grep (``overflow_dir``); none in incognito, which writes nothing."""
    if not overflow_dir or storage != "disk":
        return []
    return [f"[full output: {overflow_dir.rstrip('/')}/{overflow_id}.out]"]


def argument_stub(overflow_id: str, tool: str, call_id: str, storage: str, value: str, key: str,
                  overflow_dir: str = "") -> str:
    """What stands in a call's arguments in place of one large string value."""
    preview = _preview(value)
    return "\n".join([
        stub_line(overflow_id, tool, len(value.encode()), call_id, storage),
        f"Argument `{_clip(key) or '?'}` elided to save context ({len(value)} characters): {preview}. "
        f"{_intact(overflow_id, storage)}", *full_output(overflow_id, storage, overflow_dir),
    ])


def spill_stub(overflow_id: str, tool: str, call_id: str, storage: str, content: str, head: int, tail: int,
               overflow_dir: str = "") -> str:
    nbytes = len(content.encode())
    binary = looks_binary(content)
    kind = "looks binary" if binary else "was too large to keep inline"
    front, back = ("", "") if binary else (_head(content, head), _tail(content, tail))
    hidden = len(content) - len(front) - len(back)
    return "\n".join([
        stub_line(overflow_id, tool, nbytes, call_id, storage),
        f"Spilled on arrival: the output {kind}. {_intact(overflow_id, storage)} Head and tail:",
        _printable(front), f"[… {hidden} characters not shown …]", _printable(back),
        *full_output(overflow_id, storage, overflow_dir),
    ])


def elision_marker(overflow_id: str, tool: str, call_id: str, storage: str, content: str, arguments: str,
                   overflow_dir: str = "") -> str:
    nbytes = len(content.encode())
    command = _command_tail(arguments)
    preview = _preview(content)
    return "\n".join([
        stub_line(overflow_id, tool, nbytes, call_id, storage),
        f"Elided to save context{f' ({command})' if command else ''}: {preview}. {_intact(overflow_id, storage)}",
        *full_output(overflow_id, storage, overflow_dir),
    ])


def fold_stub(overflow_id: str, messages: Sequence[dict[str, Any]], nbytes: int, storage: str,
              overflow_dir: str = "") -> str:
    roles = Counter(str(m.get("role")) for m in messages)
    tools = Counter(call.get("function", {}).get("name", "?") for m in messages for call in m.get("tool_calls") or [])
    return fold_stub_of(overflow_id, len(messages), roles, tools, nbytes, storage, overflow_dir)


def fold_stub_of(overflow_id: str, count: int, roles: Mapping[str, int], tools: Mapping[str, int], nbytes: int,
                 storage: str, overflow_dir: str = "") -> str:
    """``fold_stub`` of ``count`` messages, from their tallies: how many of each role, and calls of each tool."""
    used = ", ".join(f"{name} x{n}" for name, n in sorted(tools.items())) or "no tools"
    return "\n".join([
        f"[folded id={overflow_id} messages={count} bytes={nbytes} storage={storage}]",
        f"Earlier history folded to fit the context window: {roles.get('assistant', 0)} assistant, "
        f"{roles.get('tool', 0)} tool and {roles.get('user', 0)} user messages ({used}). "
        + _intact(overflow_id, storage).replace("The original is", "The originals are"),
        *full_output(overflow_id, storage, overflow_dir),
    ])


def looks_binary(text: str) -> bool:
    """NUL bytes, or more than 10% control or replacement characters in the first 4 KB."""
    sample = text[:4096]
    return "\x00" in sample or len(_ODD.findall(sample)) > len(sample) // 10


def _preview(text: str) -> str:
    """The first and the last non-blank line, stripped and clipped: what an elided value showed. Found by scanning
    in from each end: an elision pass over a long history builds hundreds of markers, and stripping every line of
    every result was a fifth of such a request's projection (issue #13)."""
    lines = text.splitlines()
    first = next((s for s in map(str.strip, lines) if s), "")
    last = next((s for s in map(str.strip, reversed(lines)) if s), "")
    return f'"{_clip(_printable(first))}" … "{_clip(_printable(last))}"'


def _head(text: str, size: int) -> str:
    cut = text[:size]
    newline = cut.rfind("\n")
    return cut[:newline] if newline > size // 2 else cut


def _tail(text: str, size: int) -> str:
    cut = text[-size:] if size else ""
    newline = cut.find("\n")
    return cut[newline + 1:] if 0 <= newline < size // 2 else cut


def _printable(text: str) -> str:
    """Control characters (other than newline and tab) shown as U+FFFD, so a preview never carries raw bytes."""
    return _CONTROL.sub("\ufffd", text)


def _clip(text: str) -> str:
    return text if len(text) <= _LINE else text[: _LINE - 1] + "…"


def _command_tail(arguments: str) -> str:
    """The end of the call's most telling argument (`command`, `path`…), for an elided result's marker."""
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        args = arguments
    if isinstance(args, dict):
        value = next((args[k] for k in _COMMAND_KEYS if isinstance(args.get(k), str)), None)
        text = value if value is not None else json.dumps(args, ensure_ascii=False, sort_keys=True)
    else:
        text = str(args)
    text = " ".join(text.split())
    return f"`{text if len(text) <= 80 else '…' + text[-79:]}`" if text and text != "{}" else ""
