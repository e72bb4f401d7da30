"""Activation quantization for the fast (int8) path.

Layout, per token row of K floats, for a group size G (K a multiple of G):
  xq int8[K]       round(x / d) with d = max|x| / 127 over each group of G
  xd float32[K/G]  the per-group scale d
  xs float32[K/16] the sum over each block of 16 of the quantized x, d * sum(xq): the min and offset terms
G = 32 is llama.cpp's Q8_0 activation (legacy weight types); G = 256 its Q8_K (K-quant weights, whose row dots
sum the integer products of a whole 256-weight super-block before one float scale). A kernel knows its group
from the length of xd, so activations of the wrong group are refused by the length checks.

xs sums the quantized x, not x itself, so that a row dot with a min or offset term (Q2_K/Q4_K/Q5_K mins, Q3_K/Q6_K
offsets, Q4_1/Q5_1 mins) is the exact dot of the dequantized weights with the dequantized activations, as
llama.cpp's (block_q8_K.bsums, block_q8_1.s): w = s*u - m gives s*u.xq*d - m*sum(xq)*d = w.(xq*d), whose error
sum(w_i e_i) (e = the int8 rounding of x) is that of the weights w. The float sum of x in the min term instead
leaves sum(s*u_i e_i) = sum((w_i + m) e_i): the min (or s * offset, 32s for Q6_K) adds a large common part to
every weight and ~1.5-1.9x the error of one K-quant matrix (measured on Q4_K/Q5_K/Q6_K rows; equal on Q8_0, Q5_0).
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
        for j in range(b * g // 16, (b * g + g) // 16):  # sums of the quantized x: llama.cpp's bsums (Q8_K), s (Q8_1)
            s = 0
            for i in range(j * 16, j * 16 + 16):
                s += np.int32(xq[i])
            xs[j] = np.float32(s) * d


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
