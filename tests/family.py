"""Tiny random Qwen3-Next (`qwen3next`) and Qwen3.5-MoE (`qwen35moe`) models as oracle fixtures.

A model is built in transformers with every parameter randomised, saved, and converted to GGUF by llama.cpp's own
convert_hf_to_gguf.py (from the llama-cpp-python sdist the tests install, so the converter matches the llama.cpp
that runs the file). The same weights then have two independent references: transformers on the saved model
directory (hf_logits) and llama.cpp on the GGUF (oracles.llama_cpp_logits). transformers cannot load these
architectures from GGUF, hence the direction HF -> GGUF.

The tiny HF model has no tokenizer; the converter is given the trained BPE vocabulary of strata_nb.synth.vocab,
cut to the model's 512 rows (tests/family_convert.py writes it in place of the converter's set_vocab).
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

LLAMA_CPP_PY = "0.3.36"  # the llama-cpp-python version tests/run.sh installs; its sdist carries the converter
_SDIST_ROOT = f"llama_cpp_python-{LLAMA_CPP_PY}/vendor/llama.cpp/"
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
_RUNNER = Path(__file__).with_name("family_convert.py")

ARCHS = ("qwen3next", "qwen35moe")
HF_ARCH = {"qwen3next": "Qwen3NextForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}

# Tiny dimensions (shared by both archs). Hv/Hk = 2 exercises the k-head -> v-head mapping (grouped in qwen3next,
# tiled in qwen35moe); linear key and value head dims must be equal, llama.cpp sizes the state by one of them.
TINY: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, full_attention_interval=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    # rope_theta is no common default, so an engine ignoring rope.freq_base disagrees visibly. rms_norm_eps is the
    # real models' 1e-6: HF's delta-net q/k L2 norm hard-codes 1e-6 where llama.cpp uses the GGUF's rms epsilon.
    rope_theta=20000.0, rms_norm_eps=1e-6, max_position_embeddings=4096,
)
# qwen35moe's interleaved M-RoPE sections (t, h, w) over the rotary pairs: they must sum to
# head_dim * partial_rotary_factor / 2 = 4. Text positions are equal in t/h/w, so the split does not change the result.
MROPE_SECTION = [2, 1, 1]

# Scales of the random weights (std = gain / sqrt(fan_in), so activations stay unit-scale).
# Router logits spread ~2: top-2 choices are clear but not one-hot. Logits spread ~3: no single token dominates a
# softmax over 512, while top-1 margins stay far above float32 rounding.
ROUTER_GAIN = 2.0
HEAD_GAIN = 3.0
# The projections writing into the residual stream (o_proj, out_proj, expert and shared-expert down_proj). At 1.0
# the tiny model is chaotic: a 16-wide GDN head output built from a few tokens is renormalised by its gated RMSNorm,
# and near-tied router choices flip, so 0.5 % weight noise moved the logits by ~5-13 % (Q8_0: 13 %, top-1 73 %).
# At 0.35 Q8_0 gives ~1.7 % per position while the blocks still carry ~55 % of the logits.
OUT_GAIN = 0.35
# A = exp(A_log) ~ 0.05..0.4, per-token decay exp(-A softplus(a + dt_bias)) ~ 0.75..0.97: the recurrent state
# carries information across tens of tokens (and across ubatch boundaries).
A_LOG_MEAN = -2.0


def cache_root() -> Path:
    return Path(os.environ.get("STRATA_NB_CACHE") or Path.home() / ".cache" / "strata-nb")


# ----------------------------------------------------------------------------------------------- converter

def converter_dir() -> Path:
    """llama.cpp's converter (convert_hf_to_gguf.py, conversion/, gguf-py/) from the llama-cpp-python sdist,
    extracted once into <cache>/llama-convert (tests/run.sh does the same). A VERSION file marks a complete
    extraction of this version; the files are unpacked into a temporary sibling and renamed into place, so a
    concurrent or interrupted run never leaves a half-written converter."""
    dst = cache_root() / "llama-convert"

    def complete() -> bool:
        stamp = dst / "VERSION"
        return stamp.is_file() and stamp.read_text().strip() == LLAMA_CPP_PY

    if complete():
        return dst
    sdist = cache_root() / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PY}.tar.gz"
    if not sdist.is_file():
        pytest.skip(f"llama-cpp-python {LLAMA_CPP_PY} sdist not found at {sdist} (tests/run.sh downloads it): "
                    "no llama.cpp converter")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="llama-convert.", dir=dst.parent))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name[len(_SDIST_ROOT):] if m.name.startswith(_SDIST_ROOT) else ""
                if rel and (rel == _CONVERTER_PARTS[0] or rel.startswith(_CONVERTER_PARTS[1:])):
                    m.name = rel
                    members.append(m)
            names = {m.name for m in members}
            if _CONVERTER_PARTS[0] not in names or "gguf-py/gguf/__init__.py" not in names:
                raise RuntimeError(f"{sdist} has no vendor/llama.cpp/convert_hf_to_gguf.py and gguf-py")
            tar.extractall(tmp, members=members, filter="data")
        (tmp / "VERSION").write_text(LLAMA_CPP_PY + "\n")
        if complete():  # another process finished first
            return dst
        shutil.rmtree(dst, ignore_errors=True)  # an older version or an unmarked (partial) directory
        try:
            tmp.rename(dst)
        except OSError:  # another process renamed its copy first
            if not complete():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


# ------------------------------------------------------------------------------------------------ vocabulary

def tokenizer_metadata(n_vocab: int) -> list[tuple[str, str, object]]:
    """strata_nb.synth.vocab's GGUF tokenizer keys with the vocabulary cut to exactly `n_vocab` ids: the first
    n_vocab - 3 BPE tokens (the byte alphabet and the merges that made them), then the three special tokens.

    llama.cpp requires one token per embedding row. The BPE trainer numbers merge i's result alphabet + i, so the
    first merges only ever join tokens that are kept; this is checked. Keys holding a token id are re-pointed at
    the same token text."""
    from strata_nb.synth import vocab

    full, n_full = vocab.tokenizer_metadata(None)
    bpe_tokens, merges = vocab.trained_bpe()
    n_special = len(vocab.SPECIAL_TOKENS)
    n_bpe_full = n_full - n_special
    n_alphabet = n_bpe_full - len(merges)
    n_bpe = n_vocab - n_special
    if not n_alphabet <= n_bpe <= n_bpe_full:
        raise ValueError(f"n_vocab {n_vocab} outside {n_alphabet + n_special}..{n_full}")
    kept_merges = list(merges[:n_bpe - n_alphabet])
    for i, m in enumerate(kept_merges):
        if m.replace(" ", "") != bpe_tokens[n_alphabet + i]:
            raise AssertionError(f"merge {i} ({m!r}) does not make token {n_alphabet + i}: cannot cut the vocabulary")
    values = {k: v for k, _, v in full}
    old_tokens: list[str] = values["tokenizer.ggml.tokens"]  # type: ignore[assignment]
    old_types: list[int] = values["tokenizer.ggml.token_type"]  # type: ignore[assignment]
    tokens = old_tokens[:n_bpe] + old_tokens[n_bpe_full:n_full]
    new_id = {t: i for i, t in enumerate(tokens)}
    out: list[tuple[str, str, object]] = []
    for key, kind, value in full:
        if key == "tokenizer.ggml.tokens":
            value = tokens
        elif key == "tokenizer.ggml.token_type":
            value = old_types[:n_bpe] + old_types[n_bpe_full:n_full]
        elif key == "tokenizer.ggml.merges":
            value = kept_merges
        elif key.endswith("_token_id"):
            value = new_id[old_tokens[int(value)]]  # type: ignore[call-overload]
        out.append((key, kind, value))
    return out


# ---------------------------------------------------------------------------------------------- tiny models

def _hf_config(arch: str) -> Any:
    import torch
    import transformers as tf

    t = TINY
    common = dict(
        vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"], linear_num_key_heads=t["linear_num_key_heads"],
        linear_num_value_heads=t["linear_num_value_heads"], linear_key_head_dim=t["linear_key_head_dim"],
        linear_value_head_dim=t["linear_value_head_dim"], linear_conv_kernel_dim=t["linear_conv_kernel_dim"],
        num_experts=t["num_experts"], num_experts_per_tok=t["num_experts_per_tok"],
        moe_intermediate_size=t["moe_intermediate_size"],
        shared_expert_intermediate_size=t["shared_expert_intermediate_size"], rms_norm_eps=t["rms_norm_eps"],
        max_position_embeddings=t["max_position_embeddings"], full_attention_interval=t["full_attention_interval"],
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        dtype=torch.float32,
    )
    rope = {"rope_type": "default", "rope_theta": t["rope_theta"],
            "partial_rotary_factor": t["partial_rotary_factor"]}
    if arch == "qwen3next":
        # llama.cpp always renormalises the top-k router weights (build_moe_ffn norm_w=true), and no GGUF key says so
        config = tf.Qwen3NextConfig(rope_parameters=rope, norm_topk_prob=True, decoder_sparse_step=1,
                                    mlp_only_layers=[], **common)
    elif arch == "qwen35moe":  # Qwen3.5-MoE always renormalises (no norm_topk_prob field)
        config = tf.Qwen3_5MoeTextConfig(
            rope_parameters={**rope, "mrope_section": list(MROPE_SECTION), "mrope_interleaved": True}, **common)
    else:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    config._attn_implementation = "eager"
    return config


def _randomise(model: Any, seed: int) -> None:
    """Overwrite every parameter with seeded random values.

    HF's init leaves the zero-centred RMSNorm weights (applied as 1 + w) at 0, which would hide a reader that
    forgets the converter's +1; A_log and dt_bias get per-head spread so each v-head decays differently."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: a plain gain (not 1 + w)
                v = normal(p.shape, 0.3, 1.0)
            elif name.endswith("norm.weight"):  # zero-centred RMSNorm gains
                v = normal(p.shape, 0.3)
            elif name.endswith("A_log"):
                v = normal(p.shape, 0.5, A_LOG_MEAN)
            elif name.endswith("dt_bias"):
                v = normal(p.shape, 0.3)
            elif name.endswith("embed_tokens.weight"):
                v = normal(p.shape, 1.0)
            elif name == "lm_head.weight":
                v = normal(p.shape, HEAD_GAIN / p.shape[-1] ** 0.5)
            elif name.endswith("mlp.gate.weight"):  # the router
                v = normal(p.shape, ROUTER_GAIN / p.shape[-1] ** 0.5)
            elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj", "down_proj.weight")):
                v = normal(p.shape, OUT_GAIN / p.shape[-1] ** 0.5)
            elif p.ndim >= 2:  # projections, experts ([E, out, in]) and the depthwise conv ([C, 1, K])
                v = normal(p.shape, 1.0 / p.shape[-1] ** 0.5)
            else:
                raise AssertionError(f"no randomisation rule for parameter {name} {tuple(p.shape)}")
            p.copy_(v)


