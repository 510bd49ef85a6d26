"""Qwen3.5 (`qwen35`, dense): its Gated DeltaNet ops (ssm_conv, the gated delta rule) over the
recurrent state the backend keeps per sequence, its gated attention, and the model against
transformers.

tests/fixtures/qwen35/ comes from benchmarks/make_qwen35_fixtures.py: a tiny random checkpoint
made with transformers 5.x's Qwen3_5ForCausalLM (n_embd 64, layers DeltaNet x 3 | attention,
attention 4 heads of 32 over 2 K/V heads with a quarter rotated, DeltaNet 2 key / 4 value
heads of 16, conv kernel 4, a byte-level BPE tokenizer) converted by llama.cpp 0.3.36's
`convert_hf_to_gguf.py --no-mtp` to f32, with transformers' float32 logits of 40 token ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minfer.backends.cpu import kernels as K
from minfer.engine.forward import Batch, Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.graph import ir
from minfer.graph.params import ContextParams, GraphParams
from minfer.models.registry import graph_builder_for

from . import oracle

FIXTURES = Path(__file__).parent / "fixtures" / "qwen35"
MODEL = FIXTURES / "qwen35.gguf"
REF = np.load(FIXTURES / "logits.npz")
IDS = REF["ids"].tolist()
RNG = np.random.default_rng(7)
LONG = RNG.integers(0, 300, 100).tolist()  # a prompt longer than the 64-row chunks
OTHER = RNG.integers(0, 300, 30).tolist()


def _model() -> tuple[GGUFFile, HParams]:
    f = GGUFFile.open(MODEL)
    return f, HParams.from_gguf(f)


def _engine(**kw: object) -> Engine:
    f, hp = _model()
    kw.setdefault("n_ctx", 256)
    kw.setdefault("kv_type", "f32")
    return Engine(f, hp, **kw)  # type: ignore[arg-type]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


# -- the ops -------------------------------------------------------------------------------------
def _delta_case(nt: int, n_k: int = 2, n_v: int = 4, d: int = 16):
    rng = np.random.default_rng(nt)
    f32 = np.float32
    return (rng.standard_normal((nt, (2 * n_k + n_v) * d)).astype(f32),
            rng.standard_normal((nt, n_v)).astype(f32), rng.standard_normal((nt, n_v)).astype(f32),
            rng.standard_normal(n_v).astype(f32), -np.exp(rng.standard_normal(n_v)).astype(f32))


@pytest.mark.parametrize("taps", [2, 4])
def test_ssm_conv_matches_the_float64_oracle(taps: int) -> None:
    rng = np.random.default_rng(taps)
    x = rng.standard_normal((20, 72)).astype(np.float32)
    w = rng.standard_normal((72, taps)).astype(np.float32)
    out = np.empty_like(x)
    state = K.new_state(1, taps, 72)
    K.ssm_conv(x, w, state, np.arange(20, dtype=np.int32), np.zeros(20, np.int32), out)
    np.testing.assert_allclose(out, oracle.ssm_conv(x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(state[0], x[-(taps - 1):])  # the last inputs, oldest first


@pytest.mark.parametrize(("n_k", "n_v"), [(2, 2), (2, 4)])
def test_delta_net_matches_the_float64_oracle(n_k: int, n_v: int) -> None:
    qkv, alpha, beta, dt, a = _delta_case(24, n_k, n_v)
    out = np.empty((24, n_v * 16), np.float32)
    state = K.new_delta_state(1, n_v, 16)
    K.delta_net(qkv, alpha, beta, dt, a, state, np.arange(24, dtype=np.int32),
                np.zeros(24, np.int32), out, n_k_heads=n_k, eps=1e-6)
    np.testing.assert_allclose(out, oracle.delta_net(qkv, alpha, beta, dt, a, n_k, 1e-6),
                               rtol=1e-4, atol=1e-5)


def test_delta_net_rows_are_bitwise_whatever_the_chunks_and_neighbours() -> None:
    """A sequence fed in chunks of 1, 5 or all its rows, alone or interleaved with another
    sequence's rows, gives each row the same bits; position 0 restarts from a zero state."""
    qkv, alpha, beta, dt, a = _delta_case(30)

    def run(rows: list[tuple[int, int]], state: np.ndarray) -> np.ndarray:
        idx = np.array([r for r, _ in rows])
        out = np.empty((len(rows), 64), np.float32)
        K.delta_net(qkv[idx], alpha[idx], beta[idx], dt, a, state,
                    np.array([r for r, _ in rows], np.int32),
                    np.array([s for _, s in rows], np.int32), out, n_k_heads=2, eps=1e-6)
        return out

    whole = run([(r, 0) for r in range(30)], K.new_delta_state(1, 4, 16))
    for chunk in (1, 5):
        state = K.new_delta_state(1, 4, 16)
        parts = [run([(r, 0) for r in range(s, min(s + chunk, 30))], state)
                 for s in range(0, 30, chunk)]
        assert np.array_equal(np.concatenate(parts), whole), chunk
    state = K.new_delta_state(2, 4, 16)
    state[1] = 7.0  # a stale state: position 0 must zero it
    mixed = run([(r, s) for r in range(30) for s in (0, 1)], state)
    assert np.array_equal(mixed[0::2], whole) and np.array_equal(mixed[1::2], whole)


