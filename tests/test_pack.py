"""The expert pack and the expert sources, on small GGUFs written here with gguf.GGUFWriter."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from strata_nb.errors import ModelFormatError, PackError
from strata_nb.experts import pack as packfmt
from strata_nb.experts.source import GGUFExperts, PackExperts, open_experts
from strata_nb.model.gguf_file import GGUFFile

N_EXPERT, D, FF = 4, 512, 256
# (layer, kind) -> quant type; layer 0 is dense (no routed experts), as in models with leading dense layers
LAYOUT = {(1, "gate"): Q.Q4_0, (1, "up"): Q.Q4_0, (1, "down"): Q.Q8_0,
          (2, "gate"): Q.Q8_0, (2, "up"): Q.Q8_0, (2, "down"): Q.F16}


def make_gguf(path: Path, seed: int = 0, ff: int = FF) -> dict[tuple[int, str], np.ndarray]:
    """Write a GGUF with valid quantized expert tensors; returns each expert tensor's bytes [E, rows, row_bytes]."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(3)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, D)).astype(np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", rng.standard_normal((ff, D)).astype(np.float32))
    raw = {}
    for (layer, kind), qt in LAYOUT.items():
        shape = (N_EXPERT, D, ff) if kind == "down" else (N_EXPERT, ff, D)
        x = rng.standard_normal(shape).astype(np.float32)
        if qt == Q.F16:
            w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", x.astype(np.float16))
            raw[(layer, kind)] = x.astype(np.float16).view(np.uint8)
        else:
            q = gguf.quants.quantize(x, qt)
            w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", q, raw_dtype=qt)
            raw[(layer, kind)] = q
        if kind == "down":
            w.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(D, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raw


@pytest.fixture()
def model(tmp_path: Path) -> tuple[Path, dict]:
    p = tmp_path / "model.gguf"
    return p, make_gguf(p)


def tensor_offset(p: Path, name: str) -> int:
    """Where gguf-py (independent of our parser) says a tensor's bytes start."""
    return next(int(t.data_offset) for t in gguf.GGUFReader(p, "r").tensors if t.name == name)


def flip_byte(p: Path, offset: int) -> None:
    with open(p, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_pack_rows_equal_gguf_rows(model: tuple[Path, dict]) -> None:
    p, raw = model
    seen = []
    out = packfmt.write_pack(p, progress=lambda d, t: seen.append((d, t)))
    assert out == p.with_name("model.strata-pack") == packfmt.default_pack_path(p)
    gf = GGUFFile(p)
    g, pk = GGUFExperts(gf), PackExperts(out, gf)
    assert g.layers == pk.layers == (1, 2)
    assert not pk.buf.flags.writeable
    for (layer, kind), want in raw.items():
        mg, mp = g.matrix(layer, kind), pk.matrix(layer, kind)
        assert (mg.qtype, mg.rows, mg.cols, mg.row_bytes) == (mp.qtype, mp.rows, mp.cols, mp.row_bytes) == (
            int(LAYOUT[(layer, kind)]), want.shape[1], D if kind != "down" else FF, want.shape[2])
        assert mp.offsets.dtype == np.int64 and mp.n_expert == N_EXPERT
        assert np.all(mp.offsets % packfmt.ALIGN == 0)
        for e in range(N_EXPERT):
            np.testing.assert_array_equal(g.rows(layer, kind, e), want[e])  # GGUF in place vs what we wrote
            np.testing.assert_array_equal(pk.rows(layer, kind, e), want[e])  # pack vs what we wrote
            # the raw kernel view: rows x row_bytes at offsets[e] of buf
            o = int(mp.offsets[e])
            np.testing.assert_array_equal(pk.buf[o:o + mp.rows * mp.row_bytes], want[e].reshape(-1))
    # blobs: 4 KiB-aligned, whole strides, gate | up | down in order inside one blob
    for layer in pk.layers:
        for e in range(N_EXPERT):
            off, n = pk.blob(layer, e)
            assert off % packfmt.ALIGN == 0 and n % packfmt.ALIGN == 0
            starts = [int(pk.matrix(layer, k).offsets[e]) for k in ("gate", "up", "down")]
            assert off == starts[0] < starts[1] < starts[2] < starts[2] + pk.matrix(layer, "down").nbytes <= off + n
    # progress: monotone, ends at the total number of expert bytes
    total = sum(a.nbytes for a in raw.values())
    assert seen[-1] == (total, total)
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    assert packfmt.verify_pack(out, p) >= 0


def test_pack_is_deterministic_across_thread_counts(model: tuple[Path, dict], tmp_path: Path) -> None:
    p, _ = model
    a = packfmt.write_pack(p, tmp_path / "a.strata-pack", threads=1).read_bytes()
    b = packfmt.write_pack(p, tmp_path / "b.strata-pack", threads=6).read_bytes()
    assert a == b  # buffers reused across threads never leak bytes between blobs


def test_open_experts_choice(model: tuple[Path, dict], tmp_path: Path) -> None:
    p, _ = model
    assert type(open_experts(GGUFFile(p))) is GGUFExperts  # no pack anywhere
    away = tmp_path / "elsewhere"
    away.mkdir()
    out = packfmt.write_pack(p, away)  # a directory: default name inside it
    assert out == away / "model.strata-pack"
    assert type(open_experts(GGUFFile(p))) is GGUFExperts  # not beside the GGUF
    assert type(open_experts(GGUFFile(p), pack=out)) is PackExperts
    packfmt.write_pack(p)
    assert type(open_experts(GGUFFile(p))) is PackExperts  # found beside the GGUF
    with pytest.raises(PackError, match="not found"):
        open_experts(GGUFFile(p), pack=tmp_path / "missing.strata-pack")


def test_interrupted_write_leaves_nothing(model: tuple[Path, dict]) -> None:
    p, _ = model
    before = sorted(os.listdir(p.parent))

    def fail(done: int, total: int) -> None:
        if done > total // 3:
            raise KeyboardInterrupt  # the user's Ctrl-C mid-write

    with pytest.raises(KeyboardInterrupt):
        packfmt.write_pack(p, progress=fail)
    assert sorted(os.listdir(p.parent)) == before


def test_refuses_gguf_with_modified_expert_bytes(model: tuple[Path, dict]) -> None:
    p, _ = model
    packfmt.write_pack(p)
    flip_byte(p, tensor_offset(p, "blk.2.ffn_up_exps.weight") + 5)  # inside a fingerprint window
    with pytest.raises(PackError, match="expert bytes changed"):
        open_experts(GGUFFile(p))


def test_verify_catches_changes_the_fingerprint_misses(model: tuple[Path, dict]) -> None:
    p, _ = model
    out = packfmt.write_pack(p)
    # expert 1 of layer 1's gate: past the first 64 KiB window, before the middle one
    off = tensor_offset(p, "blk.1.ffn_gate_exps.weight") + 80_000
    flip_byte(p, off)
    PackExperts(out, GGUFFile(p))  # the cheap open check does not read this byte...
    with pytest.raises(PackError, match=r"GGUF experts do not match .* layer 1, expert 1"):
        packfmt.verify_pack(out, p)  # ...the full check does, and names the expert
    flip_byte(p, off)  # restore the GGUF; damage the pack's copy of layer 2, expert 3
    packfmt.verify_pack(out, p)
    flip_byte(out, PackExperts(out, GGUFFile(p)).blob(2, 3)[0] + 10)
    with pytest.raises(PackError, match=r"pack experts do not match .* layer 2, expert 3"):
        packfmt.verify_pack(out, p)


def test_refuses_a_different_gguf(model: tuple[Path, dict], tmp_path: Path) -> None:
    p, _ = model
    out = packfmt.write_pack(p)
    same_shape = tmp_path / "other.gguf"
    make_gguf(same_shape, seed=1)  # same size and header, other weights
    assert same_shape.stat().st_size == p.stat().st_size
    with pytest.raises(PackError, match="expert bytes changed"):
        PackExperts(out, GGUFFile(same_shape))
    other_shape = tmp_path / "bigger.gguf"
    make_gguf(other_shape, ff=2 * FF)
    with pytest.raises(PackError, match="bytes"):
        PackExperts(out, GGUFFile(other_shape))


def test_refuses_changed_header(model: tuple[Path, dict]) -> None:
    p, _ = model
    out = packfmt.write_pack(p)
    key = gguf.GGUFReader(p, "r").fields["general.architecture"]
    flip_byte(p, int(key.offset) + 8 + 2)  # a letter of the key's name (after its u64 length): still a valid GGUF
    with pytest.raises(PackError, match="header"):
        PackExperts(out, GGUFFile(p))


@pytest.mark.parametrize("cut", [1, 4096, 0.5, 1e-5])
def test_refuses_truncated_pack(model: tuple[Path, dict], cut: float) -> None:
    p, _ = model
    out = packfmt.write_pack(p)
    size = out.stat().st_size
    os.truncate(out, size - cut if isinstance(cut, int) else int(size * cut))  # 1e-5: not even a preamble
    with pytest.raises(PackError, match="truncated"):
        PackExperts(out, GGUFFile(p))


def test_refuses_corrupt_index_wrong_version_and_non_packs(model: tuple[Path, dict], tmp_path: Path) -> None:
    p, _ = model
    out = packfmt.write_pack(p)
    good = out.read_bytes()
    _, _, _, ioff, ilen, _ = struct.unpack_from("<8sIIQQ32s", good)
    assert json.loads(good[ioff:ioff + ilen])["version"] == packfmt.FORMAT_VERSION
    flip_byte(out, ioff + ilen // 2)
    with pytest.raises(PackError, match="index is corrupt"):
        PackExperts(out, GGUFFile(p))
    out.write_bytes(good[:8] + struct.pack("<I", packfmt.FORMAT_VERSION + 1) + good[12:])
    with pytest.raises(PackError, match="version 2"):
        PackExperts(out, GGUFFile(p))
    with pytest.raises(PackError, match="not a strata-nb expert pack"):
        PackExperts(p, GGUFFile(p))  # the GGUF itself


def test_gguf_without_experts_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(p), "qwen3")
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(PackError, match="no routed-expert tensors"):
        packfmt.write_pack(p)
    assert sorted(os.listdir(tmp_path)) == ["dense.gguf"]


def test_truncated_gguf_is_refused(model: tuple[Path, dict]) -> None:
    p, _ = model
    out = packfmt.write_pack(p)
    os.truncate(p, tensor_offset(p, "blk.2.ffn_down_exps.weight") + 100)  # cut inside the last expert tensor
    with pytest.raises(ModelFormatError, match="truncated GGUF: tensor blk.2.ffn_down_exps.weight"):
        packfmt.verify_pack(out, p)
    with pytest.raises(ModelFormatError, match="truncated GGUF: tensor blk.2.ffn_down_exps.weight"):
        packfmt.write_pack(p, out.with_name("again.strata-pack"))
    assert not out.with_name("again.strata-pack").exists()
