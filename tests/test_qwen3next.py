"""qwen3next and qwen35moe (gated delta-net + gated attention + MoE with a gated shared expert) on the CPU engine,
against transformers and llama.cpp on files made by llama.cpp's own converter from random transformers models
(tests/family.py), and against llama.cpp on our synthetic files of every quant type.

Bounds (48-token prompt; measured in parentheses):
- reference path (float32 activations) on the F32 file vs transformers: relative L2 <= 1e-4 at every position
  (max ~1e-6), top-1 identical; the prompt in one batch, token by token, and in uneven chunks (the delta-net's
  chunked prompt form against its token-by-token recurrence).
- fast path (int8 activations) on llama.cpp's Q8_0 and Q4_K_M files: median per-position relative L2 against
  transformers at most 1.25x llama.cpp's own + 0.01 (see the printed values), top-1 agreement with transformers
  at least llama.cpp's - 10 points.
- synthetic files (hidden 256, several quant mixes): reference path vs llama.cpp relative L2 < 1e-4 on F32
  weights (~6e-7); on quantized weights the reference path is the exact result for those weights, and the fast
  path's median per-position relative L2 from it is at most 1.25x llama.cpp's + 0.01.
"""
from __future__ import annotations

import family  # tests/family.py
import numpy as np
import oracles  # tests/oracles.py
import pytest

from strata_nb.api import load
from strata_nb.errors import ModelFormatError
from strata_nb.synth import write_synthetic
from strata_nb.synth.presets import TINY_HYBRID

pytestmark = pytest.mark.oracle

PROMPT_LEN = 48
CTX = 64


@pytest.fixture(scope="module", autouse=True)
def _oracle_packages() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("llama_cpp")


def _prompt(n_vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(1234).integers(0, n_vocab, PROMPT_LEN)]


def _rel_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("arch", family.ARCHS)
@pytest.mark.parametrize("feed", ["batch", "tokens", "chunks"])
def test_reference_path_matches_transformers(arch, feed):
    path, hf_dir = family.tiny_gguf(arch, "F32")
    eng = load(path, n_ctx=CTX, fast=False, device="cpu")
    toks = _prompt(eng.spec.n_vocab)
    ref = family.hf_logits(hf_dir, toks)
    if feed == "batch":
        ours = eng.logits(toks)
    else:
        cuts = range(PROMPT_LEN + 1) if feed == "tokens" else [0, 5, 6, 23, 40, PROMPT_LEN]  # 23: two chunks
        s = eng.new_session()
        ours = np.concatenate([eng.backend.forward(s, np.asarray(toks[a:b]), all_logits=True)
                               for a, b in zip(cuts, cuts[1:])])
    rel = _rel_rows(ours, ref)
    print(f"\n{arch} {feed}: max per-position rel L2 {rel.max():.2e}")
    assert rel.max() <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("arch", family.ARCHS)
def test_prompt_state_equals_token_by_token_state(arch):
    """The chunked recurrence of a prompt leaves the state the token-by-token recurrence does."""
    path, _ = family.tiny_gguf(arch, "F32")
    eng = load(path, n_ctx=CTX, fast=False, device="cpu")
    toks = np.asarray(_prompt(eng.spec.n_vocab))
    a, b = eng.new_session(), eng.new_session()
    eng.backend.forward(a, toks)
    for t in toks:
        eng.backend.forward(b, t[None])
    n = 0
    for sa, sb in zip(a.states, b.states):
        if sa.recurrent:
            n += 1
            for x, y in ((sa.conv, sb.conv), (sa.ssm, sb.ssm)):
                assert np.linalg.norm(x - y) <= 1e-5 * np.linalg.norm(y)
    assert n == 3


