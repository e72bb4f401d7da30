"""Every supported architecture against transformers and llama.cpp on the same synthetic GGUF.

Tolerances (relative L2 over all logits of a 16-token prompt; measured on these files in parentheses):
- reference path (float32 activations) vs transformers: 1e-4 (~7e-7), top-1 identical;
- with F32 weights, reference path vs llama.cpp: 1e-4 (~5e-7), top-1 identical;
- fast path (int8 activations, like llama.cpp's own) vs either oracle: 8e-2 (2e-2..6.4e-2; llama.cpp itself
  is 1.5e-2..6.3e-2 from transformers on the same Q4_K_M files), top-1 agreement >= 75% (81%..100%) — random
  weights give small top-1 margins, so a few flips are expected from either implementation's rounding.
"""
from __future__ import annotations

import numpy as np
import oracles  # tests/oracles.py
import pytest

from strata_nb.api import load
from strata_nb.runtime.sampler import SamplerConfig
from strata_nb.synth import write_synthetic
from strata_nb.synth.presets import TINY_ARCHS

pytestmark = pytest.mark.oracle

PROMPT_LEN = 16


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    made: dict[tuple[str, str], str] = {}

    def get(arch: str, quant: str) -> str:
        if (arch, quant) not in made:
            p = tmp_path_factory.mktemp("arch") / f"tiny-{arch}-{quant}.gguf"
            write_synthetic(p, "tiny", arch=arch, quant=quant, seed=7)
            made[arch, quant] = str(p)
        return made[arch, quant]

    return get


def _prompt(path: str) -> list[int]:
    eng = load(path, n_ctx=64, fast=False)
    rng = np.random.default_rng(3)
    return [int(t) for t in rng.integers(0, eng.spec.n_vocab, PROMPT_LEN)]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_reference_path_matches_transformers(files, arch):
    pytest.importorskip("transformers")
    path = files(arch, "Q4_K_M")
    toks = _prompt(path)
    ours = load(path, n_ctx=64, fast=False).logits(toks)
    ref = oracles.transformers_logits(path, toks)
    assert ours.shape == ref.shape == (PROMPT_LEN, ref.shape[1])
    assert _rel(ours, ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_reference_path_matches_llama_cpp_on_f32_weights(files, arch):
    pytest.importorskip("llama_cpp")
    path = files(arch, "F32")
    toks = _prompt(path)
    ours = load(path, n_ctx=64, fast=False).logits(toks)
    ref = oracles.llama_cpp_logits(path, toks)
    assert _rel(ours, ref) < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_fast_path_against_both_oracles(files, arch):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("transformers")
    path = files(arch, "Q4_K_M")
    toks = _prompt(path)
    ours = load(path, n_ctx=64, fast=True).logits(toks)
    for ref in (oracles.llama_cpp_logits(path, toks), oracles.transformers_logits(path, toks)):
        assert _rel(ours, ref) < 8e-2
        assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "mixtral", "olmoe", "qwen3"])
def test_greedy_generation_matches_llama_cpp(files, arch):
    """32 greedy tokens identical to llama.cpp's wherever llama.cpp's own top-1 margin is clear.

    At the first differing token (if any) llama.cpp's margin between its top two logits must be within the
    fast path's rounding (< 0.1 x the logits' RMS, ~4x the per-logit error measured above).
    """
    pytest.importorskip("llama_cpp")
    path = files(arch, "Q4_K_M")
    prompt = _prompt(path)
    eng = load(path, n_ctx=96, fast=True)
    ours = eng.generate(prompt, 32, SamplerConfig(temperature=0.0)).tokens
    theirs = oracles.llama_cpp_greedy(path, prompt, 32)
    n = min(len(ours), len(theirs))
    assert n >= 1
    diff = next((i for i in range(n) if ours[i] != theirs[i]), None)
    if diff is None:
        assert ours[:n] == theirs[:n]
        return
    row = oracles.llama_cpp_logits(path, prompt + theirs[:diff])[-1]
    top2 = np.sort(row)[-2:]
    margin = float(top2[1] - top2[0])
    rms = float(np.sqrt(np.mean(row.astype(np.float64) ** 2)))
    assert margin < 0.1 * rms, f"token {diff} differs although llama.cpp's margin {margin:.3f} is clear (rms {rms:.3f})"
