"""Token sampling on the host with llama.cpp's default chain and semantics.

Chain: penalties -> top-k -> top-p -> min-p -> temperature -> draw. top-p and min-p see the probabilities at
temperature 1 (as in llama.cpp, where temperature comes after the filters); each filter keeps at least one token.
The penalties see the last repeat_last_n tokens of the sequence (prompt and generated), as llama.cpp's penalties
sampler: a token's logit is divided (or, when negative, multiplied) by repeat_penalty once, then lowered by
frequency_penalty per occurrence and presence_penalty once (OpenAI's definitions). Temperature <= 0 is greedy: the
argmax of the penalized logits (the lowest id among equal ones).

The candidates are ordered by logit descending, equal logits by id ascending, and the draw inverts the cumulative
distribution over that order with the uniform `uniform(seed, step)`: a counter-based generator (splitmix64), so the
device sampler (cuda_kernels/sample.py), which implements the same generator and order, picks the same token for the
same logits, seed and step. The step counts sample() calls (draw or not), so token n always uses uniform(seed, n).

Cost for a 150k vocabulary is a few passes over the logits: top-k finds a threshold from a strided sample and
then compares once, instead of argpartitioning the whole vector; nothing sorts more than the kept candidates.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from strata_nb.errors import StrataError

_SAMPLE_STEP = 16  # top-k threshold sample: every 16th logit
_TOPP_FIRST = 256  # top-p without top-k: candidates tried first (grown x8 until the mass reaches top_p)

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def uniform(seed: int, step: int) -> float:
    """The draw of sample number `step` (0-based) for `seed`: output `step` of the splitmix64 stream started at
    seed, its top 53 bits as a float64 in [0, 1). Counter-based: any step is computed directly."""
    z = (seed + (step + 1) * _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


@dataclass
class SamplerConfig:
    temperature: float = 0.0
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64  # tokens of history penalized; 0: off, -1: the whole history
    frequency_penalty: float = 0.0  # subtracted per occurrence in the window; 0.0: off
    presence_penalty: float = 0.0  # subtracted once for a token in the window; 0.0: off
    seed: int | None = None  # None: a fresh seed from os.urandom

    def validate(self) -> None:
        def bad(what: str) -> StrataError:
            return StrataError(f"invalid sampler option: {what}")

        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not math.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            raise bad(f"repeat_penalty must be > 0 (1 = off), got {self.repeat_penalty}")
        if int(self.repeat_last_n) != self.repeat_last_n or self.repeat_last_n < -1:
            raise bad(f"repeat_last_n must be an integer >= -1 (0 = off, -1 = all), got {self.repeat_last_n}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise bad(f"{name} must be in [-2, 2] (0 = off), got {v}")
        if self.seed is not None and (int(self.seed) != self.seed or not 0 <= self.seed < 2**64):
            raise bad(f"seed must be an integer in [0, 2^64), got {self.seed}")

    @property
    def host_only(self) -> bool:
        """Whether only the host sampler implements this chain (the device sampler has no frequency or presence
        penalty): generate() then samples the logits on the host."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class Sampler:
    """Picks the next token from one row of logits; owns the seed and the step counter of the draws."""

    def __init__(self, config: SamplerConfig, vocab_size: int):
        config.validate()
        if vocab_size <= 0:
            raise StrataError(f"sampler vocabulary size must be positive, got {vocab_size}")
        self.config = config
        self.vocab_size = int(vocab_size)
        # the seed actually used, so that a run without --seed can be reported and repeated
        self.seed = int(config.seed) if config.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.step = 0  # sample() calls so far: the counter of uniform(seed, step)

    @property
    def greedy(self) -> bool:
        return self.config.temperature <= 0

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token id; history is the sequence so far (prompt and generated), oldest first.

        Every call advances the step by one, also when nothing is drawn (greedy, or a single survivor)."""
        ids, probs = self.distribution(logits, history)
        step = self.step
        self.step += 1
        if ids.shape[0] == 1:
            return int(ids[0])  # greedy, or a single survivor: no draw, as in llama.cpp's dist sampler
        cum = np.cumsum(probs)
        j = int(np.searchsorted(cum, uniform(self.seed, step) * cum[-1], side="right"))
        return int(ids[min(j, ids.shape[0] - 1)])

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) that sample() draws from: the kept candidates after the whole chain, ordered
        by penalized logit descending and equal logits by id ascending (the order the draw inverts)."""
        c = self.config
        lg = self._penalized(logits, history)
        mx = float(lg.max())  # NaN-propagating: one pass that also rejects broken logits
        if not math.isfinite(mx):
            raise StrataError("logits contain NaN or +inf" if mx != -math.inf else "all logits are -inf")
        if self.greedy:
            return np.array([int(np.argmax(lg))], np.int64), np.ones(1)
        n = lg.shape[0]
        ids = None  # None: every token is still a candidate (filters off so far)
        if 0 < c.top_k < n:
            ids = _top_k_sorted(lg, c.top_k)
        if c.top_p < 1.0:
            ids = _top_p(lg, ids, c.top_p, mx)
        if c.min_p > 0.0:
            thr = np.float32(mx + math.log(c.min_p)) if c.min_p < 1.0 else np.float32(mx)
            if ids is None:
                ids = _sort_desc(lg, np.flatnonzero(lg >= thr))
            else:
                ids = ids[lg[ids] >= thr]
        if ids is None:  # no filter at all: the whole vocabulary, in the draw's order
            ids = np.argsort(-lg, kind="stable")
        x = lg[ids].astype(np.float64)
        p = np.exp((x - mx) / c.temperature)
        return ids.astype(np.int64, copy=False), p / p.sum()

    def _penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        lg = np.asarray(logits, dtype=np.float32)
        if lg.shape != (self.vocab_size,):
            raise StrataError(f"logits have shape {lg.shape}, the sampler expects ({self.vocab_size},)")
        c = self.config
        if (c.repeat_penalty == 1.0 and not c.host_only) or c.repeat_last_n == 0 or len(history) == 0:
            return lg
        recent = history if c.repeat_last_n < 0 else history[-c.repeat_last_n:]
        toks, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
        if toks[0] < 0 or toks[-1] >= self.vocab_size:
            raise StrataError(f"token id out of range in history: {int(toks[0] if toks[0] < 0 else toks[-1])}")
        lg = lg.copy()  # never modify the caller's logits
        v = lg[toks]
        if c.repeat_penalty != 1.0:  # each token once, however often it repeats
            v = np.where(v <= 0, v * np.float32(c.repeat_penalty), v / np.float32(c.repeat_penalty))
        if c.host_only:
            v = v - (counts * np.float32(c.frequency_penalty) + np.float32(c.presence_penalty)).astype(np.float32)
        lg[toks] = v
        return lg

