"""The hybrid engine's FFNs on the GPU, one function per kind (ModelSpec.layers). Each returns (the launches up to
and including the layer's GPU work, the launches after the CPU pool's part, whether the host must act between
them). A MoE layer whose experts are not all in VRAM publishes its routing to the mailbox in the routing launch
(the doorbell): the CPU pool starts on the misses while the GPU computes the VRAM hits and the shared expert; the
launches after the pool add its sum into the residual stream. A prompt chunk's VRAM hits are grouped by expert
first, so each expert's rows are read once per tile of its choices (the decode kernels read them once per choice)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from strata_nb.cuda_kernels import matmul as kmm
from strata_nb.cuda_kernels import matvec_q8 as kq8
from strata_nb.cuda_kernels import ops as kops

if TYPE_CHECKING:
    from strata_nb.runtime.gpu_backend import GPUBackend, Op


def dense(b: "GPUBackend", l: int, T: int) -> tuple[list["Op"], list["Op"], bool]:
    L = b.dev["layers"][l]
    ops = [b._prefetch_op(l)] if T == 1 and b._prefetch else []
    ops += b._normed(L["ffn_norm"], [(L["ffn_gate"], b.fg), (L["ffn_up"], b.fu)], T)
    ops.append(lambda st: kops.swiglu(b.fg, b.fu, b.fh, T, st))
    ops += b._linear(L["ffn_down"], b.fh, b.x, T, accumulate=True)
    return ops, [], False


def moe(b: "GPUBackend", l: int, T: int) -> tuple[list["Op"], list["Op"], bool]:
    s, L = b.spec, b.dev["layers"][l]
    k = s.n_expert_used
    table = b._table[l]
    shared = L["shexp_gate"] is not None
    mats = [(L["router"], b.rl)] + ([(L["shexp_gate"], b.sg), (L["shexp_up"], b.su)] if shared else [])
    ff_types = ()
    if b.cache.slots.get(l, 0) > 0:
        lay = b.cache.layouts[l]
        ff_types = (lay.mats["gate"].qtype, lay.mats["up"].qtype)
    # one token whose gate and up have int8 kernels: the routing launch also writes x's int8 form for them
    xq8 = b.xq8 if T == 1 and ff_types and kq8.supports(ff_types, s.n_embd) else None
    hq8 = b.hq8 if xq8 is not None else None
    hybrid = l not in b._full
    pub = (b.xn, table, b.mb.device, b.done, b.counter) if hybrid else None
    ops = b._normed(L["ffn_norm"], mats, T, x_out=b.xn, q8_out=xq8)
    ops.append(lambda st: kops.route_topk(b.rl, k, bool(s.expert_norm), float(s.expert_weights_scale),
                                          b.ids, b.wts, T, st, publish=pub))
    if T == 1 and b._prefetch:
        ops.append(b._prefetch_op(l))
    if b.cache.slots.get(l, 0) > 0:  # the choices with a VRAM slot
        buf, lay = b.cache.bufs[l], b.cache.layouts[l]
        g, u, d = ((m.qtype, m.offset, m.row_bytes) for m in (lay.mats["gate"], lay.mats["up"], lay.mats["down"]))
        ff, hidden = lay.mats["gate"].rows, lay.mats["down"].rows
        if T == 1:  # matrix-vector kernels, one choice a warp
            ops.append(lambda st: kmm.moe_gate_up(g, u, buf, ff, table, b.ids, b.xn, b.eh, T, st, xq8=xq8,
                                                  hq8=hq8))
            ops.append(lambda st: kmm.moe_down(d, buf, hidden, table, b.ids, b.wts, b.eh, b.x, T, st, hq8=hq8))
        else:  # a prompt chunk: the choices grouped by expert, each expert's rows read once per tile of them
            n = T * k
            ops.append(lambda st: kops.group_experts(b.ids, table, T, kmm.TILE_TOKS, *b.grouping[:3], st))
            ops.append(lambda st: kmm.moe_tiled(g, buf, ff, b.grouping, b.xn, k, b.eh, st))
            ops.append(lambda st: kmm.moe_tiled(u, buf, ff, b.grouping, b.xn, k, b.eu, st))
            ops.append(lambda st: kops.swiglu(b.eh, b.eu, b.eh, n, st))
            ops.append(lambda st: kmm.moe_tiled(d, buf, hidden, b.grouping, b.eh, 1, b.ey, st))
            ops.append(lambda st: kops.experts_combine(b.ey, b.ids, b.wts, table, b.x, T, st))
    if shared:
        ops.append(lambda st: kops.swiglu(b.sg, b.su, b.sh, T, st))
        if L["shexp_gate_inp"] is not None:
            ops += b._linear(L["shexp_down"], b.sh, b.sy, T)
            ops.append(lambda st: kops.sigmoid_gate(b.sy, b.xn, L["shexp_gate_inp"], T, st))
            ops.append(lambda st: kops.add(b.x, b.sy, T, st))
        else:
            ops += b._linear(L["shexp_down"], b.sh, b.x, T, accumulate=True)
    after: list["Op"] = []
    if hybrid:  # the pool's sum into the residual stream (behind the layer's gate where there are gates)
        after = [b.mb.gate_op(l)] if b._gated else []
        after.append(lambda st: kops.add(b.x, b.mb.device["y"], T, st))
    return ops, after, hybrid
