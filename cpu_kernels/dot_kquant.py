"""K-quant rows (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): dequantize, float32 dot and int8-activation dot.

Every K-quant super-block holds 256 weights as eight chunks of 32, each weight w = s * (u - o) - m with an
unsigned integer u, a type constant offset o (4 for Q3_K, 32 for Q6_K, else 0), a float scale s per group of
16 (or 32) and, for Q2_K/Q4_K/Q5_K, a float min m per group. So each type is one small LLVM-IR "unpack" (block
bytes -> eight <32 x i8> vectors of u, o, the 16 per-group scales and mins) and three shared consumers build
the row loops around it:
  dequant   w = s * q - m, stored (the same float32 operations in the same order as gguf-py: bit-exact)
  dot_f32   the same w in registers, fma into float32 accumulators (the accuracy reference)
  dot_q8    integer dots of u with the int8 activations, four products per i32 lane: vpmaddubsw + vpmaddwd
            against the group scales (AVX2, AVX-512 machines included: vpdpbusd would need the scales applied
            to its i32 sums separately), or sign-extended even/odd pair sums (LLVM's vpmaddwd pattern)
            elsewhere, chosen for the CPU numba targets. Each group's sum is scaled by s * xd in float32; the
            min and the offset (s * o) are one vector fma per super-block against the sums of the int8
            activations per 16 (actq xs = xd * sum(xq), llama.cpp's bsums): the result is the dot of the
            dequantized row with xd * xq. (On the float sums of x instead, the error is sum((w_i + m) e_i), not
            sum(w_i e_i), e the int8 rounding of x: the min or offset of every weight multiplies it, ~1.7x.)
All loops take 64 or 32 elements per step with four independent accumulators and prefetch the weights
PREFETCH_BYTES ahead (rows of a matrix are contiguous, so this runs on into the next row).
Layouts: llama.cpp ggml-common.h (block_q*_K) and gguf-py gguf/quants.py (dequantize_blocks).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from strata_nb.cpu_kernels.ir import array_ptr, each_row, host_features, row_ptrs
from strata_nb.errors import StrataError

QK = 256
PREFETCH_BYTES = 2048

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
_PI8 = _I8.as_pointer()


def _vt(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _cv(t: ir.Type, vals: list) -> ir.Constant:
    """Constant vector of element type t."""
    return ir.Constant(_vt(t, len(vals)), [ir.Constant(t, v) for v in vals])


def _shuf(b: ir.IRBuilder, v: ir.Value, idx: list[int]) -> ir.Value:
    return b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), _cv(_I32, idx))


def _splat(b: ir.IRBuilder, s: ir.Value, n: int) -> ir.Value:
    v = b.insert_element(ir.Constant(_vt(s.type, 1), ir.Undefined), s, ir.Constant(_I32, 0))
    return _shuf(b, v, [0] * n)


class _Block:
    """Byte-addressed loads from one super-block."""

    def __init__(self, b: ir.IRBuilder, ptr: ir.Value):
        self.b = b
        self.ptr = ptr

    def vec(self, off: int, n: int) -> ir.Value:
        p = self.b.gep(self.ptr, [ir.Constant(_I64, off)])
        return self.b.load(self.b.bitcast(p, _vt(_I8, n).as_pointer()), align=1)

    def f16(self, off: int) -> ir.Value:
        p = self.b.bitcast(self.b.gep(self.ptr, [ir.Constant(_I64, off)]), _I16.as_pointer())
        return self.b.fpext(self.b.bitcast(self.b.load(p, align=1), ir.HalfType()), _F32)


# ---- per-type unpack: block -> (eight <32 x i8> unsigned quants u, offset o with q = u - o, the float d,
#                                <16 x i16> integer scale per group of 16, <16 x float> min per 16 or None);
#                                the weight scale per 16 is d * scale

def _i16(b: ir.IRBuilder, v: ir.Value, signed: bool) -> ir.Value:
    t = _vt(_I16, v.type.count)
    return b.sext(v, t) if signed else b.zext(v, t)


def _pair16(b: ir.IRBuilder, v8: ir.Value) -> ir.Value:
    """<8 x T> per group of 32 -> <16 x T> per group of 16."""
    return _shuf(b, v8, [i // 2 for i in range(16)])


def _unpack_q2_k(k: _Block):
    # scales[16] (low nibble scale, high nibble min) | qs[64] | d | dmin; element h*128+j*32+l = qs[h*32+l]>>2j &3
    b = k.b
    sc = k.vec(0, 16)
    ms = b.fmul(_splat(b, k.f16(82), 16), b.uitofp(b.lshr(sc, _cv(_I8, [4] * 16)), _vt(_F32, 16)))
    q = []
    for h in range(2):
        qs = k.vec(16 + 32 * h, 32)
        for j in range(4):
            q.append(b.and_(b.lshr(qs, _cv(_I8, [2 * j] * 32)), _cv(_I8, [3] * 32)))
    return q, 0, k.f16(80), _i16(b, b.and_(sc, _cv(_I8, [15] * 16)), False), ms


def _unpack_q3_k(k: _Block):
    # hmask[32] | qs[64] | scales[12] (6-bit, -32) | d; q = (qs 2-bit | hmask bit << 2) - 4
    b = k.b
    hm = k.vec(0, 32)
    s = k.vec(94, 16)  # bytes 94..109: the 12 scale bytes at s[2..13], no read past the block
    lo = b.and_(b.lshr(_shuf(b, s, [2 + i % 8 for i in range(16)]), _cv(_I8, [4 * (i // 8) for i in range(16)])),
                _cv(_I8, [15] * 16))
    hi = b.and_(b.lshr(_shuf(b, s, [10 + i % 4 for i in range(16)]), _cv(_I8, [2 * (i // 4) for i in range(16)])),
                _cv(_I8, [3] * 16))
    sc = b.sub(b.or_(lo, b.shl(hi, _cv(_I8, [4] * 16))), _cv(_I8, [32] * 16))
    q = []
    for h in range(2):
        qs = k.vec(32 + 32 * h, 32)
        for j in range(4):
            c = 4 * h + j
            ql = b.and_(b.lshr(qs, _cv(_I8, [2 * j] * 32)), _cv(_I8, [3] * 32))
            qh = b.and_(b.lshr(hm, _cv(_I8, [c - 2] * 32)) if c >= 2 else b.shl(hm, _cv(_I8, [2 - c] * 32)),
                        _cv(_I8, [4] * 32))
            q.append(b.or_(ql, qh))
    return q, 4, k.f16(108), _i16(b, sc, True), None


def _scales_k4(k: _Block):
    """Q4_K/Q5_K: the eight 6-bit (scale, min) pairs packed in bytes 4..15 -> per-16 integer scales and float
    mins (dmin * min)."""
    b = k.b
    s = k.vec(0, 16)  # d, dmin, then scales at s[4..15]
    m6 = _cv(_I8, [63] * 4 + [15] * 4)
    top = _cv(_I8, [0] * 4 + [48] * 4)
    two = _cv(_I8, [2] * 8)
    sc = b.or_(b.and_(_shuf(b, s, [4, 5, 6, 7, 12, 13, 14, 15]), m6),
               b.and_(b.lshr(_shuf(b, s, [4, 5, 6, 7, 4, 5, 6, 7]), two), top))
    mn = b.or_(b.and_(b.lshr(_shuf(b, s, [8, 9, 10, 11, 12, 13, 14, 15]), _cv(_I8, [0] * 4 + [4] * 4)), m6),
               b.and_(b.lshr(_shuf(b, s, [8, 9, 10, 11, 8, 9, 10, 11]), two), top))
    ms = b.fmul(_splat(b, k.f16(2), 8), b.uitofp(mn, _vt(_F32, 8)))
    return _pair16(b, _i16(b, sc, False)), _pair16(b, ms)


def _unpack_q4_k(k: _Block):
    # d | dmin | scales[12] | qs[128]; chunk 2c = qs[32c:32c+32] & 15, chunk 2c+1 = the high nibbles
    b = k.b
    isc, ms = _scales_k4(k)
    q = []
    for c in range(4):
        qs = k.vec(16 + 32 * c, 32)
        q.append(b.and_(qs, _cv(_I8, [15] * 32)))
        q.append(b.lshr(qs, _cv(_I8, [4] * 32)))
    return q, 0, k.f16(0), isc, ms


def _unpack_q5_k(k: _Block):
    # d | dmin | scales[12] | qh[32] | qs[128]; chunk j takes bit j of qh as its fifth bit
    b = k.b
    isc, ms = _scales_k4(k)
    qh = k.vec(16, 32)
    q = []
    for c in range(4):
        qs = k.vec(48 + 32 * c, 32)
        for j, lo in ((2 * c, b.and_(qs, _cv(_I8, [15] * 32))), (2 * c + 1, b.lshr(qs, _cv(_I8, [4] * 32)))):
            hb = b.lshr(qh, _cv(_I8, [j - 4] * 32)) if j >= 4 else b.shl(qh, _cv(_I8, [4 - j] * 32))
            q.append(b.or_(lo, b.and_(hb, _cv(_I8, [16] * 32))))
    return q, 0, k.f16(0), isc, ms


def _unpack_q6_k(k: _Block):
    # ql[128] | qh[64] | scales[16] int8 | d; q = (4 low bits | 2 high bits << 4) - 32
    b = k.b
    q = []
    for h in range(2):
        l0, l1 = k.vec(64 * h, 32), k.vec(64 * h + 32, 32)
        qh = k.vec(128 + 32 * h, 32)
        lows = (b.and_(l0, _cv(_I8, [15] * 32)), b.and_(l1, _cv(_I8, [15] * 32)),
                b.lshr(l0, _cv(_I8, [4] * 32)), b.lshr(l1, _cv(_I8, [4] * 32)))
        for j in range(4):
            hi = b.shl(qh, _cv(_I8, [4 - 2 * j] * 32)) if j < 2 else b.lshr(qh, _cv(_I8, [2 * j - 4] * 32))
            q.append(b.or_(lows[j], b.and_(hi, _cv(_I8, [48] * 32))))
    return q, 32, k.f16(208), _i16(b, k.vec(192, 16), True), None


# ---- shared loop builders

def _fn(b: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]):
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, args), name)


def _fma(b: ir.IRBuilder, x: ir.Value, y: ir.Value, z: ir.Value) -> ir.Value:
    n = x.type.count
    return b.call(_fn(b, f"llvm.fma.v{n}f32", x.type, [x.type] * 3), [x, y, z])


def _hsum(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    n = v.type.count
    while n > 1:
        n //= 2
        v = b.fadd(_shuf(b, v, list(range(n))), _shuf(b, v, list(range(n, 2 * n))))
    return b.extract_element(v, ir.Constant(_I32, 0))


def _spread(b: ir.IRBuilder, v16: ir.Value, c: int, lanes: int) -> ir.Value:
    """Per-16 values of chunk c across its lanes: <lanes> = v16[2c] x lanes/2 ++ v16[2c+1] x lanes/2."""
    return _shuf(b, v16, [2 * c] * (lanes // 2) + [2 * c + 1] * (lanes // 2))


def _weights(b: ir.IRBuilder, u: ir.Value, off: int, ws: ir.Value, ms, c: int) -> ir.Value:
    """float32 weights of chunk c, as gguf-py computes them: (scale * q) - min."""
    q = b.sub(u, _cv(_I8, [off] * 32)) if off else u
    w = b.fmul(_spread(b, ws, c, 32), b.sitofp(q, _vt(_F32, 32)))
    return b.fsub(w, _spread(b, ms, c, 32)) if ms is not None else w


def _pairsum(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """<2n x i32> -> <n x i32> sums of adjacent lanes."""
    n = v.type.count
    return b.add(_shuf(b, v, list(range(0, n, 2))), _shuf(b, v, list(range(1, n, 2))))


def _chunk_dot_generic(b: ir.IRBuilder, u: ir.Value, x: ir.Value, sc: ir.Value) -> ir.Value:
    """<32 x i8> unsigned quants (< 64) . <32 x i8> activations with <16 x i16> integer scales (lanes 0-7 the
    scale of elements 0-15, lanes 8-15 that of elements 16-31) -> <8 x i32>, lane i = scale * the sum of the
    products of elements 4i..4i+3. Portable IR; exactly the integers of _chunk_dot_avx2."""
    v32, v16 = _vt(_I32, 32), _vt(_I32, 16)
    pairs = _pairsum(b, b.mul(b.sext(u, v32), b.sext(x, v32)))
    return _pairsum(b, b.mul(pairs, b.sext(sc, v16)))


def _chunk_dot_avx2(b: ir.IRBuilder, u: ir.Value, x: ir.Value, sc: ir.Value) -> ir.Value:
    """The same as vpmaddubsw (u8 x s8 pairs to i16: |sum| <= 2 * 63 * 127, no saturation) and vpmaddwd against
    the scales (llama.cpp's AVX2 K-quant dot): two instructions for 32 products, scale included."""
    v32, v16w, v8 = _vt(_I8, 32), _vt(_I16, 16), _vt(_I32, 8)
    ubsw = _fn(b, "llvm.x86.avx2.pmadd.ub.sw", v16w, [v32, v32])
    wd = _fn(b, "llvm.x86.avx2.pmadd.wd", v8, [v16w, v16w])
    return b.call(wd, [b.call(ubsw, [u, x]), sc])


def _best_chunk_dot():
    """The integer dot for the CPU numba compiles for (AVX-512 machines have AVX2 too)."""
    return _chunk_dot_avx2 if "avx2" in host_features() else _chunk_dot_generic


def _prefetch(b: ir.IRBuilder, blk: ir.Value, bs: int) -> None:
    fn = _fn(b, "llvm.prefetch.p0", ir.VoidType(), [_PI8, _I32, _I32, _I32])
    for off in range(0, bs, 64):
        p = b.gep(blk, [ir.Constant(_I64, PREFETCH_BYTES + off)])
        b.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _zeros(b: ir.IRBuilder, n: int, count: int) -> list:
    accs = []
    for _ in range(count):
        a = cgutils.alloca_once(b, _vt(_F32, n))
        b.store(ir.Constant(_vt(_F32, n), [0.0] * n), a)
        accs.append(a)
    return accs


def _make_kernels(name: str, bs: int, unpack, chunk_dot):
    """Build the row intrinsics of one type: dequant(w, out, nb), dot_f32(w, x, nb), dot_q8(w, xq, xd, xs, nb),
    dot_q8_multi(w, xq, xd, xs, toks, nb) on 2-D activations and dot_q8_rows(w, r0, n, xq, xd, xs, out, nb) on
    rows r0..r0+n-1 of a 2-D matrix; the int8 dots by chunk_dot (one of the _chunk_dot_* builders). nb is the
    number of super-blocks in a row; callers check the array sizes, rows and token indices."""

    def scales(b, d, isc):
        return b.fmul(_splat(b, d, 16), b.sitofp(isc, _vt(_F32, 16)))  # d * scale, as gguf-py computes it

    def dequant(typingctx, w, out, nb):
        def codegen(context, builder, sig, args):
            b = builder
            wp = array_ptr(context, b, sig.args[0], args[0], _I8)
            op = array_ptr(context, b, sig.args[1], args[1], _F32)
            with cgutils.for_range(b, args[2]) as loop:
                i = loop.index
                q, off, d, isc, ms = unpack(_Block(b, b.gep(wp, [b.mul(i, ir.Constant(_I64, bs))])))
                ws = scales(b, d, isc)
                for c in range(8):
                    p = b.gep(op, [b.add(b.mul(i, ir.Constant(_I64, QK)), ir.Constant(_I64, 32 * c))])
                    b.store(_weights(b, q[c], off, ws, ms, c), b.bitcast(p, _vt(_F32, 32).as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(w, out, nb), codegen

    def dot_f32(typingctx, w, x, nb):
        def codegen(context, builder, sig, args):
            b = builder
            wp = array_ptr(context, b, sig.args[0], args[0], _I8)
            xp = array_ptr(context, b, sig.args[1], args[1], _F32)
            accs = _zeros(b, 32, 4)
            with cgutils.for_range(b, args[2]) as loop:
                i = loop.index
                blk = b.gep(wp, [b.mul(i, ir.Constant(_I64, bs))])
                _prefetch(b, blk, bs)
                q, off, d, isc, ms = unpack(_Block(b, blk))
                ws = scales(b, d, isc)
                for c in range(8):
                    p = b.gep(xp, [b.add(b.mul(i, ir.Constant(_I64, QK)), ir.Constant(_I64, 32 * c))])
                    xv = b.load(b.bitcast(p, _vt(_F32, 32).as_pointer()), align=4)
                    a = accs[c % 4]
                    b.store(_fma(b, _weights(b, q[c], off, ws, ms, c), xv, b.load(a)), a)
            v = [b.load(a) for a in accs]
            return _hsum(b, b.fadd(b.fadd(v[0], v[1]), b.fadd(v[2], v[3])))

        return types.float32(w, x, nb), codegen

    def q8_row(b: ir.IRBuilder, wp: ir.Value, nb: ir.Value, toks: list) -> list:
        """dot_q8 of one row against each token of toks, a list of (xq i8*, xd f32*, xs f32*) pointers.
        Per super-block: the integer dots of all eight chunks with the integer scales summed exactly in i32
        (|sum| < 2^26), one float fma with d * xd; the min and offset terms one fma on the sums of the int8 x (xs).
        The row is unpacked once per super-block; each token keeps its own accumulators and the same float
        operations in the same order as a single-token call, so every result is bit-identical to it."""
        accs = [_zeros(b, 8, 1) + _zeros(b, 16, 1) for _ in toks]  # per token: scaled sums, min terms
        with cgutils.for_range(b, nb) as loop:
            i = loop.index
            blk = b.gep(wp, [b.mul(i, ir.Constant(_I64, bs))])
            _prefetch(b, blk, bs)
            q, off, d, isc, ms = unpack(_Block(b, blk))
            if off:  # d * s * (u - o) - m: the o * d * s part joins the min term, on xs
                mo = b.fmul(scales(b, d, isc), ir.Constant(_vt(_F32, 16), [float(off)] * 16))
                ms = mo if ms is None else b.fadd(mo, ms)
            scv = [_shuf(b, isc, [2 * c] * 8 + [2 * c + 1] * 8) for c in range(8)]
            for k, (qp, dp, sp) in enumerate(toks):
                xq0 = b.gep(qp, [b.mul(i, ir.Constant(_I64, QK))])
                isum = None
                for c in range(8):
                    xv = b.load(b.bitcast(b.gep(xq0, [ir.Constant(_I64, 32 * c)]), _vt(_I8, 32).as_pointer()),
                                align=1)
                    r = chunk_dot(b, q[c], xv, scv[c])
                    isum = r if isum is None else b.add(isum, r)
                f = b.fmul(d, b.load(b.gep(dp, [i]), align=4))
                b.store(_fma(b, b.sitofp(isum, _vt(_F32, 8)), _splat(b, f, 8), b.load(accs[k][0])), accs[k][0])
                if ms is not None:
                    xs16 = b.load(b.bitcast(b.gep(sp, [b.mul(i, ir.Constant(_I64, 16))]),
                                            _vt(_F32, 16).as_pointer()), align=4)
                    b.store(_fma(b, ms, xs16, b.load(accs[k][1])), accs[k][1])
        res = []
        for acc, macc in accs:
            m = b.load(macc)
            m8 = b.fadd(_shuf(b, m, list(range(8))), _shuf(b, m, list(range(8, 16))))
            res.append(_hsum(b, b.fsub(b.load(acc), m8)))
        return res

    def tok_ptrs(context, b, sig, args, first: int) -> tuple:
        return tuple(array_ptr(context, b, sig.args[first + j], args[first + j], e)
                     for j, e in enumerate((_I8, _F32, _F32)))

    def dot_q8(typingctx, w, xq, xd, xs, nb):
        def codegen(context, builder, sig, args):
            b = builder
            wp = array_ptr(context, b, sig.args[0], args[0], _I8)
            return q8_row(b, wp, args[4], [tok_ptrs(context, b, sig, args, 1)])[0]

        return types.float32(w, xq, xd, xs, nb), codegen

    def dot_q8_multi(typingctx, w, xq, xd, xs, toks, nb):
        """Tokens toks (a tuple of row indices) of the 2-D xq, xd, xs; returns a tuple of their dots."""
        def codegen(context, builder, sig, args):
            b = builder
            wp = array_ptr(context, b, sig.args[0], args[0], _I8)
            ts = [context.cast(b, b.extract_value(args[4], k), ty, types.intp) for k, ty in enumerate(sig.args[4])]
            rows = [row_ptrs(context, b, sig.args[j], args[j], e, ts) for j, e in ((1, _I8), (2, _F32), (3, _F32))]
            res = q8_row(b, wp, args[5], list(zip(*rows)))
            return context.make_tuple(b, sig.return_type, res)

        if not isinstance(toks, types.BaseTuple) or not all(isinstance(t, types.Integer) for t in toks):
            raise TypeError("token indices must be a tuple of integers")
        return types.UniTuple(types.float32, len(toks))(w, xq, xd, xs, toks, nb), codegen

    def dot_q8_rows(typingctx, w, r0, n, xq, xd, xs, out, nb):
        """out[r0 + j] = dot_q8 of row r0 + j of the 2-D w (rows of nb blocks, contiguous) for j < n: one call
        for a task's rows, so the per-row call, checks and constants are paid once."""
        def codegen(context, builder, sig, args):
            b = builder
            rb = b.mul(args[7], ir.Constant(_I64, bs))
            r0 = context.cast(b, args[1], sig.args[1], types.intp)
            w0 = b.gep(array_ptr(context, b, sig.args[0], args[0], _I8), [b.mul(r0, rb)])
            op = b.gep(array_ptr(context, b, sig.args[6], args[6], _F32), [r0])
            tok = tok_ptrs(context, b, sig, args, 3)
            each_row(b, w0, rb, context.cast(b, args[2], sig.args[2], types.intp),
                     lambda p: q8_row(b, p, args[7], [tok]), [op])
            return context.get_dummy_value()

        return types.void(w, r0, n, xq, xd, xs, out, nb), codegen

    def dot_q8_multi_rows(typingctx, w, r0, n, xq, xd, xs, toks, out, j, nb):
        """out[j + k, r0 + i] = dot_q8 of row r0 + i of the 2-D w against token toks[k], for i < n: a task's
        rows against a group of tokens in one call (each row unpacked once for the group, as dot_q8_multi)."""
        def codegen(context, builder, sig, args):
            b = builder
            rb = b.mul(args[9], ir.Constant(_I64, bs))
            r0 = context.cast(b, args[1], sig.args[1], types.intp)
            w0 = b.gep(array_ptr(context, b, sig.args[0], args[0], _I8), [b.mul(r0, rb)])
            ts = [context.cast(b, b.extract_value(args[6], k), ty, types.intp) for k, ty in enumerate(sig.args[6])]
            rows = [row_ptrs(context, b, sig.args[i], args[i], e, ts) for i, e in ((3, _I8), (4, _F32), (5, _F32))]
            j = context.cast(b, args[8], sig.args[8], types.intp)
            ops = [b.gep(p, [r0]) for p in row_ptrs(context, b, sig.args[7], args[7], _F32,
                                                      [b.add(j, ir.Constant(_I64, k)) for k in range(len(ts))])]
            each_row(b, w0, rb, context.cast(b, args[2], sig.args[2], types.intp),
                     lambda p: q8_row(b, p, args[9], list(zip(*rows))), ops)
            return context.get_dummy_value()

        if not isinstance(toks, types.BaseTuple) or not all(isinstance(t, types.Integer) for t in toks):
            raise TypeError("token indices must be a tuple of integers")
        return types.void(w, r0, n, xq, xd, xs, toks, out, j, nb), codegen

    out = []
    for f in (dequant, dot_f32, dot_q8, dot_q8_multi, dot_q8_rows, dot_q8_multi_rows):
        f.__name__ = f.__qualname__ = f"_ir_{f.__name__}_{name}_{chunk_dot.__name__[11:]}"
        out.append(intrinsic(f))
    return out


# ---- argument checks: one per row, noise next to a row of 1-4 KB; needed, since the IR reads without bounds
# checks. They take shapes and strides, not arrays: an inlined helper taking arrays costs an NRT incref/decref
# pair per array per call (the raise paths defeat numba's refcount pruning), which measured 3.6x slower rows.

@njit(cache=True, nogil=True, inline="always")
def _nblocks(wlen, wstride, bs, n, nstride, itemsize):
    """Super-blocks in a row of wlen bytes, checked against a companion vector of n elements."""
    nb = wlen // bs
    if wlen != nb * bs or wstride != 1:
        raise StrataError("K-quant row: byte length is not a whole number of contiguous blocks")
    if n != nb * QK or nstride != itemsize:
        raise StrataError("K-quant row: activation/output vector does not match the row or is not contiguous")
    return nb


@njit(cache=True, nogil=True, inline="always")
def _check_scales(nb, xdlen, xdstride, xslen, xsstride):
    """The activations' per-256 scales and per-16 sums: exact lengths, so per-32 (legacy-layout) activations
    are refused, not misread."""
    if xdlen != nb or xslen != nb * 16 or xdstride != 4 or xsstride != 4:
        raise StrataError("K-quant row: activation scales are not per 256 (actq group 256) or not contiguous")


@njit(cache=True, nogil=True, inline="always")
def _check_tokens(toks, ntok):
    for t in toks:
        if t < 0 or t >= ntok:
            raise StrataError("K-quant row: token index out of range of the activation rows")


@njit(cache=True, nogil=True, inline="always")
def _nb_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, bs):
    """Super-blocks per row for a dot_q8_multi_rows call: rows r0:r1 of the matrix against tokens toks of 2-D
    activations, into out[j:j + len(toks), r0:r1]. It takes the arrays (the checks above take lengths): it is
    inlined, and the drivers pass views without a meminfo (matmul._noref), so no reference count is touched."""
    nb = _check_rows(w.shape[0], w.strides[0], w.shape[1], bs, r0, r1, out.shape[1], out.strides[1])
    _nblocks(w.shape[1], w.strides[1], bs, xq.shape[1], xq.strides[1], 1)
    _check_scales(nb, xd.shape[1], xd.strides[1], xs.shape[1], xs.strides[1])
    _check_tokens(toks, min(xq.shape[0], xd.shape[0], xs.shape[0]))
    if j < 0 or j + len(toks) > out.shape[0]:
        raise StrataError("K-quant rows: output rows out of range")
    return nb


@njit(cache=True, nogil=True, inline="always")
def _check_rows(wrows, wrow_stride, wbytes, bs, r0, r1, nout, ostride):
    """Super-blocks per row of a 2-D matrix whose rows r0:r1 a dot_q8_rows call reads (into out[r0:r1])."""
    nb = wbytes // bs
    if wbytes != nb * bs or wrow_stride != wbytes:
        raise StrataError("K-quant rows: not whole contiguous blocks")
    if r0 < 0 or r1 > wrows or r1 > nout or ostride != 4:
        raise StrataError("K-quant rows: row range outside the matrix or the output")
    return nb


# ---- public kernels: w uint8[row bytes] one row in GGUF layout; x/out float32[K]; xq int8[K], xd float32[K/256],
# xs float32[K/16] (actq layout, group 256). The _multi kernels take 2-D activations xq int8[T, K],
# xd float32[T, K/256], xs float32[T, K/16] and a tuple of n token indices, and return the n dots of the row
# against those tokens (bit-identical to n single-token calls), unpacking the row once. The _rows kernels take a
# 2-D matrix w uint8[rows, row bytes] and write out[r] = dot_q8(w[r]) for r in r0:r1 (bit-identical too). All
# raise StrataError on mismatched or non-contiguous arrays or out-of-range tokens and rows.

CHUNK_DOT = _best_chunk_dot()
_deq_q2_k, _f32_q2_k, _q8_q2_k, _q8m_q2_k, _q8r_q2_k, _q8mr_q2_k = _make_kernels("q2_k", 84, _unpack_q2_k, CHUNK_DOT)
_deq_q3_k, _f32_q3_k, _q8_q3_k, _q8m_q3_k, _q8r_q3_k, _q8mr_q3_k = _make_kernels("q3_k", 110, _unpack_q3_k, CHUNK_DOT)
_deq_q4_k, _f32_q4_k, _q8_q4_k, _q8m_q4_k, _q8r_q4_k, _q8mr_q4_k = _make_kernels("q4_k", 144, _unpack_q4_k, CHUNK_DOT)
_deq_q5_k, _f32_q5_k, _q8_q5_k, _q8m_q5_k, _q8r_q5_k, _q8mr_q5_k = _make_kernels("q5_k", 176, _unpack_q5_k, CHUNK_DOT)
_deq_q6_k, _f32_q6_k, _q8_q6_k, _q8m_q6_k, _q8r_q6_k, _q8mr_q6_k = _make_kernels("q6_k", 210, _unpack_q6_k, CHUNK_DOT)


@njit(cache=True, nogil=True)
def dequant_q2_k(w: np.ndarray, out: np.ndarray) -> None:
    _deq_q2_k(w, out, _nblocks(w.shape[0], w.strides[0], 84, out.shape[0], out.strides[0], 4))


@njit(cache=True, nogil=True)
def dot_f32_q2_k(w: np.ndarray, x: np.ndarray) -> float:
    return _f32_q2_k(w, x, _nblocks(w.shape[0], w.strides[0], 84, x.shape[0], x.strides[0], 4))


@njit(cache=True, nogil=True)
def dot_q8_q2_k(w: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray) -> float:
    nb = _nblocks(w.shape[0], w.strides[0], 84, xq.shape[0], xq.strides[0], 1)
    _check_scales(nb, xd.shape[0], xd.strides[0], xs.shape[0], xs.strides[0])
    return _q8_q2_k(w, xq, xd, xs, nb)


@njit(cache=True, nogil=True)
def dot_q8_q2_k_multi(w: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray, toks: tuple) -> tuple:
    nb = _nblocks(w.shape[0], w.strides[0], 84, xq.shape[1], xq.strides[1], 1)
    _check_scales(nb, xd.shape[1], xd.strides[1], xs.shape[1], xs.strides[1])
    _check_tokens(toks, min(xq.shape[0], xd.shape[0], xs.shape[0]))
    return _q8m_q2_k(w, xq, xd, xs, toks, nb)


@njit(cache=True, nogil=True)
def dot_q8_q2_k_rows(w: np.ndarray, r0: int, r1: int, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                    out: np.ndarray) -> None:
    nb = _check_rows(w.shape[0], w.strides[0], w.shape[1], 84, r0, r1, out.shape[0], out.strides[0])
    _nblocks(w.shape[1], w.strides[1], 84, xq.shape[0], xq.strides[0], 1)
    _check_scales(nb, xd.shape[0], xd.strides[0], xs.shape[0], xs.strides[0])
    if r1 > r0:
        _q8r_q2_k(w, r0, r1 - r0, xq, xd, xs, out, nb)


@njit(cache=True, nogil=True)
def dot_q8_q2_k_multi_rows(w: np.ndarray, r0: int, r1: int, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                            toks: tuple, out: np.ndarray, j: int) -> None:
    nb = _nb_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, 84)
    if r1 > r0:
        _q8mr_q2_k(w, r0, r1 - r0, xq, xd, xs, toks, out, j, nb)


@njit(cache=True, nogil=True)
def dequant_q3_k(w: np.ndarray, out: np.ndarray) -> None:
    _deq_q3_k(w, out, _nblocks(w.shape[0], w.strides[0], 110, out.shape[0], out.strides[0], 4))


@njit(cache=True, nogil=True)
def dot_f32_q3_k(w: np.ndarray, x: np.ndarray) -> float:
    return _f32_q3_k(w, x, _nblocks(w.shape[0], w.strides[0], 110, x.shape[0], x.strides[0], 4))


@njit(cache=True, nogil=True)
def dot_q8_q3_k(w: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray) -> float:
    nb = _nblocks(w.shape[0], w.strides[0], 110, xq.shape[0], xq.strides[0], 1)
    _check_scales(nb, xd.shape[0], xd.strides[0], xs.shape[0], xs.strides[0])
    return _q8_q3_k(w, xq, xd, xs, nb)


@njit(cache=True, nogil=True)
def dot_q8_q3_k_multi(w: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray, toks: tuple) -> tuple:
    nb = _nblocks(w.shape[0], w.strides[0], 110, xq.shape[1], xq.strides[1], 1)
    _check_scales(nb, xd.shape[1], xd.strides[1], xs.shape[1], xs.strides[1])
    _check_tokens(toks, min(xq.shape[0], xd.shape[0], xs.shape[0]))
    return _q8m_q3_k(w, xq, xd, xs, toks, nb)


@njit(cache=True, nogil=True)
def dot_q8_q3_k_rows(w: np.ndarray, r0: int, r1: int, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                    out: np.ndarray) -> None:
    nb = _check_rows(w.shape[0], w.strides[0], w.shape[1], 110, r0, r1, out.shape[0], out.strides[0])
    _nblocks(w.shape[1], w.strides[1], 110, xq.shape[0], xq.strides[0], 1)
    _check_scales(nb, xd.shape[0], xd.strides[0], xs.shape[0], xs.strides[0])
    if r1 > r0:
        _q8r_q3_k(w, r0, r1 - r0, xq, xd, xs, out, nb)


@njit(cache=True, nogil=True)
def dot_q8_q3_k_multi_rows(w: np.ndarray, r0: int, r1: int, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                            toks: tuple, out: np.ndarray, j: int) -> None:
    nb = _nb_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, 110)
    if r1 > r0:
        _q8mr_q3_k(w, r0, r1 - r0, xq, xd, xs, toks, out, j, nb)


