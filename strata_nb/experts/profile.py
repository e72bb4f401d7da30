"""Routing profiles: how often each (layer, expert) was routed, saved between runs so the next one starts warm.

File format (.npz written to a temporary name, then renamed): `counts` float64[n_layer, n_expert] (tokens routed
to each expert), `tokens` (positions counted), `arch`, `n_layer`, `n_expert`, `version`. A profile belongs to a
model shape, not to one file: the same model in another quantization routes the same way.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from strata_nb.errors import StrataError
from strata_nb.model.spec import ModelSpec

VERSION = 1


class RoutingProfile:
    """Cumulative routing counts plus the decayed counts adaptive placement ranks by."""

    def __init__(self, arch: str, n_layer: int, n_expert: int, counts: np.ndarray | None = None, tokens: int = 0):
        self.arch, self.n_layer, self.n_expert = arch, n_layer, n_expert
        self.counts = np.zeros((n_layer, n_expert)) if counts is None else counts.astype(np.float64)
        self.tokens = int(tokens)
        self.run_counts = np.zeros((n_layer, n_expert))  # this run only
        self.run_tokens = 0

    @classmethod
    def for_spec(cls, spec: ModelSpec) -> "RoutingProfile":
        return cls(spec.arch, spec.n_layer, spec.n_expert)

    def add(self, layer: int, experts: np.ndarray, n_tokens: np.ndarray) -> None:
        self.run_counts[layer, experts] += n_tokens

    def add_tokens(self, n: int) -> None:
        self.run_tokens += n

    def total(self) -> np.ndarray:
        """Loaded plus this run's counts: what is saved, and what ranks experts for a fill."""
        return self.counts + self.run_counts

    def ranked(self) -> np.ndarray:
        """(layer, expert) pairs, most routed first (ties: lower layer, then lower expert, for determinism)."""
        flat = -self.total().reshape(-1)
        order = np.argsort(flat, kind="stable")
        return np.stack([order // self.n_expert, order % self.n_expert], axis=1)

    def save(self, path: str | os.PathLike) -> None:
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, counts=self.total(), tokens=np.int64(self.tokens + self.run_tokens), arch=np.str_(self.arch),
                     n_layer=np.int64(self.n_layer), n_expert=np.int64(self.n_expert), version=np.int64(VERSION))
        os.replace(tmp, p)

    @classmethod
    def load(cls, path: str | os.PathLike, spec: ModelSpec) -> "RoutingProfile":
        p = Path(path)
        if not p.is_file():
            raise StrataError(f"expert profile not found: {p}")
        try:
            with np.load(p, allow_pickle=False) as z:
                version, arch = int(z["version"]), str(z["arch"])
                n_layer, n_expert = int(z["n_layer"]), int(z["n_expert"])
                counts, tokens = z["counts"], int(z["tokens"])
        except (OSError, ValueError, KeyError) as e:
            raise StrataError(f"{p.name}: not a strata-nb routing profile ({e})") from None
        if version != VERSION:
            raise StrataError(f"{p.name}: routing profile version {version}, this strata-nb reads {VERSION}")
        if (arch, n_layer, n_expert) != (spec.arch, spec.n_layer, spec.n_expert) or counts.shape != (n_layer, n_expert):
            raise StrataError(f"{p.name}: profile is for {arch} with {n_layer} layers x {n_expert} experts, the model "
                              f"is {spec.arch} with {spec.n_layer} x {spec.n_expert}")
        if not np.all(np.isfinite(counts)) or np.any(counts < 0):
            raise StrataError(f"{p.name}: routing profile has negative or non-finite counts")
        return cls(arch, n_layer, n_expert, counts, tokens)
