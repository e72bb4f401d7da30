"""The doorbell: how the GPU's layer hands its routed experts to the CPU pool, and the thread that listens.

The GPU publishes a layer's MoE input, expert ids, weights and each choice's VRAM slot into mapped pinned memory,
then bumps a sequence number there (cuda_kernels.mailbox). The doorbell thread spins on that number (bounded),
has the CPU pool compute the choices no slot holds, writes their weighted sum to mapped memory and launches the
graph that adds it. The GPU never waits for the host inside a kernel; the host drives.

DeviceThread is that thread: it owns every CUDA call of the hybrid engine (context, graphs, launches), so the
caller's thread only submits whole forwards and waits for them, bounded, and sees any error raised there.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import numpy as np
from numba import cuda

from strata_nb.errors import StrataError
from strata_nb.runtime.cuda_rt import host_view


class Mailbox:
    """Mapped host buffers shared with the GPU, sized for ntok_max tokens."""

    def __init__(self, ntok_max: int, n_embd: int, k: int):
        self._x = cuda.mapped_array((ntok_max, n_embd), np.float32)  # GPU -> host: the MoE input
        self._ids = cuda.mapped_array((ntok_max, max(k, 1)), np.int32)
        self._wts = cuda.mapped_array((ntok_max, max(k, 1)), np.float32)
        self._slot = cuda.mapped_array((ntok_max, max(k, 1)), np.int32)  # -1: the CPU computes this choice
        self._seq = cuda.mapped_array(1, np.int64)
        self._y = cuda.mapped_array((ntok_max, n_embd), np.float32)  # host -> GPU: the CPU pool's weighted sum
        self.x, self.ids, self.wts, self.slot, self.seq, self.y = (
            host_view(a) for a in (self._x, self._ids, self._wts, self._slot, self._seq, self._y))
        self.seq[0] = 0
        self.y[:] = 0.0

    @property
    def device(self) -> dict[str, Any]:
        """The arrays as kernels take them."""
        return {"x": self._x, "ids": self._ids, "wts": self._wts, "slot": self._slot, "seq": self._seq,
                "y": self._y}

    def wait(self, seq: int, timeout_s: float, what: str) -> float:
        """Spin until the GPU has published number seq; returns the seconds waited. Bounded: a GPU that does not
        publish within timeout_s is an error naming what was awaited, never a hang."""
        sv = self.seq
        if sv[0] >= seq:
            return 0.0
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        n = 0
        while sv[0] < seq:
            n += 1
            if n & 1023 == 0:
                now = time.perf_counter()
                if now > deadline:
                    raise StrataError(f"the GPU did not publish {what} within {timeout_s:g} s "
                                      f"(sequence {int(sv[0])}, expected {seq}); giving up")
        return time.perf_counter() - t0


class DeviceThread:
    """One thread that runs every submitted call in order (all CUDA work of the hybrid engine happens here)."""

    def __init__(self, name: str = "strata-doorbell"):
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, args, box, done = item
            try:
                box.append((True, fn(*args)))
            except BaseException as e:  # handed to the caller, raised there
                box.append((False, e))
            done.set()

    def call(self, fn: Callable, *args) -> Any:
        """Run fn(*args) on the device thread and return its result (or raise its error). Every wait inside the
        engine is bounded, so this returns; should the thread die anyway, the caller is told, not left hanging."""
        if not self._thread.is_alive():
            raise StrataError("the GPU doorbell thread is no longer running")
        box: list = []
        done = threading.Event()
        self._q.put((fn, args, box, done))
        while not done.wait(1.0):
            if not self._thread.is_alive():
                raise StrataError("the GPU doorbell thread stopped in the middle of a call")
        ok, val = box[0]
        if not ok:
            raise val
        return val

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout=30)
