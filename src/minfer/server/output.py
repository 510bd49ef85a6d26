"""A request's output, as every API shapes it: the logit mask it samples under, the final
message, and its tokens' logprob entries.

- `response_format` (`text`, `json_object`, `json_schema`) and llama-server's `grammar` (GBNF)
  compile to an llguidance grammar (minfer.sampling.grammar); a forced `tool_choice` (`required`
  or a named function) compiles to a grammar that can only write well-formed calls in the
  template's syntax (minfer.sampling.tool_calls: `<tool_call>` blocks, or a harmony reply
  ending in a commentary call). The request gets its own `GrammarMask` over the model's
  `GrammarVocab` (built once at load), applied first in its sampler, then `logit_bias`. A bad
  schema, grammar or tool list is a 400 naming the problem, before anything is queued.
- `OutputPlan.constraint` is that mask: the generation loop asks `is_stopped()` and ends the
  request with "stop" on a valid prefix when no token may follow (minfer.engine.core.request).
- A harmony reply (gpt-oss's template) is read whole by minfer.sampling.harmony: its reasoning,
  content and tool call at once, whole and streamed.
- Another chat reply's thinking is split into `reasoning_content` first
  (minfer.chat.reasoning); `tools` are rendered by the chat template (not with `tool_choice:
  "none"`) and the rest of the text is parsed into OpenAI `tool_calls` in the template's
  syntax (`tool_calls.tool_syntax`: `<tool_call>` blocks, Gemma 4's own) (`finalize`; `reply`
  keeps the texts and calls in the order written, for the Anthropic and Responses APIs' lists
  of blocks), or streamed through a `ReplyStream`.
- `template_messages` turns request messages into what chat templates expect (assistant
  `tool_calls` arguments as objects, since Qwen-style templates write `arguments | tojson`);
  `chat_messages` also writes a tool history as text for a template that cannot (its source
  never reads `tool_calls`: Gemma's, plain ChatML), as llama.cpp polyfills one.
- `token_logprobs`: each drawn token's text, logprob, bytes and top alternatives, the entries
  OpenAI's chat logprobs, Ollama's `logprobs` and llama-server's `completion_probabilities` list.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from minfer.chat.reasoning import ReplyPlan
from minfer.engine.core.request import TokenLogprob
from minfer.errors import GrammarError
from minfer.sampling.grammar import (
    GrammarMask,
    GrammarVocab,
    gbnf_grammar,
    response_format_to_grammar,
)
from minfer.sampling.harmony import HarmonyFormat, HarmonyStream
from minfer.sampling.mask import LogitMask, chain
from minfer.sampling.tool_calls import (
    HERMES,
    ToolCallStream,
    ToolSyntax,
    call_arguments,
    history_for,
    new_call_id,
    tool_choice_grammar,
    tool_segments,
    tool_syntax,
    tools_for_prompt,
)
from minfer.server.errors import bad_request
from minfer.server.schemas import ChatCompletionRequest, ChatMessage, SamplingFields

TokenBytes = Callable[[int], bytes]


class LogitBias:
    """OpenAI's logit_bias: add a bias to chosen ids; -100 bans a token outright."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        self.values = np.where(values <= -100.0, -np.inf, values).astype(np.float32)

    def apply(self, logits: np.ndarray) -> None:
        logits[self.ids] += self.values

    def accept(self, token_id: int) -> None:
        pass

    def reset(self) -> None:
        pass


