"""Speculative decoding's settings and its draft model's file.

Speculation proposes cheap guesses at the next tokens, which the target model verifies in one
forward (minfer.engine.core): decode is memory-bound, so k+1 rows cost about one. The proposers
(prompt lookup, the draft model) and the policy that decides per step whether and how many
tokens to propose are the core's (minfer.engine.core.proposer, .lookup, .policy). This module
holds what the flags and the model's assembly (minfer.engine.assembly) need:

- `SpecConfig`: llama.cpp's speculative flags and prompt lookup's, checked once;
- `check_same_vocab`, which refuses a draft whose vocabulary is not the target's;
- `draft_file`: the draft's weights at 4 bits, the file speculative decoding loads as its draft.

A draft step is worth taking only while it costs a small part of a target step, and decode
reads every weight once a token: the 0.5B coder in Q8_0 (491 MB) drafting for the 1.5B Q4_K_M
(1.1 GB) costs ~0.45 of a target step, where the same draft in Q4_0 (355 MB) costs ~0.3. The
draft's proposals are only guesses the target verifies, so its precision changes the speed and
never the output. Measured side by side (Intel Xeon, Sapphire Rapids, 2 threads; 1.5B target,
160-token greedy code): Q8_0 draft 1.00x plain (acceptance 0.81), Q4_0 draft 1.50x (0.78).

`draft_file(path, quant)` returns the file to load: the given one when `quant` is "keep" or its
matrix weights are already at most `NARROW_BITS` bits a value (a Q4_K_M draft stays as it is),
else a Q4_0 copy (`minfer.tools.quantize`, pure Q4_0 with the token embedding and output too, as
`minfer quantize --pure --allow-requantize` writes it), made once into `$MINFER_HOME/drafts/`
under a name keyed by the source's path, size and modification time (~2.5 s for the 0.5B on
2 cores); copies whose source is gone or changed are removed when a new one is made.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from minfer.errors import MinferError
from minfer.gguf.reader import GGUFFile
from minfer.store.catalog import minfer_home

DRAFT_MAX_LIMIT = 16  # --draft-max's range (llama.cpp's default is 16; proposals stop at 15)
DRAFT_VOCAB = 65536  # --draft-vocab's default (see SpecConfig.draft_vocab)
DRAFT_QUANTS = ("q4_0", "keep")  # --draft-quant's choices
NARROW_BITS = 5.0  # a draft whose matrix weights average more bits a value is narrowed


class SpeculativeError(MinferError):
    """Speculative decoding that cannot run as asked (mismatched draft vocabulary, bad flags)."""


@dataclass(frozen=True)
class SpecConfig:
    """llama.cpp's flags: --draft-max, --draft-min, --draft-p-min; and --lookup-ngram."""

    draft_max: int = 16  # most tokens proposed per step
    draft_min: int = 0  # a proposal shorter than this is dropped (plain step instead)
    p_min: float = 0.3  # the draft model stops when its top probability is below this
    lookup_ngram: int = 0  # prompt lookup's longest n-gram (0: off)
    # the draft model's logits over the vocabulary's first N ids only (0: all): a cheaper draft
    # step (its output projection is a large part of a small model); a target token beyond N
    # can then not be proposed, only verified. Exactness is untouched either way. 65536:
    # 1.5B target, 0.5B draft, free code, 3 runs side by side with the whole vocabulary:
    # 1.28-1.82x plain against 1.08-1.61x (Intel SPR, 2 threads); a no-op below 65536 ids.
    draft_vocab: int = DRAFT_VOCAB
    # the draft's weights narrowed to Q4_0 when its file's are wider ("keep": the file as it
    # is): a cheaper draft step, the output unchanged (`draft_file`)
    draft_quant: str = "q4_0"
    adaptive: bool = True  # choose k by measured cost and acceptance (else always draft_max)
    draft_model: Path | None = None  # a draft model's file (-md); None: no draft model
    mtp: bool = False  # the target's own MTP (NextN) head proposes (`--spec mtp`), alone

    def __post_init__(self) -> None:
        if not 1 <= self.draft_max <= DRAFT_MAX_LIMIT:
            raise SpeculativeError(f"--draft-max must be in 1..{DRAFT_MAX_LIMIT}, "
                                   f"got {self.draft_max}")
        if not 0 <= self.draft_min <= self.draft_max:
            raise SpeculativeError(f"--draft-min must be in 0..--draft-max, got {self.draft_min}")
        if self.draft_vocab < 0:
            raise SpeculativeError(f"--draft-vocab must be >= 0, got {self.draft_vocab}")
        if self.draft_quant not in DRAFT_QUANTS:
            raise SpeculativeError(f"--draft-quant must be one of {', '.join(DRAFT_QUANTS)}, "
                                   f"got {self.draft_quant!r}")
        if not 0.0 <= self.p_min <= 1.0:
            raise SpeculativeError(f"--draft-p-min must be in [0, 1], got {self.p_min}")
        if self.lookup_ngram < 0:
            raise SpeculativeError(f"--lookup-ngram must be >= 0, got {self.lookup_ngram}")
        if self.mtp and (self.lookup_ngram or self.draft_model is not None):
            raise SpeculativeError("--spec mtp proposes alone: drop --lookup-ngram / "
                                   "--model-draft")


