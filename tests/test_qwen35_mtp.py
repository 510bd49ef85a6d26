"""Qwen3.5's MTP (NextN) head: a file that carries it loads, the head's graph against a float64
transformers reference, the target's every-row hidden states that feed it, and the head as a
speculative proposer (`--spec mtp`): greedy output unchanged, acceptance counted.

tests/fixtures/qwen35/qwen35_mtp.gguf and mtp.npz come from benchmarks/make_qwen35_fixtures.py
(`make_mtp`): the tiny dense checkpoint of test_qwen35.py's shape with one MTP block added to
its safetensors as Qwen3.5's checkpoints store it (`mtp.*`), converted by llama.cpp 0.3.36's
`convert_hf_to_gguf.py` without --no-mtp (`blk.4.nextn.*`, `nextn_predict_layers` 1); the
reference is transformers' own modules in float64 on 40 token ids: the trunk's final normed
hidden states (`hidden`) and logits (`hf`), and the head's normed rows and logits with each
position q taking token q and hidden[q - 1] (`mtp_hidden`, `mtp_logits`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from minfer.engine.forward import Batch, Engine
from minfer.errors import ModelError
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

FIXTURES = Path(__file__).parent / "fixtures" / "qwen35"
MODEL = FIXTURES / "qwen35_mtp.gguf"
REF = np.load(FIXTURES / "mtp.npz")
IDS = REF["ids"].tolist()


def _model() -> tuple[GGUFFile, HParams]:
    f = GGUFFile.open(MODEL)
    return f, HParams.from_gguf(f)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _sink(engine: Engine) -> list[np.ndarray]:
    seen: list[np.ndarray] = []
    engine.hidden_sink = lambda batch, hidden: seen.append(hidden.copy())
    return seen


def test_mtp_file_loads_with_its_trunk_and_head_view() -> None:
    f, hp = _model()
    assert (hp.n_layer, hp.n_layer_nextn, hp.first_layer) == (4, 1, 0)
    head = hp.mtp_head()
    assert (head.n_layer, head.first_layer, head.recurrent) == (5, 4, False)
    assert [head.layer_kv_embd(il) for il in range(5)] == [0, 0, 0, 0, 2 * 32]
    names = {name for name, _ in head.expected_shapes()}
    assert "blk.4.nextn.eh_proj.weight" in names and "blk.4.attn_q.weight" in names
    assert not any(name.startswith("blk.3.") for name in names)
    logits = Engine(f, hp, n_ctx=64, kv_type="f32").forward(IDS, 0, len(IDS))
    assert _rel(logits, REF["hf"]) < 1e-3
    g = GGUFFile.open(FIXTURES / "qwen35.gguf")
    with pytest.raises(ModelError, match="no MTP"):
        HParams.from_gguf(g).mtp_head()


def test_target_hidden_rows_every_row_and_logits_unchanged() -> None:
    """With a sink, every row's final normed hidden state comes out beside the logits (a
    prefill's too, not just its tail), and the logits are bitwise those without it."""
    f, hp = _model()
    plain = Engine(f, hp, n_ctx=64, kv_type="f32")
    want = plain.forward(IDS, 0, 1)
    engine = Engine(f, hp, n_ctx=64, kv_type="f32")
    seen = _sink(engine)
    got = engine.forward(IDS, 0, 1)  # a prefill keeping one tail row
    np.testing.assert_array_equal(got, want)
    assert seen[-1].shape == (len(IDS), hp.n_embd)
    assert float(np.abs(seen[-1] - REF["hidden"]).max()) < 1e-3
    engine.forward(IDS[:5], 0, 5)  # a graph of every row: its normed rows
    np.testing.assert_allclose(seen[-1], seen[0][:5], rtol=0, atol=1e-4)


def test_mtp_head_logits_match_transformers_float64() -> None:
    """The head on the reference's own hidden states: position q takes token q and the
    target's hidden state of row q - 1 (zeros at 0), its attention over positions 0..q."""
    f, hp = _model()
    head = Engine(f, hp.mtp_head(), n_ctx=64, kv_type="f32")
    seen = _sink(head)
    prev = np.concatenate([np.zeros((1, hp.n_embd), np.float32), REF["hidden"][:-1]])
    batch = replace(Batch.single(IDS, 0, len(IDS)), hidden=prev)
    logits = head.forward_batch(batch)
    assert _rel(logits, REF["mtp_logits"]) < 1e-4
    assert float(np.abs(seen[-1] - REF["mtp_hidden"]).max()) < 1e-4
    # a prefill keeping the last row, then one row more over the cells it wrote
    n = len(IDS) - 1
    tail = head.forward_batch(replace(Batch.single(IDS[:n], 0, 1), hidden=prev[:n]))
    np.testing.assert_allclose(tail[0], logits[n - 1], rtol=0, atol=1e-4)
    step = head.forward_batch(replace(Batch.single(IDS[n:], n, 1), hidden=prev[n:]))
    np.testing.assert_allclose(step[0], logits[n], rtol=0, atol=1e-4)
