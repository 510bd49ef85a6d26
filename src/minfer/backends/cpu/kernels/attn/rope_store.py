"""Rope of q and k and the KV store as one step (`graph.fusion.fuse_rope_store`, issue #66): row
by row, q rotated into its output, k rotated into a row of the step's own and written straight
into the persistent K region (the cache's format, `kv_formats._put_row`), v into the V region.
The same row functions as the unfused steps (`rope._rope_row`, `_put_row`), so the same bits,
where the tape had three steps (two ropes, the store) and the roped k a buffer of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.kernels.attn.kv_formats import _check_cells, _put_row, bind_store_kv
from minfer.backends.cpu.kernels.elementwise.rope import _rope_par, _rope_row, bind_rope
from minfer.backends.cpu.kernels.region.parts import share
from minfer.gguf.rope_scaling import NO_YARN, YarnRope


@njit(inline="always", error_model="numpy")
def _rows(lo, hi, q, k, v, positions, n_head, n_head_kv, head_dim, rope_dim, base, freq_scale,
          factors, yarn, neox, theta_dim, cols, resets, q_out, k_cache, v_cache, cells, rot_k,
          rot_v):
    cos = np.empty(rope_dim // 2, np.float32)
    sin = np.empty(rope_dim // 2, np.float32)
    th = np.empty(4, np.float32)
    k_rope = np.empty_like(k)  # rows [lo, hi) used
    for t in range(lo, hi):
        _rope_row(q, positions, t, n_head, head_dim, rope_dim, base, freq_scale, factors, yarn,
                  neox, q_out, cos, sin, theta_dim, cols, resets, th)
        _rope_row(k, positions, t, n_head_kv, head_dim, rope_dim, base, freq_scale, factors,
                  yarn, neox, k_rope, cos, sin, theta_dim, cols, resets, th)
        _put_row(k_rope[t], k_cache[cells[t]], rot_k)
        _put_row(v[t], v_cache[cells[t]], rot_v)


@njit(cache=True, error_model="numpy")
def _rope_store(q, k, v, positions, n_head, n_head_kv, head_dim, rope_dim, base, freq_scale,
                factors, yarn, neox, theta_dim, cols, resets, q_out, k_cache, v_cache, cells,
                rot_k, rot_v):  # pragma: no cover - compiled
    _check_cells(cells, k_cache.shape[0])
    _rows(0, q.shape[0], q, k, v, positions, n_head, n_head_kv, head_dim, rope_dim, base,
          freq_scale, factors, yarn, neox, theta_dim, cols, resets, q_out, k_cache, v_cache,
          cells, rot_k, rot_v)


_CHUNK = 4  # rows a parallel chunk takes (rope's PARALLEL_CHUNK)


@njit(cache=True, error_model="numpy", parallel=True)
def _rope_store_par(q, k, v, positions, n_head, n_head_kv, head_dim, rope_dim, base, freq_scale,
                    factors, yarn, neox, theta_dim, cols, resets, q_out, k_cache, v_cache, cells,
                    rot_k, rot_v):  # pragma: no cover - compiled
    _check_cells(cells, k_cache.shape[0])
    nt = q.shape[0]
    for c in prange((nt + _CHUNK - 1) // _CHUNK):
        _rows(c * _CHUNK, min(nt, c * _CHUNK + _CHUNK), q, k, v, positions, n_head, n_head_kv,
              head_dim, rope_dim, base, freq_scale, factors, yarn, neox, theta_dim, cols,
              resets, q_out, k_cache, v_cache, cells, rot_k, rot_v)


@njit(cache=True, error_model="numpy")
def _rope_store_par_part(part, n_parts, q, k, v, positions, n_head, n_head_kv, head_dim,
                         rope_dim, base, freq_scale, factors, yarn, neox, theta_dim, cols,
                         resets, q_out, k_cache, v_cache, cells, rot_k,
                         rot_v):  # pragma: no cover - compiled
    """Rows of part `part` of `n_parts` (a parallel region's thread)."""
    _check_cells(cells, k_cache.shape[0])
    lo, hi = share(part, n_parts, q.shape[0])
    _rows(lo, hi, q, k, v, positions, n_head, n_head_kv, head_dim, rope_dim, base, freq_scale,
          factors, yarn, neox, theta_dim, cols, resets, q_out, k_cache, v_cache, cells, rot_k,
          rot_v)


def bind_rope_store(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
                    q_out: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    cells: np.ndarray, *, n_head: int, n_head_kv: int, head_dim: int,
                    rope_dim: int, base: float, style: str = "neox", freq_scale: float = 1.0,
                    factors: np.ndarray | None = None, yarn: YarnRope = NO_YARN,
                    mrope: str = "", sections: tuple[int, ...] = ()) -> Callable[[], None]:
    """q_out = rope(q); K and V regions' cells = rope(k), v: `bind_rope` twice and
    `bind_store_kv` as one step over fixed arrays (their checks, their bits)."""
    common = dict(head_dim=head_dim, rope_dim=rope_dim, base=base, style=style,
                  freq_scale=freq_scale, factors=factors, yarn=yarn, mrope=mrope,
                  sections=sections)
    rq = bind_rope(q, positions, n_head=n_head, out=q_out, **common)  # type: ignore[arg-type]
    rk = bind_rope(k, positions, n_head=n_head_kv, out=k, **common)  # type: ignore[arg-type]
    store = bind_store_kv(k, v, k_cache, v_cache, cells, head_dim=head_dim)
    if not q.shape[0] == k.shape[0] or not isinstance(rq, partial) or not isinstance(
            rk, partial) or not isinstance(store, partial):
        raise ValueError(f"rope_store wants q {q.shape} and k {k.shape} of one row count")
    (_, pos, _, _, rdim, base32, scale32, ff, terms, neox, _, theta_dim, cols,
     resets) = rq.args
    _, _, kc, vc, cells_, rot_k, rot_v = store.args
    kernel = _rope_store_par if rq.func is _rope_par else _rope_store
    return partial(kernel, q, k, v, pos, n_head, n_head_kv, head_dim, rdim, base32, scale32,
                   ff, terms, neox, theta_dim, cols, resets, q_out, kc, vc, cells_, rot_k, rot_v)
