"""The int8-activation decode kernels (cuda_kernels/matvec_q8.py) against numpy on gguf-py's dequantized weights.

The reference quantizes the activation row exactly as the kernel does (per 32 elements: a = max|v|, q = rint(v *
127/a), value q * a/127), so kernel and reference compute the same sums up to float32 ordering: |err| <= 1e-5 *
sum_k |w_k xq_k| + 1e-6 per output. A second check bounds the quantization error against the float row itself
(relative L2 <= 4e-2: int8 per 32 elements; measured up to 2.2e-2 on the random-byte K-quant rows). Runs in numba's CUDA simulator (dp4a's Python twin) and on a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from strata_nb.cpu_kernels.qtypes import F32, Q4_K, Q6_K, Q8_0, row_bytes
from strata_nb.cuda_kernels import matmul as mm
from strata_nb.cuda_kernels import matvec_q8 as kq8
from strata_nb.errors import StrataError
from tests.test_cuda_matmul import MOE_IDS, MOE_SLOT_OF, SENTINEL, _slots_with, dequant, random_rows

TYPES = [pytest.param(Q4_K, id="Q4_K"), pytest.param(Q6_K, id="Q6_K"), pytest.param(Q8_0, id="Q8_0")]


def q8_row(v: np.ndarray) -> np.ndarray:
    """v as the kernel quantizes it (float32 arithmetic), dequantized to float64."""
    b = v.astype(np.float32).reshape(-1, 32)
    a = np.abs(b).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(a > 0, np.float32(127.0) / a, np.float32(0.0)).astype(np.float32)
    q = np.rint(b * inv)
    return (q.astype(np.float64) * (a / np.float32(127.0)).astype(np.float64)).reshape(-1)


def check(got, xq, wf, exact):
    want = wf @ xq
    mag = np.abs(wf) @ np.abs(xq)
    assert np.isfinite(got).all()
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= 1e-5 * mag + 1e-6).all(), (err / (1e-5 * mag + 1e-6)).max()
    assert np.linalg.norm(got - exact) <= 4e-2 * np.linalg.norm(exact)


def test_supports():
    assert kq8.supports([Q4_K, Q6_K, Q8_0], 2048)
    assert not kq8.supports([Q4_K, F32], 2048)
    assert not kq8.supports([Q8_0], 96) and not kq8.supports([Q4_K], 2 * kq8.MAX_K)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("k", [512, 2560])
def test_matvec_q8(qtype, norm, k):
    """Five rows (none a multiple of a warp's rows); 512 elements (one unit a lane, half the lanes idle on a GPU)
    or 2560 (two units a step, then one); with the fused norm and the normalized row written out, or accumulating
    into out."""
    rng = np.random.default_rng(50 + qtype + 7 * norm + k)
    n = 5
    w = random_rows(qtype, n, k, rng)
    wf = dequant(qtype, w)
    x = rng.standard_normal((1, k)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, k).astype(np.float32)
    base = rng.standard_normal((1, n)).astype(np.float32)
    out = cuda.to_device(base.copy())
    if norm:
        xo = cuda.to_device(np.zeros((1, k), np.float32))
        mm.matvec([(qtype, cuda.to_device(w), out, False)], cuda.to_device(x), 0, norm=cuda.to_device(nw),
                  eps=1e-6, x_out=xo, q8=True)
        inv = 1.0 / np.sqrt(np.mean(x[0].astype(np.float64) ** 2) + 1e-6)
        v = x[0] * nw
        got = out.copy_to_host()[0]
        check(got / inv, q8_row(v), wf, wf @ v.astype(np.float64))
        np.testing.assert_allclose(xo.copy_to_host()[0], v * inv, rtol=1e-5, atol=1e-6)
    else:
        mm.matmul(qtype, cuda.to_device(w), cuda.to_device(x), out, 1, 0, accumulate=True, q8=True)
        got = out.copy_to_host()[0] - base[0]
        check(got, q8_row(x[0]), wf, wf @ x[0].astype(np.float64))


def q8_form(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows v [R, K] in the kernels' global int8 form (matvec_q8.q8_shapes), quantized as the kernels do: words of
    4 int8 (element 4w + e in byte e), a scale per 32, the scaled sum of the ints per 16."""
    r = v.shape[0]
    b = v.astype(np.float32).reshape(r, -1, 32)
    a = np.abs(b).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(a > 0, np.float32(127.0) / a, np.float32(0.0)).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int8)
    d = (a / np.float32(127.0)).astype(np.float32)
    xs = (d[..., None] * q.reshape(r, -1, 2, 16).sum(axis=3, dtype=np.int32).astype(np.float32)).reshape(r, -1)
    return np.ascontiguousarray(q.reshape(r, -1)).view(np.uint32), d, xs.astype(np.float32)


