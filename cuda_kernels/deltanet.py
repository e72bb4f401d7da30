"""Gated delta-net (GDN) mixer kernels and the gated-attention output gate on float32 device arrays: the GPU twins of
cpu_kernels/deltanet.py (same math and argument order; see its docstring for the mixer).

As in ops.py: every kernel has a launch helper that takes device arrays, static sizes and a stream; helpers never
allocate, copy or synchronize (they are captured into CUDA graphs); loops are grid-/block-stride, so results do not
depend on the launch size; only the first ntok rows of the token-major arrays are read or written (buffers may be
sized for the largest batch). Under the simulator the helpers launch 1-2 blocks of 32 threads.

Layouts: token-major arrays are 2-D, a token's heads side by side (q, k f32[T, Hk*dk], v, o f32[T, Hv*dv]), as the
projections and the conv write them; they may be column views of one buffer (q = mixed[:, :Hk*dk]: any strides).
3-D C-contiguous arrays [T, H, d] (the CPU kernels' shapes) are accepted too and flattened to 2-D views.

gated_delta_rule: a block owns one value head and a tile of TILE columns of its state S f32[dk, dv] (TILE = 32 on a
GPU: one column per lane, so every state load and store is a fully used, coalesced 128-byte row segment); its NW
warps split the dk rows (warp w owns rows w, w + NW, ...; NW = 8 on a GPU: 16 rows per thread at dk = 128, 256
threads, 128 blocks at Qwen3-Next's Hv = 32, dv = 128). Each thread keeps its rows of its column in registers for the
whole call: the state is read once and written once per call, however many tokens. A decode token therefore moves
2 x 2 MiB of state (read + write, the minimum for an in-place update) plus ~48 KB of q, k, v, g, beta and out. Per
token: the key head's k | q (2 dk floats) are staged in shared memory (loaded one token ahead into registers, so the
loads overlap the previous token's work); each thread takes partial sums over its rows of S^T k, S^T q, |k|^2, |q|^2
and k.q; one shared-memory round and one barrier add the warps' partials (the q/k norms come out of the same round);
then, as the CPU kernel does, delta = beta (v - e^g S^T k^), o = e^g S^T q^ + (k^.q^) delta (the updated state
against q without a second pass) and S = e^g S + k^ delta^T in registers. The staging and partial buffers are
double-buffered by token parity, so one barrier per token suffices. There are no warp shuffles or warp-synchronous
steps anywhere: the simulator runs the same code as a GPU (only TILE and NW differ: 8 x 4 there). The per-thread row
loop is generated as straight-line code per (dk, NW, TILE) so that the compiler keeps the column in registers (a loop
index would put it in local memory); for sm_90 at dk = 128 ptxas reports 167 registers and no spills.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from strata_nb.cuda_kernels.block import block_sum
from strata_nb.cuda_kernels.ops import _launch_1d, _sim
from strata_nb.errors import StrataError

_RED = 128  # threads per block of gated_rmsnorm on a GPU (and its shared buffer; dv = 128 on Qwen3-Next)


def _flat(a, name: str):
    """A 2-D [T, H*d] view of a token-major array: 2-D as is (any strides), 3-D [T, H, d] C-contiguous reshaped."""
    if a.ndim == 2:
        return a
    if a.ndim == 3:
        return a.reshape(a.shape[0], a.shape[1] * a.shape[2])
    raise StrataError(f"deltanet: {name} must be 2-D [T, H*d] or 3-D [T, H, d], got shape {a.shape}")


# -- conv_silu ------------------------------------------------------------------------------------------------------

_CONV_CHUNK = 2 if _sim() else 16  # tokens per thread (at least K-1: only chunk 0 reads the old state)


@cuda.jit(cache=True)
def _conv_silu_k(x, w, state, out, ntok, chunk):
    # One thread per (chunk of tokens, channel), channels fastest (coalesced rows). Every output sums its K taps
    # in the CPU kernel's order (tap 0, the oldest input, first) from 0, whatever the chunk. Only chunk 0 reads the
    # old state (chunk >= K-1), and its thread writes the new state after its outputs: no other thread reads it.
    nch = x.shape[1]
    K = w.shape[1]
    km1 = K - 1
    nchunk = (ntok + chunk - 1) // chunk
    one = np.float32(1.0)
    for idx in range(cuda.grid(1), nchunk * nch, cuda.gridsize(1)):
        ci = idx // nch
        c = idx - ci * nch
        t0 = ci * chunk
        t1 = min(ntok, t0 + chunk)
        for t in range(t0, t1):
            acc = np.float32(0.0)
            for j in range(K):
                p = t + j - km1  # row of x; negative: row km1 + p of the state
                xv = state[km1 + p, c] if p < 0 else x[p, c]
                acc += w[c, j] * xv
            out[t, c] = acc / (one + np.float32(math.exp(-acc)))
        if ci == 0:
            # new row r is xx[ntok + r]; ascending r reads state row ntok + r before it is overwritten (ntok < K-1)
            for r in range(km1):
                p = ntok + r - km1
                state[r, c] = state[km1 + p, c] if p < 0 else x[p, c]


def conv_silu(x, w, state, out, ntok: int, stream) -> None:
    """out = silu(causal depthwise conv1d over time of concat(state, x)) for the first ntok tokens; then state <- the
    last K-1 inputs (in place). x, out f32[>=ntok, C] (any strides); w f32[C, K] (the GGUF's ssm_conv1d.weight);
    state f32[K-1, C], oldest first. out[t, c] = silu(sum_j w[c, j] * xx[t + j, c]) with xx = concat(state, x),
    summed from tap 0 (as cpu_kernels.deltanet.conv_silu)."""
    if w.shape[0] != x.shape[1] or state.shape != (w.shape[1] - 1, x.shape[1]) or w.shape[1] < 1:
        raise StrataError(f"conv_silu: x {x.shape}, w {w.shape}, state {state.shape} do not fit")
    if ntok <= 0:
        return
    chunk = max(_CONV_CHUNK, w.shape[1] - 1)
    b, t = _launch_1d(x.shape[1] * ((ntok + chunk - 1) // chunk), 128)
    _conv_silu_k[b, t, stream](x, w, state, out, ntok, chunk)


# -- gdn_gates ------------------------------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _gdn_gates_k(a, b, a_log_neg, dt_bias, g, beta, ntok):
    nv = a.shape[1]
    one = np.float32(1.0)
    for idx in range(cuda.grid(1), ntok * nv, cuda.gridsize(1)):
        t = idx // nv
        h = idx - t * nv
        x = a[t, h] + dt_bias[h]
        sp = x if x > np.float32(20.0) else np.float32(math.log1p(math.exp(x)))
        g[t, h] = a_log_neg[h] * sp
        beta[t, h] = one / (one + np.float32(math.exp(-b[t, h])))


def gdn_gates(a, b, a_log_neg, dt_bias, g, beta, ntok: int, stream) -> None:
    """g = a_log_neg * softplus(a + dt_bias), beta = sigmoid(b) for the first ntok tokens (torch's softplus,
    threshold 20). a, b f32[>=ntok, Hv] (any strides: columns of a fused ssm_ba output); a_log_neg f32[Hv] (the
    GGUF's ssm_a = -exp(A_log)); dt_bias f32[Hv]; g, beta f32[>=ntok, Hv] out."""
    if ntok <= 0:
        return
    nb, t = _launch_1d(ntok * a.shape[1])
    _gdn_gates_k[nb, t, stream](a, b, a_log_neg, dt_bias, g, beta, ntok)


# -- gated_delta_rule -----------------------------------------------------------------------------------------------

_GDR_TILE = 8 if _sim() else 32  # state columns per block (one per lane on a GPU)
_GDR_WARPS = 4 if _sim() else 8  # row groups per block (warps on a GPU)

_GDR_KERNELS: dict = {}


def _gdr_source(dk: int, nw: int, tile: int) -> str:
    """Straight-line source of the recurrence kernel for these sizes: thread (w, c) owns rows w + nw*r (r < R) of
    column c of its tile; every index into its registers is a literal (R names, no local array)."""
    R = -(-dk // nw)
    nt = nw * tile
    P = -(-2 * dk // nt)  # k/q values of the next token each thread prefetches
    rows = [(r, f"w + {nw * r}", nw * (r + 1) <= dk) for r in range(R)]  # (r, row, in range for every warp)
    o = []
    a = o.append
    a("def gdr(q, k, v, g, beta, state, out, ntok, nkh, tiled, eps):")
    a(f"    red = cuda.shared.array({2 * nw * 2 * tile}, f32)  # [parity, warp, S^T k | S^T q, column]")
    a(f"    nrm = cuda.shared.array({2 * nw * 3}, f32)  # [parity, warp, |k|^2 | |q|^2 | k.q]")
    a(f"    stg = cuda.shared.array({2 * 2 * dk}, f32)  # [parity, k | q of the key head, dk]")
    a("    tid = cuda.threadIdx.x")
    a(f"    w = tid // {tile}")
    a(f"    c = tid - w * {tile}")
    a("    nv = state.shape[0]")
    a("    dv = state.shape[2]")
    a(f"    ntile = (dv + {tile - 1}) // {tile}")
    a("    epsf = f32(eps)")
    a("    one = f32(1.0)")
    a("    zero = f32(0.0)")
    a(f"    rsd = one / f32(math.sqrt({dk}))")
    a("    for task in range(cuda.blockIdx.x, nv * ntile, cuda.gridDim.x):")
    a("        h = task // ntile")
    a(f"        j = (task - h * ntile) * {tile} + c")
    a("        jok = j < dv")
    a("        jc = j if jok else dv - 1  # a lane past dv computes on column dv-1 and writes nothing")
    a("        kh = h % nkh if tiled else h // (nv // nkh)")
    a(f"        kb = kh * {dk}")
    a("        vb = h * dv + jc")
    a("        sh = state[h]")
    for r, row, full in rows:
        a(f"        s{r} = sh[{row}, jc]" if full else f"        s{r} = sh[{row}, jc] if {row} < {dk} else zero")

    def fetch(dst, tok, ind):  # token tok's k | q values of this thread (index tid + nt*p) into dst{p}
        for p in range(P):
            i = f"tid + {nt * p}"
            a(f"{ind}if {i} < {dk}:")
            a(f"{ind}    {dst}{p} = k[{tok}, kb + {i}]")
            a(f"{ind}elif {i} < {2 * dk}:")
            a(f"{ind}    {dst}{p} = q[{tok}, kb + {i} - {dk}]")
            a(f"{ind}else:")
            a(f"{ind}    {dst}{p} = zero")

    def stage(src, par, ind):
        for p in range(P):
            i = f"tid + {nt * p}"
            if nt * p + nt <= 2 * dk:
                a(f"{ind}stg[{par} + {i}] = {src}{p}")
            else:
                a(f"{ind}if {i} < {2 * dk}:")
                a(f"{ind}    stg[{par} + {i}] = {src}{p}")

    a("        if ntok > 0:")
    fetch("f", "0", "            ")
    stage("f", "0", "            ")
    a("        cuda.syncthreads()")
    a("        for t in range(ntok):")
    a(f"            po = (t & 1) * {2 * dk}")
    a(f"            pn = {2 * dk} - po")
    a("            nxt = t + 1 < ntok")
    a("            if nxt:  # the next token's k | q, in flight while this one computes")
    fetch("f", "t + 1", "                ")
    a("            gt = g[t, h]")
    a("            bt = beta[t, h]")
    a("            vt = v[t, vb]")
    for r, row, full in rows:
        if full:
            a(f"            k{r} = stg[po + {row}]")
            a(f"            q{r} = stg[po + {dk} + {row}]")
        else:
            a(f"            k{r} = stg[po + {row}] if {row} < {dk} else zero")
            a(f"            q{r} = stg[po + {dk} + {row}] if {row} < {dk} else zero")
    for nm, expr in (("ak", "s{r} * k{r}"), ("aq", "s{r} * q{r}"), ("kk", "k{r} * k{r}"), ("qq", "q{r} * q{r}"),
                     ("kq", "k{r} * q{r}")):
        a(f"            {nm} = " + " + ".join(expr.format(r=r) for r in range(R)))
    a(f"            pb = (t & 1) * {nw}")
    a(f"            red[((pb + w) * 2) * {tile} + c] = ak")
    a(f"            red[((pb + w) * 2 + 1) * {tile} + c] = aq")
    a("            if c == 0:")
    a("                nrm[(pb + w) * 3] = kk")
    a("                nrm[(pb + w) * 3 + 1] = qq")
    a("                nrm[(pb + w) * 3 + 2] = kq")
    a("            if nxt:  # the other half: its last reader was token t-1, before the previous barrier")
    stage("f", "pn", "                ")
    a("            cuda.syncthreads()  # double-buffered by parity: the next token writes the other halves")
    a("            ak = " + " + ".join(f"red[((pb + {x}) * 2) * {tile} + c]" for x in range(nw)))
    a("            aq = " + " + ".join(f"red[((pb + {x}) * 2 + 1) * {tile} + c]" for x in range(nw)))
    for i, nm in enumerate(("kk", "qq", "kq")):
        a(f"            {nm} = " + " + ".join(f"nrm[(pb + {x}) * 3 + {i}]" for x in range(nw)))
    a("            rk = one / f32(math.sqrt(kk + epsf))")
    a("            rq = one / f32(math.sqrt(qq + epsf)) * rsd")
    a("            dec = f32(math.exp(gt))")
    a("            d = bt * (vt - dec * (ak * rk))")
    a("            if jok:")
    a("                out[t, vb] = dec * (aq * rq) + (kq * rk * rq) * d")
    a("            dr = d * rk")
    for r in range(R):
        a(f"            s{r} = dec * s{r} + k{r} * dr")
    a("        if jok:")
    for r, row, full in rows:
        if full:
            a(f"            sh[{row}, j] = s{r}")
        else:
            a(f"            if {row} < {dk}:")
            a(f"                sh[{row}, j] = s{r}")
    a("        cuda.syncthreads()  # the shared buffers are reused by the next task")
    return "\n".join(o) + "\n"


def _gdr_kernel(dk: int, nw: int, tile: int):
    key = (dk, nw, tile)
    kern = _GDR_KERNELS.get(key)
    if kern is None:
        ns = {"cuda": cuda, "math": math, "f32": np.float32}
        exec(compile(_gdr_source(dk, nw, tile), f"<gated_delta_rule dk={dk} nw={nw} tile={tile}>", "exec"), ns)
        kern = _GDR_KERNELS[key] = cuda.jit(ns["gdr"])
    return kern


def gated_delta_rule(q, k, v, g, beta, state, tiled: bool, eps: float, out, ntok: int, stream) -> None:
    """The gated delta rule over the first ntok tokens, token by token (decode and prompts), as
    cpu_kernels.deltanet.gated_delta_rule: per value head h with key head h % Hk (tiled) or h // (Hv/Hk), q and k
    l2-normalised (x / sqrt(sum x^2 + eps), q also / sqrt(dk)) on the fly (never written),
        S = exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S = S + k_t delta^T;  o_t = S^T q_t.
    q, k f32[>=ntok, Hk*dk]; v, out f32[>=ntok, Hv*dv] (or the 3-D [T, H, d] shapes, C-contiguous); g, beta
    f32[>=ntok, Hv] (the log decay and the sigmoid gate); state f32[Hv, dk, dv], updated in place. A call of n
    tokens reads and writes the state once (module docstring)."""
    nv, dk, dv = state.shape
    q2, k2, v2, o2 = _flat(q, "q"), _flat(k, "k"), _flat(v, "v"), _flat(out, "out")
    nkh = q2.shape[1] // dk if dk else 0
    if (dk == 0 or dv == 0 or nkh == 0 or q2.shape[1] != nkh * dk or k2.shape[1] != nkh * dk or nv % nkh
            or v2.shape[1] != nv * dv or o2.shape[1] != nv * dv or g.shape[1] != nv or beta.shape[1] != nv):
        raise StrataError(f"gated_delta_rule: q {q.shape}, k {k.shape}, v {v.shape}, out {out.shape}, g {g.shape}, "
                          f"beta {beta.shape} do not fit the state {state.shape} [Hv, dk, dv]")
    if ntok <= 0:
        return
    tile, nw = _GDR_TILE, _GDR_WARPS
    ntask = nv * (-(-dv // tile))
    blocks = min(2, ntask) if _sim() else min(ntask, 65535)
    _gdr_kernel(dk, nw, tile)[blocks, tile * nw, stream](q2, k2, v2, g, beta, state, o2, ntok, nkh, bool(tiled),
                                                          float(eps))


# -- gated_rmsnorm --------------------------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _gated_rmsnorm_k(o, z, w, eps, out, nrows, nv):
    buf = cuda.shared.array(_RED, np.float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    dv = w.shape[0]
    one = np.float32(1.0)
    for r in range(cuda.blockIdx.x, nrows, cuda.gridDim.x):
        t = r // nv
        b = (r - t * nv) * dv
        ss = np.float32(0.0)
        for i in range(tid, dv, nt):
            x = o[t, b + i]
            ss += x * x
        tot = block_sum(buf, ss)  # every thread has read its o before anyone writes out (out may be o)
        # as the CPU twin: the mean and eps in float64, the scale in float32
        inv = one / np.float32(math.sqrt(np.float64(tot) / dv + eps))
        for i in range(tid, dv, nt):
            zi = z[t, b + i]
            out[t, b + i] = o[t, b + i] * inv * w[i] * (zi / (one + np.float32(math.exp(-zi))))


def gated_rmsnorm(o, z, w, eps: float, out, ntok: int, stream) -> None:
    """out = rmsnorm(o) * w * silu(z) per head of dv = len(w) values, for the first ntok tokens (as
    cpu_kernels.deltanet.gated_rmsnorm). o, out f32[>=ntok, Hv*dv] (out may be o); z f32[>=ntok, Hv*dv] (any
    strides); 3-D [T, Hv, dv] C-contiguous arrays accepted too; w f32[dv] (ssm_norm.weight, used as is)."""
    dv = w.shape[0]
    o2, z2, out2 = _flat(o, "o"), _flat(z, "z"), _flat(out, "out")
    if dv == 0 or o2.shape[1] % dv or z2.shape[1] != o2.shape[1] or out2.shape[1] != o2.shape[1]:
        raise StrataError(f"gated_rmsnorm: o {o.shape}, z {z.shape}, out {out.shape} are not heads of {dv}")
    if ntok <= 0:
        return
    nv = o2.shape[1] // dv
    nrows = ntok * nv
    b, t = (min(2, nrows), 32) if _sim() else (min(nrows, 65535), _RED)
    _gated_rmsnorm_k[b, t, stream](o2, z2, w, float(eps), out2, nrows, nv)


# -- gated attention: the sigmoid output gate -----------------------------------------------------------------------

@cuda.jit(cache=True)
def _sigmoid_mul_k(o, gate, ntok, hd):
    d = o.shape[1]
    one = np.float32(1.0)
    for idx in range(cuda.grid(1), ntok * d, cuda.gridsize(1)):
        t = idx // d
        i = idx - t * d
        h = i // hd
        gv = gate[t, i + (h + 1) * hd]  # head h's gate: columns [2 hd h + hd, 2 hd (h + 1))
        o[t, i] *= one / (one + np.float32(math.exp(-gv)))


def sigmoid_mul(o, gate, ntok: int, stream, n_head: int | None = None) -> None:
    """o *= sigmoid(gate) for the first ntok tokens (gated attention's output gate, before the output projection).
    o f32[>=ntok, H*hd]; gate: the q projection's output with per-head [q | gate] halves, either 3-D
    f32[>=ntok, H, 2*hd] (C-contiguous) or 2-D f32[>=ntok, H*2*hd] with n_head given; head h's gate is at columns
    [2*hd*h + hd, 2*hd*(h+1)) of the 2-D row."""
    if gate.ndim == 3:
        n_head = gate.shape[1]
    elif n_head is None:
        raise StrataError("sigmoid_mul: a 2-D gate needs n_head")
    g2 = _flat(gate, "gate")
    if n_head <= 0 or o.shape[1] % n_head or g2.shape[1] != 2 * o.shape[1]:
        raise StrataError(f"sigmoid_mul: o {o.shape} and gate {gate.shape} are not {n_head} heads of [q | gate]")
    if ntok <= 0:
        return
    b, t = _launch_1d(ntok * o.shape[1])
    _sigmoid_mul_k[b, t, stream](o, g2, ntok, o.shape[1] // n_head)


@cuda.jit(cache=True)
def _split_q_gate_k(qg, q, ntok, hd):
    d = q.shape[1]
    for idx in range(cuda.grid(1), ntok * d, cuda.gridsize(1)):
        t = idx // d
        i = idx - t * d
        h = i // hd
        q[t, i] = qg[t, i + h * hd]  # head h's q: columns [2 hd h, 2 hd h + hd)


def split_q_gate(qg, q, ntok: int, n_head: int, hd: int, stream) -> None:
    """q[t, h*hd + d] = qg[t, 2*hd*h + d] for the first ntok tokens: the q halves of the q projection's per-head
    [q | gate] output f32[>=ntok, H*2*hd] into a contiguous f32[>=ntok, H*hd] that the attention kernels read."""
    if q.shape[1] != n_head * hd or qg.shape[1] != 2 * n_head * hd:
        raise StrataError(f"split_q_gate: qg {qg.shape}, q {q.shape} are not {n_head} heads of {hd}")
    if ntok <= 0:
        return
    b, t = _launch_1d(ntok * q.shape[1])
    _split_q_gate_k[b, t, stream](qg, q, ntok, hd)
