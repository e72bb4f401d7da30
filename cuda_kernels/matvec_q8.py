"""Decode matrix-vector kernels with int8 activations and integer dot products (dp4a), llama.cpp's mmvq way.

The float kernels of cuda_kernels/matmul.py decode every weight into a float32 and multiply it by a float32
activation: ~130 instructions per 16 weights (SASS of the Q/K/V kernel), which one memory round per warp cannot
hide. Here the block first quantizes the activation row into shared memory (int8 per 32 elements with one float
scale, llama.cpp's q8_1: xq holds 4 int8 a word, xd the scales, xs the scaled sums of every 16 elements), then each
lane unpacks 4 weights at a time with a mask and a shift and multiplies them by 4 activations in one dp4a, so a
32-weight unit costs ~45 instructions. The weights' scales and mins apply once per 16 or 32 weights, to an exact
integer sum; the mins use xs (sum of the weights' x) as the CPU fast path uses its bsums.

The dense kernel takes matmul.py's dense arguments and launch (matmul.matvec chooses between them). The experts'
kernels work on a global int8 form of their activations (q8_shapes: what a block would stage): the routing launch
writes x's (dense_fn's q8_out, or matmul's float kernel for an F32 router), gate_up_fn reads it with no staging
pass and no barrier before its first weight loads (a block's stage and sync were ~1.5 us of every expert launch)
and writes h's int8 form in its epilogue (a block owns 32 rows: one int8 block of h), which down_fn reads (8
choices of h as floats were 3x the bytes of their int8 form, read by every block). Types: Q4_K, Q6_K, Q8_0 (nearly
every byte of a Q4_K_M file); rows of a multiple of 256 elements. Anything else takes the float kernels.

Units: unit v of a row covers 32 weights in two halves of 16 (a, b), each half with one weight scale:
  Q4_K  v = 8b + 2g + h: qs bytes 32g+16h..+15; low nibbles -> elements 64g+16h.. (chunk 2g), high nibbles ->
        64g+32+16h.. (chunk 2g+1) of super-block b
  Q6_K  v = 8b + 4h + 2l + p: ql bytes 64h+16l.. (half a) and 64h+32+16l.. (half b), nibble p, qh bytes
        128+32h+16l.. bits 4p.. (a) and 4p+2.. (b) -> elements 128h+64p+16l.. (a) and that + 32 (b)
  Q8_0  v = block v: its 32 int8 quants
Lane l of a warp takes units l, l+32, ... (adjacent lanes read adjacent weight bytes).
In numba's CUDA simulator (one-lane warps, tests/conftest.py) dp4a is a Python twin and one thread quantizes whole
32-element blocks, so the same arithmetic runs without shuffles.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32, types, uint32
from numba.core import config

from strata_nb.cpu_kernels.qtypes import Q4_K, Q6_K, Q8_0
from strata_nb.cuda_kernels.block import block_sum
from strata_nb.cuda_kernels.quant import _DEV, _U, _h, _ld8, _ld32, _scales_k4

SIM = bool(config.ENABLE_CUDASIM)
LANES = 1 if SIM else 32
LANE_MASK, WARP_SHIFT = LANES - 1, (LANES - 1).bit_length()
TYPES = frozenset((Q4_K, Q6_K, Q8_0))
MAX_K = 16384  # shared memory: 1.375 bytes an element (xq, xd, xs)
_FULL = 0xFFFFFFFF
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_I127 = np.float32(127.0)
_EXP_CAP = np.float32(80.0)
_M4 = np.uint32(0x0F0F0F0F)
_M2 = np.uint32(0x03030303)
_KERNELS: dict[tuple, object] = {}


def supports(qtypes, k: int) -> bool:
    """Whether every matrix of a launch (qtypes) with rows of k elements has an int8 kernel here."""
    return all(q in TYPES for q in qtypes) and k % 256 == 0 and k <= MAX_K


if SIM:
    @cuda.jit(device=True)
    def _dp4a(a, b, c, signed_a):
        s = int(c)
        for e in range(4):
            ab = (int(a) >> (8 * e)) & 255
            bb = (int(b) >> (8 * e)) & 255
            if signed_a and ab > 127:
                ab -= 256
            if bb > 127:
                bb -= 256
            s += ab * bb
        return np.int32(s)

    @cuda.jit(device=True)
    def dp4a_us(a, b, c):
        """c + the dot of a's 4 unsigned bytes with b's 4 signed bytes."""
        return _dp4a(a, b, c, False)

    @cuda.jit(device=True)
    def dp4a_ss(a, b, c):
        """c + the dot of a's 4 signed bytes with b's 4 signed bytes."""
        return _dp4a(a, b, c, True)

    @cuda.jit(device=True)
    def _rint(v):
        return np.rint(v)
else:
    from llvmlite import ir
    from numba.cuda import libdevice
    from numba.cuda.extending import intrinsic

    def _dp4a_intrinsic(kind: str):
        # NVVM has no dp4a intrinsic: the PTX instruction by inline assembly (ptxas maps it to IDP.4A)
        @intrinsic
        def dp4a(typingctx, a, b, c):
            sig = types.int32(types.uint32, types.uint32, types.int32)

            def codegen(context, builder, signature, args):
                i32 = ir.IntType(32)
                asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32, i32]), f"dp4a.{kind}.s32 $0, $1, $2, $3;",
                                   "=r,r,r,r")
                return builder.call(asm, args)
            return sig, codegen
        return dp4a

    dp4a_us = _dp4a_intrinsic("u32")
    dp4a_ss = _dp4a_intrinsic("s32")

    @cuda.jit(**_DEV)
    def _rint(v):
        return libdevice.rintf(v)


@cuda.jit(**_DEV)
def _q8(v, inv):
    """v quantized to int8 (|v| * inv <= 127), as the low byte of a uint32."""
    return uint32(int32(_rint(v * inv))) & 255


if SIM:
    @cuda.jit(device=True)
    def _stage(x, t, nw, norm, k, xq, xd, xs, start, stride, scale):
        """Words start, start + stride, ... of row t of x (times nw where norm) times scale quantized into
        xq/xd/xs; returns this thread's sum of squares of them (for the norm). One simulated thread takes whole
        32-element blocks (blocks start, start + stride, ...)."""
        ss = _ZERO
        for blk in range(start, k >> 5, stride):
            a = _ZERO
            for e in range(32):
                v = x[t, _U(32 * blk + e)]
                if norm:
                    ss += v * v
                    v = v * nw[_U(32 * blk + e)]
                a = max(a, abs(v * scale))
            inv = _I127 / a if a > _ZERO else _ZERO
            d = a / _I127
            for hh in range(2):
                qs = 0
                for j in range(4):
                    wd = 0
                    for e in range(4):
                        i = 32 * blk + 16 * hh + 4 * j + e
                        v = x[t, _U(i)]
                        if norm:
                            v = v * nw[_U(i)]
                        qv = int(_q8(v * scale, inv))
                        wd |= qv << (8 * e)
                        qs += qv - 256 if qv > 127 else qv
                    xq[8 * blk + 4 * hh + j] = np.uint32(wd)
                xs[2 * blk + hh] = d * np.float32(qs)
            xd[blk] = d
        return ss
else:
    @cuda.jit(**_DEV)
    def _stage(x, t, nw, norm, k, xq, xd, xs, start, stride, scale):
        """Words start, start + stride, ... of row t of x (times nw where norm) times scale quantized into
        xq/xd/xs (shared or global memory); returns this thread's sum of squares of them (for the norm). A thread
        takes 4 elements (one word) at a time, 8 adjacent lanes one 32-element block (their maximum and sums by
        shuffles): k % 128 == 0 and start, stride multiples of 32 a warp keep whole warps inside the loop."""
        lane = cuda.threadIdx.x & LANE_MASK
        ss = _ZERO
        for w in range(start, k >> 2, stride):
            i = 4 * w
            v0 = x[t, _U(i)]
            v1 = x[t, _U(i + 1)]
            v2 = x[t, _U(i + 2)]
            v3 = x[t, _U(i + 3)]
            if norm:
                ss += v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3
                v0 *= nw[_U(i)]
                v1 *= nw[_U(i + 1)]
                v2 *= nw[_U(i + 2)]
                v3 *= nw[_U(i + 3)]
            v0, v1, v2, v3 = v0 * scale, v1 * scale, v2 * scale, v3 * scale
            a = max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3)))
            a = max(a, cuda.shfl_xor_sync(_FULL, a, 1))
            a = max(a, cuda.shfl_xor_sync(_FULL, a, 2))
            a = max(a, cuda.shfl_xor_sync(_FULL, a, 4))
            inv = _I127 / a if a > _ZERO else _ZERO
            q0, q1, q2, q3 = _q8(v0, inv), _q8(v1, inv), _q8(v2, inv), _q8(v3, inv)
            xq[w] = q0 | (q1 << 8) | (q2 << 16) | (q3 << 24)
            qs = dp4a_ss(xq[w], uint32(0x01010101), int32(0))  # the sum of the 4 signed bytes
            qs += cuda.shfl_xor_sync(_FULL, qs, 1)
            qs += cuda.shfl_xor_sync(_FULL, qs, 2)
            d = a / _I127
            if (lane & 3) == 0:
                xs[w >> 2] = d * float32(qs)
            if (lane & 7) == 0:
                xd[w >> 3] = d
        return ss


def _dot_fn(qtype: int, word: int, rows: int):
    """dot(w8, wv, wh, base, rb, r0, last, nunits, xq, xd, xs, s, mn, acc, ao): acc[ao + o] += this lane's units
    of row min(r0 + o, last) . the staged activations, for o < rows (rows past the end are clamped: the caller
    discards their sums, and the body has no branch). Row r is the bytes at base + r * rb. Memoized."""
    key = ("dot", qtype, word, rows)
    if key in _KERNELS:
        return _KERNELS[key]

    if qtype == Q4_K:
        @cuda.jit(**_DEV)
        def unit(w8, wv, wh, base, rb, v, r0, last, xq, xd, xs, s, mn, acc, ao):
            b, g, h = v >> 3, (v >> 1) & 3, v & 1
            e0 = 256 * b + 64 * g + 16 * h  # half a; half b is e0 + 32
            xa0, xa1, xa2, xa3 = xq[(e0 >> 2)], xq[(e0 >> 2) + 1], xq[(e0 >> 2) + 2], xq[(e0 >> 2) + 3]
            xb0, xb1, xb2, xb3 = xq[(e0 >> 2) + 8], xq[(e0 >> 2) + 9], xq[(e0 >> 2) + 10], xq[(e0 >> 2) + 11]
            da, db = xd[e0 >> 5], xd[(e0 >> 5) + 1]
            sa, sb = xs[e0 >> 4], xs[(e0 >> 4) + 2]
            c = 16 + 32 * g + 16 * h
            for o in range(rows):
                r = r0 + o if r0 + o < last else last
                bb = base + r * rb + 144 * b
                _scales_k4(wv, wh, word, bb, g, s, mn)
                w0 = _ld32(wv, word, bb, c)
                w1 = _ld32(wv, word, bb, c + 4)
                w2 = _ld32(wv, word, bb, c + 8)
                w3 = _ld32(wv, word, bb, c + 12)
                ia = dp4a_us(w0 & _M4, xa0, int32(0))
                ia = dp4a_us(w1 & _M4, xa1, ia)
                ia = dp4a_us(w2 & _M4, xa2, ia)
                ia = dp4a_us(w3 & _M4, xa3, ia)
                ib = dp4a_us((w0 >> 4) & _M4, xb0, int32(0))
                ib = dp4a_us((w1 >> 4) & _M4, xb1, ib)
                ib = dp4a_us((w2 >> 4) & _M4, xb2, ib)
                ib = dp4a_us((w3 >> 4) & _M4, xb3, ib)
                acc[ao + o] += (s[0] * (da * float32(ia)) - mn[0] * sa) + (s[2] * (db * float32(ib)) - mn[2] * sb)
    elif qtype == Q6_K:
        @cuda.jit(**_DEV)
        def unit(w8, wv, wh, base, rb, v, r0, last, xq, xd, xs, s, mn, acc, ao):
            b, h, lh, p = v >> 3, (v >> 2) & 1, (v >> 1) & 1, v & 1
            e0 = 256 * b + 128 * h + 64 * p + 16 * lh  # half a; half b is e0 + 32
            xa0, xa1, xa2, xa3 = xq[(e0 >> 2)], xq[(e0 >> 2) + 1], xq[(e0 >> 2) + 2], xq[(e0 >> 2) + 3]
            xb0, xb1, xb2, xb3 = xq[(e0 >> 2) + 8], xq[(e0 >> 2) + 9], xq[(e0 >> 2) + 10], xq[(e0 >> 2) + 11]
            da, db = xd[e0 >> 5], xd[(e0 >> 5) + 1]
            sa, sb = xs[e0 >> 4] * np.float32(32.0), xs[(e0 >> 4) + 2] * np.float32(32.0)
            cl = 64 * h + 16 * lh
            ch = 128 + 32 * h + 16 * lh
            sp = 4 * p
            for o in range(rows):
                r = r0 + o if r0 + o < last else last
                bb = base + r * rb + 210 * b
                d = _h(wh, bb, 208)
                sca = float32(int32(_ld8(w8, bb, 192 + 8 * h + lh + sp) ^ 0x80) - 128)
                scb = float32(int32(_ld8(w8, bb, 194 + 8 * h + lh + sp) ^ 0x80) - 128)
                ia = int32(0)
                ib = int32(0)
                q = _ld32(wv, word, bb, ch) >> sp
                ia = dp4a_us(((_ld32(wv, word, bb, cl) >> sp) & _M4) | ((q & _M2) << 4), xa0, ia)
                ib = dp4a_us(((_ld32(wv, word, bb, cl + 32) >> sp) & _M4) | (((q >> 2) & _M2) << 4), xb0, ib)
                q = _ld32(wv, word, bb, ch + 4) >> sp
                ia = dp4a_us(((_ld32(wv, word, bb, cl + 4) >> sp) & _M4) | ((q & _M2) << 4), xa1, ia)
                ib = dp4a_us(((_ld32(wv, word, bb, cl + 36) >> sp) & _M4) | (((q >> 2) & _M2) << 4), xb1, ib)
                q = _ld32(wv, word, bb, ch + 8) >> sp
                ia = dp4a_us(((_ld32(wv, word, bb, cl + 8) >> sp) & _M4) | ((q & _M2) << 4), xa2, ia)
                ib = dp4a_us(((_ld32(wv, word, bb, cl + 40) >> sp) & _M4) | (((q >> 2) & _M2) << 4), xb2, ib)
                q = _ld32(wv, word, bb, ch + 12) >> sp
                ia = dp4a_us(((_ld32(wv, word, bb, cl + 12) >> sp) & _M4) | ((q & _M2) << 4), xa3, ia)
                ib = dp4a_us(((_ld32(wv, word, bb, cl + 44) >> sp) & _M4) | (((q >> 2) & _M2) << 4), xb3, ib)
                # quants are stored + 32: sum((q - 32) x) = sum(q x) - 32 sum(x)
                acc[ao + o] += d * (sca * (da * float32(ia) - sa) + scb * (db * float32(ib) - sb))
    elif qtype == Q8_0:
        @cuda.jit(**_DEV)
        def unit(w8, wv, wh, base, rb, v, r0, last, xq, xd, xs, s, mn, acc, ao):
            x0, x1, x2, x3 = xq[8 * v], xq[8 * v + 1], xq[8 * v + 2], xq[8 * v + 3]
            x4, x5, x6, x7 = xq[8 * v + 4], xq[8 * v + 5], xq[8 * v + 6], xq[8 * v + 7]
            dx = xd[v]
            for o in range(rows):
                r = r0 + o if r0 + o < last else last
                bb = base + r * rb + 34 * v
                i = dp4a_ss(_ld32(wv, word, bb, 2), x0, int32(0))
                i = dp4a_ss(_ld32(wv, word, bb, 6), x1, i)
                i = dp4a_ss(_ld32(wv, word, bb, 10), x2, i)
                i = dp4a_ss(_ld32(wv, word, bb, 14), x3, i)
                i = dp4a_ss(_ld32(wv, word, bb, 18), x4, i)
                i = dp4a_ss(_ld32(wv, word, bb, 22), x5, i)
                i = dp4a_ss(_ld32(wv, word, bb, 26), x6, i)
                i = dp4a_ss(_ld32(wv, word, bb, 30), x7, i)
                acc[ao + o] += _h(wh, bb, 0) * (dx * float32(i))
    else:
        raise ValueError(f"no int8 kernel for quant type {qtype}")

    @cuda.jit(**_DEV)
    def dot(w8, wv, wh, base, rb, r0, last, nunits, xq, xd, xs, s, mn, acc, ao):
        # two units a step: straight-line code, so the compiler issues both units' loads in one memory round
        v = cuda.threadIdx.x & LANE_MASK
        while v + LANES < nunits:
            unit(w8, wv, wh, base, rb, v, r0, last, xq, xd, xs, s, mn, acc, ao)
            unit(w8, wv, wh, base, rb, v + LANES, r0, last, xq, xd, xs, s, mn, acc, ao)
            v += 2 * LANES
        if v < nunits:
            unit(w8, wv, wh, base, rb, v, r0, last, xq, xd, xs, s, mn, acc, ao)

    _KERNELS[key] = dot
    return dot


if SIM:
    @cuda.jit(device=True)
    def _warp_reduce(acc, n):
        return
else:
    @cuda.jit(**_DEV)
    def _warp_reduce(acc, n):
        """acc[c] summed over the warp's 32 lanes (butterfly shuffles: into every lane), for c < n."""
        for c in range(n):
            v = acc[c]
            v += cuda.shfl_xor_sync(_FULL, v, 16)
            v += cuda.shfl_xor_sync(_FULL, v, 8)
            v += cuda.shfl_xor_sync(_FULL, v, 4)
            v += cuda.shfl_xor_sync(_FULL, v, 2)
            v += cuda.shfl_xor_sync(_FULL, v, 1)
            acc[c] = v


