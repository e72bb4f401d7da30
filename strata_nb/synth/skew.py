"""A skewed router for synthetic MoE files: expert selection frequencies that fall with rank as (r+1)^-alpha.

Top-k routing is invariant to a common positive scale of the logits, so skew needs a per-expert bias, and the
architectures we write have no router bias tensor. We make one: hidden dimension BIAS_DIM of every token
embedding holds the same constant C, and row BIAS_DIM of every tensor that adds into the residual stream
(attn_output, ffn_down_exps, ffn_down_shexp, ffn_down) is zero, so x[BIAS_DIM] == C in every layer. The router
column BIAS_DIM then adds beta_e * a[BIAS_DIM] to expert e's logit, next to the random part of the logit
(the "noise", the dot product with the other dimensions).

How large beta must be depends on the ratio a[BIAS_DIM] / std(noise) that the model's own dynamics produce in
each layer, so it is calibrated: `fit_bias` finds (once, by Monte Carlo) biases b in units of the noise std such
that top-k of b + N(0, 1) selects each rank at the target frequency, and `calibrate_router` runs a short pilot
forward of the written file with our engine, measures that ratio in each layer just before the layer routes, and
writes beta = b / ratio into the router column in place (layer by layer in the same forward, so later layers see
the skewed routing of earlier ones).
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from strata_nb.errors import StrataError

BIAS_DIM = 0  # the constant hidden dimension; 0 keeps the per-type block edits below to element 0 of block 0
FLOAT_C = 2.0  # the constant in float embeddings (entries have std 1); quantized types use their block maximum
RESIDUAL_WRITERS = ("attn_output.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight", "ffn_down.weight")
PILOT_TOKENS = 32  # one batch; it reads each expert these tokens route to once per layer (~half of them at 128)
_SEED_TAG = 0x5CE3  # separates the rank permutations' streams from the tensors' (seed, index) streams


def target_frequencies(n_expert: int, k: int, alpha: float) -> np.ndarray:
    """f[r] = min(1, c * (r+1)^-alpha) for ranks r = 0..n_expert-1, with c such that sum(f) == k."""
    if not 0 < k <= n_expert:
        raise StrataError(f"router skew needs 0 < experts used <= experts, got {k} of {n_expert}")
    w = np.arange(1, n_expert + 1, dtype=np.float64) ** -float(alpha)
    lo, hi = 0.0, k / w[-1]  # at hi every expert saturates: sum == n_expert >= k
    for _ in range(200):  # sum(min(1, c w)) is increasing in c: bisect
        c = 0.5 * (lo + hi)
        lo, hi = (c, hi) if np.minimum(1.0, c * w).sum() < k else (lo, c)
    return np.minimum(1.0, hi * w)


def expert_ranks(seed: int, layer: int, n_expert: int) -> np.ndarray:
    """by_rank[r] = the expert of rank r in `layer` (rank 0 is the most often selected)."""
    return np.random.Generator(np.random.PCG64([seed, _SEED_TAG, layer])).permutation(n_expert)


@functools.lru_cache(maxsize=16)
def fit_bias(n_expert: int, k: int, alpha: float, n_samples: int = 40000, iters: int = 80) -> np.ndarray:
    """Biases b[r] (rank order, mean zero, in units of the noise std) with top-k of (b + N(0,1)) selecting rank r
    at target_frequencies(...)[r]. Fixed noise draws make the fit deterministic; steps are clipped so saturated
    ranks (target 1) stop growing at a margin that selects them in all but ~1% of tokens."""
    ft = target_frequencies(n_expert, k, alpha)
    z = np.random.Generator(np.random.PCG64(_SEED_TAG)).standard_normal((n_samples, n_expert), np.float32)
    b = np.log(ft)
    b -= b.mean()
    for _ in range(iters):
        top = np.argpartition(z + b.astype(np.float32), n_expert - k, axis=1)[:, n_expert - k:]
        fm = np.bincount(top.ravel(), minlength=n_expert) / n_samples
        b += 0.5 * np.clip(np.log(ft) - np.log(np.maximum(fm, 0.5 / n_samples)), -1.0, 1.0)
        b -= b.mean()
    return b


# --- the constant dimension in the token embedding -------------------------------------------------------

def _f16_negative(blocks: np.ndarray, off: int) -> np.ndarray:
    return (blocks[:, off + 1] & 0x80) != 0


def _set_element0_max(blocks: np.ndarray, qtype: T) -> None:
    """Set element 0 of every block (uint8 [n, type_size], scales as blocks.random_rows writes them: one |d| for
    all blocks, a random sign on d for the signed types) to the largest positive value the block's scales allow,
    the same in every block. Offsets follow ggml-common.h; for K-quants the first sub-block scale is set to its
    maximum too, which coarsens that sub-block's other values but keeps the constant a few times their RMS."""
    b = blocks
    if qtype == T.Q8_0:  # d, qs[32] int8: d*q
        b[:, 2] = np.where(_f16_negative(b, 0), np.uint8(0x81), np.uint8(0x7F))  # -127 / +127
    elif qtype == T.Q4_0:  # d, qs[16]: d*(q-8); 7|d| either sign
        b[:, 2] = (b[:, 2] & 0xF0) | np.where(_f16_negative(b, 0), 1, 15).astype(np.uint8)
    elif qtype == T.Q5_0:  # d, qh u32, qs[16]: d*(q-16), bit 0 of qh is element 0's 5th bit; 15|d|
        neg = _f16_negative(b, 0)
        b[:, 2] = (b[:, 2] & 0xFE) | (~neg).astype(np.uint8)
        b[:, 6] = (b[:, 6] & 0xF0) | np.where(neg, 1, 15).astype(np.uint8)
    elif qtype == T.Q4_1:  # d > 0, m = -7.5 d, qs[16]: d*q + m
        b[:, 4] |= 0x0F
    elif qtype == T.Q5_1:  # d > 0, m = -15.5 d, qh u32, qs[16]
        b[:, 4] |= 0x01
        b[:, 8] |= 0x0F
    elif qtype == T.Q2_K:  # scales[16] (lo nibble scale, hi nibble min), qs[64], d > 0, dmin = 1.5 d
        b[:, 0] = 0xFF
        b[:, 16] |= 0x03
    elif qtype == T.Q3_K:  # hmask[32], qs[64], scales[12] (6-bit, -32), d: d*(sc-32)*(q2 - 4*(1-h))
        neg = _f16_negative(b, 108)
        b[:, 96] |= 0x0F  # scale 0: low 4 bits in scales[0], high 2 bits in scales[8] -> 63 - 32 = 31
        b[:, 104] |= 0x03
        b[:, 32] = (b[:, 32] & 0xFC) | np.where(neg, 1, 3).astype(np.uint8)  # q = 3, or 1 - 4 = -3 for d < 0
        b[:, 0] = (b[:, 0] & 0xFE) | (~neg).astype(np.uint8)
    elif qtype in (T.Q4_K, T.Q5_K):  # d > 0, dmin = mean*d, scales[12] at 4 (sub-block 0: bytes 0 and 4)
        b[:, 4] |= 0x3F
        b[:, 8] |= 0x3F
        if qtype == T.Q4_K:
            b[:, 16] |= 0x0F
        else:  # qh[32] at 16, qs at 48
            b[:, 16] |= 0x01
            b[:, 48] |= 0x0F
    elif qtype == T.Q6_K:  # ql[128], qh[64], scales[16] int8 at 192, d at 208: d*sc*(q-32)
        neg = _f16_negative(b, 208)
        b[:, 192] = 0x7F
        b[:, 0] = (b[:, 0] & 0xF0) | np.where(neg, 1, 15).astype(np.uint8)  # q = 1 or 63
        b[:, 128] = (b[:, 128] & 0xFC) | np.where(neg, 0, 3).astype(np.uint8)
    else:
        raise StrataError(f"router skew: no constant-embedding rule for {qtype.name}")


