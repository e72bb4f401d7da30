"""GGUF weight rows on the GPU: one device primitive per quant type that decodes a 16-element *unit* of a row.

A row is cut into units of 16 weights, each four *runs* of 4 consecutive elements. A unit is what one thread
reads with a few 4-byte loads, and the units are numbered so that consecutive threads read consecutive words
(coalesced). For a run i of unit u the primitive gives
  q[4i+e]  the 4 quant values as exact float32 integers (offsets such as Q4_0's -8 already applied),
  s[i]     the run's float32 scale and mn[i] its min, so that weight = s*q - mn (mn = 0 for types without one),
and pos(u, i) is the element index of the run's first weight in the row. Float weights give s = 1, mn = 0 and
q = the weights. Layouts are ggml-common.h's block_* (the same ones cpu_kernels/dot_legacy.py and
dot_kquant.py decode):
  F32/F16/BF16  unit = elements 16u..16u+15
  Q4_0/Q4_1/Q5_0/Q5_1 (32 per block)  unit j of a block: quant bytes 8j..8j+7; low nibbles are elements
                8j..8j+7, high nibbles 16+8j..16+8j+7; Q5 fifth bit of element l = bit l of qh
  Q8_0          unit j: int8 quants 16j..16j+15
  Q4_K/Q5_K (256)  unit 4g+k: qs bytes 32g+4k..+3 and 32g+16+4k..+3 -> elements 64g+4k.., 64g+16+4k.. (low
                nibbles, chunk 2g) and 64g+32+4k.., 64g+48+4k.. (high nibbles, chunk 2g+1); Q5_K fifth bit of
                chunk c element l = bit c of qh[l]
  Q2_K/Q3_K/Q6_K (256)  unit 8h+k: elements 128h+32j+4k..+3 for j = 0..3 (one run each), 4 quant bytes
                each, scale group 8h+2j+k//4

Loads: the weights arrive as three flat views of the same GGUF bytes, w8 (uint8), wv (uint32 words, word = 4,
or uint16, word = 2) and wh (float16); a row is addressed by its byte offset. The uint32 view needs every block
start 4-aligned (block bytes % 4 == 0 and 4-aligned rows: F32/F16/BF16, Q4_1, Q5_1, Q2_K, Q4_K, Q5_K); the other
types (Q4_0 18, Q5_0 22, Q8_0 34, Q3_K 110, Q6_K 210 bytes per block) read uint16 pairs. fp16 scales are float16
loads (one hardware conversion), scale bytes uint8 loads.
Integer -> float conversions use the 2^23 trick (bits 0x4B000000 | v are the float 2^23 + v, exact for
v < 2^23): one int op and one float add per weight instead of the quarter-rate I2F conversion.
"""
from __future__ import annotations

import inspect
from typing import Callable, NamedTuple

import numpy as np
from numba import cuda, float32, int32, uint32, uint64
from numba.core import config

from strata_nb.cpu_kernels.qtypes import (
    BF16, F16, F32, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
)

UNIT = 16  # weights per unit
_EXP = 0x4B000000  # float32 bits of 2^23
_TWO23 = np.float32(2.0 ** 23)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_U = uint64

# Device functions are forced inline where numba-cuda offers it: the unit primitives fill small local arrays that
# must stay in registers, and the word-size branches below fold only once `word` is a constant at the call site.
_DEV = {"device": True}
if "forceinline" in inspect.signature(cuda.jit).parameters:
    _DEV["forceinline"] = True

if config.ENABLE_CUDASIM:
    @cuda.jit(device=True)
    def _bits_f32(b):
        return np.uint32(b).view(np.float32)
else:
    from numba.cuda import libdevice

    @cuda.jit(**_DEV)
    def _bits_f32(b):
        return libdevice.int_as_float(int32(b))


