"""Shared fixtures: a clean environment for every test, settings on a temporary data dir, the app in process."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from ctxproxy.config import Settings, load_settings
from ctxproxy.proxy.core import fingerprint
from ctxproxy.proxy.edge.app import create_app
from ctxproxy.proxy.observe.events import EventBus
from tests import postgres
from tests.fakes import FakeUpstream
from tests.postgres import PostgresServer

# A noisy 2-core machine: no per-example deadline, and Hypothesis's one-time start-up (building its Unicode tables
# on a fresh clone takes ~2 s) must not count as "input generation is slow".
# In CI (`CI` set, as `.ci/run` runs) the examples are derived from each test rather than drawn at random, so a
# run is reproducible and a landing never hangs on the luck of the draw; a local run explores new examples, and a
# failure it finds is pinned with `@example`.
hypothesis_settings.register_profile("ctxproxy", deadline=None, suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.register_profile("ctxproxy-ci", parent=hypothesis_settings.get_profile("ctxproxy"),
                                     derandomize=True)
hypothesis_settings.load_profile("ctxproxy-ci" if os.environ.get("CI") else "ctxproxy")


CATALOGUE = json.loads((Path(__file__).resolve().parents[1] / "docs" / "api" / "sse_events.json").read_text())


@pytest.fixture(autouse=True)
def events_follow_the_catalogue(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every event any test makes the proxy emit must validate against docs/api/sse_events.json."""
    publish = EventBus.publish

    def checked(self: EventBus, event: dict[str, Any]) -> None:
        jsonschema.validate(event, CATALOGUE["events"][event["type"]])
        publish(self, event)

    monkeypatch.setattr(EventBus, "publish", checked)


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the developer's CTXPROXY_* or OPENAI_* variables."""
    for key in list(os.environ):
        if key.startswith(("CTXPROXY_", "OPENAI_")):
            monkeypatch.delenv(key)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path / "data"),
                              "CTXPROXY_UPSTREAM": "http://upstream.test/v1"})


@pytest.fixture
def fake() -> FakeUpstream:
    return FakeUpstream()


@pytest.fixture
def client(settings: Settings, fake: FakeUpstream) -> Iterator[TestClient]:
    """The real app in process; its upstream is the fake, reached through httpx's ASGI transport."""
    app = create_app(settings, upstream_transport=httpx.ASGITransport(app=fake))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def roomy_client(tmp_path: Path, fake: FakeUpstream) -> Iterator[TestClient]:
    """The app with a large fixed window and no spill: results stay whole unless the model cuts them."""
    settings = load_settings(env={"CTXPROXY_DATA_DIR": str(tmp_path), "CTXPROXY_UPSTREAM": "http://u.test/v1",
                                  "CTXPROXY_CTX_WINDOW": "131072", "CTXPROXY_SPILL_CHARS": "100000"})
    with app_client(settings, httpx.ASGITransport(app=fake)) as test_client:
        yield test_client


def app_client(settings: Settings, transport: httpx.AsyncBaseTransport) -> TestClient:
    """The app in process over any upstream transport; use as a context manager so the lifespan runs."""
    return TestClient(create_app(settings, upstream_transport=transport), raise_server_exceptions=False)


def session_mirror(mirror_dir: Path, messages: list[dict[str, Any]]) -> Path:
    """Where the mirror of the first unnamed session that ``messages`` open is written under ``mirror_dir``."""
    return mirror_dir / f"s-{fingerprint(messages)[:12]}" / "LIVE_CONTEXT.json"


def chat(*contents: str, **fields: object) -> dict[str, object]:
    """A chat body: a system message, then alternating user/assistant contents."""
    messages = [{"role": "system", "content": "You are terse."}]
    for i, text in enumerate(contents):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "fake-model", "messages": messages, **fields}


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL (``tests/postgres.py``): started on first use, stopped at the end. Absent, the
    PostgreSQL tests fail (``make test`` runs the store suite on both backends), unless
    ``CTXPROXY_TEST_POSTGRES=skip``."""
    server = postgres.start()
    if isinstance(server, str):
        if os.environ.get("CTXPROXY_TEST_POSTGRES") == "skip":
            pytest.skip("CTXPROXY_TEST_POSTGRES=skip")
        pytest.fail(server)
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database of this test's own."""
    url = postgres_server.database()
    yield url
    postgres_server.drop(url)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """Where a store test's journal lives: a SQLite file, then a PostgreSQL database (the store suite runs on both)."""
    if request.param == "sqlite":
        return tmp_path / "journal.db"
    return str(request.getfixturevalue("postgres_url"))
