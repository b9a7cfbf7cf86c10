"""The context tools, executed by the proxy: the model calls them, the agent never sees them, the effect shows in
the next upstream request, and what was cut comes back byte for byte (non-streamed answers)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import load_settings
from ctxproxy.proxy.core.stubs import parse_stub
from ctxproxy.proxy.tools.schemas import CONTEXT_TOOLS, TOOL_NAMES
from tests.conftest import app_client, session_mirror
from tests.fakes import FakeUpstream, Reply, completion, stream_chunks, stream_tool_answer, tool_answer

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = json.loads((ROOT / "docs" / "api" / "sse_events.json").read_text())
AGENT_TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]
BIG = "SECRET_TOKEN=needle-4471\n" + "".join(f"line {i}: some output of the tool\n" for i in range(1500))


@pytest.fixture
def client(roomy_client: TestClient) -> TestClient:
    return roomy_client


def history(results: int = 3, ask: str = "Please free up your context, then go on.") -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": ask}]
    for k in range(results):
        cid = f"call_{k}"
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": BIG if k == 1 else f"small result {k}"})
    return msgs


def ask(client: TestClient, messages: list[dict[str, Any]]) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": messages})


def sent_names(fake: FakeUpstream, n: int = -1) -> list[str]:
    return [t["function"]["name"] for t in fake.chats[n].json().get("tools") or []]


def test_tools_are_offered_when_the_person_asks_after_the_agents_own(client: TestClient, fake: FakeUpstream) -> None:
    ask(client, history())
    assert sent_names(fake) == ["read_file", *[t["function"]["name"] for t in CONTEXT_TOOLS]]
    ask(client, history(4))  # same turn: still offered, byte-identical
    assert fake.chats[-1].json()["tools"] == fake.chats[-2].json()["tools"]


def test_tools_are_not_offered_to_a_quiet_small_request(client: TestClient, fake: FakeUpstream) -> None:
    ask(client, history(ask="Fix the bug."))
    assert fake.chats[-1].json() == {"model": "m", "tools": AGENT_TOOLS, "messages": history(ask="Fix the bug.")}


def test_a_drop_is_executed_the_agent_never_sees_it_and_the_result_is_restorable(
        client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("context_drop", {"handles": ["call_1"]}))))
    fake.enqueue(Reply(body=completion("done")))
    answer = ask(client, history())
    assert answer.json()["choices"][0]["message"] == {"role": "assistant", "content": "done"}
    assert answer.headers["x-ctx-internal-rounds"] == "1"
    follow_up = fake.chats[-1].json()["messages"]
    dropped = next(m for m in follow_up if m.get("tool_call_id") == "call_1")
    oid = re.match(r"\[overflow id=([0-9a-f]{64}) ", dropped["content"]).group(1)  # type: ignore[union-attr]
    result = next(m for m in follow_up if m.get("tool_call_id") == "ctx_0_context_drop")
    assert "drop: applied to call_1" in result["content"] and "tokens freed" in result["content"]
    session = answer.headers["x-ctx-session"]
    assert client.get(f"/ctx/sessions/{session}/overflow/{oid}").content == BIG.encode()
    ask(client, [*history(), {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}])
    later = fake.chats[-1].json()["messages"]
    assert next(m for m in later if m.get("tool_call_id") == "call_1")["content"] == dropped["content"]
    assert any(m["role"] == "system" and "Applied since your last request" in m["content"] for m in later)


def test_read_overflow_returns_the_original_byte_for_byte(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("context_drop", {"handles": ["call_1"]}))))
    fake.enqueue(Reply(body=completion("ok")))
    ask(client, history())
    oid = re.search(r"id=([0-9a-f]{64})", fake.chats[-1].json()["messages"][5]["content"]).group(1)  # type: ignore
    fake.enqueue(Reply(body=tool_answer(("read_overflow", {"id": oid, "limit": 20000}))))
    fake.enqueue(Reply(body=tool_answer(("read_overflow", {"id": oid, "offset": 20000, "limit": 20000}))))
    fake.enqueue(Reply(body=tool_answer(("read_overflow", {"id": oid, "grep": "needle|line 1499:"}))))
    fake.enqueue(Reply(body=completion("read it")))
    ask(client, history(4))
    pages = [m["content"] for m in fake.chats[-1].json()["messages"] if m.get("tool_call_id", "").startswith("ctx_")]
    first, second, grep = pages[-3:]
    assert first.startswith(BIG[:20000]) and first.endswith(f"[… {len(BIG) - 20000} more characters: "
                                                            "read_overflow with offset=20000]")
    assert second.startswith(BIG[20000:40000]) and "offset=40000" in second
    assert grep.splitlines() == ["1: SECRET_TOKEN=needle-4471", "1501: line 1499: some output of the tool"]


def test_mixed_answers_return_only_the_agents_calls(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("context_drop", {"handles": ["call_1"]}), ("read_file", {"path": "b.py"}))))
    answer = ask(client, history())
    calls = answer.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["read_file"]
    assert len(fake.chats) == 1  # no follow-up round: the agent runs its call
    ask(client, [*history(), answer.json()["choices"][0]["message"],
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "b"}])
    assert next(m for m in fake.chats[-1].json()["messages"]
                if m.get("tool_call_id") == "call_1")["content"].startswith("[overflow id=")


def test_a_model_that_calls_context_tools_forever_is_cut_off_and_the_agent_still_gets_an_answer(
        client: TestClient, fake: FakeUpstream) -> None:
    for _ in range(10):
        fake.enqueue(Reply(body=tool_answer(("context_status", {}), content="checking")))
    answer = ask(client, history())
    assert answer.status_code == 200
    message = answer.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == "checking"
    assert len(fake.chats) == 5  # the first ask and max_context_rounds (4) follow-ups
    assert not set(sent_names(fake)) & TOOL_NAMES  # the last round went without the context tools
    assert answer.headers["x-ctx-internal-rounds"] == "4"


def results_of(fake: FakeUpstream) -> list[str]:
    return [m["content"] for m in fake.chats[-1].json()["messages"] if m.get("tool_call_id", "").startswith("ctx_")]


def test_each_refusal_says_why(client: TestClient, fake: FakeUpstream) -> None:
    msgs = history(5)
    msgs[-1]["content"] = "deploy waiting: approval_id=AX-42 " + "x" * 700
    fake.enqueue(Reply(body=tool_answer(("context_pin", {"handles": ["call_3"]}))))
    fake.enqueue(Reply(body=tool_answer(("context_drop", {"handles": ["call_3", "call_4", "nope", "call_1"]}))))
    fake.enqueue(Reply(body=tool_answer(("context_drop", {"handles": ["call_1"]}))))
    fake.enqueue(Reply(body=completion("ok")))
    ask(client, msgs)
    pin, drop, again = results_of(fake)
    assert "pin: applied to call_3" in pin
    assert "call_3: pinned; unpin it first" in drop and "call_4: carries a pending approval id" in drop
    assert "nope: no result with this handle" in drop and "applied to call_1" in drop
    assert "call_1: already a stub" in again


def test_model_pins_are_capped_and_unpin_all_spares_the_operators(tmp_path: Path, fake: FakeUpstream) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "131072", "CTXPROXY_MAX_PINS": "1",
                                  "CTXPROXY_SPILL_CHARS": "100000"})
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        session = ask(client, history()).headers["x-ctx-session"]
        client.post(f"/ctx/sessions/{session}/pins", json={"handle": "tool:call_0"})
        fake.enqueue(Reply(body=tool_answer(("context_pin", {"handles": ["call_1", "call_2"]}))))
        fake.enqueue(Reply(body=tool_answer(("context_unpin", {"all": True}))))
        fake.enqueue(Reply(body=completion("ok")))
        ask(client, history(4))
        pin, unpin = results_of(fake)
        assert "applied to call_1" in pin and "call_2: you hold 1 pins, the most allowed" in pin
        assert "unpin: applied to tool:call_1" in unpin and "Operator pins were left" in unpin
        assert client.get(f"/ctx/sessions/{session}/pins").json()["pins"] == ["tool:call_0"]


def test_a_note_replaces_results_and_preserves_ids_and_sources(client: TestClient, fake: FakeUpstream) -> None:
    msgs = history(3)
    msgs[3]["content"] = "see https://tracker.example/issues/12 and src/app/parser.py; approval_id=Q-7 " + "y" * 800
    note = "call_0 showed the tracker issue; call_1 is the big log, nothing needed from it."
    fake.enqueue(Reply(body=tool_answer(("context_note", {"handles": ["call_0", "call_1"], "note": note}))))
    fake.enqueue(Reply(body=completion("ok")))
    ask(client, msgs)
    sent = {m.get("tool_call_id"): m["content"] for m in fake.chats[-1].json()["messages"] if m["role"] == "tool"}
    first = sent["call_0"]
    assert first.startswith(note) and first.count("[overflow id=") == 2
    assert "Preserved (compaction-safe):" in first and "- approval_id=Q-7" in first
    assert "- https://tracker.example/issues/12" in first and "- src/app/parser.py" in first
    assert sent["call_1"].startswith("[overflow id=") and "Summarized in your note on call_0" in sent["call_1"]


def test_every_event_validates_against_the_catalogue(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("context_status", {"top": 3}), ("context_drop", {"handles": ["call_1"]}),
                                        ("context_pin", {"snippet": "small result 2"}),
                                        ("context_note", {"handles": ["nope"], "note": "x"}),
                                        ("read_overflow", {"id": "0" * 64}), ("context_drop", {}))))
    fake.enqueue(Reply(body=completion("ok")))
    ask(client, history())
    events = list(client.app.state.ctx.events.recent)  # type: ignore[attr-defined]
    assert [e["op"] for e in events] == ["status", "drop", "pin", "note", "read_overflow", "drop"]
    assert [e["ok"] for e in events] == [True, True, True, False, False, False]
    for event in events:
        jsonschema.validate(event, CATALOGUE["events"][event["type"]])
    assert events[1]["tokens_freed"] > 1000 and len(events[1]["overflow_ids"]) == 1


# --- streamed --------------------------------------------------------------------------------------------------

def ask_streamed(client: TestClient, messages: list[dict[str, Any]]) -> list[Any]:
    answer = client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": messages,
                                                       "stream": True, "stream_options": {"include_usage": True}})
    assert answer.status_code == 200
    events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def deltas(chunks: list[Any]) -> tuple[str, list[Any], list[str]]:
    text, calls, reasons = "", [], []
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            text += choice.get("delta", {}).get("content") or ""
            calls += choice.get("delta", {}).get("tool_calls") or []
            reasons += [choice["finish_reason"]] if choice.get("finish_reason") else []
    return text, calls, reasons


def test_a_streamed_drop_is_swallowed_and_the_stream_goes_on(client: TestClient, fake: FakeUpstream) -> None:
    usage = {"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55}
    fake.enqueue(Reply(sse=stream_tool_answer(("context_drop", {"handles": ["call_1"]}), content="Let me tidy.",
                                              usage=usage)))
    fake.enqueue(Reply(sse=stream_chunks("All done.", usage={"prompt_tokens": 40, "completion_tokens": 3,
                                                             "total_tokens": 43})))
    chunks = ask_streamed(client, history())
    text, calls, reasons = deltas(chunks)
    assert text == "Let me tidy. All done. " and calls == [] and reasons == ["stop"]
    assert [c["usage"]["prompt_tokens"] for c in chunks if c.get("usage")] == [40]  # the final answer's only
    follow_up = fake.chats[-1].json()["messages"]
    assert next(m for m in follow_up if m.get("tool_call_id") == "call_1")["content"].startswith("[overflow id=")


def test_a_streamed_mixed_answer_gives_the_agent_only_its_calls(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(sse=stream_tool_answer(("context_pin", {"handles": ["call_2"]}),
                                              ("read_file", {"path": "b.py"}))))
    _, calls, reasons = deltas(ask_streamed(client, history()))
    session = client.get("/ctx/sessions").json()["sessions"][0]["id"]
    assert client.get(f"/ctx/sessions/{session}/pins").json()["pins"] == ["tool:call_2"]  # the pin ran too
    assert {c["index"] for c in calls} == {0} and calls[0]["function"]["name"] == "read_file"
    assert "".join(c["function"].get("arguments", "") for c in calls) == '{"path": "b.py"}'
    assert reasons == ["tool_calls"] and len(fake.chats) == 1


def test_a_streamed_model_that_never_stops_calling_is_cut_off(client: TestClient, fake: FakeUpstream) -> None:
    for _ in range(10):
        fake.enqueue(Reply(sse=stream_tool_answer(("context_status", {}), content="hmm")))
    text, calls, reasons = deltas(ask_streamed(client, history()))
    assert calls == [] and reasons == ["stop"] and text.count("hmm") == 5 and len(fake.chats) == 5


def test_ops_are_journaled_and_counted_in_the_scorecard_and_metrics(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("context_status", {}), ("context_drop", {"handles": ["call_1"]}))))
    fake.enqueue(Reply(body=completion("ok", prompt_tokens=200)))
    session = ask(client, history()).headers["x-ctx-session"]
    ask(client, [*history(), {"role": "assistant", "content": "ok"}, {"role": "user", "content": "a new turn"}])
    card = client.get("/ctx/scorecard").json()
    second, row = [r for r in card["rows"] if r["session_id"] == session]  # newest turn first
    assert second["rounds"] == 1 and "context_ops" not in second
    assert row["context_ops"]["status"] == 1 and row["context_ops"]["drops"] == 1
    assert row["context_ops"]["tokens_freed"] > 1000 and row["rounds"] == 1 and row["tool_calls"] == 3
    assert row["input_tokens"] == 300  # both internal rounds' prompts
    metrics = client.get("/metrics").text
    assert 'ctxproxy_context_ops_total{ok="true",op="drop"} 1.0' in metrics
    assert "ctxproxy_tokens_freed_total" in metrics and 'ctxproxy_requests_total{outcome="ok"} 2.0' in metrics


def test_the_events_endpoint_streams_context_ops(tmp_path: Path) -> None:
    import threading

    from ctxproxy.proxy.edge.app import create_app
    from tests.fakes import serve_in_thread

    upstream = FakeUpstream()
    with serve_in_thread(upstream) as direct:
        settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": direct + "/v1"})
        with serve_in_thread(create_app(settings)) as proxy:
            received: list[str] = []
            ready = threading.Event()

            def listen() -> None:
                with httpx.stream("GET", proxy + "/ctx/events", timeout=10) as events:
                    for line in events.iter_lines():
                        ready.set()
                        if line.startswith("data: "):
                            received.append(line[6:])
                            return

            listener = threading.Thread(target=listen)
            listener.start()
            ready.wait(5)
            upstream.enqueue(Reply(body=tool_answer(("context_status", {}))))
            upstream.enqueue(Reply(body=completion("ok")))
            httpx.post(proxy + "/v1/chat/completions", timeout=10,
                       json={"model": "m", "tools": AGENT_TOOLS, "messages": history()})
            listener.join(10)
    (event,) = [json.loads(r) for r in received]
    jsonschema.validate(event, CATALOGUE["events"]["context_op"])
    assert event["op"] == "status"


def test_a_model_pin_is_honoured_when_elision_comes(tmp_path: Path, fake: FakeUpstream) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "8192", "CTXPROXY_SPILL_CHARS": "100000"})
    msgs = history(1)
    msgs[3]["content"] = "keep me: " + "k" * 2500
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        fake.enqueue(Reply(body=tool_answer(("context_pin", {"handles": ["call_0"]}))))
        fake.enqueue(Reply(body=completion("pinned")))
        ask(client, msgs)
        for k in range(1, 12):  # enough results to cross the budget and force an elision
            msgs += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{k}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": f"call_{k}", "content": f"{k}" * 2500}]
            ask(client, msgs)
    sent = {m.get("tool_call_id"): m["content"] for m in fake.chats[-1].json()["messages"] if m["role"] == "tool"}
    assert sent["call_0"] == msgs[3]["content"]  # pinned: whole
    assert sent["call_1"].startswith("[overflow id=")  # its neighbour was elided


def test_a_stream_carries_its_context_ops_as_comments(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(sse=stream_tool_answer(("context_status", {}))))
    fake.enqueue(Reply(sse=stream_chunks("ok")))
    answer = client.post("/v1/chat/completions", json={"model": "m", "tools": AGENT_TOOLS, "messages": history(),
                                                       "stream": True})
    comments = [line for line in answer.text.splitlines() if line.startswith(": context_op ")]
    assert [json.loads(c.removeprefix(": context_op "))["op"] for c in comments] == ["status"]
    assert ": ctxproxy internal_rounds=1" in answer.text


def test_the_reminder_comes_once_per_turn_at_the_soft_ceiling(tmp_path: Path, fake: FakeUpstream) -> None:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "16384", "CTXPROXY_SPILL_CHARS": "100000",
                                  "CTXPROXY_SOFT_CEILING_PCT": "0.5"})
    msgs = history(1, ask="Fix the bug.")
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        for k in range(1, 15):  # about 1000 tokens a result: offered at 45% of the window, reminded at 50%
            msgs += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{k}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": f"call_{k}", "content": f"{k}" * 3000}]
            ask(client, msgs)
    reminders = [i for i, r in enumerate(fake.chats)
                 if any("Your context is nearly full" in str(m.get("content")) for m in r.json()["messages"])]
    assert len(reminders) == 1 and "context_drop" in sent_names(fake, reminders[0])
    assert "context_drop" in sent_names(fake, -1)  # still offered, the reminder not repeated


def test_a_follow_up_that_does_not_fit_ends_with_the_answer_so_far(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=tool_answer(("context_status", {}), content="Checking my context.")))
    fake.enqueue(Reply(status=400, body={"error": {"type": "exceed_context_size_error", "n_prompt_tokens": 9000,
                                                   "n_ctx": 8192, "message": "exceeds the available context size"}}))
    answer = ask(client, history())
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"] == {"role": "assistant", "content": "Checking my context."}
    assert client.app.state.ctx.contexts.window_limits == {}  # type: ignore[attr-defined]  # learned nothing


@pytest.mark.parametrize("stream", [False, True])
def test_read_overflow_after_a_drop_returns_the_original(client: TestClient, fake: FakeUpstream, stream: bool) -> None:
    import hashlib

    oid = hashlib.sha256(BIG.encode()).hexdigest()
    calls = (("context_drop", {"handles": ["call_1"]}), ("read_overflow", {"id": oid, "limit": 20000}))
    fake.enqueue(Reply(sse=stream_tool_answer(*calls)) if stream else Reply(body=tool_answer(*calls)))
    fake.enqueue(Reply(sse=stream_chunks("ok")) if stream else Reply(body=completion("ok")))
    if stream:
        ask_streamed(client, history())
    else:
        ask(client, history())
    read = next(m for m in fake.chats[-1].json()["messages"] if m.get("tool_call_id") == "ctx_1_read_overflow")
    assert read["content"].startswith(BIG[:20000]) and f"{len(BIG) - 20000} more characters" in read["content"]


def test_ctx_clear_selects_then_the_masks_narrow_and_a_repeat_has_nothing_to_clear(
        client: TestClient, fake: FakeUpstream) -> None:
    msgs = history(6)
    for k in range(6):
        msgs[3 + 2 * k]["content"] = f"result {k} " * 100  # 1000 characters each: cuttable
    msgs[4]["tool_calls"][0]["function"]["name"] = "grep"  # call_1 was a grep, the rest read_file
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "clear", "before": "call_5", "keep_last": 1,
                                                  "tool": "read_file"}))))
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "clear", "call_ids": ["call_0", "call_2"]}))))
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "clear", "keep_last": 2}), ("ctx", {}))))
    fake.enqueue(Reply(body=completion("ok")))
    ask(client, msgs)
    first, again, masks_alone, commit = results_of(fake)
    assert "clear: applied to call_0, call_2, call_3." in first  # before call_5, read_file only, the newest spared
    assert "nothing to clear" in again and "masks only" not in again
    assert "clear: applied to call_1." in masks_alone  # the masks alone select: all but the newest two
    assert "there is no LIVE_CONTEXT.json to commit" in commit
    sent = {m.get("tool_call_id"): m["content"] for m in fake.chats[-1].json()["messages"] if m["role"] == "tool"}
    assert sent["call_0"].startswith("[overflow id=") and "Cleared by you (ctx clear)" in sent["call_0"]
    assert sent["call_1"].startswith("[overflow") and not sent["call_4"].startswith("[overflow")


# --- the live mirror ---------------------------------------------------------------------------------------------

@pytest.fixture
def mirrored(tmp_path: Path, fake: FakeUpstream) -> Iterator[tuple[TestClient, Path]]:
    """Eight newest results protected and each about 1000 tokens: elision cannot reach the target alone."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "16384", "CTXPROXY_SPILL_CHARS": "100000",
                                  "CTXPROXY_KEEP_RESULTS": "8", "CTXPROXY_MIRROR_DIR": str(tmp_path / "ws")})
    with app_client(settings, httpx.ASGITransport(app=fake)) as test_client:
        yield test_client, session_mirror(tmp_path / "ws", crowded())


