"""Sampler against explicit numpy computations of llama.cpp's chain (full sorts, no shortcuts)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from numba import cuda

from strata_nb.errors import StrataError
from strata_nb.runtime.sampler import Sampler, SamplerConfig, uniform

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)  # every filter disabled


def ref_penalty(logits: np.ndarray, history: list[int], penalty: float, last_n: int) -> np.ndarray:
    out = logits.astype(np.float32).copy()
    recent = history if last_n < 0 else history[-last_n:] if last_n else []
    for t in set(recent):  # once per distinct token, however often it occurs
        out[t] = out[t] * np.float32(penalty) if out[t] <= 0 else out[t] / np.float32(penalty)
    return out


def ref_chain(logits: np.ndarray, c: SamplerConfig) -> dict[int, float]:
    """llama.cpp's chain written the slow, obvious way: returns {token: probability}."""
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    keep = order if c.top_k <= 0 else order[:c.top_k]
    if c.top_p < 1.0:
        p = np.exp(logits[keep].astype(np.float64) - logits[keep].max())
        p /= p.sum()
        cum = 0.0
        for i, pi in enumerate(p):
            cum += pi
            if cum >= c.top_p:
                keep = keep[:i + 1]
                break
    if c.min_p > 0.0:
        p = np.exp(logits[keep].astype(np.float64) - logits[keep].max())
        keep = keep[p >= c.min_p * p.max()]
    x = logits[keep].astype(np.float64) / c.temperature
    p = np.exp(x - x.max())
    return dict(zip(keep.tolist(), (p / p.sum()).tolist()))


def as_dict(ids: np.ndarray, probs: np.ndarray) -> dict[int, float]:
    assert len(set(ids.tolist())) == len(ids), "a token kept twice"
    return dict(zip(ids.tolist(), probs.tolist()))


def assert_same_dist(got: dict[int, float], want: dict[int, float]) -> None:
    assert set(got) == set(want)
    for t in want:
        assert got[t] == pytest.approx(want[t], rel=1e-9, abs=1e-12)


