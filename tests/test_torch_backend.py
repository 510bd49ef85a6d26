"""The torch backend on the tiny synthetic models: the engine's behaviours with torch taking the
nodes it claims (fused and unfused, tail and full, every claim set, host and copying I/O),
against the CPU backend within bf16 tolerance; and the backend's selection rules."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from minfer.backends.cpu.backend import CpuBackend  # noqa: E402
from minfer.backends.torch_backend import make_torch_backend  # noqa: E402
from minfer.backends.torch_backend.backend import TorchBackend  # noqa: E402
from minfer.backends.torch_backend.boundary import DeviceIO, DevicePlan, exports  # noqa: E402
from minfer.backends.torch_backend.device import Capabilities, choose_device, detect  # noqa: E402
from minfer.engine.forward import Batch, Engine  # noqa: E402
from minfer.errors import MinferError  # noqa: E402
from minfer.gguf.hparams import HParams  # noqa: E402
from minfer.gguf.reader import GGUFFile  # noqa: E402
from minfer.graph import ir, scheduler  # noqa: E402
from tests.oracle import OracleQwen  # noqa: E402

TOKENS = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 11]
# The torch backend's logits are held to the exact (float64) forward, within a margin of what
# bf16 arithmetic alone does to it: the oracle with each weight product's operands and result
# rounded to bfloat16 (unit roundoff 2^-9), against the plain oracle. On the tiny models that
# is 0.3-1.1 % of the largest |logit|; the backend lands at 0.8-1.02x of it (Intel SPR with AMX,
# AMD EPYC with AVX512-BF16 alike). The margin covers the f32 accumulation order and the rare
# product whose bf16 rounding flips. (Against the CPU backend the two errors add: its Q8
# activations stray 2.6 % on tiny_qwen3, further than bf16 does.)
BF16_MARGIN = 1.5


@functools.cache
def _exact_and_bf16_error(path: Path) -> tuple[np.ndarray, float]:
    exact = OracleQwen(str(path)).logits(TOKENS)
    return exact, _rel(OracleQwen(str(path), bf16=True).logits(TOKENS), exact)


def _engine(path: Path, torch_backend: TorchBackend | None = None, **kw: object) -> Engine:
    f = GGUFFile.open(path)
    kw.setdefault("n_ctx", 64)
    backends = [torch_backend, CpuBackend()] if torch_backend else [CpuBackend()]
    return Engine(f, HParams.from_gguf(f), backends=backends, **kw)  # type: ignore[arg-type]


def _all_rows(engine: Engine, tokens: list[int]) -> np.ndarray:
    return engine.forward_batch(Batch.single(tokens, 0, n_out=len(tokens)))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _prepared(engine: Engine, n_tokens: int, n_out: int):  # type: ignore[no-untyped-def]
    return engine.cache.get(engine.params_for(n_tokens, n_out))


@pytest.mark.parametrize("claim", ["matmul", "dense", "all"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_qwen3"])
def test_full_and_tail_agree_with_cpu(fixture: str, fuse: bool, claim: str,
                                      request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    ref = _all_rows(_engine(path, fuse_swiglu=fuse, fuse_gate_up=fuse), TOKENS)
    tb = TorchBackend(min_rows=2, claim=claim)
    e = _engine(path, tb, fuse_swiglu=fuse, fuse_gate_up=fuse)
    full = _all_rows(e, TOKENS)  # a decode-type graph: every row is an output
    tail = e.forward(TOKENS, 0, n_out=3)  # a prefill graph: tail rows after the last layer
    exact, bf16_error = _exact_and_bf16_error(path)
    assert _rel(full, exact) < BF16_MARGIN * bf16_error
    assert _rel(tail, exact[-3:]) < BF16_MARGIN * bf16_error
    assert np.array_equal(full.argmax(-1), ref.argmax(-1))
    graph = _prepared(e, len(TOKENS), 3).graph
    claimed = {type(n.op) for n in graph.nodes if n.backend == "torch"}
    assert ir.MatMul in claimed
    assert (ir.Attn in claimed) == (claim == "all")
    assert (ir.RmsNorm in claimed) == (claim != "matmul")
    if fuse:
        assert ir.FusedGateUp in {type(n.op) for n in _prepared(e, 11, 11).graph.nodes
                                  if n.backend == "torch"}


def test_claim_all_crosses_only_at_the_inputs_and_the_tail(tiny_qwen2: Path) -> None:
    counts = {}
    for claim in ("matmul", "dense", "all"):
        e = _engine(tiny_qwen2, TorchBackend(min_rows=4, claim=claim))
        e.forward(TOKENS, 0)
        prepared = _prepared(e, len(TOKENS), 1)
        graph, live = prepared.graph, prepared.plan.live
        counts[claim] = scheduler.count_crossings(graph, live)
        if claim == "all":  # one torch split, then the tail on the CPU
            assert [name for name, _ in prepared.splits] == ["torch", "cpu"]
    assert counts["all"] < counts["dense"] < counts["matmul"]


def test_decode_and_tail_rows_stay_on_cpu(tiny_qwen2: Path) -> None:
    e = _engine(tiny_qwen2, TorchBackend(min_rows=4))
    e.forward(TOKENS[:8], 0)
    e.forward([TOKENS[8]], 8)
    decode = _prepared(e, 1, 1).graph
    assert all(n.backend == "cpu" for n in decode.nodes)
    prefill = _prepared(e, 8, 1).graph
    assert prefill.by_name("output").backend == "cpu"  # 1 row: the quantized kernel reads it
    assert prefill.by_name("attn_q").backend == "torch"


def test_a_batch_invariant_forward_refuses_nodes_on_torch(tiny_qwen2: Path) -> None:
    """Backends are chosen per graph, so a batch-invariant forward (a speculative verify) of
    enough rows would reach torch's bf16 GEMMs, whose rows depend on the batch: a clear error,
    not rows of other bits. Below the torch rows it runs, bitwise its decode rows."""
    e = _engine(tiny_qwen2, TorchBackend(min_rows=4))
    with pytest.raises(MinferError, match="batch-invariant forward of 8 rows would run nodes "
                                          "on torch"):
        e.forward(TOKENS[:8], 0, n_out=8, batch_invariant=True)
    verify = e.forward(TOKENS[:3], 0, n_out=3, batch_invariant=True)
    for t in range(3):
        assert np.array_equal(e.forward([TOKENS[t]], t)[0], verify[t])


def test_prefill_on_torch_then_decode_on_cpu_reads_the_same_kv(tiny_qwen3: Path) -> None:
    def run(torch_backend: TorchBackend | None) -> np.ndarray:
        e = _engine(tiny_qwen3, torch_backend)
        out = [e.forward(TOKENS[:6], 0)]
        out += [e.forward([t], 6 + i) for i, t in enumerate(TOKENS[6:])]
        return np.concatenate(out)

    ref = run(None)
    got = run(TorchBackend(min_rows=4))
    # two approximations of one exact forward differ by at most about the sum of their errors
    exact, bf16_error = _exact_and_bf16_error(tiny_qwen3)
    cpu_error = _rel(_all_rows(_engine(tiny_qwen3), TOKENS), exact)
    assert _rel(got, ref) < BF16_MARGIN * (bf16_error + cpu_error)


def test_batched_sequences_equal_each_alone(tiny_qwen3: Path) -> None:
    a, b = TOKENS[:5], TOKENS[3:10]  # the tail rows (1 and 2) stay on the CPU in both runs
    e = _engine(tiny_qwen3, TorchBackend(min_rows=3))
    alone_a = e.forward(a, 0)
    alone_b = _engine(tiny_qwen3, TorchBackend(min_rows=3)).forward(b, 0)
    na, nb = len(a), len(b)  # sequence A in cells 0.., B in cells 32..
    pos = np.concatenate([np.arange(na), np.arange(nb)]).astype(np.int32)
    cells = np.concatenate([np.arange(na), 32 + np.arange(nb)]).astype(np.int32)
    start = np.array([0] * na + [32] * nb, np.int32)
    batch = Batch(np.array(a + b, np.int32), pos, cells, start, cells + 1,
                  np.array([na - 1, na + nb - 1], np.int32))
    both = _engine(tiny_qwen3, TorchBackend(min_rows=3)).forward_batch(batch)
    np.testing.assert_allclose(both[0], alone_a[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(both[1], alone_b[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("claim", ["matmul", "dense"])
def test_copying_io_equals_host_io_and_copies_only_at_boundaries(tiny_qwen2: Path,
                                                                 claim: str) -> None:
    host = _engine(tiny_qwen2, TorchBackend(min_rows=2, claim=claim)).forward(TOKENS, 0, 3)
    tb = TorchBackend(min_rows=2, claim=claim, force_copies=True)  # the CUDA path, on the CPU
    e = _engine(tiny_qwen2, tb)
    got = e.forward(TOKENS, 0, 3)
    np.testing.assert_array_equal(got, host)
    assert isinstance(tb.io, DeviceIO)
    prepared = _prepared(e, len(TOKENS), 3)
    graph = prepared.graph
    out_of_torch = exports(graph, "torch")
    to_cpu = {s for n in graph.nodes if n.backend == "cpu" and prepared.plan.live[n.id]
              for s in n.srcs if graph.nodes[s].backend == "torch"}
    assert to_cpu <= out_of_torch
    assert tb.io.device_to_host == len(out_of_torch)  # one write-back per exported value
    plan = DevicePlan.of(graph, "torch")  # device values freed after their last torch reader
    readers: dict[int, list[int]] = {}
    for n in graph.nodes:
        if n.backend == "torch":
            for s in n.srcs:
                readers.setdefault(s, []).append(n.id)
    released = {s: at for at, ids in plan.release.items() for s in ids}
    assert released == {s: max(r) for s, r in readers.items() if s not in graph.outputs}


def test_weight_modes_agree_and_scratch_stays_small(tiny_qwen3: Path) -> None:
    results, resident = {}, {}
    for mode in ("scratch", "bf16"):
        tb = TorchBackend(min_rows=2, weights=mode)
        results[mode] = _engine(tiny_qwen3, tb).forward(TOKENS, 0)
        assert tb._weights is not None
        resident[mode] = tb._weights.resident_bytes
    np.testing.assert_array_equal(results["scratch"], results["bf16"])
    assert resident["scratch"] < resident["bf16"]


def test_scratch_tiles_cover_big_matrices(tiny_qwen2: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import minfer.backends.torch_backend.weights as tw

    whole = _all_rows(_engine(tiny_qwen2, TorchBackend(min_rows=2)), TOKENS)
    monkeypatch.setattr(tw, "TILE_WEIGHTS", 64 * 50)  # 50-row tiles: the output table in several
    tb = TorchBackend(min_rows=2)
    tiled = _all_rows(_engine(tiny_qwen2, tb), TOKENS)
    np.testing.assert_array_equal(tiled, whole)
    assert tb._weights is not None and tb._weights.resident_bytes <= 64 * 50 * 6


def test_cpu_flags_decide_the_device(tmp_path: Path) -> None:
    def caps(flags: str) -> Capabilities:
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu {flags}\n")
        return detect(info)

    amx = caps("avx512f amx_bf16 amx_tile")
    assert amx.amx and amx.cpu_bf16
    assert not caps("avx512f amx_tile").amx  # tiles alone are not bf16 tiles
    assert caps("avx512_bf16").cpu_bf16 and not caps("avx512_bf16").amx
    plain = Capabilities(torch_ok=True, amx=False, avx512_bf16=False, cuda=False)
    assert choose_device(plain) is None
    assert choose_device(Capabilities(True, amx=True, avx512_bf16=True, cuda=False)) == "cpu"
    # AVX512-BF16 without AMX: torch only when asked for (the rule for `auto`)
    assert choose_device(Capabilities(True, amx=False, avx512_bf16=True, cuda=False)) is None
    assert choose_device(Capabilities(True, amx=False, avx512_bf16=True, cuda=False),
                         "cpu") == "cpu"
    assert choose_device(plain, "cpu") == "cpu"
    assert choose_device(plain, "cuda") is None
    assert choose_device(Capabilities(True, False, False, cuda=True)) == "cuda"
    assert choose_device(Capabilities(False, True, True, cuda=True)) is None


def test_make_torch_backend_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import minfer.backends.torch_backend as tb_pkg

    monkeypatch.setenv("MINFER_TORCH_DEVICE", "cpu")
    monkeypatch.setenv("MINFER_TORCH_WEIGHTS", "bf16")
    monkeypatch.setenv("MINFER_TORCH_MIN_ROWS", "7")
    made = make_torch_backend(required=True)
    assert made is not None and made.weights_mode == "bf16" and made.min_rows == 7
    monkeypatch.setenv("MINFER_TORCH_WEIGHTS", "fp8")
    with pytest.raises(MinferError, match="MINFER_TORCH_WEIGHTS"):
        make_torch_backend(required=False)
    monkeypatch.delenv("MINFER_TORCH_WEIGHTS")
    monkeypatch.setenv("MINFER_TORCH_DEVICE", "auto")
    monkeypatch.setattr(tb_pkg, "gpu_present", lambda: True)  # so auto asks torch (detect)
    monkeypatch.setattr(tb_pkg, "detect",
                        lambda: Capabilities(True, amx=False, avx512_bf16=False, cuda=False))
    assert make_torch_backend(required=False) is None  # auto stays CPU-only
    with pytest.raises(MinferError, match="no fast device"):
        make_torch_backend(required=True)
    monkeypatch.setattr(tb_pkg, "detect", lambda: Capabilities(False, True, True, cuda=False))
    assert make_torch_backend(required=False) is None
    with pytest.raises(MinferError, match="needs torch"):
        make_torch_backend(required=True)


def test_auto_on_an_amx_host_makes_torch_only_for_a_graph_it_would_take(
        tiny_qwen2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU, `auto` defers torch (its import costs ~1.5 s of every start) until a node
    of at least min_rows rows is offered: a short prompt and decode steps never make it."""
    import minfer.backends.torch_backend as tb_pkg

    monkeypatch.setattr(tb_pkg, "worth_probing", lambda: True)
    monkeypatch.setattr(tb_pkg, "gpu_present", lambda: False)
    monkeypatch.setenv("MINFER_TORCH_DEVICE", "auto")
    monkeypatch.setenv("MINFER_TORCH_MIN_ROWS", "8")
    made: list[str] = []

    def fake_made(device: str, claim: str, weights: str, min_rows: int) -> TorchBackend:
        made.append(device)
        return TorchBackend(device="cpu", claim=claim, weights=weights, min_rows=min_rows)

    monkeypatch.setattr(tb_pkg, "_made", fake_made)
    backend = make_torch_backend(required=False)
    assert isinstance(backend, tb_pkg.DeferredTorchBackend) and backend.min_rows == 8
    f = GGUFFile.open(tiny_qwen2)
    engine = Engine(f, HParams.from_gguf(f), n_ctx=64, backends=[backend, CpuBackend()])
    engine.forward([1, 2, 3, 4], 0)  # a short prefill and a decode step: torch is not made
    engine.forward([5], 4)
    assert made == [] and backend.kv_types == TorchBackend.kv_types
    for n_tokens, takes in ((4, False), (16, True)):
        graph = engine.cache.get(engine.params_for(n_tokens, 1)).graph
        assert any(backend.supports_op(node, graph) for node in graph.nodes) is takes
        assert made == (["cpu"] if takes else [])
    assert backend.made is not None


