"""cuda_kernels.ops / attention against their njit twins in cpu_kernels.ops (simulator here, unchanged on a GPU).

Tiny shapes (D=64, 4 query heads of 16 dims over 2 kv heads, a 32-position cache, 8 experts choosing 2): the
simulator runs each thread as a Python thread. Tolerances are float32 rounding with a different summation order.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from numba import cuda

from strata_nb.cpu_kernels import ops as cpu
from strata_nb.cuda_kernels import attention as gatt
from strata_nb.cuda_kernels import ops as gops

D, H, HKV, HD, CTX, E, K = 64, 4, 2, 16, 32, 8, 2


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def dev(a: np.ndarray):
    return cuda.to_device(np.ascontiguousarray(a))


def pos_dev(p: int):
    return dev(np.array([p], np.int32))


@pytest.fixture(scope="module")
def stream():
    return cuda.stream()


@pytest.fixture(scope="module", autouse=True)
def _fast_simulator_barriers():
    """The simulator's block barrier polls its threads under the GIL: a short switch interval makes a barrier
    ~10x cheaper (restored after this module)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)
    yield
    sys.setswitchinterval(old)


def test_rmsnorm_matches_cpu(stream) -> None:
    r = rng(0)
    x = r.standard_normal((5, D)).astype(np.float32) * 3
    w = r.standard_normal(D).astype(np.float32)
    want = np.empty_like(x)
    cpu.rmsnorm(x, w, np.float32(1e-6), want)
    dx, dout = dev(x), dev(np.full_like(x, 7.0))
    gops.rmsnorm(dx, dev(w), 1e-6, dout, 4, stream)  # rows >= nrows untouched
    got = dout.copy_to_host()
    np.testing.assert_allclose(got[:4], want[:4], rtol=2e-6, atol=2e-6)
    assert np.all(got[4] == 7.0)
    # in place, per head (QK-norm): rows are T*heads of head_dim
    xh = x.reshape(-1, HD).copy()
    wh = w[:HD].copy()
    want_h = np.empty_like(xh)
    cpu.rmsnorm(xh, wh, np.float32(1e-5), want_h)
    dxh = dev(xh)
    gops.rmsnorm(dxh, dev(wh), 1e-5, dxh, xh.shape[0], stream)
    np.testing.assert_allclose(dxh.copy_to_host(), want_h, rtol=2e-6, atol=2e-6)


