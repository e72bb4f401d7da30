"""`write_synthetic(..., router_skew=ALPHA)`: expert selection frequencies that fall with rank as (r+1)^-ALPHA.

Measured on tiny-moe64 (64 experts, top 8, 4 layers), ALPHA 1.2, seeds 0..5, 64 prompt + 64 greedy tokens: the
share of routing mass held by each layer's intended top 25% of ranks was 0.687..0.808 (target 0.742), its mean
over layers 0.734..0.765. One sequence is a small sample and the random model's routing also has a
sequence-specific per-expert preference (it is there with ALPHA 0 too), hence per-layer tolerances of 0.08 and
0.04 on the mean over layers.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFReader
from gguf.quants import dequantize

from strata_nb.errors import StrataError
from strata_nb.synth import SINGLE_TYPES, blocks, skew, write_synthetic

ALPHA = 1.2
PRESET = "tiny-moe64"


def _measure(path: str) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(100)
    vocab = int(GGUFReader(path).fields["qwen3moe.vocab_size"].contents())
    # one thread: on a busy machine the engine's spinning OpenMP workers make 128 tiny decode steps ~100x slower
    return skew.measure_routing(path, rng.integers(0, vocab, 64).tolist(), 64, threads=1)


def _intended_mass(counts: np.ndarray, n: int, seed: int, k: int) -> np.ndarray:
    """[layer, (top 10%, 25%, 50%)]: routing mass held by each layer's intended top ranks."""
    e = counts.shape[1]
    return np.array([skew.rank_mass((c / n)[skew.expert_ranks(seed, layer, e)], k)
                     for layer, c in enumerate(counts)])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("skew")
    return {"plain": write_synthetic(d / "plain.gguf", PRESET, seed=0)["path"],
            "skewed": write_synthetic(d / "skewed.gguf", PRESET, seed=0, router_skew=ALPHA)["path"]}


def test_alpha_zero_writes_exactly_the_plain_file(tmp_path, files):
    a = write_synthetic(tmp_path / "zero.gguf", PRESET, seed=0, router_skew=0.0)
    assert a["router_skew"] == 0.0 and "router_bias_ratio" not in a
    assert Path(a["path"]).read_bytes() == Path(files["plain"]).read_bytes()
    b = write_synthetic(tmp_path / "tiny0.gguf", "tiny", arch="qwen2moe", seed=3, router_skew=0)["path"]
    c = write_synthetic(tmp_path / "tiny.gguf", "tiny", arch="qwen2moe", seed=3)["path"]
    assert Path(b).read_bytes() == Path(c).read_bytes()


def test_skewed_file_differs_from_the_plain_one_only_where_the_bias_lives(files):
    plain, sk = GGUFReader(files["plain"]), GGUFReader(files["skewed"])
    assert "strata.synth.router_skew" not in plain.fields
    assert sk.fields["strata.synth.router_skew"].contents() == pytest.approx(ALPHA)
    assert sk.fields["strata.synth.router_bias_dim"].contents() == skew.BIAS_DIM == 0
    H = int(sk.fields["qwen3moe.embedding_length"].contents())
    pt = {t.name: t for t in plain.tensors}
    edited = 0
    for t in sk.tensors:
        p = pt[t.name]
        a, b = np.asarray(p.data), np.asarray(t.data)
        assert a.shape == b.shape and p.tensor_type == t.tensor_type
        if t.name == "token_embd.weight":
            size = GGML_QUANT_SIZES[t.tensor_type][1]
            rows_a, rows_b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
            assert np.array_equal(rows_a[:, size:], rows_b[:, size:])  # only block 0 of each row is touched
            vals = np.asarray(dequantize(rows_b, t.tensor_type), np.float64).reshape(rows_b.shape[0], H)
            c = vals[:, 0]
            assert np.all(c == c[0]) and c[0] > 0
            rest = np.sqrt(np.mean(vals[:, 1:] ** 2))
            assert 1.3 < c[0] / rest < 4.0, (c[0], rest)  # moderate: a few times a typical entry
            edited += 1
        elif t.name.endswith(skew.RESIDUAL_WRITERS):
            ra, rb = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
            out_dim = np.arange(ra.shape[0]) % H
            assert not rb[out_dim == 0].any()  # nothing is added to the constant dimension
            assert np.array_equal(ra[out_dim != 0], rb[out_dim != 0])
            edited += 1
        elif t.name.endswith("ffn_gate_inp.weight"):
            assert np.array_equal(a[:, 1:], b[:, 1:])
            assert np.ptp(b[:, 0]) > 0  # the calibrated bias column
            edited += 1
        else:
            assert np.array_equal(a, b), t.name
    assert edited == 1 + 3 * 4


