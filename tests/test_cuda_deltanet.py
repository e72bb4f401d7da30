"""cuda_kernels.deltanet against its njit twins in cpu_kernels.deltanet (simulator here, unchanged on a GPU).

Tiny shapes, as the simulator runs each thread as a Python thread: Hk=2 with Hv=4 or 2, dk=dv=16, and one head shape
with dk=18, dv=40 that splits evenly over neither the recurrence kernel's row groups nor its column tiles (on the
simulator's 4 x 8 and on a GPU's 8 x 32); C=96 conv channels; at most 7 tokens, but for one conv case of 37 (several
of the conv kernel's token chunks on a GPU too). Inputs sit in buffers with more rows than ntok, q/k/v as column
views of one conv output (the engine's layout); rows past ntok must stay untouched.

Errors are max|got - want| / max|want| over an array, both float32, summed in another order (and with FMA contraction
on a GPU). Bounds, with the largest value measured in the simulator in parentheses:
  conv_silu                         1e-6 (1.2e-8); its state exact; two calls == one call exactly
  gdn_gates                         1e-6
  gated_delta_rule, output, state   1e-5 (2.7e-7, 2.0e-7); two calls vs one 1e-6 (bit-exact in the simulator)
  gated_rmsnorm                     2e-6
  sigmoid_mul                       2e-6; split_q_gate exact
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
from numba import cuda

from strata_nb.cpu_kernels import deltanet as cdn
from strata_nb.cuda_kernels import deltanet as gdn

EPS = 1e-6
SPARE = 2  # buffer rows past ntok
SENT = 7.0  # what rows past ntok hold, and must still hold


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def dev(a: np.ndarray):
    return cuda.to_device(np.ascontiguousarray(a))


def rel(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


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


def padded(a: np.ndarray) -> np.ndarray:
    """a with SPARE sentinel rows appended (a buffer sized for a larger batch)."""
    return np.concatenate([a, np.full((SPARE,) + a.shape[1:], SENT, a.dtype)])


# ---------------------------------------------------------------------------------------------------- conv_silu
def conv_inputs(seed, T, C, K):
    r = rng(seed)
    x = r.standard_normal((T, C)).astype(np.float32)
    w = (0.5 * r.standard_normal((C, K))).astype(np.float32)
    state = r.standard_normal((K - 1, C)).astype(np.float32)
    return x, w, state


@pytest.mark.parametrize("ntok,K", [(1, 4), (2, 4), (3, 4), (7, 4), (3, 2), (7, 3), (37, 4)])
def test_conv_silu(ntok, K, stream) -> None:
    """Against the CPU kernel from a non-zero state, T < K-1 included (37 tokens: several of the kernel's token
    chunks on a GPU too); the state is a copy of inputs: exact."""
    C = 96
    x, w, state = conv_inputs(ntok * 10 + K, ntok, C, K)
    want_s = state.copy()
    want = np.empty((ntok, C), np.float32)
    cdn.conv_silu(x, w, want_s, want)
    ds, dout = dev(state), dev(np.full((ntok + SPARE, C), SENT, np.float32))
    gdn.conv_silu(dev(padded(x)), dev(w), ds, dout, ntok, stream)
    got = dout.copy_to_host()
    assert rel(got[:ntok], want) <= 1e-6
    assert np.all(got[ntok:] == SENT)
    np.testing.assert_array_equal(ds.copy_to_host(), want_s)


@pytest.mark.parametrize("cut", [1, 2, 5])
def test_conv_silu_two_calls(cut, stream) -> None:
    """A sequence in two calls (the state carried on the device) gives the one call's outputs and state bit for bit:
    every output sums the same products in the same order, whichever call and chunk computes it."""
    T, C, K = 7, 40, 4
    x, w, state = conv_inputs(cut, T, C, K)
    dw = dev(w)
    ds1, out1 = dev(state), dev(np.zeros((T, C), np.float32))
    gdn.conv_silu(dev(x), dw, ds1, out1, T, stream)
    ds2, out2 = dev(state), dev(np.zeros((T, C), np.float32))
    dx = dev(x)
    gdn.conv_silu(dx, dw, ds2, out2, cut, stream)
    gdn.conv_silu(dx[cut:], dw, ds2, out2[cut:], T - cut, stream)
    np.testing.assert_array_equal(out2.copy_to_host(), out1.copy_to_host())
    np.testing.assert_array_equal(ds2.copy_to_host(), ds1.copy_to_host())


# ---------------------------------------------------------------------------------------------------- gdn_gates
def test_gdn_gates(stream) -> None:
    """a and b as column views of one fused projection output; a + dt_bias across softplus' threshold (20)."""
    r = rng(3)
    ntok, nv = 5, 4
    ba = r.uniform(-30.0, 30.0, (ntok + SPARE, 2 * nv)).astype(np.float32)
    ba[0, nv:] = 100.0  # exp overflows float32: the threshold branch
    a_log_neg = (-np.exp(r.uniform(np.log(0.01), np.log(16.0), nv))).astype(np.float32)
    dt_bias = r.standard_normal(nv).astype(np.float32)
    want_g, want_b = np.empty((ntok, nv), np.float32), np.empty((ntok, nv), np.float32)
    cdn.gdn_gates(np.ascontiguousarray(ba[:ntok, nv:]), np.ascontiguousarray(ba[:ntok, :nv]), a_log_neg, dt_bias,
                  want_g, want_b)
    dba = dev(ba)
    g, beta = dev(np.full((ntok + SPARE, nv), SENT, np.float32)), dev(np.full((ntok + SPARE, nv), SENT, np.float32))
    gdn.gdn_gates(dba[:, nv:], dba[:, :nv], dev(a_log_neg), dev(dt_bias), g, beta, ntok, stream)
    gg, gb = g.copy_to_host(), beta.copy_to_host()
    assert rel(gg[:ntok], want_g) <= 1e-6
    assert np.abs(gb[:ntok] - want_b).max() <= 1e-6
    assert np.all(gg[ntok:] == SENT) and np.all(gb[ntok:] == SENT)
    x = ba[:ntok, nv:] + dt_bias
    assert (x > 20).any() and (x < -20).any()


