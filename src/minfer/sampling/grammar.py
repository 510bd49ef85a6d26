"""Grammar-constrained decoding: GBNF, Lark, regex and JSON Schema masks through llguidance.

Two steps, so a bad grammar is refused before any model is loaded:

1. *Compile* user input into an llguidance grammar string (checked by the library; a grammar it
   cannot take raises `GrammarError` with its one-line message):
   `gbnf_grammar(text)`, `lark_grammar(text)`, `regex_grammar(pattern)`,
   `json_schema_grammar(schema)`, `json_object_grammar()`, and for the HTTP server
   `response_format_to_grammar(response_format) -> str | None` (OpenAI `response_format`:
   `text` → None, `json_object` → any object (or its `schema`, as llama.cpp accepts),
   `json_schema` → `json_schema.schema`).
2. *Match* it against one model's vocabulary: `GrammarVocab.from_tokenizer(tok, n_vocab)` builds
   llguidance's view of minfer's own token bytes (control tokens are marked special, every
   end-of-generation id is an EOS; ~0.5 s, build it once per model), and
   `GrammarMask(vocab, grammar)` is a `LogitMask` (apply / accept / reset) for the `Sampler`.

The mask runs first in the sampler chain, on the raw logits: forbidden ids get -inf, so no later
stage (penalties, top-k, temperature, mirostat) can pick them. End-of-generation ids are allowed
only where the grammar accepts. When no token at all is allowed (the grammar is finished but the
vocabulary has no way to end, or the matcher hit an error or a resource limit), `is_stopped()` is
true and `stop_reason` says why; the generation loop checks it before sampling, so the text so far
is always a valid prefix and no arbitrary token is ever drawn.

JSON Schema whitespace between tokens is limited to 20 characters per gap (as llama.cpp's
converter does), so a sampled model cannot wander off into endless newlines; a schema may change
that with llguidance's `x-guidance` options.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import llguidance as llg
import llguidance.numpy as llnp
import numpy as np

from minfer.errors import GrammarError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_DEFAULTS: JsonCompileOptions = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}
_EXCERPT = re.compile(r"^(?:[\s^~]*|\d+\s*\|.*)$")  # "  1 | start: foo" and "^^^" lines


# -- compiling ------------------------------------------------------------------------------------

def check_grammar(grammar: str) -> str:
    """Raise GrammarError unless llguidance accepts `grammar`; return it unchanged."""
    try:
        message = llg.LLMatcher.validate_grammar(grammar)
    except (ValueError, RuntimeError) as exc:
        raise GrammarError(f"grammar refused: {_one_line(str(exc))}") from None
    if message:
        raise GrammarError(f"grammar refused: {_one_line(message)}")
    return grammar


def gbnf_grammar(text: str) -> str:
    """A llama.cpp GBNF grammar (root rule `root`), converted to llguidance's Lark form."""
    try:
        grammar = llg.grammar_from("gbnf", text)
    except Exception as exc:  # the converter raises plain Exceptions for parse errors
        raise GrammarError(f"GBNF grammar refused: {_one_line(str(exc))}") from None
    return check_grammar(grammar)


def lark_grammar(text: str) -> str:
    """An llguidance Lark grammar (rule `start`; may embed `%json{...}` schemas)."""
    return check_grammar(llg.grammar_from("lark", text))


def regex_grammar(pattern: str) -> str:
    """The output must match `pattern` as a whole (Rust regex syntax)."""
    return check_grammar(llg.grammar_from("regex", pattern))


def json_schema_grammar(schema: str | Mapping[str, Any]) -> str:
    """Output is one JSON value valid against `schema` (a dict or JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, Mapping):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(dict(schema), defaults=JSON_DEFAULTS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"JSON schema refused: {_one_line(str(exc))}") from None
    return check_grammar(grammar)


def json_object_grammar() -> str:
    """Any JSON object (`--json-object`, OpenAI `response_format: {"type": "json_object"}`)."""
    return json_schema_grammar({"type": "object"})


def response_format_to_grammar(response_format: Mapping[str, Any] | None) -> str | None:
    """The grammar an OpenAI `response_format` asks for, or None for free text."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise GrammarError("response_format must be an object")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return json_object_grammar() if schema is None else json_schema_grammar(schema)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError("response_format.json_schema must be an object")
        schema = spec.get("schema")
        return json_object_grammar() if schema is None else json_schema_grammar(schema)
    raise GrammarError(f"unsupported response_format type {kind!r} "
                       "(expected 'text', 'json_object' or 'json_schema')")


def _one_line(message: str) -> str:
    """The library's message on one line, without its source excerpt and caret lines."""
    lines = [ln.strip() for ln in message.splitlines()]
    kept = [ln for ln in lines if ln and not _EXCERPT.match(ln)]
    return " ".join(kept) if kept else "unknown error"


def _first_line(message: str) -> str:
    """A matcher error's headline (the rest is a parser-state dump)."""
    return message.strip().split("\n", 1)[0].split("<state>", 1)[0].strip() or "unknown error"


# -- the vocabulary -------------------------------------------------------------------------------

class VocabSource(Protocol):
    """What GrammarVocab reads from a tokenizer (minfer.tokenizer.Tokenizer has it)."""

    n_vocab: int
    eos_id: int | None
    eot_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_control(self, token_id: int) -> bool: ...

    def encode(self, text: str, *, special: bool = True,
               add_bos: bool | None = None) -> list[int]: ...


