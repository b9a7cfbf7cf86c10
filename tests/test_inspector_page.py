"""The inspector page in a real browser (issue #15): Debian's headless Chromium, driven by Playwright, against the
proxy served by uvicorn on loopback, for a session produced by a scripted run that spills, elides and folds.

``scripts/test-deps`` installs Chromium (apt) and the test extras bring Playwright; without them the tests skip,
saying which is missing. ``INSPECTOR_SCREENSHOTS=1`` also writes the screenshots README links (docs/img/)."""

from __future__ import annotations

import os
import shutil
import statistics
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ctxproxy.proxy.edge.app import create_app
from tests.fakes import FakeUpstream, Reply, serve_in_thread, tool_answer
from tests.inspected import history, result, run, small_window

pytestmark = pytest.mark.e2e
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
IMAGES = Path(__file__).resolve().parents[1] / "docs" / "img"

try:
    from playwright.sync_api import Browser, Page, sync_playwright
except ImportError:  # pragma: no cover - the test extras bring it
    sync_playwright = None  # type: ignore[assignment]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if sync_playwright is None:
        pytest.skip("playwright is not installed: pip install -e '.[test]' (make test does)")
    if CHROMIUM is None:
        pytest.skip("no chromium executable: apt-get install chromium (scripts/test-deps does, as root)")
    with sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield launched
        launched.close()


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[tuple[str, FakeUpstream, httpx.Client]]:
    """The proxy on loopback over the scripted fake upstream, and an agent's client for it."""
    fake = FakeUpstream()
    app = create_app(small_window(tmp_path), upstream_transport=httpx.ASGITransport(app=fake))
    with serve_in_thread(app) as base, httpx.Client(base_url=base, timeout=30) as agent:
        yield base, fake, agent


def open_page(browser: Browser, url: str) -> Page:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.on("dialog", lambda dialog: dialog.accept())  # the operator confirms each action
    page.goto(url)
    return page


