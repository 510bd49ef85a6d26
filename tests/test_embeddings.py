"""Encoders and embeddings on synthetic models: BERT against the float64 oracle in every pooling,
batch invariance, decoder embeddings, the Embedder's checks and normalisation, WordPiece rules,
and the load errors of malformed BERT files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from minfer.engine.embed import Embedder, Encoded, InputError, normalize
from minfer.engine.forward import Batch, Engine
from minfer.errors import GGUFError, GraphError, MinferError, ModelError, TokenizerError
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.tokenizer import Tokenizer
from minfer.tools.synth import write_tiny_bert

from .oracle import OracleBert

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello world, this is a test",
         "x", "", "Tokenizer: merge the most common pairs (th, in, er)!"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer BERT with mean pooling, token types and a 1-output classifier head."""
    return write_tiny_bert(tmp_path_factory.mktemp("bert") / "bert.gguf", cls_head=1)


@pytest.fixture(scope="module")
def bert_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("bert") / "bert_q8.gguf",
                           weight_types={"token_embd": QType.F16, "default": QType.Q8_0})


def _engine(path: Path, pooling: str | None = None) -> tuple[Engine, Tokenizer]:
    f = GGUFFile.open(path)
    engine = Engine(f, HParams.from_gguf(f), n_ctx=128, batch_invariant=True, pooling=pooling)
    return engine, Tokenizer.from_gguf(f)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last", "none", "rank"])
def test_bert_matches_the_oracle(bert: Path, pooling: str) -> None:
    engine, tok = _engine(bert, pooling)
    seqs = [tok.encode(t) for t in TEXTS]
    out = engine.forward_batch(Batch.sequences(seqs, pooling=pooling))
    oracle = OracleBert(str(bert))
    if pooling == "none":
        ref = np.concatenate([oracle.hidden(s) for s in seqs])
    else:
        ref = np.stack([oracle.pool(s, pooling) for s in seqs])
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


def test_bert_token_types_are_data(bert: Path) -> None:
    """A pair's second segment reads token type 1 (BERT's sentence B)."""
    engine, tok = _engine(bert, "cls")
    ids = tok.encode("hello") + tok.encode("world", add_bos=False)
    types = [0] * 3 + [1] * (len(ids) - 3)
    out = engine.forward_batch(Batch.sequences([ids], pooling="cls", types=[types]))
    ref = OracleBert(str(bert)).pool(ids, "cls", types)
    np.testing.assert_allclose(out[0], ref, atol=2e-5)
    plain = engine.forward_batch(Batch.sequences([ids], pooling="cls"))
    assert not np.allclose(out, plain, atol=1e-3)


