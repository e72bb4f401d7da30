"""Kernels that hand data between the GPU and the host through mapped (zero-copy) pinned memory.

The GPU never waits for the host inside a kernel: it publishes (copies its arrays into mapped memory, then bumps a
sequence number there: cuda_kernels.ops.route_topk publishes a MoE layer's routing that way) and the host, spinning
on that number, drives what comes next. Here: the ring at the end of a forward (with the sampled token, into a
small ring of mapped slots indexed by the sequence number, so a forward launched ahead cannot overwrite a token the
host has not read yet), and the device-side position a captured graph advances by itself.
"""
from __future__ import annotations

from numba import config, cuda

_SIM = config.ENABLE_CUDASIM


@cuda.jit(cache=not _SIM)
def _ring(counter, mb_seq):
    """counter += 1 and tell the host (after everything earlier in the stream: kernels run in order)."""
    if cuda.grid(1) == 0:
        counter[0] += 1
        cuda.threadfence_system()
        mb_seq[0] = counter[0]
        cuda.threadfence_system()


@cuda.jit(cache=not _SIM)
def _ring_token(counter, mb_seq, token, tokens):
    """_ring, and tokens[new counter % len(tokens)] = token[0] before the host is told."""
    if cuda.grid(1) == 0:
        c = counter[0] + 1
        counter[0] = c
        tokens[c % tokens.shape[0]] = token[0]
        cuda.threadfence_system()
        mb_seq[0] = c
        cuda.threadfence_system()


@cuda.jit(cache=not _SIM)
def _advance(pos, n):
    if cuda.grid(1) == 0:
        pos[0] += n


def ring(counter, mb_seq, stream, token=None, tokens=None) -> None:
    """Bump the device counter int64[1] and write it to the mapped mb_seq int64[1]; with token (int32[1]) and
    tokens (mapped int32[R]), first copy token[0] to tokens[counter % R]."""
    if token is None:
        _ring[1, 1, stream](counter, mb_seq)
    else:
        _ring_token[1, 1, stream](counter, mb_seq, token, tokens)


def advance(pos, n: int, stream) -> None:
    """pos[0] += n on the device (a captured graph moves its own position)."""
    _advance[1, 1, stream](pos, n)
