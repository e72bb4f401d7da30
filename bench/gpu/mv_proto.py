"""Matrix-vector kernel variants on the GPU, timed against cuda_kernels.matmul (engineering, not a result).

    python3 bench/gpu/mv_proto.py

Variant "smem": the activation row staged in shared memory once per block (optionally RMS-normalized on the
way in), R rows per warp, lanes over units, blocks grid-striding over row groups. Checked against the current
kernel's output, timed with CUDA events over back-to-back launches.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from numba import cuda, float32, uint64

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from strata_nb.cpu_kernels.qtypes import Q4_K, Q6_K, Q8_0, row_bytes  # noqa: E402
from strata_nb.cuda_kernels import matmul as mm  # noqa: E402
from strata_nb.cuda_kernels.quant import _DEV, LAYOUTS, UNIT  # noqa: E402

_U = uint64
_K = {}


def smem_mv(qtype, word, K, R, warps, unroll):
    key = (qtype, word, K, R, warps, unroll)
    if key in _K:
        return _K[key]
    lay = LAYOUTS[qtype]
    unit, pos, has_min = lay.unit, lay.pos, lay.has_min
    nunits = K // UNIT

    @cuda.jit(**_DEV)
    def unit_dot(w8, wv, wh, rb, u, r0, last, xs, q, s, mn, xv, sx, acc):
        for i in range(4):
            p = pos(u, i)
            for e in range(4):
                xv[4 * i + e] = xs[p + e]
            if has_min:
                sx[i] = (xv[4 * i] + xv[4 * i + 1]) + (xv[4 * i + 2] + xv[4 * i + 3])
        for o in range(R):
            r = r0 + o if r0 + o < last else last
            unit(w8, wv, wh, word, r * rb, u, q, s, mn)
            a = acc[o]
            for i in range(4):
                d = q[4 * i] * xv[4 * i] + q[4 * i + 1] * xv[4 * i + 1] + q[4 * i + 2] * xv[4 * i + 2] + \
                    q[4 * i + 3] * xv[4 * i + 3]
                a += s[i] * d
                if has_min:
                    a -= mn[i] * sx[i]
            acc[o] = a

    @cuda.jit
    def mv(w8, wv, wh, rb, nrows, x, out):
        xs = cuda.shared.array(K, float32)
        q = cuda.local.array(UNIT, float32)
        xv = cuda.local.array(UNIT, float32)
        s = cuda.local.array(4, float32)
        mn = cuda.local.array(4, float32)
        sx = cuda.local.array(4, float32)
        acc = cuda.local.array(R, float32)
        tid = cuda.threadIdx.x
        for i in range(tid, K, warps * 32):
            xs[i] = x[0, i]
        cuda.syncthreads()
        lane = tid & 31
        ngroups = (nrows + R - 1) // R
        for g in range(cuda.blockIdx.x * warps + (tid >> 5), ngroups, cuda.gridDim.x * warps):
            r0 = g * R
            for o in range(R):
                acc[o] = float32(0.0)
            u = lane
            if unroll:
                while u + 32 < nunits:
                    unit_dot(w8, wv, wh, rb, u, r0, nrows - 1, xs, q, s, mn, xv, sx, acc)
                    unit_dot(w8, wv, wh, rb, u + 32, r0, nrows - 1, xs, q, s, mn, xv, sx, acc)
                    u += 64
            while u < nunits:
                unit_dot(w8, wv, wh, rb, u, r0, nrows - 1, xs, q, s, mn, xv, sx, acc)
                u += 32
            for o in range(R):
                v = acc[o]
                for m in (16, 8, 4, 2, 1):
                    v += cuda.shfl_xor_sync(0xFFFFFFFF, v, m)
                acc[o] = v
            if lane == 0:
                for o in range(R):
                    if r0 + o < nrows:
                        out[0, r0 + o] = acc[o]

    _K[key] = mv
    return mv


def timeit(fn, reps=200):
    st = cuda.default_stream()
    fn()
    cuda.synchronize()
    e0, e1 = cuda.event(), cuda.event()
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    e1.synchronize()
    return 1e3 * cuda.event_elapsed_time(e0, e1) / reps


def main():
    rng = np.random.default_rng(0)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    for qtype, n, k in [(Q4_K, 4096, 2048), (Q4_K, 2048, 4096), (Q6_K, 512, 2048), (Q8_0, 2048, 768),
                        (Q4_K, 768 * 16, 2048), (Q6_K, 151936, 2048)]:
        rb = row_bytes(qtype, k)
        w = rng.integers(0, 256, (n, rb), dtype=np.uint8)
        # finite fp16 scales: overwrite every 2-byte field with a small half (values are irrelevant for timing)
        wh = w.view(np.uint16)
        wh[:] = np.where((wh & 0x7C00) == 0x7C00, np.uint16(0x2000), wh)
        dw = cuda.to_device(w)
        x = cuda.to_device(rng.standard_normal((1, k)).astype(np.float32))
        out0 = cuda.device_array((1, n), np.float32)
        t0 = timeit(lambda: mm.matmul(qtype, dw, x, out0, 1, 0))
        ref = out0.copy_to_host()
        gb = n * rb / 1e9
        print(f"{mm.qname(qtype):5s} {n:6d} x {k:5d} ({gb * 1e3:.1f} MB): current {t0:7.2f} us "
              f"({gb / t0 * 1e6:.0f} GB/s)")
        w8, wv, whv, word = mm._views(dw, LAYOUTS[qtype].word4 and rb % 4 == 0)
        for R, warps, unroll in ((2, 4, True), (4, 4, True), (2, 8, True), (4, 4, False)):
            if True:
                if True:
                    for bps in (1, 2, 4, 0):
                        fn = smem_mv(qtype, word, k, R, warps, unroll)
                        ng = -(-n // R)
                        grid = -(-ng // warps) if bps == 0 else min(-(-ng // warps), bps * sms)
                        out = cuda.device_array((1, n), np.float32)
                        t = timeit(lambda: fn[grid, 32 * warps](w8, wv, whv, rb, n, x, out))
                        err = np.abs(out.copy_to_host() - ref).max() / (np.abs(ref).max() + 1e-30)
                        print(f"      smem R={R} warps={warps} unroll={int(unroll)} grid={grid:6d}: {t:7.2f} us "
                              f"({gb / t * 1e6:.0f} GB/s) err {err:.1e}")


if __name__ == "__main__":
    main()
