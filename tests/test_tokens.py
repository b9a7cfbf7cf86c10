"""Token counting works offline, caches per message identity, and calibrates towards what upstream reports."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, cast

import pytest
import tiktoken
from hypothesis import example, given
from hypothesis import strategies as st

from ctxproxy.proxy.core import message_hash
from ctxproxy.proxy.core.tokens import (
    BOUND_CHARS,
    CHUNK_CHARS,
    IMAGE_TOKENS,
    K_MAX,
    K_MIN,
    MESSAGE_OVERHEAD,
    OFFLINE_ENCODING,
    Calibration,
    CharEstimate,
    MessageCounter,
    TiktokenCounter,
    load_encoding,
    utf8_size,
)
from tests.workloads import conversation as workload

ROOT = Path(__file__).resolve().parent.parent
UNREACHABLE = "http://127.0.0.1:9"


@pytest.fixture(scope="module")
def counter() -> MessageCounter:
    return MessageCounter(load_encoding())


def run_isolated(code: str, tmp_path: Path) -> str:
    """Run ``code`` in a fresh interpreter (nothing loaded yet), offline: empty tiktoken cache, dead proxies."""
    env = {key: value for key, value in os.environ.items() if not key.upper().endswith("_PROXY")}
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    env.update(TIKTOKEN_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    for key in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
        env[key] = UNREACHABLE
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# A fresh interpreter where any attempt to resolve a name or open a connection raises, so a download cannot
# silently fall back to the character estimate: the test sees either the offline encoding or a crash.
NO_NETWORK = """
    import sys

    def refuse_network(event, args):
        if event in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname", "urllib.Request"):
            raise RuntimeError(f"network access attempted: {event} {args!r}")

    sys.addaudithook(refuse_network)
