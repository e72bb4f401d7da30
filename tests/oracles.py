"""Independent references for a GGUF file: llama.cpp (llama-cpp-python, low-level API) and transformers (float32).

Nothing here shares code with strata_nb: the engine is compared with these, and tests/test_oracles.py first
checks that the two agree with each other on the synthetic models.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np

LLAMA_CPP_THREADS = 2
GGML_TYPE_F32 = 0
_LOG_CALLBACK = None  # the ctypes log callback must outlive every llama.cpp call


def _stamp(path: str | os.PathLike) -> tuple[str, int, int]:
    """Cache key of a file: its path, mtime and size, so a rewritten file is loaded again."""
    st = os.stat(path)
    return str(path), st.st_mtime_ns, st.st_size


# ----------------------------------------------------------------------------------------------- llama.cpp

@functools.lru_cache(maxsize=None)
def _llama():
    """The llama_cpp module, its backend initialised once and its logging silenced."""
    import llama_cpp

    global _LOG_CALLBACK
    llama_cpp.llama_backend_init()
    _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    return llama_cpp


@functools.lru_cache(maxsize=None)
def _llama_model_cached(stamp: tuple[str, int, int], vocab_only: bool):
    """A loaded llama.cpp model, kept for the rest of the process (test session)."""
    path = stamp[0]
    L = _llama()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False  # the extra CPU buffer types (repacking/AMX) segfault on these VMs
    mp.vocab_only = vocab_only
    mp.use_mmap = True
    model = L.llama_model_load_from_file(os.fsencode(path), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return model


def _llama_model(path: str | os.PathLike, vocab_only: bool):
    return _llama_model_cached(_stamp(path), vocab_only)


def _vocab(path: str | os.PathLike):
    return _llama().llama_model_get_vocab(_llama_model(path, True))


class _Context:
    """A llama.cpp context over a cached model, for one sequence; freed on exit."""

    def __init__(self, path: str | os.PathLike, n_ctx: int, n_ubatch: int | None = None):
        L = _llama()
        self.L = L
        self.model = _llama_model(path, False)
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = n_ubatch or n_ctx
        cp.n_seq_max = 1
        cp.n_threads = LLAMA_CPP_THREADS
        cp.n_threads_batch = LLAMA_CPP_THREADS
        # float32 KV cache: the default f16 cache alone puts ~5e-4 relative error on the logits
        cp.type_k = cp.type_v = GGML_TYPE_F32
        cp.flash_attn_type = 0  # disabled: the CPU flash-attention path rounds Q to f16
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def __enter__(self) -> "_Context":
        return self

    def __exit__(self, *exc) -> None:
        self.L.llama_free(self.ctx)

    def decode(self, tokens: list[int], pos0: int) -> np.ndarray:
        """Run `tokens` at positions pos0.. and return the logits of every one of them, float32 [T, vocab]."""
        L, n = self.L, len(tokens)
        batch = L.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = int(t)
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1
            batch.n_tokens = n
            rc = L.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc}")
            out = np.empty((n, self.n_vocab), np.float32)
            for i in range(n):
                ptr = L.llama_get_logits_ith(self.ctx, i)
                out[i] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
            return out
        finally:
            L.llama_batch_free(batch)


def llama_cpp_logits(path: str | os.PathLike, tokens: list[int], n_ubatch: int | None = None,
                     chunk: int | None = None) -> np.ndarray:
    """llama.cpp's logits for every position of `tokens`, float32 [T, vocab].

    By default the prompt is one llama_decode call computed as one micro-batch. `n_ubatch` makes llama.cpp split
    that call into micro-batches of n_ubatch tokens; `chunk` feeds the prompt in llama_decode calls of `chunk`
    tokens (1: token by token, as in generation), so the cache carries the state between calls."""
    toks = list(tokens)
    step = chunk or max(1, len(toks))
    with _Context(path, max(64, len(toks)), n_ubatch) as c:
        return np.concatenate([c.decode(toks[i:i + step], i) for i in range(0, len(toks), step)])


def llama_cpp_greedy(path: str | os.PathLike, prompt_tokens: list[int], n: int) -> list[int]:
    """Greedy continuation of `prompt_tokens` by llama.cpp: `n` new token ids (argmax, lowest id on ties)."""
    with _Context(path, max(64, len(prompt_tokens) + n)) as c:
        logits = c.decode(list(prompt_tokens), 0)[-1]
        out: list[int] = []
        for i in range(n):
            tok = int(np.argmax(logits))
            out.append(tok)
            if i + 1 < n:
                logits = c.decode([tok], len(prompt_tokens) + i)[-1]
        return out


def llama_cpp_tokenize(path: str | os.PathLike, text: str, add_special: bool, parse_special: bool) -> list[int]:
    """llama.cpp's tokenization of `text` (loads the vocabulary only)."""
    L = _llama()
    vocab = _vocab(path)
    data = text.encode("utf-8")
    cap = len(data) + 16
    buf = (L.llama_token * cap)()
    n = L.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    if n < 0:
        raise RuntimeError(f"llama_tokenize needs {-n} tokens, more than {cap}")
    return list(buf[:n])