def check_q8_form(form, want: np.ndarray) -> None:
    """An int8 form a kernel wrote against the rows it stands for: every value within half a step (plus float32
    rounding of the row itself), each scale the block's max / 127, each sum its 16 ints times the scale."""
    xq, xd, xs = form
    r = want.shape[0]
    q = xq.view(np.int8).reshape(r, -1, 32).astype(np.float64)
    d = xd.astype(np.float64)
    vals = q * d[..., None]
    w = want.astype(np.float64).reshape(r, -1, 32)
    a = np.abs(w).max(axis=2)
    np.testing.assert_allclose(d, a / 127.0, rtol=1e-5, atol=1e-12)
    assert (np.abs(vals - w) <= 0.5 * d[..., None] * (1 + 1e-4) + 1e-6 * np.abs(w) + 1e-12).all()
    sums = (q.reshape(r, -1, 2, 16).sum(axis=3) * d[..., None]).reshape(r, -1)
    np.testing.assert_allclose(xs, sums, rtol=1e-6, atol=1e-9)


def test_q8_form_checker():
    """The checker accepts the exact int8 form of a row and rejects one with a value a step off."""
    rng = np.random.default_rng(7)
    v = rng.standard_normal((2, 512)).astype(np.float32)
    form = q8_form(v)
    check_q8_form(form, v)
    xq = form[0].copy()
    xq.view(np.int8)[1, 37] += 1
    with pytest.raises(AssertionError):
        check_q8_form((xq, form[1], form[2]), v)


@pytest.mark.parametrize("qtype", [pytest.param(F32, id="F32")] + TYPES)
def test_matvec_q8_out(qtype):
    """The routing launch's int8 form of the normalized row (float kernel for F32 weights, the int8 one for the
    rest): within half a quantization step of rmsnorm(x) * weight, consistent scales and sums; the launch's own
    outputs are as without it."""
    rng = np.random.default_rng(60 + qtype)
    n, k = 7, 768
    w = random_rows(qtype, n, k, rng) if qtype != F32 else rng.standard_normal((n, k)).astype(np.float32).view(
        np.uint8).reshape(n, -1)
    x = rng.standard_normal((1, k)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, k).astype(np.float32)
    outs = []
    for q8_out in (None, tuple(cuda.to_device(np.zeros((1, m), dt)) for m, dt in kq8.q8_shapes(k))):
        out = cuda.to_device(np.zeros((1, n), np.float32))
        xo = cuda.to_device(np.zeros((1, k), np.float32))
        mm.matvec([(qtype, cuda.to_device(w), out, False)], cuda.to_device(x), 0, norm=cuda.to_device(nw),
                  eps=1e-6, x_out=xo, q8=True, q8_out=q8_out)
        outs.append(out.copy_to_host())
    assert (outs[0] == outs[1]).all()
    check_q8_form(tuple(a.copy_to_host() for a in q8_out), xo.copy_to_host())


