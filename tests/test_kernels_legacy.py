"""Legacy-quant (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and float (F32, F16, BF16) row kernels against gguf-py.

Quant rows are random bytes with finite fp16 scales (and mins) of either sign in 1e-3..1e-1, so every quant bit
pattern is exercised; float rows are random normal values. Outputs are poisoned with NaN first. Lengths cover
the 4-block unroll and its remainder (and, for float rows, lengths that are not a multiple of 32).
Tolerances (measured worst case over these tests in brackets):
  dequant   bit-exact against gguf.quants.dequantize (the same float32 operations)
  dot_f32   |err| <= 1e-6 * sum|w_i x_i| against the float64 dot of the gguf row  [5e-8]
  dot_q8    |err| <= 1e-6 * sum|terms| against float64 on the same int8 activations (xd * xq), the Q4_1/Q5_1
            min term on xs (the sums of xd * xq per 16), as the kernel computes them  [8e-8]
            |err| <= 2e-2 * sum|w_i x_i| against the float64 dot on float x: the int8 rounding of x  [4.1e-3]
  dot_q8_multi  bit-identical to dot_q8 on each of its tokens (same float operations in the same order)
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from row_checks import check_multi_rows  # tests/row_checks.py
from strata_nb.cpu_kernels import dot_float as fl
from strata_nb.cpu_kernels import dot_legacy as lg
from strata_nb.cpu_kernels.actq import quantize

GT = gguf.GGMLQuantizationType
# name -> (gguf type, block bytes, fp16 scale offset, fp16 min offset or None)
LEGACY = {
    "q4_0": (GT.Q4_0, 18, 0, None),
    "q4_1": (GT.Q4_1, 20, 0, 2),
    "q5_0": (GT.Q5_0, 22, 0, None),
    "q5_1": (GT.Q5_1, 24, 0, 2),
    "q8_0": (GT.Q8_0, 34, 0, None),
}
FLOAT = {"f32": GT.F32, "f16": GT.F16, "bf16": GT.BF16}
NBLOCKS = (1, 3, 4, 7, 64)  # 64 blocks: K=2048, the expert width of Qwen3-30B
FLOAT_LENGTHS = (1, 31, 37, 128, 2048, 2053)


def legacy_row(name: str, nblk: int, rng: np.random.Generator) -> np.ndarray:
    _, bb, d_off, m_off = LEGACY[name]
    blocks = rng.integers(0, 256, (nblk, bb), dtype=np.uint8)
    for off in (d_off, m_off):
        if off is not None:
            v = rng.uniform(1e-3, 1e-1, nblk) * rng.choice([-1.0, 1.0], nblk)
            blocks[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(nblk, 2)
    return blocks.reshape(-1)


def float_row(name: str, k: int, rng: np.random.Generator) -> np.ndarray:
    v = rng.standard_normal(k).astype(np.float32)
    if name == "f16":
        return v.astype(np.float16).view(np.uint8)
    if name == "bf16":
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return v.view(np.uint8)


def activations(k: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(k).astype(np.float32)
    x[:32] = 0.0  # an all-zero block: scale 0 in the int8 layout
    x[-32:] *= 100.0  # and a block of another magnitude
    return x


@pytest.mark.parametrize("name", list(LEGACY))
@pytest.mark.parametrize("nblk", NBLOCKS)
def test_legacy_dequant_is_bit_exact(name, nblk):
    rng = np.random.default_rng(nblk)
    w = legacy_row(name, nblk, rng)
    out = np.full(nblk * 32, np.nan, np.float32)
    getattr(lg, f"dequant_{name}")(w, out)
    np.testing.assert_array_equal(out, dequantize(w, LEGACY[name][0]).reshape(-1))


@pytest.mark.parametrize("name", list(FLOAT))
@pytest.mark.parametrize("k", FLOAT_LENGTHS)
def test_float_dequant_is_bit_exact(name, k):
    rng = np.random.default_rng(k)
    w = float_row(name, k, rng)
    out = np.full(k, np.nan, np.float32)
    getattr(fl, f"dequant_{name}")(w, out)
    np.testing.assert_array_equal(out, dequantize(w, FLOAT[name]).reshape(-1))


def _assert_dot(got: float, want: float, scale: float, rtol: float) -> None:
    assert np.isfinite(got)
    assert abs(got - want) <= rtol * scale, (got, want, abs(got - want) / scale)


@pytest.mark.parametrize("name", list(LEGACY))
@pytest.mark.parametrize("nblk", NBLOCKS)
def test_legacy_dot_f32(name, nblk):
    rng = np.random.default_rng(100 + nblk)
    w = legacy_row(name, nblk, rng)
    x = activations(nblk * 32, rng)
    ref = dequantize(w, LEGACY[name][0]).reshape(-1).astype(np.float64)
    got = getattr(lg, f"dot_f32_{name}")(w, x)
    _assert_dot(got, ref @ x, np.abs(ref * x).sum(), 1e-6)


@pytest.mark.parametrize("name", list(FLOAT))
@pytest.mark.parametrize("k", FLOAT_LENGTHS)
def test_float_dot_f32(name, k):
    rng = np.random.default_rng(200 + k)
    w = float_row(name, k, rng)
    x = rng.standard_normal(k).astype(np.float32)
    ref = dequantize(w, FLOAT[name]).reshape(-1).astype(np.float64)
    got = getattr(fl, f"dot_f32_{name}")(w, x)
    _assert_dot(got, ref @ x, np.abs(ref * x).sum(), 1e-6)


def q8_reference(name: str, w: np.ndarray, xq, xd, xs) -> tuple[float, float]:
    """float64 dot of a row with the int8 activations, split as the kernel computes it: d * q on xd * xq, the
    min on xs (the sums of xd * xq per 16, actq). Returns (dot, sum|terms|)."""
    gt, bb, _, m_off = LEGACY[name]
    nblk = w.size // bb
    blocks = w.reshape(nblk, bb).copy()
    xdeq = (xq.astype(np.float64).reshape(nblk, 32) * xd.astype(np.float64)[:, None]).reshape(-1)
    if m_off is None:
        scaled = dequantize(blocks.reshape(-1), gt).reshape(-1).astype(np.float64)
        return scaled @ xdeq, np.abs(scaled * xdeq).sum()
    m = blocks[:, m_off:m_off + 2].copy().view(np.float16).astype(np.float64).reshape(-1)
    blocks[:, m_off:m_off + 2] = 0  # gguf then gives d * q alone
    scaled = dequantize(blocks.reshape(-1), gt).reshape(-1).astype(np.float64)
    sx = xs.astype(np.float64).reshape(nblk, 2).sum(axis=1)
    terms = np.concatenate([scaled * xdeq, m * sx])
    return terms.sum(), np.abs(terms).sum()


@pytest.mark.parametrize("name", list(LEGACY))
@pytest.mark.parametrize("nblk", NBLOCKS)
def test_legacy_dot_q8(name, nblk):
    rng = np.random.default_rng(300 + nblk)
    w = legacy_row(name, nblk, rng)
    x = activations(nblk * 32, rng)
    xq, xd, xs = (a[0] for a in quantize(x[None]))
    got = getattr(lg, f"dot_q8_{name}")(w, xq, xd, xs)
    want, scale = q8_reference(name, w, xq, xd, xs)
    _assert_dot(got, want, scale, 1e-6)
    # against the float activations: the int8 rounding of x, bounded loosely (measured worst case 4.1e-3)
    ref = dequantize(w, LEGACY[name][0]).reshape(-1).astype(np.float64)
    _assert_dot(got, ref @ x, np.abs(ref * x).sum(), 2e-2)


@pytest.mark.parametrize("name", list(LEGACY))
def test_legacy_dot_q8_multi_matches_single(name):
    """Each result of the multi-token kernel is bit-identical to the single-token kernel on that token, for
    1-4 tokens in any order (repeats included), over the unroll/pair remainders of the block loop."""
    rng = np.random.default_rng(400)
    multi, single = getattr(lg, f"dot_q8_{name}_multi"), getattr(lg, f"dot_q8_{name}")
    for nblk in NBLOCKS:
        w = legacy_row(name, nblk, rng)
        x = np.stack([activations(nblk * 32, rng) * rng.uniform(0.1, 10) for _ in range(9)])
        xq, xd, xs = quantize(x)
        want = np.array([single(w, xq[t], xd[t], xs[t]) for t in range(9)], np.float32)
        for toks in [(4,), (0, 8), (8, 3, 3), (2, 7, 0, 5), (6, 5, 4, 1)]:
            np.testing.assert_array_equal(np.array(multi(w, xq, xd, xs, toks), np.float32), want[list(toks)])


@pytest.mark.parametrize("name", list(LEGACY))
def test_legacy_dot_q8_rows_matches_single(name):
    """The rows kernel writes exactly the single-row results into out[r0:r1] and nothing else; bad row ranges,
    short outputs and activations of another length are refused."""
    rng = np.random.default_rng(500)
    rows_k, single = getattr(lg, f"dot_q8_{name}_rows"), getattr(lg, f"dot_q8_{name}")
    nblk = 9
    w = np.stack([legacy_row(name, nblk, rng) for _ in range(7)])
    xq, xd, xs = (a[0] for a in quantize(activations(nblk * 32, rng)[None]))
    want = np.array([single(w[r], xq, xd, xs) for r in range(7)], np.float32)
    for r0, r1 in ((0, 7), (2, 5), (6, 7), (3, 3)):
        out = np.full(9, np.nan, np.float32)
        rows_k(w, r0, r1, xq, xd, xs, out)
        np.testing.assert_array_equal(out[r0:r1], want[r0:r1])
        assert np.all(np.isnan(out[:r0])) and np.all(np.isnan(out[r1:]))
    out = np.empty(7, np.float32)
    for r0, r1 in ((-1, 3), (0, 8)):
        with pytest.raises(ValueError):
            rows_k(w, r0, r1, xq, xd, xs, out)
    with pytest.raises(ValueError):
        rows_k(w, 0, 7, xq, xd, xs, out[:6])
    with pytest.raises(ValueError):
        rows_k(w, 0, 7, xq[:256], xd[:8], xs[:16], out)


@pytest.mark.parametrize("name", list(LEGACY))
def test_legacy_dot_q8_multi_rows_matches_single(name):
    """The rows x tokens kernel writes exactly the single-row single-token results into out[j + k, r0:r1] and
    nothing else; rows outside the matrix, output rows outside out and token rows outside the activations are
    refused."""
    rng = np.random.default_rng(600)
    mr, single = getattr(lg, f"dot_q8_{name}_multi_rows"), getattr(lg, f"dot_q8_{name}")
    nblk = 9
    w = np.stack([legacy_row(name, nblk, rng) for _ in range(7)])
    xq, xd, xs = quantize(np.stack([activations(nblk * 32, rng) for _ in range(5)]))
    check_multi_rows(mr, single, w, xq, xd, xs, ValueError, (xq[:, :256], xd[:, :8], xs[:, :16]))


@pytest.mark.parametrize("name", list(LEGACY))
def test_legacy_dot_q8_multi_refuses_bad_input(name):
    rng = np.random.default_rng(3)
    w = legacy_row(name, 4, rng)
    xq, xd, xs = quantize(rng.standard_normal((3, 4 * 32)).astype(np.float32))
    for toks in [(0, 3), (-1, 0), (2, 1, 0, 9)]:  # token rows out of range
        with pytest.raises(ValueError):
            getattr(lg, f"dot_q8_{name}_multi")(w, xq, xd, xs, toks)
    with pytest.raises(ValueError):  # activations of another length
        getattr(lg, f"dot_q8_{name}_multi")(w, xq[:, :96], xd[:, :3], xs[:, :6], (0, 1))
    with pytest.raises(ValueError):  # non-contiguous activation rows
        getattr(lg, f"dot_q8_{name}_multi")(w, np.asfortranarray(xq), xd, xs, (0, 1))


@pytest.mark.parametrize("name", list(LEGACY))
def test_legacy_kernels_refuse_mismatched_lengths(name):
    rng = np.random.default_rng(1)
    w = legacy_row(name, 4, rng)
    x = np.zeros(4 * 32 + 32, np.float32)
    xq, xd, xs = (a[0] for a in quantize(x[None]))
    with pytest.raises(ValueError):
        getattr(lg, f"dot_f32_{name}")(w, x)
    with pytest.raises(ValueError):
        getattr(lg, f"dot_q8_{name}")(w, xq, xd, xs)
    with pytest.raises(ValueError):
        getattr(lg, f"dequant_{name}")(w, x)
    with pytest.raises(ValueError):  # a row that is not a whole number of blocks
        getattr(lg, f"dot_f32_{name}")(w[:-1], x[:128])


@pytest.mark.parametrize("name", list(FLOAT))
def test_float_kernels_refuse_mismatched_lengths(name):
    w = float_row(name, 40, np.random.default_rng(2))
    with pytest.raises(ValueError):
        getattr(fl, f"dot_f32_{name}")(w, np.zeros(41, np.float32))
    with pytest.raises(ValueError):
        getattr(fl, f"dequant_{name}")(w, np.zeros(39, np.float32))
    with pytest.raises(ValueError):
        getattr(fl, f"dot_f32_{name}")(w[:-1], np.zeros(40, np.float32))
