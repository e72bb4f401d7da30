"""Which GGML type each tensor gets: llama.cpp's Q4_K_M rules (src/llama-quant.cpp) or one type for all."""
from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, LlamaFileType

from strata_nb.errors import StrataError

SINGLE_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
MIXES: tuple[str, ...] = ("Q4_K_M", *SINGLE_TYPES)

FILE_TYPE = {
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M, "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16, "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q2_K": LlamaFileType.MOSTLY_Q2_K, "Q3_K": LlamaFileType.MOSTLY_Q3_K_S, "Q4_K": LlamaFileType.MOSTLY_Q4_K_S,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_S, "Q6_K": LlamaFileType.MOSTLY_Q6_K,
}

# tensor_type_fallback: a 256-block type on a row that is not a multiple of 256 becomes a 32-block type.
_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of layers that get more bits in attn_v / ffn_down (first and last eighth, every third)."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _fallback(qtype: T, ncols: int) -> T:
    if ncols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    new = _FALLBACK.get(qtype, qtype)
    return new if ncols % GGML_QUANT_SIZES[new][0] == 0 else T.F16


def quantizable(name: str, ndim: int) -> bool:
    """llama.cpp's tensor_allows_quantization for the tensors these models have: 2-D/3-D weights except norms,
    the router and the delta-net's conv."""
    return (ndim >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name and "ssm_conv1d.weight" not in name)


def tensor_type(mix: str, name: str, shape: tuple[int, ...], n_layer: int, n_expert: int) -> T:
    """GGML type of tensor `name` (numpy-order `shape`, row length last) in a file of the given mix."""
    if mix not in MIXES:
        raise StrataError(f"unknown quant mix {mix!r}; choose one of {', '.join(MIXES)}")
    if not quantizable(name, len(shape)):
        return T.F32
    ncols = shape[-1]
    if mix != "Q4_K_M":  # a single type for every quantizable tensor, like llama-quantize --pure
        qtype = T[mix]
        return qtype if qtype in (T.F32, T.F16, T.BF16) else _fallback(qtype, ncols)
    qtype = T.Q4_K
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight":
        qtype = T.Q8_0 if ncols % 256 else T.Q6_K
    elif "attn_v.weight" in name:
        qtype = T.Q6_K if use_more_bits(layer, n_layer) else T.Q4_K
        if n_expert == 8:
            qtype = T.Q8_0
    elif "attn_qkv.weight" in name:  # the delta-net's fused projection
        qtype = T.Q5_K
    elif "attn_k.weight" in name:
        if n_expert == 8:
            qtype = T.Q8_0
    elif "attn_output.weight" in name:
        if n_expert == 8:
            qtype = T.Q5_K
    elif "ffn_down" in name:
        if use_more_bits(layer, n_layer):
            qtype = T.Q6_K
    return _fallback(qtype, ncols)
