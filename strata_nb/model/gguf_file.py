"""Opening a GGUF file in place: header parsed once, tensors as views into one read-only memory map.

The header parser is our own (the format is small: magic, version, key/value metadata, tensor infos, aligned
data). gguf.GGUFReader builds a numpy view per array element, which costs ~10 s for a 151k-token vocabulary;
this reads the same header in well under a second. gguf-py stays the reference in the tests and the writer
for synthetic files.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strata_nb.cpu_kernels import qtypes
from strata_nb.errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}
_ARRAY_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8",
                11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
# Block geometry of every GGML type, so a file holding a type we cannot run still parses and is refused by name.
_ALL_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
              19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
              23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
              28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
              35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17)}


def type_name(qtype: int) -> str:
    return _ALL_TYPES[qtype][0] if qtype in _ALL_TYPES else f"type {qtype}"


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


def map_readonly(path: str | os.PathLike) -> np.ndarray:
    """The whole file as a read-only uint8 array backed by a memory map.

    A plain ndarray view, not the np.memmap subclass: numba types an exact ndarray on its C fast path, while a
    subclass goes through Python-level typing that costs milliseconds per kernel call.
    MADV_HUGEPAGE: pages that fault in from the disk are read ahead as 2 MiB folios and mapped as such where the
    kernel and file system can (Linux 6.x ext4/xfs). Weight streaming read 22-25 GB/s from such a mapping and
    14-15 GB/s from 4 KiB pages on the 2-core development VM, for every engine reading the file; pages already
    cached as small folios stay small.
    """
    m = np.memmap(path, dtype=np.uint8, mode="r")
    if hasattr(mmap, "MADV_HUGEPAGE") and m.size:
        try:
            m._mmap.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # a hint only
            pass
    return m.view(np.ndarray)


class _Cursor:
    __slots__ = ("buf", "off")

    def __init__(self, buf: memoryview | bytes, off: int):
        self.buf = buf
        self.off = off

    def unpack(self, fmt: str) -> tuple:
        v = struct.unpack_from(fmt, self.buf, self.off)
        self.off += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        end = self.off + n
        if end > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        s = bytes(self.buf[self.off:end]).decode("utf-8", errors="replace")
        self.off = end
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.unpack("<IQ")
            if etype == _STRING:
                return [self.string() for _ in range(n)]
            if etype not in _ARRAY_DTYPE:
                raise ValueError(f"unsupported array element type {etype}")
            dt = np.dtype(_ARRAY_DTYPE[etype])
            if self.off + n * dt.itemsize > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.off).copy()
            self.off += n * dt.itemsize
            return arr.astype(bool) if etype == 7 else arr
        if vtype not in _SCALAR_FMT:
            raise ValueError(f"unsupported value type {vtype}")
        return self.unpack(_SCALAR_FMT[vtype])[0]


class GGUFFile:
    """A GGUF file opened read-only: metadata, tensor table and the whole file as one uint8 memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelFormatError(f"model file not found: {self.path}")
        if not self.path.is_file():
            raise ModelFormatError(f"model path is not a file: {self.path}")
        self.size = self.path.stat().st_size
        if self.size < 24:
            raise ModelFormatError(f"not a GGUF file (only {self.size} bytes): {self.path}")
        with open(self.path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelFormatError(f"not a GGUF file (bad magic): {self.path}")
        self.data: np.ndarray = map_readonly(self.path)
        try:
            self._parse(memoryview(self.data))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise ModelFormatError(f"corrupt or truncated GGUF header in {self.path.name}: {e}") from None

    def _parse(self, buf: memoryview) -> None:
        c = _Cursor(buf, 4)
        (self.version,) = c.unpack("<I")
        if self.version not in (2, 3):
            raise ValueError(f"GGUF version {self.version} is not supported (2, 3)")
        n_tensors, n_kv = c.unpack("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            (vtype,) = c.unpack("<I")
            self.metadata[key] = c.value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            (nd,) = c.unpack("<I")
            dims = c.unpack(f"<{nd}Q")
            qtype, rel = c.unpack("<IQ")
            infos.append((name, dims, qtype, rel))
        align = int(self.metadata.get("general.alignment", 32))
        self.header_end = c.off
        self.data_offset = (c.off + align - 1) // align * align
        self.tensors: dict[str, TensorRef] = {}
        for name, dims, qtype, rel in infos:
            shape = tuple(int(d) for d in reversed(dims))
            if qtype not in _ALL_TYPES:
                raise ModelFormatError(f"{self.path.name}: tensor {name} has unknown GGML type {qtype}")
            _, blk, bsize = _ALL_TYPES[qtype]
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if shape and shape[-1] % blk:
                raise ModelFormatError(f"{self.path.name}: tensor {name} rows of {shape[-1]} are not a multiple "
                                       f"of the {type_name(qtype)} block ({blk})")
            nbytes = n // blk * bsize
            off = self.data_offset + int(rel)
            if off + nbytes > self.size:
                raise ModelFormatError(f"truncated GGUF: tensor {name} ends at byte {off + nbytes} but "
                                       f"{self.path.name} has {self.size} bytes")
            self.tensors[name] = TensorRef(name, int(qtype), shape, off, nbytes)

    # -- metadata -------------------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

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
        return self.data[ref.offset:ref.offset + ref.nbytes].reshape(-1, ref.row_bytes)

    def f32(self, ref: TensorRef) -> np.ndarray:
        """A small tensor (norm weight, bias) as float32, dequantized if needed."""
        raw = self.data[ref.offset:ref.offset + ref.nbytes]
        if ref.qtype == qtypes.F32:
            return np.array(raw.view(np.float32).reshape(ref.shape))
        if ref.qtype == qtypes.F16:
            return raw.view(np.float16).astype(np.float32).reshape(ref.shape)
        if ref.qtype == qtypes.BF16:
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(ref.shape)
        if ref.qtype not in qtypes.QUANT_INFO:
            raise ModelFormatError(f"{self.path.name}: tensor {ref.name} has unsupported type {type_name(ref.qtype)}")
        from strata_nb.cpu_kernels.matmul import dequant_rows

        rows = self.rows(ref)
        out = np.empty((rows.shape[0], ref.shape[-1]), np.float32)
        dequant_rows(ref.qtype, rows, np.arange(rows.shape[0], dtype=np.int64), out)
        return out.reshape(ref.shape)

    def lock(self, refs: list[TensorRef]) -> int:
        """Pin these tensors' pages in RAM (mlock): read now, never reclaimed while the file is open.

        When the expert tiers fill the RAM, the kernel's reclaim otherwise picks the page cache, i.e. the dense
        weights every token reads, and each token then takes page faults (or disk reads) on them. Returns the
        bytes locked; 0 where mlock is not allowed (RLIMIT_MEMLOCK), in which case the pages stay reclaimable.
        """
        import ctypes
        import mmap as _mmap

        libc = ctypes.CDLL(None, use_errno=True)
        base = self.data.ctypes.data
        page = _mmap.PAGESIZE
        done = 0
        for r in sorted(refs, key=lambda r: r.offset):
            a = (base + r.offset) // page * page
            n = base + r.offset + r.nbytes - a
            if libc.mlock(ctypes.c_void_p(a), ctypes.c_size_t(n)) != 0:
                return 0
            done += r.nbytes
        return done
