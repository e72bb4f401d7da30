"""Quantized matrix kernels: matmul (decode matrix-vector and prompt tiled), embedding lookup, and the grouped
MoE matmul over VRAM expert slots. Weights are the GGUF bytes as uint8 device arrays, decoded in registers by
cuda_kernels.quant one 16-weight unit at a time; accumulation in float32.

Work split (see quant.py for units): a warp owns a group of R rows and its 32 lanes stride over the units of
those rows (lane l takes units l, l+32, ...), so adjacent lanes read adjacent weight words. Warps take row groups
grid-stride; no block-level synchronization.
- Matrix-vector (decode, and each entry of moe_slots): a lane loads its unit's 16 activations once and uses
  them for the warp's R rows, as s * (q . x) - mn * sum(x) per run of 4.
- Prompt (ntok > 1): a warp takes tiles of R rows x TT tokens: a lane decodes each of its units once per tile
  into R x 16 weights in registers and applies them to the TT tokens.
- Lane partial sums are reduced with warp shuffles. The simulator has no shuffles (and a simulated thread is a
  Python thread): there a "warp" is one lane (LANES == 1) that walks all units of its rows.
Launch helpers never allocate, copy or synchronize, take every shape as a Python int fixed at capture, and use
grid-stride loops; under the simulator they launch 1-2 small blocks.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint64
from numba.core import config

from strata_nb.cpu_kernels.qtypes import name as qname
from strata_nb.cuda_kernels.quant import _DEV, LAYOUTS, UNIT, _bits_f32
from strata_nb.errors import StrataError

SIM = bool(config.ENABLE_CUDASIM)
# Real GPU. Matrix-vector: 4 warps a block, 2 rows a warp. Prompt: 4 warps a block, each 4 rows x 8 tokens (a
# unit is decoded once per 8 tokens; its 16 activations are loaded once for 4 rows).
# Simulator: one-warp blocks (see _warp_reduce), small tiles, 1-2 blocks.
MV_WARPS, MV_ROWS = (1, 2) if SIM else (4, 2)
TILE_WARPS, TILE_ROWS, TILE_TOKS = (1, 2, 2) if SIM else (4, 4, 8)
EMBED_THREADS = 32 if SIM else 256
MAX_GRID_X = 2 if SIM else 1 << 20
MAX_GRID_Y = 2 if SIM else 65535
_SH = (1, 1)  # _warp_reduce's scratch (unused)
# Lanes per warp: 32 on a GPU; 1 in the simulator, where every simulated thread is a Python thread and a barrier
# costs milliseconds, so one thread walks all units of its rows and nothing needs reducing.
LANES = 1 if SIM else 32
LANE_MASK, WARP_SHIFT = LANES - 1, (LANES - 1).bit_length()

_ZERO = np.float32(0.0)
_KERNELS: dict[tuple, object] = {}


_U = uint64  # array indices are cast to unsigned: numba skips its negative-index wraparound for those
_LO32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


@cuda.jit(**_DEV)
def _load_run(x2, row, p, xv, k):
    """xv[k:k+4] = the 4 activations at columns p..p+3 (p a multiple of 4) of a row, from x2, the float32 rows
    viewed as uint64 pairs. Two 8-byte loads instead of four: the loads of a warp's runs span many cache lines,
    and the L1 throughput of those (not DRAM) bounds the matrix-vector kernel."""
    for h in range(2):
        v = x2[_U(row), _U((p >> 1) + h)]
        xv[k + 2 * h] = _bits_f32(v & _LO32)
        xv[k + 2 * h + 1] = _bits_f32(v >> _S32)

if SIM:
    @cuda.jit(device=True)
    def _warp_reduce(acc, n, sh):
        """The simulator runs one-lane warps (LANES == 1): a thread already holds its rows' whole sums."""
        return

else:
    @cuda.jit(**_DEV)
    def _warp_reduce(acc, n, sh):
        """acc[c] summed over the warp's 32 lanes (butterfly shuffles: into every lane), for c < n; sh unused."""
        for c in range(n):
            v = acc[c]
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 16)
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 8)
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 4)
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
            acc[c] = v


