"""Random but valid GGML blocks, generated fast: random bytes with the scale fields overwritten.

Every quant payload (nibbles, high bits, sub-scales) stays random; the fp16 super-scales are set so the
dequantized values have a chosen RMS and (close to) zero mean. Zero mean matters: a constant offset in every row
adds the same rank-one term to all outputs and random models then collapse onto one token.
"""
from __future__ import annotations

import functools

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

# Byte offsets of the fp16 fields in each block (ggml-common.h layouts).
_D_OFFSET = {T.Q4_0: 0, T.Q4_1: 0, T.Q5_0: 0, T.Q5_1: 0, T.Q8_0: 0, T.Q2_K: 80, T.Q3_K: 108, T.Q4_K: 0,
             T.Q5_K: 0, T.Q6_K: 208}
# Types whose value is d * (signed quant): a random sign on d keeps the mean at zero.
_SIGNED = (T.Q4_0, T.Q5_0, T.Q8_0, T.Q3_K, T.Q6_K)
# Types with an offset field: value = d*q + m (Q4_1/Q5_1) or d*sc*q - dmin*m (K-quants), with m chosen to cancel
# the mean of the unsigned quant (q uniform over 0..2^bits-1, so its mean is (2^bits - 1) / 2).
_OFFSET_MEAN = {T.Q4_1: 7.5, T.Q5_1: 15.5, T.Q2_K: 1.5, T.Q4_K: 7.5, T.Q5_K: 15.5}

FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def row_bytes(qtype: T, ncols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return ncols // block * size


def _u16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The uint16 field at `offset` of every block, as a writable strided view."""
    return blocks[:, offset:offset + 2].view(np.uint16)[:, 0]


def _set_scales(blocks: np.ndarray, qtype: T, d: float) -> None:
    """Overwrite the scale fields of random `blocks` ([n, type_size] uint8) in place."""
    d16 = int(np.float16(d).view(np.uint16))
    if qtype in _SIGNED:
        field = _u16(blocks, _D_OFFSET[qtype])
        field &= 0x8000  # keep the random sign bit
        field |= d16
        return
    mean = _OFFSET_MEAN[qtype]
    if qtype in (T.Q4_1, T.Q5_1):
        _u16(blocks, 0)[:] = d16
        _u16(blocks, 2)[:] = np.float16(-mean * d).view(np.uint16)
        return
    # K-quants with dmin: make every sub-block's min index equal its scale index, then dmin = mean * d,
    # so d*sc*q - dmin*sc = d*sc*(q - mean).
    off = _D_OFFSET[qtype]
    _u16(blocks, off)[:] = d16
    _u16(blocks, off + 2)[:] = np.float16(mean * d).view(np.uint16)
    if qtype == T.Q2_K:  # 16 bytes: low nibble scale, high nibble min
        sc = blocks[:, 0:16] & 0x0F
        blocks[:, 0:16] = sc | (sc << 4)
    else:  # Q4_K/Q5_K: 12 bytes of 6-bit (scale, min) pairs, packed as in get_scale_min_k4
        blocks[:, 8:12] = blocks[:, 4:8]
        lo = blocks[:, 12:16] & 0x0F
        blocks[:, 12:16] = lo | (lo << 4)


@functools.lru_cache(maxsize=None)
def _rms_per_unit_d(qtype: T) -> float:
    """RMS of dequantized values when the super-scale is 1 (measured once with gguf's reference dequantizer)."""
    rng = np.random.Generator(np.random.PCG64(12345))
    blocks = _random_bytes(rng, 4096 * GGML_QUANT_SIZES[qtype][1]).reshape(4096, -1)
    _set_scales(blocks, qtype, 1.0)
    vals = dequantize(blocks.reshape(-1), qtype)
    return float(np.sqrt(np.mean(vals.astype(np.float64) ** 2)))


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    words = rng.bit_generator.random_raw((n + 7) // 8)
    return words.view(np.uint8)[:n]


def random_rows(rng: np.random.Generator, qtype: T, nrows: int, ncols: int, std: float,
                mean: float = 0.0) -> np.ndarray:
    """`nrows` rows of `ncols` values in `qtype` layout (uint8 [nrows, row_bytes]) with RMS about `std`.

    Float types are uniform around `mean` (uniform from random int16s: ~10x faster than Gaussian draws);
    quantized types are zero-mean (`mean` must be 0)."""
    if qtype in FLOAT_TYPES:
        vals = _random_bytes(rng, nrows * ncols * 2).view(np.int16).astype(np.float32).reshape(nrows, ncols)
        vals *= np.float32(std * np.sqrt(3.0) / 32768.0)
        vals += np.float32(mean)
        if qtype == T.F32:
            out = vals
        elif qtype == T.F16:
            out = vals.astype(np.float16)
        else:  # BF16: round to nearest even on the upper half of the float32 bits
            bits = vals.view(np.uint32)
            out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return out.view(np.uint8).reshape(nrows, -1)
    if mean != 0.0:
        raise ValueError("quantized synthetic tensors are zero-mean")
    nbytes = row_bytes(qtype, ncols)
    blocks = _random_bytes(rng, nrows * nbytes).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    _set_scales(blocks, qtype, std / _rms_per_unit_d(qtype))
    return blocks.reshape(nrows, nbytes)
