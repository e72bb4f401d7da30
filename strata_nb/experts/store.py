"""Expert stores: where the CPU MoE finds each selected expert, as addresses moe_matmul reads.

A store that holds every expert of a layer in RAM at fixed places hands the MoE layer one table of their
addresses (`table`), and the layer computes all its selected experts in one call. Otherwise the layer asks for the
selected experts and gets them back in *waves*: groups of experts whose bytes are in RAM now, with the addresses of
their gate, up and down matrices. The layer computes each wave as it comes and combines all of them at the end in
one fixed order, so the result does not depend on which tier served which expert.

- MappedStore: every expert read in place from the memory map (GGUF or pack); a table. The simple tier, and the
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
    """Interface of the stores."""

    tiered = False  # tiered stores also keep routing counts of their own (routed)
    lookahead_k = 0  # experts per token to predict for the next layer and prefetch (tiered stores only)

    def __init__(self, src: ExpertSource, profile: RoutingProfile | None):
        self.src = src
        self.profile = profile
        self.io = ExpertIO()
        self.expert_bytes = {l: sum(src.matrix(l, k).nbytes for k in KINDS) for l in src.layers}
        # f64[n_layer, n_expert]: tokens routed to each expert, added by the MoE layer's compiled routing split (no
        # call per layer): the profile's counts of this run where one is kept
        n_expert = src.matrix(src.layers[0], "gate").n_expert if src.layers else 0
        self.counts = (profile.run_counts if profile is not None
                       else np.zeros((max(src.layers, default=-1) + 1, n_expert)))

    def routed(self, layer: int, experts: np.ndarray, n_tokens: np.ndarray) -> None:
        """The router of `layer` sent n_tokens[i] tokens to experts[i]: counts a tiered store keeps besides
        self.counts (called for tiered stores only)."""

    def table(self, layer: int) -> np.ndarray | None:
        """The addresses i64[3, n_expert] of the gate, up and down matrices of every expert of `layer` where they all
        lie in RAM at fixed places (the MoE layer computes all its experts in one call); None: ask waves()."""
        return None

    def served(self, layer: int, n: int) -> None:
        """n experts of `layer` were read from the table (counted in io; waves() counts its own)."""

    def waves(self, layer: int, experts: np.ndarray) -> Iterator[Wave]:
        """The selected experts as they reach RAM (stores without a table)."""
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
        self._tables: dict[int, np.ndarray] = {}
        for l in src.layers:
            tbl = self._tables[l] = np.empty((len(KINDS), src.matrix(l, "gate").n_expert), np.int64)
            for i, k in enumerate(KINDS):
                m = src.matrix(l, k)
                if m.offsets.size and (m.offsets.min() < 0 or m.offsets.max() + m.nbytes > n):
                    raise StrataError(f"{src.path.name}: layer {l} {k} experts lie outside the file")
                tbl[i] = base + m.offsets

    def table(self, layer: int) -> np.ndarray:
        return self._tables[layer]

    def served(self, layer: int, n: int) -> None:
        self.io.served["mapped"] += n * self.expert_bytes[layer]