@njit(cache=True, nogil=True)
def dequant_q4_k(w: np.ndarray, out: np.ndarray) -> None:
    _deq_q4_k(w, out, _nblocks(w.shape[0], w.strides[0], 144, out.shape[0], out.strides[0], 4))


@njit(cache=True, nogil=True)
def dot_f32_q4_k(w: np.ndarray, x: np.ndarray) -> float:
    return _f32_q4_k(w, x, _nblocks(w.shape[0], w.strides[0], 144, x.shape[0], x.strides[0], 4))


@njit(cache=True, nogil=True)
def dot_q8_q4_k(w: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray) -> float:
    nb = _nblocks(w.shape[0], w.strides[0], 144, xq.shape[0], xq.strides[0], 1)
    _check_scales(nb, xd.shape[0], xd.strides[0], xs.shape[0], xs.strides[0])
    return _q8_q4_k(w, xq, xd, xs, nb)


@njit(cache=True, nogil=True)
def dot_q8_q4_k_multi(w: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray, toks: tuple) -> tuple:
    nb = _nblocks(w.shape[0], w.strides[0], 144, xq.shape[1], xq.strides[1], 1)
    _check_scales(nb, xd.shape[1], xd.strides[1], xs.shape[1], xs.strides[1])
    _check_tokens(toks, min(xq.shape[0], xd.shape[0], xs.shape[0]))
    return _q8m_q4_k(w, xq, xd, xs, toks, nb)


