"""Anthropic's Messages API through the official `anthropic` client, in-process (ASGI) on the
tiny model's tokenizer and the fake engine.

The reply equals the OpenAI chat endpoint's for the same conversation (greedy), whole and
streamed (the stream's text deltas join to the whole text; every SSE frame names its event);
usage and stop reasons map (`end_turn`, `max_tokens`, `stop_sequence`, `tool_use`);
count_tokens equals the prompt; a forced tool comes back as a `tool_use` block with an input
object, and the round trip (`tool_use` → `tool_result`) is accepted; a reasoning model's
thinking is a `thinking` block; bad bodies are Anthropic error objects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import httpx2
import pytest

from minfer.server.app import create_app
from minfer.server.state import ServerState
from tests.test_server_app import CHAT, call, make_state, running

T = TypeVar("T")
MSG = [{"role": "user", "content": "Say hello"}]
WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}
TEMPLATES = Path(__file__).parent / "fixtures" / "templates"


@pytest.fixture(scope="module")
def state(tiny_qwen2: Path) -> Iterator[ServerState]:
    yield from running(tiny_qwen2, n_ctx=2048, slots=2)


def with_client(state: ServerState, fn: Callable[[anthropic.AsyncAnthropic], Awaitable[T]],
                **client: Any) -> T:
    async def go() -> T:
        # the SDK speaks through httpx2 (httpx's successor), which has the same ASGI transport
        transport = httpx2.ASGITransport(app=create_app(state, own_state=False))
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
            c = anthropic.AsyncAnthropic(base_url="http://test", http_client=http,
                                         api_key=client.pop("api_key", "unused"), max_retries=0)
            return await fn(c)

    return asyncio.run(go())


def openai_text(state: ServerState, **body: Any) -> dict[str, Any]:
    r = call(state, "POST", CHAT, json={"messages": MSG, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_create_equals_the_openai_reply(state: ServerState) -> None:
    msg = with_client(state, lambda c: c.messages.create(
        model="qwen2", max_tokens=12, messages=MSG, extra_body={"temperature": 0}))  # type: ignore[arg-type]
    ref = openai_text(state, max_tokens=12)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == ref["choices"][0]["message"]["content"]  # type: ignore[union-attr]
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == ref["usage"]["completion_tokens"] == 12


def test_consecutive_turns_of_one_role_are_combined(state: ServerState) -> None:
    """As Anthropic's API: consecutive user (or assistant) messages are one turn, their texts
    joined by newlines; the reply is the OpenAI reply to the combined conversation."""
    parts = [{"role": "user", "content": "Say"},
             {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    counted = with_client(state, lambda c: c.messages.count_tokens(
        model="qwen2", messages=parts))  # type: ignore[arg-type]
    msg = with_client(state, lambda c: c.messages.create(
        model="qwen2", max_tokens=8, messages=parts, extra_body={"temperature": 0}))  # type: ignore[arg-type]
    ref = openai_text(state, max_tokens=8, messages=[{"role": "user", "content": "Say\nhello"}])
    assert msg.content[0].text == ref["choices"][0]["message"]["content"]  # type: ignore[union-attr]
    assert counted.input_tokens == msg.usage.input_tokens == ref["usage"]["prompt_tokens"]
    bad = call(state, "POST", "/v1/messages", json={"model": "qwen2", "max_tokens": 4, "messages": [
        *parts, {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                "input": {}}]}]})
    assert bad.status_code == 400 and "messages.2.content.0" in bad.json()["error"]["message"]


def test_text_documents_reach_the_model_as_text(state: ServerState) -> None:
    """A document with a text (or content) source is its title, context and text, a blank line
    apart, in the turn's text; a PDF source is a 400 naming the source."""
    doc = {"type": "document", "title": "Notes", "source": {
        "type": "text", "media_type": "text/plain", "data": "The sky is green."}}
    content = {"type": "document", "context": "from a test", "source": {
        "type": "content", "content": [{"type": "text", "text": "Line one."},
                                       {"type": "text", "text": "Line two."}]}}
    messages = [{"role": "user", "content": [doc, content, {"type": "text", "text": "Color?"}]}]
    msg = with_client(state, lambda c: c.messages.create(
        model="qwen2", max_tokens=8, messages=messages, extra_body={"temperature": 0}))  # type: ignore[arg-type]
    text = "Notes\n\nThe sky is green.\nfrom a test\n\nLine one.\nLine two.\nColor?"
    ref = openai_text(state, max_tokens=8, messages=[{"role": "user", "content": text}])
    assert msg.content[0].text == ref["choices"][0]["message"]["content"]  # type: ignore[union-attr]
    assert msg.usage.input_tokens == ref["usage"]["prompt_tokens"]
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                          "data": "JVBERi0="}}
    body = {"model": "qwen2", "max_tokens": 4, "messages": [{"role": "user", "content": [pdf]}]}
    bad = call(state, "POST", "/v1/messages", json=body)
    assert bad.status_code == 400 and "'base64'" in bad.json()["error"]["message"]
    assert "messages.0.content.0" in bad.json()["error"]["message"]