@cuda.jit(**_DEV)
def _u2f(v, off):
    """float32(v) - off for an integer 0 <= v < 2^23 (off a float32 constant: the type's quant offset)."""
    return _bits_f32(_EXP | v) - (_TWO23 + off)


# Loads at byte base + c of the weight bytes, through three flat views of them: w8 (uint8), wv (words: uint32
# where word == 4, else uint16) and wh (float16). base is the start of a block: 4-aligned where word == 4, else
# 2-aligned; the offset c inside it is a constant or cheap per-unit value, so the index arithmetic folds into the
# load's immediate offset. Indices are cast to unsigned: numba then skips its negative-index wraparound (a
# compare and a select per access). word is a constant of the calling kernel, so its branches fold away.

@cuda.jit(**_DEV)
def _ld32(wv, word, base, c):
    """The little-endian uint32 at byte base + c (c 4-aligned if word == 4, else 2-aligned)."""
    if word == 4:
        return uint32(wv[_U((base >> 2) + (c >> 2))])
    i = (base >> 1) + (c >> 1)
    return uint32(uint32(wv[_U(i)]) | (uint32(wv[_U(i + 1)]) << 16))


@cuda.jit(**_DEV)
def _ld16(wv, word, base, c):
    """The little-endian uint16 at byte base + c (c 2-aligned)."""
    if word == 4:
        return uint32(wv[_U((base >> 2) + (c >> 2))] >> ((c & 2) << 3)) & 0xFFFF
    return uint32(wv[_U((base >> 1) + (c >> 1))])


@cuda.jit(**_DEV)
def _ld8(w8, base, c):
    return uint32(w8[_U(base + c)])


@cuda.jit(**_DEV)
def _h(wh, base, c):
    """The fp16 scale at byte base + c (2-aligned) as float32 (one hardware conversion)."""
    return float32(wh[_U((base >> 1) + (c >> 1))])


# ---- float weights: block = unit = 16 elements

@cuda.jit(**_DEV)
def _pos_float(u, i):
    return 16 * u + 4 * i


@cuda.jit(**_DEV)
def _unit_f32(w8, wv, wh, word, off, u, q, s, mn):
    base = off + 64 * u
    for i in range(4):
        for e in range(4):
            q[4 * i + e] = _bits_f32(_ld32(wv, word, base, 16 * i + 4 * e))
        s[i] = _ONE
        mn[i] = _ZERO


@cuda.jit(**_DEV)
def _unit_f16(w8, wv, wh, word, off, u, q, s, mn):
    base = off + 32 * u
    for i in range(4):
        for e in range(4):
            q[4 * i + e] = _h(wh, base, 8 * i + 2 * e)
        s[i] = _ONE
        mn[i] = _ZERO


@cuda.jit(**_DEV)
def _unit_bf16(w8, wv, wh, word, off, u, q, s, mn):
    base = off + 32 * u
    for i in range(4):
        for h in range(2):
            v = _ld32(wv, word, base, 8 * i + 4 * h)
            q[4 * i + 2 * h] = _bits_f32((v & 0xFFFF) << 16)
            q[4 * i + 2 * h + 1] = _bits_f32(v & 0xFFFF0000)
        s[i] = _ONE
        mn[i] = _ZERO


# ---- legacy quants: 32 per block, 2 units per block

@cuda.jit(**_DEV)
def _pos_nib32(u, i):
    return 32 * (u >> 1) + 8 * (u & 1) + 4 * (i & 1) + 16 * (i >> 1)


@cuda.jit(**_DEV)
def _nibbles(w0, w1, qh, off, q):
    """A unit's runs from its two quant words: runs 0 and 1 are the low nibbles of w0 and w1, runs 2 and 3 their
    high nibbles. Fifth bit of run i element e: bit 4*(i&1) + 16*(i>>1) + e of qh (the legacy Q5 layout's qh
    shifted right by 8j for unit j), or qh = 0."""
    for i in range(4):
        w = w0 if (i & 1) == 0 else w1
        sh = 4 * (i >> 1)
        for e in range(4):
            p = 4 * (i & 1) + 16 * (i >> 1) + e
            q[4 * i + e] = _u2f(((w >> (8 * e + sh)) & 15) | (((qh >> p) & 1) << 4), off)


