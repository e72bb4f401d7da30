"""The gated delta-net kernels (cpu_kernels/deltanet.py) against transformers' torch implementation of
Qwen3-Next's mixer (modeling_qwen3_next): causal_conv1d_update, torch_recurrent_gated_delta_rule,
torch_chunk_gated_delta_rule (both with use_qk_l2norm_in_kernel=True, as Qwen3NextGatedDeltaNet.forward calls
them), Qwen3NextRMSNormGated, and the forward's gate formulas. Outputs are poisoned (NaN) first.

Errors are max|got - want| / max|want| over an array, both sides float32. Bounds, with the largest value
measured over these tests in parentheses:
  conv_silu vs HF                          1e-6  (2.2e-7); its state exact
  gated_delta_rule vs HF, output and state 1e-5  (3.0e-7)
  chunked vs HF, output and state          1e-5  (4.9e-7)
  chunked vs sequential (T=300, d=64)      1e-5  (1.2e-6)
  prompt in two pieces vs whole            exact for the conv and gated_delta_rule; 1e-5 chunked (2.8e-7)
  gated_rmsnorm vs HF                      1e-6  (1.4e-7)
  gdn_gates vs torch                       1e-6  (4.6e-9)
At Qwen3-Next's dims (T=512, Hk=16, Hv=32, dk=dv=128, inputs() below, both head mappings) measured once:
sequential vs HF's recurrent 5.2e-7, chunked (16) vs sequential 7.6e-7, chunked (64) vs HF's chunked (64) 2.0e-6
(HF's own two forms differ by 1.1e-6).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

from strata_nb.cpu_kernels import deltanet as dn  # noqa: E402

EPS = np.float32(1e-6)
# transformers < 5 named it torch_causal_conv1d_update (same semantics: silu, state copied in place)
_hf_conv_update = getattr(hf, "torch_causal_conv1d_update", None) or hf.causal_conv1d_update


def rel(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def inputs(rng, T, Hk, Hv, dk, dv, state_scale=0.3):
    """Random GDN inputs with realistic gates: g = -exp(A_log) softplus(a + dt_bias) < 0, beta in (0, 1)."""
    q = rng.standard_normal((T, Hk, dk)).astype(np.float32)
    k = rng.standard_normal((T, Hk, dk)).astype(np.float32)
    v = rng.standard_normal((T, Hv, dv)).astype(np.float32)
    a_log = rng.uniform(np.log(0.01), np.log(16.0), Hv)
    g = (-np.exp(a_log) * np.log1p(np.exp(rng.standard_normal((T, Hv)) - 2.0))).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((T, Hv))))).astype(np.float32)
    state = (state_scale * rng.standard_normal((Hv, dk, dv))).astype(np.float32)
    k[-1, 0] = 0.0  # a zero key and query: normalised through eps to zero, not NaN
    q[T // 2, -1] = 0.0
    return q, k, v, g, beta, state


def key_heads(Hk, Hv, tiled):
    return np.arange(Hv) % Hk if tiled else np.arange(Hv) // (Hv // Hk)


def hf_rule(fn, q, k, v, g, beta, state, tiled, **kw):
    """HF's rule on our layouts ([T, H, d] -> [1, T, H, d]). tiled: key heads spread to Hv heads here (HF itself
    repeats them, which is the untiled mapping)."""
    if tiled:
        idx = key_heads(q.shape[1], v.shape[1], True)
        q, k = q[:, idx], k[:, idx]
    t = [torch.from_numpy(np.ascontiguousarray(x))[None] for x in (q, k, v, g, beta)]
    o, s = fn(*t, initial_state=torch.from_numpy(state.copy())[None], output_final_state=True,
              use_qk_l2norm_in_kernel=True, **kw)
    return o[0].numpy(), s[0].numpy()


def run(kernel, q, k, v, g, beta, state, tiled, **kw):
    """A kernel on copies of state, its output poisoned first: (out, final state)."""
    s = state.copy()
    out = np.full(v.shape, np.nan, np.float32)
    kernel(q, k, v, g, beta, s, tiled, EPS, out, **kw)
    return out, s


def conv_inputs(rng, T, C, K):
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = (0.5 * rng.standard_normal((C, K))).astype(np.float32)
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    return x, w, state


# ---------------------------------------------------------------------------------------------------- conv_silu
@pytest.mark.parametrize("T,C,K", [(1, 96, 4), (2, 96, 4), (3, 130, 4), (37, 200, 4), (5, 64, 2), (9, 33, 3)])
@pytest.mark.parametrize("zero_state", [False, True])
def test_conv_silu_vs_hf(T, C, K, zero_state):
    """Against HF's cached conv update (state of K-1 columns, [B, C, T] layout), which covers the prompt from the
    sequence start (zero state) and the continuation; T < K-1 included."""
    rng = np.random.default_rng(T * 1000 + C + K)
    x, w, state = conv_inputs(rng, T, C, K)
    if zero_state:
        state[:] = 0.0
    st = state.copy()
    out = np.full((T, C), np.nan, np.float32)
    dn.conv_silu(x, w, st, out)

    hst = torch.from_numpy(state.T.copy())[None]  # [1, C, K-1], updated in place
    want = _hf_conv_update(torch.from_numpy(x.T.copy())[None], hst, torch.from_numpy(w), None, "silu")
    assert rel(out, want[0].numpy().T) <= 1e-6
    np.testing.assert_array_equal(st, hst[0].numpy().T)  # the state is a copy: exact
    if zero_state:
        # HF's prompt path: nn.Conv1d-shaped weight [C, 1, K] squeezed, left padding K-1 (no cache)
        ref = hf.causal_conv1d_fn(torch.from_numpy(x.T.copy())[None], torch.from_numpy(w), None, "silu")
        assert rel(out, ref[0].numpy().T) <= 1e-6


@pytest.mark.parametrize("T,cut", [(9, 1), (9, 2), (9, 5), (3, 1), (2, 1)])
def test_conv_silu_pieces(T, cut):
    """A prompt in two pieces, the state carried, gives the whole prompt's outputs and state bit for bit (every
    output sums the same products in the same order, also across the kernel's two paths: 9 tokens copy the taps
    time-major first, fewer than 8 read w in place)."""
    x, w, state = conv_inputs(np.random.default_rng(T + cut), T, 40, 4)
    whole_state = state.copy()
    whole = np.full((T, 40), np.nan, np.float32)
    dn.conv_silu(x, w, whole_state, whole)
    parts = np.full((T, 40), np.nan, np.float32)
    dn.conv_silu(np.ascontiguousarray(x[:cut]), w, state, parts[:cut])
    dn.conv_silu(np.ascontiguousarray(x[cut:]), w, state, parts[cut:])
    np.testing.assert_array_equal(parts, whole)
    np.testing.assert_array_equal(state, whole_state)


# ------------------------------------------------------------------------------------------------- recurrences
SHAPES = [  # T, Hk, Hv, dk, dv
    (1, 2, 4, 16, 32),    # one token (decode), Hv = 2 Hk
    (7, 2, 2, 32, 16),    # Hv = Hk
    (70, 2, 4, 32, 48),   # T not a multiple of the chunk
    (33, 1, 3, 18, 20),   # dk not a multiple of 4 (the kernels' row blocks), 3 value heads per key head
]


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_delta_rule_vs_hf(shape, tiled):
    """The token loop against HF's recurrent rule (its decode path), from a non-zero state; q and k untouched."""
    q, k, v, g, beta, state = inputs(np.random.default_rng(sum(shape)), *shape)
    q0, k0 = q.copy(), k.copy()
    out, st = run(dn.gated_delta_rule, q, k, v, g, beta, state, tiled)
    want_o, want_s = hf_rule(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state, tiled)
    assert rel(out, want_o) <= 1e-5
    assert rel(st, want_s) <= 1e-5
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_delta_rule_chunked_vs_hf(shape, tiled, chunk):
    """The chunked form against HF's chunked rule (its prompt path) with the same chunk size."""
    q, k, v, g, beta, state = inputs(np.random.default_rng(sum(shape) + chunk), *shape)
    q0, k0 = q.copy(), k.copy()
    out, st = run(dn.gated_delta_rule_chunked, q, k, v, g, beta, state, tiled, chunk=chunk)
    want_o, want_s = hf_rule(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, state, tiled, chunk_size=chunk)
    assert rel(out, want_o) <= 1e-5
    assert rel(st, want_s) <= 1e-5
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)