def test_gated_attention_slices_each_heads_query_and_gate() -> None:
    """The per-head slice (Qwen3.5's doubled q projection: query | gate per head) on the CPU
    backend, and the sigmoid gate on the attention output against float64."""
    from minfer.backends.cpu.backend import _bind_slice
    from minfer.graph.ir import Node

    x = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 24)
    for start, want in ((0, x.reshape(2, 3, 8)[:, :, :4]), (4, x.reshape(2, 3, 8)[:, :, 4:])):
        out = np.empty((2, 12), np.float32)
        node = Node(0, "s", ir.Slice(start, 4, 3), (0,), (2, 12))
        for call in _bind_slice(node, (x,), out, None):  # type: ignore[arg-type]
            call()
        np.testing.assert_array_equal(out, want.reshape(2, 12))
    g = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 12)
    y = np.random.default_rng(0).standard_normal((2, 12)).astype(np.float32)
    out = np.empty_like(y)
    K.sigmoid_mul(y, g, out)
    np.testing.assert_allclose(out, y / (1 + np.exp(-g.astype(np.float64))), rtol=1e-6)


# -- the model -----------------------------------------------------------------------------------
def test_layer_pattern_and_state_are_read_as_llamacpp_reads_them() -> None:
    _, hp = _model()
    assert hp.recurrent_layers == (True, True, True, False) and hp.n_layer == 4
    assert (hp.ssm_k_heads, hp.ssm_v_heads, hp.ssm_head_dim, hp.shortconv_l_cache) == \
        (2, 4, 16, 4)
    assert hp.attn_gated and hp.rope_dim == 8 and hp.head_dim == 32
    assert hp.state_width == 3 * 128 + 4 * 16 * 16  # conv inputs + state matrices per layer
    assert _engine(n_ctx=16).kv.state_bytes_per_seq == 3 * hp.state_width * 4


def test_graph_runs_the_delta_net_in_the_recurrent_layers() -> None:
    f, hp = _model()
    shapes = {n: tuple(t.shape) for n, t in f.tensors.items()}
    g = graph_builder_for("qwen35")(hp, GraphParams.for_batch(5, 1, ContextParams(n_ctx=64)),
                                    shapes)
    kinds = [(type(n.op).__name__, n.meta.layer) for n in g.nodes]
    for il in range(3):
        assert ("SsmConv", il) in kinds and ("DeltaNet", il) in kinds
    assert ("Attn", 3) in kinds and ("SigmoidMul", 3) in kinds
    assert ("Attn", 0) not in kinds


def test_matches_transformers() -> None:
    got = _engine().forward(IDS, 0, n_out=len(IDS))
    ref = REF["hf"]
    assert _rel(got[-1], ref[-1]) < 1e-3  # the last position, as a prompt's next token reads
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3)


def test_prefill_chunks_are_bitwise_the_whole_prompt() -> None:
    """Chunked prefill at 1, 7 and 64 rows gives each row the bits of the whole prompt's."""
    e = _engine(batch_invariant=True)
    whole = e.forward(LONG, 0, n_out=len(LONG))
    for chunk in (1, 7, 64):
        rows = []
        for start in range(0, len(LONG), chunk):
            part = LONG[start:start + chunk]
            rows.append(e.forward(part, start, n_out=len(part)))
        assert np.array_equal(np.concatenate(rows), whole), chunk


