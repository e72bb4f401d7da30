"""Shared LLVM-IR codegen helpers for the row-kernel intrinsics (dot_float, dot_legacy, dot_kquant)."""
from __future__ import annotations

from llvmlite import ir

_I8 = ir.IntType(8)


def array_ptr(context, builder, arrty, arr, elem: ir.Type = _I8) -> ir.Value:
    """Pointer (to elem, bytes by default) at the first element of a numba array value."""
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.bitcast(ary.data, elem.as_pointer())
