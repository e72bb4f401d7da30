"""Shared LLVM-IR codegen helpers for the row-kernel intrinsics (dot_float, dot_legacy, dot_kquant)."""
from __future__ import annotations

from llvmlite import binding as llvm_binding
from llvmlite import ir

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