@dataclass
class OutputPlan:
    logit_mask: LogitMask | None = None  # everything the sampler applies first
    constraint: GrammarMask | None = None  # the grammar part of it (ends the generation)
    tools: list[dict[str, Any]] | None = None  # rendered into the prompt; output parsed
    reasoning: ReplyPlan | None = None  # chat replies: the thinking split from the content
    syntax: ToolSyntax = HERMES  # how the model writes its tool calls (its template's family)
    echo: str = ""  # completions with `echo`: the prompt's text, put before the reply

    def finalize(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """The assistant message's fields for the generated text, and the finish reason;
        the thinking goes to `reasoning_content`, tool calls are parsed from the content."""
        reply = self.reply(text, finish)
        return reply.fields(), reply.finish

    def reply(self, text: str, finish: str) -> Reply:
        """The generated text as a `Reply`: its thinking, then its texts and tool calls in
        the order they were written (for APIs whose content is a list of blocks)."""
        harmony = self.harmony()
        if harmony is not None:
            got = harmony.parse(text, new_id=new_call_id)
            if not got.calls:
                return Reply(got.reasoning, [got.content], finish)
            return Reply(got.reasoning, [got.content, *got.calls],
                         "tool_calls" if finish == "stop" else finish)
        reasoning = None
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            text, reasoning = split.content, split.reasoning
        if self.tools is None:
            return Reply(reasoning, [self.echo + text], finish)
        parts = tool_segments(text, syntax=self.syntax)
        if all(isinstance(p, str) for p in parts):
            return Reply(reasoning, ["".join(parts).strip()], finish)  # type: ignore[arg-type]
        return Reply(reasoning, parts, "tool_calls" if finish == "stop" else finish)

    def reply_stream(self) -> ReplyStream:
        """The streamed counterpart of `finalize`."""
        return ReplyStream(self)

    def harmony(self) -> HarmonyFormat | None:
        """How a harmony reply (gpt-oss) is read, the offered tools' names added; None for
        other replies."""
        if self.reasoning is None or self.reasoning.harmony is None:
            return None
        names = None if self.tools is None else tuple(t["function"]["name"] for t in self.tools)
        return replace(self.reasoning.harmony, tools=names)


@dataclass(frozen=True)
class Reply:
    """A finished chat reply: the thinking (None: none split off), the texts and tool calls in
    the order written (texts as they are, possibly empty), the finish reason."""
    reasoning: str | None
    parts: list[str | dict[str, Any]]
    finish: str

    @property
    def calls(self) -> list[dict[str, Any]]:
        return [p for p in self.parts if not isinstance(p, str)]

    def fields(self) -> dict[str, Any]:
        """OpenAI's assistant message fields: the texts joined (null beside calls when empty)."""
        content = "".join(p for p in self.parts if isinstance(p, str))
        thought = {} if self.reasoning is None else {"reasoning_content": self.reasoning}
        if not self.calls:
            return {"content": content, **thought}
        return {"content": content.strip() or None, **thought, "tool_calls": self.calls}


class ReplyStream:
    """A chat reply's deltas as its text streams: `reasoning_content` pieces, then `content`
    (or `tool_calls`) pieces; they concatenate to `OutputPlan.finalize`'s fields."""

    def __init__(self, plan: OutputPlan) -> None:
        harmony = plan.harmony()
        self.harmony = None if harmony is None else harmony.stream(new_id=new_call_id)
        self.reasoning = None if plan.reasoning is None or self.harmony is not None \
            else plan.reasoning.stream()
        self.tools: ToolCallStream | HarmonyStream | None = None
        if plan.tools is not None:
            self.tools = self.harmony or ToolCallStream(syntax=plan.syntax)

    @property
    def tool_calls(self) -> bool:
        return self.tools is not None and bool(self.tools.tool_calls)

    def finish_reason(self, finish: str) -> str:
        """The reply's finish reason once streamed: `tool_calls` for a stop after calls."""
        return "tool_calls" if self.tool_calls and finish == "stop" else finish

    def push(self, text: str) -> list[dict[str, Any]]:
        if self.harmony is not None:
            return self.harmony.push(text)
        if self.reasoning is None:
            return self._content(text)
        return self._deltas(*self.reasoning.push(text))

    def finish(self) -> list[dict[str, Any]]:
        if self.harmony is not None:
            return self.harmony.finish()
        deltas = [] if self.reasoning is None else self._deltas(*self.reasoning.finish())
        return deltas + (self.tools.finish() if self.tools is not None else [])

    def _deltas(self, content: str, thought: str) -> list[dict[str, Any]]:
        return ([{"reasoning_content": thought}] if thought else []) + self._content(content)

    def _content(self, text: str) -> list[dict[str, Any]]:
        if self.tools is not None:
            return self.tools.push(text)
        return [{"content": text}] if text else []


def plan_output(req: SamplingFields, n_vocab: int, vocab: GrammarVocab | None = None, *,
                template_source: str = "") -> OutputPlan:
    """What shapes this request's output; a 400 for a bad schema, grammar or tool list.
    template_source: the chat template's, whose family writes the tool calls its own way."""
    plan = OutputPlan(syntax=tool_syntax(template_source))
    grammar = _request_grammar(req)
    if isinstance(req, ChatCompletionRequest):
        plan.tools, tool_grammar = _tools(req, template_source,
                                          vocab.specials if vocab is not None else None)
        if tool_grammar is not None:
            if grammar is not None:
                raise bad_request(f"{grammar[1]} cannot be combined with a forced tool_choice",
                                  param="tool_choice", code="invalid_value")
            grammar = (tool_grammar, "tool_choice")
    masks: list[LogitMask] = []
    if grammar is not None:
        plan.constraint = _mask(vocab, *grammar)
        masks.append(plan.constraint)
    if req.logit_bias:
        masks.append(LogitBias(_bias_ids(req.logit_bias, n_vocab)))
    plan.logit_mask = chain(*masks)
    return plan


def _request_grammar(req: SamplingFields) -> tuple[str, str] | None:
    """(grammar, the field it came from) for response_format / grammar, or None."""
    try:
        from_format = response_format_to_grammar(req.response_format)
    except GrammarError as exc:
        raise bad_request(f"response_format: {exc}", param="response_format",
                          code="invalid_value") from None
    if req.grammar is None:
        return None if from_format is None else (from_format, "response_format")
    if from_format is not None:
        raise bad_request("give either grammar or a response_format, not both", param="grammar",
                          code="invalid_value")
    try:
        return gbnf_grammar(req.grammar), "grammar"
    except GrammarError as exc:
        raise bad_request(f"grammar: {exc}", param="grammar", code="invalid_value") from None


def _tools(req: ChatCompletionRequest, template_source: str = "",
           specials: Mapping[str, int] | None = None,
           ) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(tools to render, grammar forcing a call or None)."""
    param = "tools"
    try:
        tools_for_prompt(req.tools)  # the tools themselves, before the choice among them
        param = "tool_choice"
        tools = tools_for_prompt(req.tools, req.tool_choice)
        # one forced call unless the request asks for several: llama-server's default (a
        # small model forced to call otherwise writes the call again until max_tokens, the cut
        # copy left as text)
        grammar = tool_choice_grammar(req.tools, req.tool_choice,
                                      parallel=req.parallel_tool_calls is True,
                                      template_source=template_source, specials=specials)
    except GrammarError as exc:
        raise bad_request(f"{param}: {exc}", param=param, code="invalid_value") from None
    return (None if tools is None else [dict(t) for t in tools]), grammar


def _mask(vocab: GrammarVocab | None, grammar: str, param: str) -> GrammarMask:
    if vocab is None:
        raise bad_request(f"{param}: this model's vocabulary cannot be grammar-constrained",
                          param=param, code="unsupported_value")
    try:
        return GrammarMask(vocab, grammar)
    except GrammarError as exc:
        raise bad_request(f"{param}: {exc}", param=param, code="invalid_value") from None


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them; tool-call arguments (JSON text in the API)
    become objects, as Qwen's, Llama's and Hermes' templates write `arguments | tojson`, and a
    call-only message's null content "" (Qwen3's template looks for `</think>` in it)."""
    out = []
    for i, message in enumerate(messages):
        m = message.for_template()
        if m.get("tool_calls"):
            m["tool_calls"] = [_template_call(c, f"messages.{i}.tool_calls.{j}")
                               for j, c in enumerate(m["tool_calls"])]
            if m["content"] is None:  # a call-only message: templates test text, not null
                m["content"] = ""
        out.append(m)
    return out


def chat_messages(messages: Sequence[ChatMessage], template_source: str,
                  template_variables: Collection[str],
                  tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """`template_messages`, with the tool calls and results as text where the template (its
    source, the variables it reads) does not write them, and the tools described in the system
    message where it never reads `tools` (`tool_calls.history_for`)."""
    return history_for(template_messages(messages), template_source, template_variables, tools)


def _template_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where}: a tool call needs function.name", param=where,
                          code="invalid_value")
    try:
        args = call_arguments(fn)
    except json.JSONDecodeError as exc:
        raise bad_request(f"{where}.function.arguments is not valid JSON: {exc}",
                          param=where, code="invalid_value") from None
    return {**call, "type": call.get("type", "function"),
            "function": {**fn, "arguments": args}}


def _bias_ids(bias: dict[str, float], n_vocab: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              param="logit_bias") from None
        if not 0 <= tid < n_vocab:
            raise bad_request(f"logit_bias token id {tid} is outside the vocabulary "
                              f"(0..{n_vocab - 1})", param="logit_bias")
        out[tid] = value
    return out


def token_piece(token_bytes: TokenBytes, tid: int) -> tuple[str, list[int]]:
    """A token's text (its bytes decoded, a split character replaced) and its bytes."""
    b = token_bytes(tid)
    return b.decode("utf-8", errors="replace"), list(b)


def token_logprobs(lps: Sequence[TokenLogprob], token_bytes: TokenBytes, *,
                   with_id: bool = False) -> list[dict[str, Any]]:
    """Each token's `token` (its text), `logprob` and `bytes`, with its `top_logprobs` alike:
    the entries of OpenAI's chat logprobs, of Ollama's `logprobs` and (with_id: each with its
    `id`) of llama-server's `completion_probabilities`."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = token_piece(token_bytes, token_id)
        out = {"id": token_id} if with_id else {}
        return {**out, "token": text, "logprob": logprob, "bytes": raw}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps]
