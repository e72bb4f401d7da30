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


def _tensor_specs(s: Shape, n_vocab: int) -> list[tuple[str, tuple[int, ...], float, float]]:
    """(name, numpy shape, std, mean) for every tensor, in llama.cpp's names."""
    H = s.hidden
    norm = (1.0, 0.1)  # RMSNorm gains near one, varied so a loader that ignores them is caught
    specs: list[tuple[str, tuple[int, ...], float, float]] = [("token_embd.weight", (n_vocab, H), 1.0, 0.0)]
    for i in range(s.layers):
        b = f"blk.{i}."

        def add(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
            specs.append((b + name, shape, std, mean))

        add("attn_norm.weight", (H,), norm[1], norm[0])
        add("attn_q.weight", (s.q_dim, H), H ** -0.5)
        add("attn_k.weight", (s.kv_dim, H), H ** -0.5)
        add("attn_v.weight", (s.kv_dim, H), H ** -0.5)
        if s.qkv_bias:
            add("attn_q.bias", (s.q_dim,), 0.1)
            add("attn_k.bias", (s.kv_dim,), 0.1)
            add("attn_v.bias", (s.kv_dim,), 0.1)
        if s.qk_norm:
            # olmoe normalizes the whole q / k projection, qwen3 each head
            qn, kn = (s.q_dim, s.kv_dim) if s.arch == "olmoe" else (s.head_dim, s.head_dim)
            add("attn_q_norm.weight", (qn,), norm[1], norm[0])
            add("attn_k_norm.weight", (kn,), norm[1], norm[0])
        add("attn_output.weight", (H, s.q_dim), s.q_dim ** -0.5)
        add("ffn_norm.weight", (H,), norm[1], norm[0])
        if s.n_expert:
            E, F = s.n_expert, s.moe_ffn
            add("ffn_gate_inp.weight", (E, H), ROUTER_GAIN * H ** -0.5)
            add("ffn_gate_exps.weight", (E, F, H), H ** -0.5)
            add("ffn_up_exps.weight", (E, F, H), H ** -0.5)
            add("ffn_down_exps.weight", (E, H, F), F ** -0.5)
            if s.shared_ffn:
                add("ffn_gate_inp_shexp.weight", (H,), H ** -0.5)
                add("ffn_gate_shexp.weight", (s.shared_ffn, H), H ** -0.5)
                add("ffn_up_shexp.weight", (s.shared_ffn, H), H ** -0.5)
                add("ffn_down_shexp.weight", (H, s.shared_ffn), s.shared_ffn ** -0.5)
        else:
            add("ffn_gate.weight", (s.ffn, H), H ** -0.5)
            add("ffn_up.weight", (s.ffn, H), H ** -0.5)
            add("ffn_down.weight", (H, s.ffn), s.ffn ** -0.5)
    specs.append(("output_norm.weight", (H,), norm[1], norm[0]))
    specs.append(("output.weight", (n_vocab, H), HEAD_GAIN * H ** -0.5, 0.0))
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
        (f"{a}.block_count", "u32", s.layers),
        (f"{a}.feed_forward_length", "u32", s.ffn),
        (f"{a}.attention.head_count", "u32", s.n_head),
        (f"{a}.attention.head_count_kv", "u32", s.n_head_kv),
        (f"{a}.attention.key_length", "u32", s.head_dim),
        (f"{a}.attention.value_length", "u32", s.head_dim),
        (f"{a}.attention.layer_norm_rms_epsilon", "f32", s.rms_eps),
        (f"{a}.rope.dimension_count", "u32", s.head_dim),
        (f"{a}.rope.freq_base", "f32", s.rope_base),
    ]
    if s.n_expert:
        meta += [(f"{a}.expert_count", "u32", s.n_expert), (f"{a}.expert_used_count", "u32", s.n_expert_used)]
    if s.expert_ffn:
        meta.append((f"{a}.expert_feed_forward_length", "u32", s.expert_ffn))
    if s.shared_ffn:
        meta.append((f"{a}.expert_shared_feed_forward_length", "u32", s.shared_ffn))
    if s.yarn_factor:
        meta += [(f"{a}.rope.scaling.type", "str", "yarn"),
                 (f"{a}.rope.scaling.factor", "f32", s.yarn_factor),
                 (f"{a}.rope.scaling.original_context_length", "u32", int(s.context / s.yarn_factor))]
    return meta


def plan_synthetic(preset: str, *, arch: str | None = None, layers: int | None = None,
                   quant: str = "Q4_K_M", small_vocab: bool = False) -> SynthPlan:
    """Everything `write_synthetic` would write, without writing: metadata, tensor names, shapes and types."""
    if quant not in quantmix.MIXES:
        raise StrataError(f"unknown quant mix {quant!r}; choose one of {', '.join(quantmix.MIXES)}")
    s = resolve(preset, arch, layers, small_vocab)
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
                    small_vocab: bool = False) -> dict:
    """Write a random but valid GGUF model to `path` and return a summary of it.

    The file is streamed tensor by tensor in chunks of CHUNK_BYTES (memory stays small for any model size),
    written to `<path>.partial` and renamed to `path` only when complete. `progress(done, total)` is called
    with bytes written.

    `router_skew` ALPHA > 0 skews each MoE layer's routing so expert ranks (a seeded permutation per layer,
    skew.expert_ranks) are selected with frequency min(1, c (r+1)^-ALPHA) summing to the experts used per token
    (see strata_nb.synth.skew); the router is calibrated by a short pilot run of the written file. 0 writes
    exactly the file written without the option. `small_vocab` replaces a published preset's vocabulary with
    the small trained one (see presets.resolve)."""
    plan = plan_synthetic(preset, arch=arch, layers=layers, quant=quant, small_vocab=small_vocab)
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
