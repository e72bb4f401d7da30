"""Time the decode attention kernels alone, and the small per-layer kernels, warm and after an L2 flush (GPU machine).

    python3 bench/gpu/kernel_probe.py [--keys 130,256,448,640,1024,4096] [--reps 40] [--no-attention]

Qwen3-30B-A3B's attention shapes (32 query heads over 4 kv heads of 128 dims, float16 cache). Each case is a CUDA
graph of `reps` launches replayed 5 times (median, per launch): "warm" back to back (code and data in L2), "cold"
with a kernel that writes 160 MB between launches (L2 flushed: weights, KV rows and kernel code come from HBM, as
in a decode token where ~30 MB of weights pass through L2 between one layer's launch of a kernel and the next),
less the same graph of flushes alone. Attention variants: warps per block x the least keys per chunk x the query
heads a block takes (the engine's first: its short form up to SHORT's keys, its long form beyond; then the long
form alone, with the accurate exp, and fixed forms; outputs compared with the first).
Then QK-norm + rope + KV append, route top-k, the router's matrix-vector launch (F32 128 x 2048 with the RMSNorm
fused) at several block shapes and with the int8 form of its row written for the experts, the experts of a decode
token (8 choices of Qwen3-30B-A3B's Q4_K gate+up 2 x 768 x 2048 and Q6_K down 2048 x 768 in VRAM slots: the
float kernels, the int8 ones at several block shapes), and an empty kernel (the floor of a launch inside a graph),
warm and cold.
"""
from __future__ import annotations

import argparse
import math
import statistics

import numpy as np
from numba import cuda

from strata_nb.cpu_kernels.qtypes import F32 as GGML_F32
from strata_nb.cpu_kernels.qtypes import Q4_K, Q6_K, row_bytes
from strata_nb.cuda_kernels import attention as A
from strata_nb.cuda_kernels import matmul as M
from strata_nb.cuda_kernels import matvec_q8 as Q8
from strata_nb.cuda_kernels import ops as O
from strata_nb.runtime.cuda_rt import SIM, Graph

NH, NKV, HD = 32, 4, 128


@cuda.jit
def _empty(buf):
    if cuda.grid(1) == 0:
        buf[0] += np.float32(1.0)


@cuda.jit
def _flush(buf):
    i, n = cuda.grid(1), buf.shape[0]
    for j in range(i, n, cuda.gridsize(1)):
        buf[j] += np.float32(1.0)


