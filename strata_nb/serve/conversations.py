"""Conversations kept and resumed: one engine session serves many conversations one at a time. Every run restores
the kept state whose tokens are the longest usable prefix of its prompt, computes only the rest, and keeps the state
it ends in (the prompt and the answer) as a snapshot in host RAM, least recently used dropped beyond a budget.

A KV cache can be cut at any position, so with attention-only models any kept state sharing a prefix with the prompt
serves (restored, then truncated to the common part). A recurrent state folds in every token: it resumes only from a
snapshot taken exactly at a prefix of the prompt, so for those models a run also keeps a snapshot at its turn
boundary (where the last message starts: a shared system prompt or document ends there).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from strata_nb.runtime.generate import GenerationResult
from strata_nb.runtime.sampler import SamplerConfig
from strata_nb.runtime.session import Session, Snapshot


def common_prefix(a: Sequence[int] | np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens a and b share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != b[:n])
    return int(diff[0]) if diff.size else n


class ConversationCache:
    """Snapshots by their tokens, least recently used first, their bytes within budget_bytes."""

    def __init__(self, budget_bytes: int, recurrent: bool):
        self.budget_bytes = int(budget_bytes)
        self.recurrent = recurrent
        self._snaps: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._snaps)

    def usable(self, tokens: Sequence[int], prompt: np.ndarray) -> int:
        """How many prompt tokens a state holding `tokens` can resume with (one prompt token is always left to
        run: its logits give the first answer token)."""
        limit = len(prompt) - 1
        if self.recurrent:
            ok = len(tokens) <= limit and common_prefix(tokens, prompt) == len(tokens)
            return len(tokens) if ok else 0
        return min(common_prefix(tokens, prompt), limit)

    def best(self, prompt: np.ndarray) -> tuple[Snapshot | None, int]:
        """The kept snapshot that serves the most of prompt, and how much (0: none does)."""
        best, n = None, 0
        for snap in reversed(self._snaps.values()):  # newest first: it wins a tie
            u = self.usable(snap.tokens, prompt)
            if u > n:
                best, n = snap, u
        if best is not None:
            self._snaps.move_to_end(best.tokens)
        return best, n

    def put(self, snap: Snapshot) -> None:
        """Keep snap (unless it alone exceeds the budget); with KV caches only, states it extends are dropped."""
        old = self._snaps.pop(snap.tokens, None)
        if old is not None:
            self.nbytes -= old.nbytes
        if snap.nbytes > self.budget_bytes or snap.pos == 0:
            return
        if not self.recurrent:  # a longer state serves every prefix a shorter one of the same tokens serves
            for key in [k for k in self._snaps if len(k) < len(snap.tokens) and snap.tokens[:len(k)] == k]:
                self.nbytes -= self._snaps.pop(key).nbytes
        self._snaps[snap.tokens] = snap
        self.nbytes += snap.nbytes
        while self.nbytes > self.budget_bytes:
            self.nbytes -= self._snaps.popitem(last=False)[1].nbytes


@dataclass
class Turn:
    result: GenerationResult
    prompt_tokens: int  # the whole prompt
    cached_tokens: int  # of those, resumed from a kept state instead of computed


class Runner:
    """The engine's one session, shared by every conversation in turn (only one thread may call run())."""

    def __init__(self, engine, park_budget_bytes: int):
        self.engine = engine
        self.session: Session = engine.new_session()
        self.cache = ConversationCache(park_budget_bytes, engine.spec.recurrent)
        self.hits = 0  # runs that resumed a kept state
        self.misses = 0

    def resume(self, prompt: Sequence[int]) -> int:
        """Bring the session to the longest usable prefix of prompt (the live state, or a kept one restored) and
        return its length; the session is empty when nothing serves."""
        p = np.asarray(prompt, np.int64)
        s = self.session
        live = self.cache.usable(s.tokens, p)
        snap, kept = self.cache.best(p)
        if snap is not None and kept > live:
            s.restore(snap)
            live = kept
        s.truncate(live)  # a KV tail dropped (a recurrent state is only ever resumed at its own position)
        if live:
            self.hits += 1
        else:
            self.misses += 1
        return live

    def run(self, prompt: Sequence[int], max_new: int, sampler: SamplerConfig,
            on_token: Callable[[int], bool | None] | None = None, boundary: int | None = None) -> Turn:
        """Generate an answer to prompt, computing only what no kept state holds. boundary: where the prompt's
        last message starts (a snapshot point for recurrent models)."""
        cached = self.resume(prompt)
        s = self.session
        keep = self.cache.budget_bytes > 0  # (a single conversation's live session needs no copies)
        if keep and self.cache.recurrent and boundary is not None and cached < boundary < len(prompt):
            self.engine.forward(s, prompt[cached:boundary])
            self.cache.put(s.snapshot())
        res = self.engine.generate(prompt[s.pos:], max_new, sampler, on_token=on_token, session=s)
        if keep:
            self.cache.put(s.snapshot())
        return Turn(res, len(prompt), cached)

    def reset(self) -> None:
        self.session.truncate(0)
