"""llama-bench's measurements on minfer's engine: pp<P> and tg<T> rows.

`pp<P>` prefills P random tokens into an empty context and generates nothing; `tg<T>` prefills one
token untimed, then times T single-token decode steps. With a depth D (llama-bench's `-d`), each
repetition first prefills D random tokens untimed, so the timed test runs against D tokens already
in the KV (`pp512 @ d4096`). Each test runs one untimed warm-up, then `reps` timed repetitions,
each from an empty KV (the regions are reused; windows are data, so "empty" needs no zeroing) and
without reloading the model. tg rows also report the decode roofline figure: weight bytes read per
token × tokens/s, counted two ways: the file's bytes (`weight_bytes_per_token`, issue #65's
measure: `gb_per_s`) and the bytes the CPU backend's kernels read (`held_bytes_per_token`: a
widened or repacked copy at its own size, `held_gb_per_s`); they differ where minfer widens a
type (`reencode.widen`: Q3_K, the i-quants below 4 bits; IQ2_XXS / IQ3_XXS only under
MINFER_IQ_WIDEN, their file's blocks by default).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from minfer.engine.forward import Engine
from minfer.engine.generate import prefill


@dataclass
class BenchRow:
    model: str
    size_bytes: int
    n_params: int
    backend: str
    n_threads: int
    test: str
    n_prompt: int
    n_gen: int
    tokens_per_s: float
    stddev: float
    samples_s: list[float]
    gb_per_s: float | None = None  # the file's weight bytes a decode step reads x t/s
    held_gb_per_s: float | None = None  # the bytes its kernels read (held copies) x t/s
    n_depth: int = 0
    roofline_fraction: float | None = None  # gb_per_s / the machine's read bandwidth
    roofline_gb_per_s: float | None = None  # that bandwidth, read between this row's reps
    # the model's own weight arrays read as a decode step reads them (`weights_read_bandwidth`:
    # the held copies), between this row's reps, and held_gb_per_s as a fraction of it
    weights_read_gb_per_s: float | None = None
    weights_read_fraction: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def weight_bytes_by_type(engine: Engine) -> dict[str, int]:
    """Bytes of weights one decode step reads, by GGUF type name: every matrix once, one
    embedding row; of a mixture of experts' stacked expert tensors only the `n_expert_used`
    experts a token reads (its active bytes). A tied embedding table is read whole as the
    output projection (and its row is gathered besides)."""
    tensors = engine.weights.file.tensors
    out: dict[str, int] = {}
    for name, t in tensors.items():
        n = engine.hparams.active_share(name, t.nbytes)
        if name == "token_embd.weight":
            n = (n if engine.hparams.tie_embeddings else 0) + t.nbytes // t.shape[1]
        out[t.type_name] = out.get(t.type_name, 0) + n
    return out


def weight_bytes_per_token(engine: Engine) -> int:
    """The file's bytes of weights one decode step reads (`weight_bytes_by_type`, summed)."""
    return sum(weight_bytes_by_type(engine).values())


def held_bytes_per_token(engine: Engine) -> int:
    """`weight_bytes_per_token` as the CPU backend holds the weights: each matrix its integer
    kernels read from a copy of their own (`cpu.backend.bound_matrix_nbytes`: repacked
    layouts, and `reencode.widen`'s wider types for Q3_K and IQ3/IQ2/IQ1, IQ2_XXS / IQ3_XXS
    only under MINFER_IQ_WIDEN) counted at the copy's size. Only the matrices bound so far
    count: call it after a decode step."""
    from minfer.backends.cpu.backend import bound_matrix_nbytes

    tensors = engine.weights.file.tensors
    total = weight_bytes_per_token(engine)
    for name, n in bound_matrix_nbytes(engine.weights.state).items():
        if name == "token_embd.weight" and not engine.hparams.tie_embeddings:
            continue  # gathered row by row: one row counted above whatever its layout
        total += engine.hparams.active_share(name, n - tensors[name].nbytes)
    return total


def _random_tokens(n: int, n_vocab: int, rng: np.random.Generator) -> list[int]:
    return rng.integers(0, n_vocab, size=n).tolist()


def fill_depth(engine: Engine, n_depth: int, batch_size: int, rng: np.random.Generator) -> None:
    """Put `n_depth` random tokens in the KV (untimed), as llama-bench's `-d`."""
    if n_depth:
        prefill(engine, _random_tokens(n_depth, engine.hparams.n_vocab, rng), 0, batch_size)


def time_pp(engine: Engine, n_prompt: int, batch_size: int, rng: np.random.Generator,
            n_depth: int = 0) -> float:
    fill_depth(engine, n_depth, batch_size, rng)
    tokens = _random_tokens(n_prompt, engine.hparams.n_vocab, rng)
    t0 = time.perf_counter()
    prefill(engine, tokens, n_depth, batch_size)
    return time.perf_counter() - t0


def time_tg(engine: Engine, n_gen: int, rng: np.random.Generator, n_depth: int = 0,
            batch_size: int = 512) -> float:
    fill_depth(engine, n_depth, batch_size, rng)
    tokens = _random_tokens(n_gen + 1, engine.hparams.n_vocab, rng)
    engine.forward(tokens[:1], n_depth)  # one more token of context, untimed
    t0 = time.perf_counter()
    for i in range(1, n_gen + 1):
        engine.forward([tokens[i]], n_depth + i)
    return time.perf_counter() - t0


def row_label(n_prompt: int, n_gen: int, n_depth: int) -> str:
    """llama-bench's label: `pp512`, `tg128`, `pp512 @ d4096`."""
    name = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
    return f"{name} @ d{n_depth}" if n_depth else name


def run_test(
    engine: Engine,
    *,
    model: str,
    backend: str,
    n_threads: int,
    n_prompt: int = 0,
    n_gen: int = 0,
    n_depth: int = 0,
    reps: int = 3,
    batch_size: int = 512,
    seed: int = 1234,
    before_rep: Callable[[], None] | None = None,
) -> BenchRow:
    rng = np.random.default_rng(seed)
    if n_prompt and n_gen:
        raise ValueError("a test is either pp or tg")

    def once() -> float:
        if n_prompt:
            return time_pp(engine, n_prompt, batch_size, rng, n_depth)
        return time_tg(engine, n_gen, rng, n_depth, batch_size)

    once()  # warm-up: compiles kernels and builds the graphs
    samples = []
    for _ in range(reps):
        if before_rep is not None:  # untimed: `minfer bench --roofline` reads memory here
            before_rep()
        samples.append(once())
    n = n_prompt or n_gen
    rates = [n / s for s in samples]
    mean = statistics.fmean(rates)
    row = BenchRow(
        model=model,
        size_bytes=engine.weights.file.file_size,
        n_params=sum(int(np.prod(t.shape)) for t in engine.weights.file.tensors.values()),
        backend=backend,
        n_threads=n_threads,
        test=row_label(n_prompt, n_gen, n_depth),
        n_prompt=n_prompt,
        n_gen=n_gen,
        tokens_per_s=mean,
        stddev=statistics.stdev(rates) if len(rates) > 1 else 0.0,
        samples_s=samples,
        n_depth=n_depth,
    )
    if n_gen:
        row.gb_per_s = weight_bytes_per_token(engine) * mean / 1e9
        row.held_gb_per_s = held_bytes_per_token(engine) * mean / 1e9
    return row
