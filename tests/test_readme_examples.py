"""Every example of the README runs on a fresh cache: its ```sh `minfer ...` lines (in-process,
through the CLI's main; `serve` and `viz`, which keep running, as processes until they answer)
and its Python block. `$MINFER_HOME` starts empty and the catalogue names resolve, on first use,
to small synthetic models on the network-free Hub stand-in (tests/fakehub.py): the default
model (a tiny qwen2 with FIM tokens and a long context), `qwen3:0.6b` (a tiny qwen3 with
`<think>`), `all-minilm-l6-v2` (a tiny BERT) and `qwen3-reranker:0.6b` (a tiny cross-encoder).
Generation is capped with `-n 4` (the README's prompts would otherwise run to 512 tokens)."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from minfer.cli.main import main
from minfer.tools.synth import build_tiny_vocab, write_tiny_bert, write_tiny_model
from tests.fakehub import FakeHub

README = Path(__file__).resolve().parents[1] / "README.md"
LONG_RUNNING = ("serve", "viz")
FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def readme_commands() -> list[list[str]]:
    """The `minfer ...` lines of the README's ```sh blocks, as argv (comments dropped)."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    lines = [ln.strip() for block in blocks for ln in block.splitlines()]
    return [shlex.split(ln, comments=True)[1:] for ln in lines if ln.startswith("minfer ")]


def readme_python() -> str:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory,
           think_model: Callable[..., Path]) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("readme-models")
    return {
        "tiny": write_tiny_model(folder / "tiny.gguf", n_ctx_train=16384,
                                 vocab=build_tiny_vocab(extra_tokens=FIM)),
        "qwen3:0.6b": think_model("qwen3"),
        "all-minilm-l6-v2": write_tiny_bert(folder / "minilm.gguf"),
        "qwen3-reranker:0.6b": write_tiny_bert(folder / "ranker.gguf", cls_head=1,
                                               pooling=4),
    }


@pytest.fixture
def fresh_cache(models: dict[str, Path], tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """An empty MINFER_HOME and Hub cache, a catalogue of Hub entries on a fake Hub; the
    working folder holds the README's input file. Yields the environment for processes."""
    import huggingface_hub.constants
    from numba.core import config

    repo = "org/readme-GGUF"
    files = {f"{name.replace(':', '-')}.gguf": path.read_bytes()
             for name, path in models.items()}
    hub = FakeHub({repo: files}).start()
    entries = {name: {"description": name, "hub": f"hf:{repo}:{name.replace(':', '-')}.gguf"}
               for name in models}
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({"default": "tiny", "models": entries,
                                   "aliases": {"all-minilm": "all-minilm-l6-v2"}}))
    env = {"MINFER_HOME": str(tmp_path / "home"), "MINFER_CATALOG": str(catalog),
           "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
           "NUMBA_CACHE_DIR": str(config.CACHE_DIR)}  # the kernels compiled already
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "wiki.test.raw").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    yield env
    hub.stop()


def _heavy(argv: list[str]) -> bool:
    return argv[0] in LONG_RUNNING or "--roofline" in argv


def test_the_readme_has_the_examples_this_file_runs() -> None:
    commands = readme_commands()
    assert len(commands) >= 15 and {c[0] for c in commands} >= {
        "run", "chat", "serve", "embed", "bench", "perplexity", "info", "viz", "list"}
    assert not [c for c in commands if any(a.endswith(".gguf") for a in c)]  # names, no files


def test_every_quick_readme_command_runs_on_a_fresh_cache(
        fresh_cache: dict[str, str], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for argv in readme_commands():
        if _heavy(argv):
            continue
        if argv[0] in ("run", "chat"):  # a few tokens, drawn alike on every run
            argv = [*argv, "-n", "4", "--seed", "1"]
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n"))
        rc = main(argv)
        captured = capsys.readouterr()
        assert rc == 0, (argv, captured.err)
        shown = captured.out + (Path("g.dot").read_text() if "--dump-graph" in argv else "")
        # something printed (a random stand-in may draw control characters, which strip() eats)
        assert shown.rstrip("\n"), (argv, captured.err)
        if argv[0] == "embed":
            lines = [json.loads(ln) for ln in captured.out.splitlines()]
            key = "relevance_score" if "--rerank" in argv else "embedding"
            assert [ln["index"] for ln in lines] == list(range(len(lines))) and key in lines[0]
        if argv[0] == "perplexity":
            assert "Final estimate: PPL = " in captured.out
        if argv[0] == "bench":
            assert "| pp512 |" in captured.out and "| tg128 |" in captured.out
    # the first uses fetched the catalogue's models into the Hub's cache
    snapshot = next((Path(fresh_cache["HF_HOME"]) / "hub" / "models--org--readme-GGUF" /
                     "snapshots").iterdir())
    assert {p.name for p in snapshot.iterdir()} == {
        "tiny.gguf", "qwen3-0.6b.gguf", "all-minilm-l6-v2.gguf", "qwen3-reranker-0.6b.gguf"}


def test_the_readme_python_block_runs_on_a_fresh_cache(
        fresh_cache: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    scope: dict[str, object] = {}
    exec(compile(readme_python(), str(README), "exec"), scope)
    assert capsys.readouterr().out.strip()
    vectors = scope["vectors"]
    assert getattr(vectors, "shape", None) == (2, 64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_the_heavy_readme_commands_run_on_a_fresh_cache(
        fresh_cache: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """`bench ... --roofline` in-process; `serve` and `viz` as processes, on a free port,
    until they answer over HTTP, then stopped with SIGTERM."""
    for argv in filter(_heavy, readme_commands()):
        if argv[0] not in LONG_RUNNING:
            assert main(argv) == 0
            assert "roofline" in capsys.readouterr().out
            continue
        port = _free_port()
        argv = [a if not a.isdigit() or i == 0 or argv[i - 1] != "--port" else str(port)
                for i, a in enumerate(argv)]
        if "--port" not in argv:
            argv += ["--port", str(port)]
        proc = subprocess.Popen([sys.executable, "-m", "minfer.cli.main", *argv],
                                env={**os.environ, **fresh_cache}, stderr=subprocess.PIPE,
                                text=True)
        try:
            url = f"http://127.0.0.1:{port}/" + ("health" if argv[0] == "serve" else "")
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                try:
                    if httpx.get(url, timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"{argv} did not answer"
                time.sleep(0.3)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
