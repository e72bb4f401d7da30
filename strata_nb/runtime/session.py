"""A generation session: every per-layer state of a sequence (KV caches, delta-net conv and recurrent states), the
position it has reached, and exact snapshots of all of it.

The states' arrays are the engine's: numpy arrays for the CPU engine, device arrays for the hybrid engine (whose
captured graphs hold their addresses, so a snapshot is restored by copying into them, never by replacing them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from strata_nb.errors import StrataError
from strata_nb.model.spec import ModelSpec

Alloc = Callable[[tuple[int, ...], type], object]  # a zeroed array of that shape and dtype (host or device)


def _host(a) -> np.ndarray:
    return a.copy() if isinstance(a, np.ndarray) else a.copy_to_host()


def _into(dst, src: np.ndarray) -> None:
    """Copy a saved array into a state's array (host or device), in the state's element type (a snapshot of the
    GPU engine's f16 KV cache restores into the CPU engine's f32 one and back)."""
    if isinstance(dst, np.ndarray):
        dst[...] = src
    else:
        dst.copy_to_device(np.ascontiguousarray(src, dtype=dst.dtype))


class KVState:
    """An attention layer's cache: k and v [n_head_kv, n_ctx, head_dim]. Entries past the position are stale
    and overwritten before anything reads them, so dropping a tail is free."""

    recurrent = False

    def __init__(self, k, v):
        self.k, self.v = k, v

    def save(self, pos: int) -> tuple[np.ndarray, ...]:
        # per head: [h, :pos] is contiguous in either memory, and only the first pos entries mean anything (none at
        # position 0: no zero-length device copy)
        return tuple(_host(c[h, :pos]) if pos else np.zeros((0, c.shape[2]), c.dtype)
                     for c in (self.k, self.v) for h in range(c.shape[0]))

    def shapes(self, pos: int) -> list[tuple[int, ...]]:
        """The shapes save(pos) returns."""
        return [(pos, self.k.shape[2])] * (2 * self.k.shape[0])

    def load(self, saved: tuple[np.ndarray, ...], pos: int) -> None:
        n = self.k.shape[0]
        for i, c in enumerate((self.k, self.v)):
            for h in range(n):
                if pos:
                    _into(c[h, :pos], saved[i * n + h])

    def reset(self) -> None:
        pass  # nothing before position 0 is ever read

    @property
    def nbytes(self) -> int:
        return 2 * self.k.nbytes


class RecurrentState:
    """A delta-net layer's state: the causal conv's last K-1 inputs [K-1, conv_dim] and the recurrence's matrix per
    value head [Hv, dk, dv]. It folds in every token so far: it can only return to a snapshot."""

    recurrent = True

    def __init__(self, conv, ssm, zero: Callable[[object], None]):
        self.conv, self.ssm = conv, ssm
        self._zero = zero

    def save(self, pos: int) -> tuple[np.ndarray, ...]:
        return _host(self.conv), _host(self.ssm)

    def shapes(self, pos: int) -> list[tuple[int, ...]]:
        return [tuple(self.conv.shape), tuple(self.ssm.shape)]

    def load(self, saved: tuple[np.ndarray, ...], pos: int) -> None:
        _into(self.conv, saved[0])
        _into(self.ssm, saved[1])

    def reset(self) -> None:
        self._zero(self.conv)
        self._zero(self.ssm)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


def _zero_host(a: np.ndarray) -> None:
    a[...] = 0


def _aligned_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros at a 64-byte boundary: the delta rule's state rows measured ~30% slower 16 bytes off one."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.zeros(n + 64, np.uint8)
    off = -buf.ctypes.data % 64
    return buf[off:off + n].view(dtype).reshape(shape)


def host_states(spec: ModelSpec, n_ctx: int) -> list[KVState | RecurrentState]:
    """Every layer's state as float32 numpy arrays (the CPU engine's)."""
    return make_states(spec, n_ctx, _aligned_zeros, np.float32, _zero_host)


def make_states(spec: ModelSpec, n_ctx: int, alloc: Alloc, kv_dtype, zero: Callable[[object], None]
                ) -> list[KVState | RecurrentState]:
    """One state per layer by its mixer kind; KV entries of kv_dtype, recurrent states in float32."""
    states: list[KVState | RecurrentState] = []
    kv = (spec.n_head_kv, n_ctx, spec.head_dim)
    for ls in spec.layers:
        if ls.recurrent:
            dn = spec.deltanet
            states.append(RecurrentState(alloc((dn.conv_kernel - 1, dn.conv_dim), np.float32),
                                         alloc((dn.n_v_head, dn.head_k_dim, dn.head_v_dim), np.float32), zero))
        else:
            states.append(KVState(alloc(kv, kv_dtype), alloc(kv, kv_dtype)))
    return states


def state_bytes(spec: ModelSpec, n_ctx: int, kv_itemsize: int = 4) -> int:
    """Bytes of every layer's state at a context of n_ctx (KV entries of kv_itemsize, recurrent in float32)."""
    n_att = len(spec.attention_layers)
    total = 2 * n_att * spec.n_head_kv * n_ctx * spec.head_dim * kv_itemsize
    if spec.deltanet is not None:
        dn = spec.deltanet
        total += (spec.n_layer - n_att) * 4 * ((dn.conv_kernel - 1) * dn.conv_dim
                                               + dn.n_v_head * dn.head_k_dim * dn.head_v_dim)
    return total


