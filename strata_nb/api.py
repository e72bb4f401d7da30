"""The public API: load(model, ...) -> Engine; Engine.logits(), Engine.generate()."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from strata_nb.errors import StrataError
from strata_nb.model.gguf_file import GGUFFile
from strata_nb.model.spec import ModelSpec, check_architecture, spec_from_gguf
from strata_nb.model.weights import ModelWeights, bind_weights, check_quant_types
from strata_nb.runtime.generate import GenerationResult, generate
from strata_nb.runtime.sampler import Sampler, SamplerConfig
from strata_nb.runtime.session import Session


@dataclass(frozen=True)
class MemoryNeeds:
    dense_bytes: int
    expert_bytes: int
    kv_bytes: int

    @property
    def total(self) -> int:
        return self.dense_bytes + self.expert_bytes + self.kv_bytes


def open_model(path: str | os.PathLike) -> tuple[GGUFFile, ModelSpec]:
    """Open and validate a GGUF (architecture, quant types, metadata) without binding any weights."""
    g = GGUFFile(path)
    check_architecture(g)
    check_quant_types(g)
    return g, spec_from_gguf(g)


def memory_needs(g: GGUFFile, spec: ModelSpec, n_ctx: int) -> MemoryNeeds:
    expert = sum(t.nbytes for n, t in g.tensors.items() if "_exps." in n)
    dense = sum(t.nbytes for t in g.tensors.values()) - expert
    return MemoryNeeds(dense, expert, Session.kv_bytes(spec, n_ctx))


def set_threads(threads: int | None) -> int:
    """Use `threads` numba workers (default: all cores numba sees); refuse more than that."""
    import numba

    avail = numba.config.NUMBA_NUM_THREADS
    if threads is None:
        threads = avail
    if not 1 <= threads <= avail:
        raise StrataError(f"--threads must be in 1..{avail} on this machine, got {threads}")
    numba.set_num_threads(threads)
    return threads


class Engine:
    """A loaded model on one backend (the CPU engine here), with its tokenizer."""

    def __init__(self, path: str | os.PathLike, *, pack: str | None = None, n_ctx: int = 4096,
                 threads: int | None = None, fast: bool = True):
        t0 = time.perf_counter()
        from strata_nb.experts.source import open_experts
        from strata_nb.model.tokenizer import Tokenizer
        from strata_nb.runtime.cpu_backend import CPUBackend

        self.path = Path(path)
        self.gguf, self.spec = open_model(path)
        self.n_ctx = int(n_ctx)
        if self.n_ctx <= 0:
            raise StrataError(f"--ctx must be positive, got {n_ctx}")
        self.threads = set_threads(threads)
        self.weights: ModelWeights = bind_weights(self.gguf, self.spec)
        self.experts = open_experts(self.gguf, pack) if self.spec.is_moe else None
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.backend = CPUBackend(self.spec, self.weights, self.experts, fast=fast)
        self.load_s = time.perf_counter() - t0

    # -- inputs -------------------------------------------------------------------------------------------
    def check_tokens(self, tokens: Sequence[int], n_new: int = 0) -> list[int]:
        toks = [int(t) for t in tokens]
        if not toks:
            raise StrataError("empty prompt: nothing to run")
        bad = [t for t in toks if not 0 <= t < self.spec.n_vocab]
        if bad:
            raise StrataError(f"token id {bad[0]} out of range 0..{self.spec.n_vocab - 1}")
        if len(toks) > self.n_ctx:
            raise StrataError(f"prompt of {len(toks)} tokens is longer than the context (--ctx {self.n_ctx})")
        return toks

    def new_session(self) -> Session:
        return Session(self.spec, self.n_ctx)

    # -- running ------------------------------------------------------------------------------------------
    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """float32 [len(tokens), vocab]: the logits at every position of a fresh sequence."""
        toks = self.check_tokens(tokens)
        return self.backend.forward(self.new_session(), np.asarray(toks, np.int64), all_logits=True)

    def generate(self, prompt: Sequence[int], max_new: int = 128, sampler: SamplerConfig | None = None,
                 on_token: Callable[[int], None] | None = None, keep_logits: bool = False) -> GenerationResult:
        toks = self.check_tokens(prompt)
        s = Sampler(sampler or SamplerConfig(), self.spec.n_vocab)
        return generate(self.backend, self.new_session(), toks, max_new, s, set(self.tokenizer.eog_ids),
                        on_token=on_token, keep_logits=keep_logits)


def load(model: str | os.PathLike, **kwargs) -> Engine:
    """Load a GGUF MoE (or dense) model for generation. See Engine for the options."""
    return Engine(model, **kwargs)
