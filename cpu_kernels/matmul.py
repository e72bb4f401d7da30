"""Matrix drivers over quantized rows: dense (rows x tokens) and grouped MoE (experts x rows x their tokens).

Parallel over blocks of rows. On the int8 path a task takes its tokens four at a time and runs all its rows against
each group of four in one call of a multi-token row kernel, which unpacks a row once for all four (a call per row
cost as much as the dots of a row of one or two super-blocks: experts' down rows); so a task's rows are
read from memory once per call and then stay in L1/L2 while every group uses them, and the group's
activations stay in L1. A last group of one token (decode is the T=1 case) takes the single-token kernel.
Weights are uint8 rows in their GGUF layout, read in place from a memory map (GGUF or expert pack) or, for
experts, from wherever the expert store holds them (addresses, see moe_matmul).
The drivers release the GIL: the expert store's reader threads issue SSD reads while they run.

Every driver is compiled per quant type (`specialize`): the type is a constant of the compiled function, so
rowdot resolves it to that type's row kernels while typing and nothing else is compiled. A file uses 2-4
types; compiling all 13 into every driver made a cold start take minutes. The specialized drivers are cached on
disk like any other (numba keys a closure's cache entry by its cell values: here only ints and bools).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from strata_nb.cpu_kernels import actq
from strata_nb.cpu_kernels.ops import (PLAN_DONE, PLAN_EXPERT, PLAN_IDENT, PLAN_START, PLAN_SLOT, PLAN_TOK,
                                       combine_cols, moe_split, swiglu_quant_row)
from strata_nb.cpu_kernels.qtypes import FLOAT_TYPES, QUANT_INFO
from strata_nb.cpu_kernels.rowdot import dequant_row, dot_f32, dot_q8_multi_rows, dot_q8_rows

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
def _mat_at(typingctx, addr, rows, row_bytes):
    """The rows x row_bytes uint8 matrix at address addr, as a read-only view that owns nothing (see _row).

    Expert matrices live in several buffers at once (the file's memory map, the resident arena, the blobs just
    read from the SSD), so the MoE driver takes their addresses; the caller keeps those buffers alive."""
    matty = types.Array(types.uint8, 2, "C", readonly=True)

    def codegen(context, builder, sig, args):
        dst = context.make_array(matty)(context, builder)
        a, rows, rb = (context.cast(builder, v, t, types.intp) for v, t in zip(args, sig.args))
        data = builder.inttoptr(a, context.get_data_type(types.uint8).as_pointer())
        context.populate_array(dst, data=data, shape=[rows, rb], strides=[rb, context.get_constant(types.intp, 1)],
                               itemsize=context.get_constant(types.intp, 1), meminfo=None)
        return dst._getvalue()

    return matty(addr, rows, row_bytes), codegen


@intrinsic
def _fetch_add(typingctx, arr, i, v):
    """arr[i] += v atomically (sequentially consistent: what other threads wrote before their add is seen by the
    thread that reads the total); returns the value before the add. arr: a contiguous i64 array."""
    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        ptr = builder.gep(a.data, [idx])
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return types.int64(arr, i, v), codegen


def specialize(make):
    """make(*key) -> a numba dispatcher, built once per key (quant types and flags, plain ints and bools) and
    memoized; numba's on-disk cache serves it in the next process. Returns the lookup, with .make kept and
    .built, the drivers built so far by key."""
    built = {}

    def get(*key):
        f = built.get(key)
        if f is None:
            f = built[key] = make(*key)
        return f

    get.make = make
    get.built = built
    return get


def _is_float(qtype: int) -> bool:
    return qtype in FLOAT_TYPES


# The task helpers take the quant type as an argument and are inlined into the specialized drivers, where it is a
# constant (a closure cell, so numba types it as a literal): rowdot resolves it to that type's row kernel while
# typing. No raise reaches a prange body that way (a raise in it makes numba run the loop serially, with only a
# performance warning; tests/test_matmul.py compiles every driver with that warning as an error).

@njit(nogil=True, inline="always")
def _task_f32(qtype, w, x, out, r0, r1, tok_idx, j0, j1):
    """out[j, r] = W[r] . x[tok_idx[j]] for rows r0:r1 and entries j0:j1, float32 path."""
    for r in range(r0, r1):
        wr = _row(w, r)
        for j in range(j0, j1):
            out[j, r] = dot_f32(qtype, wr, _row(x, tok_idx[j]))


@njit(nogil=True, inline="always")
def _task_q8(qtype, w, xq, xd, xs, out, r0, r1, tok_idx, j0, j1):
    """out[j, r] = W[r] . xq[tok_idx[j]] for rows r0:r1 and entries j0:j1, int8 path: all the task's rows against
    four tokens per kernel call, each row unpacked once for the four."""
    xqv, xdv, xsv, wv, ov = _noref(xq), _noref(xd), _noref(xs), _noref(w), _noref(out)
    j = j0
    while j + 4 <= j1:
        dot_q8_multi_rows(qtype, wv, r0, r1, xqv, xdv, xsv, (tok_idx[j], tok_idx[j + 1], tok_idx[j + 2],
                                                            tok_idx[j + 3]), ov, j)
        j += 4
    if j1 - j == 3:
        dot_q8_multi_rows(qtype, wv, r0, r1, xqv, xdv, xsv, (tok_idx[j], tok_idx[j + 1], tok_idx[j + 2]), ov, j)
    elif j1 - j == 2:
        dot_q8_multi_rows(qtype, wv, r0, r1, xqv, xdv, xsv, (tok_idx[j], tok_idx[j + 1]), ov, j)
    elif j1 - j == 1:  # decode: all the task's rows in one kernel call
        t = tok_idx[j]
        dot_q8_rows(qtype, w, r0, r1, _row(xq, t), _row(xd, t), _row(xs, t), _row(out, j))


@njit(nogil=True, inline="always")
def _task(q8, qtype, w, x, xq, xd, xs, out, r0, r1, tok_idx, j0, j1):
    """One task on the int8 path (q8) or the float32 path; q8 and qtype are constants where this is inlined."""
    if q8:
        _task_q8(qtype, w, xq, xd, xs, out, r0, r1, tok_idx, j0, j1)
    else:
        _task_f32(qtype, w, x, out, r0, r1, tok_idx, j0, j1)


def _make_matmul(Q8, QT):
    @njit(cache=True, parallel=True, nogil=True)
    def matmul_spec(w, x, xq, xd, xs, out):
        rows = w.shape[0]
        ntok = x.shape[0]
        tok_idx = np.arange(ntok)
        ntask = (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        for task in prange(ntask):
            r0 = task * ROWS_PER_TASK
            _task(Q8, QT, w, x, xq, xd, xs, out, r0, min(rows, r0 + ROWS_PER_TASK), tok_idx, 0, ntok)

    return matmul_spec


matmul_for = specialize(_make_matmul)  # (int8 path, qtype) -> matmul_spec(w, x, xq, xd, xs, out)


def matmul_f32(qtype, w, x, out):
    """out[t, r] = W[r] . x[t] on the float32 reference path. w u8[rows, row_bytes], x f32[T, K]."""
    matmul_for(False, int(qtype))(w, x, _EMPTY_Q, _EMPTY_D, _EMPTY_D, out)


def matmul_q8(qtype, w, x, xq, xd, xs, out):
    """Fast path: int8 activations (actq layout); float weight types use x directly."""
    qtype = int(qtype)
    matmul_for(not _is_float(qtype), qtype)(w, x, xq, xd, xs, out)


def _make_moe_matmul(Q8, QT):
    @njit(cache=True, parallel=True, nogil=True)
    def moe_matmul_spec(ptrs, nrows, row_bytes, ent_lo, ent_hi, tok_idx, x, xq, xd, xs, out):
        ngrp = ptrs.shape[0]
        nblk = (nrows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
        for task in prange(ngrp * nblk):
            g = task // nblk
            r0 = (task - g * nblk) * ROWS_PER_TASK
            w = _mat_at(ptrs[g], nrows, row_bytes)
            _task(Q8, QT, w, x, xq, xd, xs, out, r0, min(nrows, r0 + ROWS_PER_TASK), tok_idx, ent_lo[g], ent_hi[g])

    return moe_matmul_spec


moe_matmul_for = specialize(_make_moe_matmul)


def moe_matmul(fast, qtype, ptrs, nrows, row_bytes, ent_lo, ent_hi, tok_idx, x, xq, xd, xs, out):
    """Grouped expert matmul for a set of experts of a layer in one parallel region (one matrix per expert).

    ptrs i64[G]        address of group g's expert matrix (nrows rows of row_bytes), in a buffer the caller keeps
                       alive and has bounds-checked (experts.store does both)
    ent_lo, ent_hi     group g owns entries ent_lo[g]:ent_hi[g] of tok_idx and rows of out
    tok_idx i64[N]     which row of x (xq/xd/xs) each entry reads
    out f32[N, nrows]  one output row per entry (rows of entries no group owns are left alone)
    The building block of moe_ffn, and its reference in the tests.
    """
    qtype = int(qtype)
    moe_matmul_for(bool(fast) and not _is_float(qtype), qtype)(ptrs, nrows, row_bytes, ent_lo, ent_hi, tok_idx,
                                                                x, xq, xd, xs, out)


DOWN_PROMPT_ROWS = 64  # rows of a prompt's down task: its weights stay in L1 while the expert's tokens run by 4


@njit(nogil=True, inline="always")
def _moe_rows(rows: int, ntok: int, nthreads: int) -> int:
    """Rows per task of the MoE kernel over `rows` rows in all. Decode (one token): the most of 32, 16, 8 that
    still gives every thread 8 tasks: numba hands each thread an equal run of tasks, longer runs of a matrix's rows
    stream faster (2 cores, one process, interleaved: a layer's routed FFN 1310 against 1436 us at 8 rows), while
    15 threads need smaller tasks to spread one expert's down (2048 rows) within a few percent. Prompts: 8, so a
    task's rows stay in L1 while each group of tokens runs against them (32 was 3% slower at 128 tokens)."""
    if ntok > 1:
        return 8
    r = 32
    while r > 8 and (rows + r - 1) // r < 8 * nthreads:
        r //= 2
    return r


def _make_moe_ffn(FAST, QG, QU, QD):
    """The routed-expert FFN of a MoE layer whose gate, up and down matrices are of types QG, QU, QD (FAST: int8
    activations), in one call per wave of experts:

    split      first split the routing ids/slot of tokens 0..ntok-1 into `plan` and count it into row `layer` of
               the tallies (ops.moe_split); nw < 0 then means every group, combine < 0 every group. A layer whose
               experts all lie in RAM at fixed places is one call; a split alone (nw = 0) hands a tiered store the
               experts to bring in waves. Without split, plan holds an earlier split.
    table      i64[3, n_expert]: the addresses of each expert's gate, up and down matrices (read for this wave's
               experts), in buffers the caller keeps alive and has bounds-checked (experts.store does both)
    groups     i64[>= nw]: the wave, as indices of the plan's groups
    quant      first quantize x's rows 0..ntok-1 into xq/xd/xs (gate's group) and uq/ud/us (up's, if another)
    ghu        f32[3, >= N, ff] the entries' gate, up and h rows; hq/hd/hs h's int8 form (down's group); y f32[>= N,
               hidden] the down outputs (N entries in all)
    combine    > 0: the last wave: out[t] = the weighted sum (wts) of token t's entries of groups 0..combine-1,
               for t < ntok, in entry order (bit-identical whichever waves computed them)
    nthreads   the threads the call runs on (numba.get_num_threads(): inside a kernel it would keep it out of the
               disk cache), for the size of its tasks
    Returns (G, hits) of the split (without one: (nw, 0)).
    """
    Q8G = FAST and not _is_float(QG)
    Q8U = FAST and not _is_float(QU)
    Q8D = FAST and not _is_float(QD)
    SAME = QG == QU
    QUANT_U = Q8U and not (Q8G and actq.group(QG) == actq.group(QU))  # up needs int8 x of a group of its own
    QUANT_H = Q8D  # the down projection reads h as int8
    (_, GE, GB), (_, UE, UB), (_, DE, DB) = (QUANT_INFO[q] for q in (QG, QU, QD))  # elements, bytes per block

    @njit(cache=True, parallel=True, nogil=True)
    def moe_ffn_spec(split, ids, slot, ntok, layer, tally_a, tally_b, tally_c, plan, table, groups, nw, quant, x, xq,
                     xd, xs, uq, ud, us, ghu, hq, hd, hs, y, combine, wts, out, nthreads):
        if split:
            ngrp, hits = moe_split(ids, slot, ntok, layer, plan, tally_a, tally_b, tally_c)
            if ngrp == 0:  # no combine follows
                for t in range(ntok):
                    for i in range(out.shape[1]):
                        out[t, i] = 0.0
                return ngrp, hits
            if nw < 0:
                nw = ngrp
                groups = plan[PLAN_IDENT]
            if combine < 0:
                combine = ngrp
        else:
            ngrp, hits = nw, 0
        if nw == 0:
            return ngrp, hits
        ff, hidden = ghu.shape[2], y.shape[1]
        gate_rb, up_rb, down_rb = hidden // GE * GB, hidden // UE * UB, ff // DE * DB
        experts, start, etok, eslot = plan[PLAN_EXPERT], plan[PLAN_START], plan[PLAN_TOK], plan[PLAN_SLOT]
        ident, done = plan[PLAN_IDENT], plan[PLAN_DONE]
        g, u, h = ghu[0], ghu[1], ghu[2]
        if quant:
            if Q8G:
                actq.quantize_rows(x[:ntok], xq[:ntok], xd[:ntok], xs[:ntok])
            if QUANT_U:
                actq.quantize_rows(x[:ntok], uq[:ntok], ud[:ntok], us[:ntok])
        for i in range(nw):
            done[groups[i]] = 0
        # gate and up of every expert of the wave: one parallel region over all their row blocks. The task that
        # completes a group's rows (counted atomically) computes h = silu(g) * u for its entries, quantized for
        # the down projection: no region of its own.
        nr = _moe_rows(nw * 2 * ff, ntok, nthreads)
        nblk = (ff + nr - 1) // nr
        for task in prange(nw * 2 * nblk):
            i = task // (2 * nblk)
            gi = groups[i]
            e = experts[gi]
            rem = task - i * 2 * nblk
            which = rem // nblk
            r0 = (rem - which * nblk) * nr
            r1 = min(ff, r0 + nr)
            j0, j1 = start[gi], start[gi + 1]
            if SAME:
                w = _mat_at(table[which, e], ff, gate_rb)
                _task(Q8G, QG, w, x, xq, xd, xs, g if which == 0 else u, r0, r1, etok, j0, j1)
            elif which == 0:
                _task(Q8G, QG, _mat_at(table[0, e], ff, gate_rb), x, xq, xd, xs, g, r0, r1, etok, j0, j1)
            else:
                _task(Q8U, QU, _mat_at(table[1, e], ff, up_rb), x, uq, ud, us, u, r0, r1, etok, j0, j1)
            if _fetch_add(done, gi, r1 - r0) + (r1 - r0) == 2 * ff:
                for j in range(j0, j1):
                    swiglu_quant_row(_row(g, j), _row(u, j), _row(h, j), _row(hq, j), _row(hd, j), _row(hs, j),
                                     QUANT_H)
        # down, y[entry] = Down . h[entry]
        if ntok == 1:  # over row blocks of all the wave's experts; in the last wave each block then sums its
            # columns of every entry into out (no combine region: blocks own their columns)
            nr = _moe_rows(hidden, ntok, nthreads)
            nblk = (hidden + nr - 1) // nr
            for blk in prange(nblk):
                r0 = blk * nr
                r1 = min(hidden, r0 + nr)
                for i in range(nw):
                    gi = groups[i]
                    _task(Q8D, QD, _mat_at(table[2, experts[gi]], hidden, down_rb), h, hq, hd, hs, y, r0, r1, ident,
                          start[gi], start[gi + 1])
                if combine > 0:
                    combine_cols(y, wts, etok, eslot, start[combine], ntok, out, r0, r1)
            return ngrp, hits
        # a prompt: over (expert, row block) tasks, so each task reads only its own expert's h rows (blocks of
        # rows over every expert read every entry's h once a block: ~2x the weights' bytes at 512 experts), then
        # the combine over column blocks
        nblk = (hidden + DOWN_PROMPT_ROWS - 1) // DOWN_PROMPT_ROWS
        for task in prange(nw * nblk):
            i = task // nblk
            gi = groups[i]
            r0 = (task - i * nblk) * DOWN_PROMPT_ROWS
            _task(Q8D, QD, _mat_at(table[2, experts[gi]], hidden, down_rb), h, hq, hd, hs, y, r0,
                  min(hidden, r0 + DOWN_PROMPT_ROWS), ident, start[gi], start[gi + 1])
        if combine > 0:
            for blk in prange((hidden + 255) // 256):
                combine_cols(y, wts, etok, eslot, start[combine], ntok, out, blk * 256, min(hidden, blk * 256 + 256))
        return ngrp, hits

    return moe_ffn_spec


moe_ffn_for = specialize(_make_moe_ffn)  # (fast, gate qtype, up qtype, down qtype) -> moe_ffn_spec


def _make_dequant_rows(QT):
    @njit(cache=True, parallel=True, nogil=True)
    def dequant_rows_spec(w, rows, out):
        for i in prange(rows.shape[0]):
            dequant_row(QT, _row(w, rows[i]), _row(out, i))

    return dequant_rows_spec


dequant_rows_for = specialize(_make_dequant_rows)


def dequant_rows(qtype, w, rows, out):
    """out[i] = dequant(W[rows[i]]): embedding lookup from a (possibly quantized) table."""
    dequant_rows_for(int(qtype))(w, rows, out)


_EMPTY_Q = np.zeros((1, 32), np.int8)  # the int8 operands of a float32-path call: never read
_EMPTY_D = np.zeros((1, 2), np.float32)