def logits_for(n: int, seed: int, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


@pytest.mark.parametrize("n", [50, 151936])
def test_greedy_is_argmax(n: int) -> None:
    s = Sampler(SamplerConfig(temperature=0.0), n)
    for seed in range(5):
        lg = logits_for(n, seed)
        assert s.sample(lg, []) == int(np.argmax(lg))


def test_greedy_uses_penalized_logits() -> None:
    lg = np.array([1.0, 3.0, 2.9, -1.0], np.float32)
    s = Sampler(SamplerConfig(temperature=0.0, repeat_penalty=1.1), 4)
    assert s.sample(lg, [1]) == 2  # 3.0 / 1.1 < 2.9
    assert s.sample(lg, [0]) == 1


def test_penalty_math() -> None:
    lg = np.array([2.0, -2.0, 0.0, 1.5, -0.5, 4.0], np.float32)
    history = [5, 0, 1, 1, 1, 2, 4]  # 5 falls outside the last 6; repeats count once
    for penalty, last_n in ((1.3, 6), (0.7, 6), (1.3, -1), (1.3, 2)):
        c = SamplerConfig(temperature=1.0, repeat_penalty=penalty, repeat_last_n=last_n, **OFF)
        ids, probs = Sampler(c, 6).distribution(lg.copy(), history)
        want = ref_penalty(lg, history, penalty, last_n)
        e = np.exp(want.astype(np.float64) - want.max())
        assert_same_dist(as_dict(ids, probs), dict(enumerate((e / e.sum()).tolist())))
    # the explicit values, once: positive divided, negative multiplied, zero unchanged
    want = ref_penalty(lg, history, 2.0, 6)
    np.testing.assert_array_equal(want, np.array([1.0, -4.0, 0.0, 1.5, -1.0, 4.0], np.float32))


def test_penalty_leaves_caller_logits_alone() -> None:
    lg = logits_for(100, 1)
    before = lg.copy()
    Sampler(SamplerConfig(temperature=0.7, repeat_penalty=1.5), 100).sample(lg, list(range(50)))
    np.testing.assert_array_equal(lg, before)


@pytest.mark.parametrize("n", [300, 151936])
@pytest.mark.parametrize("k", [1, 5, 40, 1000])
def test_top_k(n: int, k: int) -> None:
    c = SamplerConfig(temperature=0.8, top_k=k, top_p=1.0, min_p=0.0)
    for seed in range(3):
        lg = logits_for(n, seed)
        assert_same_dist(as_dict(*Sampler(c, n).distribution(lg)), ref_chain(lg, c))


def test_top_k_when_the_sample_threshold_misses() -> None:
    # The strided sample (every 16th logit) holds the only large values: too few reach its threshold, so the
    # exact fallback must run and still return the true top k.
    n, k = 65536, 40
    lg = np.zeros(n, np.float32)
    lg[::16] = 100.0 + np.arange(n // 16, dtype=np.float32) * 1e-3
    lg[1] = 1000.0
    c = SamplerConfig(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0)
    ids, _ = Sampler(c, n).distribution(lg)
    assert set(ids.tolist()) == set(np.argsort(-lg, kind="stable")[:k].tolist())


@pytest.mark.parametrize("top_k", [0, 40])
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_top_p(top_k: int, p: float, scale: float) -> None:
    n = 20000
    c = SamplerConfig(temperature=1.0, top_k=top_k, top_p=p, min_p=0.0)
    lg = logits_for(n, 7, scale)
    assert_same_dist(as_dict(*Sampler(c, n).distribution(lg)), ref_chain(lg, c))


@pytest.mark.parametrize("top_k", [0, 40])
@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p(top_k: int, min_p: float) -> None:
    n = 5000
    c = SamplerConfig(temperature=1.3, top_k=top_k, top_p=1.0, min_p=min_p)
    lg = logits_for(n, 3)
    got = as_dict(*Sampler(c, n).distribution(lg))
    assert_same_dist(got, ref_chain(lg, c))
    assert len(got) >= 1


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_full_chain_and_temperature(temperature: float) -> None:
    n = 151936
    c = SamplerConfig(temperature=temperature, top_k=40, top_p=0.9, min_p=0.02, repeat_penalty=1.2)
    lg = logits_for(n, 11)
    hist = [int(t) for t in np.argsort(-lg)[:10]]  # penalize the current favourites
    got = as_dict(*Sampler(c, n).distribution(lg, hist))
    assert_same_dist(got, ref_chain(ref_penalty(lg, hist, 1.2, 64), c))
    assert 1 < len(got) <= 40


def test_all_filters_off_is_plain_softmax() -> None:
    lg = logits_for(1000, 5)
    ids, probs = Sampler(SamplerConfig(temperature=0.5, **OFF), 1000).distribution(lg)
    e = np.exp((lg.astype(np.float64) - lg.max()) / 0.5)
    assert_same_dist(as_dict(ids, probs), dict(enumerate((e / e.sum()).tolist())))


def test_draws_follow_the_distribution() -> None:
    n, draws = 64, 100_000
    c = SamplerConfig(temperature=0.9, top_k=12, top_p=0.97, min_p=0.0, seed=1234)
    lg = logits_for(n, 2, 1.0)
    s = Sampler(c, n)
    want = ref_chain(lg, c)
    counts = np.bincount([s.sample(lg, ()) for _ in range(draws)], minlength=n)
    assert set(np.flatnonzero(counts).tolist()) <= set(want)
    ids = np.array(sorted(want))
    p = np.array([want[i] for i in ids])
    f = counts[ids] / draws
    # every frequency within 5 standard errors, and Pearson's chi-square below df + 5 sqrt(2 df) (~p < 1e-4)
    assert np.all(np.abs(f - p) <= 5 * np.sqrt(p * (1 - p) / draws))
    chi2 = float(((counts[ids] - draws * p) ** 2 / (draws * p)).sum())
    df = len(ids) - 1
    assert chi2 < df + 5 * math.sqrt(2 * df)


def test_uniform_is_splitmix64() -> None:
    # the first outputs of the reference splitmix64 (Vigna) seeded with 0, top 53 bits
    ref = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC]
    for step, z in enumerate(ref):
        assert uniform(0, step) == (z >> 11) / 2.0**53
    # [0, 1) at the extreme seeds, and uniform: mean and a 10-bin histogram over 20000 steps
    assert all(0.0 <= uniform(s, t) < 1.0 for s in (0, 1, 2**63, 2**64 - 1) for t in (0, 1, 10**12))
    u = np.array([uniform(2**64 - 1, t) for t in range(20000)])
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / u.size)
    counts = np.bincount((u * 10).astype(int), minlength=10)
    assert float(((counts - 2000) ** 2 / 2000).sum()) < 9 + 5 * math.sqrt(18)


