"""Token sampling on the device: the chain of strata_nb/runtime/sampler.py in three launches (two over the grid, one
block), captured in a CUDA graph.

Chain: repetition penalty -> top-k -> top-p -> min-p -> temperature -> inverse-CDF draw over the kept candidates
ordered by penalized logit descending, equal logits by id ascending; temperature <= 0 is the argmax (lowest id).
The draw uses uniform(seed, step), the same counter-based generator (splitmix64) as the host Sampler, so equal logits
give equal tokens on both. Config, seed, step, the history ring and the penalty counts live in device arrays; the last
launch samples, writes the token to a device int32[1] and a mapped host int32[1], and advances step and history.

Order without sorting the vocabulary: each logit maps to an unsigned key that orders like the float (-0.0 folded
into +0.0), and d = key(max) - key(v) >= 0 measures how far below the max it is. Two pre-passes spread over the grid
(pre_max_k, pre_hist_k) and then one block of threads (1024 on a GPU) make passes over the vocabulary:
  1. the max (and the argmax, ties to the lower id: all that greedy needs), per block of the grid, then reduced;
  2. a histogram of d in 1024 log-spaced buckets (exact below 32, then 32 per octave: resolution 1/32 of the
     distance to the max, fine near the top where the candidates are), and, for top-p without top-k, the float64
     normalizer sum(exp(v - max)) (per block of the grid, summed in a fixed order);
  3. fast path: from the histogram, the bucket where the top-k count / min-p threshold is reached (for top-p
     without top-k: the first `cap` candidates) bounds a prefix of the order; if it holds at most `cap` (1024)
     candidates, they are gathered, sorted (bitonic, shared memory) and everything else runs on that sorted list
     (for top-p without top-k, when its mass is reached inside it);
  4. exact path (top-k off or above cap, top-p or min-p keeping more than cap, nothing filtering): every prefix
     boundary (the k-th, the first where the top-p mass is reached, the drawn one) is found by radix selection on
     d with count/mass histograms (a log-spaced pass, then 10-bit passes), equal logits resolved by id order.
The draw's float64 sums run in another order than numpy's, so host and device differ only when a cumulative sum
lands within rounding of a boundary (~1e-15 relative).

On invalid logits (NaN, +inf, all -inf) the device writes token 0 (a valid embedding row) and -1 to the host token,
and does not advance; GPUSampler.result() raises for it.
"""
from __future__ import annotations

import math

import numpy as np
from numba import config, cuda

from strata_nb.cuda_kernels.block import block_max, block_min, block_sum

NB = 1024  # histogram buckets
MAX_THREADS = 1024  # the reduction buffers hold one value per thread
GPU_THREADS = 1024  # block size on a GPU (registers capped at 64 so that 1024 threads fit on an SM)
I31 = (1 << 31) - 1  # ids are packed as I31 - id under the key, so a larger pack is earlier in the order
DALL = 1 << 32  # a bound beyond every d: the whole vocabulary
# The two full passes that need no decision (max, histogram) run spread over the GPU before the one-block kernel:
# on an H100 the whole chain took 244 us a token at 151,936 entries in one block (bench/gpu/trace_decode.py).
PRE_BLOCKS = 2 if config.ENABLE_CUDASIM else 128  # at most MAX_THREADS (the one-block kernel reduces their results)
PRE_THREADS = 32 if config.ENABLE_CUDASIM else 256

# cfg f64[CFG_SIZE]
CFG_TEMP, CFG_TOPK, CFG_TOPP, CFG_MINP, CFG_LOGMINP, CFG_PEN, CFG_LASTN = range(7)
CFG_SIZE = 8
# state i64[ST_SIZE]: the seed as two 32-bit halves, the step counter, the history length
ST_SEED_LO, ST_SEED_HI, ST_STEP, ST_HLEN = range(4)
ST_SIZE = 4

_M32 = np.uint64(0xFFFFFFFF)
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def threads() -> int:
    """Threads of the sampling block: GPU_THREADS on a GPU, 32 in the simulator."""
    return 32 if config.ENABLE_CUDASIM else GPU_THREADS


