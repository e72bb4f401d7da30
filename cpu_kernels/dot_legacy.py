"""Legacy GGML quants (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): row dequant and row dots as LLVM vector IR.

Blocks of 32 elements (ggml-quants.c): an fp16 scale d, for Q4_1/Q5_1 an fp16 min m, for Q5_* 32 high bits,
then the quants. Element j of a nibble block is the low nibble of byte j, element j+16 its high nibble; the Q5
high bit of element j is bit j of the little-endian qh word. Values: d*q (q signed) or d*q + m (q unsigned).

Each block is decoded in registers to 32 small integers q = u - o (<32 x i8> u unsigned, o a constant) plus d
(and m); three loops share that decoder:
  dequant: out = d*q (+ m), the same float ops as gguf-py, so the result is bit-exact
  dot_f32: sum of (d*q (+ m)) * x, float32 fma into 4 independent accumulators (the accuracy reference)
  dot_q8:  sum of d*xd[b] * (q . xq) (+ m * xd[b] * sum(xq), actq xs: llama.cpp's Q8_1 s), integer sums exact,
           converted to float once per block. With AVX512-VNNI two blocks per step: one vpdpbusd of u against
           64 int8 activations, minus o * sum(xq) from a second one. Otherwise one block per step: vpmaddwd
           on sign-extended lanes (AVX-512), vpsignb + vpmaddubsw + vpmaddwd (AVX2), or the generic even/odd
           i16 product pattern elsewhere.
Rows stream from DRAM, so the loops prefetch PREFETCH_BYTES ahead of the block being read (rows of a matrix
are contiguous, so this runs on into the next row).
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from strata_nb.cpu_kernels.ir import array_ptr, each_row, host_features, row_ptrs
from strata_nb.cpu_kernels.qtypes import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0

PREFETCH_BYTES = 4096
UNROLL = 4  # blocks per loop iteration, one accumulator each

_I1, _I8, _I16, _I32, _I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_PI8 = _I8.as_pointer()


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _c(v: int) -> ir.Constant:
    """i64 constant (offsets and indices)."""
    return ir.Constant(_I64, v)


def _splat(b: ir.IRBuilder, v: ir.Value, n: int) -> ir.Value:
    vt = _vec(v.type, n)
    one = b.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(_I32, 0))
    return b.shuffle_vector(one, ir.Constant(vt, ir.Undefined), ir.Constant(_vec(_I32, n), [0] * n))


def _const_vec(t: ir.Type, n: int, v: int) -> ir.Constant:
    return ir.Constant(_vec(t, n), [v] * n)


def _shuffle(b: ir.IRBuilder, a: ir.Value, c: ir.Value | None, idx: list[int]) -> ir.Value:
    c = ir.Constant(a.type, ir.Undefined) if c is None else c
    return b.shuffle_vector(a, c, ir.Constant(_vec(_I32, len(idx)), idx))


def _load(b: ir.IRBuilder, base: ir.Value, off: ir.Value, ty: ir.Type, align: int = 1) -> ir.Value:
    p = b.gep(base, [off])
    return b.load(b.bitcast(p, ty.as_pointer()), align=align)


def _load_half(b: ir.IRBuilder, base: ir.Value, off: ir.Value) -> ir.Value:
    h = _load(b, base, off, _I16)
    return b.fpext(b.bitcast(h, ir.HalfType()), _F32)


def _intrinsic_fn(b: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, args), name)


def _fma(b: ir.IRBuilder, x: ir.Value, y: ir.Value, z: ir.Value) -> ir.Value:
    n = x.type.count
    fn = _intrinsic_fn(b, f"llvm.fma.v{n}f32", x.type, [x.type] * 3)
    return b.call(fn, [x, y, z])


def _prefetch(b: ir.IRBuilder, base: ir.Value, off: ir.Value) -> None:
    fn = _intrinsic_fn(b, "llvm.prefetch.p0", ir.VoidType(), [_PI8, _I32, _I32, _I32])
    b.call(fn, [b.gep(base, [off]), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _hsum(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Horizontal float sum by halving (a fixed, reproducible order)."""
    n = v.type.count
    while n > 1:
        n //= 2
        v = b.fadd(_shuffle(b, v, None, list(range(n))), _shuffle(b, v, None, list(range(n, 2 * n))))
    return b.extract_element(v, ir.Constant(_I32, 0))


# ---- block decoders: (builder, block pointer) -> (q <32 x i8>, d float, m float or None) ----

def _concat(b: ir.IRBuilder, parts: list[ir.Value]) -> ir.Value:
    if len(parts) == 1:
        return parts[0]
    n = parts[0].type.count
    return _shuffle(b, parts[0], parts[1], list(range(2 * n)))