def llama_cpp_detokenize(path: str | os.PathLike, tokens: list[int], special: bool = True) -> bytes:
    """llama.cpp's text for `tokens` as bytes; `special` renders control tokens such as <|im_end|>."""
    L = _llama()
    vocab = _vocab(path)
    arr = (L.llama_token * max(1, len(tokens)))(*tokens)
    cap = 64 + 32 * len(tokens)
    buf = ctypes.create_string_buffer(cap)
    n = L.llama_detokenize(vocab, arr, len(tokens), buf, cap, False, special)
    if n < 0:
        raise RuntimeError(f"llama_detokenize needs {-n} bytes, more than {cap}")
    return buf.raw[:n]


def llama_cpp_check_tensors(path: str | os.PathLike) -> None:
    """Load `path` with llama.cpp's check_tensors (ggml_validate_row_data on every tensor: finite scales and
    values); raises RuntimeError if llama.cpp refuses the file. Not cached."""
    L = _llama()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False
    mp.check_tensors = True
    model = L.llama_model_load_from_file(os.fsencode(str(path)), mp)
    if not model:
        raise RuntimeError(f"llama.cpp rejected {path} (check_tensors)")
    L.llama_model_free(model)


def llama_cpp_quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: int, pure: bool = False) -> None:
    """Quantize `src` into `dst` with llama.cpp's own quantizer (llama_model_quantize; `ftype` is a
    gguf.LlamaFileType value, `pure` is llama-quantize --pure)."""
    L = _llama()
    qp = L.llama_model_quantize_default_params()
    qp.ftype = int(ftype)
    qp.nthread = LLAMA_CPP_THREADS
    qp.pure = pure
    rc = L.llama_model_quantize(os.fsencode(str(src)), os.fsencode(str(dst)), ctypes.byref(qp))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed with code {rc}")


# -------------------------------------------------------------------------------------------- transformers

# llama.cpp architecture string -> the transformers model_type that from_pretrained(gguf_file=...) loads.
_HF_GGUF_LOADABLE = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                     "llama": "llama"}


