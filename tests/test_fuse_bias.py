"""A projection's bias added in its kernel's epilogue (`fusion.fuse_bias`, issue #66): each thread
adds the bias to the rows it computed, the bits of the separate add step (kernels of every
driver skeleton, and engines fused vs unfused, plain and batch-invariant), and Qwen2's decode
tape loses its three bias steps a layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minfer.backends.cpu import kernels as K
from minfer.backends.cpu.kernels import QType
from tests.fused_runs import run_engine, tape_kernels
from tests.test_kernels_dequant import make_weight


@pytest.mark.parametrize("qt", [QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q6_K],
                         ids=lambda q: q.name)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("nt", [1, 11, 40])  # 40: past the expanded Q5_0 tiles' 32 tokens
def test_the_epilogue_gives_the_separate_adds_bits(qt: QType, packed: bool, nt: int) -> None:
    n_out, n_in = 48, 512
    w, wt = make_weight(qt, n_out, n_in, seed=nt), qt
    if packed:
        if not K.packable(qt, n_in, n_out):
            pytest.skip("no repacked layout on this CPU (needs AVX2)")
        w, wt = K.repack_weight(w, qt)
    rng = np.random.default_rng(nt)
    x = rng.standard_normal((nt, n_in)).astype(np.float32)
    bias = rng.standard_normal(n_out).astype(np.float32) * 4
    xq = K.new_activation(nt, n_in, wt)
    assert xq is not None and K.takes_bias(wt)
    K.bind_quantize(x, xq)()
    fused, plain = np.empty((nt, n_out), np.float32), np.empty((nt, n_out), np.float32)
    K.bind_prequant_into(w, wt, xq, fused, bias)()
    K.bind_prequant_into(w, wt, xq, plain)()
    K.bind_add(plain, bias, plain)()
    np.testing.assert_array_equal(fused, plain)
    with pytest.raises(ValueError, match="no bias"):
        K.bind_prequant_into(w, wt, xq, fused, bias[:16])




@pytest.mark.parametrize("invariant", [False, True])
def test_fused_and_unfused_engines_give_the_same_bits(invariant: bool,
                                                      tiny_qwen2: Path) -> None:
    fused, e = run_engine(tiny_qwen2, batch_invariant=invariant)
    plain, e0 = run_engine(tiny_qwen2, batch_invariant=invariant, fuse_bias=False)
    for a, b in zip(fused, plain, strict=True):
        np.testing.assert_array_equal(a, b)
    key = "tape-invariant" if invariant else "tape"
    steps, steps0 = tape_kernels(e, key), tape_kernels(e0, key)
    n_bias = 3 * e.hparams.n_layer  # q / k / v
    assert steps0.count("_add_row") - steps.count("_add_row") == n_bias
    assert len(steps) == len(steps0) - n_bias
