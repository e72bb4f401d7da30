"""The CUDA matrix kernels (cuda_kernels/matmul.py) against numpy on gguf-py's dequantized weights and against
their njit twins (cpu_kernels.matmul: matmul_f32, dequant_rows).

Runs in numba's CUDA simulator without a GPU (tests/conftest.py) and unchanged on a GPU. Weights: float and
legacy types quantized from random floats with gguf.quants.quantize; K-quants (gguf-py cannot quantize them)
random bytes with finite fp16 scales of random sign, so every quant and packed-scale bit pattern occurs.
Outputs start as sentinels, so rows and tokens a kernel must not touch are checked too.
Tolerances (float32 accumulation in another order than numpy's float64 / the njit twin):
  matmul, matvec, moe_down  |err| <= 1e-5 * sum_k |w_k x_k| + 1e-6 per output
  moe_gate_up        that bound on each of gate and up, propagated through silu(g) * u
  embed              |err| <= 1e-6 * |w| + 1e-6 * max|row| (the GPU may fuse scale*q - min into one fma;
                     gguf-py and the CPU twin round the product first)
"""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize
from numba import cuda

from strata_nb.cpu_kernels.matmul import dequant_rows, matmul_f32
from strata_nb.cpu_kernels.ops import rmsnorm as cpu_rmsnorm
from strata_nb.cpu_kernels.qtypes import F16, F32, Q4_K, Q6_K, Q8_0, QUANT_INFO, SUPPORTED, row_bytes
from strata_nb.cuda_kernels import matmul as mm
from strata_nb.errors import StrataError

# byte offsets of the fp16 scale/min fields in a K-quant block (ggml-common.h)
KQ_FP16 = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
TYPES = [pytest.param(q, id=QUANT_INFO[q][0]) for q in SUPPORTED]
SENTINEL = np.float32(-777.0)


def k_of(qtype: int) -> int:
    """Row length: one 256 super-block for K-quants, two blocks (or 4 float units) otherwise."""
    return 256 if QUANT_INFO[qtype][1] == 256 else 64


