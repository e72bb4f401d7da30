"""The oracles agree with each other on the synthetic models, before the engine is compared with them.

llama.cpp and transformers are independent implementations; if both produce the same logits from one synthetic
file, the file is a sound model of its architecture and each oracle is wired correctly (tensor mapping, Q/K
permutation, rope and YaRN, shared expert gate, QK-norm, biases, quant dequantization).
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from gguf import GGUFReader, LlamaFileType

from strata_nb.synth import SINGLE_TYPES, TINY_ARCHS, plan_synthetic, write_synthetic
from strata_nb.synth.quantmix import FILE_TYPE

_missing = [m for m in ("llama_cpp", "transformers", "torch") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.oracle,
    pytest.mark.skipif(bool(_missing), reason=f"oracle packages not importable: {', '.join(_missing)}"),
]

if not _missing:
    import torch
    from oracles import (llama_cpp_check_tensors, llama_cpp_detokenize, llama_cpp_greedy, llama_cpp_logits,
                         llama_cpp_quantize, llama_cpp_tokenize, transformers_greedy, transformers_logits,
                         transformers_tokenizer)

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was a small village"

# Tolerances. F32 weights: both sides compute in float32 (llama.cpp with an f32 KV cache and flash attention
# off), so only summation order differs: measured ~7e-7. Quantized weights: transformers multiplies the
# dequantized weights in float32, llama.cpp also rounds the activations to 8 bits (Q8_0/Q8_K) for its dot
# products: ~1.3% relative on dense models, and where that flips a near-tie in a router another expert runs and
# the error at that position (and, through attention, after it) jumps to 10-30%. Measured worst case over the
# mixes: 9% (Q3_K, qwen3moe). So quantized files get a loose bound here; the tight check of the engine on
# quantized files is against transformers, which dequantizes exactly.
F32_REL = 1e-5
QUANT_REL = 0.15
QUANT_TOP1 = 0.75
DENSE_QUANT_REL = 0.04  # measured 1.2-1.9% for every quant type, 0.05% F16, 0.4% BF16
DENSE_QUANT_TOP1 = 0.8
DENSE_NEAR_TIE = 0.25  # measured at most 0.07
NEAR_TIE = 1.0  # where top-1 differs, transformers' logit for llama.cpp's pick is within this of its maximum
                # (logits have a standard deviation of ~4)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle-synth")
    cache: dict[tuple[str, str], str] = {}

    def get(arch: str, mix: str) -> str:
        if (arch, mix) not in cache:
            cache[arch, mix] = write_synthetic(d / f"{arch}-{mix}.gguf", "tiny", arch=arch, quant=mix)["path"]
        return cache[arch, mix]

    return get


def _prompt(path: str) -> list[int]:
    ids = llama_cpp_tokenize(path, PROMPT, False, False)
    assert len(ids) >= 16
    return ids[:16]


def _compare(path: str) -> tuple[float, float, float, np.ndarray, np.ndarray]:
    tokens = _prompt(path)
    hf = transformers_logits(path, tokens)
    lc = llama_cpp_logits(path, tokens)
    assert hf.shape == lc.shape == (16, hf.shape[1])
    assert np.isfinite(hf).all() and np.isfinite(lc).all()
    rel = float(np.linalg.norm(hf - lc) / np.linalg.norm(hf))
    top1 = float(np.mean(hf.argmax(-1) == lc.argmax(-1)))
    # how far llama.cpp's top-1 is from transformers' best, in transformers' logits (0 where they agree)
    gap = float(np.max(hf.max(-1) - hf[np.arange(len(tokens)), lc.argmax(-1)]))
    return rel, top1, gap, hf, lc


@pytest.mark.parametrize("mix", ["F32", "Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_llama_cpp_and_transformers_logits_agree(files, arch, mix):
    rel, top1, gap, hf, _ = _compare(files(arch, mix))
    print(f"\n{arch:9s} {mix:7s} rel L2 {rel:.2e}  top-1 {top1:.3f}  worst top-1 gap {gap:.3f}  "
          f"logit std {hf.std():.2f}")
    if mix == "F32":
        assert rel < F32_REL and top1 == 1.0
    else:
        assert rel < QUANT_REL and top1 >= QUANT_TOP1 and gap < NEAR_TIE


def test_both_oracles_apply_yarn(files):
    """The tiny Mixtral-style file carries YaRN keys; the agreement above means something only if both sides
    apply them: transformers with plain rope on the same weights is far from llama.cpp."""
    import oracles

    path = files("mixtral", "F32")
    tokens = _prompt(path)
    lc = llama_cpp_logits(path, tokens)
    meta = oracles._gguf_metadata(path)
    assert meta["arch.rope.scaling.type"] == "yarn"
    del meta["arch.rope.scaling.type"]
    plain = oracles._build_moe_model(meta)
    with torch.no_grad():
        hf_plain = plain(torch.tensor([tokens]), use_cache=False).logits[0].numpy()
    assert np.linalg.norm(hf_plain - lc) / np.linalg.norm(lc) > 100 * F32_REL
    assert np.linalg.norm(transformers_logits(path, tokens) - lc) / np.linalg.norm(lc) < F32_REL


@pytest.mark.parametrize("mix", [m for m in SINGLE_TYPES if m not in ("F32", "Q8_0")])
def test_every_quant_type_is_valid_and_agrees(files, mix):
    """Every block of every type passes llama.cpp's validation (MoE file: 2-D and 3-D tensors); the logits of a
    dense model agree (no router, so no near-tie flips: the bound is tight)."""
    llama_cpp_check_tensors(files("qwen3moe", mix))
    rel, top1, gap, _, _ = _compare(files("qwen2", mix))
    print(f"\nqwen2     {mix:7s} rel L2 {rel:.2e}  top-1 {top1:.3f}  worst top-1 gap {gap:.3f}")
    assert rel < DENSE_QUANT_REL and top1 >= DENSE_QUANT_TOP1 and gap < DENSE_NEAR_TIE


def test_check_tensors_rejects_a_non_finite_scale(files, tmp_path):
    """The validity check above can fail: a NaN fp16 scale in one Q8_0 block is refused."""
    src = files("qwen3moe", "Q8_0")
    t = next(t for t in GGUFReader(src).tensors if t.name == "blk.0.attn_k.weight")
    data = bytearray(open(src, "rb").read())
    data[t.data_offset:t.data_offset + 2] = b"\x00\x7e"  # fp16 NaN in the first block's d
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="check_tensors"):
        llama_cpp_check_tensors(bad)


@pytest.mark.parametrize("arch,layers", [(a, None) for a in TINY_ARCHS] + [("qwen3moe", 12)])
def test_q4_k_m_mix_matches_llama_cpp_quantizer(tmp_path, arch, layers):
    """llama.cpp's own quantizer, run on the F32 file, picks the same type for every tensor as our mix."""
    src = write_synthetic(tmp_path / "f32.gguf", "tiny", arch=arch, layers=layers, quant="F32")["path"]
    llama_cpp_quantize(src, tmp_path / "q.gguf", LlamaFileType.MOSTLY_Q4_K_M)
    got = {t.name: t.tensor_type for t in GGUFReader(tmp_path / "q.gguf").tensors}
    want = {t.name: t.qtype for t in plan_synthetic("tiny", arch=arch, layers=layers, quant="Q4_K_M").tensors}
    assert got == want