# -- splitmix64 on 32-bit halves (no product exceeds 64 bits: exact in the simulator's numpy scalars too) ----------

@cuda.jit(device=True)
def _mul64(alo, ahi, blo, bhi):
    p0 = alo * blo
    cross = ((alo * bhi) & _M32) + ((ahi * blo) & _M32) + (p0 >> np.uint64(32))
    return p0 & _M32, cross & _M32


@cuda.jit(device=True)
def _add64(alo, ahi, blo, bhi):
    lo = alo + blo
    hi = ahi + bhi + (lo >> np.uint64(32))
    return lo & _M32, hi & _M32


@cuda.jit(device=True)
def _xorshr(lo, hi, k):
    """(z ^ (z >> k)) for 0 < k < 32."""
    sl = ((lo >> np.uint64(k)) | (hi << np.uint64(32 - k))) & _M32
    return lo ^ sl, hi ^ (hi >> np.uint64(k))


@cuda.jit(device=True)
def uniform(seed_lo, seed_hi, step):
    """uniform(seed, step) of strata_nb.runtime.sampler: splitmix64 output number step, 53 bits in [0, 1)."""
    s1 = np.uint64(step + 1)
    slo, shi = _mul64(s1 & _M32, s1 >> np.uint64(32), np.uint64(_GOLDEN & 0xFFFFFFFF), np.uint64(_GOLDEN >> 32))
    zlo, zhi = _add64(np.uint64(seed_lo) & _M32, np.uint64(seed_hi) & _M32, slo, shi)
    zlo, zhi = _xorshr(zlo, zhi, 30)
    zlo, zhi = _mul64(zlo, zhi, np.uint64(_MIX1 & 0xFFFFFFFF), np.uint64(_MIX1 >> 32))
    zlo, zhi = _xorshr(zlo, zhi, 27)
    zlo, zhi = _mul64(zlo, zhi, np.uint64(_MIX2 & 0xFFFFFFFF), np.uint64(_MIX2 >> 32))
    zlo, zhi = _xorshr(zlo, zhi, 31)
    top = np.float64(zhi) * 2097152.0 + np.float64(zlo >> np.uint64(11))  # z >> 11: 53 bits, exact
    return top * (1.0 / 9007199254740992.0)


# -- keys -----------------------------------------------------------------------------------------------------------

if config.ENABLE_CUDASIM:
    @cuda.jit(device=True)
    def _bits(v):
        t = cuda.local.array(1, np.float32)
        t[0] = v
        return np.int64(t.view(np.uint32)[0])

    @cuda.jit(device=True)
    def _from_bits(b):
        t = cuda.local.array(1, np.uint32)
        t[0] = np.uint32(b)
        return t.view(np.float32)[0]
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _bits(v):
        return np.int64(libdevice.float_as_int(v)) & 0xFFFFFFFF

    @cuda.jit(device=True)
    def _from_bits(b):
        return libdevice.int_as_float(np.int32(b))


@cuda.jit(device=True)
def _key(v):
    """An int64 in [0, 2^32) ordered as the float32 v (-0.0 and +0.0 map to the same key)."""
    b = _bits(v) if v != 0 else np.int64(0)
    return (b ^ 0xFFFFFFFF) if b >= 0x80000000 else (b | 0x80000000)


@cuda.jit(device=True)
def _key_value(key):
    """The float32 of a key (its inverse)."""
    return _from_bits((key ^ 0x80000000) if key >= 0x80000000 else (key ^ 0xFFFFFFFF))


@cuda.jit(device=True)
def _penalized(logits, cnt, i, pen):
    v = logits[i]
    if cnt[i] > 0:  # in the repeat window: as the host, once per distinct token
        v = v * pen if v <= 0 else v / pen
    return v


