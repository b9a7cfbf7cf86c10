"""Fuzzing the HTTP surface and the upstream's answers (issue #10): whatever comes in, never a 500, every error in
the OpenAI envelope, never a stream cut without an error event, and a response row for every journaled request.

(a) Valid chat requests are mutated at random (a value swapped for another type, a key removed, a value nested
deep, a lone surrogate as a key or a value, huge and negative numbers) and posted to the real app in process,
against the scripted fake upstream, streamed and not. (b) Valid upstream answers, buffered JSON and SSE chunks,
are mutated the same way (or replaced by bytes that are not JSON): the client gets a well-formed answer, a 502
``upstream_malformed``, or, once a stream has started, an SSE error event and ``[DONE]``.

Sized to run in well under a minute on a loaded 2-core machine; every failure Hypothesis found is pinned with
``@example``. ``FUZZ_EXAMPLES`` raises the count for a longer run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ctxproxy.config import load_settings
from ctxproxy.proxy.upstream.answers import check_completion
from ctxproxy.proxy.upstream.sse import sse_lines
from ctxproxy.store import Journal
from tests.conftest import app_client
from tests.fakes import FakeUpstream, Reply, completion, stream_chunks, stream_tool_answer, tool_answer

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
"""Per test (four of them). 150 runs each in ~5-10 s here."""
DEEP = "\x00deep\x00"
"""A marker string replaced, once serialised, by nesting too deep for ``json.dumps`` to write."""
ENVELOPE = {"message", "type", "param", "code"}

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]
REQUESTS: list[dict[str, Any]] = [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "tools": TOOLS, "stream_options": {"include_usage": True}, "max_tokens": 50, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"a\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "line\n" * 40},
        {"role": "user", "content": "and now?"}]},
]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2 ** 63, max_value=2 ** 80),
    st.integers(max_value=-1), st.floats(), st.text(max_size=20),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    st.sampled_from(["user", "assistant", "tool", "system", "function", "text", "image_url", "[DONE]", DEEP]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["role", "content", "type", "text", "function", "name", "id", "index", "tool_calls", "x"]),
    inner, max_size=3), max_leaves=6)


def paths(node: Any, here: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every position in a JSON tree (the root excluded)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield (*here, key)
        yield from paths(child, (*here, key))


def mutate(draw: Callable[[st.SearchStrategy[Any]], Any], tree: Any, rounds: int = 3) -> Any:
    """``tree`` (a deep copy) with one to ``rounds`` random mutations."""
    tree = json.loads(json.dumps(tree))
    for _ in range(draw(st.integers(1, rounds))):
        spots = list(paths(tree))
        if not spots:
            return draw(values)
        *parent_path, key = draw(st.sampled_from(spots))
        parent = tree
        for step in parent_path:
            parent = parent[step]
        kind = draw(st.sampled_from(["replace", "replace", "delete", "nest", "surrogate_key"]))
        if kind == "replace":
            parent[key] = draw(values)
        elif kind == "nest":
            parent[key] = draw(st.sampled_from([[parent[key]], {"x": parent[key]}, [DEEP]]))
        elif kind == "delete":
            del parent[key]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(["\ud800", "\udfff", "a\ud83d"]))] = parent.pop(key)
    return tree


@st.composite
def mutated_requests(draw: Callable[[st.SearchStrategy[Any]], Any], stream: bool) -> bytes:
    base = draw(st.sampled_from(REQUESTS)) | {"stream": stream}
    return dumps(mutate(draw, base), draw(st.sampled_from([3, 260, 1100])))


def dumps(tree: Any, depth: int) -> bytes:
    """JSON as a client might send it: lone surrogates as \\u escapes, NaN as the stdlib writes it, and the DEEP
    marker as ``depth`` nested arrays."""
    text = json.dumps(tree, ensure_ascii=True)
    return text.replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[TestClient, FakeUpstream, Journal]]:
    fake = FakeUpstream()
    env = {"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://upstream.test/v1",
           "CTXPROXY_CTX_WINDOW": "32768"}
    with app_client(load_settings(env=env), httpx.ASGITransport(app=fake)) as client:
        yield client, fake, Journal(tmp_path / "journal.db")


def streams(body: bytes) -> bool:
    try:
        return json.loads(body).get("stream") is True
    except (ValueError, AttributeError, RecursionError):
        return False


def answers_for(body: bytes, context: bool) -> list[Reply]:
    """The fake's scripted answers to what the proxy will forward, streamed if the request asked for it: the
    answer; or first a call of a context tool on the request's own tool result (the proxy runs it and asks again)."""
    usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
    drop = ("context_drop", {"handles": ["call_1"]})
    if streams(body):
        return [Reply(sse=stream_tool_answer(drop, usage=usage))] * context + [Reply(sse=stream_chunks("fine",
                                                                                                       usage=usage))]
    return [Reply(body=tool_answer(drop))] * context + [Reply(body=completion("fine"))]


