"""Elementwise and attention kernels on float32 arrays: norms, rope, attention, activations, routing."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from strata_nb.cpu_kernels.actq import quantize_row, quantize_rows


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _rmsnorm_row(x, w, eps, out):
    d = x.shape[0]
    ss = np.float32(0.0)
    for i in range(d):
        ss += x[i] * x[i]
    inv = np.float32(1.0) / np.float32(math.sqrt(ss / d + eps))
    for i in range(d):
        out[i] = x[i] * inv * w[i]


@njit(cache=True, parallel=True, fastmath=True)
def rmsnorm(x, w, eps, out):
    """out[t] = x[t] / rms(x[t]) * w over the last axis; x f32[N, D] (rows may be heads)."""
    for t in prange(x.shape[0]):
        _rmsnorm_row(x[t], w, eps, out[t])


@njit(cache=True, parallel=True, fastmath=True)
def rmsnorm_quant(x, w, eps, out, xq, xd, xs):
    """rmsnorm into out, and out quantized to int8 (actq layout) in the same pass: one kernel call, not two."""
    for t in prange(x.shape[0]):
        _rmsnorm_row(x[t], w, eps, out[t])
        quantize_row(out[t], xq[t], xd[t], xs[t])


@njit(cache=True)
def rope_tables(positions, n_rot, base, freq_scale, ext_factor, attn_factor, corr_lo, corr_hi, freq_factors):
    """cos/sin f32[T, n_rot/2] as ggml's rope_yarn computes them (plain rope when ext_factor == 0)."""
    half = n_rot // 2
    cos = np.empty((positions.shape[0], half), np.float32)
    sin = np.empty((positions.shape[0], half), np.float32)
    theta_scale = base ** (-2.0 / n_rot)
    for t in range(positions.shape[0]):
        for i in range(half):
            theta_extrap = positions[t] * theta_scale ** i / freq_factors[i]
            theta = freq_scale * theta_extrap
            mscale = attn_factor
            if ext_factor != 0.0:
                y = (i - corr_lo) / max(0.001, corr_hi - corr_lo)
                ramp = (1.0 - min(1.0, max(0.0, y))) * ext_factor
                theta = theta * (1.0 - ramp) + theta_extrap * ramp
                mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
            cos[t, i] = math.cos(theta) * mscale
            sin[t, i] = math.sin(theta) * mscale
    return cos, sin


@njit(cache=True, nogil=True)
def _rope_head(x, cos, sin, neox):
    """Rotate one head x f32[head_dim] in place by cos/sin f32[n_rot/2] (not inlined: one compiled rotation, so
    every caller rounds alike whatever its fastmath flags)."""
    half = cos.shape[0]
    for i in range(half):
        if neox:
            a = i
            b = i + half
        else:
            a = 2 * i
            b = 2 * i + 1
        x0 = x[a]
        x1 = x[b]
        x[a] = x0 * cos[i] - x1 * sin[i]
        x[b] = x0 * sin[i] + x1 * cos[i]


@njit(cache=True, parallel=True)
def rope_apply(x, cos, sin, neox):
    """Rotate x f32[T, H, head_dim] in place over its first n_rot = 2*cos.shape[1] dims of each head."""
    ntok, nh, _ = x.shape
    for t in prange(ntok):
        for h in range(nh):
            _rope_head(x[t, h], cos[t], sin[t], neox)


@njit(cache=True)
def kv_write(kc, vc, k, v, pos0):
    """Append k, v f32[T, Hkv, hd] at positions pos0.. of caches f32[Hkv, ctx, hd] (element loops: a slice
    assignment compiles numba's whole broadcasting machinery, seconds of a cold start)."""
    for t in range(k.shape[0]):
        for h in range(k.shape[1]):
            for i in range(k.shape[2]):
                kc[h, pos0 + t, i] = k[t, h, i]
                vc[h, pos0 + t, i] = v[t, h, i]


@njit(nogil=True, fastmath=True, inline="always")
def _attend(q, kc, vc, kvh, n, scale, out):
    """out f32[hd] = softmax(scale * K q) V over cache positions 0..n-1 of KV head kvh; q f32[hd]."""
    hd = q.shape[0]
    s = np.empty(n, np.float32)
    m = np.float32(-np.inf)
    for j in range(n):
        acc = np.float32(0.0)
        for i in range(hd):
            acc += q[i] * kc[kvh, j, i]
        acc *= scale
        s[j] = acc
        if acc > m:
            m = acc
    tot = np.float32(0.0)
    for j in range(n):
        e = np.float32(math.exp(s[j] - m))
        s[j] = e
        tot += e
    inv = np.float32(1.0) / tot
    for i in range(hd):
        out[i] = 0.0
    for j in range(n):
        p = s[j] * inv
        for i in range(hd):
            out[i] += p * vc[kvh, j, i]


