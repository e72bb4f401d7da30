"""Kernels that hand data between the GPU and the host through mapped (zero-copy) pinned memory.

The GPU never waits for the host inside a kernel: it publishes (copies its arrays into mapped memory, then bumps a
sequence number there) and the host, spinning on that number, drives what comes next. Also the small device-side
counters a captured graph advances by itself (the position).
"""
from __future__ import annotations

from numba import config, cuda

_SIM = config.ENABLE_CUDASIM
_BLOCK = 32 if _SIM else 256
_MAX_GRID = 2 if _SIM else 1024


@cuda.jit(cache=not _SIM)
def _copy_f32(src, dst, n):
    """dst.flat[:n] = src.flat[:n] for 2-D float32 arrays of the same width; each thread fences its own stores
    system-wide so the sequence number bumped by the next kernel is seen only after them."""
    w = src.shape[1]
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < n:
        r = i // w
        c = i - r * w
        dst[r, c] = src[r, c]
        i += stride
    cuda.threadfence_system()


@cuda.jit(cache=not _SIM)
def _publish_route(ids, wts, slot_of, mb_ids, mb_wts, mb_slot, n):
    """The routing of n choices (row-major [T, k]) and, per choice, its VRAM slot (-1: the CPU computes it)."""
    k = ids.shape[1]
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < n:
        t = i // k
        j = i - t * k
        e = ids[t, j]
        mb_ids[t, j] = e
        mb_wts[t, j] = wts[t, j]
        mb_slot[t, j] = slot_of[e]
        i += stride
    cuda.threadfence_system()


@cuda.jit(cache=not _SIM)
def _ring(counter, mb_seq):
    """counter += 1 and tell the host (after everything earlier in the stream: kernels run in order)."""
    if cuda.grid(1) == 0:
        counter[0] += 1
        cuda.threadfence_system()
        mb_seq[0] = counter[0]
        cuda.threadfence_system()


@cuda.jit(cache=not _SIM)
def _advance(pos, n):
    if cuda.grid(1) == 0:
        pos[0] += n


def _grid(n: int) -> int:
    return max(1, min(_MAX_GRID, (n + _BLOCK - 1) // _BLOCK))


def publish_rows(src, dst, ntok: int, stream) -> None:
    """dst[:ntok] = src[:ntok] (float32 [T, D], dst mapped host memory)."""
    n = ntok * src.shape[1]
    _copy_f32[_grid(n), _BLOCK, stream](src, dst, n)


def publish_route(ids, wts, slot_of, mb_ids, mb_wts, mb_slot, ntok: int, stream) -> None:
    """Routing ids int32[T, k], weights f32[T, k] and each choice's slot (slot_of int32[E]) into mapped memory."""
    n = ntok * ids.shape[1]
    _publish_route[_grid(n), _BLOCK, stream](ids, wts, slot_of, mb_ids, mb_wts, mb_slot, n)


def ring(counter, mb_seq, stream) -> None:
    """Bump the device counter int64[1] and write it to the mapped mb_seq int64[1]."""
    _ring[1, 1, stream](counter, mb_seq)


def advance(pos, n: int, stream) -> None:
    """pos[0] += n on the device (a captured graph moves its own position)."""
    _advance[1, 1, stream](pos, n)
