"""A Session owns every per-layer state: snapshots restore it exactly, truncation drops a KV tail or returns a
recurrent model to a checkpoint. On the CPU engine (float32 reference kernels and the int8 fast path) for an
attention-only model and for qwen3next (gated delta-net layers).

Bounds: a continuation from a restored snapshot runs the same calls on the same state, so its logits are
bit-identical to the first run's. A truncated sequence re-runs the dropped tokens as a batch of another size;
every kernel computes each token's row on its own, so those are bit-identical too (asserted exactly; a change
that made rows depend on their batch would be caught here).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from strata_nb.api import Engine
from strata_nb.errors import StrataError
from strata_nb.synth import write_synthetic

CTX = 64


@pytest.fixture(scope="module", params=["qwen3moe", "qwen3next"])
def path(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("session") / f"{request.param}.gguf"
    write_synthetic(p, "tiny", arch=request.param, quant="Q8_0", seed=3)
    return p


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 500, n).astype(np.int64)


@pytest.mark.parametrize("fast", [False, True])
def test_restored_snapshot_continues_bit_for_bit(path, fast):
    eng = Engine(path, device="cpu", n_ctx=CTX, fast=fast)
    prompt, more = _tokens(19), _tokens(6, 1)
    s = eng.new_session()
    eng.backend.forward(s, prompt)
    snap = s.snapshot()
    first = [eng.backend.forward(s, more[:4], all_logits=True), eng.backend.forward(s, more[4:5])]
    assert s.pos == 24
    # the same session back to the snapshot, and a fresh session given it
    for target in (s, eng.new_session()):
        target.restore(snap)
        assert target.pos == 19 and target.tokens == [int(t) for t in prompt]
        again = [eng.backend.forward(target, more[:4], all_logits=True), eng.backend.forward(target, more[4:5])]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


def test_snapshot_is_a_copy(path):
    eng = Engine(path, device="cpu", n_ctx=CTX, fast=False)
    s = eng.new_session()
    eng.backend.forward(s, _tokens(8))
    snap = s.snapshot()
    saved = [a.copy() for st in snap.states for a in st]
    eng.backend.forward(s, _tokens(5, 2))  # changes the session's arrays, not the snapshot's
    for a, b in zip((a for st in snap.states for a in st), saved):
        np.testing.assert_array_equal(a, b)
    assert snap.nbytes > 0
    empty = eng.new_session().snapshot()  # position 0: nothing of the KV caches, zeroed recurrent states
    s.restore(empty)
    assert s.pos == 0 and s.tokens == []
    np.testing.assert_array_equal(eng.backend.forward(s, _tokens(8), all_logits=True), eng.logits(_tokens(8)))


def test_truncate(path):
    eng = Engine(path, device="cpu", n_ctx=CTX, fast=False)
    toks = _tokens(20)
    whole = eng.logits(toks)
    s = eng.new_session()
    eng.backend.forward(s, toks[:10])
    if eng.spec.recurrent:  # a recurrent state returns only to a checkpoint at or before the position
        s.checkpoint()
        eng.backend.forward(s, toks[10:16])
        with pytest.raises(StrataError, match="no checkpoint"):
            s.truncate(7)
    else:
        eng.backend.forward(s, toks[10:16])
    assert s.truncate(12) == (10 if eng.spec.recurrent else 12)
    assert s.tokens == [int(t) for t in toks[:s.pos]]
    again = eng.backend.forward(s, toks[s.pos:], all_logits=True)
    np.testing.assert_array_equal(again, whole[len(whole) - len(again):])
    assert s.truncate(0) == 0 and s.pos == 0 and s.tokens == []
    np.testing.assert_array_equal(eng.backend.forward(s, toks, all_logits=True), whole)


def test_engine_rewind_replays_to_the_exact_position(path):
    eng = Engine(path, device="cpu", n_ctx=CTX, fast=False)
    toks = _tokens(16)
    whole = eng.logits(toks)
    s = eng.new_session()
    eng.forward(s, toks[:6])
    s.checkpoint()
    eng.forward(s, toks[6:])
    eng.rewind(s, 11)  # recurrent: back to the checkpoint at 6, then tokens 6..10 again
    assert s.pos == 11
    np.testing.assert_array_equal(eng.forward(s, toks[11:], all_logits=True), whole[11:])
    with pytest.raises(StrataError, match="out of range"):
        eng.forward(s, [eng.spec.n_vocab])
    with pytest.raises(StrataError, match="context full"):
        eng.forward(s, [1] * (CTX - s.pos + 1))
    assert s.pos == 16  # refused before anything ran


def test_bad_snapshots_and_positions_are_refused(path):
    eng = Engine(path, device="cpu", n_ctx=CTX, fast=False)
    s = eng.new_session()
    eng.backend.forward(s, _tokens(30))
    snap = s.snapshot()
    small = Engine(path, device="cpu", n_ctx=16, fast=False).new_session()
    with pytest.raises(StrataError, match="does not fit"):
        small.restore(snap)
    # a snapshot of another model with as many layers: its arrays are refused by shape, not broadcast
    bad = dataclasses.replace(snap, states=(tuple(a[..., :-1] for a in snap.states[0]),) + snap.states[1:])
    fresh = eng.new_session()
    eng.backend.forward(fresh, _tokens(3))
    with pytest.raises(StrataError, match="does not fit"):
        fresh.restore(bad)
    assert fresh.pos == 3 and fresh.tokens == [int(t) for t in _tokens(3)]  # refused before any copy
    with pytest.raises(StrataError, match="cannot truncate"):
        s.truncate(31)
