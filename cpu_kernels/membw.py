"""The machine's read-bandwidth ceiling, measured the way the weight kernels read: vectorized, all threads."""
from __future__ import annotations

import time

import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True)
def sum_u64(a, nchunk):
    """Sum of a uint64 array in nchunk prange chunks; each chunk a 1-D view, so the inner loop vectorizes (an
    integer sum needs no fastmath to). A multiple of the thread count as nchunk gives every thread equal work."""
    step = (a.shape[0] + nchunk - 1) // nchunk
    part = np.zeros(nchunk, np.uint64)
    for c in prange(nchunk):
        chunk = a[c * step:min(a.shape[0], (c + 1) * step)]
        s = np.uint64(0)
        for i in range(chunk.shape[0]):
            s += chunk[i]
        part[c] = s
    return part.sum()


def read_sweep(a: np.ndarray, nchunk: int = 64) -> float:
    """GB/s of one parallel read of the uint64 array a."""
    t0 = time.perf_counter()
    sum_u64(a, nchunk)
    return a.nbytes / (time.perf_counter() - t0) / 1e9
