"""The chat REPL: read a message, stream the reply, repeat.

Interactive (stdin is a terminal): prompt_toolkit line editing and history, a `>>> ` prompt,
replies streamed as they are generated, Qwen3-style `<think>…</think>` (a harmony reply's
analysis channel) dimmed (rich), commands
/regen /clear /help /exit /quit /bye (Ollama's) and `/image PATH` (the image goes with the next
message; a model with a vision encoder), Ctrl-D to leave and Ctrl-C to stop the current
reply (or drop the line being typed). `--multiline` collects lines until an empty one.

Piped (stdin is not a terminal): every input line is one user turn (with `--multiline`, every
block up to an empty line), each reply is printed plainly on stdout followed by a newline,
notices go to stderr, and the program ends at end of input.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from minfer.chat.session import ChatSession, TurnEvents, TurnReport
from minfer.chat.think import Splitter, ThinkSplitter
from minfer.engine.generate import Piece
from minfer.errors import MinferError

HELP = """commands:
  /image PATH         attach an image to the next message (a model with an mmproj)
  /regen              generate the last reply again
  /clear              forget the conversation (the system prompt stays)
  /help               this list
  /exit, /quit, /bye  leave (Ctrl-D too); Ctrl-C stops a reply"""
COMMANDS = ("/image", "/regen", "/clear", "/help", "/exit", "/quit", "/bye")
_COMMAND_RE = re.compile(r"/[A-Za-z]+")
_IMAGE_RE = re.compile(r"/image(?:\s+(.*))?", re.IGNORECASE | re.DOTALL)
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # everything but \t and \n


@dataclass(frozen=True)
class ReplOptions:
    multiline: bool = False
    color: str = "auto"  # auto | on | off
    verbose: bool = False
    single_turn: bool = False
    first_prompt: str | None = None
    interactive: bool | None = None  # None: stdin is a terminal


class LineReader(Protocol):
    def read(self) -> str | None:
        """The next user input; None at end of input."""
        ...


class PipeReader:
    """Lines of a stream: one turn per line, or per block up to an empty line (multiline)."""

    def __init__(self, stream: IO[str], *, multiline: bool) -> None:
        self.stream = stream
        self.multiline = multiline

    def read(self) -> str | None:
        lines: list[str] = []
        for raw in iter(self.stream.readline, ""):
            line = raw.rstrip("\r\n")
            if not self.multiline:
                if line.strip():
                    return line
                continue
            if line.strip():
                lines.append(line)
            elif lines:
                break
        return "\n".join(lines) if lines else None


class PromptReader:
    """prompt_toolkit input: line editing and history; Ctrl-C drops the line being typed."""

    def __init__(self, *, multiline: bool) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory

        self.multiline = multiline
        self._session: PromptSession[str] = PromptSession(history=InMemoryHistory())

    def read(self) -> str | None:
        lines: list[str] = []
        while True:
            try:
                line = self._session.prompt("... " if lines else ">>> ")
            except KeyboardInterrupt:
                lines = []
                continue
            except EOFError:
                return "\n".join(lines) if lines else None
            if not self.multiline or (not lines and is_command(line)):
                return line
            if line.strip():
                lines.append(line)
            elif lines:
                return "\n".join(lines)


class ReplyWriter:
    """Writes replies (reasoning dimmed when colour is on) and notices."""

    def __init__(self, *, color: bool, interactive: bool, out: IO[str] | None = None,
                 err: IO[str] | None = None, hide_reasoning: bool = False,
                 splitter: Callable[[], Splitter] = ThinkSplitter) -> None:
        from rich.console import Console

        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.color = color
        self.interactive = interactive
        self.hide_reasoning = hide_reasoning
        self._console = Console(file=self.out, force_terminal=color, no_color=not color,
                                highlight=False, markup=False, emoji=False, soft_wrap=True)
        self._splitter = splitter  # a reply's thinking / answer segments (think.splitter_for)
        self._think = splitter()

    def piece(self, text: str) -> None:
        self._write(self._think.push(text))

    def end_reply(self) -> None:
        self._write(self._think.flush())
        self._think = self._splitter()
        self.out.write("\n\n" if self.interactive else "\n")
        self.out.flush()

    def notice(self, text: str) -> None:
        """A message from the REPL itself (stdout when interactive, else stderr)."""
        if self.interactive and self.color:
            self._console.print(text, style="italic dim")
        else:
            print(text, file=self.out if self.interactive else self.err, flush=True)

    def error(self, text: str) -> None:
        print(f"error: {text}", file=self.err, flush=True)

    def report(self, r: TurnReport) -> None:
        print(format_report(r), file=self.err, flush=True)

    def _write(self, segments: list[tuple[str, bool]]) -> None:
        for text, thinking in segments:
            if thinking and self.hide_reasoning:
                continue
            if self.interactive:
                text = CONTROL_CHARS.sub("\ufffd", text)
            if self.color:
                self._console.print(text, style="dim" if thinking else "", end="")
            else:
                self.out.write(text)
        self.out.flush()


class Repl:
    def __init__(self, session: ChatSession, options: ReplOptions, *, reader: LineReader,
                 writer: ReplyWriter, on_change: Callable[[ChatSession], None] | None = None,
                 banner: str | None = None) -> None:
        self.session = session
        self.options = options
        self.reader = reader
        self.writer = writer
        self.on_change = on_change
        self.banner = banner
        self.n_errors = 0
        self.images: list[bytes] = []  # attached by /image, sent with the next message

    def run(self) -> int:
        """The loop; returns the exit status (2 when a piped turn failed, else 0)."""
        if self.banner:
            self.writer.notice(self.banner)
        first = self.options.first_prompt
        while True:
            line: str | None = first if first is not None else self.reader.read()
            first = None
            if line is None:
                break
            if not self.handle(line) or self.options.single_turn:
                break
        return 2 if self.n_errors and not self.writer.interactive else 0

    def handle(self, line: str) -> bool:
        """Run one input (a message or a command); False when the REPL should end."""
        text = line.strip()
        if not text:
            return True
        image = _IMAGE_RE.fullmatch(text)
        if image is not None:
            self.attach(image.group(1))
            return True
        if is_command(text):
            return self.command(text.lower())
        images, self.images = self.images, []
        self._turn(lambda: self.session.say(line, images))
        return True

    def attach(self, path: str | None) -> None:
        """`/image PATH`: read and check the image now, send it with the next message."""
        problem = self._image(path)
        if problem is not None:
            self.n_errors += 1
            self.writer.error(problem)
            return
        n = len(self.images)
        self.writer.notice(f"(image attached{f', {n} now' if n > 1 else ''}: it goes with "
                           "your next message)")

    def _image(self, path: str | None) -> str | None:
        """Attach the image at path; what is wrong, if anything."""
        from minfer.engine.vision.image import ImageError, decode

        if self.session.images is None:
            return ("this model takes no images: it has no vision encoder (an mmproj file: "
                    "--mmproj FILE, or mmproj*.gguf beside the model)")
        if not path or not path.strip():
            return "/image needs a file: /image PATH"
        file = Path(path.strip().strip("'\"")).expanduser()
        try:
            data = file.read_bytes()
            decode(data)
        except OSError as exc:
            return f"cannot read the image {file}: {exc.strerror or exc}"
        except ImageError as exc:
            return f"{file}: {exc}"
        self.images.append(data)
        return None

    def command(self, cmd: str) -> bool:
        if cmd in ("/exit", "/quit", "/bye"):
            return False
        if cmd == "/help":
            self.writer.notice(HELP)
        elif cmd == "/clear":
            self.session.clear()
            self._changed()
            self.writer.notice("(conversation cleared)")
        elif cmd == "/regen":
            self._turn(self.session.regen)
        else:
            self.writer.notice(f"unknown command {cmd} (try /help)")
        return True

    def _turn(self, start: Callable[[], TurnEvents]) -> None:
        try:
            events = start()
        except MinferError as exc:
            self.n_errors += 1
            self.writer.error(str(exc))
            return
        try:
            for event in events:
                if isinstance(event, Piece):
                    self.writer.piece(event.text)
        except KeyboardInterrupt:
            events.close()  # the session ends the turn with the text shown so far
            self.writer.end_reply()
            self.writer.notice("(reply stopped)")
        except MinferError as exc:
            self.n_errors += 1
            self.writer.end_reply()
            self.writer.error(str(exc))
        else:
            self.writer.end_reply()
        report = self.session.last_report
        if self.options.verbose and report is not None:
            self.writer.report(report)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.session)


def is_command(text: str) -> bool:
    """A line that is a single /word (so a path such as /usr/bin is still a message)."""
    return _COMMAND_RE.fullmatch(text.strip()) is not None


def format_report(r: TurnReport) -> str:
    """One stderr line per turn for --verbose."""
    how = "re-rendered" if r.re_rendered else "delta"
    if r.n_dropped:
        turns = f"{r.n_dropped} turn{'s' if r.n_dropped > 1 else ''}"
        how = (f"shifted {r.n_shifted} KV rows after dropping {turns}" if r.n_shifted
               else f"re-prefill after dropping {turns}")
    extras = []
    if r.eot_inserted:
        extras.append("end-of-turn inserted")
    if r.regen:
        extras.append("regenerated")
    if r.shift_fallback:
        extras.append("shift fell back to re-prefill")
    if r.state_recomputed:
        extras.append("recurrent state recomputed (no context shift on this model)")
    if r.drafted:
        extras.append(f"{r.accepted}/{r.drafted} drafted tokens accepted")
    rate = r.n_generated / r.decode_s if r.decode_s > 0 else 0.0
    tail = f", {', '.join(extras)}" if extras else ""
    return (f"[turn {r.turn}: prefilled {r.n_prefilled} tokens ({how}), {r.n_kv} in KV, "
            f"generated {r.n_generated} ({r.reason}, {rate:.1f} tok/s), "
            f"re-renders {r.n_re_renders}{tail}]")