@cuda.jit(device=True)
def _load8(logits, cnt, i, nt, nv, pen):
    """The penalized logits at i, i+nt, ..., i+7nt (-inf past the end): eight independent loads in flight, since
    one block streams the whole vocabulary and waits on memory latency otherwise."""
    ninf = np.float32(-np.inf)
    v0 = _penalized(logits, cnt, i, pen) if i < nv else ninf
    v1 = _penalized(logits, cnt, i + nt, pen) if i + nt < nv else ninf
    v2 = _penalized(logits, cnt, i + 2 * nt, pen) if i + 2 * nt < nv else ninf
    v3 = _penalized(logits, cnt, i + 3 * nt, pen) if i + 3 * nt < nv else ninf
    v4 = _penalized(logits, cnt, i + 4 * nt, pen) if i + 4 * nt < nv else ninf
    v5 = _penalized(logits, cnt, i + 5 * nt, pen) if i + 5 * nt < nv else ninf
    v6 = _penalized(logits, cnt, i + 6 * nt, pen) if i + 6 * nt < nv else ninf
    v7 = _penalized(logits, cnt, i + 7 * nt, pen) if i + 7 * nt < nv else ninf
    return v0, v1, v2, v3, v4, v5, v6, v7


@cuda.jit(device=True)
def _p_max(v, i, nv, best, bad):
    if i < nv:
        if v != v:
            bad = 1
        best = max(best, (_key(v) << 31) | (I31 - i))
    return best, bad


@cuda.jit(device=True)
def _p_hist(v, i, nv, kmax, hc, need_z, mx):
    """Counts v's bucket; returns its top-p mass exp(v - max) when the normalizer is needed (else 0)."""
    if i < nv:
        cuda.atomic.add(hc, _enc(kmax - _key(v)), 1)
        if need_z:
            return math.exp(np.float64(v) - mx)
    return 0.0


@cuda.jit(device=True)
def _p_gather(v, i, nv, kmax, dlim, si, buf):
    if i < nv:
        kv = _key(v)
        if kmax - kv <= dlim:
            slot = cuda.atomic.add(si, 2, 1)
            if slot < buf.shape[0]:
                buf[slot] = (kv << 31) | (I31 - i)


@cuda.jit(device=True)
def _enc(x):
    """Log-spaced bucket of x in [0, 2^32): exact below 32, then 32 buckets per octave (< 896)."""
    if x < 32:
        return x
    e = 31 - cuda.clz(np.uint32(x))
    return (e - 4) * 32 + ((x >> (e - 5)) & 31)


@cuda.jit(device=True)
def _enc_lo(b):
    if b < 32:
        return np.int64(b)
    e = b // 32 + 4
    return np.int64(32 + (b & 31)) << (e - 5)


