"""How a parallel region's thread finds its share of a step's work.

`share(part, n_parts, n)` -> (start, stop): thread `part` of `n_parts` takes items
[part * n // n_parts, (part + 1) * n // n_parts) of n: contiguous runs, sizes differing by at
most one, the same split its kernel's parallel loop would give (issue #66). Every kernel's
`_part` form loops `for i in range(*share(part, n_parts, n))`.
"""

from __future__ import annotations

from numba import njit


@njit(inline="always")
def share(part, n_parts, n):
    """(start, stop) of thread `part`'s items among `n_parts` threads, of n."""
    return part * n // n_parts, (part + 1) * n // n_parts
