"""A reasoning model's thinking in `minfer run` and the Python API (tiny qwen3 with `<think>`
tokens, the published Qwen3 and R1-distill templates).

The reply is forced with a grammar: `--json` carries content and reasoning_content beside the
raw text; printed, the thinking goes to stderr when stdout is not a terminal and nowhere with
`--hide-reasoning`. A budget of N gives N thinking tokens then the closing tokens, on the CLI and
in `Model.respond`; `--reasoning off` renders Qwen3's empty thinking block into the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import minfer
from minfer.chat.reasoning import FORCED_CLOSE, ReasoningOptions
from minfer.cli.main import main

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
FORCED = 'root ::= "<think>\\nTwo and two.\\n</think>\\n\\nIt is 4."'


@pytest.fixture(scope="module")
def qwen3(think_model: Callable[..., Path]) -> Path:
    return think_model("qwen3")


@pytest.fixture(scope="module")
def r1(think_model: Callable[..., Path]) -> Path:
    return think_model("r1-distill-qwen")


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["run", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_json_carries_both_fields(qwen3: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, str(qwen3), "2+2?", "--grammar", FORCED, "--temp", "0")
    assert out["text"] == "<think>\nTwo and two.\n</think>\n\nIt is 4."
    assert (out["content"], out["reasoning_content"]) == ("It is 4.", "Two and two.")
    none = _json(capsys, str(qwen3), "2+2?", "--grammar", FORCED, "--reasoning-format", "none")
    assert (none["content"], none["reasoning_content"]) == (out["text"], None)


def test_thinking_to_stderr_when_piped_or_hidden(qwen3: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(qwen3), "2+2?", "--grammar", FORCED, "--temp", "0"]) == 0
    got = capsys.readouterr()
    assert got.out == "It is 4.\n" and got.err.startswith("Two and two.")
    assert main(["run", str(qwen3), "2+2?", "--grammar", FORCED, "--hide-reasoning"]) == 0
    got = capsys.readouterr()
    assert got.out == "It is 4.\n" and "Two and two." not in got.err


def test_reasoning_off_renders_the_empty_block(qwen3: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    on = _json(capsys, str(qwen3), "hi", "-n", "1")
    off = _json(capsys, str(qwen3), "hi", "-n", "1", "--reasoning", "off")
    kwargs = _json(capsys, str(qwen3), "hi", "-n", "1", "--chat-template-kwargs",
                   '{"enable_thinking": false}')
    assert len(off["prompt_ids"]) > len(on["prompt_ids"])
    assert off["prompt_ids"] == kwargs["prompt_ids"]


def test_budget_on_the_cli_and_in_python(r1: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = minfer.load(r1, n_ctx=256)
    close = model.tokenizer.encode(FORCED_CLOSE, special=True, add_bos=False)
    out = _json(capsys, str(r1), "2+2?", "--reasoning-budget", "3", "-n", "10", "--temp", "0")
    assert out["ids"][3:3 + len(close)] == close and len(out["ids"]) == 10
    thinking = model.tokenizer.decode(out["ids"][:3])
    assert out["reasoning_content"] == (thinking.strip() or None)
    reply = model.respond([{"role": "user", "content": "2+2?"}], max_tokens=10,
                          reasoning=ReasoningOptions(budget=3), temp=0.0)
    assert reply.text == out["text"]
    assert (reply.content, reply.reasoning_content) == (out["content"], out["reasoning_content"])


@pytest.mark.parametrize("argv", [["--reasoning-budget", "-2"],
                                  ["--chat-template-kwargs", "[1]"],
                                  ["--chat-template-kwargs", "{bad"]])
def test_bad_flags_are_one_line_errors(qwen3: Path, argv: list[str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(qwen3), "hi", "-n", "1", *argv]) == 2
    assert "reasoning-budget" in capsys.readouterr().err or "chat-template-kwargs" in argv[0]


def test_the_repl_hides_the_thinking_when_asked() -> None:
    import io

    from minfer.chat.repl import ReplyWriter

    for hide, expected in ((False, "<think>hm</think>4\n"), (True, "4\n")):
        out = io.StringIO()
        writer = ReplyWriter(color=False, interactive=False, out=out, hide_reasoning=hide)
        for piece in ("<thi", "nk>hm</th", "ink>4"):
            writer.piece(piece)
        writer.end_reply()
        assert out.getvalue() == expected
