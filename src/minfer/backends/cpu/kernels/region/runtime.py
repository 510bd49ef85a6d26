"""The parallel region: every thread walks the same steps, splitting each step's work by its
thread index, with a barrier only before a step that depends on one since the last barrier.

`run_region(fns, args, barriers, ctrl, yield_fn, stamps)` is one numba parallel call (one
fork / join) for a whole run of op-tape steps, where each step used to be its own parallel
call: ~3.5 us of fork / join and argument unboxing each, 580 of them in a 0.5B decode step.
Step i is `fns[i](t, nt, args[i])` (`adapters`: a C-callable form of a kernel over fixed
arrays), called by every thread t of nt; `barriers[i]` says whether all threads must have
finished the steps before it first.

The barrier is a counter and a generation in `ctrl` (`CTRL_WORDS` int64, each on its own cache
line): a thread reads the generation, adds one to the counter; the last to arrive resets the
counter and advances the generation, the others wait for it to move. They spin with `pause`
for `SPINS` turns, then yield the core (`sched_yield` at `yield_fn`) between checks: with more
threads than free cores (a busy neighbour on these 2-core hosts) a waiting thread gives its
slice to the one it waits for. A wait past `TIMEOUT_CYCLES` sets `ctrl[ERROR]` and every thread
leaves; `run_region` returns it and the caller raises (a deadlock is a loud error, never a
hang). A step whose kernel raised (`adapters`: its block's first word set) is noted in
`ctrl[FAILED]` (its index + 1) for the caller to raise.

The region runs without the GIL: one call now spans what were hundreds of Python calls, between
which a server's other threads (its HTTP loop streaming tokens) took their turns; holding the
GIL for a whole 16-row step or prefill chunk stalled them (`serve_load.py --chat`, 16 streams:
TTFT p50 0.76 -> 0.93 s, 5% fewer tok/s, before this).

`stamps`, when it has a row per thread and two columns per step, takes each thread's
time-stamp counter as it starts step i (`stamps[t, 2i]`, after the barrier before it released
t) and as it ends it (`stamps[t, 2i + 1]`): per-step timelines from inside the region, the
barrier's wait being the gap between a step's end and the next one's start.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit, prange

from minfer.backends.cpu.kernels.region.sync import (
    address_at,
    atomic_add,
    atomic_load,
    atomic_store,
    call_int,
    call_step,
    cycles,
    spin_pause,
)
from minfer.backends.cpu.kernels.simd.llvm import thread_count

COUNT, GENERATION, ERROR, FAILED = 0, 8, 16, 24  # int64 words of ctrl, 64 bytes apart
CTRL_WORDS = 32
SPINS = 4000  # pause turns (~10-40 ns each) before a waiting thread yields between checks
TIMEOUT_CYCLES = 60 * 2_000_000_000  # ~30-60 s of time-stamp counter


@njit(inline="always")
def _barrier(ctrl: Any, nt: int, yield_fn: int) -> bool:
    """Wait until all nt threads arrive; False when the region is being abandoned."""
    gen = atomic_load(ctrl, GENERATION)
    if atomic_add(ctrl, COUNT, 1) == nt - 1:
        atomic_store(ctrl, COUNT, 0)
        atomic_add(ctrl, GENERATION, 1)
        return True
    spins = 0
    start = 0
    while atomic_load(ctrl, GENERATION) == gen:
        if spins < SPINS:
            spins += 1
            spin_pause()
            continue
        if atomic_load(ctrl, ERROR) != 0:
            return False
        if start == 0:
            start = cycles()
        elif cycles() - start > TIMEOUT_CYCLES:
            atomic_store(ctrl, ERROR, 1)
            return False
        call_int(yield_fn)
    return True


@njit(parallel=True, cache=True, nogil=True)
def run_region(fns: Any, args: Any, barriers: Any, ctrl: Any, yield_fn: int,
               stamps: Any) -> int:  # pragma: no cover - compiled
    """Run the steps in one parallel region (see the module docstring); 0, or 1 when a barrier
    timed out."""
    nt = thread_count()
    n = fns.shape[0]
    timed = stamps.shape[0] >= nt and stamps.shape[1] >= 2 * n
    ctrl[COUNT] = 0
    ctrl[ERROR] = 0
    ctrl[FAILED] = 0
    for t in prange(nt):
        for i in range(n):
            if barriers[i] and nt > 1 and not _barrier(ctrl, nt, yield_fn):
                break
            if timed:
                stamps[t, 2 * i] = cycles()
            call_step(fns[i], t, nt, args[i])
            if carray(address_at(args[i]), (1,), np.int64)[0] != 0:  # the step raised
                atomic_store(ctrl, FAILED, i + 1)
            if timed:
                stamps[t, 2 * i + 1] = cycles()
    return ctrl[ERROR]