@pytest.mark.parametrize("arch", family.ARCHS)
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_fast_path_no_worse_than_llama_cpp(arch, quant):
    path, hf_dir = family.tiny_gguf(arch, quant)
    eng = load(path, n_ctx=CTX, fast=True, device="cpu")
    toks = _prompt(eng.spec.n_vocab)
    exact = family.hf_logits(hf_dir, toks)
    ours, lc = eng.logits(toks), oracles.llama_cpp_logits(path, toks)
    e_ours, e_lc = float(np.median(_rel_rows(ours, exact))), float(np.median(_rel_rows(lc, exact)))
    t_ours, t_lc = (float(np.mean(x.argmax(-1) == exact.argmax(-1))) for x in (ours, lc))
    print(f"\n{arch} {quant}: median rel L2 vs transformers: ours {e_ours:.3f}, llama.cpp {e_lc:.3f}; "
          f"top-1 ours {t_ours:.2f}, llama.cpp {t_lc:.2f}")
    assert e_ours <= 1.25 * e_lc + 0.01
    assert t_ours >= t_lc - 0.10


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    made: dict[tuple[str, str], str] = {}

    def get(arch: str, quant: str) -> str:
        if (arch, quant) not in made:
            p = tmp_path_factory.mktemp("hyb") / f"{arch}-{quant}.gguf"
            write_synthetic(p, "tiny", arch=arch, quant=quant, seed=7)
            made[arch, quant] = str(p)
        return made[arch, quant]

    return get


@pytest.mark.parametrize("arch", TINY_HYBRID)
@pytest.mark.parametrize("quant", ["F32", "Q8_0", "Q4_K_M", "Q4_0", "Q6_K", "Q2_K"])
def test_synthetic_files_match_llama_cpp(synth, arch, quant):
    """Our files as llama.cpp reads them: on F32 weights the reference path is llama.cpp's result; on quantized
    weights it is the exact result for those weights (float32 activations), and the fast path is no further from
    it than llama.cpp (whose activations are int8 too)."""
    path = synth(arch, quant)
    ref = load(path, n_ctx=CTX, fast=False, device="cpu")
    toks = _prompt(ref.spec.n_vocab)
    exact, lc = ref.logits(toks), oracles.llama_cpp_logits(path, toks)
    if quant == "F32":
        rel = _rel_rows(exact, lc)
        print(f"\n{arch} {quant}: rel L2 vs llama.cpp max {rel.max():.2e}")
        assert np.linalg.norm(exact - lc) / np.linalg.norm(lc) < 1e-4
        assert (exact.argmax(-1) == lc.argmax(-1)).all()
        return
    ours = load(path, n_ctx=CTX, fast=True, device="cpu").logits(toks)
    e_ours, e_lc = float(np.median(_rel_rows(ours, exact))), float(np.median(_rel_rows(lc, exact)))
    print(f"\n{arch} {quant}: median rel L2 vs exact: ours {e_ours:.3f}, llama.cpp {e_lc:.3f}")
    assert e_ours <= 1.25 * e_lc + 0.01


def test_mtp_blocks_are_read_checked_and_left_out(tmp_path):
    """A file with an MTP block (nextn) gives the logits of the same file without it (llama.cpp too: the MTP block
    only predicts further ahead); a missing MTP tensor is refused by name."""
    base, mtp = tmp_path / "base.gguf", tmp_path / "mtp.gguf"
    write_synthetic(base, "tiny", arch="qwen3next", quant="Q8_0", seed=7)
    write_synthetic(mtp, "tiny", arch="qwen3next", quant="Q8_0", seed=7, mtp_layers=1)
    eng = load(mtp, n_ctx=CTX, device="cpu")
    assert (eng.spec.n_layer, eng.spec.n_nextn) == (4, 1)
    assert eng.store.src.layers == (0, 1, 2, 3)  # the MTP block's experts are not the forward's
    toks = _prompt(eng.spec.n_vocab)[:12]
    np.testing.assert_array_equal(eng.logits(toks), load(base, n_ctx=CTX, device="cpu").logits(toks))
    np.testing.assert_array_equal(oracles.llama_cpp_logits(mtp, toks), oracles.llama_cpp_logits(base, toks))
    broken = tmp_path / "broken.gguf"
    data = mtp.read_bytes()
    name = b"blk.4.nextn.eh_proj.weight"
    assert data.count(name) == 1
    broken.write_bytes(data.replace(name, b"blk.4.nextn.eh_prox.weight"))
    with pytest.raises(ModelFormatError, match="missing tensor blk.4.nextn.eh_proj.weight"):
        load(broken, n_ctx=CTX, device="cpu")