def _nibbles(b: ir.IRBuilder, blk: ir.Value, off: int, bb: int, n: int) -> ir.Value:
    """<32n x i8> nibbles of n consecutive blocks, each block low nibbles then high nibbles. Both blocks' bytes
    are unpacked in one 256-bit register when n = 2."""
    raw = _concat(b, [_load(b, blk, _c(k * bb + off), _vec(_I8, 16)) for k in range(n)])
    lo = b.and_(raw, _const_vec(_I8, 16 * n, 0x0F))
    hi = b.lshr(raw, _const_vec(_I8, 16 * n, 4))
    order = [i + 16 * k + 16 * n * h for k in range(n) for h in range(2) for i in range(16)]
    return _shuffle(b, lo, hi, order)


def _high_bits(b: ir.IRBuilder, blk: ir.Value, off: int, bb: int, n: int) -> ir.Value:
    """0x10 in lane j of each block where bit j of its little-endian 32-bit word at off is set."""
    words = [_load(b, blk, _c(k * bb + off), _I32) for k in range(n)]
    qh = words[0] if n == 1 else b.or_(b.zext(words[0], _I64), b.shl(b.zext(words[1], _I64), _c(32)))
    bits = b.bitcast(qh, _vec(_I1, 32 * n))
    return b.shl(b.zext(bits, _vec(_I8, 32 * n)), _const_vec(_I8, 32 * n, 4))


def _halves(b: ir.IRBuilder, blk: ir.Value, off: int, bb: int, n: int) -> list[ir.Value]:
    return [_load_half(b, blk, _c(k * bb + off)) for k in range(n)]


# Decoders of n (1 or 2) consecutive blocks of bb bytes: (u, o, d, m) with quants q = u - o, u unsigned
# (<32n x i8> bits) and o a constant, so that u fits vpdpbusd's unsigned operand; d the n scales, m the n mins
# or None.

def _dec_q4_0(b, blk, bb, n):
    return _nibbles(b, blk, 2, bb, n), 8, _halves(b, blk, 0, bb, n), None


def _dec_q4_1(b, blk, bb, n):
    return _nibbles(b, blk, 4, bb, n), 0, _halves(b, blk, 0, bb, n), _halves(b, blk, 2, bb, n)


def _dec_q5_0(b, blk, bb, n):
    u = b.or_(_nibbles(b, blk, 6, bb, n), _high_bits(b, blk, 2, bb, n))
    return u, 16, _halves(b, blk, 0, bb, n), None


def _dec_q5_1(b, blk, bb, n):
    u = b.or_(_nibbles(b, blk, 8, bb, n), _high_bits(b, blk, 4, bb, n))
    return u, 0, _halves(b, blk, 0, bb, n), _halves(b, blk, 2, bb, n)


def _dec_q8_0(b, blk, bb, n):
    q = _concat(b, [_load(b, blk, _c(k * bb + 2), _vec(_I8, 32)) for k in range(n)])
    return b.xor(q, _const_vec(_I8, 32 * n, 0x80)), 128, _halves(b, blk, 0, bb, n), None


# qtype -> (decoder, bytes per block)
_DECODERS = {
    Q4_0: (_dec_q4_0, 18), Q4_1: (_dec_q4_1, 20), Q5_0: (_dec_q5_0, 22), Q5_1: (_dec_q5_1, 24),
    Q8_0: (_dec_q8_0, 34),
}


def _decode_signed(decode, bb: int, b: ir.IRBuilder, blk: ir.Value):
    """(q, d, m) of one block with q = u - o as signed <32 x i8> (wraps back to the stored int8 for Q8_0)."""
    u, o, d, m = decode(b, blk, bb, 1)
    return (b.sub(u, _const_vec(_I8, 32, o)) if o else u), d[0], (None if m is None else m[0])


def _dequant_vec(b: ir.IRBuilder, q: ir.Value, d: ir.Value, m: ir.Value | None) -> ir.Value:
    v = b.fmul(b.sitofp(q, _vec(_F32, 32)), _splat(b, d, 32))
    return v if m is None else b.fadd(v, _splat(b, m, 32))


_FEATURES = host_features()
# lanes of the integer block dot (_int_dot): AVX2 sums 4 products per i32 lane, the others 2
_DOT_LANES = 8 if "avx2" in _FEATURES and not {"avx512f", "avx512bw"} <= _FEATURES else 16


