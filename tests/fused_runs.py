"""What the fusion tests share: the tiny Qwen graph after the fusion passes, a tiny model's
engine run through prefill, decode, a short chunk and a chunk past the regions' row limit, and
the kernels a decode tape's steps call."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.graph import ir
from minfer.graph.fusion import fuse
from minfer.graph.params import ContextParams, GraphParams
from minfer.jit_cache import kernel_call
from minfer.models.qwen import build_qwen
from tests.test_graph import _hparams, _shapes

TOKENS = [(7 * i + 3) % 50 for i in range(70)]


def fused_graph(ctx: ContextParams, n_tokens: int = 4) -> ir.ComputeGraph:
    """The tiny Qwen graph of test_graph for `n_tokens` rows, after the fusion passes."""
    hp = _hparams()
    params = GraphParams.for_batch(n_tokens, 1, ctx)
    graph = build_qwen(hp, params, _shapes(hp))
    fuse(graph, params)
    return graph


def run_engine(path: Path, **fields: object) -> tuple[list[np.ndarray], Engine]:
    """The logits of each forward, then every layer's K and V cache (f16 unless `kv_type`)."""
    fields.setdefault("kv_type", "f16")
    f = GGUFFile.open(path)
    e = Engine(f, HParams.from_gguf(f), n_ctx=128, **fields)  # type: ignore[arg-type]
    out = [e.forward(TOKENS[:6], 0, n_out=2)]
    for i, tok in enumerate(TOKENS[6:9]):
        out.append(e.forward([tok], 6 + i))
    out.append(e.forward(TOKENS[9:13], 9, n_out=4))
    out.append(e.forward(TOKENS[13:], 13, n_out=3))  # 57 rows: past the regions' limit
    return out + [a.copy() for a in e.kv.k + e.kv.v], e


def tape_kernels(e: Engine, key: str) -> list[str]:
    """The names of the functions a one-token decode tape's steps call, in order."""
    tape = e.cache.get(e.params_for(1, 1)).scratch[key][1]
    names = []
    for s in tape.steps:
        bound = kernel_call(s)
        func = getattr(bound[0], "py_func", bound[0]) if bound else s
        names.append(getattr(func, "__name__", "?"))
    return names


def fused_against_unfused(path: Path, invariant: bool,
                          toggle: str) -> tuple[list[str], list[str], int]:
    """Two engines, the fusion `toggle` on (the default) and off: every forward's logits and
    the KV caches bit for bit equal; then their one-token decode tapes' kernel names and the
    model's layer count, for the caller's step counts."""
    fused, e = run_engine(path, batch_invariant=invariant)
    plain, e0 = run_engine(path, batch_invariant=invariant, **{toggle: False})
    for a, b in zip(fused, plain, strict=True):
        np.testing.assert_array_equal(a, b)
    key = "tape-invariant" if invariant else "tape"
    return tape_kernels(e, key), tape_kernels(e0, key), e.hparams.n_layer
