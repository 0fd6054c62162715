"""The dashboard's server side: /, /dashboard and its files, /v1/stats (figures, series, config,
decisions, the API key), and the window arithmetic against Prometheus' own formulas.

The browser half (the page draws what /v1/stats says) is test_dashboard_browser.py.
"""

from __future__ import annotations

import argparse
import time

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from tessera.advisor.autopilot import Change
from tessera.server.app import create_app
from tessera.server.stats_series import Snapshot, derive_point, histogram_quantile, snapshot
from tests.unit.test_server import ServerThread, engine_config

MODEL = "tiny"


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as sample name -> value summed over labels (histogram buckets left out)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for s in family.samples:
            if not s.name.endswith("_bucket"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def complete(base_url: str, n: int, max_tokens: int = 6, headers: dict | None = None) -> None:
    for i in range(n):
        r = httpx.post(base_url + "/v1/completions", headers=headers, timeout=30,
                       json={"model": MODEL, "prompt": f"dashboard {i}", "max_tokens": max_tokens, "ignore_eos": True})
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    app = create_app(engine_config(tiny_model_dir), served_model_name=MODEL)
    app.state.dashboard.interval_s = 0.2
    with ServerThread(app) as srv:
        yield srv


# ---- the arithmetic ------------------------------------------------------------------------------


def test_histogram_quantile_is_prometheus_interpolation():
    # Prometheus docs: linear inside the bucket holding rank q * count; +Inf gives the top finite bound.
    buckets = [(0.1, 2.0), (0.2, 6.0), (float("inf"), 8.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.1 * (4 - 2) / (6 - 2))
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.1 * 0.8 / 2)  # first bucket starts at 0
    assert histogram_quantile(0.99, buckets) == 0.2
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_quantile_of_real_histogram_lands_in_the_bucket_of_the_true_quantile():
    registry = CollectorRegistry()
    bounds = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)
    h = Histogram("x_seconds", "x", buckets=bounds, registry=registry)
    values = np.random.default_rng(0).lognormal(mean=-3.5, sigma=0.8, size=2000)
    for v in values:
        h.observe(float(v))
    buckets = snapshot(registry).buckets["x_seconds"]
    edges = (0.0, *bounds, float("inf"))
    for q in (0.5, 0.9, 0.99):
        true = float(np.quantile(values, q))
        est = histogram_quantile(q, buckets)
        i = next(k for k in range(len(edges) - 1) if edges[k] <= true < edges[k + 1])
        assert edges[i] <= est <= min(edges[i + 1], bounds[-1]), (q, true, est)


def test_window_figures_follow_their_definitions():
    base = Snapshot(100.0, {"tessera:generation_tokens_total": 50, "tessera:prefix_cache_hits_total": 10,
                            "tessera:prefix_cache_queries_total": 40, "tessera:num_preemptions_total": 1,
                            "tessera:requests_rejected_total": 0},
                    {"tessera:time_to_first_token_seconds": [(0.1, 1.0), (float("inf"), 1.0)]})
    cur = Snapshot(104.0, {"tessera:generation_tokens_total": 250, "tessera:prefix_cache_hits_total": 40,
                           "tessera:prefix_cache_queries_total": 100, "tessera:num_preemptions_total": 3,
                           "tessera:requests_rejected_total": 2, "tessera:num_total_kv_blocks": 64,
                           "tessera:num_free_kv_blocks": 60, "tessera:num_requests_running": 2,
                           "tessera:spec_decode_num_draft_tokens_total": 8,
                           "tessera:spec_decode_num_accepted_tokens_total": 6},
                   {"tessera:time_to_first_token_seconds": [(0.1, 1.0), (float("inf"), 3.0)]})
    p = derive_point(cur, base)
    assert p["output_tokens_per_s"] == pytest.approx(200 / 4)
    assert p["prefix_hit_rate"] == pytest.approx(30 / 60)
    assert p["spec_acceptance"] == pytest.approx(6 / 8)
    assert (p["preemptions"], p["rejected"], p["kv_blocks_used"], p["running"]) == (2, 2, 4, 2)
    # The window's two first tokens both fell past the last finite bound: p50 is that bound.
    assert p["ttft_p50_ms"] == pytest.approx(100.0)
    assert p["itl_p50_ms"] is None  # nothing observed: a gap in the chart, not a zero