@pytest.mark.parametrize("mix", SINGLE_TYPES)
def test_single_type_mix_matches_llama_cpp_pure_quantizer(tmp_path, mix):
    src = write_synthetic(tmp_path / "f32.gguf", "tiny", arch="qwen2moe", quant="F32")["path"]
    llama_cpp_quantize(src, tmp_path / "q.gguf", FILE_TYPE[mix], pure=True)
    got = {t.name: t.tensor_type for t in GGUFReader(tmp_path / "q.gguf").tensors}
    want = {t.name: t.qtype for t in plan_synthetic("tiny", arch="qwen2moe", quant=mix).tensors}
    assert got == want


TEXTS = [
    "Hello world! The quick brown fox.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\n\nnewlines\t tabs 12345 ünïcödé 日本 🙂",
    "we're done; it's 3.14 and THEY'LL see",
]


def test_tokenizer_agrees_between_llama_cpp_and_transformers(files):
    path = files("qwen3moe", "F32")
    tok = transformers_tokenizer(path)
    for text in TEXTS:
        ids = llama_cpp_tokenize(path, text, False, True)
        assert tok.encode(text, add_special_tokens=False) == ids, text
        assert llama_cpp_detokenize(path, ids) == text.encode()
        assert tok.decode(ids) == text
    # without special parsing the markers are plain text, not the control tokens
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert im_start in llama_cpp_tokenize(path, TEXTS[1], False, True)
    assert im_start not in llama_cpp_tokenize(path, TEXTS[1], False, False)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_generation_agrees_and_does_not_collapse(files, arch):
    path = files(arch, "F32")
    prompt = llama_cpp_tokenize(path, "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n",
                                False, True)
    lc = llama_cpp_greedy(path, prompt, 24)
    assert lc == transformers_greedy(path, prompt, 24)
    assert len(set(lc)) >= 8 and len(set(lc[:4])) > 1, lc
