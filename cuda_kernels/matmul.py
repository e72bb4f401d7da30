"""Quantized matrix kernels: decode matrix-vector (dense, and the experts over VRAM slots), prompt tiles, embedding
rows. Weights are the GGUF bytes as uint8 device arrays, decoded in registers by cuda_kernels.quant one 16-weight
unit at a time; accumulation in float32.

Matrix-vector (one token; each MoE entry is one): a block of MV_WARPS warps owns MV_WARPS groups of `rows` rows.
It first stages the activation row in shared memory (RMS-normalized on the way when the norm is fused), so the
lanes read activations from shared memory instead of L1; then each warp's 32 lanes stride over the units of its
rows (lane l takes units l, l+32, ...: adjacent lanes read adjacent weight words), loading a unit's 16 activations
once for all its rows, as s * (q . x) - mn * sum(x) per run of 4. Lane partial sums are reduced with warp
shuffles. Rows longer than MV_CHUNK elements are staged in chunks. Fusions, each saving a launch per layer:
- dense: up to three matrices reading the same row in one launch (Q, K and V; the router and the shared expert's
  gate and up), with the RMSNorm of the row fused (and the normalized row written out once for later kernels, as
  floats and in the int8 form the experts' int8 kernels of matvec_q8.py read);
- gate_up: an expert's gate and up rows by the same warp, SwiGLU in the epilogue;
- down: a token's resident experts' down rows, weighted by the router and added to the residual stream.
Prompt (ntok > 1): a warp takes tiles of R rows x TT tokens: a lane decodes each of its units once per tile into
R x 16 weights in registers and applies them to the TT tokens. The experts' matrices take the same tiles over a
chunk's choices grouped by expert (ops.group_experts: a tile is up to TT choices of one expert).
The simulator has no shuffles (and a simulated thread is a Python thread): there a "warp" is one lane (LANES ==
1) that walks all units of its rows.
Launch helpers never allocate, copy or synchronize and take every shape as a Python int fixed at capture.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, uint64
from numba.core import config

from strata_nb.cpu_kernels.qtypes import Q8_0
from strata_nb.cpu_kernels.qtypes import name as qname
from strata_nb.cuda_kernels import matvec_q8 as kq8
from strata_nb.cuda_kernels.block import block_sum
from strata_nb.cuda_kernels.quant import _DEV, LAYOUTS, UNIT, _bits_f32
from strata_nb.errors import StrataError

SIM = bool(config.ENABLE_CUDASIM)
# Real GPU. Matrix-vector: 4 warps a block, MV_ROWS rows a warp (MV_ROWS_SMALL for matrices too short to fill the
# GPU that way). Prompt: 4 warps a block, each 4 rows x 8 tokens (a unit is decoded once per 8 tokens; its 16
# activations are loaded once for 4 rows). Simulator: one-lane warps, one warp a block, small tiles.
MV_WARPS, MV_ROWS, MV_ROWS_SMALL = (1, 2, 2) if SIM else (4, 4, 2)
MV_WARPS_WIDE = 1 if SIM else 8  # dense launches of long rows (see _mv_shape), and moe_down
# rows of a moe_down block, whose MV_WARPS_WIDE warps take different choices of those rows: on an H200 inside the
# decode graph (bench/gpu/trace_decode.py, Qwen3-30B-A3B shapes, 8 choices of 2048 x 768 Q6_K) 15.4 us a launch at
# 8 warps x 2 rows against 22.7 at 4 x 4 (a warp's choices ran one after the other)
MV_ROWS_DOWN = 2
# the int8 down kernel's rows a block (its warps take different choices): H100, kernel_probe.py, 8 choices of Q6_K
# 2048 x 768, us warm / L2-flushed: 8 warps x 4 rows 12.98 / 17.10, x 2 rows 16.07 / 19.55, x 1 row 15.50 / 16.32
# (in the decode graph, bench/gpu/trace_decode.py: 12.99 us at 4 rows, 13.40 at 2)
MV_ROWS_DOWN_Q8 = 1 if SIM else 4
# the int8 gate+up kernel: 32 rows a block (h's int8 blocks are of 32 elements), 8 warps of 4 rows on a GPU
GU_WARPS, GU_ROWS = (1, 32) if SIM else (8, 4)
MV_CHUNK = 256 if SIM else 8192  # activation elements staged in shared memory at a time (32 KB)
TILE_WARPS, TILE_ROWS, TILE_TOKS = (1, 2, 2) if SIM else (4, 4, 8)
EMBED_THREADS = 32 if SIM else 256
MAX_GRID_X = 2 if SIM else 1 << 20
MAX_GRID_Y = 2 if SIM else 65535
_SH = (1, 1)  # the tiled kernel's _warp_reduce scratch (unused)
# Lanes per warp: 32 on a GPU; 1 in the simulator, where every simulated thread is a Python thread and a barrier
# costs milliseconds, so one thread walks all units of its rows and nothing needs reducing.
LANES = 1 if SIM else 32
LANE_MASK, WARP_SHIFT = LANES - 1, (LANES - 1).bit_length()
_RED = max(MV_WARPS, MV_WARPS_WIDE) * LANES  # block_sum's buffer: one float per thread
_ONE = np.float32(1.0)
_EXP_CAP = np.float32(80.0)
_ZERO = np.float32(0.0)
_KERNELS: dict[tuple, object] = {}


_U = uint64  # array indices are cast to unsigned: numba skips its negative-index wraparound for those
_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


@cuda.jit(**_DEV)
def _load_run(x2, row, p, xv, k):
    """xv[k:k+4] = the 4 activations at columns p..p+3 (p a multiple of 4) of a row, from x2, the float32 rows
    viewed as uint64 pairs. Two 8-byte loads instead of four: the loads of a warp's runs span many cache lines,
    and the L1 throughput of those (not DRAM) bounds the matrix-vector kernel."""
    for h in range(2):
        v = x2[_U(row), _U((p >> 1) + h)]
        xv[k + 2 * h] = _bits_f32(v & _LO32)
        xv[k + 2 * h + 1] = _bits_f32(v >> _S32)

if SIM:
    @cuda.jit(device=True)
    def _warp_reduce(acc, n, sh):
        """The simulator runs one-lane warps (LANES == 1): a thread already holds its rows' whole sums."""
        return

