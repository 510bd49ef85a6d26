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


# -- a forced tool_choice ------------------------------------------------------------------------
GPTOSS = FIXTURES / "gptoss" / "gptoss.gguf"
BOUNDED = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
ASKED = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"


def _walk(mask: Any, tok: Any, text: str) -> bool:
    """Feed text's tokens to a grammar mask: False at the first one it forbids."""
    for tid in tok.encode(text, special=True, add_bos=False):
        if not mask.allowed()[tid]:
            return False
        mask.accept(tid)
    return True


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_a_forced_choice_grammar_ends_the_reply_in_a_commentary_call(choice: Any) -> None:
    """As llama.cpp's gpt-oss grammar: analysis (or preamble) messages may come first, then
    the reply must be a call to an offered function with arguments the schema allows."""
    from minfer.gguf.reader import GGUFFile
    from minfer.sampling.grammar import GrammarMask, GrammarVocab
    from minfer.sampling.tool_calls import tool_choice_grammar
    from minfer.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile.open(GPTOSS))
    vocab = GrammarVocab.from_tokenizer(tok)
    grammar = tool_choice_grammar([WEATHER, BOUNDED | {"function": {
        **BOUNDED["function"], "name": "get_forecast"}}], choice, template_source=TEMPLATE)
    assert grammar is not None
    call = ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Paris"}')
    thought = "<|channel|>analysis<|message|>Look it up; no <|end x yet.<|end|><|start|>assistant"
    mask = GrammarMask(vocab, grammar)
    assert _walk(mask, tok, thought + call) and mask.is_accepting()
    got = HarmonyFormat(tools=("get_weather",)).parse(thought + call, new_id=str)
    assert got.calls[0]["function"]["arguments"] == '{"city": "Paris"}'
    for refused in ["<|channel|>final<|message|>Sunny.",
                    '<|channel|>commentary to=functions.get_weather <|constrain|>json'
                    '<|message|>{"town": "Paris"}']:
        assert not _walk(GrammarMask(vocab, grammar), tok, refused)
    if isinstance(choice, dict):  # the named function only
        assert not _walk(GrammarMask(vocab, grammar), tok,
                         "<|channel|>commentary to=functions.get_forecast")


def test_the_random_gpt_oss_model_forced_to_call_writes_a_valid_call() -> None:
    """The tiny random gpt-oss under the forcing grammar: its reply parses into one call
    whose JSON arguments the function's schema accepts (seed 0 goes straight to the call)."""
    import jsonschema

    import minfer
    from minfer.engine.generate import Finished
    from minfer.sampling.tool_calls import tool_choice_grammar

    model = minfer.load(str(GPTOSS), n_ctx=256, backend="cpu")
    grammar = tool_choice_grammar([BOUNDED], "required", template_source=TEMPLATE)
    assert grammar is not None
    ids = model.tokenizer.encode(ASKED, special=True, add_bos=False)
    events = list(model.stream(ids, max_tokens=200, seed=0, logit_mask=model.grammar_mask(grammar)))
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.reason in ("eos", "stop", "grammar")
    got = HarmonyFormat(tools=("get_weather",)).parse(finished.text, new_id=str)
    (call,) = got.calls
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        BOUNDED["function"]["parameters"])


# -- run and chat: the channels shown, never their marks ------------------------------------------
REPLY = ("<|channel|>analysis<|message|>The user asks.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>It is sunny.")


def test_run_splits_a_harmony_reply_into_thinking_and_answer() -> None:
    """`minfer run`'s printer and `--json` read a harmony reply through its plan: the
    analysis is the reasoning, the final message the content, streamed alike."""
    plan = ReasoningOptions().plan(ASKED, lambda s: [ord(c) for c in s],
                                   template_source=TEMPLATE)
    split = plan.split(REPLY)
    assert (split.content, split.reasoning) == ("It is sunny.", "The user asks.")
    stream = plan.stream()
    pieces = [stream.push(c) for c in REPLY] + [stream.finish()]
    assert "".join(c for c, _ in pieces) == "It is sunny."
    assert "".join(r for _, r in pieces) == "The user asks."


def test_chat_shows_the_analysis_dimmed_and_keeps_the_final_message() -> None:
    import io

    from minfer.chat.repl import ReplyWriter
    from minfer.chat.think import ThinkSplitter, reply_content_for, splitter_for

    assert splitter_for("{{ messages }}") is ThinkSplitter
    assert reply_content_for("{{ messages }}") is None
    out = io.StringIO()
    writer = ReplyWriter(color=False, interactive=False, out=out, hide_reasoning=True,
                         splitter=splitter_for(TEMPLATE))
    for c in REPLY:
        writer.piece(c)
    writer.end_reply()
    assert out.getvalue() == "It is sunny.\n"  # no channel mark, the thinking hidden
    shown = io.StringIO()
    writer = ReplyWriter(color=False, interactive=False, out=shown, splitter=splitter_for(TEMPLATE))
    writer.piece(REPLY)
    writer.end_reply()
    assert shown.getvalue() == "The user asks.It is sunny.\n"
    splitter = splitter_for(TEMPLATE)()
    assert splitter.push(REPLY) + splitter.flush() == [("The user asks.", True),
                                                       ("It is sunny.", False)]
    keep = reply_content_for(TEMPLATE)
    assert keep is not None and keep(REPLY) == "It is sunny."