def check_same_vocab(target: Sequence[str], draft: Sequence[str], *, target_n_vocab: int,
                     draft_n_vocab: int) -> None:
    """Refuse a draft model whose token list or logit width differs from the target's."""
    if target_n_vocab != draft_n_vocab or len(target) != len(draft):
        raise SpeculativeError(
            f"the draft model's vocabulary does not match the target's ({len(draft)} tokens, "
            f"{draft_n_vocab} logits vs {len(target)} tokens, {target_n_vocab} logits): "
            "use a draft model of the same family")
    for i, (a, b) in enumerate(zip(target, draft, strict=True)):
        if a != b:
            raise SpeculativeError(
                f"the draft model's vocabulary does not match the target's: token {i} is "
                f"{b!r} in the draft, {a!r} in the target")


# -- the draft's file ----------------------------------------------------------------------------
log = logging.getLogger(__name__)



def weight_bits(f: GGUFFile) -> float:
    """Bits a value of the file's matrix weights (2-D or more), averaged over their values."""
    matrices = [t for t in f.tensors.values() if len(t.shape) >= 2]
    values = sum(t.n_rows * t.shape[0] for t in matrices)
    return 8 * sum(t.nbytes for t in matrices) / values if values else 0.0


def draft_file(path: Path, quant: str = "q4_0") -> Path:
    """The draft file speculative decoding loads for `path` (see the module docstring)."""
    if quant not in DRAFT_QUANTS:
        raise ValueError(f"--draft-quant must be one of {', '.join(DRAFT_QUANTS)}, got {quant!r}")
    if quant == "keep":
        return path
    with GGUFFile.open(path) as f:
        if weight_bits(f) <= NARROW_BITS:
            return path
    folder = minfer_home() / "drafts"
    dst = folder / f"{path.name.removesuffix('.gguf')}-{_key(path)}.{quant}.gguf"
    if dst.is_file():
        return dst
    from minfer.tools.quantize import MixOptions, parse_ftype, parse_tensor_type, quantize_model

    folder.mkdir(parents=True, exist_ok=True)
    _prune(folder)
    narrow = parse_tensor_type(quant)
    # written under a name of this process's own, then renamed: server replicas starting
    # together each make the copy without writing into one another's file
    mine = dst.with_name(f"{dst.name}.{os.getpid()}")
    report = quantize_model(path, mine, MixOptions(parse_ftype(quant), pure=True,
                                                   output_tensor_type=narrow,
                                                   token_embedding_type=narrow),
                            allow_requantize=True)
    dst.with_name(dst.name + ".source").write_text(str(path.resolve()))
    os.replace(mine, dst)
    log.info("draft model %s at %s: %s (%.1f s, once)", path.name, quant.upper(), dst,
             report.seconds)
    return dst


def _key(path: Path) -> str:
    """What names a source file's narrowed copy: its path, size and modification time."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
                          ).hexdigest()[:12]


def _prune(folder: Path) -> None:
    """Remove the copies whose source is gone or changed (each copy's `.source` names it), and
    the unfinished copies of processes that are gone (`<copy>.<pid>`, `<copy>.<pid>.part`)."""
    for part in folder.glob("*.gguf.*"):
        pid = part.name.split(".gguf.", 1)[1].removesuffix(".part")
        if pid.isdigit() and not _alive(int(pid)):
            part.unlink(missing_ok=True)
    for note in folder.glob("*.gguf.source"):
        copy = note.with_name(note.name.removesuffix(".source"))
        source = Path(note.read_text())
        if not source.is_file() or f"-{_key(source)}." not in copy.name:
            copy.unlink(missing_ok=True)
            note.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
