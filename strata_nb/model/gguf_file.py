"""Opening a GGUF file in place: validation up front, tensors as memory-mapped views, metadata as plain values."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strata_nb.cpu_kernels import qtypes
from strata_nb.errors import ModelFormatError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorRef:
    """One tensor of the file: its quant type, its numpy-order shape, and where its bytes are."""

    name: str
    qtype: int
    shape: tuple[int, ...]  # numpy order (outermost first); the last dimension is the row length
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return qtypes.row_bytes(self.qtype, self.shape[-1])


class GGUFFile:
    """A GGUF file opened read-only: metadata, tensor table and the whole file as one uint8 memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelFormatError(f"model file not found: {self.path}")
        if not self.path.is_file():
            raise ModelFormatError(f"model path is not a file: {self.path}")
        self.size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelFormatError(f"not a GGUF file (bad magic): {self.path}")
        import gguf  # deferred: importing gguf costs ~0.2 s and the CLI's error paths do not need it

        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises assorted errors on truncated or corrupt headers
            raise ModelFormatError(f"cannot read GGUF header of {self.path}: {e}") from None
        self.data: np.ndarray = self.reader.data  # uint8 memmap of the whole file
        self.tensors: dict[str, TensorRef] = {}
        for t in self.reader.tensors:
            qt = int(t.tensor_type)
            shape = tuple(int(n) for n in reversed([int(x) for x in t.shape]))
            nbytes = int(t.n_bytes)
            end = int(t.data_offset) + nbytes
            if end > self.size:
                raise ModelFormatError(
                    f"truncated GGUF: tensor {t.name} ends at byte {end} but {self.path.name} has {self.size} bytes")
            self.tensors[t.name] = TensorRef(t.name, qt, shape, int(t.data_offset), nbytes)
        self._meta: dict[str, Any] | None = None

    # -- metadata -------------------------------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, Any]:
        if self._meta is None:
            self._meta = {k: _field_value(f) for k, f in self.reader.fields.items()}
        return self._meta

    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else _field_value(f)

    @property
    def arch(self) -> str:
        a = self.get("general.architecture")
        if not isinstance(a, str):
            raise ModelFormatError(f"{self.path.name} has no general.architecture")
        return a

    # -- tensors --------------------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> TensorRef:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.path.name}: missing tensor {name}") from None

    def rows(self, ref: TensorRef) -> np.ndarray:
        """uint8[rows, row_bytes] view of a 2-D tensor (or of all rows of an N-D tensor)."""
        rb = ref.row_bytes
        return self.data[ref.offset:ref.offset + ref.nbytes].reshape(-1, rb)

    def f32(self, ref: TensorRef) -> np.ndarray:
        """A small tensor (norm weight, bias) as float32, dequantized if needed."""
        raw = self.data[ref.offset:ref.offset + ref.nbytes]
        if ref.qtype == qtypes.F32:
            return np.array(raw.view(np.float32).reshape(ref.shape))
        if ref.qtype == qtypes.F16:
            return raw.view(np.float16).astype(np.float32).reshape(ref.shape)
        if ref.qtype == qtypes.BF16:
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(ref.shape)
        import gguf

        return gguf.quants.dequantize(raw, ref.qtype).astype(np.float32).reshape(ref.shape)


def _field_value(f: Any) -> Any:
    import gguf

    vt = f.types[0]
    if vt == gguf.GGUFValueType.ARRAY:
        sub = f.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        return np.array([f.parts[i][0] for i in f.data]) if f.data else np.array([])
    if vt == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
    v = f.parts[f.data[0]][0]
    return v.item() if hasattr(v, "item") else v
