"""Per-request output shaping: the logit mask a request samples under, and the final message.

This is the seam for structured output. Today it honours `logit_bias` and `tools` (rendered into
the prompt by the chat template), and refuses by name what it cannot do yet (`response_format`
json_object / json_schema, `grammar`, a forced `tool_choice`). A later change plugs a grammar
matcher in as `OutputPlan.logit_mask` (the sampler applies it first, on the raw logits) and parses
tool calls out of the text in `OutputPlan.finalize`; nothing else in the server needs to change.
The pieces for that exist in `minfer.sampling.grammar` (GrammarMask, response_format_to_grammar)
and `minfer.sampling.tool_calls` (tools_for_prompt, parse_tool_calls, ToolCallStream); what is
left is wiring them here, ending a generation when the mask reports `is_stopped()`
(generation.py) and streaming `tool_calls` deltas (app.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minfer.sampling.mask import LogitMask
from minfer.server.errors import bad_request
from minfer.server.schemas import ChatCompletionRequest, SamplingFields


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


class ChainedMask:
    """Several masks applied in order (e.g. a grammar, then logit_bias)."""

    def __init__(self, masks: Sequence[LogitMask]) -> None:
        self.masks = list(masks)

    def apply(self, logits: np.ndarray) -> None:
        for m in self.masks:
            m.apply(logits)

    def accept(self, token_id: int) -> None:
        for m in self.masks:
            m.accept(token_id)

    def reset(self) -> None:
        for m in self.masks:
            m.reset()


@dataclass
class OutputPlan:
    logit_mask: LogitMask | None = None
    tools: list[dict[str, Any]] | None = None

    def finalize(self, text: str) -> dict[str, Any]:
        """The assistant message's fields for the generated text (tool-call parsing goes here)."""
        return {"content": text}


def plan_output(req: SamplingFields, n_vocab: int) -> OutputPlan:
    """What shapes this request's output; a 400 for what is not supported yet."""
    fmt = req.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        raise bad_request(f"response_format type {fmt.get('type')!r} is not supported yet",
                          param="response_format", code="unsupported_value")
    if req.grammar:
        raise bad_request("grammar-constrained output is not supported yet", param="grammar",
                          code="unsupported_value")
    plan = OutputPlan()
    masks: list[LogitMask] = []
    if req.logit_bias:
        masks.append(LogitBias(_bias_ids(req.logit_bias, n_vocab)))
    if masks:
        plan.logit_mask = masks[0] if len(masks) == 1 else ChainedMask(masks)
    if isinstance(req, ChatCompletionRequest) and req.tools:
        choice = req.tool_choice
        if choice not in (None, "auto", "none"):
            raise bad_request("forcing a tool call (tool_choice) is not supported yet",
                              param="tool_choice", code="unsupported_value")
        if choice != "none":
            plan.tools = req.tools
    return plan


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