def crowded() -> list[dict[str, Any]]:
    msgs = history(1, ask="Fix the bug.")
    for k in range(1, 14):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": f"{k % 10}" * 3000}]
    return msgs


def test_the_mirror_is_written_and_an_edit_that_removes_results_is_applied(
        mirrored: tuple[TestClient, Path], fake: FakeUpstream) -> None:
    client, path = mirrored
    ask(client, crowded())
    assert path.exists() and "You manage your context" in fake.chats[-1].json()["messages"][-1]["content"]
    draft = json.loads(path.read_text())
    draft["messages"] = [e for e in draft["messages"] if e.get("tool_call_id") not in ("call_8", "call_9")]
    path.write_text(json.dumps(draft))  # what the agent's own edit tool would do
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "commit"}))))
    fake.enqueue(Reply(body=completion("ok")))
    ask(client, crowded())
    assert "ctx commit: applied, 2 tool result(s) cut." in results_of(fake)[-1]
    sent = {m.get("tool_call_id"): m["content"] for m in fake.chats[-1].json()["messages"] if m["role"] == "tool"}
    assert sent["call_8"].startswith("[overflow id=") and "Cut by you in the mirror" in sent["call_8"]
    assert parse_stub(sent["call_8"].splitlines()[0])["tool"] == "read_file"  # type: ignore[index]  # not "?"
    assert not sent["call_10"].startswith("[overflow")
    assert journaled_ops(path) == [("commit", 1, "ctx commit: applied, 2 tool result(s) cut.")]