"""


# --- loading the encoding -------------------------------------------------------------------------------------


def test_the_offline_encoding_loads_without_touching_the_network(tmp_path: Path) -> None:
    out = run_isolated(NO_NETWORK + """
    from ctxproxy.proxy.core.tokens import load_encoding
    counter = load_encoding()
    print(counter.name, counter.count("hello world"), counter.count("<|endoftext|>") > 0)
    """, tmp_path)
    assert out == f"{OFFLINE_ENCODING} 2 True"


def test_the_isolation_really_refuses_the_network(tmp_path: Path) -> None:
    """The guard of the test above is live: the standard ``cl100k_base`` (a download) cannot load under it."""
    out = run_isolated(NO_NETWORK + """
    from ctxproxy.proxy.core.tokens import load_encoding
    counter = load_encoding("cl100k_base")
    print(counter.name, counter.reason)
    """, tmp_path)
    assert out.startswith("char-estimate cl100k_base:")
    assert "network access attempted" in out


def test_without_tiktoken_counting_falls_back_to_the_character_estimate(tmp_path: Path) -> None:
    out = run_isolated(NO_NETWORK + """
    sys.modules["tiktoken"] = None  # makes `import tiktoken` raise ImportError, as if the package were missing
    from ctxproxy.proxy.core.tokens import load_encoding
    counter = load_encoding()
    print(counter.name, counter.count("x" * 35))
    """, tmp_path)
    assert out == "char-estimate 10"


def test_an_unknown_encoding_falls_back_to_the_estimate_and_says_why() -> None:
    counter = load_encoding("no_such_encoding")
    assert isinstance(counter, CharEstimate)
    assert counter.name == "char-estimate"
    assert "no_such_encoding" in counter.reason


def test_the_encoding_is_loaded_once() -> None:
    assert load_encoding() is load_encoding()
    assert isinstance(load_encoding(), TiktokenCounter)


def test_special_token_text_is_counted_as_ordinary_text() -> None:
    counter = load_encoding()
    assert counter.count("<|endoftext|>") > 1  # ordinary text splits into several tokens; never a ValueError
    assert counter.count("before <|fim_prefix|> after <|endofprompt|>") > 0


def test_the_offline_encoding_counts_like_cl100k() -> None:
    # Known cl100k_base counts (OpenAI's cookbook example and tiktoken's own tests).
    counter = load_encoding()
    assert counter.count("tiktoken is great!") == 6
    assert counter.count("hello world") == 2
    assert counter.count("") == 0


@given(st.text())
def test_a_tiktoken_count_is_between_one_and_the_utf8_length(text: str) -> None:
    tokens = load_encoding().count(text)
    assert (tokens == 0) == (text == "")
    assert tokens <= len(text.encode("utf-8", "surrogatepass"))


@given(st.text(), st.text())
@example("", "")
@example("abc", "d")
def test_the_character_estimate_is_positive_and_subadditive(a: str, b: str) -> None:
    estimate = CharEstimate()
    assert (estimate.count(a) == 0) == (a == "")
    assert estimate.count(a + b) <= estimate.count(a) + estimate.count(b) + 1
    assert estimate.count(a) == math.ceil(len(a) / 3.5)


# --- counting messages ----------------------------------------------------------------------------------------


def test_a_message_costs_the_overhead_plus_its_content(counter: MessageCounter) -> None:
    text = counter.count_text("The tests pass.")
    assert counter.count({"role": "assistant", "content": "The tests pass."}) == MESSAGE_OVERHEAD + text
    assert counter.count({"role": "assistant", "content": None}) == MESSAGE_OVERHEAD
    assert counter.count({"role": "assistant"}) == MESSAGE_OVERHEAD


def test_text_parts_count_their_text_and_an_image_a_flat_amount(counter: MessageCounter) -> None:
    parts = [{"type": "text", "text": "What is in"}, {"type": "text", "text": " this picture?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 50_000}}]
    expected = MESSAGE_OVERHEAD + counter.count_text("What is in") + counter.count_text(" this picture?")
    assert counter.count({"role": "user", "content": parts}) == expected + IMAGE_TOKENS


def test_an_unknown_part_is_counted_by_its_json_rather_than_ignored(counter: MessageCounter) -> None:
    part = {"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}}
    assert counter.count({"role": "user", "content": [part]}) > MESSAGE_OVERHEAD


def test_tool_calls_count_their_names_and_arguments(counter: MessageCounter) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    message = {"role": "assistant", "content": "Reading.", "tool_calls": [call, call]}
    call_tokens = counter.count_text("read_file") + counter.count_text('{"path": "a.py"}')
    assert counter.count(message) == MESSAGE_OVERHEAD + counter.count_text("Reading.") + 2 * call_tokens


def test_decoded_arguments_are_counted_as_their_json(counter: MessageCounter) -> None:
    call = {"function": {"name": "f", "arguments": {"path": "a.py"}}}
    assert counter.count({"role": "assistant", "tool_calls": [call]}) == (
        MESSAGE_OVERHEAD + counter.count_text("f") + counter.count_text('{"path":"a.py"}'))


def test_name_and_tool_call_id_are_counted(counter: MessageCounter) -> None:
    bare = counter.count({"role": "tool", "content": "ok"})
    full = counter.count({"role": "tool", "content": "ok", "tool_call_id": "call_abc123", "name": "grep"})
    assert full == bare + counter.count_text("call_abc123") + counter.count_text("grep")


def test_a_keyed_count_is_cached_and_an_unkeyed_one_is_not() -> None:
    counter = MessageCounter(load_encoding())
    message = {"role": "user", "content": "hello"}
    first = counter.count(message, key="k1")
    assert (counter.hits, counter.misses) == (0, 1)
    assert counter.count(message, key="k1") == first
    assert (counter.hits, counter.misses) == (1, 1)
    assert counter.count(message) == first
    assert (counter.hits, counter.misses) == (1, 1)


def test_a_cached_count_is_read_without_counting() -> None:
    counter = MessageCounter(load_encoding())
    assert counter.cached("k1") is None
    tokens = counter.count({"role": "user", "content": "hello"}, key="k1")
    assert counter.cached("k1") == tokens and (counter.hits, counter.misses) == (0, 1)


def test_the_cache_trusts_the_key() -> None:
    """The key is the message's identity: the same key is the same message, so its count is not recomputed."""
    counter = MessageCounter(load_encoding())
    counter.count({"role": "user", "content": "short"}, key="same")
    assert counter.count({"role": "user", "content": "much longer " * 100}, key="same") == counter.count(
        {"role": "user", "content": "short"})


