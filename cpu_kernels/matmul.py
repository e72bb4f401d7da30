"""Matrix drivers over quantized rows: dense (rows x tokens) and grouped MoE (experts x rows x their tokens).

Parallel over blocks of rows; for each row the tokens loop inside, so a row is read from memory once per call
and stays in L1 while every token of the batch uses it (decode is the T=1 case of the same loop).
Weights are uint8 rows in their GGUF layout, read in place from a memory map (GGUF or expert pack).
"""
from __future__ import annotations

from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from strata_nb.cpu_kernels.qtypes import BF16, F16, F32
from strata_nb.cpu_kernels.rowdot import dequant_row, dot_f32, dot_q8

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
def _span(typingctx, buf, off, n):
    """buf[off:off + n] of a 1-D contiguous array as a view that holds no reference to buf's owner (see _row)."""
    spanty = types.Array(buf.dtype, 1, "C", readonly=not buf.mutable)

    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        dst = context.make_array(spanty)(context, builder)
        off = context.cast(builder, args[1], sig.args[1], types.intp)
        n = context.cast(builder, args[2], sig.args[2], types.intp)
        data = cgutils.pointer_add(builder, src.data, builder.mul(off, src.itemsize))
        context.populate_array(dst, data=data, shape=[n], strides=[src.itemsize], itemsize=src.itemsize,
                               meminfo=None)
        return dst._getvalue()

    return spanty(buf, off, n), codegen


# The row work of a task lives in its own (not inlined) function: the dispatch in rowdot is inlined and ends in
# a raise, and a prange body with a raise in it has two exits, which numba refuses to parallelize (it then
# runs the whole loop serially, with only a performance warning).

@njit(cache=True, nogil=True)
def _task_f32(qtype, w, x, out, r0, r1):
    for r in range(r0, r1):
        wr = _row(w, r)
        for t in range(x.shape[0]):
            out[t, r] = dot_f32(qtype, wr, _row(x, t))


@njit(cache=True, nogil=True)
def _task_q8(qtype, w, xq, xd, xs, out, r0, r1):
    for r in range(r0, r1):
        wr = _row(w, r)
        for t in range(xq.shape[0]):
            out[t, r] = dot_q8(qtype, wr, _row(xq, t), _row(xd, t), _row(xs, t))


@njit(cache=True, nogil=True)
def _task_moe(fast, qtype, buf, o0, row_bytes, r0, r1, j0, j1, tok_idx, x, xq, xd, xs, out):
    for r in range(r0, r1):
        wr = _span(buf, o0 + r * row_bytes, row_bytes)
        for j in range(j0, j1):
            t = tok_idx[j]
            if fast:
                out[j, r] = dot_q8(qtype, wr, _row(xq, t), _row(xd, t), _row(xs, t))
            else:
                out[j, r] = dot_f32(qtype, wr, _row(x, t))


@njit(cache=True, nogil=True)
def _task_dequant(qtype, w, rows, out, i):
    dequant_row(qtype, _row(w, rows[i]), _row(out, i))


@njit(cache=True, parallel=True)
def matmul_f32(qtype, w, x, out):
    """out[t, r] = W[r] . x[t] on the float32 reference path. w u8[rows, row_bytes], x f32[T, K]."""
    rows = w.shape[0]
    ntask = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(ntask):
        _task_f32(qtype, w, x, out, task * ROWS_PER_TASK, min(rows, (task + 1) * ROWS_PER_TASK))


@njit(cache=True, parallel=True)
def matmul_q8(qtype, w, x, xq, xd, xs, out):
    """Fast path: int8 activations (actq layout); float weight types use x directly."""
    rows = w.shape[0]
    ntask = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    isfloat = qtype == F32 or qtype == F16 or qtype == BF16
    for task in prange(ntask):
        r0 = task * ROWS_PER_TASK
        r1 = min(rows, r0 + ROWS_PER_TASK)
        if isfloat:
            _task_f32(qtype, w, x, out, r0, r1)
        else:
            _task_q8(qtype, w, xq, xd, xs, out, r0, r1)


@njit(cache=True, parallel=True)
def moe_matmul(fast, qtype, buf, base, nrows, row_bytes, grp_start, tok_idx, x, xq, xd, xs, out):
    """Grouped expert matmul for all selected experts of a layer in one parallel region.

    buf u8[:]          the memory map holding the experts (whole GGUF file or expert pack)
    base i64[G]        byte offset in buf of group g's expert matrix (nrows rows of row_bytes)
    grp_start i64[G+1] group g owns entries grp_start[g]:grp_start[g+1] of tok_idx and rows of out
    tok_idx i64[N]     which row of x (xq/xd/xs) each entry reads
    out f32[N, nrows]  one output row per entry
    """
    ngrp = base.shape[0]
    nblk = (nrows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    q8 = fast and not (qtype == F32 or qtype == F16 or qtype == BF16)
    for task in prange(ngrp * nblk):
        g = task // nblk
        r0 = (task - g * nblk) * ROWS_PER_TASK
        _task_moe(q8, qtype, buf, base[g], row_bytes, r0, min(nrows, r0 + ROWS_PER_TASK),
                  grp_start[g], grp_start[g + 1], tok_idx, x, xq, xd, xs, out)


@njit(cache=True, parallel=True)
def dequant_rows(qtype, w, rows, out):
    """out[i] = dequant(W[rows[i]]): embedding lookup from a (possibly quantized) table."""
    for i in prange(rows.shape[0]):
        _task_dequant(qtype, w, rows, out, i)
