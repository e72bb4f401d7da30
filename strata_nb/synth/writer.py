"""Streaming GGUF writer for synthetic models: header, metadata and tensor table, then tensor data in chunks."""
from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

from strata_nb.errors import StrataError
from strata_nb.model.spec import ARCHITECTURES, DeltaNetSpec, LayerSpec, ModelSpec, RopeSpec
from strata_nb.model.tensors import TensorDef, layer_tensors
from strata_nb.synth import blocks, quantmix, skew as skewmod, vocab
from strata_nb.synth.presets import Shape, resolve

ALIGNMENT = 32
CHUNK_BYTES = 16 << 20  # bytes generated and written at a time: bounds memory for any tensor size

# Output-head gain: logits get a standard deviation of a few units, so the top-1 token usually leads by a margin
# that two implementations' rounding does not flip, and greedy decoding wanders instead of sticking to one token.
HEAD_GAIN = 4.0
ROUTER_GAIN = 2.0  # router logits spread of ~2: top-k choices are clear but not one-hot
SKEW_KEY = "strata.synth.router_skew"  # f32 ALPHA, present only in skewed files
SKEW_DIM_KEY = "strata.synth.router_bias_dim"  # u32: the constant hidden dimension that carries the bias


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: (experts,) rows, row length
    qtype: T
    std: float
    mean: float = 0.0

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1], dtype=np.int64))
        return rows * blocks.row_bytes(self.qtype, self.shape[-1])


@dataclass(frozen=True)
class SynthPlan:
    shape: Shape
    quant: str
    metadata: list[tuple[str, str, object]]
    tensors: list[TensorPlan]
    vocab_size: int

    @property
    def data_bytes(self) -> int:
        return sum(_align(t.nbytes) for t in self.tensors)


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def model_spec(s: Shape, n_vocab: int) -> ModelSpec:
    """The ModelSpec a file of this shape will be read as (what model/tensors.py needs to list its tensors)."""
    traits = ARCHITECTURES[s.arch]
    mixers = ["attention"] * s.layers
    dn = None
    if s.attn_interval:
        mixers = ["deltanet" if (i + 1) % s.attn_interval else "gated_attention" for i in range(s.layers)]
        dn = DeltaNetSpec(s.dn_k_heads, s.dn_v_heads, s.dn_head_dim, s.dn_head_dim, s.dn_conv,
                          tiled=traits.deltanet_tiled, split_ba=traits.deltanet_tiled)
    ffn = "moe" if s.n_expert else "dense"
    return ModelSpec(
        arch=s.arch, n_layer=s.layers, n_embd=s.hidden, n_head=s.n_head, n_head_kv=s.n_head_kv, head_dim=s.head_dim,
        n_vocab=n_vocab, n_ctx_train=s.context, rms_eps=s.rms_eps,
        rope=RopeSpec(traits.rope_style, s.rope_dim or s.head_dim, s.rope_base), qk_norm=traits.qk_norm,
        qkv_bias=s.qkv_bias, n_ff=s.ffn, n_expert=s.n_expert, n_expert_used=s.n_expert_used, n_ff_exp=s.moe_ffn,
        shared_expert=bool(s.shared_ffn), shared_expert_gate=bool(s.shared_ffn),
        layers=tuple(LayerSpec(m, ffn) for m in mixers), deltanet=dn, ffn_norm=traits.ffn_norm)


def _std_mean(t: TensorDef, s: Shape) -> tuple[float, float]:
    """The random distribution of a tensor: matrices keep activations at unit scale (rows of std n_in^-1/2),
    RMSNorm gains near one, varied so a loader that ignores them is caught."""
    if t.role in ("matrix", "experts"):
        gain = ROUTER_GAIN if t.name == "ffn_gate_inp.weight" else 1.0
        return gain * t.shape[-1] ** -0.5, 0.0
    if t.role == "norm":
        return 0.1, 1.0
    if t.role == "bias":
        return 0.1, 0.0
    if t.name == "ssm_a":  # -exp(A_log): decays between exp(-0.05) and exp(-0.5) a token at softplus ~ 1
        return 0.05, -0.25
    if t.name == "ssm_dt.bias":
        return 0.5, 0.0
    if t.name == "ssm_conv1d.weight":
        return s.dn_conv ** -0.5, 0.0
    return t.shape[-1] ** -0.5, 0.0  # ffn_gate_inp_shexp