def random_rows(qtype: int, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    name, blk, bb = QUANT_INFO[qtype]
    if name in KQ_FP16:
        nb = rows * k // blk
        blocks = rng.integers(0, 256, (nb, bb), dtype=np.uint8)
        for off in KQ_FP16[name]:
            v = rng.uniform(1e-3, 1e-1, nb) * rng.choice([-1.0, 1.0], nb)
            blocks[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(nb, 2)
        return blocks.reshape(rows, -1)
    q = quantize(rng.standard_normal((rows, k)).astype(np.float32), gguf.GGMLQuantizationType(qtype))
    return np.ascontiguousarray(q).view(np.uint8).reshape(rows, row_bytes(qtype, k))


def dequant(qtype: int, w: np.ndarray) -> np.ndarray:
    gt = gguf.GGMLQuantizationType(qtype)
    return dequantize(w.reshape(-1), gt).astype(np.float64).reshape(w.shape[0], -1)


def assert_close(got: np.ndarray, want: np.ndarray, mag: np.ndarray) -> None:
    assert np.isfinite(got).all()
    err = np.abs(got.astype(np.float64) - want)
    bound = 1e-5 * mag + 1e-6
    assert (err <= bound).all(), (err / bound).max()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("ntok", [1, 3])
def test_matmul(qtype, ntok):
    """Against numpy and the njit twin; then accumulate=True adds into out. Five rows (not a multiple of any
    block's rows); x and out have one row more than ntok, which must stay untouched."""
    rng = np.random.default_rng(100 * qtype + ntok)
    n, k = 5, k_of(qtype)
    w = random_rows(qtype, n, k, rng)
    wf = dequant(qtype, w)
    x = rng.standard_normal((ntok + 1, k)).astype(np.float32)
    want = x[:ntok].astype(np.float64) @ wf.T
    mag = np.abs(x[:ntok]).astype(np.float64) @ np.abs(wf).T

    twin = np.empty((ntok, n), np.float32)
    matmul_f32(qtype, w, np.ascontiguousarray(x[:ntok]), twin)
    assert_close(twin, want, mag)

    dw, dx = cuda.to_device(w), cuda.to_device(x)
    out = cuda.to_device(np.full((ntok + 1, n), SENTINEL, np.float32))
    mm.matmul(qtype, dw, dx, out, ntok, 0)
    got = out.copy_to_host()
    assert_close(got[:ntok], want, mag)
    assert_close(got[:ntok], twin.astype(np.float64), mag)
    assert (got[ntok] == SENTINEL).all()

    base = rng.standard_normal((ntok + 1, n)).astype(np.float32)
    out = cuda.to_device(base)
    mm.matmul(qtype, dw, dx, out, ntok, 0, accumulate=True)
    got = out.copy_to_host()
    assert_close(got[:ntok], base[:ntok] + want, mag + np.abs(base[:ntok]))
    assert (got[ntok] == base[ntok]).all()


@pytest.mark.parametrize("qtype", [pytest.param(Q4_K, id="Q4_K"), pytest.param(Q6_K, id="Q6_K")])
def test_matmul_long_rows(qtype):
    """Rows long enough for the wider thread split per row (and its column fold) of the matrix-vector kernel."""
    rng = np.random.default_rng(7 + qtype)
    n, k = 3, 2048
    w = random_rows(qtype, n, k, rng)
    wf = dequant(qtype, w)
    x = rng.standard_normal((1, k)).astype(np.float32)
    out = cuda.to_device(np.full((1, n), SENTINEL, np.float32))
    mm.matmul(qtype, cuda.to_device(w), cuda.to_device(x), out, 1, 0)
    assert_close(out.copy_to_host(), x.astype(np.float64) @ wf.T, np.abs(x).astype(np.float64) @ np.abs(wf).T)


@pytest.mark.parametrize("qtype", [pytest.param(Q4_K, id="Q4_K"), pytest.param(Q6_K, id="Q6_K")])
def test_matvec_many_rows(qtype):
    """An odd row count past 1024: the launch shape of large matrices (several rows a warp, the last warp's rows
    clamped; one row a warp below 1024), with the fused norm; against rmsnorm then numpy."""
    rng = np.random.default_rng(11 + qtype)
    n, k = 1029, 256
    w = random_rows(qtype, n, k, rng)
    wf = dequant(qtype, w)
    x = (rng.standard_normal((1, k)) * 2).astype(np.float32)
    nw = rng.standard_normal(k).astype(np.float32)
    xn = np.empty_like(x)
    cpu_rmsnorm(x, nw, np.float32(1e-6), xn)
    out = cuda.to_device(np.full((2, n), SENTINEL, np.float32))
    mm.matvec([(qtype, cuda.to_device(w), out, False)], cuda.to_device(x), 0, norm=cuda.to_device(nw), eps=1e-6)
    got = out.copy_to_host()
    assert_close(got[:1], xn.astype(np.float64) @ wf.T, 2 * (np.abs(xn).astype(np.float64) @ np.abs(wf).T))
    assert (got[1] == SENTINEL).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_embed(qtype):
    """Three tokens (one repeated) against the CPU twin dequant_rows and numpy; the fourth output row (beyond
    ntok) stays untouched."""
    rng = np.random.default_rng(200 + qtype)
    vocab, k = 6, k_of(qtype)
    table = random_rows(qtype, vocab, k, rng)
    tokens = np.array([4, 0, 4, 1], np.int32)
    ntok = 3
    out = cuda.to_device(np.full((ntok + 1, k), SENTINEL, np.float32))
    mm.embed(qtype, cuda.to_device(table), cuda.to_device(tokens), out, ntok, 0)
    got = out.copy_to_host()

    twin = np.empty((ntok, k), np.float32)
    dequant_rows(qtype, table, tokens[:ntok].astype(np.int64), twin)
    ref = dequant(qtype, table)[tokens[:ntok]]
    np.testing.assert_array_equal(twin, ref.astype(np.float32))  # the twin is gguf-py bit for bit
    assert np.isfinite(got[:ntok]).all()
    bound = 1e-6 * np.abs(ref) + 1e-6 * np.abs(ref).max(axis=1, keepdims=True)
    assert (np.abs(got[:ntok] - ref) <= bound).all()
    assert (got[ntok] == SENTINEL).all()


def test_embed_token_outside_table_leaves_row():
    """A token id outside the table must not fault the context: its output row keeps what it held."""
    rng = np.random.default_rng(9)
    table = random_rows(Q4_K, 3, 256, rng)
    tokens = cuda.to_device(np.array([2, 3, -1], np.int32))
    out = cuda.to_device(np.full((3, 256), SENTINEL, np.float32))
    mm.embed(Q4_K, cuda.to_device(table), tokens, out, 3, 0)
    got = out.copy_to_host()
    assert np.isfinite(got[0]).all() and (got[0] != SENTINEL).any()
    assert (got[1:] == SENTINEL).all()


def _slots_with(qtype: int, mats: dict, slot_of: np.ndarray, rng, offsets: tuple[int, ...], rb: tuple[int, ...]):
    """Slots holding each resident expert's matrices (mats[e] = [matrix per offset]) at the given byte offsets,
    padded with garbage bytes."""
    end = max(o + m.nbytes for o, m in zip(offsets, next(iter(mats.values()))))
    slot_bytes = -(-(end + 10) // 4) * 4
    slots = rng.integers(0, 256, (int(slot_of.max()) + 1, slot_bytes), dtype=np.uint8)
    for e, s_ in enumerate(slot_of):
        if s_ >= 0:
            for o, m in zip(offsets, mats[e]):
                slots[s_, o:o + m.nbytes] = m.reshape(-1)
    return slots


MOE_IDS = np.array([[1, 0, 3], [5, 4, 1]], np.int32)  # entries 1 and 3 (experts 0 and 5) have no slot
MOE_SLOT_OF = np.array([-1, 2, -1, 0, 1, -1], np.int32)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("off", [66, 128], ids=["off66", "off128"])
def test_moe_gate_up(qtype, off):
    """Six experts, three resident in slots (in another order than their ids), two tokens choosing three each:
    h = silu(G x) * (U x) per resident entry; the others keep their sentinel. The matrices sit at 2-aligned
    (uint16 loads) or 4-aligned offsets (uint32 loads where the type allows) inside slots padded with garbage."""
    rng = np.random.default_rng(300 + qtype + off)
    n, k = 5, k_of(qtype)
    rb = row_bytes(qtype, k)
    mats = {e: [random_rows(qtype, n, k, rng), random_rows(qtype, n, k, rng)] for e in range(6)}
    og, ou = off, off + n * rb + 2 * (off % 4 == 2)
    slots = _slots_with(qtype, mats, MOE_SLOT_OF, rng, (og, ou), (rb, rb))
    ntok, kk = MOE_IDS.shape
    x = rng.standard_normal((ntok, k)).astype(np.float32)
    h = cuda.to_device(np.full((ntok * kk, n), SENTINEL, np.float32))
    mm.moe_gate_up((qtype, og, rb), (qtype, ou, rb), cuda.to_device(slots), n, cuda.to_device(MOE_SLOT_OF),
                   cuda.to_device(MOE_IDS), cuda.to_device(x), h, ntok, 0)
    got = h.copy_to_host()
    for t in range(ntok):
        for j in range(kk):
            i, e = t * kk + j, MOE_IDS[t, j]
            if MOE_SLOT_OF[e] < 0:
                assert (got[i] == SENTINEL).all(), (t, j)
                continue
            gf, uf = dequant(qtype, mats[e][0]), dequant(qtype, mats[e][1])
            xt = x[t].astype(np.float64)
            g, u = gf @ xt, uf @ xt
            want = g / (1 + np.exp(-g)) * u
            # the bound of each product's factors, propagated: |d(silu(g) u)| <= |silu'(g)| |dg| |u| + |silu(g)| |du|
            eg, eu = 1e-5 * (np.abs(gf) @ np.abs(xt)) + 1e-6, 1e-5 * (np.abs(uf) @ np.abs(xt)) + 1e-6
            bound = 1.1 * eg * np.abs(u) + np.abs(g / (1 + np.exp(-g))) * eu + 1e-6
            assert (np.abs(got[i] - want) <= bound).all(), (t, j)


@pytest.mark.parametrize("qtype,f", [pytest.param(q, k_of(q), id=QUANT_INFO[q][0]) for q in SUPPORTED]
                         + [pytest.param(Q4_K, 2 * mm.MV_CHUNK, id="Q4_K-chunked")])
def test_moe_down(qtype, f):
    """out[t] += sum_j w[t, j] * D_e h[t*k+j] over the resident choices, in place on the residual stream (rows
    longer than a shared-memory stage: in chunks)."""
    rng = np.random.default_rng(400 + qtype)
    n = 6
    rb = row_bytes(qtype, f)
    mats = {e: [random_rows(qtype, n, f, rng)] for e in range(6)}
    slots = _slots_with(qtype, mats, MOE_SLOT_OF, rng, (70,), (rb,))
    ntok, kk = MOE_IDS.shape
    h = rng.standard_normal((ntok * kk, f)).astype(np.float32)
    wts = rng.uniform(0.1, 1.0, (ntok, kk)).astype(np.float32)
    base = rng.standard_normal((ntok + 1, n)).astype(np.float32)
    out = cuda.to_device(base)
    mm.moe_down((qtype, 70, rb), cuda.to_device(slots), n, cuda.to_device(MOE_SLOT_OF), cuda.to_device(MOE_IDS),
                cuda.to_device(wts), cuda.to_device(h), out, ntok, 0)
    got = out.copy_to_host()
    for t in range(ntok):
        want, mag = base[t].astype(np.float64), np.abs(base[t]).astype(np.float64)
        for j in range(kk):
            e = MOE_IDS[t, j]
            if MOE_SLOT_OF[e] >= 0:
                df = dequant(qtype, mats[e][0])
                want = want + wts[t, j] * (df @ h[t * kk + j])
                mag = mag + wts[t, j] * (np.abs(df) @ np.abs(h[t * kk + j]))
        assert_close(got[t], want, mag)
    assert (got[ntok] == base[ntok]).all()


@pytest.mark.parametrize("qtype,off", [pytest.param(q, o, id=f"{QUANT_INFO[q][0]}-off{o}")
                                       for q, o in ((Q4_K, 66), (Q6_K, 128), (Q8_0, 66), (F16, 128))])
def test_moe_prompt_grouped_by_expert(qtype, off):
    """A prompt chunk's expert FFN grouped by expert: group_experts, then moe_tiled for gate, up and down and
    experts_combine into the residual stream, against numpy on the dequantized matrices. Tokens choosing 3 of 6
    experts, 4 of them resident in slots: every expert gets two tiles of entries and more, 21 rows (no whole row tiles), matrices at 2- or 4-aligned offsets; entries of experts without a
    slot are neither grouped nor combined."""
    from strata_nb.cuda_kernels import ops as gops

    rng = np.random.default_rng(500 + qtype + off)
    ne, kk, n, k = 6, 3, 21, k_of(qtype)
    ntok = 4 * mm.TILE_TOKS + 1  # (uneven counts: partial tiles)
    slot_of = np.array([2, -1, 0, 3, -1, 1], np.int32)
    # token t chooses experts t, t + 2, t + 4 (mod 6) in a random order: each gets ntok / 2 entries, two tiles
    ids = np.stack([rng.permutation([t % ne, (t + 2) % ne, (t + 4) % ne]) for t in range(ntok)]).astype(np.int32)
    rb = rb_d = row_bytes(qtype, k)
    # gate and up: n x k; down k x k (a k x n one would need n whole blocks: odd rows are the gate's and up's case)
    mats = {e: [random_rows(qtype, n, k, rng), random_rows(qtype, n, k, rng), random_rows(qtype, k, k, rng)]
            for e in range(ne)}
    og, ou = off, off + n * rb + 2 * (off % 4 == 2)
    od = ou + n * rb + 2
    slots = cuda.to_device(_slots_with(qtype, mats, slot_of, rng, (og, ou, od), (rb, rb, rb_d)))
    x = rng.standard_normal((ntok, k)).astype(np.float32)
    wts = rng.uniform(0.1, 1.0, (ntok, kk)).astype(np.float32)
    base = rng.standard_normal((ntok, k)).astype(np.float32)
    nent = ntok * kk
    nt = gops.group_tiles_bound(nent, ne, mm.TILE_TOKS)
    order, tiles, ntiles = (cuda.to_device(np.full(sh, -1, np.int32)) for sh in ((nent,), (nt, 3), (1,)))
    d_ids, d_slot = cuda.to_device(ids), cuda.to_device(slot_of)
    gops.group_experts(d_ids, d_slot, ntok, mm.TILE_TOKS, order, tiles, ntiles, 0)
    o, tl, m = order.copy_to_host(), tiles.copy_to_host(), int(ntiles.copy_to_host()[0])
    hit = [i for i in range(nent) if slot_of[ids[i // kk, i % kk]] >= 0]
    assert sorted(o[:len(hit)].tolist()) == hit and (o[len(hit):] == -1).all()
    assert tl[:m, 2].sum() == len(hit) and (tl[:m, 2] <= mm.TILE_TOKS).all() and (tl[:m, 2] > 0).all()
    for s_, j0, c in tl[:m]:  # a tile: entries of one expert, the one in that slot
        assert {int(slot_of[ids[i // kk, i % kk]]) for i in o[j0:j0 + c]} == {s_}
    assert (np.bincount(ids.reshape(-1), minlength=ne)[slot_of >= 0] > mm.TILE_TOKS).all()
    assert (tl[:m, 2] < mm.TILE_TOKS).any()
    grouping = (order, tiles, ntiles, nt)
    g, u = (cuda.to_device(np.full((nent, n), SENTINEL, np.float32)) for _ in range(2))
    mm.moe_tiled((qtype, og, rb), slots, n, grouping, cuda.to_device(x), kk, g, 0)
    mm.moe_tiled((qtype, ou, rb), slots, n, grouping, cuda.to_device(x), kk, u, 0)
    hg, hu = g.copy_to_host(), u.copy_to_host()
    h = rng.standard_normal((nent, k)).astype(np.float32)  # the down input, independent of the gate/up check
    y = cuda.to_device(np.full((nent, k), SENTINEL, np.float32))
    mm.moe_tiled((qtype, od, rb_d), slots, k, grouping, cuda.to_device(h), 1, y, 0)
    out = cuda.to_device(base)
    gops.experts_combine(y, d_ids, cuda.to_device(wts), d_slot, out, ntok, 0)
    got_y, got = y.copy_to_host(), out.copy_to_host()
    for i in range(nent):
        t, e = i // kk, ids[i // kk, i % kk]
        if slot_of[e] < 0:
            assert (hg[i] == SENTINEL).all() and (hu[i] == SENTINEL).all() and (got_y[i] == SENTINEL).all()
            continue
        for mat, gotm in ((mats[e][0], hg[i]), (mats[e][1], hu[i])):
            wf = dequant(qtype, mat)
            assert_close(gotm, wf @ x[t].astype(np.float64), np.abs(wf) @ np.abs(x[t]).astype(np.float64))
        df = dequant(qtype, mats[e][2])
        assert_close(got_y[i], df @ h[i].astype(np.float64), np.abs(df) @ np.abs(h[i]).astype(np.float64))
    for t in range(ntok):
        want, mag = base[t].astype(np.float64), np.abs(base[t]).astype(np.float64)
        for j in range(kk):
            i = t * kk + j
            if slot_of[ids[t, j]] >= 0:
                want = want + wts[t, j] * got_y[i].astype(np.float64)
                mag = mag + wts[t, j] * np.abs(got_y[i]).astype(np.float64)
        assert_close(got[t], want, mag)


@pytest.mark.parametrize("qtype", [pytest.param(q, id=QUANT_INFO[q][0]) for q in (Q4_K, Q6_K, Q8_0, F32)])
def test_matvec_fused_norm_three_matrices(qtype):
    """Three matrices (different row counts, accumulate on the second) on one RMS-normalized row in one launch,
    the normalized row written out; against rmsnorm then numpy."""
    rng = np.random.default_rng(500 + qtype)
    k = 2 * k_of(qtype)
    ns = (7, 3, 5)
    ws = [random_rows(qtype, n, k, rng) for n in ns]
    x = (rng.standard_normal((1, k)) * 3).astype(np.float32)
    nw = rng.standard_normal(k).astype(np.float32)
    xn = np.empty_like(x)
    cpu_rmsnorm(x, nw, np.float32(1e-6), xn)
    outs = [cuda.to_device(np.full((1, n), SENTINEL, np.float32)) for n in ns]
    base = rng.standard_normal((1, ns[1])).astype(np.float32)
    outs[1] = cuda.to_device(base)
    xo = cuda.to_device(np.zeros((1, k), np.float32))
    mm.matvec([(qtype, cuda.to_device(w), o, i == 1) for i, (w, o) in enumerate(zip(ws, outs))], cuda.to_device(x),
              0, norm=cuda.to_device(nw), eps=1e-6, x_out=xo)
    np.testing.assert_allclose(xo.copy_to_host(), xn, rtol=2e-6, atol=2e-6)
    for i, (w, o) in enumerate(zip(ws, outs)):
        wf = dequant(qtype, w)
        want = xn.astype(np.float64) @ wf.T
        mag = np.abs(xn).astype(np.float64) @ np.abs(wf).T
        if i == 1:
            want, mag = want + base, mag + np.abs(base)
        assert_close(o.copy_to_host(), want, 2 * mag)  # 2x: xn itself carries float32 rounding


def test_bad_arguments_raise():
    rng = np.random.default_rng(5)
    w = cuda.to_device(random_rows(Q4_K, 2, 256, rng))
    out = cuda.to_device(np.zeros((1, 2), np.float32))
    with pytest.raises(StrataError, match="unsupported quant type"):
        mm.matmul(99, w, cuda.to_device(np.zeros((1, 256), np.float32)), out, 1, 0)
    with pytest.raises(StrataError, match="x must be float32"):
        mm.matmul(Q4_K, w, cuda.to_device(np.zeros((1, 128), np.float32)), out, 1, 0)
    with pytest.raises(StrataError, match="not whole blocks"):
        mm.matmul(Q4_K, cuda.to_device(np.zeros((2, 100), np.uint8)), cuda.to_device(np.zeros((1, 256), np.float32)),
                  out, 1, 0)


def test_imports_without_gpu_or_simulator():
    """The module compiles nothing at import: it loads with neither a GPU nor the simulator."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = "import strata_nb.cuda_kernels.matmul as m; assert not m.SIM; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
