"""The op tape, the only way a graph runs: against the float64 oracle (every family, the
re-encoded weight types, plain and batch-invariant), its node-by-node walk (profiling, tracing)
bit for bit the plain walk, bound once per graph, its kernels called directly."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from minfer.engine.forward import Engine
from minfer.gguf.hparams import HParams
from minfer.gguf.reader import GGUFFile
from minfer.tools.synth import write_tiny_model
from tests.oracle import Oracle


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gemma3: sliding-window layers (window 8 < the prompt), GELU gate (fused), soft-caps."""
    return write_tiny_model(tmp_path_factory.mktemp("gemma") / "gemma3.gguf", arch="gemma3",
                            n_layer=3, n_embd=64, n_head=4, n_head_kv=1, head_dim=32, n_ff=128,
                            sliding_window=8, rope_base=1e6)


def _quantized(d: Path, ftype: str) -> Path:
    """A qwen3 written in F32, then quantized by `minfer quantize` to `ftype`."""
    from gguf import GGMLQuantizationType as QType

    from minfer.tools.quantize import MixOptions, parse_ftype, quantize_model

    src = write_tiny_model(d / "f32.gguf", arch="qwen3", n_embd=256, n_ff=512, head_dim=32,
                           weight_types=QType.F32, tied=False)
    quantize_model(src, d / f"{ftype}.gguf", MixOptions(parse_ftype(ftype)))
    return d / f"{ftype}.gguf"


@pytest.fixture(scope="module")
def tiny_q3_k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q3_K_M: Q3_K weights (run on Q6_K copies widened once) beside Q4_K / Q5_K / Q6_K."""
    return _quantized(tmp_path_factory.mktemp("q3k"), "Q3_K_M")


@pytest.fixture(scope="module")
def tiny_iq4_nl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """IQ4_NL weights (read in the file's blocks by their own kernels)."""
    return _quantized(tmp_path_factory.mktemp("iq4nl"), "IQ4_NL")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama: normal-mode RoPE with Llama 3.1's rope_freqs, untied output."""
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "llama.gguf", arch="llama",
                            n_embd=64, n_head=4, n_head_kv=2, rope_freqs=True, tied=False)


def _engine(path: Path, *, batch_invariant: bool, profile: bool = False) -> Engine:
    f = GGUFFile.open(path)
    e = Engine(f, HParams.from_gguf(f), n_ctx=64, kv_type="f32", batch_invariant=batch_invariant)
    e.profile = {} if profile else None
    return e


PROMPT = [(7 * i + 3) % 50 for i in range(40)]


def _steps(e: Engine) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A prefill with two rows out, three decode steps (one graph, one tape), then a small batch
    with every row out: the logits, and every layer's K and V."""
    logits = [e.forward(PROMPT, 0, n_out=2)]
    for i, tok in enumerate((5, 9, 11)):
        logits.append(e.forward([tok], 40 + i))
    logits.append(e.forward([1, 2, 3], 43, n_out=3))
    return logits, [a.copy() for a in e.kv.k + e.kv.v]


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["plain", "invariant"])
@pytest.mark.parametrize("model", ["tiny_qwen2", "tiny_qwen3", "tiny_gemma3", "tiny_llama",
                                   "tiny_q3_k", "tiny_iq4_nl"])
