"""Model shapes for synthetic GGUF files: the tiny test models and published MoE shapes."""
from __future__ import annotations

from dataclasses import dataclass, replace

from strata_nb.errors import StrataError


@dataclass(frozen=True)
class Shape:
    """Hyperparameters of one synthetic model; `arch` is the GGUF architecture string llama.cpp reads."""

    arch: str  # qwen3moe, qwen2moe, olmoe, llama (dense or Mixtral-style with experts), qwen2, qwen3, qwen3next,
    # qwen35moe
    hidden: int
    layers: int
    n_head: int
    n_head_kv: int
    head_dim: int
    ffn: int  # dense FFN width (feed_forward_length); for llama/olmoe with experts, the expert width
    vocab: int | None = None  # None: exactly the trained BPE vocabulary (tiny models)
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn: int = 0  # expert_feed_forward_length (qwen*moe); 0 where the arch uses `ffn`
    shared_ffn: int = 0  # qwen2moe shared expert width
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    context: int = 4096
    yarn_factor: float = 0.0  # > 0: write rope.scaling.* keys for YaRN with original context `context / factor`
    name: str = "synthetic"
    # Qwen3-Next layers (qwen3next, qwen35moe): gated attention on every attn_interval-th layer, gated delta-net
    # on the others, with dn_k_heads key heads and dn_v_heads value heads of dn_head_dim, a conv of dn_conv taps
    attn_interval: int = 0
    dn_k_heads: int = 0
    dn_v_heads: int = 0
    dn_head_dim: int = 0
    dn_conv: int = 4
    rope_dim: int = 0  # rotated dimensions per head (0: all of head_dim)
    mtp_layers: int = 0  # MTP blocks (llama.cpp's nextn) after the main layers

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def moe_ffn(self) -> int:
        """Width of one routed expert."""
        return self.expert_ffn or self.ffn

    @property
    def qkv_bias(self) -> bool:
        return self.arch in ("qwen2", "qwen2moe")


# Tiny models: hidden 256 and 4 layers so tests run in seconds. Widths are chosen so a Q4_K_M mix holds every
# type a real Q4_K_M file does: expert/dense FFN widths of 160/640 are not multiples of 256, so their ffn_down
# rows fall back from Q4_K/Q6_K to Q5_0/Q8_0 exactly as llama.cpp's quantizer does; 8 experts switch on the
# n_expert == 8 rules (attn_k/attn_v Q8_0, attn_output Q5_K).
TINY: dict[str, Shape] = {
    # qwen3moe keeps the real model's head_dim * n_head != hidden (512 vs 256) to exercise attention.key_length.
    "qwen3moe": Shape("qwen3moe", 256, 4, 8, 2, 64, 640, n_expert=8, n_expert_used=2, expert_ffn=160,
                      rope_base=1e6, context=2048, name="tiny-qwen3moe"),
    "qwen2moe": Shape("qwen2moe", 256, 4, 4, 2, 64, 640, n_expert=8, n_expert_used=2, expert_ffn=160,
                      shared_ffn=320, rope_base=1e6, context=2048, name="tiny-qwen2moe"),
    "olmoe": Shape("olmoe", 256, 4, 4, 4, 64, 160, n_expert=8, n_expert_used=2, rms_eps=1e-5, context=2048,
                   name="tiny-olmoe"),
    # Mixtral-style: arch "llama" with llama.expert_count; carries YaRN rope scaling (llama.cpp and the
    # Mixtral model in transformers both honour it).
    "mixtral": Shape("llama", 256, 4, 4, 2, 64, 160, n_expert=8, n_expert_used=2, rope_base=1e6, rms_eps=1e-5,
                     context=1024, yarn_factor=4.0, name="tiny-mixtral"),
    "qwen2": Shape("qwen2", 256, 4, 4, 2, 64, 640, rope_base=1e6, context=2048, name="tiny-qwen2"),
    "qwen3": Shape("qwen3", 256, 4, 4, 2, 64, 640, rope_base=1e6, context=2048, name="tiny-qwen3"),
    "llama": Shape("llama", 256, 4, 4, 2, 64, 640, rope_base=5e5, rms_eps=1e-5, context=2048, name="tiny-llama"),
    # 3 delta-net layers and one gated attention layer, Hv = 2 Hk (the key-to-value head mapping matters)
    "qwen3next": Shape("qwen3next", 256, 4, 4, 2, 64, 640, n_expert=8, n_expert_used=2, expert_ffn=160,
                       shared_ffn=320, rope_base=1e7, context=2048, attn_interval=4, dn_k_heads=2, dn_v_heads=4,
                       dn_head_dim=64, rope_dim=16, name="tiny-qwen3next"),
    "qwen35moe": Shape("qwen35moe", 256, 4, 4, 2, 64, 640, n_expert=8, n_expert_used=2, expert_ffn=160,
                       shared_ffn=320, rope_base=1e7, context=2048, attn_interval=4, dn_k_heads=2, dn_v_heads=4,
                       dn_head_dim=64, rope_dim=16, name="tiny-qwen35moe"),
}