@dataclass(frozen=True)
class Snapshot:
    """A session's exact state at a position, in host memory: restoring it continues bit for bit."""

    pos: int
    tokens: tuple[int, ...]
    states: tuple[tuple[np.ndarray, ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for s in self.states for a in s)


class Session:
    """Owns all per-sequence state so it can be saved, restored and rewound (conversation caches, speculation).

    states: the engine's arrays (Engine.new_session); by default float32 host arrays (the CPU engine's)."""

    def __init__(self, spec: ModelSpec, n_ctx: int, states: list[KVState | RecurrentState] | None = None):
        if n_ctx <= 0:
            raise StrataError(f"context length must be positive, got {n_ctx}")
        self.spec = spec
        self.n_ctx = n_ctx
        self.states = host_states(spec, n_ctx) if states is None else states
        if len(self.states) != spec.n_layer:
            raise StrataError(f"{len(self.states)} layer states for {spec.n_layer} layers")
        self.pos = 0
        self.tokens: list[int] = []
        self.checkpoints: list[Snapshot] = []  # kept for truncate() where a layer is recurrent
        # set by restore(): an engine whose device state its sessions share lets this one take it over
        self.restored = False

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.states)

    def reserve(self, n: int) -> None:
        if self.pos + n > self.n_ctx:
            raise StrataError(f"context full: {self.pos} + {n} tokens exceed --ctx {self.n_ctx}")

    def advance(self, tokens: list[int]) -> None:
        self.pos += len(tokens)
        self.tokens.extend(tokens)

    def reset(self) -> None:
        """Back to an empty sequence (recurrent states zeroed)."""
        for s in self.states:
            s.reset()
        self.pos = 0
        self.tokens.clear()

    def snapshot(self) -> Snapshot:
        """Every layer's state up to the position, copied to host memory."""
        return Snapshot(self.pos, tuple(self.tokens), tuple(s.save(self.pos) for s in self.states))

    def restore(self, snap: Snapshot) -> None:
        """Return exactly to a snapshot (of this session or of another on the same model and context)."""
        if len(snap.states) != len(self.states) or snap.pos > self.n_ctx:
            raise StrataError(f"snapshot of {len(snap.states)} layers at position {snap.pos} does not fit this "
                              f"session ({len(self.states)} layers, context {self.n_ctx})")
        for i, (s, saved) in enumerate(zip(self.states, snap.states)):  # all checked before anything is copied
            got = [tuple(a.shape) for a in saved]
            if got != s.shapes(snap.pos):
                raise StrataError(f"snapshot does not fit this session: layer {i} holds arrays of {got}, this "
                                  f"session's are {s.shapes(snap.pos)}")
        for s, saved in zip(self.states, snap.states):
            s.load(saved, snap.pos)
        self.pos = snap.pos
        self.tokens = list(snap.tokens)
        self.restored = True

    def checkpoint(self) -> Snapshot:
        """Take a snapshot and keep it for truncate()."""
        snap = self.snapshot()
        self.checkpoints = [c for c in self.checkpoints if c.pos != snap.pos] + [snap]
        return snap

    def truncate(self, pos: int) -> int:
        """Forget everything from position pos on. KV caches just drop their tail; a recurrent state can only go
        back to a snapshot, so with recurrent layers this restores the newest checkpoint at or before pos (whose
        tokens agree with this sequence's) and returns its position: the caller runs tokens[that:pos] again.
        Without such a checkpoint (position 0 always has one) it raises."""
        if not 0 <= pos <= self.pos:
            raise StrataError(f"cannot truncate to position {pos} of a sequence at {self.pos}")
        if not self.spec.recurrent or pos == self.pos:
            self.pos = pos
            del self.tokens[pos:]
            return pos
        prefix = tuple(self.tokens)
        usable = [c for c in self.checkpoints if c.pos <= pos and c.tokens == prefix[:c.pos]]
        if usable:
            self.restore(max(usable, key=lambda c: c.pos))
        elif pos == 0:
            self.reset()
        else:
            raise StrataError(f"cannot truncate to position {pos}: this model has recurrent layers and no "
                              f"checkpoint at or before it (Session.checkpoint())")
        # checkpoints past the new position describe a sequence that is no longer this one
        self.checkpoints = [c for c in self.checkpoints if c.pos <= self.pos]
        return self.pos
