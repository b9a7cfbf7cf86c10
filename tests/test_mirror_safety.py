"""The live mirror against what a client or a model may do to it: a session name that is a path, two sessions in one
``mirror_dir``, a draft that is not the JSON the proxy wrote, a commit made in the same answer as its edit.

Each of these once went wrong: the name placed the file outside the data dir; the two sessions shared one file, so
each took the other's mirror for its model's draft (and a fork's could be committed into its parent); the draft
failed the agent's request with a 500; and the commit ran before the agent's edit, reported nothing to cut, and let
the next request write over the edit without the model ever being told.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import load_settings
from ctxproxy.proxy.tools.mirror import folder_name
from tests.conftest import app_client, session_mirror
from tests.fakes import CountingUpstream, Reply, completion, tool_answer

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]


def crowded(rounds: int = 13, task: str = "Fix the bug.") -> list[dict[str, Any]]:
    """A history the automatic cuts cannot bring under the target at 16k: the mirror is turned on."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                      {"role": "user", "content": task}]
    for k in range(1, rounds + 1):
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": f"{k % 10}" * 3000}]
    return messages


def settings_env(tmp_path: Path, mirror_dir: str) -> dict[str, str]:
    return {"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1",
            "CTXPROXY_CTX_WINDOW": "16384", "CTXPROXY_SPILL_CHARS": "100000", "CTXPROXY_KEEP_RESULTS": "8",
            "CTXPROXY_MIRROR_DIR": mirror_dir}


@pytest.fixture
def fake() -> CountingUpstream:
    return CountingUpstream(window=16384)


@pytest.fixture
def mirrored(tmp_path: Path, fake: CountingUpstream) -> Iterator[tuple[TestClient, Path]]:
    with app_client(load_settings(env=settings_env(tmp_path, str(tmp_path / "ws"))),
                    httpx.ASGITransport(app=fake)) as client:
        yield client, session_mirror(tmp_path / "ws", crowded())


def send(client: TestClient, messages: list[dict[str, Any]], session: str | None = None) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    return client.post("/v1/chat/completions", json={"model": "m", "tools": TOOLS, "messages": messages},
                       headers=headers)


def system_lines(fake: CountingUpstream) -> str:
    return " ".join(str(m.get("content")) for m in fake.chats[-1].json()["messages"] if m["role"] == "system")


def spliced_results(fake: CountingUpstream) -> list[str]:
    return [str(m["content"]) for m in fake.chats[-1].json()["messages"]
            if m["role"] == "tool" and str(m.get("tool_call_id", "")).startswith("ctx_")]


@pytest.mark.parametrize("name", ["../../outside/rel", "/{tmp}/outside/abs", "Team-Run", "a\\..\\b"])
def test_a_session_name_never_places_the_mirror_outside_its_folder(tmp_path: Path, fake: CountingUpstream,
                                                                   name: str) -> None:
    name = name.format(tmp=str(tmp_path).strip("/"))
    with app_client(load_settings(env=settings_env(tmp_path, "")), httpx.ASGITransport(app=fake)) as client:
        assert send(client, crowded(), session=name).status_code == 200
    written = [p.relative_to(tmp_path) for p in tmp_path.rglob("LIVE_CONTEXT.json")]
    assert written == [Path("data", "mirror", folder_name(name), "LIVE_CONTEXT.json")]


def test_a_plain_lowercase_name_is_its_own_folder_and_any_other_a_digest() -> None:
    assert folder_name("s-cf29cc5c42b5-2") == "s-cf29cc5c42b5-2" and folder_name("run.7@ab12") == "run.7@ab12"
    others = {folder_name(n) for n in ("..", "Run", "run", "a/b", "/abs", "", "x" * 200)}
    assert len(others) == 7 and all(f == "run" or (f.startswith("n-") and len(f) == 34) for f in others)


@pytest.mark.parametrize("spoil", ["latin-1", "null id", "list id"])
def test_a_draft_the_proxy_could_not_have_written_is_refused_not_a_500(
        mirrored: tuple[TestClient, Path], fake: CountingUpstream, spoil: str) -> None:
    client, path = mirrored
    assert send(client, crowded()).status_code == 200 and path.exists()
    draft = json.loads(path.read_text(encoding="utf-8"))
    entry = next(e for e in draft["messages"] if e.get("tool_call_id") == "call_9")
    entry["content"] = "café, shortened"
    if spoil == "latin-1":
        path.write_bytes(json.dumps(draft, ensure_ascii=False).encode().replace("é".encode(), b"\xe9"))
    else:
        entry["id"] = None if spoil == "null id" else ["tool:call_9"]
        path.write_text(json.dumps(draft), encoding="utf-8")
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "commit"}))))
    fake.enqueue(Reply(body=completion("ok")))
    answer = send(client, crowded())
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "ok"
    [said] = spliced_results(fake)
    reason = {"latin-1": "could not be read as UTF-8", "null id": "an entry's id is not a string",
              "list id": "is not the JSON the proxy wrote"}[spoil]
    assert reason in said and said.endswith("Nothing applied.")


