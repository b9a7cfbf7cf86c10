"""The inspector's operator API (issue #15): what went upstream, a session's cuts and rounds, one request beside
its projection, cut bodies by lines, the sessions overview, and the page, its docs and its sign-in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.conftest import app_client
from tests.fakes import FakeUpstream
from tests.inspected import BASH, WINDOW, history, result, run, small_window

ROUNDS = 20


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, FakeUpstream]]:
    """One scripted run of 20 rounds at a 4k window: it spills (every fourth result) and elides (from round 13)."""
    fake = FakeUpstream()
    with app_client(small_window(tmp_path_factory.mktemp("ran")), httpx.ASGITransport(app=fake)) as client:
        run(client.post, ROUNDS)
        yield client, fake


def rounds_of(client: TestClient, session: str = "inspected") -> dict[str, Any]:
    answer = client.get(f"/ctx/sessions/{session}/rounds")
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_the_upstream_body_is_what_the_model_received(ran: tuple[TestClient, FakeUpstream]) -> None:
    client, fake = ran
    ids = [r["request_id"] for r in rounds_of(client)["rounds"]]
    for request_id, received in zip(ids, fake.chats, strict=True):
        answer = client.get(f"/ctx/requests/{request_id}/upstream").json()
        assert answer["body"]["messages"] == received.json()["messages"]
        assert answer["body"]["model"] == "fake-model" and answer["attempts"] == [answer["attempt"]]
    last = client.get(f"/ctx/requests/{ids[-1]}/upstream").json()
    assert last["body"]["messages"] != history(ROUNDS)  # cut: not the client's list
    assert client.get(f"/ctx/requests/{ids[-1]}/upstream", params={"attempt": 7}).status_code == 404
    assert client.get("/ctx/requests/99999/upstream").json()["error"]["code"] == "not_found"


def test_the_cuts_name_their_overflow_bodies(ran: tuple[TestClient, FakeUpstream]) -> None:
    client, _ = ran
    cuts = client.get("/ctx/sessions/inspected/cuts").json()["cuts"]
    spills = [c for c in cuts if c["kind"] == "spill"]
    assert [c["target"] for c in spills] == [f"tool:call_{i}" for i in range(3, ROUNDS, 4)]
    assert {"elide", "fold"} <= {c["kind"] for c in cuts}
    for cut in cuts:
        body = client.get(f"/ctx/sessions/inspected/overflow/{cut['overflow_id']}").text
        assert cut["bytes"] == len(body.encode()) and cut["source"] == "auto"
        if cut["kind"] == "fold":  # the rounds it folded, under one id
            assert cut["count"] > 1 and "call_0" in body
        else:
            assert body == result(int(cut["call_id"].removeprefix("call_")))
    assert client.get("/ctx/sessions/nobody/cuts").status_code == 404


def test_the_rounds_give_the_chart_its_series_lines_and_markers(ran: tuple[TestClient, FakeUpstream]) -> None:
    client, fake = ran
    data = rounds_of(client)
    rounds = data["rounds"]
    assert len(rounds) == ROUNDS and data["lines"] == {"window": WINDOW, "budget": 3072, "target": 2150}
    assert [r["prompt_tokens"] for r in rounds] == [len(c.body) // 4 for c in fake.chats]  # the fake's usage
    assert all(r["upstream_tokens"] <= r["agent_tokens"] + 100 for r in rounds)
    assert rounds[-1]["upstream_tokens"] < rounds[-1]["agent_tokens"] / 2  # the cuts at work
    assert [r["marks"].get("spill", 0) for r in rounds] == [int(i % 4 == 3) for i in range(ROUNDS)]
    first_elision = next(i for i, r in enumerate(rounds) if r["marks"].get("elide"))
    assert 8 <= first_elision < ROUNDS
    assert rounds[0]["reused_messages"] == 0
    assert all(r["reused_messages"] > 0 for r in rounds[1:first_elision])  # each extends the one before


def test_a_request_is_shown_beside_its_projection(ran: tuple[TestClient, FakeUpstream]) -> None:
    client, fake = ran
    request_id = rounds_of(client)["rounds"][-1]["request_id"]
    view = client.get(f"/ctx/requests/{request_id}/projection").json()
    assert [item["message"] for item in view["raw"]] == history(ROUNDS)
    assert view["raw"][3]["id"] == "tool:call_0"
    assert view["sent"] == fake.chats[-1].json()["messages"]
    sent = " ".join(str(m["content"]) for m in view["sent"])
    for kind in ("spill", "fold"):  # the newest spill's stub and the fold's name their bodies
        assert [c for c in view["cuts"] if c["kind"] == kind][-1]["overflow_id"] in sent
    assert client.get("/ctx/requests/99999/projection").status_code == 404


def test_a_cut_body_is_paged_and_searched_by_lines(ran: tuple[TestClient, FakeUpstream]) -> None:
    client, _ = ran
    cut = next(c for c in client.get("/ctx/sessions/inspected/cuts").json()["cuts"] if c["kind"] == "spill")
    url = f"/ctx/sessions/inspected/overflow/{cut['overflow_id']}/lines"
    page = client.get(url, params={"offset": 10, "limit": 5}).json()
    assert page["total"] == 80 and [n for n, _ in page["lines"]] == [10, 11, 12, 13, 14]
    assert page["lines"][0][1].startswith("log line 10 of run 3")
    found = client.get(url, params={"grep": r"test_case_7\d "}).json()
    assert [n for n, _ in found["lines"]] == list(range(70, 80)) and found["total"] == 10
    bad = client.get(url, params={"grep": "("})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "grep"
    assert client.get("/ctx/sessions/inspected/overflow/" + "0" * 64 + "/lines").status_code == 404


def test_the_overview_shows_forks_incognito_sessions_and_the_latest_tokens(tmp_path: Path, fake: FakeUpstream
                                                                          ) -> None:
    with app_client(small_window(tmp_path), httpx.ASGITransport(app=fake)) as client:
        parent_id = run(client.post, 6, session=None)
        fork = {"model": "fake-model", "messages": [*history(3), {"role": "user", "content": "try another way"}],
                "tools": [BASH]}
        child_id = client.post("/v1/chat/completions", json=fork).headers["x-ctx-session"]
        client.post("/v1/chat/completions", json={"model": "fake-model", "messages": history(2)},
                    headers={"X-Ctx-Incognito": "1"})
        listed = client.get("/ctx/overview").json()["sessions"]
        hidden = next(s for s in listed if s["incognito"])
        shown = client.get(f"/ctx/sessions/{hidden['id']}/rounds", params={"incognito": "true"}).json()
        request_id = shown["rounds"][0]["request_id"]
        seen = client.get(f"/ctx/requests/{request_id}/projection", params={"incognito": "true"}).json()
    sessions = {s["id"]: s for s in listed if not s["incognito"]}
    assert hidden["id"] == parent_id  # the same opening: an incognito twin bears the same id, in memory
    assert hidden["requests"] == 1 and shown["session"]["incognito"] is True and len(seen["raw"]) == 6
    parent = sessions[parent_id]
    assert parent["requests"] == 6 and parent["incognito"] is False and parent["children"] == [child_id]
    assert parent["agent_tokens"] > parent["upstream_tokens"] > 0 and 0 < parent["reuse"] <= 1
    assert sessions[child_id]["parent_id"] == parent_id and sessions[child_id]["reuse"] is not None


def test_home_points_at_the_page_which_ships_its_files(client: TestClient) -> None:
    home = client.get("/", follow_redirects=False)
    assert home.status_code == 307 and home.headers["location"] == "/ctx/ui"
    page = client.get("/ctx/ui")
    assert page.status_code == 200 and "/ctx/ui/static/app.js" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    script = client.get("/ctx/ui/static/app.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    for name in ("nothing.js", "..%2Fadmin.py", "admin.py"):
        assert client.get(f"/ctx/ui/static/{name}").status_code == 404
    docs = client.get("/ctx/docs")
    assert docs.status_code == 200 and "docs.js" in docs.text
    schema = client.get("/ctx/openapi.json").json()
    assert {"/requests/{request_id}/upstream", "/sessions/{session_id}/cuts"} <= set(schema["paths"])


def test_with_an_admin_token_the_page_signs_in_and_its_cookie_opens_the_api(tmp_path: Path, fake: FakeUpstream
                                                                           ) -> None:
    with app_client(small_window(tmp_path, admin_token="s3cret"), httpx.ASGITransport(app=fake)) as client:
        assert client.get("/ctx/overview").status_code == 401
        form = client.get("/ctx/ui")
        assert form.status_code == 401 and 'action="/ctx/ui/signin"' in form.text and "s3cret" not in form.text
        assert client.post("/ctx/ui/signin", data={"token": "wrong"}).status_code == 401
        assert "ctxproxy_admin" not in client.cookies
        signed = client.post("/ctx/ui/signin", data={"token": "s3cret"}, follow_redirects=False)
        assert signed.status_code == 303 and "httponly" in signed.headers["set-cookie"].lower()
        assert "samesite=strict" in signed.headers["set-cookie"].lower()
        assert client.get("/ctx/ui").status_code == 200 and client.get("/ctx/overview").status_code == 200
        client.cookies.clear()
        assert client.get("/ctx/overview", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/ctx/docs").status_code == 401


def test_an_operator_drop_and_restore_are_journaled_and_honoured_by_the_next_request(tmp_path: Path,
                                                                                     fake: FakeUpstream) -> None:
    with app_client(small_window(tmp_path), httpx.ASGITransport(app=fake)) as client:
        run(client.post, 6)
        whole = {"role": "tool", "tool_call_id": "call_1", "content": result(1)}
        assert whole in fake.last_chat.json()["messages"]
        dropped = client.post("/ctx/sessions/inspected/drop", json={"handle": "call_1"})
        assert dropped.status_code == 201, dropped.text
        oid = dropped.json()["overflow_id"]
        run(client.post, 7, start=7)
        sent = next(m for m in fake.last_chat.json()["messages"] if m.get("tool_call_id") == "call_1")
        assert sent["content"].startswith(f"[overflow id={oid} tool=bash")
        assert "Dropped by the operator" in sent["content"]
        assert client.get(f"/ctx/sessions/inspected/overflow/{oid}").text == result(1)
        again = client.post("/ctx/sessions/inspected/drop", json={"handle": "tool:call_1"})
        assert again.status_code == 400 and "already cut" in again.json()["error"]["message"]
        restored = client.post("/ctx/sessions/inspected/restore", json={"handle": "tool:call_1"})
        assert restored.json() == {"session_id": "inspected", "restored": "tool:call_1", "was": "drop"}
        run(client.post, 8, start=8)
        assert whole in fake.last_chat.json()["messages"]
        cuts = client.get("/ctx/sessions/inspected/cuts").json()["cuts"]
    operator = [(c["kind"], c["target"]) for c in cuts if c["source"] == "operator"]
    assert operator == [("drop", "tool:call_1"), ("restore", "tool:call_1")]


def test_a_restored_spill_goes_whole_while_it_fits(tmp_path: Path, fake: FakeUpstream) -> None:
    """A spill is decided when a result arrives: restored, it is not spilled again (over budget, the elision
    would take it, as any result: a pin keeps it)."""
    with app_client(small_window(tmp_path, ctx_window="32768"), httpx.ASGITransport(app=fake)) as client:
        run(client.post, 5)
        whole = {"role": "tool", "tool_call_id": "call_3", "content": result(3)}
        assert whole not in fake.last_chat.json()["messages"]
        assert client.post("/ctx/sessions/inspected/restore", json={"handle": "call_3"}).json()["was"] == "spill"
        run(client.post, 6, start=6)
        assert whole in fake.last_chat.json()["messages"]


def test_operator_cuts_refuse_what_they_cannot_do(tmp_path: Path, fake: FakeUpstream) -> None:
    with app_client(small_window(tmp_path), httpx.ASGITransport(app=fake)) as client:
        run(client.post, 3)
        client.post("/ctx/sessions/inspected/pins", json={"handle": "call_0"})
        refusals = {("drop", "call_0"): "pinned", ("drop", "call_9"): "No message", ("restore", "call_1"): "not cut",
                    ("drop", "user:nothing"): "No message"}
        for (verb, handle), words in refusals.items():
            answer = client.post(f"/ctx/sessions/inspected/{verb}", json={"handle": handle})
            assert answer.status_code in (400, 404) and words in answer.json()["error"]["message"], answer.text
        system = client.get("/ctx/requests/3/projection").json()["raw"][0]["id"]
        assert "not a tool result" in client.post("/ctx/sessions/inspected/drop",
                                                  json={"handle": system}).json()["error"]["message"]
        assert client.post("/ctx/sessions/nobody/drop", json={"handle": "call_0"}).status_code == 404