else:
    @cuda.jit(**_DEV)
    def _warp_reduce(acc, n, sh):
        """acc[c] summed over the warp's 32 lanes (butterfly shuffles: into every lane), for c < n; sh unused."""
        for c in range(n):
            v = acc[c]
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 16)
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 8)
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 4)
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
            acc[c] = v


def _dot_rows(qtype: int, word: int, rows: int):
    """dot_rows(w8, wv, wh, base, rb, r0, last, u0, u1, xs, xoff, q, s, mn, xv, sx, acc, ao): acc[ao + o] += the
    units u0 <= u < u1 of row min(r0 + o, last) . the activations staged in xs (xs[j] is element j + xoff of the
    row), for o < rows, by one warp (this lane's share: units u0 + lane, u0 + lane + LANES, ...). Row r is the
    bytes at base + r * rb of the weight views. Rows past the end are clamped (the caller discards their sums), so
    the body has no branch and all its loads can be issued at once. Memoized per (type, word, rows)."""
    key = ("rows", qtype, word, rows)
    if key in _KERNELS:
        return _KERNELS[key]
    lay = LAYOUTS[qtype]
    unit, pos, has_min = lay.unit, lay.pos, lay.has_min

    @cuda.jit(**_DEV)
    def unit_dot(w8, wv, wh, base, rb, u, r0, last, xs, xoff, q, s, mn, xv, sx, acc, ao):
        for i in range(4):
            p = pos(u, i) - xoff
            for e in range(4):
                xv[4 * i + e] = xs[p + e]
            if has_min:
                sx[i] = (xv[4 * i] + xv[4 * i + 1]) + (xv[4 * i + 2] + xv[4 * i + 3])
        for o in range(rows):
            r = r0 + o if r0 + o < last else last
            unit(w8, wv, wh, word, base + r * rb, u, q, s, mn)
            a = acc[ao + o]
            for i in range(4):
                d = q[4 * i] * xv[4 * i] + q[4 * i + 1] * xv[4 * i + 1] + q[4 * i + 2] * xv[4 * i + 2] + \
                    q[4 * i + 3] * xv[4 * i + 3]
                a += s[i] * d
                if has_min:
                    a -= mn[i] * sx[i]
            acc[ao + o] = a

    if rows <= 2:
        @cuda.jit(**_DEV)
        def dot_rows(w8, wv, wh, base, rb, r0, last, u0, u1, xs, xoff, q, s, mn, xv, sx, acc, ao):
            # Four units per step (straight-line code: the compiler issues all their loads in one memory round,
            # and a row of 2048 is then one step)
            u = u0 + (cuda.threadIdx.x & LANE_MASK)
            while u + 3 * LANES < u1:
                unit_dot(w8, wv, wh, base, rb, u, r0, last, xs, xoff, q, s, mn, xv, sx, acc, ao)
                unit_dot(w8, wv, wh, base, rb, u + LANES, r0, last, xs, xoff, q, s, mn, xv, sx, acc, ao)
                unit_dot(w8, wv, wh, base, rb, u + 2 * LANES, r0, last, xs, xoff, q, s, mn, xv, sx, acc, ao)
                unit_dot(w8, wv, wh, base, rb, u + 3 * LANES, r0, last, xs, xoff, q, s, mn, xv, sx, acc, ao)
                u += 4 * LANES
            while u < u1:
                unit_dot(w8, wv, wh, base, rb, u, r0, last, xs, xoff, q, s, mn, xv, sx, acc, ao)
                u += LANES
    else:
        @cuda.jit(**_DEV)
        def dot_rows(w8, wv, wh, base, rb, r0, last, u0, u1, xs, xoff, q, s, mn, xv, sx, acc, ao):
            # Two units per step of `rows` rows each (more would not fit in registers)
            u = u0 + (cuda.threadIdx.x & LANE_MASK)
            while u + LANES < u1:
                unit_dot(w8, wv, wh, base, rb, u, r0, last, xs, xoff, q, s, mn, xv, sx, acc, ao)
                unit_dot(w8, wv, wh, base, rb, u + LANES, r0, last, xs, xoff, q, s, mn, xv, sx, acc, ao)
                u += 2 * LANES
            if u < u1:
                unit_dot(w8, wv, wh, base, rb, u, r0, last, xs, xoff, q, s, mn, xv, sx, acc, ao)

    _KERNELS[key] = dot_rows
    return dot_rows