def test_a_batch_of_two_sequences_each_equals_it_alone() -> None:
    alone = _engine(batch_invariant=True).forward(LONG, 0, n_out=len(LONG))
    other = _engine(batch_invariant=True).forward(OTHER, 0, n_out=len(OTHER))
    e = _engine(batch_invariant=True, n_ctx=256)
    e.hold_sequences(2)
    n = len(OTHER)
    tokens = np.array([*LONG[:n], *OTHER], np.int32)
    pos = np.concatenate([np.arange(n), np.arange(n)]).astype(np.int32)
    base = np.repeat([0, 128], n).astype(np.int32)
    batch = Batch(tokens=tokens, positions=pos, cells=base + pos, kv_start=base,
                  kv_end=base + pos + 1, out_rows=np.arange(2 * n, dtype=np.int32))
    rows = e.forward_batch(batch)
    assert np.array_equal(rows[:n], alone[:n]) and np.array_equal(rows[n:], other)
    rest = e.forward_batch(Batch(
        tokens=np.array(LONG[n:], np.int32), positions=np.arange(n, len(LONG), dtype=np.int32),
        cells=np.arange(n, len(LONG), dtype=np.int32), kv_start=np.zeros(len(LONG) - n, np.int32),
        kv_end=np.arange(n + 1, len(LONG) + 1, dtype=np.int32),
        out_rows=np.arange(len(LONG) - n, dtype=np.int32)))
    assert np.array_equal(rest, alone[n:])


def test_info_shows_the_layer_pattern_and_the_state(capsys: pytest.CaptureFixture[str]) -> None:
    from minfer.cli.main import main

    assert main(["info", str(MODEL)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "DDDA (D: Gated DeltaNet, 4 value heads of 16" in out
    state = _engine(n_ctx=16).kv.state_bytes_per_seq
    assert f"16.5 KiB ({state:,} bytes)" in out
    assert "f32 512 B" in out  # K and V of the one attention layer: 2 x 64 f32 a token


def _with_mtp(src: Path, out: Path) -> None:
    """The fixture plus one MTP (NextN) block after the trunk, as llama.cpp's converter writes
    it without --no-mtp: block_count + 1, `nextn_predict_layers` 1, a full-attention block
    `blk.4.*` with its `nextn.*` tensors (random)."""
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, "qwen35")
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == "qwen35.block_count":
            value += 1
        if name == "qwen35.attention.recurrent_layers":
            value = [*value, False]
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, value, field.types[0], sub_type=sub)
    w.add_uint32("qwen35.nextn_predict_layers", 1)
    rng = np.random.default_rng(0)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    for t in r.tensors:
        if t.name.startswith("blk.3."):
            w.add_tensor("blk.4." + t.name[6:],
                         rng.standard_normal(t.data.shape).astype(np.float32))
    for name, shape in (("eh_proj", (64, 128)), ("enorm", (64,)), ("hnorm", (64,)),
                        ("shared_head_norm", (64,))):
        w.add_tensor(f"blk.4.nextn.{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_file_with_an_mtp_block_loads_and_runs_its_trunk(tmp_path: Path) -> None:
    """llama.cpp's `nextn_predict_layers`: the MTP block after the trunk is kept in the file,
    not run; the trunk's logits are the fixture's."""
    path = tmp_path / "qwen35-mtp.gguf"
    _with_mtp(MODEL, path)
    f = GGUFFile.open(path)
    hp = HParams.from_gguf(f)
    assert (hp.n_layer, hp.n_layer_nextn) == (4, 1) and "blk.4.nextn.eh_proj.weight" in f.tensors
    got = Engine(f, hp, n_ctx=64, kv_type="f32").forward(IDS, 0, n_out=len(IDS))
    np.testing.assert_allclose(got, REF["hf"], rtol=0, atol=1e-3)


def test_an_edit_near_the_end_restarts_from_a_checkpoint_bitwise() -> None:
    """State checkpoints hold both of a DeltaNet layer's regions (the convolution's tail and the
    delta rule's matrices): a prompt edited near its end continues from the checkpoint before
    the edit with every row bitwise a full recompute's."""
    e = _engine(batch_invariant=True, state_checkpoints=2)
    for start in range(0, len(LONG), 32):
        e.forward(LONG[start:start + 32], start)
    assert e.checkpoints.positions(0) == [96, 100]
    assert e.checkpoints.nbytes == 2 * e.kv.state_bytes_per_seq
    assert e.kv.state_bytes_per_seq > sum(s.nbytes for s in e.kv.states) // e.kv.n_seq
    edited = [*LONG[:98], 5, 6, 7]
    rows = e.forward(edited[96:], 96, n_out=5)
    fresh = _engine(batch_invariant=True).forward(edited, 0, n_out=len(edited))
    assert np.array_equal(rows, fresh[96:])