# Published shapes (config.json of each model; vocab sizes are the embedding rows of the real checkpoints).
PUBLISHED: dict[str, Shape] = {
    # Qwen3-Next-80B-A3B: 48 layers (every 4th gated attention, 16 q / 2 kv heads of 256, a quarter rotated; the
    # others gated delta-net, 16 key / 32 value heads of 128), 512 experts top-10 of 512 + a shared expert of 512
    "qwen3-next-80b-a3b": Shape("qwen3next", 2048, 48, 16, 2, 256, 5120, vocab=151936, n_expert=512,
                                n_expert_used=10, expert_ffn=512, shared_ffn=512, rope_base=1e7, context=262144,
                                attn_interval=4, dn_k_heads=16, dn_v_heads=32, dn_head_dim=128, rope_dim=64,
                                name="Qwen3-Next-80B-A3B (synthetic)"),
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 128, 6144, vocab=151936, n_expert=128, n_expert_used=8,
                           expert_ffn=768, rope_base=1e6, context=40960, name="Qwen3-30B-A3B (synthetic)"),
    "qwen3-235b-a22b": Shape("qwen3moe", 4096, 94, 64, 4, 128, 12288, vocab=151936, n_expert=128,
                             n_expert_used=8, expert_ffn=1536, rope_base=1e6, context=40960,
                             name="Qwen3-235B-A22B (synthetic)"),
    "olmoe-1b-7b": Shape("olmoe", 2048, 16, 16, 16, 128, 1024, vocab=50304, n_expert=64, n_expert_used=8,
                         rms_eps=1e-5, context=4096, name="OLMoE-1B-7B-0924 (synthetic)"),
    "mixtral-8x7b": Shape("llama", 4096, 32, 32, 8, 128, 14336, vocab=32000, n_expert=8, n_expert_used=2,
                          rope_base=1e6, rms_eps=1e-5, context=32768, name="Mixtral-8x7B (synthetic)"),
}

# The demo (`strata-nb demo`): a qwen3moe big enough that its speed means something (~0.25 GB at Q4_K_M, 32
# experts top-4), with the small trained vocabulary so it writes in seconds.
DEMO = Shape("qwen3moe", 1024, 8, 16, 4, 64, 2816, n_expert=32, n_expert_used=4, expert_ffn=512, rope_base=1e6,
             context=4096, name="demo-qwen3moe (synthetic)")

# Tiny width with many experts (the top-8-of-64 routing of OLMoE / Qwen3 MoE): routing statistics such as
# `synth --router-skew` need more than the tiny presets' 8 experts, at a size that writes and runs in seconds.
TINY_MOE64 = Shape("qwen3moe", 256, 4, 8, 2, 64, 640, n_expert=64, n_expert_used=8, expert_ffn=128, rope_base=1e6,
                   context=2048, name="tiny-qwen3moe-64e")

# The hybrid engine's tests run in numba's CUDA simulator, which interprets every thread in Python: a model with
# hidden 64 (32-element quant blocks only) keeps a simulated forward to seconds.
MICRO = Shape("qwen3moe", 64, 2, 2, 1, 32, 128, n_expert=4, n_expert_used=2, expert_ffn=64, rope_base=1e6,
              context=512, name="micro-qwen3moe")
# the same for the hybrid engine's delta-net and gated attention blocks: 3 delta-net layers and 1 gated attention
MICRO_NEXT = Shape("qwen3next", 64, 4, 2, 1, 32, 128, n_expert=4, n_expert_used=2, expert_ffn=64, shared_ffn=64,
                   rope_base=1e6, context=512, attn_interval=4, dn_k_heads=2, dn_v_heads=4, dn_head_dim=16,
                   rope_dim=8, name="micro-qwen3next")

PRESETS: tuple[str, ...] = ("tiny", "demo", *PUBLISHED, "tiny-moe64", "micro")
# the attention-only architectures (transformers loads their GGUF files; it cannot load qwen3next/qwen35moe ones)
TINY_ARCHS: tuple[str, ...] = tuple(a for a in TINY if not TINY[a].attn_interval)
TINY_HYBRID: tuple[str, ...] = tuple(a for a in TINY if TINY[a].attn_interval)


def resolve(preset: str, arch: str | None = None, layers: int | None = None, small_vocab: bool = False) -> Shape:
    """The shape for a preset name; `arch` picks the tiny variant, `layers` overrides the depth, `small_vocab`
    swaps a published vocabulary for the small trained one (a cut-down model whose head stays as small a share
    of the bytes a token reads as in the full-depth model)."""
    if preset == "tiny":
        key = arch or "qwen3moe"
        if key not in TINY:
            raise StrataError(f"unknown tiny arch {key!r}; choose one of {', '.join(TINY)}")
        shape = TINY[key]
    elif preset == "demo":
        shape = DEMO
    elif preset == "micro" and arch == "qwen3next":
        shape = MICRO_NEXT
    elif preset in ("tiny-moe64", "micro"):
        shape = TINY_MOE64 if preset == "tiny-moe64" else MICRO
        if arch is not None and arch != shape.arch:
            raise StrataError(f"preset {preset!r} has arch {shape.arch!r}; --arch applies to the tiny preset only")
    elif preset in PUBLISHED:
        shape = PUBLISHED[preset]
        if arch is not None and arch not in (shape.arch, preset):
            raise StrataError(f"preset {preset!r} has arch {shape.arch!r}; --arch applies to the tiny preset only")
    else:
        raise StrataError(f"unknown synth preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if layers is not None:
        if layers < 1:
            raise StrataError(f"layers must be >= 1, got {layers}")
        shape = replace(shape, layers=layers)
    if small_vocab and shape.vocab is not None:
        shape = replace(shape, vocab=None, name=shape.name.replace("(synthetic)", "(synthetic, small vocabulary)"))
    return shape
