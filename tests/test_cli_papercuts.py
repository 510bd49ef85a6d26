"""A newcomer's small papercuts: `--version`, help on every bench / perplexity flag, quantize
refusing to overwrite, a busy port, `model.chat("hi")`, `help(minfer.load)`, the encoder's
banner context."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

import minfer
from minfer.cli.main import build_parser, main
from minfer.tools.synth import write_tiny_bert


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"minfer {minfer.__version__}"


@pytest.mark.parametrize("command", ["bench", "perplexity"])
def test_every_bench_and_perplexity_flag_has_help(command: str) -> None:
    parser = build_parser(command).get_default("subparsers")[command]
    bare = [a.option_strings or [a.dest] for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and not a.help]
    assert bare == []


def test_quantize_refuses_to_overwrite_without_force(tmp_path: Path, tiny_qwen2: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.gguf"
    out.write_bytes(b"precious")
    assert main(["quantize", str(tiny_qwen2), str(out), "Q8_0"]) == 2
    err = capsys.readouterr().err
    assert err == f"minfer: error: {out} already exists; not overwriting it (--force replaces " \
                  "it)\n"
    assert out.read_bytes() == b"precious"


def test_a_busy_port_is_one_line_before_serving(tiny_qwen2: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tiny_qwen2), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err
    assert "serving" not in err


def test_the_banner_shows_an_encoders_real_context(tmp_path: Path, tiny_qwen2: Path) -> None:
    from minfer.cli.serve_cmd import _capacity
    from minfer.engine.config import EngineConfig
    from minfer.server.state import ServerConfig

    bert = write_tiny_bert(tmp_path / "bert.gguf", n_ctx_train=512)
    assert _capacity(ServerConfig(model_path=bert)) == "an encoder: up to 512 tokens per input"
    assert _capacity(ServerConfig(model_path=tiny_qwen2, slots=2,
                                  engine=EngineConfig.build(n_ctx=64))) == \
        "2 slots x 64 tokens"


def test_load_documents_its_options() -> None:
    doc = minfer.load.__doc__ or ""
    for option in ("model:", "n_ctx:", "kv_type:", "k_type", "threads:", "batch_size:",
                   "backend:", "fuse:", "catalogue", "hf:ORG/REPO"):
        assert option in doc


def test_chat_takes_a_plain_string(tiny_qwen2: Path) -> None:
    model = minfer.load(tiny_qwen2, n_ctx=64)
    as_text = model.render_chat([{"role": "user", "content": "hi"}])
    seen: list[object] = []
    model.render_chat = lambda messages, **kw: seen.append(messages) or as_text  # type: ignore
    assert "".join(model.chat("hi", max_tokens=2, temp=0)) == \
        "".join(model.chat([{"role": "user", "content": "hi"}], max_tokens=2, temp=0))
    assert seen[0] == seen[1] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("command", ["embed", "perplexity", "bench"])
def test_a_first_use_says_it_compiles_then_is_silent(
        command: str, tmp_path: Path, tiny_qwen2: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """embed, perplexity and bench give `run`'s first-use notice (one helper,
    `warmup.announce_cold_start`) while this model's kernels are not marked compiled, and
    none once they are."""
    from minfer.engine import warmup

    monkeypatch.setattr(warmup, "marker_path", lambda f, **kw: tmp_path / (
        f"warm-{Path(f.path).stem}-{kw['kv_type']}-{kw['batch_invariant']}"))
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 8)
    argv = {"embed": ["embed", str(write_tiny_bert(tmp_path / "bert.gguf")), "a", "b"],
            "perplexity": ["perplexity", str(tiny_qwen2), "-f", str(text), "-c", "32",
                           "--chunks", "1"],
            "bench": ["bench", str(tiny_qwen2), "-p", "8", "-n", "2", "-r", "1", "-t", "1"]}
    for round_ in ("cold", "warm"):
        assert main(argv[command]) == 0
        captured = capsys.readouterr()
        assert captured.out  # its result
        assert (warmup.COLD_START in captured.err) == (round_ == "cold"), captured.err
