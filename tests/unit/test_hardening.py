"""Hardening of the server: bad input of every kind, admission control, timeouts, engine failure,
and the security defaults (API key, logs, bind address, CORS).

One server (tiny model, API key, a 64 KiB body limit) answers the bad-input matrix: each bad
request must get its status and an OpenAI-style error body, and a good request right after it
must succeed. The load, overload and fuzz tests live in test_hardening_load.py,
test_api_fuzz.py and test_hardening_engine.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from tessera.engine.engine import LLMEngine
from tessera.server.admission import AdmissionController, ServerLimits
from tessera.server.app import create_app
from tests.load.harness import free_port
from tests.step_gate import StepGate
from tests.unit.test_server import MAX_MODEL_LEN, MODEL, ServerThread, engine_config

KEY = "k3y-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 << 10
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               415: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    app = create_app(engine_config(tiny_model_dir), served_model_name=MODEL, api_key=KEY,
                     limits=ServerLimits(max_body_bytes=BODY_LIMIT))
    with ServerThread(app) as srv:
        yield srv


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, fragment: str = "") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == ERROR_TYPES[status], err
    if param is not None:
        assert err["param"] == param, err
    assert fragment.lower() in err["message"].lower(), err
    return err


def good_request_succeeds(base_url: str) -> None:
    r = httpx.post(base_url + "/v1/completions", headers=AUTH,
                   json={"model": MODEL, "prompt": "fine", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text


# ---- the bad-input matrix -------------------------------------------------------------------------

C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
USER = [{"role": "user", "content": "hi"}]


def case(id, path, body, status, param=None, fragment="", **request):
    """One bad request: JSON `body` (None: send `request` as is) and what must come back."""
    return pytest.param(path, body, request, status, param, fragment, id=id)


BAD = [
    # completions: missing, wrong types, empty, huge
    case("c-missing-prompt", C, {"max_tokens": 3}, 400, "prompt", "prompt"),
    case("c-prompt-int", C, {"prompt": 5}, 400, "prompt"),
    case("c-prompt-object", C, {"prompt": {"text": "x"}}, 400, "prompt"),
    case("c-prompt-mixed-list", C, {"prompt": [1, "a"]}, 400, "prompt"),
    case("c-prompt-empty-string", C, {"prompt": ""}, 400, "prompt", "empty"),
    case("c-prompt-empty-list", C, {"prompt": []}, 400, "prompt", "empty"),
    case("c-prompt-empty-inner-list", C, {"prompt": [[]]}, 400, "prompt", "empty"),
    case("c-prompt-huge", C, {"prompt": "word " * 2000}, 400, "prompt", "context"),
    case("c-prompt-huge-ids", C, {"prompt": [5] * 1000}, 400, "prompt", "1000 tokens"),
    case("c-token-id-out-of-vocab", C, {"prompt": [1, 10**6]}, 400, "prompt", "1000000"),
    case("c-token-id-negative", C, {"prompt": [-1]}, 400, "prompt", "-1"),
    case("c-token-id-2-64", C, {"prompt": [2**64]}, 400, "prompt", "vocabulary"),
    case("c-too-many-prompts", C, {"prompt": ["a"] * 65}, 400, "prompt", "64"),
    # completions: numbers out of range or of the wrong type
    case("c-max-tokens-zero", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    case("c-max-tokens-negative", C, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    case("c-max-tokens-string", C, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    case("c-max-tokens-fraction", C, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    case("c-max-tokens-beyond-context", C, {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens",
         str(MAX_MODEL_LEN)),
    case("c-max-tokens-10e30", C, {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    case("c-temperature-negative", C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    case("c-temperature-string", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    case("c-top-p-zero", C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    case("c-top-p-above-one", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    case("c-top-k-negative", C, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    case("c-min-p-two", C, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    case("c-presence-penalty", C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    case("c-frequency-penalty", C, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    case("c-repetition-penalty-zero", C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    case("c-n-zero", C, {"prompt": "x", "n": 0}, 400, "n"),
    case("c-n-over-limit", C, {"prompt": "x", "n": 1000}, 400, "n", "16"),
    case("c-n-string", C, {"prompt": "x", "n": "two"}, 400, "n"),
    case("c-logprobs-21", C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    case("c-logprobs-negative", C, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    case("c-stop-too-many", C, {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop", "16"),
    case("c-stop-too-long", C, {"prompt": "x", "stop": ["y" * 300]}, 400, "stop", "300"),
    case("c-stop-empty-string", C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    case("c-stop-int", C, {"prompt": "x", "stop": 5}, 400, "stop"),
    case("c-stop-token-out-of-vocab", C, {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    case("c-stop-tokens-too-many", C, {"prompt": "x", "stop_token_ids": list(range(65))}, 400, "stop_token_ids"),
    case("c-seed-beyond-64-bits", C, {"prompt": "x", "seed": 2**70}, 400, "seed", "seed"),
    case("c-seed-string", C, {"prompt": "x", "seed": "lucky"}, 400, "seed"),
    case("c-timeout-zero", C, {"prompt": "x", "timeout": 0}, 400, "timeout"),
    case("c-timeout-negative", C, {"prompt": "x", "timeout": -1}, 400, "timeout"),
    case("c-min-tokens-over-max", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    case("c-stream-not-bool", C, {"prompt": "x", "stream": "maybe"}, 400, "stream"),
    case("c-stream-options-type", C, {"prompt": "x", "stream_options": 3}, 400, "stream_options"),
    case("c-echo", C, {"prompt": "x", "echo": True}, 400, "echo"),
    case("c-suffix", C, {"prompt": "x", "suffix": "end"}, 400, "suffix"),
    case("c-logit-bias", C, {"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    case("c-best-of", C, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    case("c-unknown-model", C, {"prompt": "x", "model": "gpt-4"}, 404, "model", "gpt-4"),
    case("c-stream-bad-params", C, {"prompt": "x", "stream": True, "top_k": -5}, 400, "top_k"),
    # chat
    case("chat-missing-messages", CHAT, {}, 400, "messages"),
    case("chat-messages-empty", CHAT, {"messages": []}, 400, "messages"),
    case("chat-messages-string", CHAT, {"messages": "hi"}, 400, "messages"),
    case("chat-role-unknown", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    case("chat-role-missing", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    case("chat-content-int", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    case("chat-image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         400, "messages.0.content", "image_url"),
    case("chat-top-logprobs-alone", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    case("chat-top-logprobs-21", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "logprobs"),
    case("chat-max-completion-tokens-zero", CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_tokens"),
    case("chat-huge-conversation", CHAT, {"messages": USER * 400}, 400, "messages", "context"),
    case("chat-tools", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    case("chat-response-format", CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400,
         "response_format"),
    case("chat-unknown-tool", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                                     "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
         "tool_choice", "'g'"),
    case("chat-bad-regex", CHAT, {"messages": USER, "structured_outputs": {"regex": "(a"}}, 400, "structured_outputs"),
    case("chat-n-over-limit", CHAT, {"messages": USER, "n": 17}, 400, "n"),
    case("chat-unknown-model", CHAT, {"messages": USER, "model": "nope"}, 404, "model"),
    # tokenize / detokenize
    case("tok-neither", TOK, {}, 400, "prompt"),
    case("tok-both", TOK, {"prompt": "x", "messages": USER}, 400, "prompt"),
    case("tok-prompt-list", TOK, {"prompt": ["x"]}, 400, "prompt"),
    case("detok-out-of-vocab", DETOK, {"tokens": [10**6]}, 400, "tokens"),
    case("detok-not-a-list", DETOK, {"tokens": "abc"}, 400, "tokens"),
    case("detok-missing", DETOK, {}, 400, "tokens"),
    # transport: JSON, encoding, content type, size, auth, method, route
    case("invalid-json", C, None, 400, content=b'{"prompt": "x",', headers={"content-type": "application/json"}),
    case("json-array-body", C, None, 400, content=b'[1, 2]', headers={"content-type": "application/json"}),
    case("json-string-body", C, None, 400, content=b'"prompt"', headers={"content-type": "application/json"}),
    case("empty-body", C, None, 400, content=b"", headers={"content-type": "application/json"}),
    case("invalid-utf8", C, None, 400, fragment="UTF-8", content=b'{"prompt": "\xff\xfe\xfa"}',
         headers={"content-type": "application/json"}),
    case("content-type-text", C, None, 415, fragment="application/json", content=b'{"prompt": "x"}',
         headers={"content-type": "text/plain"}),
    case("content-type-form", C, None, 415, content=b"prompt=x",
         headers={"content-type": "application/x-www-form-urlencoded"}),
    case("oversized-body", C, None, 413, fragment="--max-body-bytes",
         content=json.dumps({"prompt": "x" * (BODY_LIMIT + 10)}).encode(), headers={"content-type": "application/json"}),
    case("oversized-chunked-body", C, None, 413, fragment="--max-body-bytes",
         content=iter([b'{"prompt": "', b"x" * BODY_LIMIT, b'"}']), headers={"content-type": "application/json"}),
    case("auth-missing", C, None, 401, fragment="API key", json={"prompt": "x"}, auth={}),
    case("auth-wrong-key", C, None, 401, json={"prompt": "x"}, auth={"Authorization": "Bearer wrong"}),
    case("auth-key-prefix", C, None, 401, json={"prompt": "x"}, auth={"Authorization": f"Bearer {KEY[:-1]}"}),
    case("auth-wrong-scheme", C, None, 401, json={"prompt": "x"}, auth={"Authorization": f"Basic {KEY}"}),
    case("method-get-on-post-route", C, None, 405, method="GET"),
    case("unknown-route", "/v1/engines", None, 404, json={}),
]


@pytest.mark.parametrize("path,body,request_kw,status,param,fragment", BAD)
def test_bad_input_gets_its_status_and_an_openai_error_then_the_server_keeps_serving(
        server, path, body, request_kw, status, param, fragment):
    kw = dict(request_kw)
    method = kw.pop("method", "POST")
    headers = {**kw.pop("auth", AUTH), **kw.pop("headers", {})}
    if body is not None:
        kw["json"] = {"model": MODEL, **body} if path in (C, CHAT) and "model" not in body else body
    r = httpx.request(method, server.base_url + path, headers=headers, timeout=30, **kw)
    err = assert_openai_error(r, status, param, fragment)
    assert KEY not in err["message"]
    good_request_succeeds(server.base_url)


def test_the_matrix_has_at_least_40_cases_over_every_endpoint():
    assert len(BAD) >= 40
    assert {p.values[0] for p in BAD} >= {C, CHAT, TOK, DETOK}


def test_matrix_leaves_nothing_behind(server):
    stats = server.wait_idle()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0
    admission = server.app.state.admission
    assert admission.in_flight_seqs == 0 and admission.queued_seqs == 0 and admission.queued_tokens == 0
    assert server.engine.is_healthy


# ---- admission control ----------------------------------------------------------------------------


def test_admission_controller_counts_the_queue_behind_a_full_batch():
    ac = AdmissionController(ServerLimits(max_waiting_requests=2, max_waiting_tokens=100), batch_size=4)
    tickets = [ac.admit(1, [10]) for _ in range(6)]  # 4 run, 2 wait
    with pytest.raises(Exception) as e:
        ac.admit(1, [10])
    assert e.value.status_code == 503 and e.value.headers == {"Retry-After": "1"}
    assert "--max-waiting-requests 2" in e.value.message and ac.rejected["waiting_requests"] == 1
    tickets[0].release()
    tickets[0].release()  # idempotent
    tickets.append(ac.admit(1, [10]))
    assert ac.in_flight_seqs == 6 and ac.queued_tokens == 60
    # Prompt tokens count until the request's first output.
    for ticket in tickets[:5]:
        ticket.started(0)
    assert ac.queued_tokens == 20
    for ticket in tickets:
        ticket.release()
    assert (ac.in_flight_seqs, ac.queued_seqs, ac.queued_tokens) == (0, 0, 0)

    ac = AdmissionController(ServerLimits(max_waiting_requests=None, max_waiting_tokens=100), batch_size=4)
    first = ac.admit(2, [30])  # 60 tokens queued
    with pytest.raises(Exception) as e:
        ac.admit(1, [50])
    assert e.value.status_code == 503 and "--max-waiting-tokens 100" in e.value.message
    assert ac.rejected["waiting_tokens"] == 1
    first.started(0)
    ac.admit(1, [50]).release()
    first.release()
    # An idle server takes a request larger than the limits on its own, so it is never refused forever.
    big = ac.admit(16, [200] * 4)
    assert ac.in_flight_seqs == 64
    big.release()


async def _open_stream(client: httpx.AsyncClient, base_url: str, body: dict) -> httpx.Response:
    r = await client.send(client.build_request("POST", base_url + C, json=body), stream=True)
    return r


def test_server_answers_503_with_retry_after_at_once_when_the_queue_is_full(tiny_model_dir, monkeypatch):
    # No engine step runs while the 503 is decided: the refusal cannot have waited for one.
    gate = StepGate(allowed=0).install(monkeypatch)
    config = dataclasses.replace(engine_config(tiny_model_dir), max_num_seqs=2)
    app = create_app(config, served_model_name=MODEL, limits=ServerLimits(max_waiting_requests=1))
    long = {"model": MODEL, "prompt": "long", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def main(base_url: str):
        async with httpx.AsyncClient(timeout=30) as client:
            streams = [await _open_stream(client, base_url, long) for _ in range(3)]  # 2 run, 1 waits
            assert [s.status_code for s in streams] == [200, 200, 200]
            r = await client.post(base_url + C, json={"model": MODEL, "prompt": "x", "max_tokens": 1})
            steps_before_answer = gate.done
            gate.open()
            for s in streams:
                await s.aclose()
            return r, steps_before_answer

    with ServerThread(app) as srv:
        r, steps = asyncio.run(main(srv.base_url))
        err = assert_openai_error(r, 503, fragment="--max-waiting-requests")
        assert err["code"] == "server_overloaded" and r.headers["retry-after"] == "1"
        assert steps == 0
        srv.wait_idle()
        r = httpx.post(srv.base_url + C, json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
        text = httpx.get(srv.base_url + "/metrics").text
        assert 'tessera:requests_rejected_total{model_name="tiny",reason="waiting_requests"} 1.0' in text


# ---- timeouts ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def timeout_server(tiny_model_dir):
    # On a quiet machine the tiny model finishes 4 x 240 tokens inside the 0.5 s cap; a 5 ms pause
    # per step makes every request here outlive its timeout (240 steps >= 1.2 s) on any machine.
    step = LLMEngine.step

    def slow_step(self):
        time.sleep(0.005)
        return step(self)

    config = dataclasses.replace(engine_config(tiny_model_dir), max_num_seqs=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LLMEngine, "step", slow_step)
        with ServerThread(create_app(config, served_model_name=MODEL, limits=ServerLimits(request_timeout=0.5))) as srv:
            yield srv


def test_request_past_its_timeout_is_aborted_with_a_408_and_its_blocks_freed(timeout_server, monkeypatch):
    srv = timeout_server
    StepGate(allowed=3).install(monkeypatch)  # three steps, then held: the request cannot finish first
    body = {"model": MODEL, "prompt": "slow", "max_tokens": 240, "n": 4, "ignore_eos": True, "timeout": 0.05}
    r = httpx.post(srv.base_url + C, json=body, timeout=30)
    err = assert_openai_error(r, 408, "timeout", "timeout of 0.05 s")
    assert err["code"] == "request_timeout"
    stats = srv.wait_idle()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0
    # A larger timeout than the server's is capped by --request-timeout (0.5 s).
    r = httpx.post(srv.base_url + C, json={**body, "timeout": 60}, timeout=30)
    assert_openai_error(r, 408, "timeout", "0.5 s")
    assert "tessera:request_timeouts_total" in httpx.get(srv.base_url + "/metrics").text


def test_streamed_request_past_its_timeout_ends_with_finish_reason_abort(timeout_server, monkeypatch):
    srv = timeout_server
    StepGate(allowed=5).install(monkeypatch)  # the prefill and four decode steps, then held until the timeout
    # 0.5 s (the server's cap) leaves the five allowed steps ample time before the deadline.
    body = {"model": MODEL, "prompt": "slow", "max_tokens": 240, "n": 2, "ignore_eos": True, "timeout": 0.5,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.base_url + C, json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert not any("error" in c for c in chunks)
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finishes == {0: "abort", 1: "abort"}
    usage = chunks[-1]["usage"]
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
             for i in (0, 1)}
    assert usage["completion_tokens"] == 2 * 5 and all(texts.values())
    stats = srv.wait_idle()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0


def test_request_that_times_out_in_the_queue_gets_a_408(timeout_server, monkeypatch):
    srv = timeout_server
    gate = StepGate(allowed=0).install(monkeypatch)
    hog = {"model": MODEL, "prompt": "hog", "max_tokens": 200, "n": 4, "ignore_eos": True, "timeout": 0.4}
    queued = {"model": MODEL, "prompt": "queued", "max_tokens": 5, "timeout": 0.1}

    async def main():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as client:
            hog_task = asyncio.ensure_future(client.post(C, json=hog))
            while srv.engine.num_in_flight < 1:
                await asyncio.sleep(0.005)
            gate.allow(1)  # one step: the hog's 4 sequences fill the batch of 4 and are prefilled
            while gate.done < 1:
                await asyncio.sleep(0.005)
            r = await client.post(C, json=queued)  # waits behind the full batch; no step runs
            gate.open()
            return r, await hog_task

    r, hog_r = asyncio.run(main())
    assert_openai_error(r, 408, "timeout")
    assert hog_r.status_code in (200, 408)
    assert srv.app.state.admission.in_flight_seqs == 0


# ---- engine failure -------------------------------------------------------------------------------


def test_engine_failure_gives_in_flight_requests_a_500_and_the_server_exits_1(tiny_model_dir):
    """A real `tessera serve` whose engine step raises once a chosen prompt runs: the in-flight
    request gets a 500 naming the failure, and the process shuts down with exit code 1."""
    port = free_port()
    script = textwrap.dedent(f"""
        import sys
        from tessera.engine.engine import LLMEngine
        from tessera.cli import main

        real_step = LLMEngine.step
        def step(self):
            if any(state.prompt_ids == [7, 7, 7, 7] for state in self._requests.values()):
                raise RuntimeError("simulated device failure")
            return real_step(self)
        LLMEngine.step = step
        sys.exit(main(["serve", {str(tiny_model_dir)!r}, "--port", "{port}", "--dtype", "float32",
                       "--max-model-len", "256", "--served-model-name", "{MODEL}", "--log-level", "warning",
                       "--no-access-log", "--shutdown-timeout", "5"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        assert httpx.post(base + C, json={"model": MODEL, "prompt": "ok", "max_tokens": 2}).status_code == 200
        r = httpx.post(base + C, json={"model": MODEL, "prompt": [7, 7, 7, 7], "max_tokens": 2}, timeout=30)
        err = assert_openai_error(r, 500, fragment="simulated device failure")
        assert err["code"] == "engine_failed"
        assert proc.wait(timeout=30) == 1
        assert "engine failed" in proc.communicate()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- security defaults ------------------------------------------------------------------------------


def test_api_key_is_compared_in_constant_time_and_never_logged(server, monkeypatch, caplog):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    caplog.set_level(logging.DEBUG)
    wrong = "Bearer not-the-key-but-secret-too"
    for headers in (AUTH, {"Authorization": wrong}, {"Authorization": "Bearer " + KEY[:4]}):
        httpx.post(server.base_url + C, headers=headers, json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    # Every check went through compare_digest, over fixed-length digests: neither the key's
    # length nor how much of it was right shows in the time taken.
    assert len(calls) == 3 and set(calls) == {(32, 32)}
    assert KEY not in caplog.text and "not-the-key-but-secret-too" not in caplog.text


def test_serve_defaults_bind_loopback_and_flags_reach_the_limits():
    import argparse

    from tessera.server.args import add_serve_arguments, server_limits_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args([])
    assert args.host == "127.0.0.1" and args.allowed_origins is None
    limits = server_limits_from_args(p.parse_args(["--max-waiting-requests", "7", "--max-waiting-tokens", "900",
                                                   "--request-timeout", "30", "--max-body-bytes", "1MiB"]))
    assert limits == ServerLimits(max_waiting_requests=7, max_waiting_tokens=900, request_timeout=30.0,
                                  max_body_bytes=1 << 20)
    with pytest.raises(ValueError, match="--request-timeout"):
        ServerLimits(request_timeout=0)


def test_cors_is_off_by_default_and_on_for_the_allowed_origins_only(server, tiny_model_dir):
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.base_url + C, headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(server.base_url + "/v1/models", headers={**AUTH, "Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers

    app = create_app(engine_config(tiny_model_dir), served_model_name=MODEL,
                     allowed_origins=["https://app.example"])
    with ServerThread(app) as srv:
        r = httpx.options(srv.base_url + C, headers={**preflight, "Origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.options(srv.base_url + C, headers=preflight)
        assert r.headers.get("access-control-allow-origin") != "https://evil.example"
        r = httpx.get(srv.base_url + "/v1/models", headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
