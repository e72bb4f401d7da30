"""Expert stores: where the CPU MoE finds each selected expert, as addresses moe_matmul reads.

The MoE layer asks its store for the selected experts of a layer and gets them back in *waves*: groups of experts
whose bytes are in RAM now, with the addresses of their gate, up and down matrices. The layer computes each wave
as it comes and combines all of them at the end in one fixed order, so the result does not depend on which tier
served which expert.

- MappedStore: every expert read in place from the memory map (GGUF or pack); one wave. The simple tier, and the
  A/B arm of the tiered store.
- TieredStore (experts.tiered): a resident arena, recently read blobs and SSD reads with lookahead.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import numpy as np

from strata_nb.errors import StrataError
from strata_nb.experts.profile import RoutingProfile
from strata_nb.experts.source import ExpertSource

KINDS = ("gate", "up", "down")


class Wave(NamedTuple):
    groups: np.ndarray  # i64: indices into the experts passed to waves()
    gate: np.ndarray  # i64 addresses of each group's matrices
    up: np.ndarray
    down: np.ndarray


@dataclass
class ExpertIO:
    """Where the experts a forward used came from, and what reading them cost. Accumulates over forwards."""

    served: dict[str, int] = field(default_factory=lambda: {"mapped": 0, "arena": 0, "recent": 0, "ssd": 0})
    ssd_read_bytes: int = 0  # everything read from the file, lookahead that went unused included
    read_wait_s: float = 0.0  # the token thread waiting for reads
    ssd_busy_s: float = 0.0  # wall time with at least one read in flight
    lookahead_used: int = 0  # file-tier experts a layer found already read or in flight thanks to lookahead
    demand_reads: int = 0  # file-tier experts a layer had to ask for itself
    lookahead_wasted_bytes: int = 0  # read ahead, evicted unused
    swaps: int = 0  # adaptive promotions into the arena

    @property
    def recall(self) -> float:
        n = self.lookahead_used + self.demand_reads
        return self.lookahead_used / n if n else float("nan")

    def copy(self) -> "ExpertIO":
        return dataclasses.replace(self, served=dict(self.served))

    def __sub__(self, o: "ExpertIO") -> "ExpertIO":
        """What happened between snapshot o and self."""
        diff = {f.name: getattr(self, f.name) - getattr(o, f.name) for f in dataclasses.fields(self)
                if f.name != "served"}
        return ExpertIO({k: v - o.served[k] for k, v in self.served.items()}, **diff)


class ExpertStore:
    """Interface of the stores; also records routing into the profile when one is kept."""

    tiered = False
    lookahead_k = 0  # experts per token to predict for the next layer and prefetch (tiered stores only)

    def __init__(self, src: ExpertSource, profile: RoutingProfile | None):
        self.src = src
        self.profile = profile
        self.io = ExpertIO()
        self.expert_bytes = {l: sum(src.matrix(l, k).nbytes for k in KINDS) for l in src.layers}

    def routed(self, layer: int, experts: np.ndarray, n_tokens: np.ndarray) -> None:
        """The router of `layer` sent n_tokens[i] tokens to experts[i]."""
        if self.profile is not None:
            self.profile.add(layer, experts, n_tokens)

    def waves(self, layer: int, experts: np.ndarray) -> Iterator[Wave]:
        raise NotImplementedError

    def prefetch(self, layer: int, experts: np.ndarray) -> None:
        """A hint: these experts of `layer` will probably be needed soon."""

    def end_forward(self, n_tokens: int) -> None:
        if self.profile is not None:
            self.profile.add_tokens(n_tokens)

    def close(self) -> None:
        pass


class MappedStore(ExpertStore):
    """Every expert in place in the source's memory map: the page cache decides what is in RAM."""

    def __init__(self, src: ExpertSource, profile: RoutingProfile | None = None):
        super().__init__(src, profile)
        base = src.buf.ctypes.data
        n = src.buf.shape[0]
        self._addr: dict[tuple[int, str], np.ndarray] = {}
        for l in src.layers:
            for k in KINDS:
                m = src.matrix(l, k)
                if m.offsets.size and (m.offsets.min() < 0 or m.offsets.max() + m.nbytes > n):
                    raise StrataError(f"{src.path.name}: layer {l} {k} experts lie outside the file")
                self._addr[(l, k)] = base + m.offsets

    def waves(self, layer: int, experts: np.ndarray) -> Iterator[Wave]:
        self.io.served["mapped"] += len(experts) * self.expert_bytes[layer]
        a = self._addr
        yield Wave(np.arange(len(experts)), a[(layer, "gate")][experts], a[(layer, "up")][experts],
                   a[(layer, "down")][experts])
