"""Gated delta-net (GDN) mixer kernels of Qwen3-Next / Qwen3.5-MoE (llama.cpp archs qwen3next, qwen35moe).

Float32 arrays only, C-contiguous inputs; outputs and states are caller-provided and written in place. The mixer:

    qkv = silu(causal depthwise conv1d_K(qkv))             conv_silu (state: the last K-1 inputs)
    q, k f32[T, Hk, dk], v f32[T, Hv, dv] split from qkv
    g = ssm_a * softplus(a + dt_bias), beta = sigmoid(b)    gdn_gates (ssm_a = -exp(A_log), as the GGUF stores it)
    per value head h, S f32[dk, dv], q and k L2-normalised, q / sqrt(dk):
        S = exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S = S + k_t delta^T;  o_t = S^T q_t
    y = rmsnorm(o) * ssm_norm * silu(z)                     gated_rmsnorm

gated_delta_rule runs the recurrence token by token; gated_delta_rule_chunked runs a prompt in chunks (the WY /
UT-transform form of HF's torch_chunk_gated_delta_rule): matrix products within a chunk, the state carried across
chunks. They agree to float32 rounding: at Qwen3-Next's dims (T=512, Hk=16, Hv=32, dk=dv=128) chunked vs
sequential 7.6e-7 relative (outputs and state), each vs HF's function of its form <= 2.0e-6. The CPU engine runs
gated_delta_rule for prompts too (below); the chunked form is the one a GPU prompt path with matrix units takes,
and the tests hold the two forms to each other.

Speed at those dims, 2 threads (this 2-core AMD EPYC box with AVX-512, shared: the minimum over a minute of
interleaved runs), state 64-byte aligned: gated_delta_rule 14.7 ms, gated_delta_rule_chunked 16.6 ms with chunk 16
(24.0 ms with 64, HF's size), one decode token 0.08 ms; state 16 bytes off: 19.4, 19.4 (26.4) and 0.09 ms. So the
chunked form is not faster on this CPU, and gated_delta_rule is the prompt path too; the chunked one is kept,
tested, as the engine's spec asks for it. Why: both forms do the same 3 * dk * dv multiply-adds per token against
the state (S^T k, S^T q and the rank-1 update; per chunk K S, Q S and K^T vn); the chunked form saves only the
per-token decay of S and adds n * (dk + dv) per token for its in-chunk products, and these loops are bound by loads
and stores, not by the products that tensor cores make cheap on a GPU.

Loops over the value dimension take four rows of S per pass (one load and store of an accumulator row per four
rows). A loop that both stored updated rows of S and accumulated them into two other arrays was not vectorized by
LLVM (several times slower), so the sequential kernel updates a block of rows, then reads it back. Rows are 2-D
indexed rather than taken as row views (a view per row and token cost 10-20%). No fastmath, for ops.py's reason:
sums must not depend on how a kernel was compiled.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from strata_nb.cpu_kernels.dot_float import fdot_at

_CONV_BLOCK = 512  # channels per parallel task
_CONV_TRANSPOSE_T = 8  # from this many tokens a task copies its taps time-major first (contiguous loads)


@njit(nogil=True, inline="always")
def _conv_block(x, taps, state, out, u0, nc):
    """conv_silu over channels u0..u0+nc-1; taps[j, c] is w[u0 + c, j]. u0 is unsigned: numba then emits no
    negative-index fix-up, which would keep LLVM from vectorizing the channel loops."""
    ntok = x.shape[0]
    km1 = taps.shape[0] - 1
    for t in range(ntok):
        for c in range(nc):
            out[t, u0 + np.uint64(c)] = 0.0
        for j in range(km1 + 1):
            p = t + j - km1  # row of x; negative: row km1 + p of the state
            if p < 0:
                for c in range(nc):
                    out[t, u0 + np.uint64(c)] += taps[j, c] * state[km1 + p, u0 + np.uint64(c)]
            else:
                for c in range(nc):
                    out[t, u0 + np.uint64(c)] += taps[j, c] * x[p, u0 + np.uint64(c)]
        for c in range(nc):
            y = out[t, u0 + np.uint64(c)]
            out[t, u0 + np.uint64(c)] = y / (np.float32(1.0) + np.float32(math.exp(-y)))
    # New row r is xx[T + r]. Ascending r reads state row T + r before anything overwrites it (T < K-1).
    for r in range(km1):
        p = ntok + r - km1
        if p < 0:
            for c in range(nc):
                state[r, u0 + np.uint64(c)] = state[km1 + p, u0 + np.uint64(c)]
        else:
            for c in range(nc):
                state[r, u0 + np.uint64(c)] = x[p, u0 + np.uint64(c)]


@njit(cache=True, parallel=True)
def conv_silu(x, w, state, out):
    """out = silu(causal depthwise conv1d over time of concat(state, x)); then state <- its last K-1 rows.

    x f32[T, C] (T tokens, C channels); w f32[C, K], the GGUF's ssm_conv1d.weight (HF's Conv1d weight [C, 1, K]
    squeezed); state f32[K-1, C], the K-1 inputs before token 0, oldest first (zeros at sequence start);
    out f32[T, C]. With xx = concat(state, x) along time, out[t, c] = silu(sum_j w[c, j] * xx[t + j, c]):
    tap j = K-1 multiplies the current token, j = 0 the oldest (F.conv1d is a cross-correlation over the
    left-padded input, and ggml_ssm_conv sums the same way). Any T >= 0, T < K-1 included. Parallel over blocks
    of channels; a prompt's task first copies its block of w time-major (K * 512 floats: strided tap loads took
    twice as long at T=512), a decode token's reads w in place.
    """
    ntok, nch = x.shape
    K = w.shape[1]
    for blk in prange((nch + _CONV_BLOCK - 1) // _CONV_BLOCK):
        c0 = blk * _CONV_BLOCK
        nc = min(nch, c0 + _CONV_BLOCK) - c0
        if ntok >= _CONV_TRANSPOSE_T:
            taps = np.empty((K, nc), np.float32)
            for c in range(nc):
                for j in range(K):
                    taps[j, c] = w[c0 + c, j]
            _conv_block(x, taps, state, out, np.uint64(c0), nc)
        else:
            _conv_block(x, w[c0:c0 + nc].T, state, out, np.uint64(c0), nc)


@njit(nogil=True, inline="always")
def _qk_scales(q, k, t, kh, eps):
    """(1/|k_t|, 1/|q_t|/sqrt(dk), k_t.q_t normalised) of key head kh: HF's l2norm is x * rsqrt(sum x^2 + eps).
    The kernels scale rows by these on the fly, so q and k are never written."""
    nk = k.shape[1]
    dk = k.shape[2]
    off = (t * nk + kh) * dk
    rk = np.float32(1.0) / np.float32(math.sqrt(fdot_at(k, off, k, off, dk) + eps))
    rq = np.float32(1.0) / np.float32(math.sqrt(fdot_at(q, off, q, off, dk) + eps))
    rq = rq * (np.float32(1.0) / np.float32(math.sqrt(dk)))
    return rk, rq, fdot_at(k, off, q, off, dk) * rk * rq


@njit(nogil=True, inline="always")
def _key_head(h, nk, nv, tiled):
    """Key head of value head h: llama.cpp's qwen35moe tiles key heads (h % Hk), qwen3next (and HF's
    repeat_interleave) repeats each one Hv/Hk times (h // (Hv/Hk))."""
    return h % nk if tiled else h // (nv // nk)


@njit(nogil=True, inline="always")
def _read4(S, i, k, q, t, kh, rk, rq, acc):
    """acc[0] += S[i:i+4]^T k_t^ and acc[2] += S[i:i+4]^T q_t^ (k, q of token t scaled by rk, rq), four rows a
    pass: the one summation order of every token's reads (a token's output must not depend on its batch)."""
    n0, n1, n2, n3 = k[t, kh, i] * rk, k[t, kh, i + 1] * rk, k[t, kh, i + 2] * rk, k[t, kh, i + 3] * rk
    m0, m1, m2, m3 = q[t, kh, i] * rq, q[t, kh, i + 1] * rq, q[t, kh, i + 2] * rq, q[t, kh, i + 3] * rq
    for j in range(S.shape[1]):
        s0 = S[i, j]
        s1 = S[i + 1, j]
        s2 = S[i + 2, j]
        s3 = S[i + 3, j]
        acc[0, j] += s0 * n0 + s1 * n1 + s2 * n2 + s3 * n3
        acc[2, j] += s0 * m0 + s1 * m1 + s2 * m2 + s3 * m3


@njit(cache=True, nogil=True)
def _gdr_head(q, k, v, g, beta, S, h, kh, eps, acc, out):
    """The recurrence of value head h over all T >= 1 tokens; S f32[dk, dv] its state; acc f32[3, dv] scratch.

    One pass over S per token: the pass that applies token t's update also reads the updated S against k_{t+1}
    and q_{t+1} (acc rows 0 and 2), and o_{t+1} = exp(g) S^T q + (k.q) delta is S_{t+1}^T q_{t+1} without a second
    pass."""
    ntok, _, dk = k.shape
    dv = v.shape[2]
    dk4 = dk - dk % 4
    rk, rq, kq = _qk_scales(q, k, 0, kh, eps)
    for j in range(dv):
        acc[0, j] = 0.0
        acc[2, j] = 0.0
    # summed in the order of the fused pass below (rows by fours, then the rest), so that a token's output does
    # not depend on whether it starts a call or follows another token in it (a prompt in pieces, a rewind)
    for i in range(0, dk4, 4):
        _read4(S, i, k, q, 0, kh, rk, rq, acc)
    for i in range(dk4, dk):
        ki = k[0, kh, i] * rk
        qi = q[0, kh, i] * rq
        for j in range(dv):
            s = S[i, j]
            acc[0, j] += s * ki
            acc[2, j] += s * qi
    for t in range(ntok):
        # acc[0] = S_{t-1}^T k_t and acc[2] = S_{t-1}^T q_t here, before token t's decay; acc[1] <- delta
        dec = np.float32(math.exp(g[t, h]))
        b = beta[t, h]
        for j in range(dv):
            d = b * (v[t, h, j] - dec * acc[0, j])
            acc[1, j] = d
            out[t, h, j] = dec * acc[2, j] + kq * d
        if t + 1 < ntok:
            rk1, rq1, kq = _qk_scales(q, k, t + 1, kh, eps)
            for j in range(dv):
                acc[0, j] = 0.0
                acc[2, j] = 0.0
            for i in range(0, dk4, 4):
                for m in range(i, i + 4):
                    km = k[t, kh, m] * rk
                    for j in range(dv):
                        S[m, j] = dec * S[m, j] + km * acc[1, j]
                _read4(S, i, k, q, t + 1, kh, rk1, rq1, acc)
            for i in range(dk4, dk):
                ki = k[t, kh, i] * rk
                kn = k[t + 1, kh, i] * rk1
                qn = q[t + 1, kh, i] * rq1
                for j in range(dv):
                    s = dec * S[i, j] + ki * acc[1, j]
                    S[i, j] = s
                    acc[0, j] += s * kn
                    acc[2, j] += s * qn
            rk = rk1
        else:
            for i in range(dk):
                ki = k[t, kh, i] * rk
                for j in range(dv):
                    S[i, j] = dec * S[i, j] + ki * acc[1, j]


@njit(cache=True, parallel=True)
def gated_delta_rule(q, k, v, g, beta, state, tiled, eps, out):
    """The gated delta rule token by token (decode, and prompts: the faster form here), parallel over value heads.

    q, k f32[T, Hk, dk]; v f32[T, Hv, dv]; g f32[T, Hv] the log decay (ssm_a * softplus(a + dt_bias)); beta
    f32[T, Hv] (already a sigmoid); state f32[Hv, dk, dv], updated in place; tiled: value head h reads key head
    h % Hk (qwen35moe), else h // (Hv / Hk) (qwen3next); eps: the l2norm epsilon (HF: 1e-6); out f32[T, Hv, dv].
    q and k are normalised on the fly (x / sqrt(sum x^2 + eps), q also / sqrt(dk)), never written. Allocates
    3 * Hv * dv floats of scratch per call. Give state a 32-byte aligned start (64 to be safe): 16 bytes off, as
    numpy sometimes allocates, one head took 1.11 ms instead of 0.80 (T=512, dk=dv=128, one thread).
    """
    nk = k.shape[1]
    nv, dv = v.shape[1], v.shape[2]
    if k.shape[0] == 0:  # _gdr_head reads token 0 before its loop
        return
    acc = np.empty((nv, 3, dv), np.float32)
    for h in prange(nv):
        _gdr_head(q, k, v, g, beta, state[h], h, _key_head(h, nk, nv, tiled), eps, acc[h], out)


@njit(nogil=True, inline="always")
def _axpy_rows(Y, y, c, X, s0, s1):
    """Y[y] += sum over rows s0 <= s < s1 of c[s] X[s] (2-D Y and X, possibly one array), four rows per pass:
    one load and store of Y[y] per four rows."""
    s = s0
    while s + 4 <= s1:
        c0 = c[s]
        c1 = c[s + 1]
        c2 = c[s + 2]
        c3 = c[s + 3]
        for j in range(Y.shape[1]):
            Y[y, j] += c0 * X[s, j] + c1 * X[s + 1, j] + c2 * X[s + 2, j] + c3 * X[s + 3, j]
        s += 4
    while s < s1:
        cs = c[s]
        for j in range(Y.shape[1]):
            Y[y, j] += cs * X[s, j]
        s += 1


@njit(cache=True, nogil=True)
def _gdr_chunks(q, k, v, g, beta, S, h, kh, eps, chunk, A, M, sc, vn, ob, out):
    """Value head h over all T tokens, chunk by chunk; S f32[dk, dv] its state.

    Per chunk of n tokens, gc = cumsum(g), K and Q normalised, D[r, s] = exp(gc_r - gc_s) (r >= s):
        A = strictly lower (beta_r k_r.k_s D),  M = lower (q_r.k_s D)
        vn = (I + A)^-1 (beta * (V - diag(e^gc) K S))   the delta rule's corrections ("v_new" in HF)
        o  = diag(e^gc) Q S + M vn
        S  = e^gc_last S + (diag(e^(gc_last - gc)) K)^T vn
    which is HF's UT transform with the solve applied once to the residual rather than to V and K separately.
    Scratch: A, M f32[chunk, chunk], sc f32[4, chunk], vn, ob f32[chunk, dv] (ob: the outputs, copied to out
    once per chunk so that every hot loop indexes 2-D arrays)."""
    ntok, nk, dk = k.shape
    dv = v.shape[2]
    dk4 = dk - dk % 4
    for c0 in range(0, ntok, chunk):
        n = min(chunk, ntok - c0)
        acc = np.float32(0.0)
        for r in range(n):  # sc rows: 0 gc, 1 1/|k|, 2 1/|q|/sqrt(dk), 3 coefficients
            acc += g[c0 + r, h]
            sc[0, r] = acc
            rk, rq, _ = _qk_scales(q, k, c0 + r, kh, eps)
            sc[1, r] = rk
            sc[2, r] = rq
        for r in range(n):
            offr = ((c0 + r) * nk + kh) * dk
            br = beta[c0 + r, h]
            for s in range(r + 1):
                offs = ((c0 + s) * nk + kh) * dk
                dcy = np.float32(math.exp(sc[0, r] - sc[0, s]))
                M[r, s] = fdot_at(q, offr, k, offs, dk) * sc[2, r] * sc[1, s] * dcy
                if s < r:
                    A[r, s] = br * (fdot_at(k, offr, k, offs, dk) * sc[1, r] * sc[1, s] * dcy)
        # vn = beta * (V - (e^gc K) S) and ob = (e^gc Q) S, four rows of S per pass
        for r in range(n):
            e = np.float32(math.exp(sc[0, r]))
            ek = e * sc[1, r]
            eq = e * sc[2, r]
            for j in range(dv):
                vn[r, j] = v[c0 + r, h, j]
                ob[r, j] = 0.0
            for i in range(0, dk4, 4):
                a0 = k[c0 + r, kh, i] * ek
                a1 = k[c0 + r, kh, i + 1] * ek
                a2 = k[c0 + r, kh, i + 2] * ek
                a3 = k[c0 + r, kh, i + 3] * ek
                b0 = q[c0 + r, kh, i] * eq
                b1 = q[c0 + r, kh, i + 1] * eq
                b2 = q[c0 + r, kh, i + 2] * eq
                b3 = q[c0 + r, kh, i + 3] * eq
                for j in range(dv):
                    s0 = S[i, j]
                    s1 = S[i + 1, j]
                    s2 = S[i + 2, j]
                    s3 = S[i + 3, j]
                    vn[r, j] -= a0 * s0 + a1 * s1 + a2 * s2 + a3 * s3
                    ob[r, j] += b0 * s0 + b1 * s1 + b2 * s2 + b3 * s3
            for i in range(dk4, dk):
                a = k[c0 + r, kh, i] * ek
                b = q[c0 + r, kh, i] * eq
                for j in range(dv):
                    s = S[i, j]
                    vn[r, j] -= a * s
                    ob[r, j] += b * s
            br = beta[c0 + r, h]
            for j in range(dv):
                vn[r, j] *= br
        # (I + A) vn = rhs by forward substitution (unit diagonal), then ob += M vn
        for r in range(1, n):
            for s in range(r):
                sc[3, s] = -A[r, s]
            _axpy_rows(vn, r, sc[3], vn, 0, r)
        for r in range(n):
            _axpy_rows(ob, r, M[r], vn, 0, r + 1)
            for j in range(dv):
                out[c0 + r, h, j] = ob[r, j]
        gl = sc[0, n - 1]
        el = np.float32(math.exp(gl))
        for s in range(n):
            sc[0, s] = np.float32(math.exp(gl - sc[0, s])) * sc[1, s]
        for i in range(dk):
            for j in range(dv):
                S[i, j] *= el
            for s in range(n):
                sc[3, s] = k[c0 + s, kh, i] * sc[0, s]
            _axpy_rows(S, i, sc[3], vn, 0, n)


@njit(cache=True, parallel=True)
def gated_delta_rule_chunked(q, k, v, g, beta, state, tiled, eps, out, chunk=16):
    """gated_delta_rule's result for a prompt, in chunks of `chunk` tokens (matrix products within a chunk, the
    state carried across chunks), parallel over value heads. Arguments as gated_delta_rule's; T need not be a
    multiple of chunk. Allocates (2 chunk + 2 dv + 4) * chunk floats of scratch per value head per call. chunk 16
    was the fastest here (the in-chunk products grow with it); still not faster than gated_delta_rule (module
    docstring)."""
    nk = k.shape[1]
    nv, dv = v.shape[1], v.shape[2]
    A = np.empty((nv, chunk, chunk), np.float32)
    M = np.empty((nv, chunk, chunk), np.float32)
    sc = np.empty((nv, 4, chunk), np.float32)
    vn = np.empty((nv, chunk, dv), np.float32)
    ob = np.empty((nv, chunk, dv), np.float32)
    for h in prange(nv):
        _gdr_chunks(q, k, v, g, beta, state[h], h, _key_head(h, nk, nv, tiled), eps, chunk, A[h], M[h], sc[h],
                    vn[h], ob[h], out)


@njit(cache=True, parallel=True)
def gated_rmsnorm(o, z, w, eps, out):
    """out = rmsnorm(o) * w * silu(z) per head, as HF's Qwen3NextRMSNormGated: x * rsqrt(mean(x^2) + eps) * w.

    o, out f32[T, Hv, dv] (out may be o); z f32[T, Hv, dv] (a view: any strides); w f32[dv], the GGUF's
    ssm_norm.weight used as is: llama.cpp's converter adds 1 to every Qwen3-Next norm weight but this one
    (linear_attn.norm.weight), which HF also multiplies by plainly (not by 1 + w)."""
    ntok, nv, dv = o.shape
    for task in prange(ntok * nv):
        t = task // nv
        h = task - t * nv
        ss = fdot_at(o, task * dv, o, task * dv, dv)
        inv = np.float32(1.0) / np.float32(math.sqrt(ss / dv + eps))
        for i in range(dv):
            zi = z[t, h, i]
            out[t, h, i] = o[t, h, i] * inv * w[i] * (zi / (np.float32(1.0) + np.float32(math.exp(-zi))))


@njit(cache=True, nogil=True)
def gdn_gates(a, b, a_log_neg, dt_bias, g, beta):
    """g = a_log_neg * softplus(a + dt_bias) and beta = sigmoid(b), per token and value head.

    a, b f32[T, Hv] (the ssm_alpha / ssm_beta projections); a_log_neg f32[Hv], the GGUF's ssm_a = -exp(A_log);
    dt_bias f32[Hv] (ssm_dt.bias); g, beta f32[T, Hv] out. softplus as torch's (threshold 20): x above 20 is
    returned as is, else log1p(exp(x)), which neither overflows nor loses small values."""
    ntok, nv = a.shape
    for t in range(ntok):
        for h in range(nv):
            x = a[t, h] + dt_bias[h]
            sp = x if x > np.float32(20.0) else np.float32(math.log1p(math.exp(x)))
            g[t, h] = a_log_neg[h] * sp
            beta[t, h] = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-b[t, h])))
