"""Float weight rows (F32, F16, BF16) as LLVM vector IR: dequant to float32 and the float32 row dot.

Rows arrive as uint8 bytes (the weight is a uint8 view of the GGUF). Elements are widened to float32 in registers
(F16: bitcast to half and fpext, vcvtph2ps; BF16: zero-extend and shift left 16) 32 at a time, with a
1-element loop for lengths that are not a multiple of 32. The dot fmas into 4 independent <32 x float>
accumulators and prefetches PREFETCH_BYTES ahead, since weight rows stream from DRAM. Float weights have no
int8 path: their dot_f32 is also their fast path.

fdot / fdot_at: the float32 dot of two float32 vectors for the op kernels (rmsnorm, attention scores), in one fixed
summation order, so a result does not depend on how (or in which process) its caller was compiled.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from strata_nb.cpu_kernels.ir import array_ptr
from strata_nb.cpu_kernels.qtypes import BF16, F16, F32

PREFETCH_BYTES = 4096
CHUNK = 32  # elements per vector step
UNROLL = 4  # steps per loop iteration, one accumulator each

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_PI8 = _I8.as_pointer()
_ELEM_BYTES = {F32: 4, F16: 2, BF16: 2}


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _load(b: ir.IRBuilder, base: ir.Value, off: ir.Value, ty: ir.Type, align: int = 1) -> ir.Value:
    return b.load(b.bitcast(b.gep(base, [off]), ty.as_pointer()), align=align)


def _widen(qtype: int, b: ir.IRBuilder, w: ir.Value, i: ir.Value, n: int) -> ir.Value:
    """<n x float> of elements i..i+n of a row of qtype at byte pointer w."""
    off = b.mul(i, ir.Constant(_I64, _ELEM_BYTES[qtype]))
    if qtype == F32:
        return _load(b, w, off, _vec(_F32, n))
    h = _load(b, w, off, _vec(_I16, n))
    if qtype == F16:
        return b.fpext(b.bitcast(h, _vec(ir.HalfType(), n)), _vec(_F32, n))
    bits = b.shl(b.zext(h, _vec(_I32, n)), ir.Constant(_vec(_I32, n), [16] * n))
    return b.bitcast(bits, _vec(_F32, n))


def _fma(b: ir.IRBuilder, x: ir.Value, y: ir.Value, z: ir.Value) -> ir.Value:
    fnty = ir.FunctionType(x.type, [x.type] * 3)
    return b.call(cgutils.get_or_insert_function(b.module, fnty, f"llvm.fma.v{x.type.count}f32"), [x, y, z])


def _prefetch(b: ir.IRBuilder, base: ir.Value, off: ir.Value) -> None:
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [_PI8, i32, i32, i32])
    fn = cgutils.get_or_insert_function(b.module, fnty, "llvm.prefetch.p0")
    b.call(fn, [b.gep(base, [off]), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _hsum(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Horizontal float sum by halving (a fixed, reproducible order)."""
    n = v.type.count
    while n > 1:
        n //= 2
        und = ir.Constant(v.type, ir.Undefined)
        lo = b.shuffle_vector(v, und, ir.Constant(_vec(_I32, n), list(range(n))))
        hi = b.shuffle_vector(v, und, ir.Constant(_vec(_I32, n), list(range(n, 2 * n))))
        v = b.fadd(lo, hi)
    return b.extract_element(v, ir.Constant(_I32, 0))


def _row_loop(b: ir.IRBuilder, qtype: int, w: ir.Value, n: ir.Value, step) -> None:
    """Call step(builder, element index, <k x float> weights, lane) over n elements: UNROLL x CHUNK per
    iteration with lanes 0..UNROLL-1, then the remaining elements one at a time with lane UNROLL."""
    ebytes = _ELEM_BYTES[qtype]
    per_iter = UNROLL * CHUNK
    n_iter = b.udiv(n, ir.Constant(_I64, per_iter))
    with cgutils.for_range(b, n_iter) as loop:
        i0 = b.mul(loop.index, ir.Constant(_I64, per_iter))
        ahead = b.add(b.mul(i0, ir.Constant(_I64, ebytes)), ir.Constant(_I64, PREFETCH_BYTES))
        for line in range(0, per_iter * ebytes, 64):
            _prefetch(b, w, b.add(ahead, ir.Constant(_I64, line)))
        for lane in range(UNROLL):
            i = b.add(i0, ir.Constant(_I64, lane * CHUNK))
            step(b, i, _widen(qtype, b, w, i, CHUNK), lane)
    with cgutils.for_range(b, n, start=b.mul(n_iter, ir.Constant(_I64, per_iter))) as loop:
        step(b, loop.index, _widen(qtype, b, w, loop.index, 1), UNROLL)


