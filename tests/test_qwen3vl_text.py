"""Qwen3-VL's text models (`qwen3vl`, `qwen3vlmoe`) against transformers, and their
multi-position rope.

tests/fixtures/qwen3vl/ and qwen3vlmoe/ come from benchmarks/make_qwen3vl_fixtures.py (a tiny
random Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration converted by
llama.cpp 0.3.36, f32): a text-only chat prompt's logits and greedy answer, and an image
prompt's logits with transformers' image features and its M-RoPE positions (get_rope_index),
fed here as given rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minfer.backends.cpu.kernels.elementwise.rope import rope
from minfer.backends.cpu.kernels.reference import ref_rope
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.graph import ir

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3vl"
REF = np.load(FIXTURES / "ref.npz")
ARCHS = ["qwen3vl", "qwen3vlmoe"]


def _ref(arch: str) -> np.lib.npyio.NpzFile:
    return np.load(FIXTURES.parent / arch / "ref.npz")


def _hf_imrope(x: np.ndarray, pos: np.ndarray, sections: list[int], head_dim: int,
               base: float) -> np.ndarray:
    """transformers' Qwen3-VL text rope: t / h / w frequencies interleaved
    (apply_interleaved_mrope), rotate_half."""
    half = head_dim // 2
    inv = base ** (-np.arange(0, head_dim, 2) / head_dim)
    freqs = pos.astype(np.float64)[:, :, None] * inv  # [3, nt, half]
    f = freqs[0].copy()
    for dim in (1, 2):
        idx = slice(dim, sections[dim] * 3, 3)
        f[:, idx] = freqs[dim][:, idx]
    return _rotate_half(x, f, half)


def _rotate_half(x: np.ndarray, f: np.ndarray, half: int) -> np.ndarray:
    nt = x.shape[0]
    xh = x.astype(np.float64).reshape(nt, -1, 2 * half)
    c, s = np.cos(f)[:, None, :], np.sin(f)[:, None, :]
    a, b = xh[..., :half], xh[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], -1).reshape(nt, -1)


def test_interleaved_mrope_matches_transformers() -> None:
    rng = np.random.default_rng(0)
    nt, n_head, hd = 7, 3, 16
    x = rng.standard_normal((nt, n_head * hd)).astype(np.float32)
    pos = np.stack([np.arange(nt) + 3, rng.integers(0, 9, nt), rng.integers(0, 9, nt)])
    want = _hf_imrope(x, pos, [3, 3, 2], hd, 10000.0)
    flat = np.concatenate([pos.reshape(-1), np.zeros(nt, np.int64)])
    out = np.empty_like(x)
    rope(x, flat, n_head=n_head, head_dim=hd, rope_dim=hd, base=10000.0, out=out,
         mrope="imrope", sections=(3, 3, 2, 0))
    np.testing.assert_allclose(out, want, atol=2e-5)
    ref = ref_rope(x, flat, n_head=n_head, head_dim=hd, rope_dim=hd, base=10000.0,
                   mrope="imrope", sections=(3, 3, 2, 0))
    np.testing.assert_allclose(ref, want, atol=1e-12)


def test_vision_rope_matches_transformers() -> None:
    """The 2-D rope over patches: pairs (i, i + head/2) over the whole head, the first quarter
    of pairs at the row (y), the next at the column (x), each at base^(-4j / head)."""
    rng = np.random.default_rng(1)
    nt, n_head, hd = 6, 2, 16
    x = rng.standard_normal((nt, n_head * hd)).astype(np.float32)
    y, xx = rng.integers(0, 8, nt), rng.integers(0, 8, nt)
    inv = 10000.0 ** (-np.arange(0, hd // 2, 2) / (hd // 2))
    f = np.concatenate([y[:, None] * inv, xx[:, None] * inv], -1)
    want = _rotate_half(x, f, hd // 2)
    out = np.empty_like(x)
    rope(x, np.concatenate([y, xx, y, xx]), n_head=n_head, head_dim=hd, rope_dim=hd,
         base=10000.0, out=out, mrope="vision")
    np.testing.assert_allclose(out, want, atol=2e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_hparams_read_as_llama_cpp(arch: str) -> None:
    f = GGUFFile.open(FIXTURES.parent / arch / "model.gguf")
    hp = HParams.from_gguf(f)
    assert (hp.arch, hp.rope_sections, hp.n_deepstack, hp.head_dim) == (
        arch, (3, 3, 2, 0), 1, 16)
    assert (hp.n_expert, hp.n_expert_used, hp.expert_norm) == (
        (4, 2, True) if arch == "qwen3vlmoe" else (0, 0, False))


def _engine(arch: str = "qwen3vl") -> object:
    from minfer.engine.forward import Engine

    f = GGUFFile.open(FIXTURES.parent / arch / "model.gguf")
    return Engine(f, HParams.from_gguf(f), n_ctx=128)


@pytest.mark.parametrize("arch", ARCHS)
def test_text_logits_match_transformers(arch: str) -> None:
    ref = _ref(arch)
    ids = ref["text_ids"].tolist()
    got = _engine(arch).forward(ids, 0, n_out=len(ids))  # type: ignore[attr-defined]
    want = ref["text_logits"]
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-3  # f16 KV


@pytest.mark.parametrize("arch", ARCHS)
def test_text_greedy_matches_transformers_generate(arch: str) -> None:
    from minfer.api import Model
    from minfer.engine.generate import Finished
    from minfer.sampling.params import SamplerParams

    ref = _ref(arch)
    want = ref["text_greedy"].tolist()
    model = Model(FIXTURES.parent / arch / "model.gguf", n_ctx=128)
    end = model.tokenizer.token_id("<|im_end|>")
    if end in want:  # transformers went on past the end of the turn; minfer stops there
        want = want[:want.index(end)]
    *_, done = model.stream(ref["text_ids"].tolist(), max_tokens=len(want) or 1,
                            sampling=SamplerParams(temp=0.0))
    assert isinstance(done, Finished) and done.ids == want


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("split", [False, True])
def test_image_rows_at_mrope_positions_match_transformers(split: bool, arch: str) -> None:
    """transformers' image features and deepstack block as given rows at the image's
    placeholders, its t / h / w positions as the batch's rope positions: every position's
    logits are transformers' (split: the prompt fed in two batches, the image in the first)."""
    from minfer.engine.forward import Batch

    ref = _ref(arch)
    ids = ref["ids"].tolist()
    pos = ref["positions"]  # [3, nt]
    rows = np.concatenate([ref["features"], ref["deepstack"][0]], axis=1)
    at = ids.index(int(np.bincount(ids).argmax()))  # the first <|image_pad|>
    engine = _engine(arch)
    n = len(ids)
    cuts = [(0, 30), (30, n)] if split else [(0, n)]
    got = []
    for lo, hi in cuts:
        cells = np.arange(lo, hi, dtype=np.int32)
        batch = Batch(tokens=np.array(ids[lo:hi], np.int32), positions=pos[0, lo:hi].copy(),
                      cells=cells, kv_start=np.zeros(hi - lo, np.int32), kv_end=cells + 1,
                      out_rows=np.arange(hi - lo, dtype=np.int32),
                      rope_pos=np.concatenate([pos[:, lo:hi], np.zeros((1, hi - lo), np.int32)]))
        if lo <= at < hi:
            batch = batch.with_rows(at - lo, rows, causal=True)
        got.append(engine.forward_batch(batch))  # type: ignore[attr-defined]
    want = ref["logits"]
    got_all = np.concatenate(got)
    assert float(np.abs(got_all - want).max() / np.abs(want).max()) < 1e-3  # f16 KV


