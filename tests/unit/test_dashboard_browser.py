"""/dashboard in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright)
against a real server (the tiny model) while a load runs.

Checks that the charts draw, that the figures the page shows agree with /metrics within one
refresh (between a scrape before and one after it during the load, exactly once the server is
idle), that the page asks for the key behind --api-key, and that it made no request to anything
but the server. The screenshot is kept under pytest's tmp dir (its path is printed; set
TESSERA_SCREENSHOT_DIR to copy it somewhere). Skips when no Chromium is installed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from tessera.server.app import create_app
from tests.unit.test_dashboard import MODEL, scrape
from tests.unit.test_server import ServerThread, engine_config

CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or "")
                 if p and os.path.exists(p)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (apt-get install chromium; .ci/run does)")
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
REFRESH_S = 0.5
# Figures shown as counts: the page's data-metric -> the /metrics sample (or a formula of them).
COUNTERS = ("tessera:generation_tokens_total", "tessera:prompt_tokens_total", "tessera:request_success_total")
GAUGES = ("tessera:num_requests_running", "tessera:num_requests_waiting")


@pytest.fixture
def browser_page():
    """A fresh Chromium (own profile in a temp dir) and page; every URL it requested in `page.urls`."""
    with playwright_api.sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        context = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=ARGS, headless=True,
                                                        viewport={"width": 1400, "height": 1100})
        page = context.new_page()
        page.urls = []
        page.on("request", lambda request: page.urls.append(request.url))
        try:
            yield page
        finally:
            context.close()


def shown(page) -> dict[str, float]:
    """The figures as the page prints them (thousands separators removed)."""
    texts = page.eval_on_selector_all("[data-metric]", "els => els.map(e => [e.dataset.metric, e.textContent])")
    return {name: float(text.replace(",", "")) for name, text in texts if text != "-"}


def refreshes(page) -> int:
    return int(page.get_attribute("#refreshes", "data-count"))


def wait_refreshes(page, n: int) -> None:
    start = refreshes(page)
    page.wait_for_function(f"() => Number(document.querySelector('#refreshes').dataset.count) >= {start + n}",
                           timeout=15_000)


class Load:
    """Two clients sending completions back to back until stopped."""

    def __init__(self, base_url: str, headers: dict | None = None) -> None:
        self.base_url, self.headers = base_url, headers or {}
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(2)]

    def run(self, client: int) -> None:
        i = 0
        with httpx.Client(base_url=self.base_url, headers=self.headers, timeout=30) as http:
            while not self.stop.is_set():
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": f"load {client} {i} " * 4,
                                                       "max_tokens": 24, "ignore_eos": True})
                if r.status_code != 200:
                    self.errors.append(r.text)
                i += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def test_dashboard_draws_live_figures_that_match_metrics(tiny_model_dir, browser_page, tmp_path):
    page = browser_page
    app = create_app(engine_config(tiny_model_dir), served_model_name=MODEL)
    app.state.dashboard.interval_s = REFRESH_S
    shot = tmp_path / "dashboard.png"
    with ServerThread(app) as srv:
        with Load(srv.base_url) as load:
            page.goto(srv.base_url + "/")  # redirects to /dashboard
            assert page.url == srv.base_url + "/dashboard"
            # Drawn: several points of each live chart while the load runs.
            page.wait_for_function("() => ['tps', 'ttft', 'itl', 'queue', 'kv'].every(c => "
                                   "Number(document.querySelector(`[data-chart=${c}] svg`).dataset.points) >= 4)",
                                   timeout=30_000)
            assert page.locator("[data-chart=tps] svg path.line").count() == 1
            assert page.locator("#status").text_content() == "healthy"
            # During the load: the figures of a refresh that started after scrape `before` lie
            # between it and a scrape taken after the page showed them (counters only grow).
            before = scrape(srv.base_url)
            wait_refreshes(page, 2)
            figures = shown(page)
            after = scrape(srv.base_url)
            for name in COUNTERS:
                assert before[name] <= figures[name] <= after[name], name
            assert after["tessera:generation_tokens_total"] > before["tessera:generation_tokens_total"]  # live
            assert page.locator("#config tbody tr").count() > 10
            page.screenshot(path=str(shot), full_page=True)
        assert not load.errors, load.errors[:3]
        # Idle: within one refresh the page shows exactly what /metrics says.
        srv.wait_idle()
        metrics = scrape(srv.base_url)
        wait_refreshes(page, 2)
        figures = shown(page)
        for name in COUNTERS + GAUGES:
            assert figures[name] == metrics[name], name
        assert figures["kv_blocks_used"] == metrics["tessera:num_total_kv_blocks"] - metrics["tessera:num_free_kv_blocks"]
    print(f"dashboard screenshot: {shot}")
    if os.environ.get("TESSERA_SCREENSHOT_DIR"):
        shutil.copy(shot, Path(os.environ["TESSERA_SCREENSHOT_DIR"]) / "dashboard.png")
    outside = [u for u in page.urls if not u.startswith(srv.base_url + "/")]
    assert not outside, f"the page requested {outside}"
    assert any(u.endswith("/v1/stats") for u in page.urls)


def test_dashboard_asks_for_the_api_key(tiny_model_dir, browser_page):
    page = browser_page
    app = create_app(engine_config(tiny_model_dir), served_model_name=MODEL, api_key="s3cret")
    app.state.dashboard.interval_s = REFRESH_S
    with ServerThread(app) as srv:
        page.goto(srv.base_url + "/dashboard")
        page.wait_for_selector("#key-form:not([hidden])", timeout=15_000)
        assert page.locator("#main").is_hidden()
        page.fill("#key-input", "wrong")
        page.click("#key-form button")
        page.wait_for_function("() => document.querySelector('#key-error').textContent.includes('refused')", timeout=15_000)
        page.fill("#key-input", "s3cret")
        page.click("#key-form button")
        page.wait_for_selector("#main:not([hidden])", timeout=15_000)
        wait_refreshes(page, 1)
        assert page.locator("#model").text_content() == MODEL
        assert shown(page)["tessera:num_requests_running"] == 0
    assert all(u.startswith(srv.base_url + "/") for u in page.urls), page.urls