def test_a_commit_in_the_same_answer_as_the_edit_keeps_the_edit_and_says_so(
        mirrored: tuple[TestClient, Path], fake: CountingUpstream) -> None:
    client, path = mirrored
    history = crowded()
    send(client, history)
    draft = json.loads(path.read_text(encoding="utf-8"))
    draft["messages"] = [e for e in draft["messages"] if e.get("tool_call_id") != "call_9"]
    fake.enqueue(Reply(body=tool_answer(("read_file", {"path": str(path)}), ("ctx", {"action": "commit"}))))
    message = send(client, history).json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["read_file"]  # the commit ran already
    path.write_text(json.dumps(draft), encoding="utf-8")  # the agent's own call: the edit, after the commit
    history += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "written"}]
    send(client, history)
    assert "ctx commit found LIVE_CONTEXT.json as the proxy wrote it" in system_lines(fake)
    assert json.loads(path.read_text(encoding="utf-8")) == draft  # a draft, not written over
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "commit"}))))
    fake.enqueue(Reply(body=completion("ok")))
    send(client, history)
    assert spliced_results(fake)[-1].startswith("ctx commit: applied")
    sent_9 = next(m for m in fake.chats[-1].json()["messages"] if m.get("tool_call_id") == "call_9")
    assert str(sent_9["content"]).startswith("[overflow") and "Cut by you in the mirror" in str(sent_9["content"])


def test_two_sessions_in_one_mirror_dir_each_have_their_own_file(
        mirrored: tuple[TestClient, Path], fake: CountingUpstream) -> None:
    client, mine = mirrored
    other = crowded(task="Write the docs.")
    for messages in (crowded(), other, crowded(14)):
        assert send(client, messages).status_code == 200
    theirs = session_mirror(mine.parents[1], other)
    shown = {json.loads(p.read_text(encoding="utf-8"))["session"] for p in (mine, theirs)}
    assert mine != theirs and len(shown) == 2
    assert "tool:call_14" in mine.read_text(encoding="utf-8")  # its own newest round: not taken for a draft
    draft = json.loads(mine.read_text(encoding="utf-8"))
    draft["messages"] = [e for e in draft["messages"] if e.get("tool_call_id") != "call_9"]
    mine.write_text(json.dumps(draft), encoding="utf-8")
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "commit"}))))
    fake.enqueue(Reply(body=completion("ok")))
    send(client, crowded(14))
    assert spliced_results(fake)[-1] == "ctx commit: applied, 1 tool result(s) cut."
    assert "Write the docs." in theirs.read_text(encoding="utf-8")


def test_an_incognito_session_is_told_it_has_no_mirror(mirrored: tuple[TestClient, Path],
                                                       fake: CountingUpstream) -> None:
    """It is never mirrored; ``ctx status`` once named a path it would never write, where another session's could be."""
    client, path = mirrored
    fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "status"}))))
    fake.enqueue(Reply(body=completion("ok")))
    answer = client.post("/v1/chat/completions", json={"model": "m", "tools": TOOLS, "messages": crowded()},
                         headers={"X-Ctx-Incognito": "1"})
    assert answer.status_code == 200 and not path.parent.parent.exists()
    assert spliced_results(fake)[-1].endswith("\nMirror: none (this session is incognito: nothing of it is written "
                                              "to disk).")


def test_a_mirror_write_that_failed_is_not_taken_for_a_draft_after_a_restart(
        tmp_path: Path, fake: CountingUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward journals what the mirror shows before its file is written. A write that failed (a full disk) left
    the journal saying it was: after a restart the proxy's own older file passed for the model's draft, was never
    updated, and an unedited commit was refused for a removal nobody made."""
    from ctxproxy.proxy.engine import mirror_file

    env = settings_env(tmp_path, str(tmp_path / "ws"))
    path = session_mirror(tmp_path / "ws", crowded())
    with app_client(load_settings(env=env), httpx.ASGITransport(app=fake)) as client:
        send(client, crowded())

        def full(*_: object) -> None:
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(mirror_file, "_write_at", full)
        monkeypatch.setattr(mirror_file, "rewrite_in_place", full)
        send(client, crowded(14))
    monkeypatch.undo()
    assert "tool:call_14" not in path.read_text(encoding="utf-8")  # the file is still the one before
    with app_client(load_settings(env=env), httpx.ASGITransport(app=fake)) as client:  # a restart
        send(client, crowded(15))
        assert "tool:call_15" in path.read_text(encoding="utf-8")  # written: not mistaken for a draft
        fake.enqueue(Reply(body=tool_answer(("ctx", {"action": "commit"}))))
        fake.enqueue(Reply(body=completion("ok")))
        send(client, crowded(15))
    assert spliced_results(fake)[-1].startswith("ctx commit found LIVE_CONTEXT.json as the proxy wrote it")
