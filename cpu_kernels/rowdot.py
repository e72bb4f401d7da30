"""Per-row dispatch on the quant type, resolved when a kernel is compiled: the quant type must be a compile-time
constant (a literal) where these are called, so a specialized driver (matmul.specialize) compiles only its own
type's row kernels. An if-chain over all 13 types in numba IR (the earlier form) compiled every type into every
driver: a cold start spent minutes there, most of it copying the chain's IR while inlining it.

Each type module exports, for each of its types T:
  dequant_T(w u8[:], out f32[:])                  a row to float32
  dot_f32_T(w u8[:], x f32[:]) -> float32         reference path: dequantize in registers, float32 dot
  dot_q8_T(w u8[:], xq i8[:], xd f32[:], xs f32[:]) -> float32   fast path on int8 activations (actq layout)
  dot_q8_T_multi(w u8[:], xq i8[:, :], xd f32[:, :], xs f32[:, :], toks) -> (float32,) * len(toks)
                                                  dot_q8 of one row against several tokens (rows of the 2-D
                                                  activations), unpacking the row once; bit-identical results
  dot_q8_T_rows(w u8[rows, row_bytes], r0, r1, xq, xd, xs, out f32[rows])   out[r] = dot_q8_T(w[r], ...) for r in
                                                  r0:r1 of one token, in one call (the decode case)
  dot_q8_T_multi_rows(w u8[rows, row_bytes], r0, r1, xq, xd, xs, toks, out f32[:, rows], j)
                                                  out[j + k, r] = dot_q8_T(w[r], token toks[k]) for r in r0:r1, in
                                                  one call (the prompt case: a call per row cost as much as the
                                                  dots of rows of 1-2 super-blocks)
The int8 activations of K-quant rows are in groups of 256, those of legacy rows in groups of 32 (actq.group).
Float weights (F32/F16/BF16) have no int8 path: the fast drivers call dot_f32 for them with the float x.
"""
from __future__ import annotations

from numba.core import types
from numba.core.errors import TypingError
from numba.extending import overload

from strata_nb.cpu_kernels import dot_float as fl
from strata_nb.cpu_kernels import dot_kquant as kq
from strata_nb.cpu_kernels import dot_legacy as lg
from strata_nb.cpu_kernels.qtypes import (
    BF16, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, name,
)

_MODULES = {Q4_0: lg, Q4_1: lg, Q5_0: lg, Q5_1: lg, Q8_0: lg, Q2_K: kq, Q3_K: kq, Q4_K: kq, Q5_K: kq, Q6_K: kq,
            F32: fl, F16: fl, BF16: fl}
_FLOAT = (F32, F16, BF16)


def _kernel(kind: str, qtype) -> object:
    """The row kernel `kind` (dequant, dot_f32, dot_q8, dot_q8_multi, dot_q8_rows, dot_q8_multi_rows) for a
    literal quant type."""
    if not isinstance(qtype, types.IntegerLiteral):
        raise TypingError(f"rowdot.{kind}: the quant type must be a compile-time constant (got {qtype}); "
                          "call it from a driver specialized per type (matmul.specialize)")
    qt = qtype.literal_value
    if qt not in _MODULES or (kind.startswith("dot_q8") and qt in _FLOAT):
        raise TypingError(f"rowdot.{kind}: no kernel for {name(qt)}")
    tag = name(qt).lower()
    attr = f"dot_q8_{tag}_{kind[7:]}" if kind.startswith("dot_q8_") else f"{kind}_{tag}"
    return getattr(_MODULES[qt], attr)


def dequant_row(qtype, w, out):
    """out = W row as float32."""
    raise NotImplementedError("numba only")


def dot_f32(qtype, w, x):
    """W row . x on the float32 reference path."""
    raise NotImplementedError("numba only")


def dot_q8(qtype, w, xq, xd, xs):
    """W row . x on int8 activations (quantized types only)."""
    raise NotImplementedError("numba only")


def dot_q8_multi(qtype, w, xq, xd, xs, toks):
    """dot_q8 of one row against the tokens toks (a tuple) of 2-D activations, the row unpacked once."""
    raise NotImplementedError("numba only")


def dot_q8_rows(qtype, w, r0, r1, xq, xd, xs, out):
    """out[r] = W[r] . x on int8 activations for rows r0:r1 of the 2-D w (quantized types only)."""
    raise NotImplementedError("numba only")


def dot_q8_multi_rows(qtype, w, r0, r1, xq, xd, xs, toks, out, j):
    """out[j + k, r] = W[r] . token toks[k] of 2-D activations, for rows r0:r1 of the 2-D w, in one call."""
    raise NotImplementedError("numba only")


@overload(dequant_row, prefer_literal=True)
def _ol_dequant_row(qtype, w, out):
    k = _kernel("dequant", qtype)
    return lambda qtype, w, out: k(w, out)


@overload(dot_f32, prefer_literal=True)
def _ol_dot_f32(qtype, w, x):
    k = _kernel("dot_f32", qtype)
    return lambda qtype, w, x: k(w, x)


@overload(dot_q8, prefer_literal=True)
def _ol_dot_q8(qtype, w, xq, xd, xs):
    k = _kernel("dot_q8", qtype)
    return lambda qtype, w, xq, xd, xs: k(w, xq, xd, xs)


@overload(dot_q8_multi, prefer_literal=True)
def _ol_dot_q8_multi(qtype, w, xq, xd, xs, toks):
    k = _kernel("dot_q8_multi", qtype)
    return lambda qtype, w, xq, xd, xs, toks: k(w, xq, xd, xs, toks)


@overload(dot_q8_rows, prefer_literal=True)
def _ol_dot_q8_rows(qtype, w, r0, r1, xq, xd, xs, out):
    k = _kernel("dot_q8_rows", qtype)
    return lambda qtype, w, r0, r1, xq, xd, xs, out: k(w, r0, r1, xq, xd, xs, out)


@overload(dot_q8_multi_rows, prefer_literal=True)
def _ol_dot_q8_multi_rows(qtype, w, r0, r1, xq, xd, xs, toks, out, j):
    k = _kernel("dot_q8_multi_rows", qtype)
    return lambda qtype, w, r0, r1, xq, xd, xs, toks, out, j: k(w, r0, r1, xq, xd, xs, toks, out, j)
