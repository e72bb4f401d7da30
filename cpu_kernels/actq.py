"""Activation quantization for the fast (int8) path.

Layout, per token row of K floats (K a multiple of 32):
  xq int8[K]      round(x / d) with d = max|x| / 127 over each block of 32
  xd float32[K/32] the per-32 scale d
  xs float32[K/16] the exact float sum of x over each block of 16 (min terms of Q4_1/Q5_1/Q2_K/Q4_K/Q5_K)
The same scheme as llama.cpp's Q8_0 activations; float sums keep the min terms exact.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, nogil=True, fastmath=False)
def quantize_row(x, xq, xd, xs):
    k = x.shape[0]
    for b in range(k // 32):
        amax = np.float32(0.0)
        for i in range(32):
            v = abs(x[b * 32 + i])
            if v > amax:
                amax = v
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        xd[b] = d
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        for i in range(16):
            v0 = x[b * 32 + i]
            v1 = x[b * 32 + 16 + i]
            s0 += v0
            s1 += v1
            xq[b * 32 + i] = np.int8(np.rint(v0 * inv))
            xq[b * 32 + 16 + i] = np.int8(np.rint(v1 * inv))
        xs[2 * b] = s0
        xs[2 * b + 1] = s1


@njit(cache=True, parallel=True)
def quantize_rows(x, xq, xd, xs):
    """x float32[T, K] -> xq int8[T, K], xd float32[T, K/32], xs float32[T, K/16]."""
    if x.shape[0] <= 2:  # decode: waking the thread pool costs more than a row (~10-100 us vs ~1 us)
        for t in range(x.shape[0]):
            quantize_row(x[t], xq[t], xd[t], xs[t])
        return
    for t in prange(x.shape[0]):
        quantize_row(x[t], xq[t], xd[t], xs[t])


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Allocate and fill the int8 activation triple for float32 x[T, K]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    t, k = x.shape
    if k % 32:
        raise ValueError(f"activation length {k} is not a multiple of 32")
    xq = np.empty((t, k), np.int8)
    xd = np.empty((t, k // 32), np.float32)
    xs = np.empty((t, k // 16), np.float32)
    quantize_rows(x, xq, xd, xs)
    return xq, xd, xs
