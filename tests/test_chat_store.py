"""Session files (versioned JSON, atomic writes, foreign files refused) and the think splitter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minfer.chat import store
from minfer.chat.store import SessionFileError
from minfer.chat.think import ThinkSplitter

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "héllo ✓"},
    {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhi"},
]


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "chat.json"
    assert store.load(path) is None  # no file yet: a new session
    store.save(path, CONVERSATION, model="m")
    saved = store.load(path)
    assert saved is not None and saved.messages == CONVERSATION and saved.model == "m"
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert doc["format"] == store.FORMAT and doc["version"] == store.VERSION
    store.save(path, CONVERSATION[:1])  # overwrite atomically, no temporary left behind
    assert store.load(path).messages == CONVERSATION[:1]  # type: ignore[union-attr]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json"]


@pytest.mark.parametrize(("content", "needle"), [
    (b"{\"format\": \"minfer-chat-session\", \"vers", "invalid JSON"),
    (b"\xff\xfe\x00garbage", "not UTF-8"),
    (b"", "invalid JSON"),
    (b"[1, 2, 3]", "not a minfer chat session"),
    (b'{"messages": []}', "not a minfer chat session"),
    (b'{"format": "minfer-chat-session", "version": 99, "messages": []}', "newer minfer"),
    (b'{"format": "minfer-chat-session", "version": 1, "messages": [{"role": "user"}]}',
     "message 0"),
    (b'{"format": "minfer-chat-session", "version": 1, "messages": '
     b'[{"role": "assistant", "content": "x"}]}', "role 'assistant'"),
    (b'{"format": "minfer-chat-session", "version": 1, "messages": '
     b'[{"role": "user", "content": "x"}]}', "without a reply"),
])
def test_corrupt_or_foreign_files_are_refused(tmp_path: Path, content: bytes, needle: str) -> None:
    path = tmp_path / "s.json"
    path.write_bytes(content)
    with pytest.raises(SessionFileError, match=needle) as info:
        store.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert path.read_bytes() == content


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SessionFileError, match="directory"):
        store.load(tmp_path)


def test_cli_refuses_a_corrupt_session_file_and_leaves_it(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          tiny_qwen2: Path) -> None:
    from minfer.cli.main import main

    path = tmp_path / "notes.txt"
    path.write_text("my precious notes\n")
    assert main(["chat", str(tiny_qwen2), "--session", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a minfer chat session" in err
    assert path.read_text() == "my precious notes\n"


@pytest.mark.parametrize("split", [1, 2, 3, 5, 100])
def test_think_splitter_marks_the_reasoning_whatever_the_chunking(split: int) -> None:
    text = "<think>\nplan a < b\n</think>\n\nanswer <thin"
    splitter = ThinkSplitter()
    segments = []
    for i in range(0, len(text), split):
        segments += splitter.push(text[i : i + split])
    segments += splitter.flush()
    thinking = "".join(t for t, th in segments if th)
    answer = "".join(t for t, th in segments if not th)
    assert thinking == "<think>\nplan a < b\n</think>"
    assert answer == "\n\nanswer <thin"
