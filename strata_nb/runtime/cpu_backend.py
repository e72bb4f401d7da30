"""The forward pass on the CPU: one layer function for every architecture, branching on ModelSpec fields.

Prompts run as batches (matrix-matrix over all prompt tokens), decode as the one-token case of the same code.
Weights stay in their GGUF quant layout in the memory map; experts come from an ExpertStore (experts.store):
in place in the map, or tiered (arena, recently read blobs, SSD reads with lookahead).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from strata_nb.cpu_kernels import actq, ops
from strata_nb.cpu_kernels.matmul import _is_float, dequant_rows, matmul_f32, matmul_q8, moe_ffn_for
from strata_nb.experts.store import ExpertStore, MappedStore
from strata_nb.model.spec import ModelSpec
from strata_nb.model.weights import LayerWeights, Linear, ModelWeights
from strata_nb.runtime.session import Session


@dataclass
class ForwardStats:
    """Accumulated over forward calls: time in the routed-expert FFNs and weight bytes read."""

    expert_s: float = 0.0
    expert_bytes: int = 0
    dense_bytes: int = 0


class Activation:
    """A float32 activation [T, K] with its int8 forms (one per activation group size, actq.group), each made once
    and shared by every consumer. keep: a dict of buffers kept per (T, K, group) to quantize into (no allocation),
    or None."""

    __slots__ = ("x", "_q", "_keep")

    def __init__(self, x: np.ndarray, q: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                 keep: dict | None = None):
        self.x = x
        self._q = {} if q is None else {x.shape[1] // q[1].shape[1]: q}
        self._keep = keep

    def q(self, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The int8 form in groups of `group` (xq, xd, xs)."""
        q = self._q.get(group)
        if q is None:
            t, k = self.x.shape
            if self._keep is None:
                q = actq.empty(t, k, group)
            else:
                q = self._keep.get((t, k, group))
                if q is None:
                    q = self._keep[(t, k, group)] = actq.empty(t, k, group)
            actq.quantize_rows(self.x, *q)
            self._q[group] = q
        return q