def _int_dot(b: ir.IRBuilder, q: ir.Value, xq: ir.Value) -> ir.Value:
    """<_DOT_LANES x i32> sums of adjacent products of the block's signed quants q and activations xq.

    AVX-512: vpmaddwd on sign-extended i16 lanes. AVX2: vpmaddubsw on |q| and xq with q's sign (llama.cpp's
    vpsignb trick: |q| <= 128 and |xq| <= 127, so the i16 pair sums cannot saturate), then vpmaddwd against
    ones: half the instructions of the sign-extended form, which ran compute-bound. Elsewhere the generic
    even/odd i16 product pattern: LLVM narrows it to i16 multiplies and shuffles (vpmullw + vpmovdw...), 2-3x
    slower than the intrinsics."""
    if _DOT_LANES == 8:
        v32, v16w, v8 = _vec(_I8, 32), _vec(_I16, 16), _vec(_I32, 8)
        sign = _intrinsic_fn(b, "llvm.x86.avx2.psign.b", v32, [v32, v32])
        ubsw = _intrinsic_fn(b, "llvm.x86.avx2.pmadd.ub.sw", v16w, [v32, v32])
        wd = _intrinsic_fn(b, "llvm.x86.avx2.pmadd.wd", v8, [v16w, v16w])
        p = b.call(ubsw, [b.call(sign, [q, q]), b.call(sign, [xq, q])])
        return b.call(wd, [p, ir.Constant(v16w, [1] * 16)])
    a = b.sext(q, _vec(_I16, 32))
    c = b.sext(xq, _vec(_I16, 32))
    if {"avx512f", "avx512bw"} <= _FEATURES:
        fn = _intrinsic_fn(b, "llvm.x86.avx512.pmaddw.d.512", _vec(_I32, 16), [_vec(_I16, 32)] * 2)
        return b.call(fn, [a, c])
    even, odd = list(range(0, 32, 2)), list(range(1, 32, 2))
    v32 = _vec(_I32, 16)
    ae, ao = b.sext(_shuffle(b, a, None, even), v32), b.sext(_shuffle(b, a, None, odd), v32)
    ce, co = b.sext(_shuffle(b, c, None, even), v32), b.sext(_shuffle(b, c, None, odd), v32)
    return b.add(b.mul(ae, ce), b.mul(ao, co))


def _row_loop(b: ir.IRBuilder, w: ir.Value, nblk: ir.Value, bb: int, acc_types: list[ir.Type],
              step) -> list[ir.Value]:
    """Loop over nblk blocks of bb bytes, UNROLL per iteration, prefetching ahead of w.

    step(builder, block index, block pointer, accumulator values) -> new accumulator values, with UNROLL
    independent accumulator sets, one per block of an iteration. Returns the final values of every set,
    flattened set by set.
    """
    slots = [[cgutils.alloca_once_value(b, ir.Constant(t, None)) for t in acc_types] for _ in range(UNROLL)]

    def do_block(i, lane):
        blk = b.gep(w, [b.mul(i, _c(bb))])
        new = step(b, i, blk, [b.load(s) for s in slots[lane]])
        for s, v in zip(slots[lane], new):
            b.store(v, s)

    n_iter = b.udiv(nblk, _c(UNROLL))
    with cgutils.for_range(b, n_iter) as loop:
        i0 = b.mul(loop.index, _c(UNROLL))
        base = b.add(b.mul(i0, _c(bb)), _c(PREFETCH_BYTES))
        for line in range(0, UNROLL * bb, 64):
            _prefetch(b, w, b.add(base, _c(line)))
        for lane in range(UNROLL):
            do_block(b.add(i0, _c(lane)), lane)
    with cgutils.for_range(b, nblk, start=b.mul(n_iter, _c(UNROLL))) as loop:
        do_block(loop.index, 0)
    return [b.load(s) for lane in slots for s in lane]


def _qtype_of(qt) -> int:
    if not isinstance(qt, types.IntegerLiteral) or qt.literal_value not in _DECODERS:
        raise TypeError("legacy quant kernels need a literal Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 type id")
    return qt.literal_value


@intrinsic(prefer_literal=True)
def _ir_dequant(typingctx, w, out, nblk, qt):
    decode, bb = _DECODERS[_qtype_of(qt)]

    def codegen(context, builder, sig, args):
        wp = array_ptr(context, builder, sig.args[0], args[0])
        op = array_ptr(context, builder, sig.args[1], args[1], _F32)

        def step(b, i, blk, accs):
            q, d, m = _decode_signed(decode, bb, b, blk)
            dst = b.bitcast(b.gep(op, [b.mul(i, _c(32))]), _vec(_F32, 32).as_pointer())
            b.store(_dequant_vec(b, q, d, m), dst, align=4)
            return []

        _row_loop(builder, wp, builder.sext(args[2], _I64), bb, [], step)
        return context.get_dummy_value()

    return types.void(w, out, types.int64, qt), codegen


@intrinsic(prefer_literal=True)
def _ir_dot_f32(typingctx, w, x, nblk, qt):
    decode, bb = _DECODERS[_qtype_of(qt)]

    def codegen(context, builder, sig, args):
        wp = array_ptr(context, builder, sig.args[0], args[0])
        xp = array_ptr(context, builder, sig.args[1], args[1])

        def step(b, i, blk, accs):
            q, d, m = _decode_signed(decode, bb, b, blk)
            xv = _load(b, xp, b.mul(i, _c(128)), _vec(_F32, 32), align=4)
            return [_fma(b, _dequant_vec(b, q, d, m), xv, accs[0])]

        accs = _row_loop(builder, wp, builder.sext(args[2], _I64), bb, [_vec(_F32, 32)], step)
        tot = builder.fadd(builder.fadd(accs[0], accs[1]), builder.fadd(accs[2], accs[3]))
        return _hsum(builder, tot)

    return types.float32(w, x, types.int64, qt), codegen


