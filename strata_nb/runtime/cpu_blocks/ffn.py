"""The CPU engine's FFNs, one function per kind (ModelSpec.layers): a dense SwiGLU, or a MoE layer (router top-k,
the routed experts through the backend's routed-expert driver, which the hybrid engine's CPU pool shares, and a
shared expert with its optional sigmoid gate). Each takes the backend, the layer's weights and index, and the
normed FFN input, and returns what the FFN adds to the residual stream."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strata_nb.cpu_kernels import ops, qtypes
from strata_nb.cpu_kernels.matmul import matmul_f32
from strata_nb.model.weights import LayerWeights, Linear
from strata_nb.runtime.cpu_blocks.common import Activation

if TYPE_CHECKING:
    from strata_nb.runtime.cpu_backend import CPUBackend


def swiglu_ffn(b: "CPUBackend", gate: Linear, up: Linear, down: Linear, a: Activation) -> np.ndarray:
    return b.linear(down, b.swiglu(b.linear(gate, a), b.linear(up, a), down))


def dense(b: "CPUBackend", lw: LayerWeights, layer: int, a: Activation) -> np.ndarray:
    f = lw.ffn
    return swiglu_ffn(b, f.ffn_gate, f.ffn_up, f.ffn_down, a)


def route(b: "CPUBackend", lw: LayerWeights, a: Activation) -> tuple[np.ndarray, np.ndarray]:
    """The router's top-k experts ids i32[T, k] and their weights f32[T, k]."""
    s = b.spec
    logits = np.empty((a.x.shape[0], s.n_expert), np.float32)
    matmul_f32(lw.router.qtype, lw.router.rows, a.x, logits)  # routing decides: keep it in float32
    ids = np.empty((a.x.shape[0], s.n_expert_used), np.int32)
    wts = np.empty((a.x.shape[0], s.n_expert_used), np.float32)
    ops.route_softmax_topk(logits, s.n_expert_used, s.expert_norm, np.float32(s.expert_weights_scale), ids, wts)
    return ids, wts


def lookahead(b: "CPUBackend", layer: int, a: Activation) -> None:
    """Predict the next MoE layer's experts with its router on this layer's MoE input (the residual stream
    changes little in one layer) and ask a tiered store to read the missing ones while this layer computes."""
    k = b.experts.lookahead_k if b.experts is not None else 0
    nxt = b.next_moe.get(layer)
    if k <= 0 or nxt is None:
        return
    r = b.w.layers[nxt].router
    logits = np.empty((a.x.shape[0], b.spec.n_expert), np.float32)
    matmul_f32(r.qtype, r.rows, a.x, logits)
    k = min(k, b.spec.n_expert)
    top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    b.experts.prefetch(nxt, np.unique(top))


def moe(b: "CPUBackend", lw: LayerWeights, layer: int, a: Activation) -> np.ndarray:
    lookahead(b, layer, a)
    ids, wts = route(b, lw, a)
    out = np.empty((a.x.shape[0], b.spec.n_embd), np.float32)
    b.routed_experts(layer, a, ids, wts, out)
    f = lw.ffn
    if f.shexp_gate is not None:
        sh = swiglu_ffn(b, f.shexp_gate, f.shexp_up, f.shexp_down, a)
        if f.shexp_gate_inp is not None:  # a row kernel, not BLAS: a token's gate must not depend on its batch
            gate = np.empty((a.x.shape[0], 1), np.float32)
            matmul_f32(qtypes.F32, f.shexp_gate_inp.view(np.uint8).reshape(1, -1), a.x, gate)
            sh *= 1.0 / (1.0 + np.exp(-gate))
        out += sh
    return out
