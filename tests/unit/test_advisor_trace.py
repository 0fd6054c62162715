"""Workload traces: the JSONL round trip, its errors, the synthetic shapes, and the server's recorder."""

from __future__ import annotations

import json

import pytest

from tessera.advisor.trace import SHAPES, TraceRecorder, TraceRequest, read_trace, synthesize, write_trace
from tessera.outputs import CompletionOutput, RequestOutput
from tessera.sampling import SamplingParams


def test_round_trip_keeps_every_field_and_sorts_by_arrival(tmp_path):
    reqs = [
        TraceRequest(arrival_time=2.5, prompt="hello", max_tokens=8, sampling={"temperature": 0.5, "seed": 3}),
        TraceRequest(arrival_time=1.0, prompt_token_ids=[5, 6, 7], max_tokens=4, output_token_ids=[1, 2],
                     id="a", session="s1"),
        TraceRequest(arrival_time=1.5, messages=[{"role": "user", "content": "hi"}], max_tokens=None),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, reqs)
    back = read_trace(path)
    assert [r.arrival_time for r in back] == [0.0, 0.5, 1.5]  # sorted, shifted to start at 0
    assert back[0].prompt_token_ids == [5, 6, 7] and back[0].output_token_ids == [1, 2] and back[0].session == "s1"
    assert back[1].messages == [{"role": "user", "content": "hi"}] and back[1].max_tokens is None
    assert back[2].prompt == "hello" and back[2].sampling == {"temperature": 0.5, "seed": 3}
    params = back[2].sampling_params()
    assert (params.max_tokens, params.temperature, params.seed) == (8, 0.5, 3)


@pytest.mark.parametrize("line, message", [
    ({"arrival_time": 0, "prompt": "a", "prompt_token_ids": [1]}, "exactly one of"),
    ({"arrival_time": 0}, "exactly one of"),
    ({"prompt": "a"}, "needs arrival_time"),
    ({"arrival_time": 0, "prompt": "a", "temprature": 1.0}, "unknown sampling parameter"),
])
def test_bad_lines_name_the_line_and_the_problem(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"arrival_time": 0, "prompt": "fine"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{message}"):
        read_trace(path)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_is_well_formed(shape):
    trace = synthesize(shape, num_requests=20, rate=10.0, seed=1, vocab_size=300, length_scale=0.25)
    assert len(trace) == 20
    assert [r.arrival_time for r in trace] == sorted(r.arrival_time for r in trace)
    for r in trace:
        assert all(0 <= t < 300 for t in r.prompt_token_ids + r.output_token_ids)
        assert r.max_tokens == len(r.output_token_ids)


def test_chatbot_prompts_share_a_90_percent_prefix():
    trace = synthesize("chatbot", num_requests=10, seed=2)
    shared = 360
    assert all(r.prompt_token_ids[:shared] == trace[0].prompt_token_ids[:shared] for r in trace)
    fractions = [shared / len(r.prompt_token_ids) for r in trace]
    assert 0.85 < sum(fractions) / len(fractions) < 0.95


def test_code_edit_outputs_copy_the_prompt_and_bursts_arrive_together():
    for r in synthesize("code_edit", num_requests=5, seed=3):
        code = r.prompt_token_ids[24:]
        same = sum(a == b for a, b in zip(code, r.output_token_ids, strict=True))
        assert same >= len(code) - 12  # three edits of four tokens at most
    arrivals = [r.arrival_time for r in synthesize("bursty", num_requests=40, seed=4)]
    assert len(set(arrivals)) <= 5  # bursts of 8-16 at one instant


def test_multiturn_turns_extend_the_conversation():
    trace = synthesize("multiturn", num_requests=8, rate=2.0, seed=5)
    by_session: dict[str, list[TraceRequest]] = {}
    for r in trace:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        for prev, nxt in zip(turns, turns[1:], strict=False):
            history = prev.prompt_token_ids + prev.output_token_ids
            assert nxt.prompt_token_ids[: len(history)] == history and nxt.arrival_time > prev.arrival_time


def test_recorder_writes_a_line_when_a_request_ends(tmp_path):
    path = tmp_path / "rec.jsonl"
    rec = TraceRecorder(path)
    t0 = rec._start
    rec.record_add("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0), t0 + 0.5)
    rec.record_add("b", "text prompt", SamplingParams(max_tokens=7), t0 + 1.0)
    rec.record_add("c", [4], SamplingParams(), t0 + 1.5)
    rec.forget("c")  # refused by the engine
    out = RequestOutput("a", None, [1, 2, 3], [CompletionOutput(0, "", [9, 8], finish_reason="length")], finished=True)
    rec.on_step([out], None, 0.0)
    rec.on_abort(["b", "c"], 0.0)
    rec.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"arrival_time": 0.5, "prompt_token_ids": [1, 2, 3], "max_tokens": 5, "temperature": 0.0,
         "output_token_ids": [9, 8], "id": "a"},
        {"arrival_time": 1.0, "prompt": "text prompt", "max_tokens": 7, "id": "b"},
    ]
    assert [r.id for r in read_trace(path)] == ["a", "b"]