def _dpbusd(b: ir.IRBuilder, u: ir.Value, x: ir.Value) -> ir.Value:
    """<16 x i32> sums of 4 adjacent products of unsigned u and signed x (<64 x i8> each): AVX512-VNNI."""
    v16 = _vec(_I32, 16)
    fn = _intrinsic_fn(b, "llvm.x86.avx512.vpdpbusd.512", v16, [v16] * 3)
    return b.call(fn, [ir.Constant(v16, None), b.bitcast(u, v16), b.bitcast(x, v16)])


def _q8_rows(b: ir.IRBuilder, wp: ir.Value, nblk: ir.Value, decode, bb: int, toks: list) -> list:
    """dot_q8 of one row against each token of toks, a list of (xq i8*, xd f32*, xs f32*) pointers: each block
    is decoded once and used for every token. Every token keeps its own accumulators and the same float
    operations in the same order as a single-token call, so each result is bit-identical to it."""
    has_min = decode in (_dec_q4_1, _dec_q5_1)
    vnni = {"avx512f", "avx512bw", "avx512vnni"} <= _FEATURES
    nt = len(toks)

    def single(first):
        """One block per step: vpmaddwd on sign-extended lanes; blocks counted from block first."""
        def step(b, i, blk, accs):
            i = b.add(i, first)
            q, d, m = _decode_signed(decode, bb, b, blk)
            new = []
            for k, (qp, dp, sp) in enumerate(toks):
                xv = _load(b, qp, b.mul(i, _c(32)), _vec(_I8, 32))
                isum = b.sitofp(_int_dot(b, q, xv), _vec(_F32, _DOT_LANES))
                scale = b.fmul(d, b.load(b.gep(dp, [i]), align=4))
                new.append(_fma(b, isum, _splat(b, scale, _DOT_LANES), accs[k * nacc]))
                if m is not None:
                    i2 = b.mul(i, _c(2))
                    sx = b.fadd(b.load(b.gep(sp, [i2]), align=4), b.load(b.gep(sp, [b.add(i2, _c(1))]), align=4))
                    new.append(b.fadd(accs[k * nacc + 1], b.fmul(m, sx)))
            return new
        return step

    def pair(b, i, blk, accs):
        """Two blocks per step (i counts pairs): one vpdpbusd over 64 quants, lanes 0-7 block 2i."""
        u, o, (da, db), m = decode(b, blk, bb, 2)
        v2 = _vec(_F32, 2)
        dd = b.insert_element(b.insert_element(ir.Constant(v2, ir.Undefined), da, _c(0)), db, _c(1))
        if has_min:
            mm = b.insert_element(b.insert_element(ir.Constant(v2, ir.Undefined), m[0], _c(0)), m[1], _c(1))
        new = []
        for k, (qp, dp, sp) in enumerate(toks):
            xv = _load(b, qp, b.mul(i, _c(64)), _vec(_I8, 64))
            isum = _dpbusd(b, u, xv)
            if o:
                isum = b.sub(isum, _dpbusd(b, _const_vec(_I8, 64, o), xv))
            xd2 = _load(b, b.bitcast(dp, _PI8), b.mul(i, _c(8)), v2, align=4)
            scale = _shuffle(b, b.fmul(dd, xd2), None, [0] * 8 + [1] * 8)
            new.append(_fma(b, b.sitofp(isum, _vec(_F32, 16)), scale, accs[k * nacc]))
            if has_min:
                sx = _load(b, b.bitcast(sp, _PI8), b.mul(i, _c(16)), _vec(_F32, 4), align=4)
                sx2 = b.fadd(_shuffle(b, sx, None, [0, 2]), _shuffle(b, sx, None, [1, 3]))
                new.append(_fma(b, mm, sx2, accs[k * nacc + 1]))
        return new

    v16 = _vec(_F32, 16)
    nacc = 2 if has_min else 1
    single_types = [_vec(_F32, _DOT_LANES)] + ([_F32] if has_min else [])
    if vnni:
        npair = b.udiv(nblk, _c(2))
        accs = _row_loop(b, wp, npair, 2 * bb, ([v16] + ([_vec(_F32, 2)] if has_min else [])) * nt, pair)
        first = b.mul(npair, _c(2))
        tail = _row_loop(b, b.gep(wp, [b.mul(first, _c(bb))]), b.sub(nblk, first), bb, single_types * nt,
                         single(first))
        accs = accs + tail
    else:
        accs = _row_loop(b, wp, nblk, bb, single_types * nt, single(_c(0)))
    res = []
    per_set = nacc * nt  # _row_loop returns accumulator sets (one per unrolled block) one after another
    for k in range(nt):
        mine = [accs[s + k * nacc:s + (k + 1) * nacc] for s in range(0, len(accs), per_set)]
        tot = mine[0][0]
        for v in mine[1:]:
            tot = b.fadd(tot, v[0])
        tot = _hsum(b, tot)
        if has_min:
            for v in (v[1] for v in mine):
                tot = b.fadd(tot, _hsum(b, v) if isinstance(v.type, ir.VectorType) else v)
        res.append(tot)
    return res


