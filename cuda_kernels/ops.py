"""Elementwise, norm, QK-norm + rope + KV append, and routing kernels on float32 device arrays (the GPU twins of
cpu_kernels/ops.py).

Every kernel has a launch helper that takes device arrays, static sizes and a stream; helpers never allocate, copy or
synchronize (they are captured into CUDA graphs), and every per-token value (the position) is read from a device
array. Loops are grid-/block-stride, so results do not depend on the launch size; under the simulator the helpers
launch 1-2 blocks of 32 threads, on a GPU they pick sizes for speed.
"""
from __future__ import annotations

import math

import numpy as np
from numba import config, cuda

from strata_nb.cuda_kernels.block import block_sum
from strata_nb.errors import StrataError

_MAX_EXPERTS = 1024  # route_topk: experts per token at most (shared probabilities)
_RED = 256  # threads per block of the reduction kernels on a GPU (and the size of their shared buffer)


def _sim() -> bool:
    return bool(config.ENABLE_CUDASIM)


def _grid(n_items: int, threads: int, cap: int = 8192) -> int:
    return max(1, min(cap, (n_items + threads - 1) // threads))


def _launch_1d(n_items: int, threads: int = 256) -> tuple[int, int]:
    """(blocks, threads) of an elementwise grid-stride kernel over n_items."""
    if _sim():
        return min(2, max(1, (n_items + 31) // 32)), 32
    return _grid(n_items, threads), threads


def _launch_rows(nrows: int, threads: int = _RED) -> tuple[int, int]:
    """(blocks, threads) of a block-per-row kernel (a block-stride loop inside each row)."""
    if _sim():
        return min(2, max(1, nrows)), 32
    return max(1, min(nrows, 65535)), threads


# -- rmsnorm --------------------------------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _rmsnorm_k(x, w, eps, out, nrows):
    buf = cuda.shared.array(_RED, np.float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    d = x.shape[1]
    for r in range(cuda.blockIdx.x, nrows, cuda.gridDim.x):
        ss = np.float32(0.0)
        for i in range(tid, d, nt):
            v = x[r, i]
            ss += v * v
        tot = block_sum(buf, ss)
        # as the CPU twin: the mean and eps in float64, the scale in float32
        inv = np.float32(1.0) / np.float32(math.sqrt(np.float64(tot) / d + eps))
        for i in range(tid, d, nt):
            out[r, i] = x[r, i] * inv * w[i]


def rmsnorm(x, w, eps: float, out, nrows: int, stream) -> None:
    """out[r] = x[r] / rms(x[r]) * w for r < nrows; x, out f32[>=nrows, D] (out may be x), w f32[D]."""
    if nrows <= 0:
        return
    b, t = _launch_rows(nrows)
    _rmsnorm_k[b, t, stream](x, w, float(eps), out, nrows)


# -- rope -----------------------------------------------------------------------------------------------------------

def rope_mult(n_rot: int, base: float, freq_scale: float, ext_factor: float, corr_lo: float, corr_hi: float,
              freq_factors, attn_factor: float = 1.0) -> tuple[np.ndarray, float]:
    """Per-pair angle multipliers f64[n_rot/2] and the cos/sin scale, so that angle = position * mult[i].

    The same arithmetic as cpu_kernels.ops.rope_tables (ggml's rope_yarn): theta_extrap = pos * base^(-2i/n_rot) /
    freq_factors[i]; with ext_factor != 0 the YaRN ramp mixes freq_scale * theta_extrap and theta_extrap, which is
    linear in pos, so it folds into mult. mscale = attn_factor (times YaRN's 1 + 0.1 ln(1/freq_scale)).
    """
    if n_rot <= 0 or n_rot % 2:
        raise StrataError(f"rope: n_rot must be a positive even number, got {n_rot}")
    half = n_rot // 2
    ff = np.ones(half) if freq_factors is None else np.asarray(freq_factors, np.float64)
    if ff.shape[0] < half:
        raise StrataError(f"rope: {ff.shape[0]} frequency factors for {half} dimension pairs")
    theta_scale = base ** (-2.0 / n_rot)
    mult = np.empty(half, np.float64)
    mscale = float(attn_factor)
    for i in range(half):
        extrap = theta_scale ** i / ff[i]
        m = freq_scale * extrap
        if ext_factor != 0.0:
            y = (i - corr_lo) / max(0.001, corr_hi - corr_lo)
            ramp = (1.0 - min(1.0, max(0.0, y))) * ext_factor
            m = m * (1.0 - ramp) + extrap * ramp
        mult[i] = m
    if ext_factor != 0.0:
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    return mult, mscale


# -- QK-norm + rope + KV append (the attention block's elementwise part, one launch) ---------------------------

QK_NONE, QK_HEAD, QK_FULL = 0, 1, 2  # no QK-norm, per head (weights [head_dim]), over all heads (weights [H*hd])
_MAX_HD = 256
_QK_WARPS = 1 if _sim() else 4
_QK_LANES = 1 if _sim() else 32
_QK_SHIFT = (_QK_LANES - 1).bit_length()
_QK_THREADS = _QK_WARPS * _QK_LANES  # array shapes must be module constants, not expressions in the kernel

if _sim():
    @cuda.jit(device=True)
    def _warp_sum(v):
        return v  # one-lane warps

    @cuda.jit(device=True)
    def _syncwarp():
        return

    @cuda.jit(device=True)
    def _warp_max(v):
        return v

    @cuda.jit(device=True)
    def _warp_best(v, i):
        return v, i
else:
    @cuda.jit(device=True)
    def _warp_sum(v):
        for m in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, m)
        return v

    @cuda.jit(device=True)
    def _syncwarp():
        cuda.syncwarp()

    @cuda.jit(device=True)
    def _warp_max(v):
        for m in (16, 8, 4, 2, 1):
            v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, m))
        return v

    @cuda.jit(device=True)
    def _warp_best(v, i):
        """The warp's (value, index) with the largest value, ties to the lower index, in every lane."""
        for m in (16, 8, 4, 2, 1):
            ov = cuda.shfl_xor_sync(0xFFFFFFFF, v, m)
            oi = cuda.shfl_xor_sync(0xFFFFFFFF, i, m)
            if ov > v or (ov == v and oi < i):
                v = ov
                i = oi
        return v, i


@cuda.jit(device=True)
def _row_inv(src, t, n, eps, red):
    """1 / rms of src[t, :n] for QK_FULL, by the whole block (as rmsnorm: the mean and eps in float64)."""
    ss = np.float32(0.0)
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        x = src[t, i]
        ss += x * x
    tot = block_sum(red, ss)
    return np.float32(1.0) / np.float32(math.sqrt(np.float64(tot) / n + eps))


def norm_rope_fn(lanes: int, wsum, wsync):
    """norm_rope(src, t, base, nwt, mode, inv, eps, mult, mscale, neox, n_rot, hd, p, buf, row, off, lane, xb): the
    head src[t, base:base+hd] QK-normed (QK_HEAD: by its own rms, weights nwt[:hd]; QK_FULL: times inv, the row's
    1/rms, weights nwt[base:]) and rotated at position p into buf[row, off:off+hd], by one warp of `lanes` lanes
    (wsum(v, xb): the warp's sum in every lane; wsync(): the warp's barrier). Shared by qk_rope_kv and the decode
    attention, which applies it to its own heads before attending: the same arithmetic (bit-identical heads on a
    GPU; the simulator's one-lane warps of qk_rope_kv sum the squares in another order)."""
    @cuda.jit(device=True)
    def norm_rope(src, t, base, nwt, mode, inv, eps, mult, mscale, neox, n_rot, hd, p, buf, row, off, lane, xb):
        if mode == QK_HEAD:
            ss = np.float32(0.0)
            for d in range(lane, hd, lanes):
                x = src[t, base + d]
                ss += x * x
            ss = wsum(ss, xb)
            inv = np.float32(1.0) / np.float32(math.sqrt(np.float64(ss) / hd + eps))
        for d in range(lane, hd, lanes):
            x = src[t, base + d]
            if mode == QK_HEAD:
                x = x * inv * nwt[d]
            elif mode == QK_FULL:
                x = x * inv * nwt[base + d]
            buf[row, off + d] = x
        wsync()
        half = n_rot // 2
        for i in range(lane, half, lanes):
            if neox:
                a = i
                b = i + half
            else:
                a = 2 * i
                b = a + 1
            th = np.float64(p) * mult[i]
            c = np.float32(math.cos(th) * mscale)
            s = np.float32(math.sin(th) * mscale)
            x0 = buf[row, off + a]
            x1 = buf[row, off + b]
            buf[row, off + a] = x0 * c - x1 * s
            buf[row, off + b] = x0 * s + x1 * c
        wsync()
    return norm_rope


@cuda.jit(device=True)
def _wsum_qk(v, xb):
    return _warp_sum(v)


_norm_rope = norm_rope_fn(_QK_LANES, _wsum_qk, _syncwarp)


@cuda.jit(cache=True)
def _qk_rope_kv_k(q, k, v, qw, kw, mode, eps, mult, mscale, neox, n_rot, n_head, n_kv, hd, kc, vc, pos0, ntok):
    # grid (head groups, tokens): each warp owns one head (q heads, then k heads) of one token; the warp of kv head
    # h also appends v[h]. Spread over blocks so that no block walks the heads in turn (a decode token's launch is
    # latency, not throughput), except under QK_FULL: q is rotated in place, so one block per token computes the
    # row's norm before any of its heads is written.
    hb = cuda.shared.array((_QK_WARPS, _MAX_HD), np.float32)
    red = cuda.shared.array(_QK_THREADS, np.float32)
    tid = cuda.threadIdx.x
    lane = tid & (_QK_LANES - 1)
    w = tid >> _QK_SHIFT
    one = np.float32(1.0)
    for t in range(cuda.blockIdx.y, ntok, cuda.gridDim.y):
        p = pos0[0] + t
        invq = one
        invk = one
        if mode == QK_FULL:  # the whole block takes part (a barrier inside), so before any per-warp branch
            invq = _row_inv(q, t, n_head * hd, eps, red)
            invk = _row_inv(k, t, n_kv * hd, eps, red)
        for hh in range(cuda.blockIdx.x * _QK_WARPS + w, n_head + n_kv, cuda.gridDim.x * _QK_WARPS):
            is_q = hh < n_head
            h = hh if is_q else hh - n_head
            base = h * hd
            if is_q:
                _norm_rope(q, t, base, qw, mode, invq, eps, mult, mscale, neox, n_rot, hd, p, hb, w, 0, lane, red)
                for d in range(lane, hd, _QK_LANES):
                    q[t, base + d] = hb[w, d]
            else:  # float32 -> float16 (round to nearest)
                _norm_rope(k, t, base, kw, mode, invk, eps, mult, mscale, neox, n_rot, hd, p, hb, w, 0, lane, red)
                for d in range(lane, hd, _QK_LANES):
                    kc[h, p, d] = hb[w, d]
                    vc[h, p, d] = v[t, base + d]
            _syncwarp()
        cuda.syncthreads()  # hb and red are reused by the next token


def qk_rope_kv(q, k, v, q_norm, k_norm, mode: int, eps: float, mult, mscale: float, neox: bool, n_rot: int,
               n_head: int, n_kv: int, head_dim: int, kc, vc, pos0, ntok: int, stream) -> None:
    """The attention block's elementwise part for ntok tokens at positions pos0[0] + t, in one launch: QK-norm
    (mode QK_HEAD: rmsnorm of each head with weights f32[head_dim]; QK_FULL: of the whole q / k row with weights
    f32[H*hd] / f32[Hkv*hd]; QK_NONE: none, the weights unused), rope of q and k (as rope()), q rotated in place,
    the rotated k and v appended to the float16 caches kc, vc [Hkv, ctx, hd] (as kv_append()). q f32[>=ntok,
    H*hd]; k, v f32[>=ntok, Hkv*hd]."""
    if n_rot > head_dim or head_dim > _MAX_HD:
        raise StrataError(f"qk_rope_kv: n_rot {n_rot} / head_dim {head_dim} unsupported (head_dim at most {_MAX_HD})")
    if ntok <= 0:
        return
    groups = 1 if mode == QK_FULL else -(-(n_head + n_kv) // _QK_WARPS)
    grid = (groups, min(2, ntok) if _sim() else min(ntok, 65535))
    _qk_rope_kv_k[grid, _QK_THREADS, stream](q, k, v, q_norm, k_norm, int(mode), float(eps), mult,
                                                          float(mscale), bool(neox), int(n_rot), int(n_head),
                                                          int(n_kv), int(head_dim), kc, vc, pos0, ntok)


# -- routing --------------------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _lane_best(p, lane, ne):
    """The largest of this lane's probabilities p[lane::lanes] still in play (taken ones are -2), ties to the lower
    id; (-1, ne) when none is left."""
    bv = np.float32(-1.0)
    bi = ne
    for e in range(lane, ne, _QK_LANES):  # ascending ids: a tie keeps the lower one
        if p[e] > bv:
            bv = p[e]
            bi = e
    return bv, bi


@cuda.jit(cache=True)
def _route_topk_k(logits, k, renorm, scale, ids, wts, ntok, pub, x, slot_of, mb_x, mb_ids, mb_wts, mb_slot, done,
                  counter, mb_seq):
    # Warp 0 routes: softmax by shuffles, then k rounds of a warp argmax over the lanes' own best. Each lane owns
    # the experts e = lane mod 32 and keeps its best in registers; after a round only the winner's lane rescans
    # its experts, and the choices wait in shared memory (no global round trip) for the scaled write at the end.
    # The other warps copy the MoE input row to the mailbox meanwhile.
    p = cuda.shared.array(_MAX_EXPERTS, np.float32)
    cv = cuda.shared.array(_MAX_EXPERTS, np.float32)
    ci = cuda.shared.array(_MAX_EXPERTS, np.int32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    lane = tid & (_QK_LANES - 1)
    ne = logits.shape[1]
    sc = np.float32(scale)
    for t in range(cuda.blockIdx.x, ntok, cuda.gridDim.x):
        if pub:
            for i in range(tid, x.shape[1], nt):
                mb_x[t, i] = x[t, i]
        if tid < _QK_LANES:
            m = -np.inf
            for e in range(lane, ne, _QK_LANES):
                m = max(m, logits[t, e])
            m = _warp_max(np.float32(m))
            s = np.float32(0.0)
            for e in range(lane, ne, _QK_LANES):
                pe = np.float32(math.exp(logits[t, e] - m))
                p[e] = pe
                s += pe
            tot = _warp_sum(s)
            for e in range(lane, ne, _QK_LANES):
                p[e] = p[e] / tot
            bv, bi = _lane_best(p, lane, ne)
            wsum = np.float32(0.0)
            for j in range(k):  # the j-th largest probability (ties to the lower id), then taken out
                v, i = _warp_best(bv, bi)
                i = min(i, ne - 1)  # a row of NaNs picks nothing: stay in range
                wsum += v
                if lane == 0:
                    cv[j] = v
                    ci[j] = i
                if (i & (_QK_LANES - 1)) == lane:  # the winner's lane: out of play, and its next best
                    p[i] = np.float32(-2.0)
                    bv, bi = _lane_best(p, lane, ne)
            _syncwarp()
            for j in range(lane, k, _QK_LANES):
                wj = cv[j]
                if renorm:
                    wj = wj / wsum
                wj = wj * sc
                e = ci[j]
                ids[t, j] = e
                wts[t, j] = wj
                if pub:  # the host's copy: the choices and each choice's VRAM slot (-1: the CPU's)
                    mb_ids[t, j] = e
                    mb_wts[t, j] = wj
                    mb_slot[t, j] = slot_of[e]
            _syncwarp()
        cuda.syncthreads()
    if pub:  # the last block to finish rings: counter += 1, written to the host after every block's rows
        cuda.threadfence_system()
        cuda.syncthreads()
        if tid == 0:
            if cuda.atomic.add(done, 0, 1) == cuda.gridDim.x - 1:
                done[0] = 0
                counter[0] += 1
                cuda.threadfence_system()
                mb_seq[0] = counter[0]
                cuda.threadfence_system()


def route_topk(logits, k: int, renorm: bool, scale: float, ids, wts, ntok: int, stream, publish=None) -> None:
    """Softmax over the experts of each token, the top k (ties to the lower id) in descending order, optionally
    renormalized to sum 1, times scale. logits f32[>=ntok, E]; ids int32[>=ntok, k]; wts f32[>=ntok, k].
    publish: None, or (x, slot_of, mailbox arrays, done, counter) to hand the layer to the host in the same
    launch: the MoE input rows x f32[>=ntok, D], ids, weights and each choice's slot slot_of[id] go to the mapped
    mailbox (x, ids, wts, slot), then the last block bumps the device counter int64[1] and writes it to the
    mailbox's seq (done: an int32[1] scratch counter, zero between launches)."""
    if logits.shape[1] > _MAX_EXPERTS or not 0 < k <= logits.shape[1]:
        raise StrataError(f"route_topk: {logits.shape[1]} experts, k={k} unsupported (at most {_MAX_EXPERTS})")
    if ntok <= 0:
        return
    b, t = _launch_rows(ntok, 128)
    if _sim():
        t = 1  # one one-lane warp
    if publish is None:
        z = ids[:1, :1]  # placeholders of the right types, never touched
        pub = (0, wts[:1], z[0], wts[:1], z, wts[:1, :1], z, z[0], z[0], z[0])
    else:
        x, slot_of, mb, done, counter = publish
        pub = (1, x, slot_of, mb["x"], mb["ids"], mb["wts"], mb["slot"], done, counter, mb["seq"])
    _route_topk_k[b, t, stream](logits, k, bool(renorm), float(scale), ids, wts, ntok, *pub)


# -- the MoE of a prompt chunk grouped by expert --------------------------------------------------------------------

_GROUP_THREADS = 32 if _sim() else 1024


def group_tiles_bound(n_entries: int, n_expert: int, toks: int) -> int:
    """Rows of group_experts' tile table at most: every expert's last tile may be partial."""
    return n_entries // toks + n_expert + 1


@cuda.jit(cache=True)
def _group_k(ids, slot_of, ntok, toks, order, tiles, ntiles):
    c = cuda.shared.array(_MAX_EXPERTS, np.int32)  # entries per expert, then the fill position
    st = cuda.shared.array(_MAX_EXPERTS, np.int32)  # the expert's first entry in order
    ts = cuda.shared.array(_MAX_EXPERTS, np.int32)  # the expert's first tile
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    ne, k = slot_of.shape[0], ids.shape[1]
    n = ntok * k
    for e in range(tid, ne, nt):
        c[e] = 0
    cuda.syncthreads()
    for i in range(tid, n, nt):
        e = ids[i // k, i % k]
        if slot_of[e] >= 0:
            cuda.atomic.add(c, e, 1)
    cuda.syncthreads()
    if tid == 0:  # a few hundred experts: a serial scan is a few microseconds
        a = 0
        b = 0
        for e in range(ne):
            st[e] = a
            ts[e] = b
            a += c[e]
            b += (c[e] + toks - 1) // toks
        ntiles[0] = b
    cuda.syncthreads()
    for e in range(tid, ne, nt):
        m = c[e]
        for q in range((m + toks - 1) // toks):
            tiles[ts[e] + q, 0] = slot_of[e]
            tiles[ts[e] + q, 1] = st[e] + q * toks
            tiles[ts[e] + q, 2] = min(toks, m - q * toks)
        c[e] = 0
    cuda.syncthreads()
    for i in range(tid, n, nt):  # an expert's entries in any order: each entry's sums do not depend on it
        e = ids[i // k, i % k]
        if slot_of[e] >= 0:
            order[st[e] + cuda.atomic.add(c, e, 1)] = i


def group_experts(ids, slot_of, ntok: int, toks: int, order, tiles, ntiles, stream) -> None:
    """The entries i = t*k + j (t < ntok) whose expert ids[t, j] has a VRAM slot (slot_of >= 0), grouped by expert
    into `order` (int32[>= ntok*k]); tiles int32[>= group_tiles_bound, 3]: per tile of at most `toks` entries of
    one expert (slot, first index into order, count); ntiles int32[1] the number of tiles. One block."""
    if slot_of.shape[0] > _MAX_EXPERTS:
        raise StrataError(f"group_experts: {slot_of.shape[0]} experts (at most {_MAX_EXPERTS})")
    if ntok <= 0:
        return
    _group_k[1, _GROUP_THREADS, stream](ids, slot_of, ntok, toks, order, tiles, ntiles)


@cuda.jit(cache=True)
def _experts_combine_k(y, ids, wts, slot_of, out, ntok):
    d, k = out.shape[1], ids.shape[1]
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for idx in range(start, ntok * d, stride):
        t = idx // d
        r = idx - t * d
        acc = np.float32(0.0)
        for j in range(k):
            if slot_of[ids[t, j]] >= 0:
                acc += wts[t, j] * y[t * k + j, r]
        out[t, r] += acc


def experts_combine(y, ids, wts, slot_of, out, ntok: int, stream) -> None:
    """out[t] += sum over j (in order) of wts[t, j] * y[t*k + j] over the choices with a VRAM slot: the grouped
    experts' down outputs y f32[>= ntok*k, D] into the residual stream out f32[>= ntok, D]."""
    if ntok <= 0:
        return
    b, t = _launch_1d(ntok * out.shape[1])
    _experts_combine_k[b, t, stream](y, ids, wts, slot_of, out, ntok)


# -- elementwise ----------------------------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _swiglu_k(g, u, out, nrows):
    f = g.shape[1]
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for idx in range(start, nrows * f, stride):
        r = idx // f
        i = idx - r * f
        x = g[r, i]
        out[r, i] = x / (np.float32(1.0) + np.float32(math.exp(min(-x, np.float32(80.0))))) * u[r, i]


def swiglu(g, u, out, nrows: int, stream) -> None:
    """out = silu(g) * u over the first nrows rows of f32[R, F] (out may be g or u)."""
    if nrows <= 0:
        return
    b, t = _launch_1d(nrows * g.shape[1])
    _swiglu_k[b, t, stream](g, u, out, nrows)


@cuda.jit(cache=True)
def _add_k(x, y, ntok):
    d = x.shape[1]
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for idx in range(start, ntok * d, stride):
        t = idx // d
        i = idx - t * d
        x[t, i] += y[t, i]


def add(x, y, ntok: int, stream) -> None:
    """x[t] += y[t] for t < ntok; x, y f32[>=ntok, D]."""
    if ntok <= 0:
        return
    b, t = _launch_1d(ntok * x.shape[1])
    _add_k[b, t, stream](x, y, ntok)


@cuda.jit(cache=True)
def _add_bias_k(x, b, ntok):
    d = x.shape[1]
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for idx in range(start, ntok * d, stride):
        t = idx // d
        i = idx - t * d
        x[t, i] += b[i]


def add_bias(x, b, ntok: int, stream) -> None:
    """x[t] += b for t < ntok; x f32[>=ntok, D], b f32[D] (the QKV biases)."""
    if ntok <= 0:
        return
    nb, t = _launch_1d(ntok * x.shape[1])
    _add_bias_k[nb, t, stream](x, b, ntok)


@cuda.jit(cache=True)
def _sigmoid_gate_k(h, x, g, ntok):
    buf = cuda.shared.array(_RED, np.float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    kdim = x.shape[1]
    d = h.shape[1]
    for t in range(cuda.blockIdx.x, ntok, cuda.gridDim.x):
        s = np.float32(0.0)
        for i in range(tid, kdim, nt):
            s += x[t, i] * g[i]
        dot = block_sum(buf, s)
        gate = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-dot)))
        for i in range(tid, d, nt):
            h[t, i] *= gate


def sigmoid_gate(h, x, g, ntok: int, stream) -> None:
    """h[t] *= sigmoid(x[t] . g) for t < ntok (the shared expert's gate); h f32[>=ntok, D], x f32[>=ntok, K],
    g f32[K]."""
    if ntok <= 0:
        return
    b, t = _launch_rows(ntok)
    _sigmoid_gate_k[b, t, stream](h, x, g, ntok)