def _matvec_fns(qtype: int, word: int):
    """The matrix-vector kernel and the MoE-slots kernel of one quant type and word size (memoized)."""
    key = ("mv", qtype, word)
    if key in _KERNELS:
        return _KERNELS[key]
    lay = LAYOUTS[qtype]
    unit, pos, has_min = lay.unit, lay.pos, lay.has_min
    rows, warps = MV_ROWS, MV_WARPS

    @cuda.jit(**_DEV)
    def unit_dot(w8, wv, wh, off0, rb, u, r0, last, x, xr, q, s, mn, xv, sx, acc):
        """acc[o] += unit u of row min(r0 + o, last) . x[xr] for o < rows. Rows past the end are clamped (their
        sums are discarded by the caller), so the body has no branch and all its loads can be issued at once."""
        for i in range(4):
            _load_run(x, xr, pos(u, i), xv, 4 * i)
            if has_min:
                sx[i] = (xv[4 * i] + xv[4 * i + 1]) + (xv[4 * i + 2] + xv[4 * i + 3])
        for o in range(rows):
            r = r0 + o if r0 + o < last else last
            unit(w8, wv, wh, word, off0 + r * rb, u, q, s, mn)
            a = acc[o]
            for i in range(4):
                d = q[4 * i] * xv[4 * i] + q[4 * i + 1] * xv[4 * i + 1] + q[4 * i + 2] * xv[4 * i + 2] + \
                    q[4 * i + 3] * xv[4 * i + 3]
                a += s[i] * d
                if has_min:
                    a -= mn[i] * sx[i]
            acc[o] = a

    @cuda.jit(**_DEV)
    def rows_dot(w8, wv, wh, off0, rb, nunits, r0, nrows, x, xr, out, orow, accum, sh, q, s, mn, xv, sx, acc):
        """out[orow, r] (+)= row r . x[xr] for r in r0 .. r0 + rows - 1 (< nrows), by one warp; row r is the
        bytes at off0 + r * rb of the weight views."""
        lane = cuda.threadIdx.x & LANE_MASK
        for o in range(rows):
            acc[o] = _ZERO
        # Two units per step: their loads are independent, so a warp has twice the bytes in flight (short
        # matrices are latency-bound).
        u = lane
        while u + LANES < nunits:
            unit_dot(w8, wv, wh, off0, rb, u, r0, nrows - 1, x, xr, q, s, mn, xv, sx, acc)
            unit_dot(w8, wv, wh, off0, rb, u + LANES, r0, nrows - 1, x, xr, q, s, mn, xv, sx, acc)
            u += 2 * LANES
        if u < nunits:
            unit_dot(w8, wv, wh, off0, rb, u, r0, nrows - 1, x, xr, q, s, mn, xv, sx, acc)
        _warp_reduce(acc, rows, sh)
        if lane == 0:
            for o in range(rows):
                if r0 + o < nrows:
                    v = acc[o]
                    if accum:
                        v += out[_U(orow), _U(r0 + o)]
                    out[_U(orow), _U(r0 + o)] = v

    @cuda.jit(cache=True)
    def matvec(w8, wv, wh, rb, nunits, nrows, x, out, ntok, accum):
        """out[t] (+)= W . x[t] for t < ntok; W's rows are consecutive at byte stride rb. Warps take
        groups of rows, grid-stride."""
        sh = cuda.shared.array(_SH, float32)
        q = cuda.local.array(UNIT, float32)
        xv = cuda.local.array(UNIT, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        sx = cuda.local.array(4, float32)
        acc = cuda.local.array(rows, float32)
        ngroups = (nrows + rows - 1) // rows
        gw = cuda.blockIdx.x * warps + (cuda.threadIdx.x >> WARP_SHIFT)
        for t in range(cuda.blockIdx.y, ntok, cuda.gridDim.y):
            for g in range(gw, ngroups, cuda.gridDim.x * warps):
                rows_dot(w8, wv, wh, 0, rb, nunits, g * rows, nrows, x, t, out, t, accum, sh, q, s, mn, xv, sx, acc)

    @cuda.jit(cache=True)
    def moe(w8, wv, wh, slot_bytes, mat_off, rb, nunits, nrows, slot_of, ids, x, x_per_entry, out, ntok):
        """out[i] = W_s . x[i or t] for entries i = t*k + j whose expert has a slot s = slot_of[ids[t, j]] >= 0;
        W_s is the matrix at byte s * slot_bytes + mat_off."""
        sh = cuda.shared.array(_SH, float32)
        q = cuda.local.array(UNIT, float32)
        xv = cuda.local.array(UNIT, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        sx = cuda.local.array(4, float32)
        acc = cuda.local.array(rows, float32)
        k = ids.shape[1]
        ngroups = (nrows + rows - 1) // rows
        gw = cuda.blockIdx.x * warps + (cuda.threadIdx.x >> WARP_SHIFT)
        for i in range(cuda.blockIdx.y, ntok * k, cuda.gridDim.y):
            t = i // k
            slot = slot_of[_U(ids[_U(t), _U(i - t * k)])]
            if slot >= 0:
                xr = i if x_per_entry else t
                for g in range(gw, ngroups, cuda.gridDim.x * warps):
                    rows_dot(w8, wv, wh, slot * slot_bytes + mat_off, rb, nunits, g * rows, nrows, x, xr, out, i,
                             0, sh, q, s, mn, xv, sx, acc)

    _KERNELS[key] = (matvec, moe)
    return matvec, moe


def _tiled_fn(qtype: int, word: int):
    """The prompt kernel of one quant type and word size (memoized)."""
    key = ("tile", qtype, word)
    if key in _KERNELS:
        return _KERNELS[key]
    lay = LAYOUTS[qtype]
    unit, pos = lay.unit, lay.pos
    rows, toks, warps = TILE_ROWS, TILE_TOKS, TILE_WARPS
    wlen, alen = rows * UNIT, rows * toks  # local array sizes must be compile-time constants

    @cuda.jit(cache=True)
    def tiled(w8, wv, wh, rb, nunits, nrows, x, out, ntok, accum):
        """out[t] (+)= W . x[t] for t < ntok: a warp takes tiles of `rows` rows x `toks` tokens."""
        sh = cuda.shared.array(_SH, float32)
        q = cuda.local.array(UNIT, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        w = cuda.local.array(wlen, float32)
        xv = cuda.local.array(UNIT, float32)
        acc = cuda.local.array(alen, float32)
        lane = cuda.threadIdx.x & LANE_MASK
        ngroups = (nrows + rows - 1) // rows
        ntt = (ntok + toks - 1) // toks
        gw = cuda.blockIdx.x * warps + (cuda.threadIdx.x >> WARP_SHIFT)
        for tt in range(cuda.blockIdx.y, ntt, cuda.gridDim.y):
            t0 = tt * toks
            for g in range(gw, ngroups, cuda.gridDim.x * warps):
                r0 = g * rows
                for c in range(alen):
                    acc[c] = _ZERO
                for u in range(lane, nunits, LANES):
                    for o in range(rows):  # rows past the end are clamped; their sums are not stored
                        r = r0 + o if r0 + o < nrows else nrows - 1
                        unit(w8, wv, wh, word, r * rb, u, q, s, mn)
                        for i in range(4):
                            for e in range(4):
                                w[UNIT * o + 4 * i + e] = s[i] * q[4 * i + e] - mn[i]
                    for j in range(toks):
                        if t0 + j < ntok:
                            for i in range(4):
                                _load_run(x, t0 + j, pos(u, i), xv, 4 * i)
                            for o in range(rows):
                                a = acc[o * toks + j]
                                for c in range(UNIT):
                                    a += w[UNIT * o + c] * xv[c]
                                acc[o * toks + j] = a
                _warp_reduce(acc, alen, sh)
                if lane == 0:
                    for c in range(alen):
                        r = r0 + c // toks
                        t = t0 + c % toks
                        if r < nrows and t < ntok:
                            v = acc[c]
                            if accum:
                                v += out[_U(t), _U(r)]
                            out[_U(t), _U(r)] = v

    _KERNELS[key] = tiled
    return tiled


def _embed_fn(qtype: int, word: int):
    """The embedding kernel of one quant type and word size (memoized)."""
    key = ("embed", qtype, word)
    if key in _KERNELS:
        return _KERNELS[key]
    lay = LAYOUTS[qtype]
    unit, pos = lay.unit, lay.pos

    @cuda.jit(cache=True)
    def embed(w8, wv, wh, rb, nunits, nrows, tokens, out, ntok):
        """out[t] = row tokens[t] of the table, one unit per thread. A token outside the table leaves its output
        row as it was: the host validates token ids, this only keeps a bad one from faulting the context."""
        q = cuda.local.array(UNIT, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        for idx in range(cuda.grid(1), ntok * nunits, cuda.gridsize(1)):
            t = idx // nunits
            u = idx - t * nunits
            r = tokens[_U(t)]
            if r >= 0 and r < nrows:
                unit(w8, wv, wh, word, r * rb, u, q, s, mn)
                for i in range(4):
                    p = pos(u, i)
                    for e in range(4):
                        out[_U(t), _U(p + e)] = s[i] * q[4 * i + e] - mn[i]

    _KERNELS[key] = embed
    return embed


# ---- launch helpers

def _layout(qtype: int):
    lay = LAYOUTS.get(qtype)
    if lay is None:
        raise StrataError(f"GPU matmul: unsupported quant type {qname(qtype)}")
    return lay


def _row_elems(qtype: int, row_bytes: int) -> int:
    lay = _layout(qtype)
    if row_bytes <= 0 or row_bytes % lay.block_bytes:
        raise StrataError(f"GPU matmul: {qname(qtype)} rows of {row_bytes} bytes are not whole blocks of "
                          f"{lay.block_bytes} bytes (float rows need a multiple of {UNIT} elements)")
    return row_bytes // lay.block_bytes * lay.block_elems


def _check_u8(arr) -> None:
    if arr.dtype != np.uint8 or len(arr.shape) != 2:
        raise StrataError(f"GPU matmul: weights must be a 2-D uint8 device array, got {arr.dtype} {arr.shape}")


def _views(arr, word4: bool):
    """A C-contiguous uint8 device array [m, bytes] as the flat (uint8, word, float16) views the unit primitives
    read (no copy), and the word size: uint32 words where word4, else uint16."""
    try:
        flat = arr.reshape(arr.shape[0] * arr.shape[1])
    except NotImplementedError:  # numba: "operation requires copying"
        raise StrataError(f"GPU matmul: weights {arr.shape} are not C-contiguous") from None
    return flat, flat.view(np.uint32 if word4 else np.uint16), flat.view(np.float16), 4 if word4 else 2


def _check_act(what: str, a, nrow: int, ncol: int) -> None:
    if len(a.shape) != 2 or a.shape[0] < nrow or a.shape[1] != ncol or a.dtype != np.float32:
        raise StrataError(f"GPU matmul: {what} must be float32 [>={nrow}, {ncol}], got {a.dtype} {a.shape}")


def _pairs(x):
    """Activations f32[T, K] (C-contiguous) as uint64 pairs [T, K/2], the kernels' view of them; no copy."""
    try:
        return x.view(np.uint64)
    except ValueError:
        raise StrataError(f"GPU matmul: activations {x.shape} must be C-contiguous") from None


def matmul(qtype: int, w, x, out, ntok: int, stream, accumulate: bool = False) -> None:
    """out[t, r] (+)= dequant(w[r]) . x[t] for t < ntok. w u8[N, row_bytes], x f32[>=ntok, K], out f32[>=ntok, N]
    (device arrays). ntok == 1 runs the matrix-vector kernel, larger ntok the tiled one."""
    if ntok <= 0:
        return
    lay = _layout(qtype)
    _check_u8(w)
    nrows, rb = w.shape
    k = _row_elems(qtype, rb)
    _check_act("x", x, ntok, k)
    _check_act("out", out, ntok, nrows)
    w8, wv, wh, word = _views(w, lay.word4 and rb % 4 == 0)
    nunits = k // UNIT
    if ntok == 1:
        grid = (min(-(-nrows // (MV_ROWS * MV_WARPS)), MAX_GRID_X), 1)
        _matvec_fns(qtype, word)[0][grid, LANES * MV_WARPS, stream](w8, wv, wh, rb, nunits, nrows, _pairs(x), out,
                                                                    ntok, int(accumulate))
    else:
        grid = (min(-(-nrows // (TILE_ROWS * TILE_WARPS)), MAX_GRID_X), min(-(-ntok // TILE_TOKS), MAX_GRID_Y))
        _tiled_fn(qtype, word)[grid, LANES * TILE_WARPS, stream](w8, wv, wh, rb, nunits, nrows, _pairs(x), out,
                                                                  ntok, int(accumulate))


def embed(qtype: int, table, tokens, out, ntok: int, stream) -> None:
    """out[t] = dequant(table[tokens[t]]) for t < ntok. table u8[V, row_bytes], tokens int32[>=ntok], out
    f32[>=ntok, K] (device arrays)."""
    if ntok <= 0:
        return
    lay = _layout(qtype)
    _check_u8(table)
    nrows, rb = table.shape
    k = _row_elems(qtype, rb)
    _check_act("out", out, ntok, k)
    if tokens.shape[0] < ntok:
        raise StrataError(f"GPU embed: {ntok} tokens requested from a token array of {tokens.shape[0]}")
    w8, wv, wh, word = _views(table, lay.word4 and rb % 4 == 0)
    nunits = k // UNIT
    grid = min(-(-ntok * nunits // EMBED_THREADS), MAX_GRID_X)
    _embed_fn(qtype, word)[grid, EMBED_THREADS, stream](w8, wv, wh, rb, nunits, nrows, tokens, out, ntok)


def moe_slots(qtype: int, slots, mat_off: int, nrows: int, row_bytes: int, slot_of, ids, x, x_per_entry: bool,
              out, ntok: int, stream) -> None:
    """The selected experts' matmul over VRAM slots, all entries in one launch: for entry i = t*k + j whose
    expert has a slot s = slot_of[ids[t, j]] >= 0, out[i, r] = W_s[r] . (x[i] if x_per_entry else x[t]), W_s
    the nrows x row_bytes matrix at byte mat_off of slots[s]. Entries of non-resident experts are left as they
    were. slots u8[n_slots, slot_bytes], slot_of int32[E], ids int32[>=ntok, k], out f32[>=ntok*k, nrows]."""
    if ntok <= 0:
        return
    lay = _layout(qtype)
    _check_u8(slots)
    k = _row_elems(qtype, row_bytes)
    slot_bytes = slots.shape[1]
    if mat_off < 0 or mat_off % 2 or row_bytes % 2 or slot_bytes % 2 or mat_off + nrows * row_bytes > slot_bytes:
        raise StrataError(f"GPU moe_slots: matrix at byte {mat_off} ({nrows} x {row_bytes} bytes) does not fit "
                          f"2-aligned in slots of {slot_bytes} bytes")
    nent = ntok * ids.shape[1]
    if ids.shape[0] < ntok:
        raise StrataError(f"GPU moe_slots: ids has {ids.shape[0]} rows for {ntok} tokens")
    _check_act("x", x, nent if x_per_entry else ntok, k)
    _check_act("out", out, nent, nrows)
    w8, wv, wh, word = _views(slots, lay.word4 and row_bytes % 4 == 0 and mat_off % 4 == 0 and slot_bytes % 4 == 0)
    nunits = k // UNIT
    grid = (min(-(-nrows // (MV_ROWS * MV_WARPS)), MAX_GRID_X), min(nent, MAX_GRID_Y))
    _matvec_fns(qtype, word)[1][grid, LANES * MV_WARPS, stream](w8, wv, wh, slot_bytes, mat_off, row_bytes, nunits,
                                                             nrows, slot_of, ids, _pairs(x), bool(x_per_entry), out,
                                                             ntok)