def test_tiled_mapping_matters():
    """tiled changes which key head a value head reads (else the tiled tests above could not fail)."""
    q, k, v, g, beta, state = inputs(np.random.default_rng(5), 6, 2, 4, 16, 16)
    a, _ = run(dn.gated_delta_rule, q, k, v, g, beta, state, False)
    b, _ = run(dn.gated_delta_rule, q, k, v, g, beta, state, True)
    assert rel(a[:, 1:3], b[:, 1:3]) > 1e-2  # heads 1, 2 read key heads 0, 1 untiled and 1, 0 tiled
    np.testing.assert_array_equal(a[:, 0], b[:, 0])


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("tiled", [False, True])
def test_chunked_equals_sequential(chunk, tiled):
    """The two kernels agree on a longer prompt at moderate head dims (T=300: several chunks and a partial one)."""
    q, k, v, g, beta, state = inputs(np.random.default_rng(chunk), 300, 2, 4, 64, 64)
    o1, s1 = run(dn.gated_delta_rule, q, k, v, g, beta, state, tiled)
    o2, s2 = run(dn.gated_delta_rule_chunked, q, k, v, g, beta, state, tiled, chunk=chunk)
    assert rel(o2, o1) <= 1e-5
    assert rel(s2, s1) <= 1e-5