# ------------------------------------------------------------------------------------------------ the recurrence
SHAPES = [  # Hk, Hv, dk, dv
    (2, 4, 16, 16),  # Hv = 2 Hk
    (2, 2, 16, 16),  # Hv = Hk
    (1, 3, 18, 40),  # dk, dv not multiples of the row groups / column tile (both sizes); 3 value heads per key head
]


def gdr_inputs(seed, T, Hk, Hv, dk, dv):
    """Random inputs with realistic gates (g < 0, beta in (0, 1)), a non-zero state, a zero key and query."""
    r = rng(seed)
    q = r.standard_normal((T, Hk, dk)).astype(np.float32)
    k = r.standard_normal((T, Hk, dk)).astype(np.float32)
    v = r.standard_normal((T, Hv, dv)).astype(np.float32)
    a_log = r.uniform(np.log(0.01), np.log(16.0), Hv)
    g = (-np.exp(a_log) * np.log1p(np.exp(r.standard_normal((T, Hv)) - 2.0))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-r.standard_normal((T, Hv))))).astype(np.float32)
    state = (0.3 * r.standard_normal((Hv, dk, dv))).astype(np.float32)
    k[-1, 0] = 0.0  # normalised through eps to zero, not NaN
    if T > 1:  # (one token of one key head: all outputs would be zero)
        q[T // 2, -1] = 0.0
    return q, k, v, g, beta, state


def cpu_rule(q, k, v, g, beta, state, tiled):
    s = state.copy()
    out = np.full(v.shape, np.nan, np.float32)
    cdn.gated_delta_rule(q, k, v, g, beta, s, tiled, np.float32(EPS), out)
    return out, s


def mixed_buffer(q, k, v):
    """q | k | v side by side per token, as the conv writes them, with SPARE sentinel rows."""
    T = q.shape[0]
    return padded(np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=1))


