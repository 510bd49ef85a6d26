"""Structured output and tool calls from `minfer serve` on the development model, via `openai`.

Slow: `response_format` json_schema returns JSON that validates against the schema; a tool
round trip (tools → tool_calls → tool message → final answer) works streamed and not, through
Qwen2.5's own chat template (arguments rendered with `tojson`, the result as <tool_response>).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_server_process import Server, serving

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

GREEDY: dict[str, Any] = {"temperature": 0.0}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
RESULT = '{"city": "Paris", "temperature_c": 21, "sky": "sunny"}'


@pytest.fixture(scope="module")
def server(real_model_path: Path) -> Iterator[Server]:
    with serving(real_model_path, "--slots", "2", "--n-ctx", "1024", "--chunk", "256",
                 timeout=600) as srv:
        yield srv


def test_json_schema_response_validates(server: Server) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    c = server.client()
    msgs = [{"role": "user", "content": "Describe Alice, who is 30 years old, as JSON."}]
    fmt: Any = {"type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = c.chat.completions.create(model="q", messages=msgs, max_tokens=48,
                                  response_format=fmt, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content or "")
    jsonschema.validate(value, PERSON)
    assert value["age"] == 30


def test_tool_round_trip(server: Server) -> None:
    c = server.client()
    r = c.chat.completions.create(model="q", messages=QUESTION, tools=[WEATHER],
                                  tool_choice="required", max_tokens=40, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tc,) = choice.message.tool_calls or []
    assert tc.function.name == "get_weather"
    assert "paris" in json.loads(tc.function.arguments)["city"].lower()
    msgs = [*QUESTION, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tc.id, "content": RESULT}]
    final = c.chat.completions.create(model="q", messages=msgs, tools=[WEATHER],
                                      max_tokens=40, **GREEDY)
    answer = final.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "21" in (answer.message.content or "")


def test_streamed_tool_round_trip(server: Server) -> None:
    c = server.client()
    stream = c.chat.completions.create(model="q", messages=QUESTION, tools=[WEATHER],
                                       tool_choice={"type": "function",
                                                    "function": {"name": "get_weather"}},
                                       max_tokens=40, stream=True, **GREEDY)
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            if d.function is not None:
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call["name"] == "get_weather" and call["id"]
    assert "paris" in json.loads(call["arguments"])["city"].lower()
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": call["name"], "arguments": call["arguments"]}}]}
    msgs = [*QUESTION, assistant, {"role": "tool", "tool_call_id": call["id"],
                                   "content": RESULT}]
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="q", messages=msgs, tools=[WEATHER], max_tokens=40, stream=True, **GREEDY)
        if ch.choices)
    assert "21" in text