def test_a_mirror_edit_that_changes_the_person_is_refused_with_a_reason(
        mirrored: tuple[TestClient, Path], fake: FakeUpstream) -> None:
    client, path = mirrored
    ask(client, crowded())
    draft = json.loads(path.read_text())
    person = next(e for e in draft["messages"] if e["role"] == "user")
    person["content"] = "Never mind the bug."
    path.write_text(json.dumps(draft))
    fake.enqueue(Reply(body=tool_answer(("ctx", {}))))  # an empty object means commit
    fake.enqueue(Reply(body=completion("ok")))
    ask(client, crowded())
    reply = results_of(fake)[-1]
    assert "refused, nothing applied" in reply and f"the user message {person['id']} was changed" in reply
    sent = [m["content"] for m in fake.chats[-1].json()["messages"] if m["role"] == "tool"]
    assert sum(c.startswith("[overflow id=") and "mirror" in c for c in sent) == 0
    assert [(op, ok) for op, ok, _ in journaled_ops(path)] == [("commit", 0)]


def journaled_ops(mirror: Path) -> list[tuple[str, int, str]]:
    from ctxproxy.store import Journal

    journal = Journal(mirror.parent.parent.parent / "data" / "journal.db")
    return [tuple(r) for r in journal.conn.execute("SELECT op, ok, result FROM context_ops ORDER BY id")]  # type: ignore