def test_stream_events_join_to_the_whole_reply(state: ServerState) -> None:
    async def go(c: anthropic.AsyncAnthropic) -> tuple[list[str], str, Any]:
        kinds, text = [], ""
        async with c.messages.stream(model="qwen2", max_tokens=12, messages=MSG,  # type: ignore[arg-type]
                                     extra_body={"temperature": 0}) as stream:
            async for event in stream:
                kinds.append(event.type)
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    text += event.delta.text
            final = await stream.get_final_message()
        return kinds, text, final

    kinds, text, final = with_client(state, go)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert "message_delta" in kinds
    whole = openai_text(state, max_tokens=12)["choices"][0]["message"]["content"]
    assert text == whole == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    r = call(state, "POST", "/v1/messages", json={"model": "m", "max_tokens": 4, "messages": MSG,
                                                  "stream": True})
    frames = [f for f in r.text.split("\n\n") if f.strip()]
    assert frames and all(f.startswith("event: ") and "\ndata: " in f for f in frames)


def test_stop_sequence_and_count_tokens(state: ServerState) -> None:
    whole = openai_text(state, max_tokens=12)["choices"][0]["message"]["content"]
    stop = whole[3:6]
    msg = with_client(state, lambda c: c.messages.create(
        model="m", max_tokens=12, messages=MSG, extra_body={"temperature": 0},  # type: ignore[arg-type]
        stop_sequences=[stop]))
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == whole[:whole.index(stop)]  # type: ignore[union-attr]
    count = with_client(state, lambda c: c.messages.count_tokens(
        model="m", messages=MSG, system="Be brief."))  # type: ignore[arg-type]
    ref = openai_text(state, max_tokens=1, messages=[{"role": "system", "content": "Be brief."},
                                                     *MSG])
    assert count.input_tokens == ref["usage"]["prompt_tokens"]


def test_forced_tool_use_and_the_round_trip(state: ServerState) -> None:
    msg = with_client(state, lambda c: c.messages.create(
        model="m", max_tokens=300, messages=MSG, extra_body={"temperature": 0},  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}))
    assert msg.stop_reason == "tool_use"
    (block,) = [b for b in msg.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.input in ({"city": "Paris"}, {"city": "Rome"})
    follow = [*MSG, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                            "content": "22 degrees"}]}]
    again = with_client(state, lambda c: c.messages.create(
        model="m", max_tokens=4, messages=follow, tools=[WEATHER]))  # type: ignore[arg-type,list-item]
    assert again.stop_reason == "max_tokens" and again.content[0].type == "text"


def test_thinking_is_a_thinking_block(think_model: Callable[..., Path]) -> None:
    path = think_model("r1-distill-qwen")
    st = make_state(path, n_ctx=2048, slots=1)
    st.start()
    try:
        assert st.wait_ready(30)
        msg = with_client(st, lambda c: c.messages.create(
            model="m", max_tokens=12, messages=MSG, extra_body={"temperature": 0},  # type: ignore[arg-type]
            thinking={"type": "enabled", "budget_tokens": 3}))
        ref = openai_text(st, max_tokens=12, reasoning_budget=3)["choices"][0]["message"]
        kinds = [b.type for b in msg.content]
        assert kinds[0] == "thinking" and msg.content[0].thinking == ref["reasoning_content"]  # type: ignore[union-attr]
        assert "".join(b.text for b in msg.content if b.type == "text") == ref["content"]  # type: ignore[union-attr]
    finally:
        st.stop()


@pytest.mark.parametrize(("body", "fragment"), [
    ({"model": "m", "messages": MSG}, "max_tokens"),
    ({"model": "m", "max_tokens": 4, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     "takes no images"),
    ({"model": "m", "max_tokens": 4, "messages": MSG, "temperature": 1.5}, "temperature"),
    ({"model": "m", "max_tokens": 4, "messages": MSG, "tool_choice": {"type": "tool"}},
     "tool_choice"),
])
def test_bad_bodies_are_anthropic_errors(state: ServerState, body: dict[str, Any],
                                         fragment: str) -> None:
    r = call(state, "POST", "/v1/messages", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert fragment in err["error"]["message"]


def test_the_client_sees_its_error_type(state: ServerState) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        with_client(state, lambda c: c.messages.create(
            model="m", max_tokens=4, messages=[]))
    assert info.value.status_code == 400


def test_x_api_key_is_the_key(tiny_qwen2: Path) -> None:
    st = make_state(tiny_qwen2, api_key="sesame")
    st.start()
    try:
        assert st.wait_ready(30)
        msg = with_client(st, lambda c: c.messages.create(
            model="m", max_tokens=2, messages=MSG), api_key="sesame")  # type: ignore[arg-type]
        assert msg.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError):
            with_client(st, lambda c: c.messages.create(
                model="m", max_tokens=2, messages=MSG), api_key="wrong")  # type: ignore[arg-type]
    finally:
        st.stop()


def test_blocks_keep_the_order_written() -> None:
    """A reply cut off in its third call: text, two tool uses, then the unclosed block as text
    (where it was written, as the stream sends it)."""
    from minfer.server.anthropic.translate import content_blocks
    from minfer.server.output import OutputPlan

    call = '<tool_call>\n{"name": "f", "arguments": {"x": %d}}\n</tool_call>\n'
    cut = '<tool_call>\n{"name": "f", "argu'
    blocks = content_blocks(OutputPlan(tools=[{}]).reply("Looking.\n" + call % 1 + call % 2 + cut,
                                                         "length"))
    assert [(b["type"], b.get("text") or b.get("input")) for b in blocks] == [
        ("text", "Looking."), ("tool_use", {"x": 1}), ("tool_use", {"x": 2}), ("text", cut)]
