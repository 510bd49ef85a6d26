"""The chat REPL: piped input on the fake session, and a person at a terminal on a tiny model."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path

import pytest

from minfer.chat import store
from minfer.chat.repl import CONTROL_CHARS, PipeReader, Repl, ReplOptions, ReplyWriter, is_command
from tests.test_chat_session import make


def run_piped(text: str, **options: object) -> tuple[int, str, str, Repl]:
    session, _, _ = make(system="S")
    out, err = io.StringIO(), io.StringIO()
    opts = ReplOptions(interactive=False, **options)  # type: ignore[arg-type]
    repl = Repl(session, opts, reader=PipeReader(io.StringIO(text), multiline=opts.multiline),
                writer=ReplyWriter(color=False, interactive=False, out=out, err=err))
    return repl.run(), out.getvalue(), err.getvalue(), repl


def test_piped_lines_are_turns_and_replies_are_plain() -> None:
    rc, out, err, repl = run_piped("hi\n\n/regen\n/clear\nyo\n/nope\n/usr/bin is a path\n")
    assert rc == 0
    assert out == "<hi>\n<hi>\n<yo>\n</usr/bin is a path>\n"
    assert "(conversation cleared)" in err and "unknown command /nope" in err
    assert [m["role"] for m in repl.session.messages] == ["system", "user", "assistant",
                                                          "user", "assistant"]


@pytest.mark.parametrize("leave", ["/exit", "/quit", "/bye"])
def test_exit_commands_end_the_session(leave: str) -> None:
    rc, out, err, _ = run_piped(f"hi\n{leave}\nnever read\n")
    assert rc == 0 and out == "<hi>\n" and "unknown command" not in err


def test_verbose_reports_each_turn_on_stderr() -> None:
    _, _out, err, repl = run_piped("a\nb\n/regen\n", verbose=True)
    lines = [ln for ln in err.splitlines() if ln.startswith("[turn")]
    assert len(lines) == 3
    r2 = repl.session.reports[1]
    assert lines[1].startswith(f"[turn 2: prefilled {r2.n_prefilled} tokens (delta), "
                               f"{r2.n_kv} in KV, generated 4 (eos")
    assert "regenerated" in lines[2]


def test_multiline_blocks_and_single_turn() -> None:
    _, out, _, _ = run_piped("a\nb\n\n\nc\n", multiline=True)
    assert out == "<a\nb>\n<c>\n"
    _, out, _, _ = run_piped("never read\n", single_turn=True, first_prompt="p")
    assert out == "<p>\n"


def test_a_failed_turn_is_reported_and_the_exit_status_says_so() -> None:
    rc, out, err, _ = run_piped("/regen\nok\n")
    assert rc == 2 and out == "<ok>\n" and "nothing to regenerate" in err


def test_session_file_is_saved_after_every_turn(tmp_path: Path) -> None:
    session, _, _ = make()
    path = tmp_path / "s.json"
    saves: list[int] = []

    def save(s: object) -> None:
        store.save(path, session.transcript())
        saves.append(len(session.messages))

    repl = Repl(session, ReplOptions(interactive=False),
                reader=PipeReader(io.StringIO("one\ntwo\n/clear\n"), multiline=False),
                writer=ReplyWriter(color=False, interactive=False, out=io.StringIO(),
                                   err=io.StringIO()), on_change=save)
    repl.run()
    assert saves == [2, 4, 0]
    assert store.load(path).messages == []  # type: ignore[union-attr]


def test_reasoning_is_dimmed_when_colour_is_on() -> None:
    out = io.StringIO()
    w = ReplyWriter(color=True, interactive=True, out=out, err=io.StringIO())
    for piece in ["<thi", "nk>plan</th", "ink>answer\x1b[31m"]:
        w.piece(piece)
    w.end_reply()
    text = out.getvalue()
    assert "\x1b[2m<think>plan</think>\x1b[0manswer" in text.replace("\x1b[0m\x1b[2m", "")
    assert "answer" in text and "\x1b[31m" not in text  # model output cannot drive the terminal


def test_ctrl_c_stops_the_reply_but_not_the_session() -> None:
    session, engine, _ = make()
    forward = engine.forward
    calls = {"n": 0}

    def interrupting_forward(tokens: list[int], start_pos: int, n_out: int = 1) -> object:
        calls["n"] += 1
        if calls["n"] == 4:  # the third decode step of the first reply
            raise KeyboardInterrupt
        return forward(tokens, start_pos, n_out)

    engine.forward = interrupting_forward  # type: ignore[method-assign]
    out, err = io.StringIO(), io.StringIO()
    repl = Repl(session, ReplOptions(interactive=False),
                reader=PipeReader(io.StringIO("abcdef\nnext\n"), multiline=False),
                writer=ReplyWriter(color=False, interactive=False, out=out, err=err))
    assert repl.run() == 0
    assert out.getvalue() == "<ab\n<next>\n" and "(reply stopped)" in err.getvalue()
    assert session.reports[0].reason == "interrupted" and not session.reports[1].re_rendered
    assert session.messages[1] == {"role": "assistant", "content": "<ab"}


def test_command_syntax() -> None:
    assert is_command("/regen") and is_command(" /EXIT ") and is_command("/bye")
    assert not is_command("/usr/bin/env") and not is_command("/regen please")


# -- a person at a terminal ------------------------------------------------------------------------
@pytest.mark.slow
def test_repl_at_a_terminal(tiny_qwen2: Path, tmp_path: Path) -> None:
    pexpect = pytest.importorskip("pexpect")
    session_file = tmp_path / "chat.json"
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm",
           "NUMBA_NUM_THREADS": "1", "MINFER_BACKEND": "cpu"}
    child = pexpect.spawn(sys.executable, ["-m", "minfer.cli.main", "chat", str(tiny_qwen2),
                                           "-n", "6", "--temp", "1", "--seed", "1", "-c", "256",
                                           "-t", "1", "--verbose", "--session", str(session_file)],
                          env=env, encoding="utf-8", timeout=240, dimensions=(50, 200))

    def saved_reply() -> str:
        content = store.load(session_file).messages[-1]["content"]  # type: ignore[union-attr]
        return CONTROL_CHARS.sub("\ufffd", content).strip("\n")

    report = r"\[turn {}: prefilled (\d+) tokens \(delta\), (\d+) in KV"
    try:
        child.expect("/help for commands")
        child.expect(">>>")
        child.sendline("hello there")
        child.expect(report.format(1))
        n1, kv1 = int(child.match.group(1)), int(child.match.group(2))
        child.expect(">>>")
        child.send("half a thought")
        child.sendcontrol("c")  # drops the line being typed
        child.expect(">>>")
        child.sendline("and again")
        child.expect(report.format(2))
        n2, kv2 = int(child.match.group(1)), int(child.match.group(2))
        assert n2 < kv1 + n1 and kv2 > kv1  # the second turn prefilled only its delta
        reply2 = _reply_after(child.before, "and again")
        child.expect(">>>")
        assert reply2 == saved_reply()  # the screen shows the reply that was kept
        child.sendline("/regen")
        child.expect(report.format(3) + ".*regenerated")
        n3, kv3 = int(child.match.group(1)), int(child.match.group(2))
        assert n3 == n2 and kv3 < kv2 + n3  # rewound to the turn start, the delta re-prefilled
        reply3 = _reply_after(child.before, "/regen")
        child.expect(">>>")
        assert reply3 == saved_reply()
        child.sendline("/clear")
        child.expect(r"\(conversation cleared\)")
        child.expect(">>>")
        child.sendline("/help")
        child.expect("/regen +generate the last reply again")
        child.expect(">>>")
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert store.load(session_file).messages == []  # type: ignore[union-attr]


def _reply_after(screen: str, typed: str) -> str:
    """The reply printed after the echo of `typed` (escape sequences and CRs removed)."""
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen).replace("\r", "")
    return plain[plain.rindex(typed) + len(typed):].strip("\n")


# -- the CLI with piped input on a tiny model ------------------------------------------------------
def _minfer(args: list[str], stdin: str) -> tuple[int, str, str]:
    import subprocess

    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "MINFER_BACKEND": "cpu"}
    p = subprocess.run([sys.executable, "-m", "minfer.cli.main", *args], input=stdin,
                       capture_output=True, text=True, env=env, timeout=600)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.slow
def test_piped_chat_and_run_cnv_and_session_restore(tiny_qwen2: Path, tmp_path: Path) -> None:
    common = ["-n", "4", "--temp", "0", "-c", "256", "-t", "1", "--verbose"]
    rc, out, err = _minfer(["chat", str(tiny_qwen2), *common], "first\nsecond\n")
    assert rc == 0, err
    turns = re.findall(r"\[turn (\d): prefilled (\d+) tokens \(delta\), (\d+) in KV", err)
    assert [t[0] for t in turns] == ["1", "2"]
    assert int(turns[1][1]) < int(turns[0][1]) + int(turns[0][2])  # turn 2: only its delta

    rc, out2, err2 = _minfer(["run", "--cnv", str(tiny_qwen2), *common[:-1]], "first\nsecond\n")
    assert rc == 0 and out2 == out, err2  # same replies through `run --cnv`

    path = tmp_path / "s.json"
    rc, _, err = _minfer(["chat", str(tiny_qwen2), *common, "--session", str(path)], "first\n")
    assert rc == 0, err
    rc, _, err = _minfer(["chat", str(tiny_qwen2), *common, "--session", str(path)], "second\n")
    assert rc == 0, err
    assert re.search(r"\[restored 2 messages: prefilled \d+ tokens\]", err)
    saved = store.load(path)
    assert saved is not None and [m["content"] for m in saved.messages][::2] == ["first", "second"]
