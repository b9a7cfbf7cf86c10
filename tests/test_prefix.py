"""A body parsed from a recent one's bytes is exactly what a full parse gives, whatever the edit."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.proxy.core.prefix import Prefixes, common_prefix

TRICKY = st.text(alphabet=st.sampled_from(['"', "\\", "[", "]", "{", "}", ",", ":", " ", "a", "é", "😀", "\n", "\x00"]),
                 max_size=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": TRICKY},
                                optional={"tool_calls": st.lists(st.fixed_dictionaries({"id": TRICKY}), max_size=2),
                                          "n": st.integers(-5, 5)})
STYLES = st.sampled_from(["compact", "spaced", "ascii", "indented"])


def encode(body: dict[str, Any], style: str) -> bytes:
    if style == "compact":
        return orjson.dumps(body)
    if style == "indented":
        return json.dumps(body, indent=1, ensure_ascii=False).encode()
    return json.dumps(body, ensure_ascii=style == "ascii").encode()


def parse(prefixes: Prefixes, raw: bytes) -> tuple[Any, bool]:
    """What the body edge does: the prefix parse, else the full one; a valid chat body is kept."""
    reused = prefixes.loads(raw)
    try:
        full = orjson.loads(raw)
    except orjson.JSONDecodeError:
        assert reused is None  # never a body out of bytes that do not parse
        return None, False
    body = reused.body if reused is not None else full
    if isinstance(body, dict) and isinstance(body.get("messages"), list) and body["messages"] \
            and all(isinstance(m, dict) for m in body["messages"]):
        prefixes.keep(raw, body, reused)
    return body, reused is not None


def check(prefixes: Prefixes, raw: bytes) -> bool:
    body, reused = parse(prefixes, raw)
    if body is not None:
        full = orjson.loads(raw)
        assert body == full and list(body) == list(full)
        if isinstance(body, dict) and isinstance(body.get("messages"), list):
            assert [list(m) for m in body["messages"] if isinstance(m, dict)] == \
                [list(m) for m in full["messages"] if isinstance(m, dict)]  # key order, message by message
        as_came = prefixes.messages_as_came(raw, body)
        if as_came is not None:  # the array's own bytes (what goes upstream when only the tools change)
            assert orjson.loads(as_came) == full["messages"] and as_came in raw
    return reused


EDITS = st.one_of(
    st.tuples(st.just("append"), st.lists(message, min_size=1, max_size=3)),
    st.tuples(st.just("edit"), st.integers(0, 50), message),
    st.tuples(st.just("truncate"), st.integers(1, 50)),
    st.tuples(st.just("field"), TRICKY),
    st.tuples(st.just("style"), STYLES),
    st.tuples(st.just("bytes"), st.integers(0, 10_000), st.sampled_from([b",", b"]", b" ", b"\\", b'"', b"", b"}"])),
)


def apply(body: dict[str, Any], style: str, edit: tuple[Any, ...]) -> tuple[dict[str, Any], str, bytes | None]:
    messages = list(body["messages"])
    kind = edit[0]
    if kind == "append":
        messages += edit[1]
    elif kind == "edit":
        messages[edit[1] % len(messages)] = edit[2]
    elif kind == "truncate":
        messages = messages[: max(1, len(messages) - edit[1] % len(messages))]
    elif kind == "field":
        body = body | {"temperature": edit[1]}
    elif kind == "style":
        style = edit[1]
    body = body | {"messages": messages}
    if kind != "bytes":
        return body, style, None
    raw = encode(body, style)
    at = edit[1] % len(raw)
    return body, style, raw[:at] + edit[2] + raw[at + 1:]  # a byte replaced: often invalid, sometimes not


@given(st.lists(message, min_size=1, max_size=8), st.sampled_from(["first", "middle", "last"]), STYLES,
       st.lists(EDITS, max_size=8))
@example([{"role": "user", "content": '\\"]},{"'}], "last", "compact", [("append", [{"role": "tool", "content": "]"}])])
@example([{"role": "user", "content": "a"}], "first", "spaced", [("bytes", 0, b"")])
def test_a_spliced_body_equals_a_full_parse(messages: list[dict[str, Any]], where: str, style: str,
                                             edits: list[tuple[Any, ...]]) -> None:
    prefixes = Prefixes(min_bytes=0, window=16, key_bytes=4)
    body = {"first": {"messages": messages, "model": "m", "tools": [{"t": "]"}]},
            "middle": {"model": "m", "messages": messages, "stream": False},
            "last": {"model": "m", "tools": [{"x": "[\\"}], "messages": messages}}[where]
    check(prefixes, encode(body, style))
    for edit in edits:
        body, style, raw = apply(body, style, edit)
        check(prefixes, raw if raw is not None else encode(body, style))


def history(n: int, size: int = 40) -> list[dict[str, Any]]:
    return [{"role": "tool" if i % 2 else "assistant", "content": f'{i} \\"quoted\\" [x] {{y}}, ' * size}
            for i in range(n)]


def test_the_next_request_reuses_the_previous_message_objects() -> None:
    prefixes = Prefixes(min_bytes=0)
    first = history(50)
    _, reused = parse(prefixes, orjson.dumps({"model": "m", "messages": first}))
    assert not reused
    raw = orjson.dumps({"model": "m", "messages": [*first, {"role": "user", "content": "next"}]})
    got = prefixes.loads(raw)
    assert got is not None and got.count == 50 and got.body == orjson.loads(raw)
    kept = prefixes._entries[hash(raw[:2048])][0].top["messages"]
    assert all(a is b for a, b in zip(got.body["messages"], kept, strict=False))  # the same objects


def test_a_fork_far_back_walks_windows_until_it_finds_the_element() -> None:
    prefixes = Prefixes(min_bytes=0, window=64)  # every message is larger than the first window
    messages = history(30, size=20)
    check(prefixes, orjson.dumps({"model": "m", "messages": messages}))
    for at in (25, 5, 4, 28, 0):  # 0: within the first 2 KB, which a body is looked up by: parsed whole
        edited = [*messages[:at], {"role": "user", "content": f"edit {at}"}, *messages[at + 1:]]
        assert check(prefixes, orjson.dumps({"model": "m", "messages": edited})) == (at > 0)


def test_a_duplicate_messages_key_is_never_spliced() -> None:
    """orjson keeps the last of duplicate keys: the array that a scan finds first is not the one that counts."""
    prefixes = Prefixes(min_bytes=0)
    tail = b',"model":"m","messages":[{"role":"user","content":"real"}]}'
    check(prefixes, b'{"messages":' + orjson.dumps(history(5)) + tail)
    raw = b'{"messages":' + orjson.dumps([*history(5), {"role": "user", "content": "more"}]) + tail
    assert prefixes.loads(raw) is None
    assert not check(prefixes, raw)


@pytest.mark.parametrize("middle", [b",", b", ", b",]", b"1", b",{} {}"])
def test_bytes_that_do_not_parse_whole_are_not_parsed_in_part(middle: bytes) -> None:
    prefixes = Prefixes(min_bytes=0)
    raw = orjson.dumps({"model": "m", "messages": history(5)})
    check(prefixes, raw)
    spliced = raw[:-2] + middle + raw[-2:]
    assert prefixes.loads(spliced) is None
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(spliced)


def test_the_middle_nests_as_deep_as_in_the_body() -> None:
    """orjson refuses 1024 levels: an element that fits alone but not inside the body must not be accepted."""
    prefixes = Prefixes(min_bytes=0)
    raw = orjson.dumps({"model": "m", "messages": history(5)})
    check(prefixes, raw)
    def spliced(depth: int) -> bytes:
        return raw[:-2] + b',{"role":"user","content":' + b"[" * depth + b"]" * depth + b"}" + raw[-2:]

    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(spliced(1022))
    assert prefixes.loads(spliced(1022)) is None
    got = prefixes.loads(spliced(1021))
    full = orjson.loads(spliced(1021))  # parses: so does the splice (compared short of the deep part)
    assert got is not None and len(got.body["messages"]) == 6 and got.body["messages"][:5] == full["messages"][:5]


@pytest.mark.parametrize("style", ["compact", "spaced", "ascii", "indented"])
def test_a_kept_body_s_messages_are_the_bytes_it_came_with(style: str) -> None:
    """Exactly the array's bytes, as the client spaced and escaped them, for the body parsed from them (whole or
    from a kept one); nothing for an equal body that is not the kept object, a small body, or one dropped."""
    prefixes = Prefixes(max_bytes=8000, min_bytes=1000)
    messages = [*history(20, size=5), {"role": "user", "content": "é \"quoted\" ]"}]
    for body in ({"model": "m", "messages": messages[:-1], "tools": []}, {"model": "m", "messages": messages,
                                                                          "tools": []}):
        raw = encode(body, style)
        array = encode(body["messages"], style) if style != "indented" else None
        parsed, _ = parse(prefixes, raw)
        as_came = prefixes.messages_as_came(raw, parsed)
        assert as_came is not None and orjson.loads(as_came) == body["messages"] and as_came in raw
        assert array is None or as_came == array
        assert raw.index(as_came) == raw.index(b"[", raw.index(b'"messages"'))
        assert prefixes.messages_as_came(raw, orjson.loads(raw)) is None  # equal, but not what was kept
    small = encode({"model": "m", "messages": history(1, size=1)}, style)
    assert prefixes.messages_as_came(small, parse(prefixes, small)[0]) is None
    for i in range(3):  # others push it out of the kept bytes
        check(prefixes, encode({"model": f"other {i}", "messages": messages}, style))
    assert prefixes.messages_as_came(raw, parsed) is None


def test_small_bodies_are_parsed_whole() -> None:
    prefixes = Prefixes()
    raw = orjson.dumps({"model": "m", "messages": history(2, size=1)})
    check(prefixes, raw)
    assert prefixes.loads(raw) is None and prefixes.retained_bytes == 0


def test_kept_bodies_are_bounded_in_bytes_and_an_extended_body_replaces_its_parent() -> None:
    prefixes = Prefixes(max_bytes=200_000, min_bytes=0)
    messages = history(10)
    for n in range(5, 10):  # one conversation growing: one body kept, and counted once
        raw = orjson.dumps({"model": "m", "messages": messages[:n]})
        check(prefixes, raw)
        assert prefixes.retained_bytes == len(raw)
    assert len(prefixes._entries) == 1 and len(next(iter(prefixes._entries.values()))) == 1
    for i in range(20):
        check(prefixes, orjson.dumps({"model": f"m{i}", "messages": messages}))
    assert prefixes.retained_bytes <= 200_000


@given(st.binary(max_size=64), st.binary(max_size=64), st.binary(max_size=8))
def test_common_prefix_is_the_shared_length(shared: bytes, a: bytes, b: bytes) -> None:
    n = common_prefix(shared + a, shared + b)
    assert (shared + a)[:n] == (shared + b)[:n]
    assert n == min(len(shared + a), len(shared + b)) or (shared + a)[n] != (shared + b)[n]


@pytest.mark.parametrize("at", [0, 1, 65_535, 65_536, 65_537, 200_001, 999_999, None])
def test_common_prefix_finds_where_large_bodies_part_in_any_block(at: int | None) -> None:
    a = bytes(range(256)) * 3907  # ~1 MB
    b = a if at is None else a[:at] + bytes([(a[at] + 1) % 256]) + a[at + 1:]
    assert common_prefix(a, b) == (len(a) if at is None else at)
    assert common_prefix(a, b, start=min(at or 0, 10)) == (len(a) if at is None else at)


def test_forks_between_requests_compare_each_kept_body_once() -> None:
    """A fork and the session's next requests, in turn: each is parsed from the body it shares the most with."""
    prefixes = Prefixes(min_bytes=0, key_bytes=16)
    messages = history(40, size=5)
    check(prefixes, orjson.dumps({"model": "m", "messages": messages}))
    for trial in range(6):
        at = 30 - trial
        fork = [*messages[:at], {"role": "user", "content": f"fork {trial}"}, *messages[at + 1:]]
        match = prefixes.match(orjson.dumps({"model": "m", "messages": fork}))
        assert match is not None and match.kept.top["messages"][at] == messages[at]  # not an earlier fork
        assert check(prefixes, orjson.dumps({"model": "m", "messages": fork}))
        messages = [*messages, {"role": "assistant", "content": f"next {trial}"}]
        assert check(prefixes, orjson.dumps({"model": "m", "messages": messages}))
