"""The float32 op kernels against plain numpy (float64) formulas, outputs poisoned first."""
from __future__ import annotations

import math

import numpy as np
import pytest

from strata_nb.cpu_kernels import ops
from strata_nb.cpu_kernels.dot_float import FDOT_ACCS, FDOT_W, fdot_f32

RNG = np.random.default_rng(0)


def fdot_order(a: np.ndarray, b: np.ndarray) -> np.float32:
    """dot_float.fdot's summation order in numpy float32 (every step an exactly rounded float32 op)."""
    p = a * b
    n, blk = len(p), FDOT_ACCS * FDOT_W
    acc = np.zeros((FDOT_ACCS, FDOT_W), np.float32)
    n_blk, n_vec = n // blk * blk, n // FDOT_W * FDOT_W
    for i in range(0, n_blk, blk):
        acc += p[i:i + blk].reshape(FDOT_ACCS, FDOT_W)
    for i in range(n_blk, n_vec, FDOT_W):
        acc[0] += p[i:i + FDOT_W]
    tail = np.float32(0.0)
    for i in range(n_vec, n):
        tail = np.float32(tail + p[i])
    v = list(acc)
    while len(v) > 1:
        v = [v[k] + v[k + 1] for k in range(0, len(v), 2)]
    v = v[0]
    while len(v) > 1:
        v = v[:len(v) // 2] + v[len(v) // 2:]
    return np.float32(v[0] + tail)


FDOT_LENGTHS = [0, 1, 7, 15, 16, 17, 32, 63, 64, 65, 80, 100, 128, 129, 1000, 2048, 4099]


@pytest.mark.parametrize("n", FDOT_LENGTHS)
def test_fdot(n):
    """Against the float64 dot: |error| <= 1e-5 * sum|a_i b_i| (float32 rounding along a chain of at most
    n/64 + 3 + 4 + 15 additions is < 100 * 2^-24 ~ 6e-6 of that sum for these lengths). And bit-identical to its
    fixed order replayed in numpy float32."""
    a = RNG.standard_normal(n).astype(np.float32)
    b = RNG.standard_normal(n).astype(np.float32)
    got = fdot_f32(a, b)
    assert isinstance(got, float)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    assert abs(got - a64 @ b64) <= 1e-5 * np.abs(a64 * b64).sum()
    assert np.float32(got).tobytes() == fdot_order(a, b).tobytes()
    with pytest.raises(ValueError):
        fdot_f32(a, np.zeros(n + 1, np.float32))


def test_rmsnorm():
    x = RNG.standard_normal((5, 96)).astype(np.float32)
    w = RNG.standard_normal(96).astype(np.float32)
    out = np.full_like(x, np.nan)
    ops.rmsnorm(x, w, np.float32(1e-6), out)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [64, 96, 2047])
def test_rmsnorm_is_its_formula_exactly(d):
    """The sum of squares in fdot's order, mean and eps in float64, the scale and products in float32: replayed in
    numpy, bit for bit (no fastmath: nothing is reordered, contracted or approximated)."""
    x = RNG.standard_normal((3, d)).astype(np.float32)
    w = RNG.standard_normal(d).astype(np.float32)
    out = np.full_like(x, np.nan)
    ops.rmsnorm(x, w, np.float32(1e-6), out)
    for t in range(3):
        ss = fdot_order(x[t], x[t])
        inv = np.float32(1.0) / np.float32(math.sqrt(float(ss) / d + float(np.float32(1e-6))))
        np.testing.assert_array_equal(out[t], x[t] * inv * w)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("yarn", [False, True])
