"""Fill-in-the-middle prompts: the token layout llama.cpp's server builds for `/infill`.

An editor sends the text before the cursor (`input_prefix`), the text after it (`input_suffix`),
optionally other files as context (`input_extra`) and the start of the cursor's line (`prompt`).
`infill_prompt` lays them out in the repo-level pattern the FIM-trained coder models learnt
(Qwen2.5-Coder, arXiv 2409.12186), as `format_prompt_infill` in llama.cpp's
tools/server/server-common.cpp does:

    [FIM_REP]myproject\n  ([FIM_SEP]name\n text)*  [FIM_SEP]filename\n
    [BOS]? [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

Texts are tokenized without parsing special tokens and without BOS (a list of token ids is
taken as is, mixed with strings). The budget: the prefix keeps its last 3/4 of `n_batch` tokens,
the suffix its first `n_batch/4 - 2 - len(prompt)`, and the extra context the last
`n_ctx - n_batch - 2 * n_predict` tokens of the whole repo block, so the prefix is cut from the
left, the suffix from the right, and the extra chunks lose their oldest files first. Where those
sizes leave no room to generate in `n_ctx`, more extra context, then more prefix, is cut. A model
without prefix / suffix / middle tokens cannot fill in the middle: `FimUnsupported` names them.
Without a file-separator token the chunks are joined by a plain-text snippet marker instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from minfer.errors import MinferError
from minfer.tokenizer.vocab import FimTokens

REPO_NAME = "myproject\n"  # llama.cpp's server fixes both names (its TODOs: make them inputs)
CURRENT_FILE = "filename\n"
SNIPPET_MARKER = "\n\n--- snippet ---\n\n"

# A piece of input as llama.cpp's `tokenize_mixed` takes it: text, or token ids mixed with text.
Mixed = str | Sequence[str | int]


class FimUnsupported(MinferError):
    """The model has no fill-in-the-middle tokens (llama.cpp answers 501)."""


class InfillTokenizer(Protocol):
    """What the layout needs of `minfer.tokenizer.Tokenizer`."""

    fim: FimTokens
    add_bos: bool
    bos_id: int | None

    def encode(self, text: str, *, special: bool = True,
               add_bos: bool | None = None) -> list[int]: ...


@dataclass(frozen=True)
class ExtraFile:
    """One file of repo-level context (`input_extra[i]`)."""

    text: str
    filename: str = "tmp"


@dataclass(frozen=True)
class Budget:
    """The sizes llama.cpp's server cuts the pieces to (its n_batch, n_predict, slot n_ctx)."""

    n_batch: int = 2048
    n_predict: int = -1
    n_ctx: int = 4096


def check_fim(fim: FimTokens) -> tuple[int, int, int]:
    """The prefix, suffix and middle ids; FimUnsupported naming the missing ones."""
    if fim.pre is None or fim.suf is None or fim.mid is None:
        missing = ", ".join(fim.missing())
        raise FimUnsupported(f"fill-in-the-middle is not supported by this model: it has no "
                             f"FIM {missing} token")
    return fim.pre, fim.suf, fim.mid


def tokenize_mixed(tok: InfillTokenizer, piece: Mixed) -> list[int]:
    """Text without special-token parsing or BOS; ids inside a list are kept as they are."""
    if isinstance(piece, str):
        return tok.encode(piece, special=False, add_bos=False)
    ids: list[int] = []
    for item in piece:
        ids += [item] if isinstance(item, int) else tok.encode(item, special=False, add_bos=False)
    return ids


def repo_context(tok: InfillTokenizer, extra: Sequence[ExtraFile]) -> list[int]:
    """The repo-level block before the FIM prefix: repo name, each extra file, current file."""
    fim = tok.fim
    out: list[int] = []
    if fim.rep is not None:
        out += [fim.rep, *tok.encode(REPO_NAME, special=False, add_bos=False)]
    for chunk in extra:
        if fim.sep is not None:
            out += [fim.sep, *tok.encode(chunk.filename + "\n", special=False, add_bos=False)]
        else:
            out += tok.encode(SNIPPET_MARKER, special=False, add_bos=False)
        out += tok.encode(chunk.text, special=False, add_bos=False)
    if fim.sep is not None:
        out += [fim.sep, *tok.encode(CURRENT_FILE, special=False, add_bos=False)]
    return out


def infill_prompt(tok: InfillTokenizer, prefix: Mixed, suffix: Mixed, *,
                  extra: Sequence[ExtraFile] = (), prompt: Sequence[int] = (),
                  budget: Budget = Budget()) -> list[int]:
    """The prompt ids of one infill request (prefix-suffix-middle order)."""
    pre, suf, mid = check_fim(tok.fim)
    prefix_ids = tokenize_mixed(tok, prefix)
    suffix_ids = tokenize_mixed(tok, suffix)
    block = repo_context(tok, extra)
    n_prefix = min(len(prefix_ids), 3 * (budget.n_batch // 4))
    n_suffix = min(len(suffix_ids), max(0, budget.n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, budget.n_ctx - budget.n_batch - 2 * budget.n_predict), len(block))
    head = [pre, *prefix_ids[len(prefix_ids) - n_prefix:], *prompt]
    if tok.add_bos and tok.bos_id is not None:
        head.insert(0, tok.bos_id)
    tail = [*head, suf, *suffix_ids[:n_suffix], mid]
    # where llama.cpp's sizes would not leave a generated token room (a small context, or
    # n_predict -1), the oldest extra context goes first, then the prefix from the left
    room = budget.n_ctx - 1 - len(tail)
    n_extra = max(0, min(n_extra, room))
    if room < 0:
        keep = len(head) - (1 if tok.add_bos and tok.bos_id is not None else 0) - 1
        cut = min(-room, keep - len(prompt))
        at = len(head) - keep
        tail = [*tail[:at], *tail[at + cut:]]
    return [*block[len(block) - n_extra:], *tail]
