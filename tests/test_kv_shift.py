"""KV shift on the tiny synthetic models: re-rotated keys equal keys computed at the new positions,
a shifted block behaves as if it had been prefilled there, and a chat session that shifts after a
context overflow sees the same logits as one that re-prefilled the kept history wherever that is
exact (the first layer's rows; every row of a one-layer model)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

import minfer
from minfer.backends.cpu.kernels.elementwise.rope import rope, rope_neox
from minfer.chat.session import ChatConfig, ChatSession, TurnReport
from minfer.engine.forward import Batch, Engine
from minfer.engine.kv_shift import rerotate, shift_kv
from minfer.errors import MinferError
from minfer.gguf.rope_scaling import Yarn
from minfer.sampling.params import SamplerParams
from minfer.tools.synth import write_tiny_model

TOKENS = [5, 17, 42, 9, 33, 61, 2, 88, 14, 70, 23, 45]


def _engine(path: Path, n_ctx: int = 96, kv_type: str = "f32") -> Engine:
    model = minfer.load(path, n_ctx=n_ctx)
    return Engine(model.file, model.hparams, n_ctx=n_ctx, kv_type=kv_type)


def _block(tokens: Sequence[int], start: int, n_out: int = 1) -> Batch:
    """Tokens at positions/cells start.. that read only their own block (kv_start = start)."""
    b = Batch.single(tokens, start, n_out)
    return Batch(b.tokens, b.positions, b.cells, np.full(len(tokens), start, np.int32),
                 b.kv_end, b.out_rows)


@pytest.mark.parametrize(("src", "dst"), [(40, 3), (7, 0), (300, 12), (5000, 17), (3, 40)])
def test_rerotated_keys_equal_keys_roped_at_the_new_position(src: int, dst: int) -> None:
    rng = np.random.default_rng(src)
    n_head, head_dim, rope_dim, base = 2, 64, 48, 1e6  # a partial rope: the tail passes through
    raw = rng.standard_normal((4, n_head * head_dim)).astype(np.float32)
    at_src, at_dst = np.empty_like(raw), np.empty_like(raw)
    p_src = np.arange(src, src + 4)
    p_dst = np.arange(dst, dst + 4)
    kw: dict[str, Any] = {"n_head": n_head, "head_dim": head_dim, "rope_dim": rope_dim,
                          "base": base}
    rope_neox(raw, p_src, out=at_src, **kw)
    rope_neox(raw, p_dst, out=at_dst, **kw)
    moved = rerotate(at_src, p_src, p_dst, **kw)
    np.testing.assert_allclose(moved, at_dst, rtol=0, atol=2e-5 * np.abs(at_dst).max())


@pytest.mark.parametrize(("src", "dst"), [(40, 3), (300, 12), (3, 200)])
def test_rerotated_yarn_keys_equal_keys_roped_at_the_new_position(src: int, dst: int) -> None:
    # YaRN's angles stay linear in the position (a per-pair scale), and a rotation keeps the
    # magnitude the keys were given
    rng = np.random.default_rng(src)
    n_head, head_dim, rope_dim, base = 2, 64, 64, 1e6
    yarn = Yarn(factor=8.0, n_ctx_orig=128).layer(rope_dim=rope_dim, base=base, freq_scale=0.125)
    raw = rng.standard_normal((4, n_head * head_dim)).astype(np.float32)
    at_src, at_dst = np.empty_like(raw), np.empty_like(raw)
    p_src, p_dst = np.arange(src, src + 4), np.arange(dst, dst + 4)
    kw: dict[str, Any] = {"n_head": n_head, "head_dim": head_dim, "rope_dim": rope_dim,
                          "base": base, "freq_scale": 0.125, "yarn": yarn}
    rope(raw, p_src, out=at_src, **kw)
    rope(raw, p_dst, out=at_dst, **kw)
    moved = rerotate(at_src, p_src, p_dst, **kw)
    np.testing.assert_allclose(moved, at_dst, rtol=0, atol=2e-5 * np.abs(at_dst).max())


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_shifted_block_equals_the_block_prefilled_at_its_new_place(tiny_qwen2: Path,
                                                                   kv_type: str) -> None:
    # A block that reads only itself depends on relative positions alone, so moving its rows from
    # cells 50.. to 6.. must give exactly what prefilling it at 6.. gives, in every layer.
    src, dst, n = 50, 6, len(TOKENS)
    moved, fresh = _engine(tiny_qwen2, kv_type=kv_type), _engine(tiny_qwen2, kv_type=kv_type)
    moved.forward_batch(_block(TOKENS, src))
    shift_kv(moved, src_start=src, src_end=src + n, dst_start=dst)
    fresh.forward_batch(_block(TOKENS, dst))
    tol = 2e-5 if kv_type == "f32" else 1e-2  # f16: the rows round differently at each place
    for layer in range(moved.hparams.n_layer):
        pairs = ((moved.kv.k[layer], fresh.kv.k[layer]), (moved.kv.v[layer], fresh.kv.v[layer]))
        for a, b in pairs:
            got, want = a[dst:dst + n].astype(np.float32), b[dst:dst + n].astype(np.float32)
            assert np.abs(got - want).max() <= tol * np.abs(want).max(), layer
    # the next token attends to the moved rows as it would to fresh ones
    nxt = _block([77], dst)
    nxt = Batch(nxt.tokens, nxt.positions + n, nxt.cells + n, nxt.kv_start, nxt.kv_end + n,
                nxt.out_rows)
    a_logits, b_logits = moved.forward_batch(nxt), fresh.forward_batch(nxt)
    np.testing.assert_allclose(a_logits, b_logits, atol=1e-3 if kv_type == "f32" else 2e-2)


def test_shift_refuses_cells_outside_the_context(tiny_qwen2: Path) -> None:
    e = _engine(tiny_qwen2, n_ctx=16)
    with pytest.raises(MinferError):
        shift_kv(e, src_start=10, src_end=20, dst_start=0)
    with pytest.raises(MinferError):
        shift_kv(e, src_start=0, src_end=10, dst_start=8)


# -- a chat session over the real engine -----------------------------------------------------------
@pytest.fixture(scope="module")
def one_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    types = {"token_embd": QType.F16, "attn_v": QType.Q5_0, "ffn_down": QType.Q4_0,
             "default": QType.Q8_0}
    return write_tiny_model(tmp_path_factory.mktemp("one") / "one.gguf", n_layer=1,
                            weight_types=types)


class Recorder:
    """The engine seen through a wrapper that keeps every forward's logits (and can shift)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.logits: list[np.ndarray] = []

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def forward(self, tokens: Sequence[int], start_pos: int, n_out: int = 1) -> np.ndarray:
        out = self.engine.forward(tokens, start_pos, n_out)
        self.logits.append(out)
        return out

    def shift_kv(self, *, src_start: int, src_end: int, dst_start: int) -> None:
        shift_kv(self.engine, src_start=src_start, src_end=src_end, dst_start=dst_start)


