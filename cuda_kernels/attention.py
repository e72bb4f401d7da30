"""Causal GQA attention over the float16 KV cache: decode (one query token, split over the context) and prompt.

Layout: q, out f32[T, H*hd]; kc, vc f16[Hkv, ctx, hd]; query head h reads kv head h // (H / Hkv) (llama.cpp and HF
order). A block owns one kv head and up to 32 of its query heads (the group, padded to a power of two gp; a decode
block at most DECODE_HEADS of them), so a K/V row is read once for the heads of a block. Inside a block each warp
takes nk keys per step (their K/V rows loaded one step ahead, so loads overlap the math): its 32 lanes hold strided
slices of the head dimension (coalesced f16 loads, q slices in registers), the nk * gp dot products are summed
across lanes with a halving butterfly (about one exchange per dot product instead of five), and the online softmax
runs per warp; the block's warps merge at the end. The per-lane loop is generated as straight-line code per
(head_dim, gp, warps) so that the compiler keeps its arrays in registers. On a GPU the exchanges are warp shuffles;
the simulator has none, so there a shared-memory round replaces them (or, for one test, emulated shuffles with block
barriers: every warp runs the same steps).

Decode splits the context into chunks of max(min_chunk, ceil(len / n_split)) keys (len read from pos0 on the device,
so one captured graph serves every position); each block writes its chunk's partial (max, sum, unnormalized output)
and the last block of a head group to finish (an atomic count) merges the live ones. Blocks of chunks past the
length return at once: a short context costs a few chunks, not n_split of a few keys each. A decode launch is
latency-bound (a warp per scheduler runs a ~900-instruction step per nk keys), so a block has 8 warps: on an H100
(bench/gpu/kernel_probe.py) 19.6 / 24.9 / 64.8 us at 130 / 1,024 / 4,096 keys against 26.3 / 33.7 / 76.8 at 4 warps;
16-key or 32-key chunks only paid below ~200 keys. So a launch has two forms, picked on the device from the length
(SHORT): a short context takes blocks of fewer heads and shorter chunks (more blocks in flight), a long one the
long form; the grid holds either form's blocks (the other's extra blocks return at once). With rope= a decode block first QK-norms and rotates its own
query heads into shared memory and, in the chunk of the new position, the token's key (appending it and the value
to the cache), so the engine's decode needs no qk_rope_kv launch (H100 decode graph: 15.6 + 7.2 us -> 20.6 us). A compact kernel that staged 32 keys in shared memory and scored
them thread-per-(key, head) was 1.3-8x slower there (its serial per-thread loops), and was dropped.
"""
from __future__ import annotations

import math

import numpy as np
from numba import config, cuda

from strata_nb.cuda_kernels import ops as kops
from strata_nb.errors import StrataError

