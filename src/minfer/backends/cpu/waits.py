"""How numba's OpenMP workers wait between parallel kernels: spin briefly, then sleep.

The figures behind the choice are in `minfer.engine.threads`. Applied on import, which the
kernel package does before any parallel region runs: libgomp reads its environment once.
"""

from __future__ import annotations

import os

SPINCOUNT = "5000"


def configure_waits() -> None:
    """Spin-then-sleep waits for numba's OpenMP workers; call before the first parallel region
    (libgomp reads its environment once, when numba first loads it)."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPINCOUNT


configure_waits()