def set_bias_dim(rows: np.ndarray, qtype: T) -> None:
    """Give element BIAS_DIM of every embedding row (uint8 [n, row_bytes], in place) the same positive value."""
    if qtype == T.F32:
        rows.view(np.float32)[:, BIAS_DIM] = FLOAT_C
    elif qtype == T.F16:
        rows.view(np.float16)[:, BIAS_DIM] = FLOAT_C
    elif qtype == T.BF16:
        rows.view(np.uint16)[:, BIAS_DIM] = np.float32(FLOAT_C).view(np.uint32) >> 16
    else:
        from gguf import GGML_QUANT_SIZES

        size = GGML_QUANT_SIZES[qtype][1]
        first = rows[:, :size].copy()  # block 0 of each row (BIAS_DIM == 0 lies in it)
        _set_element0_max(first, qtype)
        rows[:, :size] = first


def bias_dim_value(row: np.ndarray, qtype: T) -> float:
    """The dequantized element BIAS_DIM of one embedding row (uint8 [row_bytes])."""
    return float(np.asarray(dequantize(row, qtype), np.float32).reshape(-1)[BIAS_DIM])


# --- the writer's hooks ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class SkewSpec:
    alpha: float
    seed: int
    n_expert: int
    k: int


def check_skew(alpha: float, n_expert: int, k: int) -> None:
    if not (math.isfinite(alpha) and alpha >= 0):
        raise StrataError(f"router skew must be a finite number >= 0, got {alpha}")
    if alpha > 0 and not n_expert:
        raise StrataError("router skew needs a MoE model (this preset has no experts)")
    if alpha > 0:
        target_frequencies(n_expert, k, alpha)  # raises on an impossible k


