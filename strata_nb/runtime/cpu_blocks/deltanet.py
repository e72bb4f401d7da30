"""The gated delta-net mixer on the CPU (Qwen3-Next, Qwen3.5 MoE): projections, causal conv with its state, the
decay and beta gates, the delta-rule recurrence per value head, the gated RMSNorm and the output projection. The
layer's RecurrentState carries the conv inputs and the recurrence across calls."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strata_nb.cpu_kernels import deltanet as kdn
from strata_nb.model.weights import LayerWeights
from strata_nb.runtime.cpu_blocks.common import Activation, Positions
from strata_nb.runtime.session import RecurrentState

if TYPE_CHECKING:
    from strata_nb.runtime.cpu_backend import CPUBackend


def deltanet(b: "CPUBackend", lw: LayerWeights, x: np.ndarray, state: RecurrentState, at: Positions) -> np.ndarray:
    dn, w = b.spec.deltanet, lw.mixer
    eps = np.float32(b.spec.rms_eps)
    t = x.shape[0]
    hk, hv, dk, dv = dn.n_k_head, dn.n_v_head, dn.head_k_dim, dn.head_v_dim
    a = b.norm_act(x, lw.attn_norm, b.group(w.wqkv.qtype))
    qkv, z = b.linear(w.wqkv, a), b.linear(w.wz, a)
    beta_in, alpha_in = b.linear(w.wb, a), b.linear(w.wa, a)
    mixed = np.empty_like(qkv)
    kdn.conv_silu(qkv, w.conv, state.conv, mixed)
    kd = dn.k_dim
    q = np.ascontiguousarray(mixed[:, :kd]).reshape(t, hk, dk)
    k = np.ascontiguousarray(mixed[:, kd:2 * kd]).reshape(t, hk, dk)
    v = np.ascontiguousarray(mixed[:, 2 * kd:]).reshape(t, hv, dv)
    g, beta = np.empty((t, hv), np.float32), np.empty((t, hv), np.float32)
    kdn.gdn_gates(alpha_in, beta_in, w.a, w.dt_bias, g, beta)
    o = np.empty((t, hv, dv), np.float32)
    # token by token for prompts too: on the CPU the chunked form measured slower at every length (512 tokens of
    # Qwen3-Next's heads: 14.7 ms against 16.6 with chunks of 16; the loops are bound by loads and stores of the
    # state, not by products; cpu_kernels/deltanet.py)
    kdn.gated_delta_rule(q, k, v, g, beta, state.ssm, dn.tiled, eps, o)
    y = np.empty_like(o)
    kdn.gated_rmsnorm(o, z.reshape(t, hv, dv), w.norm, eps, y)
    return b.linear(w.wo, Activation(y.reshape(t, hv * dv)))