def test_the_agents_own_mirror_edits_leave_the_projection_once_applied(
        mirrored: tuple[TestClient, Path], fake: FakeUpstream) -> None:
    client, path = mirrored
    msgs = crowded()
    ask(client, msgs)
    draft = json.loads(path.read_text())
    draft["messages"] = [e for e in draft["messages"] if e.get("tool_call_id") != "call_8"]
    path.write_text(json.dumps(draft))

    def round_(cid: str, name: str, args: dict[str, Any], result: str) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": cid, "content": result}]

    msgs += round_("m1", "read_file", {"path": str(path)}, "{...the mirror...}")
    msgs += round_("m2", "edit_file", {"path": str(path), "old": "x", "new": "y"}, "edited")
    msgs += round_("s1", "bash", {"command": f"sed -i s/a/b/ {path}"}, "done")
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "commit"}))))
    fake.enqueue(Reply(body=completion("committed")))
    ask(client, msgs)
    ask(client, [*msgs, {"role": "assistant", "content": "committed"}, {"role": "user", "content": "go on"}])
    ids = [m.get("tool_call_id") for m in fake.chats[-1].json()["messages"] if m["role"] == "tool"]
    assert "m1" not in ids and "m2" not in ids  # the file edits are gone from what the model sees
    assert "s1" in ids  # a shell edit of the same file is not mirror maintenance
    sent = fake.chats[-1].json()["messages"]
    assert not any(c.get("id") in ("m1", "m2") for m in sent for c in m.get("tool_calls") or [])


