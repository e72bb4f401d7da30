"""The tensors of each layer kind, by llama.cpp's names, with their shapes from the spec: the one table that the
weight binding checks files against and that `synth` writes files from."""
from __future__ import annotations

from dataclasses import dataclass

from strata_nb.model.spec import LayerSpec, ModelSpec


@dataclass(frozen=True)
class TensorDef:
    name: str  # inside the block: blk.{i}.<name>
    shape: tuple[int, ...]  # numpy order: (experts,) rows, row length
    # "matrix" (y = W x rows), "experts" (a matrix per expert), "bias" (of the matrix of the same name), "norm"
    # (an RMSNorm gain), "vector" (any other float tensor)
    role: str


def _kinds(spec: ModelSpec, layer: int) -> LayerSpec:
    """A main layer's kinds; an MTP block (layer >= n_layer) is a full-attention layer with a MoE."""
    if layer < spec.n_layer:
        return spec.layers[layer]
    return LayerSpec("gated_attention" if spec.deltanet is not None else "attention", "moe")


def mixer_tensors(spec: ModelSpec, layer: int) -> list[TensorDef]:
    """The token mixer's tensors of a layer (its RMSNorm included)."""
    d = spec.n_embd
    kind = _kinds(spec, layer).mixer
    out = [TensorDef("attn_norm.weight", (d,), "norm")]
    if kind == "deltanet":
        dn = spec.deltanet
        out += [TensorDef("attn_qkv.weight", (dn.conv_dim, d), "matrix"),
                TensorDef("attn_gate.weight", (dn.v_dim, d), "matrix")]
        if dn.split_ba:
            out += [TensorDef("ssm_beta.weight", (dn.n_v_head, d), "matrix"),
                    TensorDef("ssm_alpha.weight", (dn.n_v_head, d), "matrix")]
        else:  # per key head: the betas of its value heads, then their alphas
            out.append(TensorDef("ssm_ba.weight", (2 * dn.n_v_head, d), "matrix"))
        return out + [TensorDef("ssm_conv1d.weight", (dn.conv_dim, dn.conv_kernel), "vector"),
                      TensorDef("ssm_dt.bias", (dn.n_v_head,), "vector"),
                      TensorDef("ssm_a", (dn.n_v_head,), "vector"),  # -exp(A_log)
                      TensorDef("ssm_norm.weight", (dn.head_v_dim,), "norm"),
                      TensorDef("ssm_out.weight", (d, dn.v_dim), "matrix")]
    gated = kind == "gated_attention"  # attn_q holds [q | gate] per head
    qd, kvd = spec.q_dim, spec.kv_dim
    out += [TensorDef("attn_q.weight", (2 * qd if gated else qd, d), "matrix"),
            TensorDef("attn_k.weight", (kvd, d), "matrix"),
            TensorDef("attn_v.weight", (kvd, d), "matrix")]
    if spec.qkv_bias:
        out += [TensorDef("attn_q.bias", (qd,), "bias"), TensorDef("attn_k.bias", (kvd,), "bias"),
                TensorDef("attn_v.bias", (kvd,), "bias")]
    if spec.qk_norm != "none":  # per head, or over all heads at once
        qn, kn = (spec.head_dim, spec.head_dim) if spec.qk_norm == "head" else (qd, kvd)
        out += [TensorDef("attn_q_norm.weight", (qn,), "norm"), TensorDef("attn_k_norm.weight", (kn,), "norm")]
    return out + [TensorDef("attn_output.weight", (d, qd), "matrix")]


def ffn_tensors(spec: ModelSpec, layer: int, shared_ff: int = 0) -> list[TensorDef]:
    """The FFN's tensors of a layer (its RMSNorm included); shared_ff: the shared expert's width (0: none)."""
    d = spec.n_embd
    out = [TensorDef(f"{spec.ffn_norm}.weight", (d,), "norm")]
    if _kinds(spec, layer).ffn == "dense":
        f = spec.n_ff
        return out + [TensorDef("ffn_gate.weight", (f, d), "matrix"), TensorDef("ffn_up.weight", (f, d), "matrix"),
                      TensorDef("ffn_down.weight", (d, f), "matrix")]
    e, f = spec.n_expert, spec.n_ff_exp
    out += [TensorDef("ffn_gate_inp.weight", (e, d), "matrix"),
            TensorDef("ffn_gate_exps.weight", (e, f, d), "experts"),
            TensorDef("ffn_up_exps.weight", (e, f, d), "experts"),
            TensorDef("ffn_down_exps.weight", (e, d, f), "experts")]
    if shared_ff:
        if spec.shared_expert_gate:
            out.append(TensorDef("ffn_gate_inp_shexp.weight", (d,), "vector"))
        out += [TensorDef("ffn_gate_shexp.weight", (shared_ff, d), "matrix"),
                TensorDef("ffn_up_shexp.weight", (shared_ff, d), "matrix"),
                TensorDef("ffn_down_shexp.weight", (d, shared_ff), "matrix")]
    return out


def layer_tensors(spec: ModelSpec, layer: int, shared_ff: int = 0) -> list[TensorDef]:
    """Every tensor of block `layer`; blocks n_layer.. are the MTP blocks (llama.cpp's nextn)."""
    out = mixer_tensors(spec, layer) + ffn_tensors(spec, layer, shared_ff)
    if layer >= spec.n_layer:  # the MTP head: [enorm(embedding); hnorm(hidden)] -> eh_proj -> the block above
        d = spec.n_embd
        out += [TensorDef("nextn.eh_proj.weight", (d, 2 * d), "matrix"), TensorDef("nextn.enorm.weight", (d,), "norm"),
                TensorDef("nextn.hnorm.weight", (d,), "norm"), TensorDef("nextn.shared_head_norm.weight", (d,), "norm")]
    return out
