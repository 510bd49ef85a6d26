"""Grammar masks on the tokenizer alone: random walks through the real sampler chain.

Random logits stand in for a model: every step the Sampler (mask first, then its usual stages)
draws a token, so whatever the walk produces is something sampling could produce. Walks are
nudged towards closing tokens after a while so they end; each finished text must parse and
validate, and a walk cut short must still be a prefix the matcher accepted.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import jsonschema
import numpy as np
import pytest

from minfer.errors import GrammarError
from minfer.gguf.reader import GGUFFile
from minfer.sampling import Sampler, SamplerParams
from minfer.sampling.grammar import (
    GrammarMask,
    GrammarVocab,
    gbnf_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
    response_format_to_grammar,
)
from minfer.tokenizer.tokenizer import Tokenizer

SCHEMAS: dict[str, dict] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {"type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                        "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "address"], "additionalProperties": False,
    },
    "array_bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
             "required": ["color"], "additionalProperties": False},
    "int_bounds": {"type": "object",
                   "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                  "score": {"type": "integer", "exclusiveMinimum": -5,
                                            "exclusiveMaximum": 5}},
                   "required": ["age", "score"], "additionalProperties": False},
    "required_optional": {"type": "object",
                          "properties": {"id": {"type": "integer"}, "note": {"type": "string"},
                                         "ok": {"type": "boolean"}},
                          "required": ["id", "ok"], "additionalProperties": False},
    "ref": {"$defs": {"point": {"type": "object",
                                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                "required": ["x", "y"], "additionalProperties": False}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
            "required": ["a", "b"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3,
                         "items": {"type": "object",
                                   "properties": {"k": {"type": "string", "maxLength": 8},
                                                  "v": {"type": ["integer", "null"]}},
                                   "required": ["k", "v"], "additionalProperties": False}},
    "any_of": {"type": "object",
               "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"},
                                                  {"const": "n/a"}]}},
               "required": ["value"], "additionalProperties": False},
    "strings": {"type": "object",
                "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                               "word": {"type": "string", "minLength": 2, "maxLength": 5}},
                "required": ["code", "word"], "additionalProperties": False},
    "recursive": {"$defs": {"node": {"type": "object",
                                     "properties": {"v": {"type": "integer"},
                                                    "kids": {"type": "array", "maxItems": 2,
                                                             "items": {"$ref": "#/$defs/node"}}},
                                     "required": ["v"], "additionalProperties": False}},
                  "$ref": "#/$defs/node"},
    "any_object": {"type": "object"},
    "numbers": {"type": "array", "maxItems": 3,
                "items": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
}


@pytest.fixture(scope="module")
def tok(tiny_qwen2: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile.open(tiny_qwen2))


@pytest.fixture(scope="module")
def vocab(tok: Tokenizer) -> GrammarVocab:
    return GrammarVocab.from_tokenizer(tok)


def walk(tok: Tokenizer, mask: GrammarMask, *, seed: int, params: SamplerParams | None = None,
         max_steps: int = 400, patience: int = 30) -> tuple[list[int], bool]:
    """Sample under the mask from random logits; (ids, ended with an end-of-generation id)."""
    n = mask.vocab.n_vocab
    texts = [tok.token_text(i) for i in range(tok.n_vocab)] + [""] * (n - tok.n_vocab)
    sampler = Sampler(params or SamplerParams(temp=0.8), n, seed=seed, logit_mask=mask,
                      token_text=texts, encode=lambda s: tok.encode(s, special=False))
    sampler.reset()
    rng = np.random.default_rng(seed)
    pieces = [tok.token_bytes(i) for i in range(tok.n_vocab)] + [b""] * (n - tok.n_vocab)
    blank = np.array([p.strip() == b"" for p in pieces])
    closing = np.array([p != b"" and all(c in b'"}])' for c in p) for p in pieces])
    eot = sorted(tok.eot_ids)
    ids: list[int] = []
    for step in range(max_steps):
        assert not mask.is_stopped(), mask.stop_reason
        logits = rng.standard_normal(n).astype(np.float32) * 2
        logits[blank] -= 4
        if step > patience:
            logits[closing] += 6
            logits[eot] += 10
        token = sampler.sample(logits)
        sampler.accept(token)
        if token in tok.eot_ids:
            return ids, True
        ids.append(token)
    return ids, False


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_validate_against_schema(tok: Tokenizer, vocab: GrammarVocab,
                                              name: str) -> None:
    schema = SCHEMAS[name]
    mask = GrammarMask(vocab, json_schema_grammar(schema))
    for seed in range(6):
        ids, ended = walk(tok, mask, seed=seed)
        assert ended, f"walk {seed} did not finish: {tok.decode(ids)!r}"
        jsonschema.validate(json.loads(tok.decode(ids)), schema)


@pytest.mark.parametrize("params", [
    SamplerParams(temp=0.0),
    SamplerParams(temp=1.5, top_k=1),
    SamplerParams(temp=2.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5,
                  presence_penalty=2.0, frequency_penalty=1.0),
    SamplerParams(temp=1.0, mirostat=2),
    SamplerParams(temp=1.0, typical_p=0.5, dry_multiplier=0.8),
])
def test_no_sampler_setting_escapes_the_mask(tok: Tokenizer, vocab: GrammarVocab,
                                             params: SamplerParams) -> None:
    schema = SCHEMAS["array_of_objects"]
    mask = GrammarMask(vocab, json_schema_grammar(schema))
    for seed in range(3):
        ids, ended = walk(tok, mask, seed=seed, params=params, max_steps=300)
        text = tok.decode(ids)
        if ended:
            jsonschema.validate(json.loads(text), schema)
        else:
            assert not mask.stop_reason, mask.stop_reason  # every token was accepted


def test_eos_allowed_only_where_the_grammar_accepts(tok: Tokenizer, vocab: GrammarVocab) -> None:
    mask = GrammarMask(vocab, json_schema_grammar(SCHEMAS["array_bounds"]))
    ids, _ = walk(tok, mask, seed=11)
    mask.reset()
    for i, token in enumerate(ids):
        eos_ok = bool(mask.allowed()[sorted(tok.eot_ids)].any())
        assert eos_ok == mask.is_accepting()
        if eos_ok:
            json.loads(tok.decode(ids[:i]))
        mask.accept(token)
    assert mask.allowed()[sorted(tok.eot_ids)].all()


def _arith_ok(s: str) -> bool:
    """Recursive-descent check of the arithmetic grammar below."""
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(s) and s[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        while pos < len(s) and s[pos] in "*/":
            pos += 1
            if not factor():
                return False
        return True

    def factor() -> bool:
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            pos += 1
            if not expr() or pos >= len(s) or s[pos] != ")":
                return False
            pos += 1
            return True
        m = re.compile(r"[0-9]+").match(s, pos)
        if m is None:
            return False
        pos = m.end()
        return True

    return expr() and pos == len(s)


ARITH = r'''
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
'''


def test_gbnf_arithmetic_yields_only_sentences(tok: Tokenizer, vocab: GrammarVocab) -> None:
    mask = GrammarMask(vocab, gbnf_grammar(ARITH))
    seen = set()
    for seed in range(12):
        ids, ended = walk(tok, mask, seed=seed, max_steps=200)
        text = tok.decode(ids)
        assert ended and _arith_ok(text), text
        seen.add(text)
    assert len(seen) > 6
    assert not _arith_ok("1+") and not _arith_ok("(2") and _arith_ok("(1+2)*3")


def test_other_grammar_kinds(tok: Tokenizer, vocab: GrammarVocab) -> None:
    cases: list[tuple[str, Callable[[str], object]]] = [
             (regex_grammar(r"[a-c]{2,4}!"), re.compile(r"[a-c]{2,4}!").fullmatch),
             (lark_grammar('start: "yes" | "no"'), lambda s: s in ("yes", "no")),
             (json_object_grammar(), lambda s: isinstance(json.loads(s), dict))]
    for grammar, ok in cases:
        mask = GrammarMask(vocab, grammar)
        for seed in range(4):
            ids, ended = walk(tok, mask, seed=seed, max_steps=300)
            assert ended and ok(tok.decode(ids)), tok.decode(ids)


@pytest.mark.parametrize(("make", "text", "needle"), [
    (gbnf_grammar, "root ::= foo", "foo"),
    (gbnf_grammar, 'root ::= "a', "GBNF"),
    (lark_grammar, "start: foo", "unknown name"),
    (regex_grammar, "a(", "unclosed group"),
    (json_schema_grammar, '{"type": "strin"}', "strin"),
    (json_schema_grammar, '{"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}',
     "/$defs/x"),
    (json_schema_grammar, "{not json", "not valid JSON"),
    (json_schema_grammar, "[1]", "must be an object"),
])
def test_refused_grammars_raise_one_line(make: Callable[[str], str], text: str,
                                         needle: str) -> None:
    with pytest.raises(GrammarError) as info:
        make(text)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_response_format() -> None:
    assert response_format_to_grammar(None) is None
    assert response_format_to_grammar({"type": "text"}) is None
    assert response_format_to_grammar({"type": "json_object"}) == json_object_grammar()
    schema = SCHEMAS["enum"]
    expect = json_schema_grammar(schema)
    assert response_format_to_grammar({"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": schema}}) == expect
    assert response_format_to_grammar({"type": "json_object", "schema": schema}) == expect
    for bad in ({"type": "xml"}, {"type": "json_schema"}, "json"):
        with pytest.raises(GrammarError):
            response_format_to_grammar(bad)  # type: ignore[arg-type]


def test_mask_error_state_and_reset(tok: Tokenizer, vocab: GrammarVocab) -> None:
    mask = GrammarMask(vocab, lark_grammar('start: "ab"'))
    allowed = np.flatnonzero(mask.allowed())
    assert all(tok.token_bytes(int(i)) in (b"a", b"ab") for i in allowed)
    mask.accept(tok.encode("z")[0])
    assert mask.is_stopped() and "refused" in mask.stop_reason
    mask.reset()
    assert not mask.is_stopped() and mask.stop_reason == ""
    assert np.array_equal(np.flatnonzero(mask.allowed()), allowed)


def test_apply_sets_only_forbidden_to_minus_inf(tok: Tokenizer, vocab: GrammarVocab) -> None:
    for grammar in (lark_grammar('start: "ab"'), json_object_grammar(), regex_grammar(r"(?s:.*)")):
        mask = GrammarMask(vocab, grammar)
        logits = np.random.default_rng(0).standard_normal(vocab.n_vocab).astype(np.float32)
        out = logits.copy()
        mask.apply(out)
        allowed = mask.allowed()
        assert np.array_equal(out[allowed], logits[allowed])
        assert np.all(out[~allowed] == -np.inf)


def test_padded_logits(tok: Tokenizer) -> None:
    vocab = GrammarVocab.from_tokenizer(tok, tok.n_vocab + 37)
    mask = GrammarMask(vocab, regex_grammar(r"[0-9]+"))
    allowed = mask.allowed()
    assert allowed.shape == (tok.n_vocab + 37,) and not allowed[tok.n_vocab:].any()
    with pytest.raises(GrammarError):
        GrammarVocab.from_tokenizer(tok, tok.n_vocab - 1)


def _generate_module() -> ModuleType:
    """minfer.engine.generate, or a skip while the engine cannot be imported (no kernels yet)."""
    try:
        return importlib.import_module("minfer.engine.generate")
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"engine not importable: {exc}")


class _FakeEngine:
    """Random logits, no model: enough for the generation loop."""

    def __init__(self, n_vocab: int, seed: int = 0) -> None:
        self.n_ctx = 512
        self.n_vocab = n_vocab
        self.rng = np.random.default_rng(seed)

    def forward(self, tokens: list[int], pos: int, n_out: int = 1) -> np.ndarray:
        return self.rng.standard_normal((n_out, self.n_vocab)).astype(np.float32)


def test_generate_length_leaves_a_valid_prefix(tok: Tokenizer, vocab: GrammarVocab) -> None:
    gen = _generate_module()
    grammar = json_schema_grammar(SCHEMAS["nested"])
    mask = GrammarMask(vocab, grammar)
    sampler = Sampler(SamplerParams(temp=0.8), vocab.n_vocab, seed=3, logit_mask=mask)
    sampler.reset()
    events = list(gen.generate(_FakeEngine(vocab.n_vocab), tok, sampler, [1, 2, 3],
                               max_tokens=12, constraint=mask))
    done = events[-1]
    assert isinstance(done, gen.Finished) and done.reason == "length" and len(done.ids) == 12
    check = GrammarMask(vocab, grammar)
    for t in done.ids:
        check.accept(t)
    assert not check.is_stopped() and check.stop_reason == ""


class _StoppedMask:
    stop_reason = "the grammar allows no further token (NoExtension)"

    def __init__(self, after: int) -> None:
        self.left = after

    def apply(self, logits: np.ndarray) -> None:
        pass

    def accept(self, token_id: int) -> None:
        self.left -= 1

    def reset(self) -> None:
        pass

    def is_stopped(self) -> bool:
        return self.left <= 0


def test_generate_stops_when_nothing_is_allowed(tok: Tokenizer) -> None:
    gen = _generate_module()
    mask = _StoppedMask(after=4)
    sampler = Sampler(SamplerParams(temp=0.0), tok.n_vocab, seed=0, logit_mask=mask)
    events = list(gen.generate(_FakeEngine(tok.n_vocab), tok, sampler, [1, 2], max_tokens=50,
                               constraint=mask))
    done = events[-1]
    assert isinstance(done, gen.Finished) and done.reason == "grammar" and len(done.ids) == 4


@pytest.mark.real_model
def test_real_vocabulary_walks(real_model_path: Path) -> None:
    """The Qwen vocabulary: special tokens, <tool_call> as text, 150k tokens per mask."""
    tok = Tokenizer.from_gguf(GGUFFile.open(real_model_path))
    vocab = GrammarVocab.from_tokenizer(tok)
    assert tok.eot_ids <= set(vocab.eos_ids)
    for name in ("nested", "ref", "array_of_objects"):
        mask = GrammarMask(vocab, json_schema_grammar(SCHEMAS[name]))
        for seed in range(2):
            ids, ended = walk(tok, mask, seed=seed)
            assert ended
            jsonschema.validate(json.loads(tok.decode(ids)), SCHEMAS[name])
    special = GrammarMask(vocab, lark_grammar('start: "x" <|im_end|>'))
    special.accept(tok.encode("x")[0])
    assert np.flatnonzero(special.allowed()).tolist() == [tok.token_id("<|im_end|>")]


def test_cli_refuses_a_bad_grammar_before_loading(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    from minfer.cli.main import main

    missing = str(tmp_path / "no-such-model.gguf")  # never opened: the grammar fails first
    for flags, needle in [(["-j", '{"type": "strin"}'], "strin"),
                          (["--grammar", "root ::= foo"], "foo"),
                          (["-jf", str(tmp_path / "none.json")], "cannot read")]:
        assert main(["run", "-m", missing, "-p", "hi", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err


def test_cli_grammar_flags(tmp_path: Path) -> None:
    import argparse

    from minfer.cli.run_cmd import add_grammar_args, grammar_from_args

    p = argparse.ArgumentParser()
    add_grammar_args(p)
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS["enum"]))
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text(ARITH)
    assert grammar_from_args(p.parse_args([])) is None
    expect_schema = json_schema_grammar(SCHEMAS["enum"])
    assert grammar_from_args(p.parse_args(["-jf", str(schema)])) == expect_schema
    assert grammar_from_args(p.parse_args(["--json-schema", schema.read_text()])) == expect_schema
    assert grammar_from_args(p.parse_args(["--grammar-file", str(gbnf)])) == gbnf_grammar(ARITH)
    assert grammar_from_args(p.parse_args(["--json-object"])) == json_object_grammar()
    with pytest.raises(SystemExit):
        p.parse_args(["--json-object", "-j", "{}"])