def assert_sane(response: httpx.Response, streamed: bool) -> None:
    """Never a 500; an error is the envelope; a stream ends with [DONE], an error event only just before it."""
    assert response.status_code != 500, response.text
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == ENVELOPE, response.text
        return
    if not streamed:
        check_completion(response.json())
        return
    events = [line[6:] for line in sse_lines(response.text) if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text[-500:]
    for i, event in enumerate(events[:-1]):
        parsed = json.loads(event)
        if isinstance(parsed, dict) and "error" in parsed:
            assert set(parsed["error"]) == ENVELOPE and i == len(events) - 2, response.text[-500:]


def assert_journal_whole(journal: Journal) -> None:
    """Every journaled request has its answer row."""
    unanswered = journal.conn.execute("SELECT COUNT(*) FROM requests r WHERE NOT EXISTS"
                                    " (SELECT 1 FROM responses p WHERE p.request_id = r.id)").fetchone()[0]
    assert unanswered == 0


def run(lab: tuple[TestClient, FakeUpstream, Journal], body: bytes, replies: list[Reply]) -> httpx.Response:
    client, fake, journal = lab
    fake.replies.clear()
    for reply in replies:
        fake.enqueue(reply)
    response = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    streamed = replies[0].sse is not None
    assert_sane(response, streamed and response.status_code == 200)
    assert_journal_whole(journal)
    return response


COUNTS: dict[str, Counter] = {}


class Counter:
    """Examples run and 500s seen per fuzz test, printed at the end of the session (``-s``) for the report."""

    def __init__(self) -> None:
        self.examples = self.errors = 0


def counted(name: str) -> Callable[[httpx.Response], None]:
    counter = COUNTS.setdefault(name, Counter())

    def count(response: httpx.Response) -> None:
        counter.examples += 1
        counter.errors += response.status_code == 500
    return count


def pinned_request(**fields: Any) -> bytes:
    base = {"model": "m", "stream": False, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps(base | fields).encode()


PINNED_REQUESTS = [  # issue #10 item 2, and what this fuzz found before the edge checked it
    pinned_request(tools=[{"type": "function", "function": "f"}]),
    pinned_request(messages=[{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]),
    pinned_request(x=DEEP).replace(json.dumps(DEEP).encode(), b"[" * 300 + b"]" * 300),
    pinned_request(x=DEEP).replace(json.dumps(DEEP).encode(), b"[" * 1100 + b"]" * 1100),
    pinned_request(messages=[{"role": "user", "content": "hi", "\ud800": 1}]),
    pinned_request(n=2 ** 70, messages=[{"role": "user", "content": "\udfff"}]),
    pinned_request(tools=[{"function": {"name": ["read_file"]}}]),
    pinned_request(messages=[{"role": "user", "content": [None]}]),
]


def pin_requests(test: Callable[..., None], stream: bool) -> Callable[..., None]:
    for body in PINNED_REQUESTS:
        test = example(body=body.replace(b'"stream": false', b'"stream": true') if stream else body,
                       context=False)(test)
    return test


@pytest.mark.parametrize("stream", [False, True])
def test_mutated_requests_never_get_a_500(lab: tuple[TestClient, FakeUpstream, Journal], stream: bool) -> None:
    count = counted(f"requests stream={stream}")

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(body=mutated_requests(stream), context=st.booleans())
    def check(body: bytes, context: bool) -> None:
        count(run(lab, body, answers_for(body, context)))

    pin_requests(check, stream)()


@st.composite
def mutated_answers(draw: Callable[[st.SearchStrategy[Any]], Any], stream: bool) -> Reply:
    if draw(st.integers(0, 9)) == 0:  # not JSON at all
        junk = draw(st.sampled_from([b"<html>502</html>", b"", b"data: {", b"\xff\xfe", b"null"]))
        return Reply(sse=[junk]) if stream else Reply(raw=junk)
    if stream:
        chunks = draw(st.sampled_from([
            stream_chunks("a b c", usage={"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}),
            stream_tool_answer(("read_file", {"path": "a"}), content="let me look"),
            stream_tool_answer(("context_status", {}))]))
        return Reply(sse=mutate(draw, chunks))
    answer = draw(st.sampled_from([completion("fine"), tool_answer(("read_file", {"path": "a"})),
                                   tool_answer(("context_status", {}))]))
    return Reply(body=mutate(draw, answer, rounds=2))


CHUNK = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "a"}}]}
PINNED_ANSWERS = [  # issue #10 item 3, and what this fuzz found since
    Reply(body={"choices": ["x"]}),
    Reply(body=completion("fine") | {"usage": {"prompt_tokens": -5, "completion_tokens": 1}}),
    Reply(raw=b"<html>502</html>"),
    Reply(sse=[CHUNK, {"choices": [{"delta": {"tool_calls": [{"index": "z", "function": {"name": "f"}}]}}]}]),
    Reply(sse=[CHUNK, {"choices": "x"}]),
    Reply(sse=[CHUNK, {"choices": [], "usage": "x"}]),
    Reply(sse=[CHUNK, {"choices": [], "usage": {"prompt_tokens": -5, "completion_tokens": 1}}]),
    Reply(sse=[b"data: {"]),  # a data event that is not JSON (it ran into the [DONE] after it): was relayed
]


def pin_answers(test: Callable[..., None], stream: bool) -> Callable[..., None]:
    for reply in PINNED_ANSWERS:
        if (reply.sse is not None) == stream:
            test = example(reply=reply)(test)
    return test


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_upstream_answers_are_502s_or_error_events(
        lab: tuple[TestClient, FakeUpstream, Journal], stream: bool) -> None:
    count = counted(f"answers stream={stream}")
    body = json.dumps(REQUESTS[1] | {"stream": stream}).encode()

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(reply=mutated_answers(stream))
    def check(reply: Reply) -> None:
        response = run(lab, body, [reply])
        count(response)
        if response.status_code >= 500:
            assert response.json()["error"]["code"] in ("upstream_malformed", "upstream_disconnected"), response.text

    pin_answers(check, stream)()


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    for name, counter in COUNTS.items():
        print(f"\nfuzz {name}: {counter.examples} examples, {counter.errors} x 500")