def _chunks(k: int) -> tuple[int, int]:
    """(elements staged in shared memory at a time, number of stages) for rows of k elements: whole rows up to
    MV_CHUNK, else chunks of MV_CHUNK (a multiple of 256, so no quant block straddles two stages)."""
    if k <= MV_CHUNK:
        return k, 1
    return MV_CHUNK, -(-k // MV_CHUNK)


def _dense_fn(types: tuple, k: int, rows: int, warps: int, norm: bool, q8_out: bool = False):
    """The matrix-vector kernel for up to three matrices (types: their (qtype, word) pairs) reading one activation
    row of k elements, RMS-normalized when norm, by blocks of `warps` warps of `rows` rows each; q8_out: the
    blocks also write the normalized row's int8 form to gq/gd/gs (matvec_q8.q8_shapes), a share each. Memoized."""
    key = ("dense", types, k, rows, warps, norm, q8_out)
    if key in _KERNELS:
        return _KERNELS[key]
    dots = [_dot_rows(qt, wd, rows) for qt, wd in types]
    d0, d1, d2 = (dots + [dots[0]] * 3)[:3]  # absent matrices get no blocks; their slot is never called
    ch, nch = _chunks(k)
    cu, nunits = ch // UNIT, k // UNIT
    nthr = warps * LANES
    nper = -(-ch // nthr)  # staged elements a thread: a constant trip count, so the loads are issued together

    @cuda.jit(cache=True)
    def dense(x, nw, eps, xo, write_xo,
              w8a, wva, wha, rba, na, oa, acca, nba,
              w8b, wvb, whb, rbb, nb, ob, accb, nbb,
              w8c, wvc, whc, rbc, nc, oc, accc, gq, gd, gs):
        xs = cuda.shared.array(ch, float32)
        red = cuda.shared.array(_RED, float32)
        q = cuda.local.array(UNIT, float32)
        xv = cuda.local.array(UNIT, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        sx = cuda.local.array(4, float32)
        acc = cuda.local.array(rows, float32)
        tid = cuda.threadIdx.x
        lane = tid & LANE_MASK
        b = cuda.blockIdx.x
        m = 0 if b < nba else (1 if b < nba + nbb else 2)
        lb = b if m == 0 else (b - nba if m == 1 else b - nba - nbb)
        r0 = (lb * warps + (tid >> WARP_SHIFT)) * rows
        for o in range(rows):
            acc[o] = _ZERO
        # The norm's scale 1/rms is a factor of every dot product: it is applied to the sums at the end, so the
        # row is read once (x * weight staged, its squares summed on the way) before the first weight load.
        ss = _ZERO
        for c in range(nch):
            cuda.syncthreads()
            for r in range(nper):
                i = tid + r * nthr
                j = c * ch + i
                if i < ch and j < k:
                    v = x[0, _U(j)]
                    if norm:
                        ss += v * v
                        v = v * nw[_U(j)]
                    xs[i] = v
            cuda.syncthreads()
            u0 = c * cu
            u1 = min(nunits, u0 + cu)
            if m == 0:
                d0(w8a, wva, wha, 0, rba, r0, na - 1, u0, u1, xs, c * ch, q, s, mn, xv, sx, acc, 0)
            elif m == 1:
                d1(w8b, wvb, whb, 0, rbb, r0, nb - 1, u0, u1, xs, c * ch, q, s, mn, xv, sx, acc, 0)
            else:
                d2(w8c, wvc, whc, 0, rbc, r0, nc - 1, u0, u1, xs, c * ch, q, s, mn, xv, sx, acc, 0)
        if norm:  # as cuda_kernels.ops.rmsnorm: the mean and eps in float64, the scale in float32
            tot = block_sum(red, ss)
            inv = _ONE / float32(math.sqrt(float64(tot) / k + eps))
            for o in range(rows):
                acc[o] *= inv
            # the normalized row's copies, a share a block (H100, the router's launch with the int8 form: 6.28 us against
            # 6.92 with block 0 writing it all, 5.69 without it)
            if write_xo:
                for i in range(b * nthr + tid, k, cuda.gridDim.x * nthr):
                    xo[0, _U(i)] = x[0, _U(i)] * inv * nw[_U(i)]
            if q8_out:
                kq8.quantize_row(x, nw, inv, k, gq, gd, gs, b * nthr + tid, cuda.gridDim.x * nthr)
        _warp_reduce(acc, rows, red)
        if lane == 0:
            for o in range(rows):
                r = r0 + o
                v = acc[o]
                if m == 0:
                    if r < na:
                        oa[0, _U(r)] = v + oa[0, _U(r)] if acca else v
                elif m == 1:
                    if r < nb:
                        ob[0, _U(r)] = v + ob[0, _U(r)] if accb else v
                elif r < nc:
                    oc[0, _U(r)] = v + oc[0, _U(r)] if accc else v

    _KERNELS[key] = dense
    return dense


def _gate_up_fn(tg: tuple, tu: tuple, k: int, rows: int):
    """The experts' gate and up matrices with SwiGLU in the epilogue, over VRAM slots (memoized)."""
    key = ("gate_up", tg, tu, k, rows)
    if key in _KERNELS:
        return _KERNELS[key]
    dg, du = _dot_rows(*tg, rows), _dot_rows(*tu, rows)
    rows2 = 2 * rows  # local array sizes must be constants of the kernel, not expressions in it
    ch, nch = _chunks(k)
    cu, nunits = ch // UNIT, k // UNIT
    warps, nthr = MV_WARPS, MV_WARPS * LANES

    @cuda.jit(cache=True)
    def gate_up(w8g, wvg, whg, w8u, wvu, whu, slot_bytes, off_g, off_u, rbg, rbu, nrows, slot_of, ids, x, h,
                ntok):
        xs = cuda.shared.array(ch, float32)
        red = cuda.shared.array(_RED, float32)
        q = cuda.local.array(UNIT, float32)
        xv = cuda.local.array(UNIT, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        sx = cuda.local.array(4, float32)
        acc = cuda.local.array(rows2, float32)  # gate rows, then up rows
        tid = cuda.threadIdx.x
        lane = tid & LANE_MASK
        kk = ids.shape[1]
        r0 = (cuda.blockIdx.x * warps + (tid >> WARP_SHIFT)) * rows
        for i in range(cuda.blockIdx.y, ntok * kk, cuda.gridDim.y):
            t = i // kk
            slot = slot_of[_U(ids[_U(t), _U(i - t * kk)])]
            if slot >= 0:  # the same for the whole block: its barriers are safe
                base = slot * slot_bytes
                for o in range(rows2):
                    acc[o] = _ZERO
                for c in range(nch):
                    cuda.syncthreads()
                    for j in range(tid, ch, nthr):
                        if c * ch + j < k:
                            xs[j] = x[_U(t), _U(c * ch + j)]
                    cuda.syncthreads()
                    u0 = c * cu
                    u1 = min(nunits, u0 + cu)
                    dg(w8g, wvg, whg, base + off_g, rbg, r0, nrows - 1, u0, u1, xs, c * ch, q, s, mn, xv, sx, acc, 0)
                    du(w8u, wvu, whu, base + off_u, rbu, r0, nrows - 1, u0, u1, xs, c * ch, q, s, mn, xv, sx, acc,
                       rows)
                _warp_reduce(acc, rows2, red)
                if lane == 0:
                    for o in range(rows):
                        if r0 + o < nrows:
                            g = acc[o]
                            # exp's argument capped: silu(g) is 0 to float32 precision below -80 (no overflow)
                            h[_U(i), _U(r0 + o)] = g / (_ONE + float32(math.exp(min(-g, _EXP_CAP)))) * acc[rows + o]

    _KERNELS[key] = gate_up
    return gate_up


def _down_fn(td: tuple, k: int, rows: int):
    """The experts' down matrices, weighted and summed over a token's resident choices, added to the residual
    stream in the epilogue (memoized). A block owns `rows` rows of every choice: its warps take different choices
    (so their weight loads are in flight together), reading each choice's h row straight from global memory (a
    shared-memory stage of every choice's row would put k * F / threads loads a thread before the first weight
    load), and their sums meet in shared memory in warp order (deterministic)."""
    key = ("down", td, k, rows)
    if key in _KERNELS:
        return _KERNELS[key]
    dd = _dot_rows(*td, rows)
    nunits = k // UNIT
    warps, nthr = MV_WARPS_WIDE, MV_WARPS_WIDE * LANES
    red_len = MV_WARPS_WIDE * rows

    @cuda.jit(cache=True)
    def down(w8, wv, wh, slot_bytes, off, rb, nrows, slot_of, ids, wts, h, out, ntok):
        red = cuda.shared.array(red_len, float32)
        q = cuda.local.array(UNIT, float32)
        xv = cuda.local.array(UNIT, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        sx = cuda.local.array(4, float32)
        acc = cuda.local.array(rows, float32)
        accj = cuda.local.array(rows, float32)
        tid = cuda.threadIdx.x
        lane = tid & LANE_MASK
        w = tid >> WARP_SHIFT
        kk = ids.shape[1]
        r0 = cuda.blockIdx.x * rows
        for t in range(cuda.blockIdx.y, ntok, cuda.gridDim.y):
            for o in range(rows):
                acc[o] = _ZERO
            for j in range(w, kk, warps):
                slot = slot_of[_U(ids[_U(t), _U(j)])]
                if slot >= 0:  # the same for the whole warp
                    for o in range(rows):
                        accj[o] = _ZERO
                    dd(w8, wv, wh, slot * slot_bytes + off, rb, r0, nrows - 1, 0, nunits, h[_U(t * kk + j)], 0, q,
                       s, mn, xv, sx, accj, 0)
                    wj = wts[_U(t), _U(j)]
                    for o in range(rows):  # the weight distributes over the lanes' partial sums
                        acc[o] += wj * accj[o]
            _warp_reduce(acc, rows, red)
            cuda.syncthreads()  # red is free (the previous token's sums were read)
            if lane == 0:
                for o in range(rows):
                    red[w * rows + o] = acc[o]
            cuda.syncthreads()
            for o in range(tid, rows, nthr):
                if r0 + o < nrows:
                    v = red[o]
                    for ww in range(1, warps):
                        v += red[ww * rows + o]
                    out[_U(t), _U(r0 + o)] += v

    _KERNELS[key] = down
    return down


def _tile_unit_fn(qtype: int, word: int):
    """tile_unit(w8, wv, wh, base, rb, u, r0, nrows, x, xrows, nj, q, s, mn, w, xv, acc): one unit u of the rows
    r0..r0+TILE_ROWS-1 (clamped to nrows - 1; the caller drops their sums) of the matrix at byte base, decoded once
    into w, against the rows xrows[j] of the activations x (uint64 pairs) for j < nj <= TILE_TOKS, added into
    acc[o * TILE_TOKS + j]. The body of the prompt kernels, dense and grouped by expert (memoized)."""
    key = ("tile_unit", qtype, word)
    if key in _KERNELS:
        return _KERNELS[key]
    lay = LAYOUTS[qtype]
    unit, pos = lay.unit, lay.pos
    rows, toks = TILE_ROWS, TILE_TOKS

    @cuda.jit(**_DEV)
    def tile_unit(w8, wv, wh, base, rb, u, r0, nrows, x, xrows, nj, q, s, mn, w, xv, acc):
        for o in range(rows):
            r = r0 + o if r0 + o < nrows else nrows - 1
            unit(w8, wv, wh, word, base + r * rb, u, q, s, mn)
            for i in range(4):
                for e in range(4):
                    w[UNIT * o + 4 * i + e] = s[i] * q[4 * i + e] - mn[i]
        for j in range(toks):
            if j < nj:
                for i in range(4):
                    _load_run(x, xrows[j], pos(u, i), xv, 4 * i)
                for o in range(rows):
                    a = acc[o * toks + j]
                    for c in range(UNIT):
                        a += w[UNIT * o + c] * xv[c]
                    acc[o * toks + j] = a

    _KERNELS[key] = tile_unit
    return tile_unit


def _tiled_fn(qtype: int, word: int):
    """The prompt kernel of one quant type and word size (memoized)."""
    key = ("tile", qtype, word)
    if key in _KERNELS:
        return _KERNELS[key]
    tile_unit = _tile_unit_fn(qtype, word)
    rows, toks, warps = TILE_ROWS, TILE_TOKS, TILE_WARPS
    wlen, alen = rows * UNIT, rows * toks  # local array sizes must be compile-time constants

    @cuda.jit(cache=True)
    def tiled(w8, wv, wh, rb, nunits, nrows, x, out, ntok, accum):
        """out[t] (+)= W . x[t] for t < ntok: a warp takes tiles of `rows` rows x `toks` tokens."""
        sh = cuda.shared.array(_SH, float32)
        q = cuda.local.array(UNIT, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        w = cuda.local.array(wlen, float32)
        xv = cuda.local.array(UNIT, float32)
        acc = cuda.local.array(alen, float32)
        xrows = cuda.local.array(toks, np.int64)
        lane = cuda.threadIdx.x & LANE_MASK
        ngroups = (nrows + rows - 1) // rows
        ntt = (ntok + toks - 1) // toks
        gw = cuda.blockIdx.x * warps + (cuda.threadIdx.x >> WARP_SHIFT)
        for tt in range(cuda.blockIdx.y, ntt, cuda.gridDim.y):
            t0 = tt * toks
            nj = min(toks, ntok - t0)
            for j in range(toks):
                xrows[j] = t0 + j
            for g in range(gw, ngroups, cuda.gridDim.x * warps):
                r0 = g * rows
                for c in range(alen):
                    acc[c] = _ZERO
                for u in range(lane, nunits, LANES):
                    tile_unit(w8, wv, wh, 0, rb, u, r0, nrows, x, xrows, nj, q, s, mn, w, xv, acc)
                _warp_reduce(acc, alen, sh)
                if lane == 0:
                    for c in range(alen):
                        r = r0 + c // toks
                        t = t0 + c % toks
                        if r < nrows and t < ntok:
                            v = acc[c]
                            if accum:
                                v += out[_U(t), _U(r)]
                            out[_U(t), _U(r)] = v

    _KERNELS[key] = tiled
    return tiled


def _tiled_experts_fn(qtype: int, word: int):
    """The prompt kernel of one expert matrix type over the entries grouped by expert (memoized)."""
    key = ("tile_experts", qtype, word)
    if key in _KERNELS:
        return _KERNELS[key]
    tile_unit = _tile_unit_fn(qtype, word)
    rows, toks, warps = TILE_ROWS, TILE_TOKS, TILE_WARPS
    wlen, alen = rows * UNIT, rows * toks

    @cuda.jit(cache=True)
    def tiled_experts(w8, wv, wh, slot_bytes, off, rb, nunits, nrows, tiles, ntiles, order, div, x, out):
        """Tile i < ntiles[0] is (slot, start, count): out[e] = W_slot . x[e // div] for its entries e in
        order[start:start + count] (count <= toks); a warp takes `rows` rows of one tile at a time."""
        sh = cuda.shared.array(_SH, float32)
        q = cuda.local.array(UNIT, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        w = cuda.local.array(wlen, float32)
        xv = cuda.local.array(UNIT, float32)
        acc = cuda.local.array(alen, float32)
        xrows = cuda.local.array(toks, np.int64)
        lane = cuda.threadIdx.x & LANE_MASK
        ngroups = (nrows + rows - 1) // rows
        gw = cuda.blockIdx.x * warps + (cuda.threadIdx.x >> WARP_SHIFT)
        for tt in range(cuda.blockIdx.y, ntiles[0], cuda.gridDim.y):
            base = tiles[_U(tt), 0] * slot_bytes + off
            j0 = tiles[_U(tt), 1]
            nj = tiles[_U(tt), 2]
            for j in range(toks):
                xrows[j] = order[_U(j0 + min(j, nj - 1))] // div
            for g in range(gw, ngroups, cuda.gridDim.x * warps):
                r0 = g * rows
                for c in range(alen):
                    acc[c] = _ZERO
                for u in range(lane, nunits, LANES):
                    tile_unit(w8, wv, wh, base, rb, u, r0, nrows, x, xrows, nj, q, s, mn, w, xv, acc)
                _warp_reduce(acc, alen, sh)
                if lane == 0:
                    for c in range(alen):
                        r = r0 + c // toks
                        j = c % toks
                        if r < nrows and j < nj:
                            out[_U(order[_U(j0 + j)]), _U(r)] = acc[c]

    _KERNELS[key] = tiled_experts
    return tiled_experts


def _embed_fn(qtype: int, word: int):
    """The embedding kernel of one quant type and word size (memoized)."""
    key = ("embed", qtype, word)
    if key in _KERNELS:
        return _KERNELS[key]
    lay = LAYOUTS[qtype]
    unit, pos = lay.unit, lay.pos

    @cuda.jit(cache=True)
    def embed(w8, wv, wh, rb, nunits, nrows, tokens, out, ntok):
        """out[t] = row tokens[t] of the table, one unit per thread. A token outside the table leaves its output
        row as it was: the host validates token ids, this only keeps a bad one from faulting the context."""
        q = cuda.local.array(UNIT, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        for idx in range(cuda.grid(1), ntok * nunits, cuda.gridsize(1)):
            t = idx // nunits
            u = idx - t * nunits
            r = tokens[_U(t)]
            if r >= 0 and r < nrows:
                unit(w8, wv, wh, word, r * rb, u, q, s, mn)
                for i in range(4):
                    p = pos(u, i)
                    for e in range(4):
                        out[_U(t), _U(p + e)] = s[i] * q[4 * i + e] - mn[i]

    _KERNELS[key] = embed
    return embed


# ---- launch helpers

def _layout(qtype: int):
    lay = LAYOUTS.get(qtype)
    if lay is None:
        raise StrataError(f"GPU matmul: unsupported quant type {qname(qtype)}")
    return lay


def _row_elems(qtype: int, row_bytes: int) -> int:
    lay = _layout(qtype)
    if row_bytes <= 0 or row_bytes % lay.block_bytes:
        raise StrataError(f"GPU matmul: {qname(qtype)} rows of {row_bytes} bytes are not whole blocks of "
                          f"{lay.block_bytes} bytes (float rows need a multiple of {UNIT} elements)")
    return row_bytes // lay.block_bytes * lay.block_elems


def _check_u8(arr) -> None:
    if arr.dtype != np.uint8 or len(arr.shape) != 2:
        raise StrataError(f"GPU matmul: weights must be a 2-D uint8 device array, got {arr.dtype} {arr.shape}")


def _views(arr, word4: bool):
    """A C-contiguous uint8 device array [m, bytes] as the flat (uint8, word, float16) views the unit primitives
    read (no copy), and the word size: uint32 words where word4, else uint16."""
    try:
        flat = arr.reshape(arr.shape[0] * arr.shape[1])
    except NotImplementedError:  # numba: "operation requires copying"
        raise StrataError(f"GPU matmul: weights {arr.shape} are not C-contiguous") from None
    return flat, flat.view(np.uint32 if word4 else np.uint16), flat.view(np.float16), 4 if word4 else 2


def _check_act(what: str, a, nrow: int, ncol: int) -> None:
    if len(a.shape) != 2 or a.shape[0] < nrow or a.shape[1] != ncol or a.dtype != np.float32:
        raise StrataError(f"GPU matmul: {what} must be float32 [>={nrow}, {ncol}], got {a.dtype} {a.shape}")


def _check_q8(what: str, q8, nrow: int, k: int) -> None:
    """q8: (xq, xd, xs) device arrays of the int8 form of >= nrow rows of k elements (matvec_q8.q8_shapes)."""
    if len(q8) != 3:
        raise StrataError(f"GPU matmul: the int8 form of {what} is (words, scales, sums), got {len(q8)} arrays")
    for a, (n, dt) in zip(q8, kq8.q8_shapes(k)):
        if len(a.shape) != 2 or a.shape[0] < nrow or a.shape[1] != n or a.dtype != dt:
            raise StrataError(f"GPU matmul: the int8 form of {what} must be {np.dtype(dt)} [>={nrow}, {n}], got "
                              f"{a.dtype} {a.shape}")


def q8_rows_ok(k: int) -> bool:
    """Whether rows of k elements have a global int8 form (matvec_q8.q8_shapes) the kernels read and write."""
    return kq8.supports((Q8_0,), k)


def _pairs(x):
    """Activations f32[T, K] (C-contiguous) as uint64 pairs [T, K/2], the kernels' view of them; no copy."""
    try:
        return x.view(np.uint64)
    except ValueError:
        raise StrataError(f"GPU matmul: activations {x.shape} must be C-contiguous") from None


def _mv_rows(total_rows: int) -> int:
    """Rows per warp: MV_ROWS, or MV_ROWS_SMALL when that would leave the GPU with fewer than ~2 blocks per SM."""
    return MV_ROWS if -(-total_rows // (MV_ROWS * MV_WARPS)) >= 264 else MV_ROWS_SMALL


def _mv_shape(k: int, total_rows: int) -> tuple[int, int]:
    """(warps a block, rows a warp) of a dense matrix-vector launch. A block first stages the row (k / threads
    loads a thread, on the critical path), so long rows take 8 warps of one row, launches too short to fill the GPU
    4 warps of one row (more blocks, each staging the row with its loads issued together), the rest 4 warps of 2
    rows, or 4 for huge launches (the head). Measured on an H200 at Qwen3-30B-A3B shapes
    (bench/gpu/matvec_variants.py): K=4096 x 2048 rows 9.9 us at 8x1 vs 12.5 at 4x2 and 17.0 at 4x4; 5120 rows of
    K=2048 12.7 at 4x2 vs 13.6 at 4x4 and 15.8 at 8x1. The router (F32 128 x 2048 + its RMSNorm) on an H100
    (bench/gpu/kernel_probe.py): 5.7 us at 4x1, 7.9 at 8x1, 10.3 at 2x1, 16.5 at 1x1."""
    if k > 2048:
        return MV_WARPS_WIDE, 1
    if total_rows < 1024:
        return MV_WARPS, 1
    return MV_WARPS, (MV_ROWS if total_rows >= 32768 else MV_ROWS_SMALL)


def matmul(qtype: int, w, x, out, ntok: int, stream, accumulate: bool = False, q8: bool = False) -> None:
    """out[t, r] (+)= dequant(w[r]) . x[t] for t < ntok. w u8[N, row_bytes], x f32[>=ntok, K], out f32[>=ntok, N]
    (device arrays). ntok == 1 runs the matrix-vector kernel (int8 activations where q8 and the type has them),
    larger ntok the tiled one."""
    if ntok <= 0:
        return
    if ntok == 1:
        matvec([(qtype, w, out, accumulate)], x, stream, q8=q8)
        return
    lay = _layout(qtype)
    _check_u8(w)
    nrows, rb = w.shape
    k = _row_elems(qtype, rb)
    _check_act("x", x, ntok, k)
    _check_act("out", out, ntok, nrows)
    w8, wv, wh, word = _views(w, lay.word4 and rb % 4 == 0)
    grid = (min(-(-nrows // (TILE_ROWS * TILE_WARPS)), MAX_GRID_X), min(-(-ntok // TILE_TOKS), MAX_GRID_Y))
    _tiled_fn(qtype, word)[grid, LANES * TILE_WARPS, stream](w8, wv, wh, rb, k // UNIT, nrows, _pairs(x), out,
                                                              ntok, int(accumulate))


def matvec(mats, x, stream, norm=None, eps: float = 0.0, x_out=None, q8: bool = False, q8_out=None) -> None:
    """For each (qtype, w, out, accumulate) of mats (one to three matrices of the same row length K):
    out[0, r] (+)= dequant(w[r]) . xn, where xn = x[0] or, with norm (f32[K]), rmsnorm(x[0]) * norm (eps as
    cuda_kernels.ops.rmsnorm); x_out f32[>=1, K], if given with norm, receives xn, and q8_out (q8_rows_ok(K)) xn's
    int8 form (matvec_q8.q8_shapes: what moe_gate_up reads). One launch; q8: with xn quantized to int8
    (cuda_kernels/matvec_q8.py) where every matrix's type has that kernel."""
    if not 1 <= len(mats) <= 3:
        raise StrataError(f"GPU matvec: 1 to 3 matrices per launch, got {len(mats)}")
    if norm is None and x_out is not None:
        raise StrataError("GPU matvec: x_out is the normalized row; it needs a norm")
    args, types, k, blocks, total = [], [], None, [], 0
    for qtype, w, out, accumulate in mats:
        lay = _layout(qtype)
        _check_u8(w)
        nrows, rb = w.shape
        kk = _row_elems(qtype, rb)
        if k is not None and kk != k:
            raise StrataError(f"GPU matvec: matrices of one launch must share the row length ({k} vs {kk})")
        k = kk
        _check_act("out", out, 1, nrows)
        w8, wv, wh, word = _views(w, lay.word4 and rb % 4 == 0)
        types.append((qtype, word))
        args.append((w8, wv, wh, rb, nrows, out, int(accumulate)))
        total += nrows
    _check_act("x", x, 1, k)
    warps, rows = _mv_shape(k, total)
    blocks = [-(-a[4] // (rows * warps)) for a in args]
    while len(args) < 3:  # absent matrices: no blocks
        args.append(args[0])
        blocks.append(0)
    if norm is not None and norm.shape[0] != k:
        raise StrataError(f"GPU matvec: norm weight of {norm.shape[0]} for rows of {k}")
    nw = norm if norm is not None else x[0]
    xo = x_out if x_out is not None else x
    if q8_out is not None:
        if norm is None or not q8_rows_ok(k):
            raise StrataError(f"GPU matvec: the int8 form of the row is written with a norm, for rows of a multiple"
                              f" of 256 elements (got {k}{'' if norm is not None else ', no norm'})")
        _check_q8("x_out", q8_out, 1, k)
    qo = q8_out is not None
    if q8 and kq8.supports([t for t, _ in types], k):
        fn = kq8.dense_fn(tuple(types), k, rows, warps, norm is not None, _RED, qo)
    else:
        fn = _dense_fn(tuple(types), k, rows, warps, norm is not None, qo)
    fn[sum(blocks), LANES * warps, stream](x, nw, float(eps), xo, int(x_out is not None),
                                              *args[0], blocks[0], *args[1], blocks[1], *args[2],
                                              *(q8_out if qo else (x, x, x)))


def embed(qtype: int, table, tokens, out, ntok: int, stream) -> None:
    """out[t] = dequant(table[tokens[t]]) for t < ntok. table u8[V, row_bytes], tokens int32[>=ntok], out
    f32[>=ntok, K] (device arrays)."""
    if ntok <= 0:
        return
    lay = _layout(qtype)
    _check_u8(table)
    nrows, rb = table.shape
    k = _row_elems(qtype, rb)
    _check_act("out", out, ntok, k)
    if tokens.shape[0] < ntok:
        raise StrataError(f"GPU embed: {ntok} tokens requested from a token array of {tokens.shape[0]}")
    w8, wv, wh, word = _views(table, lay.word4 and rb % 4 == 0)
    nunits = k // UNIT
    grid = min(-(-ntok * nunits // EMBED_THREADS), MAX_GRID_X)
    _embed_fn(qtype, word)[grid, EMBED_THREADS, stream](w8, wv, wh, rb, nunits, nrows, tokens, out, ntok)


def _slot_views(slots, qtype: int, mat_off: int, nrows: int, row_bytes: int):
    """The weight views of one matrix inside every expert slot (at byte mat_off of each), and its word size."""
    lay = _layout(qtype)
    _check_u8(slots)
    slot_bytes = slots.shape[1]
    if mat_off < 0 or mat_off % 2 or row_bytes % 2 or slot_bytes % 2 or mat_off + nrows * row_bytes > slot_bytes:
        raise StrataError(f"GPU experts: matrix at byte {mat_off} ({nrows} x {row_bytes} bytes) does not fit "
                          f"2-aligned in slots of {slot_bytes} bytes")
    return _views(slots, lay.word4 and row_bytes % 4 == 0 and mat_off % 4 == 0 and slot_bytes % 4 == 0)


def moe_gate_up(gate, up, slots, nrows: int, slot_of, ids, x, h, ntok: int, stream, xq8=None, hq8=None) -> None:
    """h[i, r] = silu(G_s[r] . x[t]) * (U_s[r] . x[t]) for every entry i = t*k + j whose expert has a VRAM slot
    s = slot_of[ids[t, j]] >= 0; other entries keep what they held. gate, up: (qtype, byte offset in a slot,
    row bytes) of the nrows x K matrices; slots u8[n_slots, slot_bytes]; slot_of int32[E]; ids int32[>=ntok, k];
    x f32[>=ntok, K]; h f32[>=ntok*k, nrows]. xq8: x's rows in their int8 form (matvec_q8.q8_shapes(K)), used
    where both types have int8 kernels; hq8: h's rows also written in that form (for moe_down), with xq8 only."""
    if ntok <= 0:
        return
    (qg, og, rbg), (qu, ou, rbu) = gate, up
    k = _row_elems(qg, rbg)
    if _row_elems(qu, rbu) != k:
        raise StrataError("GPU experts: gate and up rows differ in length")
    w8g, wvg, whg, wdg = _slot_views(slots, qg, og, nrows, rbg)
    w8u, wvu, whu, wdu = _slot_views(slots, qu, ou, nrows, rbu)
    if ids.shape[0] < ntok:
        raise StrataError(f"GPU experts: ids has {ids.shape[0]} rows for {ntok} tokens")
    nent = ntok * ids.shape[1]
    _check_act("x", x, ntok, k)
    _check_act("h", h, nent, nrows)
    if xq8 is not None and kq8.supports((qg, qu), k):
        _check_q8("x", xq8, ntok, k)
        quant = hq8 is not None
        if quant:
            if not q8_rows_ok(nrows):
                raise StrataError(f"GPU experts: an int8 h needs rows of a multiple of 256 elements, got {nrows}")
            _check_q8("h", hq8, nent, nrows)
        grid = (-(-nrows // (GU_ROWS * GU_WARPS)), min(nent, MAX_GRID_Y))
        fn = kq8.gate_up_fn((qg, wdg), (qu, wdu), k, GU_ROWS, GU_WARPS, quant)
        fn[grid, LANES * GU_WARPS, stream](w8g, wvg, whg, w8u, wvu, whu, slots.shape[1], og, ou, rbg, rbu, nrows,
                                           slot_of, ids, *xq8, h, *(hq8 if quant else xq8), ntok)
        return
    if hq8 is not None:
        raise StrataError("GPU experts: an int8 h comes from the int8 kernel (xq8, types with int8 kernels)")
    rows = _mv_rows(nrows * nent)
    grid = (-(-nrows // (rows * MV_WARPS)), min(nent, MAX_GRID_Y))
    _gate_up_fn((qg, wdg), (qu, wdu), k, rows)[grid, LANES * MV_WARPS, stream](
        w8g, wvg, whg, w8u, wvu, whu, slots.shape[1], og, ou, rbg, rbu, nrows, slot_of, ids, x, h, ntok)


def moe_tiled(mat, slots, nrows: int, grouping, x, div: int, out, stream) -> None:
    """The prompt form of the expert matrices: out[e] = M_s . x[e // div] for every entry e that
    ops.group_experts grouped (by expert, s its slot), with the dense prompt kernel's tiles, so a chunk reads each
    expert's rows once per TILE_TOKS of its entries instead of once per entry. mat: (qtype, byte offset in a slot,
    row bytes) of the nrows x K matrix; slots u8[n_slots, slot_bytes]; grouping: (order, tiles, ntiles, max tiles)
    of group_experts; x f32[rows, K] (div = k: token rows; 1: entry rows); out f32[entries, nrows]."""
    qt, off, rb = mat
    k = _row_elems(qt, rb)
    w8, wv, wh, word = _slot_views(slots, qt, off, nrows, rb)
    order, tiles, ntiles, max_tiles = grouping
    if x.shape[1] != k or out.shape[1] != nrows:
        raise StrataError(f"GPU experts: x {x.shape} / out {out.shape} do not fit a {nrows} x {k} matrix")
    grid = (min(-(-nrows // (TILE_ROWS * TILE_WARPS)), MAX_GRID_X), min(max_tiles, MAX_GRID_Y))
    _tiled_experts_fn(qt, word)[grid, LANES * TILE_WARPS, stream](w8, wv, wh, slots.shape[1], off, rb, k // UNIT,
                                                                   nrows, tiles, ntiles, order, div, _pairs(x), out)


def moe_down(down, slots, nrows: int, slot_of, ids, wts, h, out, ntok: int, stream, hq8=None) -> None:
    """out[t, r] += sum over j (in order) of wts[t, j] * (D_s[r] . h[t*k + j]) over the choices whose expert has a
    VRAM slot s = slot_of[ids[t, j]] >= 0. down: (qtype, byte offset in a slot, row bytes) of the nrows x F
    matrix; h f32[>=ntok*k, F]; wts f32[>=ntok, k]; out f32[>=ntok, nrows] (the residual stream). hq8: h's rows
    in their int8 form (moe_gate_up's hq8), used where the type has an int8 kernel."""
    if ntok <= 0:
        return
    qd, od, rbd = down
    f = _row_elems(qd, rbd)
    w8, wv, wh, wd = _slot_views(slots, qd, od, nrows, rbd)
    if ids.shape[0] < ntok or wts.shape[0] < ntok or wts.shape[1] != ids.shape[1]:
        raise StrataError(f"GPU experts: ids {ids.shape} / weights {wts.shape} do not fit {ntok} tokens")
    _check_act("h", h, ntok * ids.shape[1], f)
    _check_act("out", out, ntok, nrows)
    q8 = hq8 is not None and kq8.supports((qd,), f)
    rows = MV_ROWS_DOWN_Q8 if q8 else MV_ROWS_DOWN
    grid = (-(-nrows // rows), min(ntok, MAX_GRID_Y))
    if q8:
        _check_q8("h", hq8, ntok * ids.shape[1], f)
        kq8.down_fn((qd, wd), f, rows, MV_WARPS_WIDE)[grid, LANES * MV_WARPS_WIDE, stream](
            w8, wv, wh, slots.shape[1], od, rbd, nrows, slot_of, ids, wts, *hq8, out, ntok)
        return
    _down_fn((qd, wd), f, rows)[grid, LANES * MV_WARPS_WIDE, stream](w8, wv, wh, slots.shape[1], od, rbd,
                                                                      nrows, slot_of, ids, wts, h, out, ntok)