def gpu_rule(q, k, v, g, beta, state, tiled, ntok, stream, calls=(None,)):
    """gated_delta_rule on the device, q/k/v column views of one buffer; calls: cut points splitting the ntok
    tokens over several calls (None: one call). Returns (out [ntok+SPARE, Hv, dv], state)."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    m = dev(mixed_buffer(q, k, v))
    kd = Hk * dk
    dq, dk_, dv_ = m[:, :kd], m[:, kd:2 * kd], m[:, 2 * kd:]
    dg, db = dev(padded(g)), dev(padded(beta))
    ds = dev(state)
    out = dev(np.full((T + SPARE, Hv * dv), SENT, np.float32))
    bounds = [0] + [c for c in calls if c is not None] + [ntok]
    for t0, t1 in zip(bounds[:-1], bounds[1:]):
        gdn.gated_delta_rule(dq[t0:], dk_[t0:], dv_[t0:], dg[t0:], db[t0:], ds, tiled, EPS, out[t0:], t1 - t0,
                             stream)
    return out.copy_to_host().reshape(T + SPARE, Hv, dv), ds.copy_to_host()


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ntok", [1, 3, 7])
def test_gated_delta_rule(ntok, shape, tiled, stream) -> None:
    """Against the CPU's token loop from a non-zero state; rows past ntok untouched; q, k, v, g, beta not written."""
    q, k, v, g, beta, state = gdr_inputs(ntok * 100 + sum(shape), ntok, *shape)
    want_o, want_s = cpu_rule(q, k, v, g, beta, state, tiled)
    got_o, got_s = gpu_rule(q, k, v, g, beta, state, tiled, ntok, stream)
    assert rel(got_o[:ntok], want_o) <= 1e-5
    assert rel(got_s, want_s) <= 1e-5
    assert np.all(got_o[ntok:] == SENT)


def test_gated_delta_rule_tiled_matters(stream) -> None:
    """tiled changes which key head a value head reads (else the tiled cases above could not fail)."""
    q, k, v, g, beta, state = gdr_inputs(5, 3, 2, 4, 16, 16)
    a, _ = gpu_rule(q, k, v, g, beta, state, False, 3, stream)
    b, _ = gpu_rule(q, k, v, g, beta, state, True, 3, stream)
    assert rel(a[:3, 1:3], b[:3, 1:3]) > 1e-2  # heads 1, 2 read key heads 0, 1 untiled and 1, 0 tiled
    np.testing.assert_array_equal(a[:3, 0], b[:3, 0])


@pytest.mark.parametrize("calls", [(3,), (1, 2)])
def test_gated_delta_rule_pieces(calls, stream) -> None:
    """A sequence in several calls (the state carried on the device) gives the one call's outputs and state, and
    both match the CPU."""
    q, k, v, g, beta, state = gdr_inputs(11, 7, 2, 4, 16, 16)
    whole_o, whole_s = gpu_rule(q, k, v, g, beta, state, True, 7, stream)
    part_o, part_s = gpu_rule(q, k, v, g, beta, state, True, 7, stream, calls=calls)
    assert rel(part_o[:7], whole_o[:7]) <= 1e-6
    assert rel(part_s, whole_s) <= 1e-6
    assert np.all(part_o[7:] == SENT)
    want_o, want_s = cpu_rule(q, k, v, g, beta, state, True)
    assert rel(part_o[:7], want_o) <= 1e-5
    assert rel(part_s, want_s) <= 1e-5


def test_gated_delta_rule_3d_and_launch_size(stream) -> None:
    """The CPU's 3-D shapes are accepted (flattened views), and the result does not depend on the grid: the kernel
    launched with one block (a grid-stride loop over all its (head, tile) tasks) gives the same bits."""
    Hk, Hv, dk, dv = 1, 3, 18, 40
    q, k, v, g, beta, state = gdr_inputs(12, 3, Hk, Hv, dk, dv)
    want_o, want_s = gpu_rule(q, k, v, g, beta, state, False, 3, stream)
    ds, out = dev(state), dev(np.zeros((3, Hv, dv), np.float32))
    gdn.gated_delta_rule(dev(q), dev(k), dev(v), dev(g), dev(beta), ds, False, EPS, out, 3, stream)
    got_o, got_s = out.copy_to_host(), ds.copy_to_host()
    assert rel(got_o, want_o[:3]) <= 1e-6  # contiguous arrays vs column views: another compiled specialization
    assert rel(got_s, want_s) <= 1e-6
    kern = gdn._gdr_kernel(dk, gdn._GDR_WARPS, gdn._GDR_TILE)
    ds, out = dev(state), dev(np.zeros((3, Hv * dv), np.float32))
    kern[1, gdn._GDR_TILE * gdn._GDR_WARPS, stream](dev(q.reshape(3, -1)), dev(k.reshape(3, -1)),
                                                    dev(v.reshape(3, -1)), dev(g), dev(beta), ds, out, 3, Hk, False,
                                                    EPS)
    np.testing.assert_array_equal(out.copy_to_host().reshape(3, Hv, dv), got_o)
    np.testing.assert_array_equal(ds.copy_to_host(), got_s)