def _qtype_of(qt) -> int:
    if not isinstance(qt, types.IntegerLiteral) or qt.literal_value not in _ELEM_BYTES:
        raise TypeError("float row kernels need a literal F32/F16/BF16 type id")
    return qt.literal_value


@intrinsic(prefer_literal=True)
def _ir_dequant(typingctx, w, out, n, qt):
    qtype = _qtype_of(qt)

    def codegen(context, builder, sig, args):
        wp = array_ptr(context, builder, sig.args[0], args[0])
        op = array_ptr(context, builder, sig.args[1], args[1], _F32)

        def step(b, i, v, lane):
            b.store(v, b.bitcast(b.gep(op, [i]), v.type.as_pointer()), align=4)

        _row_loop(builder, qtype, wp, builder.sext(args[2], _I64), step)
        return context.get_dummy_value()

    return types.void(w, out, types.int64, qt), codegen


@intrinsic(prefer_literal=True)
def _ir_dot(typingctx, w, x, n, qt):
    qtype = _qtype_of(qt)

    def codegen(context, builder, sig, args):
        wp = array_ptr(context, builder, sig.args[0], args[0])
        xp = array_ptr(context, builder, sig.args[1], args[1], _F32)
        zero = ir.Constant(_vec(_F32, CHUNK), None)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(UNROLL)]
        acc1 = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 1), None))

        def step(b, i, v, lane):
            slot = accs[lane] if lane < UNROLL else acc1
            xv = b.load(b.bitcast(b.gep(xp, [i]), v.type.as_pointer()), align=4)
            b.store(_fma(b, v, xv, b.load(slot)), slot)

        _row_loop(builder, qtype, wp, builder.sext(args[2], _I64), step)
        a = [builder.load(s) for s in accs]
        tot = _hsum(builder, builder.fadd(builder.fadd(a[0], a[1]), builder.fadd(a[2], a[3])))
        return builder.fadd(tot, builder.extract_element(builder.load(acc1), ir.Constant(_I32, 0)))

    return types.float32(w, x, types.int64, qt), codegen


@njit(cache=True, nogil=True, inline="always")
def _length(nw, nv, ebytes):
    """Elements in the row; it must fill w exactly and match v (an IR loop past the end reads foreign memory).
    Lengths, not arrays: an array argument costs an NRT incref/decref pair (atomics) per call."""
    n = nw // ebytes
    if nw != n * ebytes or nv != n:
        raise ValueError("row length does not match the activation/output length")
    return n


@njit(cache=True, nogil=True)
def dequant_f32(w, out):
    _ir_dequant(w, out, _length(w.size, out.size, 4), F32)


@njit(cache=True, nogil=True)
def dequant_f16(w, out):
    _ir_dequant(w, out, _length(w.size, out.size, 2), F16)


@njit(cache=True, nogil=True)
def dequant_bf16(w, out):
    _ir_dequant(w, out, _length(w.size, out.size, 2), BF16)


@njit(cache=True, nogil=True)
def dot_f32_f32(w, x):
    return _ir_dot(w, x, _length(w.size, x.size, 4), F32)


@njit(cache=True, nogil=True)
def dot_f32_f16(w, x):
    return _ir_dot(w, x, _length(w.size, x.size, 2), F16)


@njit(cache=True, nogil=True)
def dot_f32_bf16(w, x):
    return _ir_dot(w, x, _length(w.size, x.size, 2), BF16)


# fdot: FDOT_ACCS accumulators of <FDOT_W x float>, plain fmul + fadd (no fast-math flags, so LLVM may neither
# reassociate nor contract them): one summation order for every caller, target and compile (fresh or cached).
FDOT_W = 16
FDOT_ACCS = 4  # a power of two (the pairwise end)


