"""Block-wide reductions in shared memory, shared by the kernels (device functions: numba specializes them per
buffer type, so one serves float32 and int64 buffers). blockDim must be a power of two no larger than the buffer;
every thread gets the result, and the buffer is free again when they return."""
from __future__ import annotations

from numba import cuda


@cuda.jit(device=True)
def block_sum(buf, v):
    tid = cuda.threadIdx.x
    buf[tid] = v
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            buf[tid] += buf[tid + s]
        cuda.syncthreads()
        s //= 2
    r = buf[0]
    cuda.syncthreads()  # buf is free again once every thread has read the result
    return r


@cuda.jit(device=True)
def block_max(buf, v):
    tid = cuda.threadIdx.x
    buf[tid] = v
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s and buf[tid + s] > buf[tid]:
            buf[tid] = buf[tid + s]
        cuda.syncthreads()
        s //= 2
    r = buf[0]
    cuda.syncthreads()
    return r


@cuda.jit(device=True)
def block_min(buf, v):
    tid = cuda.threadIdx.x
    buf[tid] = v
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s and buf[tid + s] < buf[tid]:
            buf[tid] = buf[tid + s]
        cuda.syncthreads()
        s //= 2
    r = buf[0]
    cuda.syncthreads()
    return r
