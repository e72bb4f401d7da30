"""Matrix drivers over quantized rows: dense (rows x tokens) and grouped MoE (experts x rows x their tokens).

Parallel over blocks of rows. On the int8 path a task takes its tokens four at a time and runs its rows against
each group of four with the multi-token row kernels, which unpack a row once for all four; so a task's rows are
read from memory once per call and then stay in L1/L2 while every group uses them, and the group's
activations stay in L1. A last group of one token (decode is the T=1 case) takes the single-token kernel.
Weights are uint8 rows in their GGUF layout, read in place from a memory map (GGUF or expert pack).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from strata_nb.cpu_kernels.qtypes import BF16, F16, F32
from strata_nb.cpu_kernels.rowdot import dequant_row, dot_f32, dot_q8, dot_q8_multi
from strata_nb.errors import StrataError

ROWS_PER_TASK = 16


@intrinsic
def _row(typingctx, arr, i):
    """arr[i] of a 2-D array as a 1-D view that holds no reference to arr's owner; valid while arr lives.

    An ordinary view costs an NRT incref and decref per row and token: atomics on the owner's counter, which
    every thread touches for the shared activation and weight arrays, and which cost more than a row's dot."""
    rowty = types.Array(arr.dtype, 1, "C" if arr.layout == "C" else "A", readonly=not arr.mutable)

    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        dst = context.make_array(rowty)(context, builder)
        shape = cgutils.unpack_tuple(builder, src.shape)
        strides = cgutils.unpack_tuple(builder, src.strides)
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        data = cgutils.pointer_add(builder, src.data, builder.mul(idx, strides[0]))
        context.populate_array(dst, data=data, shape=[shape[1]], strides=[strides[1]], itemsize=src.itemsize,
                               meminfo=None)
        return dst._getvalue()

    return rowty(arr, i), codegen


@intrinsic
def _noref(typingctx, arr):
    """The same array as a view that holds no reference to arr's owner (see _row); valid while arr lives."""
    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        dst = context.make_array(sig.return_type)(context, builder)
        context.populate_array(dst, data=src.data, shape=cgutils.unpack_tuple(builder, src.shape),
                               strides=cgutils.unpack_tuple(builder, src.strides), itemsize=src.itemsize,
                               meminfo=None)
        return dst._getvalue()

    return arr(arr), codegen


@intrinsic
def _mat(typingctx, buf, off, rows, row_bytes):
    """buf[off:off + rows * row_bytes] of a 1-D contiguous uint8 array as a [rows, row_bytes] matrix view that
    holds no reference to buf's owner (see _row)."""
    matty = types.Array(buf.dtype, 2, "C", readonly=not buf.mutable)

    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        dst = context.make_array(matty)(context, builder)
        off, rows, rb = (context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:]))
        data = cgutils.pointer_add(builder, src.data, builder.mul(off, src.itemsize))
        context.populate_array(dst, data=data, shape=[rows, rb], strides=[builder.mul(rb, src.itemsize),
                               src.itemsize], itemsize=src.itemsize, meminfo=None)
        return dst._getvalue()

    return matty(buf, off, rows, row_bytes), codegen


# The row work of a task lives in its own (not inlined) function: the dispatch in rowdot is inlined and ends in
# a raise, and a prange body with a raise in it has two exits, which numba refuses to parallelize (it then
# runs the whole loop serially, with only a performance warning).

@njit(cache=True, nogil=True)
def _task_f32(qtype, w, x, out, r0, r1, tok_idx, j0, j1):
    """out[j, r] = W[r] . x[tok_idx[j]] for rows r0:r1 and entries j0:j1, float32 path."""
    for r in range(r0, r1):
        wr = _row(w, r)
        for j in range(j0, j1):
            out[j, r] = dot_f32(qtype, wr, _row(x, tok_idx[j]))


@njit(cache=True, nogil=True, inline="always")
def _rows_multi(qtype, w, r0, r1, xq, xd, xs, out, j, toks):
    """out[j + k, r] = W[r] . token toks[k] for rows r0:r1, each row unpacked once for all of toks."""
    for r in range(r0, r1):
        res = dot_q8_multi(qtype, _row(w, r), xq, xd, xs, toks)
        for k in range(len(toks)):
            out[j + k, r] = res[k]


