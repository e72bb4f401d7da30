"""The hybrid forward: dense layers on the GPU replayed from CUDA graphs, routed experts split between the VRAM
slot cache (GPU) and the CPU expert pool, handed over by the doorbell.

One program per forward, built from the ModelSpec: a list of *segments*, each a sequence of kernel launches that
ends where the host must act. A MoE layer whose experts are not all in VRAM ends its segment right after the GPU
has published the layer's routing (the GPU goes on with the VRAM hits and the shared expert); the host's doorbell
thread computes the misses and launches the next segment, which starts by adding the CPU's sum. A layer with every
expert in VRAM needs no host at all, so with all experts resident a token is two graph launches.

Decode captures each segment once as a CUDA graph (positions, token ids and sampler state live in device memory,
so replays need no new arguments) and never allocates; prompts run the same program for T tokens with direct
launches. The thread that calls the engine drives it (it is the doorbell thread: it launches the graphs, spins on
the doorbell and runs the CPU pool): the engine call measured 2.2 ms per token on the GPU machine with a hand-over
to a dedicated thread and back, 0.7-1.3 ms without (bench/results/gpu_pool_probe.md, hybrid_q30-Q4_K_M.md).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numba
import numpy as np
from numba import cuda

from strata_nb.cpu_kernels import ops as cops
from strata_nb.cuda_kernels import attention as katt
from strata_nb.cuda_kernels import mailbox as kmb
from strata_nb.cuda_kernels import matmul as kmm
from strata_nb.cuda_kernels import matvec_q8 as kq8
from strata_nb.cuda_kernels import ops as kops
from strata_nb.cuda_kernels import prefetch as kpf
from strata_nb.cuda_kernels import sample as ks
from strata_nb.errors import StrataError
from strata_nb.experts.store import ExpertStore
from strata_nb.experts.vram_cache import VRAMCache
from strata_nb.model.spec import ModelSpec
from strata_nb.model.weights import Linear, ModelWeights
from strata_nb.runtime.cpu_backend import CPUBackend
from strata_nb.runtime.cuda_rt import SIM, Graph, stream_wait, sync_event
from strata_nb.runtime.doorbell import Mailbox
from strata_nb.runtime.gpu_blocks import FFNS, MIXERS
from strata_nb.runtime.gpu_sampler import GPUSampler, checked_token
from strata_nb.runtime.sampler import Sampler, SamplerConfig
from strata_nb.runtime.session import Session, make_states, state_bytes

Op = Callable[[object], None]  # enqueues kernels on the stream it is given
WARM_TOKENS = 16  # decode tokens the VRAM cache gets to adapt before its hit rate is judged (late_*, routed)


@dataclass
class HybridStats:
    """Accumulated over decode tokens. graph_s + wait_s + cpu_s + host_s is the wall time of those tokens:
    wait_s the doorbell waits (the GPU running a layer up to its publish), graph_s the wait for the last segment
    (head and sampler), cpu_s the CPU expert pool, host_s everything else on the host; of host_s: launch_s the
    graph launches, glue_s the pool's per-layer glue (routing split, counts, admissions, zeroing the sum),
    call_s the engine call around the token's step, end_s the token's end (VRAM cache, sampled id)."""

    tokens: int = 0
    graph_s: float = 0.0
    wait_s: float = 0.0
    cpu_s: float = 0.0
    host_s: float = 0.0
    launch_s: float = 0.0
    glue_s: float = 0.0
    call_s: float = 0.0
    end_s: float = 0.0
    hits: int = 0  # expert choices computed from VRAM slots
    misses: int = 0  # expert choices computed by the CPU pool
    hit_bytes: int = 0
    miss_bytes: int = 0
    late_hits: int = 0  # the same after the engine's first WARM_TOKENS decode tokens (the cache adapted)
    late_misses: int = 0
    # [n_layer, n_expert] choices per expert after those tokens: the best static placement of the same slots
    routed: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))

    def copy(self) -> "HybridStats":
        return dataclasses.replace(self, routed=self.routed.copy())

    def __sub__(self, o: "HybridStats") -> "HybridStats":
        return HybridStats(**{f.name: getattr(self, f.name) - getattr(o, f.name) for f in dataclasses.fields(self)})

    @property
    def wall_s(self) -> float:
        return self.graph_s + self.wait_s + self.cpu_s + self.host_s


def scratch_bytes(spec: ModelSpec, ntok: int, n_ctx: int) -> int:
    """Device bytes of the activation buffers for ntok tokens (the KV cache and weights not included)."""
    k = max(spec.n_expert_used, 1)
    f_sh = spec.n_ff_exp * 8 if spec.shared_expert else 0  # upper bound on a shared expert's width
    per_tok = (2 * spec.n_embd + 2 * spec.q_dim + 2 * spec.kv_dim + spec.n_expert + 2 * k + spec.n_vocab
               + k * spec.n_ff_exp + 3 * f_sh + spec.n_embd + 3 * spec.n_ff + 1) * 4
    if any(ls.mixer == "gated_attention" for ls in spec.layers):
        per_tok += 2 * spec.q_dim * 4
    if spec.deltanet is not None:
        dn = spec.deltanet
        per_tok += (2 * dn.conv_dim + 2 * dn.v_dim + 4 * dn.n_v_head) * 4
    grouped = 0
    if spec.is_moe and ntok > 1:  # a prompt chunk's choices grouped by expert: up and down outputs, the grouping
        grouped = ntok * k * (spec.n_ff_exp + spec.n_embd + 1) * 4 \
            + (kops.group_tiles_bound(ntok * k, spec.n_expert, kmm.TILE_TOKS) * 3 + 1) * 4
    n_split = katt.choose_n_split(n_ctx, spec.n_head_kv)
    return ntok * per_tok + grouped + spec.n_head * (n_split * (spec.head_dim + 2) + 1) * 4


KV_TYPES = {"f16": np.float16, "f32": np.float32}  # the KV cache's element type on the device


def kv_bytes(spec: ModelSpec, n_ctx: int, kv_type: str = "f16") -> int:
    """The layers' states on the device: KV caches (f16 by default, as llama.cpp; f32 for a reference-exact
    attention) and recurrent states (f32)."""
    return state_bytes(spec, n_ctx, np.dtype(KV_TYPES[kv_type]).itemsize)


@dataclass
class _DLinear:
    qtype: int
    rows: object  # device u8[n_out, row_bytes]
    bias: object | None
    n_out: int


class _Segment:
    def __init__(self, ops: list[Op], doorbell: int | None):
        self.ops = ops
        self.doorbell = doorbell  # the MoE layer whose CPU misses follow this segment (None: the last segment)
        self.graph: Graph | None = None

    def run(self, stream) -> None:
        for op in self.ops:
            op(stream)

    def launch(self, stream) -> None:
        if self.graph is not None:
            self.graph.launch(stream)
        else:
            self.run(stream)


class GPUBackend:
    """The hybrid engine on one GPU. vram_slots: expert slots per MoE layer (the plan's)."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, store: ExpertStore | None, *, n_ctx: int,
                 vram_slots: dict[int, int], fast: bool = True, ntok_max: int = 256, timeout_s: float = 60.0,
                 kv_type: str = "f16",
                 adapt_every: int = 4, progress: Callable[[int, int], None] | None = None):
        self.spec = spec
        self.w = weights
        self.experts = store
        self.n_ctx = n_ctx
        self.ntok_max = max(1, min(ntok_max, n_ctx))
        self.timeout_s = timeout_s
        if kv_type not in KV_TYPES:
            raise StrataError(f"unknown KV cache type {kv_type!r} (f16 or f32)")
        self.kv_type = kv_type
        self.cpu = CPUBackend(spec, weights, store, fast=fast)  # the CPU expert pool (and its stats)
        self.stats = self.cpu.stats
        self._dense_per_token = weights.dense_bytes_per_token()
        self.hybrid = HybridStats(routed=np.zeros((spec.n_layer, max(spec.n_expert, 1)), np.int64))
        self.device_line = ""
        self._warming = False  # a throwaway forward (warm_up): nothing is counted, admitted or adapted
        self._busy = threading.Lock()
        self._ctx_thread = -1  # the last thread known to have the engine's CUDA context current
        self._call(self._load, vram_slots, adapt_every, progress)

    def _call(self, fn: Callable, *args):
        """Run fn(*args) on the calling thread, with the engine's CUDA context current there; one call at a time
        (a second thread gets an error, not a wait)."""
        if not self._busy.acquire(blocking=False):
            raise StrataError("the GPU engine is running a call from another thread")
        try:
            me = threading.get_ident()
            if me != self._ctx_thread and not SIM:  # once per thread, not per call
                cuda.current_context()  # makes the device's primary context current on this thread
            self._ctx_thread = me
            return fn(*args)
        finally:
            self._busy.release()

    @property
    def fast(self) -> bool:
        """int8 activations in the CPU pool and, where the GPU has int8 kernels for a matrix's type, in the
        decode matrix-vector kernels (self.q8)."""
        return self.cpu.fast

    # -- loading ------------------------------------------------------------------------------------------
    def _load(self, vram_slots, adapt_every, progress) -> None:
        s, w = self.spec, self.weights_for_device()
        self.stream = cuda.stream()
        # Decode's L2 prefetch branch (cuda_kernels/prefetch.py) on a second stream, STRATA_NB_PREFETCH=1: off by
        # default: on the H200 it made the decode graph slower (every expert in VRAM, one
        # machine: the host waited 6.77 ms/token for the GPU with it, 6.01 without; bench/results/hybrid_q30-Q4_K_M.md)
        self._prefetch = os.environ.get("STRATA_NB_PREFETCH", "0") == "1"
        if self._prefetch:
            self.side = cuda.stream()
            self._fork_ev, self._join_ev = sync_event(), sync_event()
            self._pf_out = cuda.to_device(np.zeros(1, np.uint32))
        # Decode matrix-vector kernels with int8 activations (cuda_kernels/matvec_q8.py) with the fast kernels;
        # STRATA_NB_GPU_Q8=0 keeps the float32 ones (the A/B switch)
        self.q8 = self.fast and os.environ.get("STRATA_NB_GPU_Q8", "1") != "0"
        # Query heads a decode attention block takes at most (cuda_kernels/attention.DECODE_HEADS; the A/B switch)
        heads = os.environ.get("STRATA_NB_ATT_HEADS", str(katt.DECODE_HEADS))
        if heads not in ("1", "2", "4", "8", "16", "32"):
            raise StrataError(f"STRATA_NB_ATT_HEADS={heads}: query heads a block, a power of two up to 32")
        self.att_heads = int(heads)
        self.dev = w
        tm, k = self.ntok_max, max(s.n_expert_used, 1)
        f32 = np.float32

        def z(*shape, dt=f32):
            # Zeroed: row-wise kernels also run over rows nothing wrote (SwiGLU over the misses' expert rows, which
            # nothing reads after it). Garbage there is harmless on a GPU; the simulator's Python math raises on it.
            return cuda.to_device(np.zeros(shape, dt))

        # the layers' states: the captured graphs hold their addresses, so every session of this engine uses them
        # (one at a time: Session.restore copies a snapshot into them)
        self.states = make_states(s, self.n_ctx, lambda shape, dt: cuda.to_device(np.zeros(shape, dt)),
                                  KV_TYPES[self.kv_type], lambda a: a.copy_to_device(np.zeros(a.shape, a.dtype)))
        self._owner: Session | None = None
        self.x, self.xn, self.sy = z(tm, s.n_embd), z(tm, s.n_embd), z(tm, s.n_embd)
        self.q, self.att = z(tm, s.q_dim), z(tm, s.q_dim)
        self._mixers = [MIXERS[ls.mixer] for ls in s.layers]
        self._ffns = [FFNS[ls.ffn] for ls in s.layers]
        if any(ls.mixer == "gated_attention" for ls in s.layers):
            self.qg = z(tm, 2 * s.q_dim)  # the q projection's [q | gate] per head
        if s.deltanet is not None:  # qkv, its conv output, z, beta and alpha inputs, g, beta, the rule's output
            dn = s.deltanet
            self.dn_bufs = (z(tm, dn.conv_dim), z(tm, dn.conv_dim), z(tm, dn.v_dim), z(tm, dn.n_v_head),
                            z(tm, dn.n_v_head), z(tm, dn.n_v_head), z(tm, dn.n_v_head), z(tm, dn.v_dim))
        self.k, self.v = z(tm, s.kv_dim), z(tm, s.kv_dim)
        self.logits = z(tm, s.n_vocab)
        self.tok = cuda.to_device(np.zeros(tm, np.int32))
        self.pos = cuda.to_device(np.zeros(1, np.int32))
        self.counter = cuda.to_device(np.zeros(1, np.int64))
        if s.is_moe:
            self.rl, self.ids, self.wts = z(tm, s.n_expert), z(tm, k, dt=np.int32), z(tm, k)
            self.eh = z(tm * k, s.n_ff_exp)
            # decode's experts with int8 activations: the routing launch writes x's int8 form, gate+up reads it
            # and writes h's, down reads that (matvec_q8.q8_shapes)
            self.xq8 = self.hq8 = None
            if self.q8 and kmm.q8_rows_ok(s.n_embd):
                self.xq8 = tuple(z(1, n, dt=dt) for n, dt in kq8.q8_shapes(s.n_embd))
                if kmm.q8_rows_ok(s.n_ff_exp):
                    self.hq8 = tuple(z(k, n, dt=dt) for n, dt in kq8.q8_shapes(s.n_ff_exp))
            if tm > 1:  # a prompt chunk's choices grouped by expert (gpu_blocks/ffn.py): up, down outputs, grouping
                nt = kops.group_tiles_bound(tm * k, s.n_expert, kmm.TILE_TOKS)
                self.eu, self.ey = z(tm * k, s.n_ff_exp), z(tm * k, s.n_embd)
                self.grouping = (z(tm * k, dt=np.int32), z(nt, 3, dt=np.int32), z(1, dt=np.int32), nt)
            self.done = cuda.to_device(np.zeros(1, np.int32))  # route_topk's count of blocks done publishing
        f_sh = max((lw.ffn.shexp_gate.n_out for lw in self.w.layers
                    if lw.router is not None and lw.ffn.shexp_gate is not None), default=0)
        if f_sh:
            self.sg, self.su, self.sh = z(tm, f_sh), z(tm, f_sh), z(tm, f_sh)
        if s.n_ff:
            self.fg, self.fu, self.fh = z(tm, s.n_ff), z(tm, s.n_ff), z(tm, s.n_ff)
        n_sm = 132 if SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT
        self.n_split = katt.choose_n_split(self.n_ctx, s.n_head_kv, n_sm)
        self.parts = katt.decode_scratch(s.n_head, s.head_dim, self.n_split)
        r = s.rope
        corr = r.corr_dims() if r.ext_factor else (0.0, 0.0)
        mult, self.mscale = kops.rope_mult(r.n_rot, r.base, r.freq_scale, r.ext_factor, corr[0], corr[1],
                                           self.w.rope_freqs.astype(np.float64), r.attn_factor)
        self.mult = cuda.to_device(np.ascontiguousarray(mult, np.float64))
        self.mb = Mailbox(tm, s.n_embd, k, s.n_layer)
        # the CPU pool's views of the mailbox as exact ndarrays (numba types a subclass slowly on every call); the
        # base method: on a GPU the mapped array is also a device array, whose own view() means a device view
        self._px, self._pids, self._pwts, self._pslot, self._py = (
            np.ndarray.view(a, np.ndarray) for a in (self.mb.x, self.mb.ids, self.mb.wts, self.mb.slot, self.mb.y))
        self._pall = np.full((tm, k), -1, np.int32)  # the slots while warming up: the pool computes every choice
        # where no count is kept, counts typed as the kept ones (one compiled signature)
        ne = max(s.n_expert, 1)
        self._ptally = (np.zeros((s.n_layer, ne)), np.zeros((s.n_layer, ne), np.int64))
        self.cache = None
        if s.is_moe:
            self.cache = VRAMCache(self.experts.src, s.n_layer, s.n_expert, vram_slots,
                                   self.experts.profile, adapt_every=adapt_every, timeout_s=self.timeout_s)
            self.cache.fill(self.stream, progress)
            self._table = self.cache.table
            self._full = self.cache.full_layers
            self._slot_bytes = {l: lay.slot_bytes for l, lay in self.cache.layouts.items()}
            self._expert_bytes = {l: sum(m.nbytes for m in lay.mats.values())
                                  for l, lay in self.cache.layouts.items()}
            # layers whose slots are not all taken yet: only they admit missed experts (a taken slot is never free
            # again, swaps reuse it), so a warm pool never calls into the cache
            self._pfree = {l for l, n in self.cache.slots.items() if n > 0}
        # while the doorbell thread waits for the GPU, the CPU pool's OpenMP workers are kept from falling asleep
        self._tick = None
        self._gated = False  # hybrid layers' post-pool work queued behind gates, launched ahead (doorbell.py)
        if self.cache is not None and len(self._full) < len(self.cache.slots):
            buf = np.zeros(max(numba.config.NUMBA_NUM_THREADS, 1), np.int64)
            self._tick = lambda: cops.touch_threads(buf)
            # off by default: on the H200 gates took 25% from 54.0 to 57.1 tok/s but 50% from 66.6 to 52.2 (the
            # CPU pool slower, not understood yet; bench/results/hybrid_q30-Q4_K_M.md)
            self._gated = os.environ.get("STRATA_NB_GATES", "0") == "1" and self.mb.gates_work(self.stream,
                                                                                                self.timeout_s)
        self.sampler = self._gpu_sampler(SamplerConfig(seed=0))
        self._bound_sampler: Sampler | None = None
        self._dev_pos = 0  # the device's position after everything launched
        self._seq = 0
        self._ahead = 0  # sequence number of a decode forward launched ahead of the caller's request (0: none)
        self._last_token = -1  # the token sample_next returned last (the input the device already holds)
        self._decode: list[_Segment] | None = None  # captured lazily after one direct decode step
        self._decode_logits: list[_Segment] | None = None
        self.stream.synchronize()
        self.vram = {"dense": self._dense_bytes, "kv": sum(st.nbytes for st in self.states),
                     "experts": self.cache.nbytes if self.cache else 0}

    def weights_for_device(self) -> dict:
        """Upload every dense tensor in its GGUF layout (no float copy of quantized weights)."""
        n = [0]

        def lin(m: Linear | None) -> _DLinear | None:
            if m is None:
                return None
            rows = cuda.to_device(np.ascontiguousarray(m.rows))
            bias = cuda.to_device(np.ascontiguousarray(m.bias, np.float32)) if m.bias is not None else None
            n[0] += m.rows.nbytes + (m.bias.nbytes if m.bias is not None else 0)
            return _DLinear(m.qtype, rows, bias, m.n_out)

        def vec(a: np.ndarray | None):
            if a is None:
                return None
            n[0] += a.nbytes
            return cuda.to_device(np.ascontiguousarray(a, np.float32))

        layers = []
        for lw in self.w.layers:  # one dict per layer: its norms, mixer and FFN tensors by field name
            fields = {"attn_norm": lw.attn_norm, "ffn_norm": lw.ffn_norm, **vars(lw.mixer), **vars(lw.ffn)}
            L = defaultdict(lambda: None)  # a kind's absent tensors (router of a dense FFN, ...) read as None
            L.update({k: lin(v) if isinstance(v, Linear) else vec(v) if isinstance(v, np.ndarray) else v
                      for k, v in fields.items()})
            layers.append(L)
        emb = lin(self.w.embd)
        out = emb if self.w.output is self.w.embd else lin(self.w.output)
        d = {"layers": layers, "embd": emb, "output": out, "output_norm": vec(self.w.output_norm)}
        self._dense_bytes = n[0]
        return d

    # -- the program --------------------------------------------------------------------------------------
    def _linear(self, m: _DLinear, x, out, ntok: int, accumulate: bool = False) -> list[Op]:
        ops: list[Op] = [lambda st: kmm.matmul(m.qtype, m.rows, x, out, ntok, st, accumulate=accumulate,
                                                     q8=self.q8)]
        if m.bias is not None:
            ops.append(lambda st: kops.add_bias(out, m.bias, ntok, st))
        return ops

    def _normed(self, norm, mats: list[tuple[_DLinear, object]], T: int, x_out=None, q8_out=None) -> list[Op]:
        """rmsnorm(x) * norm through each (linear, out) of mats. One token: one launch (the norm fused into the
        matrix-vector kernel, which also writes the normalized row to x_out and its int8 form to q8_out when
        given); a prompt: rmsnorm into self.xn, then the tiled matmuls."""
        eps = float(self.spec.rms_eps)
        if T == 1:
            mv = [(m.qtype, m.rows, out, False) for m, out in mats]
            ops: list[Op] = [lambda st: kmm.matvec(mv, self.x, st, norm=norm, eps=eps, x_out=x_out,
                                                         q8=self.q8, q8_out=q8_out)]
            for m, out in mats:
                if m.bias is not None:
                    ops.append(lambda st, m=m, out=out: kops.add_bias(out, m.bias, 1, st))
            return ops
        ops = [lambda st: kops.rmsnorm(self.x, norm, eps, self.xn, T, st)]
        for m, out in mats:
            ops += self._linear(m, self.xn, out, T)
        return ops

    def _prefetch_op(self, l: int) -> Op:
        """A branch off the stream that brings into L2, while layer l computes, the down matrices of the experts
        token 0 chose in layer l that have VRAM slots (l >= 0), then layer l + 1's dense matrices. It writes
        nothing the forward reads; the segment joins it at its end (_join_op)."""
        experts = None
        if 0 <= l and self.cache is not None and self.cache.slots.get(l, 0) > 0:
            d = self.cache.layouts[l].mats["down"]
            experts = (self.cache.bufs[l], d.offset, d.nbytes, self._table[l])
        mats = []
        if l + 1 < self.spec.n_layer:
            mats = [m.rows for m in self.dev["layers"][l + 1].values() if isinstance(m, _DLinear)]

        def op(st):
            self._fork_ev.record(st)
            stream_wait(self.side, self._fork_ev)
            if experts is not None:
                kpf.touch_slots(experts[0], experts[1], experts[2], experts[3], self.ids, self._pf_out, self.side)
            for w in mats:
                kpf.touch(w, self._pf_out, self.side)
            self._join_ev.record(self.side)
        op.forks = True
        return op

    def _join_op(self) -> Op:
        def op(st):
            stream_wait(st, self._join_ev)
        op.joins = True
        return op

    def _end_segment(self, segs: list[_Segment], ops: list[Op], doorbell: int | None) -> None:
        """End a segment: the prefetch branch forked in it (if any) joins the stream first (a graph's captured
        branches must rejoin before its capture ends)."""
        if any(getattr(op, "forks", False) for op in ops):
            ops = ops + [self._join_op()]
        segs.append(_Segment(ops, doorbell))

    def _program(self, T: int, tokens, tail: str, all_logits: bool = False) -> list[_Segment]:
        """The segments of a forward of T tokens read from the device array `tokens`. tail: "logits" (head into
        self.logits), or "sample" (head, then the device sampler draws the next token)."""
        s, D = self.spec, self.dev
        segs: list[_Segment] = []
        cur: list[Op] = [self._prefetch_op(-1)] if T == 1 and self._prefetch else []
        cur.append(lambda st: kmm.embed(D["embd"].qtype, D["embd"].rows, tokens, self.x, T, st))
        for l in range(s.n_layer):
            cur += self._mixers[l](self, l, T)
            pre, post, hybrid = self._ffns[l](self, l, T)
            cur += pre
            if hybrid:
                self._end_segment(segs, cur, l)
                cur = list(post)
        out, eps = D["output"], float(s.rms_eps)
        if all_logits and T > 1:
            cur.append(lambda st: kops.rmsnorm(self.x, D["output_norm"], eps, self.xn, T, st))
            cur += self._linear(out, self.xn, self.logits, T)
        else:  # the last row only: the final norm fused into the head's matrix-vector launch
            xl = self.x[T - 1:T]
            cur.append(lambda st: kmm.matvec([(out.qtype, out.rows, self.logits, False)], xl, st,
                                             norm=D["output_norm"], eps=eps, q8=self.q8))
        if tail == "sample":
            lrow = self.logits[0]
            cur.append(lambda st: self.sampler.launch(lrow, st))
        cur.append(lambda st: kmb.advance(self.pos, T, st))
        if tail == "sample":  # the token into the mailbox's ring, read by the host by sequence number
            cur.append(lambda st: kmb.ring(self.counter, self.mb.device["seq"], st, self.sampler.token_host,
                                           self.mb.device["tokens"]))
        else:
            cur.append(lambda st: kmb.ring(self.counter, self.mb.device["seq"], st))
        self._end_segment(segs, cur, None)
        return segs

    # -- running ------------------------------------------------------------------------------------------
    def _cpu_pool(self, layer: int, T: int, stats: HybridStats | None) -> float:
        """The misses of `layer` for T tokens: read the published routing, compute, write the weighted sum. One call
        into the CPU backend on plain views of the whole mailbox (no slices, no numpy temporaries): the split, the
        counts, x's int8 form and the experts run compiled. Returns the seconds in that call."""
        # The layer's choices (hits included) are counted, inside the split, for the cache's placement, the stats
        # and the store; none while warming up, when the pool computes every choice so that its kernels compile
        # even when all of them hit VRAM.
        counting = not self._warming
        late = counting and stats is not None and stats.tokens >= WARM_TOKENS
        t0 = time.perf_counter()
        ng, nh = self.cpu.pool(layer, T, self._px, self._pids, self._pslot if counting else self._pall, self._pwts,
                               self._py, self.cache.counts if counting else self._ptally[0],
                               stats.routed if late else self._ptally[1])
        dt = time.perf_counter() - t0
        if self._gated:  # the GPU goes on now; the bookkeeping below overlaps it
            self.mb.open(layer)
        if ng and counting and layer in self._pfree:
            self.cache.admit(layer, self.cpu.missed(ng))
            if (self.cache.slot_expert[layer] != -1).all():
                self._pfree.discard(layer)
        if stats is not None:
            nb = self._expert_bytes[layer]
            nm = T * self.spec.n_expert_used - nh
            stats.hits += nh
            stats.misses += nm
            stats.hit_bytes += nh * nb
            stats.miss_bytes += nm * nb
            if late:
                stats.late_hits += nh
                stats.late_misses += nm
        return dt

    def _execute(self, segs: list[_Segment], T: int, stats: HybridStats | None) -> None:
        """Run a forward's segments: each hybrid layer's CPU pool between its segment and the next. With gates and
        captured graphs the next segment is launched before the pool runs (it waits on the device for the layer's
        gate), so the launch overlaps the GPU and the GPU resumes as soon as the pool's sum is written; otherwise
        after it (its gate already open). Never ahead of direct launches: a kernel's first launch loads its
        module (CUDA's lazy loading), which waits for the device to idle, behind a gate only this thread opens."""
        t0 = time.perf_counter()
        wait = cpu = last = launch = glue = 0.0
        ahead = 1 if self._gated and segs[0].graph is not None else 0
        try:
            for i in range(min(ahead, len(segs) - 1) + 1):
                t1 = time.perf_counter()
                segs[i].launch(self.stream)
                launch += time.perf_counter() - t1
            for i, seg in enumerate(segs):
                self._seq += 1
                if seg.doorbell is not None:
                    wait += self.mb.wait(self._seq, self.timeout_s, f"the routing of layer {seg.doorbell}",
                                         self._tick)
                    t1 = time.perf_counter()
                    dt = self._cpu_pool(seg.doorbell, T, stats)
                    cpu += dt
                    glue += time.perf_counter() - t1 - dt
                else:
                    last += self.mb.wait(self._seq, self.timeout_s, "the end of the forward", self._tick)
                if i + 1 + ahead < len(segs):
                    t1 = time.perf_counter()
                    segs[i + 1 + ahead].launch(self.stream)
                    launch += time.perf_counter() - t1
        except BaseException:
            if self._gated:  # work queued behind a gate that will never be opened: let it drain, then report
                self.mb.release(self.stream, self.timeout_s)
            raise
        self._dev_pos += T
        t1 = time.perf_counter()
        if self.cache is not None and not self._warming:
            self.cache.end_token(self.stream)
        if stats is not None:
            stats.tokens += 1
            stats.wait_s += wait
            stats.cpu_s += cpu
            stats.graph_s += last
            stats.launch_s += launch
            stats.glue_s += glue
            stats.end_s += time.perf_counter() - t1
            stats.host_s += time.perf_counter() - t0 - wait - cpu - last

    def _set_pos(self, pos: int) -> None:
        if pos != self._dev_pos:
            self.pos.copy_to_device(np.array([pos], np.int32), stream=self.stream)
            self._dev_pos = pos

    def _decode_segments(self, tail: str) -> list[_Segment]:
        """The T=1 program, captured into graphs at its second use (the first run compiles every kernel)."""
        attr = "_decode" if tail == "sample" else "_decode_logits"
        segs = getattr(self, attr)
        if segs is None:
            segs = self._program(1, self.sampler.token, tail)
            setattr(self, attr, segs)
            return segs
        if segs[0].graph is None:
            self.stream.synchronize()
            for i, seg in enumerate(segs):
                seg.graph = Graph(seg.run, self.stream, f"decode segment {i}")
        return segs

    def _forward(self, pos: int, tokens: np.ndarray, tail: str, all_logits: bool) -> np.ndarray | None:
        T = len(tokens)
        self._drain()
        self._set_pos(pos)
        out = []
        for c0 in range(0, T, self.ntok_max):
            chunk = tokens[c0:c0 + self.ntok_max]
            n = len(chunk)
            last = c0 + n == T
            if n == 1 and not all_logits:
                self.sampler.token.copy_to_device(np.asarray(chunk, np.int32), stream=self.stream)
                segs = self._decode_segments(tail if last else "logits")
            else:
                self.tok[:n].copy_to_device(np.asarray(chunk, np.int32), stream=self.stream)
                segs = self._program(n, self.tok, tail if last else "logits", all_logits)
            self._execute(segs, n, None)
            if all_logits or (last and tail == "logits"):
                rows = n if all_logits else 1
                out.append(self.logits[:rows].copy_to_host(stream=self.stream))
                self.stream.synchronize()
        return np.concatenate(out) if out else None

    def _decode_step(self, stats: HybridStats, ahead: bool) -> int:
        """One decode token (its input is on the device: the token sampled last). Where the token needs no host
        work (every MoE layer in VRAM: one graph), the graph of the token after it is launched before this
        one's result is read when `ahead`, so the launch and the host's work between tokens overlap the GPU."""
        segs = self._decode_segments("sample")
        if len(segs) > 1 or segs[0].graph is None:
            self._drain()
            self._execute(segs, 1, stats)
            return self._sampled(self._seq)
        t0 = time.perf_counter()
        if self._ahead:  # this token's forward was launched by the previous call
            mine, self._ahead = self._ahead, 0
        else:
            mine = self._launch_one(segs[0])
        if ahead:
            self._ahead = self._launch_one(segs[0])
        t1 = time.perf_counter()
        last = self.mb.wait(mine, self.timeout_s, "the end of the forward")
        t2 = time.perf_counter()
        if self.cache is not None and not self._warming:
            self.cache.end_token(self.stream)
        stats.tokens += 1
        stats.graph_s += last
        stats.launch_s += t1 - t0
        stats.end_s += time.perf_counter() - t2
        stats.host_s += time.perf_counter() - t0 - last
        return self._sampled(mine)

    def _launch_one(self, seg: _Segment) -> int:
        seg.launch(self.stream)
        self._seq += 1
        self._dev_pos += 1
        return self._seq

    def _sampled(self, seq: int) -> int:
        """The token sampled by forward seq (from the mailbox's ring)."""
        return checked_token(self.mb.token(seq))

    def _drain(self) -> None:
        """Finish a forward launched ahead that was not asked for (the caller stopped or changed course). Its KV
        entry lies past the session's position (overwritten before anything reads it), and the device sampler's
        step and history are one token ahead: the next sampled forward rebinds the sampler from the host's."""
        if self._ahead:
            self.mb.wait(self._ahead, self.timeout_s, "a decode forward launched ahead")
            self._ahead = 0
            self._bound_sampler = None

    def _gpu_sampler(self, config: SamplerConfig) -> GPUSampler:
        cap = max(self.n_ctx, int(config.repeat_last_n)) + 1
        return GPUSampler(config, self.spec.n_vocab, cap)

    def _bind_sampler(self, sampler: Sampler, history: Sequence[int]) -> None:
        """The device sampler takes over the host sampler's chain and seed, in its own device arrays, so the
        captured decode graphs stay valid (only a repetition window past its ring makes a new device sampler,
        and the graphs are captured again)."""
        self._drain()
        cfg = dataclasses.replace(sampler.config, seed=sampler.seed)
        if cfg != self.sampler.config:
            if self.sampler.fits(cfg):
                self.sampler.configure(cfg, stream=self.stream)
            else:
                self.sampler = self._gpu_sampler(cfg)
                self._drop_graphs()
        self.sampler.set_history(history, stream=self.stream)
        st = self.sampler.state.copy_to_host(stream=self.stream)
        st[ks.ST_STEP] = sampler.step  # continue the host sampler's draws: uniform(seed, step)
        self.sampler.state.copy_to_device(st, stream=self.stream)
        self.stream.synchronize()
        self._bound_sampler = sampler

    def _drop_graphs(self) -> None:
        for segs in (self._decode, self._decode_logits):
            for seg in segs or ():
                if seg.graph is not None:
                    seg.graph.close()
        self._decode = self._decode_logits = None

    def _warm_up(self) -> None:
        self._drain()
        # its forwards run at position 0 on the engine's own state: the recurrent part is kept for the session
        kept = [(st, st.save(0)) for st in self.states if st.recurrent]
        pool, smp = self.cpu, self.sampler
        # the device sampler's state as it was (the throwaway tokens are sampled with it: the decode graphs
        # captured below must read its arrays)
        saved = [a.copy_to_host(stream=self.stream) for a in (smp.state, smp.ring, smp.counts, smp.token)]
        host_token = int(smp.token_host[0])
        self.cpu = pool.scratch()
        self._warming = True
        try:
            self._set_pos(0)
            if self.ntok_max >= 2:  # the prompt kernels, the head over every row (dumped logits) and the sampler
                self.tok[:2].copy_to_device(np.zeros(2, np.int32), stream=self.stream)
                self._execute(self._program(2, self.tok, "sample", all_logits=True), 2, None)
            self._execute(self._decode_segments("sample"), 1, None)  # the decode kernels, launched directly
            self.stream.synchronize()
            # captured here, where no clock runs, rather than inside a generation's first decode tokens
            self._decode_segments("sample")
        finally:
            self.cpu, self._warming = pool, False
            for st, state in kept:
                st.load(state, 0)
            for a, h in zip((smp.state, smp.ring, smp.counts, smp.token), saved):
                a.copy_to_device(h, stream=self.stream)
            smp.token_host[0] = host_token
            self.stream.synchronize()

    # -- the Backend interface ----------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Compile every kernel of the prompt, decode and sampler programs and of the CPU expert pool before
        anything is timed: a throwaway forward of 2 tokens and one of 1 (a scratch pool that computes every
        choice of the hybrid layers and counts nothing; the device sampler's state put back after), then the
        decode program's capture into CUDA graphs, so that no generation captures inside its decode clock. The
        KV positions it writes are written again by the next prompt before anything reads them; the slot table,
        profile and stats stay as they were. The simulator interprets its kernels (nothing to compile, and a
        forward costs seconds there): only the CPU pool's kernels are compiled, by the CPU engine's warm-up."""
        if SIM:
            self.cpu.warm_up()
        else:
            self._call(self._warm_up)

    def new_session(self, n_ctx: int) -> Session:
        """A session on this engine's device state (its KV caches); an older session continues only once a
        snapshot is restored into it."""
        if n_ctx != self.n_ctx:
            raise StrataError(f"this GPU engine's state holds {self.n_ctx} positions, not {n_ctx}")
        self._owner = Session(self.spec, n_ctx, self.states)
        return self._owner

    def _start(self, session: Session) -> None:
        """A sequence starts from zeroed recurrent states (after any forward launched ahead has finished)."""
        if session.pos == 0 and self.spec.recurrent:
            self._call(self._drain)
            session.reset()

    def _hold(self, session: Session) -> bool:
        """The device state is the session's: it made it, restored a snapshot into it, or starts a sequence.
        Returns whether the state changed under the device's own sequence (another session, a restore)."""
        if session.states is not self.states:
            raise StrataError("this session was not made by this GPU engine (Engine.new_session)")
        changed = session.restored or session is not self._owner
        if session is not self._owner:
            if session.pos != 0 and not session.restored:
                raise StrataError("another session has used this GPU engine's state since: restore a snapshot "
                                  "into this one (Session.restore) to continue it")
            self._owner = session
        session.restored = False
        return changed

    def forward(self, session: Session, tokens: np.ndarray, all_logits: bool = False) -> np.ndarray:
        tokens = np.asarray(tokens, np.int64)
        self._hold(session)
        session.reserve(len(tokens))
        self._start(session)
        logits = self._call(self._forward, session.pos, tokens, "logits", all_logits)
        session.advance([int(t) for t in tokens])
        self.stats.dense_bytes += self._dense_per_token
        return logits

    def sample_next(self, session: Session, tokens: Sequence[int], sampler: Sampler, history: Sequence[int],
                    ahead: bool = False) -> int:
        """Run tokens and draw the next token on the device; only its id comes back to the host. ahead: the
        caller will probably ask for the token after this one (then, where a token needs no host work, its
        forward starts before this call returns)."""
        tokens = np.asarray(tokens, np.int64)
        changed = self._hold(session)
        session.reserve(len(tokens))
        self._start(session)
        # the device continues its own sequence (its last draw as input, at the position after it) only when the
        # caller continues it too; anything else (a prompt, another token, a restored state) starts afresh
        continues = (not changed and len(tokens) == 1 and sampler is self._bound_sampler
                     and int(tokens[0]) == self._last_token and session.pos == self._dev_pos - (self._ahead > 0))
        if not continues:
            self._call(self._bind_sampler, sampler, history)
            self._call(self._forward, session.pos, tokens, "sample", False)
            tok = self._sampled(self._seq)
            sampler.step += 1
        else:
            t0, h0 = time.perf_counter(), self.hybrid.wall_s
            # the forward launched ahead sits at the session's next position: only within the context
            tok = self._call(self._decode_step, self.hybrid, ahead and session.pos + 1 < self.n_ctx)
            sampler.step += 1
            dt = time.perf_counter() - t0 - (self.hybrid.wall_s - h0)  # so the breakdown adds up to the call
            self.hybrid.host_s += dt
            self.hybrid.call_s += dt
        self._last_token = tok
        session.advance([int(t) for t in tokens])
        self.stats.dense_bytes += self._dense_per_token
        return tok

    def vram_lines(self) -> list[str]:
        gb = 1e9
        v = self.vram
        lines = [f"VRAM            dense weights {v['dense'] / gb:.2f} GB, KV cache {v['kv'] / gb:.2f} GB, "
                 f"expert slots {v['experts'] / gb:.2f} GB"]
        if self.cache is not None:
            n = sum(self.cache.slots.values())
            tot = self.spec.n_expert * len(self.cache.slots)
            lines.append(f"expert slots    {n} of {tot} experts ({100 * n / max(tot, 1):.0f}%), "
                         f"{min(self.cache.slots.values())}-{max(self.cache.slots.values())} per layer")
        return lines

    def close(self) -> None:
        def _close():
            self._drain()
            self._drop_graphs()
            if self.cache is not None:
                self.cache.close()

        self._call(_close)