def timed(fn, stream, reps: int, flush=None) -> float:
    """us per call of fn(stream) inside a graph of `reps` calls (each after flush(stream) when given, less the
    flushes' own time)."""
    def body(st, with_fn):
        for _ in range(reps):
            if flush is not None:
                flush(st)
            if with_fn:
                fn(st)

    def replay(g) -> float:
        ts = []
        for _ in range(5):
            e0, e1 = cuda.event(), cuda.event()
            e0.record(stream)
            g.launch(stream)
            e1.record(stream)
            e1.synchronize()
            ts.append(0.0 if SIM else cuda.event_elapsed_time(e0, e1) * 1e3)
        return statistics.median(ts)

    fn(stream)  # compile outside the capture
    stream.synchronize()
    g = Graph(lambda st: body(st, True), stream, "probe")
    t = replay(g)
    g.close()
    if flush is not None:
        g0 = Graph(lambda st: body(st, False), stream, "flushes")
        t -= replay(g0)
        g0.close()
    return t / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", default="130,256,448,640,1024,4096")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--flush-mb", type=int, default=160)
    ap.add_argument("--no-attention", action="store_true", help="only the small kernels and the experts")
    a = ap.parse_args()
    stream = cuda.stream()
    n_sm = 1 if SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT
    rng = np.random.default_rng(0)
    fbuf = cuda.to_device(np.zeros(a.flush_mb << 18, np.float32))
    flush = lambda st: _flush[4 * n_sm, 512 if n_sm > 1 else 1, st](fbuf)  # noqa: E731
    keys = [int(k) for k in a.keys.split(",")]
    ctx = max(keys) + 128
    kc = cuda.to_device((rng.standard_normal((NKV, ctx, HD)) * 2).astype(np.float16))
    vc = cuda.to_device(rng.standard_normal((NKV, ctx, HD)).astype(np.float16))
    q = cuda.to_device(rng.standard_normal((1, NH * HD)).astype(np.float32))
    pos = cuda.to_device(np.zeros(1, np.int32))
    scale = 1.0 / math.sqrt(HD)
    engine_warps, engine_heads = A._GPU_WARPS, A.DECODE_HEADS
    if not a.no_attention:
        print(f"decode attention, {NH} heads / {NKV} kv heads x {HD}, {n_sm} SMs, us per launch (median of 5 replays "
              f"of {a.reps})")
        print("| keys | variant | n_split | blocks | warm | cold | max rel diff vs the first |")
        print("|---|---|---|---|---|---|---|")
    ns = A.choose_n_split(ctx, NKV, n_sm)  # as the engine fixes it at capture, from the context size
    off = (1, 1, 0)
    for n in ([] if a.no_attention else keys):
        pos.copy_to_device(np.array([n - 1], np.int32))
        ref = None
        # (warps, least keys a chunk, fast exp, heads a block, short form): the engine's first
        for nw, mc, fast, heads, short in ((engine_warps, A.MIN_CHUNK, True, engine_heads, A.SHORT),
                                           (engine_warps, A.MIN_CHUNK, True, engine_heads, A.TRIAL_SHORT),
                                           (engine_warps, A.MIN_CHUNK, True, engine_heads, off),
                                           (engine_warps, A.MIN_CHUNK, False, engine_heads, off),
                                           (8, 32, True, 2, off), (8, 64, True, 2, off), (8, 32, True, 4, off),
                                           (8, 16, True, 2, off), (8, 32, True, 1, off), (4, 32, True, 2, off)):
            A._GPU_WARPS = nw  # (the simulator runs its own one warp)
            A._FAST_EXP = fast
            scratch = A.decode_scratch(NH, HD, ns)
            out = cuda.to_device(np.zeros((1, NH * HD), np.float32))

            def fn(st, scratch=scratch, out=out, mc=mc, heads=heads, short=short):
                A.attention_decode(q, kc, vc, pos, scale, out, scratch, ns, st, mc, heads=heads, short=short)

            warm = timed(fn, stream, a.reps)
            cold = timed(fn, stream, a.reps, flush)
            fn(stream)
            got = out.copy_to_host()
            if ref is None:
                ref = got
            diff = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
            use_s = n <= short[2]
            hb, mcx = (short[0], short[1]) if use_s else (heads, mc)
            chunk = max(mcx, -(-n // ns))
            _, gp, n_sub = A._group(NH, NKV, hb)
            nb = NKV * n_sub
            form = (f"up to {short[2]} keys {short[0]} heads / >= {short[1]} keys, else " if short[2] else "")
            ex = "" if fast else ", exact exp"
            print(f"| {n} | {form}{nw} warps, >= {mc} keys, {min(heads, 8)} heads a block{ex} | {ns} | "
                  f"{nb * -(-n // chunk)} live | {warm:.2f} | {cold:.2f} | {diff:.2e} |")
    A._GPU_WARPS, A._FAST_EXP, A.DECODE_HEADS = engine_warps, True, engine_heads

    # QK-norm + rope + KV append, route top-k (128 experts, top 8)
    qf = cuda.to_device(rng.standard_normal((1, NH * HD)).astype(np.float32))
    kf = cuda.to_device(rng.standard_normal((1, NKV * HD)).astype(np.float32))
    vf = cuda.to_device(rng.standard_normal((1, NKV * HD)).astype(np.float32))
    nw = cuda.to_device(np.ones(HD, np.float32))
    mult, msc = O.rope_mult(HD, 1e6, 1.0, 0.0, 0.0, 0.0, np.ones(HD // 2), 1.0)
    md = cuda.to_device(np.ascontiguousarray(mult, np.float64))

    def rope(st):
        O.qk_rope_kv(qf, kf, vf, nw, nw, O.QK_HEAD, 1e-6, md, msc, True, HD, NH, NKV, HD, kc, vc, pos, 1, st)

    logits = cuda.to_device(rng.standard_normal((1, 128)).astype(np.float32))
    ids = cuda.to_device(np.zeros((1, 8), np.int32))
    wts = cuda.to_device(np.zeros((1, 8), np.float32))

    def topk(st):
        O.route_topk(logits, 8, True, 1.0, ids, wts, 1, st)

    # the router: F32 128 rows x 2048 with the RMSNorm fused, at forced block shapes (warps, rows a warp)
    D, E = 2048, 128
    rw = cuda.to_device(rng.standard_normal((E, D)).astype(np.float32).view(np.uint8))
    xr = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32))
    nrm = cuda.to_device(np.ones(D, np.float32))
    lo = cuda.to_device(np.zeros((1, E), np.float32))
    shape0 = M._mv_shape

    def router(shape):
        def fn(st):
            M._mv_shape = lambda k, total: shape
            try:
                M.matvec([(GGML_F32, rw, lo, False)], xr, st, norm=nrm, eps=1e-6)
            finally:
                M._mv_shape = shape0
        return fn

    xq8 = tuple(cuda.to_device(np.zeros((1, n), dt)) for n, dt in Q8.q8_shapes(D))

    def router_q8(st):
        M.matvec([(GGML_F32, rw, lo, False)], xr, st, norm=nrm, eps=1e-6, q8_out=xq8)

    # a decode token's experts: 8 choices, each in its own VRAM slot (weights: random bytes, small fp16 scales)
    F, K8 = 768, 8
    rbg, rbd = row_bytes(Q4_K, D), row_bytes(Q6_K, F)
    slot_bytes = -(-(2 * F * rbg + D * rbd) // 256) * 256
    raw = rng.integers(0, 256, (K8, slot_bytes), dtype=np.uint8)
    small = np.array([1e-3], np.float16).view(np.uint8)
    raw[:, 0:2 * F * rbg].reshape(K8, 2 * F, -1, 144)[..., 0:4] = np.tile(small, 2)
    raw[:, 2 * F * rbg:2 * F * rbg + D * rbd].reshape(K8, D, -1, 210)[..., 208:210] = small
    slots = cuda.to_device(raw)
    slot_of = cuda.to_device(np.where(np.arange(E) < K8, np.arange(E), -1).astype(np.int32))
    eids = cuda.to_device(np.arange(K8, dtype=np.int32)[None])
    ewts = cuda.to_device(np.full((1, K8), 0.125, np.float32))
    eh = cuda.to_device(np.zeros((K8, F), np.float32))
    hq8 = tuple(cuda.to_device(np.zeros((K8, n), dt)) for n, dt in Q8.q8_shapes(F))
    ex = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32))
    gate, up, down = (Q4_K, 0, rbg), (Q4_K, F * rbg, rbg), (Q6_K, 2 * F * rbg, rbd)
    gu0, rd0 = (M.GU_WARPS, M.GU_ROWS), M.MV_ROWS_DOWN_Q8

    def gate_up(q8, shape=gu0, quant=True):
        def fn(st):
            M.GU_WARPS, M.GU_ROWS = shape
            try:
                M.moe_gate_up(gate, up, slots, F, slot_of, eids, ex, eh, 1, st, xq8=xq8 if q8 else None,
                              hq8=hq8 if q8 and quant else None)
            finally:
                M.GU_WARPS, M.GU_ROWS = gu0
        return fn

    # the output head: Q6_K 151,936 x 2048 with the final RMSNorm fused, at forced block shapes (warps, rows a warp)
    NV = 64 if SIM else 151936
    hw = rng.integers(0, 256, (NV, row_bytes(Q6_K, D)), dtype=np.uint8)
    hw.reshape(NV, -1, 210)[..., 208:210] = small
    hw = cuda.to_device(hw)
    hl = cuda.to_device(np.zeros((1, NV), np.float32))

    def head(shape):
        def fn(st):
            M._mv_shape = lambda k, total: shape
            try:
                M.matvec([(Q6_K, hw, hl, False)], xr, st, norm=nrm, eps=1e-6, q8=True)
            finally:
                M._mv_shape = shape0
        return fn

    # decode attention at 130 keys, the engine's shape, with and without the QK-norm + rope + KV append inside
    pos.copy_to_device(np.array([129], np.int32))
    ns_e = A.choose_n_split(ctx, NKV, n_sm)
    att_scratch = A.decode_scratch(NH, HD, ns_e)
    att_out = cuda.to_device(np.zeros((1, NH * HD), np.float32))

    def attention(fused):
        def fn(st):
            A.attention_decode(qf, kc, vc, pos, scale, att_out, att_scratch, ns_e, st,
                               rope=(kf, vf, nw, nw, O.QK_HEAD, 1e-6, md, msc, True, HD) if fused else None)
        return fn

    def expert_down(q8, rows=rd0):
        def fn(st):
            M.MV_ROWS_DOWN_Q8 = rows
            try:
                M.moe_down(down, slots, D, slot_of, eids, ewts, eh, ex, 1, st, hq8=hq8 if q8 else None)
            finally:
                M.MV_ROWS_DOWN_Q8 = rd0
        return fn

    ebuf = cuda.to_device(np.zeros(1, np.float32))
    cases = [("QK-norm + rope + KV append", rope), ("decode attention, 130 keys (engine shape)", attention(False)),
             ("decode attention, 130 keys, QK-norm + rope + KV append inside", attention(True)),
             ("route top-k", topk)]
    cases += [(f"router F32 128 x 2048 + norm, {w} warps x {r} rows ({-(-E // (w * r))} blocks)", router((w, r)))
              for w, r in (((1, 1), (1, 2)) if SIM else ((8, 1), (4, 1), (2, 1), (1, 1), (1, 2)))]
    cases.append(("router F32 128 x 2048 + norm + the row's int8 form (engine shape)", router_q8))
    cases.append(("experts gate+up x8, float", gate_up(False)))
    for shape in ((gu0,) if SIM else ((8, 4), (4, 8), (16, 2))):
        cases.append((f"experts gate+up x8, int8, {shape[0]} warps x {shape[1]} rows, h's int8 form too",
                      gate_up(True, shape)))
    cases.append(("experts gate+up x8, int8, engine shape, float h only", gate_up(True, gu0, False)))
    cases.append(("experts down x8, float", expert_down(False)))
    for rows in ((rd0,) if SIM else (2, 4, 1)):
        cases.append((f"experts down x8, int8, 8 warps x {rows} rows", expert_down(True, rows)))
    hs0 = shape0(D, NV)
    for w, r in ((hs0,) if SIM else (hs0, (8, 4), (8, 8), (4, 8), (8, 2))):
        cases.append((f"head Q6_K {NV} x 2048 + norm, int8, {w} warps x {r} rows"
                      f"{' (engine)' if (w, r) == hs0 else ''} ({-(-NV // (w * r))} blocks)", head((w, r))))
    cases.append(("empty kernel (1 block)", lambda st: _empty[1, 32, st](ebuf)))
    print()
    print("| kernel | warm | cold |")
    print("|---|---|---|")
    for name, fn in cases:
        print(f"| {name} | {timed(fn, stream, a.reps):.2f} | {timed(fn, stream, a.reps, flush):.2f} |")


if __name__ == "__main__":
    main()
