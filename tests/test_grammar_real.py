"""Constrained generation with the development model: sampled outputs obey their grammar.

Slow (the real model decodes every token); run with `-m "real_model"`. The schemas are the ones
the tokenizer-only random walks use (tests/test_grammar.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from minfer.sampling import SamplerParams
from minfer.sampling.grammar import gbnf_grammar, json_schema_grammar
from minfer.sampling.tool_calls import parse_tool_calls, tool_choice_grammar, tools_for_prompt
from tests.test_grammar import ARITH, SCHEMAS, _arith_ok

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.fixture(scope="module")
def model(real_model_path: Path) -> Any:
    try:
        import minfer.engine.generate  # needs the compiled kernels
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"engine not importable: {exc}")
    import minfer

    return minfer.load(real_model_path, n_ctx=1024)


def _run(model: Any, messages: list[dict[str, Any]], grammar: str, *, seed: int, n: int,
         tools: list[Any] | None = None) -> Any:
    from minfer.engine.generate import Finished

    ids = model.tokenizer.encode(model.render_chat(messages, tools=tools))
    mask = model.grammar_mask(grammar)
    done = None
    for event in model.stream(ids, max_tokens=n, seed=seed, logit_mask=mask,
                              sampling=SamplerParams(temp=0.8)):
        if isinstance(event, Finished):
            done = event
    assert done is not None
    return done


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_json_validates(model: Any, name: str) -> None:
    schema = SCHEMAS[name]
    ask = [{"role": "system", "content": "You answer with JSON only."},
           {"role": "user", "content": "Give a short example object for this JSON schema:\n"
            + json.dumps(schema)}]
    grammar = json_schema_grammar(schema)
    finished = 0
    for seed in (1, 2):
        done = _run(model, ask, grammar, seed=seed, n=160)
        if done.reason == "length":  # cut short: still a prefix the grammar accepts
            _assert_valid_prefix(model, grammar, done.ids)
            continue
        assert done.reason == "eos", done.reason
        jsonschema.validate(json.loads(done.text), schema)
        finished += 1
    assert finished, "no sampled output finished within 160 tokens"


def _assert_valid_prefix(model: Any, grammar: str, ids: list[int]) -> None:
    check = model.grammar_mask(grammar)
    for token in ids:
        check.accept(token)
    assert check.stop_reason == "" and not check.is_stopped()


def test_length_cut_is_a_valid_prefix(model: Any) -> None:
    schema = SCHEMAS["nested"]
    grammar = json_schema_grammar(schema)
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    done = _run(model, ask, grammar, seed=3, n=6)
    assert done.reason == "length" and len(done.ids) == 6
    _assert_valid_prefix(model, grammar, done.ids)


def test_sampled_arithmetic(model: Any) -> None:
    ask = [{"role": "user", "content": "Write an arithmetic expression equal to 42."}]
    for seed in (1, 2, 3):
        done = _run(model, ask, gbnf_grammar(ARITH), seed=seed, n=48)
        if done.reason == "eos":
            assert _arith_ok(done.text), done.text
        else:
            assert done.reason == "length"


def test_required_tool_call(model: Any) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}}]
    ask = [{"role": "user", "content": "Hi! How are you today?"}]  # no reason to call a tool
    grammar = tool_choice_grammar(tools, "required")
    assert grammar is not None
    done = _run(model, ask, grammar, seed=4, n=96, tools=tools_for_prompt(tools, "required"))
    assert done.reason == "eos", done.text
    content, calls = parse_tool_calls(done.text)
    assert content == "" and calls and calls[0]["function"]["name"] == "get_weather"
    args = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(args, tools[0]["function"]["parameters"])  # type: ignore[index]