def test_the_cache_evicts_the_least_recently_used_entry() -> None:
    counter = MessageCounter(load_encoding(), capacity=2)
    for key in ("a", "b"):
        counter.count({"role": "user", "content": key}, key=key)
    counter.count({"role": "user", "content": "a"}, key="a")  # "a" is now the most recent; "b" goes next
    counter.count({"role": "user", "content": "c"}, key="c")
    misses = counter.misses
    counter.count({"role": "user", "content": "a"}, key="a")
    assert counter.misses == misses
    counter.count({"role": "user", "content": "b"}, key="b")
    assert counter.misses == misses + 1


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        MessageCounter(CharEstimate(), capacity=0)


def test_the_tool_list_is_counted_once_while_it_repeats(counter: MessageCounter) -> None:
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    fresh = MessageCounter(load_encoding())
    tokens = fresh.count_tools(tools)
    assert tokens == counter.count_text('[{"function":{"name":"read_file","parameters":{"type":"object"}},'
                                        '"type":"function"}]')
    assert fresh.count_tools(json.loads(json.dumps(tools))) == tokens  # an equal list, not the same object
    assert (fresh.hits, fresh.misses) == (1, 1)
    assert fresh.count_tools(tools + tools) > tokens
    assert (fresh.hits, fresh.misses) == (1, 2)
    assert fresh.count_tools(None) == fresh.count_tools([]) == 0


