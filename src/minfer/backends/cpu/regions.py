"""A bound op tape's runs of steps, each run as one parallel region (issue #66).

`compose(steps)` walks the CPU backend's bound steps in order and gathers each maximal run of
steps that have a region form (`kernels.region.adapters`: serial kernels, and parallel ones
with a `_part` form) into one `RegionRun`: one numba parallel call for the run, where each
parallel step was a fork / join of its own and each step a Python call. A run gets a region only
when it holds a parallel step and more than one step; other steps stay calls of their own, in
the same order. The results are the same bits: every step computes what its call computed, rows
split across threads as its parallel loop split them.

Barriers: a step waits for all threads only where it touches memory a step since the last
barrier wrote, or writes memory such a step read (buffers compared by address range), unless
both steps run on thread 0 alone (serial kernels, one after the other on one thread). q / k / v
and gate / up projections, which read one activation and write apart, share one barrier. A
serial step that would wait is held back past the independent steps after it (`schedule`), so
serial steps waiting on a run of projections (Qwen2's q / k / v biases) share one barrier.

MINFER_REGIONS=0 binds every step as a call of its own (the tape as it ran before regions, for
side-by-side measurements).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from functools import partial

import numba
import numpy as np

from minfer import env, jit_cache
from minfer.backends.cpu.kernels.region.adapters import Form, Interval, region_form
from minfer.backends.cpu.kernels.region.runtime import CTRL_WORDS, FAILED, run_region
from minfer.errors import MinferError

_YIELD = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value or 0


def enabled() -> bool:
    return env.get("MINFER_REGIONS", "1") != "0"


class RegionRun:
    """Steps run as one parallel region; callable like the steps it replaces."""

    def __init__(self, steps: Sequence[Callable[[], None]], forms: Sequence[Form]) -> None:
        self.steps = list(steps)  # the calls it stands for (and what keeps their arrays alive)
        self.forms = list(forms)
        self.barriers = np.array(barriers(forms), np.uint8)
        self._fns = np.array([f.fn for f in forms], np.int64)
        self._args = np.array([f.block.ctypes.data for f in forms], np.int64)
        self._ctrl = np.zeros(CTRL_WORDS, np.int64)
        self._run = self._bind(np.zeros((0, 0), np.int64))

    def _bind(self, stamps: np.ndarray) -> Callable[[], int]:
        return jit_cache.direct(partial(run_region, self._fns, self._args, self.barriers,
                                        self._ctrl, _YIELD, stamps))

    def __call__(self) -> None:
        if self._run():
            raise MinferError(f"a parallel region of {len(self.steps)} steps was abandoned: a "
                              "barrier waited over a minute for a thread that never came")
        self._check()

    def _check(self) -> None:
        """Raise what a step raised inside the region: the first failed step is called again
        on its own, which raises its exception (kernels raise only on their inputs)."""
        failed = int(self._ctrl[FAILED]) - 1
        if failed >= 0:
            for f in self.forms:
                f.block[0] = 0
            self.steps[failed]()
            raise MinferError(f"step {failed} of a parallel region failed inside it but not "
                              "when called again on its own")

    def timeline(self) -> np.ndarray:
        """Run once, with each thread's time-stamp counter at each step's start and end
        ([threads, 2 * steps]: `kernels.region.runtime`; numba's thread count of the caller)."""
        stamps = np.zeros((numba.get_num_threads(), 2 * len(self.steps)), np.int64)
        if self._bind(stamps)():
            raise MinferError("a parallel region was abandoned (see RegionRun.__call__)")
        self._check()
        return stamps


def barriers(forms: Sequence[Form]) -> list[bool]:
    """Whether each step waits for every thread first (see the module docstring)."""
    out: list[bool] = []
    reads: list[tuple[Interval, bool]] = []  # since the last barrier, with its step's `split`
    writes: list[tuple[Interval, bool]] = []
    for i, f in enumerate(forms):
        wait = i > 0 and (
            _clash(writes, f.reads, f.split) or _clash(writes, f.writes, f.split)
            or _clash(reads, f.writes, f.split))
        if wait:
            reads, writes = [], []
        out.append(wait)
        reads.extend((r, f.split) for r in f.reads)
        writes.extend((w, f.split) for w in f.writes)
    return out


def schedule(forms: Sequence[Form]) -> list[int]:
    """The steps' order in their region: the tape's, but a serial step that would wait at a
    barrier is held back while the steps after it do not touch what it touches (nor it what
    they touch), then placed with the held others before the first step that does. Qwen2's
    q / k / v biases (a serial add after each projection, each waiting for every thread's
    rows) then share one barrier after the three projections instead of one each. Only
    independent steps change places: every step computes what it computed."""
    order: list[int] = []
    held: list[int] = []
    reads: list[tuple[Interval, bool]] = []
    writes: list[tuple[Interval, bool]] = []

    def waits(f: Form) -> bool:
        return bool(order) and (_clash(writes, f.reads, f.split)
                                or _clash(writes, f.writes, f.split)
                                or _clash(reads, f.writes, f.split))

    def place(i: int) -> None:
        f = forms[i]
        if waits(f):
            reads.clear()
            writes.clear()
        order.append(i)
        reads.extend((r, f.split) for r in f.reads)
        writes.extend((w, f.split) for w in f.writes)

    for i, f in enumerate(forms):
        if any(_touches(forms[h], f) for h in held):
            for h in held:
                place(h)
            held.clear()
        if not f.split and waits(f):
            held.append(i)
        else:
            place(i)
    for h in held:
        place(h)
    return order


def _touches(a: Form, b: Form) -> bool:
    """Whether one of the two steps writes memory the other reads or writes."""
    def meet(xs: Sequence[Interval], ys: Sequence[Interval]) -> bool:
        return any(s < f and r < e for s, e in xs for r, f in ys)

    return meet(a.writes, b.reads) or meet(a.writes, b.writes) or meet(a.reads, b.writes)


def _clash(seen: list[tuple[Interval, bool]], spans: Sequence[Interval], split: bool) -> bool:
    return any((split or other) and a < e and s < b
               for (a, b), other in seen for s, e in spans)


def compose(steps: Sequence[Callable[[], None]]) -> list[Callable[[], None]]:
    """The steps with each run of region forms as one `RegionRun` (see the module docstring)."""
    if not enabled():
        return list(steps)
    out: list[Callable[[], None]] = []
    run: list[tuple[Callable[[], None], Form]] = []

    def flush() -> None:
        if len(run) > 1 and any(f.split for _, f in run):
            order = schedule([f for _, f in run])
            out.append(RegionRun([run[i][0] for i in order], [run[i][1] for i in order]))
        else:
            out.extend(s for s, _ in run)
        run.clear()

    for step in steps:
        bound = jit_cache.kernel_call(step)
        form = region_form(*bound) if bound is not None else None
        if form is None:
            flush()
            out.append(step)
        else:
            run.append((step, form))
    flush()
    return out