def test_draw_is_the_inverse_cdf_of_uniform_seed_step() -> None:
    """Token n is ids[searchsorted(cumsum(probs), uniform(seed, n) * total, right)] over distribution()'s order; the
    step advances on every call, also greedy or single-survivor ones that draw nothing."""
    n = 300
    r = np.random.default_rng(21)
    for case in range(30):
        c = SamplerConfig(temperature=float(r.choice([0.0, 0.5, 1.0, 1.7])), top_k=int(r.choice([0, 1, 5, 40])),
                          top_p=float(r.choice([1.0, 0.9, 0.3])), min_p=float(r.choice([0.0, 0.05, 0.5])),
                          seed=int(r.integers(0, 2**63)) * 2 + case % 2)
        s = Sampler(c, n)
        for step in range(3):
            lg = logits_for(n, 100 * case + step, float(r.choice([0.5, 3.0])))
            ids, probs = s.distribution(lg)
            cum = np.cumsum(probs)
            want = ids[min(int(np.searchsorted(cum, uniform(s.seed, step) * cum[-1], side="right")), len(ids) - 1)]
            assert s.step == step
            assert s.sample(lg) == want
        assert s.step == 3


def test_ties_ordered_by_id() -> None:
    lg = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 3.0, 0.0, -0.0], np.float32)
    s = Sampler(SamplerConfig(temperature=1.0, **OFF), 8)
    assert s.distribution(lg)[0].tolist() == [1, 3, 5, 2, 4, 0, 6, 7]  # 0.0 and -0.0 are equal logits
    c = SamplerConfig(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    assert Sampler(c, 8).distribution(lg)[0].tolist() == [1, 3]  # the tie at the boundary goes to the lower id
    big = np.zeros(5000, np.float32)  # the strided-sample path of top-k, all tied
    big[4000:] = 1.0
    assert Sampler(c, 5000).distribution(big)[0].tolist() == [4000, 4001]
    assert Sampler(SamplerConfig(temperature=0.0), 8).sample(lg) == 1


def test_seed_reproducibility() -> None:
    n = 1000
    lg = logits_for(n, 9, 1.0)

    def run(seed: int | None) -> tuple[int, list[int]]:
        s = Sampler(SamplerConfig(temperature=1.0, top_k=50, top_p=0.99, min_p=0.0, seed=seed), n)
        return s.seed, [s.sample(lg, ()) for _ in range(200)]

    assert run(42) == run(42)
    assert run(42)[1] != run(43)[1]
    seed_a, seq_a = run(None)
    seed_b, seq_b = run(None)
    assert seed_a != seed_b and seq_a != seq_b  # fresh entropy each time (2^-64 chance of a false failure)
    assert run(seed_a)[1] == seq_a  # the reported seed replays the run


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1),
                                dict(top_k=2.5), dict(top_p=0.0), dict(top_p=1.01), dict(min_p=-0.1),
                                dict(min_p=1.5), dict(repeat_penalty=0.0), dict(repeat_last_n=-2),
                                dict(seed=-1), dict(seed=2**64)])
def test_invalid_options(kw: dict) -> None:
    with pytest.raises(StrataError, match="invalid sampler option"):
        Sampler(SamplerConfig(**kw), 10)


def test_bad_inputs() -> None:
    s = Sampler(SamplerConfig(temperature=1.0, repeat_penalty=1.1), 10)
    with pytest.raises(StrataError, match="shape"):
        s.sample(np.zeros(11, np.float32), [])
    with pytest.raises(StrataError, match="out of range"):
        s.sample(np.zeros(10, np.float32), [3, 10])
    bad = np.zeros(10, np.float32)
    bad[4] = np.nan
    with pytest.raises(StrataError, match="NaN"):
        s.sample(bad, [])
    with pytest.raises(StrataError, match="-inf"):
        s.sample(np.full(10, -np.inf, np.float32), [])
    with pytest.raises(StrataError, match="vocabulary"):
        Sampler(SamplerConfig(), 0)


def test_masked_tokens_are_never_drawn() -> None:
    lg = logits_for(500, 4, 1.0)
    lg[::2] = -np.inf
    s = Sampler(SamplerConfig(temperature=1.5, **OFF, seed=0), 500)
    assert all(s.sample(lg, ()) % 2 == 1 for _ in range(500))