@pytest.mark.parametrize("qtype", SINGLE_TYPES)
def test_constant_dimension_in_every_embedding_type(qtype):
    qt = T[qtype]
    rows = blocks.random_rows(np.random.default_rng(1), qt, 64, 256, 1.0)
    before = rows.copy()
    skew.set_bias_dim(rows, qt)
    vals = np.asarray(dequantize(rows, qt), np.float64).reshape(64, 256)
    old = np.asarray(dequantize(before, qt), np.float64).reshape(64, 256)
    c = vals[:, skew.BIAS_DIM]
    assert np.all(c == c[0]) and 1.3 < c[0] / np.sqrt(np.mean(old ** 2)) < 4.0, (qtype, c[:4])
    assert c[0] == pytest.approx(skew.bias_dim_value(rows[0], qt))
    # only the first block's bytes change, and only values in the constant's (sub-)block of 32 or fewer
    size = {T.F32: 4, T.F16: 2, T.BF16: 2}.get(qt) or GGML_QUANT_SIZES[qt][1]
    assert np.array_equal(rows[:, size:], before[:, size:])
    assert np.array_equal(vals[:, 32:], old[:, 32:])


def test_target_curve_and_monte_carlo_fit():
    f = skew.target_frequencies(64, 8, ALPHA)
    assert f.sum() == pytest.approx(8.0) and f[0] == 1.0 and np.all(np.diff(f) <= 0)
    free = f < 1
    r = np.arange(1, 65)[free]
    assert np.allclose(f[free] * r ** ALPHA, f[free][0] * r[0] ** ALPHA)  # the power law below saturation
    b = skew.fit_bias(64, 8, ALPHA)
    z = np.random.default_rng(5).standard_normal((20000, 64))  # draws other than the fit's own
    top = np.argpartition(z + b, 64 - 8, axis=1)[:, 64 - 8:]
    fm = np.bincount(top.ravel(), minlength=64) / 20000
    assert np.all(np.abs(fm - f) < 0.02 + 0.1 * f), np.abs(fm - f).max()


def test_routing_follows_the_target_curve(files):
    k = 8
    target = np.array(skew.rank_mass(skew.target_frequencies(64, k, ALPHA), k))
    counts, n = _measure(files["skewed"])
    assert n == 128 and np.all(counts.sum(axis=1) == n * k)
    mass = _intended_mass(counts, n, 0, k)
    assert np.all(np.abs(mass - target) < 0.08), (mass, target)
    assert np.all(np.abs(mass.mean(axis=0) - target) < 0.04), (mass.mean(axis=0), target)
    # the same measurement on the plain file is far from the target: the check discriminates
    plain = _intended_mass(*_measure(files["plain"]), 0, k)
    assert np.all(plain[:, 1] < 0.4), plain


def test_llama_cpp_runs_a_skewed_file(tmp_path):
    pytest.importorskip("llama_cpp")
    import oracles  # tests/oracles.py

    from strata_nb.api import load

    path = write_synthetic(tmp_path / "f32.gguf", "tiny", quant="F32", seed=7, router_skew=ALPHA)["path"]
    eng = load(path, n_ctx=64, fast=False)
    toks = [int(t) for t in np.random.default_rng(3).integers(0, eng.spec.n_vocab, 16)]
    ref = oracles.llama_cpp_logits(path, toks)
    assert np.isfinite(ref).all()
    ours = eng.logits(toks)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-4  # measured ~5e-7 with F32 weights


def test_bad_requests(tmp_path):
    with pytest.raises(StrataError, match="needs a MoE model"):
        write_synthetic(tmp_path / "x.gguf", "tiny", arch="qwen3", router_skew=1.0)
    with pytest.raises(StrataError, match="finite number >= 0"):
        write_synthetic(tmp_path / "x.gguf", "tiny", router_skew=-0.5)
    with pytest.raises(StrataError, match="finite number >= 0"):
        write_synthetic(tmp_path / "x.gguf", "tiny", router_skew=float("nan"))
    assert not list(tmp_path.iterdir())


def test_pilot_and_measurement_run_on_the_cpu_engine(tmp_path, monkeypatch):
    """Both wrap the CPU engine's MoE layer; on a GPU machine --device auto would build the hybrid engine, which
    has none (`strata-nb synth --router-skew` failed there with "'GPUBackend' object has no attribute 'moe'")."""
    from strata_nb import api

    asked: list[str] = []
    real = api.pick_device

    def pick(device: str, vram_budget: float | None = None, spec=None):
        asked.append(device)
        if device != "cpu":  # what a GPU machine's auto would give
            return "cuda", "device: a GPU (test)"
        return real(device, vram_budget, spec)

    monkeypatch.setattr(api, "pick_device", pick)
    path = write_synthetic(tmp_path / "s.gguf", "tiny", seed=4, router_skew=ALPHA)["path"]
    counts, n = skew.measure_routing(path, [1, 2, 3], 2, threads=1)
    assert n == 5 and counts.sum() == n * 2 * counts.shape[0]  # tiny: top-2
    assert asked == ["cpu", "cpu"]