def test_auto_does_not_import_torch_where_it_could_not_pay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import minfer.backends.torch_backend as tb_pkg
    from minfer.backends.torch_backend.device import worth_probing

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    node = tmp_path / "nvidia0"
    assert not worth_probing(info, (str(node),))
    node.write_text("")
    assert worth_probing(info, (str(node),))
    info.write_text("processor\t: 0\nflags\t\t: fpu amx_bf16 amx_tile\n")
    assert worth_probing(info, ())

    def no_probe() -> Capabilities:
        raise AssertionError("detect() (which imports torch) was called")

    monkeypatch.setattr(tb_pkg, "detect", no_probe)
    monkeypatch.setattr(tb_pkg, "worth_probing", lambda: False)
    monkeypatch.setenv("MINFER_TORCH_DEVICE", "auto")
    assert make_torch_backend(required=False) is None
    monkeypatch.setenv("MINFER_TORCH_CLAIM", "everything")
    with pytest.raises(MinferError, match="MINFER_TORCH_CLAIM"):
        make_torch_backend(required=False)  # a typo is loud all the same


def test_select_backends_puts_torch_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from minfer.backends.select import select_backends

    monkeypatch.setenv("MINFER_TORCH_DEVICE", "cpu")
    assert [b.name for b in select_backends("torch")] == ["torch", "cpu"]
    assert [b.name for b in select_backends("cpu")] == ["cpu"]