def test_tape_matches_the_float64_oracle(model: str, batch_invariant: bool,
                                         request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(model)
    logits, _ = _steps(_engine(path, batch_invariant=batch_invariant))
    tokens = [*PROMPT, 5, 9, 11, 1, 2, 3]
    want = Oracle(str(path)).logits(tokens)
    rows = np.concatenate(logits)
    want_rows = want[[38, 39, 40, 41, 42, 43, 44, 45]]
    # activations quantized to 8 bits per block, as llama.cpp does: test_engine.py's bound for
    # one prefill, widened for the decode rows that read the quantized KV of 40 earlier tokens
    assert np.abs(rows - want_rows).max() < 0.05 * np.abs(want_rows).max()
    assert (rows.argmax(-1) == want_rows.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_gemma3"])
def test_the_observed_walk_is_the_plain_walk_bit_for_bit(model: str,
                                                         request: pytest.FixtureRequest) -> None:
    """Profiling walks the same bound steps node by node: same logits, same KV."""
    path = request.getfixturevalue(model)
    e = _engine(path, batch_invariant=False, profile=True)
    la, ka = _steps(_engine(path, batch_invariant=False))
    lb, kb = _steps(e)
    for a, b in zip(la + ka, lb + kb, strict=True):
        np.testing.assert_array_equal(a, b)
    assert e.profile and all(t >= 0 for t in e.profile.values())
    assert any(k.startswith("MatMul:") for k in e.profile)


def test_iq4_nl_weights_are_bound_without_a_copy(tiny_iq4_nl: Path) -> None:
    """The IQ4_NL projections run on the file's blocks: the bound weight is the file's bytes,
    interleaved 16 rows at a time where the rows allow it (the same bytes rearranged, in place
    of the file's pages), never a widened Q8_0 copy (18 bytes per 32 values, not 34)."""
    e = _engine(tiny_iq4_nl, batch_invariant=False)
    e.forward([1, 2, 3], 0)
    e.forward([4], 3)
    bound = [p for key, p in e.weights.state.items()
             if key[0] == "cpu-projection" and getattr(p, "raw_type", None) == 20]  # IQ4_NL
    assert bound
    from minfer.backends.cpu.kernels.quant.types import QType

    for p in bound:
        assert p.quant_type in (QType.IQ4_NL, QType.IQ4_NL_PACKED)
        assert p.packed.nbytes == p.raw.nbytes
        assert p.quant_type == QType.IQ4_NL_PACKED or np.shares_memory(p.packed, p.raw)


def test_a_tape_is_bound_once_per_graph(tiny_qwen2: Path) -> None:
    e = _engine(tiny_qwen2, batch_invariant=False)
    e.forward([1, 2], 0)
    prepared = e.cache.get(e.params_for(1, 1))
    assert "tape" not in prepared.scratch
    e.forward([3], 2)
    tape = prepared.scratch["tape"][1]
    assert tape is not None and len(tape.steps) > 0
    e.forward([4], 3)
    assert prepared.scratch["tape"][1] is tape


def test_tape_calls_run_the_machine_code_directly(tiny_qwen2: Path) -> None:
    """Bound kernel calls skip numba's per-call typing (`jit_cache.direct`): after binding, no
    tape step is a partial of a dispatcher."""
    from functools import partial

    from numba.core.dispatcher import Dispatcher

    e = _engine(tiny_qwen2, batch_invariant=False)
    e.forward([1, 2], 0)
    e.forward([3], 2)
    tape = e.cache.get(e.params_for(1, 1)).scratch["tape"][1]
    kernels = [s for s in tape.steps if isinstance(s, partial)]
    assert kernels and not any(isinstance(s.func, Dispatcher) for s in kernels)


def test_direct_keeps_the_result_and_leaves_other_calls_alone() -> None:
    from functools import partial

    from numba import njit

    from minfer.jit_cache import direct

    @njit
    def axpy(a: float, x: np.ndarray, y: np.ndarray) -> None:  # pragma: no cover - compiled
        for i in range(x.shape[0]):
            y[i] += a * x[i]

    x, y = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    call = direct(partial(axpy, 2.0, x, y))
    assert call.func is not axpy  # type: ignore[attr-defined]
    call()
    np.testing.assert_array_equal(y, 1 + 2 * x)
    with_kw = partial(axpy, 2.0, x, y=y)
    assert direct(with_kw) is with_kw
    plain = partial(print, "x")
    assert direct(plain) is plain


def test_direct_tells_array_kinds_apart() -> None:
    """The per-process memo of machine code keys on what numba's type reads of an array: a
    read-only or strided array of the same dtype gets its own (correct) machine code."""
    from functools import partial

    from numba import njit, typeof

    from minfer.jit_cache import _numba_type, direct

    @njit
    def total(x: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
        out[0] = x.sum()

    out = np.zeros(1)
    base = np.arange(8, dtype=np.float64)
    frozen = base.copy()
    frozen.flags.writeable = False
    kinds = [base, frozen, base[::2], base.reshape(2, 4).T]
    for x in kinds:
        assert _numba_type(x) == typeof(x)
        direct(partial(total, x, out))()
        assert out[0] == x.sum()
    assert len({_numba_type(x) for x in kinds}) == len(kinds)
    scalars = [3, -(2**63), 2**63 - 1, 2**63, True, 1.5,
               np.float32(2), np.int8(-1), np.uint64(2**64 - 1), np.bool_(False), 1j]
    for v in scalars * 2:  # the second pass reads the memo
        assert _numba_type(v) == typeof(v), v


LEAN_PROBE = """
import sys
from minfer import jit_cache
jit_cache.lean_cache_loads()
from numba.core import base
from numba.core.runtime import nrtdynmod
runtimes = []  # numba's runtime compiled in this process (else loaded from the cache)
make_runtime = nrtdynmod.create_nrt_module
nrtdynmod.create_nrt_module = lambda ctx: (runtimes.append(1), make_runtime(ctx))[1]
refreshes = []
plain = base.BaseContext.refresh
base.BaseContext.refresh = lambda self: (refreshes.append(1), plain(self))[1]
sys.path.insert(0, sys.argv[1])
import numpy as np
import leanmod
from numba import njit
ramp = leanmod.ramp(5).sum()  # np.empty inside: an environment of numba.np.arrayobj's
helpers = "numba.np.arrayobj" in sys.modules
twice = njit(lambda x: 2.0 * leanmod.total(x))  # compiled here: links the loaded kernel in
print(leanmod.total(np.arange(10.0)), len(refreshes), twice(np.arange(10.0)), ramp, helpers,
      len(runtimes))
"""


def test_lean_cache_loads_skip_the_context_refresh_only_for_cached_code(tmp_path: Path) -> None:
    """With `lean_cache_loads` (the console script's processes) a kernel compiles as before on
    a cache miss (numba's compiler refreshes its contexts), and a later process loads it from
    the cache without refreshing them, importing the numba module whose helper it inlined
    (`np.empty`'s) or compiling numba's runtime (its machine code cached too), and runs it."""
    import subprocess
    import sys

    (tmp_path / "leanmod.py").write_text(
        "import numpy as np\nfrom numba import njit\n\n\n@njit(cache=True)\ndef total(x):\n"
        "    s = 0.0\n    for v in x:\n        s += v\n    return s\n\n\n"
        "@njit(cache=True)\ndef ramp(n):\n    out = np.empty(n)\n    for i in range(n):\n"
        "        out[i] = i\n    return out\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", LEAN_PROBE, str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    cold, warm = (r.stdout.split() for r in runs)
    assert cold[0] == warm[0] == "45.0"
    assert cold[2] == warm[2] == "90.0"
    assert cold[3] == warm[3] == "10.0"
    assert int(cold[1]) > 0 and int(warm[1]) == 0
    assert cold[4] == "True" and warm[4] == "False"
    assert cold[5] == "1" and warm[5] == "0"
    assert len(list((tmp_path / "cache").glob("nrt-*.bin"))) == 1


def test_cached_objects_symbols_are_those_their_modules_define() -> None:
    """Lean cache loads take a kernel's defined names from its object file's symbol table, not
    from its parsed bitcode: the two agree (functions and data, internal ones included)."""
    import llvmlite.binding as ll
    from numba import njit

    from minfer.jit_cache import elf_defined_symbols

    @njit
    def norm(x):  # type: ignore[no-untyped-def]
        return np.sqrt((x * x).sum()) + len(str(x.size))

    norm(np.arange(3.0))
    library = norm.overloads[norm.signatures[0]].library
    _, kind, (obj, bitcode) = library.serialize_using_object_code()
    module = ll.parse_bitcode(bitcode)
    defined = {g.name for group in (module.functions, module.global_variables) for g in group
               if not g.is_declaration}
    assert kind == "object" and len(defined) > 3
    assert elf_defined_symbols(obj) == defined
    assert elf_defined_symbols(b"\xcf\xfa\xed\xfe" + obj[4:]) is None  # (Mach-O's magic)
    for cut in (obj[:64], obj[:6] + b"\xff" * 100):  # numba then reads it as it would
        assert elf_defined_symbols(cut) is None
