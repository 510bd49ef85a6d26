"""The i-quant lattices as ggml's quantizers search them: grid maps, neighbour lists, the search.

ggml-quants.c's iq2xs_init_impl / iq3xs_init_impl turn each lattice (iq2xxs_grid .. iq3s_grid,
here from `iq_grids`: every grid byte as the index l of its level) into what the quantizers
look codes up in: the grid as odd integers 2l+1 ([n_points, 8 or 4] int8), a map from a group's
packed levels (2 bits a value for the 8-value IQ2 groups, 3 for the 4-value IQ3 ones) to its
grid index, and for every packed code not on the grid the grid points nearest to it (squared
distance between the odd integers; all points at the `nwant` smallest distances, by distance
then index, as ggml's qsort orders them). `lattice` builds them (numpy, at import), as flat
arrays numba reads: kmap[u] >= 0 is u's grid index, else -(start + 1) with nb[start] the count
and nb[start + 1 ..] the neighbours. Only codes whose levels are all below `n_levels` (the ones
the quantizers can form) get neighbour lists.

`group_code` is the step every i-quant search repeats: one group's levels from a trial inverse
scale, and where they are off the grid the listed neighbour nearest in weighted distance
(iq2_find_best_neighbour / iq3_find_best_neighbour, f32 in C's order).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from minfer.backends.cpu.kernels.quant import iq_grids

from .blocks32 import FLT_MAX
from .kquants import nearest_int

F = np.float32
_IQ2_LEVELS = (8, 25, 43)
_IQ3_LEVELS = (4, 12, 20, 28, 36, 44, 52, 62)
_IQ3S_LEVELS = (1, 3, 5, 7, 9, 11, 13, 15)


def lattice(grid_values: np.ndarray, levels: tuple[int, ...], n_levels: int,
            nwant: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grid as 2l+1 int8 [n, k], kmap int32 [2^(bits k)], nb uint16) for a dequantization
    grid whose bytes are `levels`; neighbour lists for codes of levels < n_levels."""
    lv = np.asarray(levels)
    idx = np.searchsorted(lv, grid_values.astype(np.int64))
    assert (lv[idx] == grid_values).all()
    n, k = idx.shape
    bits = 2 if k == 8 else 3
    shifts = bits * np.arange(k)
    grid = (2 * idx + 1).astype(np.int8)
    kmap = np.full(1 << (bits * k), -1, np.int32)
    kmap[(idx << shifts).sum(1)] = np.arange(n, dtype=np.int32)
    codes = np.arange(1 << (bits * k))
    code_levels = (codes[:, None] >> shifts) & ((1 << bits) - 1)
    off = codes[(kmap < 0) & (code_levels < n_levels).all(1)]
    pos = 2 * code_levels[off] + 1
    g = grid.astype(np.int64)  # |g - p|^2 as |g|^2 + |p|^2 - 2 p.g: no [codes, n, k] array
    d2 = (g * g).sum(1)[None, :] + (pos * pos).sum(1)[:, None] - 2 * (pos @ g.T)
    order = np.argsort(d2, axis=1, kind="stable")  # by distance, then index (qsort's order)
    sd2 = np.take_along_axis(d2, order, 1)
    rank = np.cumsum(np.diff(sd2, axis=1, prepend=sd2[:, :1]) > 0, axis=1)
    keep = rank < nwant
    counts = keep.sum(1)
    starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]])
    nb = np.zeros(int((counts + 1).sum()), np.uint16)
    nb[starts] = counts
    rows, cols = np.nonzero(keep)
    nb[starts[rows] + 1 + cols] = order[rows, cols]
    kmap[off] = -(starts + 1)
    return grid, kmap, nb


IQ2XXS_GRID, IQ2XXS_MAP, IQ2XXS_NB = lattice(iq_grids.IQ2XXS_GRID, _IQ2_LEVELS, 3, 2)
IQ3XXS_GRID, IQ3XXS_MAP, IQ3XXS_NB = lattice(iq_grids.IQ3XXS_GRID, _IQ3_LEVELS, 8, 2)
IQ2XS_GRID, IQ2XS_MAP, IQ2XS_NB = lattice(iq_grids.IQ2XS_GRID, _IQ2_LEVELS, 3, 2)
IQ2S_GRID, IQ2S_MAP, IQ2S_NB = lattice(iq_grids.IQ2S_GRID, _IQ2_LEVELS, 3, 1)
IQ3S_GRID, IQ3S_MAP, IQ3S_NB = lattice(iq_grids.IQ3S_GRID, _IQ3S_LEVELS, 8, 3)
IQ1S_GRID, IQ1S_MAP, IQ1S_NB = lattice(iq_grids.IQ1S_GRID, (-1, 0, 1), 3, 3)


@njit(inline="always", error_model="numpy")
def best_neighbour(qgrid, grid, kmap, nb, u, xval, waux, o, scale, L):
    """iq2/iq3_find_best_neighbour (iq1_find_best_neighbour2 with `qgrid` its value table):
    of off-grid code u's neighbours, the one whose values qgrid[j] at `scale` are nearest
    xval[o:o+k] in waux-weighted squared distance; its levels into L[o:o+k]."""
    start = -kmap[u] - 1
    k = grid.shape[1]
    best_d2 = FLT_MAX
    gi = np.int64(-1)
    for j in range(1, np.int64(nb[start]) + 1):
        cand = np.int64(nb[start + j])
        d2 = F(0.0)
        for i in range(k):
            diff = scale * F(qgrid[cand, i]) - xval[o + i]
            d2 += waux[o + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            gi = cand
    for i in range(k):
        L[o + i] = (np.int64(grid[gi, i]) - 1) // 2
    return gi


@njit(inline="always", error_model="numpy")
def group_code(grid, kmap, nb, xval, waux, o, inv, scale, kmax, L):
    """Group xval[o:o+k]'s levels at inverse scale `inv` (clamped to 0..kmax-1) into L and
    its grid index: (index, True) when on the grid, else the nearest listed neighbour's at
    `scale` (its levels replace L's), (index, False)."""
    k = grid.shape[1]
    bits = 2 if k == 8 else 3
    u = 0
    for i in range(k):
        lv = nearest_int(F(0.5) * (inv * xval[o + i] - F(1.0)))
        lv = max(0, min(kmax - 1, lv))
        L[o + i] = lv
        u |= lv << (bits * i)
    gi = np.int64(kmap[u])
    if gi >= 0:
        return gi, True
    return best_neighbour(grid, grid, kmap, nb, u, xval, waux, o, scale, L), False


@njit(inline="always", error_model="numpy")
def grid_index(kmap, L, o, k):
    """The grid index of the levels L[o:o+k] (which lie on the grid)."""
    bits = 2 if k == 8 else 3
    u = 0
    for i in range(k):
        u |= L[o + i] << (bits * i)
    return np.int64(kmap[u])