@intrinsic(prefer_literal=True)
def _ir_dot_q8(typingctx, w, xq, xd, xs, nblk, qt):
    decode, bb = _DECODERS[_qtype_of(qt)]

    def codegen(context, builder, sig, args):
        wp = array_ptr(context, builder, sig.args[0], args[0])
        qp = array_ptr(context, builder, sig.args[1], args[1])
        dp = array_ptr(context, builder, sig.args[2], args[2], _F32)
        sp = array_ptr(context, builder, sig.args[3], args[3], _F32)
        return _q8_rows(builder, wp, builder.sext(args[4], _I64), decode, bb, [(qp, dp, sp)])[0]

    return types.float32(w, xq, xd, xs, types.int64, qt), codegen


@intrinsic(prefer_literal=True)
def _ir_dot_q8_multi(typingctx, w, xq, xd, xs, toks, nblk, qt):
    """Tokens toks (a tuple of row indices) of the 2-D xq, xd, xs; returns a tuple of their dots."""
    decode, bb = _DECODERS[_qtype_of(qt)]

    def codegen(context, builder, sig, args):
        wp = array_ptr(context, builder, sig.args[0], args[0])
        ts = [context.cast(builder, builder.extract_value(args[4], k), ty, types.intp)
              for k, ty in enumerate(sig.args[4])]
        rows = [row_ptrs(context, builder, sig.args[j], args[j], e, ts) for j, e in ((1, _I8), (2, _F32), (3, _F32))]
        res = _q8_rows(builder, wp, builder.sext(args[5], _I64), decode, bb, list(zip(*rows)))
        return context.make_tuple(builder, sig.return_type, res)

    if not isinstance(toks, types.BaseTuple) or not all(isinstance(t, types.Integer) for t in toks):
        raise TypeError("token indices must be a tuple of integers")
    return types.UniTuple(types.float32, len(toks))(w, xq, xd, xs, toks, types.int64, qt), codegen


@intrinsic(prefer_literal=True)
def _ir_dot_q8_rows(typingctx, w, r0, n, xq, xd, xs, out, nblk, qt):
    """out[r0 + j] = dot_q8 of row r0 + j of the 2-D w (rows of nblk blocks, contiguous) for j < n: one call
    for a task's rows, so the per-row call, checks and constants are paid once."""
    decode, bb = _DECODERS[_qtype_of(qt)]

    def codegen(context, builder, sig, args):
        b = builder
        nblk = b.sext(args[7], _I64)
        rb = b.mul(nblk, _c(bb))
        r0 = context.cast(b, args[1], sig.args[1], types.intp)
        w0 = b.gep(array_ptr(context, b, sig.args[0], args[0]), [b.mul(r0, rb)])
        op = b.gep(array_ptr(context, b, sig.args[6], args[6], _F32), [r0])
        tok = (array_ptr(context, b, sig.args[3], args[3]), array_ptr(context, b, sig.args[4], args[4], _F32),
               array_ptr(context, b, sig.args[5], args[5], _F32))
        each_row(b, w0, rb, context.cast(b, args[2], sig.args[2], types.intp),
                 lambda p: _q8_rows(b, p, nblk, decode, bb, [tok]), [op])
        return context.get_dummy_value()

    return types.void(w, r0, n, xq, xd, xs, out, types.int64, qt), codegen


@intrinsic(prefer_literal=True)
def _ir_dot_q8_multi_rows(typingctx, w, r0, n, xq, xd, xs, toks, out, j, nblk, qt):
    """out[j + k, r0 + i] = dot_q8 of row r0 + i of the 2-D w against token toks[k], for i < n: a task's rows
    against a group of tokens in one call, each row decoded once for the group."""
    decode, bb = _DECODERS[_qtype_of(qt)]

    def codegen(context, builder, sig, args):
        b = builder
        nblk = b.sext(args[9], _I64)
        rb = b.mul(nblk, _c(bb))
        r0 = context.cast(b, args[1], sig.args[1], types.intp)
        w0 = b.gep(array_ptr(context, b, sig.args[0], args[0]), [b.mul(r0, rb)])
        ts = [context.cast(b, b.extract_value(args[6], k), ty, types.intp) for k, ty in enumerate(sig.args[6])]
        rows = [row_ptrs(context, b, sig.args[i], args[i], e, ts) for i, e in ((3, _I8), (4, _F32), (5, _F32))]
        j = context.cast(b, args[8], sig.args[8], types.intp)
        ops = [b.gep(p, [r0]) for p in row_ptrs(context, b, sig.args[7], args[7], _F32,
                                                  [b.add(j, _c(k)) for k in range(len(ts))])]
        each_row(b, w0, rb, context.cast(b, args[2], sig.args[2], types.intp),
                 lambda p: _q8_rows(b, p, nblk, decode, bb, list(zip(*rows))), ops)
        return context.get_dummy_value()

    if not isinstance(toks, types.BaseTuple) or not all(isinstance(t, types.Integer) for t in toks):
        raise TypeError("token indices must be a tuple of integers")
    return types.void(w, r0, n, xq, xd, xs, toks, out, j, types.int64, qt), codegen