@njit(cache=True, parallel=True, fastmath=True)
def attention(q, kc, vc, pos0, scale, out):
    """Causal GQA attention: token t (position pos0+t) of q f32[T, H, hd] sees cache positions 0..pos0+t.

    out f32[T, H, hd]. Query heads map to KV heads in contiguous groups of H / Hkv (llama.cpp and HF order).
    """
    ntok, nh, hd = q.shape
    group = nh // kc.shape[0]
    for task in prange(ntok * nh):
        t = task // nh
        h = task - t * nh
        _attend(q[t, h], kc, vc, h // group, pos0 + t + 1, scale, out[t, h])


@njit(cache=True, nogil=True, fastmath=True)
def silu_mul_row(g, u, out):
    """out = silu(g) * u over one row: a function of its own (not inlined) so every caller gets the same code."""
    for i in range(g.shape[0]):
        x = g[i]
        out[i] = x / (np.float32(1.0) + np.float32(math.exp(-x))) * u[i]


@njit(cache=True, parallel=True)
def silu_mul(g, u, out):
    """out = silu(g) * u elementwise over f32[N, F] (SwiGLU)."""
    for t in prange(g.shape[0]):
        silu_mul_row(g[t], u[t], out[t])


@njit(nogil=True, inline="always")
def swiglu_quant_row(g, u, h, hq, hd, hs, quant):
    """One row of swiglu_quant (quant: also quantize h; a constant where this is inlined)."""
    silu_mul_row(g, u, h)
    if quant:
        quantize_row(h, hq, hd, hs)


@njit(cache=True)
def route_softmax_topk(logits, k, renorm, scale, ids, weights):
    """Softmax over experts, keep the top k (ties to the lower id), optionally renormalize, then scale.

    logits f32[T, E] -> ids i64[T, k], weights f32[T, k] (in descending weight order). The top k by k scans for
    the largest remaining probability (first index on ties): k is small, and a sort compiled for seconds.
    """
    ntok, ne = logits.shape
    p = np.empty(ne, np.float32)
    taken = np.zeros(ne, np.bool_)
    for t in range(ntok):
        m = logits[t, 0]
        for e in range(1, ne):
            if logits[t, e] > m:
                m = logits[t, e]
        tot = np.float32(0.0)
        for e in range(ne):
            p[e] = np.float32(math.exp(logits[t, e] - m))
            tot += p[e]
        for e in range(ne):
            p[e] /= tot
            taken[e] = False
        wsum = np.float32(0.0)
        for j in range(k):
            best = -1
            for e in range(ne):
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
            weights[t, j] = p[best]
            wsum += weights[t, j]
        for j in range(k):
            if renorm:
                weights[t, j] /= wsum
            weights[t, j] *= scale


@njit(cache=True)
def group_by_expert(ids, n_expert):
    """Group the (token, slot) choices of ids i64[T, k] by expert (counting sort, experts ascending).

    A negative id is a choice served elsewhere (the hybrid engine's VRAM hits) and joins no group.
    Returns experts i64[G] (the distinct experts), grp_start i64[G+1] (group g owns entries
    grp_start[g]:grp_start[g+1]), entry_tok i64[N] and entry_slot i64[N] (N = the non-negative choices; tokens
    ascending in a group).
    """
    ntok, k = ids.shape
    counts = np.zeros(n_expert, np.int64)
    for t in range(ntok):
        for j in range(k):
            if ids[t, j] >= 0:
                counts[ids[t, j]] += 1
    ngrp = 0
    for e in range(n_expert):
        if counts[e]:
            ngrp += 1
    experts = np.empty(ngrp, np.int64)
    grp_start = np.empty(ngrp + 1, np.int64)
    nxt = np.empty(n_expert, np.int64)
    g = 0
    acc = 0
    for e in range(n_expert):
        if counts[e]:
            experts[g] = e
            grp_start[g] = acc
            nxt[e] = acc
            acc += counts[e]
            g += 1
    grp_start[ngrp] = acc
    entry_tok = np.empty(acc, np.int64)
    entry_slot = np.empty(acc, np.int64)
    for t in range(ntok):
        for j in range(k):
            e = ids[t, j]
            if e < 0:
                continue
            p = nxt[e]
            entry_tok[p] = t
            entry_slot[p] = j
            nxt[e] = p + 1
    return experts, grp_start, entry_tok, entry_slot


@njit(cache=True, parallel=True, fastmath=True)
def moe_combine(y, wts, entry_tok, entry_slot, out):
    """out[t] += sum of wts[t, slot] * y[entry] over the entries of token t (in entry order: deterministic).

    Parallel over column chunks so no two threads write the same element; the inner loop on 1-D row views (2-D
    indexing per element kept it scalar: 30 us for a decode token's eight 2048-wide rows).
    """
    n, d = y.shape
    nchunk = (d + 255) // 256
    for c in prange(nchunk):
        c0, c1 = c * 256, min(d, (c + 1) * 256)
        for j in range(n):
            t = entry_tok[j]
            w = wts[t, entry_slot[j]]
            o = out[t, c0:c1]
            yj = y[j, c0:c1]
            for i in range(c1 - c0):
                o[i] += w * yj[i]


QK_NORM_NONE, QK_NORM_HEAD, QK_NORM_FULL = 0, 1, 2


@njit(cache=True, parallel=True, fastmath=True)
def attention_block(q, k, v, q_norm, k_norm, qk_norm, eps, cos, sin, neox, kc, vc, pos0, scale, out):
    """Everything between the Q/K/V projections and the output projection, in one compiled call.

    q f32[T, H*hd], k and v f32[T, Hkv*hd] (normalized and rotated in place); qk_norm: QK_NORM_* (per head over
    hd, or over all heads at once); then the KV append at pos0 and causal GQA attention into out f32[T, H, hd].
    The keys (T * Hkv heads) are normalized and rotated in the calling thread; then one parallel region over
    (token, query head) normalizes, rotates and attends: a decode token enters one region here, not five.
    """
    ntok = q.shape[0]
    hd = out.shape[2]
    nh = out.shape[1]
    nkv = kc.shape[0]
    if qk_norm == QK_NORM_FULL:
        rmsnorm(q, q_norm, eps, q)
        rmsnorm(k, k_norm, eps, k)
    q3 = q.reshape(ntok, nh, hd)
    k3 = k.reshape(ntok, nkv, hd)
    for t in range(ntok):
        for h in range(nkv):
            if qk_norm == QK_NORM_HEAD:
                _rmsnorm_row(k3[t, h], k_norm, eps, k3[t, h])
            _rope_head(k3[t, h], cos[t], sin[t], neox)
    kv_write(kc, vc, k3, v.reshape(ntok, nkv, hd), pos0)
    group = nh // nkv
    for task in prange(ntok * nh):
        t = task // nh
        h = task - t * nh
        qh = q3[t, h]
        if qk_norm == QK_NORM_HEAD:
            _rmsnorm_row(qh, q_norm, eps, qh)
        _rope_head(qh, cos[t], sin[t], neox)
        _attend(qh, kc, vc, h // group, pos0 + t + 1, scale, out[t, h])


@njit(cache=True)
def swiglu_quant(g, u, h, hq, hd, hs):
    """h = silu(g) * u, and h quantized to int8 (actq layout) for the down projection, in one call."""
    silu_mul(g, u, h)
    quantize_rows(h, hq, hd, hs)


@njit(cache=True, nogil=True)
def pool_split(ids, slot, masked, experts, counts, missed, tally_a, tally_b):
    """The hybrid engine's CPU expert pool, one layer's routing in one call (no numpy temporaries).

    ids i32[T, k]     the layer's expert choices, as the GPU published them
    slot i32[T, k]    >= 0: a VRAM slot serves that choice (a hit); < 0: the CPU computes it (a miss)
    writes
    masked [T, k]     ids with the hits as -1 (any integer dtype): what CPUBackend.routed_experts takes
    experts, counts   i64[n_expert] buffers: experts[:G] the distinct experts of all choices (hits included),
                      ascending, counts[:G] how many choices each got (profile, cache placement, stats)
    missed            i64[n_expert] buffer: missed[:M] the distinct experts with at least one miss, ascending
    tally_a, tally_b  [n_expert] arrays (any number type) that each get every expert's count of choices added:
                      the VRAM cache's and the stats' rows of this layer (a scratch row where one is not kept)
    returns (G, M, hits, misses)
    """
    ntok, k = ids.shape
    ne = counts.shape[0]
    for e in range(ne):
        counts[e] = 0
        missed[e] = 0
    hits = 0
    for t in range(ntok):
        for j in range(k):
            e = ids[t, j]
            counts[e] += 1
            if slot[t, j] >= 0:
                masked[t, j] = -1
                hits += 1
            else:
                masked[t, j] = e
                missed[e] = 1
    g = 0
    m = 0
    for e in range(ne):  # compact in place: the write index never passes the read index
        c = counts[e]
        if c:
            experts[g] = e
            counts[g] = c
            g += 1
            tally_a[e] += c
            tally_b[e] += c
        if missed[e]:
            missed[m] = e
            m += 1
    return g, m, hits, ntok * k - hits


@njit(cache=True, parallel=True, nogil=True)
def touch_threads(buf):
    """An (almost) empty parallel region, one item per thread (buf i64[threads]): OpenMP's workers spin for
    GOMP_SPINCOUNT after a region, then sleep. The hybrid engine runs this while it waits for the GPU, so the CPU
    pool's next region finds them awake (on the GPU machine a longer spin, GOMP_SPINCOUNT=3e7, took the pool from
    7.7 to 6.4 ms per token at 50%: bench/results/gpu_pool_probe.md)."""
    for i in prange(buf.shape[0]):
        buf[i] = i
