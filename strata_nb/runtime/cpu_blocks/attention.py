"""Attention on the CPU: RMSNorm, Q/K/V (+bias), QK-norm, rope, KV append, causal GQA; gated attention (Qwen3-Next)
also takes a gate per head from the q projection and scales the output by its sigmoid."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from strata_nb.cpu_kernels import ops
from strata_nb.model.weights import LayerWeights
from strata_nb.runtime.cpu_blocks.common import Activation, Positions
from strata_nb.runtime.session import KVState

if TYPE_CHECKING:
    from strata_nb.runtime.cpu_backend import CPUBackend

_ONE = np.ones(1, np.float32)  # stands in for an absent QK-norm weight
_QK_MODE = {"none": ops.QK_NORM_NONE, "head": ops.QK_NORM_HEAD, "full": ops.QK_NORM_FULL}


def attention(b: "CPUBackend", lw: LayerWeights, x: np.ndarray, state: KVState, at: Positions) -> np.ndarray:
    s, w = b.spec, lw.mixer
    t, nh, hd = x.shape[0], s.n_head, s.head_dim
    a = b.norm_act(x, lw.attn_norm, b.group(w.wq.qtype))
    q, k, v = b.linear(w.wq, a), b.linear(w.wk, a), b.linear(w.wv, a)
    gate = None
    if w.gated:  # per head [q | gate]
        qg = q.reshape(t, nh, 2, hd)
        q, gate = np.ascontiguousarray(qg[:, :, 0]).reshape(t, nh * hd), qg[:, :, 1]
    o = np.empty((t, nh, hd), np.float32)
    ops.attention_block(q, k, v, _ONE if w.q_norm is None else w.q_norm, _ONE if w.k_norm is None else w.k_norm,
                        _QK_MODE[s.qk_norm], np.float32(s.rms_eps), at.cos, at.sin, s.rope.style == "neox",
                        state.k, state.v, at.pos0, np.float32(1.0 / math.sqrt(hd)), o)
    if gate is not None:
        o *= 1.0 / (1.0 + np.exp(-gate))
    return b.linear(w.wo, Activation(o.reshape(t, nh * hd)))
