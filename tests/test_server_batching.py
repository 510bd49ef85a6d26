"""Batch invariance on the real engine: a row's logits may not depend on what shares its batch.

Continuous batching promises that a greedy request yields the same ids whether it runs alone,
beside other decodes, beside a prompt chunk, or after a prompt-cache hit (its prefix computed in
other chunk sizes). That holds only if the kernels compute each row the same way whatever the
batch holds (`Engine(batch_invariant=True)`: the integer-dot path at every batch size, where
the default switches to dequantize + sgemm from 16 rows); these tests pin it through the server's
runner on the tiny models, bit for bit, for short and long neighbours and chunkings.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

try:
    from minfer.engine.forward import Engine
except (ImportError, AttributeError) as exc:  # the compiled kernels are not importable
    pytest.skip(f"the engine cannot run here: {exc}", allow_module_level=True)

from minfer.engine.core.runner import Runner
from minfer.engine.core.scheduler import Plan, Work
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

N_CTX_SLOT = 64
PREFIX = [11, 42, 7, 99, 3, 250, 17, 8, 120, 64, 5, 31, 77, 200, 150, 13, 9, 88, 21, 33]


def _runner(path: Path, n_slots: int = 3, kv_type: str = "f16") -> Runner:
    f = GGUFFile.open(path)
    engine = Engine(f, HParams.from_gguf(f), n_ctx=n_slots * N_CTX_SLOT, kv_type=kv_type,
                    batch_invariant=True)  # as `minfer serve` creates it
    return Runner(engine, N_CTX_SLOT)


def _prefill(runner: Runner, slot: int, tokens: list[int], chunk: int) -> np.ndarray:
    """Feed tokens into slot in chunks of `chunk`; the last row's logits."""
    out = None
    for i in range(0, len(tokens), chunk):
        part = tuple(tokens[i : i + chunk])
        out = runner.run(Plan((Work(slot, slot, i, part, True),)))[slot]
    assert out is not None
    return out


@pytest.fixture(params=["tiny_qwen2", "tiny_qwen3", "tiny_qwen3moe"])
def model(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(request.param))


def _warm(runner: Runner) -> Work:
    for slot in range(3):
        _prefill(runner, slot, PREFIX, 8)
    return Work(0, 0, len(PREFIX), (5,), True)


def test_a_decode_row_is_the_same_alone_and_beside_other_decodes(model: Path) -> None:
    runner = _runner(model)
    step = _warm(runner)
    alone = runner.run(Plan((step,)))[0]
    beside = runner.run(Plan((step, Work(1, 1, len(PREFIX), (6,), True),
                              Work(2, 2, len(PREFIX), (7,), True))))[0]
    assert np.array_equal(alone, beside)


def test_a_decode_row_is_the_same_beside_a_short_prompt_chunk(model: Path) -> None:
    runner = _runner(model)
    step = _warm(runner)
    alone = runner.run(Plan((step,)))[0]
    chunk = Work(1, 1, 0, tuple(PREFIX[:9]), False)  # 10 rows in all
    assert np.array_equal(alone, runner.run(Plan((step, chunk)))[0])


def test_a_decode_row_is_the_same_beside_a_long_prompt_chunk(model: Path) -> None:
    runner = _runner(model)
    step = _warm(runner)
    alone = runner.run(Plan((step,)))[0]
    chunk = Work(1, 1, 0, tuple(PREFIX[::-1]), False)  # 21 rows in all
    assert np.array_equal(alone, runner.run(Plan((step, chunk)))[0])


def test_kv_does_not_depend_on_short_chunking_of_the_prompt(model: Path) -> None:
    """A prompt-cache hit prefills only the suffix: the prefix's KV came in other chunk sizes."""
    runner = _runner(model)
    by_tokens = _prefill(runner, 0, PREFIX, 1)
    assert np.array_equal(by_tokens, _prefill(runner, 1, PREFIX, 7))
    assert np.array_equal(by_tokens, _prefill(runner, 2, PREFIX, 15))


def test_kv_does_not_depend_on_long_chunking_of_the_prompt(model: Path) -> None:
    runner = _runner(model)
    assert np.array_equal(_prefill(runner, 0, PREFIX, 1), _prefill(runner, 1, PREFIX, 64))


@pytest.mark.parametrize("kv_type", ["f32", "q8_0", "q4_0"])
def test_batch_invariance_holds_for_every_cache_type(tiny_qwen3: Path, kv_type: str) -> None:
    """The tests above with an f16 cache; here the other types (quantized K/V rows are written
    and read per row too), on the model whose head_dim (32) takes block formats."""
    runner = _runner(tiny_qwen3, kv_type=kv_type)
    step = _warm(runner)
    alone = runner.run(Plan((step,)))[0]
    beside = runner.run(Plan((step, Work(1, 1, len(PREFIX), (6,), True),
                              Work(2, 2, 0, tuple(PREFIX[::-1]), False))))[0]
    assert np.array_equal(alone, beside)
    by_tokens = _prefill(runner, 0, PREFIX, 1)
    assert np.array_equal(by_tokens, _prefill(runner, 1, PREFIX, 7))
    assert np.array_equal(by_tokens, _prefill(runner, 2, PREFIX, 64))


def _real_text_ids() -> list[int]:
    """~220 ids of real text: the reference prompts and their greedy continuations, in a row."""
    import json

    cases = json.loads((Path(__file__).parent / "fixtures" / "greedy.json").read_text())["cases"]
    return [i for c in cases for i in c["prompt_ids"] + c["greedy_ids"]]


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("context", [16, 43, 100])
def test_a_dev_model_decode_row_is_the_same_beside_a_prefill(real_model_path: Path,
                                                              context: int) -> None:
    """Issue 20: at realistic contexts a decode row alone runs the decode graph (fused gate/up,
    in place) and beside a prefill the prefill graph (separate gate and up): same bits."""
    ids = _real_text_ids()
    f = GGUFFile.open(real_model_path)
    engine = Engine(f, HParams.from_gguf(f), n_ctx=2 * 128, batch_invariant=True,
                    fuse_swiglu=True, fuse_gate_up=True)  # as `minfer serve` builds it
    runner = Runner(engine, 128)
    runner.run(Plan((Work(0, 0, 0, tuple(ids[:context]), False),)))
    step = Work(0, 0, context, (ids[context],), True)
    alone = runner.run(Plan((step,)))[0]
    neighbour = Work(1, 1, 0, tuple(ids[-37:]), False)
    assert np.array_equal(alone, runner.run(Plan((step, neighbour)))[0])