@njit(cache=True, nogil=True)
def dot_q8_q4_k_rows(w: np.ndarray, r0: int, r1: int, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                    out: np.ndarray) -> None:
    nb = _check_rows(w.shape[0], w.strides[0], w.shape[1], 144, r0, r1, out.shape[0], out.strides[0])
    _nblocks(w.shape[1], w.strides[1], 144, xq.shape[0], xq.strides[0], 1)
    _check_scales(nb, xd.shape[0], xd.strides[0], xs.shape[0], xs.strides[0])
    if r1 > r0:
        _q8r_q4_k(w, r0, r1 - r0, xq, xd, xs, out, nb)


@njit(cache=True, nogil=True)
def dot_q8_q4_k_multi_rows(w: np.ndarray, r0: int, r1: int, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                            toks: tuple, out: np.ndarray, j: int) -> None:
    nb = _nb_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, 144)
    if r1 > r0:
        _q8mr_q4_k(w, r0, r1 - r0, xq, xd, xs, toks, out, j, nb)


@njit(cache=True, nogil=True)
def dequant_q5_k(w: np.ndarray, out: np.ndarray) -> None:
    _deq_q5_k(w, out, _nblocks(w.shape[0], w.strides[0], 176, out.shape[0], out.strides[0], 4))


@njit(cache=True, nogil=True)
def dot_f32_q5_k(w: np.ndarray, x: np.ndarray) -> float:
    return _f32_q5_k(w, x, _nblocks(w.shape[0], w.strides[0], 176, x.shape[0], x.strides[0], 4))


