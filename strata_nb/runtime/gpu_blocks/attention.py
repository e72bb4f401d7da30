"""Attention on the GPU: RMSNorm fused into the Q/K/V launch (decode); decode attention over chunks of the context
with QK-norm + rope + KV append inside its launch, or, for a prompt, QK-norm + rope + KV append then causal
attention; output projection into the residual. Gated attention (Qwen3-Next): the q projection yields [q | gate]
per head; the output is scaled by sigmoid(gate) before wo."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from strata_nb.cuda_kernels import attention as katt
from strata_nb.cuda_kernels import deltanet as kdn
from strata_nb.cuda_kernels import ops as kops

if TYPE_CHECKING:
    from strata_nb.runtime.gpu_backend import GPUBackend, Op


def attention(b: "GPUBackend", l: int, T: int) -> list["Op"]:
    s, L, st = b.spec, b.dev["layers"][l], b.states[l]
    gated = s.layers[l].mixer == "gated_attention"
    qout = b.qg if gated else b.q
    ops = b._normed(L["attn_norm"], [(L["wq"], qout), (L["wk"], b.k), (L["wv"], b.v)], T)
    if gated:
        ops.append(lambda stream: kdn.split_q_gate(b.qg, b.q, T, s.n_head, s.head_dim, stream))
    r = s.rope
    mode = {"none": kops.QK_NONE, "head": kops.QK_HEAD, "full": kops.QK_FULL}[s.qk_norm]
    qn = L["q_norm"] if L["q_norm"] is not None else b.mult  # unused without QK-norm
    kn = L["k_norm"] if L["k_norm"] is not None else b.mult
    kc, vc = st.k, st.v
    rope = (b.k, b.v, qn, kn, mode, float(s.rms_eps), b.mult, b.mscale, r.style == "neox", r.n_rot)
    scale = 1.0 / math.sqrt(s.head_dim)
    if T == 1:  # the decode launch norms and rotates its heads and appends the token's key and value itself
        ops.append(lambda stream: katt.attention_decode(b.q, kc, vc, b.pos, scale, b.att, b.parts, b.n_split, stream,
                                                        heads=b.att_heads, rope=rope))
    else:  # a prompt's keys all go in before any query attends
        ops.append(lambda stream: kops.qk_rope_kv(b.q, *rope, s.n_head, s.n_head_kv, s.head_dim, kc, vc, b.pos, T,
                                                  stream))
        ops.append(lambda stream: katt.attention_prompt(b.q, kc, vc, b.pos, scale, b.att, T, stream))
    if gated:
        ops.append(lambda stream: kdn.sigmoid_mul(b.att, b.qg, T, stream, n_head=s.n_head))
    ops += b._linear(L["wo"], b.att, b.x, T, accumulate=True)
    return ops