ROPE_CASES = {
    # name: (n_rot, base, freq_scale, ext_factor, attn_factor, corr_lo, corr_hi, with freq factors)
    "plain": (HD, 10000.0, 1.0, 0.0, 1.0, 0.0, 0.0, False),
    "partial": (HD // 2, 500000.0, 1.0, 0.0, 1.0, 0.0, 0.0, False),
    "yarn": (HD, 1000000.0, 0.25, 1.0, 1.0, 1.0, 5.0, False),
    "freq_factors": (HD, 500000.0, 0.5, 0.0, 0.9, 0.0, 0.0, True),
}


def _qk_rope_kv(q, k, v, qn, kn, mode, eps, mult, mscale, neox, n_rot, kc0, vc0, pos0, stream, kv=np.float16):
    """Run qk_rope_kv on copies; returns (q, kc, vc) from the device."""
    ntok = q.shape[0]
    dq, kc, vc = dev(q), dev(kc0.astype(kv)), dev(vc0.astype(kv))
    gops.qk_rope_kv(dq, dev(k), dev(v), dev(qn), dev(kn), mode, eps, dev(mult), mscale, neox, n_rot, H, HKV, HD,
                    kc, vc, pos_dev(pos0), ntok, stream)
    return dq.copy_to_host(), kc.copy_to_host(), vc.copy_to_host()


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_matches_rope_tables(case: str, neox: bool, stream) -> None:
    """qk_rope_kv without QK-norm: q rotated in place, k rotated into the cache at the tokens' positions, as the
    CPU twin rope_tables + rope_apply (cos/sin at float32 precision); dims past n_rot untouched."""
    n_rot, base, fs, ext, attn, lo, hi, with_ff = ROPE_CASES[case]
    r = rng(1)
    ff = (1.0 + r.random(n_rot // 2) * 7.0) if with_ff else np.ones(n_rot // 2)
    ntok, pos0 = 3, 29
    q = r.standard_normal((ntok, H * HD)).astype(np.float32)
    k = r.standard_normal((ntok, HKV * HD)).astype(np.float32)
    positions = np.arange(pos0, pos0 + ntok, dtype=np.float64)
    cos, sin = cpu.rope_tables(positions, n_rot, base, fs, ext, attn, lo, hi, ff)
    want_q, want_k = q.reshape(ntok, H, HD).copy(), k.reshape(ntok, HKV, HD).copy()
    cpu.rope_apply(want_q, cos, sin, neox)
    cpu.rope_apply(want_k, cos, sin, neox)

    mult, mscale = gops.rope_mult(n_rot, base, fs, ext, lo, hi, ff if with_ff else None, attn)
    # the host multipliers reproduce rope_tables' angles (cos/sin at float32 precision)
    th = positions[:, None] * mult[None, :]
    np.testing.assert_allclose(np.cos(th) * mscale, cos, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.sin(th) * mscale, sin, rtol=0, atol=2e-6)

    z = np.zeros((HKV, CTX, HD), np.float32)
    one = np.ones(HD, np.float32)
    got, kc, _ = _qk_rope_kv(q, k, k, one, one, gops.QK_NONE, 1e-6, mult, mscale, neox, n_rot, z, z, pos0, stream,
                             kv=np.float32)
    got = got.reshape(ntok, H, HD)
    np.testing.assert_allclose(got, want_q, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(got[:, :, n_rot:], q.reshape(ntok, H, HD)[:, :, n_rot:])
    np.testing.assert_allclose(kc[:, pos0:pos0 + ntok].transpose(1, 0, 2), want_k, rtol=0, atol=2e-5)


@pytest.mark.parametrize("mode", ["head", "full"])
def test_qk_norm_rope_kv_append(mode: str, stream) -> None:
    """QK-norm per head or over the whole row, then rope (neox), k and v appended to float16 caches at pos0..:
    against cpu.rmsnorm + rope_apply + kv_write, the caches rounded as the GPU stores them; other cache rows
    keep their contents."""
    r = rng(2)
    ntok, pos0, eps = 3, 5, 1e-6
    q = (r.standard_normal((ntok, H * HD)) * 3).astype(np.float32)
    k = (r.standard_normal((ntok, HKV * HD)) * 3).astype(np.float32)
    v = r.standard_normal((ntok, HKV * HD)).astype(np.float32)
    wq = r.standard_normal(HD if mode == "head" else H * HD).astype(np.float32)
    wk = r.standard_normal(HD if mode == "head" else HKV * HD).astype(np.float32)
    nq, nk = np.empty_like(q), np.empty_like(k)
    if mode == "head":
        cpu.rmsnorm(q.reshape(-1, HD), wq, np.float32(eps), nq.reshape(-1, HD))
        cpu.rmsnorm(k.reshape(-1, HD), wk, np.float32(eps), nk.reshape(-1, HD))
    else:
        cpu.rmsnorm(q, wq, np.float32(eps), nq)
        cpu.rmsnorm(k, wk, np.float32(eps), nk)
    positions = np.arange(pos0, pos0 + ntok, dtype=np.float64)
    cos, sin = cpu.rope_tables(positions, HD, 1e6, 1.0, 0.0, 1.0, 0.0, 0.0, np.ones(HD // 2))
    want_q, want_k = nq.reshape(ntok, H, HD), nk.reshape(ntok, HKV, HD)
    cpu.rope_apply(want_q, cos, sin, True)
    cpu.rope_apply(want_k, cos, sin, True)
    kc0 = r.standard_normal((HKV, CTX, HD)).astype(np.float16)
    vc0 = r.standard_normal((HKV, CTX, HD)).astype(np.float16)
    want_kc, want_vc = kc0.astype(np.float32), vc0.astype(np.float32)
    cpu.kv_write(want_kc, want_vc, want_k, v.reshape(ntok, HKV, HD), pos0)
    mult, mscale = gops.rope_mult(HD, 1e6, 1.0, 0.0, 0.0, 0.0, None, 1.0)
    mode_id = gops.QK_HEAD if mode == "head" else gops.QK_FULL
    got, kc, vc = _qk_rope_kv(q, k, v, wq, wk, mode_id, eps, mult, mscale, True, HD, kc0, vc0, pos0, stream)
    np.testing.assert_allclose(got.reshape(ntok, H, HD), want_q, rtol=1e-5, atol=1e-5)
    # float16 storage: equal to the float32 twin rounded, within one half-ulp of the twin's own rounding noise
    np.testing.assert_allclose(kc.astype(np.float32), want_kc.astype(np.float16).astype(np.float32),
                               rtol=2e-3, atol=1e-5)
    np.testing.assert_array_equal(vc, want_vc.astype(np.float16))
    np.testing.assert_array_equal(kc[:, :pos0], kc0[:, :pos0])
    np.testing.assert_array_equal(kc[:, pos0 + ntok:], kc0[:, pos0 + ntok:])


def _cache(seed: int, n_head: int, n_kv: int, hd: int, fill: int):
    r = rng(seed)
    kc = np.zeros((n_kv, CTX, hd), np.float16)
    vc = np.zeros((n_kv, CTX, hd), np.float16)
    kc[:, :fill] = r.standard_normal((n_kv, fill, hd)) * 2
    vc[:, :fill] = r.standard_normal((n_kv, fill, hd))
    return kc, vc


ATT_SHAPES = [(H, HKV, HD), (6, 2, 40)]  # the second: a group of 3 (padded to 4) and a head_dim not a multiple of 32


def _short_form(heads: int, on: bool) -> tuple[int, int, int]:
    """attention_decode's short= for a test: off, or another head count and chunk up to 8 keys (positions 0 and 2
    take it, 13 and CTX - 1 the long form: one scratch serves both)."""
    return (1 if heads != 1 else 2, 3, 8) if on else (heads, 1, 0)


@pytest.mark.parametrize("short", [False, True])
@pytest.mark.parametrize("heads", [32, 2, 1])
@pytest.mark.parametrize("min_chunk", [1, 64])
@pytest.mark.parametrize("shape", ATT_SHAPES)
def test_attention_decode(shape, min_chunk, heads, short, monkeypatch, stream) -> None:
    """Against the CPU kernel, with a kv head's query heads in one block (32: the whole group) or split over
    blocks of 2 (the second block of a group of 3 takes one head) or 1; with short contexts in another form."""
    monkeypatch.setattr(gatt, "DECODE_HEADS", heads)
    nh, nkv, hd = shape
    kc, vc = _cache(3, nh, nkv, hd, CTX)
    scale = 1.0 / math.sqrt(hd)
    n_split = 4
    scratch = gatt.decode_scratch(nh, hd, n_split)
    dkc, dvc = dev(kc), dev(vc)
    r = rng(4)
    pos_d = pos_dev(0)
    # positions: a single key, fewer keys than chunks, chunk boundaries, the full cache; one graph-like setup (the
    # same scratch: the head groups' counts of finished blocks must be back at zero after every launch)
    for pos in (0, 2, 13, CTX - 1):
        q = r.standard_normal((1, nh * hd)).astype(np.float32)
        pos_d.copy_to_device(np.array([pos], np.int32))
        out = cuda.device_array((1, nh * hd), np.float32)
        gatt.attention_decode(dev(q), dkc, dvc, pos_d, scale, out, scratch, n_split, stream, min_chunk,
                              short=_short_form(heads, short))
        want = np.empty((1, nh, hd), np.float32)
        cpu.attention(q.reshape(1, nh, hd), kc.astype(np.float32), vc.astype(np.float32), pos, np.float32(scale),
                      want)
        np.testing.assert_allclose(out.copy_to_host().reshape(1, nh, hd), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(scratch[3].copy_to_host(), 0)


@pytest.mark.parametrize("shape", ATT_SHAPES[:1])
def test_attention_prompt(shape, stream) -> None:
    nh, nkv, hd = shape
    ntok, pos0 = 5, 4
    kc, vc = _cache(5, nh, nkv, hd, pos0 + ntok)
    q = rng(6).standard_normal((ntok, nh * hd)).astype(np.float32)
    scale = 1.0 / math.sqrt(hd)
    out = cuda.device_array((ntok + 1, nh * hd), np.float32)  # a spare row: only ntok are written
    gatt.attention_prompt(dev(q), dev(kc), dev(vc), pos_dev(pos0), scale, out, ntok, stream)
    want = np.empty((ntok, nh, hd), np.float32)
    cpu.attention(q.reshape(ntok, nh, hd), kc.astype(np.float32), vc.astype(np.float32), pos0, np.float32(scale),
                  want)
    np.testing.assert_allclose(out.copy_to_host()[:ntok].reshape(ntok, nh, hd), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,short", [(32, False), (2, False), (32, True)])
@pytest.mark.parametrize("mode,neox,n_rot", [("none", False, 8), ("head", True, None), ("full", True, None)])
@pytest.mark.parametrize("shape", ATT_SHAPES)
def test_attention_decode_rope(shape, mode, neox, n_rot, heads, short, monkeypatch, stream) -> None:
    """attention_decode with rope= (QK-norm, rope and the KV append inside the launch) against qk_rope_kv then
    attention_decode: the same output (1e-5) and caches (the token's key within float16 rounding, its value
    exact, every other row untouched), the new key in the first, a middle and the last chunk; partial rotary;
    position 0 in the short form where short."""
    monkeypatch.setattr(gatt, "DECODE_HEADS", heads)
    nh, nkv, hd = shape
    n_rot = hd if n_rot is None else n_rot
    r = rng(40 + hd)
    kc0, vc0 = _cache(41, nh, nkv, hd, CTX)
    scale, eps, n_split = 1.0 / math.sqrt(hd), 1e-6, 4
    mode_id = {"none": gops.QK_NONE, "head": gops.QK_HEAD, "full": gops.QK_FULL}[mode]
    wq = r.uniform(0.5, 1.5, hd if mode != "full" else nh * hd).astype(np.float32)
    wk = r.uniform(0.5, 1.5, hd if mode != "full" else nkv * hd).astype(np.float32)
    mult, mscale = gops.rope_mult(n_rot, 1e6, 1.0, 0.0, 0.0, 0.0, None, 1.0)
    scr_a, scr_b = gatt.decode_scratch(nh, hd, n_split), gatt.decode_scratch(nh, hd, n_split)
    for pos in (0, 13, CTX - 1):
        q = (r.standard_normal((1, nh * hd)) * 3).astype(np.float32)
        k = (r.standard_normal((1, nkv * hd)) * 3).astype(np.float32)
        v = r.standard_normal((1, nkv * hd)).astype(np.float32)
        args = (dev(wq), dev(wk), mode_id, eps, dev(mult), mscale, neox, n_rot)
        # two launches: q rotated in place, the key and value appended, then attention
        dq, kca, vca, pa = dev(q), dev(kc0), dev(vc0), pos_dev(pos)
        gops.qk_rope_kv(dq, dev(k), dev(v), *args, nh, nkv, hd, kca, vca, pa, 1, stream)
        want = cuda.device_array((1, nh * hd), np.float32)
        gatt.attention_decode(dq, kca, vca, pa, scale, want, scr_a, n_split, stream, 1, short=(heads, 1, 0))
        # one launch
        dq2, kcb, vcb = dev(q), dev(kc0), dev(vc0)
        got = cuda.device_array((1, nh * hd), np.float32)
        gatt.attention_decode(dq2, kcb, vcb, pos_dev(pos), scale, got, scr_b, n_split, stream, 1,
                              rope=(dev(k), dev(v), *args), short=_short_form(heads, short))
        np.testing.assert_allclose(got.copy_to_host(), want.copy_to_host(), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(dq2.copy_to_host(), q)  # q itself is left as it was
        ka, kb = kca.copy_to_host(), kcb.copy_to_host()
        np.testing.assert_allclose(kb[:, pos].astype(np.float32), ka[:, pos].astype(np.float32), rtol=2e-3,
                                   atol=1e-5)
        assert not np.array_equal(kb[:, pos], kc0[:, pos])
        np.testing.assert_array_equal(np.delete(kb, pos, axis=1), np.delete(kc0, pos, axis=1))
        vb = vcb.copy_to_host()
        np.testing.assert_array_equal(vb[:, pos], v.reshape(nkv, hd).astype(np.float16))
        np.testing.assert_array_equal(np.delete(vb, pos, axis=1), np.delete(vc0, pos, axis=1))
    np.testing.assert_array_equal(scr_b[3].copy_to_host(), 0)


@pytest.mark.parametrize("renorm,scale", [(True, 1.0), (False, 2.5)])
def test_route_topk(renorm: bool, scale: float, stream) -> None:
    r = rng(7)
    ntok = 4
    logits = (r.standard_normal((ntok, E)) * 2).astype(np.float32)
    logits[3, 5] = logits[3, 2]  # an exact tie: the lower id ranks first
    ids_w = np.empty((ntok, K), np.int64)
    wts_w = np.empty((ntok, K), np.float32)
    cpu.route_softmax_topk(logits, K, renorm, np.float32(scale), ids_w, wts_w)
    ids, wts = cuda.device_array((ntok, K), np.int32), cuda.device_array((ntok, K), np.float32)
    gops.route_topk(dev(logits), K, renorm, scale, ids, wts, ntok, stream)
    np.testing.assert_array_equal(ids.copy_to_host(), ids_w)
    np.testing.assert_allclose(wts.copy_to_host(), wts_w, rtol=2e-6, atol=1e-7)
    # the tie case really ranks 2 before 5 when both are chosen
    tie = np.zeros((1, E), np.float32)
    tie[0, [5, 2]] = 1.0
    gops.route_topk(dev(tie), K, renorm, scale, ids, wts, 1, stream)
    assert ids.copy_to_host()[0].tolist() == [2, 5]


@pytest.mark.parametrize("ne,k", [(128, 8), (512, 10), (40, 40)])
def test_route_topk_many_experts(ne: int, k: int, stream) -> None:
    """Several experts per lane on a GPU (lanes own ids e mod 32): ties within a lane and across lanes go to the
    lower id, every k up to all the experts, and a row of NaNs stays in range."""
    r = rng(12)
    ntok = 3
    logits = r.standard_normal((ntok, ne)).astype(np.float32)
    logits[0, [1, 33, ne - 1]] = 9.0  # a three-way tie: ids 1 and 33 share lane 1
    logits[1, [0, 32]] = 7.0  # a tie within lane 0
    ids_w = np.empty((ntok, k), np.int64)
    wts_w = np.empty((ntok, k), np.float32)
    cpu.route_softmax_topk(logits, k, True, np.float32(1.0), ids_w, wts_w)
    ids, wts = cuda.device_array((ntok + 1, k), np.int32), cuda.device_array((ntok + 1, k), np.float32)
    gops.route_topk(dev(logits), k, True, 1.0, ids, wts, ntok, stream)
    np.testing.assert_array_equal(ids.copy_to_host()[:ntok], ids_w)
    np.testing.assert_allclose(wts.copy_to_host()[:ntok], wts_w, rtol=2e-6, atol=1e-7)
    assert ids_w[0, :3].tolist() == [1, 33, ne - 1] and ids_w[1, :2].tolist() == [0, 32]
    nan = np.full((1, ne), np.nan, np.float32)
    gops.route_topk(dev(nan), k, True, 1.0, ids, wts, 1, stream)
    got = ids.copy_to_host()[0]
    assert ((got >= 0) & (got < ne)).all()


def test_route_topk_publishes_to_the_mailbox(stream) -> None:
    """With publish, the same launch copies the MoE input rows, the choices and each choice's slot into the
    mapped mailbox, and the last block bumps the counter and the mailbox's sequence number exactly once."""
    from strata_nb.runtime.doorbell import Mailbox

    r = rng(11)
    ntok = 3
    logits = (r.standard_normal((ntok, E)) * 2).astype(np.float32)
    x = r.standard_normal((ntok, D)).astype(np.float32)
    slot_of = np.full(E, -1, np.int32)
    slot_of[[1, 2, 5]] = [0, 2, 1]
    mb = Mailbox(4, D, K)
    done, counter = dev(np.zeros(1, np.int32)), dev(np.array([41], np.int64))
    ids, wts = cuda.device_array((ntok, K), np.int32), cuda.device_array((ntok, K), np.float32)
    for seq in (42, 43):  # twice: the scratch counter is reset for the next launch
        gops.route_topk(dev(logits), K, True, 1.0, ids, wts, ntok, stream,
                        publish=(dev(x), dev(slot_of), mb.device, done, counter))
        stream.synchronize()
        assert mb.seq[0] == seq
    np.testing.assert_array_equal(mb.x[:ntok], x)
    np.testing.assert_array_equal(mb.ids[:ntok], ids.copy_to_host())
    np.testing.assert_array_equal(mb.wts[:ntok], wts.copy_to_host())
    np.testing.assert_array_equal(mb.slot[:ntok], slot_of[ids.copy_to_host()])
    assert done.copy_to_host()[0] == 0 and counter.copy_to_host()[0] == 43


def test_swiglu_and_add(stream) -> None:
    r = rng(8)
    g = (r.standard_normal((3, 40)) * 4).astype(np.float32)
    u = r.standard_normal((3, 40)).astype(np.float32)
    want = np.empty_like(g)
    cpu.silu_mul(g, u, want)
    out = dev(np.zeros_like(g))
    gops.swiglu(dev(g), dev(u), out, 2, stream)
    got = out.copy_to_host()
    np.testing.assert_allclose(got[:2], want[:2], rtol=2e-6, atol=1e-6)
    assert np.all(got[2] == 0)
    x = r.standard_normal((3, D)).astype(np.float32)
    y = r.standard_normal((3, D)).astype(np.float32)
    dx = dev(x)
    gops.add(dx, dev(y), 2, stream)
    np.testing.assert_array_equal(dx.copy_to_host(), np.concatenate([x[:2] + y[:2], x[2:]]))
    b = r.standard_normal(D).astype(np.float32)
    dx = dev(x)
    gops.add_bias(dx, dev(b), 2, stream)
    np.testing.assert_array_equal(dx.copy_to_host(), np.concatenate([x[:2] + b, x[2:]]))


def test_sigmoid_gate(stream) -> None:
    r = rng(10)
    ntok = 3
    h = r.standard_normal((ntok, 40)).astype(np.float32)
    x = r.standard_normal((ntok, D)).astype(np.float32)
    g = (r.standard_normal(D) * 0.3).astype(np.float32)
    dh = dev(h)
    gops.sigmoid_gate(dh, dev(x), dev(g), 2, stream)
    gate = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ g.astype(np.float64))))
    want = h * gate[:, None].astype(np.float32)
    got = dh.copy_to_host()
    np.testing.assert_allclose(got[:2], want[:2], rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(got[2], h[2])


@pytest.mark.parametrize("short", [(4, 1, 0), (2, 1, 8)])
def test_attention_decode_shuffle_butterfly(short, monkeypatch, stream) -> None:
    """The GPU's shuffle butterfly (gp = 4: two halving steps; the short form's gp = 2: one) with the shuffles
    emulated, and two warps merged per block; on a GPU the real shuffles and its own warp count."""
    from numba import config
    if config.ENABLE_CUDASIM:
        monkeypatch.setattr(gatt, "_SIM_EXCHANGE", "emul")
        monkeypatch.setattr(gatt, "_SIM_WARPS", 2)
    nh, nkv, hd = 8, 2, 16
    kc, vc = _cache(11, nh, nkv, hd, 6)
    scale = 1.0 / math.sqrt(hd)
    n_split, pos = 2, 5
    scratch = gatt.decode_scratch(nh, hd, n_split)
    q = rng(12).standard_normal((1, nh * hd)).astype(np.float32)
    out = cuda.device_array((1, nh * hd), np.float32)
    gatt.attention_decode(dev(q), dev(kc), dev(vc), pos_dev(pos), scale, out, scratch, n_split, stream, min_chunk=1,
                          heads=4, short=short)
    want = np.empty((1, nh, hd), np.float32)
    cpu.attention(q.reshape(1, nh, hd), kc.astype(np.float32), vc.astype(np.float32), pos, np.float32(scale), want)
    np.testing.assert_allclose(out.copy_to_host().reshape(1, nh, hd), want, rtol=1e-5, atol=1e-5)


def test_l2_prefetch_reads_one_byte_of_every_sector(stream) -> None:
    """touch/touch_slots read byte 32s of their range for every 32-byte sector s (the XOR of those bytes is the
    check: a skipped or doubled sector changes it), including odd sizes, odd offsets and experts without a slot."""
    from strata_nb.cuda_kernels import prefetch as pf
    r = rng(12)

    def xor(b: np.ndarray) -> int:
        return int(np.bitwise_xor.reduce(b[::32].astype(np.uint32))) if b.size else 0

    for n in (1, 31, 32, 33, 1000, 4097):
        w = r.integers(0, 256, n, dtype=np.uint8)
        out = dev(np.zeros(1, np.uint32))
        pf.touch(dev(w), out, stream)
        assert int(out.copy_to_host()[0]) == xor(w), n
    w2 = r.integers(0, 256, (3, 50), dtype=np.uint8)  # a 2-D matrix is read as its flat bytes
    out = dev(np.zeros(1, np.uint32))
    pf.touch(dev(w2), out, stream)
    assert int(out.copy_to_host()[0]) == xor(w2.reshape(-1))
    slots = r.integers(0, 256, (4, 202), dtype=np.uint8)
    slot_of = np.array([2, -1, 0, 3, -1, 1, -1, -1], np.int32)
    ids = np.array([[1, 3, 2]], np.int32)  # expert 1 has no slot; 3 -> slot 3, 2 -> slot 0
    off, nb = 6, 101
    out = dev(np.zeros(1, np.uint32))
    pf.touch_slots(dev(slots), off, nb, dev(slot_of), dev(ids), out, stream)
    assert int(out.copy_to_host()[0]) == xor(slots[3, off:off + nb]) ^ xor(slots[0, off:off + nb])
