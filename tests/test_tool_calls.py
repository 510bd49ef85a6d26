"""Tool calls: the forcing grammar (random walks on the tiny vocabulary) and both parsers."""

from __future__ import annotations

import codecs
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from minfer.errors import GrammarError
from minfer.gguf.reader import GGUFFile
from minfer.sampling import Sampler, SamplerParams
from minfer.sampling.grammar import GrammarMask, GrammarVocab
from minfer.sampling.tool_calls import (
    ToolCallStream,
    parse_tool_calls,
    tool_choice_grammar,
    tools_for_prompt,
)
from minfer.tokenizer.tokenizer import Tokenizer

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["c", "f"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]
SCHEMA_OF = {"get_weather": WEATHER, "now": TOOLS[1]["function"]["parameters"]}  # type: ignore[index]

CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris\\"x", "unit": "c"}}'
        '\n</tool_call>')
TEXTS = [
    CALL,
    "Let me check. é✓ " + CALL + "\n" + CALL.replace("get_weather", "now") + "\n",
    '<tool_call>\n{"arguments": {"unit": "f"}, "name": "get_weather"}\n</tool_call>',  # other order
    '<tool_call>{"name": "now", "arguments": "{\\"a\\": 1}"}</tool_call> done',  # string args
    "a < b <tool and <tool_call>not json</tool_call> end",  # malformed: stays content
    'x <tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',  # name not a string
    "just text, no calls",
    "   ",
    '<tool_call>\n{"name": "now", "arguments": []}\n</tool_call>',
]


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def test_parse_complete_calls() -> None:
    content, calls = parse_tool_calls(TEXTS[1], new_id=ids())
    assert content == "Let me check. é✓"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert calls[0] == {"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Pa}ris\\"x", "unit": "c"}'}}
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Pa}ris"x', "unit": "c"}
    assert calls[1]["id"] == "call_1"
    _, calls = parse_tool_calls(TEXTS[2])
    assert json.loads(calls[0]["function"]["arguments"]) == {"unit": "f"}
    content, calls = parse_tool_calls(TEXTS[3])
    assert content == "done" and calls[0]["function"]["arguments"] == '{"a": 1}'


@pytest.mark.parametrize("text", [TEXTS[4], TEXTS[5], "x <tool_call>\n{\"name\": \"now\", ",
                                  '<tool_call>{"name": "now", "arguments": {}</tool_call>'])
def test_malformed_blocks_stay_content(text: str) -> None:
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text.strip()


def _stream(pieces: list[str]) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    parser = ToolCallStream(new_id=ids())
    deltas = [d for p in pieces for d in parser.push(p)] + parser.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict[str, Any]] = []
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["function"]["arguments"] == ""
                calls.append({"id": tc["id"], "type": tc["type"],
                              "function": {"name": tc["function"]["name"], "arguments": ""}})
            else:
                assert set(tc) == {"index", "function"} and tc["function"]["arguments"]
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    assert calls == parser.tool_calls
    return content, calls, deltas