def test_torch_rope_tables_follow_the_sections() -> None:
    torch = pytest.importorskip("torch")
    from minfer.backends.torch_backend import ops

    rng = np.random.default_rng(3)
    nt, n_head, hd = 5, 2, 16
    x = rng.standard_normal((nt, n_head * hd)).astype(np.float32)
    for mode, secs in (("imrope", (3, 3, 2, 0)), ("vision", ())):
        pos = rng.integers(0, 9, 4 * nt)
        cos, sin = ops.rope_tables(torch.from_numpy(pos), base=10000.0, rope_dim=hd,
                                   mrope=mode, sections=secs)
        out = torch.empty(nt, n_head * hd)
        ops.rope_neox(torch.from_numpy(x), cos, sin, n_head=n_head, head_dim=hd, rope_dim=hd,
                      out=out)
        want = ref_rope(x, pos, n_head=n_head, head_dim=hd, rope_dim=hd, base=10000.0,
                        mrope=mode, sections=secs)
        np.testing.assert_allclose(out.numpy(), want, atol=2e-5)


def test_context_shift_is_refused() -> None:
    from minfer.chat.kv import kv_shifter
    from minfer.engine.kv_shift import shift_kv
    from minfer.errors import MinferError

    engine = _engine()
    assert kv_shifter(engine) is None
    with pytest.raises(MinferError, match="M-RoPE"):
        shift_kv(engine, src_start=4, src_end=8, dst_start=0)  # type: ignore[arg-type]