def make_tiny(arch: str, out_dir: str | os.PathLike, seed: int = 0) -> dict[str, Any]:
    """Build the tiny `arch` model in transformers with all parameters random (seeded), save it to `out_dir`
    (config.json + model.safetensors) and return the hyperparameters tests check the GGUF against."""
    import torch
    import transformers as tf

    config = _hf_config(arch)
    torch.manual_seed(seed)  # the HF init is overwritten, but keep its draws deterministic too
    cls = tf.Qwen3NextForCausalLM if arch == "qwen3next" else tf.Qwen3_5MoeForCausalLM
    model = cls(config).to(torch.float32).eval()
    _randomise(model, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    t = TINY
    info: dict[str, Any] = {
        "arch": arch, "hf_arch": HF_ARCH[arch], "seed": seed, **t,
        "layer_types": list(config.layer_types),
        "recurrent": [lt == "linear_attention" for lt in config.layer_types],
        "rope_dim": int(t["head_dim"] * t["partial_rotary_factor"]),
        "conv_dim": 2 * t["linear_num_key_heads"] * t["linear_key_head_dim"]
        + t["linear_num_value_heads"] * t["linear_value_head_dim"],
        "value_dim": t["linear_num_value_heads"] * t["linear_value_head_dim"],
    }
    if arch == "qwen35moe":
        info["mrope_section"] = list(MROPE_SECTION)
    return info


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str) -> Any:
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_logits(model_dir: str | os.PathLike, tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits for every position of `tokens` (one forward, no cache), [T, vocab]."""
    import torch

    model = _hf_model(str(Path(model_dir).resolve()))
    with torch.no_grad():
        out = model(torch.tensor([list(tokens)], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


# ------------------------------------------------------------------------------------------------ conversion

def convert(model_dir: str | os.PathLike, out_gguf: str | os.PathLike, outtype: str = "f32") -> Path:
    """Convert the HF model in `model_dir` to `out_gguf` with llama.cpp's convert_hf_to_gguf.py (`outtype` as its
    --outtype), the vocabulary replaced by tokenizer_metadata(vocab_size). Written under a temporary name and
    renamed when the converter succeeded."""
    model_dir, out = Path(model_dir), Path(out_gguf)
    conv = converter_dir()
    n_vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    tmp = out.with_name(out.name + ".partial")
    vocab_json = out.with_name(out.name + ".vocab.json")
    vocab_json.write_text(json.dumps(tokenizer_metadata(n_vocab)))
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    # The sdist's gguf-py is newer than the installed gguf package and must win the import.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(conv / "gguf-py"), str(conv), env.get("PYTHONPATH")) if p)
    # The Qwen3-Next / Qwen3.5 converters require an MTP block unless told to leave it out; the tiny models have none.
    cmd = [sys.executable, str(_RUNNER), str(conv), str(vocab_json), "--",
           str(model_dir), "--outfile", str(tmp), "--outtype", outtype, "--no-mtp"]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf failed ({res.returncode}) on {model_dir}:\n{res.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        vocab_json.unlink(missing_ok=True)
    return out


# ------------------------------------------------------------------------------------------- session cache

_WORK: Path | None = None
_BUILT: dict[tuple[str, str, int], tuple[Path, Path]] = {}


def _work_dir() -> Path:
    global _WORK
    if _WORK is None:
        _WORK = Path(tempfile.mkdtemp(prefix="strata-family-"))
        atexit.register(shutil.rmtree, _WORK, True)
    return _WORK


def tiny_gguf(arch: str, quant: str = "F32", seed: int = 0) -> tuple[Path, Path]:
    """(GGUF path, HF model directory) of the tiny `arch` model, built once per process.

    `quant` "F32" is the converter's own output; any other llama.cpp file type name (Q8_0, Q4_K_M, ...) is the F32
    file quantized by llama.cpp (llama_model_quantize). With hidden 64 the k-quant rows (256 wide) do not fit, so
    llama.cpp falls back to its legacy types for those tensors, as it does for any row width that is not a multiple
    of 256."""
    key = (arch, quant.upper(), seed)
    if key in _BUILT:
        return _BUILT[key]
    if key[1] == "F32":
        hf_dir = _work_dir() / f"{arch}-s{seed}-hf"
        make_tiny(arch, hf_dir, seed)
        path = convert(hf_dir, _work_dir() / f"{arch}-s{seed}-F32.gguf", "f32")
    else:
        import gguf
        import oracles  # tests/oracles.py

        src, hf_dir = tiny_gguf(arch, "F32", seed)
        try:
            ftype = gguf.LlamaFileType[f"MOSTLY_{key[1]}"]
        except KeyError:
            raise ValueError(f"unknown llama.cpp file type {quant!r}") from None
        path = _work_dir() / f"{arch}-s{seed}-{key[1]}.gguf"
        tmp = path.with_name(path.name + ".partial")
        try:
            oracles.llama_cpp_quantize(src, tmp, int(ftype))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    _BUILT[key] = (path, hf_dir)
    return _BUILT[key]
