"""A generation session: the per-layer state (here a KV cache per layer) and the position it has reached."""
from __future__ import annotations

import numpy as np

from strata_nb.errors import StrataError
from strata_nb.model.spec import ModelSpec


class Session:
    """Owns all per-sequence state so it can be rewound (speculation and prompt caching need that later)."""

    def __init__(self, spec: ModelSpec, n_ctx: int, host_kv: bool = True):
        """host_kv: keep the KV cache here (the CPU engine); the GPU engine keeps its own in device memory."""
        if n_ctx <= 0:
            raise StrataError(f"context length must be positive, got {n_ctx}")
        self.n_ctx = n_ctx
        shape = (spec.n_head_kv, n_ctx, spec.head_dim)
        n = spec.n_layer if host_kv else 0
        self.k = [np.zeros(shape, np.float32) for _ in range(n)]
        self.v = [np.zeros(shape, np.float32) for _ in range(n)]
        self.pos = 0
        self.tokens: list[int] = []

    @staticmethod
    def kv_bytes(spec: ModelSpec, n_ctx: int) -> int:
        return 2 * spec.n_layer * spec.n_head_kv * n_ctx * spec.head_dim * 4

    def reserve(self, n: int) -> None:
        if self.pos + n > self.n_ctx:
            raise StrataError(f"context full: {self.pos} + {n} tokens exceed --ctx {self.n_ctx}")

    def advance(self, tokens: list[int]) -> None:
        self.pos += len(tokens)
        self.tokens.extend(tokens)

    def rewind(self, pos: int) -> None:
        """Forget everything from position pos on (cache entries past it are simply overwritten later)."""
        if not 0 <= pos <= self.pos:
            raise StrataError(f"cannot rewind to {pos} from {self.pos}")
        self.pos = pos
        del self.tokens[pos:]
