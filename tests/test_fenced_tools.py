"""The context tools on a text-protocol route: context blocks in the model's text, executed by the proxy, never
seen by the agent; handles r<round>.<i> name results inside the agent's own results messages."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.fakes import FakeUpstream, Reply, completion

BIG = "".join(f"test_case_{i} PASSED\n" for i in range(2500))


@pytest.fixture
def client(roomy_client: TestClient) -> TestClient:
    return roomy_client


def history() -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Reply with one ```bash``` block."},
                                  {"role": "user", "content": "Free up your context, then fix the test."}]
    for k, out in enumerate(["setup ok", BIG, "collected 12 items"]):
        msgs.append({"role": "assistant", "content": f"Step {k}.\n```bash\npytest -k step{k}\n```"})
        msgs.append({"role": "user", "content": f"<returncode>0</returncode>\n<output>\n{out}\n</output>"})
    return msgs


def block(tool: str, **args: Any) -> str:
    return "```context\n" + json.dumps({"tool": tool, **args}) + "\n```\n"


def ask(client: TestClient) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": "m", "messages": history()})


def test_the_syntax_is_offered_as_a_note_not_as_schemas(client: TestClient, fake: FakeUpstream) -> None:
    ask(client)
    sent = fake.chats[-1].json()
    assert "tools" not in sent and "```context" in sent["messages"][-1]["content"]


def test_a_drop_by_round_handle_cuts_inside_the_wrapper_and_the_agent_never_sees_the_block(
        client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=completion("Tidying up.\n" + block("context_drop", handles=["r2.1"]))))
    fake.enqueue(Reply(body=completion("Now the fix.\n```bash\nsed -i s/a/b/ x.py\n```")))
    answer = ask(client).json()["choices"][0]["message"]["content"]
    assert "```context" not in answer and answer.startswith("Now the fix.")
    follow_up = fake.chats[-1].json()["messages"]
    results = next(m for m in follow_up if str(m["content"]).startswith("<returncode>0</returncode>\n<output>\ntest_"
                                                                      ) or "call_id=r2.1" in str(m["content"]))
    assert results["content"].startswith("<returncode>0</returncode>\n<output>\n[overflow id=")
    assert results["content"].endswith("\n</output>") and "call_id=r2.1" in results["content"]
    assert "drop: applied to r2.1" in follow_up[-1]["content"]  # the blocks' results, as the next message
    oid = re.search(r"id=([0-9a-f]{64})", results["content"]).group(1)  # type: ignore[union-attr]
    session = client.get("/ctx/sessions").json()["sessions"][0]["id"]
    assert client.get(f"/ctx/sessions/{session}/overflow/{oid}").content == BIG.encode()


def test_status_pin_and_note_through_blocks(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=completion(block("context_status") + block("context_pin", handles=["r1"]))))
    fake.enqueue(Reply(body=completion(block("context_note", handles=["r1.1", "r2.1"], note="step 1 set up; "
                                             "the big log only passed"))))
    fake.enqueue(Reply(body=completion(block("context_note", handles=["r2.1"], note="the log passed"))))
    fake.enqueue(Reply(body=completion("Done.\n```bash\necho ok\n```")))
    answer = ask(client).json()["choices"][0]["message"]["content"]
    assert answer == "Done.\n```bash\necho ok\n```"
    replies = [m["content"] for m in fake.chats[-1].json()["messages"] if str(m["content"]).startswith("[ctxproxy] "
                                                                                                     "Context tool")]
    status_pin, first_note, second_note = replies
    assert "Largest results in context" in status_pin and "pin: applied to r1" in status_pin
    assert "r1.1: pinned; unpin it first; a pin covers the whole round's message" in first_note
    assert "note: applied to r2.1" in first_note and "r2.1: already a stub" in second_note


def test_a_broken_block_is_answered_with_what_to_fix(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=completion("```context\n{not json\n```\n")))
    fake.enqueue(Reply(body=completion("ok\n```bash\nls\n```")))
    ask(client)
    assert "not valid JSON" in fake.chats[-1].json()["messages"][-1]["content"]


def test_ctx_clear_through_a_block(client: TestClient, fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body=completion(block("ctx", action="clear", before="r3.1"))))
    fake.enqueue(Reply(body=completion("ok\n```bash\nls\n```")))
    ask(client)
    reply = fake.chats[-1].json()["messages"][-1]["content"]
    assert "clear: applied to r2.1." in reply and "r1.1: under 600 characters" in reply
    results = [m["content"] for m in fake.chats[-1].json()["messages"] if "call_id=r2.1" in str(m["content"])]
    assert results and results[0].startswith("<returncode>0</returncode>\n<output>\n[overflow id=")


def test_a_whole_results_message_by_its_m_handle(client: TestClient, fake: FakeUpstream) -> None:
    import hashlib

    from ctxproxy.proxy.core.identity import canonical_json

    handle = "m" + hashlib.sha256(canonical_json(history()[5])).hexdigest()[:8]
    fake.enqueue(Reply(body=completion(block("context_drop", handles=[handle]))))
    fake.enqueue(Reply(body=completion("ok\n```bash\nls\n```")))
    ask(client)
    assert "drop: applied to r2.1." in fake.chats[-1].json()["messages"][-1]["content"]


def test_a_streamed_block_is_run_and_the_stream_goes_on(client: TestClient, fake: FakeUpstream) -> None:
    from tests.fakes import stream_chunks

    fake.enqueue(Reply(sse=stream_chunks("Tidying first.\n" + block("context_drop", handles=["r2.1"]))))
    fake.enqueue(Reply(sse=stream_chunks("Now the fix.\n```bash\nls\n```")))
    answer = client.post("/v1/chat/completions", json={"model": "m", "messages": history(), "stream": True})
    events = [json.loads(line[6:]) for line in answer.text.splitlines()
              if line.startswith("data: {") and '"choices"' in line]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert "```context" not in text and "Now the fix." in text and answer.text.count("[DONE]") == 1
    assert "drop: applied to r2.1" in fake.chats[-1].json()["messages"][-1]["content"]


def test_a_round_handle_never_lands_on_a_persons_paste(client: TestClient, fake: FakeUpstream) -> None:
    paste = "Look at this log:\n\n" + "x " * 15000 + "\n\nwhat do you think?"
    messages = [*history(), {"role": "assistant", "content": "Here is what I see."}, {"role": "user", "content": paste}]
    fake.enqueue(Reply(body=completion(block("context_drop", handles=["r3.1"]) + block("context_status"))))
    fake.enqueue(Reply(body=completion("ok\n```bash\nls\n```")))
    client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    reply = fake.chats[-1].json()["messages"][-1]["content"]
    assert "drop: nothing applied" in reply and "r3.1: under 600 characters" in reply  # the real r3.1 is small
    assert "- r2.1:" in reply  # status lists text-protocol results by their handles
