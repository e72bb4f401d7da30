"""The generation loop: prompt as one batch, then token by token; streaming, stop ids, honest stats."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from strata_nb.experts.store import ExpertIO
from strata_nb.runtime.sampler import Sampler
from strata_nb.runtime.session import Session


class Backend(Protocol):
    def warm_up(self) -> None:
        """Compile every kernel a forward calls, changing no state (Engine.generate runs it before the clocks)."""
        ...

    def forward(self, session: Session, tokens: np.ndarray, all_logits: bool = False) -> np.ndarray: ...

    def sample_next(self, session: Session, tokens: Sequence[int], sampler: Sampler,
                    history: Sequence[int], ahead: bool = False) -> int:
        """Run tokens and draw the next token (on the host, or on the device where only the id comes back).
        ahead: the caller will probably ask for the token after this one (a hint a backend may act on)."""
        ...


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (a stop id that ended generation included)
    stopped_by: str  # "eog", "length", "context" or "caller" (on_token asked to stop)
    prompt_tokens: int
    prompt_s: float  # wall time of the prompt batch (including sampling the first token)
    decode_s: float  # wall time of the decode steps
    decode_steps: int  # forwards of one token each inside decode_s
    expert_s: float = 0.0  # time in expert FFNs during decode
    expert_bytes: int = 0  # routed-expert weight bytes read during decode
    dense_bytes: int = 0  # dense weight bytes read during decode
    logits: list[np.ndarray] = field(default_factory=list)  # when dumping: one [rows, vocab] block per forward
    prompt_io: ExpertIO | None = None  # where the experts came from during the prompt and the decode steps
    decode_io: ExpertIO | None = None
    hybrid: object | None = None  # the hybrid engine's decode breakdown (runtime.gpu_backend.HybridStats)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else float("nan")

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def bytes_per_token(self) -> float:
        return (self.expert_bytes + self.dense_bytes) / self.decode_steps if self.decode_steps else float("nan")


def generate(backend: Backend, session: Session, prompt: Sequence[int], max_new: int, sampler: Sampler,
             stop_ids: set[int], on_token: Callable[[int], bool | None] | None = None,
             keep_logits: bool = False) -> GenerationResult:
    """Run the prompt as one batch at the session's position (the tokens it holds already are the context, so a
    resumed conversation passes only its new tokens), then decode up to max_new tokens or until a stop id is
    sampled, the context is full or on_token returns True (the caller's stop: a stop string, a cancelled request).

    With keep_logits the last generated token is also run, so the kept logits cover every position. The host samples
    when the logits are kept or the chain is one only the host sampler has (SamplerConfig.host_only).
    """
    stats = getattr(backend, "stats", None)
    store = getattr(backend, "experts", None)
    io0 = store.io.copy() if store is not None else None
    t0 = time.perf_counter()
    history = list(session.tokens) + list(prompt)
    host = keep_logits or sampler.config.host_only
    kept = []
    tok = -1

    def host_step(tokens: Sequence[int], all_logits: bool) -> np.ndarray:
        logits = backend.forward(session, np.asarray(tokens, np.int64), all_logits=all_logits)
        if keep_logits:
            kept.append(logits)
        return logits

    if host:
        logits = host_step(prompt, keep_logits)
        if max_new > 0:
            tok = sampler.sample(logits[-1], history)
    elif max_new > 0:
        tok = backend.sample_next(session, prompt, sampler, history)
    else:
        backend.forward(session, np.asarray(prompt, np.int64))
    out: list[int] = []
    stopped = "length"
    prompt_s = time.perf_counter() - t0
    e0 = (stats.expert_s, stats.expert_bytes, stats.dense_bytes) if stats else (0.0, 0, 0)
    hyb = getattr(backend, "hybrid", None)
    h0 = hyb.copy() if hyb is not None else None
    io1 = store.io.copy() if store is not None else None
    t1 = time.perf_counter()
    steps = 0
    while max_new > 0:
        out.append(tok)
        history.append(tok)
        if on_token is not None and on_token(tok):
            stopped = "caller"
            break
        if tok in stop_ids:
            stopped = "eog"
            break
        if len(out) >= max_new and not keep_logits:
            break
        if session.pos >= session.n_ctx:
            stopped = "context"
            break
        steps += 1
        if host:
            logits = host_step([tok], False)
            if len(out) >= max_new:
                break
            tok = sampler.sample(logits[-1], history)
        else:
            tok = backend.sample_next(session, [tok], sampler, history, ahead=len(out) + 1 < max_new)
    decode_s = time.perf_counter() - t1
    res = GenerationResult(tokens=out, stopped_by=stopped, prompt_tokens=len(prompt), prompt_s=prompt_s,
                           decode_s=decode_s, decode_steps=steps, logits=kept)
    if stats:
        res.expert_s = stats.expert_s - e0[0]
        res.expert_bytes = stats.expert_bytes - e0[1]
        res.dense_bytes = stats.dense_bytes - e0[2]
    if store is not None:
        res.prompt_io, res.decode_io = io1 - io0, store.io.copy() - io1
    if hyb is not None:
        res.hybrid = hyb.copy() - h0
    return res