def _tensor_specs(s: Shape, n_vocab: int) -> list[tuple[str, tuple[int, ...], float, float]]:
    """(name, numpy shape, std, mean) for every tensor, in llama.cpp's names, from model/tensors.py's table."""
    spec = model_spec(s, n_vocab)
    specs: list[tuple[str, tuple[int, ...], float, float]] = [("token_embd.weight", (n_vocab, s.hidden), 1.0, 0.0)]
    for i in range(s.layers):
        specs += [(f"blk.{i}.{t.name}", t.shape, *_std_mean(t, s)) for t in layer_tensors(spec, i, s.shared_ffn)]
    specs.append(("output_norm.weight", (s.hidden,), 0.1, 1.0))
    specs.append(("output.weight", (n_vocab, s.hidden), HEAD_GAIN * s.hidden ** -0.5, 0.0))
    for i in range(s.layers, s.layers + s.mtp_layers):  # last: every other tensor is the file without them
        specs += [(f"blk.{i}.{t.name}", t.shape, *_std_mean(t, s)) for t in layer_tensors(spec, i, s.shared_ffn)]
    return specs


def _model_metadata(s: Shape, quant: str, n_vocab: int) -> list[tuple[str, str, object]]:
    a = s.arch
    meta: list[tuple[str, str, object]] = [
        ("general.architecture", "str", a),
        ("general.name", "str", s.name),
        ("general.file_type", "u32", int(quantmix.FILE_TYPE[quant])),
        ("general.quantization_version", "u32", 2),
        ("general.alignment", "u32", ALIGNMENT),
        (f"{a}.vocab_size", "u32", n_vocab),
        (f"{a}.context_length", "u32", s.context),
        (f"{a}.embedding_length", "u32", s.hidden),
        (f"{a}.block_count", "u32", s.layers + s.mtp_layers),
        (f"{a}.feed_forward_length", "u32", s.ffn),
        (f"{a}.attention.head_count", "u32", s.n_head),
        (f"{a}.attention.head_count_kv", "u32", s.n_head_kv),
        (f"{a}.attention.key_length", "u32", s.head_dim),
        (f"{a}.attention.value_length", "u32", s.head_dim),
        (f"{a}.attention.layer_norm_rms_epsilon", "f32", s.rms_eps),
        (f"{a}.rope.dimension_count", "u32", s.rope_dim or s.head_dim),
        (f"{a}.rope.freq_base", "f32", s.rope_base),
    ]
    if s.n_expert:
        meta += [(f"{a}.expert_count", "u32", s.n_expert), (f"{a}.expert_used_count", "u32", s.n_expert_used)]
    if s.expert_ffn:
        meta.append((f"{a}.expert_feed_forward_length", "u32", s.expert_ffn))
    if s.shared_ffn:
        meta.append((f"{a}.expert_shared_feed_forward_length", "u32", s.shared_ffn))
    if s.mtp_layers:  # the MTP blocks are full-attention blocks: say so per block
        meta += [(f"{a}.nextn_predict_layers", "u32", s.mtp_layers),
                 (f"{a}.attention.recurrent_layers", "[bool]",
                  [bool(s.attn_interval) and (i + 1) % s.attn_interval != 0 for i in range(s.layers)]
                  + [False] * s.mtp_layers)]
    if s.attn_interval:
        meta += [(f"{a}.full_attention_interval", "u32", s.attn_interval),
                 (f"{a}.ssm.conv_kernel", "u32", s.dn_conv),
                 (f"{a}.ssm.state_size", "u32", s.dn_head_dim),
                 (f"{a}.ssm.group_count", "u32", s.dn_k_heads),
                 (f"{a}.ssm.time_step_rank", "u32", s.dn_v_heads),
                 (f"{a}.ssm.inner_size", "u32", s.dn_v_heads * s.dn_head_dim)]
    if s.arch == "qwen35moe":  # multimodal rope sections; text positions make them plain neox rope
        rd = (s.rope_dim or s.head_dim) // 2
        meta.append((f"{a}.rope.dimension_sections", "[i32]", [rd - 2 * (rd // 3), rd // 3, rd // 3, 0]))
    if s.yarn_factor:
        meta += [(f"{a}.rope.scaling.type", "str", "yarn"),
                 (f"{a}.rope.scaling.factor", "f32", s.yarn_factor),
                 (f"{a}.rope.scaling.original_context_length", "u32", int(s.context / s.yarn_factor))]
    return meta


def plan_synthetic(preset: str, *, arch: str | None = None, layers: int | None = None,
                   quant: str = "Q4_K_M", small_vocab: bool = False, mtp_layers: int = 0) -> SynthPlan:
    """Everything `write_synthetic` would write, without writing: metadata, tensor names, shapes and types."""
    if quant not in quantmix.MIXES:
        raise StrataError(f"unknown quant mix {quant!r}; choose one of {', '.join(quantmix.MIXES)}")
    s = resolve(preset, arch, layers, small_vocab)
    if mtp_layers:
        if not s.n_expert or mtp_layers < 0:
            raise StrataError("MTP blocks are written for MoE shapes only, and their count must be >= 0")
        s = replace(s, mtp_layers=mtp_layers)
    tok_meta, n_vocab = vocab.tokenizer_metadata(s.vocab)
    tensors = [TensorPlan(name, shape, quantmix.tensor_type(quant, name, shape, s.layers, s.n_expert), std, mean)
               for name, shape, std, mean in _tensor_specs(s, n_vocab)]
    return SynthPlan(s, quant, _model_metadata(s, quant, n_vocab) + tok_meta, tensors, n_vocab)


# --- GGUF encoding (v3, little endian) ---

_SCALAR = {"u32": (4, "<I"), "i32": (5, "<i"), "f32": (6, "<f"), "bool": (7, "<?")}
_STRING, _ARRAY = 8, 9


def _gguf_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, kind: str, value: object) -> bytes:
    out = _gguf_str(key)
    if kind == "str":
        return out + struct.pack("<I", _STRING) + _gguf_str(str(value))
    if kind in _SCALAR:
        code, fmt = _SCALAR[kind]
        return out + struct.pack("<I", code) + struct.pack(fmt, value)
    items = list(value)  # type: ignore[call-overload]
    if kind == "[str]":
        return out + struct.pack("<IIQ", _ARRAY, _STRING, len(items)) + b"".join(_gguf_str(x) for x in items)
    if kind == "[i32]":
        return out + struct.pack("<IIQ", _ARRAY, 5, len(items)) + np.asarray(items, "<i4").tobytes()
    if kind == "[bool]":
        return out + struct.pack("<IIQ", _ARRAY, 7, len(items)) + np.asarray(items, np.uint8).tobytes()
    raise ValueError(f"unsupported metadata kind {kind}")


def _header(plan: SynthPlan) -> bytes:
    parts = [b"GGUF", struct.pack("<IQQ", 3, len(plan.tensors), len(plan.metadata))]
    parts += [_kv(*m) for m in plan.metadata]
    offset = 0
    for t in plan.tensors:
        dims = t.shape[::-1]  # GGUF lists ne0 (row length) first
        parts.append(_gguf_str(t.name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                     + struct.pack("<IQ", int(t.qtype), offset))
        offset += _align(t.nbytes)
    head = b"".join(parts)
    return head + b"\0" * (_align(len(head)) - len(head))


def write_synthetic(path: str | os.PathLike, preset: str, *, arch: str | None = None, layers: int | None = None,
                    quant: str = "Q4_K_M", seed: int = 0,
                    progress: Callable[[int, int], None] | None = None, router_skew: float = 0.0,
                    small_vocab: bool = False, mtp_layers: int = 0) -> dict:
    """Write a random but valid GGUF model to `path` and return a summary of it.

    The file is streamed tensor by tensor in chunks of CHUNK_BYTES (memory stays small for any model size),
    written to `<path>.partial` and renamed to `path` only when complete. `progress(done, total)` is called
    with bytes written.

    `router_skew` ALPHA > 0 skews each MoE layer's routing so expert ranks (a seeded permutation per layer,
    skew.expert_ranks) are selected with frequency min(1, c (r+1)^-ALPHA) summing to the experts used per token
    (see strata_nb.synth.skew); the router is calibrated by a short pilot run of the written file. 0 writes
    exactly the file written without the option. `small_vocab` replaces a published preset's vocabulary with
    the small trained one (see presets.resolve). `mtp_layers` appends that many MTP blocks (llama.cpp's nextn:
    a full-attention MoE block and its nextn.* tensors) after every other tensor."""
    plan = plan_synthetic(preset, arch=arch, layers=layers, quant=quant, small_vocab=small_vocab,
                          mtp_layers=mtp_layers)
    router_skew = float(router_skew)
    skewmod.check_skew(router_skew, plan.shape.n_expert, plan.shape.n_expert_used)
    if router_skew > 0:
        plan = replace(plan, metadata=plan.metadata + [(SKEW_KEY, "f32", router_skew),
                                                       (SKEW_DIM_KEY, "u32", skewmod.BIAS_DIM)])
    path = Path(path)
    if path.is_dir():
        raise StrataError(f"output path is a directory: {path}")
    if not path.parent.is_dir():
        raise StrataError(f"output directory does not exist: {path.parent}")
    head = _header(plan)
    total = len(head) + plan.data_bytes
    tmp = path.with_name(path.name + ".partial")
    t0 = time.perf_counter()
    done = 0
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            done = len(head)
            for index, t in enumerate(plan.tensors):
                rng = np.random.Generator(np.random.PCG64([seed, index]))
                ncols = t.shape[-1]
                nrows = int(np.prod(t.shape[:-1], dtype=np.int64))
                rb = blocks.row_bytes(t.qtype, ncols)
                step = max(1, CHUNK_BYTES // rb)
                for r0 in range(0, nrows, step):
                    n = min(step, nrows - r0)
                    rows = blocks.random_rows(rng, t.qtype, n, ncols, t.std, t.mean)
                    if router_skew > 0:  # after the draws: every other byte is the unskewed file's
                        skewmod.edit_rows(t.name, t.qtype, plan.shape.hidden, r0, rows)
                    f.write(rows.data)
                    done += n * rb
                    if progress is not None:
                        progress(done, total)
                pad = _align(t.nbytes) - t.nbytes
                f.write(b"\0" * pad)
                done += pad
        if router_skew > 0:
            ratios = _calibrate_router(tmp, plan, len(head), seed, router_skew)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    seconds = time.perf_counter() - t0
    types: dict[str, int] = {}
    for t in plan.tensors:
        types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
    s = plan.shape
    return {
        "path": str(path), "preset": preset, "arch": s.arch, "name": s.name, "quant": quant, "seed": seed,
        "bytes": total, "tensors": len(plan.tensors), "types": types, "vocab": plan.vocab_size,
        "layers": s.layers, "hidden": s.hidden, "n_expert": s.n_expert, "n_expert_used": s.n_expert_used,
        "seconds": seconds, "mb_per_s": total / 1e6 / max(seconds, 1e-9), "router_skew": router_skew,
        **({"router_bias_ratio": ratios} if router_skew > 0 else {}),
    }


def _calibrate_router(tmp: Path, plan: SynthPlan, data_start: int, seed: int, alpha: float) -> list[float]:
    """Locate each layer's router in the written file and let skew.calibrate_router fill its bias column."""
    s = plan.shape
    offsets, off = {}, data_start
    for t in plan.tensors:
        if t.name.endswith("ffn_gate_inp.weight"):
            if t.qtype != T.F32:
                raise StrataError(f"router skew needs an F32 router, {t.name} is {t.qtype.name}")
            offsets[int(t.name.split(".")[1])] = off
        off += _align(t.nbytes)
    spec = skewmod.SkewSpec(alpha, seed, s.n_expert, s.n_expert_used)
    return skewmod.calibrate_router(tmp, spec, offsets, s.hidden)
