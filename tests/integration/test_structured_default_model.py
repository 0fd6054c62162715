"""Structured outputs and tools with the official `openai` client against a real `tessera serve`
subprocess on the default model (SmolLM2-135M-Instruct): parse() with a nested Pydantic model,
a streamed tool call whose pieces assemble into valid arguments, and tool_choice="required"."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.load.harness import MODEL, ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    age: int
    address: Address


@pytest.fixture(scope="module")
def client(default_model_path):
    with ServerProcess(default_model_path, "--dtype", "auto", "--max-model-len", "2048") as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_returns_a_nested_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, temperature=0.0, max_tokens=120, response_format=Person,
        messages=[{"role": "user", "content": "John Smith is 42 years old and lives in Paris, France. "
                                              "Give his name, age and address as JSON."}])
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)


def test_streamed_tool_call_assembles_into_valid_arguments(client):
    stream = client.chat.completions.create(
        model=MODEL, temperature=0.0, max_tokens=100, stream=True, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What is the weather in Rome in celsius?"}])
    name, arguments, finish = "", "", None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            name += d.function.name or ""
            arguments += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_tool_choice_required_yields_a_call(client):
    r = client.chat.completions.create(
        model=MODEL, temperature=0.0, max_tokens=100, tools=[WEATHER], tool_choice="required",
        messages=[{"role": "user", "content": "Is it raining in Oslo?"}])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
