"""ChatSession on a fake engine and a character-level fake tokenizer (real ChatML template).

The fake engine's "model" reads its own KV cells: it answers the last user message `m` with
`<m>` then `<|im_end|>`, deciding each next token from the cells below the query position. So a
reply comes out right only if the KV really holds the conversation, and every forward is
recorded, which pins what each turn prefilled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from minfer.chat.kv import KVMirror, common_prefix
from minfer.chat.session import ChatConfig, ChatError, ChatSession, TurnReport
from minfer.engine.generate import Piece
from minfer.errors import ContextOverflowError, MinferError
from minfer.tokenizer.chat import CHATML, ChatTemplate

IM_START, IM_END, EOT = 1, 2, 3
SPECIALS = {"<|im_start|>": IM_START, "<|im_end|>": IM_END, "<|endoftext|>": EOT}
OFFSET = 10  # ASCII character c is token OFFSET + ord(c)
N_VOCAB = OFFSET + 128


class FakeTokenizer:
    eot_ids = frozenset({IM_END, EOT})

    def encode_prompt(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for s, tid in SPECIALS.items():
                if text.startswith(s, i):
                    ids.append(tid)
                    i += len(s)
                    break
            else:
                ids.append(OFFSET + ord(text[i]))
                i += 1
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        for s, tid in SPECIALS.items():
            if tid == token_id:
                return s.encode()
        return chr(token_id - OFFSET).encode() if token_id >= OFFSET else b""

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode()


TOK = FakeTokenizer()


def echo_policy(context: str) -> str:
    """The next piece of text after `context`: the reply `<m>` to the last user message m."""
    head, sep, generated = context.rpartition("<|im_start|>assistant\n")
    user = head.rpartition("<|im_start|>user\n")[2].partition("<|im_end|>")[0]
    reply = f"<{user}>"
    if not sep or not reply.startswith(generated) or generated == reply:
        return "<|im_end|>"
    return reply[len(generated)]


@dataclass
class FakeEngine:
    n_ctx: int = 512
    policy: object = echo_policy
    calls: list[tuple[list[int], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cells = np.full(self.n_ctx, -1, np.int64)

    def forward(self, tokens: Sequence[int], start_pos: int, n_out: int = 1) -> np.ndarray:
        if start_pos + len(tokens) > self.n_ctx:
            raise ContextOverflowError(f"{start_pos + len(tokens)} > {self.n_ctx}")
        assert np.all(self.cells[:start_pos] >= 0), "a read below the cursor hit an empty cell"
        self.cells[start_pos : start_pos + len(tokens)] = tokens
        self.calls.append((list(tokens), start_pos))
        out = np.zeros((n_out, N_VOCAB), np.float32)
        for row, pos in enumerate(range(start_pos + len(tokens) - n_out, start_pos + len(tokens))):
            context = TOK.decode([int(t) for t in self.cells[: pos + 1]])
            out[row, TOK.encode_prompt(self.policy(context))[0]] = 10.0  # type: ignore[operator]
        return out


@dataclass
class ShiftingFakeEngine(FakeEngine):
    """A FakeEngine whose cells can be moved (what a context shift does to the real KV)."""

    shifts: list[tuple[int, int, int]] = field(default_factory=list)

    def shift_kv(self, *, src_start: int, src_end: int, dst_start: int) -> None:
        n = src_end - src_start
        self.cells[dst_start:dst_start + n] = self.cells[src_start:src_end].copy()
        self.cells[dst_start + n:] = -1  # past the new cursor nothing may be read
        self.shifts.append((src_start, src_end, dst_start))


@dataclass
class GreedySampler:
    seed: int = 7
    resets: list[tuple[list[int], int | None]] = field(default_factory=list)

    def sample(self, logits: np.ndarray) -> int:
        return int(np.argmax(logits))

    def accept(self, token_id: int) -> None:
        pass

    def reset(self, prompt_tail: Sequence[int] = (), *, seed: int | None = None) -> None:
        self.resets.append((list(prompt_tail), seed))


def make(n_ctx: int = 512, *, system: str | None = None, template: str = CHATML,
         shifting: bool = False, **config: object) -> tuple[ChatSession, FakeEngine, GreedySampler]:
    engine = ShiftingFakeEngine(n_ctx) if shifting else FakeEngine(n_ctx)
    sampler = GreedySampler()
    session = ChatSession(engine, TOK, ChatTemplate(template), sampler, system=system,
                          config=ChatConfig(**config))  # type: ignore[arg-type]
    return session, engine, sampler


def turn(events: object) -> tuple[str, TurnReport]:
    text, report = [], None
    for e in events:  # type: ignore[attr-defined]
        if isinstance(e, Piece):
            text.append(e.text)
        else:
            report = e
    assert isinstance(report, TurnReport)
    return "".join(text), report


def render_ids(session: ChatSession, messages: list[dict[str, str]], gen: bool) -> list[int]:
    return TOK.encode_prompt(session.template.render(messages, add_generation_prompt=gen))


# -- delta prefill ---------------------------------------------------------------------------------
def test_each_turn_prefills_exactly_its_delta_and_kv_stays_canonical() -> None:
    s, engine, _ = make(system="Be brief.")
    for i, msg in enumerate(["hi", "how are you", "bye"]):
        before = s.kv.cursor
        n_calls = len(engine.calls)
        target = render_ids(s, [*s.messages, {"role": "user", "content": msg}], True)
        text, report = turn(s.say(msg))
        assert text == f"<{msg}>"
        delta = target[before:]
        assert engine.calls[n_calls] == (delta, before)  # one forward: the delta at the cursor
        assert report.n_prefilled == len(delta)
        assert report.n_re_renders == 0 and not report.re_rendered
        assert report.reason == "eos" and report.n_generated == len(text) + 1
        # the EOT was forwarded, so the KV is the canonical render of the whole conversation
        assert engine.calls[-1] == ([IM_END], s.kv.cursor - 1)
        canonical = render_ids(s, s.messages, False)
        assert s.kv.tokens == canonical[:-1]  # all but the "\n" the next delta starts with
        assert list(engine.cells[: s.kv.cursor]) == s.kv.tokens
        assert report.n_kv == s.kv.cursor
        if i:
            assert delta[:3] == TOK.encode_prompt("\n<|im_start|>u")


def test_length_capped_turn_gets_its_end_of_turn_token_in_the_next_delta() -> None:
    s, engine, _ = make(max_tokens=3)
    text, r1 = turn(s.say("hello"))
    assert (text, r1.reason) == ("<he", "length")
    assert s.kv.tokens[-1] != IM_END  # nothing written for the cut turn yet
    before = s.kv.cursor
    n_calls = len(engine.calls)
    text2, r2 = turn(s.say("xy"))
    assert text2 == "<xy"
    delta = engine.calls[n_calls][0]
    # the last sampled token was never forwarded; then the end-of-turn token, then the message
    assert delta[:4] == TOK.encode_prompt("e<|im_end|>\n<|im_start|>")
    assert r2.eot_inserted and r2.n_prefilled == len(delta) and not r2.re_rendered
    canonical = render_ids(s, s.messages[:-1], True)
    assert s.kv.tokens[: len(canonical)] == canonical
    assert before == len(render_ids(s, s.messages[:1], True)) + 2


def test_stop_string_spanning_tokens_is_trimmed_from_the_kv() -> None:
    s, _engine, _ = make(stops=("hi>",))
    text, r1 = turn(s.say("hi"))
    assert (text, r1.reason) == ("<", "stop")
    assert TOK.decode(s.kv.tokens).endswith("assistant\n<")  # "h", "i" forwarded, then trimmed
    _, r2 = turn(s.say("ok"))
    assert not r2.re_rendered and r2.eot_inserted
    assert s.messages[1]["content"] == "<"


def test_template_that_rewrites_history_falls_back_to_a_counted_re_render() -> None:
    rewriting = CHATML.replace("message['content']",
                               "(message['content'] | replace('<', '[') if message['role'] == "
                               "'assistant' else message['content'])")
    s, engine, _ = make(template=rewriting)
    turn(s.say("hi"))
    kv_before = s.kv.tokens
    target = render_ids(s, [*s.messages, {"role": "user", "content": "yo"}], True)
    lcp = common_prefix(kv_before, target)
    assert lcp < len(kv_before)
    n_calls = len(engine.calls)
    text, r2 = turn(s.say("yo"))
    assert text == "<yo>"
    assert r2.re_rendered and r2.n_re_renders == 1 and s.n_re_renders == 1
    assert engine.calls[n_calls] == (target[lcp:], lcp)  # only the rewritten tail is re-prefilled
    assert r2.n_prefilled == len(target) - lcp


# -- /regen and /clear -----------------------------------------------------------------------------
def test_regen_rewinds_to_the_turn_start_and_overwrites() -> None:
    s, engine, sampler = make(system="S")
    turn(s.say("one"))
    turn(s.say("two"))
    kv_after, start, n_msgs = s.kv.tokens, s.turn_start, len(s.messages)
    delta = engine.calls[-len("<two>") - 2][0]  # the turn-2 prefill call
    n_calls = len(engine.calls)
    text, r = turn(s.regen())
    assert text == "<two>" and r.regen and r.n_prefilled == len(delta)
    assert engine.calls[n_calls] == (delta, start)  # re-prefilled at the old turn start
    assert start < len(kv_after)
    assert s.kv.tokens == kv_after and len(s.messages) == n_msgs
    assert sampler.resets[-1][1] != sampler.resets[-2][1]  # a new draw seed


def test_regen_without_a_reply_is_refused() -> None:
    s, _, _ = make()
    with pytest.raises(ChatError):
        s.regen()


def test_clear_keeps_the_system_rows() -> None:
    s, engine, _ = make(system="Sys")
    turn(s.say("a"))
    turn(s.say("b"))
    s.clear()
    system_ids = render_ids(s, s.messages, False)
    assert s.messages == [{"role": "system", "content": "Sys"}]
    assert s.kv.tokens == system_ids
    n_calls = len(engine.calls)
    text, r = turn(s.say("c"))
    assert text == "<c>" and engine.calls[n_calls][1] == len(system_ids) and not r.re_rendered


# -- context overflow ------------------------------------------------------------------------------
def test_overflow_drops_oldest_turns_keeps_the_system_prompt_and_fits() -> None:
    s, engine, _ = make(n_ctx=160, system="SYS", max_tokens=16, overflow="reprefill")
    system_ids = render_ids(s, s.messages, False)
    overflowed = []
    for i in range(30):
        msg = f"m{i:02d}"
        kv_before = s.kv.tokens
        text, r = turn(s.say(msg))
        assert text == f"<{msg}>"  # the model still sees the right context
        assert s.messages[0] == {"role": "system", "content": "SYS"}
        assert s.kv.cursor <= s.n_ctx
        assert s.kv.tokens[: len(system_ids)] == system_ids
        if r.n_dropped:
            overflowed.append(r)
            # re-prefill of the kept history after what it shares with the old KV (the system
            # rows, and here also "<|im_start|>user\nm" of the first dropped turn)
            target = render_ids(s, s.messages[:-1], True)
            assert r.n_prefilled == len(target) - common_prefix(kv_before, target)
            assert len(system_ids) <= common_prefix(kv_before, target) <= len(system_ids) + 8
    assert len(overflowed) >= 3
    # the transcript (what --session saves) still has every turn
    assert [m["content"] for m in s.transcript()][1::2] == [f"m{i:02d}" for i in range(30)]
    assert all(max(p + len(t) for t, p in engine.calls) <= 160 for _ in [0])


def test_reply_reaching_the_end_of_the_context_drops_turns_and_goes_on() -> None:
    s, engine, _ = make(n_ctx=64, max_tokens=40, reserve=2, keep=0.5, overflow="reprefill")
    turn(s.say("abc"))
    long = "x" * 14
    target = render_ids(s, [*s.messages, {"role": "user", "content": long}], True)
    assert len(target) + 2 <= 64 < len(target) + len(long) + 3  # the prompt fits, the reply not
    n_calls = len(engine.calls)
    text, r = turn(s.say(long))
    assert text == f"<{long}>" and r.reason == "eos" and r.n_dropped == 1
    resumed = [(t, p) for t, p in engine.calls[n_calls:] if len(t) > 1][1]
    assert resumed[1] <= 6  # the kept history (after "<|im_start|>user\n") and the reply so far
    assert s.messages == [{"role": "user", "content": long},
                              {"role": "assistant", "content": f"<{long}>"}]
    assert s.kv.cursor <= 64


def test_overflow_by_shift_moves_the_kept_rows_and_prefills_only_the_delta() -> None:
    s, engine, _ = make(n_ctx=160, system="SYS", max_tokens=16, shifting=True)
    assert isinstance(engine, ShiftingFakeEngine) and s.overflow == "shift"
    system_ids = render_ids(s, s.messages, False)
    shifted = []
    for i in range(30):
        msg = f"m{i:02d}"
        kv_before = s.kv.tokens
        n_calls = len(engine.calls)
        text, r = turn(s.say(msg))
        assert text == f"<{msg}>"  # the echo model reads the moved cells: they hold the history
        assert list(engine.cells[: s.kv.cursor]) == s.kv.tokens
        assert s.kv.tokens[: len(system_ids)] == system_ids
        canonical = render_ids(s, s.messages, False)
        assert s.kv.tokens == canonical[:-1]  # still the canonical render of what is kept
        if r.n_dropped:
            shifted.append(r)
            assert not r.shift_fallback and r.n_shifted > 0
            src, end, dst = engine.shifts[-1]
            assert dst == len(system_ids) and end == len(kv_before)
            assert r.n_shifted == end - src
            # only the new message's delta is forwarded, at the end of the moved rows
            delta, pos = engine.calls[n_calls]
            assert pos == dst + r.n_shifted
            assert r.n_prefilled == len(delta) == len(
                render_ids(s, s.messages[:-1], True)) - pos
            assert r.n_prefilled == len(TOK.encode_prompt(
                f"\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n"))
    assert len(shifted) >= 3 and s.n_shift_fallbacks == 0
    assert s.kv.n_shifted == sum(r.n_shifted for r in shifted)


def test_reply_reaching_the_end_of_the_context_shifts_and_goes_on() -> None:
    s, engine, _ = make(n_ctx=64, max_tokens=40, reserve=2, keep=0.5, shifting=True)
    turn(s.say("abc"))
    long = "x" * 14
    text, r = turn(s.say(long))
    assert text == f"<{long}>" and r.reason == "eos" and r.n_dropped == 1 and r.n_shifted > 0
    assert s.messages == [{"role": "user", "content": long},
                              {"role": "assistant", "content": f"<{long}>"}]
    assert list(engine.cells[: s.kv.cursor]) == s.kv.tokens
    assert s.kv.tokens == render_ids(s, s.messages, False)[:-1]
    text, r = turn(s.regen())  # the turn start moved with the rows
    assert text == f"<{long}>" and s.kv.tokens == render_ids(s, s.messages, False)[:-1]


def test_shift_that_is_not_prefix_consistent_falls_back_to_re_prefill() -> None:
    # a template that counts the messages up front: dropping turns rewrites the head of the render
    numbered = "{{ '#' ~ (messages | length) ~ '\n' }}" + CHATML
    s, engine, _ = make(n_ctx=160, system="SYS", max_tokens=16, shifting=True, template=numbered)
    fallbacks = 0
    for i in range(20):
        text, r = turn(s.say(f"m{i:02d}"))
        assert text == f"<m{i:02d}>"
        assert list(engine.cells[: s.kv.cursor]) == s.kv.tokens
        if r.n_dropped:
            assert r.shift_fallback and r.n_shifted == 0
            fallbacks += 1
    assert fallbacks >= 2 and s.n_shift_fallbacks == fallbacks and not engine.shifts  # type: ignore[attr-defined]


def test_unknown_overflow_strategy_is_refused() -> None:
    with pytest.raises(MinferError):
        make(overflow="truncate")


def test_a_message_that_cannot_fit_is_refused_and_forgotten() -> None:
    s, _, _ = make(n_ctx=40, system="S")
    turn(s.say("a"))
    kept = list(s.messages)
    with pytest.raises(ContextOverflowError):
        s.say("y" * 60)
    assert s.messages == kept and s.dropped == []  # nothing dropped for a turn that failed


# -- interruption, restore -------------------------------------------------------------------------
def test_interrupted_reply_keeps_the_text_so_far_and_the_kv_consistent() -> None:
    s, _, _ = make()
    events = s.say("abcdef")
    pieces = [next(events), next(events), next(events)]
    events.close()  # what the REPL does on Ctrl-C
    assert "".join(p.text for p in pieces if isinstance(p, Piece)) == "<ab"
    report = s.last_report
    assert report is not None and report.reason == "interrupted"
    assert s.messages[-1] == {"role": "assistant", "content": "<ab"}
    assert TOK.decode(s.kv.tokens).endswith("assistant\n<a")  # "b" was sampled, not forwarded
    text, r = turn(s.say("q"))
    assert text == "<q>" and not r.re_rendered and r.eot_inserted


def test_restore_prefills_the_history_once_then_deltas() -> None:
    s, engine, _ = make(system="S")
    history = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
               {"role": "assistant", "content": "<a>"}]
    n = s.restore(history)
    assert n == len(render_ids(s, history, False)) == s.kv.cursor
    assert len(engine.calls) == 1
    text, r = turn(s.say("b"))
    assert text == "<b>" and not r.re_rendered
    assert r.n_prefilled == len(render_ids(s, s.messages[:-1], True)) - n
    # /regen right after a restore rewinds to the restored last user message
    s2, _engine2, _ = make(system="S")
    s2.restore(history)
    text, r = turn(s2.regen())
    assert text == "<a>" and r.n_prefilled == len(render_ids(s2, history[:2], True)) - len(
        render_ids(s2, history[:1], False))


def test_kv_mirror_refuses_gaps_and_tracks_rewrites() -> None:
    engine = FakeEngine(32)
    kv = KVMirror(engine)
    kv.forward([11, 12, 13], 0)
    kv.forward([14], 1)
    assert kv.tokens == [11, 14] and kv.cursor == 2
    with pytest.raises(Exception, match="gap"):
        kv.forward([1], 5)
    with pytest.raises(ContextOverflowError):
        kv.forward([1] * 40, 0)
    assert kv.tokens == []  # the failed write forgot what it would have overwritten