@pytest.mark.parametrize("kernel", ["gated_delta_rule", "gated_delta_rule_chunked"])
@pytest.mark.parametrize("cut", [1, 37, 64])
def test_rule_pieces(kernel, cut):
    """A prompt in two pieces, the state carried, gives the whole prompt's outputs and state; token by token, bit
    for bit (the engine's path: a session continued, restored or rewound must not change a logit), for a dk that
    is a multiple of 4 and one that is not."""
    fn = getattr(dn, kernel)
    for dk in (32, 30):
        q, k, v, g, beta, state = inputs(np.random.default_rng(cut), 100, 2, 4, dk, 32)
        whole_o, whole_s = run(fn, q, k, v, g, beta, state, False)
        o1, s = run(fn, *(np.ascontiguousarray(x[:cut]) for x in (q, k, v, g, beta)), state, False)
        o2, s = run(fn, *(np.ascontiguousarray(x[cut:]) for x in (q, k, v, g, beta)), s, False)
        if kernel == "gated_delta_rule":
            np.testing.assert_array_equal(np.concatenate([o1, o2]), whole_o)
            np.testing.assert_array_equal(s, whole_s)
        else:
            assert rel(np.concatenate([o1, o2]), whole_o) <= 1e-5
            assert rel(s, whole_s) <= 1e-5


@pytest.mark.parametrize("kernel", ["gated_delta_rule", "gated_delta_rule_chunked"])
def test_no_tokens(kernel):
    """T = 0 leaves the state alone."""
    q, k, v, g, beta, state = inputs(np.random.default_rng(1), 1, 2, 4, 16, 16)
    _, st = run(getattr(dn, kernel), *(x[:0] for x in (q, k, v, g, beta)), state, False)
    np.testing.assert_array_equal(st, state)