def _split_bytes(text: str, cuts: tuple[int, ...]) -> list[str]:
    """The text cut at byte offsets, each piece decoded as the engine does (whole chars)."""
    data = text.encode()
    dec = codecs.getincrementaldecoder("utf-8")()
    bounds = [0, *cuts, len(data)]
    return [dec.decode(data[a:b], final=b == len(data)) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_matches_one_shot_at_every_byte_boundary(text: str) -> None:
    expect = parse_tool_calls(text, new_id=ids())
    n = len(text.encode())
    splits = [(i,) for i in range(n + 1)] + [tuple(range(1, n))]  # two pieces; byte by byte
    for cuts in splits:
        content, calls, _ = _stream(_split_bytes(text, cuts))
        assert (content, calls) == expect, cuts


def test_stream_sends_arguments_incrementally() -> None:
    pieces = [CALL[:60], CALL[60:75], CALL[75:]]
    _, _, deltas = _stream(pieces)
    args = [d["tool_calls"][0]["function"]["arguments"] for d in deltas
            if "id" not in d["tool_calls"][0]]
    assert len(args) >= 2 and "".join(args) == '{"city": "Pa}ris\\"x", "unit": "c"}'
    first = deltas[0]["tool_calls"][0]
    assert first["type"] == "function" and first["function"]["name"] == "get_weather"


def test_stream_holds_back_a_partial_tag() -> None:
    parser = ToolCallStream()
    assert parser.push("Hi <tool_") == [{"content": "Hi"}]
    assert parser.push("box>") == [{"content": " <tool_box>"}]
    assert parser.push(" <tool_c") == []
    assert parser.finish() == [{"content": " <tool_c"}]


def test_tool_choice_values() -> None:
    assert tool_choice_grammar(TOOLS, "auto") is None
    assert tool_choice_grammar(TOOLS, None) is None
    assert tool_choice_grammar(TOOLS, "none") is None
    assert tool_choice_grammar(None, "auto") is None
    assert tools_for_prompt(TOOLS, "none") is None and tools_for_prompt([], "auto") is None
    assert tools_for_prompt(TOOLS, "required") == TOOLS
    for bad_tools, choice in [(TOOLS, "sometimes"), (TOOLS, {"type": "function"}),
                              (TOOLS, {"type": "function", "function": {"name": "nope"}}),
                              ([], "required"), ([{"type": "function"}], "required"),
                              ([{"type": "function", "function": {"name": "f",
                                                                  "parameters": 3}}], "required")]:
        with pytest.raises(GrammarError):
            tool_choice_grammar(bad_tools, choice)  # type: ignore[arg-type]
    with pytest.raises(GrammarError):
        tool_choice_grammar([{"type": "function", "function": {
            "name": "f", "parameters": {"type": "strin"}}}], "required")


@pytest.fixture(scope="module")
def tok(tiny_qwen2: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile.open(tiny_qwen2))


def _walk(tok: Tokenizer, mask: GrammarMask, seed: int) -> str:
    n = mask.vocab.n_vocab
    sampler = Sampler(SamplerParams(temp=0.8), n, seed=seed, logit_mask=mask)
    sampler.reset()
    rng = np.random.default_rng(seed)
    closing = np.array([p != b"" and all(c in b'"}]' for c in p)
                        for p in map(tok.token_bytes, range(n))])
    out: list[int] = []
    for step in range(600):
        assert not mask.is_stopped(), mask.stop_reason
        logits = rng.standard_normal(n).astype(np.float32)
        if step > 40:
            logits[closing] += 6
            logits[sorted(tok.eot_ids)] += 10
        token = sampler.sample(logits)
        sampler.accept(token)
        if token in tok.eot_ids:
            return tok.decode(out)
        out.append(token)
    raise AssertionError(f"walk did not finish: {tok.decode(out)!r}")


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_always_parse_and_match_the_schema(tok: Tokenizer,
                                                        choice: str | dict[str, Any]) -> None:
    vocab = GrammarVocab.from_tokenizer(tok)
    mask = GrammarMask(vocab, tool_choice_grammar(TOOLS, choice) or "")
    names = set()
    for seed in range(8):
        text = _walk(tok, mask, seed)
        content, calls = parse_tool_calls(text)
        assert content == "" and calls, text
        for call in calls:
            fn = call["function"]
            jsonschema.validate(json.loads(fn["arguments"]), SCHEMA_OF[fn["name"]])
            names.add(fn["name"])
        assert _stream(_split_bytes(text, (len(text) // 2,)))[1] == parse_tool_calls(
            text, new_id=ids())[1]
    assert names == ({"get_weather", "now"} if choice == "required" else {"get_weather"})


BARE_CASES = [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "", ["get_weather"]),
    ('```json\n{"name": "f", "arguments": {}}\n```', "", ["f"]),
    ('Hello {"name": "f", "arguments": {}}', 'Hello {"name": "f", "arguments": {}}', []),
    ('{"a": 1}', '{"a": 1}', []),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
]


@pytest.mark.parametrize(("text", "content", "names"), BARE_CASES)
def test_untagged_call_is_a_call_in_both_parsers(text: str, content: str,
                                                 names: list[str]) -> None:
    got_content, calls = parse_tool_calls(text)
    assert got_content == content and [c["function"]["name"] for c in calls] == names
    for step in (1, 2, 7, len(text)):
        stream = ToolCallStream()
        deltas = [d for i in range(0, len(text), step) for d in stream.push(text[i:i + step])]
        deltas += stream.finish()
        assert "".join(d.get("content", "") for d in deltas) == content
        assert [c["function"] for c in stream.tool_calls] == [c["function"] for c in calls]
