"""Stop strings: matched on bytes across token boundaries and inside multi-byte characters;
nothing of the stop text is ever emitted; flush releases what was held back."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as hs

from minfer.engine.stops import StopMatcher
from minfer.errors import SamplingError


def feed(m: StopMatcher, pieces: list[bytes]) -> tuple[list[bytes], bool]:
    out, stopped = [], False
    for p in pieces:
        emit, stopped = m.push(p)
        out.append(emit)
        if stopped:
            break
    return out, stopped


def test_no_stops_pass_everything_through() -> None:
    m = StopMatcher([])
    assert m.push(b"abc") == (b"abc", False)
    assert m.flush() == b""


def test_stop_inside_one_piece() -> None:
    m = StopMatcher(["STOP"])
    assert m.push(b"hello STOP world") == (b"hello ", True)
    assert m.matched == "STOP" and m.stopped
    assert m.push(b"more") == (b"", True)
    assert m.flush() == b""


def test_stop_across_token_boundaries() -> None:
    m = StopMatcher(["STOP"])
    out, stopped = feed(m, [b"hel", b"lo S", b"TO", b"P!", b"x"])
    assert out == [b"hel", b"lo ", b"", b""] and stopped


def test_false_start_is_released() -> None:
    m = StopMatcher(["abc"])
    assert m.push(b"xab") == (b"x", False)
    assert m.push(b"d") == (b"abd", False)
    assert m.push(b"ab") == (b"", False)
    assert m.flush() == b"ab"


def test_held_tail_is_the_longest_open_prefix() -> None:
    m = StopMatcher(["aab"])
    assert m.push(b"aaa") == (b"a", False)  # "aa" may still become "aab"
    assert m.push(b"b") == (b"", True)


def test_stop_inside_a_multibyte_character() -> None:
    m = StopMatcher(["é"])  # b"\xc3\xa9"
    assert m.push(b"caf\xc3") == (b"caf", False)
    assert m.push(b"\xa9 au lait") == (b"", True)


def test_partial_multibyte_that_is_not_the_stop_is_released() -> None:
    m = StopMatcher(["é"])
    assert m.push(b"\xc3") == (b"", False)
    assert m.push(b"\xa8") == (b"\xc3\xa8", False)  # "è"


def test_cjk_stop_split_over_three_pieces() -> None:
    m = StopMatcher(["日本"])
    text = "今日は日本です".encode()
    i = text.index("日本".encode())
    pieces = [text[: i + 1], text[i + 1 : i + 4], text[i + 4 :]]
    out, stopped = feed(m, pieces)
    assert b"".join(out) == text[:i] and stopped


def test_earliest_stop_wins_and_duplicates_are_merged() -> None:
    m = StopMatcher(["world", "lo", "lo"])
    assert m.stops == (b"world", b"lo")
    assert m.push(b"hello world") == (b"hel", True)
    assert m.matched == "lo"


def test_empty_stop_is_refused() -> None:
    with pytest.raises(SamplingError):
        StopMatcher(["ok", ""])


ALPHABET = ["a", "b", "é", "日", "\n"]


@settings(max_examples=300, deadline=None)
@given(
    text=hs.lists(hs.sampled_from(ALPHABET), max_size=30).map("".join),
    stops=hs.lists(
        hs.lists(hs.sampled_from(ALPHABET), min_size=1, max_size=4).map("".join),
        max_size=3,
    ),
    cuts=hs.lists(hs.integers(min_value=0, max_value=200), max_size=12),
)
def test_any_split_emits_exactly_the_text_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    # with no stop inside another, "first to complete" and "first to start" agree
    assume(not any(a != b and a in b for a in stops for b in stops))
    data = text.encode()
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    starts = [data.find(s.encode()) for s in stops if s.encode() in data]
    want = data[: min(starts)] if starts else data

    m = StopMatcher(stops)
    emitted = b""
    stopped = False
    for p in pieces:
        emit, stopped = m.push(p)
        emitted += emit
        assert want.startswith(emitted)  # never ahead of the truth, never any stop text
        if stopped:
            break
    emitted += m.flush()
    assert emitted == want
    assert stopped == bool(starts)


class _Vocab:
    eot_ids = frozenset({0})

    def token_bytes(self, token_id: int) -> bytes:
        return {1: b"ab", 2: b"c\xc3", 3: b"\xa9d", 4: b"EN", 5: b"D!"}[token_id]


class _Script:
    """A sampler that draws a fixed sequence of ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.accepted = list(ids), []

    def sample(self, logits: object) -> int:
        return self.ids.pop(0)

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)


class _Grammar:
    def __init__(self) -> None:
        self.stopped = False

    def is_stopped(self) -> bool:
        return self.stopped


def test_stepper_text_cuts_characters_and_stop_strings_across_tokens() -> None:
    from minfer.engine.stepper import TokenStepper

    s = TokenStepper(_Script([1, 2, 3, 4, 5]), _Vocab(), stops=["END"])
    steps = [s.step(None) for _ in range(5)]  # type: ignore[arg-type]
    assert [st.text for st in steps] == ["ab", "c", "éd", "", ""]  # é waits for its 2nd byte
    assert [st.end for st in steps] == [None, None, None, None, "stop"]
    assert s.finish("stop") == ""  # the stop text and what followed are never shown


def test_stepper_ends_on_eos_and_grammar_and_releases_the_held_tail() -> None:
    from minfer.engine.stepper import TokenStepper

    sampler = _Script([4, 0])
    s = TokenStepper(sampler, _Vocab(), stops=["END"])
    assert s.step(None).text == ""  # type: ignore[arg-type]  # "EN" may start "END": held
    eos = s.step(None)  # type: ignore[arg-type]
    assert (eos.token, eos.end) == (0, "eos") and s.finish(eos.end) == "EN"
    grammar = _Grammar()
    g = TokenStepper(_Script([1]), _Vocab(), constraint=grammar)
    grammar.stopped = True
    done = g.step(None)  # type: ignore[arg-type]
    assert (done.token, done.end) == (None, "grammar") and g.sampler.accepted == []  # type: ignore[attr-defined]