def _gguf_metadata(path: str | os.PathLike) -> dict:
    """Scalar and string metadata of a GGUF file (arrays skipped), with the arch prefix stripped to 'arch.'."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    meta: dict = {"arch": arch}
    for key, field in reader.fields.items():
        if not field.types or field.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        value = field.contents()
        meta[key.replace(f"{arch}.", "arch.", 1) if key.startswith(arch + ".") else key] = value
    meta["tensors"] = {t.name: t for t in reader.tensors}
    return meta


def _rope_parameters(meta: dict) -> dict:
    rp = {"rope_type": "default", "rope_theta": float(meta["arch.rope.freq_base"])}
    if meta.get("arch.rope.scaling.type") == "yarn":
        rp = {"rope_type": "yarn", "rope_theta": rp["rope_theta"],
              "factor": float(meta["arch.rope.scaling.factor"]),
              "original_max_position_embeddings": int(meta["arch.rope.scaling.original_context_length"])}
    return rp


def _patch_config(config, meta: dict) -> None:
    """Fill in what transformers' GGUF config mapping leaves out for these archs (checked in 5.24):
    expert widths for qwen2moe/qwen3moe, head_dim for qwen3 (its default is 128), and rope scaling."""
    config.head_dim = int(meta["arch.attention.key_length"])
    if "arch.expert_feed_forward_length" in meta:
        config.moe_intermediate_size = int(meta["arch.expert_feed_forward_length"])
    if "arch.expert_shared_feed_forward_length" in meta:
        config.shared_expert_intermediate_size = int(meta["arch.expert_shared_feed_forward_length"])
    config.rope_parameters = _rope_parameters(meta)


def _dequantized(meta: dict, name: str):
    import torch
    from gguf.quants import dequantize

    t = meta["tensors"][name]
    arr = dequantize(t.data, t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
    return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))  # a copy: F32 data is a read-only map


def _unpermute(w, n_head: int):
    """Undo convert_hf_to_gguf's LlamaModel.permute of Q/K rows (llama.cpp's llama arch ropes adjacent pairs)."""
    # convert: reshape(n_head, 2, half, ...).swapaxes(1, 2); its inverse swaps the same two axes back
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _build_moe_model(meta: dict):
    """MixtralForCausalLM (llama arch with experts) or OlmoeForCausalLM from GGUF metadata and dequantized
    weights: transformers cannot load these two from GGUF."""
    import torch
    import transformers as tf

    arch = meta["arch"]
    n_layer = int(meta["arch.block_count"])
    n_head, n_head_kv = int(meta["arch.attention.head_count"]), int(meta["arch.attention.head_count_kv"])
    common = dict(
        vocab_size=int(meta["tensors"]["token_embd.weight"].shape[1]),
        hidden_size=int(meta["arch.embedding_length"]), intermediate_size=int(meta["arch.feed_forward_length"]),
        num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head_kv,
        max_position_embeddings=int(meta["arch.context_length"]),
        rms_norm_eps=float(meta["arch.attention.layer_norm_rms_epsilon"]),
        num_experts_per_tok=int(meta["arch.expert_used_count"]), tie_word_embeddings=False,
        rope_parameters=_rope_parameters(meta), bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if arch == "llama":
        config = tf.MixtralConfig(num_local_experts=int(meta["arch.expert_count"]),
                                  head_dim=int(meta["arch.attention.key_length"]), sliding_window=None, **common)
        model = tf.MixtralForCausalLM(config)
    elif arch == "olmoe":
        config = tf.OlmoeConfig(num_experts=int(meta["arch.expert_count"]), norm_topk_prob=False, clip_qkv=None,
                                **common)
        model = tf.OlmoeForCausalLM(config)
    else:
        raise ValueError(f"no transformers builder for arch {arch!r}")

    def w(name: str):
        return _dequantized(meta, name)

    sd = {"model.embed_tokens.weight": w("token_embd.weight"), "model.norm.weight": w("output_norm.weight"),
          "lm_head.weight": w("output.weight")}
    for i in range(n_layer):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        q, k = w(b + "attn_q.weight"), w(b + "attn_k.weight")
        if arch == "llama":
            q, k = _unpermute(q, n_head), _unpermute(k, n_head_kv)
        sd.update({
            h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
            h + "self_attn.v_proj.weight": w(b + "attn_v.weight"),
            h + "self_attn.o_proj.weight": w(b + "attn_output.weight"),
            h + "input_layernorm.weight": w(b + "attn_norm.weight"),
            h + "post_attention_layernorm.weight": w(b + "ffn_norm.weight"),
            h + "mlp.gate.weight": w(b + "ffn_gate_inp.weight"),
            h + "mlp.experts.gate_up_proj": torch.cat([w(b + "ffn_gate_exps.weight"), w(b + "ffn_up_exps.weight")],
                                                      dim=1),
            h + "mlp.experts.down_proj": w(b + "ffn_down_exps.weight"),
        })
        if arch == "olmoe":
            sd[h + "self_attn.q_norm.weight"] = w(b + "attn_q_norm.weight")
            sd[h + "self_attn.k_norm.weight"] = w(b + "attn_k_norm.weight")
    model.load_state_dict(sd, strict=True)
    return model


def _transformers_model(path: str | os.PathLike):
    return _transformers_model_cached(_stamp(path))


@functools.lru_cache(maxsize=8)
def _transformers_model_cached(stamp: tuple[str, int, int]):
    import torch
    import transformers as tf

    path = stamp[0]
    meta = _gguf_metadata(path)
    arch = meta["arch"]
    if arch in _HF_GGUF_LOADABLE and not (arch == "llama" and "arch.expert_count" in meta):
        p = Path(path)
        config = tf.AutoConfig.from_pretrained(p.parent, gguf_file=p.name)
        _patch_config(config, meta)
        model = tf.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, config=config,
                                                        dtype=torch.float32, attn_implementation="eager")
    else:
        model = _build_moe_model(meta)
    model.config._attn_implementation = "eager"
    # loaded with dtype=float32 / built in float32; .float() is refused on GGUF-loaded models
    assert next(model.parameters()).dtype == torch.float32
    return model.eval()


def transformers_logits(path: str | os.PathLike, tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits for every position of `tokens`, float32 [T, vocab]."""
    import torch

    model = _transformers_model(path)
    with torch.no_grad():
        out = model(torch.tensor([list(tokens)], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


def transformers_tokenizer(path: str | os.PathLike):
    """transformers' fast tokenizer converted from the GGUF's tokenizer metadata."""
    import transformers as tf

    p = Path(path)
    return tf.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


def transformers_greedy(path: str | os.PathLike, prompt_tokens: list[int], n: int) -> list[int]:
    """Greedy continuation by transformers (full recompute each step, float32): `n` new token ids."""
    import torch

    model = _transformers_model(path)
    seq = list(prompt_tokens)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq], dtype=torch.long), use_cache=False).logits[0, -1]
            seq.append(int(torch.argmax(logits)))
    return seq[len(prompt_tokens):]
