"""Float weight rows (F32, F16, BF16) as LLVM vector IR: dequant to float32 and the float32 row dot.

Rows arrive as uint8 bytes (the weight is a uint8 view of the GGUF). Elements are widened to float32 in registers
(F16: bitcast to half and fpext, vcvtph2ps; BF16: zero-extend and shift left 16) 32 at a time, with a
1-element loop for lengths that are not a multiple of 32. The dot fmas into 4 independent <32 x float>
accumulators and prefetches PREFETCH_BYTES ahead, since weight rows stream from DRAM. Float weights have no
int8 path: their dot_f32 is also their fast path.
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