def test_a_mirror_edit_that_makes_a_result_longer_is_refused(
        mirrored: tuple[TestClient, Path], fake: FakeUpstream) -> None:
    client, path = mirrored
    ask(client, crowded())
    draft = json.loads(path.read_text())
    entry = next(e for e in draft["messages"] if e.get("tool_call_id") == "call_9")
    entry["content"] += " and more"
    path.write_text(json.dumps(draft))
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "commit"}))))
    fake.enqueue(Reply(body=completion("ok")))
    ask(client, crowded())
    assert "was made longer, not cut" in results_of(fake)[-1]


def test_a_mirror_edit_that_shortens_call_arguments_is_applied(
        mirrored: tuple[TestClient, Path], fake: FakeUpstream) -> None:
    client, path = mirrored
    msgs = crowded()
    body = "".join(f"def f{i}(): return {i}\n" for i in range(100))
    msgs[-2]["tool_calls"][0]["function"] = {"name": "write_file",
                                             "arguments": json.dumps({"path": "m.py", "content": body})}
    ask(client, msgs)  # the newest call's arguments are whole: the model may shorten them itself
    draft = json.loads(path.read_text())
    entry = next(e for e in draft["messages"] if (e.get("tool_calls") or [{}])[0].get("id") == "call_13")
    entry["tool_calls"][0]["function"]["arguments"] = json.dumps({"path": "m.py", "content": "(100 one-liners)"})
    path.write_text(json.dumps(draft))
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "commit"}))))
    fake.enqueue(Reply(body=completion("ok")))
    ask(client, msgs)
    assert "ctx commit: applied, 0 tool result(s) and the arguments of 1 call(s) cut." in results_of(fake)[-1]
    ask(client, [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}])
    call = next(c for m in fake.chats[-1].json()["messages"] for c in m.get("tool_calls") or []
                if c["id"] == "call_13")
    assert call["function"]["name"] == "write_file"
    arguments = json.loads(call["function"]["arguments"])
    kept, line, *_ = arguments["content"].split("\n")
    assert arguments["path"] == "m.py" and kept == "(100 one-liners)"
    assert parse_stub(line) == {"id": hashlib.sha256(body.encode()).hexdigest(), "tool": "write_file",
                                "bytes": str(len(body)), "call_id": "call_13", "storage": "disk"}
    session = client.get("/ctx/sessions").json()["sessions"][0]["id"]
    oid = hashlib.sha256(body.encode()).hexdigest()
    assert client.get(f"/ctx/sessions/{session}/overflow/{oid}").content == body.encode()


