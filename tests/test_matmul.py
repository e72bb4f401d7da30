"""The matrix drivers (cpu_kernels/matmul.py) against numpy float64 on gguf-py's dequantized weights.

Checks that every row, token and expert lands where it belongs, for every quant type the dispatch table
supports, on shapes that are not a multiple of the 16-row task block. Outputs are poisoned with NaN first.
Tolerances: float32 path 1e-5 * (|W| @ |x|) against the float64 product; int8 path 2e-2 * (|W| @ |x|) against
the float64 product on float x (the int8 rounding of x; the row kernels' own tests bound it tightly) and
1e-6 relative against the same row kernel called one row at a time (the driver must not change the result).
The int8 drivers serve up to four tokens per row unpack with the multi-token row kernels; for token counts and
expert group sizes that exercise every remainder of that grouping, their output is bit-identical to the
single-token kernel called per (row, token).
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from numba import njit

from strata_nb.cpu_kernels.actq import group, quantize
from strata_nb.cpu_kernels.matmul import dequant_rows, matmul_f32, matmul_q8, moe_matmul, specialize
from strata_nb.cpu_kernels.qtypes import (
    BF16, F16, FLOAT_TYPES, Q4_K, Q5_0, Q6_K, Q8_0, QUANT_INFO, SUPPORTED, row_bytes,
)
from strata_nb.cpu_kernels.rowdot import dot_q8

ROWS = 37  # two full 16-row tasks and a partial one
K = 256  # the smallest K-quant row
# byte offsets of the fp16 scale/min fields inside one block (ggml-common.h block layouts)
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
TYPES = [pytest.param(q, id=QUANT_INFO[q][0]) for q in SUPPORTED]


def random_matrix(qtype: int, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8[rows, row_bytes]: random quants with finite fp16 scales, or random normal float weights."""
    name, blk, bb = QUANT_INFO[qtype]
    if qtype in FLOAT_TYPES:
        v = rng.standard_normal((rows, k)).astype(np.float32)
        v = {"F32": v, "F16": v.astype(np.float16), "BF16": (v.view(np.uint32) >> 16).astype(np.uint16)}[name]
        return v.view(np.uint8).reshape(rows, -1)
    nb = rows * k // blk
    blocks = rng.integers(0, 256, (nb, bb), dtype=np.uint8)
    for off in FP16_FIELDS[name]:
        v = rng.uniform(1e-3, 1e-1, nb) * rng.choice([-1.0, 1.0], nb)
        blocks[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


def gguf_matrix(qtype: int, w: np.ndarray) -> np.ndarray:
    gt = gguf.GGMLQuantizationType(qtype)
    return dequantize(w.reshape(-1), gt).astype(np.float64).reshape(w.shape[0], -1)


def _make_rowwise_q8(QT):
    @njit(cache=True)
    def rowwise_q8(w, xq, xd, xs, out):
        for t in range(xq.shape[0]):
            for r in range(w.shape[0]):
                out[t, r] = dot_q8(QT, w[r], xq[t], xd[t], xs[t])

    return rowwise_q8


_rowwise_q8_for = specialize(_make_rowwise_q8)


def _rowwise_q8(qtype, w, xq, xd, xs, out):
    """The single-token row kernel called per (row, token): what the drivers must reproduce bit for bit."""
    _rowwise_q8_for(int(qtype))(w, xq, xd, xs, out)


def check_close(got: np.ndarray, want: np.ndarray, scale: np.ndarray, rtol: float) -> None:
    assert np.isfinite(got).all()
    err = np.abs(got - want) / scale
    assert err.max() <= rtol, err.max()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("ntok", [1, 7])
def test_matmul(qtype, ntok):
    rng = np.random.default_rng(qtype * 10 + ntok)
    w = random_matrix(qtype, ROWS, K, rng)
    w.setflags(write=False)  # as the GGUF memory map is
    wf = gguf_matrix(qtype, w)
    x = rng.standard_normal((ntok, K)).astype(np.float32)
    want = x.astype(np.float64) @ wf.T
    scale = np.abs(x).astype(np.float64) @ np.abs(wf).T

    out = np.full((ntok, ROWS), np.nan, np.float32)
    matmul_f32(qtype, w, x, out)
    check_close(out, want, scale, 1e-5)

    xq, xd, xs = quantize(x, group(qtype))
    out = np.full((ntok, ROWS), np.nan, np.float32)
    matmul_q8(qtype, w, x, xq, xd, xs, out)
    check_close(out, want, scale, 1e-5 if qtype in FLOAT_TYPES else 2e-2)
    if qtype not in FLOAT_TYPES:
        rowwise = np.full((ntok, ROWS), np.nan, np.float32)
        _rowwise_q8(qtype, w, xq, xd, xs, rowwise)
        check_close(out, rowwise.astype(np.float64), scale, 1e-6)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("fast", [True, False])
def test_moe_matmul(qtype, fast):
    """Four groups of 3, 0, 1 and 5 tokens over experts stored at uneven offsets of one buffer."""
    rng = np.random.default_rng(qtype * 10 + fast)
    n_exp, ntok = 5, 7
    rb = row_bytes(qtype, K)
    experts = [random_matrix(qtype, ROWS, K, rng) for _ in range(n_exp)]
    gap = 96  # experts not back to back: base offsets must be honoured
    buf = np.zeros(64 + n_exp * (ROWS * rb + gap), np.uint8)
    offsets = [64 + e * (ROWS * rb + gap) for e in range(n_exp)]
    for e, off in enumerate(offsets):
        buf[off:off + ROWS * rb] = experts[e].reshape(-1)
    buf.setflags(write=False)  # as the GGUF or pack memory map is
    chosen = [3, 0, 4, 1]
    counts = [3, 0, 1, 5]
    base = np.array([offsets[e] for e in chosen], np.int64)
    grp_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    tok_idx = np.concatenate([rng.choice(ntok, c, replace=False) for c in counts]).astype(np.int64)
    x = rng.standard_normal((ntok, K)).astype(np.float32)
    xq, xd, xs = quantize(x, group(qtype))
    out = np.full((tok_idx.size, ROWS), np.nan, np.float32)
    moe_matmul(fast, qtype, buf.ctypes.data + base, ROWS, rb, grp_start[:-1], grp_start[1:], tok_idx, x, xq, xd, xs,
               out)

    for g, e in enumerate(chosen):
        wf = gguf_matrix(qtype, experts[e])
        for j in range(grp_start[g], grp_start[g + 1]):
            xt = x[tok_idx[j]].astype(np.float64)
            rtol = 2e-2 if fast and qtype not in FLOAT_TYPES else 1e-5
            check_close(out[j], wf @ xt, np.abs(wf) @ np.abs(xt), rtol)


QUANT_TYPES = [pytest.param(q, id=QUANT_INFO[q][0]) for q in SUPPORTED if q not in FLOAT_TYPES]


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_multi_token_drivers_match_single_token_kernel(qtype):
    """matmul_q8 for T in {2, 3, 4, 5, 7, 9} and moe_matmul over groups of 9, 2, 0, 4, 1, 3, 5 and 7 tokens:
    bit-identical to dot_q8 per (row, token), and within the int8 tolerance of numpy on float x."""
    rng = np.random.default_rng(qtype + 500)
    n_exp = 8
    experts = [random_matrix(qtype, ROWS, K, rng) for _ in range(n_exp)]
    for w in experts:
        w.setflags(write=False)
    w = experts[0]
    wf = gguf_matrix(qtype, w)
    for ntok in (2, 3, 4, 5, 7, 9):
        x = rng.standard_normal((ntok, K)).astype(np.float32)
        xq, xd, xs = quantize(x, group(qtype))
        out = np.full((ntok, ROWS), np.nan, np.float32)
        matmul_q8(qtype, w, x, xq, xd, xs, out)
        single = np.full((ntok, ROWS), np.nan, np.float32)
        _rowwise_q8(qtype, w, xq, xd, xs, single)
        np.testing.assert_array_equal(out, single)
        check_close(out, x.astype(np.float64) @ wf.T, np.abs(x).astype(np.float64) @ np.abs(wf).T, 2e-2)

    rb = row_bytes(qtype, K)
    buf = np.concatenate([np.zeros(32, np.uint8)] + [e.reshape(-1) for e in experts[::-1]])
    buf.setflags(write=False)
    base = np.array([32 + (n_exp - 1 - e) * ROWS * rb for e in range(n_exp)], np.int64)  # expert e's offset
    counts = [9, 2, 0, 4, 1, 3, 5, 7]
    ntok = 9
    grp_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    tok_idx = np.concatenate([rng.choice(ntok, c, replace=False) for c in counts]).astype(np.int64)
    x = rng.standard_normal((ntok, K)).astype(np.float32)
    xq, xd, xs = quantize(x, group(qtype))
    out = np.full((tok_idx.size, ROWS), np.nan, np.float32)
    moe_matmul(True, qtype, buf.ctypes.data + base, ROWS, rb, grp_start[:-1], grp_start[1:], tok_idx, x, xq, xd, xs,
               out)
    for g in range(n_exp):
        single = np.full((ntok, ROWS), np.nan, np.float32)
        _rowwise_q8(qtype, experts[g], xq, xd, xs, single)
        wf = gguf_matrix(qtype, experts[g])
        for j in range(grp_start[g], grp_start[g + 1]):
            t = tok_idx[j]
            np.testing.assert_array_equal(out[j], single[t])
            check_close(out[j], wf @ x[t].astype(np.float64), np.abs(wf) @ np.abs(x[t]).astype(np.float64), 2e-2)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequant_rows(qtype):
    rng = np.random.default_rng(qtype)
    w = random_matrix(qtype, ROWS, K, rng)
    rows = np.array([36, 0, 5, 5, 17, 36], np.int64)
    out = np.full((rows.size, K), np.nan, np.float32)
    dequant_rows(qtype, w, rows, out)
    np.testing.assert_array_equal(out, gguf_matrix(qtype, w)[rows].astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["matmul_for", "moe_matmul_for", "moe_ffn_for"])
def test_drivers_compile_parallel(driver):
    """A raise reaching a prange body (say, through an inlined dispatch) makes numba run the loop serially with
    only a warning; compile a fresh copy of each specialized driver with warnings as errors so that regression
    fails here."""
    import warnings

    from numba.core.errors import NumbaPerformanceWarning

    from strata_nb.cpu_kernels import matmul

    make = getattr(matmul, driver).make
    fresh = njit(parallel=True)((make(True, Q8_0, Q8_0, Q8_0) if driver == "moe_ffn_for" else make(True, Q8_0)).py_func)
    w = random_matrix(Q8_0, 32, K, np.random.default_rng(0))
    x = np.zeros((1, K), np.float32)
    xq, xd, xs = quantize(x)
    out = np.zeros((1, 32), np.float32)
    p = np.array([w.ctypes.data], np.int64)
    zero, one = np.zeros(1, np.int64), np.ones(1, np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumbaPerformanceWarning)
        if driver == "matmul_for":
            fresh(w, x, xq, xd, xs, out)
        elif driver == "moe_matmul_for":
            fresh(p, 32, w.shape[1], zero, one, zero, x, xq, xd, xs, out)
        else:  # a 32 x 256 gate/up, a 256 x 32 "down" read from the same bytes (only the control flow matters)
            from strata_nb.cpu_kernels.ops import plan_buffer

            hq, hd, hs = quantize(np.zeros((1, 32), np.float32))
            ids, tally = np.zeros((1, 1), np.int32), np.zeros((1, 1))
            fresh(True, ids, ids - 1, 1, 0, tally, tally, tally.astype(np.int64), plan_buffer(1, 1),
                  np.repeat(p, 3).reshape(3, 1), zero, -1, True, x, xq, xd, xs, xq, xd, xs,
                  np.zeros((3, 1, 32), np.float32), hq, hd, hs, np.zeros((1, K), np.float32), -1,
                  np.ones((1, 1), np.float32), np.zeros((1, K), np.float32), 2)


MOE_TYPES = [pytest.param(True, (Q8_0, Q8_0, Q8_0), id="fast-Q8_0"),
             pytest.param(True, (Q4_K, Q4_K, Q6_K), id="fast-Q4_K-Q6_K"),
             pytest.param(True, (Q4_K, Q5_0, Q8_0), id="fast-gate-up-differ"),
             pytest.param(True, (Q8_0, Q8_0, Q6_K), id="fast-down-group-differs"),
             pytest.param(True, (F16, F16, BF16), id="fast-F16-BF16"),
             pytest.param(False, (Q4_K, Q4_K, Q6_K), id="f32-Q4_K-Q6_K")]


@pytest.mark.parametrize("ntok,nthreads", [(5, 2), (1, 1), (1, 2), (1, 15)], ids=lambda v: str(v))
@pytest.mark.parametrize("fast,types", MOE_TYPES)
def test_moe_ffn_matches_the_grouped_calls(fast, types, ntok, nthreads):
    """moe_ffn (the routing split, x's int8 form, gate+up, SwiGLU + int8 quantization, down and the weighted
    combine in one call per wave) against the calls it replaces: ops.moe_split, actq.quantize, moe_matmul for
    gate, up and down, ops.swiglu_quant (ops.silu_mul on the float path) and ops.moe_combine. Bit-identical, for
    one call (x quantized before or inside) and for the split alone then the experts in three waves in another
    order (as the tiered store hands them over), with negative ids skipped; for a prompt and for one token with
    the task sizes of 1, 2 and 15 threads (32, 16 and 8 rows here)."""
    from strata_nb.cpu_kernels import ops
    from strata_nb.cpu_kernels.matmul import moe_ffn_for

    qg, qu, qd = types
    hidden, ff, n_exp, k = 256, 512, 6, 3
    rng = np.random.default_rng(sum(types) + fast + ntok)
    mats = [[random_matrix(q, rows, cols, rng) for q, rows, cols in ((qg, ff, hidden), (qu, ff, hidden),
                                                                      (qd, hidden, ff))] for _ in range(n_exp)]
    flat = np.concatenate([m.reshape(-1) for e in mats for m in e])
    flat.setflags(write=False)
    sizes = [m.size for e in mats for m in e]
    offs = np.concatenate([[0], np.cumsum(sizes)])[:-1].reshape(n_exp, 3) + flat.ctypes.data
    ids = np.array([rng.choice(n_exp, k, replace=False) for _ in range(ntok)], np.int32)
    ids[0 if ntok == 1 else 1, 2] = -1
    if ntok > 3:
        ids[3, 0] = -1
    wts = rng.uniform(0.1, 1.0, (ntok, k)).astype(np.float32)
    x = rng.standard_normal((ntok, hidden)).astype(np.float32)
    xq, xd, xs = quantize(x, group(qg))
    uq, ud, us = quantize(x, group(qu))
    plan = ops.plan_buffer(n_exp, ids.size)
    tallies = (np.zeros((1, n_exp)), np.zeros((1, n_exp)), np.zeros((1, n_exp), np.int64))
    nsplit, _ = ops.moe_split(ids, np.full(ids.shape, -1, np.int32), ntok, 0, plan, *tallies)
    experts, grp_start = plan[ops.PLAN_EXPERT, :nsplit].copy(), plan[ops.PLAN_START, :nsplit + 1].copy()
    n = int(grp_start[-1])
    entry_tok, entry_slot = plan[ops.PLAN_TOK, :n].copy(), plan[ops.PLAN_SLOT, :n].copy()
    lo, hi = grp_start[:-1], grp_start[1:]
    rb = [m.shape[1] for m in mats[0]]

    g, u = np.full((n, ff), np.nan, np.float32), np.full((n, ff), np.nan, np.float32)
    moe_matmul(fast, qg, offs[experts, 0], ff, rb[0], lo, hi, entry_tok, x, xq, xd, xs, g)
    moe_matmul(fast, qu, offs[experts, 1], ff, rb[1], lo, hi, entry_tok, x, uq, ud, us, u)
    h = np.empty_like(g)
    hq, hd, hs = quantize(np.zeros((n, ff), np.float32), group(qd))
    if fast:
        ops.swiglu_quant(g, u, h, hq, hd, hs)
    else:
        ops.silu_mul(g, u, h)
    y = np.full((n, hidden), np.nan, np.float32)
    moe_matmul(fast, qd, offs[experts, 2], hidden, rb[2], lo, hi, np.arange(n), h, hq, hd, hs, y)
    want = rng.standard_normal((ntok, hidden)).astype(np.float32)
    got0 = want.copy()
    ops.moe_combine(y, wts, entry_tok, entry_slot, want)

    kern = moe_ffn_for(fast, qg, qu, qd)
    table = np.ascontiguousarray(offs.T)
    perm = rng.permutation(len(experts))
    no_slot = np.full(ids.shape, -1, np.int32)
    waves3 = [perm[:2], perm[2:3], perm[3:]] if len(perm) > 3 else [perm[:1], perm[1:]]  # none of them empty
    for quant, waves in ((False, None), (True, None), (True, waves3)):
        cap = n + 3
        plan = ops.plan_buffer(n_exp, cap)
        plan[:ops.PLAN_IDENT] = plan[ops.PLAN_IDENT + 1:] = 99  # stale contents
        ghu = np.full((3, cap, ff), np.nan, np.float32)
        hbuf = (*quantize(np.zeros((cap, ff), np.float32), group(qd)), np.full((cap, hidden), np.nan, np.float32))
        if quant:  # the kernel quantizes x into buffers of stale contents (one triple where the groups agree)
            qx = tuple(np.full_like(a, 7) for a in (xq, xd, xs))
            qx = qx + (qx if group(qg) == group(qu) else tuple(np.full_like(a, 7) for a in (uq, ud, us)))
        else:
            qx = (xq, xd, xs, uq, ud, us)
        got = got0.copy()
        split = (ids, no_slot, ntok, 0, *tallies, plan)
        if waves is None:  # one call: split, every group, combine
            r = kern(True, *split, table, plan[ops.PLAN_IDENT], -1, quant, x, *qx, ghu, *hbuf, -1, wts, got, nthreads)
        else:  # the split alone, then the waves as a tiered store hands them over
            r = kern(True, *split, table, plan[ops.PLAN_IDENT], 0, quant, x, *qx, ghu, *hbuf, 0, wts, got, nthreads)
            for i, grp in enumerate(waves):
                kern(False, *split, table, grp, len(grp), quant and i == 0, x, *qx, ghu, *hbuf,
                     nsplit if i == len(waves) - 1 else 0, wts, got, nthreads)
        assert r == (nsplit, 0)
        np.testing.assert_array_equal(hbuf[-1][:n], y)
        np.testing.assert_array_equal(got, want)