def test_gated_delta_rule_no_tokens(stream) -> None:
    q, k, v, g, beta, state = gdr_inputs(1, 1, 2, 4, 16, 16)
    _, s = gpu_rule(q, k, v, g, beta, state, False, 0, stream)
    np.testing.assert_array_equal(s, state)


# ------------------------------------------------------------------------------------------------ gated_rmsnorm
@pytest.mark.parametrize("ntok,Hv,dv", [(1, 4, 16), (3, 3, 40)])
def test_gated_rmsnorm(ntok, Hv, dv, stream) -> None:
    """z a column view of a wider buffer (the z projection beside another output); out separate and in place."""
    r = rng(ntok * Hv)
    o = (3.0 * r.standard_normal((ntok, Hv, dv))).astype(np.float32)
    zbig = r.standard_normal((ntok + SPARE, 2 * Hv * dv)).astype(np.float32)
    w = (1.0 + 0.5 * r.standard_normal(dv)).astype(np.float32)
    want = np.empty_like(o)
    cdn.gated_rmsnorm(o, zbig[:ntok, Hv * dv:].reshape(ntok, Hv, dv), w, np.float32(EPS), want)
    dz = dev(zbig)[:, Hv * dv:]
    do = dev(padded(o.reshape(ntok, -1)))
    out = dev(np.full((ntok + SPARE, Hv * dv), SENT, np.float32))
    gdn.gated_rmsnorm(do, dz, dev(w), EPS, out, ntok, stream)
    got = out.copy_to_host()
    assert rel(got[:ntok].reshape(ntok, Hv, dv), want) <= 2e-6
    assert np.all(got[ntok:] == SENT)
    gdn.gated_rmsnorm(do, dz, dev(w), EPS, do, ntok, stream)  # in place
    np.testing.assert_array_equal(do.copy_to_host(), got)


# ------------------------------------------------------------------------------------- gated attention's gate
@pytest.mark.parametrize("three_d", [False, True])
def test_split_q_gate_and_sigmoid_mul(three_d, stream) -> None:
    """The per-head [q | gate] projection output: split_q_gate copies the q halves out, sigmoid_mul scales the
    attention output by the sigmoid of the gate halves, as the CPU block does (o *= 1 / (1 + exp(-gate)))."""
    r = rng(21)
    ntok, H, hd = 3, 3, 12
    qg = (3.0 * r.standard_normal((ntok + SPARE, H * 2 * hd))).astype(np.float32)
    o = r.standard_normal((ntok + SPARE, H * hd)).astype(np.float32)
    halves = qg[:ntok].reshape(ntok, H, 2, hd)
    want_q = halves[:, :, 0].reshape(ntok, H * hd)
    want_o = o[:ntok] * (1.0 / (1.0 + np.exp(-halves[:, :, 1].reshape(ntok, H * hd))))
    dqg = dev(qg)
    dq = dev(np.full((ntok + SPARE, H * hd), SENT, np.float32))
    gdn.split_q_gate(dqg, dq, ntok, H, hd, stream)
    got_q = dq.copy_to_host()
    np.testing.assert_array_equal(got_q[:ntok], want_q)
    assert np.all(got_q[ntok:] == SENT)
    do = dev(o)
    if three_d:
        gdn.sigmoid_mul(do, dqg.reshape(ntok + SPARE, H, 2 * hd), ntok, stream)
    else:
        gdn.sigmoid_mul(do, dqg, ntok, stream, n_head=H)
    got_o = do.copy_to_host()
    assert rel(got_o[:ntok], want_o) <= 2e-6
    np.testing.assert_array_equal(got_o[ntok:], o[ntok:])