@cuda.jit(**_DEV)
def _unit_q4_0(w8, wv, wh, word, off, u, q, s, mn):
    j = u & 1
    base = off + 18 * (u >> 1)
    d = _h(wh, base, 0)
    _nibbles(_ld32(wv, word, base, 2 + 8 * j), _ld32(wv, word, base, 6 + 8 * j), 0, np.float32(8.0), q)
    for i in range(4):
        s[i] = d
        mn[i] = _ZERO


@cuda.jit(**_DEV)
def _unit_q4_1(w8, wv, wh, word, off, u, q, s, mn):
    j = u & 1
    base = off + 20 * (u >> 1)
    d = _h(wh, base, 0)
    m = -_h(wh, base, 2)  # weight = d*q + m
    _nibbles(_ld32(wv, word, base, 4 + 8 * j), _ld32(wv, word, base, 8 + 8 * j), 0, _ZERO, q)
    for i in range(4):
        s[i] = d
        mn[i] = m


@cuda.jit(**_DEV)
def _unit_q5_0(w8, wv, wh, word, off, u, q, s, mn):
    j = u & 1
    base = off + 22 * (u >> 1)
    d = _h(wh, base, 0)
    qh = _ld32(wv, word, base, 2) >> (8 * j)
    _nibbles(_ld32(wv, word, base, 6 + 8 * j), _ld32(wv, word, base, 10 + 8 * j), qh, np.float32(16.0), q)
    for i in range(4):
        s[i] = d
        mn[i] = _ZERO


@cuda.jit(**_DEV)
def _unit_q5_1(w8, wv, wh, word, off, u, q, s, mn):
    j = u & 1
    base = off + 24 * (u >> 1)
    d = _h(wh, base, 0)
    m = -_h(wh, base, 2)
    qh = _ld32(wv, word, base, 4) >> (8 * j)
    _nibbles(_ld32(wv, word, base, 8 + 8 * j), _ld32(wv, word, base, 12 + 8 * j), qh, _ZERO, q)
    for i in range(4):
        s[i] = d
        mn[i] = m


@cuda.jit(**_DEV)
def _pos_q8_0(u, i):
    return 16 * u + 4 * i


@cuda.jit(**_DEV)
def _unit_q8_0(w8, wv, wh, word, off, u, q, s, mn):
    j = u & 1
    base = off + 34 * (u >> 1)
    d = _h(wh, base, 0)
    for i in range(4):
        w = _ld32(wv, word, base, 2 + 16 * j + 4 * i) ^ 0x80808080  # int8 -> int8 + 128
        for e in range(4):
            q[4 * i + e] = _u2f((w >> (8 * e)) & 0xFF, np.float32(128.0))
        s[i] = d
        mn[i] = _ZERO


# ---- K-quants: 256 per block, 16 units per block

@cuda.jit(**_DEV)
def _pos_k4(u, i):
    return 256 * (u >> 4) + 64 * ((u >> 2) & 3) + 4 * (u & 3) + 16 * (i & 1) + 32 * (i >> 1)