def edit_rows(name: str, qtype: T, n_embd: int, r0: int, rows: np.ndarray) -> None:
    """Adjust a freshly generated chunk (rows r0.. of tensor `name`, uint8 [n, row_bytes]) in place: the constant in
    the token embedding, zero rows where a tensor would write into the residual stream's BIAS_DIM."""
    if name == "token_embd.weight":
        set_bias_dim(rows, qtype)
    elif name.endswith(RESIDUAL_WRITERS):
        # row index mod n_embd is the output dimension (experts stack [E, n_embd, F]); all-zero bytes are a zero
        # row in every GGML type (zero scales)
        first = (BIAS_DIM - r0) % n_embd
        rows[first::n_embd] = 0
    elif name.endswith("ffn_gate_inp.weight"):
        rows.view(np.float32)[:, BIAS_DIM] = 0.0  # calibrate_router fills the column in


def _wrap_moe(backend, block) -> None:
    """Run `block` (the MoE FFN's signature: backend, layer weights, layer, input) in place of the CPU engine's MoE
    FFN in every MoE layer."""
    from strata_nb.runtime.cpu_blocks.ffn import moe as ffn_moe

    backend.ffns = [block if f is ffn_moe else f for f in backend.ffns]


def calibrate_router(path: str | os.PathLike, spec: SkewSpec, router_offsets: dict[int, int],
                     n_embd: int, n_pilot: int = PILOT_TOKENS) -> list[float]:
    """Fill router column BIAS_DIM of each MoE layer of the file at `path` (in place) from a pilot forward.

    `router_offsets[layer]` is the absolute file offset of that layer's F32 [n_expert, n_embd] router. Returns
    the measured per-layer ratio mean(a[BIAS_DIM] / std_e(noise)) (the bias gain per unit of column weight)."""
    if n_pilot < 2:
        raise StrataError(f"router skew: the pilot needs at least 2 tokens, got {n_pilot}")
    from strata_nb.api import Engine
    from strata_nb.runtime.cpu_blocks.ffn import moe as ffn_moe

    b = fit_bias(spec.n_expert, spec.k, float(spec.alpha))
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    ratios: list[float] = []
    try:
        routers = {i: mm[o:o + spec.n_expert * n_embd * 4].view(np.float32).reshape(spec.n_expert, n_embd)
                   for i, o in router_offsets.items()}
        # The CPU engine always: the pilot wraps its MoE layer (the hybrid engine routes on the GPU); the file is
        # patched as we go.
        eng = Engine(path, device="cpu", n_ctx=max(64, n_pilot), experts="mmap")

        def moe(bk, lw, layer, a):
            w = routers.get(layer)
            if w is not None:
                x = np.asarray(a.x, np.float64)
                w[:, BIAS_DIM] = 0.0
                noise = x @ w.astype(np.float64).T  # [T, E]: the logits without the bias column
                # The ratio grows with position (attention averages over more tokens, the residual shrinks) and
                # levels off after ~100 tokens: the pilot's second half is closer to that than its first.
                late = slice(x.shape[0] // 2, None)
                ratio = float(np.mean(x[late, BIAS_DIM] / np.maximum(noise[late].std(axis=1), 1e-30)))
                if not ratio > 0:
                    raise StrataError(f"router skew: the constant dimension vanished in layer {layer}")
                col = np.empty(spec.n_expert)
                col[expert_ranks(spec.seed, layer, spec.n_expert)] = b / ratio
                w[:, BIAS_DIM] = col  # the engine's read-only map of the same file sees this before routing
                ratios.append(ratio)
            return ffn_moe(bk, lw, layer, a)

        _wrap_moe(eng.backend, moe)
        rng = np.random.Generator(np.random.PCG64([spec.seed, _SEED_TAG + 1]))  # the pilot's token ids
        eng.logits(rng.integers(0, eng.spec.n_vocab, n_pilot).tolist())
        del eng
        mm.flush()
    finally:
        del mm
    if len(ratios) != len(router_offsets):
        raise StrataError(f"router skew: the pilot routed {len(ratios)} of {len(router_offsets)} MoE layers")
    return ratios


# --- measuring ---------------------------------------------------------------------------------------------

def measure_routing(path: str | os.PathLike, prompt: list[int], n_gen: int, threads: int | None = None) \
        -> tuple[np.ndarray, int]:
    """Routing counts [layer, expert] of our engine over `prompt` then `n_gen` greedy tokens, and the token count.

    Top-k is recomputed in float32 from the router and the MoE input (the engine's own choice up to rounding)."""
    from strata_nb.api import Engine
    from strata_nb.runtime.cpu_blocks.ffn import moe as ffn_moe

    eng = Engine(path, device="cpu", n_ctx=len(prompt) + n_gen + 1, threads=threads)  # wraps the CPU MoE layer
    s = eng.spec
    prompt = eng.check_tokens(prompt)
    routers = {}
    for i in range(s.n_layer):
        name = f"blk.{i}.ffn_gate_inp.weight"
        if eng.gguf.has(name):
            routers[i] = eng.gguf.f32(eng.gguf.tensor(name)).reshape(s.n_expert, s.n_embd)
    counts = np.zeros((s.n_layer, s.n_expert), np.int64)

    def moe(bk, lw, layer, a):
        logits = np.asarray(a.x, np.float32) @ routers[layer].T
        top = np.argsort(-logits, axis=1, kind="stable")[:, :s.n_expert_used]
        counts[layer] += np.bincount(top.ravel(), minlength=s.n_expert)
        return ffn_moe(bk, lw, layer, a)

    _wrap_moe(eng.backend, moe)
    session = eng.new_session()
    logits = eng.backend.forward(session, np.asarray(prompt, np.int64))
    for _ in range(n_gen):
        logits = eng.backend.forward(session, np.asarray([int(np.argmax(logits[-1]))], np.int64))
    return counts[sorted(routers)], len(prompt) + n_gen


def rank_mass(freq: np.ndarray, k: int, shares: tuple[float, ...] = (0.10, 0.25, 0.50)) -> list[float]:
    """Share of the routing mass (sum of freq == k) held by the first ceil(share * E) entries of `freq`."""
    return [float(freq[:max(1, math.ceil(sh * len(freq)))].sum() / k) for sh in shares]
