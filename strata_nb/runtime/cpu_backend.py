"""The forward pass on the CPU: a loop over the layers, each a token mixer and an FFN by their kinds (cpu_blocks/:
attention, gated delta-net; dense, MoE). The routed-expert driver is here: the MoE block and the hybrid engine's
CPU pool share it.

Prompts run as batches (matrix-matrix over all prompt tokens), decode as the one-token case of the same code.
Weights stay in their GGUF quant layout in the memory map; experts come from an ExpertStore (experts.store):
in place in the map, or tiered (arena, recently read blobs, SSD reads with lookahead).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from numba import get_num_threads

from strata_nb.cpu_kernels import actq, ops
from strata_nb.cpu_kernels.matmul import _is_float, dequant_rows, matmul_f32, matmul_q8, moe_ffn_for
from strata_nb.experts.store import ExpertStore, MappedStore
from strata_nb.model.spec import ModelSpec
from strata_nb.model.weights import LayerWeights, Linear, ModelWeights
from strata_nb.runtime.cpu_blocks import FFNS, MIXERS
from strata_nb.runtime.cpu_blocks.common import Activation, Positions
from strata_nb.runtime.session import Session, host_states


@dataclass
class ForwardStats:
    """Accumulated over forward calls: time in the routed-expert FFNs and weight bytes read."""

    expert_s: float = 0.0
    expert_bytes: int = 0
    dense_bytes: int = 0


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
        self.next_moe = dict(zip(moe, moe[1:]))  # for the MoE block's lookahead
        self._mixers = [MIXERS[ls.mixer] for ls in spec.layers]
        self.ffns = [FFNS[ls.ffn] for ls in spec.layers]  # per layer: ffn(backend, lw, layer, a)
        # Per MoE layer: the routed-expert kernel specialized for its quant types, and its matrix geometry.
        self._moe: dict[int, tuple] = {}
        self._skip_routed = False  # warm_up(routed=False)
        self._scratch: dict[tuple[int, int, int | None], tuple[np.ndarray, ...]] = {}
        # kept between calls (a decode token's MoE allocates nothing): the routing plan (ops.moe_split), its identity
        # row (the groups of a one-wave call), slots that send every choice to the CPU, the pool's kernel buffers per
        # layer (x's int8 forms and the scratch), the addresses of a tiered store's waves, and rows that count nothing
        ne = max(spec.n_expert, 1)
        self._plan = ops.plan_buffer(ne, 0)
        self._ident = self._plan[ops.PLAN_IDENT]
        self._cpu_slot = np.full((1, max(spec.n_expert_used, 1)), -1, np.int32)
        self._pool_args: dict[int, tuple[int, tuple[np.ndarray, ...]]] = {}
        self._wave_table = np.zeros((3, ne), np.int64)
        self._no_count = (np.zeros((spec.n_layer, ne)), np.zeros((spec.n_layer, ne), np.int64))
        # MoE layer -> int8 activation groups of its gate, up and down matrices (None: float32 activations)
        self._grp: dict[int, tuple[int | None, int | None, int | None]] = {}
        if experts is not None:
            src = experts.src
            for l in moe:
                mg, mu, md = src.matrix(l, "gate"), src.matrix(l, "up"), src.matrix(l, "down")
                if mg.rows != mu.rows or md.rows != spec.n_embd:
                    raise ValueError(f"layer {l}: expert matrices of {mg.rows}, {mu.rows} and {md.rows} rows")
                kern = moe_ffn_for(bool(fast), int(mg.qtype), int(mu.qtype), int(md.qtype))
                self._grp[l] = tuple(self.group(int(m.qtype)) for m in (mg, mu, md))
                self._moe[l] = (kern, mg.rows, md.rows, mg.nbytes + mu.nbytes + md.nbytes)
        # the int8 group of each layer's FFN input: that of its first quantized consumer
        self._ffn_group = [self._ffn_in_group(l, lw) for l, lw in enumerate(weights.layers)]

    # -- building blocks ----------------------------------------------------------------------------------
    def linear(self, m: Linear, a: Activation) -> np.ndarray:
        out = np.empty((a.x.shape[0], m.n_out), np.float32)
        if self.fast:
            group = self.group(m.qtype)
            xq, xd, xs = a.q(group) if group else _EMPTY
            matmul_q8(m.qtype, m.rows, a.x, xq, xd, xs, out)
        else:
            matmul_f32(m.qtype, m.rows, a.x, out)
        if m.bias is not None:
            out += m.bias
        return out

    def norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        ops.rmsnorm(x, w, np.float32(self.spec.rms_eps), out)
        return out

    def group(self, qtype: int) -> int | None:
        """The int8 activation group for matrices of qtype, None where they take float32 activations."""
        return actq.group(qtype) if self.fast and not _is_float(qtype) else None

    def _ffn_in_group(self, layer: int, lw: LayerWeights) -> int | None:
        if lw.router is None:
            return self.group(lw.ffn.ffn_gate.qtype)
        if self.experts is not None:
            return self.group(self.experts.src.matrix(layer, "gate").qtype)
        return self.group(lw.ffn.shexp_gate.qtype) if lw.ffn.shexp_gate is not None else None

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
        group = self.group(down.qtype)
        if group is None or g.shape[1] % group:
            h = np.empty_like(g)
            ops.silu_mul(g, u, h)
            return Activation(h)
        q = actq.empty(*g.shape, group)
        a = Activation(np.empty_like(g), q)
        ops.swiglu_quant(g, u, a.x, *q)
        return a

    # -- the routed experts of MoE layers (the CPU engine's MoE block and the hybrid engine's CPU pool) ----
    def routed_experts(self, layer: int, a: Activation, ids: np.ndarray, wts: np.ndarray, out: np.ndarray) -> None:
        """out[t] = sum over j of wts[t, j] * expert_{ids[t, j]}(a[t]): the CPU engine's MoE. Choices with a
        negative id are skipped; the routing is counted in the store. ids i32[T, k]; wts f32[T, k]; out
        f32[T, n_embd], C-contiguous."""
        if self._skip_routed:  # a warm-up pass without the routed-expert drivers (warm_up)
            out[...] = 0.0
            return
        t, k = ids.shape
        gg, gu, gd = self._grp[layer]
        _, ff, hidden, _ = self._moe[layer]
        args = (*(a.q(gg) if gg else _EMPTY), *(a.q(gu) if gu else _EMPTY), *self._moe_scratch(ff, hidden, gd, t * k))
        if self._cpu_slot.shape[0] < t:
            self._cpu_slot = np.full((t, k), -1, np.int32)
        self._routed(layer, t, a.x, args, False, ids, self._cpu_slot, wts, out, *self._no_count)

    def pool(self, layer: int, ntok: int, x: np.ndarray, ids: np.ndarray, slot: np.ndarray, wts: np.ndarray,
             out: np.ndarray, cache_counts: np.ndarray, routed: np.ndarray) -> tuple[int, int]:
        """The hybrid engine's CPU expert pool on one layer's mailbox: out[t] = sum over the choices j with
        slot[t, j] < 0 of wts[t, j] * expert_{ids[t, j]}(x[t]) for tokens 0..ntok-1 (later rows of the buffers are
        left alone); x is quantized inside the kernel's call. Row `layer` of cache_counts (f64) and routed (i64)
        [n_layer, n_expert], and of the store's counts, gets every choice, those with a slot included.
        Returns (G, hits): missed(G) are the experts computed here."""
        rows, args = self._pool_args.get(layer, (0, ()))
        if rows != x.shape[0]:  # the buffers for every row of the mailbox, made at the layer's first call
            rows = x.shape[0]
            gg, gu, gd = self._grp[layer]
            _, ff, hidden, _ = self._moe[layer]
            xq = actq.empty(rows, x.shape[1], gg) if gg else _EMPTY
            uq = actq.empty(rows, x.shape[1], gu) if gu and gu != gg else xq if gu else _EMPTY
            args = (*xq, *uq, *self._moe_scratch(ff, hidden, gd, rows * ids.shape[1]))
            self._pool_args[layer] = (rows, args)
        return self._routed(layer, ntok, x, args, True, ids, slot, wts, out, cache_counts, routed)

    def missed(self, n: int) -> np.ndarray:
        """The n experts the last pool call computed (ascending; a view, valid until the next call)."""
        return self._plan[ops.PLAN_EXPERT, :n]

    def _routed(self, layer: int, ntok: int, x: np.ndarray, args: tuple[np.ndarray, ...], quant: bool,
                ids: np.ndarray, slot: np.ndarray, wts: np.ndarray, out: np.ndarray, tally_a: np.ndarray,
                tally_c: np.ndarray) -> tuple[int, int]:
        """routed_experts and pool: the kernel splits the routing (counted into the tallies and the store's
        counts) and computes the experts on x's int8 forms and its scratch (args): in one call where the store
        has a table of every expert, else in one call per wave the store hands over, the last adding the
        weighted sum of every entry into out in entry order, so which tier served an expert (and in which wave
        it came) never changes a bit of the result. quant: the kernel makes x's int8 forms."""
        t0 = time.perf_counter()
        kern, _, _, nbytes = self._moe[layer]
        store = self.experts
        if self._plan.shape[1] < ntok * ids.shape[1]:
            self._plan = ops.plan_buffer(max(self.spec.n_expert, 1), ntok * ids.shape[1])
            self._ident = self._plan[ops.PLAN_IDENT]
        plan = self._plan
        nt = get_num_threads()
        table = store.table(layer)
        if table is not None:  # every expert in RAM at fixed places: one call
            ngrp, hits = kern(True, ids, slot, ntok, layer, tally_a, store.counts, tally_c, plan, table, self._ident,
                              -1, quant, x, *args, -1, wts, out, nt)
        else:  # the store hands the experts over in waves as their bytes reach RAM
            ngrp, hits = kern(True, ids, slot, ntok, layer, tally_a, store.counts, tally_c, plan, self._wave_table,
                              self._ident, 0, quant, x, *args, 0, wts, out, nt)
            experts = plan[ops.PLAN_EXPERT, :ngrp]
            table = self._wave_table
            done = 0
            for wave in store.waves(layer, experts) if ngrp else ():
                e = experts[wave.groups]
                table[0, e], table[1, e], table[2, e] = wave.gate, wave.up, wave.down
                first = done == 0
                done += len(wave.groups)
                kern(False, ids, slot, ntok, layer, tally_a, store.counts, tally_c, plan, table, wave.groups,
                     len(wave.groups), quant and first, x, *args, ngrp if done == ngrp else 0, wts, out, nt)
        if store.tiered:
            v = ids[:ntok].ravel()
            store.routed(layer, *np.unique(v[v >= 0], return_counts=True))
        store.served(layer, ngrp)
        self.stats.expert_s += time.perf_counter() - t0
        self.stats.expert_bytes += ngrp * nbytes
        return ngrp, hits

    def _moe_scratch(self, ff: int, hidden: int, group: int | None, n: int) -> tuple[np.ndarray, ...]:
        """The routed-expert kernel's buffers for n entries (kept, grown when a batch needs more): the gate, up and
        h rows, h's int8 form (in the down matrix's activation group) and the down outputs."""
        buf = self._scratch.get((ff, hidden, group))
        if buf is None or buf[0].shape[1] < n:
            cap = max(n, 2 * self.spec.n_expert_used)
            qf, qd, qs = actq.empty(cap, ff, group) if group and ff % group == 0 else _EMPTY
            buf = (np.empty((3, cap, ff), np.float32), qf, qd, qs, np.empty((cap, hidden), np.float32))
            self._scratch[(ff, hidden, group)] = buf
        return buf

    # -- the whole model ----------------------------------------------------------------------------------
    def scratch(self) -> "CPUBackend":
        """A backend on the same weights whose experts are read in place and counted nowhere: for throwaway
        forwards that must leave this backend's store (tiered slots, routing profile, I/O counts) untouched."""
        store = MappedStore(self.experts.src, None) if self.experts is not None else None
        return CPUBackend(self.spec, self.w, store, fast=self.fast)

    def warm_up(self, routed: bool = True) -> None:
        """Compile every kernel a forward calls (numba compiles per type signature, not per shape, and the token
        count only changes shapes): one token through a scratch backend on a one-position session. routed=False
        leaves out the routed-expert drivers (their layers' experts add nothing): a helper process compiles them
        meanwhile (runtime/warm.py), and a second warm-up then loads them from numba's cache."""
        b = self.scratch()
        b._skip_routed = not routed
        b.forward(Session(self.spec, 1), np.zeros(1, np.int64))

    def new_session(self, n_ctx: int) -> Session:
        return Session(self.spec, n_ctx, host_states(self.spec, n_ctx))

    def routed_kernel_layers(self) -> list[int]:
        """One MoE layer per distinct routed-expert driver (the drivers a warm-up compiles)."""
        first: dict[int, int] = {}
        for l, (kern, *_rest) in self._moe.items():
            first.setdefault(id(kern), l)
        return sorted(first.values())

    def compile_routed(self, layers: list[int]) -> None:
        """Compile (or load) the routed-expert drivers of these layers, as a warm-up's forward calls them: each
        layer's experts 0..k-1 on one token of zeros, through a scratch backend (nothing counted)."""
        b = self.scratch()
        s = self.spec
        k = max(s.n_expert_used, 1)
        for l in layers:
            x = np.zeros((1, s.n_embd), np.float32)
            g = b._ffn_group[l]
            a = Activation(x)
            if g and s.n_embd % g == 0:  # the int8 form norm_act would have made (zeros: x's own)
                a = Activation(x, tuple(np.zeros_like(t) for t in actq.empty(1, s.n_embd, g)))
            ids = np.arange(k, dtype=np.int32).reshape(1, k)
            b.routed_experts(l, a, ids, np.full((1, k), 1.0 / k, np.float32), np.empty((1, s.n_embd), np.float32))

    def sample_next(self, session: Session, tokens, sampler, history, ahead: bool = False) -> int:
        """Run tokens and draw the next token from the last position's logits (ahead: nothing to start early)."""
        return sampler.sample(self.forward(session, np.asarray(tokens, np.int64))[-1], history)

    def forward(self, session: Session, tokens: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Run tokens at the session's position; returns logits f32[T, vocab] (or [1, vocab] for the last)."""
        s = self.spec
        tokens = np.asarray(tokens, np.int64)
        t = len(tokens)
        session.reserve(t)
        if session.pos == 0:
            session.reset()  # a recurrent state starts from zeros
        x = np.empty((t, s.n_embd), np.float32)
        dequant_rows(self.w.embd.qtype, self.w.embd.rows, tokens, x)
        positions = np.arange(session.pos, session.pos + t, dtype=np.float64)
        r = s.rope
        cos, sin = ops.rope_tables(positions, r.n_rot, r.base, r.freq_scale, r.ext_factor, r.attn_factor,
                                   self._corr[0], self._corr[1], self.w.rope_freqs.astype(np.float64))
        at = Positions(session.pos, cos, sin)
        for i, lw in enumerate(self.w.layers):
            x += self._mixers[i](self, lw, x, session.states[i], at)
            x += self.ffns[i](self, lw, i, self.norm_act(x, lw.ffn_norm, self._ffn_group[i]))
        if not all_logits:
            x = x[-1:]
        logits = self.linear(self.w.output, self.norm_act(x, self.w.output_norm, self.group(self.w.output.qtype)))
        session.advance([int(v) for v in tokens])
        if self.experts is not None:
            self.experts.end_forward(t)
        self.stats.dense_bytes += self.w.dense_bytes_per_token()
        return logits


_EMPTY = (np.zeros((1, 32), np.int8), np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32))  # never read