# -- the device sampler (cuda_kernels/sample.py): the same tokens as the host Sampler ---------------------------------
# In the simulator (no GPU) a vocabulary of a few hundred; cand_cap 8 or 16 sends most cases down the exact radix path,
# 1024 down the sorted fast path.

GV = 300


@pytest.fixture(scope="module")
def fast_barriers():
    import sys
    old = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)  # the simulator's barriers poll under the GIL: ~10x cheaper (restored below)
    yield
    sys.setswitchinterval(old)


def _gpu(c: SamplerConfig, hist, cap: int = 1024, vocab: int = GV):
    from strata_nb.runtime.gpu_sampler import GPUSampler
    g = GPUSampler(c, vocab, history_cap=80, cand_cap=cap)
    g.set_history(hist)
    return g


def _both(host: Sampler, g, lg: np.ndarray, hist: list[int]) -> tuple[int, int]:
    want = host.sample(lg, hist)
    g.launch(cuda.to_device(lg), 0)
    cuda.synchronize()
    return want, g.result()


def test_gpu_uniform_is_the_host_uniform(fast_barriers) -> None:
    from strata_nb.cuda_kernels import sample as ks

    @cuda.jit
    def draw(seeds, steps, out):
        for i in range(cuda.threadIdx.x, out.shape[0], cuda.blockDim.x):
            out[i] = ks.uniform(seeds[i] & 0xFFFFFFFF, seeds[i] >> 32, steps[i])

    pairs = [(0, 0), (0, 3), (1, 0), (2**63, 7), (2**64 - 1, 2**40 + 5), (0x0123456789ABCDEF, 123456)]
    pairs += [(int(s), int(t)) for s, t in zip(np.random.default_rng(5).integers(0, 2**63, 10) * 2 + 1,
                                              np.random.default_rng(6).integers(0, 2**40, 10))]
    seeds = np.array([s - 2**64 if s >= 2**63 else s for s, _ in pairs], np.int64)  # the bits, as int64
    out = cuda.device_array(len(pairs), np.float64)
    draw[1, 32](cuda.to_device(seeds), cuda.to_device(np.array([t for _, t in pairs], np.int64)), out)
    assert out.copy_to_host().tolist() == [uniform(s, t) for s, t in pairs]


def test_gpu_sampler_matches_host(fast_barriers) -> None:
    r = np.random.default_rng(31)
    for case in range(24):
        c = SamplerConfig(temperature=float(r.choice([0.0, 0.6, 1.0, 1.8])), top_k=int(r.choice([0, 1, 7, 40, 500])),
                          top_p=float(r.choice([1.0, 0.95, 0.5])), min_p=float(r.choice([0.0, 0.05, 0.4, 1.0])),
                          repeat_penalty=float(r.choice([1.0, 1.3, 0.8])), repeat_last_n=int(r.choice([0, 6, -1])),
                          seed=int(r.integers(0, 2**63)) * 2 + case % 2)
        hist = [int(t) for t in r.integers(0, GV, int(r.integers(0, 30)))]
        host = Sampler(c, GV)
        g = _gpu(c, hist, cap=int(r.choice([8, 1024])))
        for step in range(2):
            lg = (r.standard_normal(GV) * float(r.choice([0.3, 2.0, 6.0]))).astype(np.float32)
            want, got = _both(host, g, lg, hist)
            assert got == want, (case, step, c)
            hist.append(want)
        assert g.step == host.step == 2


def test_gpu_sampler_ties_masks_and_zeros(fast_barriers) -> None:
    """Logits on a coarse grid (hundreds of exact ties, at every boundary), masked (-inf) tokens and -0.0 / +0.0:
    the order is logit descending, ties by id ascending, on both."""
    r = np.random.default_rng(32)
    for case in range(16):
        lg = np.round(r.standard_normal(GV) * float(r.choice([1.0, 3.0]))).astype(np.float32) / 2
        lg[r.random(GV) < 0.2] = -np.inf
        lg[lg == 0] = np.where(r.random(int((lg == 0).sum())) < 0.5, -0.0, 0.0)
        c = SamplerConfig(temperature=float(r.choice([0.0, 0.7, 2.0])), top_k=int(r.choice([0, 3, 20])),
                          top_p=float(r.choice([1.0, 0.8, 0.3])), min_p=float(r.choice([0.0, 0.1])),
                          seed=int(r.integers(0, 2**63)))
        host = Sampler(c, GV)
        g = _gpu(c, [], cap=int(r.choice([8, 1024])))
        for step in range(2):
            want, got = _both(host, g, lg, [])
            assert got == want, (case, step, c)


