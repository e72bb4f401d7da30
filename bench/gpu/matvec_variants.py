"""Decode matrix kernels at Qwen3-30B-A3B shapes under several launch shapes (run on the GPU machine).

    python3 bench/gpu/matvec_variants.py [--reps 50] [--variants auto,4x4,4x2,8x1]

A variant WxR gives every launch W warps a block and R rows a warp (the dense launches' shape rule _mv_shape is
replaced; kernels compiled afresh, without the on-disk cache, whose key does not hold those constants); "auto"
keeps the engine's own rule. Each kernel is timed alone,
`reps` launches captured in one CUDA graph (as profile_decode.py), with random weight bytes (timing only: the
values do not matter). A copy kernel reading the same bytes gives each shape's floor (launch + one pass over the
bytes), and GB/s is against the bytes each kernel must read. `--copies N` (N > 1) gives every kernel N copies of its
weights (N routings of the experts, over 128 experts' slots) and cycles through them launch by launch, so with
N x the bytes well past the L2 (50 MB) each launch reads its weights from HBM, as a real token does; the default 1
replays L2-resident weights.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np
from numba import cuda, uint32

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from strata_nb.cpu_kernels.qtypes import F32, Q4_K, Q6_K, row_bytes  # noqa: E402
from strata_nb.cuda_kernels import matmul as mm  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode import replay_us  # noqa: E402

D, QD, KVD, E, F, K = 2048, 4096, 512, 128, 768, 8  # hidden, q width, k/v width, experts, expert ff, top-k

_jit = cuda.jit


def _jit_nocache(*a, **kw):
    kw.pop("cache", None)
    return _jit(*a, **kw)


@cuda.jit
def _touch(w, out):
    """Reads every uint32 of w once (grid-stride), so a launch costs what one pass over the bytes costs."""
    acc = uint32(0)
    for i in range(cuda.grid(1), w.shape[0], cuda.gridsize(1)):
        acc ^= w[i]
    if acc == 0x12345678:
        out[0] = acc


def rand_u8(rng, rows: int, rb: int):
    a = rng.integers(0, 256, (rows, rb), dtype=np.uint8)
    if rb % 2 == 0:  # keep fp16 fields finite-ish: clear the exponent's top bit of every 16-bit word
        a.view(np.uint16)[...] &= 0xBFFF
    return cuda.to_device(a)


def _run(fn, st, reps: int, name: str, var: str) -> float:
    try:
        fn(st)
        st.synchronize()
        return replay_us(fn, st, reps)
    except Exception as e:  # a variant that does not compile is reported, not fatal
        print(f"  {name} {var}: {type(e).__name__}: {str(e)[:120]}")
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--variants", default="auto,4x4,4x2,8x1")
    ap.add_argument("--copies", type=int, default=1, help="weight copies cycled launch by launch (16: HBM-cold)")
    a = ap.parse_args()
    n = max(1, a.copies)
    rng = np.random.default_rng(0)
    st = cuda.stream()
    f32 = lambda *s: cuda.to_device(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    wq = [rand_u8(rng, QD, row_bytes(Q4_K, D)) for _ in range(n)]
    wk = [rand_u8(rng, KVD, row_bytes(Q4_K, D)) for _ in range(n)]
    wv = [rand_u8(rng, KVD, row_bytes(Q6_K, D)) for _ in range(n)]
    wo = [rand_u8(rng, D, row_bytes(Q4_K, QD)) for _ in range(n)]
    wr = [rand_u8(rng, E, row_bytes(F32, D)) for _ in range(n)]
    for w in wr:
        w.copy_to_device(rng.standard_normal((E, D)).astype(np.float32).view(np.uint8))
    rbg, rbd = row_bytes(Q4_K, D), row_bytes(Q6_K, F)
    slot_bytes = 2 * F * rbg + D * rbd
    slots = rand_u8(rng, E, slot_bytes)
    slot_of = cuda.to_device(np.arange(E, dtype=np.int32))
    ids = [cuda.to_device(rng.choice(E, K, replace=False).astype(np.int32).reshape(1, K)) for _ in range(n)]
    wts = cuda.to_device(np.full((1, K), 0.125, np.float32))
    x, xn, nw = f32(1, D), f32(1, D), f32(D)
    q, kk, v, att, rl = f32(1, QD), f32(1, KVD), f32(1, KVD), f32(1, QD), f32(1, E)
    h = f32(K, F)
    V = 151936  # the head (Q6_K, 255 MB: past the L2 with one copy)
    wh_ = rand_u8(rng, V, row_bytes(Q6_K, D))
    logits = cuda.device_array((1, V), np.float32)
    out = f32(1, D)
    sink = cuda.device_array(1, np.uint32)

    def mb(*arrs) -> float:
        return sum(int(np.prod(w.shape)) for w in arrs) / 1e6

    def cycling(fn):
        """fn(stream, copy) as fn(stream), the copy advancing at every call (every captured launch)."""
        it = itertools.cycle(range(n))
        return lambda s: fn(s, next(it))

    cases = {
        "qkv+norm": (cycling(lambda s, c: mm.matvec([(Q4_K, wq[c], q, False), (Q4_K, wk[c], kk, False),
                                                      (Q6_K, wv[c], v, False)], x, s, norm=nw, eps=1e-6)),
                     mb(wq[0], wk[0], wv[0])),
        "qkv": (cycling(lambda s, c: mm.matvec([(Q4_K, wq[c], q, False), (Q4_K, wk[c], kk, False),
                                                 (Q6_K, wv[c], v, False)], x, s)), mb(wq[0], wk[0], wv[0])),
        "o (accum)": (cycling(lambda s, c: mm.matvec([(Q4_K, wo[c], x, True)], att, s)), mb(wo[0])),
        "router+norm": (cycling(lambda s, c: mm.matvec([(F32, wr[c], rl, False)], x, s, norm=nw, eps=1e-6,
                                                        x_out=xn)), mb(wr[0])),
        "gate_up x8": (cycling(lambda s, c: mm.moe_gate_up((Q4_K, 0, rbg), (Q4_K, F * rbg, rbg), slots, F, slot_of,
                                                            ids[c], xn, h, 1, s)), K * 2 * F * rbg / 1e6),
        "head+norm": (lambda s: mm.matvec([(Q6_K, wh_, logits, False)], x, s, norm=nw, eps=1e-6), mb(wh_)),
        "down x8": (cycling(lambda s, c: mm.moe_down((Q6_K, 2 * F * rbg, rbd), slots, D, slot_of, ids[c], wts, h,
                                                      out, 1, s)), K * D * rbd / 1e6),
    }
    floors = {}
    for name, (_, mbytes) in cases.items():
        n32 = int(mbytes * 1e6) // 4
        bufs = [cuda.device_array(n32, np.uint32) for _ in range(n)]
        grid = min(-(-n32 // 256), 132 * 16)
        floors[name] = replay_us(cycling(lambda s, c, bufs=bufs, grid=grid: _touch[grid, 256, s](bufs[c], sink)),
                                 st, a.reps)
    mm.cuda.jit = _jit_nocache  # variants differ in module constants the on-disk cache key does not hold
    print(f"weights: {'L2-resident (one copy, replayed)' if n == 1 else f'{n} copies cycled (HBM-cold)'}")
    print(f"{'kernel':14s} {'MB':>6s} {'floor us':>9s} " + " ".join(f"{v:>14s}" for v in a.variants.split(",")))
    res = {}
    rule = mm._mv_shape
    auto = (mm.MV_WARPS, mm.MV_ROWS, mm.MV_ROWS_SMALL, mm.MV_ROWS_DOWN, mm.MV_WARPS_WIDE)
    for var in a.variants.split(","):
        if var == "auto":
            mm.MV_WARPS, mm.MV_ROWS, mm.MV_ROWS_SMALL, mm.MV_ROWS_DOWN, mm.MV_WARPS_WIDE = auto
            mm._mv_shape, mm._RED = rule, 8 * mm.LANES
            mm._KERNELS.clear()
            for name, (fn, _) in cases.items():
                res[name, var] = _run(fn, st, a.reps, name, var)
            continue
        w, r = (int(t) for t in var.split("x"))
        mm.MV_WARPS, mm.MV_ROWS, mm.MV_ROWS_SMALL, mm.MV_ROWS_DOWN, mm.MV_WARPS_WIDE = w, r, r, r, w
        mm._mv_shape = lambda k, n, w=w, r=r: (w, r)
        mm._RED = max(w, 8) * mm.LANES
        mm._KERNELS.clear()
        for name, (fn, _) in cases.items():
            res[name, var] = _run(fn, st, a.reps, name, var)
    for name, (_, mbytes) in cases.items():
        cells = []
        for var in a.variants.split(","):
            us = res[name, var]
            cells.append(f"{us:6.2f} {mbytes / us if us == us else 0:5.2f}TB")
        print(f"{name:14s} {mbytes:6.2f} {floors[name]:9.2f} " + " ".join(f"{c:>14s}" for c in cells))


if __name__ == "__main__":
    main()