# ---- the routes ----------------------------------------------------------------------------------


def test_root_redirects_and_the_page_loads_only_its_own_files(server):
    r = httpx.get(server.base_url + "/")
    assert r.status_code == 307 and r.headers["location"] == "/dashboard"
    page = httpx.get(server.base_url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text
    for name, kind in (("dashboard.js", "javascript"), ("dashboard.css", "css")):
        r = httpx.get(f"{server.base_url}/dashboard/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"] and r.text
        assert "http://" not in r.text.replace("http://www.w3.org/2000/svg", "")
    assert httpx.get(server.base_url + "/dashboard/..%2Fapp.py").status_code == 404


def test_stats_totals_equal_metrics_and_series_grow(server):
    complete(server.base_url, 4)
    server.wait_idle()
    time.sleep(0.5)  # a few snapshots after the requests
    stats = httpx.get(server.base_url + "/v1/stats").json()
    metrics = scrape(server.base_url)
    for name, value in stats["totals"].items():
        assert value == metrics[name], name
    assert stats["totals"]["tessera:generation_tokens_total"] >= 4 * 6
    series = stats["series"]
    assert len(series["t"]) >= 2 and all(len(v) == len(series["t"]) for v in series.values())
    assert series["t"] == sorted(series["t"])
    assert max(v for v in series["output_tokens_per_s"] if v is not None) > 0
    assert any(v is not None for v in series["ttft_p99_ms"])
    assert stats["config"]["configured"]["max_num_batched_tokens"] == 1024
    assert stats["decisions"] == []


def test_config_in_force_shows_a_knob_changed_while_serving(server):
    scheduler = server.engine.engine.scheduler
    old = scheduler.max_num_batched_tokens
    assert "prefill_only_budget" not in httpx.get(server.base_url + "/v1/stats").json()["config"]["in_force"]
    scheduler.max_num_batched_tokens, scheduler.prefill_only_budget = 256, 1024  # as the autopilot cuts
    try:
        config = httpx.get(server.base_url + "/v1/stats").json()["config"]
    finally:
        scheduler.max_num_batched_tokens, scheduler.prefill_only_budget = old, None
    assert config["configured"]["max_num_batched_tokens"] == 1024
    assert config["in_force"]["max_num_batched_tokens"] == 256
    assert config["in_force"]["prefill_only_budget"] == 1024


def test_stats_need_the_api_key_the_page_does_not(tiny_model_dir):
    app = create_app(engine_config(tiny_model_dir), served_model_name=MODEL, api_key="s3cret")
    with ServerThread(app) as srv:
        assert httpx.get(srv.base_url + "/dashboard").status_code == 200
        r = httpx.get(srv.base_url + "/v1/stats")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(srv.base_url + "/v1/stats", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["model"] == MODEL


def test_autopilot_decisions_reach_the_timeline(server):
    from tessera.advisor.commands import attach_serve_advisor

    app = server.app
    args = argparse.Namespace(autopilot=True, slo_ttft_ms=500.0, slo_itl_ms=50.0, record_trace=None)
    old_observer = app.state.engine.observer
    attach_serve_advisor(app, args)
    try:
        autopilot = app.state.autopilot
        autopilot.changes.append(Change(time.monotonic(), "max_num_batched_tokens", 1024, 512, "p90 ITL 80 ms > 50 ms"))
        decisions = httpx.get(server.base_url + "/v1/stats").json()["decisions"]
        assert len(decisions) == 1
        d = decisions[0]
        assert (d["source"], d["knob"], d["old"], d["new"]) == ("autopilot", "max_num_batched_tokens", 1024, 512)
        assert "80 ms" in d["reason"] and abs(d["wall_time"] - time.time()) < 5

        # Records of another shape (an autopilot that keeps `decisions`, with more figures) pass through.
        class Recorder:
            decisions = [{"time": time.monotonic(), "knob": "enable_prefix_caching", "old": True, "new": False,
                          "reason": "hit rate 1%", "figure": 0.01}]

        app.state.autopilot = Recorder()
        d = httpx.get(server.base_url + "/v1/stats").json()["decisions"][0]
        assert d["figure"] == 0.01 and d["knob"] == "enable_prefix_caching"
    finally:
        app.state.engine.observer = old_observer
        del app.state.autopilot