@cuda.jit(**_DEV)
def _scales_k4(wv, wh, word, base, g, s, mn):
    """Q4_K/Q5_K: runs 0,1 take chunk 2g's scale and min, runs 2,3 chunk 2g+1's. Bytes 4..15 pack eight 6-bit
    (scale, min) pairs: chunk c < 4 has the low 6 bits of bytes 4+c and 8+c; chunk c >= 4 the nibbles of byte
    8+c and the top 2 bits of bytes c and 4+c (bytes counted from 4)."""
    d = _h(wh, base, 0)
    dmin = _h(wh, base, 2)
    j0 = (2 * g) & 3  # chunks 2g, 2g+1 use bytes j0, j0+1 of each 4-byte group
    t4 = _ld16(wv, word, base, 4 + j0)
    t8 = _ld16(wv, word, base, 8 + j0)
    t12 = _ld16(wv, word, base, 12 + j0)
    # g varies across a warp's lanes: a branch on it would split the unit into basic blocks, and the compiler does
    # not hoist the next unit's loads across those (one memory round per unit instead of per several); a mask
    # selects without branching
    lo = uint32(0) - uint32(g < 2)
    for h in range(2):
        a = (t4 >> (8 * h)) & 0xFF
        b = (t8 >> (8 * h)) & 0xFF
        c = (t12 >> (8 * h)) & 0xFF
        sc = ((a & 63) & lo) | (((c & 15) | ((a >> 6) << 4)) & ~lo)
        mv = ((b & 63) & lo) | (((c >> 4) | ((b >> 6) << 4)) & ~lo)
        s[2 * h] = d * _u2f(sc, _ZERO)
        s[2 * h + 1] = s[2 * h]
        mn[2 * h] = dmin * _u2f(mv, _ZERO)
        mn[2 * h + 1] = mn[2 * h]


@cuda.jit(**_DEV)
def _unit_q4_k(w8, wv, wh, word, off, u, q, s, mn):
    g = (u >> 2) & 3
    base = off + 144 * (u >> 4)
    _scales_k4(wv, wh, word, base, g, s, mn)
    c = 16 + 32 * g + 4 * (u & 3)
    _nibbles(_ld32(wv, word, base, c), _ld32(wv, word, base, c + 16), 0, _ZERO, q)


@cuda.jit(**_DEV)
def _unit_q5_k(w8, wv, wh, word, off, u, q, s, mn):
    g = (u >> 2) & 3
    k = u & 3
    base = off + 176 * (u >> 4)
    _scales_k4(wv, wh, word, base, g, s, mn)
    c = 48 + 32 * g + 4 * k
    w0 = _ld32(wv, word, base, c)
    w1 = _ld32(wv, word, base, c + 16)
    h0 = _ld32(wv, word, base, 16 + 4 * k) >> (2 * g)  # qh bytes of the unit's elements; bit 0 chunk 2g
    h1 = _ld32(wv, word, base, 32 + 4 * k) >> (2 * g)
    for i in range(4):
        w = w0 if (i & 1) == 0 else w1
        hw = h0 if (i & 1) == 0 else h1
        sh = 4 * (i >> 1)
        for e in range(4):
            v = ((w >> (8 * e + sh)) & 15) | (((hw >> (8 * e + (i >> 1))) & 1) << 4)
            q[4 * i + e] = _u2f(v, _ZERO)


@cuda.jit(**_DEV)
def _pos_k2(u, i):
    return 256 * (u >> 4) + 128 * ((u >> 3) & 1) + 4 * (u & 7) + 32 * i


@cuda.jit(**_DEV)
def _unit_q2_k(w8, wv, wh, word, off, u, q, s, mn):
    h = (u >> 3) & 1
    k = u & 7
    base = off + 84 * (u >> 4)
    d = _h(wh, base, 80)
    dmin = _h(wh, base, 82)
    w = _ld32(wv, word, base, 16 + 32 * h + 4 * k)
    for i in range(4):
        sc = _ld8(w8, base, 8 * h + 2 * i + (k >> 2))  # scale (low nibble) and min (high) of the group
        s[i] = d * _u2f(sc & 15, _ZERO)
        mn[i] = dmin * _u2f(sc >> 4, _ZERO)
        for e in range(4):
            q[4 * i + e] = _u2f((w >> (8 * e + 2 * i)) & 3, _ZERO)


