"""Elementwise and attention kernels on float32 arrays: norms, rope, attention, activations, routing.

No fastmath here: with it LLVM reassociates float sums differently in a fresh compile and in a kernel loaded from
numba's cache (1 ulp, which the int8 activations amplify), so logits depended on the cache. Long float sums go
through dot_float.fdot (vectorized in one fixed order); the rest is in source order.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from strata_nb.cpu_kernels.actq import quantize_row, quantize_rows
from strata_nb.cpu_kernels.dot_float import fdot, fdot_at


@njit(cache=True, nogil=True, inline="always")
def _rmsnorm_row(x, w, eps, out):
    d = x.shape[0]
    ss = fdot(x, x, d)
    inv = np.float32(1.0) / np.float32(math.sqrt(ss / d + eps))
    for i in range(d):
        out[i] = x[i] * inv * w[i]


@njit(cache=True, parallel=True)
def rmsnorm(x, w, eps, out):
    """out[t] = x[t] / rms(x[t]) * w over the last axis; x f32[N, D] (rows may be heads)."""
    for t in prange(x.shape[0]):
        _rmsnorm_row(x[t], w, eps, out[t])


@njit(cache=True, parallel=True)
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
    """Rotate one head x f32[head_dim] in place by cos/sin f32[n_rot/2]."""
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


# Query heads a CPU attention task takes, of one kv head's group: the task reads each K and V row once for all of
# them (from L1 after the first head) instead of once a head. 2 threads, 32 heads over 4 kv heads, one token at
# position 150 (bench/cpu_attention.py): 77-91 us a layer against 139-144 with a task a head.
ATT_HEADS = 4


@njit(nogil=True, inline="always")
def _attend_heads(q3t, h0, nq, kc, vc, kvh, n, scale, outt):
    """outt[h] = softmax(scale * K q3t[h]) V over cache positions 0..n-1 of KV head kvh, for the query heads
    h = h0..h0+nq-1 (q3t, outt f32[H, hd]). Per head the sums run in the same order as for one head alone."""
    hd = q3t.shape[1]
    row0 = kvh * kc.shape[1]
    s = np.empty((nq, n), np.float32)
    for j in range(n):
        for g in range(nq):
            s[g, j] = fdot_at(q3t, (h0 + g) * hd, kc, (row0 + j) * hd, hd) * scale
    for g in range(nq):
        m = np.float32(-np.inf)
        for j in range(n):
            if s[g, j] > m:
                m = s[g, j]
        tot = np.float32(0.0)
        for j in range(n):
            e = np.float32(math.exp(s[g, j] - m))
            s[g, j] = e
            tot += e
        inv = np.float32(1.0) / tot
        for j in range(n):
            s[g, j] *= inv
        for i in range(hd):
            outt[h0 + g, i] = 0.0
    for j in range(n):
        for g in range(nq):
            p = s[g, j]
            for i in range(hd):
                outt[h0 + g, i] += p * vc[kvh, j, i]


@njit(nogil=True, inline="always")
def _head_task(task, nkv, nsub, group):
    """(token, kv head, first query head, query heads) of attention task `task`: tasks run over (token, kv head,
    sub-group of up to ATT_HEADS of its group of query heads), nsub sub-groups a kv head."""
    t = task // (nkv * nsub)
    r = task - t * nkv * nsub
    kvh = r // nsub
    sub = r - kvh * nsub
    return t, kvh, kvh * group + sub * ATT_HEADS, min(ATT_HEADS, group - sub * ATT_HEADS)


@njit(cache=True, parallel=True)
def attention(q, kc, vc, pos0, scale, out):
    """Causal GQA attention: token t (position pos0+t) of q f32[T, H, hd] sees cache positions 0..pos0+t.

    out f32[T, H, hd]. Query heads map to KV heads in contiguous groups of H / Hkv (llama.cpp and HF order).
    """
    ntok, nh, hd = q.shape
    nkv = kc.shape[0]
    group = nh // nkv
    nsub = (group + ATT_HEADS - 1) // ATT_HEADS
    for task in prange(ntok * nkv * nsub):
        t, kvh, h0, nq = _head_task(task, nkv, nsub, group)
        _attend_heads(q[t], h0, nq, kc, vc, kvh, pos0 + t + 1, scale, out[t])


@njit(cache=True, nogil=True)
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


# Rows of the routing plan moe_split writes for the routed-expert kernel (one i64 buffer: one kernel argument).
PLAN_EXPERT, PLAN_START, PLAN_TOK, PLAN_SLOT, PLAN_IDENT, PLAN_DONE, PLAN_NALL, PLAN_NCPU = range(8)
PLAN_ROWS = 8


def plan_buffer(n_expert: int, n_entries: int) -> np.ndarray:
    """A routing plan for up to n_entries choices among n_expert experts, its identity row filled."""
    plan = np.zeros((PLAN_ROWS, max(n_expert + 1, n_entries)), np.int64)
    plan[PLAN_IDENT] = np.arange(plan.shape[1])
    return plan


@njit(cache=True, nogil=True)
def moe_split(ids, slot, ntok, layer, plan, tally_a, tally_b, tally_c):
    """One MoE layer's routing as the routed-expert kernel takes it, and its counts, in one call (no numpy
    temporaries: a decode token's MoE glue is per-call costs).

    ids i32[>= ntok, k]   the expert choices of tokens 0..ntok-1 (a negative id: no choice)
    slot i32[>= ntok, k]  >= 0: another device computes that choice (the hybrid engine's VRAM hits); < 0: here
    plan i64[PLAN_ROWS, >= max(n_expert + 1, ntok * k)] (plan_buffer) gets the choices computed here grouped by
                          expert (counting sort, experts ascending): group g is expert plan[PLAN_EXPERT, g] and
                          owns entries plan[PLAN_START, g]:plan[PLAN_START, g + 1] of plan[PLAN_TOK] (the token)
                          and plan[PLAN_SLOT] (its choice), tokens ascending in a group
    tally_a, tally_b, tally_c [n_layer, n_expert] (any number types): row `layer` of each gets every expert's count
                          of choices (those computed elsewhere included), added once per expert
    returns (G, hits): the number of groups (the distinct experts computed here), the choices computed elsewhere
    """
    k = ids.shape[1]
    ne = tally_a.shape[1]
    nall = plan[PLAN_NALL]
    nxt = plan[PLAN_NCPU]
    for e in range(ne):
        nall[e] = 0
        nxt[e] = 0
    hits = 0
    for t in range(ntok):
        for j in range(k):
            e = ids[t, j]
            if e < 0:
                continue
            nall[e] += 1
            if slot[t, j] >= 0:
                hits += 1
            else:
                nxt[e] += 1
    experts = plan[PLAN_EXPERT]
    start = plan[PLAN_START]
    g = 0
    acc = 0
    for e in range(ne):
        c = nall[e]
        if c:
            tally_a[layer, e] += c
            tally_b[layer, e] += c
            tally_c[layer, e] += c
        c = nxt[e]
        if c:
            experts[g] = e
            start[g] = acc
            nxt[e] = acc
            acc += c
            g += 1
    start[g] = acc
    etok = plan[PLAN_TOK]
    eslot = plan[PLAN_SLOT]
    for t in range(ntok):
        for j in range(k):
            e = ids[t, j]
            if e < 0 or slot[t, j] >= 0:
                continue
            p = nxt[e]
            etok[p] = t
            eslot[p] = j
            nxt[e] = p + 1
    return g, hits


@njit(cache=True, nogil=True)
def combine_cols(y, wts, entry_tok, entry_slot, n, ntok, out, c0, c1):
    """out[t, c0:c1] = the sum of wts[t, slot] * y[entry, c0:c1] over the first n entries that are token t's (in
    entry order: deterministic), for tokens 0..ntok-1. 2-D indexing: a row view costs a reference count
    on the array's owner per entry, shared by every thread."""
    for t in range(ntok):
        for i in range(c0, c1):
            out[t, i] = 0.0
    for j in range(n):
        t = entry_tok[j]
        w = wts[t, entry_slot[j]]
        for i in range(c0, c1):
            out[t, i] += w * y[j, i]


