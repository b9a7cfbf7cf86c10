"""Who may reach what (issue #10, item 8): the operator surface behind its tokens, sessions scoped to a credential,
headers journaled by allowlist, session ids as UTF-8 with a length cap, and ``X-Ctx-Incognito`` parsed strictly."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from ctxproxy.config import Settings, load_settings
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.store import Journal
from tests.conftest import app_client, chat
from tests.fakes import FakeUpstream, serve_in_thread

CHAT = "/v1/chat/completions"


def settings_with(tmp_path: Path, **env: str) -> Settings:
    return load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                              **{f"CTXPROXY_{k.upper()}": v for k, v in env.items()}})


@pytest.fixture
def guarded(tmp_path: Path, fake: FakeUpstream) -> Iterator[TestClient]:
    """The app with an admin token and a separate metrics token."""
    settings = settings_with(tmp_path, admin_token="adm1n", metrics_token="scr4pe")
    with app_client(settings, httpx.ASGITransport(app=fake)) as client:
        yield client


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def disk_bytes(settings: Settings) -> bytes:
    return b"".join(p.read_bytes() for p in settings.data_path.iterdir())


# --- the operator surface -----------------------------------------------------------------------------------------

def test_with_an_admin_token_metrics_and_the_openapi_schema_need_a_token(guarded: TestClient) -> None:
    for path in ("/metrics", "/ctx/openapi.json", "/ctx/sessions"):
        refused = guarded.get(path)
        assert refused.status_code == 401, path
        assert refused.json()["error"]["type"] == "authentication_error"
        assert guarded.get(path, headers=bearer("wrong")).status_code == 401
        assert guarded.get(path, headers=bearer("adm1n")).status_code == 200, path
    assert "ctxproxy_" in guarded.get("/metrics", headers=bearer("scr4pe")).text
    assert guarded.get("/ctx/openapi.json", headers=bearer("scr4pe")).status_code == 401  # metrics only
    assert guarded.get("/ctx/openapi.json", headers=bearer("adm1n")).json()["info"]["title"]


def test_with_an_admin_token_healthz_is_a_bare_liveness_check(guarded: TestClient) -> None:
    assert guarded.get("/healthz").json() == {"status": "ok"}
    detailed = guarded.get("/healthz", headers=bearer("adm1n")).json()
    assert detailed["upstream"] == "http://u.test/v1" and detailed["version"]


def test_without_tokens_the_operator_surface_stays_open_on_loopback(client: TestClient) -> None:
    assert client.get("/metrics").status_code == 200
    assert client.get("/ctx/openapi.json").status_code == 200
    assert client.get("/healthz").json()["upstream"] == "http://upstream.test/v1"


def test_a_metrics_token_alone_guards_metrics_only(tmp_path: Path, fake: FakeUpstream) -> None:
    with app_client(settings_with(tmp_path, metrics_token="scr4pe"), httpx.ASGITransport(app=fake)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=bearer("scr4pe")).status_code == 200
        assert client.get("/ctx/sessions").status_code == 200


# --- sessions ---------------------------------------------------------------------------------------------------

def test_by_default_anyone_naming_a_session_joins_it(client: TestClient) -> None:
    """session_scope = "global" (the default) keeps the behaviour named sessions always had."""
    a = client.post(CHAT, json=chat("hi"), headers={"X-Session-Id": "alice", **bearer("key-a")})
    b = client.post(CHAT, json=chat("hi", "hello", "more"), headers={"X-Session-Id": "alice", **bearer("key-b")})
    assert a.headers["x-ctx-session"] == b.headers["x-ctx-session"] == "alice"


def test_credential_scope_keeps_a_named_session_to_its_credential(tmp_path: Path, fake: FakeUpstream) -> None:
    with app_client(settings_with(tmp_path, session_scope="credential"), httpx.ASGITransport(app=fake)) as client:
        alice = client.post(CHAT, json=chat("hi"), headers={"X-Session-Id": "alice", **bearer("key-a")})
        mallory = client.post(CHAT, json=chat("hi", "hello", "more"),
                              headers={"X-Session-Id": "alice", **bearer("key-b")})
        again = client.post(CHAT, json=chat("hi", "hello", "more"),
                            headers={"X-Session-Id": "alice", **bearer("key-a")})
        forged = client.post(CHAT, json=chat("hi", "x", "y"),
                             headers={"X-Session-Id": alice.headers["x-ctx-session"], **bearer("key-b")})
        anonymous = client.post(CHAT, json=chat("hi", "x", "y"), headers={"X-Session-Id": "alice"})
    ids = [r.headers["x-ctx-session"] for r in (alice, mallory, again, forged, anonymous)]
    assert ids[0].startswith("alice@k-") and ids[0] == ids[2]
    assert len(set(ids)) == 4 and ids[1] != ids[0] and ids[3] != ids[0] and ids[4] != ids[0]
    assert "key-a" not in ids[0]


def test_credential_scope_applies_to_unnamed_sessions_too(tmp_path: Path, fake: FakeUpstream) -> None:
    with app_client(settings_with(tmp_path, session_scope="credential"), httpx.ASGITransport(app=fake)) as client:
        first = client.post(CHAT, json=chat("same opening"), headers=bearer("key-a"))
        other = client.post(CHAT, json=chat("same opening", "ok", "next"), headers=bearer("key-b"))
        same = client.post(CHAT, json=chat("same opening", "ok", "next"), headers=bearer("key-a"))
    assert other.headers["x-ctx-session"] != first.headers["x-ctx-session"] == same.headers["x-ctx-session"]


def test_a_utf8_session_id_is_stored_and_echoed_as_utf8(settings: Settings, fake: FakeUpstream) -> None:
    """Over real uvicorn (the test client cannot carry a non-ASCII response header): the bytes the client sent
    come back in X-Ctx-Session, and the journal stores the text, not its latin-1 mojibake."""
    name = "équipe-アリス"
    with serve_in_thread(create_app(settings, upstream_transport=httpx.ASGITransport(app=fake))) as url:
        response = httpx.post(url + CHAT, json=chat("hi"), headers=[("X-Session-Id", name.encode())])
        listed = httpx.get(f"{url}/ctx/sessions/{name}")
    assert response.status_code == 200
    assert dict(response.headers.raw)[b"x-ctx-session"] == name.encode()
    assert listed.json()["id"] == name
    journal = Journal(settings.data_path / "journal.db")
    assert [s["id"] for s in journal.sessions()] == [name]
    assert journal.request(1)["headers"]["x-session-id"] == name  # type: ignore[index]


@pytest.mark.parametrize(("value", "why"), [(b"a" * 129, "at most 128"), (b"caf\xe9", "not valid UTF-8")])
def test_a_session_id_too_long_or_not_utf8_is_refused(settings: Settings, fake: FakeUpstream, value: bytes,
                                                       why: str) -> None:
    with serve_in_thread(create_app(settings, upstream_transport=httpx.ASGITransport(app=fake))) as url:
        response = httpx.post(url + CHAT, json=chat("hi"), headers=[("X-Session-Id", value)])
        assert response.status_code == 400
        error = response.json()["error"]
        assert why in error["message"] and error["param"] == "X-Session-Id"
        assert fake.chats == [] and httpx.get(url + "/ctx/sessions").json()["sessions"] == []
        assert httpx.post(url + CHAT, json=chat("hi"), headers={"X-Session-Id": "a" * 128}).status_code == 200


# --- incognito --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["1", "true", "yes", "On"])
def test_every_on_value_of_the_incognito_header_keeps_the_request_off_disk(client: TestClient, settings: Settings,
                                                                          value: str) -> None:
    response = client.post(CHAT, json=chat("secret plans"), headers={"X-Ctx-Incognito": value})
    assert response.status_code == 200
    assert b"secret plans" not in disk_bytes(settings)
    assert client.get("/ctx/sessions").json()["sessions"] == []


@pytest.mark.parametrize("value", ["0", "false", "no", "off"])
def test_every_off_value_of_the_incognito_header_journals(client: TestClient, value: str) -> None:
    assert client.post(CHAT, json=chat("plans"), headers={"X-Ctx-Incognito": value}).status_code == 200
    assert len(client.get("/ctx/sessions").json()["sessions"]) == 1


@pytest.mark.parametrize("value", ["maybe", "2", "", "ja"])
def test_an_unknown_incognito_value_is_refused_naming_the_header(client: TestClient, fake: FakeUpstream,
                                                                settings: Settings, value: str) -> None:
    response = client.post(CHAT, json=chat("secret plans"), headers={"X-Ctx-Incognito": value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "X-Ctx-Incognito" and "X-Ctx-Incognito" in error["message"]
    assert fake.chats == []
    assert b"secret plans" not in disk_bytes(settings)


# --- headers in the journal ---------------------------------------------------------------------------------------

def test_only_harmless_headers_are_journaled_with_their_values(client: TestClient, settings: Settings) -> None:
    secret_headers = {"OpenAI-Organization": "org-s3cret1", "X-Custom-Credential": "s3cret2",
                      "OpenAI-Project": "proj_s3cret3", "Authorization": "Bearer sk-s3cret4", "Forwarded": "s3cret5"}
    harmless = {"User-Agent": "OpenAI/Python 1.40", "X-Stainless-Lang": "python", "OpenAI-Beta": "assistants=v2",
                "Anthropic-Version": "2023-06-01", "X-Session-Id": "run-1"}
    client.post(CHAT, json=chat("hi"), headers={**secret_headers, **harmless})
    assert b"s3cret" not in disk_bytes(settings)
    headers = Journal(settings.data_path / "journal.db").request(1)["headers"]  # type: ignore[index]
    assert all(headers[name.lower()] is None for name in secret_headers)
    assert all(headers[name.lower()] == value for name, value in harmless.items())


def test_the_journal_file_holds_no_header_value_outside_the_allowlist(client: TestClient, settings: Settings) -> None:
    client.post(CHAT, json=chat("hi"), headers={"X-Anything": "v4lue"})
    rows = sqlite3.connect(settings.data_path / "journal.db").execute("SELECT headers FROM requests").fetchall()
    assert '"x-anything":null' in rows[0][0].replace(" ", "")