_MAX_SPLIT = 1024  # chunks of a decode launch at most
# Keys per decode chunk at least: below that a block's fixed cost outweighs its keys. An H200 at Qwen3-30B-A3B
# shapes, 4 kv heads, ~130 keys, took 9.5 us with 64-key chunks and 9.8 with 16-key ones (bench/gpu/trace_decode.py).
MIN_CHUNK = 64
_GPU_WARPS = 8  # warps per attention block on a GPU (kernel_probe.py: 4 warps took 1.2-1.4x as long)
# Query heads a decode block takes at most (a power of two). Fewer heads per block: more blocks, each with fewer
# dot products, exchanges and exps per step (a decode launch is latency-bound), and each K/V row read by more
# blocks (from L2). H100, 32 heads over 4 kv heads (kernel_probe.py, us at 130 / 1,024 / 4,096 keys): 8 heads (the
# whole group) 18.2 / 23.7 / 63.1, 4 heads 13.5 / 17.6 / 61.4, 2 heads 10.9 / 22.2 / 79.7: 4 is ahead of the whole
# group at every length. Prompt blocks always take the whole group (their tokens are the parallelism).
DECODE_HEADS = 4
# The form of a short context (heads a block, keys a chunk at least, up to how many keys), chosen on the device at
# every launch: a short context gives the long form few blocks (at 130 keys 24 of 40), each a serial chain of
# steps; H100, 130 keys, 5-9 splits: 2 heads and 32-key chunks 9.98 us against 13.67. Off (0 keys): at the split
# count the engine fixes (66 for a 4k context) the short form's dead blocks cost more than it gains (18.1 vs 16.2
# us, H100, bench/results/gpu_decode_trace.md); TRIAL_SHORT is kernel_probe.py's candidate until the tasks run
# over the live chunks only.
TRIAL_SHORT = (2, 32, 448)
SHORT = (2, 32, 0)
_SIM_WARPS = 1  # in the simulator (the butterfly test runs 2, to exercise the merge of warps there)
# How the simulator sums a warp's dot products: "smem" (one shared-memory round, fast there) or "emul" (the GPU's
# shuffle butterfly with shuffles emulated through shared memory: slow, a test runs it once on a tiny case).
_SIM_EXCHANGE = "smem"
# The online-softmax update without per-head branches; False: rescale only when a head's max grows. Both pass the
# tests on an H200 and time the same there (decode at 32k is latency-bound elsewhere): kept to compare.
_BRANCH_FREE = True


def decode_scratch_shapes(n_head: int, head_dim: int, n_split: int) -> tuple[tuple, tuple, tuple, tuple]:
    """Shapes of attention_decode's scratch (part_m f32, part_l f32, part_o f32, the head groups' counts of
    finished blocks int32, zero between launches)."""
    return (n_head, n_split), (n_head, n_split), (n_head, n_split, head_dim), (n_head,)


def decode_scratch(n_head: int, head_dim: int, n_split: int) -> tuple:
    """attention_decode's scratch as zeroed device arrays."""
    dts = (np.float32, np.float32, np.float32, np.int32)
    return tuple(cuda.to_device(np.zeros(sh, dt)) for sh, dt in zip(decode_scratch_shapes(n_head, head_dim, n_split),
                                                                     dts))


