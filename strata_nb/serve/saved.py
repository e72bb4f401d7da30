"""A conversation saved to a file (its messages and its exact engine state) and loaded back on the same model."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from strata_nb.errors import StrataError
from strata_nb.runtime.session import Snapshot

FORMAT = "strata-nb conversation 1"
_SAMPLES = 64  # 4 KiB blocks of the tensor data hashed, spread over the file: files differing in weights only differ


def model_fingerprint(gguf) -> str:
    """A hash of the GGUF's header (metadata, tensor table) and of blocks spread over its tensor data."""
    h = hashlib.sha256()
    with open(gguf.path, "rb") as f:
        h.update(f.read(gguf.data_offset))
        span = max(gguf.size - gguf.data_offset - 4096, 0)
        for i in range(_SAMPLES):
            f.seek(gguf.data_offset + span * i // max(_SAMPLES - 1, 1))
            h.update(f.read(4096))
    h.update(str(gguf.size).encode())
    return h.hexdigest()


def save_conversation(path: str | os.PathLike, gguf, snap: Snapshot, messages: list[dict]) -> None:
    """Write to a temporary name beside path, then rename: a failed save never leaves half a file."""
    p = Path(path)
    if not p.resolve().parent.is_dir():
        raise StrataError(f"directory does not exist: {p.parent}")
    meta = {"format": FORMAT, "model": model_fingerprint(gguf), "model_file": gguf.path.name, "pos": snap.pos,
            "messages": messages, "layers": [len(s) for s in snap.states]}
    arrays = {f"s{i}_{j}": a for i, st in enumerate(snap.states) for j, a in enumerate(st)}
    tmp = p.with_name(p.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.array(json.dumps(meta)), tokens=np.asarray(snap.tokens, np.int64), **arrays)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)


def load_conversation(path: str | os.PathLike, gguf) -> tuple[Snapshot, list[dict]]:
    """The snapshot and messages saved in path; refused unless it was saved on this model."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise StrataError(f"{path} is not a saved strata-nb conversation")
            if meta["model"] != model_fingerprint(gguf):
                raise StrataError(f"{path} was saved with another model ({meta.get('model_file')}), not "
                                  f"{gguf.path.name}")
            states = tuple(tuple(z[f"s{i}_{j}"] for j in range(n)) for i, n in enumerate(meta["layers"]))
            tokens = tuple(int(t) for t in z["tokens"])
    except FileNotFoundError:
        raise StrataError(f"no such file: {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StrataError(f"{path} is not a readable saved conversation: {e}") from None
    if len(tokens) != meta["pos"] or not isinstance(meta.get("messages"), list):
        raise StrataError(f"{path} is not a consistent saved conversation")
    return Snapshot(meta["pos"], tokens, states), meta["messages"]
