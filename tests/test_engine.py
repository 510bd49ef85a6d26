"""The engine on synthetic models: minfer's logits against the numpy oracle, and the invariants
that need real execution (tail rows, fusion twins, KV regions surviving rebuilds, batching)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from minfer.backends.cpu.kernels import PACKED_FORM
from minfer.engine.forward import Batch, Engine
from minfer.errors import ContextOverflowError
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.tools.synth import build_tiny_vocab, write_tiny_model
from tests.oracle import OracleQwen

TOKENS = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 11]


def _engine(path: Path, **kw: object) -> Engine:
    f = GGUFFile.open(path)
    kw.setdefault("n_ctx", 64)
    return Engine(f, HParams.from_gguf(f), **kw)  # type: ignore[arg-type]


def _all_rows(engine: Engine, tokens: list[int]) -> np.ndarray:
    nt = len(tokens)
    b = Batch.single(tokens, 0, n_out=nt)
    return engine.forward_batch(b)


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("f32") / "f32.gguf", weight_types=QType.F32)


def test_f32_model_matches_oracle_tightly(f32_model: Path) -> None:
    ref = OracleQwen(str(f32_model)).logits(TOKENS)
    got = _all_rows(_engine(f32_model, kv_type="f32"), TOKENS)
    assert _rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_qwen3"])
def test_quantized_models_match_oracle(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    ref = OracleQwen(str(path)).logits(TOKENS)
    got = _all_rows(_engine(path, kv_type="f32"), TOKENS)
    # activations are quantized to 8 bits per block, as llama.cpp does: a small, bounded drift
    assert _rel_err(got, ref) < 0.03
    assert np.array_equal(got.argmax(-1), ref.argmax(-1)) or _rel_err(got, ref) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("qtype, widen", [
    *(pytest.param(q, False, id=q.name)
      for q in (QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S,
                QType.IQ1_S, QType.IQ1_M, QType.IQ4_XS, QType.TQ1_0, QType.TQ2_0, QType.MXFP4)),
    *(pytest.param(q, True, id=f"{q.name}-widened") for q in (QType.IQ2_XXS, QType.IQ3_XXS))])
def test_iquant_models_match_oracle(qtype: QType, widen: bool, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every projection and the (tied) embeddings in one of the i-quant / ternary / MXFP4 types
    (random valid blocks for the i-quants, `tools.quantize.simple`), decode and prefill;
    IQ2_XXS / IQ3_XXS on the file's blocks (the default) and widened (MINFER_IQ_WIDEN)."""
    if widen:
        monkeypatch.setenv("MINFER_IQ_WIDEN", "1")
    else:
        monkeypatch.delenv("MINFER_IQ_WIDEN", raising=False)
    path = write_tiny_model(tmp_path / "iq.gguf", n_embd=256, n_ff=512, weight_types=qtype)
    ref = OracleQwen(str(path)).logits(TOKENS)
    engine = _engine(path, kv_type="f32")
    got = _all_rows(engine, TOKENS)
    assert _rel_err(got, ref) < 0.03
    step = engine.forward_batch(Batch.single(TOKENS[:1], 0, n_out=1))  # a decode-shaped step
    assert _rel_err(step[0], got[0]) < 1e-5