def _paths(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder's matmul path: "f32" (the f32 GEMM), "integer" (the decoders' int8 dots,
    under MINFER_ENCODER_INT8 where AMX tiles are not usable), "i16" (the int16 x int8 GEMM,
    the default where AMX tiles are not usable), "default" (what this host picks)."""
    from minfer.backends.cpu import kernels

    if path == "f32":
        monkeypatch.setenv("MINFER_ENCODER_F32", "1")
    elif path in ("integer", "i16"):
        if path == "integer":
            monkeypatch.setenv("MINFER_ENCODER_INT8", "1")
        monkeypatch.setattr(kernels, "amx_usable", lambda: False)


@pytest.mark.parametrize(("path", "min_cos"), [("f32", 0.99999), ("default", 0.9999),
                                               ("integer", 0.9999), ("i16", 0.99999)])
def test_quantized_bert_close_to_the_oracle(bert_q8: Path, path: str, min_cos: float,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 path rounds each activation to Q8_0 (as llama.cpp does): a little further
    from the float64 oracle than the f32 GEMM."""
    _paths(path, monkeypatch)
    engine, tok = _engine(bert_q8)
    seqs = [tok.encode(t) for t in TEXTS]
    out = engine.forward_batch(Batch.sequences(seqs, pooling="mean"))
    ref = np.stack([OracleBert(str(bert_q8)).pool(s, "mean") for s in seqs])
    cos = (out * ref).sum(1) / np.linalg.norm(out, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > min_cos


@pytest.mark.parametrize("flag", ["", "MINFER_ENCODER_INT8", "MINFER_ENCODER_F32"])
def test_a_quantized_encoder_without_amx_runs_the_int16_gemm_unless_told(
        bert_q8: Path, flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where AMX tiles are not usable, a Q8_0 encoder's projections are the int16 x int8 GEMM
    over the file's codes (the default), under MINFER_ENCODER_INT8 the decoders' int8 row
    drivers, under MINFER_ENCODER_F32 the f32 GEMM (all batch-invariant: see the test below)."""
    from minfer import jit_cache
    from minfer.backends.cpu import kernels

    monkeypatch.setattr(kernels, "amx_usable", lambda: False)
    if flag:
        monkeypatch.setenv(flag, "1")
    engine, tok = _engine(bert_q8)
    seqs = [tok.encode(t) for t in TEXTS]
    engine.forward_batch(Batch.sequences(seqs, pooling="mean"))
    names = set()
    for prepared in engine.cache._entries.values():
        tape = prepared.scratch["tape-invariant" if "tape-invariant" in prepared.scratch
                                else "tape"][1]
        for step in tape.steps:
            call = jit_cache.kernel_call(step)
            if call is not None:
                names.add(getattr(getattr(call[0], "py_func", call[0]), "__name__", ""))
    assert any(n.startswith("mv_q8_0") for n in names) == (flag == "MINFER_ENCODER_INT8"), names
    assert ("_quantize" in names) == (flag == ""), names
    assert any("gemm" in n for n in names) != (flag == "MINFER_ENCODER_INT8"), names


@pytest.mark.parametrize(("path_name", "path"), [("bert", "default"), ("bert_q8", "default"),
                                                ("bert_q8", "integer"), ("bert_q8", "f32"),
                                                ("bert_q8", "i16")])
def test_an_inputs_embedding_does_not_depend_on_its_batch(
        path_name: str, path: str, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bitwise: alone, first, last, between others, in a batch of 1 to 5 inputs."""
    _paths(path, monkeypatch)
    engine, tok = _engine(request.getfixturevalue(path_name))
    seqs = [tok.encode(t) for t in TEXTS]
    alone = [engine.forward_batch(Batch.sequences([s], pooling="mean"))[0] for s in seqs]
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0], [1, 4, 1, 3]):
        out = engine.forward_batch(Batch.sequences([seqs[i] for i in order], pooling="mean"))
        for row, i in enumerate(order):
            assert np.array_equal(out[row], alone[i]), (order, i)


def test_embedder_packs_normalises_and_checks(bert: Path) -> None:
    engine, tok = _engine(bert)
    emb = Embedder(engine, tok, max_batch_tokens=20)  # several forwards
    vecs = emb.embed(TEXTS)
    assert len(vecs) == len(TEXTS)
    np.testing.assert_allclose([np.linalg.norm(v) for v in vecs], 1.0, atol=1e-6)
    raw = emb.embed(TEXTS, norm=-1)
    for v, r in zip(vecs, raw, strict=True):
        assert np.array_equal(v, normalize(r, 2))
    one = Embedder(engine, tok).embed(TEXTS)  # one forward: the same bits
    assert all(np.array_equal(a, b) for a, b in zip(vecs, one, strict=True))
    with pytest.raises(InputError, match="input 1 is empty") as err:
        emb.check([Encoded([2]), Encoded([])])
    assert err.value.index == 1
    with pytest.raises(InputError, match="outside the vocabulary"):
        emb.check([Encoded([2, 10_000])])
    long = Encoded(tok.encode("x " * 200))
    with pytest.raises(InputError, match="more than this model reads"):
        emb.check([long])
    (cut,) = emb.check([long], truncate=True)
    assert len(cut.ids) == emb.max_tokens and cut.ids[-1] == tok.sep_id and cut.truncated
    with pytest.raises(MinferError, match="rank pooling"):
        emb.rerank("q", ["d"])


