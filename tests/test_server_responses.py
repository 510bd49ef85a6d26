"""OpenAI's Responses API (`POST /v1/responses`) through the official `openai` client,
in-process (ASGI) on the tiny model and the fake engine.

Whole and streamed (the events in OpenAI's order, their deltas joining to the whole output,
sequence numbers counting up), each equal to `/v1/chat/completions`' greedy reply to the same
conversation; instructions and message items; a forced function tool as a `function_call` item
(and its argument deltas); a tool round trip in the input (function_call /
function_call_output items) rendered as the chat request's tool turns; `text.format` JSON;
`max_output_tokens` reached is `incomplete`; what this server cannot do is a 400 naming the
field (stored responses, an image for a text-only model, files, non-function tools).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import openai
import pytest

from minfer.server.app import create_app
from minfer.server.state import ServerState
from tests.test_server_app import CHAT, call, running
from tests.test_server_tools import WEATHER, check_weather_args

T = TypeVar("T")
RESP = "/v1/responses"
TOOL = {"type": "function", **WEATHER["function"]}  # Responses' flat function tool


@pytest.fixture(scope="module")
def state(tiny_qwen2: Path) -> Iterator[ServerState]:
    yield from running(tiny_qwen2, n_ctx=2048, slots=2)


def with_client(state: ServerState, fn: Callable[[openai.AsyncOpenAI], Awaitable[T]]) -> T:
    async def go() -> T:
        transport = httpx2.ASGITransport(app=create_app(state, own_state=False))
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
            return await fn(openai.AsyncOpenAI(base_url="http://test/v1", api_key="x",
                                               http_client=http, max_retries=0))

    return asyncio.run(go())


def chat(state: ServerState, messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    r = call(state, "POST", CHAT, json={"messages": messages, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_response_is_the_chat_reply_of_the_same_conversation(state: ServerState) -> None:
    ref = chat(state, [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Say hello"}], max_tokens=8)
    got = with_client(state, lambda c: c.responses.create(
        model="m", instructions="Be brief.", input="Say hello", max_output_tokens=8,
        temperature=0))
    assert got.object == "response" and got.id.startswith("resp_")
    (item,) = got.output
    assert item.type == "message" and item.role == "assistant"
    assert got.output_text == ref["choices"][0]["message"]["content"]
    assert got.usage is not None
    assert got.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert got.usage.output_tokens == ref["usage"]["completion_tokens"] == 8
    assert got.status == "incomplete" and got.incomplete_details is not None
    assert got.incomplete_details.reason == "max_output_tokens"
    items = with_client(state, lambda c: c.responses.create(
        model="m", instructions="Be brief.", max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello"}]}]))
    assert items.output_text == got.output_text


def test_a_stream_sends_openais_events_joining_to_the_whole_output(state: ServerState) -> None:
    body = {"model": "m", "input": "Say hello", "max_output_tokens": 10, "temperature": 0}
    whole = with_client(state, lambda c: c.responses.create(**body))

    async def events(c: openai.AsyncOpenAI) -> list[Any]:
        stream = await c.responses.create(**body, stream=True)
        return [e async for e in stream]

    got = with_client(state, events)
    kinds = [e.type for e in got]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in got] == list(range(len(got)))
    text = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    assert text == whole.output_text == got[-4].text
    final = got[-1].response
    assert final.output_text == text and final.usage.output_tokens == 10


def test_a_forced_function_tool_is_a_function_call_item(state: ServerState) -> None:
    body = {"model": "m", "input": "Weather?", "tools": [TOOL], "temperature": 0,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 300, "parallel_tool_calls": False}
    got = with_client(state, lambda c: c.responses.create(**body))
    assert got.status == "completed"
    (call_item,) = [o for o in got.output if o.type == "function_call"]
    assert call_item.name == "get_weather" and call_item.call_id.startswith("call_")
    check_weather_args(call_item.arguments)

    async def events(c: openai.AsyncOpenAI) -> list[Any]:
        stream = await c.responses.create(**body, stream=True)
        return [e async for e in stream]

    streamed = with_client(state, events)
    args = "".join(e.delta for e in streamed
                   if e.type == "response.function_call_arguments.delta")
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == args == call_item.arguments


def test_a_tool_round_trip_renders_as_the_chat_requests_tool_turns(state: ServerState) -> None:
    args = json.dumps({"city": "Paris", "celsius": True})
    ref = chat(state, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21C"}],
        tools=[WEATHER], max_tokens=6)
    got = with_client(state, lambda c: c.responses.create(
        model="m", tools=[TOOL], max_output_tokens=6, temperature=0, input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": args},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21C"}]))
    assert got.usage is not None and got.usage.input_tokens == ref["usage"]["prompt_tokens"]


def test_text_format_json_schema_constrains_the_output(state: ServerState) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    got = with_client(state, lambda c: c.responses.create(
        model="m", input="A number", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "num", "schema": schema}}))
    assert got.status == "completed"
    assert isinstance(json.loads(got.output_text)["n"], int)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "messages"),  # a text-only model: the image is refused where the prompt is read
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input.0.content.0.image_url"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
])
def test_what_cannot_be_done_is_a_400_naming_the_field(state: ServerState, body: dict[str, Any],
                                                       param: str) -> None:
    r = call(state, "POST", RESP, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert state.model().worker.scheduler.n_busy == 0


def test_thinking_comes_first_as_a_reasoning_item() -> None:
    from minfer.server.output import Reply
    from minfer.server.responses.translate import ItemEvents, output_items

    ev = ItemEvents()
    events = ev.push([{"reasoning_content": "hm"}, {"reasoning_content": "m"},
                      {"content": "Hi"}]) + ev.finish()
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    reasoning, message = ev.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert message["content"][0]["text"] == "Hi"
    assert [e["output_index"] for e in events if "output_index" in e] == [0] * 5 + [1] * 6
    whole = output_items(Reply("hmm", ["Hi"], "stop"))
    assert [i["type"] for i in whole] == ["reasoning", "message"]
    assert whole[0]["content"] == reasoning["content"]


def test_texts_and_calls_keep_the_order_written() -> None:
    """A reply cut off in its third call: the two calls, then the unclosed block as a message
    (last, where it was written); a reply without calls is one message, even empty."""
    from minfer.server.output import OutputPlan
    from minfer.server.responses.translate import output_items

    call = '<tool_call>\n{"name": "f", "arguments": {"x": %d}}\n</tool_call>\n'
    text = "Let me look.\n" + call % 1 + call % 2 + '<tool_call>\n{"name": "f", "argu'
    reply = OutputPlan(tools=[{}]).reply(text, "length")
    items = output_items(reply)
    assert [i["type"] for i in items] == ["message", "function_call", "function_call", "message"]
    assert items[0]["content"][0]["text"] == "Let me look."
    assert [i["arguments"] for i in items[1:3]] == ['{"x": 1}', '{"x": 2}']
    assert items[3]["content"][0]["text"] == '<tool_call>\n{"name": "f", "argu'
    assert reply.finish == "length" and reply.fields()["content"] == (
        "Let me look.\n\n\n" + '<tool_call>\n{"name": "f", "argu')
    assert [i["type"] for i in output_items(OutputPlan(tools=[{}]).reply("", "stop"))] == [
        "message"]


def test_previous_response_id_continues_a_stored_conversation(state: ServerState) -> None:
    """A stored response's input and output come before the next input (its instructions do
    not, as OpenAI's do not): the chat reply to the whole conversation. GET reads a stored
    response back, DELETE drops it; `store: false` keeps nothing; an unknown id is a 404."""
    first = with_client(state, lambda c: c.responses.create(
        model="m", instructions="Be brief.", input="Say hello", max_output_tokens=6,
        temperature=0))
    second = with_client(state, lambda c: c.responses.create(
        model="m", previous_response_id=first.id, input="Again", max_output_tokens=6,
        temperature=0))
    ref = chat(state, [{"role": "user", "content": "Say hello"},
                       {"role": "assistant", "content": first.output_text},
                       {"role": "user", "content": "Again"}], max_tokens=6)
    assert second.output_text == ref["choices"][0]["message"]["content"]
    assert second.usage is not None
    assert second.usage.input_tokens == ref["usage"]["prompt_tokens"]
    third = with_client(state, lambda c: c.responses.create(  # a chain of three, streamed
        model="m", previous_response_id=second.id, input="Once more", max_output_tokens=6,
        temperature=0, stream=True))
    assert third is not None
    got = with_client(state, lambda c: c.responses.retrieve(second.id))
    assert got.id == second.id and got.output_text == second.output_text
    unstored = with_client(state, lambda c: c.responses.create(
        model="m", input="Say hello", max_output_tokens=2, store=False))
    r = call(state, "GET", f"{RESP}/{unstored.id}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = call(state, "POST", RESP, json={"input": "x", "previous_response_id": unstored.id})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "previous_response_id"
    assert call(state, "DELETE", f"{RESP}/{first.id}").json()["deleted"] is True
    assert call(state, "GET", f"{RESP}/{first.id}").status_code == 404
    assert call(state, "DELETE", f"{RESP}/{first.id}").status_code == 404
    r = call(state, "POST", RESP, json={"input": "x", "previous_response_id": second.id,
                                        "max_output_tokens": 2})
    assert r.status_code == 200  # second keeps its own copy of the conversation


def test_the_store_keeps_the_last_responses() -> None:
    from minfer.server.errors import APIError
    from minfer.server.responses.store import ResponseStore

    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put({"id": f"r{i}", "output": []}, [])
    store.get("r1")
    store.put({"id": "r3", "output": []}, [])  # r2 was used least recently
    with pytest.raises(APIError):
        store.get("r2")
    assert store.get("r1").response["id"] == "r1" and store.get("r3")


def test_a_chain_named_by_the_front_is_kept_along_the_conversation(state: ServerState) -> None:
    """Behind Ray's front (which routes a chain to one replica) a new response's id starts with
    the chain the front names; a continuation's id keeps its previous response's chain."""
    chain = "00112233445566aa"
    r = call(state, "POST", RESP, json={"input": "Say hello", "max_output_tokens": 2},
             headers={"x-minfer-response-chain": chain})
    first = r.json()["id"]
    assert first.startswith("resp_" + chain)
    r = call(state, "POST", RESP, json={"input": "Again", "max_output_tokens": 2,
                                        "previous_response_id": first})
    assert r.status_code == 200 and r.json()["id"].startswith("resp_" + chain)
    assert r.json()["id"] != first
