"""Small LLVM-IR intrinsics shared by the row-dot kernels (numba's CPU target has no float16 type).

Kernels that need more (vector dots) build their IR beside themselves, using these helpers for pointers.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def array_byte_ptr(context, builder, arrty, arr):
    """i8* to the first element of a numba array value."""
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.bitcast(ary.data, ir.IntType(8).as_pointer())


@intrinsic
def load_f16(typingctx, arr, off):
    """float32 value of the little-endian IEEE half at byte offset off of a uint8 array."""
    sig = types.float32(arr, off)

    def codegen(context, builder, signature, args):
        base = array_byte_ptr(context, builder, signature.args[0], args[0])
        p = builder.gep(base, [builder.sext(args[1], ir.IntType(64)) if args[1].type.width < 64 else args[1]])
        p16 = builder.bitcast(p, ir.IntType(16).as_pointer())
        h = builder.load(p16, align=1)
        return builder.fpext(builder.bitcast(h, ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def load_bf16(typingctx, arr, off):
    """float32 value of the little-endian bfloat16 at byte offset off of a uint8 array."""
    sig = types.float32(arr, off)

    def codegen(context, builder, signature, args):
        base = array_byte_ptr(context, builder, signature.args[0], args[0])
        p = builder.gep(base, [builder.sext(args[1], ir.IntType(64)) if args[1].type.width < 64 else args[1]])
        h = builder.load(builder.bitcast(p, ir.IntType(16).as_pointer()), align=1)
        w = builder.shl(builder.zext(h, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(w, ir.FloatType())

    return sig, codegen


@intrinsic
def prefetch(typingctx, arr, off):
    """Software prefetch (read, locality 3) of byte offset off of a uint8 array; never faults."""
    sig = types.void(arr, off)

    def codegen(context, builder, signature, args):
        base = array_byte_ptr(context, builder, signature.args[0], args[0])
        p = builder.gep(base, [builder.sext(args[1], ir.IntType(64)) if args[1].type.width < 64 else args[1]])
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(32),
                                               ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        i32 = ir.IntType(32)
        builder.call(fn, [p, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen
