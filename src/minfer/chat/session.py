"""A multi-turn conversation over one engine: append-only KV, delta prefill, rollback, overflow.

The session owns a `KVMirror` (the token in every written KV cell; the write cursor is its
length), the messages, and `turn_start`, the cell where the last turn's prefill began.

A user turn renders the whole conversation with the model's template
(`add_generation_prompt=True`) and tokenizes it. Normally what the KV holds is a prefix of that
render, and only the rest — the delta — is prefilled at the cursor: a turn costs O(delta), not
O(history). A template that rewrites history (Qwen3 drops earlier `<think>` blocks) breaks the
prefix; the session then rewinds to the longest common prefix, re-prefills the rest and counts a
re-render (a harmony reply is kept as its final message, the `reply_content` the CLI gives, so
every gpt-oss turn re-renders from the reply on). Rows are position-addressed and a token's
attention window ends at its own cell, so rewinding is just moving the cursor: stale rows beyond
it are never read and get overwritten.
A model with recurrent layers (LFM2) cannot rewind its state by truncation: there a turn that
would rewind (a re-render, /regen, a trimmed reply, an overflow) goes back to the furthest state
checkpoint before that point (`KVMirror.rewind`: one is kept at each turn's end, and after each
prefill chunk) and prefills from there, and an overflow never shifts: the kept turns' state is
recomputed from the furthest checkpoint before the dropped turns (the system prompt's end,
else position 0), exact, and the turn says so (`TurnReport.state_recomputed`; llama.cpp
refuses a context shift on these models and stops).

KV-consistency invariant (between turns): the KV holds a prefix of the template's canonical
render of the conversation. Hence an end-of-generation token is written into the KV before a turn
ends (the template's end-of-turn token, e.g. `<|im_end|>`); a turn that ended without one (length
cap, stop string, Ctrl-C) is trimmed back to the tokens that spell its kept text, and the next
delta inserts the end-of-turn token at the cursor before the new message (`eot_inserted`).

Context full: before a turn whose prompt plus a reply reserve would not fit, the oldest turns are
dropped (the system prompt stays) until the history fills at most `keep` of the context. A reply
that still reaches the end of the context drops turns the same way and goes on. Two strategies
bring the KV back to (a prefix of) the render of the kept conversation:

- `overflow="shift"`: the kept turns' rows are moved down over the dropped ones in place, their
  keys re-rotated for the new positions (minfer.engine.kv_shift); only the new delta is prefilled.
  This is exact for the tokens and the positions, approximate for the values: rows past the first
  layer were computed while the dropped turns were still in the window (as llama.cpp's context
  shift). It applies when the edit is prefix-consistent — the render of the kept conversation is
  exactly [the rows before the dropped turns] + [the kept turns' rows as they are in the KV] — and
  the engine can shift; otherwise the turn falls back to a re-prefill (`shift_fallback`, counted in
  `n_shift_fallbacks`).
- `overflow="reprefill"`: the kept history after the shared prefix (the system rows) is prefilled
  again (exact; its cost is reported as that turn's `n_prefilled`).

Images (`say(text, images=...)`, given an `ImagePrompt`: a model's vision encoder): a user
message keeps its images' file bytes; each render puts the media marker before its text and the
prompt's image blocks take the encoder's rows (minfer.engine.vision.prompt). Two images of the
same size are the same placeholder ids, so a turn reuses the KV rows of an image only where
the cells were given that image's rows at that place (a chat's next turn about the same picture
prefills only its new text); from the first other image on it prefills again, the encoder's
cache sparing the tower (`VisionEncoder.encode`). After a context overflow the KV is reused
only up to the first image. A saved transcript keeps the text, not the images.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from minfer.chat.kv import ForwardEngine, KVMirror, common_prefix
from minfer.engine.core.request import Block, PromptRows, held_blocks, reach_past_blocks
from minfer.engine.generate import Finished, Piece, generate, prefill
from minfer.engine.vision.prompt import MARKER
from minfer.errors import ContextOverflowError, MinferError, TemplateError

if TYPE_CHECKING:
    from minfer.engine.core.proposer import Speculator
    from minfer.engine.forward import Engine

Message = dict[str, Any]  # role, content (text), and a user message's images (file bytes)
# a rendered prompt with image markers and the images' bytes -> its ids and the images' rows
ImagePrompt = Callable[[str, Sequence[bytes]], tuple[list[int], tuple[PromptRows, ...]]]


class ChatError(MinferError):
    """A chat command that cannot run now (e.g. /regen with nothing to regenerate)."""


class ChatTokenizer(Protocol):
    eot_ids: frozenset[int]

    def encode_prompt(self, text: str) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class ChatRenderer(Protocol):
    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True) -> str: ...


class ChatSampler(Protocol):
    seed: int

    def sample(self, logits: Any) -> int: ...

    def accept(self, token_id: int) -> None: ...

    def reset(self, prompt_tail: Sequence[int] = (), *, seed: int | None = None) -> None: ...


@dataclass(frozen=True)
class ChatConfig:
    max_tokens: int = 512
    stops: tuple[str, ...] = ()
    batch_size: int = 512
    reserve: int | None = None  # cells kept free for a reply; None → min(max_tokens+1, n_ctx/4)
    keep: float = 0.5  # after an overflow the history fills at most this share of the context
    overflow: str = "shift"  # shift | reprefill: how the KV follows the dropped turns


@dataclass
class TurnReport:
    turn: int  # 1-based count of replies generated in this session (regenerations included)
    regen: bool = False
    n_prefilled: int = 0  # prompt tokens forwarded for this turn (delta, or a re-prefill)
    n_generated: int = 0  # tokens sampled, the end-of-turn token written to the KV included
    n_kv: int = 0  # tokens in the KV after the turn
    re_rendered: bool = False  # the render did not extend the KV; rewound to the common prefix
    n_re_renders: int = 0  # re-renders so far in the session
    n_dropped: int = 0  # oldest turns dropped for context overflow during this turn
    n_shifted: int = 0  # KV rows moved (and re-rotated) instead of re-prefilled after the drop
    shift_fallback: bool = False  # a shift was wanted but the edit was not prefix-consistent
    # a recurrent model's turns were dropped: its state is never shifted, the kept window's
    # state is recomputed (from the furthest checkpoint before the drop, else position 0)
    state_recomputed: bool = False
    eot_inserted: bool = False  # the previous turn's missing end-of-turn token came in this delta
    reason: str = "interrupted"  # eos | length | stop | context | interrupted
    ids: list[int] = field(default_factory=list)  # the reply's sampled ids (EOT not included)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafted: int = 0  # speculative decoding: tokens proposed and verified this turn
    accepted: int = 0  # ... and kept


TurnEvents = Generator[Piece | TurnReport, None, None]
OVERFLOW_STRATEGIES = ("shift", "reprefill")


class ChatSession:
    """One conversation over one engine. `say` / `regen` yield Pieces, then a TurnReport."""

    def __init__(self, engine: ForwardEngine, tokenizer: ChatTokenizer, template: ChatRenderer,
                 sampler: ChatSampler, *, system: str | None = None,
                 config: ChatConfig | None = None, overflow: str | None = None,
                 speculator: Speculator | None = None,
                 reply_content: Callable[[str], str] | None = None,
                 images: ImagePrompt | None = None) -> None:
        self.kv = KVMirror(engine)
        # what of a reply the history keeps (a harmony reply: its final message; None: all)
        self.reply_content = reply_content
        self.images = images  # None: the model takes no images
        self._embd: tuple[PromptRows, ...] = ()  # the last render's image rows, where they go
        # the image blocks the KV's cells were last given (`_image_cap`)
        self._fed: frozenset[Block] = frozenset()
        self.speculator = speculator  # proposals verified in batches; the output is the same
        self.tokenizer = tokenizer
        self.template = template
        self.sampler = sampler
        self.config = config or ChatConfig()
        self.overflow = overflow if overflow is not None else self.config.overflow
        if self.overflow not in OVERFLOW_STRATEGIES:
            raise MinferError(f"unknown overflow strategy {self.overflow!r} "
                              f"(use {' or '.join(OVERFLOW_STRATEGIES)})")
        self.system = system
        self.messages: list[Message] = self._fresh_messages()
        self.dropped: list[Message] = []  # turns dropped for context room, oldest first
        self.turn_start = 0
        self.reports: list[TurnReport] = []
        self.n_re_renders = 0
        self.n_shift_fallbacks = 0
        self.end_of_turn_id = find_end_of_turn(tokenizer, template)
        self._eot_pending = False
        self._base_seed = int(getattr(sampler, "seed", 0))

    @property
    def n_ctx(self) -> int:
        return self.kv.n_ctx

    @property
    def last_report(self) -> TurnReport | None:
        return self.reports[-1] if self.reports else None

    # -- commands ------------------------------------------------------------------------------
    def say(self, text: str, images: Sequence[bytes] = ()) -> TurnEvents:
        """A user turn (its images, file bytes, before its text): prefill its delta, stream
        the reply, end with the turn's report."""
        if images and self.images is None:
            raise ChatError("this model takes no images: it has no vision encoder (an mmproj "
                            "file: --mmproj FILE, or mmproj*.gguf beside the model)")
        saved = self._snapshot()
        message: Message = {"role": "user", "content": text}
        if images:
            message["images"] = list(images)
        self.messages.append(message)
        report = TurnReport(turn=len(self.reports) + 1)
        try:
            prompt = self._prompt_for_turn(report)
        except BaseException:
            self.messages, self.dropped = saved
            raise
        return self._reply(report, prompt)

    def regen(self) -> TurnEvents:
        """Rewind to the last turn's start and generate its reply again (overwriting the KV)."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            raise ChatError("nothing to regenerate yet")
        saved = self._snapshot()
        self.messages.pop()
        self.kv.rewind(self.turn_start)
        self._eot_pending = False
        report = TurnReport(turn=len(self.reports) + 1, regen=True)
        try:
            prompt = self._prompt_for_turn(report)
        except BaseException:
            self.messages, self.dropped = saved
            raise
        return self._reply(report, prompt)

    def transcript(self) -> list[Message]:
        """The whole conversation: the messages in the context and those dropped for room
        (their text: images are not kept)."""
        head = [m for m in self.messages[:1] if m["role"] == "system"]
        return [{k: v for k, v in m.items() if k != "images"}
                for m in (*head, *self.dropped, *self.messages[len(head):])]

    def clear(self) -> None:
        """Forget the conversation (the system prompt stays, and its KV rows with it)."""
        self.messages = self._fresh_messages()
        self.dropped = []
        keep = common_prefix(self.kv.tokens, self._render_ids(False)) if self.messages else 0
        self.kv.rewind(keep)
        self.turn_start = self.kv.cursor  # keep, or 0 where a recurrent state cannot go back
        self._eot_pending = False

    def restore(self, messages: Sequence[Mapping[str, str]]) -> int:
        """Load a saved conversation and prefill it once; returns the tokens prefilled."""
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        self.dropped = []
        if self.system is not None:
            if self.messages and self.messages[0]["role"] == "system":
                self.messages[0] = {"role": "system", "content": self.system}
            else:
                self.messages.insert(0, {"role": "system", "content": self.system})
        self.kv.rewind(0)
        self._eot_pending = False
        self.turn_start = 0
        if not self.messages:
            return 0
        target = self._render_ids(False)
        if len(target) + self._reserve() > self.n_ctx:
            while len(target) > self._keep_limit() and self._drop_oldest_turn(keep_last=False):
                target = self._render_ids(False)
        if len(target) >= self.n_ctx:
            raise ContextOverflowError(
                f"the saved conversation ({len(target)} tokens) does not fit in the context "
                f"(n_ctx = {self.n_ctx})")
        prefill(self._engine(), target, 0, self.config.batch_size)
        self.turn_start = self._last_turn_start(target)
        return len(target)

    # -- turn mechanics ------------------------------------------------------------------------
    def _prompt_for_turn(self, report: TurnReport) -> list[int]:
        """Render, fit the context, and rewind to what the KV shares with the render."""
        target = self._render_ids(True)
        if len(target) + self._reserve() > self.n_ctx:
            before = list(self.messages)
            while len(target) > self._keep_limit() and self._drop_oldest_turn(keep_last=True):
                report.n_dropped += 1
                target = self._render_ids(True)
            if len(target) >= self.n_ctx:
                raise ContextOverflowError(
                    f"the message does not fit in the context ({len(target)} tokens with the "
                    f"system prompt, n_ctx = {self.n_ctx})")
            if report.n_dropped:
                self._shift_after_drop(report, before, target, [])
        return self._delta(report, target)

    def _delta(self, report: TurnReport, target: list[int]) -> list[int]:
        start = common_prefix(self.kv.tokens, target)
        if start < self.kv.cursor and not report.n_dropped:
            report.re_rendered = True
            self.n_re_renders += 1
        start = min(start, len(target) - 1)  # the last prompt token is forwarded for its logits
        self.kv.rewind(self._image_cap(start))  # image rows are reused where the same
        start = self.kv.cursor  # start, or 0 where a recurrent state cannot go back
        eot = self.end_of_turn_id
        report.eot_inserted = self._eot_pending and eot is not None and eot in target[start:]
        self._eot_pending = False
        self.turn_start = start
        return target[start:]

    def _reply(self, report: TurnReport, prompt: list[int]) -> TurnEvents:
        """Generate after `prompt` (prefilled at the cursor); finish the turn however it ends."""
        cfg = self.config
        self._reset_sampler(self.kv.tokens + prompt)
        reply_start = self.kv.cursor + len(prompt)
        ids: list[int] = []
        text: list[str] = []
        finished: Finished | None = None
        try:
            while True:
                report.n_prefilled += len(prompt)
                finished = None
                self._fed = held_blocks(self._embd, self.kv.cursor + len(prompt))
                events = generate(self._engine(), self.tokenizer, self.sampler, prompt,
                                  max_tokens=cfg.max_tokens - len(ids), stops=cfg.stops,
                                  start_pos=self.kv.cursor, batch_size=cfg.batch_size,
                                  speculator=self.speculator, context=self.kv.tokens,
                                  embd=[e.shifted(-self.kv.cursor) for e in self._embd])
                for event in events:
                    if isinstance(event, Piece):
                        text.append(event.text)
                        yield event
                    else:
                        finished = event
                assert finished is not None
                ids += finished.ids
                report.prefill_s += finished.timings.prefill_s
                report.decode_s += finished.timings.decode_s
                if finished.speculation is not None:
                    report.drafted += finished.speculation.drafted
                    report.accepted += finished.speculation.accepted
                if finished.reason != "context" or len(ids) >= cfg.max_tokens:
                    break
                resumed = self._resume_after_overflow(report, ids)
                if resumed is None:
                    break
                prompt, reply_start = resumed
        finally:
            reason = finished.reason if finished is not None else "interrupted"
            self._end_turn(report, ids, "".join(text), reason, reply_start)
        yield report

    def _resume_after_overflow(self, report: TurnReport,
                               ids: list[int]) -> tuple[list[int], int] | None:
        """The reply hit the end of the context: drop old turns, re-prefill, keep going."""
        target = self._render_ids(True)
        before = list(self.messages)
        dropped = 0
        while len(target) + len(ids) > self._keep_limit() and self._drop_oldest_turn(True):
            dropped += 1
            target = self._render_ids(True)
        if not dropped:
            return None
        report.n_dropped += dropped
        self._shift_after_drop(report, before, target, ids)
        full = target + ids
        self.kv.rewind(min(common_prefix(self.kv.tokens, full), len(full) - 1,
                           self._first_image()))
        start = self.kv.cursor
        self.turn_start = min(self.turn_start, start)
        return full[start:], len(target)

    def _shift_after_drop(self, report: TurnReport, before: list[Message], target: list[int],
                          tail: list[int]) -> None:
        """Move the kept turns' KV rows down over the dropped turns' rows (overflow="shift").

        `before` is the conversation before the drop, `self.messages` the kept one and `target`
        its render (generation prompt added); `tail` follows the render in the KV (the reply so
        far). The dropped messages are `before[first:nxt]`, contiguous after the system prompt.
        With F = render(before), b = len(render(before[:nxt])) (where the kept turns begin in F)
        and a = b - (len(F) - len(target)), the edit is prefix-consistent when target == F[:a] +
        F[b:] and the KV agrees with target on [0, a); then the KV's cells from b on that spell
        target[a:] (+ tail) move to a. Anything else is a counted fallback to the re-prefill.
        """
        if self.kv.recurrent:  # a state holds every token: nothing to shift, all recomputed
            report.state_recomputed = True
            return
        if self.overflow != "shift":
            return
        n_dropped = len(before) - len(self.messages)
        first = next((i for i, m in enumerate(before) if m["role"] != "system"), 0)
        kv = self.kv.tokens
        try:
            full = self._render_ids(True, before)
            b = len(self._render_ids(False, before[:first + n_dropped]))
        except TemplateError:
            full, b = [], -1
        a = b - (len(full) - len(target))
        consistent = (self.kv.can_shift and 0 <= a <= b <= len(kv)
                      and full[:a] == target[:a] and full[b:] == target[a:]
                      and kv[:a] == target[:a])
        if not consistent:
            report.shift_fallback = True
            self.n_shift_fallbacks += 1
            return
        want = target + tail
        n = common_prefix(kv[b:], want[a:])
        if n == 0:
            self.kv.rewind(a)
        else:
            self.kv.shift(b, b + n, a)
            report.n_shifted += n
        # the turn's first cell moves with its rows (or back to where the kept rows end)
        start = self.turn_start
        self.turn_start = start - (b - a) if start >= b else min(start, a)
        self.turn_start = min(self.turn_start, self.kv.cursor)

    def _end_turn(self, report: TurnReport, ids: list[int], text: str, reason: str,
                  reply_start: int) -> None:
        content = text if self.reply_content is None else self.reply_content(text)
        self.messages.append({"role": "assistant", "content": content})
        report.reason = reason
        report.ids = list(ids)
        report.n_generated = len(ids)
        self.reports.append(report)
        self._eot_pending = True
        if reason == "eos":
            eot = self.end_of_turn_id
            if eot is not None and self.kv.cursor < self.n_ctx:
                # The canonical render carries the end-of-turn marker after the reply.
                self.kv.forward([eot], self.kv.cursor)
                report.n_generated += 1
                self._eot_pending = False
        else:
            self._trim_to_text(reply_start, text)
        report.n_kv = self.kv.cursor
        self.kv.checkpoint()  # the next turn, or a /regen of it, starts here
        report.n_re_renders = self.n_re_renders

    def _trim_to_text(self, reply_start: int, text: str) -> None:
        """Rewind past reply tokens whose bytes are not in the kept text (a cut stop string)."""
        want = text.encode("utf-8")
        kept, offset = reply_start, 0
        for token in self.kv.tokens[reply_start:]:
            piece = self.tokenizer.token_bytes(token)
            if not want.startswith(piece, offset):
                break
            kept += 1
            offset += len(piece)
        self.kv.rewind(kept)

    def _reset_sampler(self, context: list[int]) -> None:
        seed = (self._base_seed + len(self.reports)) % (1 << 32)  # /regen draws anew
        self.sampler.reset(context, seed=seed)  # each stage keeps the history it needs

    # -- helpers -------------------------------------------------------------------------------
    def _engine(self) -> Engine:
        return cast("Engine", self.kv)  # generate() only calls forward() and reads n_ctx

    def _snapshot(self) -> tuple[list[Message], list[Message]]:
        return list(self.messages), list(self.dropped)

    def _fresh_messages(self) -> list[Message]:
        return [{"role": "system", "content": self.system}] if self.system is not None else []

    def _render_ids(self, add_generation_prompt: bool,
                    messages: Sequence[Message] | None = None) -> list[int]:
        """The render's ids; of the conversation itself (messages None), its images' rows are
        kept where they go (`_embd`)."""
        msgs = self.messages if messages is None else messages
        images = [data for m in msgs for data in m.get("images", ())]
        text = self.template.render(
            [{"role": m["role"], "content": MARKER * len(m["images"]) + m["content"]}
             if m.get("images") else m for m in msgs],
            add_generation_prompt=add_generation_prompt)
        embd: tuple[PromptRows, ...] = ()
        if not images:
            ids = self.tokenizer.encode_prompt(text)
        elif self.images is None:
            raise ChatError("this model takes no images")
        else:
            ids, embd = self.images(text, images)
        if messages is None:
            self._embd = embd
        return ids

    def _first_image(self) -> int:
        """Where the conversation's first image rows begin (past the end: none)."""
        return self._embd[0].at if self._embd else 1 << 62

    def _image_cap(self, start: int) -> int:
        """start, or the first image of the render before it whose rows the KV was not given
        at that place (another image of the same size has the same placeholder ids)."""
        return reach_past_blocks(self._embd, start, self._fed)

    def _reserve(self) -> int:
        if self.config.reserve is not None:
            return self.config.reserve
        return min(self.config.max_tokens + 1, self.n_ctx // 4)

    def _keep_limit(self) -> int:
        return int((self.n_ctx - self._reserve()) * self.config.keep)

    def _drop_oldest_turn(self, keep_last: bool) -> bool:
        """Remove the first turn after the system prompt; never the last one when keep_last."""
        first = next((i for i, m in enumerate(self.messages) if m["role"] != "system"), None)
        if first is None:
            return False
        nxt = next((i for i in range(first + 1, len(self.messages))
                    if self.messages[i]["role"] == "user"), None)
        if nxt is None:
            if keep_last:
                return False
            nxt = len(self.messages)
        self.dropped += self.messages[first:nxt]
        del self.messages[first:nxt]
        return True

    def _last_turn_start(self, history: list[int]) -> int:
        """Where the last user message starts in `history` (the /regen point after a restore)."""
        last_user = max((i for i, m in enumerate(self.messages) if m["role"] == "user"),
                        default=None)
        if not last_user:
            return 0
        return common_prefix(history, self._render_ids(False, self.messages[:last_user]))


def find_end_of_turn(tokenizer: ChatTokenizer, template: ChatRenderer) -> int | None:
    """The end-of-generation id the template writes after an assistant message (ChatML:
    `<|im_end|>`), found by rendering a probe conversation; None when there is none."""
    probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    try:
        ids = tokenizer.encode_prompt(template.render(probe, add_generation_prompt=False))
    except TemplateError:
        return None
    found = [t for t in ids if t in tokenizer.eot_ids]
    return found[-1] if found else None
