"""Binding the dense tensors of a GGUF to the forward: shapes checked against the spec, bytes left in place."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata_nb.cpu_kernels import qtypes
from strata_nb.errors import ModelFormatError
from strata_nb.model.gguf_file import GGUFFile, TensorRef, type_name
from strata_nb.model.spec import ModelSpec
from strata_nb.model.tensors import TensorDef, layer_tensors


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
class Attention:
    """Attention mixer; gated: wq yields [q | gate] per head and the output is scaled by sigmoid(gate)."""

    wq: Linear
    wk: Linear
    wv: Linear
    wo: Linear
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    gated: bool = False


@dataclass(frozen=True)
class DeltaNet:
    """Gated delta-net mixer (Qwen3-Next): projections, the causal conv, gates and the gated output norm."""

    wqkv: Linear  # q, k, v of all heads: the conv's channels
    wz: Linear  # the output gate z
    wb: Linear  # beta (sigmoid), one row per value head
    wa: Linear  # alpha (the decay's input), one row per value head
    conv: np.ndarray  # float32[conv_dim, K]
    dt_bias: np.ndarray  # float32[Hv]
    a: np.ndarray  # float32[Hv]: -exp(A_log)
    norm: np.ndarray  # float32[dv]
    wo: Linear


@dataclass(frozen=True)
class DenseFFN:
    ffn_gate: Linear
    ffn_up: Linear
    ffn_down: Linear


@dataclass(frozen=True)
class MoE:
    router: Linear
    shexp_gate: Linear | None = None  # shared expert FFN
    shexp_up: Linear | None = None
    shexp_down: Linear | None = None
    shexp_gate_inp: np.ndarray | None = None  # float32[n_embd]: sigmoid gate of the shared expert


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    mixer: Attention | DeltaNet
    ffn: DenseFFN | MoE

    @property
    def router(self) -> Linear | None:
        return self.ffn.router if isinstance(self.ffn, MoE) else None

    def dense_linears(self) -> list[Linear]:
        return [m for part in (self.mixer, self.ffn) for m in vars(part).values() if isinstance(m, Linear)]


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


def _split_ba(ba: Linear, dn) -> tuple[Linear, Linear]:
    """A fused ssm_ba as beta and alpha matrices (copies of its rows, a few KB): per key head it holds the betas of
    its Hv/Hk value heads, then their alphas."""
    r = dn.n_v_head // dn.n_k_head
    kh, j = np.divmod(np.arange(dn.n_v_head), r)
    rows_b, rows_a = kh * 2 * r + j, kh * 2 * r + r + j
    return (Linear(ba.name + "[beta]", ba.qtype, np.ascontiguousarray(ba.rows[rows_b])),
            Linear(ba.name + "[alpha]", ba.qtype, np.ascontiguousarray(ba.rows[rows_a])))


def _bind(g: GGUFFile, p: str, defs: list[TensorDef]) -> dict[str, object]:
    """Every tensor of a layer kind bound by its name (without the block prefix), its shape checked."""
    out: dict[str, object] = {}
    biases = {t.name for t in defs if t.role == "bias"}
    for t in defs:
        name = p + t.name
        if t.role == "experts":  # bytes stay with the expert store; only the shape is checked here
            _expect(g, g.tensor(name), t.shape)
        elif t.role == "matrix":
            out[t.name] = _linear(g, name, *t.shape, bias=t.name.replace(".weight", ".bias") in biases)
        elif t.role == "bias":
            continue  # read with its matrix
        else:
            ref = g.tensor(name)
            if len(t.shape) == 1 and tuple(ref.shape) == (1, t.shape[0]):
                out[t.name] = g.f32(ref).reshape(t.shape)  # a vector written as one row
            else:
                _expect(g, ref, t.shape)
                out[t.name] = g.f32(ref)
    return out


def bind_weights(g: GGUFFile, spec: ModelSpec) -> ModelWeights:
    d = spec.n_embd
    layers = []
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        shared_ff = g.tensor(p + "ffn_gate_shexp.weight").shape[0] if g.has(p + "ffn_gate_shexp.weight") else 0
        t = _bind(g, p, layer_tensors(spec, i, shared_ff))
        kind = spec.layers[i].mixer
        if kind == "deltanet":
            dn = spec.deltanet
            wb, wa = (t["ssm_beta.weight"], t["ssm_alpha.weight"]) if dn.split_ba else _split_ba(t["ssm_ba.weight"],
                                                                                             dn)
            mixer = DeltaNet(wqkv=t["attn_qkv.weight"], wz=t["attn_gate.weight"], wb=wb, wa=wa,
                             conv=t["ssm_conv1d.weight"], dt_bias=t["ssm_dt.bias"], a=t["ssm_a"],
                             norm=t["ssm_norm.weight"], wo=t["ssm_out.weight"])
        else:
            mixer = Attention(wq=t["attn_q.weight"], wk=t["attn_k.weight"], wv=t["attn_v.weight"],
                              wo=t["attn_output.weight"], q_norm=t.get("attn_q_norm.weight"),
                              k_norm=t.get("attn_k_norm.weight"), gated=kind == "gated_attention")
        if spec.layers[i].ffn == "moe":
            ffn = MoE(router=t["ffn_gate_inp.weight"], shexp_gate=t.get("ffn_gate_shexp.weight"),
                      shexp_up=t.get("ffn_up_shexp.weight"), shexp_down=t.get("ffn_down_shexp.weight"),
                      shexp_gate_inp=t.get("ffn_gate_inp_shexp.weight"))
        else:
            ffn = DenseFFN(t["ffn_gate.weight"], t["ffn_up.weight"], t["ffn_down.weight"])
        layers.append(LayerWeights(attn_norm=t["attn_norm.weight"], ffn_norm=t[f"{spec.ffn_norm}.weight"],
                                   mixer=mixer, ffn=ffn))
    check_nextn(g, spec)
    embd = _linear(g, "token_embd.weight", spec.n_vocab, d)
    output = embd if spec.tied_embeddings else _linear(g, "output.weight", spec.n_vocab, d)
    if spec.rope_freq_factors:
        rope_freqs = _vector(g, "rope_freqs.weight", spec.rope.n_rot // 2)
    else:
        rope_freqs = np.ones(spec.rope.n_rot // 2, np.float32)
    return ModelWeights(embd=embd, output_norm=_vector(g, "output_norm.weight", d), output=output,
                        rope_freqs=rope_freqs, layers=layers)


def check_nextn(g: GGUFFile, spec: ModelSpec) -> None:
    """MTP blocks (blk.{n_layer}..): every tensor present with its shape, bound to nothing (not run yet)."""
    for i in range(spec.n_layer, spec.n_layer + spec.n_nextn):
        p = f"blk.{i}."
        shared_ff = g.tensor(p + "ffn_gate_shexp.weight").shape[0] if g.has(p + "ffn_gate_shexp.weight") else 0
        for t in layer_tensors(spec, i, shared_ff):
            if t.name == "nextn.shared_head_norm.weight" and not g.has(p + t.name):
                continue  # optional: llama.cpp falls back to output_norm
            ref = g.tensor(p + t.name)
            if not (len(t.shape) == 1 and tuple(ref.shape) == (1, t.shape[0])):
                _expect(g, ref, t.shape)