@njit(cache=True, nogil=True)
def _task_q8(qtype, w, xq, xd, xs, out, r0, r1, tok_idx, j0, j1):
    """out[j, r] = W[r] . xq[tok_idx[j]] for rows r0:r1 and entries j0:j1, int8 path, four tokens per unpack."""
    xqv, xdv, xsv = _noref(xq), _noref(xd), _noref(xs)
    j = j0
    while j + 4 <= j1:
        _rows_multi(qtype, w, r0, r1, xqv, xdv, xsv, out, j,
                    (tok_idx[j], tok_idx[j + 1], tok_idx[j + 2], tok_idx[j + 3]))
        j += 4
    if j1 - j == 3:
        _rows_multi(qtype, w, r0, r1, xqv, xdv, xsv, out, j, (tok_idx[j], tok_idx[j + 1], tok_idx[j + 2]))
    elif j1 - j == 2:
        _rows_multi(qtype, w, r0, r1, xqv, xdv, xsv, out, j, (tok_idx[j], tok_idx[j + 1]))
    elif j1 - j == 1:
        t = tok_idx[j]
        for r in range(r0, r1):
            out[j, r] = dot_q8(qtype, _row(w, r), _row(xq, t), _row(xd, t), _row(xs, t))


@njit(cache=True, nogil=True)
def _check_experts(nbuf, base, nrows, row_bytes):
    """The row kernels read expert rows without bounds checks: every matrix must lie inside the buffer."""
    for g in range(base.shape[0]):
        if base[g] < 0 or base[g] + nrows * row_bytes > nbuf:
            raise StrataError("moe_matmul: an expert matrix lies outside the weight buffer")


@njit(cache=True, nogil=True)
def _task_dequant(qtype, w, rows, out, i):
    dequant_row(qtype, _row(w, rows[i]), _row(out, i))


@njit(cache=True, parallel=True)
def matmul_f32(qtype, w, x, out):
    """out[t, r] = W[r] . x[t] on the float32 reference path. w u8[rows, row_bytes], x f32[T, K]."""
    rows = w.shape[0]
    ntok = x.shape[0]
    tok_idx = np.arange(ntok)
    ntask = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(ntask):
        _task_f32(qtype, w, x, out, task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK), tok_idx, 0, ntok)


@njit(cache=True, parallel=True)
def matmul_q8(qtype, w, x, xq, xd, xs, out):
    """Fast path: int8 activations (actq layout); float weight types use x directly."""
    rows = w.shape[0]
    ntok = x.shape[0]
    tok_idx = np.arange(ntok)
    ntask = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    isfloat = qtype == F32 or qtype == F16 or qtype == BF16
    for task in prange(ntask):
        r0 = task * ROWS_PER_TASK
        r1 = min(rows, r0 + ROWS_PER_TASK)
        if isfloat:
            _task_f32(qtype, w, x, out, r0, r1, tok_idx, 0, ntok)
        else:
            _task_q8(qtype, w, xq, xd, xs, out, r0, r1, tok_idx, 0, ntok)


@njit(cache=True, parallel=True)
def moe_matmul(fast, qtype, buf, base, nrows, row_bytes, grp_start, tok_idx, x, xq, xd, xs, out):
    """Grouped expert matmul for all selected experts of a layer in one parallel region.

    buf u8[:]          the memory map holding the experts (whole GGUF file or expert pack)
    base i64[G]        byte offset in buf of group g's expert matrix (nrows rows of row_bytes)
    grp_start i64[G+1] group g owns entries grp_start[g]:grp_start[g+1] of tok_idx and rows of out
    tok_idx i64[N]     which row of x (xq/xd/xs) each entry reads
    out f32[N, nrows]  one output row per entry
    """
    _check_experts(buf.shape[0], base, nrows, row_bytes)
    ngrp = base.shape[0]
    nblk = (nrows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    q8 = fast and not (qtype == F32 or qtype == F16 or qtype == BF16)
    for task in prange(ngrp * nblk):
        g = task // nblk
        r0 = (task - g * nblk) * ROWS_PER_TASK
        r1 = min(nrows, r0 + ROWS_PER_TASK)
        w = _mat(buf, base[g], nrows, row_bytes)
        if q8:
            _task_q8(qtype, w, xq, xd, xs, out, r0, r1, tok_idx, grp_start[g], grp_start[g + 1])
        else:
            _task_f32(qtype, w, x, out, r0, r1, tok_idx, grp_start[g], grp_start[g + 1])


@njit(cache=True, parallel=True)
def dequant_rows(qtype, w, rows, out):
    """out[i] = dequant(W[rows[i]]): embedding lookup from a (possibly quantized) table."""
    for i in prange(rows.shape[0]):
        _task_dequant(qtype, w, rows, out, i)