# ---- shape checks: one compare per row (an IR loop past the end would read foreign memory). They take
# lengths, not arrays: an array argument costs an NRT incref/decref pair per call, atomics that threads
# sharing one activation row would contend on.

@njit(cache=True, nogil=True, inline="always")
def _nblk_f32(nw, nx, bb):
    nblk = nw // bb
    if nw != nblk * bb or nx != nblk * 32:
        raise ValueError("row length does not match the activation/output length")
    return nblk


@njit(cache=True, nogil=True, inline="always")
def _nblk_q8(nw, nxq, nxd, nxs, bb):
    nblk = nw // bb
    if nw != nblk * bb or nxq != nblk * 32 or nxd != nblk or nxs != 2 * nblk:
        raise ValueError("row length does not match the int8 activation layout")
    return nblk


@njit(cache=True, nogil=True, inline="always")
def _nblk_q8_multi(nw, nxq, nxd, nxs, ntok, toks, bb):
    """Blocks of the row, checked against 2-D activations (row lengths nxq/nxd/nxs, ntok rows) and tokens."""
    nblk = _nblk_q8(nw, nxq, nxd, nxs, bb)
    for t in toks:
        if t < 0 or t >= ntok:
            raise ValueError("token index out of range of the activation rows")
    return nblk


@njit(cache=True, nogil=True, inline="always")
def _nblk_rows(wrows, wrow_stride, wbytes, wstride, nxq, nxd, nxs, r0, r1, nout, ostride, bb):
    """Blocks per row of a 2-D matrix whose rows r0:r1 a dot_q8_rows call reads (into out[r0:r1])."""
    nblk = _nblk_q8(wbytes, nxq, nxd, nxs, bb)
    if wrow_stride != wbytes or wstride != 1:
        raise ValueError("matrix rows are not contiguous")
    if r0 < 0 or r1 > wrows or r1 > nout or ostride != 4:
        raise ValueError("row range outside the matrix or the output")
    return nblk


@njit(cache=True, nogil=True, inline="always")
def _nblk_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, bb):
    """Blocks per row for a dot_q8_multi_rows call: rows r0:r1 of the matrix against tokens toks of 2-D
    activations, into out[j:j + len(toks), r0:r1]. It takes the arrays (the checks above take lengths): it is
    inlined, and the drivers pass views without a meminfo (matmul._noref), so no reference count is touched."""
    nblk = _nblk_rows(w.shape[0], w.strides[0], w.shape[1], w.strides[1], xq.shape[1], xd.shape[1], xs.shape[1],
                      r0, r1, out.shape[1], out.strides[1], bb)
    if xq.strides[1] != 1 or xd.strides[1] != 4 or xs.strides[1] != 4:
        raise ValueError("int8 activation rows are not contiguous")
    ntok = min(xq.shape[0], xd.shape[0], xs.shape[0])
    for t in toks:
        if t < 0 or t >= ntok:
            raise ValueError("token index out of range of the activation rows")
    if j < 0 or j + len(toks) > out.shape[0]:
        raise ValueError("output rows out of range")
    return nblk


# ---- public kernels: dequant_T(w, out), dot_f32_T(w, x), dot_q8_T(w, xq, xd, xs), and
# dot_q8_T_multi(w, xq, xd, xs, toks) -> tuple: the dots of the row against tokens toks (a tuple of n row
# indices) of 2-D activations xq int8[T, K], xd float32[T, K/32], xs float32[T, K/16], bit-identical to n
# single-token calls with the row decoded once. ----

@njit(cache=True, nogil=True)
def dequant_q4_0(w, out):
    _ir_dequant(w, out, _nblk_f32(w.size, out.size, 18), Q4_0)


@njit(cache=True, nogil=True)
def dequant_q4_1(w, out):
    _ir_dequant(w, out, _nblk_f32(w.size, out.size, 20), Q4_1)


@njit(cache=True, nogil=True)
def dequant_q5_0(w, out):
    _ir_dequant(w, out, _nblk_f32(w.size, out.size, 22), Q5_0)


@njit(cache=True, nogil=True)
def dequant_q5_1(w, out):
    _ir_dequant(w, out, _nblk_f32(w.size, out.size, 24), Q5_1)


@njit(cache=True, nogil=True)
def dequant_q8_0(w, out):
    _ir_dequant(w, out, _nblk_f32(w.size, out.size, 34), Q8_0)