def test_repacked_weights_match_the_oracle(tmp_path: Path) -> None:
    """Rows wide enough for the CPU backend's repacked layouts (groups of 16 and 8 blocks, K-quant
    pairs), tied Q8_0 embeddings serving as the output projection too."""
    from minfer.backends.cpu.kernels import packable

    if not packable(QType.Q4_0, 512, 512):
        pytest.skip("no repacked layouts on this CPU (needs AVX2)")
    types = {"token_embd": QType.Q8_0, "ffn_down": QType.Q4_0, "ffn_gate": QType.Q4_K,
             "ffn_up": QType.Q5_0, "default": QType.Q5_0}
    # 512 ids: the tied output's rows interleave 16 at a time
    path = write_tiny_model(tmp_path / "wide.gguf", n_embd=512, n_head=8, n_head_kv=2, n_ff=768,
                            weight_types=types, tied=True, seed=3,
                            vocab=build_tiny_vocab(vocab_size=512))
    engine = _engine(path, kv_type="f32")
    got = _all_rows(engine, TOKENS)
    ref = OracleQwen(str(path)).logits(TOKENS)
    assert _rel_err(got, ref) < 0.03
    forms = {name for name, form in engine.weights._derived if form == PACKED_FORM}
    assert {"blk.0.ffn_down.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight",
            "blk.0.attn_q.weight"} <= forms
    # Q8_0 interleaves where the dots are VNNI, and for batched engines on AVX2 (one row alone
    # reads the file's rows faster there): the engine's choice
    assert ("token_embd.weight" in forms) == packable(QType.Q8_0, 512, 512,
                                                      engine.batch_invariant)
    # the embedding lookup still reads the file's rows, released or not
    again = _all_rows(engine, TOKENS)
    np.testing.assert_array_equal(again, got)


def test_weights_readied_in_the_background_change_nothing(tmp_path: Path) -> None:
    """`warm_in_background` binds the decode tape (repacking the weights) on another thread;
    the first forward waits for it and gives bitwise what an engine without it gives."""
    types = {"token_embd": QType.Q8_0, "ffn_down": QType.Q4_0, "ffn_gate": QType.Q4_K,
             "default": QType.Q5_0}
    path = write_tiny_model(tmp_path / "wide.gguf", n_embd=512, n_head=8, n_head_kv=2, n_ff=768,
                            weight_types=types, tied=True, seed=5)
    plain = _engine(path, kv_type="f32")
    warmed = _engine(path, kv_type="f32")
    warmed.warm_in_background()
    warmed.wait_ready()
    assert warmed.weights.state  # every projection of the decode graph is bound already
    bound = len(warmed.weights.state)
    for engine in (plain, warmed):
        engine.warm_in_background()  # a second call, or one after the first forward: no-op
    np.testing.assert_array_equal(_all_rows(warmed, TOKENS), _all_rows(plain, TOKENS))
    np.testing.assert_array_equal(warmed.forward([5], len(TOKENS)),
                                  plain.forward([5], len(TOKENS)))
    assert len(warmed.weights.state) == bound  # nothing bound twice
    n = len(TOKENS) + 1
    for layer in range(plain.hparams.n_layer):
        np.testing.assert_array_equal(warmed.kv.k[layer][:n], plain.kv.k[layer][:n])
        np.testing.assert_array_equal(warmed.kv.v[layer][:n], plain.kv.v[layer][:n])


def test_an_error_met_in_the_background_is_raised_by_the_forward(tiny_qwen2: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    engine = _engine(tiny_qwen2)

    def broken(*_: object) -> None:
        raise RuntimeError("weights unreadable")

    monkeypatch.setattr(engine, "_tape", broken)
    engine.warm_in_background()
    with pytest.raises(RuntimeError, match="weights unreadable"):
        engine.forward([1, 2], 0)
    monkeypatch.undo()
    assert engine.forward([1, 2], 0).shape[0] == 1  # raised once; the engine still works


def test_a_vocab_limited_head_gives_the_first_columns_bitwise(tiny_qwen2: Path) -> None:
    """Engine(vocab_limit=N) (a draft model's cheaper head): logits of the first N ids only (N
    rounded up to whole groups of 16 rows), bitwise those columns of the whole head, in prefill
    and decode."""
    full, part = _engine(tiny_qwen2), _engine(tiny_qwen2, vocab_limit=100)
    a, b = full.forward(TOKENS, 0, n_out=3), part.forward(TOKENS, 0, n_out=3)
    assert b.shape == (3, 112)
    np.testing.assert_array_equal(b, a[:, :112])
    np.testing.assert_array_equal(part.forward([9], len(TOKENS))[0],
                                  full.forward([9], len(TOKENS))[0, :112])
    assert _engine(tiny_qwen2, vocab_limit=10**9).forward([1], 0).shape[1] == \
        full.hparams.n_vocab  # a limit at or above the vocabulary is no limit


def test_tail_rows_equal_the_full_graphs_last_rows(tiny_qwen2: Path) -> None:
    full = _all_rows(_engine(tiny_qwen2), TOKENS)
    for n_out in (1, 3):
        tail = _engine(tiny_qwen2).forward(TOKENS, 0, n_out=n_out)
        np.testing.assert_allclose(tail, full[-n_out:], rtol=1e-5, atol=1e-5)


def test_fused_equals_unfused(tiny_qwen3: Path) -> None:
    results = []
    for fuse in (True, False):
        e = _engine(tiny_qwen3, fuse_swiglu=fuse, fuse_gate_up=fuse)
        prefill = e.forward(TOKENS[:6], 0)
        steps = [e.forward([t], 6 + i) for i, t in enumerate(TOKENS[6:])]
        results.append(np.concatenate([prefill, *steps]))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-5)


