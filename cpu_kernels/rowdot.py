"""Per-row dispatch on the quant type: one branch per row is noise next to a row of 1-4 KB.

Each type module exports, for each of its types T:
  dequant_T(w u8[:], out f32[:])                  a row to float32
  dot_f32_T(w u8[:], x f32[:]) -> float32         reference path: dequantize in registers, float32 dot
  dot_q8_T(w u8[:], xq i8[:], xd f32[:], xs f32[:]) -> float32   fast path on int8 activations (actq layout)
  dot_q8_T_multi(w u8[:], xq i8[:, :], xd f32[:, :], xs f32[:, :], toks) -> (float32,) * len(toks)
                                                  dot_q8 of one row against several tokens (rows of the 2-D
                                                  activations), unpacking the row once; bit-identical results
Float weights (F32/F16/BF16) have no int8 path: the fast drivers call dot_f32 for them with the float x.
"""
from __future__ import annotations

from numba import njit

from strata_nb.cpu_kernels import dot_float as fl
from strata_nb.cpu_kernels import dot_kquant as kq
from strata_nb.cpu_kernels import dot_legacy as lg
from strata_nb.cpu_kernels.qtypes import (
    BF16, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
)


@njit(cache=True, nogil=True, inline="always")
def dequant_row(qtype, w, out):
    if qtype == Q4_K:
        kq.dequant_q4_k(w, out)
    elif qtype == Q6_K:
        kq.dequant_q6_k(w, out)
    elif qtype == Q8_0:
        lg.dequant_q8_0(w, out)
    elif qtype == Q5_0:
        lg.dequant_q5_0(w, out)
    elif qtype == F32:
        fl.dequant_f32(w, out)
    elif qtype == F16:
        fl.dequant_f16(w, out)
    elif qtype == BF16:
        fl.dequant_bf16(w, out)
    elif qtype == Q4_0:
        lg.dequant_q4_0(w, out)
    elif qtype == Q4_1:
        lg.dequant_q4_1(w, out)
    elif qtype == Q5_1:
        lg.dequant_q5_1(w, out)
    elif qtype == Q2_K:
        kq.dequant_q2_k(w, out)
    elif qtype == Q3_K:
        kq.dequant_q3_k(w, out)
    elif qtype == Q5_K:
        kq.dequant_q5_k(w, out)
    else:
        raise ValueError("unsupported quant type")


@njit(cache=True, nogil=True, inline="always")
def dot_f32(qtype, w, x):
    if qtype == Q4_K:
        return kq.dot_f32_q4_k(w, x)
    elif qtype == Q6_K:
        return kq.dot_f32_q6_k(w, x)
    elif qtype == Q8_0:
        return lg.dot_f32_q8_0(w, x)
    elif qtype == Q5_0:
        return lg.dot_f32_q5_0(w, x)
    elif qtype == F32:
        return fl.dot_f32_f32(w, x)
    elif qtype == F16:
        return fl.dot_f32_f16(w, x)
    elif qtype == BF16:
        return fl.dot_f32_bf16(w, x)
    elif qtype == Q4_0:
        return lg.dot_f32_q4_0(w, x)
    elif qtype == Q4_1:
        return lg.dot_f32_q4_1(w, x)
    elif qtype == Q5_1:
        return lg.dot_f32_q5_1(w, x)
    elif qtype == Q2_K:
        return kq.dot_f32_q2_k(w, x)
    elif qtype == Q3_K:
        return kq.dot_f32_q3_k(w, x)
    elif qtype == Q5_K:
        return kq.dot_f32_q5_k(w, x)
    raise ValueError("unsupported quant type")


@njit(cache=True, nogil=True, inline="always")
def dot_q8(qtype, w, xq, xd, xs):
    if qtype == Q4_K:
        return kq.dot_q8_q4_k(w, xq, xd, xs)
    elif qtype == Q6_K:
        return kq.dot_q8_q6_k(w, xq, xd, xs)
    elif qtype == Q8_0:
        return lg.dot_q8_q8_0(w, xq, xd, xs)
    elif qtype == Q5_0:
        return lg.dot_q8_q5_0(w, xq, xd, xs)
    elif qtype == Q4_0:
        return lg.dot_q8_q4_0(w, xq, xd, xs)
    elif qtype == Q4_1:
        return lg.dot_q8_q4_1(w, xq, xd, xs)
    elif qtype == Q5_1:
        return lg.dot_q8_q5_1(w, xq, xd, xs)
    elif qtype == Q2_K:
        return kq.dot_q8_q2_k(w, xq, xd, xs)
    elif qtype == Q3_K:
        return kq.dot_q8_q3_k(w, xq, xd, xs)
    elif qtype == Q5_K:
        return kq.dot_q8_q5_k(w, xq, xd, xs)
    raise ValueError("float weights take the float32 path")


@njit(cache=True, nogil=True, inline="always")
def dot_q8_multi(qtype, w, xq, xd, xs, toks):
    if qtype == Q4_K:
        return kq.dot_q8_q4_k_multi(w, xq, xd, xs, toks)
    elif qtype == Q6_K:
        return kq.dot_q8_q6_k_multi(w, xq, xd, xs, toks)
    elif qtype == Q8_0:
        return lg.dot_q8_q8_0_multi(w, xq, xd, xs, toks)
    elif qtype == Q5_0:
        return lg.dot_q8_q5_0_multi(w, xq, xd, xs, toks)
    elif qtype == Q4_0:
        return lg.dot_q8_q4_0_multi(w, xq, xd, xs, toks)
    elif qtype == Q4_1:
        return lg.dot_q8_q4_1_multi(w, xq, xd, xs, toks)
    elif qtype == Q5_1:
        return lg.dot_q8_q5_1_multi(w, xq, xd, xs, toks)
    elif qtype == Q2_K:
        return kq.dot_q8_q2_k_multi(w, xq, xd, xs, toks)
    elif qtype == Q3_K:
        return kq.dot_q8_q3_k_multi(w, xq, xd, xs, toks)
    elif qtype == Q5_K:
        return kq.dot_q8_q5_k_multi(w, xq, xd, xs, toks)
    raise ValueError("float weights take the float32 path")