def test_the_same_tool_list_is_not_serialised_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body parsed from a kept one's bytes holds that body's own ``tools`` list: counted without its JSON."""
    import ctxproxy.proxy.core.tokens as tokens_module

    serialised: list[object] = []
    real = tokens_module.canonical_json
    monkeypatch.setattr(tokens_module, "canonical_json", lambda value: serialised.append(value) or real(value))
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    counter = MessageCounter(CharEstimate())
    first = counter.count_tools(tools)
    assert counter.count_tools(tools) == first and len(serialised) == 1
    equal = json.loads(json.dumps(tools))
    assert counter.count_tools(equal) == first and len(serialised) == 2  # equal, not the same: compared by its JSON
    assert counter.count_tools(equal) == first and len(serialised) == 2  # and then remembered as the last list


messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
    optional={"content": st.one_of(st.none(), st.text(), st.lists(st.fixed_dictionaries(
                  {"type": st.just("text"), "text": st.text()}), max_size=3)),
              "name": st.text(min_size=1, max_size=10),
              "tool_call_id": st.text(min_size=1, max_size=10),
              "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
                  {"name": st.text(max_size=10), "arguments": st.text()})}), max_size=2)})


@given(messages)
def test_a_message_costs_at_least_the_overhead_and_the_cache_never_changes_a_count(message: dict[str, Any]) -> None:
    counter = MessageCounter(CharEstimate())
    tokens = counter.count(message)
    assert tokens >= MESSAGE_OVERHEAD
    assert counter.count(message, key="m") == tokens
    assert counter.count(message, key="m") == tokens


def test_the_benchmark_conversation_is_counted_once_and_close_to_tiktoken() -> None:
    conversation = workload(rounds=60)["messages"]
    counter = MessageCounter(load_encoding())
    keyed = [(message, message_hash(message)) for message in conversation]
    first = sum(counter.count(message, key) for message, key in keyed)
    assert (counter.hits, counter.misses) == (0, len(conversation))
    second = sum(counter.count(message, key) for message, key in keyed)
    assert counter.hits == len(conversation)
    assert second == first

    def texts(message: dict[str, Any]) -> list[str]:
        calls = [c["function"][field] for c in message.get("tool_calls", ()) for field in ("name", "arguments")]
        return [message.get("content") or "", *calls, message.get("tool_call_id", "")]

    reference = tiktoken.get_encoding(OFFLINE_ENCODING)
    joined = "\n".join(text for message in conversation for text in texts(message))
    expected = len(reference.encode_ordinary(joined)) + MESSAGE_OVERHEAD * len(conversation)
    assert abs(first - expected) <= 0.10 * expected


# --- calibration ----------------------------------------------------------------------------------------------


def test_the_first_observation_replaces_the_default() -> None:
    assert Calibration().observe(estimate=1000, actual=1200) == Calibration(k=1.2, samples=1)


def test_later_observations_weigh_the_newest_half() -> None:
    calibration = Calibration().observe(1000, 1200).observe(1000, 1600)
    assert calibration.k == pytest.approx(1.4)
    assert calibration.samples == 2


def test_nonsense_ratios_are_clamped() -> None:
    assert Calibration().observe(100, 10_000).k == K_MAX
    assert Calibration().observe(10_000, 1).k == K_MIN


def test_observations_without_information_are_ignored() -> None:
    calibration = Calibration(k=1.3, samples=4)
    assert calibration.observe(0, 500) == calibration
    assert calibration.observe(-5, 500) == calibration
    assert calibration.observe(500, 0) == calibration


def test_scaled_rounds_up_without_float_noise() -> None:
    assert Calibration(k=1.1).scaled(50) == 55  # 50 * 1.1 == 55.00000000000001 in floats
    assert Calibration(k=1.1).scaled(51) == 57
    assert Calibration().scaled(0) == 0


def test_an_overflow_with_a_count_adopts_its_ratio_at_once() -> None:
    calibration = Calibration(k=1.0, samples=10).overflow(estimate=100_000, actual=140_000)
    assert calibration == Calibration(k=1.4, samples=11)


def test_an_overflow_never_lowers_k() -> None:
    calibration = Calibration(k=2.0, samples=3)
    assert calibration.overflow(estimate=100_000, actual=120_000).k == 2.0
    assert calibration.overflow(estimate=100, actual=1_000_000).k == K_MAX


def test_an_overflow_without_a_count_raises_k_by_a_quarter_up_to_the_cap() -> None:
    assert Calibration(k=1.2, samples=2).overflow(estimate=1000, actual=None) == Calibration(k=1.5, samples=2)
    assert Calibration(k=3.9).overflow(1000, None).k == K_MAX
    assert Calibration(k=1.0).overflow(0, 5000).k == 1.25  # no estimate: no ratio, so guess upwards


def test_an_out_of_range_calibration_cannot_be_built() -> None:
    for k in (0.1, 4.5, float("nan")):
        with pytest.raises(ValueError, match="within"):
            Calibration(k=k)
    with pytest.raises(ValueError, match="samples"):
        Calibration(samples=-1)


events = st.lists(st.tuples(st.sampled_from(["observe", "overflow"]), st.integers(-10, 10**7),
                            st.one_of(st.none(), st.integers(-10, 10**7))), max_size=40)


@given(events)
@example([("observe", 1, 10**7), ("overflow", 1, None), ("overflow", 1, None)])
def test_k_stays_within_bounds_for_any_sequence_of_events(sequence: list[tuple[str, int, int | None]]) -> None:
    calibration = Calibration()
    for kind, estimate, actual in sequence:
        before = calibration
        if kind == "overflow":
            calibration = calibration.overflow(estimate, actual)
            assert calibration.k >= before.k
        else:
            calibration = calibration.observe(estimate, actual if actual is not None else 0)
        assert K_MIN <= calibration.k <= K_MAX


@given(st.floats(min_value=K_MIN, max_value=K_MAX), st.integers(1, 10**6), st.integers(1, 10**6),
       st.integers(1, 20))
def test_a_constant_ratio_is_converged_to(start: float, estimate: int, actual: int, warmup: int) -> None:
    ratio = min(max(actual / estimate, K_MIN), K_MAX)
    calibration = Calibration(k=start, samples=warmup)
    for _ in range(60):
        calibration = calibration.observe(estimate, actual)
    assert calibration.k == pytest.approx(ratio, rel=1e-9)


# --- bounded cost for long text (issue #10) -----------------------------------------------------------------------
class RecordingEncoding:
    """The real offline encoding, remembering the length of every text it was asked to encode."""

    def __init__(self) -> None:
        self.inner = tiktoken.get_encoding(OFFLINE_ENCODING)
        self.name = self.inner.name
        self.encoded: list[int] = []

    def encode_ordinary(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return self.inner.encode_ordinary(text)


def recording_counter() -> tuple[TiktokenCounter, RecordingEncoding]:
    encoding = RecordingEncoding()
    return TiktokenCounter(cast(tiktoken.Encoding, encoding)), encoding


FRAGMENTS = ["x" * 997, "=" * 613, " word", "\n\n", "\t  ", "🙂👍🏽", "漢字かなカナ", "1234567", "a   b", "é",
             "def f(x):\n    return x\n", "<|endoftext|>"]


@given(st.lists(st.tuples(st.sampled_from(FRAGMENTS), st.integers(1, 300)), min_size=1, max_size=12))
@example([("x" * 997, 60)])
@example([("=" * 613, 80)])
@example([(" word", 4000)])
@example([("漢字かなカナ", 3500)])
def test_long_text_is_never_counted_below_its_whole_encoding(parts: list[tuple[str, int]]) -> None:
    text = "".join(fragment * times for fragment, times in parts)
    whole = len(tiktoken.get_encoding(OFFLINE_ENCODING).encode_ordinary(text))
    counted = TiktokenCounter(tiktoken.get_encoding(OFFLINE_ENCODING)).count(text)
    assert whole <= counted <= max(whole, utf8_size(text))
    if len(text) <= CHUNK_CHARS:
        assert counted == whole


def test_long_text_is_encoded_in_pieces_never_longer_than_a_chunk() -> None:
    counter, encoding = recording_counter()
    assert counter.count("=" * 900_000) >= 900_000 // 64  # cl100k's longest run of "=" is 64
    assert encoding.encoded and max(encoding.encoded) <= CHUNK_CHARS
    assert sum(encoding.encoded) == 900_000


def test_text_above_the_bound_is_counted_by_its_utf8_size_without_encoding() -> None:
    counter, encoding = recording_counter()
    assert counter.count("=" * 8_000_000) == 8_000_000
    assert counter.count("é" * (BOUND_CHARS + 1)) == 2 * (BOUND_CHARS + 1)
    assert counter.count("\ud83d" + "x" * BOUND_CHARS) == BOUND_CHARS + 3  # a lone surrogate: three bytes
    assert encoding.encoded == []


def test_the_utf8_size_is_an_upper_bound_of_the_token_count() -> None:
    encoding = tiktoken.get_encoding(OFFLINE_ENCODING)
    for text in ["漢字かなカナ" * 500, "🙂👍🏽 family 👨‍👩‍👧 " * 300, "x" * 5000, "=" * 5000, " a" * 5000, "é" * 3000]:
        assert len(encoding.encode_ordinary(text)) <= utf8_size(text)


def test_a_50_mb_message_is_counted_without_encoding_it() -> None:
    counter, encoding = recording_counter()
    tokens = MessageCounter(counter).count({"role": "user", "content": "x" * 50_000_000})
    assert tokens == MESSAGE_OVERHEAD + 50_000_000
    assert encoding.encoded == []


@given(st.text(max_size=400), st.lists(st.text(max_size=40), max_size=3), st.booleans())
def test_a_message_s_estimate_is_its_count_with_each_text_estimated_from_its_characters(
        content: str, arguments: list[str], named: bool) -> None:
    """``estimate`` counts a message as ``count`` does (the overhead, the content, each call's name and
    arguments, ``name``), each text ``CharEstimate``'s way, and tokenises nothing. Kept under its key apart from the
    counts: a tally finds it (``known_all``), the projection never takes it for a count (``cached``), and a count
    made later wins."""
    message: dict[str, Any] = {"role": "tool" if named else "assistant", "content": content,
                               "tool_calls": [{"function": {"name": "run", "arguments": a}} for a in arguments]}
    if named:
        message["name"] = "run_shell"
    counter, encoding = recording_counter()
    messages = MessageCounter(counter)
    key = message_hash(message)
    estimated = MessageCounter(CharEstimate()).count(message)
    assert messages.estimate(message, key) == estimated == messages.estimate({"role": "user"}, key)  # kept
    assert encoding.encoded == [] and messages.cached(key) is None and messages.known_all([key, "other"]) == [
        estimated, None]
    counted = messages.count(message, key)
    assert messages.known_all([key]) == [counted]  # counted since: the count