class CPUBackend:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, experts: ExpertStore | None, fast: bool = True):
        self.spec = spec
        self.w = weights
        self.experts = experts
        self.fast = fast
        self.stats = ForwardStats()
        r = spec.rope
        self._corr = r.corr_dims() if r.ext_factor else (0.0, 0.0)
        moe = [i for i, lw in enumerate(weights.layers) if lw.router is not None]
        self._next_moe = dict(zip(moe, moe[1:]))
        self._qk_mode = {"none": ops.QK_NORM_NONE, "head": ops.QK_NORM_HEAD, "full": ops.QK_NORM_FULL}[spec.qk_norm]
        # Per MoE layer: the routed-expert kernel specialized for its quant types, and its matrix geometry.
        self._moe: dict[int, tuple] = {}
        self._scratch: dict[tuple[int, int, int], tuple[np.ndarray, ...]] = {}
        self._act_q: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # MoE layer -> int8 activation groups of its gate, up and down matrices (None: float32 activations)
        self._grp: dict[int, tuple[int | None, int | None, int | None]] = {}
        if experts is not None:
            src = experts.src
            for l in moe:
                mg, mu, md = src.matrix(l, "gate"), src.matrix(l, "up"), src.matrix(l, "down")
                if mg.rows != mu.rows or md.rows != spec.n_embd:
                    raise ValueError(f"layer {l}: expert matrices of {mg.rows}, {mu.rows} and {md.rows} rows")
                kern = moe_ffn_for(bool(fast), int(mg.qtype), int(mu.qtype), int(md.qtype))
                self._grp[l] = tuple(self._group(int(m.qtype)) for m in (mg, mu, md))
                self._moe[l] = (kern, mg.rows, mg.row_bytes, mu.row_bytes, md.rows, md.row_bytes,
                                mg.nbytes + mu.nbytes + md.nbytes)
        # the int8 group of each layer's FFN input: that of its first quantized consumer
        self._ffn_group = [self._ffn_in_group(l, lw) for l, lw in enumerate(weights.layers)]

    # -- building blocks ----------------------------------------------------------------------------------
    def linear(self, m: Linear, a: Activation) -> np.ndarray:
        out = np.empty((a.x.shape[0], m.n_out), np.float32)
        if self.fast:
            group = self._group(m.qtype)
            xq, xd, xs = a.q(group) if group else (_EMPTY_Q, _EMPTY_D, _EMPTY_D)
            matmul_q8(m.qtype, m.rows, a.x, xq, xd, xs, out)
        else:
            matmul_f32(m.qtype, m.rows, a.x, out)
        if m.bias is not None:
            out += m.bias
        return out

    def activation(self, x: np.ndarray) -> Activation:
        """x f32[T, K] (C-contiguous) as an Activation whose int8 forms go into buffers kept per shape: for callers
        outside the forward such as the hybrid engine's CPU pool (no allocation per layer); valid until the next
        call with the same shape."""
        return Activation(x, keep=self._act_q)

    def norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        ops.rmsnorm(x, w, np.float32(self.spec.rms_eps), out)
        return out

    def _group(self, qtype: int) -> int | None:
        """The int8 activation group for matrices of qtype, None where they take float32 activations."""
        return actq.group(qtype) if self.fast and not _is_float(qtype) else None

    def _ffn_in_group(self, layer: int, lw: LayerWeights) -> int | None:
        if lw.router is None:
            return self._group(lw.ffn_gate.qtype)
        if self.experts is not None:
            return self._group(self.experts.src.matrix(layer, "gate").qtype)
        return self._group(lw.shexp_gate.qtype) if lw.shexp_gate is not None else None

    def norm_act(self, x: np.ndarray, w: np.ndarray, group: int | None) -> Activation:
        """rmsnorm(x) * w as the input of matmuls; on the fast path quantized in the same kernel call, in the
        activation group of its first consumer (others quantize on first use; None: float consumers)."""
        if group is None or x.shape[1] % group:
            return Activation(self.norm(x, w))
        q = actq.empty(*x.shape, group)
        a = Activation(np.empty_like(x), q)
        ops.rmsnorm_quant(x, w, np.float32(self.spec.rms_eps), a.x, *q)
        return a

    def swiglu(self, g: np.ndarray, u: np.ndarray, down: Linear) -> Activation:
        """silu(g) * u as the input of the down projection; on the fast path quantized in the same call."""
        group = self._group(down.qtype)
        if group is None or g.shape[1] % group:
            h = np.empty_like(g)
            ops.silu_mul(g, u, h)
            return Activation(h)
        q = actq.empty(*g.shape, group)
        a = Activation(np.empty_like(g), q)
        ops.swiglu_quant(g, u, a.x, *q)
        return a

    def ffn(self, gate: Linear, up: Linear, down: Linear, a: Activation) -> np.ndarray:
        return self.linear(down, self.swiglu(self.linear(gate, a), self.linear(up, a), down))

    # -- layers -------------------------------------------------------------------------------------------
    def attention(self, lw: LayerWeights, layer: int, x: np.ndarray, session: Session, cos, sin) -> np.ndarray:
        s = self.spec
        t = x.shape[0]
        a = self.norm_act(x, lw.attn_norm, self._group(lw.wq.qtype))
        q, k, v = self.linear(lw.wq, a), self.linear(lw.wk, a), self.linear(lw.wv, a)
        o = np.empty((t, s.n_head, s.head_dim), np.float32)
        ops.attention_block(q, k, v, _ONE if lw.q_norm is None else lw.q_norm,
                            _ONE if lw.k_norm is None else lw.k_norm, self._qk_mode, np.float32(s.rms_eps), cos, sin,
                            s.rope.style == "neox", session.k[layer], session.v[layer], session.pos,
                            np.float32(1.0 / math.sqrt(s.head_dim)), o)
        return self.linear(lw.wo, Activation(o.reshape(t, s.q_dim)))

    def route(self, lw: LayerWeights, a: Activation) -> tuple[np.ndarray, np.ndarray]:
        """The router's top-k experts ids i64[T, k] and their weights f32[T, k]."""
        s = self.spec
        logits = np.empty((a.x.shape[0], s.n_expert), np.float32)
        matmul_f32(lw.router.qtype, lw.router.rows, a.x, logits)  # routing decides: keep it in float32
        ids = np.empty((a.x.shape[0], s.n_expert_used), np.int64)
        wts = np.empty((a.x.shape[0], s.n_expert_used), np.float32)
        ops.route_softmax_topk(logits, s.n_expert_used, s.expert_norm, np.float32(s.expert_weights_scale), ids, wts)
        return ids, wts

    def routed_experts(self, layer: int, a: Activation, ids: np.ndarray, wts: np.ndarray,
                       out: np.ndarray, record: bool = True) -> None:
        """out[t] += sum over j of wts[t, j] * expert_{ids[t, j]}(a[t]); choices with a negative id are skipped
        (the hybrid engine computes those on the GPU). The CPU engine's MoE and the hybrid's CPU expert pool.
        ids: i64 or i32 [T, k]; wts f32[T, k]; out f32[T, n_embd], C-contiguous.
        record: count the routing in the store's profile (the hybrid engine counts all choices itself)."""
        t0 = time.perf_counter()
        # Group the (token, slot) pairs by expert: each selected expert's rows are read once for all its tokens.
        experts, grp_start, entry_tok, entry_slot = ops.group_by_expert(ids, self.spec.n_expert)
        ngrp = len(experts)
        if ngrp == 0:
            return
        store = self.experts
        if record:
            store.routed(layer, experts, np.diff(grp_start))
        kern, ff, gate_rb, up_rb, hidden, down_rb, nbytes = self._moe[layer]
        gg, gu, gd = self._grp[layer]
        buf = self._moe_scratch(ff, hidden, gd, entry_tok.shape[0])
        xq, xd, xs = a.q(gg) if gg else (_EMPTY_Q, _EMPTY_D, _EMPTY_D)
        uq, ud, us = a.q(gu) if gu else (_EMPTY_Q, _EMPTY_D, _EMPTY_D)
        # The store hands the experts over in waves as their bytes reach RAM: one compiled call per wave runs
        # gate+up, SwiGLU (+ int8 quantization) and down for the wave's entries; the call of the last wave also
        # adds the weighted sum of every entry into out, in entry order, so which tier served an expert (and in
        # which wave it came) never changes a bit of the result.
        done = 0
        for wave in store.waves(layer, experts):
            grp = wave.groups
            done += len(grp)
            kern(wave.gate, wave.up, wave.down, ff, gate_rb, up_rb, hidden, down_rb, grp_start[grp],
                 grp_start[grp + 1], entry_tok, buf[0], a.x, xq, xd, xs, uq, ud, us, *buf[1:], done == ngrp, wts,
                 entry_slot, out)
        self.stats.expert_s += time.perf_counter() - t0
        self.stats.expert_bytes += ngrp * nbytes

    def _moe_scratch(self, ff: int, hidden: int, group: int | None, n: int) -> tuple[np.ndarray, ...]:
        """The routed-expert kernel's buffers for n entries (kept, grown when a batch needs more): the entries'
        identity index, gate and up outputs, h with its int8 form (in the down matrix's activation group), and
        the down outputs."""
        buf = self._scratch.get((ff, hidden, group))
        if buf is None or buf[0].shape[0] < n:
            cap = max(n, 2 * self.spec.n_expert_used)
            qf, qd, qs = actq.empty(cap, ff, group) if group and ff % group == 0 else (_EMPTY_Q, _EMPTY_D, _EMPTY_D)
            buf = (np.arange(cap, dtype=np.int64), np.empty((cap, ff), np.float32), np.empty((cap, ff), np.float32),
                   np.empty((cap, ff), np.float32), qf, qd, qs, np.empty((cap, hidden), np.float32))
            self._scratch[(ff, hidden, group)] = buf
        return buf

    def moe(self, lw: LayerWeights, layer: int, a: Activation) -> np.ndarray:
        ids, wts = self.route(lw, a)
        out = np.zeros((a.x.shape[0], self.spec.n_embd), np.float32)
        self.routed_experts(layer, a, ids, wts, out)

        if lw.shexp_gate is not None:
            sh = self.ffn(lw.shexp_gate, lw.shexp_up, lw.shexp_down, a)
            if lw.shexp_gate_inp is not None:
                sh *= 1.0 / (1.0 + np.exp(-(a.x @ lw.shexp_gate_inp)))[:, None]
            out += sh
        return out

    def lookahead(self, layer: int, a: Activation) -> None:
        """Predict the next MoE layer's experts with its router on this layer's MoE input (the residual stream
        changes little in one layer) and ask the store to read the missing ones while this layer computes."""
        k = self.experts.lookahead_k if self.experts is not None else 0
        nxt = self._next_moe.get(layer)
        if k <= 0 or nxt is None:
            return
        r = self.w.layers[nxt].router
        logits = np.empty((a.x.shape[0], self.spec.n_expert), np.float32)
        matmul_f32(r.qtype, r.rows, a.x, logits)
        k = min(k, self.spec.n_expert)
        top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
        self.experts.prefetch(nxt, np.unique(top))

    # -- the whole model ----------------------------------------------------------------------------------
    def scratch(self) -> "CPUBackend":
        """A backend on the same weights whose experts are read in place and counted nowhere: for throwaway
        forwards that must leave this backend's store (tiered slots, routing profile, I/O counts) untouched."""
        store = MappedStore(self.experts.src, None) if self.experts is not None else None
        return CPUBackend(self.spec, self.w, store, fast=self.fast)

    def warm_up(self) -> None:
        """Compile every kernel a forward calls (numba compiles per type signature, not per shape, and the token
        count only changes shapes): one token through a scratch backend on a one-position session."""
        self.scratch().forward(Session(self.spec, 1), np.zeros(1, np.int64))

    def sample_next(self, session: Session, tokens, sampler, history, ahead: bool = False) -> int:
        """Run tokens and draw the next token from the last position's logits (ahead: nothing to start early)."""
        return sampler.sample(self.forward(session, np.asarray(tokens, np.int64))[-1], history)

    def forward(self, session: Session, tokens: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Run tokens at the session's position; returns logits f32[T, vocab] (or [1, vocab] for the last)."""
        s = self.spec
        tokens = np.asarray(tokens, np.int64)
        t = len(tokens)
        session.reserve(t)
        x = np.empty((t, s.n_embd), np.float32)
        dequant_rows(self.w.embd.qtype, self.w.embd.rows, tokens, x)
        positions = np.arange(session.pos, session.pos + t, dtype=np.float64)
        r = s.rope
        cos, sin = ops.rope_tables(positions, r.n_rot, r.base, r.freq_scale, r.ext_factor, r.attn_factor,
                                   self._corr[0], self._corr[1], self.w.rope_freqs.astype(np.float64))
        for i, lw in enumerate(self.w.layers):
            x += self.attention(lw, i, x, session, cos, sin)
            a = self.norm_act(x, lw.ffn_norm, self._ffn_group[i])
            if lw.router is not None:
                self.lookahead(i, a)
                x += self.moe(lw, i, a)
            else:
                x += self.ffn(lw.ffn_gate, lw.ffn_up, lw.ffn_down, a)
        if not all_logits:
            x = x[-1:]
        logits = self.linear(self.w.output, self.norm_act(x, self.w.output_norm, self._group(self.w.output.qtype)))
        session.advance([int(v) for v in tokens])
        if self.experts is not None:
            self.experts.end_forward(t)
        self.stats.dense_bytes += self.w.dense_bytes_per_token()
        return logits


_ONE = np.ones(1, np.float32)  # stands in for an absent QK-norm weight
_EMPTY_Q = np.zeros((1, 32), np.int8)
_EMPTY_D = np.zeros((1, 2), np.float32)