@njit(cache=True, nogil=True)
def dot_q8_q5_k(w: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray) -> float:
    nb = _nblocks(w.shape[0], w.strides[0], 176, xq.shape[0], xq.strides[0], 1)
    _check_scales(nb, xd.shape[0], xd.strides[0], xs.shape[0], xs.strides[0])
    return _q8_q5_k(w, xq, xd, xs, nb)


@njit(cache=True, nogil=True)
def dot_q8_q5_k_multi(w: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray, toks: tuple) -> tuple:
    nb = _nblocks(w.shape[0], w.strides[0], 176, xq.shape[1], xq.strides[1], 1)
    _check_scales(nb, xd.shape[1], xd.strides[1], xs.shape[1], xs.strides[1])
    _check_tokens(toks, min(xq.shape[0], xd.shape[0], xs.shape[0]))
    return _q8m_q5_k(w, xq, xd, xs, toks, nb)


@njit(cache=True, nogil=True)
def dot_q8_q5_k_rows(w: np.ndarray, r0: int, r1: int, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                    out: np.ndarray) -> None:
    nb = _check_rows(w.shape[0], w.strides[0], w.shape[1], 176, r0, r1, out.shape[0], out.strides[0])
    _nblocks(w.shape[1], w.strides[1], 176, xq.shape[0], xq.strides[0], 1)
    _check_scales(nb, xd.shape[0], xd.strides[0], xs.shape[0], xs.strides[0])
    if r1 > r0:
        _q8r_q5_k(w, r0, r1 - r0, xq, xd, xs, out, nb)


