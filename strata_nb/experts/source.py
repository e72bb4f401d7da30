"""Where the routed experts' bytes are: one flat uint8 memory map plus per-expert byte offsets.

The CPU MoE kernel (cpu_kernels.matmul.moe_matmul) reads expert e's matrix as `nrows` rows of `row_bytes` starting
at `offsets[e]` of `buf`. Two sources give it that view: the GGUF itself (experts read in place, no packing
needed) and the expert pack (one 4 KiB-aligned blob per expert, see experts.pack).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata_nb.errors import PackError, StrataError
from strata_nb.experts import pack as packfmt
from strata_nb.model.gguf_file import GGUFFile, map_readonly


@dataclass(frozen=True)
class ExpertMatrix:
    """One kind of matrix (gate, up or down) of every expert of a layer: n_expert matrices of rows x cols."""

    qtype: int
    rows: int
    cols: int
    row_bytes: int
    offsets: np.ndarray  # int64[n_expert]: byte offset in the source's buf of expert e's rows x row_bytes

    @property
    def n_expert(self) -> int:
        return self.offsets.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's matrix."""
        return self.rows * self.row_bytes


class ExpertSource:
    """Experts of a model as (layer, kind) -> ExpertMatrix over one read-only uint8 memory map `buf`."""

    buf: np.ndarray
    path: Path

    def __init__(self, buf: np.ndarray, path: Path, matrices: dict[tuple[int, str], ExpertMatrix]):
        self.buf = buf
        self.path = path
        self._matrices = matrices
        self.layers: tuple[int, ...] = tuple(sorted({l for l, _ in matrices}))  # layers that have routed experts

    def matrix(self, layer: int, kind: str) -> ExpertMatrix:
        try:
            return self._matrices[(layer, kind)]
        except KeyError:
            raise StrataError(f"{self.path.name}: layer {layer} has no routed-expert {kind} matrix") from None

    def kinds(self, layer: int) -> tuple[str, ...]:
        return tuple(k for l, k in self._matrices if l == layer)

    def rows(self, layer: int, kind: str, expert: int) -> np.ndarray:
        """uint8[rows, row_bytes] view of one expert's matrix (tests and single-expert tools)."""
        m = self.matrix(layer, kind)
        o = int(m.offsets[expert])
        return self.buf[o:o + m.nbytes].reshape(m.rows, m.row_bytes)


class GGUFExperts(ExpertSource):
    """The experts read in place from the GGUF: buf is the GGUFFile's map of the whole file."""

    def __init__(self, g: GGUFFile):
        mats = {}
        for key, et in packfmt.expert_tensors(g).items():
            offs = et.offset + np.arange(et.n_expert, dtype=np.int64) * et.matrix_bytes
            mats[key] = ExpertMatrix(et.qtype, et.rows, et.cols, et.row_bytes, offs)
        super().__init__(g.data, g.path, mats)


class PackExperts(ExpertSource):
    """The experts from an expert pack, after checking that the pack belongs to the GGUF g."""

    def __init__(self, pack_path: str | os.PathLike, g: GGUFFile):
        self.index = packfmt.read_pack_index(pack_path)
        packfmt.check_pack(self.index, g)
        mats = {}
        for pl in self.index.layers.values():
            base = pl.offset + np.arange(pl.n_expert, dtype=np.int64) * pl.stride
            for kind, pm in pl.matrices.items():
                mats[(pl.layer, kind)] = ExpertMatrix(pm.qtype, pm.rows, pm.cols, pm.row_bytes, base + pm.offset)
        super().__init__(map_readonly(self.index.path), self.index.path, mats)

    def blob(self, layer: int, expert: int) -> tuple[int, int]:
        """(offset, nbytes) of one expert's whole blob: a single 4 KiB-aligned read or copy."""
        pl = self.index.layers.get(layer)
        if pl is None or not 0 <= expert < pl.n_expert:
            raise StrataError(f"{self.path.name}: no expert {expert} in layer {layer}")
        return pl.offset + expert * pl.stride, pl.stride


def open_experts(g: GGUFFile, pack: str | os.PathLike | None = None) -> ExpertSource:
    """The given pack, else the pack beside the GGUF (default_pack_path), else the GGUF's experts in place.

    A pack that does not match the GGUF raises PackError rather than silently falling back.
    """
    if pack is not None:
        if not Path(pack).is_file():
            raise PackError(f"expert pack not found: {pack}")
        return PackExperts(pack, g)
    beside = packfmt.default_pack_path(g.path)
    if beside.is_file():
        return PackExperts(beside, g)
    return GGUFExperts(g)
