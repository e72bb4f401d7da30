"""The expert pack: every routed expert of a GGUF as one 4 KiB-aligned blob, so that one expert is one read.

File layout (format version 1, little-endian):

    [0, 4096)        preamble: magic b"STRATAPK", u32 version, u32 0, u64 index_offset, u64 index_length,
                     32-byte SHA-256 of the index, zero padding
    [4096, ...)      layer by layer, expert by expert: one blob per (layer, expert) holding that expert's
                     matrices in kind order (gate, up, down; each present kind of the GGUF), every matrix its rows
                     in their GGUF quant layout starting at a 4 KiB boundary; zero padding between matrices
    [index_offset, EOF)  the index: UTF-8 JSON (format version, layer layout, quant types, shapes, and what binds
                     the pack to its GGUF); the file ends exactly where the index ends

Blobs of one layer share a layout: expert e's matrix `kind` of layer l lies at
`layer.offset + e * layer.stride + layer.matrices[kind].offset`.

Binding to the GGUF: `experts_sha256` is the SHA-256 of the concatenated per-blob SHA-256 digests (each over the
blob's matrix bytes, padding excluded), computed while packing; checking it reads the whole model, so only
`verify_pack` does. Every open checks a cheap fingerprint instead: the GGUF's size, the SHA-256 of its header
(metadata and tensor table) and of 64 KiB windows at the start, middle and end of every expert tensor.

The pack is written to a hidden temporary file in the destination directory, fsynced and renamed into place,
so an interrupted write never leaves a file under the final name.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strata_nb.cpu_kernels import qtypes
from strata_nb.errors import ModelFormatError, PackError
from strata_nb.model.gguf_file import GGUFFile, type_name

FORMAT_VERSION = 1
MAGIC = b"STRATAPK"
ALIGN = 4096
PACK_SUFFIX = ".strata-pack"
KINDS = ("gate", "up", "down", "gate_up")  # blob order; gate_up is the fused form some converters write
WINDOW = 64 * 1024  # fingerprint window
_PREAMBLE = struct.Struct("<8sIIQQ32s")
_TENSOR_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight")

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ExpertTensor:
    """A 3-D expert tensor of the GGUF: n_expert matrices of rows x cols, stored one after the other."""

    layer: int
    kind: str
    qtype: int
    n_expert: int
    rows: int
    cols: int
    row_bytes: int
    offset: int  # absolute byte offset in the GGUF

    @property
    def matrix_bytes(self) -> int:
        return self.rows * self.row_bytes

    def expert_offset(self, e: int) -> int:
        return self.offset + e * self.matrix_bytes


@dataclass(frozen=True)
class PackMatrix:
    qtype: int
    rows: int
    cols: int
    row_bytes: int
    offset: int  # within the blob


@dataclass(frozen=True)
class PackLayer:
    layer: int
    n_expert: int
    offset: int  # of expert 0's blob in the pack
    stride: int  # blob size, a multiple of ALIGN
    matrices: dict[str, PackMatrix]

    def blob_bytes(self) -> int:
        """Matrix bytes of one blob (padding excluded)."""
        return sum(m.rows * m.row_bytes for m in self.matrices.values())


@dataclass(frozen=True)
class PackIndex:
    path: Path
    version: int
    file_size: int
    gguf: dict[str, Any]  # name, size, header_sha256, sample_sha256, experts_sha256
    layers: dict[int, PackLayer]


def default_pack_path(gguf_path: str | os.PathLike) -> Path:
    """MODEL.gguf -> MODEL.strata-pack beside it."""
    p = Path(gguf_path)
    return p.with_name((p.stem if p.suffix == ".gguf" else p.name) + PACK_SUFFIX)


# -- the experts of a GGUF ---------------------------------------------------------------------------------------

def expert_tensors(g: GGUFFile) -> dict[tuple[int, str], ExpertTensor]:
    """The routed-expert tensors of a GGUF keyed by (layer, kind), validated, in (layer, kind) order.

    GGUFFile has already checked that every tensor lies inside the file and has whole quant blocks per row. The
    MTP blocks' experts (blocks past block_count - nextn_predict_layers) are left out: nothing runs them yet.
    """
    found: dict[tuple[int, str], ExpertTensor] = {}
    arch = g.get("general.architecture")  # unchecked here: a pack is matched to any header (check_pack)
    n_main = 0
    if isinstance(arch, str):
        n_main = int(g.get(f"{arch}.block_count") or 0) - int(g.get(f"{arch}.nextn_predict_layers") or 0)
    for t in g.tensors.values():
        m = _TENSOR_RE.fullmatch(t.name)
        if m is None or (n_main > 0 and int(m.group(1)) >= n_main):
            continue
        if t.qtype not in qtypes.QUANT_INFO:
            raise ModelFormatError(f"expert tensor {t.name} has unsupported quant type {type_name(t.qtype)}")
        if len(t.shape) != 3:
            raise ModelFormatError(f"expert tensor {t.name} has {len(t.shape)} dimensions, expected 3")
        n_expert, rows, cols = t.shape  # numpy order: outermost first
        et = ExpertTensor(int(m.group(1)), m.group(2), t.qtype, n_expert, rows, cols, t.row_bytes, t.offset)
        found[(et.layer, et.kind)] = et
    out = dict(sorted(found.items(), key=lambda kv: (kv[0][0], KINDS.index(kv[0][1]))))
    first: dict[int, ExpertTensor] = {}
    for (layer, kind), et in out.items():
        f = first.setdefault(layer, et)
        if et.n_expert != f.n_expert:
            raise ModelFormatError(f"layer {layer}: ffn_{kind}_exps has {et.n_expert} experts, "
                                   f"ffn_{f.kind}_exps has {f.n_expert}")
    return out


def _windows(tensors: dict[tuple[int, str], ExpertTensor]) -> list[tuple[int, int]]:
    """(offset, length) of the sampled windows: start, middle and end of every expert tensor."""
    out = []
    for et in tensors.values():
        n = et.n_expert * et.matrix_bytes
        for start in sorted({0, (n // 2) // ALIGN * ALIGN, max(0, n - WINDOW)}):
            out.append((et.offset + start, min(n - start, WINDOW)))
    return out


def _fingerprint(g: GGUFFile, tensors: dict[tuple[int, str], ExpertTensor]) -> dict[str, Any]:
    """Cheap binding to the GGUF, recomputed at every open: reads the header and three windows per tensor.

    The header hash covers everything before the aligned tensor data (metadata, tensor table, alignment padding).
    """
    windows = _windows(tensors)
    # Ask for every window at once so a cold disk serves them in parallel rather than one seek at a time.
    fd = os.open(g.path, os.O_RDONLY)
    try:
        for off, n in windows:
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)
    samples = hashlib.sha256()
    for off, n in windows:
        samples.update(g.data[off:off + n])
    return {"size": g.size, "header_sha256": hashlib.sha256(g.data[:g.data_offset]).hexdigest(),
            "sample_sha256": samples.hexdigest()}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _plan(tensors: dict[tuple[int, str], ExpertTensor]) -> dict[int, PackLayer]:
    layers: dict[int, PackLayer] = {}
    pos = ALIGN  # after the preamble
    for layer in sorted({l for l, _ in tensors}):
        mats: dict[str, PackMatrix] = {}
        blob = 0
        n_expert = 0
        for kind in KINDS:
            et = tensors.get((layer, kind))
            if et is None:
                continue
            mats[kind] = PackMatrix(et.qtype, et.rows, et.cols, et.row_bytes, blob)
            blob = _align(blob + et.matrix_bytes)
            n_expert = et.n_expert
        layers[layer] = PackLayer(layer, n_expert, pos, blob, mats)
        pos += n_expert * blob
    return layers


# -- writing ----------------------------------------------------------------------------------------------------

def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise PackError(f"unexpected end of file at byte {offset + got} while reading experts")
        got += n


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _blobs(layers: dict[int, PackLayer]) -> Iterator[tuple[PackLayer, int]]:
    for pl in layers.values():
        for e in range(pl.n_expert):
            yield pl, e


def _blob_digest(fd: int, pl: PackLayer, sources: list[tuple[PackMatrix, int]], buf: np.ndarray,
                 out_fd: int | None, out_offset: int) -> bytes:
    """Read one blob's matrices (from absolute offsets `sources` of fd), hash them, optionally write the blob."""
    view = memoryview(buf)[:pl.stride]
    h = hashlib.sha256()
    end = 0
    for pm, src in sources:
        n = pm.rows * pm.row_bytes
        buf[end:pm.offset] = 0  # padding before this matrix (buffers are reused across layers)
        _pread_into(fd, view[pm.offset:pm.offset + n], src)
        h.update(view[pm.offset:pm.offset + n])
        end = pm.offset + n
    buf[end:pl.stride] = 0
    if out_fd is not None:
        _pwrite_all(out_fd, view, out_offset)
    return h.digest()


