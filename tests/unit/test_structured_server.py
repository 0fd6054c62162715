"""Structured outputs and tool calls through the server, with the official `openai` client, on
the tiny random model (validity is the mask's property, checked with jsonschema): response_format,
vLLM's structured_outputs field, tools with tool_choice required / named / auto, streamed tool
calls, and the 400s for constraints that cannot work."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tessera.server.app import create_app
from tessera.structured.tool_parsers import HermesToolParser, Llama3JsonToolParser, StreamingToolCalls
from tessera.structured.tools import plan_tools, tool_constraint
from tests.unit.test_server import MODEL, ServerThread, engine_config

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                       "required": ["tz"]}}}
# vLLM's option next to response_format / tools: no whitespace between JSON tokens, so that a
# random model's outputs stay short.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


class Address(BaseModel):
    city: Literal["Paris", "Rome"]
    zip: str = Field(pattern=r"^[0-9]{4}$")


class Person(BaseModel):
    age: int = Field(ge=0, le=120)
    address: Address
    tags: list[Literal["a", "b"]] = Field(min_length=1, max_length=3)


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    # The tools system block is ~900 byte-level tokens of the tiny vocabulary: a longer context.
    config = dataclasses.replace(engine_config(tiny_model_factory(max_position_embeddings=2048)), max_model_len=2048)
    with ServerThread(create_app(config, served_model_name=MODEL)) as srv:
        yield srv


def ask(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 200,
            "extra_body": COMPACT, **kw}


def test_parse_with_a_nested_pydantic_model(server):
    client = server.client()
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=4, n=3)):
        completion = client.chat.completions.parse(response_format=Person, **ask(**kw))
        for choice in completion.choices:
            assert choice.finish_reason == "stop", choice.message.content
            assert isinstance(choice.message.parsed, Person)


def test_json_schema_json_object_and_extra_field_regex_choice(server):
    client = server.client()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}},
              "required": ["n"]}
    r = client.chat.completions.create(**ask(temperature=0.9, seed=1, n=4, response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}))
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    r = client.chat.completions.create(**{**ask(temperature=0.0, max_tokens=40),
                                          "extra_body": {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}})
    assert len(r.choices[0].message.content) == 6 and r.choices[0].message.content[3] == "-"
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0, n=5, seed=2,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert {c.text for c in r.choices} <= {"red", "green", "blue"}
    r = client.chat.completions.create(**ask(temperature=1.0, seed=5, max_tokens=200),
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_tool_choice_required_always_yields_calls(server):
    client = server.client()
    for parallel in (True, False):
        r = client.chat.completions.create(**ask(temperature=1.0, seed=7, n=4, max_tokens=800), tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=parallel)
        for c in r.choices:
            assert c.finish_reason == "tool_calls"
            calls = c.message.tool_calls
            assert calls and (parallel or len(calls) == 1)
            for call in calls:
                tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
                jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_assembles_into_valid_arguments(server, tool_choice):
    stream = server.client().chat.completions.create(**ask(temperature=0.8, seed=3), tools=[WEATHER, TIME],
                                                     tool_choice=tool_choice, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            call["id"] = call["id"] or d.id
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"]
        tool = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]
        jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
    if isinstance(tool_choice, dict):
        assert [c["name"] for c in calls.values()] == ["get_weather"]


def test_tool_messages_render_in_hermes_format(server):
    # The tiny model's ChatML template ignores tools: the server writes the Hermes system block,
    # earlier calls as <tool_call> blocks and results as <tool_response>.
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Rome", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = httpx.post(server.base_url + "/v1/chat/completions", json=dict(model=MODEL, messages=messages, max_tokens=3,
                                                                       tools=[WEATHER]))
    assert r.status_code == 200, r.text
    from tessera.structured.tools import render_chat

    text = render_chat(server.engine.tokenizer.hf, [dict(m) for m in messages], plan_tools([WEATHER], None, None),
                       HermesToolParser(), True)
    assert "<tools>" in text and '"get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


@pytest.mark.parametrize("body, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     "response_format", "nope"),
    (dict(structured_outputs={"regex": "(ab"}), "structured_outputs", "parenthesis"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
    (dict(structured_outputs={"jsn": {}}), "structured_outputs", "unknown field"),
    (dict(response_format={"type": "xml"}), "response_format", "xml"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice",
     "get_time"),
    (dict(tool_choice="required"), "tool_choice", "tools"),
    (dict(tools=[{"type": "function", "function": {}}]), "tools", "name"),
    (dict(response_format={"type": "json_object"}, tools=[WEATHER], tool_choice="required"), "tool_choice",
     "only one"),
])
def test_bad_constraints_get_a_400_naming_the_problem(server, body, param, words):
    for stream in (False, True):
        r = httpx.post(server.base_url + "/v1/chat/completions",
                       json=dict(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=stream, **body))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
    assert server.wait_idle().num_running == 0


def test_unsatisfiable_within_max_tokens_ends_with_length(server):
    r = server.client().chat.completions.create(**{**ask(max_tokens=4), "extra_body": {"structured_outputs": {
        "regex": "z{30}"}}})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == "zzzz"


def test_openai_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="get_time"):
        server.client().chat.completions.create(**ask(), tools=[WEATHER],
                                                tool_choice={"type": "function", "function": {"name": "get_time"}})


# ---- parsers, without a server -----------------------------------------------------------------


def test_hermes_and_llama3_parsers():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = HermesToolParser().parse(text)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert HermesToolParser().parse("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    content, calls = Llama3JsonToolParser().parse('<|python_tag|>{"name": "f", "parameters": {"a": "b"}}; {"name": "g", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": "b"}), ("g", {})]
    assert Llama3JsonToolParser().parse("plain answer") == ("plain answer", [])


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), 'Let me check. <tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call>'),
    (Llama3JsonToolParser(), '  {"name": "f", "parameters": {"x": [1, 2]}}'),
    (HermesToolParser(), "No tools needed: a < b and <tool is not a call."),
])
def test_streaming_tool_calls_equal_the_whole_text_parse(parser, text):
    for size in (1, 3, 7):
        stream = StreamingToolCalls(parser)
        content = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
        rest, calls = stream.finish()
        content += rest
        want_content, want_calls = parser.parse(text)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]
        if want_calls:
            assert content.strip() == (want_content or "")
        else:
            assert content == text


def test_required_schema_validates_exactly_the_calls():
    schema = tool_constraint(plan_tools([WEATHER, TIME], "required", False)).json
    jsonschema.validate([{"name": "get_time", "parameters": {"tz": "UTC"}}], schema)
    for bad in ([], [{"name": "get_time", "parameters": {"tz": "UTC"}}] * 2,
                [{"name": "get_time", "parameters": {"city": "Rome", "days": 2}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize("call", [{}, {"type": "function"}, {"function": {"arguments": "{}"}},
                                  {"function": {"name": "f", "arguments": {"a": 1}}}, "not a call"])
def test_a_malformed_earlier_tool_call_is_a_400_not_a_500(server, call):
    # Found by the schemathesis fuzzer (test_api_fuzz.py): a tool_calls entry without a function
    # used to raise KeyError('function') in the chat rendering.
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "ok", "tool_call_id": "1"}]
    r = httpx.post(server.base_url + "/v1/chat/completions", json=dict(model=MODEL, messages=messages, max_tokens=2))
    assert r.status_code == 400, r.text
    assert "tool_calls" in r.json()["error"]["message"]
