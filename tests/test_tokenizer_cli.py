"""`minfer tokenize` on a synthetic model: argument forms, JSON output, chat files, errors."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from minfer.cli.main import main
from minfer.gguf.reader import GGUFFile
from minfer.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def only_tokenize(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch through the real `main`, loading only this sub-command."""
    monkeypatch.setattr("minfer.cli.main.COMMANDS", ("tokenize",))


@pytest.fixture(scope="module")
def tok(tiny_qwen2: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile.open(tiny_qwen2))


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["tokenize", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_model_and_text(capsys: pytest.CaptureFixture[str], tiny_qwen2: Path,
                        tok: Tokenizer) -> None:
    out = run_json(capsys, str(tiny_qwen2), "<|im_start|>hi 😀")
    assert out["ids"] == tok.encode("<|im_start|>hi 😀")
    assert out["pieces"][0] == "<|im_start|>"
    assert "\ufffd" in out["pieces"]  # the emoji's bytes are split over byte tokens
    assert "".join(out["pieces"]).startswith("<|im_start|>hi ")


def test_no_special_and_model_option(capsys: pytest.CaptureFixture[str], tiny_qwen2: Path,
                                     tok: Tokenizer) -> None:
    out = run_json(capsys, "-m", str(tiny_qwen2), "<|im_start|>", "--no-special")
    assert out["ids"] == tok.encode("<|im_start|>", special=False)
    assert len(out["ids"]) > 1


def test_one_positional_uses_default_model(capsys: pytest.CaptureFixture[str], tiny_qwen2: Path,
                                           tok: Tokenizer, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from minfer.store.catalog import default_model_name

    shutil.copy(tiny_qwen2, tmp_path / f"{default_model_name()}.gguf")
    monkeypatch.setenv("MINFER_HOME", str(tmp_path))
    assert run_json(capsys, "The fox")["ids"] == tok.encode("The fox")


def test_text_from_stdin_and_plain_output(capsys: pytest.CaptureFixture[str], tiny_qwen2: Path,
                                          tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("the dog\n"))
    assert main(["tokenize", str(tiny_qwen2), "-"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ids = tok.encode("the dog\n")
    assert len(lines) == len(ids)
    assert lines[0].split(" -> ")[0].strip() == str(ids[0])


def test_chat_file(capsys: pytest.CaptureFixture[str], tiny_qwen2: Path, tok: Tokenizer,
                   tmp_path: Path) -> None:
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                "tools": [], "add_generation_prompt": True}))
    out = run_json(capsys, str(tiny_qwen2), "--chat", str(chat))
    assert out["text"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert out["ids"] == tok.encode(out["text"])
    assert main(["tokenize", str(tiny_qwen2), "--chat", str(chat)]) == 0
    plain = capsys.readouterr().out
    assert plain.startswith(out["text"]) and str(out["ids"]) in plain


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read chat file"),
    ("{not json", "invalid JSON"),
    ('{"messages": "hi"}', "must be a list of objects"),
    ('{"messages": [], "tools": {}}', "\"tools\" must be a list"),
    ('{"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": 1}',
     "true or false"),
])
def test_bad_chat_file_is_one_line_error(capsys: pytest.CaptureFixture[str], tiny_qwen2: Path,
                                         tmp_path: Path, content: str | None,
                                         message: str) -> None:
    chat = tmp_path / "chat.json"
    if content is not None:
        chat.write_text(content)
    assert main(["tokenize", str(tiny_qwen2), "--chat", str(chat)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize("argv", [["a", "b", "c"], ["-m", "x.gguf", "a", "b"], []])
def test_bad_positionals(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(["tokenize", *argv]) == 2
    assert "minfer: error:" in capsys.readouterr().err


def test_missing_model_is_one_line_error(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    assert main(["tokenize", str(tmp_path / "nope.gguf"), "hi"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# -- --jsonl and vocabulary-only files --------------------------------------------------------

VOCAB_ONLY = Path(__file__).parent / "fixtures" / "llama-vocab" / "ggml-vocab-llama-spm.gguf"


def test_jsonl_one_line_per_input_in_order(capsys: pytest.CaptureFixture[str], tiny_qwen2: Path,
                                           tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = ["The fox", "", "<|im_start|>hi 😀\nnext", " spaced  out "]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(json.dumps(t) + "\n" for t in texts)))
    assert main(["tokenize", str(tiny_qwen2), "--jsonl"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["ids"] for line in lines] == [tok.encode(t) for t in texts]
    assert json.loads(lines[2])["pieces"][0] == "<|im_start|>"


def test_jsonl_no_special(capsys: pytest.CaptureFixture[str], tiny_qwen2: Path, tok: Tokenizer,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO('"<|im_start|>"\n'))
    assert main(["tokenize", str(tiny_qwen2), "--jsonl", "--no-special"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ids"] == tok.encode("<|im_start|>", special=False) and len(out["ids"]) > 1


@pytest.mark.parametrize(("stdin", "message"), [
    ('"ok"\nnot json\n', "stdin line 2: invalid JSON"),
    ('["a"]\n', "stdin line 1: expected a JSON string, got list"),
    ("\n", "stdin line 1: invalid JSON"),
])
def test_jsonl_bad_line_is_one_line_error(capsys: pytest.CaptureFixture[str], tiny_qwen2: Path,
                                          monkeypatch: pytest.MonkeyPatch, stdin: str,
                                          message: str) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert main(["tokenize", str(tiny_qwen2), "--jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_jsonl_with_text_or_chat_is_refused(capsys: pytest.CaptureFixture[str],
                                            tiny_qwen2: Path) -> None:
    assert main(["tokenize", str(tiny_qwen2), "hello", "--jsonl"]) == 2
    assert main(["tokenize", str(tiny_qwen2), "--jsonl", "--chat", "x.json"]) == 2
    assert "cannot be combined" in capsys.readouterr().err


def test_vocabulary_only_gguf_tokenizes(capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO('"Hello world"\n"<s>x"\n'))
    assert main(["tokenize", str(VOCAB_ONLY), "--jsonl"]) == 0
    first, second = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    # llama.cpp: BOS (add_bos defaults on for SPM), then '▁Hello' '▁world'
    assert first == {"ids": [1, 15043, 3186], "pieces": ["<s>", " Hello", " world"]}
    assert second["ids"][:3] == [1, 1, 921]  # '<s>' parsed, then the space prefix again: '▁x'


def test_vocabulary_only_gguf_info(capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("minfer.cli.main.COMMANDS", ("info",))
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["info", str(VOCAB_ONLY)]) == 0
    out = capsys.readouterr().out
    assert "vocabulary only (no tensors)" in out and "32000" in out and "'<s>'" in out
