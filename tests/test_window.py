"""ctx_window = auto: the window comes from vLLM's /models, then llama.cpp's /props, else the default; cached."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest

from ctxproxy.proxy.upstream.endpoint import Upstream
from ctxproxy.proxy.upstream.window import (
    DEFAULT_WINDOW,
    RETRY_FIRST,
    RETRY_MAX,
    Window,
    WindowDetector,
    props_window,
    vllm_window,
)
from tests.fakes import FakeUpstream, Reply

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def detector(fake: FakeUpstream, ctx_window: int = 0) -> WindowDetector:
    return WindowDetector(Upstream("http://upstream.test/v1", httpx.ASGITransport(app=fake), 5.0, 5.0), ctx_window)


def models(*entries: dict[str, Any]) -> Reply:
    return Reply(body={"object": "list", "data": list(entries)})


def paths(fake: FakeUpstream) -> list[str]:
    return [r.path for r in fake.received]


async def test_vllm_models_answer(fake: FakeUpstream) -> None:
    fake.enqueue(path="/models",
                 reply=models({"id": "other", "max_model_len": 8192}, {"id": "MODEL", "max_model_len": 32768}))
    assert await detector(fake).window_for("MODEL") == Window(32768, "vllm /models")
    assert paths(fake) == ["/v1/models"]
    sent = fake.last
    assert sent.method == "GET" and sent.body == b""
    assert sent.headers.get("accept-encoding") == "identity"
    assert "authorization" not in sent.headers


async def test_unlisted_model_uses_the_only_entry_with_a_window(fake: FakeUpstream) -> None:
    fake.enqueue(path="/models", reply=models({"id": "served", "max_model_len": 16384}, {"id": "no-window"}))
    assert await detector(fake).window_for("alias") == Window(16384, "vllm /models")


@pytest.mark.parametrize("props", [{"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1},
                                   {"n_ctx": 2048}])
async def test_llama_cpp_props_after_models_lacks_the_field(fake: FakeUpstream, props: dict[str, Any]) -> None:
    fake.enqueue(path="/models", reply=models({"id": "fake-model", "object": "model"}))
    fake.enqueue(Reply(body=props), path="/props")
    expected = props.get("default_generation_settings", props)["n_ctx"]
    assert await detector(fake).window_for("fake-model") == Window(expected, "llama.cpp /props")
    assert paths(fake) == ["/v1/models", "/props"]  # /props lives at the root, beside /v1
    assert fake.last.headers.get("accept-encoding") == "identity"


@pytest.mark.parametrize("replies", [
    [Reply(status=404, body={"error": "nope"}), Reply(status=404, body={"error": "nope"})],
    [Reply(raw=b"not json"), Reply(raw=b"not json")],
    [Reply(status=500, body={"data": [{"id": "m", "max_model_len": 999}]}), Reply(body={"slots": []})],
    [],  # llama-cpp-python: /models without a window (the fake's default), /props unknown (echo without n_ctx)
])
async def test_default_when_nothing_answers(fake: FakeUpstream, replies: list[Reply]) -> None:
    for reply, path in zip(replies, ("/models", "/props"), strict=False):
        fake.enqueue(reply, path=path)
    assert await detector(fake).window_for("m") == Window(DEFAULT_WINDOW, "default")
    assert paths(fake) == ["/v1/models", "/props"]


@pytest.mark.parametrize("error", [httpx.ConnectError, httpx.ReadTimeout])
async def test_default_on_transport_error(error: type[httpx.TransportError]) -> None:
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        raise error("boom", request=request)

    upstream = Upstream("http://127.0.0.1:8080/v1", httpx.MockTransport(handler), 5.0, 5.0)
    assert await WindowDetector(upstream, 0).window_for("m") == Window(DEFAULT_WINDOW, "default")
    assert asked == ["http://127.0.0.1:8080/v1/models", "http://127.0.0.1:8080/props"]


async def test_settings_win_without_a_request(fake: FakeUpstream) -> None:
    assert await detector(fake, ctx_window=65536).window_for("m") == Window(65536, "settings")
    assert fake.received == []


async def test_answer_is_cached_per_model(fake: FakeUpstream) -> None:
    fake.enqueue(path="/models", reply=models({"id": "a", "max_model_len": 1000}, {"id": "b", "max_model_len": 2000}))
    fake.enqueue(path="/models", reply=models({"id": "a", "max_model_len": 1000}, {"id": "b", "max_model_len": 2000}))
    windows = detector(fake)
    assert (await windows.window_for("a")).tokens == 1000
    assert (await windows.window_for("a")).tokens == 1000
    assert len(fake.received) == 1
    assert (await windows.window_for("b")).tokens == 2000  # another model is asked for separately
    assert len(fake.received) == 2


async def test_ten_concurrent_callers_cause_one_detection(fake: FakeUpstream) -> None:
    fake.enqueue(Reply(body={"data": [{"id": "m", "max_model_len": 32768}]}, delay=0.05), path="/models")
    windows = detector(fake)
    results: list[Window] = []

    async def ask() -> None:
        results.append(await windows.window_for("m"))

    async with anyio.create_task_group() as group:
        for _ in range(10):
            group.start_soon(ask)
    assert results == [Window(32768, "vllm /models")] * 10
    assert paths(fake) == ["/v1/models"]


async def test_an_answer_without_a_window_is_cached_until_forget(fake: FakeUpstream) -> None:
    fake.enqueue(Reply(status=404, body={}), path="/models")
    fake.enqueue(Reply(status=404, body={}), path="/props")
    clock = Clock()
    windows = WindowDetector(Upstream("http://upstream.test/v1", httpx.ASGITransport(app=fake), 5.0, 5.0), 0,
                             clock=clock)
    assert (await windows.window_for("m")).source == "default"
    clock.now += 3600
    assert (await windows.window_for("m")).source == "default"
    assert len(fake.received) == 2  # the server answered: the second call asked nobody, however late
    windows.forget("m")
    fake.enqueue(path="/models", reply=models({"id": "m", "max_model_len": 4096}))
    assert await windows.window_for("m") == Window(4096, "vllm /models")
    assert len(fake.received) == 3


class Clock:
    """A clock the test moves: seconds since an arbitrary start."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_server_still_loading_is_asked_again_with_backoff(fake: FakeUpstream) -> None:
    """#11: llama.cpp answers 503 while its model loads (and refuses connections before that): the default is used
    meanwhile but not cached until restart; the upstream is asked again after 1 s, then 2 s, 4 s..."""
    clock = Clock()
    windows = WindowDetector(Upstream("http://upstream.test/v1", httpx.ASGITransport(app=fake), 5.0, 5.0), 0,
                             clock=clock)
    for _ in range(2):
        fake.enqueue(Reply(status=503, body={"error": {"message": "Loading model"}}), path="/models")
        fake.enqueue(Reply(status=503, body={"error": {"message": "Loading model"}}), path="/props")
    assert await windows.window_for("m") == Window(DEFAULT_WINDOW, "default")
    assert await windows.window_for("m") == Window(DEFAULT_WINDOW, "default")
    assert len(fake.received) == 2  # within the backoff: nobody asked
    clock.now += RETRY_FIRST
    assert await windows.window_for("m") == Window(DEFAULT_WINDOW, "default")
    assert len(fake.received) == 4  # asked again, still loading
    clock.now += RETRY_FIRST
    assert (await windows.window_for("m")).source == "default" and len(fake.received) == 4  # the delay doubled
    clock.now += RETRY_FIRST
    fake.enqueue(path="/models", reply=models({"id": "m", "object": "model"}))
    fake.enqueue(Reply(body={"default_generation_settings": {"n_ctx": 4096}}), path="/props")
    assert await windows.window_for("m") == Window(4096, "llama.cpp /props")  # loaded: its window, from now on
    clock.now += RETRY_MAX * 10
    assert await windows.window_for("m") == Window(4096, "llama.cpp /props")
    assert len(fake.received) == 6


