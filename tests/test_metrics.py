"""``GET /metrics`` counts what the proxy did: tokens its own cuts freed (not only the model's tools), requests by
outcome, and the upstream's and the proxy's own time as histograms."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from ctxproxy.config import load_settings
from ctxproxy.proxy.core.identity import message_hash
from ctxproxy.proxy.core.project import Projection, project
from ctxproxy.proxy.core.state import Rules
from ctxproxy.proxy.core.tokens import MessageCounter
from ctxproxy.proxy.engine.tally import Tally, counting, taken, tally
from tests.conftest import app_client
from tests.fakes import CountingUpstream, FakeUpstream
from tests.test_project import budget, history


def samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def with_result(output: str) -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "sh", "arguments": '{"command": "cat log"}'}}
    return [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Read the log."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": output}]


def test_a_spill_counts_the_tokens_it_freed(tmp_path: Path) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "32768", "CTXPROXY_SPILL_CHARS": "2000"})
    output = "\n".join(f"line {i}: all is well with item number {i}" for i in range(1500))
    with app_client(settings, httpx.ASGITransport(app=FakeUpstream())) as c:
        assert c.post("/v1/chat/completions", json={"model": "m", "messages": with_result(output)}).status_code == 200
        got = samples(c)
    freed = got[("ctxproxy_tokens_freed_total", (("by", "auto"), ("kind", "spill")))]
    assert freed > 10_000  # ~15k tokens of log went to overflow; a stub of a few hundred went upstream
    assert got[("ctxproxy_decisions_total", (("kind", "spill"),))] == 1


def test_requests_are_counted_by_outcome_and_timed(tmp_path: Path) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "4096"})
    too_big = {"model": "m", "messages": [{"role": "system", "content": "rule; " * 5000},
                                          {"role": "user", "content": "go"}]}
    fits = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with app_client(settings, httpx.ASGITransport(app=CountingUpstream(window=100_000))) as c:
        assert c.post("/v1/chat/completions", json=fits).status_code == 200
        assert c.post("/v1/chat/completions", json=too_big).status_code == 400
        got = samples(c)
    assert got[("ctxproxy_requests_total", (("outcome", "ok"),))] == 1
    assert got[("ctxproxy_requests_total", (("outcome", "context_too_large"),))] == 1
    assert got[("ctxproxy_upstream_seconds_count", ())] == 1  # the refused one never went upstream
    assert got[("ctxproxy_added_seconds_count", ())] == 1
    assert got[("ctxproxy_added_seconds_sum", ())] > 0


def tallied(messages: list[dict[str, Any]], rules: Rules) -> tuple[Projection, Tally]:
    counter = MessageCounter()
    hashes = [message_hash(m) for m in messages]
    p = project(messages, hashes, [], rules, counter)
    return p, tally(p, messages, hashes, counter, p.report.estimate, 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=1, max_size=24), st.sets(st.integers(0, 60)), st.integers(0, 2))
@example(sizes=[42, 43, 1, 1, 10, 2, 42, 42, 42, 75], warm={0, 1, 3}, pick=0)  # estimates over and under, one kind
@example(sizes=[1, 1, 1, 1, 1, 1, 42, 42, 42, 42, 62, 69], warm=set(), pick=0)  # a result spilled, then elided
def test_a_tally_estimates_only_what_the_counter_had_not_counted(sizes: list[int], warm: set[int], pick: int) -> None:
    """What the counter had not counted (a result spilled as it came) is estimated from its characters, never
    tokenised for the tally: the tally is the one a counter that knew every original gives, less what each such
    original's estimate is short of its count. It comes out the same from its ``known`` copy, the one the session
    keeps, which nothing is left to estimate in."""
    messages = history([f"output line {n} " * n for n in sizes])
    hashes = [message_hash(m) for m in messages]
    rules = Rules(budget((2048, 4096, 8192)[pick], spill_chars=600))
    p = project(messages, hashes, [], rules, MessageCounter())
    knows_all = MessageCounter()
    for m, h in zip(messages, hashes, strict=True):
        knows_all.count(m, h)
    partly = MessageCounter()
    for i in warm & set(range(len(messages))):
        partly.count(messages[i], hashes[i])
    later = counting(p, messages, hashes, partly, p.report.estimate, 0)
    unknown = [i for i in later.cut if partly.cached(hashes[i]) is None]
    assert later.complete == (not unknown)
    off = [knows_all.count(messages[i]) - partly.estimate(messages[i]) for i in unknown]
    short = sum(off)
    exact = tally(p, messages, hashes, knows_all, p.report.estimate, 0)
    misses = partly.misses
    got = later.finish(partly)
    assert got.tokens_in == exact.tokens_in - short and got.tokens_out == exact.tokens_out
    assert got.freed.keys() == exact.freed.keys()
    # what each kind freed moves by what its own estimates are off, some over, some under: not by their net
    assert sum(abs(got.freed[kind] - exact.freed[kind]) for kind in got.freed) <= sum(map(abs, off))
    assert partly.misses == misses and all(partly.cached(hashes[i]) is None for i in unknown)  # nothing tokenised
    kept = later.known(partly)
    assert kept.complete and kept.finish(MessageCounter()) == got
    assert partly.known_all([hashes[i] for i in unknown]) == [partly.estimate(messages[i]) for i in unknown]


def test_a_tally_counted_after_the_session_moved_on_is_the_one_its_forward_planned() -> None:
    """A forward's tally is counted once its answer has left, when the session's lock is let go: by then the
    session's next request may have extended the projection's state in place. What was taken when the forward was
    planned still counts that forward, cut for cut."""
    messages = history([f"output line {n} " * 300 for n in range(12)])
    hashes = [message_hash(m) for m in messages]
    rules, counter = Rules(budget(2048, spill_chars=600)), MessageCounter()
    p = project(messages, hashes, [], rules, counter)
    planned, expected = taken(p), tally(p, messages, hashes, counter, p.report.estimate, 0)
    longer = messages + history(["next output " * 300], call_id="next_{}")[2:]
    longer_hashes = [message_hash(m) for m in longer]
    project(longer, longer_hashes, list(p.new), rules, counter, p.state, len(messages))
    assert len(p.state.hashes) == len(longer) and len(planned.hashes) == len(messages)  # the state moved on
    later = counting(planned, messages, hashes, counter, p.report.estimate, 0)
    assert expected.freed and later.finish(counter) == expected


def test_an_elision_and_a_fold_count_what_they_took_out() -> None:
    """What each cut freed is what the agent's messages lost: the tally adds up with the projection's estimate."""
    for results, kind in ((["r " * 2000] * 20, "elide"), (["short output " * 10] * 120, "fold")):
        messages = history(results)
        p, counted = tallied(messages, Rules(budget(8192 if kind == "elide" else 4096, spill_chars=100_000)))
        assert kind in [d.kind for d in p.new] and counted.freed[kind] > 0
        assert counted.tokens_in == counted.tokens_out + sum(counted.freed.values())
        assert counted.tokens_in == MessageCounter().count_tools(None) + sum(
            MessageCounter().count(m) for m in messages)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=2, max_size=40), st.lists(st.booleans(), min_size=40, max_size=40),
       st.integers(0, 2))
def test_a_tally_taken_on_from_the_last_one_is_the_one_counted_from_the_start(
        sizes: list[int], finished: list[bool], pick: int) -> None:
    """A session's tally walks only what changed since its last one (``counting``'s ``last``): request after
    request of a session that spills, elides and folds, whether the last tally's originals were known (the copy
    the session keeps, ``known``) or not, it comes out as the tally walked from the first message. It fails if the
    cuts standing from the last tally are dropped, or counted twice, or a settled original is taken for one not
    known."""
    rules, counter = Rules(budget((2048, 4096, 8192)[pick], spill_chars=600)), MessageCounter()
    decisions: list[Any] = []
    state, last, seen, kinds = None, None, 0, set()
    for n in range(1, len(sizes) + 1):
        messages = history([f"output line {k} " * size for k, size in enumerate(sizes[:n])])
        hashes = [message_hash(m) for m in messages]
        p = project(messages, hashes, list(decisions), rules, counter, state, seen)
        decisions += p.new
        kinds |= {d.kind for d in p.new}
        state, seen, t = p.state, len(messages), taken(p)
        walked_on = counting(t, messages, hashes, counter, p.report.estimate, 0, last)
        from_start = counting(t, messages, hashes, counter, p.report.estimate, 0)
        assert walked_on.cut == from_start.cut and walked_on.stubs == from_start.stubs
        assert walked_on.finish(counter) == from_start.finish(counter)
        last = walked_on.known(counter) if finished[n - 1] else walked_on
    assert "spill" in kinds or max(sizes) < 100  # the rules did cut (a result of 1,400 characters is spilled)