def test_torch_backend_runs_the_image_prompt() -> None:
    """The torch backend (claim "all": M-RoPE, ReplaceRows and the deepstack adds on torch)
    gives the image prompt's logits within bf16's reach of transformers', the same next token
    (bf16 may flip a near-tie elsewhere in the prompt)."""
    pytest.importorskip("torch")
    from minfer.backends.cpu.backend import CpuBackend
    from minfer.backends.torch_backend.backend import TorchBackend
    from minfer.engine.core.request import PromptRows, mrope_positions
    from minfer.engine.forward import Engine

    ids = REF["ids"].tolist()
    rows = np.concatenate([REF["features"], REF["deepstack"][0]], axis=1)
    block = PromptRows(6, rows, True, (3, 4))
    f = GGUFFile.open(FIXTURES / "model.gguf")
    engine = Engine(f, HParams.from_gguf(f), n_ctx=64,
                    backends=[TorchBackend(min_rows=2, claim="all"), CpuBackend()])
    got = engine.forward(ids, 0, n_out=len(ids), embd=[(6, rows, True)],
                         rope_pos=mrope_positions([block], 0, len(ids)))
    want = REF["logits"]
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 3e-2
    assert got[-1].argmax() == want[-1].argmax()
    graph = engine.cache.get(engine.params_for(len(ids), len(ids), embd_input=True)).graph
    assert any(n.backend == "torch" and isinstance(n.op, ir.Rope) and n.op.mrope
               for n in graph.nodes)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_after_given_image_rows_matches_transformers(arch: str) -> None:
    """transformers' image rows given to the Python API's stream (one causal block with its
    grid): the greedy tokens, decoded at rope positions past the image's, are generate's."""
    from minfer.api import Model
    from minfer.engine.core.request import PromptRows
    from minfer.engine.generate import Finished
    from minfer.sampling.params import SamplerParams

    ref = _ref(arch)
    want = ref["greedy"].tolist()
    top2 = np.sort(ref["logits"][-1])[-2:]
    assert top2[1] - top2[0] > 1e-3  # the first choice is not a near-tie
    rows = np.concatenate([ref["features"], ref["deepstack"][0]], axis=1)
    model = Model(FIXTURES.parent / arch / "model.gguf", n_ctx=128)
    assert model.tokenizer.token_id("<|im_end|>") not in want
    *_, done = model.stream(ref["ids"].tolist(), max_tokens=len(want),
                            embd=[PromptRows(6, rows, True, (3, 4))],
                            sampling=SamplerParams(temp=0.0), top_logits=3)
    assert isinstance(done, Finished) and done.ids == want
    assert_draws_match(done.top_logits, ref["decode_logits"])


def assert_draws_match(tops: list[list[tuple[int, float]]], want: np.ndarray) -> None:
    """Each draw's largest logits (ids and values) are transformers' at that decode step."""
    assert len(tops) == len(want)
    scale = float(np.abs(want).max())
    for top, row in zip(tops, want, strict=True):
        ids = [i for i, _ in top]
        assert ids[0] == int(row.argmax())
        np.testing.assert_allclose([v for _, v in top], row[ids], atol=1e-3 * scale)