class _Wrapped:
    """The duck type `llguidance.TokenizerWrapper` reads: token bytes, ids, and an encoder."""

    def __init__(self, tok: VocabSource, n_vocab: int, eos: list[int]) -> None:
        tokens: list[bytes] = []
        for i in range(min(n_vocab, tok.n_vocab)):
            b = tok.token_bytes(i)
            # llguidance (like llama.cpp) marks special tokens with a 0xff prefix; the grammar
            # names them as <|im_end|>. User-defined ones (<tool_call>) stay plain text.
            tokens.append(b"\xff" + b if tok.is_control(i) and b else b)
        tokens.extend(b"" for _ in range(n_vocab - len(tokens)))  # padding rows of the logits
        self.tokens = tokens
        self.eos_token_id = eos[0]
        self.bos_token_id = None
        self.special_token_ids = [i for i, b in enumerate(tokens) if b.startswith(b"\xff")]
        self._encode = tok.encode

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text, special=False, add_bos=False)


class GrammarVocab:
    """llguidance's tokenizer view of one model's vocabulary (build once, share between masks)."""

    def __init__(self, lltok: llg.LLTokenizer, n_vocab: int, eos_ids: Sequence[int],
                 specials: Mapping[str, int] | None = None) -> None:
        self.lltok = lltok
        self.n_vocab = n_vocab
        self.eos_ids = tuple(eos_ids)
        # control tokens' texts → ids: a grammar matches them as tokens (`<[id]>`), not text
        self.specials: dict[str, int] = dict(specials or {})

    @classmethod
    def from_tokenizer(cls, tok: VocabSource, n_vocab: int | None = None) -> GrammarVocab:
        """n_vocab: the logits' length (the model's vocabulary, may exceed the tokenizer's)."""
        n = tok.n_vocab if n_vocab is None else n_vocab
        eos = sorted(tok.eot_ids) or ([tok.eos_id] if tok.eos_id is not None else [])
        if not eos:
            raise GrammarError("the vocabulary has no end-of-generation token")
        if n < tok.n_vocab:
            raise GrammarError(f"logits of {n} ids cannot cover the {tok.n_vocab}-token vocabulary")
        wrapped = _Wrapped(tok, n, eos)
        specials: dict[str, int] = {}
        for i in wrapped.special_token_ids:
            specials.setdefault(wrapped.tokens[i][1:].decode("utf-8", errors="replace"), i)
        wrapper = llg.TokenizerWrapper(wrapped)
        return cls(llg.LLTokenizer(wrapper, n_vocab=n, eos_token=eos), n, eos, specials)


# -- the mask -------------------------------------------------------------------------------------

class GrammarMask:
    """A LogitMask driven by an llguidance matcher: one generation's grammar state."""

    def __init__(self, vocab: GrammarVocab, grammar: str) -> None:
        self.vocab = vocab
        self.grammar = grammar
        self.stop_reason = ""
        self._matcher = self._new_matcher()
        self._bits = llnp.allocate_token_bitmask(1, vocab.n_vocab)  # int32 [1, ceil(n/32)]
        self._fresh = False  # does _bits hold the mask of the current state?

    def _new_matcher(self) -> llg.LLMatcher:
        matcher = llg.LLMatcher(self.vocab.lltok, self.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"grammar refused: {_first_line(matcher.get_error())}")
        return matcher

    def _compute(self) -> None:
        if not self._fresh:
            llnp.fill_next_token_bitmask(self._matcher, self._bits)
            self._fresh = True

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the ids the grammar allows next."""
        self._compute()
        bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little",
                             count=self.vocab.n_vocab)
        return bits.view(np.bool_)

    def apply(self, logits: np.ndarray) -> None:
        """Forbidden ids -> -inf, in place (logits: float32 [n_vocab])."""
        allowed = self.allowed()
        ids = np.flatnonzero(allowed)
        if len(ids) * 8 < len(logits):  # the usual case: a few ids allowed; copy them around
            kept = logits[ids]
            logits.fill(-np.inf)
            logits[ids] = kept
        else:
            np.copyto(logits, -np.inf, where=~allowed)

    def accept(self, token_id: int) -> None:
        """Advance the matcher past a committed token (a forbidden one puts it in error)."""
        self._fresh = False
        if not self._matcher.consume_token(int(token_id)):
            self.stop_reason = f"token {token_id} refused: {_first_line(self._matcher.get_error())}"

    def reset(self) -> None:
        self._fresh = False
        self.stop_reason = ""
        if not self._matcher.reset() or self._matcher.is_error():
            self._matcher = self._new_matcher()

    def is_accepting(self) -> bool:
        """True where the text so far is a complete sentence of the grammar."""
        return bool(self._matcher.is_accepting())

    def is_stopped(self) -> bool:
        """True when no token (not even end-of-generation) may follow; see `stop_reason`."""
        if self._matcher.is_error():
            if not self.stop_reason:
                self.stop_reason = f"grammar error: {_first_line(self._matcher.get_error())}"
            return True
        self._compute()
        if self._bits.any():
            return False
        reason = self._matcher.stop_reason()
        self.stop_reason = f"the grammar allows no further token ({reason})"
        return True
