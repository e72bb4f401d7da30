"""The machine's read-bandwidth ceiling, measured the way the weight kernels read: vectorized, all threads."""
from __future__ import annotations

import time

import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True)
def _sum_u64(a):
    """Sum of a uint64 array in 64 prange chunks; each chunk a 1-D view, so the inner loop vectorizes."""
    nchunk = 64
    step = (a.shape[0] + nchunk - 1) // nchunk
    part = np.zeros(nchunk, np.uint64)
    for c in prange(nchunk):
        chunk = a[c * step:min(a.shape[0], (c + 1) * step)]
        s = np.uint64(0)
        for i in range(chunk.shape[0]):
            s += chunk[i]
        part[c] = s
    return part.sum()


def read_sweep(a: np.ndarray) -> float:
    """GB/s of one parallel read of the uint64 array a."""
    t0 = time.perf_counter()
    _sum_u64(a)
    return a.nbytes / (time.perf_counter() - t0) / 1e9


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Median GB/s of parallel sums over nbytes of anonymous memory (touched first, so no page faults)."""
    a = np.ones(nbytes // 8, np.uint64)
    _sum_u64(a[:1024])
    return float(np.median([read_sweep(a) for _ in range(reps)]))
