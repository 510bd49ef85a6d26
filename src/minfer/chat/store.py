"""Session files: a conversation saved as versioned JSON, written atomically.

    {"format": "minfer-chat-session", "version": 1, "model": "...", "saved_at": "...",
     "messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}

`save` writes a temporary file beside the target, fsyncs it and renames it over the target, so
a crash leaves either the old file or the new one, never half of either. `load` refuses a file
that is not JSON, not this format, from a newer version, or whose messages do not form a
conversation (an optional system message, then user/assistant turns ending with a reply) — with a
`SessionFileError` that names the file. A refused file is never written: the CLI stops first.
Only the messages are kept; the KV is rebuilt on restore by one prefill of the history.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from minfer.errors import MinferError

FORMAT = "minfer-chat-session"
VERSION = 1
MAX_BYTES = 64 << 20  # a session file larger than this is not one of ours


class SessionFileError(MinferError):
    """A session file minfer will neither read nor overwrite."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}; refusing to use or overwrite it")
        self.path = path


@dataclass(frozen=True)
class SavedSession:
    messages: list[dict[str, str]]
    model: str | None = None


def load(path: Path) -> SavedSession | None:
    """The conversation saved at `path`; None when no file exists there yet."""
    try:
        if path.stat().st_size > MAX_BYTES:
            raise SessionFileError(path, "too large to be a minfer chat session")
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise SessionFileError(path, "is a directory") from None
    except OSError as exc:
        raise SessionFileError(path, f"cannot be read ({exc.strerror})") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise SessionFileError(path, "is not a minfer chat session (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise SessionFileError(path, f"is not a minfer chat session (invalid JSON at line "
                                     f"{exc.lineno}, column {exc.colno})") from None
    return _parse(path, doc)


def _parse(path: Path, doc: Any) -> SavedSession:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SessionFileError(path, "is not a minfer chat session (no "
                                     f'"format": "{FORMAT}")')
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise SessionFileError(path, f"has an invalid version {version!r}")
    if version > VERSION:
        raise SessionFileError(path, f"was written by a newer minfer (format version {version}, "
                                     f"this one reads {VERSION})")
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise SessionFileError(path, "has a non-text model name")
    messages = doc.get("messages")
    if not isinstance(messages, list):
        raise SessionFileError(path, "has no message list")
    problem = conversation_problem(messages)
    if problem:
        raise SessionFileError(path, problem)
    return SavedSession([{"role": m["role"], "content": m["content"]} for m in messages], model)


def conversation_problem(messages: Sequence[Any]) -> str | None:
    """Why `messages` is not a saved conversation, or None when it is one."""
    expected = "user"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            return f"message {i} is not a {{role, content}} object with text values"
        role = m["role"]
        if role == "system" and i == 0:
            continue
        if role != expected:
            return f"message {i} has role {role!r} where {expected!r} was expected"
        expected = "assistant" if role == "user" else "user"
    if expected == "assistant":
        return "the last message is a user message without a reply"
    return None


def save(path: Path, messages: Sequence[Mapping[str, str]], *, model: str | None = None) -> None:
    """Write the conversation to `path` atomically (temporary file + fsync + rename)."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "saved_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
    }
    data = json.dumps(doc, ensure_ascii=False, indent=1).encode("utf-8") + b"\n"
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