def test_gpu_sampler_configured_in_place(fast_barriers) -> None:
    """configure() loads another chain and seed into the same device arrays (what captured decode graphs read):
    the draws are then the host sampler's of that configuration; a repetition window past the ring is refused."""
    r = np.random.default_rng(33)
    g = _gpu(SamplerConfig(temperature=1.0, seed=1), [])
    arrays = (g.cfg, g.state, g.ring, g.counts, g.token)
    for case in range(4):
        c = SamplerConfig(temperature=float(r.choice([0.0, 0.7, 1.5])), top_k=int(r.choice([0, 5, 40])),
                          top_p=float(r.choice([1.0, 0.9])), min_p=float(r.choice([0.0, 0.05])),
                          repeat_penalty=float(r.choice([1.0, 1.3])), repeat_last_n=int(r.choice([0, 8])),
                          seed=int(r.integers(0, 2**62)))
        hist = [int(t) for t in r.integers(0, GV, 12)]
        host = Sampler(c, GV)
        g.configure(c)
        g.set_history(hist)
        for _ in range(2):
            lg = (r.standard_normal(GV) * 2.0).astype(np.float32)
            want, got = _both(host, g, lg, hist)
            assert got == want, (case, c)
            hist.append(want)
        assert g.step == 2 and g.seed == c.seed
    assert all(a is b for a, b in zip((g.cfg, g.state, g.ring, g.counts, g.token), arrays))
    assert not g.fits(SamplerConfig(repeat_last_n=80))
    with pytest.raises(StrataError, match="history_cap"):
        g.configure(SamplerConfig(repeat_last_n=80))


def test_gpu_greedy_and_invalid_logits(fast_barriers) -> None:
    lg = logits_for(GV, 3)
    lg[[7, 250]] = lg.max() + 1.0  # a tie for the max: the lower id
    g = _gpu(SamplerConfig(temperature=0.0), [])
    g.launch(cuda.to_device(lg), 0)
    cuda.synchronize()
    assert g.result() == 7 and g.step == 1
    assert g.token.copy_to_host()[0] == 7  # the device copy, for the next token's embedding
    # penalized: 7 in the history drops below 250 (positive logits are divided)
    pen = _gpu(SamplerConfig(temperature=0.0, repeat_penalty=1.5, repeat_last_n=4), [1, 7, 2])
    pen.launch(cuda.to_device(lg), 0)
    cuda.synchronize()
    assert pen.result() == 250
    for bad in (np.nan, np.inf):
        x = lg.copy()
        x[123] = bad
        g.launch(cuda.to_device(x), 0)
        cuda.synchronize()
        with pytest.raises(StrataError, match="NaN"):
            g.result()
        assert g.step == 1  # nothing drawn, nothing advanced
    g.launch(cuda.to_device(np.full(GV, -np.inf, np.float32)), 0)
    cuda.synchronize()
    with pytest.raises(StrataError, match="-inf"):
        g.result()


def test_gpu_history_window_on_device(fast_barriers) -> None:
    """The ring and counts follow the last repeat_last_n tokens as sampling appends to them (no host upload)."""
    c = SamplerConfig(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0, repeat_penalty=1.2, repeat_last_n=3, seed=9)
    hist = [5, 5, 9, 11]
    host = Sampler(c, GV)
    g = _gpu(c, hist)
    lg = logits_for(GV, 4, 0.2)
    lg[[5, 9, 11, 12, 13]] += 3.0  # a few favourites that the penalty reorders
    for _ in range(5):
        want, got = _both(host, g, lg, hist)
        assert got == want
        hist.append(want)
        np.testing.assert_array_equal(g.counts.copy_to_host(), np.bincount(hist[-3:], minlength=GV))
    with pytest.raises(StrataError, match="history_cap"):
        from strata_nb.runtime.gpu_sampler import GPUSampler
        GPUSampler(c, GV, history_cap=3)
    with pytest.raises(StrataError, match="out of range"):
        g.set_history([1, GV])
