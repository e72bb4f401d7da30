"""ModelSpec: everything the forward needs, read from GGUF metadata; architectures differ only as data here."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from strata_nb.errors import ModelFormatError
from strata_nb.model.gguf_file import GGUFFile


@dataclass(frozen=True)
class ArchTraits:
    """What llama.cpp hard-codes per architecture (its src/models/<arch>.cpp); metadata may override some."""

    rope_style: str  # "neox" (rotate halves) or "norm" (rotate adjacent pairs)
    qk_norm: str = "none"  # "none", "head" (RMSNorm per head over head_dim) or "full" (over all heads at once)
    expert_norm: bool = False  # renormalize the top-k softmax weights (HF: norm_topk_prob)
    moe: bool = False
    # Qwen3-Next style: gated delta-net layers, and gated attention on every full_attention_interval-th layer
    hybrid: bool = False
    deltanet_tiled: bool = False  # delta-net value heads tiled over key heads (h % Hk), else grouped (h // (Hv/Hk))
    ffn_norm: str = "ffn_norm"  # the FFN's RMSNorm tensor


ARCHITECTURES: dict[str, ArchTraits] = {
    "qwen3next": ArchTraits("neox", qk_norm="head", expert_norm=True, moe=True, hybrid=True,
                            ffn_norm="post_attention_norm"),
    "qwen35moe": ArchTraits("neox", qk_norm="head", expert_norm=True, moe=True, hybrid=True, deltanet_tiled=True,
                            ffn_norm="post_attention_norm"),
    "qwen3moe": ArchTraits("neox", qk_norm="head", expert_norm=True, moe=True),
    "qwen2moe": ArchTraits("neox", expert_norm=False, moe=True),
    "olmoe": ArchTraits("neox", qk_norm="full", expert_norm=False, moe=True),
    "llama": ArchTraits("norm", expert_norm=True),  # Mixtral-style when it has experts
    "qwen2": ArchTraits("neox"),
    "qwen3": ArchTraits("neox", qk_norm="head"),
}


@dataclass(frozen=True)
class RopeSpec:
    style: str
    n_rot: int  # rotated dimensions per head (may be < head_dim)
    base: float
    freq_scale: float = 1.0  # 1 / scaling factor (linear and YaRN)
    ext_factor: float = 0.0  # YaRN extrapolation mix (1 when YaRN is on)
    attn_factor: float = 1.0  # magnitude scale of cos/sin, as llama.cpp derives it
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    scaling: str = "none"

    def corr_dims(self) -> tuple[float, float]:
        """YaRN's correction range in dimensions (ggml_rope_yarn_corr_dims)."""
        def dim(n_rot_turns: float) -> float:
            return self.n_rot * math.log(self.n_ctx_orig / (n_rot_turns * 2 * math.pi)) / (2 * math.log(self.base))

        lo = math.floor(dim(self.beta_fast))
        hi = math.ceil(dim(self.beta_slow))
        return float(max(0, lo)), float(min(self.n_rot - 1, hi))


MIXERS = ("attention", "gated_attention", "deltanet")  # gated: a sigmoid gate per head on the attention output
FFNS = ("dense", "moe")


@dataclass(frozen=True)
class LayerSpec:
    """What a layer is made of: its token mixer and its FFN (model/tensors.py lists each kind's tensors)."""

    mixer: str  # one of MIXERS
    ffn: str  # one of FFNS

    @property
    def recurrent(self) -> bool:
        """Its state is a recurrence (only returns to a snapshot), not a cache that can drop its tail."""
        return self.mixer == "deltanet"


