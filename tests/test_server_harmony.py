"""gpt-oss's harmony replies through the HTTP app in-process, with the official openai,
anthropic and ollama clients: a tiny model whose vocabulary has the harmony tokens, the gpt-oss
chat template, and a fake engine that writes a scripted reply token by token.

`<|end|>` closes a message without ending the reply; `<|return|>` and `<|call|>` end it. The
reply's analysis is the reasoning (`reasoning_content`, a `reasoning` item, a `thinking` block,
Ollama's `thinking`), its final message the content, a commentary call to an offered function
the tool call; whole and streamed alike. A broken channel header is content. The reasoning
effort each API names reaches the template.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import httpx
import httpx2
import numpy as np
import ollama
import openai
import pytest

from minfer.engine.config import EngineConfig
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.server.app import create_app
from minfer.server.state import ServerConfig, ServerState
from minfer.tokenizer.tokenizer import Tokenizer
from minfer.tools.synth import build_tiny_vocab, write_tiny_model
from tests.fake_engine import HashEngine

T = TypeVar("T")
TEMPLATE = Path(__file__).parent / "fixtures" / "templates" / "gpt-oss.jinja"
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
           "<|constrain|>")
ASK = [{"role": "user", "content": "Weather in Paris?"}]
THINKING = "The user asks. Think."
ANSWER = "It is sunny."
REPLY = (f"<|channel|>analysis<|message|>{THINKING}<|end|>"
         f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>")
ARGS = '{"city": "Paris"}'
CALL = (f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>"
        f"commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>")
BROKEN = f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>oops" \
         f"<|message|>{ANSWER}<|return|>"
FUNCTION = {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class ScriptedEngine(HashEngine):
    """Writes `script.ids` after the prompt's `<|start|>assistant`, one token a step."""

    def __init__(self, n_ctx: int, n_vocab: int, script: Script) -> None:
        super().__init__(n_ctx, n_vocab)
        self.script = script

    def row_logits(self, window: np.ndarray, position: int) -> np.ndarray:
        ids, lead = self.script.ids, self.script.lead
        seen = window.tolist()
        self.script.windows.append(seen)
        logits = np.zeros(self.n_vocab, dtype=np.float32)
        for k in range(min(len(ids) - 1, len(seen) - len(lead)), -1, -1):
            cut = len(seen) - k
            if seen[cut:] == ids[:k] and seen[cut - len(lead):cut] == lead:
                logits[ids[k]] = 30.0
                break
        return logits


class Script:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.lead = tok.encode("<|start|>assistant", special=True, add_bos=False)
        self.ids: list[int] = []
        self.windows: list[list[int]] = []

    def set(self, text: str) -> None:
        self.ids = self.tok.encode(text, special=True, add_bos=False)

    def last_prompt(self) -> str:
        return self.tok.decode(self.windows[-1])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("harmony") / "gpt-oss.gguf", arch="qwen3",
                            n_embd=64, n_ff=128, head_dim=16, chat_template=TEMPLATE.read_text(),
                            vocab=build_tiny_vocab(extra_tokens=HARMONY))


@pytest.fixture(scope="module")
def served(model: Path) -> Iterator[tuple[ServerState, Script]]:
    f = GGUFFile.open(model)
    script = Script(Tokenizer.from_gguf(f))
    n_vocab = HParams.from_gguf(f).n_vocab
    state = ServerState(ServerConfig(model_path=model, engine=EngineConfig.build(n_ctx=1024),
                                     slots=1),
                        engine_factory=lambda n_ctx: ScriptedEngine(n_ctx, n_vocab, script))
    state.start()
    assert state.wait_ready(30)
    yield state, script
    state.stop()


def _run(state: ServerState, fn: Callable[[httpx2.AsyncClient], Awaitable[T]]) -> T:
    async def go() -> T:
        transport = httpx2.ASGITransport(app=create_app(state, own_state=False))
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
            return await fn(http)

    return asyncio.run(go())


def with_openai(state: ServerState, fn: Callable[[openai.AsyncOpenAI], Awaitable[T]]) -> T:
    return _run(state, lambda http: fn(openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)))