@cuda.jit(device=True)
def _enc_width(b):
    if b < 32:
        return np.int64(1)
    return np.int64(1) << (b // 32 - 1)


# -- block scan (the reductions are in block.py; blockDim a power of two <= MAX_THREADS) -----------------------------

@cuda.jit(device=True)
def _bscan_i(buf, v):
    """(exclusive prefix sum of v over the threads, total)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf[tid] = v
    cuda.syncthreads()
    off = 1
    while off < nt:
        t = buf[tid - off] if tid >= off else 0
        cuda.syncthreads()
        buf[tid] += t
        cuda.syncthreads()
        off *= 2
    excl = buf[tid - 1] if tid > 0 else 0
    tot = buf[nt - 1]
    cuda.syncthreads()
    return excl, tot


@cuda.jit(device=True)
def _bscan_f(buf, v):
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf[tid] = v
    cuda.syncthreads()
    off = 1
    while off < nt:
        t = buf[tid - off] if tid >= off else 0.0
        cuda.syncthreads()
        buf[tid] += t
        cuda.syncthreads()
        off *= 2
    excl = buf[tid - 1] if tid > 0 else 0.0
    tot = buf[nt - 1]
    cuda.syncthreads()
    return excl, tot


@cuda.jit(device=True)
def _scan_inplace(arr, n, redf):
    """Inclusive prefix sum of arr[:n] in place (each thread a contiguous segment, then a block scan)."""
    tid = cuda.threadIdx.x
    seg = (n + cuda.blockDim.x - 1) // cuda.blockDim.x
    b0 = tid * seg
    b1 = min(n, b0 + seg)
    s = 0.0
    for j in range(b0, b1):
        s += arr[j]
        arr[j] = s
    excl, _ = _bscan_f(redf, s)
    for j in range(b0, b1):
        arr[j] += excl
    cuda.syncthreads()


@cuda.jit(device=True)
def _count_below(arr, n, target, strict, redi):
    """#{j < n: arr[j] < target} (strict) or #{arr[j] <= target}."""
    c = 0
    for j in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        if arr[j] < target or (not strict and arr[j] == target):
            c += 1
    return block_sum(redi, c)


@cuda.jit(device=True)
def _crossing(mass, acc, target, ge, redf, redi, sf):
    """The first bucket b where acc + mass[0..b] reaches target (>= if ge, else >), or NB if none; the sum before
    it is left in sf[0]."""
    tid = cuda.threadIdx.x
    per = NB // cuda.blockDim.x
    b0 = tid * per
    s = 0.0
    for b in range(b0, b0 + per):
        s += mass[b]
    excl, _ = _bscan_f(redf, s)
    a = acc + excl
    found = NB
    for b in range(b0, b0 + per):
        a2 = a + mass[b]
        if a2 >= target if ge else a2 > target:
            found = b
            break
        a = a2
    fb = block_min(redi, found)
    if found == fb and fb < NB:
        sf[0] = a
    cuda.syncthreads()
    return fb


@cuda.jit(device=True)
def _in_bound(d, i, bd, bid):
    return d < bd or (d == bd and i <= bid)


# -- pre-passes over the whole grid ------------------------------------------------------------------------------

@cuda.jit
def pre_max_k(logits, cnt, cfg, part_best, part_bad, hist):
    """Per block: the largest pack of key and id, and whether a NaN was seen, over its grid-strided elements
    (part_best, part_bad [PRE_BLOCKS]); the grid also zeroes the global histogram for pre_hist_k."""
    red = cuda.shared.array(PRE_THREADS, np.int64)
    tid = cuda.threadIdx.x
    g = cuda.gridDim.x * cuda.blockDim.x
    i0 = cuda.grid(1)
    nv = logits.shape[0]
    pen = np.float32(cfg[CFG_PEN])
    for j in range(i0, NB, g):
        hist[j] = 0
    best = np.int64(-1)
    bad = 0
    for i in range(i0, nv, 8 * g):
        v0, v1, v2, v3, v4, v5, v6, v7 = _load8(logits, cnt, i, g, nv, pen)
        best, bad = _p_max(v0, i, nv, best, bad)
        best, bad = _p_max(v1, i + g, nv, best, bad)
        best, bad = _p_max(v2, i + 2 * g, nv, best, bad)
        best, bad = _p_max(v3, i + 3 * g, nv, best, bad)
        best, bad = _p_max(v4, i + 4 * g, nv, best, bad)
        best, bad = _p_max(v5, i + 5 * g, nv, best, bad)
        best, bad = _p_max(v6, i + 6 * g, nv, best, bad)
        best, bad = _p_max(v7, i + 7 * g, nv, best, bad)
    best = block_max(red, best)
    bad = block_max(red, np.int64(bad))
    if tid == 0:
        part_best[cuda.blockIdx.x] = best
        part_bad[cuda.blockIdx.x] = bad


@cuda.jit(device=True)
def _reduce_max(red, part):
    """The max of part[:gridDim of the pre-passes] across the block (part fits in the block's threads)."""
    tid = cuda.threadIdx.x
    return block_max(red, part[tid] if tid < part.shape[0] else np.int64(-1))


@cuda.jit(device=True)
def _grid_max(red, part_best, part_bad, logits, cnt, pen):
    """pre_max_k's result across the block: (key of the max, its id, its penalized logit, whether the logits are
    valid: no NaN, the max finite)."""
    best = _reduce_max(red, part_best)
    bad = _reduce_max(red, part_bad)
    amax = I31 - (best & I31)
    mx32 = _penalized(logits, cnt, amax, pen)
    return best >> 31, amax, mx32, bad == 0 and mx32 != np.inf and mx32 != -np.inf


@cuda.jit(device=True)
def _needs_z(cfg, nv):
    topk = np.int64(cfg[CFG_TOPK])
    return cfg[CFG_TOPP] < 1.0 and not 0 < topk < nv


@cuda.jit
def pre_hist_k(logits, cnt, cfg, part_best, part_bad, hist, part_z):
    """After pre_max_k: the histogram of d (as pass 2 of the one-block kernel) summed into hist, and per block the
    top-p normalizer's share sum(exp(v - max)) when it is needed (part_z, summed in a fixed order later). Nothing
    for greedy or invalid logits."""
    red = cuda.shared.array(PRE_THREADS, np.int64)
    hc = cuda.shared.array(NB, np.int32)
    redf = cuda.shared.array(PRE_THREADS, np.float64)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    g = cuda.gridDim.x * nt
    i0 = cuda.grid(1)
    nv = logits.shape[0]
    pen = np.float32(cfg[CFG_PEN])
    kmax, _, mx32, valid = _grid_max(red, part_best, part_bad, logits, cnt, pen)
    if cfg[CFG_TEMP] <= 0.0 or not valid:
        return
    mx = np.float64(mx32)
    need_z = _needs_z(cfg, nv)
    for j in range(tid, NB, nt):
        hc[j] = 0
    cuda.syncthreads()
    zs = 0.0
    for i in range(i0, nv, 8 * g):
        v0, v1, v2, v3, v4, v5, v6, v7 = _load8(logits, cnt, i, g, nv, pen)
        zs += _p_hist(v0, i, nv, kmax, hc, need_z, mx)
        zs += _p_hist(v1, i + g, nv, kmax, hc, need_z, mx)
        zs += _p_hist(v2, i + 2 * g, nv, kmax, hc, need_z, mx)
        zs += _p_hist(v3, i + 3 * g, nv, kmax, hc, need_z, mx)
        zs += _p_hist(v4, i + 4 * g, nv, kmax, hc, need_z, mx)
        zs += _p_hist(v5, i + 5 * g, nv, kmax, hc, need_z, mx)
        zs += _p_hist(v6, i + 6 * g, nv, kmax, hc, need_z, mx)
        zs += _p_hist(v7, i + 7 * g, nv, kmax, hc, need_z, mx)
    cuda.syncthreads()
    for j in range(tid, NB, nt):
        if hc[j] != 0:
            cuda.atomic.add(hist, j, hc[j])
    z = block_sum(redf, zs)
    if tid == 0:
        part_z[cuda.blockIdx.x] = z


# -- the kernel -------------------------------------------------------------------------------------------------

_KERNELS: dict = {}


def kernel(cap: int, nthreads: int):
    """The sampling kernel for a candidate cap (a power of two <= 1024), launched as one block of nthreads."""
    key = (cap, nthreads)
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = _build(cap, nthreads)
    return k


def _build(cap: int, nthreads: int):
    @cuda.jit(device=True)
    def mass_of(mode, v, mx, temp):
        if mode == 0:
            return 1.0
        if mode == 1:
            return math.exp(np.float64(v) - mx)
        return math.exp((np.float64(v) - mx) / temp)

    @cuda.jit(device=True)
    def select(logits, cnt, pen, kmax, mx, temp, mode, target, ge, bd, bid, hc, hm, redi, redf, si, sf):
        """The first element of the order, within the prefix bounded by (bd, bid), where the cumulative mode
        (0 count, 1 exp(v - mx), 2 exp((v - mx) / temp)) reaches target. Returns (found, d, id)."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        nv = logits.shape[0]
        lo = np.int64(0)
        width = np.int64(DALL)
        acc = 0.0
        first = True
        b = 0
        while True:
            for j in range(tid, NB, nt):
                hc[j] = 0
                hm[j] = 0.0
            cuda.syncthreads()
            shift = 0
            if not first:
                while (width - 1) >> shift >= NB:
                    shift += 1
            for i in range(tid, nv, nt):
                v = _penalized(logits, cnt, i, pen)
                d = kmax - _key(v)
                if d >= lo and d - lo < width and _in_bound(d, i, bd, bid):
                    x = d - lo
                    bk = _enc(x) if first else x >> shift
                    cuda.atomic.add(hc, bk, 1)
                    if mode != 0:
                        cuda.atomic.add(hm, bk, mass_of(mode, v, mx, temp))
            cuda.syncthreads()
            if mode == 0:  # counts: the integer histogram, no float64 atomics
                for j in range(tid, NB, nt):
                    hm[j] = np.float64(hc[j])
                cuda.syncthreads()
            b = _crossing(hm, acc, target, ge, redf, redi, sf)
            if b >= NB:
                return False, np.int64(0), np.int64(0)
            acc = sf[0]
            if first:
                lo += _enc_lo(b)
                width = _enc_width(b)
            else:
                lo += np.int64(b) << shift
                width = min(np.int64(1) << shift, width - (np.int64(b) << shift))
            first = False
            if width == 1:
                break
        # equal logits at d = lo: the crossing is the m-th of them in id order
        ties = np.int64(hc[b])
        if tid == 0:
            e = mass_of(mode, _key_value(kmax - lo), mx, temp)
            a = acc
            m = 0
            while m < ties - 1:
                a += e
                if a >= target if ge else a > target:
                    break
                m += 1
            si[0] = m
        cuda.syncthreads()
        m = si[0]
        cuda.syncthreads()
        if m == 0:
            best = np.int64(I31)
            for i in range(tid, nv, nt):
                v = _penalized(logits, cnt, i, pen)
                d = kmax - _key(v)
                if d == lo and _in_bound(d, i, bd, bid):
                    best = min(best, np.int64(i))
            return True, lo, block_min(redi, best)
        base = np.int64(0)
        for start in range(0, nv, nt):  # ordered scan: the block counts the ties chunk by chunk, in id order
            i = start + tid
            f = 0
            if i < nv:
                d = kmax - _key(_penalized(logits, cnt, i, pen))
                if d == lo and _in_bound(d, i, bd, bid):
                    f = 1
            excl, tot = _bscan_i(redi, f)
            if f == 1 and base + excl == m:
                si[1] = i
            base += tot
            if base > m:
                break
        cuda.syncthreads()
        r = si[1]
        cuda.syncthreads()
        return True, lo, np.int64(r)

    @cuda.jit(device=True)
    def domain_sum(logits, cnt, pen, kmax, mx, temp, mode, bd, bid, redf, redi):
        """(sum of the mode's mass, count) over the prefix bounded by (bd, bid)."""
        s = 0.0
        c = 0
        for i in range(cuda.threadIdx.x, logits.shape[0], cuda.blockDim.x):
            v = _penalized(logits, cnt, i, pen)
            d = kmax - _key(v)
            if _in_bound(d, i, bd, bid):
                s += mass_of(mode, v, mx, temp)
                c += 1
        return block_sum(redf, s), block_sum(redi, c)

    # a block of 1024 threads has 64 registers each: cap them (the spills are in the cold paths)
    jit = cuda.jit(max_registers=65536 // nthreads) if nthreads > 256 and not config.ENABLE_CUDASIM else cuda.jit

    @jit
    def sample_k(logits, cnt, cfg, state, ring, token, token_host, part_best, part_bad, hist, part_z):
        hc = cuda.shared.array(NB, np.int32)
        hm = cuda.shared.array(NB, np.float64)
        buf = cuda.shared.array(cap, np.int64)
        arr = cuda.shared.array(cap, np.float64)
        redi = cuda.shared.array(MAX_THREADS, np.int64)
        redf = cuda.shared.array(MAX_THREADS, np.float64)
        si = cuda.shared.array(4, np.int64)
        sf = cuda.shared.array(4, np.float64)
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        nv = logits.shape[0]
        temp = cfg[CFG_TEMP]
        topk = np.int64(cfg[CFG_TOPK])
        topp = cfg[CFG_TOPP]
        minp = cfg[CFG_MINP]
        pen = np.float32(cfg[CFG_PEN])

        # 1. max and argmax (the largest pack of key and id), invalid logits: pre_max_k's per-block results
        kmax, amax, mx32, valid = _grid_max(redi, part_best, part_bad, logits, cnt, pen)
        mx = np.float64(mx32)
        tok = amax
        if not valid:
            tok = -1
        elif temp > 0.0:
            kk = topk if 0 < topk < nv else 0
            use_p = topp < 1.0
            need_z = use_p and kk == 0
            dthr = np.int64(DALL)
            thr = mx32
            if minp > 0.0:
                thr = np.float32(mx + cfg[CFG_LOGMINP])
                dthr = kmax - _key(thr)

            # 2. histogram of d: counts, and the masses of top-p's normalizer when top-k is off (pre_hist_k's)
            for j in range(tid, NB, nt):
                hc[j] = hist[j]
            z = 0.0
            if need_z:
                z = block_sum(redf, part_z[tid] if tid < part_z.shape[0] else 0.0)
            cuda.syncthreads()
            # the prefix (d <= dlim) that holds every kept candidate
            dlim = np.int64(DALL - 1)
            by_minp = False  # the prefix is cut by min-p: a top-p crossing past it is then irrelevant
            if 0 < kk <= cap:
                for j in range(tid, NB, nt):
                    hm[j] = np.float64(hc[j])
                cuda.syncthreads()
                b = _crossing(hm, 0.0, np.float64(kk), True, redf, redi, sf)
                dlim = _enc_lo(b) + _enc_width(b) - 1
                if not use_p:  # (top-p normalizes over all k: they must all be gathered)
                    dlim = min(dlim, dthr)
            elif kk == 0:
                if need_z:  # the first cap candidates (whole buckets); the sorted list tells if top-p ends there
                    for j in range(tid, NB, nt):
                        hm[j] = np.float64(hc[j])
                    cuda.syncthreads()
                    b = _crossing(hm, 0.0, np.float64(cap), False, redf, redi, sf)
                    if b < NB:
                        dlim = _enc_lo(b) - 1
                by_minp = dthr < dlim
                dlim = min(dlim, dthr)
            else:
                dlim = -1  # top-k above the cap: exact path
            # elements certainly within d <= dlim: those of the buckets wholly below it
            c = 0
            if dlim >= 0:
                for j in range(tid, NB, nt):
                    if _enc_lo(j) + _enc_width(j) - 1 <= dlim:
                        c += hc[j]
            c = block_sum(redi, c)

            # 3. fast path: gather d <= dlim, sort, finish on the sorted list
            fast = False
            if dlim >= 0 and c <= cap:
                if tid == 0:
                    si[2] = 0
                cuda.syncthreads()
                for i in range(tid, nv, 8 * nt):
                    v0, v1, v2, v3, v4, v5, v6, v7 = _load8(logits, cnt, i, nt, nv, pen)
                    _p_gather(v0, i, nv, kmax, dlim, si, buf)
                    _p_gather(v1, i + nt, nv, kmax, dlim, si, buf)
                    _p_gather(v2, i + 2 * nt, nv, kmax, dlim, si, buf)
                    _p_gather(v3, i + 3 * nt, nv, kmax, dlim, si, buf)
                    _p_gather(v4, i + 4 * nt, nv, kmax, dlim, si, buf)
                    _p_gather(v5, i + 5 * nt, nv, kmax, dlim, si, buf)
                    _p_gather(v6, i + 6 * nt, nv, kmax, dlim, si, buf)
                    _p_gather(v7, i + 7 * nt, nv, kmax, dlim, si, buf)
                cuda.syncthreads()
                ncand = si[2]
                cuda.syncthreads()
                if ncand <= cap:
                    fast = True
                    n2 = 1
                    while n2 < ncand:
                        n2 *= 2
                    for j in range(ncand + tid, n2, nt):
                        buf[j] = -1
                    cuda.syncthreads()
                    kb = 2
                    while kb <= n2:  # bitonic sort, descending
                        jb = kb // 2
                        while jb > 0:
                            for i in range(tid, n2, nt):
                                l = i ^ jb
                                if l > i:
                                    a = buf[i]
                                    bb = buf[l]
                                    if (a < bb) == ((i & kb) == 0):
                                        buf[i] = bb
                                        buf[l] = a
                            cuda.syncthreads()
                            jb //= 2
                        kb *= 2
                    n = ncand
                    if kk > 0:
                        n = min(n, kk)
                    if use_p:
                        for j in range(tid, cap, nt):
                            arr[j] = 0.0
                            if j < n:
                                ij = I31 - (buf[j] & I31)
                                arr[j] = math.exp(np.float64(_penalized(logits, cnt, ij, pen)) - mx)
                        cuda.syncthreads()
                        _scan_inplace(arr, n, redf)
                        zp = arr[n - 1] if kk > 0 else z
                        below = _count_below(arr, n, topp * zp, True, redi)
                        if below >= n and kk == 0 and not by_minp:
                            fast = False  # the top-p crossing lies past the gathered prefix (rounding)
                        n = min(n, below + 1)
                    if fast and minp > 0.0:
                        c2 = 0
                        for j in range(tid, n, nt):
                            if _penalized(logits, cnt, I31 - (buf[j] & I31), pen) >= thr:
                                c2 += 1
                        n = min(n, block_sum(redi, c2))
                    if fast:
                        for j in range(tid, cap, nt):
                            arr[j] = 0.0
                            if j < n:
                                ij = I31 - (buf[j] & I31)
                                arr[j] = math.exp((np.float64(_penalized(logits, cnt, ij, pen)) - mx) / temp)
                        cuda.syncthreads()
                        _scan_inplace(arr, n, redf)
                        u = uniform(state[ST_SEED_LO], state[ST_SEED_HI], state[ST_STEP])
                        jstar = _count_below(arr, n, u * arr[n - 1], False, redi)
                        tok = I31 - (buf[min(jstar, n - 1)] & I31)
                        cuda.syncthreads()

            # 4. exact path: prefix boundaries by radix selection
            if not fast:
                bd = np.int64(DALL)
                bid = np.int64(0)
                if kk > 0:
                    f, bd, bid = select(logits, cnt, pen, kmax, mx, temp, 0, np.float64(kk), True, np.int64(DALL),
                                        np.int64(0), hc, hm, redi, redf, si, sf)
                if use_p:
                    zp = z
                    if kk > 0:
                        zp, _ = domain_sum(logits, cnt, pen, kmax, mx, temp, 1, bd, bid, redf, redi)
                    f, d2, i2 = select(logits, cnt, pen, kmax, mx, temp, 1, topp * zp, True, bd, bid, hc, hm,
                                       redi, redf, si, sf)
                    if f:
                        bd = d2
                        bid = i2
                if minp > 0.0 and dthr < bd:
                    bd = dthr
                    bid = np.int64(I31)
                zt, cnt_f = domain_sum(logits, cnt, pen, kmax, mx, temp, 2, bd, bid, redf, redi)
                u = uniform(state[ST_SEED_LO], state[ST_SEED_HI], state[ST_STEP])
                f, d3, i3 = select(logits, cnt, pen, kmax, mx, temp, 2, u * zt, False, bd, bid, hc, hm, redi,
                                   redf, si, sf)
                if not f:  # u * total rounded up to the total: the last kept candidate, as the host's clip
                    f, d3, i3 = select(logits, cnt, pen, kmax, mx, temp, 0, np.float64(cnt_f), True, bd, bid, hc,
                                       hm, redi, redf, si, sf)
                tok = i3

        # 5. outputs and state: one thread, after every read of the counts
        cuda.syncthreads()
        if tid == 0:
            if tok < 0:
                token[0] = 0
                token_host[0] = -1
            else:
                token[0] = tok
                token_host[0] = tok
                state[ST_STEP] += 1
                h = state[ST_HLEN]
                hcap = ring.shape[0]
                ring[h % hcap] = tok
                state[ST_HLEN] = h + 1
                last_n = np.int64(cfg[CFG_LASTN])
                if last_n != 0:
                    cnt[tok] += 1
                if last_n > 0 and h >= last_n:
                    cnt[ring[(h - last_n) % hcap]] -= 1

    return sample_k
