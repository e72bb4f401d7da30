"""K-quant row kernels against gguf-py's dequantizers (an independent numpy implementation of the layouts).

Blocks are random bytes with valid fp16 d/dmin in 1e-3..1e-1, so every bit pattern of the quants and packed
scales is exercised. Tolerances (measured worst case on K=2048 rows in brackets):
  dequant        bit-exact (same float32 operations as gguf-py)
  dot_f32        |err| <= 1e-6 * sum|w_i x_i| against a float64 dot of the gguf row  [1.6e-8]
  dot_q8         |err| <= 1e-6 * sum|terms| against float64: the gguf row . the int8 activations xd * xq
                 (per-256 scales), the min and offset terms included (they read xs, the sums of xd * xq per
                 16), as llama.cpp's dots on block_q8_K with its bsums
                 |err| <= 5e-3 * sum|w_i x_i| against the float64 dot on float x: the int8 rounding of x
  dot_q8_multi   bit-identical to dot_q8 on each of its tokens (same float operations in the same order)
  dot_q8_rows    bit-identical to dot_q8 on each of its rows
  dot_q8_multi_rows  bit-identical to dot_q8 on each of its rows and tokens
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from numba import njit

from row_checks import check_multi_rows  # tests/row_checks.py
from strata_nb.cpu_kernels import dot_kquant as kq
from strata_nb.cpu_kernels.actq import quantize
from strata_nb.cpu_kernels.ir import host_features
from strata_nb.cpu_kernels.qtypes import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, row_bytes
from strata_nb.errors import StrataError

GT = gguf.GGMLQuantizationType
# name -> (qtype id, gguf type, block bytes, fp16 offsets, quant byte range: zeroed, a block dequantizes to its
# min and offset terms (-m, or -s * o), which dot_q8 takes on the sums of the int8 activations, xs)
TYPES = {
    "q2_k": (Q2_K, GT.Q2_K, 84, (80, 82), (16, 80)),
    "q3_k": (Q3_K, GT.Q3_K, 110, (108,), (0, 96)),
    "q4_k": (Q4_K, GT.Q4_K, 144, (0, 2), (16, 144)),
    "q5_k": (Q5_K, GT.Q5_K, 176, (0, 2), (16, 176)),
    "q6_k": (Q6_K, GT.Q6_K, 210, (208,), (0, 192)),
}
NAMES = list(TYPES)


def random_rows(name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8[rows, row_bytes]: random quants and packed scales, valid positive fp16 d/dmin of sane size."""
    _, _, bs, f16_offs, _ = TYPES[name]
    nb = rows * (k // 256)
    blocks = rng.integers(0, 256, (nb, bs), dtype=np.uint8)
    for o in f16_offs:
        blocks[:, o:o + 2] = rng.uniform(1e-3, 1e-1, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


def gguf_rows(name: str, w: np.ndarray) -> np.ndarray:
    return dequantize(w, TYPES[name][1]).astype(np.float32).reshape(w.shape[0], -1)


def q8_reference(name: str, w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 dots of rows w with the int8 activations xd * xq of x[T, K] (the min and offset part too: the
    kernel takes it on xs, the sums of xd * xq), with the magnitude of the scale and the min terms as the kernel
    splits them. Returns (dots[T, rows], sum|terms|[T, rows])."""
    rows = w.shape[0]
    full = gguf_rows(name, w).astype(np.float64)
    qrange = TYPES[name][4]
    nb = w.shape[1] // TYPES[name][2]
    z = w.reshape(rows * nb, -1).copy()
    z[:, qrange[0]:qrange[1]] = 0  # zero quants: gguf gives -m or -s * o per weight
    mins = gguf_rows(name, z.reshape(rows, -1)).astype(np.float64)
    scaled = full - mins
    xq, xd, _ = quantize(x, 256)
    xa = xq.astype(np.float64) * np.repeat(xd.astype(np.float64), 256, axis=1)
    dots = xa @ full.T
    mag = np.abs(xa) @ np.abs(scaled).T + np.abs(xa) @ np.abs(mins).T
    return dots, mag


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.mark.parametrize("name", NAMES)
def test_dequant_matches_gguf_bit_exact(name, rng):
    w = random_rows(name, 3, 1024, rng)
    ref = gguf_rows(name, w)
    deq = getattr(kq, f"dequant_{name}")
    for r in range(w.shape[0]):
        out = np.full(1024, np.nan, np.float32)
        deq(w[r], out)
        np.testing.assert_array_equal(out, ref[r])


@pytest.mark.parametrize("name", NAMES)
def test_dot_f32_matches_float64(name, rng):
    w = random_rows(name, 6, 2048, rng)
    ref = gguf_rows(name, w).astype(np.float64)
    dot = getattr(kq, f"dot_f32_{name}")
    for r in range(w.shape[0]):
        x = rng.standard_normal(2048).astype(np.float32)
        got = dot(w[r], x)
        exact = ref[r] @ x
        assert abs(got - exact) <= 1e-6 * (np.abs(ref[r]) @ np.abs(x)), (got, exact)


@pytest.mark.parametrize("name", NAMES)
def test_dot_q8_matches_int8_reference_and_float(name, rng):
    w = random_rows(name, 8, 2048, rng)
    x = (rng.standard_normal((3, 2048)) * rng.uniform(0.1, 10, (3, 1))).astype(np.float32)
    xq, xd, xs = quantize(x, 256)
    same, mag = q8_reference(name, w, x)
    ref = gguf_rows(name, w).astype(np.float64)
    exact = x.astype(np.float64) @ ref.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(ref).T
    dot = getattr(kq, f"dot_q8_{name}")
    for t in range(x.shape[0]):
        for r in range(w.shape[0]):
            got = dot(w[r], xq[t], xd[t], xs[t])
            assert abs(got - same[t, r]) <= 1e-6 * mag[t, r], (got, same[t, r])
            assert abs(got - exact[t, r]) <= 5e-3 * scale[t, r], (got, exact[t, r])


@pytest.mark.parametrize("g", [32, 256])
def test_actq_sums_are_of_the_quantized_x(g, rng):
    """xs holds d * sum(xq) per 16, llama.cpp's bsums (Q8_K) / s (Q8_1): the min and offset terms of a row dot
    then see the same int8 activations as its scale terms (the float sums of x instead gave ~1.7x the error)."""
    x = (rng.standard_normal((3, 1024)) * rng.uniform(0.1, 10, (3, 1))).astype(np.float32)
    xq, xd, xs = quantize(x, g)
    want = xq.astype(np.int32).reshape(3, -1, 16).sum(axis=2).astype(np.float32) * np.repeat(xd, g // 16, axis=1)
    np.testing.assert_array_equal(xs, want)


@pytest.mark.parametrize("name", NAMES)
def test_dot_q8_error_is_that_of_the_int8_activations(name, rng):
    """dot_q8 is no further from the float dot than the gguf row . the dequantized int8 activations (llama.cpp's
    result). With the min and offset terms on the float sums of x (xs before it summed the int8 x) these rows
    gave 1.02x (Q5_K) to 2.0x (Q6_K) that error, the synthetic Q4_K_M models' matrices 1.5-1.9x."""
    w = random_rows(name, 16, 2048, rng)
    x = rng.standard_normal((4, 2048)).astype(np.float32)
    xq, xd, xs = quantize(x, 256)
    ref = gguf_rows(name, w).astype(np.float64)
    exact = x.astype(np.float64) @ ref.T
    xa = xq.astype(np.float64) * np.repeat(xd.astype(np.float64), 256, axis=1)
    dot = getattr(kq, f"dot_q8_{name}")
    got = np.array([[dot(w[r], xq[t], xd[t], xs[t]) for r in range(16)] for t in range(4)], np.float64)
    err, floor = np.linalg.norm(got - exact), np.linalg.norm(xa @ ref.T - exact)
    assert err <= 1.01 * floor, (err, floor)


def _chunk_dot_paths() -> list:
    """The integer-dot builders this machine can run: the portable IR always, AVX2 where numba's target has it."""
    return [kq._chunk_dot_generic] + ([kq._chunk_dot_avx2] if "avx2" in host_features() else [])


@pytest.mark.parametrize("chunk_dot", _chunk_dot_paths(), ids=lambda f: f.__name__[11:])
@pytest.mark.parametrize("name", NAMES)
def test_dot_q8_every_ir_path(name, chunk_dot, rng):
    """Each integer-dot IR path (the one chosen for this CPU and the others it can run) gives the same results,
    bit for bit: the integer sums are exact on every path."""
    bs = TYPES[name][2]
    _, _, q8, q8m, _, q8mr = kq._make_kernels(name, bs, getattr(kq, f"_unpack_{name}"), chunk_dot)

    @njit
    def dot(w, xq, xd, xs):
        return q8(w, xq, xd, xs, w.shape[0] // bs)

    @njit
    def dot3(w, xq, xd, xs):
        return q8m(w, xq, xd, xs, (1, 0, 1), w.shape[0] // bs)

    @njit
    def rows3(w, xq, xd, xs, out):
        q8mr(w, 0, w.shape[0], xq, xd, xs, (1, 0, 1), out, 0, w.shape[1] // bs)

    w = random_rows(name, 4, 1024, rng)
    x = rng.standard_normal((2, 1024)).astype(np.float32)
    xq, xd, xs = quantize(x, 256)
    same, mag = q8_reference(name, w, x)
    for r in range(4):
        for t in range(2):
            got = dot(w[r], xq[t], xd[t], xs[t])
            assert abs(got - same[t, r]) <= 1e-6 * mag[t, r], (got, same[t, r])
        singles = [dot(w[r], xq[t], xd[t], xs[t]) for t in (1, 0, 1)]
        np.testing.assert_array_equal(np.array(dot3(w[r], xq, xd, xs), np.float32), np.float32(singles))
        np.testing.assert_array_equal(np.float32(singles[1]), getattr(kq, f"dot_q8_{name}")(w[r], xq[0], xd[0], xs[0]))
    out = np.empty((3, 4), np.float32)
    rows3(w, xq, xd, xs, out)
    np.testing.assert_array_equal(out, np.float32([[dot(w[r], xq[t], xd[t], xs[t]) for r in range(4)] for t in (1, 0, 1)]))


@pytest.mark.parametrize("name", NAMES)
def test_dot_q8_rows_matches_single(name, rng):
    """The rows kernel writes exactly the single-row results into out[r0:r1] and nothing else."""
    rows_k = getattr(kq, f"dot_q8_{name}_rows")
    single = getattr(kq, f"dot_q8_{name}")
    w = random_rows(name, 7, 512, rng)
    xq, xd, xs = quantize(rng.standard_normal((1, 512)).astype(np.float32), 256)
    want = np.array([single(w[r], xq[0], xd[0], xs[0]) for r in range(7)], np.float32)
    for r0, r1 in ((0, 7), (2, 5), (6, 7), (3, 3)):
        out = np.full(9, np.nan, np.float32)
        rows_k(w, r0, r1, xq[0], xd[0], xs[0], out)
        np.testing.assert_array_equal(out[r0:r1], want[r0:r1])
        assert np.all(np.isnan(out[:r0])) and np.all(np.isnan(out[r1:]))
    out = np.empty(7, np.float32)
    for r0, r1 in ((-1, 3), (0, 8)):  # rows outside the matrix
        with pytest.raises(StrataError):
            rows_k(w, r0, r1, xq[0], xd[0], xs[0], out)
    with pytest.raises(StrataError):  # output too short
        rows_k(w, 0, 7, xq[0], xd[0], xs[0], out[:6])


@pytest.mark.parametrize("name", NAMES)
def test_dot_q8_multi_rows_matches_single(name, rng):
    """The rows x tokens kernel writes exactly the single-row single-token results into out[j + k, r0:r1] and
    nothing else; rows outside the matrix, output rows outside out and token rows outside the activations are
    refused."""
    mr = getattr(kq, f"dot_q8_{name}_multi_rows")
    single = getattr(kq, f"dot_q8_{name}")
    w = random_rows(name, 7, 512, rng)
    xq, xd, xs = quantize(rng.standard_normal((5, 512)).astype(np.float32), 256)
    check_multi_rows(mr, single, w, xq, xd, xs, StrataError, (xq[:, :256], xd[:, :1], xs[:, :16]))


@pytest.mark.parametrize("name", ["q4_k", "q6_k"])
def test_dot_q8_refuses_per32_activations(name, rng):
    """K-quant dots read per-256 activation scales: the per-32 form (legacy types) is refused, not misread."""
    w = random_rows(name, 2, 512, rng)
    xq, xd, xs = quantize(rng.standard_normal((1, 512)).astype(np.float32), 32)
    with pytest.raises(StrataError):
        getattr(kq, f"dot_q8_{name}")(w[0], xq[0], xd[0], xs[0])
    with pytest.raises(StrataError):
        getattr(kq, f"dot_q8_{name}_multi")(w[0], xq, xd, xs, (0,))
    with pytest.raises(StrataError):
        getattr(kq, f"dot_q8_{name}_rows")(w, 0, 2, xq[0], xd[0], xs[0], np.empty(2, np.float32))


@pytest.mark.parametrize("name", NAMES)
def test_dot_q8_multi_matches_single(name, rng):
    """Each result of the multi-token kernel is bit-identical to the single-token kernel on that token, for
    1-4 tokens in any order (repeats included), on rows of one and of eight super-blocks."""
    multi = getattr(kq, f"dot_q8_{name}_multi")
    single = getattr(kq, f"dot_q8_{name}")
    for k in (256, 2048):
        w = random_rows(name, 3, k, rng)
        x = (rng.standard_normal((9, k)) * rng.uniform(0.1, 10, (9, 1))).astype(np.float32)
        xq, xd, xs = quantize(x, 256)
        want = np.array([[single(w[r], xq[t], xd[t], xs[t]) for t in range(9)] for r in range(3)], np.float32)
        for toks in [(4,), (0, 8), (8, 3, 3), (2, 7, 0, 5), (6, 5, 4, 1)]:
            for r in range(3):
                got = np.array(multi(w[r], xq, xd, xs, toks), np.float32)
                np.testing.assert_array_equal(got, want[r, list(toks)])


@pytest.mark.parametrize("name", ["q4_k", "q6_k"])
def test_dot_q8_multi_bad_input_raises(name, rng):
    multi = getattr(kq, f"dot_q8_{name}_multi")
    w = random_rows(name, 1, 512, rng)[0]
    xq, xd, xs = quantize(rng.standard_normal((3, 512)).astype(np.float32), 256)
    for toks in [(0, 3), (-1, 0), (2, 1, 0, 9)]:  # token rows out of range
        with pytest.raises(StrataError):
            multi(w, xq, xd, xs, toks)
    with pytest.raises(StrataError):  # activations of another length
        multi(w, xq[:, :256], xd[:, :1], xs[:, :16], (0, 1))
    with pytest.raises(StrataError):  # non-contiguous activation rows
        multi(w, np.asfortranarray(xq), xd, xs, (0, 1))


@pytest.mark.parametrize("name", ["q4_k", "q6_k"])
def test_bad_lengths_raise(name, rng):
    w = random_rows(name, 1, 512, rng)[0]
    x = rng.standard_normal(512).astype(np.float32)
    xq, xd, xs = quantize(x[None], 256)
    with pytest.raises(StrataError):
        getattr(kq, f"dot_f32_{name}")(w, x[:256])
    with pytest.raises(StrataError):
        getattr(kq, f"dot_f32_{name}")(w[:-1], x)
    with pytest.raises(StrataError):
        getattr(kq, f"dot_q8_{name}")(w, xq[0, :256], xd[0], xs[0])
    with pytest.raises(StrataError):
        getattr(kq, f"dequant_{name}")(w, np.empty(256, np.float32))


@pytest.mark.parametrize("name", NAMES)
def test_drivers(name, rng):
    from strata_nb.cpu_kernels.matmul import dequant_rows, matmul_f32, matmul_q8, moe_matmul

    qtype = TYPES[name][0]
    rows, k = 40, 512  # 40 rows: a partial last task of ROWS_PER_TASK
    w = random_rows(name, rows, k, rng)
    assert w.shape[1] == row_bytes(qtype, k)
    ref = gguf_rows(name, w).astype(np.float64)

    for ntok in (1, 5):
        x = rng.standard_normal((ntok, k)).astype(np.float32)
        exact = x.astype(np.float64) @ ref.T
        scale = np.abs(x.astype(np.float64)) @ np.abs(ref).T
        out = np.full((ntok, rows), np.nan, np.float32)
        matmul_f32(qtype, w, x, out)
        assert np.all(np.abs(out - exact) <= 1e-6 * scale)
        xq, xd, xs = quantize(x, 256)
        same, mag = q8_reference(name, w, x)
        out = np.full((ntok, rows), np.nan, np.float32)
        matmul_q8(qtype, w, x, xq, xd, xs, out)
        assert np.all(np.abs(out - same) <= 1e-6 * mag)

    # three experts of 40 rows in one buffer at byte offsets (not in order), tokens routed unevenly
    experts = [random_rows(name, rows, k, rng) for _ in range(3)]
    rb = w.shape[1]
    buf = np.zeros(7 * rows * rb, np.uint8)
    base = np.array([4 * rows * rb, 0, 2 * rows * rb], np.int64)
    for g in range(3):
        buf[base[g]:base[g] + rows * rb] = experts[g].reshape(-1)
    x = rng.standard_normal((4, k)).astype(np.float32)
    xq, xd, xs = quantize(x, 256)
    grp_start = np.array([0, 2, 3, 6], np.int64)
    tok_idx = np.array([0, 3, 1, 0, 2, 3], np.int64)
    for fast in (False, True):
        out = np.full((6, rows), np.nan, np.float32)
        moe_matmul(fast, qtype, buf.ctypes.data + base, rows, rb, grp_start[:-1], grp_start[1:], tok_idx, x, xq, xd,
                   xs, out)
        for g in range(3):
            for j in range(grp_start[g], grp_start[g + 1]):
                t = tok_idx[j]
                if fast:
                    same, mag = q8_reference(name, experts[g], x[t:t + 1])
                    assert np.all(np.abs(out[j] - same[0]) <= 1e-6 * mag[0])
                else:
                    eref = gguf_rows(name, experts[g]).astype(np.float64)
                    exact = eref @ x[t].astype(np.float64)
                    assert np.all(np.abs(out[j] - exact) <= 1e-6 * (np.abs(eref) @ np.abs(x[t])))

    ids = np.array([3, 0, 39], np.int64)
    out = np.full((3, k), np.nan, np.float32)
    dequant_rows(qtype, w, ids, out)
    np.testing.assert_array_equal(out, ref[ids].astype(np.float32))