def with_anthropic(state: ServerState,
                   fn: Callable[[anthropic.AsyncAnthropic], Awaitable[T]]) -> T:
    return _run(state, lambda http: fn(anthropic.AsyncAnthropic(
        base_url="http://test", api_key="x", http_client=http, max_retries=0)))


def with_ollama(state: ServerState, fn: Callable[[ollama.AsyncClient], Awaitable[T]]) -> T:
    async def go() -> T:
        transport = httpx.ASGITransport(app=create_app(state, own_state=False))
        return await fn(ollama.AsyncClient(host="http://test", transport=transport))

    return asyncio.run(go())


def openai_chat(state: ServerState, **body: Any) -> tuple[Any, dict[str, Any]]:
    """(the whole reply's choice, the stream's deltas joined: content, reasoning, calls)."""
    body = {"model": "m", "messages": ASK, "temperature": 0, "max_tokens": 200, **body}

    async def both(c: openai.AsyncOpenAI) -> tuple[Any, dict[str, Any]]:
        whole = await c.chat.completions.create(**body)
        joined: dict[str, Any] = {"content": "", "reasoning": "", "calls": []}
        async for chunk in await c.chat.completions.create(**body, stream=True):
            choice = chunk.choices[0]
            d = choice.delta
            joined["content"] += d.content or ""
            joined["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                if tc.id:
                    joined["calls"].append([tc.function.name, ""])
                joined["calls"][tc.index][1] += tc.function.arguments or ""
            if choice.finish_reason:
                joined["finish"] = choice.finish_reason
        return whole.choices[0], joined

    return with_openai(state, both)


def test_openai_chat_reasoning_and_answer(served: tuple[ServerState, Script]) -> None:
    state, script = served
    script.set(REPLY)
    choice, joined = openai_chat(state, reasoning_effort="high")
    assert "Reasoning: high\n" in script.last_prompt()
    msg = choice.message
    assert (msg.content, msg.model_extra["reasoning_content"]) == (ANSWER, THINKING)
    assert choice.finish_reason == joined["finish"] == "stop"  # <|end|> did not end it
    assert (joined["content"], joined["reasoning"]) == (ANSWER, THINKING)
    choice, _ = openai_chat(state, extra_body={"reasoning_format": "none"})
    assert choice.message.content == f"<|channel|>analysis<|message|>{THINKING}<|end|>{ANSWER}"


def test_openai_chat_tool_call(served: tuple[ServerState, Script]) -> None:
    state, script = served
    script.set(CALL)
    choice, joined = openai_chat(state, tools=[{"type": "function", "function": FUNCTION}])
    (tc,) = choice.message.tool_calls
    assert (tc.function.name, tc.function.arguments) == ("get_weather", ARGS)
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == THINKING
    assert joined["calls"] == [["get_weather", ARGS]] and joined["finish"] == "tool_calls"
    assert joined["reasoning"] == THINKING and joined["content"] == ""
    choice, _ = openai_chat(state)  # no tools offered: an unsolicited call, dropped
    assert choice.message.content == "" and not choice.message.tool_calls


def test_openai_chat_broken_header_is_content(served: tuple[ServerState, Script]) -> None:
    state, script = served
    script.set(BROKEN)
    choice, joined = openai_chat(state)
    broken = f"<|channel|>oops<|message|>{ANSWER}"
    assert (choice.message.content, choice.message.model_extra["reasoning_content"]) == \
        (broken, THINKING)
    assert (joined["content"], joined["reasoning"]) == (broken, THINKING)


def test_responses_items_and_effort(served: tuple[ServerState, Script]) -> None:
    state, script = served
    script.set(REPLY)
    got = with_openai(state, lambda c: c.responses.create(
        model="m", input="Weather in Paris?", reasoning={"effort": "low"}, temperature=0))
    assert "Reasoning: low\n" in script.last_prompt()
    assert [o.type for o in got.output] == ["reasoning", "message"]
    assert got.output[0].content[0].text == THINKING and got.output_text == ANSWER
    script.set(CALL)
    tool = {"type": "function", **FUNCTION}

    async def streamed(c: openai.AsyncOpenAI) -> list[Any]:
        return [e async for e in await c.responses.create(
            model="m", input="Weather in Paris?", tools=[tool], temperature=0, stream=True)]

    events = with_openai(state, streamed)
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert (final.output[1].name, final.output[1].arguments) == ("get_weather", ARGS)


def test_anthropic_thinking_and_tool_use(served: tuple[ServerState, Script]) -> None:
    state, script = served
    script.set(REPLY)
    msg = with_anthropic(state, lambda c: c.messages.create(
        model="m", max_tokens=200, messages=ASK,  # type: ignore[arg-type]
        thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0}))
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert (msg.content[0].thinking, msg.content[1].text) == (THINKING, ANSWER)  # type: ignore[union-attr]
    assert msg.stop_reason == "end_turn"
    script.set(CALL)
    tool = {"name": FUNCTION["name"], "description": FUNCTION["description"],
            "input_schema": FUNCTION["parameters"]}

    async def streamed(c: anthropic.AsyncAnthropic) -> Any:
        async with c.messages.stream(model="m", max_tokens=200, messages=ASK,  # type: ignore[arg-type]
                                     tools=[tool], extra_body={"temperature": 0}) as s:  # type: ignore[list-item]
            return await s.get_final_message()

    final = with_anthropic(state, streamed)
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].name == "get_weather" and final.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use"