def test_rope_matches_ggml_formula(neox, yarn):
    n_rot, hd, base = 32, 48, 10000.0  # partial rotary: the last 16 dims pass through
    pos = np.array([0, 1, 7, 300], np.float64)
    ff = np.linspace(1.0, 3.0, n_rot // 2)
    freq_scale, ext, attn = (0.25, 1.0, 0.9) if yarn else (1.0, 0.0, 1.0)
    lo, hi = 3.0, 11.0
    cos, sin = ops.rope_tables(pos, n_rot, base, freq_scale, ext, attn, lo, hi, ff)
    x = RNG.standard_normal((4, 3, hd)).astype(np.float32)
    y = x.copy()
    ops.rope_apply(y, cos, sin, neox)
    ref = x.astype(np.float64).copy()
    for t, p in enumerate(pos):
        for i in range(n_rot // 2):
            th_ex = p * base ** (-2.0 * i / n_rot) / ff[i]
            th, m = freq_scale * th_ex, attn
            if yarn:  # ggml's rope_yarn
                ramp = (1 - min(1, max(0, (i - lo) / max(0.001, hi - lo)))) * ext
                th = th * (1 - ramp) + th_ex * ramp
                m *= 1 + 0.1 * math.log(1 / freq_scale)
            a, b = (i, i + n_rot // 2) if neox else (2 * i, 2 * i + 1)
            x0, x1 = x[t, :, a].astype(np.float64), x[t, :, b].astype(np.float64)
            ref[t, :, a] = (x0 * math.cos(th) - x1 * math.sin(th)) * m
            ref[t, :, b] = (x0 * math.sin(th) + x1 * math.cos(th)) * m
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(y[:, :, n_rot:], x[:, :, n_rot:])


@pytest.mark.parametrize("h,hkv", [(6, 2), (12, 2), (8, 1)])
def test_causal_gqa_attention(h, hkv):
    """Groups of 3, 6 and 8 query heads: a task takes up to ops.ATT_HEADS of a group (6 = 4 + 2)."""
    t, hd, pos0 = 5, 16, 3
    q = RNG.standard_normal((t, h, hd)).astype(np.float32)
    kc = np.zeros((hkv, 16, hd), np.float32)
    vc = np.zeros((hkv, 16, hd), np.float32)
    kc[:, :pos0 + t] = RNG.standard_normal((hkv, pos0 + t, hd))
    vc[:, :pos0 + t] = RNG.standard_normal((hkv, pos0 + t, hd))
    kc[:, pos0 + t:] = np.nan  # never read: beyond the causal horizon
    out = np.full_like(q, np.nan)
    ops.attention(q, kc, vc, pos0, np.float32(0.25), out)
    for i in range(t):
        for j in range(h):
            g = j // (h // hkv)
            s = kc[g, :pos0 + i + 1].astype(np.float64) @ q[i, j] * 0.25
            p = np.exp(s - s.max())
            p /= p.sum()
            np.testing.assert_allclose(out[i, j], p @ vc[g, :pos0 + i + 1], rtol=1e-4, atol=1e-5)


def test_silu_mul():
    g = RNG.standard_normal((3, 40)).astype(np.float32)
    u = RNG.standard_normal((3, 40)).astype(np.float32)
    out = np.full_like(g, np.nan)
    ops.silu_mul(g, u, out)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g.astype(np.float64))) * u, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("renorm", [True, False])
def test_route_softmax_topk(renorm):
    logits = RNG.standard_normal((4, 16)).astype(np.float32)
    logits[1, 3] = logits[1, 9] = 5.0  # a tie: the lower id comes first
    ids = np.full((4, 3), -1, np.int64)
    w = np.full((4, 3), np.nan, np.float32)
    ops.route_softmax_topk(logits, 3, renorm, np.float32(2.0), ids, w)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    for t in range(4):
        order = sorted(range(16), key=lambda e: (-p[t, e], e))[:3]
        assert list(ids[t]) == order
        ref = p[t, order] / (p[t, order].sum() if renorm else 1.0) * 2.0
        np.testing.assert_allclose(w[t], ref, rtol=1e-5)
    assert list(ids[1][:2]) == [3, 9]


def test_split_and_combine():
    ids = np.array([[5, 1], [1, 7], [7, 5], [2, 1]], np.int32)
    plan = ops.plan_buffer(8, 8)
    tallies = [np.zeros((1, 8)), np.zeros((1, 8)), np.zeros((1, 8), np.int64)]
    g, hits = ops.moe_split(ids, np.full(ids.shape, -1, np.int32), 4, 0, plan, *tallies)
    experts, start = plan[ops.PLAN_EXPERT, :g], plan[ops.PLAN_START, :g + 1]
    tok, slot = plan[ops.PLAN_TOK, :8], plan[ops.PLAN_SLOT, :8]
    assert (g, hits) == (4, 0)
    assert list(experts) == [1, 2, 5, 7]
    assert list(start) == [0, 3, 4, 6, 8]
    for g, e in enumerate(experts):
        for j in range(start[g], start[g + 1]):
            assert ids[tok[j], slot[j]] == e
    assert sorted(zip(tok, slot)) == [(t, j) for t in range(4) for j in range(2)]
    y = RNG.standard_normal((8, 300)).astype(np.float32)
    wts = RNG.standard_normal((4, 2)).astype(np.float32)
    out = np.full((4, 300), np.nan, np.float32)
    ops.moe_combine(y, wts, tok, slot, out)
    ref = np.zeros((4, 300))
    for j in range(8):
        ref[tok[j]] += wts[tok[j], slot[j]] * y[j]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_rmsnorm_quant_is_rmsnorm_then_quantize():
    from strata_nb.cpu_kernels import actq

    x = RNG.standard_normal((3, 128)).astype(np.float32)
    w = RNG.standard_normal(128).astype(np.float32)
    out = np.full_like(x, np.nan)
    xq = np.zeros((3, 128), np.int8)
    xd = np.full((3, 4), np.nan, np.float32)
    xs = np.full((3, 8), np.nan, np.float32)
    ops.rmsnorm_quant(x, w, np.float32(1e-6), out, xq, xd, xs)
    ref = np.empty_like(x)
    ops.rmsnorm(x, w, np.float32(1e-6), ref)
    np.testing.assert_array_equal(out, ref)
    q, d, s = actq.quantize(out)
    np.testing.assert_array_equal(xq, q)
    np.testing.assert_array_equal(xd, d)
    np.testing.assert_array_equal(xs, s)


@pytest.mark.parametrize("mode", [ops.QK_NORM_NONE, ops.QK_NORM_HEAD, ops.QK_NORM_FULL])
def test_attention_block_is_the_kernels_in_sequence(mode):
    t, h, hkv, hd, pos0 = 3, 4, 2, 16, 2
    q = RNG.standard_normal((t, h * hd)).astype(np.float32)
    k = RNG.standard_normal((t, hkv * hd)).astype(np.float32)
    v = RNG.standard_normal((t, hkv * hd)).astype(np.float32)
    n = {ops.QK_NORM_NONE: 1, ops.QK_NORM_HEAD: hd, ops.QK_NORM_FULL: None}[mode]
    qn = RNG.standard_normal(n or h * hd).astype(np.float32)
    kn = RNG.standard_normal(n or hkv * hd).astype(np.float32)
    cos, sin = ops.rope_tables(np.arange(pos0, pos0 + t, dtype=np.float64), hd, 1e4, 1.0, 0.0, 1.0, 0.0, 0.0,
                               np.ones(hd // 2))
    kc, vc = np.zeros((hkv, 8, hd), np.float32), np.zeros((hkv, 8, hd), np.float32)
    out = np.full((t, h, hd), np.nan, np.float32)
    ops.attention_block(q.copy(), k.copy(), v.copy(), qn, kn, mode, np.float32(1e-6), cos, sin, True, kc, vc, pos0,
                        np.float32(0.25), out)
    # the same steps, one kernel at a time
    q2, k2 = q.copy(), k.copy()
    if mode == ops.QK_NORM_FULL:
        ops.rmsnorm(q.copy(), qn, np.float32(1e-6), q2)
        ops.rmsnorm(k.copy(), kn, np.float32(1e-6), k2)
    if mode == ops.QK_NORM_HEAD:
        ops.rmsnorm(q.reshape(-1, hd).copy(), qn, np.float32(1e-6), q2.reshape(-1, hd))
        ops.rmsnorm(k.reshape(-1, hd).copy(), kn, np.float32(1e-6), k2.reshape(-1, hd))
    q3, k3 = q2.reshape(t, h, hd), k2.reshape(t, hkv, hd)
    ops.rope_apply(q3, cos, sin, True)
    ops.rope_apply(k3, cos, sin, True)
    kc2, vc2 = np.zeros_like(kc), np.zeros_like(vc)
    ops.kv_write(kc2, vc2, k3, v.reshape(t, hkv, hd), pos0)
    ref = np.empty_like(out)
    ops.attention(q3, kc2, vc2, pos0, np.float32(0.25), ref)
    # Bit-identical: separate compilations of the same steps, but no fastmath, so none reorders a float sum.
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(kc, kc2)


def test_swiglu_quant():
    from strata_nb.cpu_kernels import actq

    g = RNG.standard_normal((3, 64)).astype(np.float32)
    u = RNG.standard_normal((3, 64)).astype(np.float32)
    h = np.full_like(g, np.nan)
    hq, hd, hs = np.zeros((3, 64), np.int8), np.full((3, 2), np.nan, np.float32), np.full((3, 4), np.nan, np.float32)
    ops.swiglu_quant(g, u, h, hq, hd, hs)
    ref = np.empty_like(g)
    ops.silu_mul(g, u, ref)
    np.testing.assert_array_equal(h, ref)
    for a, b in zip((hq, hd, hs), actq.quantize(ref)):
        np.testing.assert_array_equal(a, b)


def test_moe_split():
    """ops.moe_split against numpy: the groups (np.unique of the choices computed here), their entries, the hits,
    and every choice's count added once per expert to row `layer` of each tally; buffers reused with stale
    contents, negative ids skipped."""
    rng = np.random.default_rng(7)
    ne, layer = 16, 1
    plan = ops.plan_buffer(ne, 0)
    plan[:] = 99
    ta, tb, tc = np.full((2, ne), 0.5), np.zeros((2, ne)), np.zeros((2, ne), np.int64)
    for ntok, k in ((1, 4), (3, 4), (5, 2)):
        ids = np.array([rng.choice(ne, k, replace=False) for _ in range(ntok + 1)], np.int32)  # a row past ntok
        ids[0, -1] = -1
        slot = np.where(rng.random(ids.shape) < 0.5, rng.integers(0, 8, ids.shape), -1).astype(np.int32)
        plan = ops.plan_buffer(ne, ntok * k) if plan.shape[1] < ntok * k else plan
        before = ta.copy(), tb.copy(), tc.copy()
        g, nh = ops.moe_split(ids, slot, ntok, layer, plan, ta, tb, tc)
        ids, slot = ids[:ntok], slot[:ntok]
        valid = ids >= 0
        per = np.bincount(ids[valid], minlength=ne)
        for got, was in zip((ta, tb, tc), before):
            np.testing.assert_array_equal(got[layer], was[layer] + per)
            np.testing.assert_array_equal(got[0], was[0])
        cpu = valid & (slot < 0)
        np.testing.assert_array_equal(plan[ops.PLAN_EXPERT, :g], np.unique(ids[cpu]))
        assert nh == int((valid & (slot >= 0)).sum())
        start = plan[ops.PLAN_START, :g + 1]
        n = int(cpu.sum())
        assert start[0] == 0 and start[g] == n
        tok, sl = plan[ops.PLAN_TOK, :n], plan[ops.PLAN_SLOT, :n]
        assert sorted(zip(tok, sl)) == sorted(zip(*np.nonzero(cpu)))
        for i in range(g):
            assert (ids[tok[start[i]:start[i + 1]], sl[start[i]:start[i + 1]]] == plan[ops.PLAN_EXPERT, i]).all()
            assert (np.diff(tok[start[i]:start[i + 1]]) > 0).all()