def _sort_desc(lg: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids (ascending) ordered by logit descending, equal logits by id ascending (a stable sort keeps id order)."""
    return ids[np.argsort(-lg[ids], kind="stable")]


def _top_k_sorted(lg: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, largest first, equal logits by id ascending (exact, ties included)."""
    n = lg.shape[0]
    cand = None
    if n >= 64 * _SAMPLE_STEP and k * 8 < n // _SAMPLE_STEP:
        # Any threshold with >= k logits at or above it contains the top k: take one from a 1/16 sample with
        # ~2x the needed margin, so the exact selection below runs on a few hundred candidates, not n.
        sample = lg[::_SAMPLE_STEP]
        m = 2 * (k // _SAMPLE_STEP) + 8
        thr = np.partition(sample, sample.shape[0] - m)[sample.shape[0] - m]
        cand = np.flatnonzero(lg >= thr)
        if cand.shape[0] < k:  # an unlucky sample: fall back to the full selection
            cand = None
    if cand is None:  # every logit >= the k-th largest: the top k and all its ties
        cand = np.flatnonzero(lg >= np.partition(lg, n - k)[n - k])
    return _sort_desc(lg, cand)[:k]


def _top_p(lg: np.ndarray, ids: np.ndarray | None, p: float, mx: float) -> np.ndarray:
    """Smallest prefix of the sorted candidates whose probability mass reaches p (at least one token)."""
    if ids is not None:
        e = np.exp(lg[ids].astype(np.float64) - mx)
        cum = np.cumsum(e)
        return ids[:min(int(np.searchsorted(cum, p * cum[-1], side="left")) + 1, ids.shape[0])]
    # No top-k before: normalize over the whole vocabulary, but sort only a growing head of it.
    n = lg.shape[0]
    z = float(np.exp(lg.astype(np.float64) - mx).sum())
    m = _TOPP_FIRST
    while True:
        head = _top_k_sorted(lg, m) if m < n else np.argsort(-lg, kind="stable")
        cum = np.cumsum(np.exp(lg[head].astype(np.float64) - mx))
        cut = int(np.searchsorted(cum, p * z, side="left"))
        if cut < head.shape[0] or m >= n:
            return head[:min(cut + 1, head.shape[0])]
        m *= 8