@cuda.jit(**_DEV)
def _unit_q3_k(w8, wv, wh, word, off, u, q, s, mn):
    h = (u >> 3) & 1
    k = u & 7
    base = off + 110 * (u >> 4)
    d = _h(wh, base, 108)
    hm = _ld32(wv, word, base, 4 * k) >> (4 * h)  # bit i: the high bit of run i
    w = _ld32(wv, word, base, 32 + 32 * h + 4 * k)
    for i in range(4):
        g = 8 * h + 2 * i + (k >> 2)  # scale group: low 4 bits in bytes 96..103, high 2 in 104..107
        lo = (_ld8(w8, base, 96 + (g & 7)) >> (4 * (g >> 3))) & 15
        hi = (_ld8(w8, base, 104 + (g & 3)) >> (2 * (g >> 2))) & 3
        s[i] = d * _u2f(lo | (hi << 4), np.float32(32.0))
        mn[i] = _ZERO
        for e in range(4):
            v = ((w >> (8 * e + 2 * i)) & 3) | (((hm >> (8 * e + i)) & 1) << 2)
            q[4 * i + e] = _u2f(v, np.float32(4.0))


@cuda.jit(**_DEV)
def _unit_q6_k(w8, wv, wh, word, off, u, q, s, mn):
    h = (u >> 3) & 1
    k = u & 7
    base = off + 210 * (u >> 4)
    d = _h(wh, base, 208)
    la = _ld32(wv, word, base, 64 * h + 4 * k)  # low nibbles: runs 0 (la) and 1 (lb); high nibbles: 2 and 3
    lb = _ld32(wv, word, base, 64 * h + 32 + 4 * k)
    qh = _ld32(wv, word, base, 128 + 32 * h + 4 * k)
    for i in range(4):
        sc = _ld8(w8, base, 192 + 8 * h + 2 * i + (k >> 2))  # int8 scale of the group
        s[i] = d * _u2f(sc ^ 0x80, np.float32(128.0))
        mn[i] = _ZERO
        w = la if (i & 1) == 0 else lb
        sh = 4 * (i >> 1)
        for e in range(4):
            v = ((w >> (8 * e + sh)) & 15) | (((qh >> (8 * e + 2 * i)) & 3) << 4)
            q[4 * i + e] = _u2f(v, np.float32(32.0))


class Layout(NamedTuple):
    """unit(w8, wv, wh, word, off, u, q, s, mn) and pos(u, i) as described in the module docstring; block_elems
    weights in block_bytes bytes; word4: blocks can be read as uint32 (block_bytes % 4 == 0); has_min: mn can be
    nonzero."""
    unit: Callable
    pos: Callable
    block_elems: int
    block_bytes: int
    word4: bool
    has_min: bool


LAYOUTS: dict[int, Layout] = {
    F32: Layout(_unit_f32, _pos_float, 16, 64, True, False),
    F16: Layout(_unit_f16, _pos_float, 16, 32, True, False),
    BF16: Layout(_unit_bf16, _pos_float, 16, 32, True, False),
    Q4_0: Layout(_unit_q4_0, _pos_nib32, 32, 18, False, False),
    Q4_1: Layout(_unit_q4_1, _pos_nib32, 32, 20, True, True),
    Q5_0: Layout(_unit_q5_0, _pos_nib32, 32, 22, False, False),
    Q5_1: Layout(_unit_q5_1, _pos_nib32, 32, 24, True, True),
    Q8_0: Layout(_unit_q8_0, _pos_q8_0, 32, 34, False, False),
    Q2_K: Layout(_unit_q2_k, _pos_k2, 256, 84, True, True),
    Q3_K: Layout(_unit_q3_k, _pos_k2, 256, 110, False, False),
    Q4_K: Layout(_unit_q4_k, _pos_k4, 256, 144, True, True),
    Q5_K: Layout(_unit_q5_k, _pos_k4, 256, 176, True, True),
    Q6_K: Layout(_unit_q6_k, _pos_k2, 256, 210, False, False),
}
