"""The VRAM expert cache's adaptation step, compiled: which missing experts replace which residents, every layer in
one call (strata_nb/experts/vram_cache.py holds the policy and the copies).

In numpy (flatnonzero and two argsorts a layer) the step cost ~1.5 ms over 48 layers of 512 experts, on the host
between two decode tokens; the budget is a few swaps a layer, so selecting the best few by scans is enough.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def layer_swaps(slot_expert, table, loading, counts, budget, layer, out, n):
    """One layer's swaps, appended to out[n:] as (layer, slot, expert) rows; returns the new n.

    The most-routed experts without a slot (table < 0, not loading, count > 0; ties to the lower id) replace the
    least-routed residents (slot_expert >= 0; ties to the lower slot), pairing the i-th of each, while the
    newcomer's decayed count beats the resident's by more than one token (hysteresis), at most `budget` pairs.
    slot_expert i64[S] (-1 free, -2 loading), table i32[E], loading bool[E], counts f64[E]."""
    ne, ns = table.shape[0], slot_expert.shape[0]
    k = 0
    while k < budget:
        e = -1
        for c in range(ne):  # the best candidate not paired yet
            if table[c] < 0 and not loading[c] and counts[c] > 0 and (e < 0 or counts[c] > counts[e]):
                if not _paired_expert(out, n - k, n, c):
                    e = c
        s = -1
        for r in range(ns):  # the coldest resident not paired yet
            x = slot_expert[r]
            if x >= 0 and (s < 0 or counts[x] < counts[slot_expert[s]]):
                if not _paired_slot(out, n - k, n, r):
                    s = r
        if e < 0 or s < 0 or counts[e] <= counts[slot_expert[s]] + 1.0:
            break
        out[n, 0] = layer
        out[n, 1] = s
        out[n, 2] = e
        n += 1
        k += 1
    return n


@njit(nogil=True, inline="always")
def _paired_expert(out, n0, n, e):
    for i in range(n0, n):
        if out[i, 2] == e:
            return True
    return False


@njit(nogil=True, inline="always")
def _paired_slot(out, n0, n, s):
    for i in range(n0, n):
        if out[i, 1] == s:
            return True
    return False


@njit(cache=True, nogil=True)
def plan_swaps(slot_expert, nslots, table, loading, counts, decay, budget, out):
    """The adaptation step over every layer: counts *= decay, then layer_swaps for each layer l that has slots but
    not every expert (0 < nslots[l] < E). slot_expert i64[L, >= max slots] (row l's first nslots[l] entries),
    table i32[L, E], loading bool[L, E], counts f64[L, E], out i64[>= L * budget, 3]. Returns the rows written."""
    nl, ne = table.shape
    for l in range(nl):
        for e in range(ne):
            counts[l, e] *= decay
    n = 0
    for l in range(nl):
        if 0 < nslots[l] < ne:
            n = layer_swaps(slot_expert[l, :nslots[l]], table[l], loading[l], counts[l], budget, l, out, n)
    return n