def choose_n_split(ctx: int, n_kv_head: int, n_sm: int = 132) -> int:
    """A split count for attention_decode: about 4 blocks per SM at the full context, chunks of >= MIN_CHUNK keys."""
    want = max(1, (4 * n_sm) // max(1, n_kv_head))
    return int(max(1, min(_MAX_SPLIT, want, -(-ctx // MIN_CHUNK))))


# -- the exponential ---------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _exp_exact(x):
    return math.exp(x)


if config.ENABLE_CUDASIM:
    _exp_fast = _exp_exact
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _exp_fast(x):
        """exp by the SFU (ex2.approx: ~2 ulp near 0, where the weights that matter are): the accurate expf is
        ~20 instructions, and the softmax's 3 exps per head and key were most of a decode step's ~900."""
        return libdevice.fast_expf(x)


_FAST_EXP = True  # the SFU's exp in the softmax and the merges; False: the accurate one (kernel_probe.py's A/B)


# -- warp exchanges ---------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _xor_gpu(v, mask, xb):
    return cuda.shfl_xor_sync(0xFFFFFFFF, v, mask)


@cuda.jit(device=True)
def _bcast_gpu(v, src, xb):
    return cuda.shfl_sync(0xFFFFFFFF, v, src)


@cuda.jit(device=True)
def _xor_sim(v, mask, xb):
    tid = cuda.threadIdx.x
    xb[tid] = v
    cuda.syncthreads()
    r = xb[tid ^ mask]
    cuda.syncthreads()
    return r


@cuda.jit(device=True)
def _bcast_sim(v, src, xb):
    tid = cuda.threadIdx.x
    xb[tid] = v
    cuda.syncthreads()
    r = xb[(tid - (tid & 31)) + src]
    cuda.syncthreads()
    return r


# -- kernels (one set per head_dim, padded group, warps per block) ----------------------------------------------

_KERNELS: dict = {}


def _kernels(hd: int, gp: int, gps: int, nw: int, sim: bool):
    """(decode, decode with rope, prompt) for head_dim hd, padded groups gp (long contexts and prompts) and gps
    (short contexts) of query heads a block, nw warps."""
    exchange = _SIM_EXCHANGE if sim else "shfl"
    key = (hd, gp, gps, nw, exchange, _BRANCH_FREE, _FAST_EXP)
    ks = _KERNELS.get(key)
    if ks is None:
        ks = _KERNELS[key] = _build(hd, gp, gps, nw, exchange, _exp_fast if _FAST_EXP else _exp_exact)
    return ks


def _keys_per_step(gp: int) -> int:
    """Keys a warp takes per step: their K/V loads are in flight together and their dot products share one
    butterfly (nk * gp <= 32 values); 2 for big groups to bound the registers."""
    return max(1, min(4 if gp < 4 else 2, 32 // gp))


def _attend_source(hd: int, gp: int, nw: int, nk: int, exchange: str) -> str:
    """Straight-line source of the per-block attention loop for these sizes.

    Generated so that every index into the per-lane arrays (q slices, accumulators, K/V rows of the step) is a
    literal: the compiler then keeps them in registers (a loop index would put them in local memory).
    """
    dpl = (hd + 31) // 32
    npair = nk * gp  # (key, head) dot products per step
    lgp = npair.bit_length() - 1
    full = [32 * e + 31 < hd for e in range(dpl)]  # dims slice e is in range for every lane
    o = []
    a = o.append
    a("def attend(q, qrow, hq0, nq, kc, vc, g, j0, j1, scale, smw, slw, so, xb, xs):")
    a("    tid = cuda.threadIdx.x")
    a("    lane = tid & 31")
    a("    w = tid >> 5")
    a(f"    qr = cuda.local.array({gp * dpl}, f32)")
    a(f"    acc = cuda.local.array({gp * dpl}, f32)")
    a(f"    m = cuda.local.array({gp}, f32)")
    a(f"    ls = cuda.local.array({gp}, f32)")
    for nm in ("ka", "va", "kb", "vb"):
        a(f"    {nm} = cuda.local.array({nk * dpl}, f32)")
    a(f"    sc = cuda.local.array({npair}, f32)")
    for h in range(gp):
        a(f"    m[{h}] = -np.inf")
        a(f"    ls[{h}] = f32(0.0)")
        for e in range(dpl):
            i = h * dpl + e
            cond = f"{h} < nq" + ("" if full[e] else f" and lane + {32 * e} < {hd}")
            a(f"    acc[{i}] = f32(0.0)")
            a(f"    qr[{i}] = q[qrow, (hq0 + {h}) * {hd} + lane + {32 * e}] if {cond} else f32(0.0)")

    def load(dst_k, dst_v, base):
        for k in range(nk):
            a(f"        jj = {base} + {k}")
            for e in range(dpl):
                i = k * dpl + e
                cond = "jj < j1" + ("" if full[e] else f" and lane + {32 * e} < {hd}")
                a(f"        if {cond}:")
                a(f"            {dst_k}[{i}] = kc[g, jj, lane + {32 * e}]")
                a(f"            {dst_v}[{i}] = vc[g, jj, lane + {32 * e}]")
                a("        else:")
                a(f"            {dst_k}[{i}] = f32(0.0)")
                a(f"            {dst_v}[{i}] = f32(0.0)")

    a("    ninf = f32(-np.inf)")
    a("    one = f32(1.0)")
    a("    zero = f32(0.0)")
    a(f"    stp = {nw * nk}")
    a(f"    jb = j0 + w * {nk}")
    a("    if True:")
    load("ka", "va", "jb")
    a("    rounds = (j1 - j0 + stp - 1) // stp")
    a("    for it in range(rounds):")
    a(f"        jb = j0 + it * stp + w * {nk}")
    load("kb", "vb", "jb + stp")  # the next step's rows, in flight while this one computes
    for k in range(nk):
        for h in range(gp):
            terms = " + ".join(f"qr[{h * dpl + e}] * ka[{k * dpl + e}]" for e in range(dpl))
            a(f"        sc[{k * gp + h}] = {terms}")
    if exchange == "smem":  # simulator: one shared-memory round
        for p_ in range(npair):
            a(f"        xs[w, lane, {p_}] = sc[{p_}]")
        a("        cuda.syncthreads()")
        for p_ in range(npair):
            a("        t = f32(0.0)")
            a("        for i in range(32):")
            a(f"            t += xs[w, i, {p_}]")
            a(f"        sc[{p_}] = t")
        a("        cuda.syncthreads()")
    else:  # halving butterfly, then the plain one, then every lane gets every sum
        for st in range(lgp):
            half = npair >> (st + 1)
            off = 16 >> st
            a(f"        up = (lane & {off}) != 0")
            for i in range(half):
                a(f"        t = sc[{i}] if up else sc[{i + half}]")
                a(f"        sc[{i}] = (sc[{i + half}] if up else sc[{i}]) + xor(t, {off}, xb)")
        a("        s0 = sc[0]")
        for st in range(lgp, 5):
            a(f"        s0 += xor(s0, {16 >> st}, xb)")
        for p_ in range(npair):
            a(f"        sc[{p_}] = bcast(s0, {p_ << (5 - lgp)}, xb)")
    for k in range(nk):
        a(f"        ok{k} = jb + {k} < j1")
    if not _BRANCH_FREE:
        for h in range(gp):
            a(f"        mn = m[{h}]")
            for k in range(nk):
                a(f"        s{k} = sc[{k * gp + h}] * scale")
                a(f"        if ok{k} and s{k} > mn:")
                a(f"            mn = s{k}")
            a(f"        if mn > m[{h}]:  # rescale only when the max grows (rare after the first keys)")
            a(f"            c = f32(fexp(m[{h}] - mn))")
            a(f"            ls[{h}] *= c")
            for e in range(dpl):
                a(f"            acc[{h * dpl + e}] *= c")
            a(f"            m[{h}] = mn")
            for k in range(nk):
                a(f"        if ok{k}:")
                a(f"            pr = f32(fexp(s{k} - m[{h}]))")
                a(f"            ls[{h}] += pr")
                for e in range(dpl):
                    a(f"            acc[{h * dpl + e}] += pr * va[{k * dpl + e}]")
    else:
        # no branches per head, so the compiler can interleave the heads' exp/FMA chains (masked keys: -inf)
        for h in range(gp):
            for k in range(nk):
                a(f"        s{k} = sc[{k * gp + h}] * scale if ok{k} else ninf")
            a(f"        mn = max(m[{h}], {', '.join(f's{k}' for k in range(nk))})" if nk > 1 else
              f"        mn = max(m[{h}], s0)")
            a(f"        c = f32(fexp(m[{h}] - mn)) if mn > m[{h}] else one")
            a(f"        m[{h}] = mn")
            for k in range(nk):
                a(f"        p{k} = f32(fexp(s{k} - mn)) if ok{k} else zero")
            a(f"        ls[{h}] = ls[{h}] * c + {' + '.join(f'p{k}' for k in range(nk))}")
            for e in range(dpl):
                i = h * dpl + e
                terms = " + ".join(f"p{k} * va[{k * dpl + e}]" for k in range(nk))
                a(f"        acc[{i}] = acc[{i}] * c + {terms}")
    for i in range(nk * dpl):
        a(f"        ka[{i}] = kb[{i}]")
        a(f"        va[{i}] = vb[{i}]")
    # merge the warps: each scales its sums to the block max, then they add into so one warp at a time
    a("    if lane == 0:")
    for h in range(gp):
        a(f"        smw[w, {h}] = m[{h}]")
        a(f"        slw[w, {h}] = ls[{h}]")
    a("    cuda.syncthreads()")
    for h in range(gp):
        a(f"    mx = smw[0, {h}]")
        for r in range(1, nw):
            a(f"    mx = max(mx, smw[{r}, {h}])")
        a(f"    f = f32(fexp(m[{h}] - mx)) if m[{h}] > -np.inf else f32(0.0)")
        for e in range(dpl):
            a(f"    acc[{h * dpl + e}] *= f")
    a(f"    for r in range({nw}):")
    a("        if w == r:")
    for h in range(gp):
        for e in range(dpl):
            i = h * dpl + e
            ind = "            "
            if not full[e]:
                a(f"            if lane + {32 * e} < {hd}:")
                ind += "    "
            a(f"{ind}so[{h}, lane + {32 * e}] = acc[{i}] if r == 0 else so[{h}, lane + {32 * e}] + acc[{i}]")
    a("        cuda.syncthreads()")
    return "\n".join(o) + "\n"


def _build(hd: int, gp: int, gps: int, nw: int, exchange: str, ex):
    nt = 32 * nw
    gmax = max(gp, gps)
    sim = exchange != "shfl"
    smem = exchange == "smem"
    xs_shape = (nw, 32, max(_keys_per_step(gp) * gp, _keys_per_step(gps) * gps)) if smem else (1, 1, 1)
    xor = _xor_sim if sim else _xor_gpu

    def attend_fn(g: int):
        ns = {"cuda": cuda, "np": np, "fexp": ex, "f32": np.float32, "xor": xor,
              "bcast": _bcast_sim if sim else _bcast_gpu}
        src = _attend_source(hd, g, nw, _keys_per_step(g), exchange)
        exec(compile(src, f"<attention hd={hd} gp={g} nw={nw}>", "exec"), ns)
        return cuda.jit(device=True)(ns["attend"])

    attend = attend_fn(gp)
    attend_s = attend if gps == gp else attend_fn(gps)

    @cuda.jit(device=True)
    def wsum(v, xb):
        for m in (16, 8, 4, 2, 1):
            v += xor(v, m, xb)
        return v

    @cuda.jit(device=True)
    def wsync():
        if sim:  # a simulated warp is the whole block (one warp a block wherever the heads are rotated here)
            cuda.syncthreads()
        else:
            cuda.syncwarp()

    norm_rope = kops.norm_rope_fn(32, wsum, wsync)

    @cuda.jit(device=True)
    def max_sum(smw, slw, h):
        """The block's (max, sum of exp(s - max)) of head h from the per-warp values."""
        mx = smw[0, h]
        for r in range(1, nw):
            mx = max(mx, smw[r, h])
        tot = np.float32(0.0)
        if mx > -np.inf:
            for r in range(nw):
                if smw[r, h] > -np.inf:
                    tot += slw[r, h] * ex(smw[r, h] - mx)
        return mx, tot

    def make_decode(rope: bool):
        qs_shape, ks_shape = ((1, gmax * hd), (1, hd)) if rope else ((1, 1), (1, 1))

        @cuda.jit
        def decode_partial(q, kc, vc, pos0, scale, part_m, part_l, part_o, cnt, out, n_split, grp, n_sub_l,
                           min_chunk_l, n_sub_s, min_chunk_s, short_keys,
                           kx, vx, qn, kn, mode, eps, mult, mscale, neox, n_rot):
            so = cuda.shared.array((gmax, hd), np.float32)
            smw = cuda.shared.array((nw, gmax), np.float32)
            slw = cuda.shared.array((nw, gmax), np.float32)
            xb = cuda.shared.array(nt, np.float32)
            xs = cuda.shared.array(xs_shape, np.float32)
            qs = cuda.shared.array(qs_shape, np.float32)
            ks = cuda.shared.array(ks_shape, np.float32)
            last = cuda.shared.array(1, np.int32)
            tid = cuda.threadIdx.x
            lane = tid & 31
            w = tid >> 5
            sc = np.float32(scale)
            n = pos0[0] + 1
            # the decomposition of this launch, the same for every block: a short context takes the short form
            # (fewer heads a block, shorter chunks: more blocks in flight), a long one the long form
            short = n <= short_keys
            gpx = gps if short else gp
            n_sub = n_sub_s if short else n_sub_l
            chunk = max(min_chunk_s if short else min_chunk_l, (n + n_split - 1) // n_split)
            nl = (n + chunk - 1) // chunk  # live chunks (<= n_split)
            ntask = kc.shape[0] * n_sub * n_split
            for task in range(cuda.blockIdx.x, ntask, cuda.gridDim.x):
                c = task % n_split
                j0 = c * chunk
                if j0 >= n:  # past the length (the same for the whole block): neither computed nor counted
                    continue
                gs = task // n_split
                g = gs // n_sub
                sub = gs - g * n_sub
                hq0 = g * grp + sub * gpx
                nq = min(gpx, grp - sub * gpx)
                j1 = min(n, j0 + chunk)
                if rope:
                    # QK-norm + rope of the block's query heads (into qs) and, in the blocks of the chunk that
                    # holds the new position, of its key, appended with its value: in place of a launch of
                    # ops.qk_rope_kv before this one (~7 us of a decode layer on an H100). Blocks of one chunk
                    # and kv head write the same bits.
                    p = n - 1
                    invq = np.float32(1.0)
                    invk = np.float32(1.0)
                    if mode == kops.QK_FULL:  # the whole block takes part (a barrier inside)
                        invq = kops._row_inv(q, 0, part_m.shape[0] * hd, eps, xb)
                        invk = kops._row_inv(kx, 0, kc.shape[0] * hd, eps, xb)
                    nh = nq + 1 if j1 == n else nq
                    for hh in range(w, nh, nw):
                        if hh < nq:
                            norm_rope(q, 0, (hq0 + hh) * hd, qn, mode, invq, eps, mult, mscale, neox, n_rot, hd, p,
                                      qs, 0, hh * hd, lane, xb)
                        else:  # float32 -> float16 (round to nearest)
                            norm_rope(kx, 0, g * hd, kn, mode, invk, eps, mult, mscale, neox, n_rot, hd, p, ks, 0,
                                      0, lane, xb)
                            for d in range(lane, hd, 32):
                                kc[g, p, d] = ks[0, d]
                                vc[g, p, d] = vx[0, g * hd + d]
                    cuda.syncthreads()
                    if short:
                        attend_s(qs, 0, 0, nq, kc, vc, g, j0, max(j0, j1), sc, smw, slw, so, xb, xs)
                    else:
                        attend(qs, 0, 0, nq, kc, vc, g, j0, max(j0, j1), sc, smw, slw, so, xb, xs)
                elif short:
                    attend_s(q, 0, hq0, nq, kc, vc, g, j0, max(j0, j1), sc, smw, slw, so, xb, xs)
                else:
                    attend(q, 0, hq0, nq, kc, vc, g, j0, max(j0, j1), sc, smw, slw, so, xb, xs)
                for h in range(tid, nq, nt):
                    mx, tot = max_sum(smw, slw, h)
                    part_m[hq0 + h, c] = mx
                    part_l[hq0 + h, c] = tot
                for idx in range(tid, nq * hd, nt):
                    h = idx // hd
                    d = idx - h * hd
                    part_o[hq0 + h, c, d] = so[h, d]
                # The last block of the head group to finish merges its live chunks (a reduce launch of its own cost
                # ~5 us a layer): each block fences its partials before counting itself, so the last one sees them all.
                cuda.threadfence()
                cuda.syncthreads()
                if tid == 0:
                    last[0] = 1 if cuda.atomic.add(cnt, gs, 1) == nl - 1 else 0
                cuda.syncthreads()
                if last[0] == 1:
                    if tid == 0:
                        cnt[gs] = 0  # zero for the next launch
                    cuda.threadfence()
                    for h in range(tid, nq, nt):  # each live chunk's share of the output, in place of its max
                        mx = np.float32(-np.inf)
                        for cc in range(nl):
                            mx = max(mx, part_m[hq0 + h, cc])
                        tot = np.float32(0.0)
                        for cc in range(nl):
                            tot += part_l[hq0 + h, cc] * ex(part_m[hq0 + h, cc] - mx)
                        inv = np.float32(1.0) / tot
                        for cc in range(nl):
                            part_m[hq0 + h, cc] = ex(part_m[hq0 + h, cc] - mx) * inv
                    cuda.syncthreads()
                    for idx in range(tid, nq * hd, nt):
                        h = idx // hd
                        d = idx - h * hd
                        acc = np.float32(0.0)
                        for cc in range(nl):
                            acc += part_o[hq0 + h, cc, d] * part_m[hq0 + h, cc]
                        out[0, (hq0 + h) * hd + d] = acc
                cuda.syncthreads()

        return decode_partial

    @cuda.jit
    def prompt(q, kc, vc, pos0, scale, out, ntok, grp, n_sub):
        so = cuda.shared.array((gp, hd), np.float32)
        smw = cuda.shared.array((nw, gp), np.float32)
        slw = cuda.shared.array((nw, gp), np.float32)
        xb = cuda.shared.array(nt, np.float32)
        xs = cuda.shared.array(xs_shape, np.float32)
        tid = cuda.threadIdx.x
        sc = np.float32(scale)
        p0 = pos0[0]
        per_tok = kc.shape[0] * n_sub
        for task in range(cuda.blockIdx.x, ntok * per_tok, cuda.gridDim.x):
            t = task // per_tok
            gs = task - t * per_tok
            g = gs // n_sub
            sub = gs - g * n_sub
            hq0 = g * grp + sub * gp
            nq = min(gp, grp - sub * gp)
            attend(q, t, hq0, nq, kc, vc, g, 0, p0 + t + 1, sc, smw, slw, so, xb, xs)
            for idx in range(tid, nq * hd, nt):
                h = idx // hd
                d = idx - h * hd
                mx, tot = max_sum(smw, slw, h)
                out[t, (hq0 + h) * hd + d] = so[h, d] / tot
            cuda.syncthreads()

    return make_decode(False), make_decode(True), prompt


# -- launch helpers ---------------------------------------------------------------------------------------------

def _group(n_head: int, n_kv: int, max_gp: int = 32) -> tuple[int, int, int]:
    """(query heads per kv head, padded group gp <= max_gp (a power of two <= 32), blocks per kv head)."""
    if n_kv <= 0 or n_head % n_kv:
        raise StrataError(f"attention: {n_head} query heads do not split over {n_kv} kv heads")
    grp = n_head // n_kv
    gp = min(1 << (min(grp, 32) - 1).bit_length(), max_gp)
    return grp, gp, (grp + gp - 1) // gp


def attention_decode(q, kc, vc, pos0, scale: float, out, scratch, n_split: int, stream,
                     min_chunk: int = MIN_CHUNK, heads: int | None = None, rope=None, short=None) -> None:
    """One query token at position pos0[0] (sees cache 0..pos0[0]); q, out f32[1, H*hd]; kc, vc f16[Hkv, ctx, hd];
    scratch: decode_scratch(H, hd, n_split). n_split is fixed at capture; chunks hold at least min_chunk keys; a
    block takes at most `heads` query heads (a power of two <= 32; None: DECODE_HEADS). short: (heads, min_chunk,
    max_keys) of the form a context of at most max_keys keys takes instead, decided on the device at every launch
    (None: SHORT; max_keys 0: never). rope: None (q is rotated and the token's key and value are in the cache), or
    (k, v, q_norm, k_norm, mode, eps, mult, mscale, neox, n_rot) as ops.qk_rope_kv takes them: the launch does that
    op's work for this token itself (q is left as it was)."""
    heads = DECODE_HEADS if heads is None else heads
    heads_s, min_chunk_s, short_keys = SHORT if short is None else short
    for hh in (heads, heads_s):
        if hh not in (1, 2, 4, 8, 16, 32):
            raise StrataError(f"attention_decode: {hh} query heads a block (a power of two up to 32)")
    if min(min_chunk, min_chunk_s) < 1 or short_keys < 0:
        raise StrataError(f"attention_decode: chunks of at least {min_chunk} / {min_chunk_s} keys, short form up to "
                          f"{short_keys} keys")
    part_m, part_l, part_o, cnt = scratch
    n_kv, _, hd = kc.shape
    n_head = part_m.shape[0]
    if not 0 < n_split <= _MAX_SPLIT or part_m.shape[1] != n_split or part_o.shape != (n_head, n_split, hd) \
            or cnt.shape[0] < n_head:
        raise StrataError(f"attention_decode: scratch shapes {part_m.shape}/{part_o.shape} do not fit "
                          f"n_split={n_split} (at most {_MAX_SPLIT}), head_dim {hd}")
    grp, gp, n_sub = _group(n_head, n_kv, heads)
    _, gps, n_sub_s = _group(n_head, n_kv, heads_s) if short_keys > 0 else (grp, gp, n_sub)
    sim = bool(config.ENABLE_CUDASIM)
    ntask = n_kv * max(n_sub, n_sub_s) * n_split  # a block a task of either form (the other form's extra blocks
    blocks = min(ntask, 2) if sim else ntask      # return at once)
    nw = _SIM_WARPS if sim else _GPU_WARPS
    plain, fused, _ = _kernels(hd, gp, gps, nw, sim)
    if rope is None:
        kern, extra = plain, (q, q, q[0], q[0], 0, 0.0, q[0], 1.0, False, 0)
    else:
        k, v, q_norm, k_norm, mode, eps, mult, mscale, neox, n_rot = rope
        if not 0 <= n_rot <= hd or n_rot % 2 or k.shape[1] < n_kv * hd or v.shape[1] < n_kv * hd:
            raise StrataError(f"attention_decode: rope over {n_rot} of {hd} dims, k/v rows {k.shape[1]}/"
                              f"{v.shape[1]} for {n_kv} kv heads")
        kern, extra = fused, (k, v, q_norm, k_norm, int(mode), float(eps), mult, float(mscale), bool(neox),
                              int(n_rot))
    kern[blocks, 32 * nw, stream](q, kc, vc, pos0, float(scale), part_m, part_l, part_o, cnt, out, n_split, grp,
                                  n_sub, int(min_chunk), n_sub_s, int(min_chunk_s), int(short_keys), *extra)


def attention_prompt(q, kc, vc, pos0, scale: float, out, ntok: int, stream) -> None:
    """Causal attention of ntok query tokens: token t (position pos0[0]+t) sees cache 0..pos0[0]+t.
    q, out f32[>=ntok, H*hd]; kc, vc f16[Hkv, ctx, hd] already hold the tokens' own keys and values."""
    if ntok <= 0:
        return
    n_kv, _, hd = kc.shape
    n_head = q.shape[1] // hd
    grp, gp, n_sub = _group(n_head, n_kv)
    sim = bool(config.ENABLE_CUDASIM)
    nw = _SIM_WARPS if sim else _GPU_WARPS
    _, _, prompt = _kernels(hd, gp, gp, nw, sim)
    ntask = ntok * n_kv * n_sub
    blocks = min(ntask, 2) if sim else min(ntask, 1 << 20)
    prompt[blocks, 32 * nw, stream](q, kc, vc, pos0, float(scale), out, ntok, grp, n_sub)