def test_strong_decay_no_overflow():
    """Gates of a fully closed head (g = -80 per token: exp(cumsum) underflows within a chunk) stay finite and
    forget the initial state, in both kernels."""
    q, k, v, g, beta, state = inputs(np.random.default_rng(9), 40, 1, 2, 16, 16, state_scale=1e3)
    g[:] = -80.0
    o1, s1 = run(dn.gated_delta_rule, q, k, v, g, beta, state, False)
    o2, s2 = run(dn.gated_delta_rule_chunked, q, k, v, g, beta, state, False, chunk=16)
    for o, s in ((o1, s1), (o2, s2)):
        assert np.isfinite(o).all() and np.isfinite(s).all()
    # state forgotten: token t's output is beta_t (k_t.q_t) v_t only
    kn = k / np.sqrt((k * k).sum(-1, keepdims=True) + EPS)
    qn = q / np.sqrt((q * q).sum(-1, keepdims=True) + EPS) / np.sqrt(q.shape[-1])
    want = beta[..., None] * (kn * qn).sum(-1)[:, [0, 0], None] * v
    assert rel(o1, want) <= 1e-5
    assert rel(o2, want) <= 1e-5


# ----------------------------------------------------------------------------------------- norm and gates
@pytest.mark.parametrize("T,Hv,dv", [(1, 4, 32), (5, 3, 128)])
def test_gated_rmsnorm_vs_hf(T, Hv, dv):
    """Against the HF module with a random weight (used as is, not 1 + w); z a strided view; in place too."""
    rng = np.random.default_rng(T * Hv)
    o = (3.0 * rng.standard_normal((T, Hv, dv))).astype(np.float32)
    zbig = rng.standard_normal((T, Hv, 2 * dv)).astype(np.float32)
    z = zbig[:, :, dv:]  # a strided view
    assert not z.flags.c_contiguous
    w = (1.0 + 0.5 * rng.standard_normal(dv)).astype(np.float32)
    eps = np.float32(1e-6)
    norm = hf.Qwen3NextRMSNormGated(dv, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        want = norm(torch.from_numpy(o.reshape(-1, dv)), torch.from_numpy(np.ascontiguousarray(z).reshape(-1, dv)))
    want = want.numpy().reshape(T, Hv, dv)
    out = np.full_like(o, np.nan)
    dn.gated_rmsnorm(o, z, w, eps, out)
    assert rel(out, want) <= 1e-6
    dn.gated_rmsnorm(o, z, w, eps, o)  # in place
    np.testing.assert_array_equal(o, out)


def test_gdn_gates_vs_torch():
    """g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) as the HF forward computes them, with a + dt_bias
    across softplus' threshold (20) and far below 0."""
    rng = np.random.default_rng(3)
    T, Hv = 64, 8
    a = rng.uniform(-40.0, 40.0, (T, Hv)).astype(np.float32)
    a[0] = 100.0  # exp overflows float32 here: softplus must take its threshold branch
    b = rng.uniform(-30.0, 30.0, (T, Hv)).astype(np.float32)
    a_log = torch.from_numpy(rng.uniform(np.log(0.01), np.log(16.0), Hv).astype(np.float32))
    dt_bias = rng.standard_normal(Hv).astype(np.float32)
    a_log_neg = (-a_log.exp()).numpy()  # what the GGUF stores as ssm_a
    g = np.full((T, Hv), np.nan, np.float32)
    beta = np.full((T, Hv), np.nan, np.float32)
    dn.gdn_gates(a, b, a_log_neg, dt_bias, g, beta)
    # the forward's own expression: g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    want_g = -a_log.float().exp() * torch.nn.functional.softplus(torch.from_numpy(a) + torch.from_numpy(dt_bias))
    want_b = torch.from_numpy(b).sigmoid()
    assert rel(g, want_g.numpy()) <= 1e-6
    assert np.abs(beta - want_b.numpy()).max() <= 1e-6
    assert np.isfinite(g).all()
    x = a + dt_bias
    assert (x > 20).any() and (x < -20).any()
