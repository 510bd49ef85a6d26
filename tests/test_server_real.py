"""`minfer serve` on the development model (Qwen2.5-Coder-0.5B-Instruct), via the openai client.

Slow: a real answer through the chat template, stream and non-stream agreeing, and greedy
streams batched together (beside a long prompt prefilling in chunks) yielding exactly their solo
text (the server's engine is batch-invariant).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_server_process import Server, openai, serving

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def real_server(real_model_path: Path) -> Iterator[Server]:
    with serving(real_model_path, "--slots", "4", "--n-ctx", "1024", "--chunk", "64",
                 timeout=600) as srv:
        yield srv


def test_chat_answers_through_the_template(real_server: Server) -> None:
    c = real_server.client()
    msgs = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    r = c.chat.completions.create(model="qwen", messages=msgs, max_tokens=16, **GREEDY)
    assert "4" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason == "stop"  # <|im_end|> ends the turn
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="qwen", messages=msgs, max_tokens=16, stream=True, **GREEDY) if ch.choices)
    assert streamed == r.choices[0].message.content


def test_batched_greedy_streams_equal_their_solo_runs(real_server: Server) -> None:
    prompts = [f"def function_{i}(x):\n    # returns x times {i}\n" for i in range(3)]
    c = real_server.client()
    solo = [c.completions.create(model="q", prompt=p, max_tokens=20, **GREEDY).choices[0].text
            for p in prompts]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model="q", prompt=prompt, max_tokens=20,
                                                 stream=True, **GREEDY)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def main() -> list[str]:
        client = real_server.aclient()
        # a long prompt prefills in chunks beside the three decodes
        long_prompt = "# notes\n" + "x = 1\n" * 100
        extra = client.completions.create(model="q", prompt=long_prompt, max_tokens=4)
        *texts, _ = await asyncio.gather(*(one(client, p) for p in prompts), extra)
        return list(texts)

    assert asyncio.run(main()) == solo


def test_anthropic_messages_equal_the_openai_reply(real_server: Server) -> None:
    import anthropic

    msgs = [{"role": "user", "content": "Name one prime number greater than 10."}]
    ref = real_server.client().chat.completions.create(
        model="qwen", messages=msgs, max_tokens=24, **GREEDY)  # type: ignore[arg-type]
    c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{real_server.port}", api_key="unused",
                            max_retries=0)
    msg = c.messages.create(model="qwen", max_tokens=24, messages=msgs,  # type: ignore[arg-type]
                            extra_body=GREEDY)
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert text == ref.choices[0].message.content
    assert msg.usage.input_tokens == ref.usage.prompt_tokens  # type: ignore[union-attr]
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        ref.choices[0].finish_reason]
    with c.messages.stream(model="qwen", max_tokens=24, messages=msgs,  # type: ignore[arg-type]
                           extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == text
    assert c.messages.count_tokens(model="qwen", messages=msgs).input_tokens == \
        msg.usage.input_tokens  # type: ignore[arg-type]
    tool = {"name": "add", "description": "Add two integers", "input_schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}
    ask = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    called = c.messages.create(model="qwen", max_tokens=64, messages=ask, tools=[tool],  # type: ignore[arg-type,list-item]
                               tool_choice={"type": "any"}, extra_body=GREEDY)
    (use,) = [b for b in called.content if b.type == "tool_use"]
    assert called.stop_reason == "tool_use" and use.name == "add" and set(use.input) == {"a", "b"}
    turn = {"role": "assistant", "content": [b.model_dump() for b in called.content]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "5"}]}
    done = c.messages.create(model="qwen", max_tokens=24, tools=[tool],  # type: ignore[arg-type,list-item]
                             messages=[*ask, turn, result], extra_body=GREEDY)  # type: ignore[list-item]
    assert "5" in "".join(b.text for b in done.content if b.type == "text")
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="qwen", max_tokens=8, messages=[])


def test_ollama_chat_and_generate_equal_the_openai_reply(real_server: Server) -> None:
    import ollama

    msgs = [{"role": "user", "content": "Name one prime number greater than 10."}]
    ref = real_server.client().chat.completions.create(
        model="qwen", messages=msgs, max_tokens=24, **GREEDY)  # type: ignore[arg-type]
    c = ollama.Client(host=real_server.base)
    name = c.list().models[0].model
    opts = {"temperature": 0, "num_predict": 24}
    assert c.chat(name, messages=msgs, options=opts).message.content == \
        ref.choices[0].message.content
    streamed = "".join(p.message.content or "" for p in c.chat(name, messages=msgs,
                                                                 options=opts, stream=True))
    assert streamed == ref.choices[0].message.content
    gen = c.generate(name, prompt=msgs[0]["content"], options=opts)
    assert gen.response == ref.choices[0].message.content
    raw_ref = real_server.client().completions.create(model="qwen", prompt="def fib(n):",
                                                      max_tokens=16, temperature=0.0)
    raw = c.generate(name, prompt="def fib(n):", raw=True,
                     options={"temperature": 0, "num_predict": 16})
    assert raw.response == raw_ref.choices[0].text
    shown = c.show(name)
    assert shown.details.family == "qwen2" and shown.modelinfo["general.architecture"] == "qwen2"
    assert [m.model for m in c.ps().models] == [name]
    as_json = c.chat(name, messages=[{"role": "user", "content": "Give a JSON object with a "
                                      "key named n holding the number 7."}],
                     format="json", options={"temperature": 0, "num_predict": 32})
    assert isinstance(json.loads(as_json.message.content), dict)


def test_a_burst_sharing_a_system_prompt_gets_the_one_slot_answers(real_model_path: Path) -> None:
    """Four chat requests at once with one long system prompt: the first computes it, the others
    copy its KV cells from that slot (`Plan.copies`) and report them as cached; every answer
    equals the one a one-slot server gives (no slot to copy from there)."""
    system = ("You are a careful assistant for a Python team. Answer in one short sentence, "
              "name the standard library module you would use, and never write code.")
    questions = ["How do I read a CSV file?", "How do I parse JSON?",
                 "How do I get today's date?", "How do I join file paths?"]

    def messages(q: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": q}]

    with serving(real_model_path, "--slots", "1", "--n-ctx", "1024", timeout=600) as one:
        c = one.client()
        alone = [c.chat.completions.create(model="q", messages=messages(q),  # type: ignore[arg-type]
                                           max_tokens=12, **GREEDY).choices[0].message.content
                 for q in questions]

    async def burst(srv: Server) -> list[tuple[str | None, int]]:
        client = srv.aclient()
        rs = await asyncio.gather(*(client.chat.completions.create(
            model="q", messages=messages(q), max_tokens=12, **GREEDY)  # type: ignore[arg-type]
            for q in questions))
        return [(r.choices[0].message.content,
                 r.usage.prompt_tokens_details.cached_tokens)  # type: ignore[union-attr]
                for r in rs]

    with serving(real_model_path, "--slots", "4", "--n-ctx", "1024", timeout=600) as srv:
        got = asyncio.run(burst(srv))
    assert [text for text, _ in got] == alone
    assert sum(1 for _, cached in got if cached >= 16) >= 3  # the system prompt was copied