@cuda.jit(**_DEV)
def quantize_row(x, nw, scale, k, gq, gd, gs, start, stride):
    """Words start, start + stride, ... of row 0 of x times nw times scale in its global int8 form (gq/gd/gs,
    q8_shapes); start and stride multiples of 32 per warp (whole warps take part in the shuffles)."""
    _stage(x, 0, nw, True, k, gq[0], gd[0], gs[0], start, stride, scale)


def q8_shapes(k: int) -> tuple[tuple[int, type], tuple[int, type], tuple[int, type]]:
    """Row lengths and dtypes of the global int8 form of rows of k elements (xq, xd, xs: as the blocks stage it):
    kernels that read it need no staging pass and no barrier before their first weight load."""
    return (k // 4, np.uint32), (k // 32, np.float32), (k // 16, np.float32)


def dense_fn(types_: tuple, k: int, rows: int, warps: int, norm: bool, red_len: int, q8_out: bool = False):
    """The int8 twin of matmul._dense_fn (same arguments and launch, plus gq/gd/gs): up to three matrices (types_:
    (qtype, word) pairs) reading one row of k elements, RMS-normalized when norm; q8_out: the blocks also write the
    normalized row's int8 form (a share each) to gq/gd/gs (q8_shapes). Memoized."""
    key = ("dense", types_, k, rows, warps, norm, q8_out)
    if key in _KERNELS:
        return _KERNELS[key]
    dots = [_dot_fn(qt, wd, rows) for qt, wd in types_]
    d0, d1, d2 = (dots + [dots[0]] * 3)[:3]
    nthr, nunits = warps * LANES, k // 32
    kw, kb, ks = k // 4, k // 32, k // 16

    @cuda.jit(cache=True)
    def dense(x, nw, eps, xo, write_xo,
              w8a, wva, wha, rba, na, oa, acca, nba,
              w8b, wvb, whb, rbb, nb, ob, accb, nbb,
              w8c, wvc, whc, rbc, nc, oc, accc, gq, gd, gs):
        xq = cuda.shared.array(kw, uint32)
        xd = cuda.shared.array(kb, float32)
        xs = cuda.shared.array(ks, float32)
        red = cuda.shared.array(red_len, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        acc = cuda.local.array(rows, float32)
        tid = cuda.threadIdx.x
        lane = tid & LANE_MASK
        b = cuda.blockIdx.x
        nblk = cuda.gridDim.x
        m = 0 if b < nba else (1 if b < nba + nbb else 2)
        lb = b if m == 0 else (b - nba if m == 1 else b - nba - nbb)
        r0 = (lb * warps + (tid >> WARP_SHIFT)) * rows
        for o in range(rows):
            acc[o] = _ZERO
        # x * weight is quantized; the norm's 1/rms, a factor of every dot product, is applied to the sums
        ss = _stage(x, 0, nw, norm, k, xq, xd, xs, tid, nthr, _ONE)
        cuda.syncthreads()
        if m == 0:
            d0(w8a, wva, wha, 0, rba, r0, na - 1, nunits, xq, xd, xs, s, mn, acc, 0)
        elif m == 1:
            d1(w8b, wvb, whb, 0, rbb, r0, nb - 1, nunits, xq, xd, xs, s, mn, acc, 0)
        else:
            d2(w8c, wvc, whc, 0, rbc, r0, nc - 1, nunits, xq, xd, xs, s, mn, acc, 0)
        inv = _ONE
        if norm:  # as cuda_kernels.ops.rmsnorm: the mean and eps in float64, the scale in float32
            tot = block_sum(red, ss)
            inv = _ONE / float32(math.sqrt(float64(tot) / k + eps))
            for o in range(rows):
                acc[o] *= inv
            if write_xo:  # a share a block
                for i in range(b * nthr + tid, k, nblk * nthr):
                    xo[0, _U(i)] = x[0, _U(i)] * inv * nw[_U(i)]
        if q8_out:  # a share a block; int8 quantization is scale-free: only the scales and sums take 1/rms
            for i in range(b * nthr + tid, kw, nblk * nthr):
                gq[0, _U(i)] = xq[i]
            for i in range(b * nthr + tid, kb, nblk * nthr):
                gd[0, _U(i)] = xd[i] * inv
            for i in range(b * nthr + tid, ks, nblk * nthr):
                gs[0, _U(i)] = xs[i] * inv
        _warp_reduce(acc, rows)
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


if SIM:
    @cuda.jit(device=True)
    def _quant_block(hv, lane, hq, hd, hs, i, e0):
        """hv[0:32] quantized as one int8 block into row i of hq/hd/hs at element e0 (the one simulated thread)."""
        a = _ZERO
        for e in range(32):
            a = max(a, abs(hv[e]))
        inv = _I127 / a if a > _ZERO else _ZERO
        d = a / _I127
        for hh in range(2):
            qs = 0
            for j in range(4):
                wd = 0
                for e in range(4):
                    qv = int(_q8(hv[16 * hh + 4 * j + e], inv))
                    wd |= qv << (8 * e)
                    qs += qv - 256 if qv > 127 else qv
                hq[i, (e0 >> 2) + 4 * hh + j] = np.uint32(wd)
            hs[i, (e0 >> 4) + hh] = d * np.float32(qs)
        hd[i, e0 >> 5] = d
else:
    @cuda.jit(**_DEV)
    def _quant_block(hv, lane, hq, hd, hs, i, e0):
        """hv[0:32] quantized as one int8 block into row i of hq/hd/hs at element e0, by one warp (lane l takes
        element l: the maximum and the 16-element sums by shuffles, 4 lanes' bytes ORed into a word)."""
        v = hv[lane]
        a = abs(v)
        a = max(a, cuda.shfl_xor_sync(_FULL, a, 16))
        a = max(a, cuda.shfl_xor_sync(_FULL, a, 8))
        a = max(a, cuda.shfl_xor_sync(_FULL, a, 4))
        a = max(a, cuda.shfl_xor_sync(_FULL, a, 2))
        a = max(a, cuda.shfl_xor_sync(_FULL, a, 1))
        inv = _I127 / a if a > _ZERO else _ZERO
        q = _q8(v, inv)
        wd = int32(q << uint32(8 * (lane & 3)))  # shuffled as int32 (numba's shuffles take signed words)
        wd |= cuda.shfl_xor_sync(_FULL, wd, 1)
        wd |= cuda.shfl_xor_sync(_FULL, wd, 2)
        qs = int32(q ^ uint32(0x80)) - int32(128)  # the byte as a signed int8
        qs += cuda.shfl_xor_sync(_FULL, qs, 1)
        qs += cuda.shfl_xor_sync(_FULL, qs, 2)
        qs += cuda.shfl_xor_sync(_FULL, qs, 4)
        qs += cuda.shfl_xor_sync(_FULL, qs, 8)
        d = a / _I127
        if (lane & 3) == 0:
            hq[i, _U((e0 >> 2) + (lane >> 2))] = uint32(wd)
        if (lane & 15) == 0:
            hs[i, _U((e0 >> 4) + (lane >> 4))] = d * float32(qs)
        if lane == 0:
            hd[i, _U(e0 >> 5)] = d


def gate_up_fn(tg: tuple, tu: tuple, k: int, rows: int, warps: int, quant_h: bool):
    """The int8 form of matmul._gate_up_fn: the experts' gate and up rows over VRAM slots against x already in
    its global int8 form (q8_shapes; the routing launch writes it), so the first weight loads issue at once, with
    no staging pass or barrier before them; SwiGLU in the epilogue. quant_h (a block's rows * warps == 32): h is
    also written in int8 form (hq/hd/hs), the input of down_fn. Memoized."""
    key = ("gate_up", tg, tu, k, rows, warps, quant_h)
    if key in _KERNELS:
        return _KERNELS[key]
    if quant_h and rows * warps != 32:
        raise ValueError("gate_up_fn: quant_h needs 32 rows a block")
    dg, du = _dot_fn(*tg, rows), _dot_fn(*tu, rows)
    rows2 = 2 * rows
    nunits = k // 32

    @cuda.jit(cache=True)
    def gate_up(w8g, wvg, whg, w8u, wvu, whu, slot_bytes, off_g, off_u, rbg, rbu, nrows, slot_of, ids,
                xq, xd, xs, h, hq, hd, hs, ntok):
        hv = cuda.shared.array(32, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        acc = cuda.local.array(rows2, float32)  # gate rows, then up rows
        tid = cuda.threadIdx.x
        lane = tid & LANE_MASK
        w = tid >> WARP_SHIFT
        kk = ids.shape[1]
        r0 = (cuda.blockIdx.x * warps + w) * rows
        for i in range(cuda.blockIdx.y, ntok * kk, cuda.gridDim.y):
            t = i // kk
            slot = slot_of[_U(ids[_U(t), _U(i - t * kk)])]
            if slot >= 0:  # the same for the whole block: its barriers are safe
                base = slot * slot_bytes
                for o in range(rows2):
                    acc[o] = _ZERO
                dg(w8g, wvg, whg, base + off_g, rbg, r0, nrows - 1, nunits, xq[_U(t)], xd[_U(t)], xs[_U(t)], s, mn,
                   acc, 0)
                du(w8u, wvu, whu, base + off_u, rbu, r0, nrows - 1, nunits, xq[_U(t)], xd[_U(t)], xs[_U(t)], s, mn,
                   acc, rows)
                _warp_reduce(acc, rows2)
                if lane == 0:
                    for o in range(rows):
                        if r0 + o < nrows:
                            g = acc[o]
                            # exp's argument capped: silu(g) is 0 to float32 precision below -80 (no overflow)
                            v = g / (_ONE + float32(math.exp(min(-g, _EXP_CAP)))) * acc[rows + o]
                            h[_U(i), _U(r0 + o)] = v
                            if quant_h:
                                hv[w * rows + o] = v
                if quant_h:
                    cuda.syncthreads()
                    if w == 0:
                        _quant_block(hv, lane, hq, hd, hs, i, cuda.blockIdx.x * 32)
                    cuda.syncthreads()  # hv is read before the next entry writes it

    _KERNELS[key] = gate_up
    return gate_up


def down_fn(td: tuple, k: int, rows: int, warps: int):
    """The int8 form of matmul._down_fn (same launch): the experts' down rows against h in its int8 form (written
    by gate_up_fn), weighted and summed over a token's resident choices into the residual stream; a block's warps
    take different choices of its rows, their sums meeting in shared memory in warp order. Memoized."""
    key = ("down", td, k, rows, warps)
    if key in _KERNELS:
        return _KERNELS[key]
    dd = _dot_fn(*td, rows)
    nunits = k // 32
    nthr, red_len = warps * LANES, warps * rows

    @cuda.jit(cache=True)
    def down(w8, wv, wh, slot_bytes, off, rb, nrows, slot_of, ids, wts, hq, hd, hs, out, ntok):
        red = cuda.shared.array(red_len, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
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
                    e = t * kk + j
                    dd(w8, wv, wh, slot * slot_bytes + off, rb, r0, nrows - 1, nunits, hq[_U(e)], hd[_U(e)],
                       hs[_U(e)], s, mn, accj, 0)
                    wj = wts[_U(t), _U(j)]
                    for o in range(rows):  # the weight distributes over the lanes' partial sums
                        acc[o] += wj * accj[o]
            _warp_reduce(acc, rows)
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
