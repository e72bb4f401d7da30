"""The qwen3next / qwen35moe oracle fixtures (tests/family.py): tiny random models built in transformers, converted
by llama.cpp's own converter, checked to be understood alike by transformers and llama.cpp.

Bounds (48-token random prompt, seed-0 models; measured on seeds 0, 1, 2 in parentheses):
- F32 GGUF, llama.cpp vs transformers, relative L2 over all logits: < 5e-6 (3.4e-7..3.7e-7; max |diff| <= 1.1e-5
  with logits of std ~3; 30 other prompts <= 5.0e-7), top-1 identical at >= 95 % of positions (100 %).
- llama.cpp fed token by token (48 llama_decode calls) vs one batch: relative L2 < 5e-6 (2.4e-7..2.7e-7); in
  micro-batches of 7 tokens: identical to the bit.
- llama.cpp's quantizer on the F32 file, vs transformers, median per-position relative L2: Q8_0 < 0.05
  (0.016..0.019), top-1 >= 80 % (96..100 %); Q4_K_M < 0.2 (0.081..0.099), top-1 >= 60 % (81..88 %). The random
  tiny model amplifies weight noise ~3x (renormalised 16-wide delta-net heads, near-tied router choices), and with
  64-wide rows the k-quants fall back to Q5_0/Q5_1/Q8_0/F16.
"""
from __future__ import annotations

from pathlib import Path

import family  # tests/family.py
import numpy as np
import oracles  # tests/oracles.py
import pytest

from strata_nb.api import Model
from strata_nb.model.gguf_file import GGUFFile, type_name

pytestmark = pytest.mark.oracle

PROMPT_LEN = 48
ARCHS = family.ARCHS


@pytest.fixture(scope="module", autouse=True)
def _oracle_packages() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("llama_cpp")


def _prompt() -> list[int]:
    rng = np.random.default_rng(1234)
    return [int(t) for t in rng.integers(0, family.TINY["vocab_size"], PROMPT_LEN)]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _f32(g: GGUFFile, name: str) -> np.ndarray:
    ref = g.tensor(name)
    assert type_name(ref.qtype) == "F32", name
    return g.data[ref.offset:ref.offset + ref.nbytes].view(np.float32).reshape(ref.shape)


def _expected_tensors(arch: str) -> dict[str, tuple[int, ...]]:
    """Every tensor the converter writes for the tiny model, numpy-order shapes ([rows, row length])."""
    t = family.TINY
    H, V, E = t["hidden_size"], t["vocab_size"], t["num_experts"]
    hd, nh, nkv = t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"]
    hk, hv, dk, dv = (t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"],
                      t["linear_value_head_dim"])
    ff, sff = t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    out = {"token_embd.weight": (V, H), "output.weight": (V, H), "output_norm.weight": (H,)}
    for i in range(t["num_hidden_layers"]):
        b = f"blk.{i}."
        out.update({
            b + "attn_norm.weight": (H,), b + "post_attention_norm.weight": (H,),
            b + "ffn_gate_inp.weight": (E, H), b + "ffn_gate_exps.weight": (E, ff, H),
            b + "ffn_up_exps.weight": (E, ff, H), b + "ffn_down_exps.weight": (E, H, ff),
            b + "ffn_gate_inp_shexp.weight": (1, H), b + "ffn_gate_shexp.weight": (sff, H),
            b + "ffn_up_shexp.weight": (sff, H), b + "ffn_down_shexp.weight": (H, sff),
        })
        if (i + 1) % t["full_attention_interval"]:  # gated delta net
            out.update({
                b + "attn_qkv.weight": (2 * hk * dk + hv * dv, H), b + "attn_gate.weight": (hv * dv, H),
                b + "ssm_conv1d.weight": (2 * hk * dk + hv * dv, t["linear_conv_kernel_dim"]),
                b + "ssm_dt.bias": (hv,), b + "ssm_a": (hv,), b + "ssm_norm.weight": (dv,),
                b + "ssm_out.weight": (H, hv * dv),
            })
            if arch == "qwen3next":
                out[b + "ssm_ba.weight"] = (2 * hv, H)
            else:
                out[b + "ssm_beta.weight"] = (hv, H)
                out[b + "ssm_alpha.weight"] = (hv, H)
        else:  # gated attention: attn_q holds [q | gate] per head, twice the q width
            out.update({
                b + "attn_q.weight": (2 * nh * hd, H), b + "attn_k.weight": (nkv * hd, H),
                b + "attn_v.weight": (nkv * hd, H), b + "attn_output.weight": (H, nh * hd),
                b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,),
            })
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_converted_gguf_has_the_expected_keys_and_tensors(arch):
    path, _ = family.tiny_gguf(arch)
    g = GGUFFile(path)
    t, a = family.TINY, arch
    assert g.arch == arch
    expected_keys = {
        f"{a}.block_count": t["num_hidden_layers"], f"{a}.context_length": t["max_position_embeddings"],
        f"{a}.embedding_length": t["hidden_size"], f"{a}.attention.head_count": t["num_attention_heads"],
        f"{a}.attention.head_count_kv": t["num_key_value_heads"], f"{a}.attention.key_length": t["head_dim"],
        f"{a}.attention.value_length": t["head_dim"],
        f"{a}.rope.dimension_count": int(t["head_dim"] * t["partial_rotary_factor"]),
        f"{a}.expert_count": t["num_experts"], f"{a}.expert_used_count": t["num_experts_per_tok"],
        f"{a}.expert_feed_forward_length": t["moe_intermediate_size"],
        f"{a}.expert_shared_feed_forward_length": t["shared_expert_intermediate_size"],
        f"{a}.ssm.conv_kernel": t["linear_conv_kernel_dim"], f"{a}.ssm.state_size": t["linear_key_head_dim"],
        f"{a}.ssm.group_count": t["linear_num_key_heads"], f"{a}.ssm.time_step_rank": t["linear_num_value_heads"],
        f"{a}.ssm.inner_size": t["linear_num_value_heads"] * t["linear_value_head_dim"],
        f"{a}.full_attention_interval": t["full_attention_interval"], "general.file_type": 0,
    }
    assert {k: g.get(k) for k in expected_keys} == expected_keys
    assert g.get(f"{a}.rope.freq_base") == pytest.approx(t["rope_theta"])
    assert g.get(f"{a}.attention.layer_norm_rms_epsilon") == pytest.approx(t["rms_norm_eps"])
    assert g.get(f"{a}.attention.recurrent_layers").tolist() == [True, True, True, False]
    assert g.get(f"{a}.nextn_predict_layers") is None  # converted with --no-mtp
    if arch == "qwen35moe":  # IMRoPE sections, padded to 4 by the converter
        assert g.get(f"{a}.rope.dimension_sections").tolist() == family.MROPE_SECTION + [0]
    else:
        assert g.get(f"{a}.rope.dimension_sections") is None
    assert {n: r.shape for n, r in g.tensors.items()} == _expected_tensors(arch)
    assert {type_name(r.qtype) for r in g.tensors.values()} == {"F32"}


