"""How many threads a forward runs on, and how the idle ones wait.

Every parallel kernel ends in a barrier, and a decode step has ~170 of them. Two effects decide
whether more threads pay, and neither is known in advance on a user's machine:

- **Waiting.** libgomp (numba's `omp` layer) lets an idle worker spin for GOMP_SPINCOUNT turns
  (300,000 by default) before it sleeps. Next to another busy process a spinning worker keeps
  its full share of the core it shares, so the barrier waits for whole scheduler time slices:
  on a 2-core Intel Xeon (SPR) with one core busy, decode fell from 27.6 tok/s (1 thread) to
  4.9 (2 threads). A worker that sleeps soon is woken ahead of the busy process instead.
  Measured there, tg64 at 2 threads (idle / one core busy): spin 300,000 48.4 / 4.9;
  passive 45.1 / 26.8; 10,000 56.3 / 13.8; 1,000 51.6 / 24.5. Too short a spin costs as
  much on an idle machine: the Python between two parallel kernels outlasts it, so every kernel
  starts by waking a sleeping worker. On a quiet host of the same kind (36 GB/s read), tg64 at 2
  threads was 44.7 tok/s at 1,000, 60.9 at 2,000, 63.7 at 5,000, 64.4 at 10,000 (1.5B: 17.6 /
  21.3 at 1,000 / 5,000); with one core busy the default thread choice gave 30.7 at 1,000,
  31.8 at 5,000, 30.5 at 10,000, 27.9 at 30,000 (`-t 1`: 32.0). On an idle 2-core AMD EPYC
  (Zen 4) the same choice held: 56.5 at 1,000, 62.3 / 64.5 at 5,000, 63.8 / 63.4 at 20,000,
  61.0 at 100,000 (0.5B tg64). The CPU backend sets 5,000
  (`backends.cpu.waits`) unless the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT).
- **Cores actually free.** A step measured is the only honest test. `ThreadTuner` times the
  repeated steps of one shape (decode) at each candidate count (all threads, one fewer, one),
  keeps the fastest by median, and re-measures the others every `every` steps, so a load that
  comes or goes is followed within a second or two. Thread counts do not change results: every
  kernel's row arithmetic is independent of how rows are split.
"""

from __future__ import annotations

import statistics
from collections import deque


class ThreadTuner:
    """Picks a thread count per step shape from measured step times."""

    def __init__(self, n_max: int, *, samples: int = 3, every: int = 64) -> None:
        self.candidates = sorted({n_max, max(1, n_max - 1), 1}, reverse=True)
        self.samples = samples
        self.every = every
        self._times: dict[object, dict[int, deque[float]]] = {}
        self._steps: dict[object, int] = {}

    def choose(self, key: object) -> int:
        """The thread count for the next step of shape `key`."""
        times = self._times.setdefault(
            key, {n: deque(maxlen=self.samples) for n in self.candidates})
        for n in self.candidates:  # measure every candidate first (the most threads first)
            if len(times[n]) < self.samples:
                return n
        best = self.best(key)
        steps = self._steps[key] = self._steps.get(key, 0) + 1
        if steps % self.every == 0:  # forget the others: they are measured again
            for n in self.candidates:
                if n != best:
                    times[n].clear()
        return best

    def record(self, key: object, n_threads: int, seconds: float) -> None:
        self._times[key][n_threads].append(seconds)

    def best(self, key: object) -> int:
        times = self._times[key]
        measured = [n for n in self.candidates if times[n]]
        return min(measured, key=lambda n: statistics.median(times[n]))
