"""Activation quantization for the fast (int8) path.

Layout, per token row of K floats, for a group size G (K a multiple of G):
  xq int8[K]       round(x / d) with d = max|x| / 127 over each group of G
  xd float32[K/G]  the per-group scale d
  xs float32[K/16] the exact float sum of x over each block of 16 (min and offset terms)
G = 32 is llama.cpp's Q8_0 activation (legacy weight types); G = 256 its Q8_K (K-quant weights, whose row dots
sum the integer products of a whole 256-weight super-block before one float scale). A kernel knows its group
from the length of xd, so activations of the wrong group are refused by the length checks.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from strata_nb.cpu_kernels.qtypes import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K

_K_QUANTS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)


def group(qtype: int) -> int:
    """The activation group size the int8 row dots of a weight type read."""
    return 256 if qtype in _K_QUANTS else 32


@njit(cache=True, nogil=True, fastmath=False)
def quantize_row(x, xq, xd, xs):
    """One row; the group size is len(x) / len(xd)."""
    k = x.shape[0]
    g = k // xd.shape[0]
    for b in range(xd.shape[0]):
        amax = np.float32(0.0)
        for i in range(b * g, b * g + g):
            v = abs(x[i])
            if v > amax:
                amax = v
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        xd[b] = d
        for i in range(b * g, b * g + g):
            xq[i] = np.int8(np.rint(x[i] * inv))
    for b in range(k // 16):
        s = np.float32(0.0)
        for i in range(b * 16, b * 16 + 16):
            s += x[i]
        xs[b] = s


@njit(cache=True, parallel=True)
def quantize_rows(x, xq, xd, xs):
    """x float32[T, K] -> xq int8[T, K], xd float32[T, K/G], xs float32[T, K/16]."""
    if x.shape[0] <= 2:  # decode: waking the thread pool costs more than a row (~10-100 us vs ~1 us)
        for t in range(x.shape[0]):
            quantize_row(x[t], xq[t], xd[t], xs[t])
        return
    for t in prange(x.shape[0]):
        quantize_row(x[t], xq[t], xd[t], xs[t])


def empty(t: int, k: int, g: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Uninitialized buffers for the int8 form of T rows of K floats in groups of g."""
    if k % g:
        raise ValueError(f"activation length {k} is not a multiple of the group {g}")
    return np.empty((t, k), np.int8), np.empty((t, k // g), np.float32), np.empty((t, k // 16), np.float32)


def quantize(x: np.ndarray, g: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Allocate and fill the int8 activation triple for float32 x[T, K] in groups of g (32 or 256)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    q = empty(*x.shape, g)
    quantize_rows(x, *q)
    return q