async def test_a_refused_connection_is_asked_again_later() -> None:
    up = {"ready": False}

    def handler(request: httpx.Request) -> httpx.Response:
        if not up["ready"]:
            raise httpx.ConnectError("Connection refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 2048}]})
        return httpx.Response(404)

    clock = Clock()
    upstream = Upstream("http://127.0.0.1:8080/v1", httpx.MockTransport(handler), 5.0, 5.0)
    windows = WindowDetector(upstream, 0, clock=clock)
    assert await windows.window_for("m") == Window(DEFAULT_WINDOW, "default")
    up["ready"] = True
    assert (await windows.window_for("m")).source == "default"  # not yet due
    clock.now += RETRY_MAX
    assert await windows.window_for("m") == Window(2048, "vllm /models")


@pytest.mark.parametrize(("entry", "expected"), [
    ({"id": "m", "max_model_len": 100, "context_length": 200}, 100),
    ({"id": "m", "context_length": 200, "meta": {"n_ctx": 300}}, 200),
    ({"id": "m", "meta": {"n_ctx": 300, "n_ctx_train": 8192}}, 300),
    ({"id": "m", "meta": {"n_ctx_train": 8192}}, None),  # llama-cpp-python: no reliable field
    ({"id": "m", "max_model_len": True}, None),
    ({"id": "m", "max_model_len": "4096"}, None),
    ({"id": "m", "max_model_len": 0}, None),
])
async def test_model_entry_fields(entry: dict[str, Any], expected: int | None) -> None:
    assert vllm_window({"data": [entry]}, "m") == expected


async def test_listed_model_without_a_window_does_not_borrow_another() -> None:
    answer = {"data": [{"id": "m"}, {"id": "other", "max_model_len": 100}]}
    assert vllm_window(answer, "m") is None
    assert vllm_window(answer, None) == 100
    assert vllm_window({"data": [{"id": "a", "max_model_len": 1}, {"id": "b", "max_model_len": 2}]}, "c") is None


@pytest.mark.parametrize("answer", [None, [], {"data": "x"}, {"default_generation_settings": None}, {"n_ctx": -1}])
async def test_malformed_answers(answer: Any) -> None:
    assert vllm_window(answer, "m") is None
    assert props_window(answer) is None