def test_q8_out_refused():
    k = 768
    w = cuda.to_device(np.zeros((4, k * 4), np.uint8))
    out = cuda.to_device(np.zeros((1, 4), np.float32))
    x = cuda.to_device(np.zeros((1, k), np.float32))
    good = tuple(cuda.to_device(np.zeros((1, m), dt)) for m, dt in kq8.q8_shapes(k))
    with pytest.raises(StrataError, match="with a norm"):
        mm.matvec([(F32, w, out, False)], x, 0, q8_out=good)
    bad = (good[0], good[1], cuda.to_device(np.zeros((1, k // 32), np.float32)))
    with pytest.raises(StrataError, match="int8 form of x_out"):
        mm.matvec([(F32, w, out, False)], x, 0, norm=cuda.to_device(np.ones(k, np.float32)), q8_out=bad)


def _entry_ref(qtype, mats, e, xq):
    gf, uf = dequant(qtype, mats[e][0]), dequant(qtype, mats[e][1])
    g, u = gf @ xq, uf @ xq
    want = g / (1 + np.exp(-g)) * u
    eg, eu = 1e-5 * (np.abs(gf) @ np.abs(xq)) + 1e-6, 1e-5 * (np.abs(uf) @ np.abs(xq)) + 1e-6
    return want, 1.1 * eg * np.abs(u) + np.abs(g / (1 + np.exp(-g))) * eu + 1e-6


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,quant_h", [(5, False), (256, True)], ids=["5rows", "256rows-hq8"])
def test_moe_gate_up_q8(qtype, n, quant_h):
    """h = silu(G xq) * (U xq) per resident entry from x's int8 form; entries without a slot keep their sentinel.
    With hq8 (256 rows: whole int8 blocks of h), h's int8 form is within half a step of the h written."""
    rng = np.random.default_rng(90 + qtype + n)
    k = 256
    rb = row_bytes(qtype, k)
    mats = {e: [random_rows(qtype, n, k, rng), random_rows(qtype, n, k, rng)] for e in range(6)}
    og, ou = 2, 2 + n * rb
    slots = _slots_with(qtype, mats, MOE_SLOT_OF, rng, (og, ou), (rb, rb))
    ntok, kk = MOE_IDS.shape
    x = rng.standard_normal((ntok, k)).astype(np.float32)
    h = cuda.to_device(np.full((ntok * kk, n), SENTINEL, np.float32))
    hq8 = tuple(cuda.to_device(np.zeros((ntok * kk, m), dt)) for m, dt in kq8.q8_shapes(n)) if quant_h else None
    mm.moe_gate_up((qtype, og, rb), (qtype, ou, rb), cuda.to_device(slots), n, cuda.to_device(MOE_SLOT_OF),
                   cuda.to_device(MOE_IDS), cuda.to_device(x), h, ntok, 0,
                   xq8=tuple(cuda.to_device(a) for a in q8_form(x)), hq8=hq8)
    got = h.copy_to_host()
    live = []
    for t in range(ntok):
        xq = q8_row(x[t])
        for j in range(kk):
            i, e = t * kk + j, MOE_IDS[t, j]
            if MOE_SLOT_OF[e] < 0:
                assert (got[i] == SENTINEL).all(), (t, j)
                continue
            want, bound = _entry_ref(qtype, mats, e, xq)
            assert (np.abs(got[i] - want) <= bound).all(), (t, j)
            live.append(i)
    if quant_h:
        form = tuple(a.copy_to_host()[live] for a in hq8)
        check_q8_form(form, got[live])


@pytest.mark.parametrize("qtype", TYPES)
def test_moe_down_q8(qtype):
    """out[t] += sum_j w[t, j] * D_e hq[t*k+j] over the resident choices, from h's int8 form."""
    rng = np.random.default_rng(400 + qtype)
    n, f = 6, 512
    rb = row_bytes(qtype, f)
    mats = {e: [random_rows(qtype, n, f, rng)] for e in range(6)}
    slots = _slots_with(qtype, mats, MOE_SLOT_OF, rng, (70,), (rb,))
    ntok, kk = MOE_IDS.shape
    h = rng.standard_normal((ntok * kk, f)).astype(np.float32)
    wts = rng.uniform(0.1, 1.0, (ntok, kk)).astype(np.float32)
    base = rng.standard_normal((ntok + 1, n)).astype(np.float32)
    out = cuda.to_device(base)
    mm.moe_down((qtype, 70, rb), cuda.to_device(slots), n, cuda.to_device(MOE_SLOT_OF), cuda.to_device(MOE_IDS),
                cuda.to_device(wts), cuda.to_device(h), out, ntok, 0,
                hq8=tuple(cuda.to_device(a) for a in q8_form(h)))
    got = out.copy_to_host()
    for t in range(ntok):
        want, mag = base[t].astype(np.float64), np.abs(base[t]).astype(np.float64)
        for j in range(kk):
            e = MOE_IDS[t, j]
            if MOE_SLOT_OF[e] >= 0:
                df, hq = dequant(qtype, mats[e][0]), q8_row(h[t * kk + j])
                want = want + wts[t, j] * (df @ hq)
                mag = mag + wts[t, j] * (np.abs(df) @ np.abs(hq))
        err = np.abs(got[t].astype(np.float64) - want)
        assert (err <= 1e-5 * mag + 1e-6).all(), (t, (err / (1e-5 * mag + 1e-6)).max())
    assert (got[ntok] == base[ntok]).all()
