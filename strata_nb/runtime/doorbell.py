"""The doorbell: how the GPU's layer hands its routed experts to the CPU pool.

The GPU publishes a layer's MoE input, expert ids, weights and each choice's VRAM slot into mapped pinned memory,
then bumps a sequence number there (cuda_kernels.mailbox). The doorbell thread (the thread that called the
engine) spins on that number (bounded), has the CPU pool compute the choices no slot holds, writes their weighted
sum to mapped memory and launches the work that adds it. With gates (STRATA_NB_GATES=1, off by default: see
docs/architecture.md) that work was launched ahead behind the layer's gate, a word of mapped memory it waits on in
the GPU's front end (a stream wait captured into the graph; no kernel spins), and the host opens the gate instead.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
from numba import cuda

from strata_nb.errors import StrataError
from strata_nb.runtime.cuda_rt import SIM, Graph, device_pointer, gate, host_view, wait_event


TOKEN_RING = 4  # sampled-token slots: a forward launched ahead writes the next slot, not the one being read


class Mailbox:
    """Mapped host buffers shared with the GPU, sized for ntok_max tokens."""

    def __init__(self, ntok_max: int, n_embd: int, k: int, n_layer: int = 1):
        self._x = cuda.mapped_array((ntok_max, n_embd), np.float32)  # GPU -> host: the MoE input
        self._ids = cuda.mapped_array((ntok_max, max(k, 1)), np.int32)
        self._wts = cuda.mapped_array((ntok_max, max(k, 1)), np.float32)
        self._slot = cuda.mapped_array((ntok_max, max(k, 1)), np.int32)  # -1: the CPU computes this choice
        self._seq = cuda.mapped_array(1, np.int64)
        self._y = cuda.mapped_array((ntok_max, n_embd), np.float32)  # host -> GPU: the CPU pool's weighted sum
        self._tokens = cuda.mapped_array(TOKEN_RING, np.int32)  # GPU -> host: the token sampled by forward seq
        self.x, self.ids, self.wts, self.slot, self.seq, self.y, self.tokens = (
            host_view(a) for a in (self._x, self._ids, self._wts, self._slot, self._seq, self._y, self._tokens))
        self._gates = cuda.mapped_array(max(n_layer, 1) + 1, np.uint32)  # host -> GPU: one per layer, + a probe
        self.gates = host_view(self._gates)
        self.seq[0] = 0
        self.y[:] = 0.0
        self.tokens[:] = 0
        self.gates[:] = 0

    def gate_op(self, layer: int) -> Callable[[Any], None]:
        """The op (stream -> None) that holds the work after it until open(layer), then closes the gate again."""
        addr = device_pointer(self._gates, layer)
        return lambda st: gate(st, addr)

    def open(self, layer: int) -> None:
        """Let the GPU past the layer's gate (after the pool's sum is written: x86 stores are seen in order)."""
        self.gates[layer] = 1

    def release(self, stream, timeout_s: float) -> None:
        """After an error mid-forward: open every gate so that the work already queued behind one drains, wait
        for the stream (bounded), then close them all."""
        self.gates[:-1] = 1
        ev = cuda.event()
        ev.record(stream)
        wait_event(ev, timeout_s, "the GPU's drain after an error")
        self.gates[:] = 0

    def gates_work(self, stream, timeout_s: float) -> bool:
        """Can this device hold work behind a gate, in a captured graph? Captures one with the probe word's gate,
        opens it, replays it and checks that the device closed it again (bounded). False where the driver or
        the simulator lacks stream memory operations."""
        if SIM:
            return False
        p = len(self.gates) - 1
        try:
            g = Graph(self.gate_op(p), stream, "gate probe")
        except Exception:
            return False
        try:
            self.gates[p] = 1
            g.launch(stream)
            ev = cuda.event()
            ev.record(stream)
            wait_event(ev, timeout_s, "the gate probe")
            return int(self.gates[p]) == 0
        except Exception:
            return False
        finally:
            self.gates[p] = 0
            g.close()

    @property
    def device(self) -> dict[str, Any]:
        """The arrays as kernels take them."""
        return {"x": self._x, "ids": self._ids, "wts": self._wts, "slot": self._slot, "seq": self._seq,
                "y": self._y, "tokens": self._tokens}

    def token(self, seq: int) -> int:
        """The token sampled by the forward that published number seq (-1: its logits had NaN or +inf, or were
        all -inf; the device sampler's convention)."""
        return int(self.tokens[seq % TOKEN_RING])

    def wait(self, seq: int, timeout_s: float, what: str, tick: Callable[[], None] | None = None,
             tick_s: float = 5e-5) -> float:
        """Spin until the GPU has published number seq; returns the seconds waited. Bounded: a GPU that does not
        publish within timeout_s is an error naming what was awaited, never a hang. tick: called every tick_s
        seconds while waiting."""
        sv = self.seq
        if sv[0] >= seq:
            return 0.0
        t0 = time.perf_counter()
        deadline, next_tick = t0 + timeout_s, t0 + tick_s
        n = 0
        while sv[0] < seq:
            n += 1
            if n & 255 == 0:
                now = time.perf_counter()
                if now > deadline:
                    raise StrataError(f"the GPU did not publish {what} within {timeout_s:g} s "
                                      f"(sequence {int(sv[0])}, expected {seq}); giving up")
                if tick is not None and now >= next_tick:
                    tick()
                    next_tick = time.perf_counter() + tick_s
        return time.perf_counter() - t0

