"""`minfer run` end to end on a tiny synthetic model: JSON output, stops, dumps, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minfer.cli.main import main


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["run", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_json_output_has_the_documented_fields(tiny_qwen2: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(capsys, str(tiny_qwen2), "hello there", "--temp", "0", "-n", "5",
                    "--top-logits", "3", "--raw")
    assert set(out) >= {"prompt_ids", "ids", "text", "finish_reason", "timings", "top_logits"}
    ids = out["ids"]
    assert isinstance(ids, list) and len(ids) <= 5
    assert out["finish_reason"] in ("length", "eos")
    tops = out["top_logits"]
    assert isinstance(tops, list) and len(tops) == len(ids) + (out["finish_reason"] == "eos")
    for step, chosen in zip(tops, ids, strict=False):  # greedy: the first pair is the choice
        assert len(step) == 3 and step[0][0] == chosen and step[0][1] >= step[1][1]
    assert {"prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s"} <= set(
        out["timings"])  # type: ignore[arg-type]


def test_same_seed_same_output(tiny_qwen2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = (str(tiny_qwen2), "once upon", "--raw", "-n", "8", "--temp", "1.0", "--seed", "7")
    a = _run_json(capsys, *args)
    b = _run_json(capsys, *args)
    assert a["ids"] == b["ids"] and len(a["ids"]) > 0  # type: ignore[arg-type]


def test_chat_template_applied_unless_raw(tiny_qwen2: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    chat = _run_json(capsys, str(tiny_qwen2), "hi", "-n", "1", "--system", "be brief")
    raw = _run_json(capsys, str(tiny_qwen2), "hi", "-n", "1", "--raw")
    assert len(chat["prompt_ids"]) > len(raw["prompt_ids"]) + 5  # type: ignore[arg-type]


def test_stop_string_is_not_printed(tiny_qwen2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    free = _run_json(capsys, str(tiny_qwen2), "the", "--raw", "-n", "12", "--temp", "1",
                     "--seed", "3")
    text = str(free["text"])
    assert len(text) >= 3
    stop = text[1:3]
    cut = _run_json(capsys, str(tiny_qwen2), "the", "--raw", "-n", "12", "--temp", "1",
                    "--seed", "3", "--stop", stop)
    assert cut["finish_reason"] == "stop" and stop not in str(cut["text"])
    assert text.startswith(str(cut["text"]))


def test_dump_graph_files(tiny_qwen3: Path, tmp_path: Path) -> None:
    dot, js = tmp_path / "g.dot", tmp_path / "g.json"
    assert main(["run", str(tiny_qwen3), "hello", "--raw", "--dump-graph", str(dot),
                 "--dump-graph-json", str(js)]) == 0
    assert dot.read_text().startswith("digraph")
    data = json.loads(js.read_text())
    assert data["params"]["gtype"] == "prefill" and data["params"]["n_out"] == 1
    assert any(n["op"] == "QkNorm" for n in data["nodes"])


def test_bad_model_file_is_one_line_exit_2(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    assert main(["run", str(bad), "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.gguf" in err[0]


def test_prompt_beyond_the_models_context_is_refused(tiny_qwen2: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    long_prompt = "word " * 3000  # the tiny model's training context is 2048
    assert main(["run", str(tiny_qwen2), long_prompt, "--raw", "-n", "1"]) == 2
    assert "context" in capsys.readouterr().err


def test_options_and_positionals_mix_in_any_order(tiny_qwen2: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`minfer run MODEL --raw -n 4 --temp 0 PROMPT`, as users type it (and llama.cpp's -p)."""
    model = str(tiny_qwen2)
    first = _run_json(capsys, model, "--raw", "-n", "4", "--temp", "0", "def fib(n):")
    assert first["prompt_ids"] and first["ids"]
    for argv in (["--raw", model, "-n", "4", "def fib(n):", "--temp", "0"],
                 [model, "-p", "def fib(n):", "--temp", "0", "--raw", "-n", "4"]):
        again = _run_json(capsys, *argv)
        assert (again["prompt_ids"], again["ids"]) == (first["prompt_ids"], first["ids"])


def test_a_reader_that_goes_away_ends_the_run_quietly(tiny_qwen2: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`minfer run … | head -c 1`: no traceback, the exit status of a SIGPIPE'd tool."""
    import io
    import sys

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["run", str(tiny_qwen2), "--raw", "-n", "4", "--temp", "0", "hello"]) == 141


def test_start_up_ends_with_the_collector_on_and_what_it_made_frozen() -> None:
    """`run` / `chat` start with the cyclic collector off (`main.DEFERRED_GC`); the end of
    start-up turns it on, with start-up's objects out of its walks."""
    import gc

    from minfer.cli import common, main

    assert {"run", "chat"} <= main.DEFERRED_GC
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        common.started()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        if not was_enabled:
            gc.disable()


def test_a_prompt_longer_than_n_ctx_says_the_context_grows(
        tiny_qwen2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--json", str(tiny_qwen2), "one two three four five six seven eight",
                 "--raw", "-c", "4", "-n", "2", "--temp", "0"]) == 0
    got = capsys.readouterr()
    n_prompt = len(json.loads(got.out)["prompt_ids"])
    assert n_prompt > 4
    assert f"the prompt is {n_prompt} tokens, more than -c 4" in got.err


def test_prompt_file_and_ignore_eos(tiny_qwen2: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`-f FILE` reads the prompt as llama-cli's does; `--ignore-eos` never draws an
    end-of-generation token, so a run goes to -n (hot sampling ends some runs at EOS
    without it)."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello there")
    by_file = _run_json(capsys, str(tiny_qwen2), "-f", str(prompt), "--raw", "-n", "3",
                        "--temp", "0")
    inline = _run_json(capsys, str(tiny_qwen2), "hello there", "--raw", "-n", "3", "--temp", "0")
    assert by_file["prompt_ids"] == inline["prompt_ids"] and by_file["ids"] == inline["ids"]
    hot = ("a", "--raw", "-n", "40", "--temp", "2", "--top-k", "0", "--top-p", "1",
           "--min-p", "0")
    ends = {flag: [_run_json(capsys, str(tiny_qwen2), *hot, "--seed", str(s),
                             *([flag] if flag else []))["finish_reason"] for s in range(8)]
            for flag in ("", "--ignore-eos")}
    assert "eos" in ends[""] and set(ends["--ignore-eos"]) == {"length"}
    assert main(["run", str(tiny_qwen2), "-p", "x", "-f", str(prompt)]) != 0


def test_a_context_past_the_models_is_capped_with_a_warning(
        tiny_qwen2: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """`-c 99999999` (past the tiny model's 2048) runs in 2048, and says so (on stderr: the
    `minfer` logger's warning), as the server's --n-ctx does in its log."""
    import minfer

    with caplog.at_level("WARNING", logger="minfer"):
        assert minfer.load(tiny_qwen2, n_ctx=99_999_999).n_ctx == 2048
        out = _run_json(capsys, str(tiny_qwen2), "hi", "--raw", "-c", "99999999", "-n", "1")
    assert out["ids"]
    said = [r.getMessage() for r in caplog.records]
    assert said.count("n_ctx = 99999999 exceeds the model's context length (2048); "
                      "capped to 2048") == 2
