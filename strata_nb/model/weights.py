"""Binding the dense tensors of a GGUF to the forward: shapes checked against the spec, bytes left in place."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata_nb.cpu_kernels import qtypes
from strata_nb.errors import ModelFormatError
from strata_nb.model.gguf_file import GGUFFile, TensorRef, type_name
from strata_nb.model.spec import ModelSpec


@dataclass(frozen=True)
class Linear:
    """A weight matrix y = W x in its GGUF layout: n_out rows of n_in elements (uint8 rows, memory-mapped)."""

    name: str
    qtype: int
    rows: np.ndarray  # uint8[n_out, row_bytes]
    bias: np.ndarray | None = None  # float32[n_out]

    @property
    def n_out(self) -> int:
        return self.rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray
    wq: Linear
    wk: Linear
    wv: Linear
    wo: Linear
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    ffn_norm: np.ndarray
    ffn_gate: Linear | None = None  # dense FFN (dense layers and dense models)
    ffn_up: Linear | None = None
    ffn_down: Linear | None = None
    router: Linear | None = None  # MoE layers
    shexp_gate: Linear | None = None  # shared expert FFN
    shexp_up: Linear | None = None
    shexp_down: Linear | None = None
    shexp_gate_inp: np.ndarray | None = None  # float32[n_embd]: sigmoid gate of the shared expert

    def dense_linears(self) -> list[Linear]:
        return [m for m in (self.wq, self.wk, self.wv, self.wo, self.ffn_gate, self.ffn_up, self.ffn_down,
                            self.router, self.shexp_gate, self.shexp_up, self.shexp_down) if m is not None]


@dataclass(frozen=True)
class ModelWeights:
    embd: Linear  # token_embd: n_vocab rows of n_embd
    output_norm: np.ndarray
    output: Linear
    rope_freqs: np.ndarray  # float32[n_rot/2] frequency divisors (ones when the file has none)
    layers: list[LayerWeights]

    def dense_bytes_per_token(self) -> int:
        """Weight bytes a decode step reads outside the routed experts (one embedding row, not the table)."""
        return sum(m.nbytes for layer in self.layers for m in layer.dense_linears()) + self.output.nbytes \
            + self.embd.rows.shape[1]


def check_quant_types(g: GGUFFile) -> None:
    """Refuse a file holding a quant type we have no kernel for, naming the tensor, before anything loads."""
    for ref in g.tensors.values():
        if ref.qtype not in qtypes.QUANT_INFO:
            tname = type_name(ref.qtype)
            supported = ", ".join(qtypes.name(q) for q in qtypes.SUPPORTED)
            raise ModelFormatError(
                f"unsupported quant type {tname} in tensor {ref.name}; supported: {supported}")


def _linear(g: GGUFFile, name: str, n_out: int, n_in: int, bias: bool = False) -> Linear:
    ref = g.tensor(name)
    _expect(g, ref, (n_out, n_in))
    b = None
    bname = name.replace(".weight", ".bias")
    if bias or g.has(bname):
        bref = g.tensor(bname)
        _expect(g, bref, (n_out,))
        b = g.f32(bref)
    return Linear(name, ref.qtype, g.rows(ref), b)


def _vector(g: GGUFFile, name: str, n: int) -> np.ndarray:
    ref = g.tensor(name)
    _expect(g, ref, (n,))
    return g.f32(ref)


def _expect(g: GGUFFile, ref: TensorRef, shape: tuple[int, ...]) -> None:
    if tuple(ref.shape) != shape:
        raise ModelFormatError(f"{g.path.name}: tensor {ref.name} has shape {list(ref.shape)}, expected {list(shape)}")


def bind_weights(g: GGUFFile, spec: ModelSpec) -> ModelWeights:
    d, qd, kvd = spec.n_embd, spec.q_dim, spec.kv_dim
    layers = []
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        if spec.qk_norm == "head":
            qn, kn = _vector(g, p + "attn_q_norm.weight", spec.head_dim), _vector(g, p + "attn_k_norm.weight",
                                                                                  spec.head_dim)
        elif spec.qk_norm == "full":
            qn, kn = _vector(g, p + "attn_q_norm.weight", qd), _vector(g, p + "attn_k_norm.weight", kvd)
        else:
            qn = kn = None
        kw = dict(
            attn_norm=_vector(g, p + "attn_norm.weight", d),
            wq=_linear(g, p + "attn_q.weight", qd, d, spec.qkv_bias),
            wk=_linear(g, p + "attn_k.weight", kvd, d, spec.qkv_bias),
            wv=_linear(g, p + "attn_v.weight", kvd, d, spec.qkv_bias),
            wo=_linear(g, p + "attn_output.weight", d, qd),
            q_norm=qn, k_norm=kn,
            ffn_norm=_vector(g, p + "ffn_norm.weight", d),
        )
        if spec.moe_layers[i]:
            kw["router"] = _linear(g, p + "ffn_gate_inp.weight", spec.n_expert, d)
            for kind in ("gate", "up", "down"):
                ref = g.tensor(f"{p}ffn_{kind}_exps.weight")
                want = (spec.n_expert, spec.n_ff_exp, d) if kind != "down" else (spec.n_expert, d, spec.n_ff_exp)
                _expect(g, ref, want)
            if g.has(p + "ffn_gate_shexp.weight"):
                f = g.tensor(p + "ffn_gate_shexp.weight").shape[0]
                kw["shexp_gate"] = _linear(g, p + "ffn_gate_shexp.weight", f, d)
                kw["shexp_up"] = _linear(g, p + "ffn_up_shexp.weight", f, d)
                kw["shexp_down"] = _linear(g, p + "ffn_down_shexp.weight", d, f)
                if g.has(p + "ffn_gate_inp_shexp.weight"):
                    kw["shexp_gate_inp"] = _vector(g, p + "ffn_gate_inp_shexp.weight", d)
        else:
            f = spec.n_ff
            kw["ffn_gate"] = _linear(g, p + "ffn_gate.weight", f, d)
            kw["ffn_up"] = _linear(g, p + "ffn_up.weight", f, d)
            kw["ffn_down"] = _linear(g, p + "ffn_down.weight", d, f)
        layers.append(LayerWeights(**kw))
    embd = _linear(g, "token_embd.weight", spec.n_vocab, d)
    output = embd if spec.tied_embeddings else _linear(g, "output.weight", spec.n_vocab, d)
    if spec.rope_freq_factors:
        rope_freqs = _vector(g, "rope_freqs.weight", spec.rope.n_rot // 2)
    else:
        rope_freqs = np.ones(spec.rope.n_rot // 2, np.float32)
    return ModelWeights(embd=embd, output_norm=_vector(g, "output_norm.weight", d), output=output,
                        rope_freqs=rope_freqs, layers=layers)
