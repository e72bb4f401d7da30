"""Synthetic GGUF writer: files the gguf reader accepts, with the expected tensors, metadata and valid blocks."""
from __future__ import annotations

import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader
from gguf.quants import dequantize

from strata_nb.errors import StrataError
from strata_nb.synth import MIXES, SINGLE_TYPES, TINY_ARCHS, plan_synthetic, write_synthetic

# Per-layer tensors llama.cpp's loaders create for each arch (src/models/<arch>.cpp), written out here rather
# than derived from the writer so the two are checked against each other.
ATTN = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
        "ffn_norm.weight"}
QK_NORM = {"attn_q_norm.weight", "attn_k_norm.weight"}
QKV_BIAS = {"attn_q.bias", "attn_k.bias", "attn_v.bias"}
MOE = {"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}
SHARED = {"ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}
DENSE = {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
LAYER_TENSORS = {
    "qwen3moe": ATTN | QK_NORM | MOE, "qwen2moe": ATTN | QKV_BIAS | MOE | SHARED, "olmoe": ATTN | QK_NORM | MOE,
    "mixtral": ATTN | MOE, "qwen2": ATTN | QKV_BIAS | DENSE, "qwen3": ATTN | QK_NORM | DENSE, "llama": ATTN | DENSE,
}
GGUF_ARCH = {"mixtral": "llama"}


def field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("synth")
    return {a: write_synthetic(d / f"{a}.gguf", "tiny", arch=a)["path"] for a in TINY_ARCHS}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_file_has_the_arch_tensors_and_metadata(tiny_files, arch):
    r = GGUFReader(tiny_files[arch])
    a = GGUF_ARCH.get(arch, arch)
    assert field(r, "general.architecture") == a
    n_layer = field(r, f"{a}.block_count")
    H = field(r, f"{a}.embedding_length")
    assert (n_layer, H) == (4, 256)
    names = {t.name for t in r.tensors}
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{i}.{n}" for i in range(n_layer) for n in LAYER_TENSORS[arch]}
    assert names == expected

    tokens = field(r, "tokenizer.ggml.tokens")
    t = {x.name: x for x in r.tensors}
    assert list(t["token_embd.weight"].shape) == [H, len(tokens)]  # GGUF order: row length first
    assert list(t["output.weight"].shape) == [H, len(tokens)]
    assert 500 <= len(tokens) <= 4096
    assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.pre") == "qwen2"
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert special in tokens
    assert tokens[field(r, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert len(field(r, "tokenizer.ggml.merges")) > 100
    assert "<|im_start|>" in field(r, "tokenizer.chat_template")

    n_head, n_kv = field(r, f"{a}.attention.head_count"), field(r, f"{a}.attention.head_count_kv")
    hd = field(r, f"{a}.attention.key_length")
    assert list(t["blk.0.attn_q.weight"].shape) == [H, n_head * hd]
    assert list(t["blk.0.attn_k.weight"].shape) == [H, n_kv * hd]
    assert list(t["blk.0.attn_output.weight"].shape) == [n_head * hd, H]
    if "blk.0.ffn_gate_exps.weight" in names:
        E, k = field(r, f"{a}.expert_count"), field(r, f"{a}.expert_used_count")
        assert (E, k) == (8, 2)
        F = field(r, f"{a}.expert_feed_forward_length") if arch.startswith("qwen") else \
            field(r, f"{a}.feed_forward_length")
        assert list(t["blk.0.ffn_gate_exps.weight"].shape) == [H, F, E]
        assert list(t["blk.0.ffn_down_exps.weight"].shape) == [F, H, E]
        assert list(t["blk.0.ffn_gate_inp.weight"].shape) == [H, E]
    if arch == "qwen2moe":
        assert list(t["blk.0.ffn_gate_inp_shexp.weight"].shape) == [H]
        Fs = field(r, f"{a}.expert_shared_feed_forward_length")
        assert list(t["blk.0.ffn_down_shexp.weight"].shape) == [Fs, H]
    if arch == "qwen3moe":
        assert list(t["blk.0.attn_q_norm.weight"].shape) == [hd]
    if arch == "olmoe":  # OLMoE normalizes the whole projection, not per head
        assert list(t["blk.0.attn_q_norm.weight"].shape) == [n_head * hd]
    if arch == "mixtral":
        assert field(r, "llama.rope.scaling.type") == "yarn"
        assert field(r, "llama.rope.scaling.factor") == 4.0
        assert field(r, "llama.rope.scaling.original_context_length") * 4 == field(r, "llama.context_length")
    assert field(r, f"{a}.rope.freq_base") > 0


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2"])
def test_q4_k_m_holds_every_type_of_a_real_q4_k_m_file(tiny_files, arch):
    r = GGUFReader(tiny_files[arch])
    types = {t.name: t.tensor_type for t in r.tensors}
    assert {T.F32, T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0} <= set(types.values())
    assert types["output.weight"] == T.Q6_K
    assert types["token_embd.weight"] == T.Q4_K
    down = "ffn_down_exps" if arch == "qwen3moe" else "ffn_down"
    # rows of 160/640 are not multiples of 256: Q4_K falls back to Q5_0 and Q6_K (layers 2, 3 of 4) to Q8_0
    assert [types[f"blk.{i}.{down}.weight"] for i in range(4)] == [T.Q5_0, T.Q5_0, T.Q8_0, T.Q8_0]
    for name, qt in types.items():
        if name.endswith(("_norm.weight", ".bias", "ffn_gate_inp.weight")):
            assert qt == T.F32, name
    if arch == "qwen3moe":  # llama.cpp's n_expert == 8 rules
        assert types["blk.0.attn_v.weight"] == T.Q8_0 and types["blk.0.attn_k.weight"] == T.Q8_0
        assert types["blk.0.attn_output.weight"] == T.Q5_K
    else:
        assert [types[f"blk.{i}.attn_v.weight"] for i in range(4)] == [T.Q4_K, T.Q4_K, T.Q6_K, T.Q6_K]


# Where a single-type mix meets a row length that is not a multiple of 256 (llama.cpp tensor_type_fallback).
FALLBACK = {"Q2_K": T.Q4_0, "Q3_K": T.Q4_0, "Q4_K": T.Q5_0, "Q5_K": T.Q5_1, "Q6_K": T.Q8_0}


@pytest.mark.parametrize("mix", MIXES)
def test_every_mix_writes_valid_blocks_with_the_planned_scale(tmp_path, mix):
    arch = "qwen2moe"  # the arch with the most tensor kinds: biases, shared expert, 1-D gate
    path = write_synthetic(tmp_path / "m.gguf", "tiny", arch=arch, quant=mix, seed=3)["path"]
    plan = {t.name: t for t in plan_synthetic("tiny", arch=arch, quant=mix).tensors}
    r = GGUFReader(path)
    assert len(r.tensors) == len(plan)
    for t in r.tensors:
        p = plan[t.name]
        assert t.tensor_type == p.qtype, t.name
        vals = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64)
        assert vals.size == int(np.prod(t.shape))
        assert np.isfinite(vals).all(), t.name
        rms_dev = np.sqrt(np.mean((vals - p.mean) ** 2))
        assert 0.7 * p.std < rms_dev < 1.3 * p.std, (t.name, rms_dev, p.std)
        # zero-mean payload: the sample mean is within 5 standard errors (plus 1% of std for scale rounding)
        assert abs(vals.mean() - p.mean) < 5 * p.std / np.sqrt(vals.size) + 0.01 * p.std, t.name
        if mix in SINGLE_TYPES and t.name in ("blk.0.attn_q.weight", "blk.0.ffn_down_exps.weight"):
            ncols = int(t.shape[0])
            want = T[mix] if ncols % 256 == 0 or mix not in FALLBACK else FALLBACK[mix]
            assert t.tensor_type == want, (t.name, mix)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = write_synthetic(tmp_path / "a.gguf", "tiny", arch="olmoe", seed=1)["path"]
    b = write_synthetic(tmp_path / "b.gguf", "tiny", arch="olmoe", seed=1)["path"]
    c = write_synthetic(tmp_path / "c.gguf", "tiny", arch="olmoe", seed=2)["path"]
    da, db, dc = (open(p, "rb").read() for p in (a, b, c))
    assert da == db
    assert len(da) == len(dc) and da != dc


def test_written_to_a_temporary_name_and_renamed_when_complete(tmp_path):
    path = tmp_path / "model.gguf"
    partial = tmp_path / "model.gguf.partial"
    path.write_bytes(b"old contents")
    seen: list[tuple[bool, bool]] = []

    def progress(done: int, total: int) -> None:
        seen.append((partial.exists(), path.read_bytes() == b"old contents"))

    summary = write_synthetic(path, "tiny", progress=progress)
    assert seen and all(p and old for p, old in seen)  # the target is untouched while the file is written
    assert not partial.exists()
    assert path.stat().st_size == summary["bytes"]
    GGUFReader(path)

    class Stop(Exception):
        pass

    def fail(done: int, total: int) -> None:
        if done > total // 2:
            raise Stop

    with pytest.raises(Stop):
        write_synthetic(tmp_path / "broken.gguf", "tiny", progress=fail)
    assert not (tmp_path / "broken.gguf").exists() and not (tmp_path / "broken.gguf.partial").exists()


def test_bad_requests_raise_strata_errors(tmp_path):
    with pytest.raises(StrataError, match="unknown synth preset"):
        write_synthetic(tmp_path / "x.gguf", "gpt-5")
    with pytest.raises(StrataError, match="unknown tiny arch"):
        write_synthetic(tmp_path / "x.gguf", "tiny", arch="gpt2")
    with pytest.raises(StrataError, match="unknown quant mix"):
        write_synthetic(tmp_path / "x.gguf", "tiny", quant="Q4_K_S")
    with pytest.raises(StrataError, match="directory does not exist"):
        write_synthetic(tmp_path / "no" / "x.gguf", "tiny")
    assert not list(tmp_path.iterdir())


def test_published_presets_have_the_published_shapes():
    # config.json values of the released checkpoints
    p = plan_synthetic("qwen3-30b-a3b")
    t = {x.name: x for x in p.tensors}
    assert p.shape.layers == 48 and p.vocab_size == 151936
    assert t["blk.47.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert t["blk.0.attn_q.weight"].shape == (32 * 128, 2048) and t["blk.0.attn_k.weight"].shape == (4 * 128, 2048)
    assert t["blk.0.attn_q_norm.weight"].shape == (128,)
    # the released Qwen3-30B-A3B-Q4_K_M.gguf is 18.6 GB
    assert 18.0e9 < p.data_bytes < 19.0e9
    assert plan_synthetic("qwen3-235b-a22b").tensors[-1].shape == (151936, 4096)
    olmoe = {x.name: x for x in plan_synthetic("olmoe-1b-7b").tensors}
    assert olmoe["blk.15.ffn_down_exps.weight"].shape == (64, 2048, 1024)
    mixtral = {x.name: x for x in plan_synthetic("mixtral-8x7b").tensors}
    assert mixtral["blk.31.ffn_up_exps.weight"].shape == (8, 14336, 4096)
    assert mixtral["blk.0.attn_k.weight"].shape == (8 * 128, 4096)


def test_write_speed(tmp_path):
    """Streams a ~200 MB file (one OLMoE-1B-7B layer plus its 50k-row embedding and head, Q2_K)."""
    t0 = time.perf_counter()
    s = write_synthetic(tmp_path / "big.gguf", "olmoe-1b-7b", layers=1, quant="Q2_K")
    seconds = time.perf_counter() - t0
    mb_s = s["bytes"] / 1e6 / seconds
    print(f"\nsynth write: {s['bytes'] / 1e6:.0f} MB in {seconds:.2f} s = {mb_s:.0f} MB/s")
    assert s["bytes"] > 150e6
    assert mb_s > 25  # loose floor (1.5 GB/min) for a shared 2-core VM; ~200-500 MB/s measured