SourceOf = Callable[[PackLayer, int], list[tuple[PackMatrix, int]]]  # (layer, expert) -> [(matrix, byte offset)]


def _stream_blobs(fd: int, layers: dict[int, PackLayer], source_of: SourceOf, out_fd: int | None,
                  progress: Progress | None, threads: int) -> list[bytes]:
    """Per-blob digests in (layer, expert) order; blobs are read (and written) by a pool of threads.

    Each task does one blob end to end with os.preadv / sha256 / os.pwrite, all of which release the GIL, so
    reads, hashing and writes of different blobs overlap. At most 2 * threads blobs are in flight.
    """
    total = sum(pl.n_expert * pl.blob_bytes() for pl in layers.values())
    stride_max = max((pl.stride for pl in layers.values()), default=0)
    free: list[np.ndarray] = [np.zeros(stride_max, np.uint8) for _ in range(2 * threads)]
    digests: list[bytes] = []
    inflight: deque[tuple[Future[bytes], np.ndarray, int]] = deque()
    done = 0
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="strata-pack")
    try:
        def finish_oldest() -> None:
            nonlocal done
            fut, buf, nbytes = inflight.popleft()
            digests.append(fut.result())
            free.append(buf)
            done += nbytes
            if progress is not None:
                progress(done, total)

        for pl, e in _blobs(layers):
            if not free:
                finish_oldest()
            buf = free.pop()
            out_off = pl.offset + e * pl.stride
            inflight.append((pool.submit(_blob_digest, fd, pl, source_of(pl, e), buf, out_fd, out_off), buf,
                             pl.blob_bytes()))
        while inflight:
            finish_oldest()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return digests