@dataclass(frozen=True)
class DeltaNetSpec:
    """Gated delta-net dimensions (GGUF ssm.* keys): Hk key heads of dk, Hv value heads of dv, conv kernel K."""

    n_k_head: int
    n_v_head: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    tiled: bool  # value head h reads key head h % Hk (qwen35moe), else h // (Hv / Hk) (qwen3next)
    split_ba: bool  # beta and alpha projections as two tensors (ssm_beta, ssm_alpha), else one ssm_ba

    @property
    def k_dim(self) -> int:
        return self.n_k_head * self.head_k_dim

    @property
    def v_dim(self) -> int:
        return self.n_v_head * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v of all heads."""
        return 2 * self.k_dim + self.v_dim


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope: RopeSpec
    qk_norm: str
    qkv_bias: bool
    n_ff: int  # dense FFN width (0 when every layer is MoE)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_norm: bool = False
    expert_weights_scale: float = 1.0
    shared_expert: bool = False  # ffn_*_shexp tensors present
    shared_expert_gate: bool = False  # a sigmoid gate vector ffn_gate_inp_shexp scales the shared expert
    tied_embeddings: bool = False
    rope_freq_factors: bool = False  # a rope_freqs tensor divides the frequencies (llama3-style scaling)
    layers: tuple[LayerSpec, ...] = field(default_factory=tuple)
    deltanet: DeltaNetSpec | None = None
    ffn_norm: str = "ffn_norm"  # tensor name of each layer's FFN RMSNorm
    n_nextn: int = 0  # MTP blocks after the n_layer main ones (blk.{n_layer}..): read and checked, not run yet

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        return tuple(ls.ffn == "moe" for ls in self.layers)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, ls in enumerate(self.layers) if ls.mixer != "deltanet"]

    @property
    def recurrent(self) -> bool:
        """Some layer keeps a recurrent state (truncating then needs a snapshot)."""
        return any(ls.recurrent for ls in self.layers)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def _req(g: GGUFFile, key: str) -> Any:
    v = g.get(key)
    if v is None:
        raise ModelFormatError(f"{g.path.name}: missing metadata key {key}")
    if hasattr(v, "__len__") and not isinstance(v, str):  # per-layer arrays: accept only uniform ones
        vals = set(int(x) for x in v)
        if len(vals) != 1:
            raise ModelFormatError(f"{g.path.name}: per-layer {key} values are not supported")
        v = vals.pop()
    return v


def supported_architectures() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def check_architecture(g: GGUFFile) -> ArchTraits:
    arch = g.arch
    if arch not in ARCHITECTURES:
        raise ModelFormatError(
            f"unsupported architecture '{arch}' in {g.path.name}; supported: {supported_architectures()}")
    return ARCHITECTURES[arch]


def spec_from_gguf(g: GGUFFile) -> ModelSpec:
    traits = check_architecture(g)
    a = g.arch
    n_embd = int(_req(g, f"{a}.embedding_length"))
    n_head = int(_req(g, f"{a}.attention.head_count"))
    n_head_kv = int(g.get(f"{a}.attention.head_count_kv") or n_head)
    head_dim = int(g.get(f"{a}.attention.key_length") or n_embd // n_head)
    v_dim = int(g.get(f"{a}.attention.value_length") or head_dim)
    if v_dim != head_dim:
        raise ModelFormatError(f"{g.path.name}: key length {head_dim} != value length {v_dim} is not supported")
    n_nextn = int(g.get(f"{a}.nextn_predict_layers") or 0)
    n_layer = int(_req(g, f"{a}.block_count")) - n_nextn  # MTP blocks are counted in block_count
    if n_layer < 1:
        raise ModelFormatError(f"{g.path.name}: block_count leaves no layer besides {n_nextn} MTP layers")
    n_ctx_train = int(g.get(f"{a}.context_length") or 4096)
    n_expert = int(g.get(f"{a}.expert_count") or 0)
    n_expert_used = int(g.get(f"{a}.expert_used_count") or 0)
    if n_expert and not (0 < n_expert_used <= n_expert):
        raise ModelFormatError(f"{g.path.name}: expert_used_count {n_expert_used} not in 1..{n_expert}")
    if traits.moe and not n_expert:
        raise ModelFormatError(f"{g.path.name}: architecture {a} needs {a}.expert_count")

    emb = g.tensor("token_embd.weight")
    n_vocab = emb.shape[0]
    if emb.shape[1] != n_embd:
        raise ModelFormatError(f"{g.path.name}: token_embd.weight has width {emb.shape[1]}, expected {n_embd}")

    n_rot = int(g.get(f"{a}.rope.dimension_count") or head_dim)
    base = float(g.get(f"{a}.rope.freq_base") or 10000.0)
    scaling = str(g.get(f"{a}.rope.scaling.type") or "none")
    factor = float(g.get(f"{a}.rope.scaling.factor") or g.get(f"{a}.rope.scale_linear") or 0.0)
    if scaling not in ("none", "linear", "yarn"):
        raise ModelFormatError(f"{g.path.name}: rope scaling '{scaling}' is not supported (none, linear, yarn)")
    freq_scale = 1.0 / factor if factor and scaling != "none" else 1.0
    rope_attn = float(g.get(f"{a}.rope.scaling.attn_factor") or 1.0)
    ext_factor = 1.0 if scaling == "yarn" else 0.0
    attn_factor = 1.0
    if ext_factor:  # llama.cpp's llama_context: mscale, cancelled by the 1 + 0.1 ln(factor) that rope re-applies
        f = 1.0 / freq_scale
        mscale = 1.0 if f <= 1 else 0.1 * math.log(f) + 1.0
        attn_factor = mscale / (1.0 + 0.1 * math.log(f))
    attn_factor *= rope_attn
    rope = RopeSpec(
        style=traits.rope_style, n_rot=n_rot, base=base, freq_scale=freq_scale, ext_factor=ext_factor,
        attn_factor=attn_factor,
        beta_fast=float(g.get(f"{a}.rope.scaling.yarn_beta_fast") or 32.0),
        beta_slow=float(g.get(f"{a}.rope.scaling.yarn_beta_slow") or 1.0),
        n_ctx_orig=int(g.get(f"{a}.rope.scaling.original_context_length") or n_ctx_train), scaling=scaling)

    expert_norm = g.get(f"{a}.expert_weights_norm")
    moe_layers = tuple(g.has(f"blk.{i}.ffn_gate_inp.weight") for i in range(n_layer))
    mixers, deltanet = _mixers(g, traits, n_layer, n_nextn)
    layers = tuple(LayerSpec(m, "moe" if moe else "dense") for m, moe in zip(mixers, moe_layers))
    if n_expert and not any(moe_layers):
        raise ModelFormatError(f"{g.path.name}: expert_count is {n_expert} but no layer has ffn_gate_inp")
    n_ff_exp = int(g.get(f"{a}.expert_feed_forward_length") or 0)
    if n_expert and not n_ff_exp:
        n_ff_exp = g.tensor(f"blk.{moe_layers.index(True)}.ffn_gate_exps.weight").shape[1]
    return ModelSpec(
        arch=a, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_vocab=n_vocab, n_ctx_train=n_ctx_train,
        rms_eps=float(_req(g, f"{a}.attention.layer_norm_rms_epsilon")),
        rope=rope, qk_norm=traits.qk_norm, qkv_bias=g.has("blk.0.attn_q.bias"),
        n_ff=int(g.get(f"{a}.feed_forward_length") or 0),
        n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=n_ff_exp,
        expert_norm=bool(expert_norm) if expert_norm is not None else traits.expert_norm,
        expert_weights_scale=float(g.get(f"{a}.expert_weights_scale") or 1.0),
        shared_expert=g.has("blk.0.ffn_gate_shexp.weight") or g.has(f"blk.{n_layer - 1}.ffn_gate_shexp.weight"),
        shared_expert_gate=g.has(f"blk.{n_layer - 1}.ffn_gate_inp_shexp.weight"),
        tied_embeddings=not g.has("output.weight"),
        rope_freq_factors=g.has("rope_freqs.weight"),
        layers=layers, deltanet=deltanet, ffn_norm=traits.ffn_norm, n_nextn=n_nextn,
    )


def _mixers(g: GGUFFile, traits: ArchTraits, n_layer: int, n_nextn: int) -> tuple[list[str], DeltaNetSpec | None]:
    """Each layer's mixer kind, and the delta-net dimensions where the architecture has such layers."""
    if not traits.hybrid:
        return ["attention"] * n_layer, None
    a = g.arch
    rec = g.get(f"{a}.attention.recurrent_layers")
    if rec is not None:  # one flag per block, MTP blocks included
        rec = [bool(v) for v in rec]
        if len(rec) not in (n_layer, n_layer + n_nextn):
            raise ModelFormatError(f"{g.path.name}: {a}.attention.recurrent_layers has {len(rec)} entries for "
                                   f"{n_layer} layers")
        rec = rec[:n_layer]
    else:  # llama.cpp's default: every interval-th layer is full attention
        interval = int(g.get(f"{a}.full_attention_interval") or 4)
        if interval < 1:
            raise ModelFormatError(f"{g.path.name}: {a}.full_attention_interval is {interval}")
        rec = [(i + 1) % interval != 0 for i in range(n_layer)]
    dn = None
    if any(rec):
        ssm = {k: _req(g, f"{a}.ssm.{k}") for k in ("conv_kernel", "state_size", "group_count", "time_step_rank",
                                                     "inner_size")}
        hk, hv, dk = int(ssm["group_count"]), int(ssm["time_step_rank"]), int(ssm["state_size"])
        if hk < 1 or hv < 1 or hv % hk or int(ssm["inner_size"]) % hv:
            raise ModelFormatError(f"{g.path.name}: delta-net heads {hv} value / {hk} key with inner size "
                                   f"{ssm['inner_size']} do not divide")
        first = rec.index(True)
        dn = DeltaNetSpec(n_k_head=hk, n_v_head=hv, head_k_dim=dk, head_v_dim=int(ssm["inner_size"]) // hv,
                          conv_kernel=int(ssm["conv_kernel"]), tiled=traits.deltanet_tiled,
                          split_ba=not g.has(f"blk.{first}.ssm_ba.weight"))
    return ["deltanet" if r else "gated_attention" for r in rec], dn
