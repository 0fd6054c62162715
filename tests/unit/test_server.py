"""The OpenAI-compatible server end to end: a real uvicorn on loopback, the tiny model, the `openai` client.

Every generated text is checked against a solo run of the same prompt on a separate synchronous
LLMEngine (greedy, so batching must not change a single token); the engine itself is checked
against transformers in test_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tessera.config import EngineConfig
from tessera.engine.engine import LLMEngine
from tessera.sampling import SamplingParams
from tessera.server.app import create_app
from tests.step_gate import StepGate, wait_until

MODEL = "tiny"
MAX_MODEL_LEN = 256


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                        max_num_batched_tokens=1024, block_size=16, num_threads=1)


class ServerThread:
    """uvicorn serving `app` on a free loopback port, in a background thread."""

    def __init__(self, app) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    @property
    def engine(self):
        return self.app.state.engine

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0)

    def wait_idle(self, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.stats()
            if s.num_running == 0 and s.num_waiting == 0 and self.engine.num_in_flight == 0:
                return s
            time.sleep(0.02)
        return self.engine.stats()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(create_app(engine_config(tiny_model_dir), served_model_name=MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """A separate synchronous engine: `solo(prompt, params)` runs one request alone to completion."""
    engine = LLMEngine(engine_config(tiny_model_dir))
    counter = iter(range(10**9))

    def solo(prompt, params: SamplingParams):
        rid = f"ref-{next(counter)}"
        engine.add_request(rid, prompt, params)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        return final

    solo.engine = engine
    return solo


def chat_prompt_ids(reference, messages) -> list[int]:
    tok = reference.engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def metric_samples(base_url: str) -> dict[str, list]:
    text = httpx.get(base_url + "/metrics").text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


# ---- plain routes -------------------------------------------------------------------------------


def test_models_health_tokenize(server, reference):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.base_url + "/health").status_code == 200
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": "the weather"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == reference.engine.tokenizer.encode("the weather")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    r = httpx.post(server.base_url + "/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": "the weather"}
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.base_url + "/tokenize", json={"messages": messages})
    assert r.json()["tokens"] == chat_prompt_ids(reference, messages)


# ---- completions and chat -----------------------------------------------------------------------


def test_completion_matches_solo_run_and_streams_the_same_text(server, reference):
    client = server.client()
    prompt = "Once upon a time"
    expected = reference(prompt, greedy(12)).outputs[0]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == "length"
    n_prompt = len(reference.engine.tokenizer.encode(prompt))
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (
        n_prompt, 12, n_prompt + 12)

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1, "expected the text to arrive in several chunks"
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == n_prompt


def test_chat_matches_solo_run_streamed_and_not(server, reference):
    client = server.client()
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]
    flat = [messages[0], {"role": "user", "content": "Say\nhi"}]
    prompt_ids = chat_prompt_ids(reference, flat)
    expected = reference(prompt_ids, greedy(10)).outputs[0]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == 10

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected.text
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.total_tokens == len(prompt_ids) + 10


def test_n_and_prompt_lists_give_all_choices(server, reference):
    client = server.client()
    prompts = ["alpha", "beta gamma"]
    resp = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    for c in resp.choices:
        assert c.text == reference(prompts[c.index // 2], greedy(6)).outputs[0].text
    assert resp.usage.completion_tokens == 4 * 6

    # Sampled n > 1 with a seed: n distinct streams, each repeatable.
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3, max_tokens=8, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    streamed = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in a.choices]


def test_stop_string_cuts_the_text(server, reference):
    client = server.client()
    prompt = "Stop me"
    full = reference(prompt, greedy(24)).outputs[0].text
    # An ASCII character that first appears a few characters in.
    stop = next(ch for i, ch in enumerate(full) if i >= 2 and ch.isascii() and ch.isalnum() and ch not in full[:i])
    expected = full[: full.index(stop)]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_logprobs(server, reference):
    client = server.client()
    prompt = "log"
    ref = reference(prompt, greedy(5, logprobs=2)).outputs[0]
    ref_lp = [entry[t].logprob for t, entry in zip(ref.token_ids, ref.logprobs, strict=True)]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref_lp, abs=1e-4)
    assert len(lp.tokens) == 5 and all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0

    streamed = []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                           stream=True, extra_body={"ignore_eos": True}):
        streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(ref_lp, abs=1e-4)

    messages = [{"role": "user", "content": "log"}]
    ref = reference(chat_prompt_ids(reference, messages), greedy(5, logprobs=2)).outputs[0]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [entry[t].logprob for t, entry in zip(ref.token_ids, ref.logprobs, strict=True)], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


# ---- concurrency, metrics, disconnects ----------------------------------------------------------


def test_64_concurrent_streams_match_solo_runs_and_share_steps(server, reference):
    prompts = [f"request number {i}: " + "ab" * (i % 5) for i in range(64)]
    max_tokens = 6
    before = metric_samples(server.base_url)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(main())
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == reference(prompt, greedy(max_tokens)).outputs[0].text, prompt

    after = metric_samples(server.base_url)

    def multi_seq_steps(samples) -> float:
        buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
        return buckets["+Inf"] - buckets["1.0"]

    assert multi_seq_steps(after["tessera:iteration_num_seqs"]) > multi_seq_steps(before["tessera:iteration_num_seqs"])
    success = {s.labels["finished_reason"]: s.value for s in after["tessera:request_success"]
               if s.name.endswith("_total")}
    assert success["length"] >= 64
    ttft_count = next(s.value for s in after["tessera:time_to_first_token_seconds"] if s.name.endswith("_count"))
    assert ttft_count >= 64
    for name in ("tessera:e2e_request_latency_seconds", "tessera:request_queue_time_seconds",
                 "tessera:inter_token_latency_seconds"):
        assert next(s.value for s in after[name] if s.name.endswith("_count")) > 0, name
    gen_total = next(s.value for s in after["tessera:generation_tokens"] if s.name.endswith("_total"))
    assert gen_total >= 64 * max_tokens
    for name in ("tessera:num_requests_running", "tessera:num_requests_waiting", "tessera:kv_cache_usage_perc",
                 "tessera:prompt_tokens", "tessera:num_preemptions"):
        assert name in after, name


def abort_count(base_url: str) -> float:
    samples = metric_samples(base_url)["tessera:request_success"]
    return sum(s.value for s in samples if s.name.endswith("_total") and s.labels["finished_reason"] == "abort")


def test_client_disconnect_mid_stream_frees_blocks(server):
    aborts = abort_count(server.base_url)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.base_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip((x for x in lines if x.startswith("data: {")), range(3), strict=False)]
        assert len(got) == 3
        assert server.engine.stats().kv_cache_usage > 0
    stats = server.wait_idle()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0
    assert abort_count(server.base_url) == aborts + 1
    # And the server keeps serving.
    assert server.client().completions.create(model=MODEL, prompt="ok", max_tokens=2).choices


def test_client_disconnect_while_waiting_for_non_streamed_answer(server, monkeypatch):
    # The engine's steps are held, so the request is certainly unfinished when the client leaves
    # (on a quiet machine the tiny model would finish 240 tokens before any client timeout).
    gate = StepGate(allowed=2).install(monkeypatch)
    aborts = abort_count(server.base_url)
    body = json.dumps({"model": MODEL, "prompt": "patience", "max_tokens": 240, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: server.engine.num_in_flight == 1 and gate.done == 2, what="the request to run")
    # The socket is closed: the server sees the disconnect and aborts the request, with no step taken.
    wait_until(lambda: server.engine.num_in_flight == 0, what="the abort")
    assert gate.done == 2
    gate.open()
    stats = server.wait_idle()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0
    assert abort_count(server.base_url) == aborts + 1


# ---- errors -------------------------------------------------------------------------------------


BAD_REQUESTS = [
    # (route, body, status, param, message fragment)
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature"),
    ("completions", {"prompt": "x", "top_p": 2}, 400, "top_p", "top_p"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n", "n must be"),
    ("completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs", "logprobs"),
    ("completions", {"prompt": [5] * 300}, 400, "prompt", "300 tokens"),
    ("completions", {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens", "256"),
    ("completions", {"prompt": [999999]}, 400, "prompt", "999999"),
    ("completions", {"prompt": []}, 400, "prompt", "empty"),
    ("completions", {"prompt": "x", "echo": True}, 400, "echo", "echo"),
    ("completions", {"max_tokens": 3}, 400, "prompt", "prompt"),
    ("completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("chat/completions", {"messages": []}, 400, "messages", "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0.content", "image_url"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs",
     "logprobs"),
]


@pytest.mark.parametrize("route,body,status,param,fragment", BAD_REQUESTS,
                         ids=[f"{r}-{'-'.join(map(str, b))}" for r, b, *_ in BAD_REQUESTS])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, route, body, status, param, fragment):
    body = {"model": MODEL, **body}
    r = httpx.post(f"{server.base_url}/v1/{route}", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and fragment in err["message"], err
    ok = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_malformed_json_unknown_route_and_openai_client_errors(server):
    r = httpx.post(server.base_url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.base_url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    assert "context" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    # A streaming request that is invalid fails before the stream starts, with a normal error.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", stream=True, extra_body={"top_k": -5})
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].finish_reason


# ---- a second app: API key, engine failure ------------------------------------------------------


def test_api_key_and_engine_failure(tiny_model_dir):
    app = create_app(engine_config(tiny_model_dir), served_model_name=MODEL, api_key="s3cret")
    with ServerThread(app) as srv:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        r = httpx.post(srv.base_url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(srv.base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        assert srv.client(api_key="s3cret").completions.create(**body).choices
        assert httpx.get(srv.base_url + "/health").status_code == 200  # probes need no key
        assert httpx.get(srv.base_url + "/metrics").status_code == 200

        def broken_step():
            raise RuntimeError("simulated device failure")

        srv.engine.engine.step = broken_step
        r = httpx.post(srv.base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        # In flight when the engine died: a server error; afterwards the server is unavailable.
        assert r.status_code == 500 and "simulated device failure" in r.json()["error"]["message"]
        assert httpx.get(srv.base_url + "/health").status_code == 503
        r = httpx.post(srv.base_url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 503


def test_streamed_error_is_reported_in_band():
    from tessera.server.formatting import sse_error

    payload = json.loads(sse_error(RuntimeError("boom")).removeprefix("data: "))
    assert payload["error"]["message"] == "boom" and payload["error"]["type"] == "internal_server_error"


# ---- the serving benchmark and `tessera serve` itself --------------------------------------------


def test_serving_benchmark_against_the_server(server, tmp_path):
    from tessera.bench.serve import check_loopback, main

    out = tmp_path / "bench.json"
    summary = main(["--base-url", server.base_url, "--num-prompts", "8", "--input-len", "12", "--output-len", "4",
                    "--request-rate", "100", "--max-concurrency", "4", "--slo-ttft-ms", "60000",
                    "--max-duration", "60", "--out", str(out)])
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert summary["output_token_throughput"] == pytest.approx(8 * 4 / summary["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = summary[key]
        assert 0 < row["p50"] <= row["p99"] and row["mean"] > 0, key
    assert json.loads(out.read_text())["completed"] == 8
    with pytest.raises(SystemExit, match="loopback"):
        check_loopback("http://example.com:8000")


def test_tessera_serve_exits_cleanly_on_sigterm_after_finishing_in_flight(tiny_model_dir):
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tessera.cli", "serve", str(tiny_model_dir), "--port", str(port), "--dtype", "float32",
         "--max-model-len", "256", "--served-model-name", MODEL, "--shutdown-timeout", "20", "--no-access-log",
         "--log-level", "warning"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        body = {"model": MODEL, "prompt": "in flight", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(x for x in lines if x.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x]
        assert first and rest[-1] == "data: [DONE]"
        text_chunks = [json.loads(x[6:]) for x in [first, *rest] if x.startswith("data: {")]
        assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