@njit(cache=True, nogil=True)
def dot_f32_q4_0(w, x):
    return _ir_dot_f32(w, x, _nblk_f32(w.size, x.size, 18), Q4_0)


@njit(cache=True, nogil=True)
def dot_f32_q4_1(w, x):
    return _ir_dot_f32(w, x, _nblk_f32(w.size, x.size, 20), Q4_1)


@njit(cache=True, nogil=True)
def dot_f32_q5_0(w, x):
    return _ir_dot_f32(w, x, _nblk_f32(w.size, x.size, 22), Q5_0)


@njit(cache=True, nogil=True)
def dot_f32_q5_1(w, x):
    return _ir_dot_f32(w, x, _nblk_f32(w.size, x.size, 24), Q5_1)


@njit(cache=True, nogil=True)
def dot_f32_q8_0(w, x):
    return _ir_dot_f32(w, x, _nblk_f32(w.size, x.size, 34), Q8_0)


@njit(cache=True, nogil=True)
def dot_q8_q4_0(w, xq, xd, xs):
    return _ir_dot_q8(w, xq, xd, xs, _nblk_q8(w.size, xq.size, xd.size, xs.size, 18), Q4_0)


@njit(cache=True, nogil=True)
def dot_q8_q4_1(w, xq, xd, xs):
    return _ir_dot_q8(w, xq, xd, xs, _nblk_q8(w.size, xq.size, xd.size, xs.size, 20), Q4_1)


@njit(cache=True, nogil=True)
def dot_q8_q5_0(w, xq, xd, xs):
    return _ir_dot_q8(w, xq, xd, xs, _nblk_q8(w.size, xq.size, xd.size, xs.size, 22), Q5_0)


@njit(cache=True, nogil=True)
def dot_q8_q5_1(w, xq, xd, xs):
    return _ir_dot_q8(w, xq, xd, xs, _nblk_q8(w.size, xq.size, xd.size, xs.size, 24), Q5_1)


@njit(cache=True, nogil=True)
def dot_q8_q8_0(w, xq, xd, xs):
    return _ir_dot_q8(w, xq, xd, xs, _nblk_q8(w.size, xq.size, xd.size, xs.size, 34), Q8_0)


@njit(cache=True, nogil=True)
def dot_q8_q4_0_multi(w, xq, xd, xs, toks):
    ntok = min(xq.shape[0], xd.shape[0], xs.shape[0])
    if xq.strides[1] != 1 or xd.strides[1] != 4 or xs.strides[1] != 4:
        raise ValueError("int8 activation rows are not contiguous")
    nblk = _nblk_q8_multi(w.size, xq.shape[1], xd.shape[1], xs.shape[1], ntok, toks, 18)
    return _ir_dot_q8_multi(w, xq, xd, xs, toks, nblk, Q4_0)


@njit(cache=True, nogil=True)
def dot_q8_q4_1_multi(w, xq, xd, xs, toks):
    ntok = min(xq.shape[0], xd.shape[0], xs.shape[0])
    if xq.strides[1] != 1 or xd.strides[1] != 4 or xs.strides[1] != 4:
        raise ValueError("int8 activation rows are not contiguous")
    nblk = _nblk_q8_multi(w.size, xq.shape[1], xd.shape[1], xs.shape[1], ntok, toks, 20)
    return _ir_dot_q8_multi(w, xq, xd, xs, toks, nblk, Q4_1)


@njit(cache=True, nogil=True)
def dot_q8_q5_0_multi(w, xq, xd, xs, toks):
    ntok = min(xq.shape[0], xd.shape[0], xs.shape[0])
    if xq.strides[1] != 1 or xd.strides[1] != 4 or xs.strides[1] != 4:
        raise ValueError("int8 activation rows are not contiguous")
    nblk = _nblk_q8_multi(w.size, xq.shape[1], xd.shape[1], xs.shape[1], ntok, toks, 22)
    return _ir_dot_q8_multi(w, xq, xd, xs, toks, nblk, Q5_0)


@njit(cache=True, nogil=True)
def dot_q8_q5_1_multi(w, xq, xd, xs, toks):
    ntok = min(xq.shape[0], xd.shape[0], xs.shape[0])
    if xq.strides[1] != 1 or xd.strides[1] != 4 or xs.strides[1] != 4:
        raise ValueError("int8 activation rows are not contiguous")
    nblk = _nblk_q8_multi(w.size, xq.shape[1], xd.shape[1], xs.shape[1], ntok, toks, 24)
    return _ir_dot_q8_multi(w, xq, xd, xs, toks, nblk, Q5_1)


@njit(cache=True, nogil=True)
def dot_q8_q8_0_multi(w, xq, xd, xs, toks):
    ntok = min(xq.shape[0], xd.shape[0], xs.shape[0])
    if xq.strides[1] != 1 or xd.strides[1] != 4 or xs.strides[1] != 4:
        raise ValueError("int8 activation rows are not contiguous")
    nblk = _nblk_q8_multi(w.size, xq.shape[1], xd.shape[1], xs.shape[1], ntok, toks, 34)
    return _ir_dot_q8_multi(w, xq, xd, xs, toks, nblk, Q8_0)


