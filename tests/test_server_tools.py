"""Tool calls through the HTTP app in-process (tiny model's tokenizer, fake engine).

A forced tool_choice (a named function, or `required`) is grammar-constrained, so even random
logits write a call that parses and matches the parameter schema: `message.tool_calls`, content
null, finish_reason "tool_calls"; streamed as `delta.tool_calls` whose joined arguments equal the
whole response's. Bad tool lists and choices are 400s; assistant tool calls in the request reach
the template with their arguments as objects.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from minfer.sampling.tool_calls import (
    history_as_text,
    history_for,
    parse_tool_calls,
    tools_as_text,
)
from minfer.server.output import template_messages
from minfer.server.schemas import ChatMessage
from minfer.server.state import ServerState
from tests.test_server_app import CHAT, HELLO, call, make_state, running, sse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
        "required": ["city", "celsius"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
FORCED = {"messages": HELLO, "tools": [WEATHER, TIME], "max_tokens": 300, "temperature": 0,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
          "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def state(tiny_qwen2: Path) -> Iterator[ServerState]:
    yield from running(tiny_qwen2, n_ctx=2048, slots=2)


def check_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert args["city"] in ("Paris", "Rome") and isinstance(args["celsius"], bool)
    assert set(args) == {"city", "celsius"}


def test_forced_named_call_returns_tool_calls(state: ServerState) -> None:
    r = call(state, "POST", CHAT, json=FORCED)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["role"] == "assistant" and msg["content"] is None
    (tc,) = msg["tool_calls"]
    assert tc["type"] == "function" and tc["id"].startswith("call_")
    assert tc["function"]["name"] == "get_weather"
    check_weather_args(tc["function"]["arguments"])


def test_a_forced_call_is_one_call_unless_parallel_calls_are_asked(state: ServerState) -> None:
    """As llama-server: without `parallel_tool_calls: true` the forcing grammar ends after one
    call (a small model otherwise writes it again until max_tokens); with it, more may follow."""
    body = {k: v for k, v in FORCED.items() if k != "parallel_tool_calls"}
    (choice,) = call(state, "POST", CHAT, json=body).json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    from minfer.server.output import _tools
    from minfer.server.schemas import ChatCompletionRequest

    one = _tools(ChatCompletionRequest(**body))[1]
    assert one == _tools(ChatCompletionRequest(**FORCED))[1]
    several = _tools(ChatCompletionRequest(**{**body, "parallel_tool_calls": True}))[1]
    assert several is not None and one is not None and several != one


def test_forced_call_streams_tool_call_deltas(state: ServerState) -> None:
    whole = call(state, "POST", CHAT, json=FORCED).json()["choices"][0]["message"]
    chunks = sse(call(state, "POST", CHAT, json={**FORCED, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    first = calls[0][0]
    assert first["index"] == 0 and first["id"].startswith("call_")
    assert first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert all(c[0]["index"] == 0 and set(c[0]) == {"index", "function"} for c in calls[1:])
    arguments = "".join(c[0]["function"]["arguments"] for c in calls)
    assert arguments == whole["tool_calls"][0]["function"]["arguments"]
    check_weather_args(arguments)
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_required_calls_one_of_the_tools(state: ServerState) -> None:
    body = {**FORCED, "tool_choice": "required", "messages": [{"role": "user", "content": "?"}]}
    r = call(state, "POST", CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"]["name"] in ("get_weather", "get_time")
    assert isinstance(json.loads(tc["function"]["arguments"]), dict)


def test_auto_and_none_leave_free_text(state: ServerState) -> None:
    for choice in ("auto", "none"):
        r = call(state, "POST", CHAT, json={**FORCED, "tool_choice": choice, "max_tokens": 8})
        assert r.status_code == 200, r.text
        body = r.json()["choices"][0]
        assert body["finish_reason"] == "length" and "tool_calls" not in body["message"]
        assert isinstance(body["message"]["content"], str)


# a template that writes no tool history and alternates its roles strictly, as Gemma's does
STRICT = ("{%- for m in messages %}{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{- raise_exception('roles must alternate user/assistant') }}{%- endif %}"
          "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")
HELLO_TEXT = HELLO[0]["content"]
TWO_CALLS = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                  "arguments": '{"city": "Paris"}'}},
    {"id": "c2", "type": "function", "function": {"name": "get_time",
                                                  "arguments": '{"zone": "UTC"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"}]


def test_history_as_text_writes_calls_and_results_as_the_parser_reads_them() -> None:
    msgs = template_messages([ChatMessage.model_validate(m) for m in TWO_CALLS])
    user, assistant, results = history_as_text(msgs)
    assert user == msgs[0] and "tool_calls" not in assistant
    content, calls = parse_tool_calls(assistant["content"])
    assert content == "" and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                              for c in calls] == [("get_weather", {"city": "Paris"}),
                                                  ("get_time", {"zone": "UTC"})]
    assert results == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n"
                                                  "<tool_response>\n12:00\n</tool_response>"}
    assert history_as_text(msgs[:1]) == msgs[:1]
    *_, joined = history_as_text([*msgs, {"role": "user", "content": "Summarize."}])
    assert joined["role"] == "user" and joined["content"].endswith("</tool_response>\nSummarize.")


@pytest.mark.parametrize("template", [None, STRICT])
def test_a_template_without_tool_history_gets_it_as_text(tmp_path: Path,
                                                         template: str | None) -> None:
    """Plain ChatML and a strictly alternating template (Gemma's kind) write no tool_calls:
    a call-only message (content null) and two results still render, as text, and generate
    (before, the null content was a template error, a 400)."""
    from minfer.tools.synth import write_tiny_model

    path = write_tiny_model(tmp_path / "plain.gguf",
                            **({} if template is None else {"chat_template": template}))
    st = make_state(path, n_ctx=2048, slots=1)
    st.start()
    try:
        assert st.wait_ready(30)
        prompt = call(st, "POST", "/apply-template", json={"messages": TWO_CALLS}).json()["prompt"]
        assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather"' in prompt
        assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>" \
            in prompt and "<|im_start|>tool" not in prompt
        r = call(st, "POST", CHAT, json={"messages": TWO_CALLS, "tools": [WEATHER, TIME],
                                         "max_tokens": 4})
        assert r.status_code == 200, r.text
        with_tools = call(st, "POST", "/apply-template",
                          json={"messages": TWO_CALLS, "tools": [WEATHER, TIME]}).json()["prompt"]
        described = tools_as_text([WEATHER, TIME])
        assert described in with_tools and with_tools.endswith(prompt.split(HELLO_TEXT, 1)[1])
        first_turn = ("<|im_start|>system\n" + described + "<|im_end|>\n<|im_start|>user\n"
                      if template is None else "<|im_start|>user\n" + described + "\n\n")
        assert with_tools.startswith(first_turn + HELLO_TEXT)
    finally:
        st.stop()


def test_tools_are_described_where_the_template_never_reads_them() -> None:
    """Each tool's signature (as the request gave it) and the <tool_call> form, at the end of
    the system message; a template that reads `tools` gets the messages untouched."""
    tools = [WEATHER, TIME]
    text = tools_as_text(tools)
    assert text.count("\n{\"type\": \"function\"") == 2 and "<tool_call>" in text
    for tool in tools:
        assert json.dumps(tool) in text
    system = [{"role": "system", "content": "Be brief."}, *HELLO]
    assert history_for(system, "", {"messages"}, tools)[0] == {
        "role": "system", "content": "Be brief.\n\n" + text}
    assert history_for(system, "", {"messages", "tools"}, tools) == system
    assert history_for(system, "", {"messages"}, None) == system


def test_the_python_api_renders_the_same_tool_history(tmp_path: Path) -> None:
    """`Model.render_chat` writes a tool history as the server does, for arguments given as
    JSON text (the API's form) or as objects."""
    import minfer
    from minfer.tools.synth import write_tiny_model

    path = write_tiny_model(tmp_path / "plain.gguf")
    model = minfer.load(path)
    st = make_state(path, n_ctx=2048, slots=1)
    st.start()
    try:
        assert st.wait_ready(30)
        served = call(st, "POST", "/apply-template", json={"messages": TWO_CALLS}).json()["prompt"]
        with_tools = call(st, "POST", "/apply-template",
                          json={"messages": TWO_CALLS, "tools": [WEATHER]}).json()["prompt"]
    finally:
        st.stop()
    assert model.render_chat(TWO_CALLS) == served
    assert model.render_chat(TWO_CALLS, tools=[WEATHER]) == with_tools != served
    as_objects = json.loads(json.dumps(TWO_CALLS))
    for c in as_objects[1]["tool_calls"]:
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    assert model.render_chat(as_objects) == served


def test_a_template_that_writes_tool_calls_gets_them_as_they_are(
        think_model: Callable[..., Path]) -> None:
    """Qwen3's template writes calls and results itself: its messages are not rewritten."""
    from minfer.gguf.reader import GGUFFile
    from minfer.tokenizer.chat import ChatTemplate
    from minfer.tokenizer.tokenizer import Tokenizer

    path = think_model("qwen3")
    st = make_state(path, n_ctx=2048, slots=1)
    st.start()
    try:
        assert st.wait_ready(30)
        prompt = call(st, "POST", "/apply-template", json={"messages": TWO_CALLS}).json()["prompt"]
        f = GGUFFile.open(path)
        template = ChatTemplate.from_gguf(f, Tokenizer.from_gguf(f))
        msgs = [ChatMessage.model_validate(m) for m in TWO_CALLS]
        assert prompt == template.render(template_messages(msgs))
    finally:
        st.stop()


def test_a_tool_round_trip_request_is_accepted(state: ServerState) -> None:
    call_ = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [*HELLO, {"role": "assistant", "content": "", "tool_calls": [call_]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = call(state, "POST", CHAT, json={"messages": msgs, "tools": [WEATHER], "max_tokens": 4})
    assert r.status_code == 200, r.text


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "unknown function"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "at least one tool"),
    ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "a tool must be"),
    ({"response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": 7}}}]}, "tool_choice", "type"),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD)
def test_bad_tools_are_a_400(state: ServerState, extra: dict[str, Any], param: str,
                             words: str) -> None:
    r = call(state, "POST", CHAT, json={**FORCED, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]


def test_bad_tool_call_arguments_in_a_message_are_a_400(state: ServerState) -> None:
    bad = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    msgs = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [bad]}]
    r = call(state, "POST", CHAT, json={"messages": msgs, "max_tokens": 4})
    assert r.status_code == 400
    assert "arguments is not valid JSON" in r.json()["error"]["message"]


def test_template_messages_turn_arguments_into_objects() -> None:
    msg = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": '{"a": [1, 2]}'}},
        {"id": "c2", "function": {"name": "g", "arguments": {"b": 1}}}])
    (out,) = template_messages([msg])
    assert out["tool_calls"][0]["function"]["arguments"] == {"a": [1, 2]}
    assert out["tool_calls"][1]["function"] == {"name": "g", "arguments": {"b": 1}}
    assert out["tool_calls"][1]["type"] == "function"