@njit(cache=True, parallel=True)
def moe_combine(y, wts, entry_tok, entry_slot, out):
    """out[t] = the weighted sum of token t's entries of y f32[N, D] (combine_cols over column chunks in
    parallel): what the routed-expert kernel does inside its down projection, and its reference in the tests."""
    n, d = y.shape
    for c in prange((d + 255) // 256):
        combine_cols(y, wts, entry_tok, entry_slot, n, out.shape[0], out, c * 256, min(d, (c + 1) * 256))


QK_NORM_NONE, QK_NORM_HEAD, QK_NORM_FULL = 0, 1, 2


@njit(cache=True, parallel=True)
def attention_block(q, k, v, q_norm, k_norm, qk_norm, eps, cos, sin, neox, kc, vc, pos0, scale, out):
    """Everything between the Q/K/V projections and the output projection, in one compiled call.

    q f32[T, H*hd], k and v f32[T, Hkv*hd] (normalized and rotated in place); qk_norm: QK_NORM_* (per head over
    hd, or over all heads at once); then the KV append at pos0 and causal GQA attention into out f32[T, H, hd].
    The keys (T * Hkv heads) are normalized and rotated in the calling thread; then one parallel region over
    (token, up to ATT_HEADS query heads of one kv head) normalizes, rotates and attends: a decode token enters one
    region here, not five.
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
    nsub = (group + ATT_HEADS - 1) // ATT_HEADS
    for task in prange(ntok * nkv * nsub):
        t, kvh, h0, nq = _head_task(task, nkv, nsub, group)
        for h in range(h0, h0 + nq):
            qh = q3[t, h]
            if qk_norm == QK_NORM_HEAD:
                _rmsnorm_row(qh, q_norm, eps, qh)
            _rope_head(qh, cos[t], sin[t], neox)
        _attend_heads(q3[t], h0, nq, kc, vc, kvh, pos0 + t + 1, scale, out[t])


@njit(cache=True)
def swiglu_quant(g, u, h, hq, hd, hs):
    """h = silu(g) * u, and h quantized to int8 (actq layout) for the down projection, in one call."""
    silu_mul(g, u, h)
    quantize_rows(h, hq, hd, hs)


@njit(cache=True, parallel=True, nogil=True)
def touch_threads(buf):
    """An (almost) empty parallel region, one item per thread (buf i64[threads]): OpenMP's workers spin for
    GOMP_SPINCOUNT after a region, then sleep. The hybrid engine runs this while it waits for the GPU, so the CPU
    pool's next region finds them awake (on the GPU machine a longer spin, GOMP_SPINCOUNT=3e7, took the pool from
    7.7 to 6.4 ms per token at 50%: bench/results/gpu_pool_probe.md)."""
    for i in prange(buf.shape[0]):
        buf[i] = i