def test_a_mirror_edit_that_changes_a_calls_name_is_refused(
        mirrored: tuple[TestClient, Path], fake: FakeUpstream) -> None:
    client, path = mirrored
    ask(client, crowded())
    draft = json.loads(path.read_text())
    entry = next(e for e in draft["messages"] if (e.get("tool_calls") or [{}])[0].get("id") == "call_12")
    entry["tool_calls"][0]["function"]["name"] = "bash"
    path.write_text(json.dumps(draft))
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "commit"}))))
    fake.enqueue(Reply(body=completion("ok")))
    ask(client, crowded())
    assert "were changed (only their arguments may be shortened)" in results_of(fake)[-1]


def test_ctx_status_reports_the_last_accepted_revision_after_a_restart(tmp_path: Path, fake: FakeUpstream) -> None:
    env = {"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1",
           "CTXPROXY_CTX_WINDOW": "16384", "CTXPROXY_SPILL_CHARS": "100000", "CTXPROXY_KEEP_RESULTS": "8",
           "CTXPROXY_MIRROR_DIR": str(tmp_path / "ws")}
    path = session_mirror(tmp_path / "ws", crowded())
    with app_client(load_settings(env=env), httpx.ASGITransport(app=fake)) as client:
        ask(client, crowded())
        draft = json.loads(path.read_text())
        draft["messages"] = [e for e in draft["messages"] if e.get("tool_call_id") != "call_8"]
        path.write_text(json.dumps(draft))
        fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "commit"}), ("ctx", {"action": "status"}))))
        fake.enqueue(Reply(body=completion("ok")))
        ask(client, crowded())
        assert f"Mirror: {path} (last accepted revision 1;" in results_of(fake)[-1]
    with app_client(load_settings(env=env), httpx.ASGITransport(app=fake)) as client:  # a restart
        fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "status"}))))
        fake.enqueue(Reply(body=completion("ok")))
        ask(client, [*crowded(), {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}])
        assert "(last accepted revision 1;" in results_of(fake)[-1]


@pytest.mark.parametrize("native_tools", [True, False])
def test_compact_sends_the_schemas_only_to_an_upstream_that_takes_function_calls(
        tmp_path: Path, fake: FakeUpstream, native_tools: bool) -> None:
    """``native_tools = false`` says the upstream does not take a tool list: a request that brings none of its own
    gets none there, ``/compact`` or not (the rule and ``/compact`` once disagreed; the schemas were not budgeted)."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "131072", "CTXPROXY_NATIVE_TOOLS": str(native_tools).lower()})
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Hi."},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "/compact"}]
        answer = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert answer.status_code == 200 and "Context compacted" in answer.json()["choices"][0]["message"]["content"]
    assert sent_names(fake) == ([t["function"]["name"] for t in CONTEXT_TOOLS] if native_tools else [])
    asked = [m["content"] for m in fake.chats[-1].json()["messages"] if "(/compact)" in str(m["content"])]
    assert len(asked) == (1 if native_tools else 0)  # told to use its tools only where it has them