@njit(cache=True, nogil=True)
def dot_q8_q5_k_multi_rows(w: np.ndarray, r0: int, r1: int, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                            toks: tuple, out: np.ndarray, j: int) -> None:
    nb = _nb_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, 176)
    if r1 > r0:
        _q8mr_q5_k(w, r0, r1 - r0, xq, xd, xs, toks, out, j, nb)


@njit(cache=True, nogil=True)
def dequant_q6_k(w: np.ndarray, out: np.ndarray) -> None:
    _deq_q6_k(w, out, _nblocks(w.shape[0], w.strides[0], 210, out.shape[0], out.strides[0], 4))


@njit(cache=True, nogil=True)
def dot_f32_q6_k(w: np.ndarray, x: np.ndarray) -> float:
    return _f32_q6_k(w, x, _nblocks(w.shape[0], w.strides[0], 210, x.shape[0], x.strides[0], 4))


@njit(cache=True, nogil=True)
def dot_q8_q6_k(w: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray) -> float:
    nb = _nblocks(w.shape[0], w.strides[0], 210, xq.shape[0], xq.strides[0], 1)
    _check_scales(nb, xd.shape[0], xd.strides[0], xs.shape[0], xs.strides[0])
    return _q8_q6_k(w, xq, xd, xs, nb)


