"""Schema fuzzing of the HTTP API: Schemathesis generates requests from the server's own
/openapi.json, both valid ones (positive) and ones that break the schema (negative), and sends
them to a real server running the tiny model. Whatever comes in: never a 5xx; every 4xx is a
well-formed OpenAI error body; every 200 parses (JSON, or an SSE stream that ends in [DONE] with
no in-band server error); and afterwards the engine is healthy, idle, and its KV invariant holds.

Bounded for CI: TESSERA_FUZZ_EXAMPLES examples per operation and mode (default 50), derandomized
(the same examples every run); set TESSERA_FUZZ_RANDOM=1 to explore new ones.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tessera.server.admission import ServerLimits
from tessera.server.app import create_app
from tests.unit.test_server import MODEL, ServerThread, engine_config

EXAMPLES = int(os.environ.get("TESSERA_FUZZ_EXAMPLES", "50"))
POST_OPERATIONS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
CASES = [(path, mode) for path in POST_OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
# GET /v1/models takes no input, so there is nothing to break: positive only.
CASES.append(("/v1/models", GenerationMode.POSITIVE))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # A short --request-timeout bounds what a generated request may cost (a 408 is a 4xx).
    app = create_app(engine_config(tiny_model_dir), served_model_name=MODEL,
                     limits=ServerLimits(request_timeout=3.0))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json")


# Fields the server refuses whatever their value (or, for random tools and response_format, nearly
# always), and the model name: a random one is a 404.
_ALWAYS_REFUSED = ("logit_bias", "best_of", "echo", "suffix", "tools", "response_format")


def plausible(case):
    """Half the positive cases drop what the server always refuses, so that the rest of a random
    body (sampling parameters, stop lists, n, prompts) reaches the engine instead of a 400."""
    if isinstance(case.body, dict):
        body = {k: v for k, v in case.body.items() if k not in _ALWAYS_REFUSED}
        if "model" in body:
            body["model"] = MODEL
        if isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], int):
            body["prompt"] = [t % 256 for t in body["prompt"]]  # in the vocabulary
        case.body = body
    return case


def check_response(response) -> None:
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:500]}"
    if status >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
        assert err["param"] is None or isinstance(err["param"], str), err
        return
    assert status == 200, status
    content_type = response.headers.get("content-type") or [""]  # Schemathesis keeps every value of a header
    if content_type[0].startswith("text/event-stream"):
        events = [x for x in response.text.split("\n") if x]
        # Schemathesis stops reading a stream after a number of events (its max_stream_events).
        if getattr(response, "stream_cut_short", False):
            events = events[:-1]  # it may have been cut mid-event
        else:
            assert events and events[-1] == "data: [DONE]", events[-3:]
        for x in events:
            if x == "data: [DONE]":
                continue
            data = json.loads(x.removeprefix("data: "))
            if "error" in data:  # a timeout is the only failure allowed after a stream started
                raise AssertionError(f"in-band error: {data['error']}")
    else:
        json.loads(response.text)


@pytest.mark.parametrize("path,mode", CASES, ids=[f"{p}-{m.value}" for p, m in CASES])
def test_fuzzed_requests_never_get_a_5xx_and_4xx_are_well_formed(server, schema, path, mode):
    operation = schema[path]["GET" if path == "/v1/models" else "POST"]
    random = os.environ.get("TESSERA_FUZZ_RANDOM") == "1"
    statuses: Counter[int] = Counter()

    strategy = operation.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE and path != "/v1/models":
        strategy = strategy | strategy.map(plausible)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not random,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case):
        response = case.call(base_url=server.base_url, timeout=30)
        statuses[response.status_code] += 1
        try:
            check_response(response)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nrequest body: {case.body!r}") from None

    fuzz()
    print(f"{path} {mode.value}: {dict(statuses)}")
    if mode is GenerationMode.POSITIVE:
        assert statuses[200], f"no generated request was served: {dict(statuses)}"


def test_after_fuzzing_the_engine_is_healthy_idle_and_consistent(server):
    stats = server.wait_idle(timeout=30)
    assert server.engine.is_healthy
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0
    server.engine.engine.check_invariants()  # the engine thread is idle: nothing moves under us
    admission = server.app.state.admission
    assert admission.in_flight_seqs == 0 and admission.queued_tokens == 0
