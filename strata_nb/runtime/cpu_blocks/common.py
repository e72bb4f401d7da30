"""What the CPU engine's blocks share: activations with their int8 forms, and a forward's positions."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata_nb.cpu_kernels import actq


class Activation:
    """A float32 activation [T, K] with its int8 forms (one per activation group size, actq.group), each made once
    and shared by every consumer."""

    __slots__ = ("x", "_q")

    def __init__(self, x: np.ndarray, q: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None):
        self.x = x
        self._q = {} if q is None else {x.shape[1] // q[1].shape[1]: q}

    def q(self, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The int8 form in groups of `group` (xq, xd, xs)."""
        q = self._q.get(group)
        if q is None:
            q = self._q[group] = actq.quantize(self.x, group)
        return q


@dataclass(frozen=True)
class Positions:
    """The positions a forward runs at: the first, and rope's cos/sin f32[T, n_rot/2] for each."""

    pos0: int
    cos: np.ndarray
    sin: np.ndarray