def _fdot_ir(b: ir.IRBuilder, ap: ir.Value, bp: ir.Value, n: ir.Value) -> ir.Value:
    """sum(a[i] * b[i], i < n) of float pointers ap, bp: blocks of FDOT_ACCS * FDOT_W elements, one accumulator
    per FDOT_W-vector of a block; then the remaining whole vectors into accumulator 0; then the last n % FDOT_W
    elements into a scalar. The end: ((acc0 + acc1) + (acc2 + acc3)), halved horizontally, + the scalar."""
    vt = _vec(_F32, FDOT_W)
    accs = [cgutils.alloca_once_value(b, ir.Constant(vt, None)) for _ in range(FDOT_ACCS)]
    tail = cgutils.alloca_once_value(b, ir.Constant(_F32, 0.0))

    def vstep(i, acc):
        av = b.load(b.bitcast(b.gep(ap, [i]), vt.as_pointer()), align=4)
        bv = b.load(b.bitcast(b.gep(bp, [i]), vt.as_pointer()), align=4)
        b.store(b.fadd(b.load(acc), b.fmul(av, bv)), acc)

    per = FDOT_ACCS * FDOT_W
    n_blk = b.mul(b.udiv(n, ir.Constant(_I64, per)), ir.Constant(_I64, per))
    n_vec = b.mul(b.udiv(n, ir.Constant(_I64, FDOT_W)), ir.Constant(_I64, FDOT_W))
    with cgutils.for_range_slice(b, ir.Constant(_I64, 0), n_blk, ir.Constant(_I64, per), _I64) as (i0, _):
        for k in range(FDOT_ACCS):
            vstep(b.add(i0, ir.Constant(_I64, k * FDOT_W)), accs[k])
    with cgutils.for_range_slice(b, n_blk, n_vec, ir.Constant(_I64, FDOT_W), _I64) as (i, _):
        vstep(i, accs[0])
    with cgutils.for_range_slice(b, n_vec, n, ir.Constant(_I64, 1), _I64) as (i, _):
        x = b.fmul(b.load(b.gep(ap, [i])), b.load(b.gep(bp, [i])))
        b.store(b.fadd(b.load(tail), x), tail)
    a = [b.load(acc) for acc in accs]
    while len(a) > 1:  # pairwise: ((acc0 + acc1) + (acc2 + acc3))
        a = [b.fadd(a[k], a[k + 1]) for k in range(0, len(a), 2)]
    return b.fadd(_hsum(b, a[0]), b.load(tail))


def _check_f32_c(name, arr):
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.layout == "C"):
        raise TypeError(f"fdot: {name} must be a C-contiguous float32 array, got {arr}")


@intrinsic
def fdot_at(typingctx, a, ia, b, ib, n):
    """sum(a.flat[ia + i] * b.flat[ib + i] for i < n) in fdot's fixed order; a, b C-contiguous float32 arrays of
    any rank (a row of a cache by its flat offset: no view, so no reference counting per row). Unchecked: the
    caller keeps ia + n and ib + n within the arrays (no raise: it would serialize a prange body)."""
    _check_f32_c("a", a)
    _check_f32_c("b", b)
    sig = types.float32(a, types.intp, b, types.intp, types.intp)

    def codegen(context, builder, sig, args):
        ap = builder.gep(array_ptr(context, builder, sig.args[0], args[0], _F32), [args[1]])
        bp = builder.gep(array_ptr(context, builder, sig.args[2], args[2], _F32), [args[3]])
        return _fdot_ir(builder, ap, bp, args[4])

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def fdot(a, b, n):
    """sum(a[i] * b[i] for i < n) of C-contiguous float32 vectors in a fixed order (see fdot_at)."""
    return fdot_at(a, 0, b, 0, n)


@njit(cache=True, nogil=True)
def fdot_f32(a, b):
    """fdot of two whole float32 vectors of one length, checked (a Python entry point: tests, references)."""
    if a.size != b.size:
        raise ValueError("fdot_f32: vectors of different lengths")
    return fdot_at(a, 0, b, 0, a.size)