def _chat(path: Path, overflow: str, n_turns: int) -> tuple[ChatSession, Recorder,
                                                              list[TurnReport], list[int]]:
    model = minfer.load(path, n_ctx=256)
    rec = Recorder(Engine(model.file, model.hparams, n_ctx=256, kv_type="f32",
                          batch_invariant=True))
    sampler = model.sampler(SamplerParams.greedy(), 0, 256)
    s = ChatSession(rec, model.tokenizer, model.chat_template, sampler, system="be brief",
                    config=ChatConfig(max_tokens=8), overflow=overflow)
    reports, first_logit_index = [], []
    for i in range(n_turns):
        first_logit_index.append(len(rec.logits))
        *_, r = list(s.say(f"turn {i} says hi"))
        assert isinstance(r, TurnReport)
        reports.append(r)
    return s, rec, reports, first_logit_index


def test_session_shift_sees_what_a_re_prefill_sees_with_one_layer(one_layer: Path) -> None:
    s_shift, rec_s, rep_s, idx_s = _chat(one_layer, "shift", 14)
    s_pre, rec_p, rep_p, idx_p = _chat(one_layer, "reprefill", 14)
    over = [i for i, r in enumerate(rep_s) if r.n_dropped]
    assert over and all(rep_s[i].n_shifted > 0 and not rep_s[i].shift_fallback for i in over)
    assert all(rep_p[i].n_dropped == rep_s[i].n_dropped for i in over)
    assert all(rep_s[i].n_prefilled < rep_p[i].n_prefilled for i in over)
    assert s_shift.kv.tokens == s_pre.kv.tokens  # the same kept conversation, cell for cell
    assert [r.ids for r in rep_s] == [r.ids for r in rep_p]
    for i in over:  # the first logits after the shift (the delta's last token) and the decode
        a = rec_s.logits[idx_s[i]:idx_s[i + 1] if i + 1 < len(idx_s) else None]
        b = rec_p.logits[idx_p[i]:idx_p[i + 1] if i + 1 < len(idx_p) else None]
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-3)


def test_session_shift_keeps_first_layer_rows_exact(tiny_qwen2: Path) -> None:
    # Past the first layer a kept row was computed with the dropped turns in its window, so a
    # shift is close to, not equal to, a re-prefill there; the first layer's rows are exact.
    s_shift, rec_s, rep_s, _ = _chat(tiny_qwen2, "shift", 14)
    over = [i for i, r in enumerate(rep_s) if r.n_dropped]
    assert over and rep_s[over[0]].n_shifted > 0
    n = s_shift.kv.cursor
    fresh = Engine(rec_s.engine.weights.file, rec_s.engine.hparams, n_ctx=256, kv_type="f32",
                   batch_invariant=True)
    fresh.forward(s_shift.kv.tokens, 0, 1)
    kv = rec_s.engine.kv
    for kv_a, kv_b in ((kv.k[0], fresh.kv.k[0]), (kv.v[0], fresh.kv.v[0])):
        np.testing.assert_allclose(kv_a[:n], kv_b[:n], rtol=0, atol=2e-5 * np.abs(kv_b[:n]).max())
    assert np.abs(rec_s.engine.kv.k[1][:n] - fresh.kv.k[1][:n]).max() > 0  # not exact past it