def test_rerank_scores_pairs_with_token_types(bert: Path) -> None:
    engine, tok = _engine(bert, "rank")
    emb = Embedder(engine, tok)
    pair = emb.encode_pair("hello", "world test")
    cls, sep = tok.bos_id, tok.sep_id
    assert pair.ids[0] == cls and pair.ids.count(sep) == 2 and pair.ids[-1] == sep
    assert pair.types is not None and pair.types[0] == 0 and pair.types[-1] == 1
    scores = emb.rerank("hello", ["world test", "the fox"])
    ref = OracleBert(str(bert)).pool(pair.ids, "rank", pair.types)
    assert scores[0] == pytest.approx(float(ref[0]), abs=2e-5)


@pytest.mark.parametrize("norm", [-1, 0, 1, 2, 3])
def test_normalize_follows_llama_cpp(norm: int) -> None:
    v = np.array([3.0, -4.0, 0.5, 0.0], np.float32)
    total = {-1: 1.0, 0: 4.0 / 32760.0, 1: 7.5, 2: np.sqrt(25.25),
             3: (27 + 64 + 0.125) ** (1 / 3)}[norm]
    np.testing.assert_allclose(normalize(v, norm), v / total, rtol=1e-6)
    assert not normalize(np.zeros(4, np.float32), norm).any()


def test_decoder_embeddings_pool_the_final_hidden_states(tiny_qwen2: Path) -> None:
    """A generative model's embeddings: last-token rows equal the unpooled rows' last, the
    mean their mean, and an input's vector does not depend on its batch."""
    f = GGUFFile.open(tiny_qwen2)
    hp = HParams.from_gguf(f)
    tok = Tokenizer.from_gguf(f)
    seqs = [tok.encode(t) for t in TEXTS if t]
    runs = {p: Engine(f, hp, n_ctx=256, batch_invariant=True, pooling=p)
            for p in ("none", "last", "mean")}
    rows = runs["none"].forward_batch(Batch.sequences(seqs, pooling="none"))
    last = runs["last"].forward_batch(Batch.sequences(seqs, pooling="last"))
    mean = runs["mean"].forward_batch(Batch.sequences(seqs, pooling="mean"))
    ends = np.cumsum([len(s) for s in seqs])
    starts = ends - [len(s) for s in seqs]
    for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
        np.testing.assert_allclose(last[i], rows[e - 1], atol=1e-5)
        np.testing.assert_allclose(mean[i], rows[s:e].astype(np.float64).mean(0), atol=1e-5)
        alone = runs["last"].forward_batch(Batch.sequences([seqs[i]], pooling="last"))
        assert np.array_equal(alone[0], last[i])
    with pytest.raises(GraphError, match="rank"):
        Engine(f, hp, n_ctx=64, pooling="rank").forward_batch(
            Batch.sequences(seqs[:1], pooling="rank"))


def test_wordpiece_rules(bert: Path) -> None:
    tok = Tokenizer.from_gguf(GGUFFile.open(bert))
    assert tok.kind == "wpm"
    ids = tok.encode("The FOX!")
    assert ids[0] == tok.bos_id and ids[-1] == tok.sep_id
    assert tok.encode("The FOX!", add_bos=False) == ids[1:-1]
    # lowercased, punctuation its own word, an unknown character makes its word [UNK]
    assert tok.encode("the fox !", add_bos=False) == ids[1:-1]
    assert tok.encode("fox\u4e2d", add_bos=False)[-1] == tok.unk_id
    # accents stripped: é -> e
    assert tok.encode("th\u00e9", add_bos=False) == tok.encode("the", add_bos=False)


