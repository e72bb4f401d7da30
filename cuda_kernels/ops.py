"""Elementwise, norm, rope, routing and combine kernels on float32 device arrays (the GPU twins of cpu_kernels/ops.py).

Every kernel has a launch helper that takes device arrays, static sizes and a stream; helpers never allocate, copy or
synchronize (they are captured into CUDA graphs), and every per-token value (the position) is read from a device
array. Loops are grid-/block-stride, so results do not depend on the launch size; under the simulator the helpers
launch 1-2 blocks of 32 threads, on a GPU they pick sizes for speed.
"""
from __future__ import annotations

import math

import numpy as np
from numba import config, cuda

from strata_nb.cuda_kernels.block import block_max, block_sum
from strata_nb.errors import StrataError

_MAX_HALF = 512  # rope: n_rot / 2 at most (shared cos/sin tables)
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


@cuda.jit(cache=True)
def _rope_k(x, n_head, head_dim, n_rot, mult, mscale, neox, pos0, ntok):
    cs = cuda.shared.array(_MAX_HALF, np.float32)
    sn = cuda.shared.array(_MAX_HALF, np.float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    half = n_rot // 2
    for t in range(cuda.blockIdx.x, ntok, cuda.gridDim.x):
        p = np.float64(pos0[0] + t)
        for i in range(tid, half, nt):
            th = p * mult[i]
            cs[i] = np.float32(math.cos(th) * mscale)
            sn[i] = np.float32(math.sin(th) * mscale)
        cuda.syncthreads()
        for idx in range(tid, n_head * half, nt):
            h = idx // half
            i = idx - h * half
            if neox:
                a = h * head_dim + i
                b = a + half
            else:
                a = h * head_dim + 2 * i
                b = a + 1
            x0 = x[t, a]
            x1 = x[t, b]
            c = cs[i]
            s = sn[i]
            x[t, a] = x0 * c - x1 * s
            x[t, b] = x0 * s + x1 * c
        cuda.syncthreads()


def rope(x, n_head: int, head_dim: int, n_rot: int, mult, mscale: float, neox: bool, pos0, ntok: int,
         stream) -> None:
    """Rotate x f32[>=ntok, n_head*head_dim] in place: token t at position pos0[0] + t, pair i by the angle
    float64(pos) * mult[i] (mult f64[n_rot/2] from rope_mult), cos/sin scaled by mscale. neox pairs (i, i+n_rot/2),
    else (2i, 2i+1); dims >= n_rot untouched."""
    if n_rot // 2 > _MAX_HALF or n_rot > head_dim:
        raise StrataError(f"rope: n_rot {n_rot} unsupported (head_dim {head_dim}, at most {2 * _MAX_HALF})")
    if ntok <= 0:
        return
    b, t = _launch_rows(ntok, 128)
    _rope_k[b, t, stream](x, n_head, head_dim, n_rot, mult, float(mscale), bool(neox), pos0, ntok)


# -- KV cache append --------------------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _kv_append_k(k, v, kc, vc, pos0, ntok):
    nkv = kc.shape[0]
    hd = kc.shape[2]
    row = nkv * hd
    p0 = pos0[0]
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for idx in range(start, ntok * row, stride):
        t = idx // row
        r = idx - t * row
        h = r // hd
        d = r - h * hd
        kc[h, p0 + t, d] = k[t, r]  # float32 -> float16 (round to nearest)
        vc[h, p0 + t, d] = v[t, r]


def kv_append(k, v, kc, vc, pos0, ntok: int, stream) -> None:
    """kc[h, pos0[0]+t, :] = k[t, h*hd:(h+1)*hd] (and vc from v) for t < ntok; k, v f32[>=ntok, Hkv*hd];
    kc, vc f16[Hkv, ctx, hd]. The caller keeps pos0[0] + ntok <= ctx."""
    if ntok <= 0:
        return
    b, t = _launch_1d(ntok * kc.shape[0] * kc.shape[2])
    _kv_append_k[b, t, stream](k, v, kc, vc, pos0, ntok)


# -- routing --------------------------------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _route_topk_k(logits, k, renorm, scale, ids, wts, ntok):
    buf = cuda.shared.array(_RED, np.float32)
    p = cuda.shared.array(_MAX_EXPERTS, np.float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    ne = logits.shape[1]
    sc = np.float32(scale)
    for t in range(cuda.blockIdx.x, ntok, cuda.gridDim.x):
        m = -np.inf
        for e in range(tid, ne, nt):
            m = max(m, logits[t, e])
        m = block_max(buf, np.float32(m))
        s = np.float32(0.0)
        for e in range(tid, ne, nt):
            pe = np.float32(math.exp(logits[t, e] - m))
            p[e] = pe
            s += pe
        tot = block_sum(buf, s)
        for e in range(tid, ne, nt):
            p[e] = p[e] / tot
        cuda.syncthreads()
        # the rank of expert e in (probability descending, id ascending) order: the top k write themselves
        for e in range(tid, ne, nt):
            pe = p[e]
            rank = 0
            for f in range(ne):
                pf = p[f]
                if pf > pe or (pf == pe and f < e):
                    rank += 1
            if rank < k:
                ids[t, rank] = e
                wts[t, rank] = pe
        cuda.syncthreads()
        if tid == 0:
            wsum = np.float32(0.0)
            for j in range(k):
                wsum += wts[t, j]
            for j in range(k):
                wj = wts[t, j]
                if renorm:
                    wj = wj / wsum
                wts[t, j] = wj * sc
        cuda.syncthreads()


def route_topk(logits, k: int, renorm: bool, scale: float, ids, wts, ntok: int, stream) -> None:
    """Softmax over the experts of each token, the top k (ties to the lower id) in descending order, optionally
    renormalized to sum 1, times scale. logits f32[>=ntok, E]; ids int32[>=ntok, k]; wts f32[>=ntok, k]."""
    if logits.shape[1] > _MAX_EXPERTS or not 0 < k <= logits.shape[1]:
        raise StrataError(f"route_topk: {logits.shape[1]} experts, k={k} unsupported (at most {_MAX_EXPERTS})")
    if ntok <= 0:
        return
    b, t = _launch_rows(ntok, 128)
    _route_topk_k[b, t, stream](logits, k, bool(renorm), float(scale), ids, wts, ntok)


# -- elementwise ----------------------------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _swiglu_k(g, u, out, nrows):
    f = g.shape[1]
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for idx in range(start, nrows * f, stride):
        r = idx // f
        i = idx - r * f
        x = g[r, i]
        out[r, i] = x / (np.float32(1.0) + np.float32(math.exp(-x))) * u[r, i]


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
def _moe_combine_k(out, y, wts, ids, slot_of, ntok):
    d = out.shape[1]
    k = ids.shape[1]
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for idx in range(start, ntok * d, stride):
        t = idx // d
        i = idx - t * d
        acc = out[t, i]
        for j in range(k):  # in slot order, as the CPU twin: deterministic
            if slot_of[ids[t, j]] >= 0:
                acc += wts[t, j] * y[t * k + j, i]
        out[t, i] = acc


def moe_combine(out, y, wts, ids, slot_of, ntok: int, stream) -> None:
    """out[t] += sum over j (in order) of wts[t, j] * y[t*k + j] for the entries whose expert is resident
    (slot_of[ids[t, j]] >= 0). out f32[>=ntok, D]; y f32[>=ntok*k, D]; wts f32[T, k]; ids int32[T, k]."""
    if ntok <= 0:
        return
    b, t = _launch_1d(ntok * out.shape[1])
    _moe_combine_k[b, t, stream](out, y, wts, ids, slot_of, ntok)


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
