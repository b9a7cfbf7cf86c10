"""A text's 64-hex ids counted from their pieces give tiktoken's own count of the whole text, on any text."""

from __future__ import annotations

import pytest
import tiktoken
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ctxproxy.proxy.core import id_tokens
from ctxproxy.proxy.core.id_tokens import CL100K_PATTERN, IdCounter
from ctxproxy.proxy.core.stubs import elision_marker, fold_stub, spill_stub
from ctxproxy.proxy.core.tokens import ID_TEXT_CHARS, OFFLINE_ENCODING, TiktokenCounter, load_encoding

ENCODING = tiktoken.get_encoding(OFFLINE_ENCODING)


def real(text: str) -> int:
    return len(ENCODING.encode_ordinary(text))


hex_ids = st.text("0123456789abcdef", min_size=64, max_size=64)
# Around an id: what a stub puts there, and what could fool a boundary (letters, digits, spaces, a quote, an
# apostrophe, other scripts, more hex, newlines).
around = st.lists(st.sampled_from([*"aZ9=/ .])},\n\r\t'\"-_:é٣中", "id", " tool", ".out]", "'s", "  ", "\n\n", "0x",
                                  "ff"]), max_size=6).map("".join)
texts = st.lists(st.tuples(around, st.sampled_from("=/"), hex_ids, around), max_size=4).map(
    lambda parts: "".join(f"{a}{p}{h}{b}" for a, p, h, b in parts))


def test_the_trusted_pattern_is_the_offline_encodings_own() -> None:
    """The shortcut is taken: the encoding the proxy loads has the pattern the boundaries were read from."""
    assert ENCODING._pat_str == CL100K_PATTERN
    counter = load_encoding()
    assert isinstance(counter, TiktokenCounter) and counter.ids is not None


@given(texts)
@example("[overflow id=" + "a" * 64 + " tool=x")
@example("id=" + "0" * 64)
@example("x/" + "abcdef1234" * 6 + "abcd.out]")
@example("'d=" + "f00d" * 16 + "\n")
@settings(max_examples=400)
def test_ids_counted_from_pieces_are_counted_as_tiktoken_counts_the_text(text: str) -> None:
    assert IdCounter(real).count(text) == real(text)


@given(st.text(max_size=300))
def test_any_text_is_counted_as_tiktoken_counts_it(text: str) -> None:
    assert IdCounter(real).count(text) == real(text)


@given(hex_ids, st.text(max_size=40), st.text(max_size=40), st.text(max_size=400), st.text(max_size=60),
       st.sampled_from(["", "/tmp/out", "/srv/x-", "rel dir/é", "/a/b2"]), st.sampled_from(["disk", "memory-only"]))
def test_stubs_and_markers_are_counted_exactly(overflow_id: str, tool: str, call_id: str, content: str,
                                               arguments: str, outdir: str, storage: str) -> None:
    counter = load_encoding()
    stubs = [elision_marker(overflow_id, tool, call_id, storage, content, arguments, outdir),
             spill_stub(overflow_id, tool, call_id, storage, content, 50, 50, outdir),
             fold_stub(overflow_id, [{"role": "assistant", "tool_calls": [{"function": {"name": tool}}]}],
                       len(content), storage, outdir)]
    for stub in stubs:
        assert len(stub) <= ID_TEXT_CHARS
        assert counter.count(stub) == real(stub)


def test_an_id_is_counted_once_for_its_three_mentions() -> None:
    """The id's own pieces are kept: the marker's second and third mention cost no tokenising of it."""
    asked: list[str] = []

    def whole(text: str) -> int:
        asked.append(text)
        return real(text)

    counter, overflow_id = IdCounter(whole), "0a" * 32
    marker = elision_marker(overflow_id, "bash", "c1", "disk", "one\ntwo", '{"command": "ls"}', "/tmp/out")
    assert counter.count(marker) == real(marker)
    assert not any(overflow_id in text for text in asked)
    before = len(asked)
    counter.id_tokens("=", overflow_id)
    assert len(asked) == before


@given(texts)
@settings(max_examples=50)
def test_full_caches_start_again_and_count_the_same(text: str) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(id_tokens, "_KEPT", 1)
        counter = IdCounter(real)
        assert [counter.count(text) for _ in range(2)] == [real(text)] * 2
        assert len(counter._ids) <= 1 and len(counter._pieces) <= 1