def test_malformed_bert_files_are_refused(tmp_path: Path) -> None:
    def load(**kw: object) -> None:
        path = write_tiny_bert(tmp_path / f"b{len(list(tmp_path.iterdir()))}.gguf", **kw)  # type: ignore[arg-type]
        f = GGUFFile.open(path)
        HParams.from_gguf(f)
        Tokenizer.from_gguf(f)

    with pytest.raises(GGUFError, match="position_embd"):
        load(omit=("position_embd.weight",))
    with pytest.raises(GGUFError, match=r"blk\.1\.attn_output_norm\.bias"):
        load(omit=("blk.1.attn_output_norm.bias",))
    with pytest.raises(GGUFError, match="pooling_type=7"):
        load(pooling=7)
    load(pooling=None)  # no key: no pooling, as llama.cpp


def test_a_wordpiece_vocabulary_without_cls_is_refused(tmp_path: Path) -> None:
    from minfer.tools.synth import copy_gguf

    src = write_tiny_bert(tmp_path / "b.gguf")
    meta = GGUFFile.open(src).metadata
    n = 60  # below llama.cpp's default [CLS] id (101), and no id in the metadata
    bad = copy_gguf(src, tmp_path / "nocls.gguf", metadata={
        "tokenizer.ggml.bos_token_id": None,
        "tokenizer.ggml.tokens": meta["tokenizer.ggml.tokens"].tolist()[:n],
        "tokenizer.ggml.token_type": np.asarray(meta["tokenizer.ggml.token_type"])[:n]})
    with pytest.raises(TokenizerError, match=r"\[CLS\]"):
        Tokenizer.from_gguf(GGUFFile.open(bad))


def test_a_causal_bert_is_refused(tmp_path: Path) -> None:
    from minfer.tools.synth import copy_gguf

    src = write_tiny_bert(tmp_path / "b.gguf")
    bad = copy_gguf(src, tmp_path / "causal.gguf", metadata={"bert.attention.causal": True})
    with pytest.raises(ModelError, match="causal"):
        HParams.from_gguf(GGUFFile.open(bad))


def test_an_embedding_decoder_closes_its_input_with_eos(tiny_qwen2: Path, tmp_path: Path) -> None:
    """Qwen3-Embedding's files set add_eos_token: the last-token pooling reads that EOS."""
    from minfer.tools.synth import copy_gguf

    path = copy_gguf(tiny_qwen2, tmp_path / "emb.gguf",
                     metadata={"tokenizer.ggml.add_eos_token": True, "qwen2.pooling_type": 3})
    f = GGUFFile.open(path)
    hp = HParams.from_gguf(f)
    assert hp.pooling == "last"
    tok = Tokenizer.from_gguf(f)
    emb = Embedder(Engine(f, hp, n_ctx=64, batch_invariant=True, pooling=hp.pooling), tok)
    enc = emb.encode_text("hello world")
    assert enc.ids == [*tok.encode("hello world"), tok.eos_id]
    plain = Embedder(*_engine(tiny_qwen2, "last"))
    assert plain.encode_text("hello world").ids == tok.encode("hello world")


def test_generation_surfaces_refuse_an_encoder(bert: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from minfer.cli.main import main

    for argv in (["run", str(bert), "hello"], ["bench", str(bert), "-p", "8", "-n", "2"]):
        assert main(argv) == 2
        assert "embedding model" in capsys.readouterr().err


def test_rerank_on_a_model_with_one_token_type(tmp_path: Path) -> None:
    """An XLM-R-style cross-encoder has one token type: the pair reads type 0 throughout."""
    path = write_tiny_bert(tmp_path / "one.gguf", cls_head=1, n_token_types=1)
    engine, tok = _engine(path, "rank")
    emb = Embedder(engine, tok)
    pair = emb.encode_pair("hello", "world")
    assert pair.types is not None and set(pair.types) == {0}
    (score,) = emb.rerank("hello", ["world"])
    ref = OracleBert(str(path)).pool(pair.ids, "rank", pair.types)
    assert score == pytest.approx(float(ref[0]), abs=2e-5)
