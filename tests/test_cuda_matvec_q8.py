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


@pytest.mark.parametrize("qtype", TYPES)
def test_moe_gate_up_q8(qtype):
    """h = silu(G xq) * (U xq) per resident entry; entries without a slot keep their sentinel."""
    rng = np.random.default_rng(90 + qtype)
    n, k = 5, 256
    rb = row_bytes(qtype, k)
    mats = {e: [random_rows(qtype, n, k, rng), random_rows(qtype, n, k, rng)] for e in range(6)}
    og, ou = 2, 2 + n * rb
    slots = _slots_with(qtype, mats, MOE_SLOT_OF, rng, (og, ou), (rb, rb))
    ntok, kk = MOE_IDS.shape
    x = rng.standard_normal((ntok, k)).astype(np.float32)
    h = cuda.to_device(np.full((ntok * kk, n), SENTINEL, np.float32))
    mm.moe_gate_up((qtype, og, rb), (qtype, ou, rb), cuda.to_device(slots), n, cuda.to_device(MOE_SLOT_OF),
                   cuda.to_device(MOE_IDS), cuda.to_device(x), h, ntok, 0, q8=True)
    got = h.copy_to_host()
    for t in range(ntok):
        xq = q8_row(x[t])
        for j in range(kk):
            i, e = t * kk + j, MOE_IDS[t, j]
            if MOE_SLOT_OF[e] < 0:
                assert (got[i] == SENTINEL).all(), (t, j)
                continue
            gf, uf = dequant(qtype, mats[e][0]), dequant(qtype, mats[e][1])
            g, u = gf @ xq, uf @ xq
            want = g / (1 + np.exp(-g)) * u
            eg, eu = 1e-5 * (np.abs(gf) @ np.abs(xq)) + 1e-6, 1e-5 * (np.abs(uf) @ np.abs(xq)) + 1e-6
            bound = 1.1 * eg * np.abs(u) + np.abs(g / (1 + np.exp(-g))) * eu + 1e-6
            assert (np.abs(got[i] - want) <= bound).all(), (t, j)
