"""What an operator sees: Prometheus naming conventions on /metrics, a log line for refused
requests, and bad Unicode in a JSON body answered as bad input (400), not as a crash (500)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tessera.server.admission import lone_surrogate_escape
from tessera.server.app import create_app
from tests.unit.test_server import MODEL, ServerThread, engine_config


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(create_app(engine_config(tiny_model_dir), served_model_name=MODEL)) as srv:
        yield srv


def test_metrics_follow_the_prometheus_conventions_on_a_fresh_server(server):
    text = httpx.get(server.base_url + "/metrics").text
    families = list(text_string_to_metric_families(text))
    exported = {f.name for f in families if f.samples}
    # Every TYPE line is followed by samples of that name, even before the first request.
    sample_names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            wanted = {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
            assert wanted <= sample_names, f"{line}: no sample"
    assert {f.name for f in families if not f.samples} == set()
    for f in families:
        if f.type == "histogram":
            assert not f.name.endswith("_total"), f.name
            suffixes = {s.name[len(f.name):] for s in f.samples}
            assert suffixes == {"_bucket", "_sum", "_count"}, (f.name, suffixes)
        if f.type == "counter":
            assert all(s.name.endswith("_total") for s in f.samples), f.name
    assert "tessera:iteration_tokens" in exported and "tessera:request_success" in exported
    success = {s.labels["finished_reason"] for f in families if f.name == "tessera:request_success"
               for s in f.samples}
    assert success == {"stop", "length", "abort"}
    # The process's own figures, as every Prometheus client exports them.
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds",
                 "process_start_time_seconds"):
        assert name in exported, name


def test_refused_requests_get_one_log_line_with_status_and_message(server, caplog):
    with caplog.at_level(logging.INFO, logger="tessera.requests"):
        r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1})
        assert r.status_code == 400
        r2 = httpx.post(server.base_url + "/v1/completions", content=b"x" * 10, headers={"content-type": "text/plain"})
        assert r2.status_code == 415
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tessera.requests"]
    assert lines[0] == f"POST /v1/completions -> 400: {r.json()['error']['message']}"
    assert lines[1] == f"POST /v1/completions -> 415: {r2.json()['error']['message']}"
    assert len(lines) == 2


@pytest.mark.parametrize("route,field", [("completions", "prompt"), ("chat/completions", "messages")])
def test_a_lone_surrogate_in_a_json_string_is_a_400(server, route, field):
    value = "\\ud800" if field == "prompt" else [{"role": "user", "content": "hi \\udfff"}]
    body = json.dumps({"model": MODEL, field: value, "max_tokens": 2}).replace("\\\\u", "\\u")
    assert "\\ud800" in body or "\\udfff" in body
    r = httpx.post(f"{server.base_url}/v1/{route}", content=body.encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "lone UTF-16 surrogate" in err["message"]
    # A proper pair (an emoji) and an escaped backslash are fine.
    for ok in ('"\\ud83d\\ude00 hi"', '"\\\\ud800"'):
        r = httpx.post(server.base_url + "/v1/completions", content=f'{{"model": "{MODEL}", "prompt": {ok}, '
                                                                     f'"max_tokens": 2}}'.encode(),
                       headers={"content-type": "application/json"})
        assert r.status_code == 200, (ok, r.text)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet='\\u"d8Dc0aFx', max_size=24))
def test_the_surrogate_check_agrees_with_json_and_utf8(text):
    """Reference: json.loads, then whether the string encodes as UTF-8."""
    doc = f'"{text}"'
    try:
        decoded = json.loads(doc)
    except ValueError:
        return  # not JSON: the parser's 400, not this check's
    try:
        decoded.encode("utf-8")
        valid = True
    except UnicodeEncodeError:
        valid = False
    assert (lone_surrogate_escape(doc) is None) == valid, doc
