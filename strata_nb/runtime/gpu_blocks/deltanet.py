"""The gated delta-net on the GPU (Qwen3-Next, Qwen3.5 MoE): RMSNorm with the qkv, z and beta projections in one
launch (decode), alpha from the normalized row, causal conv with its state + SiLU, gates, the delta rule (its state
in registers for the whole call), gated RMSNorm, output projection into the residual. The layer's RecurrentState
(device arrays) carries the conv inputs and the state across forwards."""
from __future__ import annotations

from typing import TYPE_CHECKING

from strata_nb.cuda_kernels import deltanet as kdn

if TYPE_CHECKING:
    from strata_nb.runtime.gpu_backend import GPUBackend, Op


def deltanet(b: "GPUBackend", l: int, T: int) -> list["Op"]:
    s, L, st = b.spec, b.dev["layers"][l], b.states[l]
    dn, eps = s.deltanet, float(s.rms_eps)
    kd = dn.k_dim
    qkv, mix, z, bb, ab, g, beta, o = b.dn_bufs
    ops = b._normed(L["attn_norm"], [(L["wqkv"], qkv), (L["wz"], z), (L["wb"], bb)], T, x_out=b.xn)
    ops += b._linear(L["wa"], b.xn, ab, T)  # a launch takes up to three matrices: the fourth reads the normed row
    q, k, v = mix[:, :kd], mix[:, kd:2 * kd], mix[:, 2 * kd:]
    ops.append(lambda stream: kdn.conv_silu(qkv, L["conv"], st.conv, mix, T, stream))
    ops.append(lambda stream: kdn.gdn_gates(ab, bb, L["a"], L["dt_bias"], g, beta, T, stream))
    ops.append(lambda stream: kdn.gated_delta_rule(q, k, v, g, beta, st.ssm, dn.tiled, eps, o, T, stream))
    ops.append(lambda stream: kdn.gated_rmsnorm(o, z, L["norm"], eps, o, T, stream))
    ops += b._linear(L["wo"], o, b.x, T, accumulate=True)
    return ops