@njit(cache=True, nogil=True)
def dot_q8_q6_k_multi(w: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray, toks: tuple) -> tuple:
    nb = _nblocks(w.shape[0], w.strides[0], 210, xq.shape[1], xq.strides[1], 1)
    _check_scales(nb, xd.shape[1], xd.strides[1], xs.shape[1], xs.strides[1])
    _check_tokens(toks, min(xq.shape[0], xd.shape[0], xs.shape[0]))
    return _q8m_q6_k(w, xq, xd, xs, toks, nb)


@njit(cache=True, nogil=True)
def dot_q8_q6_k_rows(w: np.ndarray, r0: int, r1: int, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                    out: np.ndarray) -> None:
    nb = _check_rows(w.shape[0], w.strides[0], w.shape[1], 210, r0, r1, out.shape[0], out.strides[0])
    _nblocks(w.shape[1], w.strides[1], 210, xq.shape[0], xq.strides[0], 1)
    _check_scales(nb, xd.shape[0], xd.strides[0], xs.shape[0], xs.strides[0])
    if r1 > r0:
        _q8r_q6_k(w, r0, r1 - r0, xq, xd, xs, out, nb)


@njit(cache=True, nogil=True)
def dot_q8_q6_k_multi_rows(w: np.ndarray, r0: int, r1: int, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                            toks: tuple, out: np.ndarray, j: int) -> None:
    nb = _nb_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, 210)
    if r1 > r0:
        _q8mr_q6_k(w, r0, r1 - r0, xq, xd, xs, toks, out, j, nb)
