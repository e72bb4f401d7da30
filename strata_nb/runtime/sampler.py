"""Token sampling on the host with llama.cpp's default chain and semantics.

Chain: repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw. top-p and min-p see the
probabilities at temperature 1 (as in llama.cpp, where temperature comes after the filters); each filter keeps at
least one token. Temperature <= 0 is greedy: the argmax of the penalized logits.

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


@dataclass
class SamplerConfig:
    temperature: float = 0.0
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64  # tokens of history penalized; 0: off, -1: the whole history
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
        if self.seed is not None and (int(self.seed) != self.seed or not 0 <= self.seed < 2**64):
            raise bad(f"seed must be an integer in [0, 2^64), got {self.seed}")


class Sampler:
    """Picks the next token from one row of logits; owns the random generator (seeded once)."""

    def __init__(self, config: SamplerConfig, vocab_size: int):
        config.validate()
        if vocab_size <= 0:
            raise StrataError(f"sampler vocabulary size must be positive, got {vocab_size}")
        self.config = config
        self.vocab_size = int(vocab_size)
        # the seed actually used, so that a run without --seed can be reported and repeated
        self.seed = int(config.seed) if config.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.config.temperature <= 0

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token id; history is the sequence so far (prompt and generated), oldest first."""
        ids, probs = self.distribution(logits, history)
        if ids.shape[0] == 1:
            return int(ids[0])  # greedy, or a single survivor: no draw, as in llama.cpp's dist sampler
        cum = np.cumsum(probs)
        j = int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right"))
        return int(ids[min(j, ids.shape[0] - 1)])

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) that sample() draws from: the kept candidates after the whole chain."""
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
                ids = np.flatnonzero(lg >= thr)
            else:
                ids = ids[lg[ids] >= thr]
        x = (lg if ids is None else lg[ids]).astype(np.float64)
        if ids is None:
            ids = np.arange(n, dtype=np.int64)
        p = np.exp((x - mx) / c.temperature)
        return ids.astype(np.int64, copy=False), p / p.sum()

    def _penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        lg = np.asarray(logits, dtype=np.float32)
        if lg.shape != (self.vocab_size,):
            raise StrataError(f"logits have shape {lg.shape}, the sampler expects ({self.vocab_size},)")
        c = self.config
        if c.repeat_penalty == 1.0 or c.repeat_last_n == 0 or len(history) == 0:
            return lg
        recent = history if c.repeat_last_n < 0 else history[-c.repeat_last_n:]
        toks = np.unique(np.asarray(recent, dtype=np.int64))  # each token once, however often it repeats
        if toks[0] < 0 or toks[-1] >= self.vocab_size:
            raise StrataError(f"token id out of range in history: {int(toks[0] if toks[0] < 0 else toks[-1])}")
        lg = lg.copy()  # never modify the caller's logits
        v = lg[toks]
        lg[toks] = np.where(v <= 0, v * np.float32(c.repeat_penalty), v / np.float32(c.repeat_penalty))
        return lg


def _top_k_sorted(lg: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, largest first (exact; ties at the boundary broken arbitrarily)."""
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
    if cand is None:
        top = np.argpartition(lg, n - k)[n - k:]
    else:
        top = cand[np.argpartition(lg[cand], cand.shape[0] - k)[cand.shape[0] - k:]]
    return top[np.argsort(-lg[top], kind="stable")]


def _top_p(lg: np.ndarray, ids: np.ndarray | None, p: float, mx: float) -> np.ndarray:
    """Smallest prefix of the sorted candidates whose probability mass reaches p (at least one token)."""
    if ids is not None:
        e = np.exp(lg[ids].astype(np.float64) - mx)
        cum = np.cumsum(e)
        return ids[:min(int(np.searchsorted(cum, p * cum[-1], side="left")) + 1, ids.shape[0])]
    # No top-k before: normalize over the whole vocabulary, but sort only a growing head of it.
    n = lg.shape[0]
    z = float(np.exp(lg - np.float32(mx)).sum(dtype=np.float64))
    m = _TOPP_FIRST
    while True:
        head = _top_k_sorted(lg, m) if m < n else np.argsort(-lg, kind="stable")
        cum = np.cumsum(np.exp(lg[head].astype(np.float64) - mx))
        cut = int(np.searchsorted(cum, p * z, side="left"))
        if cut < head.shape[0] or m >= n:
            return head[:min(cut + 1, head.shape[0])]
        m *= 8
