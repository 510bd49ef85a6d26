"""Parallel regions (issue #66): a bound tape's runs of steps as one numba parallel call each,
the same bits as the steps called one by one, barriers only where a step depends on another."""

from __future__ import annotations

from pathlib import Path

import numba
import numpy as np
import pytest
from numba import njit

from minfer.backends.cpu.kernels.region.adapters import Form, region_form
from minfer.backends.cpu.regions import RegionRun, barriers, schedule
from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile

PROMPT = [(5 * i + 1) % 50 for i in range(24)]


def _run(path: Path) -> tuple[list[np.ndarray], Engine]:
    f = GGUFFile.open(path)
    e = Engine(f, HParams.from_gguf(f), n_ctx=64, kv_type="f16")
    out = [e.forward(PROMPT, 0, n_out=2)]
    for i, tok in enumerate((4, 8, 15)):
        out.append(e.forward([tok], len(PROMPT) + i))
    out.append(e.forward([1, 2, 3], len(PROMPT) + 3, n_out=3))
    return out + [a.copy() for a in e.kv.k + e.kv.v], e


@pytest.mark.parametrize("model", ["tiny_qwen2", "tiny_qwen3", "tiny_qwen3moe"])
def test_regions_give_the_bits_of_the_steps_one_by_one(
        model: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    path = request.getfixturevalue(model)
    with_regions, e = _run(path)
    monkeypatch.setenv("MINFER_REGIONS", "0")
    without, e0 = _run(path)
    for a, b in zip(with_regions, without, strict=True):
        np.testing.assert_array_equal(a, b)
    decode = e.cache.get(e.params_for(1, 1)).scratch["tape"][1]
    regions = [c for c in decode.program if isinstance(c, RegionRun)]
    assert regions, "a decode step runs in parallel regions"
    if model != "tiny_qwen3moe":  # (its expert drivers have no region form yet)
        assert len(regions) == 1 and len(regions[0].steps) >= len(decode.steps) - 2
        assert 0 < regions[0].barriers.sum() < len(regions[0].steps)
    plain = e0.cache.get(e0.params_for(1, 1)).scratch["tape"][1]
    assert not any(isinstance(c, RegionRun) for c in plain.program)
    assert len(plain.program) == len(plain.steps)


def _form(reads: list[tuple[int, int]], writes: list[tuple[int, int]], split: bool) -> Form:
    return Form(0, np.zeros(0, np.int64), split, tuple(reads), tuple(writes))


def test_barriers_only_before_a_step_that_depends_on_one_since_the_last() -> None:
    x, xq, q, k, y = (0, 10), (10, 20), (20, 30), (30, 40), (40, 50)
    forms = [
        _form([x, xq], [xq], False),  # quantize x (thread 0)
        _form([xq, q], [q], True),  # q = W_q xq: reads what thread 0 wrote
        _form([xq, k], [k], True),  # k = W_k xq: reads xq too, writes apart: no wait
        _form([q, k, y], [y], False),  # reads q and k, which every thread wrote
        _form([y], [y], False),  # thread 0 after thread 0: no wait
        _form([x], [x], True),  # x was read before the last barrier: no wait
        _form([y], [y], True),  # writes y, which thread 0 read since the barrier
    ]
    assert barriers(forms) == [False, True, False, True, False, False, True]


def test_serial_steps_waiting_on_projections_are_held_to_share_one_barrier() -> None:
    """Qwen2's q / k / v: a bias add (thread 0) after each projection (every thread) waited
    for all threads three times; held past the independent projections they wait once."""
    xq, q, k, v, pos = (0, 10), (10, 20), (20, 30), (30, 40), (40, 50)
    forms = [
        _form([xq, q], [q], True),  # 0: q = W_q xq
        _form([q], [q], False),  # 1: q += b_q (reads every thread's q)
        _form([xq, k], [k], True),  # 2: k = W_k xq
        _form([k], [k], False),  # 3: k += b_k
        _form([xq, v], [v], True),  # 4: v = W_v xq
        _form([v], [v], False),  # 5: v += b_v
        _form([q, pos], [q], False),  # 6: rope of q (reads q: after its bias)
        _form([(50, 60)], [(50, 60)], True),  # 7: apart from all of them
    ]
    order = schedule(forms)
    assert order == [0, 2, 4, 1, 3, 5, 6, 7]
    assert barriers([forms[i] for i in order]) == [False] * 3 + [True] + [False] * 4
    assert sum(barriers(forms)) == 3  # before 1, 3 and 5
    # a step touching a held one is never moved before it
    touching = [forms[0], forms[1], _form([q], [k], True)]
    assert schedule(touching) == [0, 1, 2]


@njit(parallel=True, cache=True)
def _parallel_only(x, out):  # pragma: no cover - compiled
    out[:] = x


@njit(cache=True)
def _serial(x, out):  # pragma: no cover - compiled
    for i in range(x.shape[0]):
        out[i] = x[i] * 2


def test_region_forms_only_for_what_the_region_can_run() -> None:
    x, out = np.arange(8, dtype=np.float32), np.zeros(8, np.float32)
    assert region_form(_parallel_only, (x, out)) is None  # no _part form
    assert region_form(_serial, (x[::2], out[:4])) is None  # not contiguous
    assert region_form(print, (x, out)) is None  # not a numba function
    form = region_form(_serial, (x, out))
    assert form is not None and not form.split and len(form.writes) == 2  # not in WRITES: all


def test_a_region_records_each_threads_timeline(tiny_qwen2: Path) -> None:
    _, e = _run(tiny_qwen2)
    decode = e.cache.get(e.params_for(1, 1)).scratch["tape"][1]
    region = next(c for c in decode.program if isinstance(c, RegionRun))
    stamps = region.timeline()
    assert stamps.shape == (numba.get_num_threads(), 2 * len(region.steps))
    for row in stamps:  # every thread passes every step, in order
        assert (np.diff(row) >= 0).all() and row[0] > 0


@njit(parallel=True, cache=True)
def _double(x, out):  # pragma: no cover - compiled
    for i in numba.prange(x.shape[0]):
        out[i] = x[i] * 2


@njit(cache=True)
def _double_part(part, n_parts, x, out):  # pragma: no cover - compiled
    for i in range(part * x.shape[0] // n_parts, (part + 1) * x.shape[0] // n_parts):
        out[i] = x[i] * 2


def test_a_kernel_that_raises_in_a_region_raises_its_own_error() -> None:
    """A cfunc cannot raise: the region notes the failed step and calls it again on its own,
    which raises the kernel's error (here a KV cell outside the cache)."""
    from functools import partial

    from minfer import jit_cache
    from minfer.backends.cpu.kernels.attn.kv_formats import bind_store_kv, new_cache
    from minfer.backends.cpu.regions import compose

    rows = np.ones((1, 64), np.float32)
    k_cache, v_cache = new_cache("f32", 8, 64), new_cache("f32", 8, 64)
    cells = np.array([3], np.int64)
    x, y = np.arange(64, dtype=np.float32), np.zeros(64, np.float32)
    program = compose([jit_cache.direct(partial(_double, x, y)),
                       jit_cache.direct(bind_store_kv(rows, rows * 2, k_cache, v_cache, cells))])
    assert len(program) == 1 and isinstance(program[0], RegionRun)
    program[0]()
    assert (y == 2 * x).all() and (k_cache[3] == 1).all() and (v_cache[3] == 2).all()
    cells[0] = 8
    with pytest.raises(ValueError, match="outside the cache"):
        program[0]()
    cells[0] = 5
    program[0]()  # the flags were cleared
    assert (k_cache[5] == 1).all()