def test_ollama_thinking_and_tool_calls(served: tuple[ServerState, Script]) -> None:
    state, script = served
    script.set(REPLY)
    opts = {"temperature": 0}
    got = with_ollama(state, lambda c: c.chat(model="gpt-oss", messages=ASK, think="medium",
                                              options=opts))
    assert "Reasoning: medium\n" in script.last_prompt()
    assert (got.message.thinking, got.message.content) == (THINKING, ANSWER)

    async def streamed(c: ollama.AsyncClient) -> list[Any]:
        return [p async for p in await c.chat(model="gpt-oss", messages=ASK, think=True,
                                             stream=True, options=opts)]

    parts = with_ollama(state, streamed)
    assert "".join(p.message.thinking or "" for p in parts) == THINKING
    assert "".join(p.message.content or "" for p in parts) == ANSWER
    script.set(CALL)
    tool = {"type": "function", "function": FUNCTION}
    got = with_ollama(state, lambda c: c.chat(model="gpt-oss", messages=ASK, tools=[tool],
                                              options=opts))
    (tc,) = got.message.tool_calls or []
    assert tc.function.name == "get_weather" and dict(tc.function.arguments) == {"city": "Paris"}
    caps = with_ollama(state, lambda c: c.show("gpt-oss"))
    assert "thinking" in (caps.capabilities or [])


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_openai_forced_tool_choice(served: tuple[ServerState, Script], choice: Any) -> None:
    """A forced tool_choice constrains the reply to end in a commentary call (the grammar
    lets the scripted analysis and call through), whole and streamed."""
    state, script = served
    script.set(CALL)
    choice_, joined = openai_chat(state, tools=[{"type": "function", "function": FUNCTION}],
                                  tool_choice=choice)
    (tc,) = choice_.message.tool_calls
    assert (tc.function.name, tc.function.arguments) == ("get_weather", ARGS)
    assert choice_.finish_reason == "tool_calls" and joined["calls"] == [["get_weather", ARGS]]
    assert choice_.message.model_extra["reasoning_content"] == THINKING


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_choice(served: tuple[ServerState, Script],
                                      choice: dict[str, Any]) -> None:
    state, script = served
    script.set(CALL)
    tool = {"name": FUNCTION["name"], "description": FUNCTION["description"],
            "input_schema": FUNCTION["parameters"]}
    msg = with_anthropic(state, lambda c: c.messages.create(
        model="m", max_tokens=120, messages=ASK, tools=[tool],  # type: ignore[arg-type, list-item]
        tool_choice=choice, extra_body={"temperature": 0}))  # type: ignore[arg-type]
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert uses[0].input == {"city": "Paris"} and msg.stop_reason == "tool_use"