def test_the_list_and_the_session_view_show_what_the_model_saw(
        browser: Browser, proxy: tuple[str, FakeUpstream, httpx.Client]) -> None:
    base, fake, agent = proxy
    run(agent.post, 20)
    run(agent.post, 4, session="review")
    parent = run(agent.post, 5, session=None)
    fork = agent.post("/v1/chat/completions", json={"model": "fake-model", "messages": [
        *history(2), {"role": "user", "content": "Try another way."}]}).headers["x-ctx-session"]
    page = open_page(browser, base + "/ctx/ui")
    page.locator(f'tr[data-session="{fork}"] a[href="#/s/{parent}"]').wait_for()  # the fork names its parent
    row = page.locator('tr[data-session="inspected"]')
    row.wait_for()
    assert row.locator("td").nth(2).inner_text() == "20"
    page.fill("#filter", "no such session")
    assert page.locator("#sessions tbody tr").count() == 0
    page.fill("#filter", "")
    page.locator("#sessions tbody tr").nth(3).wait_for()
    shot(page, "inspector-list.png", height=300)
    row.locator("a").first.click()
    page.locator('polyline[data-series="agent"][data-points="20"]').wait_for()
    for series in ("upstream", "prompt", "reused"):
        assert page.get_attribute(f'polyline[data-series="{series}"]', "data-points") == "20"
    assert page.get_attribute('[data-line="budget"]', "data-value") == "3072"
    assert page.locator('#chart circle[data-mark="spill"]').count() == 5
    assert page.locator('#chart circle[data-mark="elide"]').count() >= 1
    assert page.locator('#chart circle[data-mark="fold"]').count() >= 1
    page.locator("#sent .message").last.wait_for()
    assert page.locator('#sent button[data-mark="spill"]').count() >= 1  # the newest spill's stub
    assert page.locator('#sent button[data-mark="fold"]').count() == 1
    assert page.locator('#raw [data-id="tool:call_10"] button[data-mark="elide"]').count() == 1
    assert page.locator('#raw [data-id="tool:call_0"] button[data-mark="fold"]').count() == 1  # in the fold
    assert page.locator('#timeline li[data-kind="elide"]').count() >= 4
    shot(page, "inspector-session.png")

    page.locator('#sent button[data-mark="spill"]').last.click()
    body = page.locator("#overflow-body")
    body.wait_for()
    assert "log line 0 of run 19" in body.inner_text()
    page.fill("#overflow-grep", r"test_case_7\d ")
    page.press("#overflow-grep", "Enter")
    page.locator("#overflow-range", has_text="matching").wait_for()  # (the page's CSP allows no eval'd predicate)
    assert body.inner_text().count("\n") == 9 and "test_case_79 " in body.inner_text()
    page.click("#overflow button[value=close]")

    page.click('#raw [data-id="tool:call_10"] button[data-action="pin"]')
    page.locator('#raw [data-id="tool:call_10"] button[data-action="unpin"]').wait_for()
    page.click('#raw [data-id="tool:call_18"] button[data-action="drop"]')
    page.locator('#raw [data-id="tool:call_18"] button[data-action="restore"]').wait_for()
    run(agent.post, 21, start=21)
    sent = fake.last_chat.json()["messages"]
    assert {"role": "tool", "tool_call_id": "call_10", "content": result(10)} in sent  # restored whole, pinned
    dropped = next(m for m in sent if m.get("tool_call_id") == "call_18")
    assert "Dropped by the operator" in dropped["content"]

    page.locator("#live.on").wait_for()  # subscribed to GET /ctx/events
    fake.enqueue(Reply(body=tool_answer(("context_status", {}))))  # the model looks at its context
    run(agent.post, 22, start=22)
    page.locator('#events li[data-op="status"]').wait_for()  # live, as it ran
    page.locator('#chart circle[data-mark="op"]').wait_for()  # and on the chart once the rounds refresh
    assert page.locator('#timeline li[data-op="status"]').count() == 1
    page.close()


def test_a_600_round_session_renders_about_as_fast_as_a_10_round_one(
        browser: Browser, proxy: tuple[str, FakeUpstream, httpx.Client]) -> None:
    """Render time (fetching the rounds, drawing the chart, fetching and drawing the newest request) of a session
    of 600 rounds against one of 10, in the same browser, medians of 3."""
    base, _, agent = proxy
    run(agent.post, 10, session="short")
    run(agent.post, 600, session="long", output=short_result)
    page = open_page(browser, base + "/ctx/ui")
    page.locator('tr[data-session="long"]').wait_for()
    short = [render_ms(page, "short") for _ in range(3)]
    long = [render_ms(page, "long") for _ in range(3)]
    ratio = statistics.median(long) / statistics.median(short)
    print(f"render: 10 rounds {statistics.median(short):.0f} ms, 600 rounds {statistics.median(long):.0f} ms, "
          f"ratio {ratio:.1f}")
    assert ratio < 10, (short, long)  # a 10-round one takes ~0.1 s: 10× is the second the page may take
    page.close()


def short_result(i: int) -> str:
    """A long run's output: a line, and every tenth round a 2 KB log (spilled)."""
    return f"part {i}: ok\n" * (150 if i % 10 == 9 else 1)


def render_ms(page: Page, session: str) -> float:
    page.evaluate("location.hash = '#/'")
    page.locator(f'tr[data-session="{session}"]').wait_for()
    page.evaluate("delete document.body.dataset.render")
    page.evaluate(f"location.hash = '#/s/{session}'")
    page.locator("body[data-render]").wait_for(state="attached")
    return float(page.evaluate("document.body.dataset.render"))


def shot(page: Page, name: str, height: int = 1000) -> None:
    if os.environ.get("INSPECTOR_SCREENSHOTS"):
        page.screenshot(path=str(IMAGES / name), clip={"x": 0, "y": 0, "width": 1400, "height": height})
