"""The device sampler: owns the device state of cuda_kernels/sample.py and launches it (capturable in a graph).

Same chain, order and random draw as the host Sampler (strata_nb/runtime/sampler.py): for the same logits, seed and
step both pick the same token. The repetition window is kept on the device as a ring of the last tokens and a count
per vocabulary entry (the kernel penalizes a token whose count is > 0, and updates both after each sample), so the
decode path uploads nothing.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
from numba import cuda

from strata_nb.cuda_kernels import sample as ks
from strata_nb.errors import StrataError
from strata_nb.runtime.sampler import SamplerConfig


class GPUSampler:
    """Samples one token per launch from a device logits row f32[vocab]."""

    def __init__(self, config: SamplerConfig, vocab: int, history_cap: int, cand_cap: int = 1024):
        """history_cap: ring size (> repeat_last_n when that is > 0); cand_cap: candidates of the sorted fast path
        (a power of two, 2..1024); more candidates take the exact radix path."""
        config.validate()
        if vocab <= 0 or vocab >= ks.I31:
            raise StrataError(f"sampler vocabulary size must be in [1, 2^31 - 1), got {vocab}")
        last_n = int(config.repeat_last_n)
        if history_cap < 1 or (last_n > 0 and history_cap <= last_n):
            raise StrataError(f"GPU sampler history_cap {history_cap} must exceed repeat_last_n {last_n} (and be >= 1)")
        if cand_cap < 2 or cand_cap > ks.MAX_THREADS or cand_cap & (cand_cap - 1):
            raise StrataError(f"GPU sampler cand_cap must be a power of two in [2, {ks.MAX_THREADS}], got {cand_cap}")
        self.vocab = int(vocab)
        self.history_cap = int(history_cap)
        self.cand_cap = int(cand_cap)
        self.cfg = cuda.to_device(np.zeros(ks.CFG_SIZE, np.float64))
        self.state = cuda.to_device(np.zeros(ks.ST_SIZE, np.int64))
        self.configure(config)
        self.ring = cuda.to_device(np.zeros(self.history_cap, np.int32))
        self.counts = cuda.to_device(np.zeros(self.vocab, np.int32))
        self.token = cuda.to_device(np.zeros(1, np.int32))  # read by the next token's embedding
        self.token_host = cuda.mapped_array(1, np.int32)  # read by the host after the stream synchronizes
        self.token_host[0] = 0
        # the pre-passes' results (cuda_kernels/sample.py: per-block max and NaN flag, the histogram, per-block z)
        self.part_best = cuda.to_device(np.zeros(ks.PRE_BLOCKS, np.int64))
        self.part_bad = cuda.to_device(np.zeros(ks.PRE_BLOCKS, np.int64))
        self.hist = cuda.to_device(np.zeros(ks.NB, np.int32))
        self.part_z = cuda.to_device(np.zeros(ks.PRE_BLOCKS, np.float64))
        self._kernel = None

    def fits(self, config: SamplerConfig) -> bool:
        """Whether configure() can take config: its repetition window fits the ring."""
        last_n = int(config.repeat_last_n)
        return last_n <= 0 or self.history_cap > last_n

    def configure(self, config: SamplerConfig, stream=0) -> None:
        """Another chain and seed in the same device arrays (graphs that captured launches of this sampler stay
        valid): writes the config, the seed and step 0; the history is set_history's. config must fit()."""
        config.validate()
        if not self.fits(config):
            raise StrataError(f"GPU sampler history_cap {self.history_cap} must exceed repeat_last_n "
                              f"{config.repeat_last_n}")
        self.config = config
        # the seed actually used (as the host Sampler: reported so a run can be repeated)
        self.seed = int(config.seed) if config.seed is not None else int.from_bytes(os.urandom(8), "little")
        cfg = np.zeros(ks.CFG_SIZE, np.float64)
        cfg[ks.CFG_TEMP] = config.temperature
        cfg[ks.CFG_TOPK] = config.top_k
        cfg[ks.CFG_TOPP] = config.top_p
        cfg[ks.CFG_MINP] = config.min_p
        # the host's threshold is float32(max + log(min_p)); log on the host keeps it bit-identical
        cfg[ks.CFG_LOGMINP] = math.log(config.min_p) if 0.0 < config.min_p < 1.0 else 0.0
        cfg[ks.CFG_PEN] = np.float32(config.repeat_penalty)
        cfg[ks.CFG_LASTN] = int(config.repeat_last_n)
        st = np.zeros(ks.ST_SIZE, np.int64)
        st[ks.ST_SEED_LO] = self.seed & 0xFFFFFFFF
        st[ks.ST_SEED_HI] = self.seed >> 32
        self.cfg.copy_to_device(cfg, stream=stream)
        self.state.copy_to_device(st, stream=stream)

    def set_history(self, tokens: Sequence[int], stream=0) -> None:
        """The sequence so far (prompt and any generated tokens), oldest first: fills the ring and the penalty
        counts. A host upload, at prompt time (not on the decode path)."""
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if toks.size and (toks.min() < 0 or toks.max() >= self.vocab):
            bad = int(toks.min() if toks.min() < 0 else toks.max())
            raise StrataError(f"token id out of range in history: {bad}")
        n = toks.shape[0]
        ring = np.zeros(self.history_cap, np.int32)
        keep = toks[max(0, n - self.history_cap):]
        ring[np.arange(n - keep.shape[0], n) % self.history_cap] = keep
        last_n = int(self.config.repeat_last_n)
        window = toks if last_n < 0 else toks[-last_n:] if last_n > 0 else toks[:0]
        counts = np.bincount(window, minlength=self.vocab).astype(np.int32)
        st = self.state.copy_to_host()
        st[ks.ST_HLEN] = n
        self.ring.copy_to_device(ring, stream=stream)
        self.counts.copy_to_device(counts, stream=stream)
        self.state.copy_to_device(st, stream=stream)

    def launch(self, logits_row, stream) -> None:
        """Enqueue the sampling of logits_row (device f32[vocab]) as three launches (two pre-passes over the grid,
        then the one-block chain): writes self.token and self.token_host, advances the step and the history on the
        device. No allocation, copy or synchronization: capturable."""
        if logits_row.shape != (self.vocab,):
            raise StrataError(f"logits row has shape {logits_row.shape}, the sampler expects ({self.vocab},)")
        nt = ks.threads()
        if self._kernel is None:
            self._kernel = ks.kernel(self.cand_cap, nt)
        pre = (logits_row, self.counts, self.cfg, self.part_best, self.part_bad, self.hist)
        ks.pre_max_k[ks.PRE_BLOCKS, ks.PRE_THREADS, stream](*pre)
        ks.pre_hist_k[ks.PRE_BLOCKS, ks.PRE_THREADS, stream](*pre, self.part_z)
        self._kernel[1, nt, stream](logits_row, self.counts, self.cfg, self.state, self.ring, self.token,
                                    self.token_host, self.part_best, self.part_bad, self.hist, self.part_z)

    def result(self) -> int:
        """The last sampled token (after the launch's stream has synchronized)."""
        return checked_token(int(self.token_host[0]))

    @property
    def step(self) -> int:
        """Samples taken so far (reads the device: not for the decode path)."""
        return int(self.state.copy_to_host()[ks.ST_STEP])


def checked_token(t: int) -> int:
    """A token id the device sampler wrote; its -1 (NaN or +inf logits, or all -inf) is an error."""
    if t < 0:
        raise StrataError("logits contain NaN or +inf, or all are -inf")
    return t