@njit(cache=True, nogil=True)
def dot_q8_q4_0_rows(w, r0, r1, xq, xd, xs, out):
    nblk = _nblk_rows(w.shape[0], w.strides[0], w.shape[1], w.strides[1], xq.size, xd.size, xs.size, r0, r1,
                      out.shape[0], out.strides[0], 18)
    if xq.strides[0] != 1 or xd.strides[0] != 4 or xs.strides[0] != 4:
        raise ValueError("int8 activation row is not contiguous")
    if r1 > r0:
        _ir_dot_q8_rows(w, r0, r1 - r0, xq, xd, xs, out, nblk, Q4_0)


@njit(cache=True, nogil=True)
def dot_q8_q4_0_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j):
    nblk = _nblk_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, 18)
    if r1 > r0:
        _ir_dot_q8_multi_rows(w, r0, r1 - r0, xq, xd, xs, toks, out, j, nblk, Q4_0)


@njit(cache=True, nogil=True)
def dot_q8_q4_1_rows(w, r0, r1, xq, xd, xs, out):
    nblk = _nblk_rows(w.shape[0], w.strides[0], w.shape[1], w.strides[1], xq.size, xd.size, xs.size, r0, r1,
                      out.shape[0], out.strides[0], 20)
    if xq.strides[0] != 1 or xd.strides[0] != 4 or xs.strides[0] != 4:
        raise ValueError("int8 activation row is not contiguous")
    if r1 > r0:
        _ir_dot_q8_rows(w, r0, r1 - r0, xq, xd, xs, out, nblk, Q4_1)


@njit(cache=True, nogil=True)
def dot_q8_q4_1_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j):
    nblk = _nblk_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, 20)
    if r1 > r0:
        _ir_dot_q8_multi_rows(w, r0, r1 - r0, xq, xd, xs, toks, out, j, nblk, Q4_1)


@njit(cache=True, nogil=True)
def dot_q8_q5_0_rows(w, r0, r1, xq, xd, xs, out):
    nblk = _nblk_rows(w.shape[0], w.strides[0], w.shape[1], w.strides[1], xq.size, xd.size, xs.size, r0, r1,
                      out.shape[0], out.strides[0], 22)
    if xq.strides[0] != 1 or xd.strides[0] != 4 or xs.strides[0] != 4:
        raise ValueError("int8 activation row is not contiguous")
    if r1 > r0:
        _ir_dot_q8_rows(w, r0, r1 - r0, xq, xd, xs, out, nblk, Q5_0)


@njit(cache=True, nogil=True)
def dot_q8_q5_0_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j):
    nblk = _nblk_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, 22)
    if r1 > r0:
        _ir_dot_q8_multi_rows(w, r0, r1 - r0, xq, xd, xs, toks, out, j, nblk, Q5_0)


@njit(cache=True, nogil=True)
def dot_q8_q5_1_rows(w, r0, r1, xq, xd, xs, out):
    nblk = _nblk_rows(w.shape[0], w.strides[0], w.shape[1], w.strides[1], xq.size, xd.size, xs.size, r0, r1,
                      out.shape[0], out.strides[0], 24)
    if xq.strides[0] != 1 or xd.strides[0] != 4 or xs.strides[0] != 4:
        raise ValueError("int8 activation row is not contiguous")
    if r1 > r0:
        _ir_dot_q8_rows(w, r0, r1 - r0, xq, xd, xs, out, nblk, Q5_1)


@njit(cache=True, nogil=True)
def dot_q8_q5_1_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j):
    nblk = _nblk_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, 24)
    if r1 > r0:
        _ir_dot_q8_multi_rows(w, r0, r1 - r0, xq, xd, xs, toks, out, j, nblk, Q5_1)


@njit(cache=True, nogil=True)
def dot_q8_q8_0_rows(w, r0, r1, xq, xd, xs, out):
    nblk = _nblk_rows(w.shape[0], w.strides[0], w.shape[1], w.strides[1], xq.size, xd.size, xs.size, r0, r1,
                      out.shape[0], out.strides[0], 34)
    if xq.strides[0] != 1 or xd.strides[0] != 4 or xs.strides[0] != 4:
        raise ValueError("int8 activation row is not contiguous")
    if r1 > r0:
        _ir_dot_q8_rows(w, r0, r1 - r0, xq, xd, xs, out, nblk, Q8_0)


@njit(cache=True, nogil=True)
def dot_q8_q8_0_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j):
    nblk = _nblk_multi_rows(w, r0, r1, xq, xd, xs, toks, out, j, 34)
    if r1 > r0:
        _ir_dot_q8_multi_rows(w, r0, r1 - r0, xq, xd, xs, toks, out, j, nblk, Q8_0)