@pytest.mark.parametrize("arch", ARCHS)
def test_converter_weight_transforms(arch):
    """What a GGUF reader must undo, checked against the saved HF weights: zero-centred RMSNorm gains stored as
    1 + w (the gated delta-net norm as is), A_log as -exp(A_log), conv1d squeezed, and the V-head order: HF groups
    the V heads by K head (v-head h uses k-head h // (Hv/Hk)); qwen3next keeps that order, qwen35moe stores them
    tiled (GGUF v-head j*Hk + g is HF v-head g*(Hv/Hk) + j, so it uses k-head h % Hk)."""
    from safetensors.numpy import load_file

    path, hf_dir = family.tiny_gguf(arch)
    g = GGUFFile(path)
    hf = load_file(Path(hf_dir) / "model.safetensors")
    t = family.TINY
    hk, hv, dk, dv = (t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"],
                      t["linear_value_head_dim"])
    r = hv // hk
    p = "model.layers.0."
    np.testing.assert_array_equal(_f32(g, "blk.0.attn_norm.weight"), 1 + hf[p + "input_layernorm.weight"])
    np.testing.assert_array_equal(_f32(g, "blk.0.post_attention_norm.weight"),
                                  1 + hf[p + "post_attention_layernorm.weight"])
    np.testing.assert_array_equal(_f32(g, "output_norm.weight"), 1 + hf["model.norm.weight"])
    np.testing.assert_array_equal(_f32(g, "blk.3.attn_q_norm.weight"), 1 + hf["model.layers.3.self_attn.q_norm.weight"])
    np.testing.assert_array_equal(_f32(g, "blk.0.ssm_norm.weight"), hf[p + "linear_attn.norm.weight"])

    # GGUF v-head -> HF v-head
    hf_head = np.arange(hv) if arch == "qwen3next" else np.array([g_ * r + j for j in range(r) for g_ in range(hk)])
    np.testing.assert_allclose(_f32(g, "blk.0.ssm_a"), -np.exp(hf[p + "linear_attn.A_log"][hf_head]), rtol=1e-6)
    np.testing.assert_array_equal(_f32(g, "blk.0.ssm_dt.bias"), hf[p + "linear_attn.dt_bias"][hf_head])
    v_cols = (hf_head[:, None] * dv + np.arange(dv)).ravel()  # the V / z / out_proj channels, in GGUF order
    np.testing.assert_array_equal(_f32(g, "blk.0.ssm_out.weight"), hf[p + "linear_attn.out_proj.weight"][:, v_cols])
    conv = hf[p + "linear_attn.conv1d.weight"][:, 0, :]  # [channels, K]
    np.testing.assert_array_equal(_f32(g, "blk.0.ssm_conv1d.weight"),
                                  np.concatenate([conv[:2 * hk * dk], conv[2 * hk * dk:][v_cols]]))
    if arch == "qwen35moe":
        for gguf_name, hf_name, rows in (("ssm_beta", "in_proj_b", hf_head), ("ssm_alpha", "in_proj_a", hf_head),
                                         ("attn_gate", "in_proj_z", v_cols)):
            np.testing.assert_array_equal(_f32(g, f"blk.0.{gguf_name}.weight"),
                                          hf[f"{p}linear_attn.{hf_name}.weight"][rows])
    else:  # in_proj_ba is stored as is: per k-head [b (r rows) | a (r rows)]
        np.testing.assert_array_equal(_f32(g, "blk.0.ssm_ba.weight"), hf[p + "linear_attn.in_proj_ba.weight"])
        # in_proj_qkvz interleaves [q | k | v (r heads) | z (r heads)] per k-head; the GGUF splits it into
        # attn_qkv = [all q | all k | all v] and attn_gate = all z
        w = hf[p + "linear_attn.in_proj_qkvz.weight"].reshape(hk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = np.split(w, np.cumsum([dk, dk, r * dv]), axis=1)
        np.testing.assert_array_equal(_f32(g, "blk.0.attn_qkv.weight"),
                                      np.concatenate([x.reshape(-1, w.shape[-1]) for x in (q, k, v)]))
        np.testing.assert_array_equal(_f32(g, "blk.0.attn_gate.weight"), z.reshape(-1, w.shape[-1]))


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_is_readable_by_strata_and_llama_cpp(arch):
    path, _ = family.tiny_gguf(arch)
    model = Model(path)  # strata-nb opens the file as it would run it: architecture, metadata, tokenizer
    tok = model.tokenizer
    assert tok.vocab_size == model.spec.n_vocab == family.TINY["vocab_size"]
    assert tok.token_text(tok.eos_id) == "<|im_end|>"
    text = "<|im_start|>user\nThe quick brown fox jumps over the lazy dog. 12 + 30 = 42!<|im_end|>"
    ids = model.encode(text)
    assert ids == oracles.llama_cpp_tokenize(path, text, True, True)
    assert max(ids) < family.TINY["vocab_size"] and tok.decode(ids, special=True) == text


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_and_llama_cpp_agree_on_the_f32_file(arch):
    path, hf_dir = family.tiny_gguf(arch)
    toks = _prompt()
    hf = family.hf_logits(hf_dir, toks)
    lc = oracles.llama_cpp_logits(path, toks)
    assert hf.shape == lc.shape == (PROMPT_LEN, family.TINY["vocab_size"])
    assert _rel(lc, hf) < 5e-6
    assert (lc.argmax(-1) == hf.argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_is_batch_invariant(arch):
    """Token-by-token decoding (the recurrent and conv states carried between llama_decode calls) and 7-token
    micro-batches give the logits of one batch."""
    path, _ = family.tiny_gguf(arch)
    toks = _prompt()
    batch = oracles.llama_cpp_logits(path, toks)
    assert _rel(oracles.llama_cpp_logits(path, toks, chunk=1), batch) < 5e-6
    assert _rel(oracles.llama_cpp_logits(path, toks, n_ubatch=7), batch) < 5e-6


@pytest.mark.parametrize("quant, ftype, matrix_type, max_median, min_top1",
                         [("Q8_0", 7, "Q8_0", 0.05, 0.8), ("Q4_K_M", 15, "Q5_0", 0.2, 0.6)])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_files_stay_close_to_transformers(arch, quant, ftype, matrix_type, max_median, min_top1):
    path, hf_dir = family.tiny_gguf(arch, quant)
    g = GGUFFile(path)
    assert g.get("general.file_type") == ftype
    assert type_name(g.tensor("blk.0.ffn_gate_exps.weight").qtype) == matrix_type
    assert type_name(g.tensor("blk.0.ssm_conv1d.weight").qtype) == "F32"
    toks = _prompt()
    hf = family.hf_logits(hf_dir, toks)
    lc = oracles.llama_cpp_logits(path, toks)
    per_position = np.linalg.norm(lc - hf, axis=1) / np.linalg.norm(hf, axis=1)
    assert np.median(per_position) < max_median
    assert (lc.argmax(-1) == hf.argmax(-1)).mean() >= min_top1
