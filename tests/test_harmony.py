"""gpt-oss's harmony format: the template renders, replies parse as llama.cpp parses them.

Every case of tests/fixtures/harmony/*.json (llama.cpp's own GPT-OSS test texts, cases derived
from its parser, broken headers) is parsed whole and streamed in random splits: the deltas
concatenate to the whole result, which is the expected one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from minfer.chat.reasoning import ReasoningOptions, template_thinks
from minfer.sampling.harmony import HarmonyFormat, harmony_history, is_harmony
from minfer.sampling.tool_calls import history_for, new_call_id
from minfer.tokenizer.chat import ChatTemplate

FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATE = (FIXTURES / "templates" / "gpt-oss.jinja").read_text()
CASES = [c for f in sorted((FIXTURES / "harmony").glob("*.json"))
         for c in json.loads(f.read_text())["cases"]]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _format(case: dict[str, Any]) -> HarmonyFormat:
    tools = case["tools"]
    return HarmonyFormat(reasoning=case["reasoning_format"] != "none",
                         tools=None if tools is None else tuple(tools))


def _expected(case: dict[str, Any]) -> tuple[Any, ...]:
    e = case["expect"]
    return (e["reasoning_content"], e["content"],
            [(c["name"], c["arguments"]) for c in e["tool_calls"]])


def _streamed(fmt: HarmonyFormat, text: str, rng: random.Random) -> tuple[Any, ...]:
    stream = fmt.stream(new_id=new_call_id)
    deltas = []
    i = 0
    while i < len(text):
        n = rng.choice((1, 1, 2, 3, 5, 8, 13))
        deltas += stream.push(text[i:i + n])
        i += n
    deltas += stream.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[list[str]] = []
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function"
                calls.append([tc["function"]["name"], ""])
            calls[tc["index"]][1] += tc["function"]["arguments"]
    assert all(set(d) in ({"reasoning_content"}, {"content"}, {"tool_calls"}) for d in deltas)
    return reasoning, content, [tuple(c) for c in calls]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_parsed_as_llama_cpp(case: dict[str, Any]) -> None:
    fmt = _format(case)
    reply = fmt.parse(case["text"], new_id=new_call_id)
    got = (reply.reasoning, reply.content,
           [(c["function"]["name"], c["function"]["arguments"]) for c in reply.calls])
    assert got == _expected(case)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in reply.calls)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_streamed_in_random_splits(case: dict[str, Any]) -> None:
    fmt = _format(case)
    for seed in range(12):
        assert _streamed(fmt, case["text"], random.Random(seed)) == _expected(case), seed


def test_a_broken_header_streams_as_content_from_where_it_breaks() -> None:
    stream = HarmonyFormat().stream(new_id=new_call_id)
    first = stream.push("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>")
    assert first == [{"reasoning_content": "hm"}]
    assert stream.push("oops") == [{"content": "<|channel|>oops"}]
    assert stream.push(" <|channel|>final<|message|>x") == \
        [{"content": " <|channel|>final<|message|>x"}]


def test_held_back_while_a_tag_may_follow() -> None:
    stream = HarmonyFormat().stream(new_id=new_call_id)
    assert stream.push("<|channel|>final<|message|>Hi <|e") == [{"content": "Hi "}]
    assert stream.push("xtra") == [{"content": "<|extra"}]


def test_the_template_renders_effort_tools_and_history() -> None:
    assert is_harmony(TEMPLATE) and not is_harmony("{{ messages }}")
    assert template_thinks(TEMPLATE, ChatTemplate(TEMPLATE).variables)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    t = ChatTemplate(TEMPLATE)
    opts = ReasoningOptions().override(template_kwargs={"reasoning_effort": "high"})
    text = t.render(history_for(history, t.source, t.variables, [WEATHER]),
                    tools=[WEATHER], **opts.template_vars())
    assert "Reasoning: high\n" in text and "type get_weather = (_: {\ncity: string,\n" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools" in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris"}<|call|>') in text
    assert text.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary'
                         '<|message|>"sunny"<|end|><|start|>assistant')
    assert "Reasoning: medium\n" in t.render([{"role": "user", "content": "Hi"}])


def test_history_gives_the_thinking_to_the_template() -> None:
    calls = [{"function": {"name": "f", "arguments": "{}"}}]
    out = harmony_history([{"role": "assistant", "content": "x", "reasoning_content": "r"},
                           {"role": "assistant", "content": "", "reasoning_content": "s",
                            "tool_calls": calls},
                           {"role": "user", "content": "u"}])
    assert out[0] == {"role": "assistant", "content": "x", "reasoning_content": "r",
                      "thinking": "r"}
    assert "content" not in out[1] and out[1]["thinking"] == "s"
    assert out[2] == {"role": "user", "content": "u"}


def test_a_harmony_plan_reads_harmony_and_budgets_the_analysis() -> None:
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    plan = ReasoningOptions(budget=4).plan("<|start|>user<|message|>Hi<|end|><|start|>assistant",
                                           encode, template_source=TEMPLATE)
    assert plan.harmony == HarmonyFormat(reasoning=True, opens_header=True)
    assert plan.budget is not None and plan.budget.start == encode("<|channel|>analysis<|message|>")
    assert plan.budget.end == plan.budget.forced == encode("<|end|>")
    assert ReasoningOptions(fmt="none").plan("x", encode, template_source=TEMPLATE).harmony == \
        HarmonyFormat(reasoning=False, opens_header=False)
    assert ReasoningOptions().plan("<think>", encode, template_source="").harmony is None
