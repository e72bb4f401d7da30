"""Shared LLVM-IR codegen helpers for the row-kernel intrinsics (dot_float, dot_legacy, dot_kquant)."""
from __future__ import annotations

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba.core import cgutils

_I8 = ir.IntType(8)


def host_features() -> set[str]:
    """CPU features numba compiles for: the host's, unless NUMBA_CPU_FEATURES / NUMBA_CPU_NAME say otherwise
    (a named, portable target gets none, so kernels take their generic IR paths)."""
    from numba.core import config

    if config.CPU_FEATURES is not None:
        feats = config.CPU_FEATURES
    elif config.CPU_NAME not in (None, "host"):
        return set()
    else:
        feats = llvm_binding.get_host_cpu_features().flatten()
    return {f[1:] for f in feats.split(",") if f.startswith("+")}


def array_ptr(context, builder, arrty, arr, elem: ir.Type = _I8) -> ir.Value:
    """Pointer (to elem, bytes by default) at the first element of a numba array value."""
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.bitcast(ary.data, elem.as_pointer())


def row_ptrs(context, builder, arrty, arr, elem: ir.Type, rows: list) -> list:
    """Pointers (to elem) at the start of the given rows (intp values) of a 2-D numba array value."""
    ary = context.make_array(arrty)(context, builder, arr)
    stride = cgutils.unpack_tuple(builder, ary.strides)[0]
    base = builder.bitcast(ary.data, _I8.as_pointer())
    return [builder.bitcast(builder.gep(base, [builder.mul(r, stride)]), elem.as_pointer()) for r in rows]


def each_row(builder, w0: ir.Value, row_bytes: ir.Value, n: ir.Value, row_dots, outs: list) -> None:
    """For i < n: row_dots(pointer to row i, at w0 + i * row_bytes) -> one float per output, stored at outs[k] + i
    (the loop of the rows kernels: one token's row or a group of tokens' rows of out)."""
    with cgutils.for_range(builder, n) as loop:
        i = loop.index
        for o, v in zip(outs, row_dots(builder.gep(w0, [builder.mul(i, row_bytes)]))):
            builder.store(v, builder.gep(o, [i]))