def test_yarn_rope_on_torch_equals_cpu() -> None:
    """A YaRN model (llama.cpp-converted, tests/fixtures/llama) with torch taking the rope: its
    tables carry the ramp and the magnitude, so the forward equals the one with the rope on the
    CPU (the same bf16 matmuls on torch in both), and both stay near the f32 CPU forward."""
    path = Path(__file__).parent / "fixtures" / "llama" / "qwen2_yarn.gguf"
    ids = np.load(path.with_name("logits.npz"))["ids_long"][:96].tolist()
    ref = _all_rows(_engine(path, n_ctx=128), ids)
    runs = {}
    for claim in ("matmul", "dense"):
        e = _engine(path, TorchBackend(min_rows=2, claim=claim), n_ctx=128)
        runs[claim] = _all_rows(e, ids)
        on_torch = {type(n.op) for n in _prepared(e, len(ids), len(ids)).graph.nodes
                    if n.backend == "torch"}
        assert (ir.Rope in on_torch) == (claim == "dense")
    assert _rel(runs["dense"], runs["matmul"]) < 1e-4
    assert _rel(runs["dense"], ref) < 0.1  # bf16 weights on sharp random attention


def test_yarn_rope_tables_match_the_float64_reference() -> None:
    from minfer.backends.cpu.kernels.reference import ref_rope
    from minfer.backends.torch_backend import ops
    from minfer.gguf.rope_scaling import Yarn

    yarn = Yarn(factor=8.0, n_ctx_orig=32).layer(rope_dim=16, base=1e6, freq_scale=0.125)
    pos = np.array([0, 5, 90, 250])
    x = np.random.default_rng(0).standard_normal((4, 2 * 16)).astype(np.float32)
    cos, sin = ops.rope_tables(torch.from_numpy(pos), base=1e6, rope_dim=16, freq_scale=0.125,
                               yarn=yarn)
    out = torch.empty(4, 32)
    ops.rope_neox(torch.from_numpy(x), cos, sin, n_head=2, head_dim=16, rope_dim=16, out=out)
    want = ref_rope(x, pos, n_head=2, head_dim=16, rope_dim=16, base=1e6, freq_scale=0.125,
                    yarn=yarn)
    np.testing.assert_allclose(out.numpy(), want, rtol=0, atol=1e-6)