def test_incremental_decode_matches_one_prefill_and_kv_survives_rebuilds(tiny_qwen2: Path) -> None:
    full = _all_rows(_engine(tiny_qwen2), TOKENS)
    e = _engine(tiny_qwen2)
    e.forward(TOKENS[:4], 0)  # prefill graph
    got = [e.forward([TOKENS[4]], 4)]  # decode graph: a rebuild, the KV regions stay
    got.append(e.forward(TOKENS[5:8], 5, n_out=3))  # another shape
    for i in range(8, len(TOKENS)):
        got.append(e.forward([TOKENS[i]], i))
    np.testing.assert_allclose(np.concatenate(got), full[4:], rtol=2e-3, atol=2e-3)
    assert e.cache.rebuilds == 3 and e.cache.reuses == len(TOKENS) - 8


def test_batched_sequences_equal_each_alone(tiny_qwen3: Path) -> None:
    a, b = TOKENS[:5], TOKENS[3:10]
    alone_a = _engine(tiny_qwen3).forward(a, 0)
    alone_b = _engine(tiny_qwen3).forward(b, 0)
    e = _engine(tiny_qwen3)  # sequence A in cells 0.., B in cells 32..
    na, nb = len(a), len(b)
    pos = np.concatenate([np.arange(na), np.arange(nb)]).astype(np.int32)
    cells = np.concatenate([np.arange(na), 32 + np.arange(nb)]).astype(np.int32)
    start = np.array([0] * na + [32] * nb, np.int32)
    batch = Batch(np.array(a + b, np.int32), pos, cells, start, cells + 1,
                  np.array([na - 1, na + nb - 1], np.int32))
    both = e.forward_batch(batch)
    np.testing.assert_allclose(both[0], alone_a[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(both[1], alone_b[0], rtol=1e-4, atol=1e-4)


def test_out_of_range_position_is_refused_before_writing(tiny_qwen2: Path) -> None:
    e = _engine(tiny_qwen2, n_ctx=8)
    e.forward(TOKENS[:4], 0)
    before = [k.copy() for k in e.kv.k]
    with pytest.raises(ContextOverflowError, match="n_ctx = 8"):
        e.forward(TOKENS[:6], 4)  # positions 4..9, two past the end
    with pytest.raises(ContextOverflowError):
        e.forward([1], 8)
    assert all(np.array_equal(x, y) for x, y in zip(before, e.kv.k, strict=True))


def test_kv_f16_and_f32_agree_closely(tiny_qwen2: Path) -> None:
    a = _engine(tiny_qwen2, kv_type="f16").forward(TOKENS, 0)
    b = _engine(tiny_qwen2, kv_type="f32").forward(TOKENS, 0)
    assert _rel_err(a, b) < 1e-2


def test_batch_invariant_rows_do_not_depend_on_the_batch(tiny_qwen3: Path) -> None:
    # The server's guarantee: a sequence's arithmetic is the same alone or beside a long prefill.
    a, b = TOKENS[:4], (TOKENS * 3)[:20]
    alone = _engine(tiny_qwen3, batch_invariant=True)
    alone.forward(a[:3], 0)
    ref = alone.forward([a[3]], 3)[0]
    e = _engine(tiny_qwen3, batch_invariant=True)
    e.forward(a[:3], 0)
    nb = len(b)
    pos = np.array([3, *range(nb)], np.int32)
    cells = np.array([3, *(32 + np.arange(nb))], np.int32)
    start = np.array([0] + [32] * nb, np.int32)
    batch = Batch(np.array([a[3], *b], np.int32), pos, cells, start, cells + 1,
                  np.array([0, nb], np.int32))
    got = e.forward_batch(batch)
    assert np.array_equal(got[0], ref)



def test_activation_quantized_once_per_input_and_only_the_latest_held(
        tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v (and gate/up) share one quantization of their input; a prefill does not keep every
    layer's quantized inputs alive until the forward ends: the op tape quantizes each input once,
    into one buffer per shape and form that every layer's inputs reuse."""
    from minfer.backends.cpu import backend as cpu_backend

    made: list[tuple[int, ...]] = []
    binds: list[int] = []
    new_activation, bind_quantize = cpu_backend.K.new_activation, cpu_backend.K.bind_quantize

    def counting_new(rows: int, cols: int, qtype: int) -> object:
        made.append((rows, cols, qtype))
        return new_activation(rows, cols, qtype)

    def counting_bind(x: np.ndarray, xq: object) -> object:
        binds.append(x.shape[0])
        return bind_quantize(x, xq)

    monkeypatch.setattr(cpu_backend.K, "new_activation", counting_new)
    monkeypatch.setattr(cpu_backend.K, "bind_quantize", counting_bind)
    e = _engine(tiny_qwen2, batch_invariant=True)  # every matmul on the integer path
    e.forward(TOKENS, 0)
    # per layer: the attention input (q/k/v), the attention output, the ffn input (gate/up),
    # the ffn hidden state; then the output projection
    assert 0 < len(binds) <= 4 * e.hparams.n_layer + 1
    # one buffer per (shape, form), however many layers' inputs pass through it
    assert len(made) == len(set(made)) and len(made) < len(binds)


def test_derived_weights_are_made_once_and_the_file_stays_readable(tiny_qwen2: Path) -> None:
    from minfer.engine.weights import ModelWeights

    weights = ModelWeights(GGUFFile.open(tiny_qwen2))
    name = "blk.0.ffn_up.weight"
    before = weights.matrix(name)[0].copy()
    calls: list[int] = []

    def make(rows: np.ndarray, qtype: int, out: np.ndarray) -> int:
        calls.append(rows.shape[0])
        np.bitwise_xor(rows, np.uint8(0xFF), out=out)
        return qtype + 1000

    a = weights.derived(name, "test", make, chunk_rows=3)  # row chunks, pages released after each
    b = weights.derived(name, "test", make)
    assert a is b and sum(calls) == before.shape[0] and max(calls) <= 3
    assert a[1] == int(weights.file.tensors[name].ggml_type) + 1000
    np.testing.assert_array_equal(a[0], before ^ np.uint8(0xFF))
    # the file's pages were released from this process; reading them again faults them back
    np.testing.assert_array_equal(weights.matrix(name)[0], before)


def test_a_weight_type_the_kernels_cannot_run_is_refused_by_name(tiny_qwen2: Path) -> None:
    """A file holding a type minfer has no kernel for (NVFP4 here) is refused when the engine
    is made, naming the type and a tensor, before any graph is built or kernel compiled."""
    from dataclasses import replace

    from minfer.errors import MinferError

    f = GGUFFile.open(tiny_qwen2)
    name = "blk.1.ffn_up.weight"
    f.tensors[name] = replace(f.tensors[name], ggml_type=int(QType.NVFP4))
    with pytest.raises(MinferError, match=r"NVFP4 \(such as blk\.1\.ffn_up\.weight\).*Q4_K"):
        Engine(f, HParams.from_gguf(f), n_ctx=16)