def _default_threads() -> int:
    return min(8, max(4, os.cpu_count() or 4))  # I/O-bound: >= 4 reads in flight even on 2 cores


def write_pack(gguf_path: str | os.PathLike, out_path: str | os.PathLike | None = None,
               progress: Progress | None = None, threads: int | None = None) -> Path:
    """Write the expert pack of a GGUF; returns its path (default: beside the GGUF, see default_pack_path).

    out_path may be a directory (the default name is used inside it). progress(done_bytes, total_bytes) is
    called after each blob, from the calling thread; if it raises, the write is abandoned and nothing is left.
    """
    gguf_path = Path(gguf_path)
    g = GGUFFile(gguf_path)
    tensors = expert_tensors(g)
    if not tensors:
        raise PackError(f"{gguf_path.name} has no routed-expert tensors (blk.N.ffn_*_exps.weight) to pack")
    layers = _plan(tensors)
    data_end = max(pl.offset + pl.n_expert * pl.stride for pl in layers.values())

    out = Path(out_path) if out_path is not None else default_pack_path(gguf_path)
    if out.is_dir():
        out = out / default_pack_path(gguf_path).name
    if not out.parent.is_dir():
        raise PackError(f"pack destination directory does not exist: {out.parent}")
    free = shutil.disk_usage(out.parent).free
    if free < data_end + (1 << 20):
        raise PackError(f"not enough disk space for the pack in {out.parent}: "
                        f"needs {data_end / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free")

    fingerprint = _fingerprint(g, tensors)
    src = os.open(gguf_path, os.O_RDONLY)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    try:
        os.fchmod(fd, os.stat(gguf_path).st_mode & 0o777)  # readable by whoever can read the model (mkstemp: 0600)
        os.posix_fadvise(src, 0, 0, os.POSIX_FADV_SEQUENTIAL)

        def source_of(pl: PackLayer, e: int) -> list[tuple[PackMatrix, int]]:
            return [(pm, tensors[(pl.layer, k)].expert_offset(e)) for k, pm in pl.matrices.items()]

        digests = _stream_blobs(src, layers, source_of, fd, progress, threads or _default_threads())
        index = {
            "format": "strata-nb expert pack",
            "version": FORMAT_VERSION,
            "alignment": ALIGN,
            "gguf": {"name": gguf_path.name, **fingerprint,
                     "experts_sha256": hashlib.sha256(b"".join(digests)).hexdigest()},
            "layers": [{"layer": pl.layer, "n_expert": pl.n_expert, "offset": pl.offset, "stride": pl.stride,
                        "matrices": {k: {"qtype": m.qtype, "rows": m.rows, "cols": m.cols,
                                         "row_bytes": m.row_bytes, "offset": m.offset}
                                     for k, m in pl.matrices.items()}}
                       for pl in layers.values()],
        }
        blob = json.dumps(index, separators=(",", ":")).encode()
        _pwrite_all(fd, memoryview(blob), data_end)
        pre = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, data_end, len(blob), hashlib.sha256(blob).digest())
        _pwrite_all(fd, memoryview(pre.ljust(ALIGN, b"\0")), 0)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, out)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)
        raise
    finally:
        os.close(src)
    dfd = os.open(out.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return out


# -- reading and checking -----------------------------------------------------------------------------------------

def read_pack_index(pack_path: str | os.PathLike) -> PackIndex:
    """Read and sanity-check a pack's preamble and index (not its binding to a GGUF; see check_pack)."""
    path = Path(pack_path)
    if not path.is_file():
        raise PackError(f"expert pack not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        pre = f.read(_PREAMBLE.size)
        if len(pre) < _PREAMBLE.size or not pre.startswith(MAGIC):
            raise PackError(f"{path} is not a strata-nb expert pack (bad magic or truncated)")
        _, version, _, ioff, ilen, isha = _PREAMBLE.unpack(pre)
        if version != FORMAT_VERSION:
            raise PackError(f"{path} has pack format version {version}, this strata-nb reads version "
                            f"{FORMAT_VERSION}: re-run `strata-nb pack`")
        if ioff + ilen != size:
            raise PackError(f"{path} is truncated or damaged: {size} bytes, its preamble says {ioff + ilen}")
        f.seek(ioff)
        blob = f.read(ilen)
    if hashlib.sha256(blob).digest() != isha:
        raise PackError(f"{path}: the pack index is corrupt (checksum mismatch)")
    try:
        ix = json.loads(blob)
        layers = {}
        for d in ix["layers"]:
            mats = {k: PackMatrix(int(m["qtype"]), int(m["rows"]), int(m["cols"]), int(m["row_bytes"]),
                                  int(m["offset"])) for k, m in d["matrices"].items()}
            pl = PackLayer(int(d["layer"]), int(d["n_expert"]), int(d["offset"]), int(d["stride"]), mats)
            if pl.offset % ALIGN or pl.stride % ALIGN or pl.offset + pl.n_expert * pl.stride > ioff or any(
                    m.offset % ALIGN or m.offset + m.rows * m.row_bytes > pl.stride for m in mats.values()):
                raise ValueError(f"layer {pl.layer} lies outside the data region or is misaligned")
            layers[pl.layer] = pl
        gg = dict(ix["gguf"])
        missing = {"size", "header_sha256", "sample_sha256", "experts_sha256"} - set(gg)
        if missing:
            raise ValueError(f"no {', '.join(sorted(missing))}")
        if int(ix["version"]) != version:
            raise ValueError("index and preamble disagree on the version")
    except (ValueError, KeyError, TypeError) as e:
        raise PackError(f"{path}: the pack index is invalid ({e})") from None
    return PackIndex(path, version, size, gg, layers)


def check_pack(index: PackIndex, g: GGUFFile) -> None:
    """Refuse (PackError) a pack that does not belong to this GGUF, naming the first difference found."""
    name = index.path.name
    gname = index.gguf.get("name", "?")
    if g.size != index.gguf["size"]:
        raise PackError(f"pack {name} was made from a GGUF of {index.gguf['size']} bytes ({gname}), "
                        f"this one has {g.size}: re-run `strata-nb pack`")
    tensors = expert_tensors(g)
    have = {(l, k) for l, pl in index.layers.items() for k in pl.matrices}
    if have != set(tensors):
        diff = sorted(have ^ set(tensors))[0]
        where = "the pack" if diff in have else "the GGUF"
        raise PackError(f"pack {name} does not match the GGUF: blk.{diff[0]}.ffn_{diff[1]}_exps only in {where}")
    for (l, k), et in tensors.items():
        pm = index.layers[l].matrices[k]
        if (pm.qtype, pm.rows, pm.cols, index.layers[l].n_expert) != (et.qtype, et.rows, et.cols, et.n_expert):
            raise PackError(
                f"pack {name} does not match the GGUF: blk.{l}.ffn_{k}_exps is {qtypes.name(pm.qtype)} "
                f"{index.layers[l].n_expert}x{pm.rows}x{pm.cols} in the pack, "
                f"{qtypes.name(et.qtype)} {et.n_expert}x{et.rows}x{et.cols} in the GGUF")
    fp = _fingerprint(g, tensors)
    if fp["header_sha256"] != index.gguf["header_sha256"]:
        raise PackError(f"pack {name} does not match the GGUF: its header (metadata or tensor table) changed "
                        f"since packing: re-run `strata-nb pack`")
    if fp["sample_sha256"] != index.gguf["sample_sha256"]:
        raise PackError(f"pack {name} does not match the GGUF: expert bytes changed since packing: "
                        f"re-run `strata-nb pack`")


def verify_pack(pack_path: str | os.PathLike, gguf_path: str | os.PathLike, progress: Progress | None = None,
                threads: int | None = None) -> float:
    """Full check: re-hash every expert in the GGUF and in the pack against the hash recorded at packing.

    Raises PackError naming the first (layer, expert) that differs; returns the seconds it took.
    """
    t0 = time.perf_counter()
    index = read_pack_index(pack_path)
    g = GGUFFile(gguf_path)
    check_pack(index, g)
    tensors = expert_tensors(g)
    want = index.gguf["experts_sha256"]
    n = threads or _default_threads()

    def gguf_source(pl: PackLayer, e: int) -> list[tuple[PackMatrix, int]]:
        return [(pm, tensors[(pl.layer, k)].expert_offset(e)) for k, pm in pl.matrices.items()]

    def pack_source(pl: PackLayer, e: int) -> list[tuple[PackMatrix, int]]:
        return [(pm, pl.offset + e * pl.stride + pm.offset) for pm in pl.matrices.values()]

    results = {}
    for i, (label, path, source_of) in enumerate((("GGUF", gguf_path, gguf_source), ("pack", pack_path, pack_source))):
        # progress runs over both passes: done counts the first pass's total once it is over
        prog = None if progress is None else (lambda d, t, i=i: progress(i * t + d, 2 * t))
        fd = os.open(path, os.O_RDONLY)
        try:
            results[label] = _stream_blobs(fd, index.layers, source_of, None, prog, n)
        finally:
            os.close(fd)
    blobs = list(_blobs(index.layers))
    for label in ("GGUF", "pack"):
        if hashlib.sha256(b"".join(results[label])).hexdigest() != want:
            other = "pack" if label == "GGUF" else "GGUF"
            diff = [i for i, (a, b) in enumerate(zip(results[label], results[other])) if a != b]
            where = (f" (first difference with the {other}: layer {blobs[diff[0]][0].layer}, "
                     f"expert {blobs[diff[0]][1]})") if diff else ""
            raise PackError(f"{label} experts do not match the hash recorded when {Path(pack_path).name} "
                            f"was written{where}")
    return time.perf_counter() - t0
